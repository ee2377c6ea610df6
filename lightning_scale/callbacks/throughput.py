"""``Throughput``: samples/s, tokens/s and MFU, right at every (dp, tp, pp) layout."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_scale.callbacks import _telemetry as telemetry
from lightning_scale.core.checks import check_positive_int
from lightning_scale.core.telemetry.flops import model_flops_utilization
from lightning_scale.core.telemetry.model_facts import FLOPS_HOOK, ModelFacts
from lightning_scale.core.telemetry.peaks import PEAK_FILE_ENV, device_peak, machine_key, measured_peak, recorded_peak

__all__ = ["Throughput"]


class Throughput(telemetry.SharedTelemetry):
    """Log throughput and model FLOPs utilisation at Lightning's logging steps.

    Tokens are counted per **data-parallel replica**: every process of a replica (its tensor and
    pipeline ranks) sees the same batch, so the processes' counts are summed and divided by the
    processes per replica. Rates are over the last ``window`` optimizer steps (validation inside
    ``fit`` excluded), timed by each process's own clock; the only synchronisation is a few numbers in
    the logging step's one all-reduce (shared with the other telemetry callbacks).

    MFU is ``FLOPs per token x tokens/s / (devices x peak)``: FLOPs per token from the model
    (:mod:`lightning_scale.core.telemetry.model_facts`: a ``flops_per_token(seq_len)`` hook, the analytic
    transformer count, or ``FlopCounterMode`` on meta tensors), the peak from the dense datasheet
    table (:mod:`lightning_scale.core.telemetry.peaks`) for the dtype the precision computes in. On a CPU the
    peak is measured once by a matmul and logged as ``train/peak_flops_measured``. A device or dtype
    the table does not know gets a warning naming ``peak_flops`` and no MFU, never a guessed peak.
    ``train/hfu`` (hardware FLOPs utilisation) is logged as well when activation checkpointing
    recomputes forwards: model FLOPs plus the FLOPs the backward spends recomputing. Those are counted,
    not assumed: at set-up, before the model is cut, ``FlopCounterMode`` counts one training step on
    meta tensors with every block checkpointed by the package's own wrapper, and attributes what each
    block's recomputation costs (torch's non-reentrant checkpoint stops once the tensors the backward
    needs are back: a block's last linear layer is not recomputed, nor is anything outside the
    blocks); the blocks ``HybridParallelStrategy`` wraps on all pipeline ranks are summed
    (``ModelFacts.recomputed_flops_per_token``).

    Args:
        window: optimizer steps the rates are averaged over.
        peak_flops: dense FLOP/s of one device, overriding the table (or the measurement).
        causal: count attention's causal half only in the analytic count (what FlashAttention-style
            kernels compute); the default counts the full product.
        batch_shape: ``batch -> (samples, tokens per sample)``; the default reads the token ids
            (the batch, a tuple's first element or ``input_ids``; a float input is one token per sample).
        recomputed_flops_per_token: FLOPs per token that activation checkpointing adds to a training
            step (hardware minus model FLOPs); default: counted as above under ``HybridParallelStrategy``'s
            ``activation_checkpointing``, else 0 (no ``train/hfu``). Pass it for checkpointing applied
            some other way.
        peak_file: a JSON file where a CPU's measured peak is recorded per machine and reused
            (default: the ``LIGHTNING_SCALE_PEAK_FILE`` environment variable, which a sweep sets to its
            study's ``peaks.json``; unset: measured in each process).
        token_count: ``batch -> tokens`` counted in ``train/tokens*`` (e.g. leaving out padding:
            ``lambda b: int(b["attention_mask"].sum())``); FLOPs and MFU stay those of the whole batch.

    Also logged: ``train/batches_per_sec`` (optimizer steps) and ``train/achieved_tflops_per_device``
    (the model's FLOPs per second per device). An MFU above 1 is a measurement error (a peak or a FLOPs
    count that is wrong): it is warned about once and neither MFU nor HFU is logged.
    """

    needs_model_flops = True
    """Asks ``HybridParallelStrategy`` to count the FLOPs of a model it cannot read them from, before it cuts it."""

    def __init__(
        self,
        window: int = 50,
        *,
        peak_flops: float | None = None,
        causal: bool = False,
        batch_shape: Callable[[Any], tuple[int, int]] | None = None,
        recomputed_flops_per_token: float | None = None,
        peak_file: str | os.PathLike[str] | None = None,
        token_count: Callable[[Any], int] | None = None,
    ) -> None:
        check_positive_int("window", window, fix="It counts optimizer steps.")
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(f"peak_flops={peak_flops!r} must be a positive number of FLOP/s per device.")
        if recomputed_flops_per_token is not None and (
            isinstance(recomputed_flops_per_token, bool)
            or not isinstance(recomputed_flops_per_token, (int, float))
            or not recomputed_flops_per_token >= 0
        ):
            raise ValueError(
                f"recomputed_flops_per_token={recomputed_flops_per_token!r} must be a number >= 0: the FLOPs per token "
                "that recomputing checkpointed activations adds to a training step (hardware minus model FLOPs). "
                "Pass None to have them counted under HybridParallelStrategy's activation checkpointing."
            )
        super().__init__()
        self.window = window
        self.peak_flops = peak_flops
        self.causal = causal
        self.batch_shape = batch_shape
        self.recomputed_flops_per_token = recomputed_flops_per_token
        self.peak_file = peak_file
        self.token_count = token_count
        self.facts: ModelFacts | None = None
        self._peak: float | None = None
        self._measured_peak = False
        self._marks: deque[tuple[float, ...]] = deque(maxlen=window + 1)  # (time, *totals) after each step
        self._per_token: dict[int, tuple[float, float]] = {}  # seq_len -> model and recomputed FLOPs per token
        # tokens, samples, model and recomputed FLOPs on this process since fit started
        self._totals = [0.0, 0.0, 0.0, 0.0]

    # ------------------------------------------------------------------ set-up

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.facts = telemetry.model_facts(trainer, pl_module)
        self._uncut = not hasattr(trainer.strategy, "model_facts")
        self._per_replica = trainer.world_size / telemetry.replicas(trainer)  # processes per replica
        self._peak, self._measured_peak = self._find_peak(trainer)
        self._marks.clear()
        self._per_token = {}
        self._totals = [0.0, 0.0, 0.0, 0.0]
        self._warned_flops = self._warned_recomputed = False
        self._warned_above_peak = False

    def _find_peak(self, trainer: Trainer) -> tuple[float | None, bool]:
        if self.peak_flops is not None:
            return float(self.peak_flops), False
        dtype, name = telemetry.compute_dtype(trainer), telemetry.device_name(trainer)
        if name == "cpu":
            path = self.peak_file if self.peak_file is not None else os.environ.get(PEAK_FILE_ENV)
            recorded, _ = recorded_peak(
                path, key=machine_key(dtype, trainer.num_devices), measure=lambda: measured_peak(dtype)
            )
            rank_zero_info(
                f"Throughput: a CPU has no datasheet peak; MFU is against {recorded / 1e9:.1f} GFLOP/s per process, "
                f"the median of repeated {dtype} matmuls (train/peak_flops_measured)"
                + (f", recorded in {path} for this machine." if path else ".")
            )
            return recorded, True
        peak = device_peak(name, dtype)
        if peak is None:
            rank_zero_warn(
                f"Throughput: no dense peak FLOP/s is known for {name!r} computing in {dtype}, so train/mfu is not "
                "logged. Pass Throughput(peak_flops=...) with one device's dense peak to report it."
            )
        return peak, False

    def _recomputed(self, seq_len: int) -> float:
        if self.recomputed_flops_per_token is not None:
            return float(self.recomputed_flops_per_token)
        assert self.facts is not None
        recomputed = self.facts.recomputed_flops_per_token(seq_len, causal=self.causal)
        if recomputed is None and not self._warned_recomputed:
            self._warned_recomputed = True
            rank_zero_warn(
                f"Throughput: activation checkpointing wraps {len(self.facts.checkpointed_blocks)} blocks, but what "
                "their recomputation costs was not counted (it is counted at the set-up of a fit with this callback, "
                "on meta tensors; the model was set up without it, or its training step cannot run on meta tensors), "
                "so train/hfu is not logged. Pass Throughput(recomputed_flops_per_token=...) to report it."
            )
        return recomputed or 0.0

    # ------------------------------------------------------------------ counting

    sizes = True
    reads = ("end",)

    @override
    def share_steps(self) -> bool:
        return self.batch_shape is None and self.token_count is None

    @override
    def record_options(self, trainer: Trainer) -> dict[str, Any]:
        return super().record_options(trainer) | {"shape_fn": self.batch_shape, "count_fn": self.token_count}

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._marks.append((self.steps.clock.now(), *self._totals))

    @override
    def fold_steps(self, trainer: Trainer, pl_module: LightningModule, steps: Sequence[telemetry.Step]) -> None:
        totals, marks = self._totals, self._marks
        for step in steps:
            seq_len = step.seq_len
            tokens = step.samples * seq_len  # what the model computes on, padding included: its FLOPs
            totals[0] += tokens if step.counted is None else step.counted
            totals[1] += step.samples
            per_token = self._per_token.get(seq_len)
            if per_token is None:  # counted once per sequence length, on the first batch of it
                per_token = self._per_token[seq_len] = self._flops_at(pl_module, step.batch, seq_len)
            totals[2] += tokens * per_token[0]
            totals[3] += tokens * per_token[1]
            if not step.accumulate:
                marks.append((step.end, *totals))  # (time, tokens, samples, flops, recomputed)

    @override
    def logging_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        (start, *first), (end, *last) = self._marks[0], self._marks[-1]
        window = [b - a for a, b in zip(first, last)]
        seconds, batches = end - start, len(self._marks) - 1
        telemetry.contribute(
            trainer,
            self,
            telemetry.Share(
                [*window, *self._totals[:2]],
                "sum",
                lambda reduced: self._metrics(trainer, reduced, seconds, batches),
                prog_bar=("train/tokens_per_sec", "train/mfu"),
            ),
        )

    def _flops_at(self, pl_module: LightningModule, batch: Any, seq_len: int) -> tuple[float, float]:
        """Model and recomputed FLOPs per token at ``seq_len`` (0.0 where unknown, with a warning)."""
        assert self.facts is not None
        if self.facts.source == "none" and not self._warned_flops and self._uncut and batch is not None:
            # A strategy that does not cut the model (DDP): count one training step on meta tensors now.
            self.facts.measure(pl_module, batch)
        flops = self.facts.flops_per_token(seq_len, causal=self.causal)
        if flops is None and not self._warned_flops:
            self._warned_flops = True
            rank_zero_warn(
                f"Throughput: the FLOPs per token of {type(pl_module).__name__} are unknown (no {FLOPS_HOOK}(seq_len) "
                "hook, no transformer config, and FlopCounterMode could not run its training step on meta tensors), so "
                f"train/mfu is not logged. Define {type(pl_module).__name__}.{FLOPS_HOOK}(self, seq_len) -> float."
            )
        return flops or 0.0, self._recomputed(seq_len)

    def _metrics(self, trainer: Trainer, totals: list[float], seconds: float, batches: int) -> dict[str, float]:
        """The metrics over the window of ``seconds`` and ``batches`` optimizer steps, from the processes'
        summed window counts and totals."""
        tokens, samples, flops, recomputed, total_tokens, total_samples = (v / self._per_replica for v in totals)
        devices = trainer.world_size
        out = {"train/tokens": total_tokens, "train/samples": total_samples}
        if seconds <= 0:
            return out
        out |= {
            "train/tokens_per_sec": tokens / seconds,
            "train/tokens_per_sec_per_device": tokens / seconds / devices,
            "train/samples_per_sec": samples / seconds,
            "train/samples_per_sec_per_device": samples / seconds / devices,
            "train/batches_per_sec": batches / seconds,  # optimizer steps (global batches)
        }
        if flops > 0:
            out["train/achieved_tflops_per_device"] = flops / seconds / devices / 1e12  # the model's FLOPs
        if self._peak is not None and flops > 0:
            # flops / tokens: FLOPs per token averaged over the window's sequence lengths.
            mfu = model_flops_utilization(flops / tokens, tokens / seconds, devices, self._peak)
            if self._measured_peak:
                out["train/peak_flops_measured"] = self._peak
            if mfu > 1:
                # More FLOP/s than the peak: the peak (or the FLOPs count) is wrong, not the utilisation.
                if not self._warned_above_peak:
                    self._warned_above_peak = True
                    rank_zero_warn(
                        f"Throughput: the model ran at {mfu:.2f}x the peak of {self._peak / 1e12:.4g} TFLOP/s per device, "
                        "which is a measurement error, so train/mfu and train/hfu are not logged: "
                        + (
                            "the CPU peak was measured low (a busy machine?); pass Throughput(peak_flops=...) or delete the "
                            "recorded peak to measure again."
                            if self._measured_peak
                            else "check peak_flops and the model's FLOPs per token."
                        )
                    )
                return out
            out["train/mfu"] = mfu
            if recomputed > 0:
                out["train/hfu"] = model_flops_utilization(
                    (flops + recomputed) / tokens, tokens / seconds, devices, self._peak
                )
        return out
