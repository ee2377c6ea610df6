"""Running a LightningModule's model as pipeline stages with torch.distributed.pipelining.

Lightning zeroes gradients after ``training_step`` returns and before ``backward``, so the
schedule (forward and backward together) cannot run inside ``training_step``: the strategy's
``training_step`` keeps the batch and returns a placeholder, and its ``backward`` runs the
schedule. Loss scaling is ours: torch's ``scale_grads`` would divide by the micro-batch count
only, turning gradient accumulation into an average, so each micro-batch loss is multiplied by
``1 / (microbatches * accumulate_grad_batches)`` and ``scale_grads=False``.
"""

from __future__ import annotations

from typing import Any

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _ComputationType
from torch.distributed.tensor import DTensor

from lightning_scale.core.modules import tied_parameter_groups
from lightning_scale.core.partition import (
    Partition,
    balanced_partition,
    bubble_fraction,
    check_schedule_microbatches,
    check_stage_blocks,
    V_SHAPED,
    partition_by_layers,
    stage_ranks,
)
from lightning_scale.core.pipeline import PipelineSpec, find_registered_spec, prune_to_stage, stage_view
from lightning_scale.strategies._options import PARTITIONS

__all__ = [
    "PARTITIONS",
    "PIPELINE_SPEC_HOOK",
    "PipelineRunner",
    "measure_costs",
    "pipeline_spec_of",
]

PIPELINE_SPEC_HOOK = "pipeline_spec"
"""LightningModule method returning ``(root, spec)``: the name of the module whose ``forward``
runs a stage (``""`` for the LightningModule itself) and a :class:`PipelineSpec` relative to it."""

_SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_MULTI = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def pipeline_spec_of(module: LightningModule) -> tuple[str, PipelineSpec]:
    """``(root, spec)`` from the LightningModule's hook, else from the registry of architectures."""
    hook = getattr(module, PIPELINE_SPEC_HOOK, None)
    found = hook() if callable(hook) else find_registered_spec(module)
    if found is None:
        raise ValueError(
            f"pipeline_parallel > 1 needs to know where {type(module).__name__} may be cut, but it declares no "
            f"blocks: define `{PIPELINE_SPEC_HOOK}(self) -> (root_module_name, PipelineSpec(blocks=..., first=..., "
            "last=..., loss_fn=...))` or register the architecture with "
            "lightning_scale.core.pipeline.register_pipeline_spec."
        )
    return found


