"""Gradient compression (DDP communication hooks) on a 2-rank gradient bucket, and in training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import seed_everything

import lightning_scale  # noqa: F401
from lightning_scale.core.parallel.data_parallel import COMPRESSIONS, wrap_ddp
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

STEPS, START = 4, 2  # backward passes; PowerSGD compresses from the START-th on


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, 16))


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).pow(2).sum().backward()


def _reduced_gradients(
    rank: int, world: int
) -> tuple[dict[str, list[dict[str, torch.Tensor]]], list[dict[str, torch.Tensor]]]:
    """Every hook's averaged gradients over STEPS backward passes, and the exact average (fp64 all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    hooked: dict[str, list[dict[str, torch.Tensor]]] = {}
    for kind in COMPRESSIONS:
        ddp = wrap_ddp(_model(), mesh, backend="gloo", compression=kind, powersgd_rank=2, powersgd_start_iter=START)
        hooked[kind] = []
        for step in range(STEPS):
            ddp.zero_grad()
            _backward(ddp, rank, step)
            hooked[kind].append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
    model, exact = _model(), []
    for step in range(STEPS):
        model.zero_grad()
        _backward(model, rank, step)
        grads = {n: p.grad.double() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        exact.append({n: (g / world).float() for n, g in grads.items()})
    return hooked, exact


def _final_val_losses(world: int) -> dict[str, float]:
    """A short dp=2 training run with each compression (PowerSGD compressing from step 5)."""
    losses = {}
    for kind in COMPRESSIONS:
        seed_everything(0, verbose=False)
        strategy = HybridParallelStrategy(
            data_parallel=world, gradient_compression=kind, powersgd_rank=2, powersgd_start_iter=5
        )
        trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=20, limit_val_batches=4)
        module = GPTLightningModule(
            GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=32), learning_rate=3e-3, warmup_steps=5
        )
        datamodule = TextDataModule(seq_len=32, global_batch_size=8)
        trainer.fit(module, datamodule=datamodule)
        losses[kind] = trainer.validate(module, datamodule=datamodule, verbose=False)[0]["val/loss"]
    return losses


def _both(rank: int, world: int) -> dict[str, Any]:
    hooked, exact = _reduced_gradients(rank, world)
    return {"hooked": hooked, "exact": exact, "val": _final_val_losses(world)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_both, 2, timeout=240)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> bool:
    """Every element within ``tol`` of the tensor's largest magnitude: rounding the ranks' addends
    leaves an error relative to them, not to their (possibly cancelling) sum."""
    return all(torch.allclose(a[n], b[n], rtol=0, atol=tol * float(b[n].abs().max())) for n in b)


def test_half_precision_hooks_round_the_averaged_gradient(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        hooked, exact = run["hooked"], run["exact"]
        for step in range(STEPS):
            assert _close(hooked["none"][step], exact[step], 1e-6)
            # fp16: 11 significant bits; bf16: 8. Both round (not equal to the exact average), both stay close.
            assert _close(hooked["fp16"][step], exact[step], 2e-3)
            assert _close(hooked["bf16"][step], exact[step], 2e-2)
            for kind in ("fp16", "bf16"):
                assert not _close(hooked[kind][step], exact[step], 1e-6), kind
            assert not _close(hooked["fp16"][step], hooked["bf16"][step], 1e-6)


def test_powersgd_averages_exactly_then_sends_low_rank_matrices(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        powersgd, exact = run["hooked"]["powersgd"], run["exact"]
        for step in range(START):  # plain all-reduce for the first powersgd_start_iter steps
            assert _close(powersgd[step], exact[step], 1e-6)
        for step in range(START, STEPS):
            for name, grad in powersgd[step].items():
                if grad.dim() == 1:  # vectors are sent as they are
                    torch.testing.assert_close(grad, exact[step][name], rtol=1e-6, atol=1e-7)
                else:  # matrices as P @ Q.T of rank powersgd_rank=2, which the exact average is not
                    assert torch.linalg.matrix_rank(exact[step][name]) > 2
                    assert torch.linalg.matrix_rank(grad) <= 2, name


def test_compressed_training_stays_within_3_percent_of_uncompressed(runs: list[dict[str, Any]]) -> None:
    for run in runs:
        losses = run["val"]
        assert losses["none"] < 5.0, losses  # it learned: the byte-level loss starts at about 5.5
        for kind in ("fp16", "bf16", "powersgd"):
            assert abs(losses[kind] - losses["none"]) <= 0.03 * losses["none"], (kind, losses)
        assert len(set(losses.values())) == len(losses), losses  # compression changed the arithmetic
