"""Float8 training through torchao (``HybridParallelStrategy(float8=...)``), emulated on the CPU: the blocks'
linears are converted and nothing else, the loss stays near the unconverted run's (and is not identical to
it: the casts happen), a Hugging Face decoder trains too, FSDP2 and tensor parallelism match one process,
and every refusal names the value, the rule and the fix."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_cases, run_distributed
from helpers.lightning import fit_error, quiet_trainer
from helpers.parity import RecordLoss, fit_gpt
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.cli.plan import table
from lightning_scale.core.planner import Candidate, Workload, cluster, estimate, model_shape
from lightning_scale.core.planner.calibration import FITTED, Observation, default_fit, fit_efficiency
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.data import TextDataModule
from lightning_scale.models import PRESETS, GPTConfig, GPTLightningModule
from lightning_scale.plugins import MixedPrecision
from lightning_scale.strategies import HybridParallelStrategy
from lightning_scale.strategies.hybrid.float8 import check_float8_run, convert_float8, float8_linears

pytest.importorskip("torchao")  # the dev extra installs it (the fp8 extra for users)

SMALL = GPTConfig(n_layers=2, d_model=32, n_heads=2, block_size=32)
"""The model for the multi-process cases (every linear's dimensions multiples of 16)."""

# Float8 against the same run unconverted, as the largest relative difference of a step's loss. Measured
# (torch 2.13 CPU, torchao 0.18, 2026-12-06): tiny preset, 8 steps, fp32: 7.3e-4 rowwise, 6.1e-4 tensorwise;
# the small model below, 3 steps: 4.8e-5 / 6.5e-5; the Llama below, 4 steps: 1.6e-4. A conversion that does
# nothing gives exactly 0 (the floor catches it); every Float8Linear output off by 10% (a wrong scale) gives
# 7.6e-3 on the tiny preset, off by 2x 2.5e-2 (measured with a patched forward): above the tolerance.
FLOAT8_RTOL = 2e-3
FLOAT8_FLOOR = 1e-7
# Float8 at a layout against float8 on one process. Measured: FSDP2 dp=2 at most 9e-6, tp=2 at most 3.4e-5
# (rowwise scales are taken per row of the local shard: tensor parallelism changes the rows' split).
LAYOUT_RTOL = 5e-4


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _fit_gpt(config: GPTConfig | str, float8: str | None, steps: int) -> tuple[list[float], GPTLightningModule]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    trainer = quiet_trainer(
        devices=1, strategy=HybridParallelStrategy(float8=float8), max_steps=steps, callbacks=[record]
    )
    module = GPTLightningModule(config, learning_rate=3e-3, warmup_steps=2)
    seq = min(64, (PRESETS[config] if isinstance(config, str) else config).block_size)
    trainer.fit(module, datamodule=TextDataModule(seq_len=seq, global_batch_size=4))
    return record.losses, module


def test_rowwise_float8_converts_the_blocks_linears_and_keeps_the_loss_near_the_unconverted_run() -> None:
    begin = time.perf_counter()
    reference, _ = _fit_gpt("tiny", None, steps=8)
    losses, module = _fit_gpt("tiny", "rowwise", steps=8)
    converted = float8_linears(module)
    blocks = PRESETS["tiny"].n_layers
    linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    # Every linear inside a block, nothing outside (the head, the embeddings: not linears at all).
    assert converted == [n for n in linears if ".blocks." in f".{n}"] and len(converted) >= 6 * blocks
    assert "model.head" in linears and "model.head" not in converted
    assert type(module.model.tok_emb) is nn.Embedding
    difference = _relative(losses, reference)
    assert FLOAT8_FLOOR < difference < FLOAT8_RTOL, (difference, losses, reference)
    assert losses[-1] < losses[0]
    assert time.perf_counter() - begin < 120


def test_tensorwise_float8_trains_too() -> None:
    reference, _ = _fit_gpt(SMALL, None, steps=3)
    losses, module = _fit_gpt(SMALL, "tensorwise", steps=3)
    assert float8_linears(module) and FLOAT8_FLOOR < _relative(losses, reference) < FLOAT8_RTOL


def test_a_linear_whose_dimensions_are_not_multiples_of_16_stays_as_it_is() -> None:
    blocks = [nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 20)), nn.Sequential(nn.Linear(16, 16))]
    assert convert_float8(blocks, "rowwise", torch.device("cpu")) == (2, 1)
    assert type(blocks[0][2]) is nn.Linear and isinstance(blocks[0][0], nn.Linear)
    assert len(float8_linears(blocks[0])) == 1 and len(float8_linears(blocks[1])) == 1


transformers = pytest.importorskip("transformers")


