"""Every option of ``HybridParallelStrategy``, checked when the strategy is built: before any
process starts, a bad value raises ``ValueError`` naming the value, the rule and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_scale.core.checks import format_choices
from lightning_scale.core.data_parallel import ACTIVATION_CHECKPOINTING, COMPRESSIONS, DATA_PARALLEL_MODES
from lightning_scale.core.layout import Layout, check_size
from lightning_scale.core.partition import SCHEDULES, check_schedule_microbatches, stages_per_rank

__all__ = ["PARTITIONS", "ParallelOptions"]

PARTITIONS = ("by_layers", "by_params", "by_cost")
Size = int | Literal["auto"]


def _positive_int(name: str, value: object, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer{hint}.")


@dataclass(frozen=True)
class ParallelOptions:
    data_parallel: Size = "auto"
    tensor_parallel: Size = 1
    pipeline_parallel: Size = 1
    data_parallel_mode: str = "ddp"
    hsdp_replicate: Size = "auto"
    hsdp_shard: Size = "auto"
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 2
    partition: str = "by_layers"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 2
    compile: bool = False
    gradient_compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10

    def __post_init__(self) -> None:
        for name in ("data_parallel", "tensor_parallel", "pipeline_parallel", "hsdp_replicate", "hsdp_shard"):
            check_size(name, getattr(self, name))
        mode = self.data_parallel_mode
        if mode not in DATA_PARALLEL_MODES:
            raise ValueError(
                f"data_parallel_mode={mode!r} is not one of {format_choices(DATA_PARALLEL_MODES)} "
                "(ddp: replicas; fsdp: ZeRO-3-like sharding; fsdp_grad_op: ZeRO-2-like; hsdp: replicate x shard)."
            )
        if mode != "hsdp" and (self.hsdp_replicate != "auto" or self.hsdp_shard != "auto"):
            raise ValueError(
                f"hsdp_replicate/hsdp_shard are set but data_parallel_mode={mode!r}; they only apply to "
                "data_parallel_mode='hsdp'."
            )
        sizes = [self.hsdp_replicate, self.hsdp_shard, self.data_parallel]
        if mode == "hsdp" and all(isinstance(s, int) for s in sizes):
            self.hsdp_split(int(self.data_parallel))  # type: ignore[arg-type]
        if self.gradient_compression not in COMPRESSIONS:
            raise ValueError(
                f"gradient_compression={self.gradient_compression!r} is not one of {format_choices(COMPRESSIONS)}."
            )
        if self.gradient_compression != "none":
            if mode != "ddp":
                raise ValueError(
                    f"gradient_compression={self.gradient_compression!r} uses DDP communication hooks, which "
                    f"data_parallel_mode={mode!r} does not have (FSDP reduce-scatters sharded gradients itself). "
                    "Use data_parallel_mode='ddp' or gradient_compression='none'."
                )
            for name in ("tensor_parallel", "pipeline_parallel"):
                if getattr(self, name) != 1:
                    raise ValueError(
                        f"gradient_compression={self.gradient_compression!r} applies to plain data parallelism "
                        f"(DistributedDataParallel's communication hooks); {name}={getattr(self, name)!r} must be 1."
                    )
        _positive_int("powersgd_rank", self.powersgd_rank)
        _positive_int("powersgd_start_iter", self.powersgd_start_iter)
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{format_choices(ACTIVATION_CHECKPOINTING)} (selective: every activation_checkpointing_every-th block)."
            )
        _positive_int("activation_checkpointing_every", self.activation_checkpointing_every)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Unknown pipeline schedule {self.schedule!r}. Valid schedules: {format_choices(SCHEDULES)}.")
        _positive_int("virtual_stages", self.virtual_stages, " (stages per rank when interleaved)")
        stages_per_rank(self.schedule, self.virtual_stages)  # interleaved schedules need virtual_stages >= 2
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r} is not one of {format_choices(PARTITIONS)}.")
        if self.microbatches is not None:
            _positive_int("microbatches", self.microbatches, " (or None for 2 x pipeline_parallel)")
            if isinstance(self.pipeline_parallel, int):
                check_schedule_microbatches(self.schedule, self.pipeline_parallel, self.microbatches)

    def hsdp_split(self, data_parallel: int, num_nodes: int = 1) -> tuple[int, int]:
        """(replicate, shard) sizes for ``hsdp``; ``"auto"``: replicate across nodes, shard within one."""
        replicate, shard = self.hsdp_replicate, self.hsdp_shard
        if replicate == "auto" and shard == "auto":
            replicate = num_nodes if num_nodes > 1 and data_parallel % num_nodes == 0 else 1
        if replicate == "auto":
            replicate = data_parallel // int(shard) if data_parallel % int(shard) == 0 else -1
        if shard == "auto":
            shard = data_parallel // int(replicate) if data_parallel % int(replicate) == 0 else -1
        if int(replicate) * int(shard) != data_parallel or int(replicate) < 1 or int(shard) < 1:
            raise ValueError(
                f"hsdp needs hsdp_replicate x hsdp_shard = data_parallel, but {self.hsdp_replicate} x "
                f"{self.hsdp_shard} does not make data_parallel={data_parallel}. Choose sizes whose product is "
                f"{data_parallel} (e.g. hsdp_replicate=<nodes>, hsdp_shard=<processes per node>)."
            )
        return int(replicate), int(shard)

    def check_layout(self, layout: Layout) -> None:
        """Checks that need the resolved sizes (``"auto"`` filled in)."""
        if self.gradient_compression != "none" and (layout.tp > 1 or layout.pp > 1):
            raise ValueError(
                f"gradient_compression={self.gradient_compression!r} applies to plain data parallelism; {layout} "
                "also uses tensor or pipeline parallelism. Use gradient_compression='none'."
            )
        if self.microbatches is not None:
            check_schedule_microbatches(self.schedule, layout.pp, self.microbatches)
