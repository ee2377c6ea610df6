"""Tensor parallelism at tp=2: HybridParallelStrategy against a raw torch loop and a physical bound.

    python benchmarks/tensor_parallel.py                      # CPU/gloo, 2 processes, 1 thread each
    python benchmarks/tensor_parallel.py --layers 8 --d-model 512 --rounds 5

In one run, on the same model, batch and optimizer:
- A: ``Trainer(strategy=HybridParallelStrategy(tensor_parallel=2))``, the step time from
  ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, clipping, AdamW);
- B: the same step as a raw loop: ``parallelize_module`` with the same plan, no Lightning;
- C: one process, no parallelism (tp=1), on rank 0 while rank 1 waits.
Rounds alternate A, B, C; the first ``--warmup`` steps of every block are dropped; medians reported.

The bound for tp=2 is ``T1/2 + T_comm``: perfect halving of the tp=1 step plus the collectives
tp=2 cannot avoid, with ``T_comm`` the time spent in c10d collectives per raw tp=2 step, measured
with the torch profiler in the same run. ``fraction_of_bound = bound / measured`` (1.0 = at the bound).

Prints ``BENCH tensor_parallel {json}`` last and writes benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import RESULTS, StepTimer, emit, join_process_group, model_arguments, run_workers, timed
from lightning.pytorch import Trainer
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.core.parallel.tensor_parallel import apply_tensor_parallel
from lightning_scale.core.precision.grad_norm import clip_grad_norm_
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule, gpt_tensor_parallel_plan
from lightning_scale.strategies import HybridParallelStrategy

LR, CLIP = 1e-3, 1.0


def _raw_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, tensor_parallel: bool) -> None:
    context = loss_parallel() if tensor_parallel else torch.enable_grad()
    logits = model(tokens[:, :-1])
    with context:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _comm_seconds_per_step(step: Any, steps: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages() if "c10d" in e.key)
    return total_us / 1e6 / steps


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    config = GPTConfig(
        n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, block_size=args.seq, vocab_size=256
    )
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    steps = args.warmup + args.steps

    torch.manual_seed(0)
    raw = GPT(config)
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "pp", "tp"))
    apply_tensor_parallel(raw, mesh["tp"], gpt_tensor_parallel_plan(raw, world))
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=LR)
    torch.manual_seed(0)
    single = GPT(config) if rank == 0 else None
    single_opt = torch.optim.AdamW(single.parameters(), lr=LR) if single is not None else None
    torch.manual_seed(0)
    module = GPTLightningModule(config, learning_rate=LR, warmup_steps=0)
    loader = DataLoader(TensorDataset(tokens[:, :-1].repeat(steps, 1), tokens[:, 1:].repeat(steps, 1)), args.batch)

    timings: dict[str, list[float]] = {"strategy": [], "raw_torch": [], "tp1": []}
    for _ in range(args.rounds):
        timer = StepTimer()
        trainer = Trainer(
            accelerator="cpu",
            devices=world,
            strategy=HybridParallelStrategy(tensor_parallel=world),
            max_steps=steps,
            gradient_clip_val=CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer],
        )
        trainer.fit(module, train_dataloaders=loader)
        timings["strategy"] += timer.times[args.warmup :]
        dist.barrier()
        raw_times = timed(lambda: _raw_step(raw, raw_opt, tokens, True), steps)
        timings["raw_torch"] += raw_times[args.warmup :]
        dist.barrier()
        if single is not None and single_opt is not None:
            tp1_times = timed(lambda: _raw_step(single, single_opt, tokens, False), steps)
            timings["tp1"] += tp1_times[args.warmup :]
        dist.barrier()
    comm = _comm_seconds_per_step(lambda: _raw_step(raw, raw_opt, tokens, True), args.steps)
    dist.barrier()
    if rank == 0:
        queue.put({"timings": timings, "comm_s": comm})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every block")
    parser.add_argument("--rounds", type=int, default=3, help="A/B/C rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.json")
    args = parser.parse_args()

    world = 2
    result = run_workers(_worker, world, args)

    timings = result["timings"]
    med = {k: statistics.median(v) for k, v in timings.items()}
    bound = med["tp1"] / world + result["comm_s"]
    report = {
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "vocab": 256},
        "batch": [args.batch, args.seq],
        "tensor_parallel": world,
        "device": "cpu (gloo), 1 thread per process",
        "samples_per_variant": len(timings["strategy"]),
        "strategy_step_s": round(med["strategy"], 5),
        "raw_torch_step_s": round(med["raw_torch"], 5),
        "tp1_step_s": round(med["tp1"], 5),
        "comm_s_per_step": round(result["comm_s"], 5),
        "bound_step_s": round(bound, 5),
        "ratio_vs_raw_torch": round(med["strategy"] / med["raw_torch"], 4),
        "speedup_vs_tp1": round(med["tp1"] / med["strategy"], 4),
        "bound_speedup_vs_tp1": round(med["tp1"] / bound, 4),
        "fraction_of_bound": round(bound / med["strategy"], 4),
        "targets": {"ratio_vs_raw_torch": "<= 1.05"},
    }
    emit("tensor_parallel", report, args.out)


if __name__ == "__main__":
    main()
