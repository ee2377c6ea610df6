"""``lightning-scale-plan``: every layout of this run's model on a cluster, ranked before a GPU is spent.

A Hydra app over the same config as ``lightning-scale-train`` (its ``model``, ``data``, ``trainer`` and
``precision`` groups) plus a ``cluster`` group, so the plan of a run is the run's command with another
name::

    lightning-scale-plan model=7b data.global_batch_size=512 data.seq_len=4096 precision=bf16 \\
        cluster=h100-sxm cluster.nodes=8
    lightning-scale-plan model=7b data.global_batch_size=512 data.seq_len=4096 precision=bf16 \\
        cluster=h100-sxm cluster.nodes=8 --explain fsdp64-tp1-pp1-mb2

It prints the ranked table (fits, memory per device, step time, tokens/s, MFU, $ per million tokens,
hours and $ to ``plan.token_budget``), writes ``plan.json`` (every layout with every term) and
``plan.png`` (the Pareto front of $ against hours, and memory against step time) into ``plan.out``.
``--explain LAYOUT`` (or ``plan.explain=LAYOUT``) prints each term of that layout with its inputs.
``--budget-usd``, ``--budget-hours`` or ``--budget-flops`` (with ``--law besiroglu2024``, the default,
``hoffmann2022`` or ``fit``) add the compute-optimal model and tokens for that budget
(:mod:`lightning_scale.cli.plan_sizing`). ``lightning-scale-plan calibrate DIR...`` fits the cluster's
efficiency factors to measured runs and stores them (:mod:`lightning_scale.cli.plan_calibrate`); plans
on a calibrated system use them and print their source.
When no layout fits, it names the smallest memory per device found, the term that dominates it and
the changes that would make it fit. The estimates come from :mod:`lightning_scale.core.planner`.

Stands apart from ``lightning-scale-train``'s chain: it imports only ``plan_sizing`` and ``plan_calibrate`` from ``cli``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_scale.cli.plan_sizing import describe, law_named, size_for_budget
from lightning_scale.core.checks import format_choices
from lightning_scale.core.parallel.sync_spec import sync_spec
from lightning_scale.core.planner import Cluster, Estimate, ModelShape, Workload, cluster, estimate, model_shape, plan
from lightning_scale.core.planner.calibration import calibrated
from lightning_scale.core.planner.sync import break_even, sync_time
from lightning_scale.core.telemetry.cost import OFFERS, Price

__all__ = ["HELP", "explain", "main", "offer_name", "plan_from_config", "table"]

GiB = 2**30


def offer_name(offer: Price) -> str:
    """An offer's name for ``plan.price=``: its provider and instance (``aws-p5.48xlarge``)."""
    return offer.offer.split(",")[0].strip().lower().replace(" ", "-")


def _priced(system: Cluster, price: Any) -> Cluster:
    """``system`` with the offer ``plan.price`` names (None: the device's default; a number: $ per device-hour)."""
    if price is None:
        return system
    offers = OFFERS.get(system.device.price_key or "", ())
    if isinstance(price, (int, float)) and not isinstance(price, bool):
        if price <= 0:
            raise ValueError(
                f"plan.price={price!r}: a price is a positive number of dollars per device-hour, or an offer's name."
            )
        return replace(
            system, price=Price(system.device.price_key or system.device.name, float(price), "plan.price", "-", "given")
        )
    named = {offer_name(o): o for o in offers}
    if str(price) not in named:
        known = format_choices(named) if named else f"none for {system.device.name}"
        raise ValueError(
            f"plan.price={price!r} is not an offer of the price table for {system.device.name} (offers: {known}); "
            "or give dollars per device-hour (plan.price=4.5)."
        )
    return replace(system, price=named[str(price)])


def _setup(cfg: DictConfig) -> tuple[ModelShape, Workload, Cluster]:
    from hydra.utils import instantiate

    model = instantiate(cfg.model) if "_target_" in cfg.model else OmegaConf.to_container(cfg.model)
    workload = Workload(int(cfg.data.global_batch_size), int(cfg.data.seq_len), str(cfg.precision.precision))
    c = cfg.cluster
    devices = c.devices_per_node if c.devices_per_node is not None else cfg.trainer.devices
    nodes = c.nodes if c.nodes is not None else cfg.trainer.num_nodes
    system = calibrated(cluster(str(c.name), nodes=int(nodes), devices_per_node=int(devices)))
    return model_shape(model), workload, _priced(system, cfg.plan.get("price"))


