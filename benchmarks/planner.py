"""How right the planner is: its predictions against measurements, on this machine and published.

    python benchmarks/planner.py                        # every case; 2 and 4 gloo processes on CPU
    python benchmarks/planner.py --cases gpt-full-fp32,gpt/tp2 --time-steps 0

- memory, one process: one training step of the reference GPT (GPT-2-like and Llama-like shapes;
  fp32 and bf16-mixed; no, full and selective activation checkpointing), in Lightning's order (the
  last step's gradients freed between forward and backward): the predicted peak against the peak of
  live tensors torch's ``MemTracker`` tracks on the same step (:data:`MEMORY_CASES`);
- memory, several processes (``memory_cases_multiprocess``, :data:`MULTIPROCESS_CASES`): the second
  training step of ``HybridParallelStrategy`` in a Lightning ``Trainer`` on 2 or 4 gloo processes (ddp,
  fsdp, tp, pp under gpipe/1f1b/interleaved, dp x tp, tp x pp, dp x pp; with and without
  checkpointing; two GPT sizes and a Hugging Face Llama), each rank's peak against the planner's
  estimate for its pipeline rank. ``MemTracker`` counts a DTensor's local shard, and here every tensor
  the run holds at the step's start (:class:`~lightning_scale.core.planner.measure.StepTracker`).
  ``memory_error_mean``/``_max``: relative, over the one-process cases and every rank of the others
  (``memory_error_mean_multiprocess``/``_max_multiprocess``: the latter only);
- Narayanan: the achieved teraFLOP/s per GPU of every row of Narayanan et al. 2021, Table 1
  (Megatron-LM, 1.7B-1T parameters, up to 3,072 A100s) with the A100 Megatron constants, which were
  fitted on it (``narayanan_error_mean``/``_max``), each row printed;
- published: tokens/s per GPU of every record of three other sources
  (:data:`~lightning_scale.core.planner.published.RECORDS`: Korthikanti et al. 2022, Megatron-Core's
  weak scaling, llm-foundry's H100 tables; ``published_sources``), each row printed:
  ``published_error_mean``/``_max`` pooled over their rows, ``published_spearman_min`` (the lowest of the
  sources' rank correlations of predicted and published MFU), ``published_by_source``;
  ``fsdp_scaling_spread``: MPT-13B under FSDP on 8 to 64 H100s, predicted per-GPU throughput's largest
  over smallest minus one (published: flat);
- ``untested_ranked``: data-parallel modes (with and without a pipeline) and schedules the planner ranks
  that no memory case run here measures (``untested`` names them);
- search: every layout of a 70B Llama-shaped model on 1,024 H100s estimated and ranked
  (``search_seconds``, CPU time of this process, and ``search_layouts``).

- step time (``--time-steps``, 0 to skip; :mod:`planner_time`): 12 configurations of ``lightning-scale-train``
  on 2 and 4 processes, each run ``--time-repeats`` times round-robin (median), calibrated from three, the
  other nine predicted (``time_error_mean``/``_max``, ``spearman``), and ``strategy=auto`` on 4 processes
  against the best of them (``auto_vs_best``).

Prints ``BENCH planner {json}`` last and writes benchmarks/results/planner.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.planner import Candidate, Workload, cluster, model_shape, plan
from lightning_scale.core.planner.cluster import A100_MEGATRON
from lightning_scale.core.planner.layout import DP_MODES
from lightning_scale.core.planner.measure import StepTracker, tracked_peak
from lightning_scale.core.planner.memory import estimate_memory
from lightning_scale.core.planner.published import NARAYANAN_2021, RECORDS, megatron_flops_per_step, predict
from lightning_scale.core.planner.search import PIPELINE_SCHEDULES, candidates
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule
from lightning_scale.models.parallel import language_model_loss
from lightning_scale.strategies import HybridParallelStrategy

RESULTS = Path(__file__).resolve().parent / "results"

_GPT = GPTConfig()
_LLAMA_LIKE = GPTConfig(
    n_layers=4,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    mlp="swiglu",
    positional="rope",
    norm="rmsnorm",
    tie_embeddings=False,
    vocab_size=1000,
)
MEMORY_CASES: dict[str, tuple[GPTConfig, int, int, str, str]] = {
    "gpt-none-fp32": (_GPT, 8, 256, "none", "32-true"),
    "gpt-full-fp32": (_GPT, 8, 256, "full", "32-true"),
    "gpt-selective-fp32": (_GPT, 8, 256, "selective", "32-true"),
    "gpt-none-bf16": (_GPT, 8, 256, "none", "bf16-mixed"),
    "llama-like-none-fp32": (_LLAMA_LIKE, 4, 128, "none", "32-true"),
    "llama-like-full-bf16": (_LLAMA_LIKE, 4, 128, "full", "bf16-mixed"),
}
"""(model, micro-batch, sequence length, activation checkpointing, precision) per case."""


def measured_step_peak(config: GPTConfig, batch: int, seq: int, checkpointing: str, precision: str) -> int:
    """Peak bytes of live tensors over one training step after the first (AdamW's state exists)."""
    torch.manual_seed(0)
    model = GPT(config)
    apply_activation_checkpointing(list(model.blocks.values()), checkpointing, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (torch.randint(0, config.vocab_size, (batch, seq)) for _ in range(2))

    def step() -> None:  # in Lightning's order: the last step's gradients are freed after the forward
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = language_model_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()
    return tracked_peak(step, model, optimizer)


def memory_errors(cases: list[str] | None = None) -> dict[str, float]:
    """Predicted over measured, minus one, per case of :data:`MEMORY_CASES` (one process, CPU)."""
    errors = {}
    for name in cases or MEMORY_CASES:
        config, batch, seq, checkpointing, precision = MEMORY_CASES[name]
        measured = measured_step_peak(config, batch, seq, checkpointing, precision)
        candidate = Candidate(1, 1, 1, micro_batch=batch, checkpointing=checkpointing, checkpoint_every=2)
        predicted = estimate_memory(
            model_shape(config), Workload(batch, seq, precision), candidate, foreach=False
        ).total
        errors[name] = _report(name, measured, predicted)
    return errors


# ------------------------------------------------------------------------------ multi-process memory

_GPT_SMALL = GPTConfig(n_layers=4, d_model=128, n_heads=4, block_size=64, vocab_size=256)
_GPT_WIDE = GPTConfig(
    n_layers=4,
    d_model=192,
    n_heads=4,
    n_kv_heads=2,
    mlp="swiglu",
    positional="rope",
    norm="rmsnorm",
    tie_embeddings=False,
    vocab_size=512,
    block_size=64,
)
HF_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
"""A Hugging Face ``LlamaConfig``'s fields (random weights; nothing is downloaded)."""
MODELS: dict[str, Any] = {"gpt": _GPT_SMALL, "gpt-wide": _GPT_WIDE, "hf-llama": HF_LLAMA}

_FP32 = Workload(8, 64, "32-true")
_BF16 = Workload(8, 64, "bf16-mixed")
MULTIPROCESS_CASES: dict[str, tuple[str, Workload, Candidate]] = {
    "gpt/ddp2": ("gpt", _FP32, Candidate(2, 1, 1, micro_batch=4)),
    "gpt/fsdp2": ("gpt", _FP32, Candidate(2, 1, 1, "fsdp", micro_batch=4)),
    "gpt/fsdp2-ac": ("gpt", _FP32, Candidate(2, 1, 1, "fsdp", micro_batch=4, checkpointing="full")),
    "gpt/tp2": ("gpt", _FP32, Candidate(1, 2, 1, micro_batch=8, sequence_parallel=True)),
    "gpt/tp2-ac": ("gpt", _FP32, Candidate(1, 2, 1, micro_batch=8, sequence_parallel=True, checkpointing="full")),
    "gpt/pp2-gpipe": ("gpt", _FP32, Candidate(1, 1, 2, schedule="gpipe", micro_batch=2)),
    "gpt/pp2-1f1b": ("gpt", _FP32, Candidate(1, 1, 2, schedule="1f1b", micro_batch=2)),
    "gpt/pp2-1f1b-ac": ("gpt", _FP32, Candidate(1, 1, 2, schedule="1f1b", micro_batch=2, checkpointing="full")),
    "gpt/pp2-interleaved": (
        "gpt",
        _FP32,
        Candidate(1, 1, 2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch=2),
    ),
    "gpt-wide/ddp2-ac": ("gpt-wide", _FP32, Candidate(2, 1, 1, micro_batch=4, checkpointing="selective")),
    "gpt-wide/tp2-nosp": ("gpt-wide", _FP32, Candidate(1, 2, 1, micro_batch=8)),
    "gpt-wide/pp2-interleaved-ac": (
        "gpt-wide",
        _FP32,
        Candidate(1, 1, 2, schedule="interleaved_1f1b", virtual_stages=2, micro_batch=2, checkpointing="full"),
    ),
    "hf-llama/fsdp2": ("hf-llama", _FP32, Candidate(2, 1, 1, "fsdp", micro_batch=4)),
    "hf-llama/pp2-1f1b": ("hf-llama", _FP32, Candidate(1, 1, 2, schedule="1f1b", micro_batch=2)),
    "gpt/dp2-tp2": ("gpt", _FP32, Candidate(2, 2, 1, micro_batch=4, sequence_parallel=True)),
    "gpt/tp2-pp2": ("gpt", _FP32, Candidate(1, 2, 2, micro_batch=2, sequence_parallel=True)),
    "gpt-wide/dp2-tp2-ac": (
        "gpt-wide",
        _FP32,
        Candidate(2, 2, 1, "fsdp", micro_batch=4, sequence_parallel=True, checkpointing="full"),
    ),
    "hf-llama/dp2-pp2": ("hf-llama", _FP32, Candidate(2, 1, 2, "fsdp", schedule="1f1b", micro_batch=2)),
    "gpt/ddp2-bf16": ("gpt", _BF16, Candidate(2, 1, 1, micro_batch=4)),
    "gpt/fsdp2-bf16": ("gpt", _BF16, Candidate(2, 1, 1, "fsdp", micro_batch=4)),
    "gpt/fsdp2-ac-bf16": ("gpt", _BF16, Candidate(2, 1, 1, "fsdp", micro_batch=4, checkpointing="full")),
    "hf-llama/fsdp2-bf16": ("hf-llama", _BF16, Candidate(2, 1, 1, "fsdp", micro_batch=4)),
    "gpt/fsdp_grad_op2-bf16": ("gpt", _BF16, Candidate(2, 1, 1, "fsdp_grad_op", micro_batch=4)),
    "gpt/hsdp4-bf16": ("gpt", _BF16, Candidate(4, 1, 1, "hsdp", micro_batch=2, hsdp_shard=2)),
    "hf-llama/hsdp4": ("hf-llama", _FP32, Candidate(4, 1, 1, "hsdp", micro_batch=2, hsdp_shard=2)),
    "gpt/fsdp_grad_op2-pp2-bf16": ("gpt", _BF16, Candidate(2, 1, 2, "fsdp_grad_op", schedule="1f1b", micro_batch=2)),
    "hf-llama/fsdp2-pp2-bf16": ("hf-llama", _BF16, Candidate(2, 1, 2, "fsdp", schedule="1f1b", micro_batch=2)),
    "gpt-wide/fsdp2-tp2-bf16": ("gpt-wide", _BF16, Candidate(2, 2, 1, "fsdp", micro_batch=4, sequence_parallel=True)),
    "gpt/hsdp4-pp2-bf16": (
        "gpt",
        Workload(16, 64, "bf16-mixed"),
        Candidate(4, 1, 2, "hsdp", schedule="gpipe", micro_batch=2, hsdp_shard=2),
    ),
}
"""(model of :data:`MODELS`, workload, layout) per case, run by ``HybridParallelStrategy`` on
``candidate.world_size`` gloo processes."""


class _HFLlama(LightningModule):
    """A transformers ``LlamaForCausalLM`` as a user wraps one (the strategy finds its plan and stages)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(**config))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return language_model_loss(self.model(input_ids=inputs).logits, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepPeak(Callback):
    """The peak bytes of live tensors over training step ``step`` (0-based), counting every tensor the
    run holds at its start (:class:`StepTracker`). The second by default: the optimizer state exists,
    and DDP rebuilds its gradient buckets at its start, where the tracker sees them (in C++ from then
    on, a later step would miss them)."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.tracker: StepTracker | None = None
        self._running = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.tracker is None:
            self.tracker = StepTracker(trainer.strategy.model, *trainer.optimizers, alive=True)
            self.tracker.start()
            self._running = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._running and self.tracker is not None:
            self.tracker.stop()
            self._running = False


def _rank_step_peak(model: str, workload: Workload, candidate: Candidate) -> dict[str, int]:
    """In one rank of ``candidate.world_size``: two training steps of ``model`` under
    ``HybridParallelStrategy`` at ``candidate``'s layout; the second step's peak and this rank's
    pipeline rank."""
    seed_everything(0, verbose=False)
    c, config = candidate, MODELS[model]
    vocab = config.vocab_size if isinstance(config, GPTConfig) else config["vocab_size"]
    tokens = torch.randint(
        0, vocab, (2 * workload.global_batch, workload.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=workload.global_batch // c.dp)
    strategy = HybridParallelStrategy(
        data_parallel=c.dp,
        tensor_parallel=c.tp,
        pipeline_parallel=c.pp,
        data_parallel_mode=c.dp_mode,
        schedule=c.schedule,
        virtual_stages=c.virtual_stages,
        microbatches=c.microbatches(workload) if c.pp > 1 else None,
        activation_checkpointing=c.checkpointing,
        activation_checkpointing_every=c.checkpoint_every,
        sequence_parallel=c.sequence_parallel,
    )
    peak = StepPeak()
    trainer = Trainer(
        accelerator="cpu",
        devices=c.world_size,
        strategy=strategy,
        max_steps=2,
        precision=workload.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[peak],
    )
    module = GPTLightningModule(config, warmup_steps=0) if isinstance(config, GPTConfig) else _HFLlama(config)
    trainer.fit(module, train_dataloaders=loader)
    if peak.tracker is None:
        raise RuntimeError(f"{model} at {c.name}: the run ended before its second step")
    return {"peak": peak.tracker.peak, "pipeline_rank": strategy.device_mesh["pp"].get_local_rank()}


def multiprocess_peaks(rank: int, world: int, names: list[str]) -> dict[str, dict[str, int]]:
    """In each of ``world`` ranks, the process group joined: :func:`_rank_step_peak` of each case named
    (all of ``world`` processes), one after the other."""
    return {name: _rank_step_peak(*MULTIPROCESS_CASES[name]) for name in names}


def multiprocess_errors(peaks: list[dict[str, dict[str, int]]]) -> dict[str, float]:
    """Predicted over measured, minus one, per case and rank, from every rank's :func:`multiprocess_peaks`
    (in rank order): the planner's estimate for the rank's pipeline stage."""
    errors = {}
    for name in peaks[0]:
        model, workload, candidate = MULTIPROCESS_CASES[name]
        for rank, measured in enumerate(p[name] for p in peaks):
            estimate = estimate_memory(
                model_shape(MODELS[model]), workload, candidate, foreach=False, pipeline_rank=measured["pipeline_rank"]
            )
            errors[f"{name} rank {rank}"] = _report(f"{name} rank {rank}", measured["peak"], estimate.total)
    return errors


def _report(case: str, measured: float, predicted: float) -> float:
    """Print a case's measured and predicted peak; return the relative error."""
    error = predicted / measured - 1
    print(
        f"memory {case}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB, error {error:+.3f}"
    )
    return error


def _multiprocess_worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    from _common import join_process_group

    join_process_group(rank, world, port)
    peaks = multiprocess_peaks(rank, world, args.names)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def published_errors() -> list[float]:
    """Per row of Narayanan et al. 2021, Table 1: the published layout (tp, pp, GPUs, batch), the
    schedule Megatron had (1F1B or interleaved) and micro-batch the planner finds fastest, full
    recomputation, no sequence parallelism; predicted over published teraFLOP/s per GPU, minus one."""
    errors = []
    for run in NARAYANAN_2021:
        node = dataclasses.replace(
            cluster("a100-sxm-80", nodes=run.gpus // 8), efficiency=A100_MEGATRON
        )  # no fused attention in 2021
        workload = Workload(run.global_batch, run.seq_len, "16-mixed")
        options = [
            c
            for c in candidates(
                run.shape,
                workload,
                node,
                dp_modes=("ddp",),
                checkpointing=("full",),
                schedules=(("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)),
                sequence_parallel=False,
                max_micro_batch=8,
                context_parallel=(1,),
                float8=(False,),
            )
            if (c.tp, c.pp) == (run.tp, run.pp)
        ]
        best = min((estimate_time(run.shape, workload, c, node) for c in options), key=lambda e: e.step_time)
        predicted = megatron_flops_per_step(run) / best.step_time / run.gpus / 1e12
        errors.append(predicted / run.tflops_per_gpu - 1)
        print(
            f"published {run.billions}B on {run.gpus} GPUs (tp={run.tp}, pp={run.pp}): predicted {predicted:.1f} "
            f"TFLOP/s per GPU, published {run.tflops_per_gpu}, error {errors[-1]:+.3f}"
        )
    return errors


def published_sources() -> dict[str, Any]:
    """Every record of :data:`~lightning_scale.core.planner.published.RECORDS` (three sources besides
    Narayanan's, none of them fitted but the H100 GEMM rate on ``megatron_core_2024``): predicted over
    published tokens/s per GPU, minus one, printed per row; per source the mean and largest error and the
    Spearman correlation of predicted and published MFU (``6 N + 12 L H Q T`` per token, both)."""
    from planner_time import _spearman

    by_source: dict[str, list[tuple[float, float, float]]] = {}
    for record in RECORDS:
        predicted = predict(record).tokens_per_sec / record.gpus
        error = predicted / record.tokens_per_sec_per_gpu - 1
        flops = record.shape.flops_per_token(record.seq_len)
        by_source.setdefault(record.source, []).append(
            (error, predicted * flops, record.tokens_per_sec_per_gpu * flops)
        )
        print(
            f"published {record.source} {record.label}: predicted {predicted:,.1f} tokens/s per GPU, published "
            f"{record.tokens_per_sec_per_gpu:,.1f}, error {error:+.3f}"
        )
    report = {
        name: {
            "rows": len(rows),
            "error_mean": statistics.fmean(abs(r[0]) for r in rows),
            "error_max": max(abs(r[0]) for r in rows),
            "error_signed_mean": statistics.fmean(r[0] for r in rows),
            "spearman": _spearman([r[1] for r in rows], [r[2] for r in rows]),
        }
        for name, rows in by_source.items()
    }
    every = [abs(r[0]) for rows in by_source.values() for r in rows]
    return {
        "published_sources": sorted(report),
        "published_error_mean": statistics.fmean(every),
        "published_error_max": max(every),
        "published_spearman_min": min(r["spearman"] for r in report.values()),
        "published_by_source": report,
    }


def fsdp_scaling_spread() -> float:
    """llm-foundry's MPT-13B at sequence 2,048, micro-batch 2, FULL_SHARD on 8, 16, 32 and 64 H100s (4,792, 4,767,
    4,811 and 4,800 tokens/s per GPU published): the predicted tokens/s per GPU's largest over smallest, minus one
    (a planner that timed inter-node collectives over one NIC predicted a 7x fall from 8 to 16)."""
    rows = [r for r in RECORDS if r.label in {f"mpt-13b seq 2048 on {n}" for n in (8, 16, 32, 64)}]
    rates = [predict(r).tokens_per_sec / r.gpus for r in rows]
    print(
        "fsdp scaling, MPT-13B on 8/16/32/64 H100s: predicted tokens/s per GPU " + ", ".join(f"{x:,.0f}" for x in rates)
    )
    return max(rates) / min(rates) - 1


def untested_ranked(cases: list[str]) -> list[str]:
    """What the planner ranks by default and none of the measured ``cases`` exercises: each data-parallel
    mode without and with a pipeline, and each pipeline schedule (:data:`PIPELINE_SCHEDULES`)."""
    measured = [MULTIPROCESS_CASES[n][2] for n in cases if n in MULTIPROCESS_CASES]
    if any(n in MEMORY_CASES for n in cases):
        measured.append(Candidate(1, 1, 1))
    wanted = {f"{mode} pp{'>1' if piped else '=1'}" for mode in DP_MODES for piped in (False, True)}
    wanted |= {f"schedule {schedule}" for schedule, _ in PIPELINE_SCHEDULES}
    seen = {f"{c.dp_mode} pp{'>1' if c.pp > 1 else '=1'}" for c in measured if c.dp > 1 or c.dp_mode == "ddp"}
    seen |= {f"schedule {c.schedule}" for c in measured if c.pp > 1}
    return sorted(wanted - seen)


LLAMA_70B = {
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def search() -> tuple[float, int]:
    start = time.process_time()
    ranked = plan(
        model_shape(LLAMA_70B, "Llama-70B"), Workload(1024, 4096, "bf16-mixed"), cluster("h100-sxm", nodes=128)
    )
    return time.process_time() - start, len(ranked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "planner.json")
    every = [*MEMORY_CASES, *MULTIPROCESS_CASES]
    parser.add_argument("--cases", default=",".join(every), help="memory cases, comma-separated (default: all)")
    parser.add_argument(
        "--time-steps",
        type=int,
        default=40,
        help="steps of each run of the step-time study (benchmarks/planner_time.py); 0: skip it",
    )
    parser.add_argument("--time-workdir", type=Path, default=None, help="keep (and reuse) the study's runs here")
    parser.add_argument(
        "--time-repeats", type=int, default=3, help="runs of each configuration of the study, round-robin"
    )
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = sorted(set(names) - set(every))
    if unknown:
        parser.error(f"unknown memory case(s) {unknown}; valid: {', '.join(every)}")
    memory = memory_errors([n for n in names if n in MEMORY_CASES]) if set(names) & set(MEMORY_CASES) else {}
    multiprocess: dict[str, float] = {}
    for world in (2, 4, 8):  # one start of the processes per world size, its cases in sequence
        chosen = [n for n in names if n in MULTIPROCESS_CASES and MULTIPROCESS_CASES[n][2].world_size == world]
        if chosen:
            from _common import run_workers

            multiprocess |= multiprocess_errors(
                run_workers(_multiprocess_worker, world, argparse.Namespace(names=chosen))
            )
    published = published_errors()
    others = published_sources()
    scaling = fsdp_scaling_spread()
    untested = untested_ranked(names)
    seconds, layouts = search()
    every_error = [abs(e) for e in (*memory.values(), *multiprocess.values())]
    timed: dict[str, Any] = {}
    if args.time_steps:
        import tempfile

        from planner_time import time_study

        workdir = args.time_workdir or Path(tempfile.mkdtemp(prefix="planner-time-"))
        workdir.mkdir(parents=True, exist_ok=True)
        timed = time_study(workdir, args.time_steps, repeats=args.time_repeats)
    report: dict[str, Any] = {
        "memory_error_mean": statistics.fmean(every_error) if every_error else None,
        "memory_error_max": max(every_error) if every_error else None,
        "memory_cases": len(memory),
        "memory_cases_multiprocess": len({key.rsplit(" rank ", 1)[0] for key in multiprocess}),
        "memory_error_mean_multiprocess": statistics.fmean(abs(e) for e in multiprocess.values())
        if multiprocess
        else None,
        "memory_error_max_multiprocess": max(abs(e) for e in multiprocess.values()) if multiprocess else None,
        "time_error_mean": timed.get("time_error_mean"),
        "time_error_max": timed.get("time_error_max"),
        "time_cases": timed.get("time_cases"),
        "spearman": timed.get("spearman"),
        "narayanan_error_mean": statistics.fmean(abs(e) for e in published),
        "narayanan_error_max": max(abs(e) for e in published),
        **others,
        "fsdp_scaling_spread": scaling,
        "untested_ranked": len(untested),
        "untested": untested,
        "auto_vs_best": timed.get("auto_vs_best"),
        "auto_layout": timed.get("auto_layout"),
        "search_seconds": seconds,
        "search_layouts": layouts,
    }
    from _common import emit

    emit("planner", report, args.out)


if __name__ == "__main__":
    main()
