"""The loss a pipeline's last stage computes: the spec's ``loss_fn`` on each micro-batch, weighted so
that the batch's loss is what ``loss_fn`` gives on the whole batch at one process.

A cross entropy that ignores some positions (labels of -100: prompts, padding, document ends)
averages over the labelled ones. The mean of the micro-batches' means is not that mean when the
micro-batches hold different numbers of labelled positions. So each micro-batch's loss counts by
its share of the batch's positions (``PipelineSpec.loss_tokens``, counted on every micro-batch
before the schedule runs): the sum over the micro-batches divided once by the batch's count.

torch's schedules split the target themselves and call the loss with each piece. They are given
the micro-batch indices as the target instead (``arange(microbatches)``), so the loss receives its
micro-batch's index and looks up its own target (any structure of tensors) and weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_scale.core.pipeline.spec import IGNORE_INDEX

__all__ = ["MicroBatchLoss", "split_microbatches", "tensors_of", "zero_loss"]


def split_microbatches(value: Any, n: int) -> list[Any]:
    """``value`` (tensors, possibly inside tuples, lists and dicts) as ``n`` micro-batches along dim 0,
    as torch's schedules split inputs; anything else is shared by every micro-batch."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(n))
    if isinstance(value, (tuple, list)):
        parts = [split_microbatches(v, n) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(n)]
    if isinstance(value, Mapping):
        split = {k: split_microbatches(v, n) for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(n)]
    return [value] * n


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value`` (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_of(v)]
    return []


def zero_loss(output: Any) -> torch.Tensor:
    """A loss of exactly zero whose backward gives every output element a zero gradient: a micro-batch
    with nothing labelled still runs its backward, as the schedule's other stages expect (its own loss
    would be 0/0)."""
    return tensors_of(output)[0].sum() * 0.0


class MicroBatchLoss:
    """The loss function handed to torch's schedules: ``loss(output, index)``.

    Args:
        loss_fn: ``loss_fn(output, target)``, the spec's (a mean over what ``loss_tokens`` counts).
        loss_tokens: ``loss_tokens(target) -> count`` of the positions ``loss_fn`` averages over, or
            ``None``: micro-batches count equally (and integer targets holding -100 are refused).

    Call :meth:`set_targets` before each schedule step; ``scale`` multiplies every weighted loss
    (the precision plugin's loss scale over the accumulation steps), ``predicting`` makes every loss
    a placeholder zero. ``rebuild`` turns the output torch hands over back into what the model
    returned (:meth:`~lightning_scale.core.pipeline.structure.StructuredEdges.rebuild_output`).

    Subclasses may run another loss per micro-batch (the user's own step): ``target_of`` picks what
    ``loss_tokens`` counts in a micro-batch's target, and :meth:`finish`, called on the last stage after
    each schedule step, reports a refusal and the values to log.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], loss_tokens: Callable[[Any], Any] | None) -> None:
        self.loss_fn, self.loss_tokens = loss_fn, loss_tokens
        self.scale = 1.0
        self.predicting = False
        self.targets: list[Any] = []
        self.weights: list[float] = []
        self.rebuild: Callable[[Any], Any] = lambda output: output

    def target_of(self, target: Any) -> Any:
        """What ``loss_tokens`` counts in (and the -100 check reads from) a target."""
        return target

    def finish(self) -> tuple[str | None, dict[str, tuple[torch.Tensor, Any]]]:
        """After a schedule step, on the last stage: ``(refusal or None, {name: (value, extra)})`` of what
        to log (the value a float64 tensor, ``extra`` passed through to the caller)."""
        return None, {}

    def set_targets(self, target: Any, microbatches: int) -> torch.Tensor:
        """Split ``target`` into the step's micro-batch targets and weigh them; returns the index
        "target" for the schedule to split in their place.

        Every rank calls this alike, so a refusal stops every rank before the schedule's first send.
        """
        n = microbatches
        self.targets = split_microbatches(target, n)
        if self.loss_tokens is None:
            labels = tensors_of(self.target_of(target))
            if any(not t.is_floating_point() and bool((t == IGNORE_INDEX).any()) for t in labels):
                raise ValueError(
                    f"The batch's target holds {IGNORE_INDEX} (positions a cross entropy leaves out of its mean), and "
                    "the pipeline spec does not say how many positions its loss_fn averages over, so the micro-batches "
                    "cannot be weighted to give the whole batch's loss. Give the spec "
                    "`loss_tokens=lightning_scale.core.pipeline.spec.labelled_tokens` (or your own count of the positions "
                    "loss_fn averages over)."
                )
            self.weights = [1.0 / n] * n
        else:
            # One host synchronisation for all the counts.
            counts = [
                int(c)
                for c in torch.stack(
                    [torch.as_tensor(self.loss_tokens(self.target_of(t))) for t in self.targets]
                ).tolist()
            ]
            total = sum(counts)
            # Nothing labelled in the whole batch: every micro-batch's loss is NaN, as one process's would be.
            self.weights = [c / total for c in counts] if total else [1.0 / n] * n
        return torch.arange(n)

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        output = self.rebuild(output)
        if self.predicting:
            return tensors_of(output)[0].new_zeros(())
        i = int(index)
        weight = self.weights[i]
        if weight == 0.0:
            return zero_loss(output)
        return self.loss_fn(output, self.targets[i]) * (weight * self.scale)
