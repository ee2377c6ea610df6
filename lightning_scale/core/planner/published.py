"""Published step-time measurements the planner is checked against. No Lightning.

:data:`RECORDS` holds the runs of four other sources, each row copied as published (``benchmarks/README.md``
says which tables and why; ``benchmarks/planner.py`` prints every row's prediction), and :data:`SOURCES`
what each source's software did that the planner's system constants must be told (a kernel it had or
lacked), never a number fitted to it:

- ``korthikanti2022``: Table 3 (layouts) and Table 5 (iteration times) of Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models" (MLSys 2023, https://arxiv.org/abs/2205.05198):
  GPT models of 22B to 1T parameters on 8 to 512 A100 80GB GPUs of Selene, Megatron-LM, full
  recomputation against sequence parallelism with selective recomputation;
- ``megatron_core_2024``: the weak-scaling table of NVIDIA/Megatron-LM's README (``images/model_table.png``
  at core_r0.8.0, 2024-07): GPT models of 1.7B to 462B parameters on 48 to 6,144 H100 GPUs;
- ``torchtitan_2024``: Tables 1-6 of pytorch/torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``:
  Llama 3.1 8B, 70B and 405B on 8 to 512 H100s (96 GB HBM2e parts at 500 W) with FSDP2, tensor, pipeline
  and context parallelism, float8 linears and ``torch.compile``;
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

from lightning_scale.core.planner.cluster import A100_MEGATRON, DEVICES, HOPPER, Device, Efficiency, cluster
from lightning_scale.core.planner.layout import CHECKPOINTING, Workload
from lightning_scale.core.planner.published_tables import (
    FOUNDRY,
    FOUNDRY_FP8,
    FOUNDRY_SHAPES,
    KORTHIKANTI,
    LLAMA3,
    MCORE,
    TORCHTITAN,
)
from lightning_scale.core.planner.search import Estimate, candidates, estimate
from lightning_scale.core.planner.shape import ModelShape

__all__ = [
    "NARAYANAN_2021",
    "RECORDS",
    "SOURCES",
    "PublishedRecord",
    "PublishedRun",
    "PublishedSource",
    "megatron_flops_per_step",
    "predict",
]

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
            n_layers=self.layers,
            d_model=self.hidden,
            n_heads=self.heads,
            n_kv_heads=self.heads,
            head_dim=self.hidden // self.heads,
            d_ff=4 * self.hidden,
            vocab_size=self.vocab,
            tied=True,
            bias=True,
            learned_positions=self.seq_len,
            layernorm=True,
            name=f"GPT-{self.billions}B",
        )

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
    device: Device | None = None
    """The source's GPU where it is not the preset's own."""


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
    cp: int = 1
    float8: bool = False
    elementwise: float | None = None
    """The run's own elementwise traffic factor (``torch.compile``: :data:`COMPILED`); None: its source's."""
    tp_overlap: bool = False
    """Tensor-parallel communication overlapped (async TP): at the source's ``dp_overlap``."""


MEGATRON_LOSS_TRAFFIC = 54 / 34
"""Megatron-Core's loss against eager PyTorch's, in bytes moved per logit at bf16: its vocabulary-parallel
cross entropy runs unfused unless ``cross_entropy_loss_fusion`` is set (``ModelParallelConfig``'s default is
False): the logits written (2), cast to fp32 (6), their maximum (4), subtracted (8), exponentiated (8), summed
(4) and divided (8) in place; backward, multiplied by the loss's gradient (8) and cast back (6): 54, where
eager's fused log-softmax moves 34 (:meth:`~lightning_scale.core.planner.shape.ModelShape.loss_bytes_per_token`)."""