def plan_from_config(cfg: DictConfig) -> tuple[list[Estimate], dict[str, Any]]:
    """The ranked estimates for a composed config, and what they were computed from."""
    shape, workload, system = _setup(cfg)
    budget = cfg.plan.token_budget
    ranked = plan(
        shape, workload, system, headroom=float(cfg.plan.headroom), token_budget=float(budget) if budget else None
    )
    inputs = {
        "model": shape.name,
        "parameters": shape.parameters,
        "cluster": system.name,
        "device": system.device.name,
        "devices": system.world_size,
        "device_memory": system.device.memory,
        "devices_per_node": system.devices_per_node,
        "nodes": system.nodes,
        "global_batch": workload.global_batch,
        "seq_len": workload.seq_len,
        "precision": workload.precision,
        "efficiency": system.efficiency.source,
        "headroom": float(cfg.plan.headroom),
        "token_budget": budget,
        "price": _price_line(system),
    }
    return ranked, inputs


def _price_line(system: Cluster) -> str:
    price = system.device_price()
    if price is None:
        return f"no price for {system.device.name} (plan.price=DOLLARS_PER_DEVICE_HOUR)"
    offers = [offer_name(o) for o in OFFERS.get(system.device.price_key or "", ())]
    others = f"; plan.price= one of {', '.join(offers)}" if len(offers) > 1 else ""
    return f"${price.usd_per_device_hour:.3f} per device-hour ({price.offer}, {price.date}{others})"


def _money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def table(ranked: Sequence[Estimate], top: int) -> str:
    head = f"{'#':>3}  {'layout':52s} {'fits':4s} {'GiB/dev':>8s} {'step s':>8s} {'tokens/s':>11s} {'MFU':>6s} {'$/1M tok':>9s} {'hours':>8s} {'$ total':>12s}"
    lines = [head, "-" * len(head)]
    planned_only = False
    for i, e in enumerate(ranked[:top]):
        hours = "-" if e.hours_to_budget is None else f"{e.hours_to_budget:,.1f}"
        name = e.name if e.candidate.cp == 1 else e.name + " *"
        planned_only |= e.candidate.cp > 1
        lines.append(
            f"{i + 1:>3}  {name:52s} {'yes' if e.fits else 'NO':4s} {e.memory.total / GiB:8.2f} {e.time.step_time:8.3f} "
            f"{e.tokens_per_sec:11,.0f} {e.mfu:6.1%} {_money(e.usd_per_million_tokens):>9s} {hours:>8s} {_money(e.usd_to_budget):>12s}"
        )
    if planned_only:
        lines.append(
            "  * planned only: context parallelism (cp) is not trained by HybridParallelStrategy yet; strategy=auto "
            "never chooses it"
        )
    if any(e.candidate.float8 for e in ranked[:top]):
        lines.append(
            "  fp8: float8 linears, which HybridParallelStrategy trains with strategy.float8=rowwise (precision=fp8); "
            "strategy=auto never chooses them"
        )
    return "\n".join(lines)


def _value(key: str, value: object) -> str:
    if isinstance(value, str):
        return value
    number = float(value)  # type: ignore[arg-type]
    if key.endswith("bytes") or key.startswith("bytes") or "_bytes_" in key:
        return f"{number / GiB:.4g} GiB"
    if "bandwidth" in key:
        return f"{number / 1e9:.4g} GB/s"
    if key.endswith("rate") or key == "peak_flops":
        return f"{number / 1e12:.4g} TFLOP/s"
    if key.endswith("flops") or "flops_" in key:
        return f"{number:.4g} FLOP"
    if key.endswith("_s"):
        return f"{number:.4g} s"
    return f"{number:.4g}"


