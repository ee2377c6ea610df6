"""Turning a LightningModule into this rank's part of a (dp, pp, tp) layout: :func:`parallelize`,
whose docstring is where the order is written down, and what it needs (the tensor-parallel plan,
the blocks activation checkpointing wraps, the model's facts taken before it is cut).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_scale._lightning_compat import before_batch_transfer
from lightning_scale.core.parallel.blocks import apply_activation_checkpointing, compile_blocks
from lightning_scale.core.parallel.data_parallel import apply_data_parallel
from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.parallel.offload import apply_activation_offload, offloaded_blocks
from lightning_scale.core.parallel.tensor_parallel import apply_tensor_parallel, find_registered_plans, resolve_plan
from lightning_scale.core.pipeline.partition import stage_ranks
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.core.pipeline.spec import PipelineSpec, find_registered_spec
from lightning_scale.core.telemetry.model_facts import ModelFacts
from lightning_scale.strategies.hybrid.float8 import convert_float8
from lightning_scale.strategies.hybrid.options import ParallelOptions
from lightning_scale.strategies.hybrid.pipeline_hooks import PIPELINE_SPEC_HOOK, example_batch, pipeline_spec_of
from lightning_scale.strategies.hybrid.state import ParallelState

__all__ = [
    "TENSOR_PARALLEL_PLAN_HOOK",
    "checkpointed_blocks",
    "count_model_facts",
    "count_recomputation",
    "parallelize",
    "tensor_parallel_plan",
]


TENSOR_PARALLEL_PLAN_HOOK = "tensor_parallel_plan"
"""Name of the LightningModule method that supplies a tensor-parallel plan::

    def tensor_parallel_plan(self, tp_size: int, *, sequence_parallel: bool, loss_parallel: bool)
        -> Mapping[str, ParallelStyle | str]   # module names relative to the LightningModule
"""


def tensor_parallel_plan(module: LightningModule, tp: int, options: ParallelOptions) -> dict[str, ParallelStyle | str]:
    """The plan from the module's ``tensor_parallel_plan`` hook, else from the registered architectures inside it."""
    kwargs = {"sequence_parallel": options.sequence_parallel, "loss_parallel": options.loss_parallel}
    hook = getattr(module, TENSOR_PARALLEL_PLAN_HOOK, None)
    if callable(hook):
        return dict(hook(tp, **kwargs))
    plan: dict[str, ParallelStyle | str] = {}
    for prefix, plan_fn in find_registered_plans(module).items():
        sub = module.get_submodule(prefix) if prefix else module
        plan |= {(f"{prefix}.{k}" if prefix else k): v for k, v in plan_fn(sub, tp, **kwargs).items()}
    if not plan:
        raise ValueError(
            f"tensor_parallel={tp} needs a tensor-parallel plan, but {type(module).__name__} defines no "
            f"`{TENSOR_PARALLEL_PLAN_HOOK}(tp_size, *, sequence_parallel, loss_parallel)` method and contains no "
            "module of a registered architecture (lightning_scale.core.parallel.tensor_parallel.register_plan). "
            "Add the hook, or use tensor_parallel=1."
        )
    return plan


def _blocks_spec(module: LightningModule) -> tuple[str, PipelineSpec] | None:
    hook = getattr(module, PIPELINE_SPEC_HOOK, None)
    return hook() if callable(hook) else find_registered_spec(module)


def count_model_facts(
    module: LightningModule, trainer: Trainer, options: ParallelOptions, state: ParallelState | None = None
) -> ModelFacts:
    """The whole model's facts, before it is cut (``state``: an earlier Trainer cut it; its facts, when
    it counted them); FLOPs counted on meta tensors with one training batch's shapes
    (``ModelFacts.measure``) when neither a hook nor a known config gives them, and what activation
    checkpointing recomputes (:func:`count_recomputation`), when a callback wants them
    (``needs_model_flops``: ``Throughput``)."""
    if state is not None and state.facts is not None:
        return state.facts
    facts = ModelFacts.of(module)
    wanted = any(getattr(callback, "needs_model_flops", False) for callback in trainer.callbacks)
    recomputes = options.activation_checkpointing != "none"
    if (facts.source == "none" or recomputes) and wanted and trainer.state.fn == TrainerFn.FITTING:
        batch = example_batch(trainer)
        if batch is not None:
            batch = before_batch_transfer(module, batch, dataloader_idx=0)
            if facts.source == "none":
                facts.measure(module, batch)
            count_recomputation(module, options, facts, batch)
    return facts


