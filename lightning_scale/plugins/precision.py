"""``MixedPrecision``: fp16 with one loss-scale decision for the whole mesh, bf16 that applies at every layout.

What Lightning's own plugins leave out, and this one does:

- **One decision, one collective.** After the backward (and the ``on_before_optimizer_step``
  hooks) the global gradient norm and an overflow flag come from a single all-reduce over every
  rank of every mesh dimension (``lightning_scale.core.precision.grad_norm.gradient_stats``). Clipping,
  ``train/grad_norm`` and the fp16 overflow decision all use it, so every rank skips the same steps
  and holds the same scale. (torch's ``ShardedGradScaler`` reduces the flag over one group only.)
- **Skipped means skipped.** On an overflow neither the optimizer nor the step-interval LR
  schedulers step (Lightning steps the scheduler anyway: Lightning #5558); the schedule counts
  good optimizer steps.
- **A policy at the bottom.** Hysteresis, a minimum scale and what to do when fp16 overflows even
  there (``lightning_scale.core.precision.loss_scaler``).
- **The same under a pipeline.** ``HybridParallelStrategy`` runs its schedules under this plugin's
  autocast and multiplies each micro-batch loss by :attr:`MixedPrecision.loss_scale`; with FSDP2
  data parallelism the mixed modes are FSDP2's own ``MixedPrecisionPolicy`` instead of autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_scale._lightning_compat import after_closure, should_update_logs
from lightning_scale.core.deprecation import moved_names
from lightning_scale.core.precision.grad_norm import (
    GradientScope,
    GradientStats,
    clip_grads_by_value_,
    gradient_stats,
    reduce_partial_grads_,
    scale_grads_,
)
from lightning_scale.core.precision.loss_scaler import DynamicLossScaler
from lightning_scale.core.precision.options import (
    COMPUTE_DTYPE,
    NONFINITE_POLICIES,
    PRECISIONS,
    TRUE_DTYPE,
    PrecisionOptions,
)
from lightning_scale.plugins._lr_schedulers import hold_lr_schedulers_after_skipped_steps

__all__ = ["NONFINITE_POLICIES", "PRECISIONS", "MixedPrecision"]

# Internal since the strategy converts Lightning's stock plugins itself; exported here before.
__getattr__ = moved_names(__name__, {"as_mesh_precision": "lightning_scale.plugins._stock.as_mesh_precision"})


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class MixedPrecision(Precision):
    """Precision for ``HybridParallelStrategy`` (and any other strategy).

    Args:
        precision: ``"fp16-mixed"`` (alias ``"16-mixed"``: fp16 autocast, dynamic loss scaling),
            ``"bf16-mixed"`` (bf16 autocast), ``"bf16-true"`` (bf16 weights, gradients, optimizer state
            and compute), ``"32-true"`` or ``"64-true"``. In the mixed modes weights, gradients and
            optimizer state stay fp32.
        device: the device type autocast runs on (``"cuda"``, ``"cpu"``, ...); default: the model's.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, min_scale_policy:
            the fp16 loss scaler (``lightning_scale.core.precision.loss_scaler``); fp16 only.
            Defaults ``2**16``, ``2.0``, ``0.5``, ``2000``, ``1``, ``1.0``, ``"raise"``.
        nonfinite_grads: bf16 and fp32 only: ``"skip"`` a step whose gradients are non-finite
            (anywhere in the mesh; neither optimizer nor step-wise LR schedulers step), ``"raise"``
            ``FloatingPointError``, or ``"ignore"`` (default: no check). fp16 always skips.
        reduce_dtype: the dtype FSDP2 reduces gradients in, when the mixed modes run as FSDP2's
            ``MixedPrecisionPolicy`` (``data_parallel_mode`` ``fsdp``, ``fsdp_grad_op``, ``hsdp``):
            ``"float32"`` (default), ``"bfloat16"``, ``"float16"``, or ``None`` (the compute dtype).
        norm_type: the p of the gradient norm that clipping, logging and overflow detection share.
        log_grad_norm: log that norm as ``train/grad_norm`` (``GradNormMonitor`` turns this on
            instead of taking a norm of its own).
        log_nonfinite: on a step with non-finite gradients, warn (rank 0) with the names of the
            parameters whose gradients were non-finite on any rank (one more collective, on those
            steps only).

    Logged on the optimizer steps the loggers write (``Trainer(log_every_n_steps=...)``):
    ``precision/loss_scale`` (fp16) and ``precision/skipped_steps`` (fp16, or when
    ``nonfinite_grads="skip"``), and ``train/grad_norm`` with ``log_grad_norm``.
    """

    def __init__(
        self,
        precision: str = "bf16-mixed",
        *,
        device: str | None = None,
        init_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        hysteresis: int | None = None,
        min_scale: float | None = None,
        min_scale_policy: str | None = None,
        nonfinite_grads: str | None = None,
        reduce_dtype: str | torch.dtype | None = "float32",
        norm_type: float = 2.0,
        log_grad_norm: bool = False,
        log_nonfinite: bool = False,
    ) -> None:
        options = PrecisionOptions.of(
            precision,
            scaler=dict(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                min_scale=min_scale,
                min_scale_policy=min_scale_policy,
            ),
            nonfinite_grads=nonfinite_grads,
            reduce_dtype=reduce_dtype,
            norm_type=norm_type,
        )
        self.precision = options.precision  # type: ignore[assignment]  # Lightning's name, as trainer.precision
        self.device = device
        self.scaler: DynamicLossScaler | None = None
        if options.scaler is not None:
            self.scaler = DynamicLossScaler(
                **options.scaler, warn=lambda message: rank_zero_warn(message, category=RuntimeWarning)
            )
        self.nonfinite_grads = options.nonfinite_grads
        self.reduce_dtype = options.reduce_dtype
        self.norm_type = options.norm_type
        self.log_grad_norm = log_grad_norm
        self.log_nonfinite = log_nonfinite
        self._skipped = 0  # bf16/fp32 with nonfinite_grads="skip"; fp16 counts in its scaler
        self.step_checks: list[Callable[[Any, GradientStats | None], bool]] = []
        """``check(loss, stats) -> skip``, asked on every rank (identically) before each step the plugin
        would take; any ``True`` skips it like an overflow (``NumericalHealth`` registers one). ``stats``
        is ``None`` on steps that compute no gradient statistics (no clipping, logging or check needs
        them) unless ``stats_every_step``."""
        self.stats_every_step = False
        self.last_step_skipped = False
        self.gradient_scope = GradientScope()
        """How this rank's gradients make up the model's (``HybridParallelStrategy`` sets it from its mesh)."""
        self.fsdp_managed = False
        """True while FSDP2's ``MixedPrecisionPolicy`` casts the parameters (no autocast then)."""
        self._stats: GradientStats | None = None
        self._unscaled = False

    # ------------------------------------------------------------------ what the model computes in

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return COMPUTE_DTYPE.get(self.precision, TRUE_DTYPE.get(self.precision, torch.float32))

    @property
    def is_mixed(self) -> bool:
        return self.precision in COMPUTE_DTYPE

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients (fp16 overflows included)."""
        return self.scaler.skipped_steps if self.scaler is not None else self._skipped

    @property
    def loss_scale(self) -> float:
        """The factor each loss is multiplied by before its backward (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy for the mixed modes: parameters cast to the compute dtype for forward and
        backward, fp32 sharded master weights, gradients reduced in ``reduce_dtype``; ``None`` otherwise."""
        if not self.is_mixed:
            return None
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def _device_type(self) -> str:
        if self.device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        if self.device is None:
            real = next((p for p in model.parameters() if not p.is_meta), None)
            if real is not None:
                self.device = real.device.type
        return model, optimizers, lr_schedulers

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = TRUE_DTYPE.get(self.precision)
        return module.to(dtype=dtype) if dtype is not None and dtype != torch.float32 else module

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        dtype = TRUE_DTYPE.get(self.precision)
        return _default_dtype(dtype) if dtype is not None else contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        dtype = TRUE_DTYPE.get(self.precision)
        if dtype is None or dtype == torch.float32:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            if self.fsdp_managed:  # FSDP2 casts the parameters; autocast over them would change nothing
                yield
                return
            with torch.autocast(self._device_type(), dtype=self.compute_dtype, cache_enabled=False):
                yield
            return
        with self.tensor_init_context():
            yield

    # ------------------------------------------------------------------ backward and the step

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # the hooks see the loss itself
        return tensor * self.scaler.scale if self.scaler is not None else tensor

    def _params(self, optimizer: Any) -> list[Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _unscale(self, optimizer: Any) -> None:
        """Once per step, before hooks and clipping see the gradients: finish reductions left pending
        (``Partial`` DTensor gradients), and divide by the loss scale."""
        if self._unscaled:
            return
        params = self._params(optimizer)
        reduce_partial_grads_(params)
        if self.scaler is not None:
            scale_grads_(params, self.scaler.inv_scale)
        self._unscaled = True

    def gradient_stats(self, optimizer: Any) -> GradientStats:
        """This step's global gradient norm and overflow flag (one collective, taken once per step)."""
        if self._stats is None:
            self._unscale(optimizer)
            decides = self.scaler is not None or self.nonfinite_grads != "ignore"  # a step skipped on the flag
            self._stats = gradient_stats(self._params(optimizer), self.gradient_scope, self.norm_type, agree=decides)
        return self._stats

    def _needs_stats(self, logging: bool = True) -> bool:
        return (
            self.scaler is not None
            or self.nonfinite_grads != "ignore"
            or self.stats_every_step
            or (self.log_grad_norm and logging)
        )

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        try:
            return self._optimizer_step(optimizer, model, closure, **kwargs)
        finally:
            # The next step starts afresh (in manual optimisation clip_gradients may run before step()).
            self._stats, self._unscaled = None, False

    def _optimizer_step(self, optimizer: Any, model: LightningModule, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, LBFGS):
            if self.scaler is not None or self.nonfinite_grads != "ignore":
                raise ValueError(
                    f"{type(optimizer).__name__} re-evaluates its closure inside step(), so a step cannot be decided "
                    f"before it runs, as precision={self.precision!r} with nonfinite_grads={self.nonfinite_grads!r} "
                    "needs. Use precision='32-true' or 'bf16-mixed' with nonfinite_grads='ignore'."
                )

            def fresh() -> Any:  # every evaluation has new gradients
                self._stats, self._unscaled = None, False
                return closure()

            return super().optimizer_step(optimizer, model=model, closure=fresh, **kwargs)
        result = closure()
        if result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, nothing to scale or check.
            return optimizer.step(**kwargs)
        self._unscale(optimizer)
        after_closure(self, model, optimizer)  # on_before_optimizer_step hooks, then clipping
        step, stats = True, None
        # Metrics are logged when the loggers write (every log_every_n_steps): a log call costs more
        # than the scaler's own work on small models.
        logging = should_update_logs(model.trainer, missing=True)
        if self._needs_stats(logging) or self._stats is not None:
            stats = self.gradient_stats(optimizer)
            step = self._decide(stats, model, optimizer)
            if logging:
                self._log(model, stats)
        if step and self.step_checks:
            # Every check runs (each may keep statistics), on every rank alike.
            step = not any([check(result, stats) for check in self.step_checks])
        self.last_step_skipped = not step
        hold_lr_schedulers_after_skipped_steps(model.trainer, lambda: self.last_step_skipped)
        return optimizer.step(**kwargs) if step else result

    def _decide(self, stats: GradientStats, model: LightningModule, optimizer: Any) -> bool:
        """Step or skip, identically on every rank (``stats`` came from one all-reduce)."""
        if not stats.finite:
            if self.nonfinite_grads == "skip" and self.scaler is None:
                self._skipped += 1
            names = self._nonfinite_names(stats, model, optimizer) if self.log_nonfinite else []
            if names:
                rank_zero_warn(
                    f"Non-finite gradients at global step {model.trainer.global_step} in {len(names)} parameters: "
                    f"{', '.join(names[:20])}{' ...' if len(names) > 20 else ''}",
                    category=RuntimeWarning,
                )
            if self.nonfinite_grads == "raise":
                raise FloatingPointError(
                    f"The gradients are non-finite at global step {model.trainer.global_step} (global norm "
                    f"{stats.norm}) and nonfinite_grads='raise'. Use nonfinite_grads='skip' to skip such steps, "
                    "lower the learning rate, or clip gradients."
                )
        if self.scaler is not None:
            return self.scaler.update(overflow=not stats.finite).step
        return stats.finite or self.nonfinite_grads == "ignore"

    def _nonfinite_names(self, stats: GradientStats, model: LightningModule, optimizer: Any) -> list[str]:
        """Every rank's non-finite parameter names (one all_gather_object, on such steps only)."""
        params = self._params(optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        local = sorted({names.get(id(params[i]), f"<parameter {i}>") for i in stats.nonfinite_local})
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return local
        everyone: list[list[str]] = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(everyone, local)
        return sorted({n for rank in everyone for n in rank})

    def _log(self, model: LightningModule, stats: GradientStats) -> None:
        def log(name: str, value: float) -> None:
            model.log(name, value, on_step=True, on_epoch=False, logger=True, prog_bar=False)

        if self.log_grad_norm:
            log("train/grad_norm", stats.norm)
        if self.scaler is not None:
            log("precision/loss_scale", self.scaler.scale)
        if self.scaler is not None or self.nonfinite_grads == "skip":
            log("precision/skipped_steps", float(self.skipped_steps))

    # ------------------------------------------------------------------ clipping

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        self._unscale(optimizer)  # manual optimisation clips before optimizer.step()
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            clip_grads_by_value_(self._params(optimizer), float(clip_val))
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Scale the gradients so the whole model's norm is at most ``clip_val`` (the step's shared norm;
        nothing on a step that overflowed, which is skipped)."""
        stats = self.gradient_stats(optimizer)
        if stats.finite:
            coef = min(1.0, float(clip_val) / (stats.norm + 1e-6))
            if coef < 1.0:
                scale_grads_(self._params(optimizer), coef)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grads_by_value_(self._params(optimizer), float(clip_val))

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        """Scale, its counters and the skipped-step count: equal on every rank, saved in Lightning's checkpoints."""
        state: dict[str, Any] = {"precision": self.precision, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "_growth_tracker" in state_dict:
            # torch.amp.GradScaler's (a checkpoint of Lightning's own 16-mixed plugin): its scale and growth.
            if self.scaler is not None:
                self.scaler.scale = float(state_dict["scale"])
                self.scaler.growth_tracker = int(state_dict["_growth_tracker"])
            return
        if self.scaler is None:
            self._skipped = int(state_dict.get("skipped_steps", 0))
        elif "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