def explain(estimate: Estimate) -> str:
    """Every memory and time term of one layout, each with the inputs it was computed from (bytes moved,
    which link and at what achieved bandwidth, the rates, the overlap assumed, the micro-batches in flight)."""
    c = estimate.candidate
    lines = [
        f"{estimate.name}: dp={c.dp} ({c.dp_mode}) x tp={c.tp}{' (sequence parallel)' if c.sequence_parallel else ''} "
        f"x pp={c.pp} ({c.schedule}, {c.stages_per_rank} stage(s) per rank), micro-batch {c.micro_batch}, "
        f"activation checkpointing {c.checkpointing}"
        + (f", context parallel {c.cp}" if c.cp > 1 else "")
        + (", float8 linears (strategy.float8=rowwise)" if c.float8 else "")
        + (f", activations of {c.offload_blocks} block(s) per rank offloaded" if c.offload_blocks else "")
        + ("" if c.cp == 1 else " (planned only: the strategy cannot train context parallelism yet)")
    ]
    lines.append(
        f"memory per device: {estimate.memory.total / GiB:.3f} GiB at the {estimate.memory.rank} pipeline rank "
        f"({'fits' if estimate.fits else 'does not fit'})"
    )
    lines += [f"  {k:18s} {v / GiB:10.3f} GiB" for k, v in estimate.memory.terms.items()]
    lines.append("  from: " + ", ".join(f"{k}={_value(k, v)}" for k, v in estimate.memory.inputs.items()))
    lines.append(
        f"step time: {estimate.time.step_time:.4f} s (peak {_value('peak_flops', estimate.time.inputs['peak_flops'])} "
        "per device)"
    )
    for term, seconds in estimate.time.terms.items():
        lines.append(f"  {term:18s} {seconds:10.4f} s")
        detail = estimate.time.details.get(term)
        if detail and seconds > 0:
            lines.append("      from: " + ", ".join(f"{k}={_value(k, v)}" for k, v in detail.items()))
    lines.append(
        f"tokens/s {estimate.tokens_per_sec:,.0f}, MFU {estimate.mfu:.1%}, "
        f"$ per million tokens {_money(estimate.usd_per_million_tokens)}"
    )
    return "\n".join(lines)


def _no_fit(ranked: Sequence[Estimate], memory: float, headroom: float) -> str:
    smallest = min(ranked, key=lambda e: e.memory.total)
    term = smallest.memory.dominant()
    fixes = {
        "activations": "full activation checkpointing, a smaller micro-batch or sequence length, or more tensor parallelism",
        "optimizer": "fsdp (shards the optimizer state over data parallelism) or more devices",
        "parameters": "fsdp, more tensor or pipeline parallelism, or more devices",
        "gradients": "fsdp or fsdp_grad_op, or more devices",
        "logits": "tensor parallelism (the vocabulary is split) or a smaller micro-batch",
        "pipeline_buffers": "fewer micro-batches per step (a smaller global batch or larger micro-batch)",
    }.get(term, "more devices")
    return (
        f"No layout fits in {memory * (1 - headroom) / GiB:.1f} GiB per device ({memory / GiB:.1f} GiB less the "
        f"{headroom:.0%} headroom). The smallest found, {smallest.name}, needs "
        f"{smallest.memory.total / GiB:.2f} GiB, most of it {term} ({smallest.memory.terms[term] / GiB:.2f} GiB); "
        f"try {fixes}."
    )


