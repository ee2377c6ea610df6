"""What the planner plans: a training workload, and one candidate layout for it.

:class:`Workload` is the batch, sequence length, precision and optimizer; :class:`Candidate` one way of
running it: the data, tensor and pipeline sizes, how data parallelism shards, the pipeline schedule,
the micro-batch and activation checkpointing. No Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_scale.core.checks import check_positive_int, format_choices
from lightning_scale.core.pipeline.partition import SCHEDULES, stages_per_rank

__all__ = ["CHECKPOINTING", "DP_MODES", "OPTIMIZERS", "PRECISION_BYTES", "Candidate", "Workload"]

DP_MODES = ("ddp", "fsdp", "fsdp_grad_op", "hsdp")
CHECKPOINTING = ("none", "selective", "full")
OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
"""States per parameter, each of the parameter's dtype."""

PRECISION_BYTES: dict[str, tuple[int, int, int]] = {
    "32-true": (4, 4, 4),
    "bf16-mixed": (4, 4, 2),
    "16-mixed": (4, 4, 2),
    "bf16-true": (2, 2, 2),
    "16-true": (2, 2, 2),
}
"""Bytes of a parameter, of a gradient and of a matmul's output, per precision (mixed precision keeps
fp32 parameters and gradients, and computes matmuls in 16 bits)."""

COMPUTE_DTYPE = {
    "32-true": "float32",
    "bf16-mixed": "bfloat16",
    "16-mixed": "float16",
    "bf16-true": "bfloat16",
    "16-true": "float16",
}


@dataclass(frozen=True)
class Workload:
    global_batch: int
    """Sequences per optimizer step, all data-parallel replicas together."""
    seq_len: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        check_positive_int("global_batch", self.global_batch, fix="It is the sequences per optimizer step.")
        check_positive_int("seq_len", self.seq_len, fix="It is the tokens per sequence.")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(
                f"precision={self.precision!r} is not one the planner knows: {format_choices(PRECISION_BYTES)}."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={self.optimizer!r} is not one the planner knows: {format_choices(OPTIMIZERS)}."
            )

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def compute_dtype(self) -> str:
        return COMPUTE_DTYPE[self.precision]


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    dp_mode: str = "ddp"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batch: int = 1
    """Sequences per micro-batch on one data-parallel replica."""
    checkpointing: str = "none"
    checkpoint_every: int = 2
    """``selective``: every k-th block of a stage is checkpointed (``blocks[::k]``)."""
    sequence_parallel: bool = False
    hsdp_shard: int = 1
    """``hsdp``: the devices each replica shards over (the rest replicate)."""
    cp: int = 1
    """Context parallel: the ranks each sequence is split over (ring attention passes the keys and values
    around them); planned with the mesh ``(dp, cp, pp, tp)``. Planned only: the strategy cannot train it yet."""
    float8: bool = False
    """The blocks' linear layers' matmuls in float8 (torchao, rowwise or tensorwise scaling; attention and the
    head stay bf16): ``HybridParallelStrategy(float8="rowwise")`` trains it (``layout="auto"`` does not choose it)."""
    offload_blocks: int = 0
    """Blocks of each pipeline rank, counted from its first, whose saved activations are kept in host memory
    (``HybridParallelStrategy(activation_offload=N)``); a checkpointed one among them saves only its input,
    which stays on the device."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "checkpoint_every", "virtual_stages", "hsdp_shard", "cp"):
            check_positive_int(name, getattr(self, name))
        if isinstance(self.offload_blocks, bool) or not isinstance(self.offload_blocks, int) or self.offload_blocks < 0:
            raise ValueError(f"offload_blocks={self.offload_blocks!r} must be a number of blocks >= 0 (0: none).")
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode={self.dp_mode!r}; valid: {format_choices(DP_MODES)}.")
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing={self.checkpointing!r}; valid: {format_choices(CHECKPOINTING)}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; valid: {format_choices(SCHEDULES)}.")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def trainable(self) -> bool:
        """Whether the layout options alone (what ``layout="auto"`` and a study set) train this layout: not
        context parallelism (planned only: the strategy cannot train it yet) nor float8 linears (the strategy
        trains them, but through its own ``float8=`` option, which neither sets)."""
        return self.cp == 1 and not self.float8

    @property
    def data_shards(self) -> int:
        """The ranks the data-parallel mode reduces gradients over and shards across: data and context
        parallel together (each context-parallel rank holds a part of every sequence)."""
        return self.dp * self.cp

    @property
    def stages_per_rank(self) -> int:
        return stages_per_rank(self.schedule, self.virtual_stages) if self.pp > 1 else 1

    def checkpointed_blocks(self, blocks: int) -> int:
        """How many of a rank's ``blocks`` activation checkpointing wraps (``blocks[::k]`` when selective)."""
        if self.checkpointing == "full":
            return blocks
        return math.ceil(blocks / self.checkpoint_every) if self.checkpointing == "selective" else 0

    def offloaded_blocks(self, blocks: int) -> int:
        """How many of a rank's ``blocks`` offload their saved activations to the host: the first
        ``offload_blocks`` of them, less the checkpointed ones (which save only their input, kept on the device)."""
        first = min(self.offload_blocks, blocks)
        if self.checkpointing == "full":
            return 0
        return first - (math.ceil(first / self.checkpoint_every) if self.checkpointing == "selective" else 0)

    def microbatches(self, workload: Workload) -> int:
        """Micro-batches per optimizer step on one replica (pipeline micro-batches, or gradient
        accumulation steps without a pipeline)."""
        return workload.global_batch // (self.dp * self.micro_batch)

    def fits_batch(self, workload: Workload) -> bool:
        return workload.global_batch % (self.dp * self.micro_batch) == 0

    @property
    def layout(self) -> str:
        """The sizes and data-parallel mode, named as a sweep's jobs are (``dp2-tp1-pp1``, ``fsdp8-tp2-pp1``)."""
        prefix = "dp" if self.dp_mode == "ddp" else self.dp_mode
        return f"{prefix}{self.dp}-tp{self.tp}-pp{self.pp}" + (f"-cp{self.cp}" if self.cp > 1 else "")

    @property
    def name(self) -> str:
        """The layout, then the pipeline schedule, micro-batch and checkpointing: unique in a plan."""
        parts = [self.layout]
        if self.hsdp_shard > 1:
            parts.append(f"shard{self.hsdp_shard}")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("nosp")
        if self.pp > 1:
            parts.append(
                self.schedule
                + (
                    f"v{self.virtual_stages}"
                    if self.stages_per_rank > 1 and self.schedule.startswith("interleaved")
                    else ""
                )
            )
        parts.append(f"mb{self.micro_batch}")
        if self.checkpointing != "none":
            parts.append("ac" if self.checkpointing == "full" else f"ac{self.checkpoint_every}")
        if self.float8:
            parts.append("fp8")
        if self.offload_blocks:
            parts.append(f"off{self.offload_blocks}")
        return "-".join(parts)