def count_recomputation(module: LightningModule, options: ParallelOptions, facts: ModelFacts, batch: Any) -> None:
    """Before the model is cut: count what checkpointing each of its blocks makes the backward
    recompute (``ModelFacts.measure_recomputation``, on meta tensors with ``batch``'s shapes), for
    ``train/hfu``. Nothing to do without activation checkpointing or declared blocks."""
    found = _blocks_spec(module)
    if options.activation_checkpointing == "none" or found is None:
        return
    root_name, spec = found
    root = module.get_submodule(root_name) if root_name else module
    facts.measure_recomputation(module, batch, [root.get_submodule(b) for b in spec.blocks])


def checkpointed_blocks(rank_blocks: Sequence[Sequence[int]], mode: str, every: int) -> tuple[int, ...]:
    """The blocks (indices in the model's block order) activation checkpointing wraps when every
    pipeline rank applies it to the blocks it holds (``rank_blocks``, each rank's in its order; a
    single list without a pipeline). ``selective`` counts from each rank's first block: a rank with
    ``n`` blocks wraps ``ceil(n / every)`` of them."""
    chosen: list[int] = []
    for blocks in rank_blocks:
        # apply_activation_checkpointing's own choice, read off stand-ins that it wraps (never run).
        stand_ins = [nn.Module() for _ in blocks]
        apply_activation_checkpointing(stand_ins, mode, every)
        chosen += [b for b, m in zip(blocks, stand_ins) if getattr(m, "_lightning_scale_checkpointed", False)]
    return tuple(sorted(chosen))


