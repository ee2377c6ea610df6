"""Running a LightningModule's model as one pipeline stage per rank with torch.distributed.pipelining.

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lightning_scale.core.partition import Partition, balanced_partition, bubble_fraction, partition_by_layers
from lightning_scale.core.pipeline import PipelineSpec, find_registered_spec, prune_to_stage
from lightning_scale.core.modules import tied_parameter_groups

__all__ = [
    "PARTITIONS",
    "PIPELINE_SPEC_HOOK",
    "RUNNABLE_SCHEDULES",
    "PipelineRunner",
    "measure_costs",
    "pipeline_spec_of",
]

PIPELINE_SPEC_HOOK = "pipeline_spec"
"""LightningModule method returning ``(root, spec)``: the name of the module whose ``forward``
runs a stage (``""`` for the LightningModule itself) and a :class:`PipelineSpec` relative to it."""

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
RUNNABLE_SCHEDULES = tuple(_SCHEDULES)
PARTITIONS = ("by_layers", "by_params", "by_cost")


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
    """One stage per rank of the ``pp`` mesh dimension; the LightningModule is pruned in place."""

    def __init__(
        self,
        module: LightningModule,
        mesh: DeviceMesh,
        *,
        schedule: str,
        microbatches: int,
        partition: str,
        device: torch.device,
        example_batch: Any = None,
    ) -> None:
        # schedule and partition were checked by the strategy's constructor.
        self.mesh, self.microbatches = mesh, microbatches
        self._shape: tuple[int, ...] | None = None  # stage buffers are sized on the first batch
        self.pp_size, self.pp_rank = mesh.size(), mesh.get_local_rank()
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp_size - 1
        root_name, spec = pipeline_spec_of(module)
        if spec.loss_fn is None:
            raise ValueError("The pipeline spec has no loss_fn; the last stage needs one to compute the loss.")
        root = module.get_submodule(root_name) if root_name else module
        if len(spec.blocks) < self.pp_size:
            raise ValueError(
                f"pipeline_parallel={self.pp_size} is larger than the {len(spec.blocks)} blocks "
                f"{type(root).__name__} declares; use pipeline_parallel <= {len(spec.blocks)}."
            )
        if partition == "by_cost" and example_batch is None:
            raise ValueError(
                "partition='by_cost' times every block on a real batch at set-up, so it needs a datamodule "
                "(trainer.fit(model, datamodule=...)); with plain dataloaders use partition='by_params'."
            )
        self.partition = self._partition(root, spec, partition, example_batch)
        tied = [(names, tuple(root.get_parameter(names[0]).shape)) for names in tied_parameter_groups(root)]
        prune_to_stage(
            root, spec, self.partition.blocks(self.pp_rank), is_first=self.is_first, is_last=self.is_last
        )
        present = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        # A parameter shared by modules on different stages (a tied embedding and output head) now
        # has a copy on each of those stages: their gradients are summed after every backward, so
        # the copies get the single-process gradient and stay equal.
        self._split_ties: list[tuple[nn.Parameter | None, tuple[int, ...], bool]] = []
        for names, shape in tied:
            here = [n for n in names if n in present]
            if here and len(here) == len(names):
                continue  # the whole group stayed on this stage
            param = root.get_parameter(here[0]) if here else None
            # Count the parameter once in the gradient norm: on the first stage that holds it.
            first_holder = torch.tensor([self.pp_rank if here else self.pp_size], device=device)
            dist.all_reduce(first_holder, op=dist.ReduceOp.MIN, group=mesh.get_group())
            self._split_ties.append((param, shape, bool(here) and int(first_holder) == self.pp_rank))
        rank_zero_info(
            f"Pipeline: {self.pp_size} stages by {partition}, blocks per stage "
            f"{[len(self.partition.blocks(s)) for s in range(self.pp_size)]}, stage costs "
            f"{[round(c, 1) for c in self.partition.costs]}, predicted bubble "
            f"{bubble_fraction(schedule, self.pp_size, microbatches):.1%} ({schedule}, {microbatches} micro-batches)"
        )
        self._loss_fn = spec.loss_fn
        self._scale = 1.0
        stage = PipelineStage(root, self.pp_rank, self.pp_size, device, group=mesh.get_group())
        self.schedule = _SCHEDULES[schedule](stage, microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        self._last_global_rank = int(mesh.mesh.flatten()[-1])

    def _partition(self, root: nn.Module, spec: PipelineSpec, kind: str, example_batch: Any) -> Partition:
        if kind == "by_cost":
            weights, first, last = measure_costs(root, spec, self._split(example_batch), self.microbatches)
            # Timings differ a little between ranks; every rank must cut the same way.
            costs = torch.tensor([*weights, first, last], dtype=torch.float64)
            dist.all_reduce(costs, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
            *weights, first, last = costs.tolist()
            self._shape = None  # the example batch does not fix the training shape
            return balanced_partition(weights, self.pp_size, first, last)

        def params(names: Any) -> float:
            return float(sum(p.numel() for n in names for p in root.get_submodule(n).parameters()))

        weights = [params([b]) for b in spec.blocks]
        first, last = params(spec.first), params(spec.last)
        if kind == "by_layers":
            return partition_by_layers(len(weights), self.pp_size, weights, first, last)
        return balanced_partition(weights, self.pp_size, first, last)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target) * self._scale

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"With pipeline parallelism a batch must be (inputs, target); got {type(batch).__name__}. "
                "The first stage feeds inputs to the model, the last compares its output with target."
            )
        inputs, target = batch
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
        return inputs, target

    def _run(self, batch: Any, scale: float, train: bool) -> torch.Tensor:
        inputs, target = self._split(batch)
        self._scale = scale
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []  # one scaled loss per micro-batch, filled on the last stage
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.is_last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        # Only the last stage knows the loss; every rank logs the true value. float64 on every rank:
        # the broadcast must have the same size everywhere, whatever the model's precision.
        loss = torch.zeros((), device=inputs.device, dtype=torch.float64)
        if self.is_last:
            loss = (torch.stack([l.detach() for l in losses]).mean() / scale).to(torch.float64)
        dist.broadcast(loss, src=self._last_global_rank, group=self.mesh.get_group())
        return loss

    def train_step(self, batch: Any, accumulate_grad_batches: int) -> torch.Tensor:
        loss = self._run(batch, 1.0 / (self.microbatches * accumulate_grad_batches), train=True)
        self._sum_split_tie_grads()
        return loss

    def _sum_split_tie_grads(self) -> None:
        for param, shape, _ in self._split_ties:
            # Stages without a copy join with zeros: the collective runs over the whole pp group.
            if param is None:
                grad = torch.zeros(shape, device=self.mesh.device_type)
            else:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            dist.all_reduce(grad, group=self.mesh.get_group())

    def excluded_from_norm(self) -> set[int]:
        """ids of tied copies that another stage already counts in the global gradient norm."""
        return {id(p) for p, _, counted in self._split_ties if p is not None and not counted}

    def eval_step(self, batch: Any) -> torch.Tensor:
        return self._run(batch, 1.0, train=False)


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
