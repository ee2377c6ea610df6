"""HybridParallelStrategy against the strategies a Lightning user would pick instead, on 2 processes.

    python benchmarks/lightning_peers.py                      # CPU/gloo, 2 processes, 1 thread each
    python benchmarks/lightning_peers.py --layers 8 --d-model 512 --rounds 5

Three pairs, each in one run on the same model (the reference GPT, untied), data and optimizer:

- dp=2: ``HybridParallelStrategy(data_parallel=2)`` vs Lightning's ``DDPStrategy``;
- tp=2: ``HybridParallelStrategy(tensor_parallel=2)`` vs Lightning's ``ModelParallelStrategy`` with
  the hand-written ``configure_model`` its documentation asks for (``parallelize_module`` with the
  same plan: Megatron-style, sequence parallel, logits gathered);
- dp=2 FSDP2: ``HybridParallelStrategy(data_parallel_mode="fsdp")`` vs ``ModelParallelStrategy``
  with ``fully_shard`` per block, then the model (unsharded between forward and backward at the root).

The bound of each pair is the same parallel step with no framework at all: a raw torch loop
(``DistributedDataParallel``, ``parallelize_module``, ``fully_shard``; forward, loss, backward,
AdamW), whose time is what the parallelism itself costs. Per step: ``on_train_batch_start`` to
``on_train_batch_end`` for the Trainers. Rounds run ours, Lightning's and raw in an order that
rotates every round; the first ``--warmup`` steps of every block are dropped; medians reported, with
each variant's spread (interquartile range / median) beside them.

Prints ``BENCH lightning_peers {json}`` last and writes benchmarks/results/lightning_peers.json.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import RESULTS, StepTimer, emit, join_process_group, model_arguments, run_workers, timed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.models import GPT, GPTConfig, GPTLightningModule, gpt_tensor_parallel_plan
from lightning_scale.strategies import HybridParallelStrategy

LR = 1e-3


def _tp_plan(model: GPT, mesh: DeviceMesh) -> dict[str, Any]:
    return gpt_tensor_parallel_plan(model, mesh.size(), sequence_parallel=True, loss_parallel=False)


def _fsdp(model: GPT, mesh: DeviceMesh) -> None:
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


class _HandWrittenTP(GPTLightningModule):
    """What a ModelParallelStrategy user writes for tensor parallelism."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["tensor_parallel"]
        parallelize_module(self.model, mesh, _tp_plan(self.model, mesh))


class _HandWrittenFSDP(GPTLightningModule):
    """What a ModelParallelStrategy user writes for FSDP2."""

    def configure_model(self) -> None:
        _fsdp(self.model, self.device_mesh["data_parallel"])


PAIRS: dict[str, dict[str, Any]] = {
    "dp2": {
        "ours": lambda: HybridParallelStrategy(data_parallel=2),
        "lightning": lambda: DDPStrategy(),
        "module": GPTLightningModule,
    },
    "tp2": {
        "ours": lambda: HybridParallelStrategy(tensor_parallel=2, loss_parallel=False),
        "lightning": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        "module": _HandWrittenTP,
    },
    "fsdp2": {
        "ours": lambda: HybridParallelStrategy(data_parallel=2, data_parallel_mode="fsdp"),
        "lightning": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "module": _HandWrittenFSDP,
    },
}


def _fit(
    strategy: Strategy, module: GPTLightningModule, loader: DataLoader, steps: int, warmup: int
) -> tuple[list[float], float]:
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    return timer.times[warmup:], float(timer.first_loss or 0.0)


def _raw(pair: str, config: GPTConfig, tokens: torch.Tensor, rank: int, world: int) -> Callable[[], None]:
    """One step of the pair's parallelism as a raw torch loop on this rank's share of the batch."""
    torch.manual_seed(0)
    model = GPT(config)
    if pair == "tp2":
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, _tp_plan(model, mesh))
        share = tokens
    else:
        mesh = init_device_mesh("cpu", (world,))
        share = tokens[rank::world]
        if pair == "fsdp2":
            _fsdp(model, mesh)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> None:
        logits = model(share[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), share[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    join_process_group(rank, world, port)
    config = GPTConfig(
        n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, block_size=args.seq, tie_embeddings=False
    )
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    steps = args.warmup + args.steps
    results: dict[str, Any] = {}
    for pair in args.pairs:
        spec = PAIRS[pair]
        per_rank = args.batch if pair == "tp2" else args.batch // world  # Lightning splits the loader over dp
        data = TensorDataset(tokens[:, :-1].repeat(steps * world, 1), tokens[:, 1:].repeat(steps * world, 1))
        raw_step = _raw(pair, config, tokens, rank, world)
        times: dict[str, list[float]] = {"ours": [], "lightning": [], "raw_torch": []}
        first: dict[str, float] = {}
        for round_ in range(args.rounds):
            # The order rotates every round, so no variant always runs first (or right after another).
            order = ["ours", "lightning", "raw_torch"][round_ % 3 :] + ["ours", "lightning", "raw_torch"][: round_ % 3]
            for name in order:
                if name == "raw_torch":
                    times["raw_torch"] += timed(raw_step, steps)[args.warmup :]
                    dist.barrier()
                    continue
                torch.manual_seed(0)
                # Ours takes the module as it is; Lightning's ModelParallelStrategy needs its configure_model.
                module_cls = spec["module"] if name == "lightning" else GPTLightningModule
                module = module_cls(config, learning_rate=LR, warmup_steps=0)
                loader = DataLoader(data, batch_size=per_rank)
                block, first[name] = _fit(spec[name](), module, loader, steps, args.warmup)
                times[name] += block
                dist.barrier()
        results[pair] = {"times": times, "first_loss": first}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _spread(times: list[float]) -> float:
    if len(times) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every block")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of ours, Lightning's and raw, in rotating order")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {','.join(PAIRS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "lightning_peers.json")
    args = parser.parse_args()
    args.pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = sorted(set(args.pairs) - set(PAIRS))
    if unknown or not args.pairs:
        parser.error(f"--pairs {unknown or '(none)'}: choose among {', '.join(PAIRS)}")

    results = run_workers(_worker, 2, args)
    report: dict[str, Any] = {
        "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "vocab": 256, "tied": False},
        "batch": [args.batch, args.seq],
        "device": "cpu (gloo), 2 processes, 1 thread each",
        "pairs": {},
    }
    fields = {"dp2": "lightning_ddp", "tp2": "lightning_model_parallel_tp", "fsdp2": "lightning_model_parallel_fsdp"}
    for pair, result in results.items():
        med = {k: statistics.median(v) for k, v in result["times"].items()}
        report["pairs"][pair] = {
            "samples_per_variant": len(result["times"]["ours"]),
            # Interquartile range over the median: how far apart repeated steps of one variant lie.
            "spread": {k: round(_spread(v), 4) for k, v in result["times"].items()},
            "ours_step_s": round(med["ours"], 5),
            "lightning_step_s": round(med["lightning"], 5),
            "raw_torch_step_s": round(med["raw_torch"], 5),
            "first_loss": {k: round(v, 6) for k, v in result["first_loss"].items()},
        }
        report[f"ratio_vs_{fields[pair]}"] = round(med["ours"] / med["lightning"], 4)
        report[f"fraction_of_bound_{pair}"] = round(med["raw_torch"] / med["ours"], 4)
    report["targets"] = {f"ratio_vs_{fields[p]}": "<= 1.02" for p in args.pairs}
    emit("lightning_peers", report, args.out)


if __name__ == "__main__":
    main()
