"""Issue 41's GPU-efficiency paths, each run on the CPU: async checkpoint staging into reused host buffers,
the fused-AdamW choice, and ``compile="auto"``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_scale.core.checkpoint.host_staging import HostStager
from lightning_scale.plugins import ShardedCheckpointIO

# ---------------------------------------------------------------- async checkpoint staging


def _checkpoint(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Linear after one AdamW step, as the strategy hands it to the checkpoint IO (optimizer state by name)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    names = ["weight", "bias"]
    state = optimizer.state_dict()
    by_name = {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }
    return model, {"state_dict": model.state_dict(), "optimizer_states": [by_name], "global_step": 1, "epoch": 0}


def _tensors(loaded: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in loaded["state_dict"].items()}
    for i, entries in loaded["optimizer_states"][0]["state"].items():
        out.update({f"optim/{i}/{k}": v for k, v in entries.items()})
    return out


def _io(async_save: bool) -> ShardedCheckpointIO:
    return ShardedCheckpointIO(async_save=async_save, preemption=False, auto_resume=False)


@pytest.fixture(autouse=True)
def _quiet_single_process_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_an_async_save_loads_to_exactly_the_tensors_of_a_sync_save(tmp_path: Path) -> None:
    _, checkpoint = _checkpoint()
    sync, asynchronous = _io(False), _io(True)
    sync.save_checkpoint(checkpoint, tmp_path / "sync")
    asynchronous.save_checkpoint(checkpoint, tmp_path / "async")
    asynchronous.wait()
    expected, got = (
        _tensors(sync.load_checkpoint(tmp_path / "sync")),
        _tensors(sync.load_checkpoint(tmp_path / "async")),
    )
    assert expected.keys() == got.keys() and len(expected) == 8
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_the_second_async_save_refills_the_same_host_buffers(tmp_path: Path) -> None:
    model, checkpoint = _checkpoint()
    io = _io(True)
    io.save_checkpoint(checkpoint, tmp_path / "first")
    io.wait()
    assert io._writer is not None
    first = {k: v.data_ptr() for k, v in io._writer.stager.buffers().items()}
    assert len(first) == 8 and not io._writer.stager.last_reused
    with torch.no_grad():
        model.weight.add_(1.0)
    io.save_checkpoint(checkpoint, tmp_path / "second")
    io.wait()
    assert {k: v.data_ptr() for k, v in io._writer.stager.buffers().items()} == first
    assert io._writer.stager.last_reused
    loaded = io.load_checkpoint(tmp_path / "second")["state_dict"]["weight"]
    assert torch.equal(loaded, model.weight.detach())  # the refilled buffers hold the new values


def test_a_tensor_changed_right_after_the_async_save_returns_is_saved_as_it_was(tmp_path: Path) -> None:
    model, checkpoint = _checkpoint()
    before = model.weight.detach().clone()
    exp_avg = checkpoint["optimizer_states"][0]["state"]["weight"]["exp_avg"]
    exp_avg_before = exp_avg.clone()
    io = _io(True)
    io.save_checkpoint(checkpoint, tmp_path / "ckpt")
    with torch.no_grad():  # what the next optimizer step does, while the writer thread may still be writing
        model.weight.mul_(-3.0).add_(7.0)
        exp_avg.fill_(123.0)
    io.wait()
    loaded = _tensors(io.load_checkpoint(tmp_path / "ckpt"))
    assert torch.equal(loaded["model/weight"], before)
    assert torch.equal(loaded["optim/0/exp_avg"], exp_avg_before)
    assert not torch.equal(model.weight.detach(), before)


def test_the_stager_keeps_a_buffer_per_key_and_frees_those_of_keys_that_are_gone() -> None:
    stager = HostStager()
    a, b = torch.arange(4.0), torch.ones(2, dtype=torch.bfloat16)
    staged = stager.stage({"a": a, "b": b})
    assert staged["b"].dtype == torch.bfloat16 and torch.equal(staged["a"], a)
    assert not staged["a"].is_pinned()  # no CUDA: pageable host memory
    kept = staged["a"].data_ptr()
    staged = stager.stage({"a": a, "b": b.float()})  # b changed dtype: a new buffer for b only
    assert staged["a"].data_ptr() == kept and staged["b"].dtype == torch.float32 and not stager.last_reused
    stager.stage({"a": a})
    assert list(stager.buffers()) == ["a"]
    fresh = HostStager(reuse=False)
    assert torch.equal(fresh.stage({"a": a})["a"], a) and not fresh.buffers()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinned_staging_without_cuda_is_refused_with_the_fix() -> None:
    message = "pin_memory=True needs CUDA (page-locked memory is a CUDA allocation) and CUDA is not available; pass"
    with pytest.raises(ValueError, match=re.escape(message)):
        HostStager(pin_memory=True)
    with pytest.raises(TypeError, match=re.escape("reuse='yes' must be True or False.")):
        HostStager(reuse="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=re.escape("state_dict['n'] is a int; only tensors are staged.")):
        HostStager().stage({"n": 3})  # type: ignore[dict-item]


# ---------------------------------------------------------------- fused AdamW on CUDA


def test_adamw_is_fused_only_when_every_parameter_is_a_floating_point_cuda_tensor() -> None:
    from lightning_scale.models.module import _adamw_fused

    weights = [torch.zeros(2, 2), torch.zeros(2)]
    assert _adamw_fused(weights, device="cuda") is True
    assert _adamw_fused(weights, device=torch.device("cuda", 1)) is True
    assert _adamw_fused(weights) is None  # CPU tensors: torch's default, as before
    assert _adamw_fused(weights, device="meta") is None
    assert _adamw_fused([*weights, torch.zeros(2, dtype=torch.int64)], device="cuda") is None
    assert _adamw_fused([], device="cuda") is None
    assert _adamw_fused(torch.zeros(1, device="meta") for _ in range(2)) is None


def test_the_gpt_module_keeps_torchs_default_adamw_on_the_cpu() -> None:
    from lightning_scale.models import GPTLightningModule

    module = GPTLightningModule("tiny", warmup_steps=1)
    module.trainer = type("T", (), {"estimated_stepping_batches": 10})()  # type: ignore[assignment]
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["fused"] is None and optimizer.defaults["foreach"] is None


# ---------------------------------------------------------------- compile="auto"


def test_compile_auto_is_on_for_cuda_and_off_for_the_cpu() -> None:
    from lightning_scale.core.parallel.blocks import resolve_compile

    assert resolve_compile("auto", "cpu") is False
    assert resolve_compile("auto", torch.device("cuda", 0)) is True
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cuda") is False
    for bad in ("yes", 1, None, "Auto"):
        with pytest.raises(ValueError, match=re.escape(f"compile={bad!r} is not one of True, False, 'auto': True")):
            resolve_compile(bad, "cpu")  # type: ignore[arg-type]


def test_the_strategy_takes_compile_auto_and_resolves_it_by_the_root_device() -> None:
    from lightning_scale.strategies import HybridParallelStrategy
    from lightning_scale.strategies.hybrid.options import ParallelOptions

    options = ParallelOptions(compile="auto")  # type: ignore[arg-type]
    assert options.compile_setting == "auto"
    assert options.compiles_on("cpu") is False and options.compiles_on("cuda") is True
    assert options.compile is torch.cuda.is_available()  # every reader of `compile` sees a bool
    assert ParallelOptions(compile=True).compile_setting is True
    assert ParallelOptions(compile=True).compiles_on("cpu") is True
    assert HybridParallelStrategy(compile="auto").options.compiles_on("cpu") is False  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("compile='on' is not one of True, False, 'auto'")):
        HybridParallelStrategy(compile="on")  # type: ignore[arg-type]


def _two_adamw_steps(compiled: bool) -> list[float]:
    from lightning_scale.core.parallel.blocks import compile_blocks
    from lightning_scale.models import GPT, PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    if compiled:
        assert compile_blocks(list(model.blocks.values())) == PRESETS["tiny"].n_layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_blocks_on_the_cpu_give_the_eager_losses() -> None:
    # Inductor's CPU backend (gcc) compiles the tiny GPT's block in about 8 s on 2 cores.
    eager, compiled = _two_adamw_steps(False), _two_adamw_steps(True)
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert eager[1] != eager[0]


def test_the_attention_kernels_are_checked_and_reported_at_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_scale.core.parallel import attention

    assert attention.sdpa_backends(torch.device("cpu"), torch.bfloat16) == {}
    assert "torch's own kernels for torch.bfloat16" in attention.describe_sdpa(torch.device("cpu"), "bf16-mixed")
    # A GPU (mocked: none here) whose fused kernels cannot run in the run's dtype: said, with the fix.
    monkeypatch.setattr(attention, "sdpa_backends", lambda *_: {"flash": False, "cudnn": False, "efficient": True})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla V100-SXM2-32GB")
    line = attention.describe_sdpa(torch.device("cuda"), "32-true")
    assert "Tesla V100-SXM2-32GB in torch.float32: flash not usable, cudnn not usable, efficient usable" in line
    assert "Neither FlashAttention nor cuDNN attention runs here" in line and "bf16-mixed" in line
    monkeypatch.setattr(attention, "sdpa_backends", lambda *_: {"flash": True, "cudnn": True, "efficient": True})
    assert "Neither" not in attention.describe_sdpa(torch.device("cuda"), "bf16-mixed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_attention_runs_in_bf16_on_this_gpu() -> None:
    from lightning_scale.core.parallel.attention import sdpa_backends

    usable = sdpa_backends(torch.device("cuda"), torch.bfloat16)
    assert usable["flash"] or usable["cudnn"], usable
