"""This rank's pipeline stages of a model, and the steps that run them (no Lightning here).

The model is pruned in place to the union of the rank's stages, so its state dict and optimizer
hold exactly the parameters this rank trains, under their original names. With several stages per
rank (interleaved and V-shaped schedules) each stage runs through a
:func:`~lightning_scale.core.pipeline.spec.stage_view` of that module.

The batch's loss is what the spec's ``loss_fn`` gives on the whole batch: each micro-batch's loss is
weighted by its share of the batch's positions (:mod:`lightning_scale.core.pipeline.loss`). Further
scaling is the caller's: torch's
``scale_grads`` would divide by the micro-batch count only, turning gradient accumulation into an
average, so each weighted loss is multiplied by the ``scale`` passed to
:meth:`PipelineRunner.train_step` (``loss scale / accumulation``) and the schedules run with
``scale_grads=False``.

Extra model inputs (``kwargs``: ``position_ids`` of packed sequences, an attention mask, ...) are
split into micro-batches like the inputs and reach the forward of every stage, not only the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_scale.core.parallel.modules import tied_parameter_groups
from lightning_scale.core.pipeline.block_costs import cut_model
from lightning_scale.core.pipeline.loss import MicroBatchLoss
from lightning_scale.core.pipeline.partition import (
    V_SHAPED,
    bubble_fraction,
    check_schedule_microbatches,
    check_stage_blocks,
    stage_ranks,
)
from lightning_scale.core.pipeline.schedules import build_schedule, forward_only_schedule, make_stages
from lightning_scale.core.pipeline.spec import (
    PipelineSpec,
    StageForward,
    prune_to_stage,
    removed_module_called,
    removed_modules,
    stage_view,
    undeclared_buffers,
    undeclared_parameters,
)
from lightning_scale.core.pipeline.structure import DescriptionLink, StructuredEdges, gloo_group, map_tensors
from lightning_scale.core.pipeline.ties import TiedCopies, check_ties_for_data_parallel
from lightning_scale.core.pipeline.timing import StageTimer

__all__ = ["PipelineRunner"]

Inputs = torch.Tensor | tuple[torch.Tensor, ...]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_args(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


# What torch's schedule `step` takes itself; a model input of that name would be taken for it.
_STEP_ARGUMENTS = ("target", "losses", "return_outputs", "loss_kwargs")


class PipelineRunner:
    """This rank's pipeline stages (one, or several for interleaved and V-shaped schedules).

    Args:
        root: the module whose ``forward`` runs a stage; pruned in place.
        spec: where ``root`` may be cut, and the loss.
        mesh: the device mesh; its ``"pp"`` dimension is the pipeline, ``"dp"`` the replicas.
        schedule, microbatches, virtual_stages: torch's schedule, by name (``core.pipeline.partition.SCHEDULES``).
        partition: ``by_layers``, ``by_params`` or ``by_cost`` (needs ``example_batch``).
        example_batch: ``(inputs, target)`` to time blocks on for ``by_cost``.

    Call :meth:`build` once the other parallelisms are applied (and again to change the
    micro-batch count or start a new shape).
    """

    def __init__(
        self,
        root: nn.Module,
        spec: PipelineSpec,
        mesh: DeviceMesh,
        *,
        schedule: str,
        microbatches: int,
        partition: str,
        device: torch.device,
        virtual_stages: int = 2,
        example_batch: tuple[Inputs, Any] | None = None,
    ) -> None:
        if spec.loss_fn is None:
            raise ValueError("The pipeline spec has no loss_fn; the last stage needs one to compute the loss.")
        self.mesh, self.pp_mesh = mesh, mesh["pp"]
        self.schedule_name, self.microbatches, self.device = schedule, microbatches, device
        self.pp_size, self.pp_rank = self.pp_mesh.size(), self.pp_mesh.get_local_rank()
        self._per_rank = check_stage_blocks(
            num_blocks=len(spec.blocks),
            pipeline_parallel=self.pp_size,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        check_schedule_microbatches(schedule, self.pp_size, microbatches)
        self.num_stages = self.pp_size * self._per_rank
        if partition == "by_cost" and example_batch is None:
            raise ValueError("partition='by_cost' times every block on a real batch, but no example batch was given.")
        self.partition_kind = partition
        self.partition = cut_model(
            root, spec, partition, self.num_stages, self.microbatches, example_batch, self.device
        )
        ranks = stage_ranks(schedule, self.pp_size, self.num_stages)
        self.local_stages = [s for s in range(self.num_stages) if ranks[s] == self.pp_rank]
        self.is_first = 0 in self.local_stages
        self.is_last = self.num_stages - 1 in self.local_stages
        self._last_global_rank = int(self.pp_mesh.mesh[ranks[-1]])
        self._replicas = mesh["dp"].size()
        # Stage outputs that are dicts, dataclasses or ModelOutputs cross the cut as their tensors.
        link = DescriptionLink([int(self.pp_mesh.mesh[r]) for r in ranks], gloo_group(mesh))
        self._edges = StructuredEdges(link, self.num_stages)

        tied = tied_parameter_groups(root)
        self.tied_groups = [list(names) for names in tied]
        """Names (in ``root``) of each weight shared by several modules of the whole model (before pruning), first name first."""
        self.shared_parameters = undeclared_parameters(root, spec)
        """Parameters outside every module the spec places: each stage keeps a copy, kept in step."""
        if self._replicas > 1:
            check_ties_for_data_parallel(tied, lambda name: self._stage_of(spec, name), ranks, schedule)
            self._check_shared_for_data_parallel(root)
        keep = sorted(b for s in self.local_stages for b in self.partition.blocks(s))
        # Buffers every stage keeps a copy of must not change in training (checked on the first step).
        self._shared_buffers: list[str] | None = undeclared_buffers(root, spec)
        # What a forward may find missing: what the stage it runs (its view, with several stages) lacks.
        by_stage = [
            removed_modules(spec, self.partition.blocks(s), s == 0, s == self.num_stages - 1) for s in self.local_stages
        ]
        self._removed = [n for n in dict.fromkeys(n for names in by_stage for n in names) if n not in spec.identity]
        prune_to_stage(root, spec, keep, is_first=self.is_first, is_last=self.is_last)
        # A parameter every stage holds is a weight tied across all of them: its copies' gradients are
        # summed (the stages that do not use it add zeros), so every copy takes the one-process step.
        tied_names = {n for names in tied for n in names}
        groups = [*tied, *([n] for n in self.shared_parameters if n not in tied_names)]
        self._ties = TiedCopies(root, groups, mesh, device)
        self._loss = MicroBatchLoss(spec.loss_fn, spec.loss_tokens)
        self._loss.rebuild = self._edges.rebuild_output
        self._root, self._spec = root, spec
        self._modules: list[nn.Module] | None = None
        self._shape: tuple[tuple[int, ...], ...] | None = None  # fixed by the first batch after `build`
        self.sync_grads = True
        """False on accumulation micro-steps: no data-parallel reduction, no tied-copy sum."""
        self.schedule: Any = None
        self._eval_schedule: Any = None
        self.batches_described = False
        """Whether the strategy has said how it reads this runner's batches (it does so once)."""
        self.timer = StageTimer(device)
        """Compute and step time of the training schedule on this rank (``core.pipeline.timing``)."""
        self.metrics: dict[str, tuple[float, Any]] = {}
        """What the last step's loss reported to log (:meth:`MicroBatchLoss.finish`), averaged over replicas."""

    def use_loss(self, loss: MicroBatchLoss) -> None:
        """Run ``loss`` on the last stage instead of the spec's (e.g. the user's own step per micro-batch)."""
        loss.rebuild = self._edges.rebuild_output
        self._loss = loss
        if self.schedule is not None:
            self.build()

    @property
    def loss(self) -> MicroBatchLoss:
        return self._loss

    def describe(self) -> str:
        """One line for the start-up log: stages, partition, costs and the predicted bubble."""
        by_cost = self.partition_kind == "by_cost"
        costs = [round(c, 4 if by_cost else 1) for c in self.partition.costs]
        bubble = bubble_fraction(self.schedule_name, self.pp_size, self.microbatches, self._per_rank)
        return (
            f"Pipeline: {self.num_stages} stages on {self.pp_size} ranks ({self._per_rank} per rank), partition "
            f"{self.partition_kind}, blocks per stage {[len(self.partition.blocks(s)) for s in range(self.num_stages)]}, "
            f"stage costs {costs}{' s' if by_cost else ''}, predicted bubble {bubble:.1%} ({self.schedule_name}, "
            f"{self.microbatches} micro-batches)"
            + (f"; on every stage, kept in step: {self.shared_parameters}" if self.shared_parameters else "")
        )

    def _check_shared_for_data_parallel(self, root: nn.Module) -> None:
        if self.shared_parameters and self._per_rank > 1:
            raise ValueError(
                f"{self.shared_parameters[:4]} are parameters of {type(root).__name__} outside every module its "
                "pipeline spec places (blocks, first, last), so every stage holds them. With data parallelism each of "
                f"a rank's {self._per_rank} stages (schedule={self.schedule_name!r}) is wrapped on its own, which "
                "would wrap them twice: move them into a module listed in the spec's first (or last), or use a "
                "schedule with one stage per rank (gpipe, 1f1b)."
            )

    @property
    def root(self) -> nn.Module:
        """The module that holds all of this rank's blocks (pruned in place)."""
        return self._root

    @property
    def spec(self) -> PipelineSpec:
        return self._spec

    def block_modules(self) -> list[nn.Module]:
        """This rank's blocks, in order."""
        return [
            self._root.get_submodule(self._spec.blocks[b]) for s in self.local_stages for b in self.partition.blocks(s)
        ]

    def stage_modules(self) -> list[nn.Module]:
        """The module each local stage runs: the pruned root itself, or one view per stage (each in a
        :class:`StageForward` when the spec says how a stage runs)."""
        if self._modules is None:
            root, spec = self._root, self._spec
            if len(self.local_stages) == 1:
                modules = [root]
            else:
                modules = [
                    stage_view(root, spec, self.partition.blocks(s), is_first=s == 0, is_last=s == self.num_stages - 1)
                    for s in self.local_stages
                ]
            if spec.stage_forward is not None:
                modules = [StageForward(m, spec.stage_forward) for m in modules]
            self._modules = modules
        return self._modules

    def build(self, microbatches: int | None = None) -> None:
        """Create the stages and schedules (again: a new micro-batch count, or batches of a new shape)."""
        if microbatches is not None:
            check_schedule_microbatches(self.schedule_name, self.pp_size, microbatches)
            self.microbatches = microbatches
        modules, group = self.stage_modules(), self.pp_mesh.get_group()
        self._edges.attach(modules, self.local_stages)

        def stages() -> list[Any]:
            return make_stages(modules, self.local_stages, self.num_stages, self.device, group, lambda: self.sync_grads)

        train_stages = stages()
        for stage in train_stages:
            self.timer.wrap(stage)
        self.schedule = build_schedule(self.schedule_name, train_stages, self.microbatches, self._loss)
        eval_stages = stages() if self.schedule_name in V_SHAPED else []  # the V's eval needs stages of its own
        self._eval_schedule = forward_only_schedule(
            self.schedule_name, eval_stages, self.microbatches, self._loss, self.schedule
        )
        self._shape = None

    def _stage_of(self, spec: PipelineSpec, param_name: str) -> int | None:
        """The stage whose modules hold ``param_name`` (None: outside every declared module)."""

        def owner(module: str) -> bool:
            return param_name.startswith(module + ".")

        if any(owner(m) for m in spec.first):
            return 0
        if any(owner(m) for m in spec.last):
            return self.num_stages - 1
        for b, block in enumerate(spec.blocks):
            if owner(block):
                return next(s for s in range(self.num_stages) if b in self.partition.blocks(s))
        return None

    def _check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        clash = sorted(set(kwargs) & set(_STEP_ARGUMENTS))
        if clash:
            raise ValueError(
                f"The batch's extra model inputs {clash} have names that torch's pipeline schedule takes for itself "
                f"({', '.join(_STEP_ARGUMENTS)}); rename them in pipeline_batch and in the model's forward."
            )

    def _check_shape(self, inputs: Inputs) -> None:
        args = _as_args(inputs)
        if not args or not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError(
                f"Pipeline inputs must be a tensor or a tuple of tensors (split into micro-batches on dim 0), got "
                f"{type(inputs).__name__}."
            )
        shape = tuple(tuple(a.shape) for a in args)
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            first = self._shape[0] if len(self._shape) == 1 else self._shape
            now = shape[0] if len(shape) == 1 else shape
            raise ValueError(
                f"Pipeline schedules need fixed-shape batches: the first batch had inputs of shape {first}, "
                f"this one {now}. Use fixed-length sequences and drop_last=True (TextDataModule does)."
            )
        size = args[0].size(0)
        if size % self.microbatches:
            raise ValueError(
                f"microbatches={self.microbatches} does not divide the per-replica batch of {size} samples; "
                "pipeline schedules need equal micro-batches. Choose microbatches dividing the batch size."
            )

    def _run(self, inputs: Inputs, target: Any, kwargs: Mapping[str, Any], scale: float, train: bool) -> torch.Tensor:
        self._check_shape(inputs)
        self._check_kwargs(kwargs)
        indices = self._loss.set_targets(target, self.microbatches)
        self._loss.scale = scale
        args = _as_args(inputs) if self.is_first else ()
        losses: list[torch.Tensor] = []  # one weighted, scaled loss per micro-batch, filled on the last stage
        step: dict[str, Any] = {"target": indices, "losses": losses} if self.is_last else {}
        self._edges.active = True
        try:
            if train:
                with self.timer.span("step"):
                    self.schedule.step(*args, return_outputs=False, **step, **kwargs)
            else:
                self._eval_schedule.eval(*args, **step, **kwargs)
        except (RuntimeError, TypeError) as err:
            # torch wraps a stage's forward error in a RuntimeError, except on the first step, whose
            # shape inference calls the stage's module directly.
            cause = err.__cause__ if isinstance(err, RuntimeError) else err
            called = removed_module_called(cause, self._root, self._spec, self._removed)
            if called is not None:
                raise ValueError(called) from err
            raise
        finally:
            self._edges.active = False
            self._edges.link.wait()
        refusal, metrics = self._loss.finish() if self.is_last else (None, {})
        # Only the last stage knows the loss (and whether its loss refused the step, and what it logs);
        # every rank gets the true value, averaged over the data-parallel replicas: one collective per
        # step. float64 on every rank: the collective must have the same size everywhere, whatever the
        # model's precision.
        head = torch.zeros(3, device=self.device, dtype=torch.float64)
        if self.is_last:
            head[0] = torch.stack([_local(l.detach()).to(torch.float64) for l in losses]).sum() / scale
            head[1], head[2] = float(refusal is not None), float(bool(metrics))
        if self._replicas == 1:
            dist.broadcast(head, src=self._last_global_rank, group=self.pp_mesh.get_group())
        else:
            # Every rank of the last stage (each data-parallel replica, each tensor shard) holds its
            # replica's loss; the others contribute zero.
            dist.all_reduce(head)
            head[0] /= self._replicas * self.mesh["tp"].size()
        self.metrics = {}
        if bool((head[1:] > 0).any()):  # rarely: a refusal, or a step that logs
            self.metrics = self._gathered(refusal, metrics)
        return head[0]

    def _gathered(
        self, refusal: str | None, metrics: dict[str, tuple[torch.Tensor, Any]]
    ) -> dict[str, tuple[float, Any]]:
        """Every last stage's refusal and values, on every rank: raises the first refusal; else each
        value averaged over the replicas (every last stage must report the same names)."""
        mine = (refusal, {k: (float(v), extra) for k, (v, extra) in metrics.items()}) if self.is_last else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        reports = [g for g in gathered if g is not None]
        refusals = [r for r, _ in reports if r is not None]
        if refusals:
            raise ValueError(refusals[0])
        names = [list(m) for _, m in reports]
        if any(n != names[0] for n in names):
            raise ValueError(
                f"The pipeline's last stages logged different metrics in one step ({names[0]} and "
                f"{next(n for n in names if n != names[0])}): every data-parallel replica must log the same names."
            )
        return {name: (sum(m[name][0] for _, m in reports) / len(reports), reports[0][1][name][1]) for name in names[0]}

    def train_step(
        self, inputs: Inputs, target: Any, scale: float, kwargs: Mapping[str, Any] | None = None
    ) -> torch.Tensor:
        """Forward and backward of one batch; returns its (unscaled) loss on every rank.

        Each micro-batch's weighted loss is multiplied by ``scale`` before its backward. ``kwargs``:
        extra model inputs, split like ``inputs``, for every stage. With ``sync_grads`` (the last
        micro-step of an accumulation window) the tied and shared copies' gradients are summed.
        """
        shared = self._shared_buffers
        before = {n: _local(self._root.get_buffer(n)).detach().clone() for n in shared} if shared is not None else None
        loss = self._run(inputs, target, kwargs or {}, scale, train=True)
        if self.sync_grads:
            self._ties.all_reduce_grads()
        if before is not None:
            self._shared_buffers = None
            self._check_shared_buffers(before)
        return loss

    def _check_shared_buffers(self, before: dict[str, torch.Tensor]) -> None:
        """Refuse, on every rank, buffers outside the declared modules that the first training step
        changed: each stage has its own copy, and only the stage that ran the module updates its own."""
        if not before:  # the same on every rank: the same model
            return
        changed = [n for n, value in before.items() if not torch.equal(_local(self._root.get_buffer(n)), value)]
        flag = torch.tensor(float(bool(changed)), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        names: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(names, changed)
        found = sorted({n for part in names for n in part or []})
        raise ValueError(
            f"Buffers {found[:4]} of {type(self._root).__name__} lie outside every module its pipeline spec places "
            "(blocks, first, last), so every stage keeps a copy, and the first training step changed them (a "
            "running statistic, a counter): the copies now differ and a checkpoint could hold either. Put the "
            "module that updates them in the spec's first or last (or make it a block)."
        )

    def excluded_from_norm(self) -> set[int]:
        """ids of tied copies that another stage already counts in the global gradient norm."""
        return self._ties.excluded_from_norm()

    def eval_step(self, inputs: Inputs, target: Any, kwargs: Mapping[str, Any] | None = None) -> torch.Tensor:
        """Forward only; the batch's loss on every rank."""
        return self._run(inputs, target, kwargs or {}, 1.0, train=False)

    def predict_step(self, inputs: Inputs, kwargs: Mapping[str, Any] | None = None) -> Any:
        """The last stage's output for ``inputs``, returned on every rank."""
        self._check_shape(inputs)
        kwargs = kwargs or {}
        self._check_kwargs(kwargs)
        args = _as_args(inputs)
        # The schedule computes a loss on the last stage whenever it has a loss function; while
        # predicting that loss is a placeholder.
        self._loss.predicting = True
        self._edges.active = True
        try:
            step = {"target": torch.arange(self.microbatches)} if self.is_last else {}
            output = self._eval_schedule.eval(*(args if self.is_first else ()), **step, **kwargs)
        finally:
            self._loss.predicting = False
            self._edges.active = False
            self._edges.link.wait()
        box = [None]
        if self.is_last:
            whole = self._edges.rebuild_output(output)
            box = [map_tensors(whole, lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).cpu())]
        dist.broadcast_object_list(box, src=self._last_global_rank, group=self.pp_mesh.get_group())
        return map_tensors(box[0], lambda t: t.to(args[0].device))