SOURCES: dict[str, PublishedSource] = {
    s.name: s
    for s in (
        PublishedSource(
            "korthikanti2022",
            "a100-sxm-80",
            A100_MEGATRON,
            "Korthikanti et al. 2022, Tables 3 and 5 (https://arxiv.org/abs/2205.05198); Megatron-LM's "
            "own kernels (no fused attention: the A100 constants fitted on Narayanan et al. 2021, unchanged)",
        ),
        PublishedSource(
            "megatron_core_2024",
            "h100-sxm",
            replace(
                HOPPER,
                elementwise=0.5,
                loss_traffic=MEGATRON_LOSS_TRAFFIC,
                tp_overlap=HOPPER.dp_overlap,
                source=HOPPER.source + "; Transformer Engine's fused kernels: half of eager's elementwise "
                "traffic (norms fused into the next linear, bias-GeLU and bias-dropout-add fused); "
                "tensor-parallel communication overlapped with the GEMMs (--tp-comm-overlap) as much as "
                "data-parallel (--overlap-grad-reduce, --overlap-param-gather)",
            ),
            "NVIDIA/Megatron-LM README, weak scaling (images/model_table.png at core_r0.8.0)",
        ),
        PublishedSource(
            "llm_foundry_2024",
            "h100-sxm",
            replace(
                HOPPER,
                attention=HOPPER.attention / 2.5,
                source=HOPPER.source + "; llm-foundry's Triton FlashAttention (attn_impl 'triton', its "
                "default in v0.3.0), at FlashAttention-2's rate / 2.5 (Dao 2023: FlashAttention-2 is "
                "1.3-2.5x faster than the Triton FlashAttention)",
            ),
            "mosaicml/llm-foundry scripts/train/benchmarking/README.md at 4952183 (H100 80GB BF16 tables); "
            "eager PyTorch under FSDP",
        ),
        PublishedSource(
            "torchtitan_2024",
            "h100-sxm",
            HOPPER,
            "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e, first in "
            "docs/performance.md at d4c86e3): Llama 3.1 8B, 70B and 405B on 8 to 512 H100s; FSDP2, TP, "
            "PP, CP, float8 (torchao), torch.compile, async TP",
            replace(
                DEVICES["H100 SXM 80GB"],
                name="H100 SXM 96GB HBM2e (500 W)",
                chip="H100 NVL",
                memory=89.4 * 2**30,
                memory_bandwidth=2.4e12,
                source="torchtitan's footnote: 'HBM2e-based SXM H100 with lower TDP, the actual peak "
                "TFLOPs number is between SXM and NVL' (planned at the NVL column); 96 GB HBM2e at "
                "2.4 TB/s; 8 per host, 400 Gb/s RDMA per GPU",
            ),
        ),
    )
}

COMPILED = 0.72
"""The eager elementwise traffic ``torch.compile`` leaves a Llama block, counted per token for Llama 3 8B:
the residual add fused into the next norm (``8 d`` of ``10 d``), rotary embeddings into the head-major
copies (``2 (H + K) Q`` of ``5 (H + K) Q``), SiLU and the product into one kernel (``3 F`` of ``5 F``):
106,496 of 148,480 elements."""


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> ModelShape:
    """A GPT of Megatron's or MPT's kind: 4x MLP, biases, LayerNorm, tied embedding, learned positions."""
    return ModelShape(
        n_layers=layers,
        d_model=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=hidden // heads,
        d_ff=4 * hidden,
        vocab_size=vocab,
        tied=True,
        bias=True,
        learned_positions=positions,
        layernorm=True,
        name=name,
    )


