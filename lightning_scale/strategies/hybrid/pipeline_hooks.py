"""What a LightningModule tells the pipeline (its hooks), and what the pipeline tells the user.

The mechanism (stages, schedules, tied weights, timing) is ``lightning_scale.core.pipeline.runner``;
this module is the Lightning side: the ``pipeline_spec`` and ``pipeline_batch`` hooks, the batch
used to time blocks for ``partition="by_cost"``, and the set-up checks and warning. The steps that run it are
:mod:`.pipeline_steps`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_scale._lightning_compat import before_batch_transfer, loop_data_source
from lightning_scale.core.pipeline.spec import PipelineSpec, find_registered_spec, with_registered_forward
from lightning_scale.integrations.huggingface import unsupported_pipeline_family

__all__ = [
    "PIPELINE_BATCH_HOOK",
    "PIPELINE_SPEC_HOOK",
    "check_pipeline_module",
    "describe_batches",
    "describe_loss",
    "example_batch",
    "pipeline_batch",
    "pipeline_spec_of",
    "timing_batch",
]

PIPELINE_SPEC_HOOK = "pipeline_spec"
"""LightningModule method returning ``(root, spec)``: the name of the module whose ``forward``
runs a stage (``""`` for the LightningModule itself) and a :class:`PipelineSpec` relative to it."""

PIPELINE_BATCH_HOOK = "pipeline_batch"
"""LightningModule method ``pipeline_batch(self, batch) -> (inputs, target)`` or ``(inputs, target, kwargs)``:
what the first stage feeds the model (a tensor, or a tuple of tensors passed as positional
arguments), what the last stage's ``loss_fn(output, target)`` compares with, and extra keyword
inputs of the model's forward (``position_ids``, an attention mask, ...) that every stage receives,
split into micro-batches like the inputs. Not needed for ``(inputs, target)`` tuples. For
``trainer.predict`` the target may be ``None``."""


def pipeline_spec_of(module: LightningModule) -> tuple[str, PipelineSpec]:
    """``(root, spec)`` from the LightningModule's hook, else from the registry of architectures.

    A hook's spec for a module that is itself a registered architecture (a user's own cut of a
    Hugging Face decoder) runs its stages with the architecture's stage forward
    (:func:`~lightning_scale.core.pipeline.spec.with_registered_forward`)."""
    hook = getattr(module, PIPELINE_SPEC_HOOK, None)
    found = hook() if callable(hook) else find_registered_spec(module)
    if found is None:
        why = unsupported_pipeline_family(module)
        raise ValueError(
            f"pipeline_parallel > 1 needs to know where {type(module).__name__} may be cut, but "
            f"{why + ', not this one' if why else 'it declares no blocks'}: define `{PIPELINE_SPEC_HOOK}(self) -> "
            "(root_module_name, PipelineSpec(blocks=..., first=..., last=..., loss_fn=...))` or register the "
            "architecture with lightning_scale.core.pipeline.spec.register_pipeline_spec."
        )
    if callable(hook):
        root_name, spec = found
        root = module.get_submodule(root_name) if root_name else module
        found = root_name, with_registered_forward(root, spec)
    return found


def describe_batches(module: LightningModule, spec: PipelineSpec | None) -> str:
    if callable(getattr(module, PIPELINE_BATCH_HOOK, None)):
        return f"{type(module).__name__}.{PIPELINE_BATCH_HOOK}"
    if spec is not None and spec.split_batch is not None:
        describe = getattr(spec.split_batch, "describe", None)
        return describe() if callable(describe) else f"the spec's split_batch ({_name(spec.split_batch)})"
    return "(inputs, target) pairs as they come"


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def pipeline_batch(
    module: LightningModule, batch: Any, *, predicting: bool = False, spec: PipelineSpec | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """``(inputs, target, kwargs)`` of a batch: the module's ``pipeline_batch`` hook, else the spec's
    ``split_batch`` (a model family's usual batches), else the batch itself when it is a pair. For
    prediction a lone tensor (or a 1-tuple) is the inputs, with no target."""
    hook = getattr(module, PIPELINE_BATCH_HOOK, None)
    if not callable(hook) and spec is not None and spec.split_batch is not None:
        hook = spec.split_batch
    if callable(hook):
        parts = hook(batch)
        if not (
            isinstance(parts, (tuple, list))
            and len(parts) in (2, 3)
            and (len(parts) == 2 or isinstance(parts[2], Mapping))
        ):
            raise TypeError(
                f"{type(module).__name__}.{PIPELINE_BATCH_HOOK}(batch) must return (inputs, target) or (inputs, target, "
                f"kwargs) with kwargs a dict of the model's extra inputs, got {type(parts).__name__}"
                f"{f' of length {len(parts)}' if isinstance(parts, (tuple, list)) else ''}."
            )
        inputs, target = parts[0], parts[1]
        kwargs = dict(parts[2]) if len(parts) == 3 else {}
        return (tuple(inputs) if isinstance(inputs, list) else inputs), target, kwargs
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1], {}
    if predicting:
        if isinstance(batch, (tuple, list)) and len(batch) == 1:
            return batch[0], None, {}
        if not isinstance(batch, (tuple, list, Mapping)):
            return batch, None, {}
    kind = type(batch).__name__
    keys = f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else ""
    raise TypeError(
        f"With pipeline_parallel > 1 the first stage feeds the model the batch's inputs and the last stage's loss "
        f"compares the output with its target, but this batch is a {kind}{keys}, not (inputs, target). Define "
        f"`{PIPELINE_BATCH_HOOK}(self, batch) -> (inputs, target)` on {type(module).__name__} "
        "(e.g. `return batch['input_ids'], batch['labels']`; a third element, a dict, passes extra inputs such as "
        "position_ids to every stage)."
    )


def check_pipeline_module(module: LightningModule, pipeline_parallel: int, loss_names: Mapping[str, str]) -> None:
    """Before any work at ``pipeline_parallel > 1``: refuse manual optimisation, and warn once about the
    module's step methods that the pipeline runs instead of."""
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} uses manual optimisation (automatic_optimization=False), which "
            f"pipeline_parallel={pipeline_parallel} cannot run: the pipeline schedule does the forward and backward "
            "of every micro-batch itself, so `manual_backward` has no graph to act on. Use automatic optimisation, "
            "or pipeline_parallel=1."
        )
    _, spec = pipeline_spec_of(module)
    name = type(module).__name__
    own = [m for m in ("training_step", "validation_step", "test_step") if is_overridden(m, module)]
    rank_zero_info(
        f"pipeline_parallel={pipeline_parallel}: each rank runs its stages; on the last one {name}'s "
        f"{', '.join(own) or 'training_step'} run{'s' if len(own) < 2 else ''} once per micro-batch with the model's "
        "output in place of its forward, the micro-batches weighted "
        f"{'equally' if spec.loss_tokens is None else f'by their shares of {_name(spec.loss_tokens)}'} (a step the "
        "pipeline cannot run exactly is refused before the optimizer steps); what they log is logged once per step, "
        "reduced over the micro-batches. "
        f"Batches: {describe_batches(module, spec)}."
    )
    bypassed = [m for m in ("predict_step", "backward") if is_overridden(m, module)]
    zero_grad = (
        " Its optimizer_zero_grad runs, but the strategy itself releases the previous step's gradients before "
        "each window's first schedule (on_before_zero_grad sees none)."
        if is_overridden("optimizer_zero_grad", module)
        else ""
    )
    if bypassed or zero_grad:
        not_called = (
            f"{name}'s {' and '.join(bypassed)} {'is' if len(bypassed) == 1 else 'are'} not called: "
            if bypassed
            else ""
        )
        rank_zero_warn(
            f"pipeline_parallel={pipeline_parallel}: {not_called}predict returns the last stage's output and the "
            f"schedule runs the backward of every micro-batch itself.{zero_grad}",
            category=UserWarning,
        )