def _plot(ranked: Sequence[Estimate], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [e for e in ranked if e.fits]
    fig, (cost, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    priced = [e for e in fits if e.usd_to_budget is not None]
    if priced:
        cost.scatter([e.hours_to_budget for e in priced], [e.usd_to_budget for e in priced], s=8, alpha=0.4)
        front, best = [], float("inf")
        for e in sorted(priced, key=lambda e: e.hours_to_budget or 0.0):
            if e.usd_to_budget is not None and e.usd_to_budget < best:
                front.append(e)
                best = e.usd_to_budget
        cost.plot(
            [e.hours_to_budget for e in front], [e.usd_to_budget for e in front], "r-o", ms=3, label="Pareto front"
        )
        cost.set(xlabel="hours to the token budget", ylabel="$ to the token budget", title="cost against time")
        cost.legend(loc="upper right")
    else:
        cost.text(0.5, 0.5, "no price or no plan.token_budget", ha="center", va="center", transform=cost.transAxes)
    memory.scatter(
        [e.time.step_time for e in ranked],
        [e.memory.total / GiB for e in ranked],
        s=8,
        alpha=0.4,
        c=["tab:green" if e.fits else "tab:red" for e in ranked],
    )
    memory.set(
        xlabel="step time (s)", ylabel="memory per device (GiB)", title="memory against step time (red: does not fit)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: DictConfig) -> int:
    ranked, inputs = plan_from_config(cfg)
    out = Path(str(cfg.plan.out))
    out.mkdir(parents=True, exist_ok=True)
    budgets = {k: cfg.plan.get(f"budget_{k}") for k in ("usd", "hours", "flops")}
    doc: dict[str, Any] = {"inputs": inputs}
    if any(v is not None for v in budgets.values()) and not cfg.plan.explain:
        # A budget query: the model and tokens it buys, and their best layout (not a table of the config's model).
        _, workload, system = _setup(cfg)
        law = law_named(str(cfg.plan.law), list(cfg.plan.fit_studies or []))
        print(
            f"lightning-scale-plan: what a budget buys on {system.world_size} x {system.device.name} "
            f"({system.nodes} node(s)), global batch {workload.global_batch} x {workload.seq_len} tokens, {workload.precision}; "
            f"price {inputs['price']}"
        )
        doc["sizing"] = size_for_budget(
            law, system, workload, **{k: float(v) for k, v in budgets.items() if v is not None}
        )
        print(describe(doc["sizing"]))
        (out / "plan.json").write_text(json.dumps(doc, indent=1))
        print(f"lightning-scale-plan: wrote {out / 'plan.json'}")
        return 0
    fits = sum(e.fits for e in ranked)
    print(
        f"lightning-scale-plan: {inputs['model']} ({inputs['parameters'] / 1e9:.3g}B parameters) on {inputs['devices']} x "
        f"{inputs['device']} ({inputs['nodes']} node(s)), global batch {inputs['global_batch']} x {inputs['seq_len']} tokens, "
        f"{inputs['precision']}; {len(ranked)} layouts, {fits} fit"
    )
    print(f"  price: {inputs['price']}")
    print(f"  efficiency: {inputs['efficiency'].split(': ', 1)[0]} (--explain LAYOUT: every term and its inputs)")
    if cfg.plan.explain:
        chosen = [e for e in ranked if e.name == cfg.plan.explain]
        if not chosen:
            near = ", ".join(e.name for e in ranked[:5])
            print(
                f"lightning-scale-plan: error: no layout named {cfg.plan.explain!r}; the best are: {near}",
                file=sys.stderr,
            )
            return 2
        shape, workload, system = _setup(cfg)  # the chosen layout again, with each term's inputs
        budget = cfg.plan.token_budget
        print(
            explain(
                estimate(
                    shape,
                    workload,
                    chosen[0].candidate,
                    system,
                    headroom=float(cfg.plan.headroom),
                    token_budget=float(budget) if budget else None,
                    explain=True,
                )
            )
        )
    else:
        print(table(ranked, int(cfg.plan.top)))
        doc["data_parallel_sync"] = _sync_lines(cfg, ranked)
    if not ranked[0].fits:
        print(_no_fit(ranked, inputs["device_memory"], inputs["headroom"]))
    doc["layouts"] = [{**e.row(), "memory_terms": e.memory.terms, "time_terms": e.time.terms} for e in ranked]
    (out / "plan.json").write_text(json.dumps(doc, indent=1))
    _plot(ranked, out / "plan.png")
    print(f"lightning-scale-plan: wrote {out / 'plan.json'} and {out / 'plan.png'}")
    return 0


def _sync_lines(cfg: DictConfig, ranked: Sequence[Estimate]) -> dict[str, Any] | None:
    """``plan.sync`` (else the strategy's ``data_parallel_sync``), when periodic: the best replica layout that
    fits priced under it beside every step, and the link speed below which it wins (printed; for plan.json)."""
    value = cfg.plan.get("sync")
    every = cfg.plan.get("sync_every")
    if value is None:
        value, every = cfg.get("strategy", {}).get("data_parallel_sync"), cfg.get("strategy", {}).get("sync_every")
    if value is None:
        return None
    spec = sync_spec(OmegaConf.to_container(value) if isinstance(value, DictConfig) else value, every)
    if not spec.periodic:
        return None
    replicas = [  # what the strategy trains under a periodic mode: replicas, no planned-only dimension
        e for e in ranked if e.fits and e.candidate.dp_mode == "ddp" and e.candidate.cp == 1 and not e.candidate.float8
    ]
    if not replicas:
        print(f"  data_parallel_sync {spec.describe()}: no layout of replicas (dp_mode ddp, cp 1) fits; not priced")
        return None
    _, _, system = _setup(cfg)
    best, penalty = replicas[0], float(cfg.plan.get("sync_penalty", 1.0))
    priced = sync_time(best, system, spec)
    link = break_even(best, system, spec, penalty=penalty)
    where = (
        "at every speed"
        if math.isinf(link)
        else ("at no speed" if link == 0 else f"below {link / 1e9:.3g} GB/s per NIC")
    )
    print(
        f"  data_parallel_sync {spec.describe()} on {best.name}: {priced.step_time * 1e3:.1f} ms a step against "
        f"{priced.every_step_time * 1e3:.1f} ms every step ({priced.time_saved * 1e3:+.1f} ms saved), "
        f"{priced.bytes_ratio:.3g}x the bytes; wins {where} (inter-node {system.inter.bandwidth / 1e9:.3g} GB/s per "
        f"NIC here; needing {penalty:g}x the tokens: plan.sync_penalty)"
    )
    return {**priced.row(), "layout": best.name, "break_even_bytes_per_s_per_nic": link, "penalty": penalty}


_FLAGS = {
    "--explain": "plan.explain",
    "--budget-usd": "plan.budget_usd",
    "--budget-hours": "plan.budget_hours",
    "--budget-flops": "plan.budget_flops",
    "--law": "plan.law",
}


def _hydra_argv(argv: Sequence[str]) -> list[str]:
    """``--explain LAYOUT``, ``--budget-usd X`` (``-hours``, ``-flops``) and ``--law NAME`` as their
    ``plan.*`` overrides; everything else as Hydra reads it."""
    args, out = list(argv), []
    while args:
        arg = args.pop(0)
        flag, _, value = arg.partition("=")
        if flag in _FLAGS and (value or args):
            out.append(f"{_FLAGS[flag]}={value or args.pop(0)}")
        else:
            out.append(arg)
    return out


HELP = """usage: lightning-scale-plan [KEY=VALUE ...] [--explain LAYOUT] [--budget-usd X | --budget-hours X | --budget-flops X]
       lightning-scale-plan calibrate RUN_DIR... [--fit FACTORS] [--store FILE]

Every layout of your model on a cluster (data x tensor x pipeline sizes, FSDP mode, pipeline schedule,
micro-batch, activation checkpointing) ranked by predicted tokens/s, with memory per device, step time,
MFU and dollars, before a GPU is spent. The config is lightning-scale-train's (model, data, precision,
trainer) plus a cluster; layouts that fit are listed first, fastest first. Writes plan.json (every layout,
every term) and plan.png (cost against time; memory against step time) to plan.out.

options:
  -h, --help            this text (--hydra-help: Hydra's own)
  --explain LAYOUT      every memory and time term of one layout with its inputs (bytes moved, link and
                        achieved bandwidth, rates, overlap assumed, micro-batches in flight)
  --budget-usd X, --budget-hours X, --budget-flops X
                        what a budget buys: the compute-optimal model and tokens (--law besiroglu2024 |
                        hoffmann2022 | fit, with plan.fit_studies=[DIR,...]), its best layout, hours and $
  calibrate RUN_DIR...  fit this system's efficiency factors to finished runs (their results.json), store
                        them; later plans use them (lightning-scale-plan calibrate --help)

keys (KEY=VALUE, Hydra overrides):
  model=PRESET                  tiny, small, gpt2-124m, 350m, 1.3b, 7b
  data.global_batch_size=N data.seq_len=N precision=fp32|bf16|bf16_true|fp16
  cluster=NAME                  h100-sxm, h200-sxm, a100-sxm-80, a100-sxm-40, l4-pcie, l40s-pcie, cpu
  cluster.nodes=N cluster.devices_per_node=N
  plan.price=OFFER|DOLLARS      an offer of the price table (the header lists the device's) or $ per device-hour
  plan.token_budget=TOKENS      hours and $ to train on that many tokens
  plan.headroom=0.1 plan.top=20 plan.out=DIR

example:
  lightning-scale-plan model=7b data.global_batch_size=512 data.seq_len=4096 precision=bf16 \\
      cluster=h100-sxm cluster.nodes=8 plan.token_budget=1e11 plan.price=lambda-gpu_8x_h100_sxm5
  lightning-scale-plan model=7b data.global_batch_size=512 data.seq_len=4096 precision=bf16 \\
      cluster=h100-sxm cluster.nodes=8 --explain fsdp64-tp1-pp1-mb2

The physics, each constant's source and the model's limits: docs/planner.md."""


def main(argv: Sequence[str] | None = None) -> int:
    import hydra

    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] and given[0] in ("-h", "--help"):
        print(HELP)
        return 0
    if given[:1] == ["calibrate"]:
        from lightning_scale.cli.plan_calibrate import main as calibrate

        return calibrate(given[1:])
    sys.argv = [sys.argv[0], *_hydra_argv(sys.argv[1:] if argv is None else argv)]
    status: list[int] = []

    @hydra.main(version_base="1.3", config_path="pkg://lightning_scale.conf", config_name="plan")
    def _main(cfg: DictConfig) -> None:
        try:
            status.append(run(cfg))
        except ValueError as err:
            print(f"lightning-scale-plan: error: {err}", file=sys.stderr)
            status.append(2)

    _main()
    return status[0] if status else 1


if __name__ == "__main__":
    sys.exit(main())
