"""Memory that data-parallel sharding and activation checkpointing save, measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from helpers.parity import RecordLoss
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor

import lightning_scale  # noqa: F401
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _state_bytes(rank: int, world: int, mode: str) -> int:
    """Bytes this rank holds in parameters, gradients and AdamW state after two steps."""
    seed_everything(0, verbose=False)
    config = GPTConfig(n_layers=4, d_model=64, n_heads=4, block_size=32, tie_embeddings=False)
    module = GPTLightningModule(config)
    holder: dict[str, Any] = {}

    class _Measure(Callback):
        def on_before_zero_grad(self, trainer: Trainer, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            holder["bytes"] = sum(_local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0) for p in params)
            holder["bytes"] += sum(_local_bytes(s) for s in states if s.dim() > 0)  # not the scalar step counts

    strategy = HybridParallelStrategy(data_parallel=world, data_parallel_mode=mode)
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=2, callbacks=[_Measure()])
    trainer.fit(module, datamodule=TextDataModule(seq_len=32, global_batch_size=4))
    return holder["bytes"]


def _state_bytes_by_mode(rank: int, world: int) -> dict[str, int]:
    return {mode: _state_bytes(rank, world, mode) for mode in ("ddp", "fsdp")}


@pytest.mark.slow
def test_fsdp_holds_about_half_the_parameter_gradient_and_optimizer_bytes_of_ddp() -> None:
    results = run_distributed(_state_bytes_by_mode, 2, timeout=180)
    ddp, fsdp = [r["ddp"] for r in results], [r["fsdp"] for r in results]
    assert ddp[0] == ddp[1]  # replicas hold everything
    ratio = max(fsdp) / ddp[0]
    print(f"fsdp/ddp parameter+gradient+AdamW bytes per rank at dp=2: {ratio:.3f} ({max(fsdp)} / {ddp[0]})")
    assert ratio <= 0.55, ratio


class _ProfileStep(Callback):
    """Profiles CPU memory over the first training step (forward, backward, optimizer) and reads its peak."""

    def __init__(self, out: Path) -> None:
        self.out, self.peak = out, 0
        self._prof: Any = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
            )
            self._prof.__enter__()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._prof.__exit__(None, None, None)
            self._prof.export_memory_timeline(str(self.out), device="cpu")
            _, sizes = json.loads(self.out.read_text())
            self.peak = max(sum(s) for s in sizes)


def _peak_and_losses(rank: int, world: int, out: str) -> dict[str, tuple[int, list[float]]]:
    results = {}
    for mode in ("none", "selective", "full"):
        seed_everything(0, verbose=False)
        config = GPTConfig(n_layers=12, d_model=64, n_heads=4, block_size=128, tie_embeddings=False)
        profile, record = _ProfileStep(Path(out) / f"{mode}.json"), RecordLoss()
        strategy = HybridParallelStrategy(data_parallel=1, activation_checkpointing=mode)
        trainer = quiet_trainer(devices=1, strategy=strategy, max_steps=2, callbacks=[profile, record])
        trainer.fit(GPTLightningModule(config), datamodule=TextDataModule(seq_len=128, global_batch_size=8))
        results[mode] = (profile.peak, record.losses)
    return results


@pytest.mark.slow
def test_full_activation_checkpointing_lowers_the_peak_memory_of_a_step_with_identical_losses(tmp_path: Path) -> None:
    results = run_distributed(_peak_and_losses, 1, str(tmp_path), timeout=180)[0]
    (none_peak, none_losses), (sel_peak, _), (full_peak, full_losses) = results.values()
    print(
        f"12-block GPT, batch 8 x 128: peak memory of a training step, full/none {full_peak / none_peak:.2f}, "
        f"selective/none {sel_peak / none_peak:.2f} ({full_peak / 2**20:.1f} / {sel_peak / 2**20:.1f} / "
        f"{none_peak / 2**20:.1f} MiB)"
    )
    assert full_peak < 0.7 * none_peak
    assert full_peak < sel_peak < none_peak
    # Recomputed activations are the same numbers: the losses of every step (after updates from
    # checkpointed backward passes) match exactly.
    assert full_losses == none_losses
