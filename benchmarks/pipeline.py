"""Pipeline parallelism at pp=2: HybridParallelStrategy against raw torch, DeepSpeed and a critical-path bound.

    python benchmarks/pipeline.py                              # CPU/gloo, 2 processes, 1 thread each
    python benchmarks/pipeline.py --microbatches 4,8 --rounds 5
    python benchmarks/pipeline.py --layers 2 --d-model 64 --seq 32 --steps 2 --warmup 1 --rounds 1 --microbatches 2,4

For every micro-batch count ``m`` in one run, on the same untied GPT, batch and optimizer (AdamW,
the LightningModule's parameter groups, no clipping):
- A: ``Trainer(strategy=HybridParallelStrategy(pipeline_parallel=2, schedule=..., microbatches=m))``,
  the step time from ``on_train_batch_start`` to ``on_train_batch_end`` (schedule, AdamW, zero_grad);
- B: the same step as a raw ``torch.distributed.pipelining`` loop, no Lightning: the stage cut with
  ``prune_to_stage`` + ``partition_by_layers``, ``Schedule1F1B(stage, m, loss_fn=loss / m,
  scale_grads=False)``, AdamW step, zero_grad;
- C: DeepSpeed's ``PipelineModule`` (embedding, blocks, norm + head as layers; the same blocks per
  stage) with ``gradient_accumulation_steps = m`` and ``engine.train_batch`` (benchmarks/_pipeline_peers.py).
Rounds alternate A, B, C (and the bound's timings) for every ``m``; the first ``--warmup`` steps of
every block are dropped; a step's time is the slower of the two ranks; medians reported.

The bound is the pipeline's critical path without communication or scheduling:
``sum_s t_s + (m - 1) * max_s t_s + max_s t_opt``, with ``t_s`` the forward + backward of ONE
micro-batch (``batch / m`` samples) on stage ``s`` (the last stage with its loss), timed in
isolation on the input captured from the raw pipeline, both ranks at once (as they run in the
pipeline); and ``t_opt`` the stage's AdamW step + zero_grad, which A also contains, so the bound
includes the optimizer. Both are medians of all their timings (``--steps`` a round), like A's.
``first_loss`` (A, B and C on their first step) checks that the three train the same model on
the same batch.
``fraction_of_bound = bound / A`` (1.0 = at the bound; a little above it is noise). The load
average at start and the CPU time stolen by the hypervisor during the run are reported: a load
above ~0.5 or steal above a few percent means something else shares the cores, and every figure
is noisier.

Prints ``BENCH pipeline {json}`` last and writes benchmarks/results/pipeline.json; the top-level
``fraction_of_bound`` and ratios are the worst over ``m`` (lowest fraction, highest ratios).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import RESULTS, StepTimer, emit, join_process_group, model_arguments, run_workers, timed
from lightning.pytorch import Trainer
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.core.pipeline.partition import bubble_fraction, partition_by_layers
from lightning_scale.core.pipeline.spec import prune_to_stage
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule, gpt_pipeline_spec, language_model_loss
from lightning_scale.strategies import HybridParallelStrategy

LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.95)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _adamw(module: nn.Module) -> torch.optim.Optimizer:
    """GPTLightningModule's optimizer: matrices decay, vectors (norms, biases) do not."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
    )