def _rank_blocks(runner: PipelineRunner) -> list[list[int]]:
    """Every pipeline rank's blocks, in the order its ``block_modules()`` lists them."""
    ranks = stage_ranks(runner.schedule_name, runner.pp_size, runner.num_stages)
    return [
        [b for s in range(runner.num_stages) if ranks[s] == rank for b in runner.partition.blocks(s)]
        for rank in range(runner.pp_size)
    ]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def parallelize(
    module: LightningModule,
    options: ParallelOptions,
    layout: Layout,
    mesh: DeviceMesh,
    *,
    device: torch.device,
    timing_batch: Callable[[], Any],
    mp_policy: MixedPrecisionPolicy | None = None,
    facts: ModelFacts | None = None,
) -> PipelineRunner | None:
    """Cut and shard ``module`` in place into this rank's part of ``layout``, in this order (each step
    sees the module the previous one left, so e.g. FSDP shards the tensor-parallel shards):

    1. pipeline: keep this rank's stage(s), removing the other stages' blocks (names unchanged);
    2. float8 (``float8=``): the blocks' linear layers become torchao's ``Float8Linear`` (:mod:`.float8`);
    3. tensor parallel: the plan (:func:`tensor_parallel_plan`), checked against the whole model,
       applied to the modules kept;
    4. activation checkpointing of blocks (``none``, ``full``, ``selective``: every k-th block of each
       pipeline rank's); which blocks are wrapped on all ranks goes into ``facts`` (``train/hfu``);
    5. activation offloading (``activation_offload=``): each pipeline rank's first N blocks (or those listed)
       keep what they save for the backward in host memory (:mod:`lightning_scale.core.parallel.offload`);
    6. ``torch.compile`` of each block (optional);
    7. data parallel over the ``dp`` mesh: FSDP2 ``replicate``/``fully_shard`` per block, then the
       modules that run them (``mp_policy``: FSDP2's mixed precision, the precision plugin's); none
       under a periodic ``data_parallel_sync`` (:mod:`.data_sync` synchronises the replicas).

    Tensors created on the meta device stay there: the caller then materialises each rank's part
    (:class:`~lightning_scale.strategies.hybrid.deferred.DeferredBuilder`). Plain data parallelism
    (``dp`` only, ``data_parallel_mode="ddp"``) is not applied here: like Lightning's ``DDPStrategy``,
    the strategy wraps the whole LightningModule in ``DistributedDataParallel`` for every Trainer call,
    after that. A module is parallelised once; a later Trainer at the same layout adopts it
    (:class:`~lightning_scale.strategies.hybrid.state.ParallelState`).

    Returns the pipeline runner when ``layout.pp > 1`` (its schedule is built by the caller).
    ``timing_batch()``: ``(inputs, target)`` to time blocks on, for ``partition="by_cost"``.
    """
    found = _blocks_spec(module)
    compiling = options.compiles_on(device)
    if compiling and found is None and options.compile_setting == "auto":
        rank_zero_info(f"compile='auto': {type(module).__name__} declares no blocks, so none is compiled.")
        compiling = False
    offload = options.activation_offload
    needs_blocks = options.activation_checkpointing != "none" or compiling or options.float8 or offload
    if needs_blocks and found is None:
        raise ValueError(
            f"activation_checkpointing={options.activation_checkpointing!r}, compile={options.compile_setting!r}, "
            f"float8={options.float8!r} and activation_offload={offload!r} act on "
            f"the model's blocks, but {type(module).__name__} declares none: define `{PIPELINE_SPEC_HOOK}(self)` "
            "(it lists the blocks) or register the architecture with lightning_scale.core.pipeline.spec.register_pipeline_spec."
        )
    # The plan is checked against the whole model (every key must match a module), then applied to
    # the modules this rank kept.
    plan = resolve_plan(module, tensor_parallel_plan(module, layout.tp, options)) if layout.tp > 1 else {}
    runner = None
    if layout.pp > 1:  # 1. pipeline
        root_name, spec = pipeline_spec_of(module)
        runner = PipelineRunner(
            module.get_submodule(root_name) if root_name else module,
            spec,
            mesh,
            schedule=options.schedule,
            microbatches=options.microbatches or 2 * layout.pp,
            virtual_stages=options.virtual_stages,
            partition=options.partition,
            device=device,
            example_batch=timing_batch() if options.partition == "by_cost" else None,
        )
        rank_zero_info(runner.describe())
    blocks: list[nn.Module] = []
    root: nn.Module | None = None
    if runner is not None:
        blocks, root = runner.block_modules(), runner.root
    elif found is not None:
        root_name, spec = found
        root = module.get_submodule(root_name) if root_name else module
        blocks = [root.get_submodule(b) for b in spec.blocks]
    if options.float8 is not None:  # 2. float8: the blocks' linears swapped, before tensor parallel and FSDP2 wrap them
        convert_float8(blocks, options.float8, device)
    if plan:  # 3. tensor parallel
        kept = {n for n, _ in module.named_modules()}
        apply_tensor_parallel(module, mesh["tp"], {n: s for n, s in plan.items() if n in kept})

    mode, every = options.activation_checkpointing, options.activation_checkpointing_every
    checkpointed = apply_activation_checkpointing(blocks, mode, every)  # 4. activation checkpointing
    if facts is not None:
        facts.checkpointed_blocks = checkpointed_blocks(
            _rank_blocks(runner) if runner is not None else [range(len(blocks))], mode, every
        )
    if checkpointed:
        detail = f"{checkpointed} blocks"
        if facts is not None and layout.pp > 1:
            detail += f" on this rank, {len(facts.checkpointed_blocks)} on all pipeline ranks"
        share = facts.recomputed_share() if facts is not None else None
        if share is not None:
            detail += f"; recomputing them adds {share:.1%} to the training FLOPs (FlopCounterMode, meta tensors)"
        rank_zero_info(f"Activation checkpointing ({mode}): {detail}")
    if offload:  # 5. activation offloading: around the checkpointed forward, inside the compiled call
        indices = _rank_blocks(runner)[mesh["pp"].get_local_rank()] if runner is not None else range(len(blocks))
        chosen = offloaded_blocks(offload, list(indices))  # type: ignore[arg-type]  # "auto" was resolved before
        count = apply_activation_offload(blocks, chosen, pin_memory=device.type == "cuda")
        rank_zero_info(
            f"Activation offloading ({offload!r}): {count} of this rank's {len(blocks)} blocks keep what they save for "
            f"the backward in {'pinned ' if device.type == 'cuda' else ''}host memory"
            + (" (on the CPU the host is the device: nothing moves)" if device.type == "cpu" else "")
        )
    if compiling:  # 6. compile (regional: each block its own graph)
        begin = time.perf_counter()
        count = compile_blocks(blocks)
        rank_zero_info(
            f"torch.compile (compile={options.compile_setting!r}, {device.type}): {count} blocks wrapped in "
            f"{time.perf_counter() - begin:.2f} s; each compiles at its first call (the first training step's "
            "extra time is the compile time)."
        )

    # 7. data parallel (none for a periodic data_parallel_sync: each replica trains alone between synchronisations)
    periodic = options.sync.periodic
    if layout.dp > 1 and not periodic and not ParallelOptions.plain_ddp(layout, options.data_parallel_mode):
        if runner is not None:
            roots = runner.stage_modules()
        else:
            if any(True for _ in module.parameters(recurse=False)):
                raise ValueError(
                    f"{type(module).__name__} holds parameters directly; put them in a submodule so that "
                    f"data_parallel_mode={options.data_parallel_mode!r} can wrap the modules the training step calls."
                )
            # FSDP2 hooks a module's forward: wrap the modules the training step calls, not the LightningModule.
            roots = [root] if root is not None and root is not module else []
            roots += [c for c in module.children() if _has_params(c) and c is not root]
        dp_mesh = mesh["dp_replicate", "dp_shard"] if options.data_parallel_mode == "hsdp" else mesh["dp"]
        apply_data_parallel(
            options.data_parallel_mode, dp_mesh, blocks, roots, pipelined=runner is not None, mp_policy=mp_policy
        )
    return runner
