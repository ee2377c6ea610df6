"""``HybridParallelStrategy``'s bridge to the planner (:mod:`lightning_scale.core.planner`).

- :func:`planner_inputs`: this run as the planner sees it: the model's shape (read off the module's
  ``config``: a ``GPTConfig``, a Hugging Face config, a ``ModelShape``; else off its modules), the workload (the datamodule's
  ``global_batch_size`` and ``seq_len``, the Trainer's precision, AdamW) and the cluster (the devices the
  processes see, with the calibration stored for that system, if any);
- :func:`candidate_of`: the strategy's resolved options as the planner's :class:`Candidate`, so any run
  records the prediction for its own layout (``results.json``'s ``planner``) and calibration can learn
  from it;
- :class:`AutoLayout`: ``layout="auto"``: every layout the strategy can run (with the planned options the
  user set too, as constraints) is estimated on rank 0, the fastest that fits is broadcast and becomes the
  options every rank builds (the same on all of them), and its predicted figures are printed and logged as
  ``plan/*`` next to what telemetry measures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.parallel.tensor_parallel import find_registered_plans
from lightning_scale.core.planner import (
    Candidate,
    Cluster,
    Estimate,
    ModelShape,
    Workload,
    cluster,
    estimate,
    model_shape,
    plan,
)
from lightning_scale.core.planner.calibration import calibrated, planner_record
from lightning_scale.core.planner.cluster import local_cluster
from lightning_scale.core.planner.layout import PRECISION_BYTES
from lightning_scale.core.planner.memory import fewest_offloaded_blocks, rank_blocks
from lightning_scale.core.planner.module_shape import module_shape
from lightning_scale.core.telemetry.peaks import PEAK_FILE_ENV, machine_key, measured_peak, recorded_peak
from lightning_scale.strategies.hybrid.float8 import check_float8_run
from lightning_scale.strategies.hybrid.options import ParallelOptions
from lightning_scale.strategies.hybrid.parallelize import TENSOR_PARALLEL_PLAN_HOOK
from lightning_scale.strategies.hybrid.pipeline_hooks import pipeline_spec_of

__all__ = [
    "AutoLayout",
    "auto_offload",
    "candidate_of",
    "memory_and_float8_options",
    "planner_inputs",
    "prediction_record",
    "run_cluster",
]

_AUTO_HINT = "or choose the layout yourself (layout='manual' with data_parallel/tensor_parallel/pipeline_parallel)"


def model_shape_of(module: LightningModule) -> ModelShape:
    """The decoder shape of ``module``'s ``config`` (or its ``model``'s: Hugging Face models carry one), else
    read off its modules (:func:`~lightning_scale.core.planner.module_shape.module_shape`); ``ValueError``
    naming what to add when none reads as one."""
    tried = []
    for owner in (module, getattr(module, "model", None)):
        config = getattr(owner, "config", None)
        if config is None:
            continue
        try:
            return model_shape(config, getattr(config, "name", None) or type(module).__name__)
        except ValueError as err:
            tried.append(str(err))
    try:
        return module_shape(module)
    except ValueError as err:
        tried.append(str(err))
    raise ValueError(
        f"The planner cannot read {type(module).__name__}'s shape: give it a `config` attribute (a GPTConfig, a Hugging "
        f"Face config, or a lightning_scale.core.planner.ModelShape) or a `model` with one, {_AUTO_HINT}. "
        f"({'; '.join(tried)})"
    )


def workload_of(trainer: Trainer) -> Workload:
    data = trainer.datamodule
    batch, seq = getattr(data, "global_batch_size", None), getattr(data, "seq_len", None)
    if not isinstance(batch, int) or not isinstance(seq, int):
        raise ValueError(
            f"The planner needs the global batch and sequence length: the datamodule ({type(data).__name__}) has no "
            f"integer `global_batch_size` and `seq_len` attributes. Add them (lightning_scale.data.TextDataModule "
            f"has both), {_AUTO_HINT}."
        )
    precision = str(trainer.precision)
    if precision not in PRECISION_BYTES:
        raise ValueError(f"The planner knows precisions {sorted(PRECISION_BYTES)}, not {precision!r}; {_AUTO_HINT}.")
    return Workload(batch, seq, precision, "adamw")


def cpu_peak(trainer: Trainer, dtype: str) -> float:
    """A CPU process's matmul rate as ``Throughput`` measures it (all processes at once, recorded per
    machine in the study's peak file when there is one): the planner's and MFU's denominators agree."""
    path = os.environ.get(PEAK_FILE_ENV)
    peak, _ = recorded_peak(path, machine_key(dtype, trainer.num_devices), lambda: measured_peak(dtype))
    return peak


