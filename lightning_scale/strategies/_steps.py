"""Lightning's step methods for a strategy whose model may run as a pipeline or under loss parallelism."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.strategies import _pipeline
from lightning_scale.strategies._options import ParallelOptions
from lightning_scale.strategies._pipeline import pipeline_batch

__all__ = ["ParallelSteps"]


class ParallelSteps:
    """Mixin for ``HybridParallelStrategy`` (before Lightning's ``ParallelStrategy`` in the bases).

    With a pipeline (``_pipeline`` set) the module's step methods are not called: the schedule runs
    the model's stages in ``training_step`` and the last stage's loss is logged and returned; the
    hooks of ``backward`` run around the gradients it produced. With ``loss_parallel`` and tensor
    parallelism every step and the backward run under ``loss_parallel()``.
    """

    options: ParallelOptions
    layout: Layout
    lightning_module: LightningModule
    optimizers: list[Any]
    precision_plugin: Any
    _pipeline: PipelineRunner | None
    _stashed_grads: list[tuple[Tensor, Tensor | None]]

    def _loss_context(self) -> contextlib.AbstractContextManager[None]:
        if self.options.loss_parallel and self.layout.tp > 1:
            return loss_parallel()
        return contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._loss_context():
                return super().training_step(*args, **kwargs)
        module = self.lightning_module
        # The precision plugin's autocast (Lightning's own steps enter it around the module's step);
        # with fp16 each micro-batch loss is multiplied by its loss scale inside the schedule.
        with self.precision_plugin.train_step_context(), self._loss_context():
            loss, self._stashed_grads = _pipeline.training_step(
                self._pipeline,
                module,
                args[0] if args else kwargs["batch"],
                self.optimizers[0] if self.optimizers else None,
                self.options.loss_names["train"],
                loss_scale=self.precision_plugin.loss_scale,
            )
        return loss

    @override
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            # loss_parallel's cross entropy must also be differentiated inside the context.
            with self._loss_context():
                return super().backward(closure_loss, *args, **kwargs)
        # The schedule ran the backward in training_step (each micro-batch loss multiplied by the
        # plugin's loss scale); the hooks run here, around the gradients it set aside.
        self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        for param, grad in self._stashed_grads:
            param.grad = grad
        self._stashed_grads = []
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No data-parallel gradient reduction (nor tied-weight sum) on accumulation micro-steps:
        Lightning enters this around every micro-step but the last of a window."""
        if self._pipeline is not None:
            self._pipeline.sync_grads = False
            try:
                yield
            finally:
                self._pipeline.sync_grads = True
            return
        sharded = [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]
        for m in sharded:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            with super().block_backward_sync():  # DistributedDataParallel's no_sync
                yield
        finally:
            for m in sharded:
                m.set_requires_gradient_sync(True, recurse=False)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", self.precision_plugin.val_step_context, super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", self.precision_plugin.test_step_context, super().test_step, args, kwargs)

    def _eval_step(self, stage: str, context: Any, module_step: Any, args: Any, kwargs: Any) -> Any:
        """The pipeline's forward-only step under the precision plugin's ``context``, else the module's own."""
        if self._pipeline is not None:
            with context():
                return self._pipeline_eval(args[0], stage)
        with self._loss_context():
            return module_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            # The model's output for the batch's inputs (its predict_step would need the whole model).
            inputs, _, kwargs = pipeline_batch(self.lightning_module, args[0], predicting=True, spec=self._pipeline.spec)
            with self.precision_plugin.predict_step_context():
                return self._pipeline.predict_step(inputs, kwargs)
        # Vocabulary-sharded outputs (loss_parallel) are returned whole, as one process would.
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, lambda t: t.full_tensor())

    def _pipeline_eval(self, batch: Any, stage: str) -> Tensor:
        assert self._pipeline is not None
        with self._loss_context():
            return _pipeline.eval_step(self._pipeline, self.lightning_module, batch, self.options.loss_names[stage])

