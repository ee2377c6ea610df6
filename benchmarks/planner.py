"""How right the planner is: its predictions against measurements, on this machine and published.

    python benchmarks/planner.py

- memory: one training step of the reference GPT in one process (GPT-2-like and Llama-like shapes;
  fp32 and bf16-mixed; no, full and selective activation checkpointing): the predicted peak
  against the peak of live tensors torch's ``MemTracker`` tracks on the same step
  (``memory_error_mean``/``_max``, relative);
- published: the achieved teraFLOP/s per GPU of every row of Narayanan et al. 2021, Table 1
  (Megatron-LM, 1.7B-1T parameters, up to 3,072 A100s) with the A100 preset's one set of constants
  (``published_error_mean``/``_max``), each row printed;
- search: every layout of a 70B Llama-shaped model on 1,024 H100s estimated and ranked
  (``search_seconds``, CPU time of this process, and ``search_layouts``).

Not measured yet, reported as null: multi-process memory (``memory_cases_multiprocess``), step time
after calibration on this machine (``time_error_mean``, ``spearman``) and ``strategy=auto``
(``auto_vs_best``); see issue 26's notes.

Prints ``BENCH planner {json}`` last and writes benchmarks/results/planner.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.planner import Candidate, Workload, cluster, model_shape, plan
from lightning_scale.core.planner.measure import tracked_peak
from lightning_scale.core.planner.memory import estimate_memory
from lightning_scale.core.planner.published import NARAYANAN_2021, megatron_flops_per_step
from lightning_scale.core.planner.search import candidates
from lightning_scale.core.planner.step_time import estimate_time
from lightning_scale.models import GPT, GPTConfig
from lightning_scale.models.parallel import language_model_loss

RESULTS = Path(__file__).resolve().parent / "results"

_GPT = GPTConfig()
_LLAMA_LIKE = GPTConfig(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, mlp="swiglu", positional="rope", norm="rmsnorm",
                        tie_embeddings=False, vocab_size=1000)  # fmt: skip
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

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = language_model_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return tracked_peak(step, model, optimizer)


def memory_errors(cases: list[str] | None = None) -> dict[str, float]:
    """Predicted over measured, minus one, per case of :data:`MEMORY_CASES` (one process, CPU)."""
    errors = {}
    for name in cases or MEMORY_CASES:
        config, batch, seq, checkpointing, precision = MEMORY_CASES[name]
        measured = measured_step_peak(config, batch, seq, checkpointing, precision)
        candidate = Candidate(1, 1, 1, micro_batch=batch, checkpointing=checkpointing, checkpoint_every=2)
        predicted = estimate_memory(model_shape(config), Workload(batch, seq, precision), candidate, foreach=False).total
        errors[name] = predicted / measured - 1
        print(f"memory {name}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB, error {errors[name]:+.3f}")
    return errors


def published_errors() -> list[float]:
    """Per row of Narayanan et al. 2021, Table 1: the published layout (tp, pp, GPUs, batch), the
    schedule Megatron had (1F1B or interleaved) and micro-batch the planner finds fastest, full
    recomputation, no sequence parallelism; predicted over published teraFLOP/s per GPU, minus one."""
    errors = []
    for run in NARAYANAN_2021:
        node = cluster("a100-sxm-80", nodes=run.gpus // 8)
        workload = Workload(run.global_batch, run.seq_len, "16-mixed")
        options = [c for c in candidates(run.shape, workload, node, dp_modes=("ddp",), checkpointing=("full",),
                                         schedules=(("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)),
                                         sequence_parallel=False, max_micro_batch=8)
                   if (c.tp, c.pp) == (run.tp, run.pp)]  # fmt: skip
        best = min((estimate_time(run.shape, workload, c, node) for c in options), key=lambda e: e.step_time)
        predicted = megatron_flops_per_step(run) / best.step_time / run.gpus / 1e12
        errors.append(predicted / run.tflops_per_gpu - 1)
        print(f"published {run.billions}B on {run.gpus} GPUs (tp={run.tp}, pp={run.pp}): predicted {predicted:.1f} "
              f"TFLOP/s per GPU, published {run.tflops_per_gpu}, error {errors[-1]:+.3f}")  # fmt: skip
    return errors


LLAMA_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip


def search() -> tuple[float, int]:
    start = time.process_time()
    ranked = plan(model_shape(LLAMA_70B, "Llama-70B"), Workload(1024, 4096, "bf16-mixed"), cluster("h100-sxm", nodes=128))
    return time.process_time() - start, len(ranked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "planner.json")
    parser.add_argument("--cases", default=",".join(MEMORY_CASES), help="memory cases, comma-separated (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.cases.split(",")) - set(MEMORY_CASES))
    if unknown:
        parser.error(f"unknown memory case(s) {unknown}; valid: {', '.join(MEMORY_CASES)}")
    memory = memory_errors(args.cases.split(","))
    published = published_errors()
    seconds, layouts = search()
    report: dict[str, Any] = {
        "memory_error_mean": statistics.fmean(abs(e) for e in memory.values()),
        "memory_error_max": max(abs(e) for e in memory.values()),
        "memory_cases": len(memory),
        "memory_cases_multiprocess": None,
        "time_error_mean": None,
        "spearman": None,
        "published_error_mean": statistics.fmean(abs(e) for e in published),
        "published_error_max": max(abs(e) for e in published),
        "auto_vs_best": None,
        "search_seconds": seconds,
        "search_layouts": layouts,
    }
    from _common import emit

    emit("planner", report, args.out)


if __name__ == "__main__":
    main()
