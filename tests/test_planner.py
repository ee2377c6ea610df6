"""The planner's model (core/planner): shapes read exactly, memory against torch's dispatch-level
tracker on real steps (in one process, and in every rank of the strategy on several), step time against published Megatron-LM measurements, the search's size and
speed, and bad input refused before any work."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.plan_cli import plan_cli

from lightning_scale.core.pipeline.partition import bubble_fraction
from lightning_scale.core.planner import (
    Candidate,
    Cluster,
    ModelShape,
    Workload,
    cluster,
    estimate,
    model_shape,
    module_shape,
    plan,
)
from lightning_scale.core.planner.cluster import CPU_EFFICIENCY, DEVICES, LINKS, cpu_cluster
from lightning_scale.core.planner.memory import estimate_memory
from lightning_scale.core.planner.published import NARAYANAN_2021
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.models import GPT, PRESETS

ROOT = Path(__file__).resolve().parents[1]
TINY = model_shape(PRESETS["tiny"])

# ------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_shape_of_every_preset_counts_its_parameters_exactly(preset: str) -> None:
    config = PRESETS[preset]
    with torch.device("meta"):
        model = GPT(config)
    shape = model_shape(config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_the_shape_of_a_hugging_face_config_counts_its_model_exactly(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = {
        "llama": lambda: transformers.LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=1000,
        ),
        "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=3, n_head=4, vocab_size=1000, n_positions=64),
        "qwen2": lambda: transformers.Qwen2Config(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=500,
            tie_word_embeddings=True,
        ),
    }[family]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = model_shape(config)
    unique = {id(p): p.numel() for p in model.parameters()}
    if family == "qwen2":  # Qwen2's q/k/v projections carry biases (no flag says so): counted apart
        biases = sum(m.bias.numel() for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj")))
        assert shape.parameters + biases == sum(unique.values())
    else:
        assert shape.parameters == sum(unique.values())


def _same_shape(read: ModelShape, expected: ModelShape, *ignore: str) -> None:
    """Equal field by field but the name (and ``ignore``)."""
    skip = ("name", *ignore)
    assert {k: v for k, v in dataclasses.asdict(read).items() if k not in skip} == {
        k: v for k, v in dataclasses.asdict(expected).items() if k not in skip
    }


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_modules_shape_read_off_its_meta_tensors_is_its_configs(preset: str) -> None:
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    _same_shape(module_shape(model), model_shape(PRESETS[preset]))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_a_hugging_face_models_shape_read_off_its_modules_is_its_configs(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    config, cls = {
        "llama": (
            transformers.LlamaConfig(
                hidden_size=256,
                intermediate_size=688,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=1000,
            ),
            transformers.LlamaForCausalLM,
        ),
        "gpt2": (
            transformers.GPT2Config(
                n_embd=128, n_layer=3, n_head=4, vocab_size=1000, n_positions=64
            ),  # Conv1D: (in, out)
            transformers.GPT2LMHeadModel,
        ),
        "qwen2": (
            transformers.Qwen2Config(
                hidden_size=128,
                intermediate_size=352,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=500,
                tie_word_embeddings=True,
            ),
            transformers.Qwen2ForCausalLM,
        ),
    }[family]
    with torch.device("meta"):
        model = cls(config)
    # Qwen2's q/k/v biases are seen on the module (its config has no flag for them): biased, within 1% of its count.
    _same_shape(module_shape(model), model_shape(config), *(("bias",) if family == "qwen2" else ()))
    assert module_shape(model).bias == (family != "llama")


class _TorchLayersLM(torch.nn.Module):
    """A user's model the package did not write: torch's own encoder layers (nn.MultiheadAttention's fused
    in-projection, biases, LayerNorm) under a causal mask, untied head."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(64, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True) for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, vocab, bias=False)