class _Llama(LightningModule):
    """A Hugging Face Llama built from a config with random weights, as a user writes it (no hook)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self.model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        x = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)


def _fit_llama(float8: str | None) -> tuple[list[float], _Llama]:
    seed_everything(0, verbose=False)
    record = RecordLoss()
    module = _Llama()
    trainer = quiet_trainer(strategy=HybridParallelStrategy(float8=float8), max_steps=4, callbacks=[record])
    trainer.fit(module)
    return record.losses, module


def test_a_hugging_face_decoder_trains_in_float8_with_its_layers_linears_converted() -> None:
    reference, _ = _fit_llama(None)
    losses, module = _fit_llama("rowwise")
    converted = float8_linears(module)
    # q, k, v, o and the gated MLP's three, in each decoder layer; not lm_head nor the embeddings.
    assert len(converted) == 2 * 7 and all(".layers." in n for n in converted), converted
    assert FLOAT8_FLOOR < _relative(losses, reference) < FLOAT8_RTOL, (losses, reference)


def _small(world: int, **layout: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    result = fit_gpt(HybridParallelStrategy(float8="rowwise", **layout), world, SMALL, precision="32-true")
    return {"losses": result["losses"], "val": result["val"]}


LAYOUTS = {
    "fsdp-dp2": lambda world: _small(world, data_parallel=2, data_parallel_mode="fsdp"),
    "tp2": lambda world: _small(world, data_parallel=1, tensor_parallel=2),
}


def test_float8_under_fsdp2_and_tensor_parallelism_matches_one_process() -> None:
    reference = fit_gpt(HybridParallelStrategy(float8="rowwise"), 1, SMALL, precision="32-true")
    results = run_distributed(run_cases, 2, __name__, "LAYOUTS", timeout=300, env={"OMP_NUM_THREADS": "1"})
    for rank, by_layout in enumerate(results):
        for name, result in by_layout.items():
            difference = _relative(result["losses"], reference["losses"])
            assert difference < LAYOUT_RTOL, (rank, name, difference)
            assert result["val"] == pytest.approx(reference["val"], rel=LAYOUT_RTOL)


# ---------------------------------------------------------------------------------------------------- refusals


def test_an_unknown_recipe_is_refused_naming_the_recipes() -> None:
    with pytest.raises(ValueError, match=r"float8='fp8' is not a torchao float8 recipe: use one of .*rowwise"):
        HybridParallelStrategy(float8="fp8")


def test_without_torchao_float8_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ValueError, match=r"torchao, which is not installed: pip install 'lightning-scale\[fp8\]'"):
        HybridParallelStrategy(float8="rowwise")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import that fails
    with pytest.raises(ValueError, match=r"torchao, which failed to import .*lightning-scale\[fp8\]"):
        convert_float8([nn.Linear(16, 16)], "rowwise", torch.device("cpu"))


def test_a_gpu_without_float8_matmuls_is_refused_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB \(compute capability 8.0\) .* >= 8.9 .*Use float8=None"):
        check_float8_run("rowwise", torch.device("cuda", 0), "bf16-mixed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_run("rowwise", torch.device("cuda", 0), "bf16-mixed")  # an H100: accepted


def test_fp16_is_refused_at_set_up_before_the_model_is_touched() -> None:
    module = GPTLightningModule(SMALL)
    trainer = quiet_trainer(
        strategy=HybridParallelStrategy(float8="rowwise"), plugins=[MixedPrecision("fp16-mixed")], max_steps=1
    )
    error = fit_error(trainer, module, datamodule=TextDataModule(seq_len=16, global_batch_size=2))
    assert "float8='rowwise' with precision='16-mixed'" in error and "Use precision='bf16-mixed'" in error, error
    assert not float8_linears(module)  # refused before the conversion
    with pytest.raises(ValueError, match=r"not fp16 with loss scaling"):
        check_float8_run("tensorwise", torch.device("cpu"), "16-mixed")


def test_float8_on_a_model_without_blocks_names_the_hook() -> None:
    class Plain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(16, 16)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(strategy=HybridParallelStrategy(float8="rowwise"), max_steps=1)
    error = fit_error(trainer, Plain(), train_dataloaders=DataLoader(TensorDataset(torch.randn(4, 16)), batch_size=2))
    assert "float8='rowwise'" in error and "pipeline_spec(self)" in error, error


def test_precision_fp8_in_hydra_is_bf16_with_rowwise_float8() -> None:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        cfg = compose("config", overrides=["precision=fp8"])
        explicit = compose("config", overrides=["precision=bf16", "strategy.float8=tensorwise"])
    assert cfg.strategy.float8 == "rowwise" and cfg.precision.precision == "bf16-mixed"
    assert explicit.strategy.float8 == "tensorwise"
    GlobalHydra.instance().clear()


# ---------------------------------------------------------------------------------------------------- planner


def test_calibration_fits_the_float8_speed_up_from_a_float8_run() -> None:
    """gpu_check's float8 run (its planner record says float8) makes calibration fit ``float8_gemm``: two runs
    timed with a known factor (0.6, not the default 0.88) give it back."""
    h100 = cluster("h100-sxm", devices_per_node=1)
    shape, workload = model_shape(PRESETS["1.3b"]), Workload(8, 2048, "bf16-mixed")
    bf16, fp8 = Candidate(1, 1, 1, micro_batch=8), Candidate(1, 1, 1, micro_batch=8, float8=True)
    truth = dataclasses.replace(h100.efficiency, compute=0.5, float8_gemm=0.6)
    runs = [
        Observation(shape, workload, c, estimate_time(shape, workload, c, h100, truth).step_time, name=c.name)
        for c in (bf16, fp8)
    ]
    assert default_fit(h100, runs[:1]) == FITTED and default_fit(h100, runs) == (*FITTED, "float8_gemm")
    fitted = fit_efficiency(runs, h100, fit=("compute", "float8_gemm"))
    assert fitted.float8_gemm == pytest.approx(0.6, rel=0.02) and fitted.compute == pytest.approx(0.5, rel=0.02)
    # The plan table no longer calls float8 layouts planned only.
    line = table([estimate(shape, workload, fp8, h100)], 1)
    assert "-fp8 *" not in line and "HybridParallelStrategy trains with strategy.float8=rowwise" in line, line
