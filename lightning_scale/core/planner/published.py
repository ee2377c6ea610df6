"""Published step-time measurements the planner is checked against. No Lightning.

:data:`RECORDS` holds the runs of three other sources, each row copied as published (``benchmarks/README.md``
says which tables and why; ``benchmarks/planner.py`` prints every row's prediction), and :data:`SOURCES`
what each source's software did that the planner's system constants must be told (a kernel it had or
lacked), never a number fitted to it:

- ``korthikanti2022``: Table 3 (layouts) and Table 5 (iteration times) of Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models" (MLSys 2023, https://arxiv.org/abs/2205.05198):
  GPT models of 22B to 1T parameters on 8 to 512 A100 80GB GPUs of Selene, Megatron-LM, full
  recomputation against sequence parallelism with selective recomputation;
- ``megatron_core_2024``: the weak-scaling table of NVIDIA/Megatron-LM's README (``images/model_table.png``
  at core_r0.8.0, 2024-07): GPT models of 1.7B to 462B parameters on 48 to 6,144 H100 GPUs;
- ``llm_foundry_2024``: the H100 80GB bf16 tables of mosaicml/llm-foundry's
  ``scripts/train/benchmarking/README.md`` (commit 4952183; runs of 2023-10 and 2024-01): MPT models of
  760M to 70B parameters under PyTorch FSDP on 8 to 512 GPUs, sequences of 512 to 65,536 tokens.

:data:`NARAYANAN_2021`: Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (SC'21, https://arxiv.org/abs/2104.04473): GPT models of 1.7B to 1T
parameters on up to 3,072 A100 80GB GPUs of NVIDIA's Selene (DGX A100 nodes: 8 GPUs on NVLink 3,
8 HDR InfiniBand links per node), sequence length 2,048, vocabulary 51,200, mixed precision (fp16),
activation recomputation on; the achieved teraFLOP/s per GPU count the recomputation
(:func:`megatron_flops_per_step`, their equation 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_scale.core.planner.cluster import A100_MEGATRON, HOPPER, Efficiency, cluster
from lightning_scale.core.planner.layout import CHECKPOINTING, Workload
from lightning_scale.core.planner.search import Estimate, candidates, estimate
from lightning_scale.core.planner.shape import ModelShape

__all__ = ["NARAYANAN_2021", "RECORDS", "SOURCES", "PublishedRecord", "PublishedRun", "PublishedSource",
           "megatron_flops_per_step", "predict"]

SOURCE = "Narayanan et al. 2021, Table 1 (https://arxiv.org/abs/2104.04473)"


@dataclass(frozen=True)
class PublishedRun:
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float
    """Achieved teraFLOP/s per GPU, recomputation counted."""
    seq_len: int = 2048
    vocab: int = 51200

    @property
    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.layers, d_model=self.hidden, n_heads=self.heads, n_kv_heads=self.heads,
            head_dim=self.hidden // self.heads, d_ff=4 * self.hidden, vocab_size=self.vocab, tied=True, bias=True,
            learned_positions=self.seq_len, layernorm=True, name=f"GPT-{self.billions}B",
        )  # fmt: skip

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


NARAYANAN_2021: tuple[PublishedRun, ...] = (
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def megatron_flops_per_step(run: PublishedRun) -> float:
    """The paper's count: ``96 B s l h^2 (1 + s / (6 h) + V / (16 l h))`` per iteration, forward,
    backward and the recomputed forward."""
    b, s, l, h, v = run.global_batch, run.seq_len, run.layers, run.hidden, run.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# --------------------------------------------------------------------------------------------- other sources


@dataclass(frozen=True)
class PublishedSource:
    name: str
    cluster: str
    """The preset of :data:`~lightning_scale.core.planner.cluster.CLUSTERS` its GPUs were."""
    efficiency: Efficiency
    """The preset's constants, told what the source's software had (see :data:`SOURCES`)."""
    citation: str


@dataclass(frozen=True)
class PublishedRecord:
    """One published run: the model, the layout as far as the source states it, and its throughput."""

    source: str
    label: str
    shape: ModelShape
    gpus: int
    tp: int
    pp: int
    global_batch: int
    seq_len: int
    tokens_per_sec_per_gpu: float
    """As published, or derived from a published time (the source's doc line says how)."""
    dp_mode: str = "ddp"
    micro_batch: int | None = None
    """None: not published; the planner's fastest."""
    checkpointing: str | None = None
    """None: not published; the planner's fastest that fits."""
    sequence_parallel: bool = False
    schedules: tuple[tuple[str, int], ...] = (("1f1b", 1),)
    """The pipeline schedules the source's software had (the planner's fastest of them)."""


SOURCES: dict[str, PublishedSource] = {
    s.name: s
    for s in (
        PublishedSource("korthikanti2022", "a100-sxm-80", A100_MEGATRON,
                        "Korthikanti et al. 2022, Tables 3 and 5 (https://arxiv.org/abs/2205.05198); Megatron-LM's "
                        "own kernels (no fused attention: the A100 constants fitted on Narayanan et al. 2021, unchanged)"),
        PublishedSource("megatron_core_2024", "h100-sxm",
                        replace(HOPPER, elementwise=0.5, tp_overlap=HOPPER.dp_overlap,
                                source=HOPPER.source + "; Transformer Engine's fused kernels: half of eager's elementwise "
                                "traffic (norms fused into the next linear, bias-GeLU and bias-dropout-add fused); "
                                "tensor-parallel communication overlapped with the GEMMs (--tp-comm-overlap) as much as "
                                "data-parallel (--overlap-grad-reduce, --overlap-param-gather)"),
                        "NVIDIA/Megatron-LM README, weak scaling (images/model_table.png at core_r0.8.0)"),
        PublishedSource("llm_foundry_2024", "h100-sxm",
                        replace(HOPPER, attention=HOPPER.attention / 2.5,
                                source=HOPPER.source + "; llm-foundry's Triton FlashAttention (attn_impl 'triton', its "
                                "default in v0.3.0), at FlashAttention-2's rate / 2.5 (Dao 2023: FlashAttention-2 is "
                                "1.3-2.5x faster than the Triton FlashAttention)"),
                        "mosaicml/llm-foundry scripts/train/benchmarking/README.md at 4952183 (H100 80GB BF16 tables); "
                        "eager PyTorch under FSDP"),
    )
}  # fmt: skip


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> ModelShape:
    """A GPT of Megatron's or MPT's kind: 4x MLP, biases, LayerNorm, tied embedding, learned positions."""
    return ModelShape(n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads,
                      d_ff=4 * hidden, vocab_size=vocab, tied=True, bias=True, learned_positions=positions,
                      layernorm=True, name=name)  # fmt: skip


_K22 = "korthikanti2022"
_KORTHIKANTI = (  # label, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch, schedule, seconds (full, present)
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, ("1f1b", 1), 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, ("interleaved_1f1b", 3), 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, ("interleaved_1f1b", 3), 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, ("1f1b", 1), 94.42, 71.49),
)
"""Table 3's layouts (sequence 2,048, vocabulary 51,200; the 175B and 530B runs interleaved, 3 stages a
rank) and Table 5's iteration times: full recomputation, and "present work" (sequence parallelism with
selective recomputation, which recomputes only attention's softmax and products: the planner has no such
mode, so it is planned with no checkpointing). Tokens/s per GPU = batch x 2,048 / time / GPUs."""

