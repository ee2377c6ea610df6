"""Activation offloading (``HybridParallelStrategy(activation_offload=...)``): on the CPU ``save_on_cpu`` keeps
each saved tensor itself, so a run with offloading equals the run without bit for bit, while the hooks are
shown to have packed the blocks' tensors; it composes with checkpointing, compile and pipeline stages; the
planner's memory falls and its time grows by the host transfers; ``"auto"`` asks the planner; bad values are
refused naming the value and the fix."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.parity import fit_gpt
from lightning.pytorch import Callback
from torch import nn

from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.parallel.offload import apply_activation_offload, offload_stats, offloaded_blocks
from lightning_scale.core.planner import Candidate, Workload, cluster, model_shape
from lightning_scale.core.planner.cluster import cpu_cluster
from lightning_scale.core.planner.memory import estimate_memory, fewest_offloaded_blocks
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.models import PRESETS, GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

SMALL = GPTConfig(n_layers=4, d_model=32, n_heads=2, block_size=32)


def _fit(world: int, **options: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    captured: dict[str, Any] = {}

    class Capture(Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            captured["packed"] = offload_stats(pl_module).tensors
            captured["offload"] = trainer.strategy.options.activation_offload

    result = fit_gpt(HybridParallelStrategy(**options), world, SMALL, precision="32-true", callbacks=[Capture()])
    return {**result, **captured}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"] and a["val"] == b["val"]
    assert a["state"].keys() == b["state"].keys()
    for name, value in b["state"].items():
        assert torch.equal(a["state"][name], value), name


def test_offloading_equals_the_run_without_to_the_bit_and_packs_the_blocks_tensors() -> None:
    reference = _fit(1)
    offloaded = _fit(1, activation_offload=2)
    _same(offloaded, reference)
    assert reference["packed"] == 0 and offloaded["packed"] > 0
    # A list of block indices, and offloading beside selective checkpointing: the same run again.
    listed = _fit(1, activation_offload=[1, 3], activation_checkpointing="selective")
    _same(listed, reference)
    # Blocks 1 and 3 are the ones selective checkpointing (every 2nd from block 0) leaves alone.
    assert listed["packed"] == offloaded["packed"]


def test_offloading_composes_with_checkpointing_and_compile_on_one_block() -> None:
    def block() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    x = torch.randn(4, 16)
    plain = block()
    plain(x).square().sum().backward()
    expected = [p.grad for p in plain.parameters()]
    packed = {}
    for case in ("eager", "compiled", "checkpointed"):
        b = block()
        if case == "checkpointed":
            apply_activation_checkpointing([b], "full")
        assert apply_activation_offload([b], [True], pin_memory=False) == 1
        if case == "compiled":
            b.compile(backend="eager")  # what compile_blocks does, with dynamo's tracing only
        b(x).square().sum().backward()
        for grad, want in zip((p.grad for p in b.parameters()), expected, strict=True):
            torch.testing.assert_close(grad, want, rtol=0, atol=0)
        packed[case] = offload_stats(b).tensors
    assert packed["eager"] > 0 and packed["compiled"] > 0, packed
    # A checkpointed block saves (next to) nothing beyond what the checkpoint keeps itself.
    assert packed["checkpointed"] < packed["eager"], packed


def test_each_pipeline_rank_offloads_its_own_first_blocks() -> None:
    assert offloaded_blocks(1, [2, 3]) == [True, False]  # the rank holding blocks 2 and 3: its first
    assert offloaded_blocks((0, 3), [2, 3]) == [False, True]
    results = run_distributed(run_cases, 2, __name__, "PIPELINE", timeout=300, env={"OMP_NUM_THREADS": "1"})
    for rank in results:
        _same(rank["offload"], rank["plain"])
        assert rank["offload"]["packed"] > 0 and rank["plain"]["packed"] == 0


PIPELINE = {
    "plain": lambda world: _fit(world, data_parallel=1, pipeline_parallel=2),
    "offload": lambda world: _fit(world, data_parallel=1, pipeline_parallel=2, activation_offload=1),
}


def test_auto_offloads_nothing_when_the_layout_fits() -> None:
    assert _fit(1, activation_offload="auto")["offload"] == 0


# ---------------------------------------------------------------------------------------------------- planner

SHAPE = model_shape(PRESETS["1.3b"])
WORKLOAD = Workload(global_batch=8, seq_len=2048, precision="bf16-mixed", optimizer="adamw")
ONE = Candidate(dp=1, tp=1, pp=1, micro_batch=8)


def test_the_planner_moves_the_offloaded_blocks_activations_to_the_host_and_pays_the_transfer() -> None:
    h100 = cluster("h100-sxm", devices_per_node=1)
    base_memory, base_time = estimate_memory(SHAPE, WORKLOAD, ONE), estimate_time(SHAPE, WORKLOAD, ONE, h100)
    off = dataclasses.replace(ONE, offload_blocks=12)
    memory, time = estimate_memory(SHAPE, WORKLOAD, off), estimate_time(SHAPE, WORKLOAD, off, h100, explain=True)
    saved = memory.inputs["block_activation_bytes_per_microbatch"]
    assert memory.inputs["offloaded_blocks_on_rank"] == 12
    assert base_memory.terms["activations"] - memory.terms["activations"] == pytest.approx(12 * saved)
    assert memory.total < base_memory.total and time.step_time > base_time.step_time
    # Forward to the host and back, over PCIe Gen5 x16 (55 GB/s assumed), nothing overlapped.
    assert time.terms["activation_offload"] == pytest.approx(2 * 12 * saved / 55e9)
    assert base_time.terms["activation_offload"] == 0.0
    assert time.details["activation_offload"]["host_link"] == "pcie5-host"
    # Checkpointed blocks keep only their input on the device: offloading them moves nothing.
    full = dataclasses.replace(off, checkpointing="full")
    assert (
        full.offloaded_blocks(24) == 0 and dataclasses.replace(off, checkpointing="selective").offloaded_blocks(24) == 6
    )
    # On a CPU the host is the device: no time.
    host = cpu_cluster(devices_per_node=1, peak_flops={"bfloat16": 5e10})
    assert estimate_time(SHAPE, WORKLOAD, off, host).terms["activation_offload"] == 0.0


def test_auto_offload_is_the_fewest_blocks_that_fit_and_none_when_everything_fits() -> None:
    roomy, totals = fewest_offloaded_blocks(SHAPE, WORKLOAD, ONE, 80 * 2**30)
    assert roomy == 0 and totals == sorted(totals, reverse=True)
    fewest, totals = fewest_offloaded_blocks(SHAPE, WORKLOAD, ONE, (totals[0] + totals[-1]) / 2)
    assert fewest is not None and 0 < fewest < SHAPE.n_layers
    assert totals[fewest] <= (totals[0] + totals[-1]) / 2 < totals[fewest - 1]
    assert fewest_offloaded_blocks(SHAPE, WORKLOAD, ONE, 2**20)[0] is None


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, r"activation_offload=-1 is negative: pass the number of blocks"),
        ("all", ValueError, r"activation_offload='all' is not 'auto': pass 'auto'"),
        ([0, 0], ValueError, r"activation_offload=\[0, 0\]: a list must hold distinct block indices"),
        (1.5, TypeError, r"activation_offload=1.5 must be a number of blocks \(0: off\), 'auto'"),
        (True, TypeError, r"activation_offload=True must be a number of blocks"),
    ],
)
def test_bad_values_are_refused_naming_the_value_and_what_to_pass(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        HybridParallelStrategy(activation_offload=value)
    with pytest.raises(ValueError, match=r"offload_blocks=-1 must be a number of blocks >= 0"):
        Candidate(dp=1, tp=1, pp=1, offload_blocks=-1)


def test_auto_on_a_run_the_planner_cannot_read_is_refused_naming_the_fix() -> None:
    tokens = torch.randint(0, 256, (8, 17))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = quiet_trainer(strategy=HybridParallelStrategy(activation_offload="auto"), max_steps=1)
    error = fit_error(trainer, GPTLightningModule(SMALL), train_dataloaders=loader)
    assert "activation_offload='auto' asks the planner, which cannot plan this run" in error, error
    assert "global_batch_size" in error and "Pass a number of blocks instead." in error, error