class _FusedQKV(torch.nn.Module):
    def __init__(self, d: int, kv: int, head_dim: int, ff: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv = torch.nn.Linear(d, d + 2 * kv, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.gate_up = torch.nn.Linear(d, 2 * ff, bias=False)
        self.down = torch.nn.Linear(ff, d, bias=False)


class _FusedLM(torch.nn.Module):
    """Fused q/k/v with grouped keys, a fused SwiGLU gate/up, RMSNorm, a head tied by reusing the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(384, 96)
        self.blocks = torch.nn.Sequential(*[_FusedQKV(96, 48, 24, 256) for _ in range(5)])


def test_a_users_own_models_shape_is_read_off_its_modules_parameter_for_parameter() -> None:
    with torch.device("meta"):
        torch_layers, fused = _TorchLayersLM(), _FusedLM()
    shape = module_shape(torch_layers)
    assert shape.parameters == sum(p.numel() for p in torch_layers.parameters()) == 726144 + 64 * 128
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.d_ff, shape.vocab_size, shape.learned_positions) == (
        3,
        4,
        4,
        512,
        512,
        64,
    )
    assert (shape.bias, shape.layernorm, shape.tied, shape.gated_mlp) == (True, True, False, False)
    shape = module_shape(fused)
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.d_ff) == (5, 4, 2, 24, 256)
    assert (shape.bias, shape.layernorm, shape.tied, shape.gated_mlp) == (False, False, True, True)
    assert shape.parameters - sum(p.numel() for p in fused.parameters()) == 96  # this one has no final norm: within 1%


def test_a_module_the_planner_cannot_read_is_refused_with_what_to_add() -> None:
    with pytest.raises(
        ValueError, match=r"found no transformer blocks in Module.*build it in `__init__`.*give the module a `config`"
    ):
        module_shape(torch.nn.Module())  # built in configure_model: nothing there yet
    with torch.device("meta"):
        fused = _FusedLM()
    for block in fused.blocks:
        del block.head_dim
    with pytest.raises(
        ValueError, match=r"cannot tell _FusedLM's attention heads: give its attention module an `n_heads`"
    ):
        module_shape(fused)
    with torch.device("meta"):
        no_embedding = torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2)))
    with pytest.raises(ValueError, match=r"found no token embedding"):
        module_shape(no_embedding)
    with torch.device("meta"):
        wrong = _TorchLayersLM()
        wrong.extra = torch.nn.Linear(512, 512)  # parameters the shape cannot account for
    with pytest.raises(
        ValueError, match=r"with 734,336 parameters, but it has 996,992: it is not a decoder whose shape can be read"
    ):
        module_shape(wrong)


def test_a_config_the_planner_cannot_read_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"Cannot read a decoder's shape from dict: no layers, heads.*Pass a ModelShape"
    ):
        model_shape({"hidden_size": 64, "vocab_size": 10})
    with pytest.raises(ValueError, match=r"mixture-of-experts config"):
        model_shape(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "vocab_size": 10,
                "num_local_experts": 8,
            }
        )


# ------------------------------------------------------------------------------------ memory


def _benchmark() -> Any:
    """``benchmarks/planner.py``, whose measurements these tests check (one copy of the cases)."""
    spec = importlib.util.spec_from_file_location("planner_benchmark", ROOT / "benchmarks" / "planner.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_process_memory_is_within_10_percent_of_the_tracked_peak() -> None:
    errors = (
        _benchmark().memory_errors()
    )  # six cases: GPT and Llama-like, fp32 and bf16, no/full/selective checkpointing
    assert len(errors) == 6 and all(abs(e) <= 0.10 for e in errors.values()), errors


MULTIPROCESS_SUBSET = {
    2: [
        "gpt/ddp2",
        "gpt/fsdp2-ac",
        "gpt/tp2",
        "gpt/pp2-gpipe",
        "gpt/pp2-interleaved",
        "hf-llama/pp2-1f1b",
        "hf-llama/fsdp2-bf16",
    ],
    4: ["gpt/tp2-pp2", "gpt-wide/dp2-tp2-ac", "gpt/fsdp_grad_op2-pp2-bf16"],
}
"""Of the benchmark's multi-process cases: DDP's buckets, FSDP2's buffers under checkpointing, sequence
parallelism's gathered inputs, GPipe's gradients, interleaved stages, a Hugging Face Llama's pipeline,
FSDP2's mixed precision (bf16 gathers and activations, no autocast copies) on a Hugging Face Llama,
tensor x pipeline, FSDP2 over tensor parallelism, and ``fsdp_grad_op`` under a pipeline in bf16."""


def _multiprocess_peaks(rank: int, world: int, names: list[str]) -> Any:
    return _benchmark().multiprocess_peaks(rank, world, names)


@pytest.mark.parametrize("world", sorted(MULTIPROCESS_SUBSET))
def test_every_ranks_memory_is_within_10_percent_of_its_tracked_peak_under_the_strategy(world: int) -> None:
    """HybridParallelStrategy in a Trainer on ``world`` gloo processes, the second step of each case
    tracked in every rank; the planner's estimate for each rank's pipeline stage."""
    names = MULTIPROCESS_SUBSET[world]
    errors = _benchmark().multiprocess_errors(run_distributed(_multiprocess_peaks, world, names, timeout=300))
    assert len(errors) == world * len(names) and all(abs(e) < 0.10 for e in errors.values()), errors


def test_a_pipeline_ranks_estimate_is_its_own() -> None:
    shape, workload = model_shape(PRESETS["gpt2-124m"]), Workload(16, 1024, "bf16-mixed")
    candidate = Candidate(1, 1, 4, schedule="1f1b", micro_batch=2)
    ranks = [estimate_memory(shape, workload, candidate, pipeline_rank=r) for r in range(4)]
    assert [e.rank for e in ranks] == ["first", "rank 1", "rank 2", "last"]
    assert [r.terms["activations"] for r in ranks] == sorted((r.terms["activations"] for r in ranks), reverse=True)
    assert estimate_memory(shape, workload, candidate).total == max(ranks[0].total, ranks[3].total)
    with pytest.raises(ValueError, match=r"pipeline_rank=4 is not a pipeline rank of .* use 0 to 3"):
        estimate_memory(shape, workload, candidate, pipeline_rank=4)


def test_sharding_divides_the_states_the_mode_shards() -> None:
    shape, workload = model_shape(PRESETS["gpt2-124m"]), Workload(64, 1024, "bf16-mixed")
    ddp = estimate_memory(shape, workload, Candidate(8, 1, 1, dp_mode="ddp", micro_batch=8)).terms
    fsdp = estimate_memory(shape, workload, Candidate(8, 1, 1, dp_mode="fsdp", micro_batch=8)).terms
    zero2 = estimate_memory(shape, workload, Candidate(8, 1, 1, dp_mode="fsdp_grad_op", micro_batch=8)).terms
    assert fsdp["parameters"] == pytest.approx(ddp["parameters"] / 8)
    assert fsdp["optimizer"] == zero2["optimizer"] == pytest.approx(ddp["optimizer"] / 8)
    # FSDP2's mixed precision: the fp32 shards, and the bf16 copy gathered from the forward to the backward.
    assert zero2["parameters"] == pytest.approx(ddp["parameters"] * (1 / 8 + 2 / 4))
    assert fsdp["fsdp_buffers"] > 0 and ddp["fsdp_buffers"] == 0
    # No autocast copies where FSDP2 casts the parameters; DDP (autocast) keeps a 16-bit copy of each weight.
    assert fsdp["cast_weights"] == zero2["cast_weights"] == 0 and ddp["cast_weights"] > 0
    fp32 = estimate_memory(
        shape, Workload(64, 1024, "32-true"), Candidate(8, 1, 1, dp_mode="fsdp_grad_op", micro_batch=8)
    ).terms
    assert fp32["parameters"] == ddp["parameters"]  # fp32: the gathered parameters are the fp32 ones


# ------------------------------------------------------------------------------------ time


def test_pipeline_bubble_is_the_schedules_predicted_share() -> None:
    shape, workload = model_shape(PRESETS["350m"]), Workload(32, 1024, "bf16-mixed")
    node = cluster("h100-sxm")
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        c = Candidate(2, 1, 4, schedule=schedule, virtual_stages=v, micro_batch=2)
        terms = estimate_time(shape, workload, c, node).terms
        pipeline = sum(
            terms[k]
            for k in (
                "compute",
                "attention",
                "elementwise",
                "recompute",
                "tensor_parallel",
                "pipeline_transfers",
                "bubble",
            )
        )
        assert terms["bubble"] / pipeline == pytest.approx(bubble_fraction(schedule, 4, 8, v))


def _cpu_host(slowdown: float) -> Cluster:
    """Two processes of this host, their cores shared ``slowdown`` ways (fixed, whatever this host has)."""
    host = cpu_cluster(devices_per_node=2, peak_flops={"float32": 5e10})
    return dataclasses.replace(host, device=dataclasses.replace(host.device, slowdown=slowdown))


def test_on_a_host_whose_processes_share_cores_the_bubble_shrinks_by_their_slowdown() -> None:
    """While one stage waits, the others' processes have its cores: the bubble (their time) runs
    ``slowdown`` times faster; on a device of its own it is the schedule's whole share."""
    workload, c = Workload(16, 128, "32-true"), Candidate(1, 1, 2, micro_batch=4)  # 4 micro-batches
    eff = dataclasses.replace(CPU_EFFICIENCY, overhead=1e-3)
    share = bubble_fraction("1f1b", 2, 4)
    for slowdown in (1.0, 2.0):
        terms = estimate_time(TINY, workload, c, _cpu_host(slowdown), eff).terms
        busy = sum(
            terms[k] for k in ("compute", "attention", "recompute", "tensor_parallel", "pipeline_transfers", "overhead")
        )
        assert terms["bubble"] == pytest.approx(busy * share / (1 - share) / slowdown)


def test_collectives_issued_from_python_take_their_factor_of_the_links_time_and_ddps_do_not() -> None:
    """DTensor's (tensor parallel) and FSDP2's collectives take ``framework_collectives`` times the link's
    time; DDP's flat buckets and the pipeline's sends the link's own."""
    workload, host = Workload(16, 128, "32-true"), _cpu_host(1.0)
    plain, slow = CPU_EFFICIENCY, dataclasses.replace(CPU_EFFICIENCY, framework_collectives=3.0)
    for c, term, ratio in (
        (Candidate(1, 2, 1, micro_batch=16, sequence_parallel=True), "tensor_parallel", 3.0),
        (Candidate(2, 1, 1, dp_mode="fsdp", micro_batch=8), "data_parallel", 3.0),
        (Candidate(2, 1, 1, micro_batch=8), "data_parallel", 1.0),
        (Candidate(1, 1, 2, micro_batch=4), "pipeline_transfers", 1.0),
    ):
        before = estimate_time(TINY, workload, c, host, plain).terms[term]
        assert before > 0 and estimate_time(TINY, workload, c, host, slow).terms[term] == pytest.approx(
            ratio * before
        ), c.name


def test_a_recomputed_block_pays_its_forward_share_of_the_fixed_cost_again() -> None:
    workload, host = Workload(16, 128, "32-true"), _cpu_host(1.0)
    eff = dataclasses.replace(CPU_EFFICIENCY, overhead=1e-3, forward_overhead=0.4)
    none = estimate_time(TINY, workload, Candidate(2, 1, 1, micro_batch=8), host, eff).terms
    full = estimate_time(TINY, workload, Candidate(2, 1, 1, micro_batch=8, checkpointing="full"), host, eff).terms
    assert none["overhead"] == pytest.approx(4 * 1e-3) and full["overhead"] == pytest.approx(4 * 1.4 * 1e-3)
    # On a CPU attention runs as plain matmuls at the GEMM rate: a block's forward is a third of its FLOPs
    # (the head, at its own rate, is not recomputed).
    inputs = estimate_time(TINY, workload, Candidate(2, 1, 1, micro_batch=8), host, eff).inputs
    head = TINY.head_flops_per_token() * 8 * 128 / inputs["head_rate"]
    assert full["recompute"] == pytest.approx((none["compute"] + none["attention"] - head) / 3)


def test_an_interleaved_rank_sends_and_receives_once_per_stage() -> None:
    workload, host = Workload(16, 128, "32-true"), _cpu_host(1.0)
    one = estimate_time(TINY, workload, Candidate(1, 1, 2, micro_batch=2), host).terms
    two = estimate_time(
        TINY, workload, Candidate(1, 1, 2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch=2), host
    ).terms
    assert two["pipeline_transfers"] == pytest.approx(2 * one["pipeline_transfers"]) and one["pipeline_transfers"] > 0


def test_a_single_device_step_is_gemms_attention_memory_bound_operators_and_the_optimizer_only() -> None:
    """Each at its own rate: GEMMs at ``compute`` of the peak (less for small matmuls), the causal attention
    kernel's half of ``12 H Q T`` at its own efficiency (lower for short sequences), the eager operators'
    traffic (GPT-2: LayerNorm, GeLU, learned positions) at the HBM bandwidth."""
    shape, workload = model_shape(PRESETS["gpt2-124m"]), Workload(8, 1024, "bf16-mixed")
    node = cluster("h100-sxm", devices_per_node=1)
    e = estimate_time(shape, workload, Candidate(1, 1, 1, micro_batch=8), node)
    assert {k for k, v in e.terms.items() if v} == {"compute", "attention", "elementwise", "optimizer"}
    eff, peak, tokens = node.efficiency, 989.4e12, 8 * 1024
    d, layers, vocab = 768, 12, 50257
    # Each matmul's size is 1 / (1/M + 1/N + 1/K), the blocks' a FLOP-weighted harmonic mean: q/k/v (N 3d, K d;
    # weight 3), the output projection (d, d; 1), the MLP's input (4d, d; 4) and output (d, 4d; 4).
    size = 1 / (1 / tokens + (3 * (1 / (3 * d) + 1 / d) + 2 / d + 8 * (1 / (4 * d) + 1 / d)) / 12)
    assert e.inputs["matmul_rate"] == pytest.approx(peak * eff.compute * size / (size + eff.matmul_half))
    head_size = 1 / (1 / tokens + 1 / vocab + 1 / d)
    assert e.inputs["head_rate"] == pytest.approx(peak * eff.compute * head_size / (head_size + eff.matmul_half))
    assert e.terms["compute"] == pytest.approx(
        layers * 6 * 12 * d * d * tokens / e.inputs["matmul_rate"] + 6 * vocab * d * tokens / e.inputs["head_rate"]
    )
    attention_rate = peak * eff.attention * 1024 / (1024 + eff.attention_half)
    assert e.terms["attention"] == pytest.approx(layers * 12 * d * 1024 / 2 * tokens / attention_rate)
    # Per token and block, forward: norms 2 x 2d and residual adds 2 x 3d at fp32 (autocast); q/k/v and the
    # output head-major 2 x 3d + 2d, GeLU 2 x 4d at bf16; the backward twice that. The loss: 3a + 28 bytes a logit.
    block = 3 * (10 * d * 4 + (8 * d + 8 * d) * 2)
    moved = layers * block + vocab * (3 * 2 + 28)
    assert e.terms["elementwise"] == pytest.approx(moved * tokens / (3.35e12 * eff.memory))


def test_published_megatron_throughput_within_15_percent_with_one_set_of_constants() -> None:
    """Narayanan et al. 2021, Table 1: each row's layout (tp, pp, GPUs, batch) as published, the
    schedule (1F1B or interleaved, as Megatron had) and micro-batch the planner's fastest, full
    recomputation and no sequence parallelism (both as in the paper); the A100 preset's constants."""
    errors = _benchmark().published_errors()
    assert len(errors) == len(NARAYANAN_2021) == 10
    assert sum(abs(e) for e in errors) / len(errors) <= 0.15


# ------------------------------------------------------------------------------------ search


def test_every_layout_of_a_70b_model_on_1024_h100s_is_ranked_in_seconds() -> None:
    llama70b = model_shape(
        {
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 28672,
            "vocab_size": 128256,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
    )
    start = time.process_time()
    ranked = plan(llama70b, Workload(1024, 4096, "bf16-mixed"), cluster("h100-sxm", nodes=128))
    seconds = time.process_time() - start
    assert seconds <= 30, seconds
    assert len(ranked) > 1000
    assert all(e.candidate.world_size == 1024 and e.candidate.tp <= 8 for e in ranked)
    assert {e.candidate.pp for e in ranked} == {1, 2, 4, 8, 16, 32, 64}  # every depth up to the 80 blocks
    fitting = [e for e in ranked if e.fits]
    assert fitting and ranked[: len(fitting)] == fitting  # those that fit first
    assert [e.tokens_per_sec for e in fitting] == sorted((e.tokens_per_sec for e in fitting), reverse=True)
    best = fitting[0]
    assert best.memory.total <= 0.9 * DEVICES["H100 SXM 80GB"].memory and 0.2 < best.mfu < 0.8
    assert best.usd_per_million_tokens and best.usd_per_million_tokens > 0
    # A model that is too big for DDP on a device: plain data parallelism never fits.
    assert not any(e.fits for e in ranked if e.candidate.dp_mode == "ddp" and e.candidate.tp == e.candidate.pp == 1)


def test_bad_input_is_refused_before_any_work() -> None:
    with pytest.raises(ValueError, match=r"Unknown cluster 'h900'. Presets: 'a100-sxm-40', .*or build a Cluster"):
        cluster("h900")
    with pytest.raises(ValueError, match=r"^nodes=0 must be a positive integer"):
        Cluster(DEVICES["L4"], 8, 0, LINKS["pcie4"], LINKS["ethernet-100g"])
    with pytest.raises(ValueError, match=r"precision='fp8' is not one the planner knows"):
        Workload(8, 128, "fp8")
    shape = model_shape(PRESETS["tiny"])
    # 4 blocks and 4 heads: at most tp=4 x pp=4, so 64 devices leave at least 4 data-parallel replicas.
    with pytest.raises(
        ValueError, match=r"No layout of .* on 64 devices splits global_batch=7: .* are \[4, 8, 16, 32, 64\]"
    ):
        plan(shape, Workload(7, 128), cluster("h100-sxm", nodes=8), context_parallel=(1,))  # (cp=64 would split it)
    with pytest.raises(ValueError, match=r"No peak FLOP/s for .* pass peak="):
        estimate(
            shape,
            Workload(8, 128, "32-true"),
            Candidate(1, 1, 1),
            Cluster(
                DEVICES["L4"].__class__("cpu", "cpu", 2**34, 1e10, None, "this machine"),
                1,
                1,
                LINKS["pcie4"],
                LINKS["pcie4"],
            ),
        )
    assert math.isfinite(
        estimate(shape, Workload(8, 128, "32-true"), Candidate(1, 1, 1), cluster("l4-pcie")).tokens_per_sec
    )


# ------------------------------------------------------------------------------------ lightning-scale-plan


def test_the_plan_app_ranks_explains_and_writes_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = [
        "model=350m",
        "data.global_batch_size=64",
        "data.seq_len=1024",
        "precision=bf16",
        "cluster=a100-sxm-80",
        "cluster.nodes=2",
        "plan.token_budget=1e9",
        f"plan.out={tmp_path}",
    ]
    status, out, _ = plan_cli(monkeypatch, capsys, *run)
    assert status == 0, out
    assert "on 16 x A100 SXM 80GB (2 node(s)), global batch 64 x 1024 tokens, bf16-mixed" in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    rows = doc["layouts"]
    assert doc["inputs"]["devices"] == 16 and len(rows) > 100
    fitting = [r for r in rows if r["fits"]]
    first_row = next(line for line in out.splitlines() if line.startswith("  1  "))
    assert rows[: len(fitting)] == fitting and fitting[0]["layout"] in first_row  # the table's first row
    # The price it used, and the offers plan.price= can name instead.
    assert (
        "  price: $3.431 per device-hour (AWS p4de.24xlarge" in out
        and "aws-p4de.24xlarge, lambda-gpu_8x_a100_80gb_sxm4" in out
    )
    assert [r["tokens_per_sec"] for r in fitting] == sorted((r["tokens_per_sec"] for r in fitting), reverse=True)
    for r in rows[:5]:
        assert r["memory_per_device_gib"] == pytest.approx(sum(r["memory_terms"].values()) / 2**30)
        assert r["step_time_s"] == pytest.approx(sum(r["time_terms"].values()))
        assert r["hours_to_budget"] == pytest.approx(1e9 / r["tokens_per_sec"] / 3600)
    assert (tmp_path / "plan.png").stat().st_size > 10_000

    status, out, _ = plan_cli(monkeypatch, capsys, *run, "--explain", fitting[0]["layout"])
    assert status == 0
    for term in (
        *rows[0]["memory_terms"],
        *rows[0]["time_terms"],
        "from: microbatches=",
        "gemm_rate=",
        "attention_rate=",
    ):
        assert term in out, term
    # A data-parallel group over both nodes: its placement, the link that limits it, its bandwidth, the overlap.
    spread = next(
        r["layout"] for r in rows if r["layout"].startswith(("dp16", "fsdp16")) and r["time_terms"]["data_parallel"] > 0
    )
    status, out, _ = plan_cli(monkeypatch, capsys, *run, "--explain", spread)
    assert re.search(
        r"from: mode=\w+, group=16, per_node=8, nodes=2, link=ib-hdr x 8 NIC\(s\) per node, bus_bandwidth=[\d.]+ GB/s, .*overlap=0.8",
        out,
    ), out
    # Another offer by name, or dollars; an unknown name is refused naming the device's offers.
    status, out, _ = plan_cli(monkeypatch, capsys, *run, "plan.price=lambda-gpu_8x_a100_80gb_sxm4")
    assert status == 0 and "price: $2.790 per device-hour (Lambda" in out
    lambda_rows = json.loads((tmp_path / "plan.json").read_text())["layouts"]
    assert lambda_rows[0]["usd_per_million_tokens"] == pytest.approx(
        rows[0]["usd_per_million_tokens"] * 22.32 / 27.44705
    )
    status, out, _ = plan_cli(monkeypatch, capsys, *run, "plan.price=2.5")
    assert status == 0 and "price: $2.500 per device-hour" in out
    status, _, err = plan_cli(monkeypatch, capsys, *run, "plan.price=gcp-a2")
    assert status == 2 and re.search(
        r"plan.price='gcp-a2' is not an offer .* \(offers: 'aws-p4de.24xlarge', 'lambda-", err
    ), err
    status, _, err = plan_cli(monkeypatch, capsys, *run, "--explain", "dp3-tp5-pp7-mb1")
    assert status == 2 and "no layout named 'dp3-tp5-pp7-mb1'; the best are: " in err


def test_the_plan_app_says_why_nothing_fits_and_refuses_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The 7B model on one 24 GB L4: the optimizer state alone is 50 GiB.
    status, out, _ = plan_cli(
        monkeypatch, capsys, "model=7b", "cluster=l4-pcie", "cluster.devices_per_node=1", f"plan.out={tmp_path}"
    )
    assert status == 0
    assert re.search(
        r"No layout fits in 19\.8 GiB per device \(22\.0 GiB less the 10% headroom\)\. The smallest found, \S+, needs [\d.]+ GiB, most of it "
        r"optimizer \([\d.]+ GiB\); try fsdp",
        out,
    ), out
    status, _, err = plan_cli(monkeypatch, capsys, "cluster.name=h900", f"plan.out={tmp_path}")
    assert status == 2 and "lightning-scale-plan: error: Unknown cluster 'h900'" in err


# ------------------------------------------------------------------------------------ compute-optimal sizing


@pytest.mark.parametrize("law", ["besiroglu2024", "hoffmann2022"])
def test_the_compute_optimal_point_spends_the_budget_at_the_least_loss(law: str) -> None:
    from lightning_scale.core.planner.sizing import LAWS

    scaling = LAWS[law]
    for flops in (1e20, 1e23, 1e25):
        n, d = scaling.optimal(flops)
        assert 6 * n * d == pytest.approx(flops)
        for factor in (0.8, 1.25):  # any other split of the same compute loses more
            assert scaling.loss(n * factor, d / factor) > scaling.loss(n, d)
    n, d = LAWS["besiroglu2024"].optimal(1e24)
    assert 15 < d / n < 30  # the refit's ~20 tokens per parameter


def test_a_law_fitted_to_runs_recovers_the_law_that_made_them() -> None:
    from lightning_scale.core.planner.sizing import HOFFMANN_2022, fit_law

    runs = [(n, d, HOFFMANN_2022.loss(n, d)) for n in (1e7, 1e8, 1e9) for d in (1e9, 1e10, 1e11)]
    fitted = fit_law(runs)
    for n, d, loss in runs:
        assert fitted.loss(n, d) == pytest.approx(loss, rel=1e-3)
    assert fitted.alpha == pytest.approx(0.34, rel=0.05) and fitted.beta == pytest.approx(0.28, rel=0.05)
    with pytest.raises(ValueError, match=r"needs at least 5 runs .* got 2"):
        fit_law(runs[:2])


def test_the_plan_app_sizes_a_model_for_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = [
        "data.global_batch_size=512",
        "data.seq_len=2048",
        "precision=bf16",
        "cluster.nodes=8",
        "plan.top=1",
        f"plan.out={tmp_path}",
    ]
    status, out, _ = plan_cli(monkeypatch, capsys, *run, "--budget-hours", "24")
    assert status == 0, out
    sizing = json.loads((tmp_path / "plan.json").read_text())["sizing"]
    assert "compute-optimal for" in out and f"nearest preset model={sizing['preset']}" in out
    assert sizing["hours"] == 24 and sizing["fits"] and sizing["usd"] == pytest.approx(24 * 64 * 55.04 / 8)
    assert sizing["optimal_tokens"] * sizing["optimal_parameters"] * 6 == pytest.approx(sizing["budget_flops"])
    # The answer alone: no table of the config's default model first.
    assert "what a budget buys on 64 x H100 SXM 80GB" in out and "tokens/s" not in out and "  1  " not in out
    status, out, _ = plan_cli(monkeypatch, capsys, *run, "--budget-usd", "10000", "plan.price=lambda-gpu_8x_h100_sxm5")
    cheaper = json.loads((tmp_path / "plan.json").read_text())["sizing"]
    assert (
        status == 0
        and cheaper["usd"] == pytest.approx(10000)
        and cheaper["hours"] == pytest.approx(10000 / (64 * 31.92 / 8), rel=1e-6)
    )
    status, _, err = plan_cli(monkeypatch, capsys, *run, "--budget-hours", "24", "--law", "kaplan")
    assert status == 2 and "plan.law='kaplan' is not a law the planner knows" in err
    status, _, err = plan_cli(monkeypatch, capsys, *run, "--budget-hours", "24", "--budget-usd", "5")
    assert status == 2 and "Give exactly one budget" in err


def test_the_plan_apps_help_says_what_it_does_with_its_options_and_an_example(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_scale.cli.plan import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "usage: lightning-scale-plan",
        "ranked by predicted tokens/s",
        "--explain LAYOUT",
        "--budget-usd",
        "calibrate RUN_DIR",
        "plan.price=OFFER|DOLLARS",
        "example:",
        "docs/planner.md",
    ):
        assert needle in out, needle
    assert "Hydra" in out and "_target_" not in out  # not Hydra's config dump
