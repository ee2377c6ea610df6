"""Every admissible layout of a model on a cluster, estimated and ranked. No Lightning.

:func:`candidates` enumerates data x tensor x pipeline sizes that multiply to the world size (tensor
parallel within a node, dividing the heads, key/value heads and MLP width; pipeline no deeper than
the blocks; never a layout the strategy refuses, such as a V-shaped schedule over a tied embedding
under data parallelism), each data-parallel mode, pipeline schedule (with its virtual stages), micro-batch size
and activation checkpointing, and the planned-only dimensions (context parallel sizes, float8 linears:
:attr:`~lightning_scale.core.planner.layout.Candidate.trainable`); gradient accumulation (or pipeline
micro-batches) keeps the global batch. :func:`plan` estimates each (:mod:`.memory`, :mod:`.step_time`) and ranks those that fit first,
fastest first. Only what ``benchmarks/planner.py`` measures is ranked unless asked for: the zero-bubble
schedules are not (:data:`UNMEASURED_SCHEDULES` says why).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lightning_scale.core.checks import divisors
from lightning_scale.core.planner.cluster import Cluster
from lightning_scale.core.planner.layout import CHECKPOINTING, DP_MODES, Candidate, Workload
from lightning_scale.core.planner.memory import MemoryEstimate, estimate_memory
from lightning_scale.core.planner.shape import ModelShape
from lightning_scale.core.planner.step_time import Efficiency, TimeEstimate, estimate_time

__all__ = ["PIPELINE_SCHEDULES", "UNMEASURED_SCHEDULES", "Estimate", "candidates", "estimate", "plan"]

PIPELINE_SCHEDULES: tuple[tuple[str, int], ...] = (
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("interleaved_1f1b", 4),
)
"""(schedule, stages per rank) the search tries when ``pp > 1``: those whose memory and step time
``benchmarks/planner.py`` measures. Not ranked unless asked for (``schedules=``): :data:`UNMEASURED_SCHEDULES`."""
UNMEASURED_SCHEDULES: dict[str, str] = {
    schedule: "its memory is not measured: torch's MemTracker cannot follow the split backward of the zero-bubble "
    "schedules (autograd.grad over a stage's inputs: 'A leaf node was passed to _will_engine_execute_node'), so the "
    "planner's estimate for it is unchecked"
    for schedule in ("interleaved_zero_bubble", "zbv", "dualpipev")
}
"""Schedules the strategy trains but the planner does not rank by default, with the reason."""
_V_SHAPED = ("zbv", "dualpipev")
"""Schedules whose rank 0 runs the first and the last stage: a tied embedding and head are one weight
there, which data parallelism (each stage wrapped on its own) cannot hold; the strategy refuses it."""


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool
    tokens_per_sec: float
    mfu: float
    usd_per_million_tokens: float | None
    hours_to_budget: float | None
    usd_to_budget: float | None

    @property
    def name(self) -> str:
        return self.candidate.name

    def metrics(self) -> dict[str, float]:
        """The predicted figures a run logs as ``plan/*``, beside what its telemetry measures."""
        return {
            "plan/step_time": self.time.step_time,
            "plan/memory_per_device_gib": self.memory.total / 2**30,
            "plan/tokens_per_sec": self.tokens_per_sec,
            "plan/mfu": self.mfu,
        }

    def row(self) -> dict[str, object]:
        """The plan table's columns, as plain values (``plan.json``)."""
        return {
            "layout": self.name,
            "fits": self.fits,
            "memory_per_device_gib": self.memory.total / 2**30,
            "step_time_s": self.time.step_time,
            "tokens_per_sec": self.tokens_per_sec,
            "mfu": self.mfu,
            "usd_per_million_tokens": self.usd_per_million_tokens,
            "hours_to_budget": self.hours_to_budget,
            "usd_to_budget": self.usd_to_budget,
        }


def _tp_sizes(shape: ModelShape, cluster: Cluster) -> list[int]:
    return [
        t
        for t in divisors(cluster.devices_per_node)
        if shape.n_heads % t == 0 and shape.n_kv_heads % t == 0 and shape.d_ff % t == 0
    ]


def _context_parallel_sizes(workload: Workload, ranks: int, asked: Sequence[int] | None) -> list[int]:
    """Context-parallel sizes for ``ranks`` data x context ranks: each splits every sequence into ``2 cp``
    chunks (load-balanced causal ring attention); by default 1 and every such size up to 16."""
    sizes = asked if asked is not None else [c for c in divisors(ranks) if c <= 16]
    return [c for c in sizes if ranks % c == 0 and (c == 1 or workload.seq_len % (2 * c) == 0)]


def _float8_options(workload: Workload, cluster: Cluster, asked: Sequence[bool] | None) -> list[bool]:
    """Whether to plan float8 linears: by default where the device has a float8 peak and the run is bf16-mixed."""
    if asked is not None:
        return list(asked)
    return [False, True] if cluster.device.peak("float8") and workload.precision == "bf16-mixed" else [False]


def candidates(
    shape: ModelShape,
    workload: Workload,
    cluster: Cluster,
    *,
    dp_modes: Sequence[str] = DP_MODES,
    checkpointing: Sequence[str] = CHECKPOINTING,
    schedules: Sequence[tuple[str, int]] = PIPELINE_SCHEDULES,
    sequence_parallel: bool = True,
    max_micro_batch: int = 16,
    gradient_accumulation: bool = True,
    context_parallel: Sequence[int] | None = None,
    float8: Sequence[bool] | None = None,
) -> Iterator[Candidate]:
    """Every layout the model, cluster and batch admit (see the module doc). ``sequence_parallel``:
    whether tensor-parallel layouts shard the norms' activations too (the package's default);
    ``gradient_accumulation=False``: without a pipeline, each replica's whole batch is one micro-batch
    (what a strategy runs when the Trainer accumulates nothing). ``context_parallel`` (sizes) and
    ``float8`` (``False``, ``True``) are planned-only dimensions (:attr:`Candidate.trainable`): by default
    every context-parallel size up to 16 that splits the sequence, and float8 where the device has it;
    ``(1,)`` and ``(False,)`` plan only what the strategy trains."""
    world = cluster.world_size
    fp8_options = _float8_options(workload, cluster, float8)
    for t in _tp_sizes(shape, cluster):
        for p in divisors(world // t) if world % t == 0 else []:
            if p > shape.n_layers:
                break
            for c in _context_parallel_sizes(workload, world // (t * p), context_parallel):
                d = world // (t * p * c)
                if workload.global_batch % d:
                    continue
                local = workload.global_batch // d
                ranks = d * c  # data x context: what data parallelism reduces over and shards across
                modes = [m for m in dp_modes if ranks > 1 or m == "ddp"]
                group = t * p
                shard = cluster.devices_per_node // group if cluster.devices_per_node % group == 0 else 0
                sizes = (
                    [local]
                    if p == 1 and not gradient_accumulation
                    else [b for b in divisors(local) if b <= max_micro_batch]
                )
                for mb in sizes:
                    m = local // mb
                    for schedule, v in schedules if p > 1 else (("1f1b", 1),):
                        if p > 1 and (m < p or (v > 1 and (m % p or shape.n_layers % (p * v)))):
                            continue
                        if schedule in _V_SHAPED and shape.tied and ranks > 1:
                            continue  # the tied embedding and head on one rank's two stages, wrapped apart by data parallelism
                        for mode in modes:
                            if mode == "hsdp" and not (1 < shard < ranks and ranks % shard == 0):
                                continue
                            for ckpt in checkpointing:
                                for fp8 in fp8_options:
                                    yield Candidate(
                                        dp=d,
                                        tp=t,
                                        pp=p,
                                        dp_mode=mode,
                                        schedule=schedule,
                                        virtual_stages=max(v, 1),
                                        micro_batch=mb,
                                        checkpointing=ckpt,
                                        sequence_parallel=sequence_parallel and t > 1,
                                        hsdp_shard=shard if mode == "hsdp" else 1,
                                        cp=c,
                                        float8=fp8,
                                    )


def estimate(
    shape: ModelShape,
    workload: Workload,
    candidate: Candidate,
    cluster: Cluster,
    efficiency: Efficiency | None = None,
    *,
    headroom: float = 0.1,
    token_budget: float | None = None,
    peak: float | None = None,
    framework: float = 0.0,
    explain: bool = False,
) -> Estimate:
    """Memory, time, throughput and cost of one layout (``explain``: with each time term's inputs)."""
    memory = estimate_memory(shape, workload, candidate, framework=framework, foreach=cluster.device.chip != "cpu")
    time = estimate_time(shape, workload, candidate, cluster, efficiency, peak=peak, explain=explain)
    step = time.step_time
    tokens_per_sec = workload.tokens / step
    peak_flops = time.inputs["peak_flops"]
    mfu = time.model_flops / step / (candidate.world_size * peak_flops)
    price = cluster.device_price()
    usd_per_hour = price.usd_per_device_hour * candidate.world_size if price else None
    usd_per_mtok = usd_per_hour / 3600 / tokens_per_sec * 1e6 if usd_per_hour else None
    hours = token_budget / tokens_per_sec / 3600 if token_budget else None
    usd = hours * usd_per_hour if hours is not None and usd_per_hour else None
    fits = memory.total <= cluster.device.memory * (1 - headroom)
    return Estimate(candidate, memory, time, fits, tokens_per_sec, mfu, usd_per_mtok, hours, usd)


def plan(
    shape: ModelShape,
    workload: Workload,
    cluster: Cluster,
    efficiency: Efficiency | None = None,
    *,
    headroom: float = 0.1,
    token_budget: float | None = None,
    peak: float | None = None,
    framework: float = 0.0,
    **search: object,
) -> list[Estimate]:
    """Every candidate estimated; those that fit first, each group by tokens/s, fastest first.

    Raises a ``ValueError`` when the cluster, model and batch admit no layout at all (e.g. a global
    batch that no data-parallel size divides), naming why."""
    found = [
        estimate(
            shape,
            workload,
            c,
            cluster,
            efficiency,
            headroom=headroom,
            token_budget=token_budget,
            peak=peak,
            framework=framework,
        )
        for c in candidates(shape, workload, cluster, **search)  # type: ignore[arg-type]
    ]
    if not found:
        world = cluster.world_size
        sizes = sorted(
            {
                world // (t * p)
                for t in _tp_sizes(shape, cluster)
                for p in divisors(world // t)
                if world % t == 0 and p <= shape.n_layers
            }
        )
        raise ValueError(
            f"No layout of {shape.name} on {world} devices splits global_batch={workload.global_batch}: the "
            f"data-parallel sizes these devices allow are {sizes}, and the global batch must be a multiple of "
            f"one of them. Use a global batch that is a multiple of {sizes[0] if sizes else world}, or other devices."
        )
    found.sort(key=lambda e: (not e.fits, -e.tokens_per_sec))
    return found
