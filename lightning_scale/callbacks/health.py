"""``NumericalHealth``: non-finite losses and gradients, loss spikes; warn, skip, roll back or stop."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_scale._lightning_compat import restore_training_state
from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.checks import format_choices
from lightning_scale.core.telemetry.health import LossSpikeDetector

__all__ = ["POLICIES", "NumericalHealth"]

POLICIES = ("warn", "skip", "rollback", "stop")


class NumericalHealth(Callback):
    """Check every optimizer step before it is taken: a non-finite loss or gradient norm, or a loss
    spike (``zscore`` standard deviations above the mean of the last ``window`` healthy steps), and
    then, by ``policy``:

    - ``"warn"``: a warning naming the step and the reason; the step is taken;
    - ``"skip"``: the step is not taken (optimizer and step-interval LR schedulers stand still, as
      for an fp16 overflow); training goes on with the next batch;
    - ``"rollback"``: the step is not taken, and the model, optimizers, LR schedulers and precision
      state are restored from the newest checkpoint that verifies (``ShardedCheckpointIO``'s
      ``"latest"``; for ``.ckpt`` files, ``ModelCheckpoint``'s last or best). The loop counters and
      the data go on: the offending batch and those since the checkpoint are not trained on again.
      Without a checkpoint yet, the step is skipped with a warning saying so;
    - ``"stop"``: the step is not taken and ``trainer.should_stop`` ends the fit (the weights are the
      last healthy ones).

    The decision is the same on every rank: the gradient norm is the precision plugin's global one,
    and the loss is averaged over the processes by one all-reduce of two numbers per step (under a
    pipeline every rank already has the true loss). Needs :class:`lightning_scale.plugins.MixedPrecision`
    (``HybridParallelStrategy`` always uses it; with another strategy pass
    ``plugins=[MixedPrecision(...)]``), which asks this callback before each step. fp16 overflows
    are the loss scaler's business and do not count here. Logs ``health/anomalies``,
    ``health/skipped_steps``, ``health/rollbacks`` and ``health/loss_zscore`` at logging steps;
    ``events`` keeps ``(step, reason, action)``; the window is checkpointed.

    The gradient norm is checked on the steps the plugin computes it anyway (clipping,
    ``GradNormMonitor``'s logging steps, fp16, ``nonfinite_grads``) with ``check_grad_norm="auto"``;
    ``True`` computes it every step (one pass over the gradients and an all-reduce: on the tiny GPT
    on CPU about 2 % of a step), ``False`` never looks at it.
    """

    def __init__(
        self,
        policy: str = "warn",
        *,
        zscore: float = 6.0,
        window: int = 100,
        min_history: int = 20,
        check_grad_norm: bool | str = "auto",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {format_choices(POLICIES)}.")
        if check_grad_norm not in (True, False, "auto"):
            raise ValueError(f"check_grad_norm={check_grad_norm!r} must be True, False or 'auto'.")
        self.policy = policy
        self.check_grad_norm = check_grad_norm
        self.detector = LossSpikeDetector(window=window, zscore=zscore, min_history=min_history)
        self.events: list[tuple[int, str, str]] = []
        self.skipped = 0
        self.rollbacks = 0
        self._trainer: Trainer | None = None
        self._rollback_pending = False
        self._rollback_to: Any = None
        self._last_z: float | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_scale.plugins import MixedPrecision

        telemetry.forget_logging_step(trainer)
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            raise ValueError(
                f"NumericalHealth decides before each optimizer step through lightning_scale.plugins.MixedPrecision; "
                f"this Trainer's precision plugin is {type(plugin).__name__}. Pass "
                f"Trainer(plugins=[MixedPrecision({str(trainer.precision)!r})]) or use HybridParallelStrategy."
            )
        if not pl_module.automatic_optimization:
            raise ValueError("NumericalHealth needs automatic optimization (it decides inside the optimizer step).")
        self._trainer = trainer
        if self._check not in plugin.step_checks:
            plugin.step_checks.append(self._check)
        forced = plugin.stats_every_step
        plugin.stats_every_step = forced or self.check_grad_norm is True

        def remove() -> None:
            if self._check in plugin.step_checks:
                plugin.step_checks.remove(self._check)
            plugin.stats_every_step = forced

        self._remove = remove

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        getattr(self, "_remove", lambda: None)()

    def _check(self, loss: Any, stats: Any) -> bool:
        """``True``: do not take this step. Called by the precision plugin on every rank."""
        trainer = self._trainer
        assert trainer is not None
        value = float(loss.detach().float().item()) if loss is not None else math.nan
        if not getattr(trainer.strategy, "pipeline", None):
            total, count = telemetry.reduce_sum(trainer, [value, 1.0])
            value = total / count
        norm = stats.norm if stats is not None and self.check_grad_norm is not False else None
        verdict = self.detector.check(value, norm)
        self._last_z = verdict.zscore
        if verdict.healthy:
            return False
        step = trainer.global_step
        action = self.policy
        if action == "rollback":
            self._rollback_to = self._checkpoint(trainer)
            action = (
                f"rollback to {self._rollback_to}" if self._rollback_to else "skip (no checkpoint to roll back to yet)"
            )
        self.events.append((step, verdict.reason, action))
        rank_zero_warn(f"NumericalHealth at global step {step}: {verdict.reason}; policy {self.policy!r}: {action}.")
        if self.policy == "warn":
            return False
        self.skipped += 1
        if self.policy == "stop":
            trainer.should_stop = True
        elif self.policy == "rollback" and self._rollback_to is not None:
            self._rollback_pending = True
        return True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._rollback_pending:
            self._rollback_pending = False
            self._restore(trainer)
        if telemetry.should_log(trainer):
            metrics = {
                "health/anomalies": float(len(self.events)),
                "health/skipped_steps": float(self.skipped),
                "health/rollbacks": float(self.rollbacks),
            }
            if self._last_z is not None:
                metrics["health/loss_zscore"] = self._last_z
            telemetry.publish(trainer, metrics)

    # ------------------------------------------------------------------ rollback

    @staticmethod
    def _checkpoint(trainer: Trainer) -> Any:
        """The checkpoint a rollback restores (collective with ``ShardedCheckpointIO``)."""
        io = trainer.strategy.checkpoint_io
        roots = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        if hasattr(io, "latest"):
            return io.latest(roots)
        files = [
            Path(p)
            for cb in trainer.checkpoint_callbacks
            for p in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""))
            if p
        ]
        files = [f for f in files if f.exists()]
        return max(files, key=lambda f: f.stat().st_mtime) if files else None

    def _restore(self, trainer: Trainer) -> None:
        path, self._rollback_to = self._rollback_to, None
        # Lightning's own restore steps, less the loops: counters and data go on.
        restore_training_state(trainer, trainer.strategy.load_checkpoint(path))
        self.rollbacks += 1
        rank_zero_warn(f"NumericalHealth: rolled back to {path} at global step {trainer.global_step}.")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "skipped": self.skipped,
            "rollbacks": self.rollbacks,
            "anomalies": len(self.events),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.detector.load_state_dict(state_dict.get("detector", {}))
        self.skipped = int(state_dict.get("skipped", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))