def run_cluster(trainer: Trainer, workload: Workload, preset: str | None, *, peak: float | None = None) -> Cluster:
    """The cluster this run is on (``preset``: a named one instead), with its stored calibration; on a
    CPU, ``peak`` (default :func:`cpu_peak`) is each process's rate in the workload's compute dtype."""
    strategy = trainer.strategy
    per_node, nodes = trainer.num_devices, trainer.num_nodes
    if preset is not None:
        found = cluster(preset, nodes=nodes, devices_per_node=per_node)
    elif strategy.root_device.type == "cuda":
        props = torch.cuda.get_device_properties(strategy.root_device)
        found = local_cluster(
            "cuda",
            devices_per_node=per_node,
            nodes=nodes,
            device_name=props.name,
            device_memory=float(props.total_memory),
        )
    else:
        dtype = workload.compute_dtype
        found = local_cluster(
            "cpu", devices_per_node=per_node, nodes=nodes, peak_flops={dtype: peak or cpu_peak(trainer, dtype)}
        )
    return calibrated(found)


def planner_inputs(trainer: Trainer, module: LightningModule) -> tuple[ModelShape, Workload]:
    return model_shape_of(module), workload_of(trainer)


def candidate_of(options: ParallelOptions, layout: Layout, hsdp_shard: int, workload: Workload) -> Candidate:
    """The resolved options at ``layout`` as the planner's candidate: micro-batches of the pipeline (or
    one per step without one: Lightning's gradient accumulation is the Trainer's, not the layout's)."""
    local = workload.global_batch // layout.dp
    m = (options.microbatches or 2 * layout.pp) if layout.pp > 1 else 1
    return Candidate(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        dp_mode=options.data_parallel_mode,
        schedule=options.schedule,
        virtual_stages=options.virtual_stages,
        micro_batch=max(1, local // m),
        checkpointing=options.activation_checkpointing,
        checkpoint_every=options.activation_checkpointing_every,
        sequence_parallel=options.sequence_parallel and layout.tp > 1,
        hsdp_shard=hsdp_shard,
        float8=options.float8 is not None,
        # a list of block indices: planned as that many blocks per rank
        offload_blocks=(
            0
            if options.activation_offload == "auto"
            else options.activation_offload
            if isinstance(options.activation_offload, int)
            else len(options.activation_offload)
        ),
    )


def memory_and_float8_options(strategy: Any, trainer: Trainer, module: LightningModule) -> ParallelOptions:
    """``strategy.options`` once the run is known, before the model is cut: float8 checked against the device
    and precision (:func:`~lightning_scale.strategies.hybrid.float8.check_float8_run`); ``activation_offload=
    "auto"`` replaced by the planner's choice (:func:`auto_offload`)."""
    options = strategy.options
    check_float8_run(options.float8, strategy.root_device, str(strategy.precision_plugin.precision))
    if options.activation_offload != "auto":
        return options
    return dataclasses.replace(options, activation_offload=auto_offload(strategy, trainer, module))


def auto_offload(strategy: Any, trainer: Trainer, module: LightningModule) -> int:
    """``activation_offload="auto"``: the fewest blocks per pipeline rank (from its first) whose activations in
    host memory make the planner's memory estimate of this run's layout fit the device (0 when it fits as it
    is; every block, with a warning, when even that does not). Rank 0 plans, every rank gets its choice."""
    choice: dict[str, Any] = {}
    if strategy.global_rank == 0:
        try:
            choice = {"blocks": _plan_offload(strategy, trainer, module)}
        except ValueError as err:  # (the planner cannot read this run): every rank raises alike
            choice = {"error": f"activation_offload='auto' asks the planner, which cannot plan this run: {err}"}
    choice = strategy.broadcast(choice)
    if "error" in choice:
        raise ValueError(choice["error"] + " Pass a number of blocks instead.")
    return int(choice["blocks"])


def _plan_offload(strategy: Any, trainer: Trainer, module: LightningModule) -> int:
    shape, workload = planner_inputs(trainer, module)
    mesh = strategy.device_mesh
    shard = mesh["dp_shard"].size() if "dp_shard" in (mesh.mesh_dim_names or ()) else 1
    base = candidate_of(strategy.options, strategy.layout, shard, workload)
    system = run_cluster(trainer, workload, None, peak=1.0)  # memory only: no peak is measured
    blocks, capacity = rank_blocks(shape, base.pp), system.device.memory
    fewest, memory = fewest_offloaded_blocks(shape, workload, base, capacity)
    chosen = blocks if fewest is None else fewest
    gib = [round(m / 2**30, 3) for m in memory]
    rank_zero_info(
        f"activation_offload='auto': {chosen} of {blocks} blocks per pipeline rank (planned memory per device "
        f"{gib[0]} GiB without offloading, {gib[chosen]} GiB with; {capacity / 2**30:.3f} GiB on {system.device.name})."
    )
    if fewest is None:
        rank_zero_warn(
            f"activation_offload='auto': even with every block offloaded the planner's estimate ({gib[-1]} GiB) "
            f"exceeds the device's {capacity / 2**30:.3f} GiB; offloading all {blocks} blocks. Shard more "
            "(data_parallel_mode='fsdp', tensor or pipeline parallelism) or checkpoint activations."
        )
    return chosen


def options_for(candidate: Candidate, workload: Workload) -> dict[str, Any]:
    """The strategy options that run ``candidate``."""
    m = candidate.microbatches(workload)
    return {
        "data_parallel": candidate.dp,
        "tensor_parallel": candidate.tp,
        "pipeline_parallel": candidate.pp,
        "data_parallel_mode": candidate.dp_mode,
        "schedule": candidate.schedule if candidate.pp > 1 else "1f1b",
        "microbatches": m if candidate.pp > 1 else None,
        "virtual_stages": max(2, candidate.virtual_stages),
        "activation_checkpointing": candidate.checkpointing,
        "activation_checkpointing_every": candidate.checkpoint_every,
    }


class AutoLayout:
    """``layout="auto"``: the planner's choice, made once per strategy (later Trainer calls keep it)."""

    def __init__(self) -> None:
        self.chosen: Estimate | None = None
        self._options: dict[str, Any] | None = None

    def apply(self, strategy: Any, trainer: Trainer | None, module: LightningModule) -> ParallelOptions:
        """``strategy.options`` with the planner's choice filled in (``layout="manual"`` from then on)."""
        if trainer is None:
            raise RuntimeError(
                "layout='auto' plans from the Trainer's datamodule and precision; this module has no Trainer."
            )
        chosen = self.choose(strategy, trainer, module, strategy.options.cluster)
        return dataclasses.replace(strategy.options, layout="manual", cluster=None, **chosen)

    def choose(self, strategy: Any, trainer: Trainer, module: LightningModule, preset: str | None) -> dict[str, Any]:
        """The options to run (rank 0 plans; every rank gets its choice)."""
        if self._options is not None:
            return self._options
        shape, workload = planner_inputs(trainer, module)
        if preset is None and strategy.root_device.type == "cpu":
            cpu_peak(trainer, workload.compute_dtype)  # every rank at once, as they will train
        doc: dict[str, Any] = {}
        if strategy.global_rank == 0:
            system = run_cluster(trainer, workload, preset)
            ranked = plan(
                shape,
                workload,
                system,
                # a periodic data_parallel_sync trains replicas: no sharding mode
                dp_modes=("ddp",) if strategy.options.sync.periodic else _dp_modes(strategy.num_nodes),
                gradient_accumulation=False,
                max_micro_batch=workload.global_batch,
                context_parallel=(1,),
                float8=(False,),
            )
            runnable = _runnable(module)
            ranked = [e for e in ranked if runnable(e.candidate)]  # dp x 1 x 1 always is
            constrained = _constrained(ranked, strategy.options.constraints(), workload)
            if isinstance(constrained, str):
                doc = {"error": f"{constrained} ({shape.name} on {system.world_size} devices)"}
            else:
                best = constrained[0]  # the fastest that fits, else the smallest miss is refused below
                doc = {"candidate": dataclasses.asdict(best.candidate), "fits": best.fits}
                self.chosen = best
                _announce(best, constrained, system, shape)
        doc = strategy.broadcast(doc)
        if "error" in doc:  # every rank raises alike
            raise ValueError(doc["error"])
        candidate = Candidate(**doc["candidate"])
        if not doc["fits"]:
            raise ValueError(
                f"layout='auto': no layout of this model fits the devices' memory; the smallest needs more than there is "
                f"(run lightning-scale-plan for the terms and fixes), {_AUTO_HINT}."
            )
        if self.chosen is None:  # the other ranks: the same choice, estimated here for the record
            self.chosen = estimate(shape, workload, candidate, run_cluster(trainer, workload, preset))
        self._options = options_for(candidate, workload)
        return self._options


def _constrained(ranked: list[Estimate], constraints: dict[str, Any], workload: Workload) -> list[Estimate] | str:
    """The layouts of ``ranked`` whose options have every constraint's value, in order; when none has, the
    error: the first constraint no layout meets and the values this model and these devices allow."""
    kept, earlier = [(e, options_for(e.candidate, workload)) for e in ranked], []
    for name, value in constraints.items():
        allowed = {options[name] for _, options in kept}
        kept = [(e, options) for e, options in kept if options[name] == value]
        if not kept:
            shown = ", ".join(sorted(map(repr, allowed - {None}))) or "nothing"
            given = f" with {', '.join(earlier)}" if earlier else ""
            return (
                f"layout='auto' keeps {name}={value!r}, but no layout the planner can run{given} has it: {name} can be "
                f"{shown} here. Change or remove it, or set layout='manual' with your sizes"
            )
        earlier.append(f"{name}={value!r}")
    return [e for e, _ in kept]


def _runnable(module: LightningModule) -> Callable[[Candidate], bool]:
    """Whether the module can run a candidate's layout: tensor parallelism needs a plan (the module's
    ``tensor_parallel_plan`` hook or a registered architecture inside it), a pipeline a spec (its
    ``pipeline_spec`` hook or a registered architecture). A module whose model is built later (in
    ``configure_model``, a GPTLightningModule's way) brings them with it: all its layouts are candidates."""
    if next(module.children(), None) is None:
        return lambda candidate: True
    tensor = callable(getattr(module, TENSOR_PARALLEL_PLAN_HOOK, None)) or bool(find_registered_plans(module))
    try:
        pipeline_spec_of(module)
        pipeline = True
    except ValueError:
        pipeline = False
    return lambda candidate: (tensor or candidate.tp == 1) and (pipeline or candidate.pp == 1)


def _dp_modes(num_nodes: int) -> tuple[str, ...]:
    return ("ddp", "fsdp", "fsdp_grad_op", "hsdp") if num_nodes > 1 else ("ddp", "fsdp", "fsdp_grad_op")


def _announce(best: Estimate, ranked: list[Estimate], system: Cluster, shape: ModelShape) -> None:
    lines = [
        f"layout='auto': {best.name} for {shape.name} on {system.world_size} x {system.device.name} "
        f"(efficiency: {system.efficiency.source}); predicted step {best.time.step_time:.4f} s, "
        f"{best.tokens_per_sec:,.0f} tokens/s, {best.memory.total / 2**30:.3f} GiB per device. The best of "
        f"{len(ranked)} layouts:"
    ]
    for e in ranked[:5]:
        lines.append(
            f"  {e.name:48s} {'fits' if e.fits else 'NO  '} {e.time.step_time:9.4f} s {e.memory.total / 2**30:8.3f} GiB"
        )
    rank_zero_info("\n".join(lines))


def prediction_record(trainer: Trainer, summary: dict[str, Any], peak_memory: int | None) -> dict[str, Any] | None:
    """``results.json``'s ``planner``: the planner's prediction for the layout this run ran, beside what
    it measured, and the inputs calibration refits from (:func:`~lightning_scale.core.planner.calibration.planner_record`).
    ``None`` for another strategy; ``{"error": ...}`` when the planner cannot read this run (its reason).
    ``peak_memory``: the run's measured peak tensor memory per device (CUDA's allocator; None on a CPU,
    whose resident set is not tensor memory)."""
    strategy, module = trainer.strategy, trainer.lightning_module
    auto = getattr(strategy, "auto_layout", None)
    if auto is None:
        return None
    try:
        shape, workload = planner_inputs(trainer, module)
        peak = summary.get("train/peak_flops_measured")
        system = run_cluster(trainer, workload, None, peak=float(peak) if peak else None)
        mesh = strategy.device_mesh
        shard = mesh["dp_shard"].size() if "dp_shard" in (mesh.mesh_dim_names or ()) else 1
        chosen = auto.chosen
        candidate = (
            chosen.candidate if chosen is not None else candidate_of(strategy.options, strategy.layout, shard, workload)
        )
        predicted = estimate(shape, workload, candidate, system)
    except ValueError as err:  # the run is done and recorded either way: say why there is no prediction
        return {"error": str(err)}
    rate = summary.get("train/tokens_per_sec")
    measured = {
        "step_time_s": workload.tokens / rate if rate else None,
        "tokens_per_sec": rate,
        "memory_per_device_bytes": peak_memory,
    }
    guess = {
        "step_time_s": predicted.time.step_time,
        "tokens_per_sec": predicted.tokens_per_sec,
        "memory_per_device_bytes": predicted.memory.total,
        "mfu": predicted.mfu,
        "time_terms": predicted.time.terms,
        "memory_terms": predicted.memory.terms,
    }
    errors = {k: guess[k] / v - 1 for k, v in measured.items() if v}
    return {
        "layout": candidate.name,
        "chosen_by": "auto" if auto.chosen is not None else "manual",
        "efficiency": system.efficiency.source,
        "predicted": guess,
        "measured": measured,
        "error": errors,
        "inputs": planner_record(shape, workload, candidate, system, system.device.peak(workload.compute_dtype)),
    }
