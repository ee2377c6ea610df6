"""FLOPs per token and peak FLOP/s (``core/flops``, ``core/peaks``): no process group, no compute
(the FLOP counts run on meta tensors)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.telemetry.flops import (
    hardware_flops_per_token,
    matmul_parameters,
    measured_flops_per_token,
    model_flops_utilization,
    transformer_flops_per_token,
)
from lightning_scale.core.telemetry.model_facts import ModelFacts
from lightning_scale.core.telemetry.peaks import PEAKS, chip_of, device_peak, measured_peak
from lightning_scale.models import GPT, PRESETS
from lightning_scale.strategies.hybrid.parallelize import checkpointed_blocks


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_analytic_count_matches_the_flop_counter_for_every_gpt_preset(preset: str) -> None:
    with torch.device("meta"):
        model = GPT(preset)
    c = model.config
    tokens = torch.zeros(1, c.block_size, dtype=torch.long, device="meta")
    measured = measured_flops_per_token(lambda: model(tokens).float().sum().backward(), c.block_size)
    analytic = transformer_flops_per_token(
        matmul_parameters(model), c.n_layers, c.n_heads, c.d_model // c.n_heads, c.block_size
    )
    assert analytic == pytest.approx(measured, rel=0.02)


def test_causal_halves_attention_and_recomputation_adds_a_forward() -> None:
    full = transformer_flops_per_token(1000, 2, 4, 8, 16)
    assert full == 6 * 1000 + 12 * 2 * 4 * 8 * 16
    assert transformer_flops_per_token(1000, 2, 4, 8, 16, causal=True) == 6 * 1000 + 6 * 2 * 4 * 8 * 16
    assert hardware_flops_per_token(1000, 2, 4, 8, 16) == 8 * 1000 + 16 * 2 * 4 * 8 * 16
    assert hardware_flops_per_token(1000, 2, 4, 8, 16, recomputed_fraction=0.0) == full


def _gpt(n_layers: int) -> tuple[nn.Module, list[nn.Module]]:
    with torch.device("meta"):
        model = GPT({**PRESETS["tiny"].__dict__, "n_layers": n_layers})
    return model, list(model.blocks.values())


def _llama(n_layers: int) -> tuple[nn.Module, list[nn.Module]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model, list(model.model.layers)


MODELS: dict[str, Callable[[int], tuple[nn.Module, list[nn.Module]]]] = {"gpt": _gpt, "llama": _llama}
SEQ = 128


def _step_flops(model: nn.Module, tokens: torch.Tensor) -> int:
    """FlopCounterMode over one training step (forward and backward) on meta tensors."""
    with FlopCounterMode(display=False) as counter:
        output = model(tokens)
        (output if isinstance(output, torch.Tensor) else output.logits).float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("stages", [(5,), (3, 3)], ids=["pp1-5-blocks", "pp2-3+3-blocks"])
def test_hardware_flops_are_the_flop_counters_count_of_a_step_with_the_packages_checkpointing(
    family: str, mode: str, stages: Sequence[int]
) -> None:
    """Recomputation counted per block, summed over the blocks each pipeline stage wraps, against
    FlopCounterMode over a step of the model with each stage's blocks wrapped by the real wrapper.
    ``selective`` (every 2nd block): 5 blocks wrap 3, not 5/2; two stages of 3 wrap 2 each, not 6/2."""
    tokens = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    model, blocks = MODELS[family](sum(stages))
    facts = ModelFacts.of(model)
    assert facts.measure_recomputation(model, tokens, blocks)
    assert all("forward" not in vars(b) for b in blocks)  # the blocks are left as they were
    starts = [sum(stages[:i]) for i in range(len(stages))]
    rank_blocks = [range(start, start + n) for start, n in zip(starts, stages)]
    facts.checkpointed_blocks = checkpointed_blocks(rank_blocks, mode, 2)
    assert len(facts.checkpointed_blocks) == (sum(stages) if mode == "full" else sum(math.ceil(n / 2) for n in stages))

    reference, reference_blocks = MODELS[family](sum(stages))
    plain = _step_flops(reference, tokens)
    for stage in rank_blocks:
        apply_activation_checkpointing([reference_blocks[b] for b in stage], mode, 2)
    hardware = _step_flops(reference, tokens)

    model_flops, recomputed = facts.flops_per_token(SEQ), facts.recomputed_flops_per_token(SEQ)
    assert (model_flops + recomputed) / model_flops == pytest.approx(hardware / plain, rel=0.01)
    if family == "gpt":  # its analytic count is the counter's: the hardware FLOPs themselves agree
        assert model_flops + recomputed == pytest.approx(hardware / tokens.numel(), rel=0.01)
    if mode == "full":  # the textbook 8N + 16LHQT recomputes the head and every block's last layer too
        s = facts.shape
        textbook = hardware_flops_per_token(facts.matmul_parameters, s.n_layers, s.n_heads, s.head_dim, SEQ)
        assert textbook > 1.05 * (model_flops + recomputed)


def test_recomputation_is_zero_without_checkpointed_blocks_and_unknown_when_not_counted() -> None:
    model, blocks = _gpt(2)
    facts = ModelFacts.of(model)
    assert facts.recomputed_flops_per_token(SEQ) == 0.0
    facts.checkpointed_blocks = (0, 1)
    assert facts.recomputed_flops_per_token(SEQ) is None
    assert facts.measure_recomputation(model, torch.zeros(2, SEQ, dtype=torch.long), blocks)
    # At another length it scales with the model's FLOPs per token.
    share = facts.recomputed_flops_per_token(SEQ) / facts.flops_per_token(SEQ)
    assert facts.recomputed_flops_per_token(SEQ // 2) == pytest.approx(share * facts.flops_per_token(SEQ // 2))


def test_a_tied_head_counts_its_matmul_and_embeddings_do_not() -> None:
    with torch.device("meta"):
        tied, untied = GPT("tiny"), GPT({**GPT("tiny").config.__dict__, "tie_embeddings": False})
    assert matmul_parameters(tied) == matmul_parameters(untied)  # the head multiplies either way
    linear = sum(p.numel() for n, p in untied.named_parameters() if p.dim() == 2 and not n.endswith("_emb.weight"))
    assert matmul_parameters(untied) == linear  # the embedding lookups are no matmul


def test_mfu_is_the_needed_flops_over_the_devices_peak() -> None:
    # 1e9 FLOPs per token at 1e5 tokens/s on 4 devices of 1e14 FLOP/s each.
    assert model_flops_utilization(1e9, 1e5, 4, 1e14) == pytest.approx(0.25)
    with pytest.raises(ValueError, match=r"devices=0 and peak_flops_per_device=100000000000000.0 must be positive"):
        model_flops_utilization(1e9, 1e5, 0, 1e14)


@pytest.mark.parametrize(
    ("name", "chip"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10G", "A10G"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla T4", "T4"),
        ("AMD Instinct MI250X", "MI250X"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA GeForce RTX 3090", None),
        ("cpu", None),
    ],
)
def test_device_names_map_to_chips_and_unknown_ones_to_none(name: str, chip: str | None) -> None:
    assert chip_of(name) == chip


def test_peaks_are_dense_with_a_source_and_unknowns_are_none() -> None:
    assert device_peak("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert device_peak("NVIDIA H200", "bfloat16") == pytest.approx(989.4e12)  # not the sparse 1979
    assert device_peak("Tesla T4", "bfloat16") is None  # no bf16 tensor cores: no figure, no guess
    assert device_peak("NVIDIA GeForce RTX 3090", "bfloat16") is None
    for peak in PEAKS.values():
        assert peak.flops, peak
        # Dense tensor rates: bf16/fp16 never above fp8, tf32 never above bf16.
        f = peak.flops
        assert f.get("float8", float("inf")) >= f.get("bfloat16", 0) >= f.get("tf32", 0), peak.chip
    with pytest.raises(ValueError, match=r"dtype='fp32' must be one of"):
        device_peak("NVIDIA H100 PCIe", "fp32")


def test_every_peak_row_has_a_source_and_a_month() -> None:
    for peak in PEAKS.values():
        assert re.fullmatch(r"https?://\S+.*", peak.source), peak
        assert re.fullmatch(r"(19|20)\d\d-(0[1-9]|1[0-2])", peak.date), peak


def test_float64_is_the_matmul_rate_on_tensor_or_matrix_cores_where_the_chip_has_them() -> None:
    assert device_peak("NVIDIA A100-SXM4-80GB", "float64") == pytest.approx(19.5e12)  # not the 9.7 vector rate
    assert device_peak("NVIDIA H100 80GB HBM3", "float64") == pytest.approx(67e12)  # not 33.5
    assert device_peak("NVIDIA H100 PCIe", "float64") == pytest.approx(51e12)
    assert device_peak("NVIDIA H200", "float64") == pytest.approx(67e12)
    assert device_peak("AMD Instinct MI300X", "float64") == pytest.approx(163.4e12)  # 'FP64 Matrix', not 81.7
    assert device_peak("Tesla V100-SXM2-16GB", "float64") == pytest.approx(7.8e12)  # no FP64 tensor cores
    for chip in ("A100", "H100 SXM", "H100 PCIe", "H100 NVL", "H200 SXM", "H200 NVL", "MI300X", "MI250X"):
        assert PEAKS[chip].flops["float64"] >= PEAKS[chip].flops["float32"] * 0.99, chip  # matrix FP64 >= FP32


def test_the_a10g_has_its_own_peak_not_the_a10s() -> None:
    # NVIDIA/AWS A10G datasheet: 70 dense bf16/fp16 tensor TFLOPS (the A10's is 125), 35 fp32 and tf32.
    assert device_peak("NVIDIA A10G", "bfloat16") == pytest.approx(70e12)
    assert device_peak("NVIDIA A10G", "float16") == pytest.approx(70e12)
    assert device_peak("NVIDIA A10G", "tf32") == pytest.approx(35e12)
    assert device_peak("NVIDIA A10G", "float32") == pytest.approx(35e12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: measured_flops_per_token(lambda: None, 0),
            r"^tokens=0 must be a positive integer \(1 or more\)\. It counts the tokens the step processes\.$",
        ),
        (lambda: measured_peak("float32", size=0), r"^size=0 must be a positive integer \(1 or more\)\.$"),
        (lambda: measured_peak("float32", repeats=True), r"^repeats=True must be a positive integer \(1 or more\)\.$"),
        (
            lambda: apply_activation_checkpointing([], "full", 0),
            r"^activation_checkpointing_every=0 must be a positive integer \(1 or more\)\.$",
        ),
    ],
    ids=["tokens", "size", "repeats", "checkpointing-every"],
)
def test_counts_that_must_be_positive_integers_are_refused_naming_the_value(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