def describe_loss(spec: PipelineSpec) -> str:
    """The pipeline's loss in words: the spec's loss function and how micro-batches are combined."""
    loss = _name(spec.loss_fn)
    if spec.loss_tokens is None:
        return f"the pipeline spec's loss_fn ({loss}) on each micro-batch, averaged over the micro-batches"
    return (
        f"the pipeline spec's loss_fn ({loss}) on each micro-batch, weighted by its share of the batch's "
        f"{_name(spec.loss_tokens)} (the sum over micro-batches divided once by the batch's count: {loss} of the "
        "whole batch)"
    )


def timing_batch(
    module: LightningModule, convert: Callable[[Any], Any], to_device: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """``(inputs, target)`` of one batch of this Trainer call's data, prepared as the loops prepare a
    batch before the step sees it (the precision plugin's ``convert``, the module's
    ``on_before_batch_transfer``, ``to_device``), for timing blocks (``partition="by_cost"``)."""
    batch = example_batch(module.trainer)
    if batch is None:
        raise ValueError(
            "partition='by_cost' times every block on a real batch at set-up, but this Trainer call has no "
            "batch to give (no datamodule or dataloaders, or an empty one). Pass the data to "
            "fit/validate/test/predict, or use partition='by_params'."
        )
    batch = to_device(before_batch_transfer(module, convert(batch), dataloader_idx=0))
    predicting = module.trainer.state.fn == TrainerFn.PREDICTING
    inputs, target, _ = pipeline_batch(module, batch, predicting=predicting, spec=pipeline_spec_of(module)[1])
    return inputs, target


def example_batch(trainer: Trainer) -> Any:
    """One batch of the data the running Trainer call uses (fit: training data; validate, test,
    predict: theirs), from a datamodule or plain dataloaders; ``None`` when there is none.

    Several training loaders give what Lightning's training loop gives: a dict (or list) with a batch
    of each; several evaluation loaders, a batch of the first (evaluation runs them one by one).
    """
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }.get(trainer.state.fn)
    source = loop_data_source(loop)
    if source is None or not source.is_defined():
        return None
    loaders = source.dataloader()
    training = trainer.state.fn == TrainerFn.FITTING
    if isinstance(loaders, Mapping):
        if training:
            batches = {key: next(iter(loader), None) for key, loader in loaders.items()}
            return None if any(b is None for b in batches.values()) else batches
        loaders = next(iter(loaders.values()), None)
    elif isinstance(loaders, (list, tuple)):
        if training:
            batches_list = [next(iter(loader), None) for loader in loaders]
            return None if not batches_list or any(b is None for b in batches_list) else batches_list
        loaders = loaders[0] if loaders else None
    return None if loaders is None else next(iter(loaders), None)