class _RawPipeline:
    """One rank's stage of the GPT, cut as the strategy cuts it, run by a torch schedule."""

    def __init__(self, config: GPTConfig, rank: int, world: int, schedule: str, microbatches: int) -> None:
        torch.manual_seed(0)
        self.model = GPT(config)
        spec = gpt_pipeline_spec(self.model)
        self.blocks = partition_by_layers(len(spec.blocks), world).blocks(rank)
        self.is_first, self.is_last = rank == 0, rank == world - 1
        prune_to_stage(self.model, spec, self.blocks, is_first=self.is_first, is_last=self.is_last)
        self.optimizer = _adamw(self.model)
        self.scale = 1.0 / microbatches
        stage = PipelineStage(self.model, rank, world, torch.device("cpu"))
        self.schedule = SCHEDULES[schedule](stage, microbatches, loss_fn=self.loss, scale_grads=False)
        self.captured: torch.Tensor | None = None  # a micro-batch input, for the bound's timings
        self.first_loss: float | None = None

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return language_model_loss(output, target) * self.scale

    def _capture(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.captured = args[0].detach().clone()

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> None:
        handle = self.model.register_forward_pre_hook(self._capture) if self.captured is None else None
        losses: list[torch.Tensor] = []
        # return_outputs=False: the last stage does not concatenate the micro-batches' logits.
        if self.is_first:
            self.schedule.step(inputs, return_outputs=False)
        elif self.is_last:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        if handle is not None:
            handle.remove()
        if self.is_last and self.first_loss is None:
            self.first_loss = float(torch.stack(losses).detach().sum())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def stage_seconds(self, target: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
        """Seconds of this stage's forward + backward of one micro-batch (no communication), and of
        its AdamW step + zero_grad, ``repeats`` times each after a warm-up."""
        assert self.captured is not None, "run step() once first"
        x = self.captured
        grad = torch.randn(x.shape + (self.model.config.d_model,)) if self.is_first else None
        mb_target = target[: x.size(0)]
        fwd_bwd, opt = [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            if self.is_first:
                self.model(x).backward(grad)
            else:
                out = self.model(x.requires_grad_(True))
                if self.is_last:
                    self.loss(out, mb_target).backward()
                else:
                    out.backward(torch.randn_like(out))
            middle = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            fwd_bwd.append(middle - start)
            opt.append(time.perf_counter() - middle)
            x = x.detach()
        return fwd_bwd[1:], opt[1:]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port, LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    # Lightning 2.6's pytree helper against torch >= 2.10, and per-Trainer banners: noise here.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    warnings.filterwarnings("ignore", message=r".*`validation_step` but have no `val_dataloader`.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    config = GPTConfig(
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        block_size=args.seq,
        vocab_size=256,
        tie_embeddings=False,
    )
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    steps = args.warmup + args.steps
    loader = DataLoader(TensorDataset(inputs.repeat(steps, 1), target.repeat(steps, 1)), args.batch)

    raw = {m: _RawPipeline(config, rank, world, args.schedule, m) for m in args.microbatches}
    peers: dict[int, Any] = {}
    error = "skipped (--no-deepspeed)" if args.no_deepspeed else None
    if error is None:
        try:
            from _pipeline_peers import DeepSpeedPipeline

            peers = {m: DeepSpeedPipeline(config, world, m, (inputs, target), _adamw) for m in args.microbatches}
        except Exception as err:  # noqa: BLE001 - reported in the JSON, the other variants still run
            error = f"{type(err).__name__}: {err}"
    # Both ranks must agree to run C, or one would wait forever in its collectives.
    agree = torch.tensor([0 if error else 1])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    ok = bool(agree)
    if not ok and error is None:
        error = "failed on the other rank"

    keys = ("strategy", "raw_torch", "deepspeed", "stage", "optimizer")
    timings: dict[int, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in args.microbatches}
    first_loss: dict[int, dict[str, float | None]] = {m: {} for m in args.microbatches}
    for _ in range(args.rounds):
        for m in args.microbatches:
            t = timings[m]
            torch.manual_seed(0)
            module = GPTLightningModule(
                config, learning_rate=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, warmup_steps=0
            )
            timer = StepTimer()
            strategy = HybridParallelStrategy(
                data_parallel=1, pipeline_parallel=world, schedule=args.schedule, microbatches=m
            )
            # No sampler: at dp=1 Lightning's would only shuffle the rows, and A must see B's and C's batch.
            trainer = Trainer(
                accelerator="cpu",
                devices=world,
                strategy=strategy,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[timer],
                limit_val_batches=0,
                use_distributed_sampler=False,
            )
            trainer.fit(module, train_dataloaders=loader)
            t["strategy"] += timer.times[args.warmup :]
            first_loss[m].setdefault("strategy", timer.first_loss)
            dist.barrier()
            t["raw_torch"] += timed(lambda pipe=raw[m]: pipe.step(inputs, target), steps)[args.warmup :]
            first_loss[m].setdefault("raw_torch", raw[m].first_loss)
            dist.barrier()
            if ok:
                losses: list[float] = []
                ds_times = timed(lambda peer=peers[m], out=losses: out.append(peer.step()), steps)
                t["deepspeed"] += ds_times[args.warmup :]
                first_loss[m].setdefault("deepspeed", losses[0])
            dist.barrier()
            fwd_bwd, opt = raw[m].stage_seconds(target, args.steps)
            t["stage"] += fwd_bwd
            t["optimizer"] += opt
            dist.barrier()

    local = {
        "timings": timings,
        "first_loss": first_loss,
        "blocks": list(raw[args.microbatches[0]].blocks),
        "deepspeed_blocks": peers[args.microbatches[0]].blocks_per_stage if ok else None,
        "deepspeed_version": next(iter(peers.values())).version if ok else None,
        "deepspeed_error": error,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def _cpu_times() -> list[int] | None:
    """The machine's cumulative CPU times (user, nice, system, idle, iowait, irq, softirq, steal), Linux only."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--batch", type=int, default=16, help="global batch; every micro-batch count must divide it")
    parser.add_argument("--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every block")
    parser.add_argument("--rounds", type=int, default=4, help="A/B/C rounds")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed peer (reported as null)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = parser.parse_args()
    world = 2
    load_at_start = os.getloadavg()[0]  # > ~0.5: something else shares the cores, expect noise
    cpu_at_start = _cpu_times()
    bad = [m for m in args.microbatches if m < 1 or args.batch % m]
    if bad:
        parser.error(f"--microbatches {bad} do not divide --batch {args.batch}")
    if args.schedule == "1f1b" and min(args.microbatches) < world:
        parser.error(f"schedule 1f1b needs at least {world} micro-batches; use --schedule gpipe for fewer")

    # The workers import the DeepSpeed peer from this directory.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    ranks = run_workers(_worker, world, args)
    cpu_at_end = _cpu_times()
    steal = None
    if cpu_at_start and cpu_at_end:
        spent = [b - a for a, b in zip(cpu_at_start, cpu_at_end, strict=True)]
        steal = round(100 * spent[7] / max(sum(spent), 1), 2)

    def med(m: int, key: str) -> float | None:
        # A step ends when its slower rank does: the element-wise max over ranks, then the median.
        series = [r["timings"][m][key] for r in ranks]
        return statistics.median(map(max, zip(*series, strict=True))) if series[0] else None

    results = []
    for m in args.microbatches:
        ours, raw, peer = med(m, "strategy"), med(m, "raw_torch"), med(m, "deepspeed")
        stage = [statistics.median(r["timings"][m]["stage"]) for r in ranks]
        opt = max(statistics.median(r["timings"][m]["optimizer"]) for r in ranks)
        bound = sum(stage) + (m - 1) * max(stage) + opt
        assert ours is not None and raw is not None
        results.append(
            {
                "microbatches": m,
                "ours_s": _round(ours),
                "raw_torch_s": _round(raw),
                "deepspeed_s": _round(peer),
                "bound_s": _round(bound),
                "stage_s": [_round(s) for s in stage],
                "optimizer_s": _round(opt),
                "predicted_bubble": round(bubble_fraction(args.schedule, world, m), 4),
                "fraction_of_bound": round(bound / ours, 4),
                "raw_torch_fraction_of_bound": round(bound / raw, 4),
                "ratio_vs_raw_torch": round(ours / raw, 4),
                "ratio_vs_deepspeed": None if peer is None else round(ours / peer, 4),
                "first_loss": {k: _round(v) for k, v in ranks[-1]["first_loss"][m].items()},
            }
        )
    peer_ratios = [r["ratio_vs_deepspeed"] for r in results if r["ratio_vs_deepspeed"] is not None]
    report = {
        "pp": world,
        "schedule": args.schedule,
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "vocab": 256, "tied": False},
        "batch": [args.batch, args.seq],
        "device": "cpu (gloo), 1 thread per process",
        "load_average_at_start": round(load_at_start, 2),
        "cpu_steal_percent": steal,
        "blocks_per_stage": [len(r["blocks"]) for r in ranks],
        "deepspeed_blocks_per_stage": ranks[0]["deepspeed_blocks"],
        "deepspeed_version": ranks[0]["deepspeed_version"],
        "deepspeed_error": next((r["deepspeed_error"] for r in ranks if r["deepspeed_error"]), None),
        "samples_per_variant": len(ranks[0]["timings"][args.microbatches[0]]["strategy"]),
        "bound": "sum(stage_s) + (m - 1) * max(stage_s) + optimizer_s",
        "results": results,
        "fraction_of_bound": min(r["fraction_of_bound"] for r in results),
        "ratio_vs_raw_torch": max(r["ratio_vs_raw_torch"] for r in results),
        "ratio_vs_deepspeed": max(peer_ratios) if len(peer_ratios) == len(results) else None,
        "targets": {"fraction_of_bound": ">= 0.9", "ratio_vs_raw_torch": "<= 1.05", "ratio_vs_deepspeed": "<= 1.0"},
    }
    emit("pipeline", report, args.out)


if __name__ == "__main__":
    main()