def _records() -> tuple[PublishedRecord, ...]:
    out = []
    for label, heads, hidden, layers, tp, pp, gpus, batch, micro, schedule, *seconds in KORTHIKANTI:
        shape = _gpt(f"GPT-{label}", layers, hidden, heads, 51200, 2048)
        for experiment, time, ckpt, sp in zip(
            ("full recompute", "present work"), seconds, ("full", "none"), (False, True)
        ):
            out.append(
                PublishedRecord(
                    "korthikanti2022",
                    f"{label} {experiment}",
                    shape,
                    gpus,
                    tp,
                    pp,
                    batch,
                    2048,
                    batch * 2048 / time / gpus,
                    micro_batch=micro,
                    checkpointing=ckpt,
                    sequence_parallel=sp,
                    schedules=(schedule,),
                )
            )
    for label, heads, hidden, layers, tp, pp, gpus, batch, tflops in MCORE:
        shape = _gpt(f"GPT-{label}", layers, hidden, heads, 131072, 4096)
        out.append(
            PublishedRecord(
                "megatron_core_2024",
                label,
                shape,
                gpus,
                tp,
                pp,
                batch,
                4096,
                tflops * 1e12 / shape.flops_per_token(4096),
                dp_mode="fsdp_grad_op",
                checkpointing="none",  # Megatron-Core's default: recompute_granularity None
                sequence_parallel=tp > 1,
                schedules=(
                    ("1f1b", 1),
                    *(
                        ("interleaved_1f1b", v)
                        for v in range(2, layers // pp + 1)
                        if (layers // pp) % v == 0 and layers % pp == 0
                    ),
                ),
            )
        )
    for i, (model, seq, gpus, micro, accumulation, ckpt, mode, tokens, _mfu) in enumerate(FOUNDRY):
        layers, hidden, heads = FOUNDRY_SHAPES[model]
        fp8 = i >= len(FOUNDRY) - FOUNDRY_FP8
        out.append(
            PublishedRecord(
                "llm_foundry_2024",
                f"{model} seq {seq} on {gpus}" + (" fp8" if fp8 else ""),
                _gpt(model, layers, hidden, heads, 50368, seq),
                gpus,
                1,
                1,
                micro * accumulation * gpus,
                seq,
                float(tokens),
                dp_mode=mode,
                micro_batch=micro,
                checkpointing=ckpt,
                float8=fp8,
            )
        )
    return tuple(out)


def _torchtitan_records() -> tuple[PublishedRecord, ...]:
    out = []
    for model, gpus, fsdp, tp, pp, cp, local, seq, compiled, fp8, ckpt, async_tp, schedule, tokens, table in TORCHTITAN:
        layers, hidden, heads, kv, ffn = LLAMA3[model]
        shape = ModelShape(
            n_layers=layers,
            d_model=hidden,
            n_heads=heads,
            n_kv_heads=kv,
            head_dim=hidden // heads,
            d_ff=ffn,
            vocab_size=128256,
            gated_mlp=True,
            tied=False,
            layernorm=False,
            name=f"Llama-3.1-{model}",
        )
        stack = ("compile" if compiled else "eager") + (" float8" if fp8 else "") + (" async-TP" if async_tp else "")
        out.append(
            PublishedRecord(
                "torchtitan_2024",
                f"{model} table {table} fsdp{fsdp} tp{tp} pp{pp} cp{cp} seq {seq} {stack}",
                shape,
                gpus,
                tp,
                pp,
                local * fsdp,
                seq,
                float(tokens),
                dp_mode="fsdp",
                micro_batch=local // pp,
                checkpointing=ckpt,
                sequence_parallel=tp > 1,
                schedules=(schedule,) if schedule else (("1f1b", 1),),
                cp=cp,
                float8=fp8,
                elementwise=COMPILED if compiled else 1.0,
                tp_overlap=async_tp,
            )
        )
    return tuple(out)


RECORDS: tuple[PublishedRecord, ...] = _records() + _torchtitan_records()


def predict(record: PublishedRecord, efficiency: Efficiency | None = None) -> Estimate:
    """The planner's estimate of ``record``'s run: its layout as published, on its source's system (at
    ``efficiency`` instead, if given); what the source does not state (micro-batch, schedule among those
    it had, checkpointing) the planner's fastest that fits, or its fastest when none fits (a source whose
    optimizer shards what the planner's mode does not)."""
    source = SOURCES[record.source]
    per_node = min(8, record.gpus)
    eff = efficiency or source.efficiency
    if record.elementwise is not None:
        eff = replace(eff, elementwise=record.elementwise)
    if record.tp_overlap:
        eff = replace(eff, tp_overlap=eff.dp_overlap)
    node = replace(
        cluster(source.cluster, nodes=math.ceil(record.gpus / per_node), devices_per_node=per_node), efficiency=eff
    )
    if source.device is not None:
        node = replace(node, device=source.device)
    precision = "16-mixed" if record.source == "korthikanti2022" else "bf16-mixed"
    workload = Workload(record.global_batch, record.seq_len, precision)
    options = [
        c
        for c in candidates(
            record.shape,
            workload,
            node,
            dp_modes=(record.dp_mode,),
            schedules=record.schedules,
            checkpointing=(record.checkpointing,) if record.checkpointing else CHECKPOINTING,
            sequence_parallel=record.sequence_parallel,
            max_micro_batch=record.micro_batch or 16,
            context_parallel=(record.cp,),
            float8=(record.float8,),
        )
        if (c.tp, c.pp) == (record.tp, record.pp) and record.micro_batch in (None, c.micro_batch)
    ]
    if not options:
        raise ValueError(f"{record.source} {record.label}: no candidate layout matches tp={record.tp}, pp={record.pp}.")
    estimates = [estimate(record.shape, workload, c, node) for c in options]
    return max([e for e in estimates if e.fits] or estimates, key=lambda e: e.tokens_per_sec)