class PipelineRunner:
    """This rank's pipeline stages (one, or several for interleaved and V-shaped schedules).

    The LightningModule is pruned in place to the union of the rank's stages, so its state dict
    and optimizer hold exactly the parameters this rank trains, under their original names. With
    several stages per rank each stage runs through a :func:`stage_view` of that module.
    """

    def __init__(
        self,
        module: LightningModule,
        mesh: DeviceMesh,
        *,
        schedule: str,
        microbatches: int,
        partition: str,
        device: torch.device,
        virtual_stages: int = 2,
        example_batch: Any = None,
    ) -> None:
        # schedule, partition and the micro-batch count were checked by the strategy's constructor.
        self.mesh, self.pp_mesh = mesh, mesh["pp"]
        self.schedule_name, self.microbatches, self.device = schedule, microbatches, device
        self._shape: tuple[int, ...] | None = None  # stage buffers are sized on the first batch
        self.pp_size, self.pp_rank = self.pp_mesh.size(), self.pp_mesh.get_local_rank()
        root_name, spec = pipeline_spec_of(module)
        if spec.loss_fn is None:
            raise ValueError("The pipeline spec has no loss_fn; the last stage needs one to compute the loss.")
        root = module.get_submodule(root_name) if root_name else module
        per_rank = check_stage_blocks(
            num_blocks=len(spec.blocks), pipeline_parallel=self.pp_size, schedule=schedule, virtual_stages=virtual_stages
        )
        check_schedule_microbatches(schedule, self.pp_size, microbatches)
        self.num_stages = self.pp_size * per_rank
        if partition == "by_cost" and example_batch is None:
            raise ValueError(
                "partition='by_cost' times every block on a real batch at set-up, so it needs a datamodule "
                "(trainer.fit(model, datamodule=...)); with plain dataloaders use partition='by_params'."
            )
        self.partition = self._partition(root, spec, partition, example_batch)
        ranks = stage_ranks(schedule, self.pp_size, self.num_stages)
        self.local_stages = [s for s in range(self.num_stages) if ranks[s] == self.pp_rank]
        self.is_first = 0 in self.local_stages
        self.is_last = self.num_stages - 1 in self.local_stages
        last_rank = ranks[-1]
        self._last_global_rank = int(self.pp_mesh.mesh[last_rank])
        self._replicas = mesh["dp"].size()

        tied = [(names, tuple(root.get_parameter(names[0]).shape)) for names in tied_parameter_groups(root)]
        if mesh["dp"].size() > 1:
            self._check_ties_for_data_parallel(spec, [names for names, _ in tied], ranks)
        keep = sorted(b for s in self.local_stages for b in self.partition.blocks(s))
        prune_to_stage(root, spec, keep, is_first=self.is_first, is_last=self.is_last)
        self._split_ties = self._split_tie_groups(root, tied)
        rank_zero_info(
            f"Pipeline: {self.num_stages} stages on {self.pp_size} ranks ({per_rank} per rank), partition {partition}, blocks "
            f"per stage {[len(self.partition.blocks(s)) for s in range(self.num_stages)]}, stage costs "
            f"{[round(c, 4 if partition == 'by_cost' else 1) for c in self.partition.costs]}"
            f"{' s' if partition == 'by_cost' else ''}, predicted bubble "
            f"{bubble_fraction(schedule, self.pp_size, microbatches, per_rank):.1%} ({schedule}, "
            f"{microbatches} micro-batches)"
        )
        self._loss_fn = spec.loss_fn
        self._scale = 1.0
        self._predicting = False
        self._root, self._spec = root, spec
        self._modules: list[nn.Module] | None = None
        self.schedule: Any = None  # built by `build()`, once the other parallelisms are applied

    @property
    def root(self) -> nn.Module:
        """The module that holds all of this rank's blocks (pruned in place)."""
        return self._root

    def block_modules(self) -> list[nn.Module]:
        """This rank's blocks, in order."""
        return [self._root.get_submodule(self._spec.blocks[b]) for s in self.local_stages for b in self.partition.blocks(s)]

    def stage_modules(self) -> list[nn.Module]:
        """The module each local stage runs: the pruned root itself, or one view per stage."""
        if self._modules is None:
            root, spec = self._root, self._spec
            if len(self.local_stages) == 1:
                self._modules = [root]
            else:
                self._modules = [
                    stage_view(root, spec, self.partition.blocks(s), is_first=s == 0, is_last=s == self.num_stages - 1)
                    for s in self.local_stages
                ]
        return self._modules

    def build(self) -> None:
        """Create the stages and the schedule; call once the other parallelisms are applied."""
        modules = self.stage_modules()
        if self.schedule_name in _SINGLE:
            self.schedule = _SINGLE[self.schedule_name](
                self._stages(modules)[0], self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
            )
        else:
            self.schedule = _MULTI[self.schedule_name](
                self._stages(modules), self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
            )
        self._eval_schedule = self.schedule
        if self.schedule_name in V_SHAPED:
            # torch 2.13's `eval` on V-shaped schedules still runs their backward actions and fails
            # passing gradients between the two stages of rank 0 ("can't steal_bwd_input"). Evaluate
            # with the forward actions of the same schedule, on stages of their own.
            self._eval_schedule = ScheduleZBVZeroBubble(
                self._stages(modules), self.microbatches, loss_fn=self._scaled_loss, scale_grads=False
            )
            # The forward actions and their sends and receives, in the schedule's order: a subset of a
            # deadlock-free order with only forward dependencies, so it cannot deadlock either.
            keep = {_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F}
            keep |= {_ComputationType.UNSHARD, _ComputationType.RESHARD}
            lowered = self._eval_schedule.pipeline_order_with_comms
            self._eval_schedule.pipeline_order_with_comms = {
                rank: [a for a in actions if a.computation_type in keep] for rank, actions in lowered.items()
            }

    def _stages(self, modules: list[nn.Module]) -> list[PipelineStage]:
        group = self.pp_mesh.get_group()
        return [
            PipelineStage(module, s, self.num_stages, self.device, group=group)
            for module, s in zip(modules, self.local_stages, strict=True)
        ]

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

    def _check_ties_for_data_parallel(self, spec: PipelineSpec, tied: list[list[str]], ranks: list[int]) -> None:
        """Data parallelism wraps each stage of a rank on its own; a weight two stages of one rank share
        (a tied embedding and head under a V-shaped schedule) would come apart. Every rank decides alike."""
        for names in tied:
            stages = {s for s in (self._stage_of(spec, n) for n in names) if s is not None}
            by_rank: dict[int, set[int]] = {}
            for s in stages:
                by_rank.setdefault(ranks[s], set()).add(s)
            if any(len(on_rank) > 1 for on_rank in by_rank.values()):
                raise ValueError(
                    f"Parameters {names} are one weight shared by two pipeline stages of one rank (a tied embedding "
                    f"and output head under schedule={self.schedule_name!r}). With data parallelism each stage is "
                    "wrapped on its own, which would break the tie: untie the weights (GPT: tie_embeddings=False) or "
                    "use a schedule that puts the first and last stage on different ranks (gpipe, 1f1b, "
                    "interleaved_1f1b, interleaved_zero_bubble)."
                )

    def _split_tie_groups(
        self, root: nn.Module, tied: list[tuple[list[str], tuple[int, ...]]]
    ) -> list[tuple[str, ProcessGroup | None, bool]]:
        """Parameters shared by modules on different ranks (a tied embedding and output head) now have a
        copy on each of those ranks. Their gradients are summed over just the ranks holding a copy
        after every backward, so every copy gets the single-process gradient and they stay equal.

        Returns ``(parameter name, group, counted)`` for this rank's copies; ``counted`` marks the one
        copy (on the lowest pipeline rank) that enters the global gradient norm. Names, not parameter
        objects: tensor and data parallelism replace the parameters after this runs.
        """
        present = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        # Which pipeline ranks hold each tied group: the same answer on every rank of the mesh.
        holds = torch.zeros(len(tied), self.pp_size, dtype=torch.int32, device=self.device)
        for i, (names, _) in enumerate(tied):
            holds[i, self.pp_rank] = int(any(n in present for n in names))
        dist.all_reduce(holds, group=self.pp_mesh.get_group())
        # Every pipeline group of the mesh (one per dp x tp coordinate) needs its own process group
        # of holders; every rank creates all of them, in the same order (new_group is collective).
        full = self.mesh.mesh
        rows = full.movedim(self.mesh.mesh_dim_names.index("pp"), -1).reshape(-1, self.pp_size).tolist()
        groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        result = []
        for i, (names, _) in enumerate(tied):
            holders = tuple(r for r in range(self.pp_size) if holds[i, r])
            if len(holders) < 2:
                continue  # the whole group lives on one rank: nothing to sum
            if holders not in groups:
                mine = None
                for row in rows:
                    group = dist.new_group([row[r] for r in holders])
                    if dist.get_rank() in [row[r] for r in holders]:
                        mine = group
                groups[holders] = mine
            here = [n for n in names if n in present]
            if here:
                result.append((here[0], groups[holders], self.pp_rank == holders[0]))
        return result

    def _partition(self, root: nn.Module, spec: PipelineSpec, kind: str, example_batch: Any) -> Partition:
        if kind == "by_cost":
            weights, first, last = measure_costs(root, spec, self._split(example_batch), self.microbatches)
            # Timings differ a little between ranks; every rank must cut the same way.
            costs = torch.tensor([*weights, first, last], dtype=torch.float64)
            dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.pp_mesh.get_group())
            *weights, first, last = costs.tolist()
            self._shape = None  # the example batch does not fix the training shape
            return balanced_partition(weights, self.num_stages, first, last)

        def params(names: Any) -> float:
            return float(sum(p.numel() for n in names for p in root.get_submodule(n).parameters()))

        weights = [params([b]) for b in spec.blocks]
        first, last = params(spec.first), params(spec.last)
        if kind == "by_layers":
            return partition_by_layers(len(weights), self.num_stages, weights, first, last)
        return balanced_partition(weights, self.num_stages, first, last)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._predicting:
            return output.new_zeros(())
        return self._loss_fn(output, target) * self._scale

    def _check_shape(self, inputs: torch.Tensor) -> None:
        if self._shape is None:
            self._shape = tuple(inputs.shape)
        elif tuple(inputs.shape) != self._shape:
            raise ValueError(
                f"Pipeline schedules need fixed-shape batches: the first batch had inputs of shape {self._shape}, "
                f"this one {tuple(inputs.shape)}. Use fixed-length sequences and drop_last=True (TextDataModule does)."
            )
        if inputs.size(0) % self.microbatches:
            raise ValueError(
                f"microbatches={self.microbatches} does not divide the per-replica batch of {inputs.size(0)} samples; "
                "pipeline schedules need equal micro-batches. Choose microbatches dividing the batch size."
            )

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"With pipeline parallelism a batch must be (inputs, target); got {type(batch).__name__}. "
                "The first stage feeds inputs to the model, the last compares its output with target."
            )
        inputs, target = batch
        self._check_shape(inputs)
        return inputs, target

    def _run(self, batch: Any, scale: float, train: bool) -> torch.Tensor:
        inputs, target = self._split(batch)
        self._scale = scale
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []  # one scaled loss per micro-batch, filled on the last stage
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        if train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            self._eval_schedule.eval(*args, **kwargs)
        # Only the last stage knows the loss; every rank logs the true value, averaged over the
        # data-parallel replicas: one collective per step. float64 on every rank: the collective
        # must have the same size everywhere, whatever the model's precision.
        loss = torch.zeros((), device=inputs.device, dtype=torch.float64)
        if self.is_last:
            loss = (torch.stack([_local(l.detach()) for l in losses]).mean() / scale).to(torch.float64)
        if self._replicas == 1:
            dist.broadcast(loss, src=self._last_global_rank, group=self.pp_mesh.get_group())
        else:
            # Every rank of the last stage (each data-parallel replica, each tensor shard) holds its
            # replica's loss; the others contribute zero.
            dist.all_reduce(loss)
            loss /= self._replicas * self.mesh["tp"].size()
        return loss

    def train_step(self, batch: Any, accumulate_grad_batches: int) -> torch.Tensor:
        loss = self._run(batch, 1.0 / (self.microbatches * accumulate_grad_batches), train=True)
        for name, group, _ in self._split_ties:
            param = self._root.get_parameter(name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(_local(param.grad), group=group)
        return loss

    def excluded_from_norm(self) -> set[int]:
        """ids of tied copies that another stage already counts in the global gradient norm."""
        return {id(self._root.get_parameter(n)) for n, _, counted in self._split_ties if not counted}

    def eval_step(self, batch: Any) -> torch.Tensor:
        return self._run(batch, 1.0, train=False)

    def predict_step(self, batch: Any) -> Any:
        """The last stage's output for the batch's inputs, returned on every rank."""
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(
                f"With pipeline parallelism predict batches must be an inputs tensor or (inputs, ...); got "
                f"{type(inputs).__name__}."
            )
        self._check_shape(inputs)
        # The schedule computes a loss on the last stage whenever it has a loss function; while
        # predicting that loss is a placeholder (the inputs stand in for the absent target).
        self._predicting = True
        try:
            output = self._eval_schedule.eval(
                *((inputs,) if self.is_first else ()), **({"target": inputs} if self.is_last else {})
            )
        finally:
            self._predicting = False
        if isinstance(output, DTensor):
            output = output.full_tensor()
        box = [output.cpu() if self.is_last else None]
        dist.broadcast_object_list(box, src=self._last_global_rank, group=self.pp_mesh.get_group())
        return box[0].to(inputs.device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def measure_costs(
    root: nn.Module, spec: PipelineSpec, batch: tuple[Any, Any], microbatches: int, repeats: int = 2
) -> tuple[list[float], float, float]:
    """Seconds of forward + backward of each block, of the ``first`` modules and of the ``last``
    modules with the loss, on one micro-batch of ``batch`` (the fastest of ``repeats`` runs).

    One forward of the whole model records every module's inputs; each piece is then replayed on
    its own with fresh leaf inputs, so its backward is timed without the rest of the graph.
    """
    inputs, target = batch
    inputs, target = inputs[: inputs.size(0) // microbatches], target[: target.size(0) // microbatches]
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {}
    handles = []
    for name in [*spec.blocks, *spec.first, *spec.last]:

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            captured[name] = (args, kwargs, output)

        handles.append(root.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            root(inputs)
    finally:
        for handle in handles:
            handle.remove()

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    def timed(names: Sequence[str], with_loss: bool = False) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            total: torch.Tensor | None = None
            for name in names:
                args, kwargs, _ = captured[name]
                out = root.get_submodule(name)(*[leaf(a) for a in args], **kwargs)
                if with_loss and name == names[-1]:
                    out = spec.loss_fn(out, target) if spec.loss_fn is not None else out
                piece = out.float().sum() if isinstance(out, torch.Tensor) else None
                if piece is not None:
                    total = piece if total is None else total + piece
            if total is not None and total.requires_grad:
                total.backward()
            best = min(best, time.perf_counter() - start)
        root.zero_grad(set_to_none=True)
        return best

    weights = [timed([b]) for b in spec.blocks]
    return weights, timed(list(spec.first)) if spec.first else 0.0, timed(list(spec.last), with_loss=True) if spec.last else 0.0
