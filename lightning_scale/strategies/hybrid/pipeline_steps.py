"""Lightning's step methods when a pipeline runs the model: the schedule does the forward and
backward of every micro-batch, and the module's own step (``training_step``; ``validation_step`` and
``test_step`` when it defines them) runs on the last stage once per micro-batch as its loss
(:mod:`.pipeline_loss`). What it logs is logged on every rank after the schedule, reduced over the
micro-batches and replicas; the step's loss is returned (and logged under the strategy's loss name
unless the step logs that name itself)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_scale._lightning_compat import skips_backward
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.strategies.hybrid.pipeline_hooks import describe_batches, pipeline_batch
from lightning_scale.strategies.hybrid.pipeline_loss import StepLoss

__all__ = ["PipelineSteps"]

StashedGrads = list[tuple[Tensor, "Tensor | None"]]


class PipelineSteps:
    """This rank's pipeline and what its steps carry from one of Lightning's hooks to the next.

    Args:
        loss_names: where each stage's loss is logged (``{"train": ..., "val": ..., "test": ...}``).

    State: ``runner``, the rank's stages and schedule (``None`` without pipeline parallelism: the
    strategy runs the module's own steps), and the gradients :meth:`train` set aside from Lightning's
    ``zero_grad`` until :meth:`put_back_grads` (in ``backward``).
    """

    def __init__(self, loss_names: Mapping[str, str]) -> None:
        self.loss_names = dict(loss_names)
        self.runner: PipelineRunner | None = None
        self.stashed: StashedGrads = []
        self._options: dict[str, dict[str, Any]] = {}
        self.in_user_step = False
        """True while the module's own step runs on the last stage (the strategy's collectives then do not
        communicate: only that stage's ranks are there)."""

    @contextlib.contextmanager
    def user_step(self) -> Generator[None, None, None]:
        self.in_user_step = True
        try:
            yield
        finally:
            self.in_user_step = False

    def _step_loss(self, module: LightningModule, method: str, args: tuple[Any, ...], training: bool) -> bool:
        """The runner's loss set to run ``module``'s ``method`` (installed once); whether the module defines it."""
        runner = self._runner()
        if not isinstance(runner.loss, StepLoss) or runner.loss.module is not module:
            spec = runner.spec
            runner.use_loss(
                StepLoss(module, runner.root, spec, lambda b: pipeline_batch(module, b, spec=spec), self.user_step)
            )
        own = is_overridden(method, module, parent=LightningModule)
        runner.loss.begin(method, args, training, own=own)  # type: ignore[attr-defined]
        return own

    def _log(self, module: LightningModule, name: str, loss: Tensor) -> None:
        """What the step logged (averaged over micro-batches and replicas); the loss under ``name`` unless
        logged. Each name keeps the options it was first logged with (Lightning wants one set per name,
        and the loss's name may be logged by the strategy on some steps and by the step on others)."""
        metrics = self._runner().metrics
        for key, (value, options) in metrics.items():
            kept = self._options.setdefault(key, options)
            module.log(key, torch.tensor(value, dtype=torch.float64, device=loss.device), **kept)
        if name not in metrics:
            # Already the mean over replicas on every rank (the pipeline's one collective): no sync_dist.
            module.log(name, loss, **self._options.setdefault(name, {"prog_bar": True}))

    def _runner(self) -> PipelineRunner:
        if self.runner is None:
            raise RuntimeError("PipelineSteps has no pipeline runner: the strategy sets one at pipeline_parallel > 1.")
        return self.runner

    def _split(self, module: LightningModule, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """:func:`pipeline_batch`; the first batch a runner sees is described once (the conventions a
        model family's ``split_batch`` infers, like whether pair targets are shifted, are known by then)."""
        runner = self._runner()
        parts = pipeline_batch(module, batch, spec=runner.spec)
        if not runner.batches_described:
            runner.batches_described = True
            extra = f"; extra inputs every stage receives: {sorted(parts[2])}" if parts[2] else ""
            rank_zero_info(f"Pipeline batches: {describe_batches(module, runner.spec)}{extra}")
        return parts

    def _returned(self, loss: Tensor) -> Tensor:
        """The loss in the model's floating-point precision (float32 at least), as its own step would return it."""
        dtype = next((p.dtype for p in self._runner().root.parameters() if p.is_floating_point()), torch.float32)
        return loss.to(torch.promote_types(dtype, torch.float32))

    def train(
        self,
        module: LightningModule,
        batch: Any,
        optimizer: Any,
        *,
        loss_scale: float = 1.0,
        args: tuple[Any, ...] = (),
    ) -> Tensor:
        """Forward and backward of every micro-batch of ``batch``; logs and returns the step's loss.

        The schedule runs here, not in ``backward``, so that ``training_step`` returns the real loss
        (callbacks see it as ``outputs["loss"]``). Lightning zeroes the gradients after
        ``training_step`` on the first micro-step of an accumulation window: there the previous step's
        gradients are released before the schedule runs (not held beside the new ones), and the new
        ones are taken off the parameters until :meth:`put_back_grads`.
        """
        runner, trainer = self._runner(), module.trainer
        inputs, _, kwargs = self._split(module, batch)
        self.stashed = []
        forward_only = skips_backward(trainer)  # e.g. StochasticWeightAveraging's extra epoch
        self._step_loss(module, "training_step", args, training=not forward_only)
        # The loss gets the whole batch (split into micro-batches): the module's step runs on each.
        target = batch
        if forward_only:
            loss = runner.eval_step(inputs, target, kwargs)
        else:
            accumulate = trainer.accumulate_grad_batches
            zeroed_after = trainer.fit_loop.epoch_loop.batch_idx % accumulate == 0
            params = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
            if zeroed_after:
                for p in params:
                    p.grad = None
            # The runner weighs the micro-batches into the batch's loss; each batch is a 1/accumulate share of
            # the window's, times the precision plugin's loss scale.
            loss = runner.train_step(inputs, target, loss_scale / accumulate, kwargs)
            if zeroed_after:
                self.stashed = [(p, p.grad) for p in params]
                for p in params:
                    p.grad = None
        self._log(module, self.loss_names["train"], loss)
        return self._returned(loss)

    def put_back_grads(self) -> None:
        """The gradients :meth:`train` set aside, back on their parameters (once)."""
        for param, grad in self.stashed:
            param.grad = grad
        self.stashed = []

    def evaluate(self, module: LightningModule, batch: Any, stage: str, args: tuple[Any, ...] = ()) -> Tensor:
        """Forward of every micro-batch of ``batch`` (``stage``: ``"val"`` or ``"test"``); logs and returns its loss."""
        inputs, _, kwargs = self._split(module, batch)
        self._step_loss(module, f"{'validation' if stage == 'val' else 'test'}_step", args, training=False)
        loss = self._runner().eval_step(inputs, batch, kwargs)
        self._log(module, self.loss_names[stage], loss)
        return self._returned(loss)

    def predict(
        self, module: LightningModule, batch: Any, context: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> Any:
        """The model's output for the batch's inputs (its ``predict_step`` would need the whole model),
        computed under ``context`` (the precision plugin's)."""
        runner = self._runner()
        inputs, _, kwargs = pipeline_batch(module, batch, predicting=True, spec=runner.spec)
        with context():
            return runner.predict_step(inputs, kwargs)

    @contextlib.contextmanager
    def grad_sync_blocked(self) -> Generator[None, None, None]:
        """No data-parallel gradient reduction nor tied-weight sum inside (accumulation micro-steps)."""
        runner = self._runner()
        runner.sync_grads = False
        try:
            yield
        finally:
            runner.sync_grads = True
