"""Every option of ``HybridParallelStrategy``, declared once (name, default, what it does) and checked
when the strategy is built: before any process starts, a bad value raises ``ValueError`` naming the
value, the rule and the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from lightning_scale.core.checks import check_positive_int, check_positive_number, format_choices
from lightning_scale.core.parallel.blocks import ACTIVATION_CHECKPOINTING, resolve_compile
from lightning_scale.core.parallel.data_parallel import COMPRESSIONS, DATA_PARALLEL_MODES
from lightning_scale.core.parallel.layout import Layout, check_size
from lightning_scale.core.parallel.offload import check_activation_offload
from lightning_scale.core.parallel.sync_exchange import EmulatedLink
from lightning_scale.core.parallel.sync_spec import SyncSpec, sync_spec
from lightning_scale.core.pipeline.partition import SCHEDULES, check_schedule_microbatches, stages_per_rank
from lightning_scale.core.resilience.watchdog import hang_timeout_policy
from lightning_scale.strategies.hybrid.float8 import check_float8

__all__ = ["GLOBAL_BATCH_CHANGES", "LOSS_STAGES", "PARTITIONS", "PLANNED", "PRESETS", "ParallelOptions", "loss_names"]

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "hybrid": ("data x tensor x pipeline parallelism", {}),
    "pipeline": ("pipeline parallelism over all processes", {"data_parallel": 1, "pipeline_parallel": "auto"}),
    "tensor_parallel": ("tensor parallelism over all processes of a node", {"tensor_parallel": "auto"}),
}
"""The names ``HybridParallelStrategy`` registers with Lightning (``Trainer(strategy="pipeline")``): a
description and the options each name sets."""

PARTITIONS = ("by_layers", "by_params", "by_cost")
GLOBAL_BATCH_CHANGES = ("refuse", "allow")
LOSS_STAGES = ("train", "val", "test")
Size = int | Literal["auto"]

_NON_STRUCTURAL = frozenset(
    {
        # Sizes: compared once resolved ("auto" filled in), as the layout and the hsdp split.
        "layout",
        "cluster",
        "data_parallel",
        "tensor_parallel",
        "pipeline_parallel",
        "hsdp_replicate",
        "hsdp_shard",
        # What a module already cut for one set of options may be set up again with: the pipeline
        # schedule is rebuilt for a new micro-batch count, plain DDP is wrapped anew every time.
        "microbatches",
        "loss_name",
        "gradient_compression",
        "powersgd_rank",
        "powersgd_start_iter",
        "find_unused_parameters",
        "static_graph",
        "bucket_cap_mb",
        "gradient_as_bucket_view",
        "hang_timeout",
        "global_batch_change",
        # A periodic synchronisation wraps nothing for data parallelism, every_step does: compared on that.
        "data_parallel_sync",
        "sync_every",
        "emulated_link",
    }
)
_DDP_OPTIONS = ("find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view")
_SIZES = ("data_parallel", "tensor_parallel", "pipeline_parallel")  # the options also taken positionally
PLANNED = (
    *_SIZES,
    "data_parallel_mode",
    "schedule",
    "microbatches",
    "virtual_stages",
    "activation_checkpointing",
    "activation_checkpointing_every",
)
"""What ``layout="auto"`` chooses (:mod:`.planning`); one set too (to other than its default) is a constraint: the
planner chooses among the layouts that have it (:meth:`ParallelOptions.constraints`)."""


def loss_names(loss_name: str | Mapping[str, str]) -> dict[str, str]:
    """The name the pipeline's loss is logged under for each of ``train``, ``val`` and ``test``.

    ``loss_name`` is a template with ``{stage}`` (``"{stage}/loss"``, ``"{stage}_loss"``) or a
    mapping from some of those stages to names (the others keep ``"{stage}/loss"``).
    """
    if isinstance(loss_name, str):
        try:
            names = {stage: loss_name.format(stage=stage) for stage in LOSS_STAGES}
        except (KeyError, IndexError, ValueError, AttributeError) as err:
            raise ValueError(
                f"loss_name={loss_name!r} is not a template with only {{stage}} in braces ({err!r}); e.g. '{{stage}}_loss'."
            ) from None
        if len(set(names.values())) < len(LOSS_STAGES):
            raise ValueError(
                f"loss_name={loss_name!r} would log the training, validation and test losses under one name. Use a "
                "template with {stage} (e.g. '{stage}_loss' gives train_loss, val_loss, test_loss) or a mapping "
                f"such as {{'val': {loss_name!r}}}."
            )
        return names
    if isinstance(loss_name, Mapping):
        unknown = sorted(set(loss_name) - set(LOSS_STAGES))
        if unknown or not all(isinstance(v, str) and v for v in loss_name.values()):
            raise ValueError(
                f"loss_name={dict(loss_name)!r}: keys must be among {format_choices(LOSS_STAGES)} and values non-empty "
                f"names{f' (unknown: {unknown})' if unknown else ''}."
            )
        return {stage: str(loss_name.get(stage, f"{stage}/loss")) for stage in LOSS_STAGES}
    raise TypeError(f"loss_name must be a string template or a mapping, got {type(loss_name).__name__}")


@dataclass(frozen=True)
class ParallelOptions:
    """Every option of :class:`~lightning_scale.strategies.HybridParallelStrategy`, declared once with its type
    and default, and checked here. The strategy's constructor spells out the same parameters (a test keeps
    them equal) and its docstring documents each."""

    data_parallel: Size = "auto"
    tensor_parallel: Size = 1
    pipeline_parallel: Size = 1
    layout: str = "manual"
    cluster: str | None = None
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
    compile: bool | Literal["auto"] = "auto"
    float8: str | None = None
    activation_offload: int | str | Sequence[int] = 0
    gradient_compression: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 10
    loss_name: str | Mapping[str, str] = "{stage}/loss"
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    hang_timeout: str | float | Mapping[str, Any] = "auto"
    global_batch_change: str = "refuse"
    data_parallel_sync: str | Mapping[str, Any] | SyncSpec = "every_step"
    sync_every: int | None = None
    emulated_link: Mapping[str, float] | EmulatedLink | None = None
    _loss_names: dict[str, str] = field(init=False, repr=False, compare=False, default_factory=dict)
    _sync: SyncSpec = field(init=False, repr=False, compare=False, default_factory=SyncSpec)
    _compile_auto: bool = field(init=False, repr=False, compare=False, default=False)

    @classmethod
    def names(cls) -> list[str]:
        """The options, in the order of the strategy's arguments."""
        return [f.name for f in fields(cls) if f.init]

    def constraints(self) -> dict[str, Any]:
        """``layout="auto"``'s constraints: the :data:`PLANNED` options set to other than their defaults."""
        defaults = {f.name: f.default for f in fields(self)}
        return {name: getattr(self, name) for name in PLANNED if getattr(self, name) != defaults[name]}

    def __post_init__(self) -> None:
        if self.layout not in ("manual", "auto"):
            raise ValueError(
                f"layout={self.layout!r} must be 'manual' (the sizes given) or 'auto' (the planner chooses)."
            )
        if self.cluster is not None and self.layout != "auto":
            raise ValueError(
                f"cluster={self.cluster!r} is what layout='auto' plans for; set layout='auto' or remove it."
            )
        for name in ("sequence_parallel", "loss_parallel"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        # compile="auto" (what conf/strategy/hybrid.yaml sets) reads as a bool here, by whether CUDA is available,
        # so every reader of ``compile`` sees a bool; parallelize() decides by the root device (compiles_on).
        object.__setattr__(self, "_compile_auto", self.compile == "auto" and not isinstance(self.compile, bool))
        object.__setattr__(
            self, "compile", resolve_compile(self.compile, "cuda" if torch.cuda.is_available() else "cpu")
        )
        for name in ("loss_name", "hang_timeout", "data_parallel_sync", "emulated_link"):  # a YAML mapping as a dict
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, dict(getattr(self, name)))
        object.__setattr__(self, "_loss_names", loss_names(self.loss_name))
        for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.bucket_cap_mb is not None:
            fix = "Pass None for DDP's default of 25."
            check_positive_number("bucket_cap_mb", self.bucket_cap_mb, unit="megabytes", fix=fix)
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
        check_positive_int("powersgd_rank", self.powersgd_rank)
        check_positive_int("powersgd_start_iter", self.powersgd_start_iter)
        hang_timeout_policy(self.hang_timeout)  # ValueError naming the value and what to pass
        self._check_sync(mode)
        if self.global_batch_change not in GLOBAL_BATCH_CHANGES:
            raise ValueError(
                f"global_batch_change={self.global_batch_change!r} is not one of {format_choices(GLOBAL_BATCH_CHANGES)}."
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{format_choices(ACTIVATION_CHECKPOINTING)} (selective: every activation_checkpointing_every-th block)."
            )
        check_positive_int("activation_checkpointing_every", self.activation_checkpointing_every)
        self._check_memory_and_float8()
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown pipeline schedule {self.schedule!r}. Valid schedules: {format_choices(SCHEDULES)}."
            )
        check_positive_int(
            "virtual_stages", self.virtual_stages, fix="It is the number of stages per rank of an interleaved schedule."
        )
        stages_per_rank(self.schedule, self.virtual_stages)  # interleaved schedules need virtual_stages >= 2
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r} is not one of {format_choices(PARTITIONS)}.")
        if self.microbatches is not None:
            check_positive_int("microbatches", self.microbatches, fix="Pass None for 2 x pipeline_parallel.")
            if isinstance(self.pipeline_parallel, int):
                check_schedule_microbatches(self.schedule, self.pipeline_parallel, self.microbatches)

    def _check_memory_and_float8(self) -> None:
        if not isinstance(self.activation_offload, (int, str)) and isinstance(self.activation_offload, Sequence):
            object.__setattr__(self, "activation_offload", tuple(self.activation_offload))  # a YAML list, hashable
        check_activation_offload(self.activation_offload)
        check_float8(self.float8)  # the recipe, and that torchao is installed (imported only to convert the model)

    def _check_sync(self, mode: str) -> None:
        if self.sync_every is not None:
            check_positive_int(
                "sync_every", self.sync_every, fix="It is H, the optimizer steps between synchronisations."
            )
        spec = sync_spec(self.data_parallel_sync, self.sync_every)
        object.__setattr__(self, "_sync", spec)
        link = EmulatedLink.of(self.emulated_link)
        object.__setattr__(self, "emulated_link", link)
        if not spec.periodic:
            if link is not None and (self.gradient_compression != "none" or self.ddp_kwargs()):
                raise ValueError(
                    f"emulated_link={link} delays DistributedDataParallel's own all-reduce (a communication hook); "
                    f"gradient_compression={self.gradient_compression!r} and the DDP options "
                    f"{sorted(self.ddp_kwargs())} would replace or change it. Remove them, or the emulated link."
                )
            return
        if mode != "ddp":
            raise ValueError(
                f"data_parallel_sync={spec.describe()} lets each data-parallel replica train a whole model of its own; "
                f"data_parallel_mode={mode!r} shards one model over the replicas. Use data_parallel_mode='ddp'."
            )
        if self.gradient_compression != "none":
            raise ValueError(
                f"gradient_compression={self.gradient_compression!r} compresses every step's gradients; "
                f"data_parallel_sync={spec.describe()} reduces none. Compress its exchange instead "
                f"(data_parallel_sync={{'mode': {spec.mode!r}, 'every': {spec.every}, 'compression': 'bf16'}})."
            )
        ddp = self.ddp_kwargs()
        if ddp:
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in ddp.items())} configure DistributedDataParallel, which "
                f"data_parallel_sync={spec.describe()} does not use (no gradient is reduced over the replicas). "
                "Remove them."
            )

    @property
    def sync(self) -> SyncSpec:
        """The data-parallel synchronisation (``data_parallel_sync`` and ``sync_every`` read together)."""
        return self._sync

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

    @property
    def loss_names(self) -> dict[str, str]:
        """``{"train": ..., "val": ..., "test": ...}``: where the pipeline's loss is logged."""
        return dict(self._loss_names)

    def ddp_kwargs(self, *, hooks: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel`` (the options left at their defaults omitted);
        ``hooks``: with the communication hook's (``compression``, ``powersgd_*``: ``wrap_ddp``'s)."""
        defaults = {f.name: f.default for f in fields(self) if f.name in _DDP_OPTIONS}
        kwargs = {k: getattr(self, k) for k, default in defaults.items() if getattr(self, k) != default}
        if hooks:  # (what wrap_ddp gets: the package's default of gradient_as_bucket_view too, not DDP's)
            kwargs |= {"compression": self.gradient_compression, "powersgd_rank": self.powersgd_rank}
            kwargs["gradient_as_bucket_view"] = self.gradient_as_bucket_view
            kwargs["powersgd_start_iter"] = self.powersgd_start_iter
        return kwargs

    @property
    def compile_setting(self) -> bool | str:
        """``compile`` as given: True, False or ``"auto"``."""
        return "auto" if self._compile_auto else self.compile

    def compiles_on(self, device: torch.device | str) -> bool:
        """Whether each block is ``torch.compile``-d on the root ``device``: ``compile=True``/``False`` as given,
        ``"auto"`` on CUDA only (:func:`~lightning_scale.core.parallel.blocks.resolve_compile`)."""
        return resolve_compile(self.compile_setting, device)

    def structural_differences(self, other: ParallelOptions, layout: Layout) -> list[str]:
        """Options that decide how a module is cut and wrapped at ``layout`` and differ between ``self``
        and ``other`` (sizes aside: compare the resolved layouts). Options that do nothing at ``layout``
        (``loss_parallel`` at tp=1, the schedule at pp=1, ...) may differ."""

        def matters(name: str) -> bool:
            if name in ("sequence_parallel", "loss_parallel"):
                return layout.tp > 1
            if name in ("schedule", "partition"):
                return layout.pp > 1
            if name == "virtual_stages":
                return layout.pp > 1 and self.schedule.startswith("interleaved")
            if name == "data_parallel_mode":
                return layout.dp > 1
            if name == "activation_checkpointing_every":
                return "selective" in (self.activation_checkpointing, other.activation_checkpointing)
            return True

        wrapped = (
            []
            if self._sync.periodic == other._sync.periodic or layout.dp == 1
            else [f"data_parallel_sync={self._sync.describe()} vs {other._sync.describe()}"]
        )
        return wrapped + [
            f"{f.name}={getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.init
            and f.name not in _NON_STRUCTURAL
            and matters(f.name)
            and getattr(self, f.name) != getattr(other, f.name)
        ]

    @staticmethod
    def plain_ddp(layout: Layout, mode: str, periodic: bool = False) -> bool:
        """Whether the data-parallel axis is torch's ``DistributedDataParallel`` around the whole module
        (``periodic``: a periodic ``data_parallel_sync``, which reduces no gradient: no wrapper at all)."""
        return layout.dp > 1 and layout.tp == 1 and layout.pp == 1 and mode == "ddp" and not periodic

    def check_layout(self, layout: Layout) -> None:
        """Checks that need the resolved sizes (``"auto"`` filled in)."""
        ddp = self.ddp_kwargs()
        without_ddp = layout.tp > 1 or layout.pp > 1 or (layout.dp > 1 and self.data_parallel_mode != "ddp")
        if ddp and without_ddp:
            reason = (
                f"{layout} has no data parallelism"
                if layout.dp == 1
                else f"{layout} with data_parallel_mode={self.data_parallel_mode!r} runs FSDP2 (replicate/fully_shard), "
                "which needs no such settings (it handles unused parameters and buckets itself)"
            )
            raise ValueError(
                f"{', '.join(f'{k}={v!r}' for k, v in ddp.items())} configure DistributedDataParallel, which this "
                f"run does not use: {reason}. Remove them, or use plain data parallelism (tensor_parallel=1, "
                "pipeline_parallel=1, data_parallel_mode='ddp')."
            )
        if self.emulated_link is not None and not self._sync.periodic and (layout.tp > 1 or layout.pp > 1):
            raise ValueError(
                f"emulated_link delays the every-step gradient all-reduce through a DistributedDataParallel hook; "
                f"{layout} reduces gradients through FSDP2, which takes none. Use a periodic data_parallel_sync, "
                "plain data parallelism, or no emulated link."
            )
        if self.gradient_compression != "none" and (layout.tp > 1 or layout.pp > 1):
            raise ValueError(
                f"gradient_compression={self.gradient_compression!r} applies to plain data parallelism; {layout} "
                "also uses tensor or pipeline parallelism. Use gradient_compression='none'."
            )
        if self.microbatches is not None:
            check_schedule_microbatches(self.schedule, layout.pp, self.microbatches)