_MCORE = (  # params, heads, hidden, layers, tp, pp, GPUs, global batch, TFLOP/s per GPU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)
"""Sequence 4,096, vocabulary 131,072, data parallel 48 in every row; micro-batch, schedule and
recomputation are not published (the planner's fastest). Megatron-Core's distributed optimizer
reduce-scatters the gradients and all-gathers the parameters once a step, as ``fsdp_grad_op`` does
under a pipeline (its memory differs: only the optimizer state is sharded). The TFLOP/s count ``6 N + 12 L H Q T`` per token
(Megatron-Core's ``num_floating_point_operations``, the planner's own count), so tokens/s per GPU =
TFLOP/s / that count."""

_FOUNDRY_SHAPES = {  # layers, hidden, heads (vocabulary 50,368; learned positions as long as the sequence)
    "mpt-760m": (24, 1536, 12), "mpt-1b": (24, 2048, 16), "mpt-3b": (32, 2560, 20), "mpt-7b": (32, 4096, 32),
    "mpt-13b": (40, 5120, 40), "mpt-30b": (48, 7168, 56), "mpt-70b": (80, 8192, 64),
}  # fmt: skip
_FOUNDRY = (  # model, sequence, GPUs, micro-batch, accumulation, checkpointing, FSDP mode, tokens/s per GPU, MFU %
    ("mpt-70b", 2048, 512, 8, 1, "full", "fsdp", 1007, 41.25),  # large
    ("mpt-70b", 2048, 256, 8, 1, "full", "fsdp", 1035, 42.42),  # large
    ("mpt-70b", 2048, 128, 8, 1, "full", "fsdp", 1058, 43.36),  # large
    ("mpt-30b", 2048, 512, 8, 1, "full", "fsdp", 2115, 40.27),  # large
    ("mpt-30b", 2048, 256, 8, 1, "full", "fsdp", 2148, 40.89),  # large
    ("mpt-30b", 2048, 128, 8, 1, "full", "fsdp", 2199, 41.85),  # large
    ("mpt-13b", 2048, 512, 16, 1, "full", "fsdp", 4952, 41.12),  # large
    ("mpt-13b", 2048, 256, 16, 1, "full", "fsdp", 4989, 41.42),  # large
    ("mpt-13b", 2048, 128, 16, 1, "full", "fsdp", 5080, 42.18),  # large
    ("mpt-7b", 2048, 512, 6, 1, "none", "fsdp", 9670, 42.2),  # large
    ("mpt-7b", 2048, 256, 6, 1, "none", "fsdp", 10119, 44.15),  # large
    ("mpt-7b", 2048, 128, 6, 1, "none", "fsdp", 10475, 45.71),  # large
    ("mpt-3b", 2048, 512, 8, 1, "none", "fsdp_grad_op", 21664, 39.24),  # large
    ("mpt-3b", 2048, 256, 8, 1, "none", "fsdp_grad_op", 22772, 41.25),  # large
    ("mpt-3b", 2048, 128, 8, 1, "none", "fsdp_grad_op", 23422, 42.43),  # large
    ("mpt-1b", 2048, 512, 12, 1, "none", "fsdp_grad_op", 39837, 36.65),  # large
    ("mpt-1b", 2048, 256, 12, 1, "none", "fsdp_grad_op", 42555, 39.15),  # large
    ("mpt-1b", 2048, 128, 12, 1, "none", "fsdp_grad_op", 44123, 40.6),  # large
    ("mpt-70b", 2048, 64, 8, 4, "full", "fsdp", 1039, 42.57),  # bf16
    ("mpt-70b", 2048, 32, 2, 16, "full", "fsdp", 882, 36.15),  # bf16
    ("mpt-30b", 8192, 8, 1, 21, "full", "fsdp", 1384, 29.92),  # bf16
    ("mpt-30b", 4096, 8, 1, 21, "full", "fsdp", 1802, 35.86),  # bf16
    ("mpt-30b", 2048, 32, 14, 3, "full", "fsdp", 2308, 43.92),  # bf16
    ("mpt-30b", 2048, 16, 10, 3, "full", "fsdp", 2263, 43.07),  # bf16
    ("mpt-30b", 2048, 8, 3, 21, "full", "fsdp", 2002, 38.11),  # bf16
    ("mpt-30b", 1024, 8, 6, 21, "full", "fsdp", 2084, 38.76),  # bf16
    ("mpt-13b", 32768, 8, 1, 3, "full", "fsdp", 1976, 31.68),  # bf16
    ("mpt-13b", 16384, 8, 3, 3, "full", "fsdp", 2985, 35.55),  # bf16
    ("mpt-13b", 4096, 8, 10, 3, "full", "fsdp", 4717, 41.6),  # bf16
    ("mpt-13b", 2048, 64, 2, 1, "none", "fsdp", 4800, 39.86),  # bf16
    ("mpt-13b", 2048, 32, 2, 1, "none", "fsdp", 4811, 39.95),  # bf16
    ("mpt-13b", 2048, 16, 2, 1, "none", "fsdp", 4767, 39.58),  # bf16
    ("mpt-13b", 2048, 8, 2, 1, "none", "fsdp", 4792, 39.79),  # bf16
    ("mpt-13b", 1024, 8, 40, 3, "full", "fsdp", 5502, 44.27),  # bf16
    ("mpt-7b", 65536, 8, 1, 2, "full", "fsdp", 1956, 28.59),  # bf16
    ("mpt-7b", 32768, 8, 2, 2, "full", "fsdp", 3318, 30.94),  # bf16
    ("mpt-7b", 8192, 8, 8, 2, "full", "fsdp", 6935, 37.14),  # bf16
    ("mpt-7b", 4096, 8, 16, 2, "full", "fsdp", 8611, 40.42),  # bf16
    ("mpt-7b", 2048, 8, 6, 1, "none", "fsdp", 10643, 46.44),  # bf16
    ("mpt-7b", 1024, 8, 64, 2, "full", "fsdp", 10203, 42.83),  # bf16
    ("mpt-3b", 65536, 8, 1, 2, "full", "fsdp", 3262, 26.81),  # bf16
    ("mpt-3b", 32768, 8, 3, 6, "full", "fsdp", 5873, 28.84),  # bf16
    ("mpt-3b", 16384, 8, 1, 6, "none", "fsdp", 11152, 36.34),  # bf16
    ("mpt-3b", 8192, 8, 3, 6, "none", "fsdp", 16578, 40.31),  # bf16
    ("mpt-3b", 4096, 8, 5, 6, "none", "fsdp", 20964, 42.31),  # bf16
    ("mpt-3b", 2048, 64, 6, 3, "none", "fsdp", 22525, 40.8),  # bf16
    ("mpt-3b", 2048, 32, 6, 3, "none", "fsdp", 23021, 41.7),  # bf16
    ("mpt-3b", 2048, 16, 10, 3, "none", "fsdp", 24142, 43.73),  # bf16
    ("mpt-3b", 1024, 8, 20, 6, "none", "fsdp", 27046, 46.2),  # bf16
    ("mpt-3b", 512, 8, 40, 6, "none", "fsdp", 27965, 46.32),  # bf16
    ("mpt-1b", 65536, 8, 1, 2, "full", "fsdp", 5506, 26.34),  # bf16
    ("mpt-1b", 32768, 8, 1, 4, "none", "fsdp", 12025, 33.54),  # bf16
    ("mpt-1b", 16384, 8, 2, 4, "none", "fsdp", 19649, 35.22),  # bf16
    ("mpt-1b", 8192, 8, 3, 4, "none", "fsdp", 29157, 37.73),  # bf16
    ("mpt-1b", 4096, 8, 7, 4, "none", "fsdp", 38535, 40.26),  # bf16
    ("mpt-1b", 2048, 64, 20, 1, "none", "fsdp", 44402, 40.85),  # bf16
    ("mpt-1b", 2048, 32, 20, 1, "none", "fsdp", 45130, 41.52),  # bf16
    ("mpt-1b", 2048, 16, 20, 1, "none", "fsdp", 46037, 42.36),  # bf16
    ("mpt-1b", 2048, 8, 14, 1, "none", "fsdp", 45455, 41.82),  # bf16
    ("mpt-1b", 1024, 8, 18, 4, "none", "fsdp", 48910, 41.95),  # bf16
    ("mpt-1b", 512, 8, 56, 4, "none", "fsdp", 52275, 43.21),  # bf16
    ("mpt-760m", 32768, 8, 1, 2, "none", "fsdp", 16291, 31.84),  # bf16
    ("mpt-760m", 16384, 8, 3, 2, "none", "fsdp", 27815, 33.57),  # bf16
    ("mpt-760m", 8192, 8, 6, 2, "none", "fsdp", 41825, 34.84),  # bf16
    ("mpt-760m", 4096, 8, 12, 2, "none", "fsdp", 55459, 35.83),  # bf16
    ("mpt-760m", 2048, 32, 24, 1, "none", "fsdp", 67971, 37.57),  # bf16
    ("mpt-760m", 2048, 16, 24, 1, "none", "fsdp", 68551, 37.89),  # bf16
    ("mpt-760m", 2048, 8, 24, 2, "none", "fsdp", 63147, 34.9),  # bf16
    ("mpt-760m", 1024, 8, 48, 2, "none", "fsdp", 78581, 39.76),  # bf16
    ("mpt-760m", 512, 8, 96, 2, "none", "fsdp", 83749, 40.42),  # bf16
)
"""Every row of the two H100 80GB BF16 tables (``amp_bf16``, FSDP mixed precision ``DEFAULT``: fp32
parameters gathered, bf16 autocast); FULL_SHARD is ``fsdp``, SHARD_GRAD_OP ``fsdp_grad_op``;
activation checkpointing is full. Tokens/s per GPU as published."""


def _records() -> tuple[PublishedRecord, ...]:
    out = []
    for label, heads, hidden, layers, tp, pp, gpus, batch, micro, schedule, *seconds in _KORTHIKANTI:
        shape = _gpt(f"GPT-{label}", layers, hidden, heads, 51200, 2048)
        for experiment, time, ckpt, sp in zip(("full recompute", "present work"), seconds, ("full", "none"), (False, True)):
            out.append(PublishedRecord(_K22, f"{label} {experiment}", shape, gpus, tp, pp, batch, 2048,
                                       batch * 2048 / time / gpus, micro_batch=micro, checkpointing=ckpt,
                                       sequence_parallel=sp, schedules=(schedule,)))  # fmt: skip
    for label, heads, hidden, layers, tp, pp, gpus, batch, tflops in _MCORE:
        shape = _gpt(f"GPT-{label}", layers, hidden, heads, 131072, 4096)
        out.append(PublishedRecord("megatron_core_2024", label, shape, gpus, tp, pp, batch, 4096,
                                   tflops * 1e12 / shape.flops_per_token(4096), dp_mode="fsdp_grad_op", sequence_parallel=tp > 1,
                                   schedules=(("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4))))  # fmt: skip
    for model, seq, gpus, micro, accumulation, ckpt, mode, tokens, _mfu in _FOUNDRY:
        layers, hidden, heads = _FOUNDRY_SHAPES[model]
        out.append(PublishedRecord("llm_foundry_2024", f"{model} seq {seq} on {gpus}", _gpt(model, layers, hidden, heads, 50368, seq),
                                   gpus, 1, 1, micro * accumulation * gpus, seq, float(tokens), dp_mode=mode,
                                   micro_batch=micro, checkpointing=ckpt))  # fmt: skip
    return tuple(out)


RECORDS: tuple[PublishedRecord, ...] = _records()


def predict(record: PublishedRecord, efficiency: Efficiency | None = None) -> Estimate:
    """The planner's estimate of ``record``'s run: its layout as published, on its source's system (at
    ``efficiency`` instead, if given); what the source does not state (micro-batch, schedule among those
    it had, checkpointing) the planner's fastest that fits, or its fastest when none fits (a source whose
    optimizer shards what the planner's mode does not)."""
    source = SOURCES[record.source]
    per_node = min(8, record.gpus)
    node = replace(cluster(source.cluster, nodes=math.ceil(record.gpus / per_node), devices_per_node=per_node),
                   efficiency=efficiency or source.efficiency)  # fmt: skip
    precision = "16-mixed" if record.source == "korthikanti2022" else "bf16-mixed"
    workload = Workload(record.global_batch, record.seq_len, precision)
    options = [
        c for c in candidates(record.shape, workload, node, dp_modes=(record.dp_mode,), schedules=record.schedules,
                              checkpointing=(record.checkpointing,) if record.checkpointing else CHECKPOINTING,
                              sequence_parallel=record.sequence_parallel, max_micro_batch=record.micro_batch or 16)
        if (c.tp, c.pp) == (record.tp, record.pp) and record.micro_batch in (None, c.micro_batch)
    ]  # fmt: skip
    if not options:
        raise ValueError(f"{record.source} {record.label}: no candidate layout matches tp={record.tp}, pp={record.pp}.")
    estimates = [estimate(record.shape, workload, c, node) for c in options]
    return max([e for e in estimates if e.fits] or estimates, key=lambda e: e.tokens_per_sec)
