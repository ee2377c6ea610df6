"""Timing a model's pipeline pieces (each block, the modules before and after them) for ``by_cost``."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_scale.core.compat import module_buffers, module_parameters
from lightning_scale.core.parallel.deferred_init import has_meta_tensors
from lightning_scale.core.pipeline.partition import Partition, balanced_partition, partition_by_layers
from lightning_scale.core.pipeline.spec import PipelineSpec

__all__ = ["cut_model", "measure_costs", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: accelerators run kernels asynchronously, so a wall
    clock read without this times the kernel launches, not the kernels. A no-op on CPU."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        torch.accelerator.synchronize(device)


@contextmanager
def stand_in_tensors(
    modules: Sequence[nn.Module], device: torch.device, skip: Sequence[nn.Module] = ()
) -> Iterator[None]:
    """Random tensors on ``device`` in place of the meta tensors of ``modules`` (not of those inside
    ``skip``) while the block runs, for timing a model that is not materialised yet: only what runs
    is real. The meta tensors (the very objects, so ties and plans stay valid) come back after."""
    skipped = {id(m) for s in skip for m in s.modules()}
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    real: dict[int, torch.Tensor] = {}
    for module in {id(m): m for top in modules for m in top.modules() if id(m) not in skipped}.values():
        params = module_parameters(module)
        for table in (params, module_buffers(module)):
            for attr, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in real:
                    value = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    value.normal_(0.0, 0.02) if value.is_floating_point() else value.zero_()
                    real[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if table is params else value
                saved.append((table, attr, tensor))
                table[attr] = real[id(tensor)]
    try:
        yield
    finally:
        for table, attr, tensor in saved:
            table[attr] = tensor


def _device_of(module: nn.Module) -> torch.device:
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta:
            return tensor.device
    return torch.device("cpu")


def measure_costs(
    root: nn.Module, spec: PipelineSpec, batch: tuple[Any, Any], microbatches: int, repeats: int = 2
) -> tuple[list[float], float, float]:
    """Seconds of forward + backward of each block, of the ``first`` modules and of the ``last``
    modules with the loss, on one micro-batch of ``batch`` (the fastest of ``repeats`` runs).

    One forward of the whole model records every module's inputs; each piece is then replayed on
    its own with fresh leaf inputs, so its backward is timed without the rest of the graph. The
    device is synchronised before every clock read. The modules run in eval mode, so timing leaves
    no trace in the run (no batch-norm statistics updated, no dropout random numbers drawn), and
    leaves no gradients behind.
    """
    training = {m: m.training for m in root.modules()}
    root.eval()
    try:
        return _measure(root, spec, batch, microbatches, repeats)
    finally:
        for module, mode in training.items():
            module.training = mode


def _measure(
    root: nn.Module, spec: PipelineSpec, batch: tuple[Any, Any], microbatches: int, repeats: int
) -> tuple[list[float], float, float]:
    inputs, target = batch
    inputs = inputs[: max(inputs.size(0) // microbatches, 1)]
    if isinstance(target, torch.Tensor):
        target = target[: max(target.size(0) // microbatches, 1)]
    deferred = has_meta_tensors(root)
    device = inputs.device if deferred else _device_of(root)
    pieces = [root.get_submodule(n) for n in [*spec.blocks, *spec.first, *spec.last]]
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any], Any]] = {}
    handles = []
    for name in [*spec.blocks, *spec.first, *spec.last]:

        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            captured[name] = (args, kwargs, output)

        handles.append(root.get_submodule(name).register_forward_hook(hook, with_kwargs=True))
    running = ExitStack()

    def enter(module: nn.Module, args: Any) -> None:
        running.enter_context(stand_in_tensors([module], device))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.close()

    if deferred:
        # Each piece is real only while it runs; the rest (a root's tables, a rotary embedding) throughout.
        for piece in pieces:
            handles += [piece.register_forward_pre_hook(enter), piece.register_forward_hook(leave)]
    try:
        with torch.no_grad(), stand_in_tensors([root], device, skip=pieces) if deferred else nullcontext():
            root(inputs)
    finally:
        for handle in handles:
            handle.remove()

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    def timed(names: Sequence[str], with_loss: bool = False) -> float:
        modules = [root.get_submodule(n) for n in names]
        with stand_in_tensors(modules, device) if deferred else nullcontext():
            return _timed(names, with_loss)

    def _timed(names: Sequence[str], with_loss: bool) -> float:
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            total: torch.Tensor | None = None
            for name in names:
                args, kwargs, _ = captured[name]
                out = root.get_submodule(name)(*[leaf(a) for a in args], **kwargs)
                if with_loss and name == names[-1] and spec.loss_fn is not None and target is not None:
                    out = spec.loss_fn(out, target)
                piece = out.float().sum() if isinstance(out, torch.Tensor) else None
                if piece is not None:
                    total = piece if total is None else total + piece
            if total is not None and total.requires_grad:
                total.backward()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        root.zero_grad(set_to_none=True)
        return best

    weights = [timed([b]) for b in spec.blocks]
    first = timed(list(spec.first)) if spec.first else 0.0
    last = timed(list(spec.last), with_loss=True) if spec.last else 0.0
    return weights, first, last


def cut_model(
    root: nn.Module,
    spec: PipelineSpec,
    kind: str,
    num_stages: int,
    microbatches: int,
    example_batch: Any,
    device: torch.device,
) -> Partition:
    """Cut ``spec``'s blocks into ``num_stages`` stages: ``by_layers`` (equal block counts), ``by_params``
    (balanced parameter counts) or ``by_cost`` (blocks timed on ``example_batch``, an ``(inputs, target)``
    pair, split into ``microbatches``; collective: every rank of the world takes the slowest timing of
    each piece, so all cut alike)."""
    if kind == "by_cost":
        inputs, target = example_batch
        if isinstance(inputs, tuple):
            raise ValueError("partition='by_cost' times blocks on a single inputs tensor; use 'by_params'.")
        weights, first, last = measure_costs(root, spec, (inputs, target), microbatches)
        # Timings differ between ranks; every rank of the mesh must cut the same way (not just the
        # ranks of one pipeline: replicas and tensor-parallel peers must hold the same blocks too).
        costs = torch.tensor([*weights, first, last], dtype=torch.float64, device=device)
        dist.all_reduce(costs, op=dist.ReduceOp.MAX)
        *weights, first, last = costs.tolist()
        return balanced_partition(weights, num_stages, first, last)

    def params(names: Any) -> float:
        return float(sum(p.numel() for n in names for p in root.get_submodule(n).parameters()))

    weights = [params([b]) for b in spec.blocks]
    first, last = params(spec.first), params(spec.last)
    if kind == "by_layers":
        return partition_by_layers(len(weights), num_stages, weights, first, last)
    return balanced_partition(weights, num_stages, first, last)
