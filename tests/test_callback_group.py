"""CallbackGroup: several callbacks dispatched as one behave as they do apart (the hooks each receives, what
Lightning's own callbacks log, checkpoint state both ways), and what cannot be grouped is refused."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lightning import quiet_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_scale.callbacks._steps as _steps
from lightning_scale._lightning_hooks import STEP_HOOKS, restore_hooks, skip_hooks
from lightning_scale.callbacks import (
    CallbackGroup,
    ConsoleLogger,
    CostMonitor,
    GradNormMonitor,
    PreemptionCheckpoint,
    Throughput,
    each_callback,
)
from lightning_scale.callbacks.group import HOOKS, group_callbacks
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins import MixedPrecision

CONFIG = GPTConfig(n_layers=1, d_model=16, n_heads=2, block_size=8)


class Recorder(Callback):
    """Records every hook Lightning calls on it, with the step it came at."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []


def _recording(hook: str) -> Any:
    def record(self: Recorder, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append((hook, trainer.global_step))

    return record


for _hook in HOOKS:
    setattr(Recorder, _hook, _recording(_hook))


class Counter(Callback):
    """A user's stateful callback that only counts training batches (one hook)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


def _fit(callbacks: list[Callback], steps: int = 4, ckpt_path: Any = None, **kwargs: Any) -> Any:
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, **kwargs)
    datamodule = TextDataModule(seq_len=8, global_batch_size=2)
    trainer.fit(GPTLightningModule(CONFIG, learning_rate=1e-2), datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def test_members_get_the_hooks_they_would_get_apart_and_lightnings_own_callbacks_log_alike(tmp_path: Path) -> None:
    # Validation, sanity check, a checkpoint save and the fit's end all run; Lightning's LearningRateMonitor
    # (which the package did not write) logs from inside the group.
    runs = {}
    for grouped in (False, True):
        recorder, counter, monitor = Recorder(), Counter(), LearningRateMonitor(logging_interval="step")
        members: list[Callback] = [recorder, counter, monitor]
        save = ModelCheckpoint(dirpath=tmp_path / f"ckpt-{grouped}", every_n_train_steps=2)
        logger = CSVLogger(tmp_path, name=f"grouped-{grouped}")
        callbacks = ([CallbackGroup(members)] if grouped else members) + [save]
        trainer = _fit(
            callbacks,
            limit_val_batches=1,
            val_check_interval=2,
            num_sanity_val_steps=1,
            logger=logger,
            enable_checkpointing=True,
        )
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            lrs = [(row["step"], row["lr-AdamW/pg1"]) for row in csv.DictReader(f) if row.get("lr-AdamW/pg1")]
        runs[grouped] = (recorder.calls, counter.batches, lrs, [type(c).__name__ for c in each_callback(trainer)])
    apart, grouped_run = runs[False], runs[True]
    assert grouped_run[0] == apart[0]
    assert {"on_save_checkpoint", "on_validation_batch_end", "on_sanity_check_start", "on_fit_end", "teardown"} <= {
        h for h, _ in apart[0]
    }
    assert grouped_run[1] == apart[1] == 4
    assert grouped_run[2] == apart[2] and len(apart[2]) == 4
    assert "Recorder" in grouped_run[3] and "LearningRateMonitor" in grouped_run[3]


class _VirtualTime:
    """The telemetry's clock, advanced by the model at known points of each step (exact figures)."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedGPT(GPTLightningModule):
    """0.3 s of forward and backward, 0.1 s of optimizer step, 0.05 s between batches, 7 s per validation batch."""

    def __init__(self, clock: _VirtualTime, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.virtual = clock

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.virtual.now += 0.3
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:  # after the callbacks' hook: the optimizer span
        self.virtual.now += 0.1

    def on_train_batch_end(self, *args: Any) -> None:  # after the callbacks': the wait for the next batch
        self.virtual.now += 0.05

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.virtual.now += 7.0  # not training time
        return super().validation_step(batch, batch_idx)


def test_telemetry_members_report_the_same_figures_grouped_as_apart_and_fold_steps_only_at_logging_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a group the members' per-step hooks do not run: the group records each step once and the members fold
    # the records at logging steps. Every figure must be what each member computes alone (a virtual clock makes
    # them exact), through gradient accumulation, validation inside the fit and a checkpoint save.
    from lightning_scale.callbacks import GoodputMonitor, StepTimeBreakdown, StragglerMonitor

    runs, folds = {}, {}
    for grouped in (False, True):
        virtual = _VirtualTime()
        monkeypatch.setattr(_steps, "clock", virtual)
        members: list[Callback] = [
            Throughput(window=3, peak_flops=1e12),
            CostMonitor(price_per_device_hour=3.6),
            StepTimeBreakdown(),
            StragglerMonitor(probe=False),
            GoodputMonitor(dirpath=tmp_path / f"goodput-{grouped}"),
        ]
        calls = folds[grouped] = []
        for member in members:
            fold = member.fold_steps
            member.fold_steps = lambda t, m, steps, fold=fold: (calls.append(len(steps)), fold(t, m, steps))[1]  # type: ignore[method-assign]
        logger = CSVLogger(tmp_path, name=f"grouped-{grouped}")
        seed_everything(0, verbose=False)
        trainer = quiet_trainer(
            max_steps=8,
            callbacks=[CallbackGroup(members)] if grouped else members,
            logger=logger,
            log_every_n_steps=3,
            accumulate_grad_batches=2,
            limit_val_batches=1,
            val_check_interval=6,
            num_sanity_val_steps=0,
        )
        trainer.fit(
            TimedGPT(virtual, CONFIG, learning_rate=1e-2), datamodule=TextDataModule(seq_len=8, global_batch_size=2)
        )
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            rows = [
                {k: v for k, v in row.items() if v and not k.startswith(("goodput/", "val/"))}
                for row in csv.DictReader(f)
            ]
        runs[grouped] = [row for row in rows if len(row) > 2]
    apart, grouped_rows = runs[False], runs[True]
    assert grouped_rows == apart
    logged = {k for row in apart for k in row}
    assert {
        "train/tokens_per_sec",
        "train/mfu",
        "cost/usd",
        "train/step_time/data",
        "train/step_time/optimizer",
        "stragglers/max_ratio",
    } <= logged
    # The spans of the virtual clock: 2 batches per optimizer step, validation left out.
    second = [row for row in apart if "train/step_time/data" in row][1]
    assert float(second["train/step_time/compute"]) == pytest.approx(2 * 0.3)
    assert float(second["train/step_time/optimizer"]) == pytest.approx(0.1)
    assert float(second["train/step_time/data"]) == pytest.approx(2 * 0.05)
    # Apart, each member folds every batch as it ends (the goodput monitor the fit's first only: then it has nothing
    # to record); grouped, at the fit's first batch, the logging steps and validation's start only, every batch once.
    assert folds[False] == [1] * (4 * 16 + 1)
    assert sum(folds[True]) == 5 * 16 and len(folds[True]) <= 5 * 6, folds[True]


def test_a_groups_checkpoint_keeps_each_members_state_and_loads_one_written_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_steps, "clock", lambda: 0.0)  # cost by steps only: no time passes
    # Written apart, resumed in a group: the members' states carry over.
    apart = ModelCheckpoint(dirpath=tmp_path / "apart", every_n_train_steps=2)
    counter = Counter()
    _fit([counter, CostMonitor(price_per_device_hour=1.0), apart], steps=2, enable_checkpointing=True)
    resumed = Counter()
    group = CallbackGroup([resumed, CostMonitor(price_per_device_hour=1.0)], name="mine")
    save = ModelCheckpoint(dirpath=tmp_path / "grouped", every_n_train_steps=4)
    _fit([group, save], steps=4, ckpt_path=apart.last_model_path or apart.best_model_path, enable_checkpointing=True)
    assert resumed.batches == 2 + 2
    # Written by a group: each member's state under its own key, inside the group's entry.
    saved = torch.load(save.best_model_path, weights_only=False)["callbacks"]
    assert set(saved[group.state_key]) == {"Counter", "CostMonitor"} and saved[group.state_key]["Counter"] == {
        "batches": 4
    }
    assert "Counter" not in saved
    again = Counter()
    _fit(
        [CallbackGroup([again, CostMonitor(price_per_device_hour=1.0)], name="mine")],
        steps=5,
        ckpt_path=save.best_model_path,
    )
    assert again.batches == 4 + 1


def test_a_hook_taken_out_of_lightnings_dispatch_is_not_called_until_restored_and_a_group_skips_its_idle_ones() -> None:
    # lightning_scale._lightning_hooks relies on Lightning calling a callback's hook only when it is callable.
    counter = Counter()
    skip_hooks(counter, ["on_train_batch_end"])
    _fit([counter], steps=2)
    assert counter.batches == 0
    restore_hooks(counter)
    _fit([counter], steps=2)
    assert counter.batches == 2

    # A group's per-step hooks that no member has are not dispatched (they come back at its next set-up).
    class Starts(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.started = True

    group = CallbackGroup([Counter(), Starts()])
    _fit([group], steps=2)
    skipped = {h for h in STEP_HOOKS if vars(group).get(h, 0) is None}
    assert skipped == {"on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"}
    assert group.callbacks[0].batches == 2 and group.callbacks[1].started
    # A member that takes a hook out at its own set-up is not called there by the group either: GradNormMonitor,
    # when the precision plugin logs the norm, has nothing to do per step.
    group = CallbackGroup([GradNormMonitor(), Counter()])
    _fit([group], steps=2, plugins=[MixedPrecision("32-true")])
    assert (
        vars(group.callbacks[0])["on_before_optimizer_step"] is None and vars(group)["on_before_optimizer_step"] is None
    )


def test_what_lightning_or_the_package_finds_by_type_stays_out_of_a_group() -> None:
    with pytest.raises(
        TypeError, match=r"ModelCheckpoint cannot be in a CallbackGroup: .* Pass it to Trainer\(callbacks="
    ):
        CallbackGroup([Counter(), ModelCheckpoint()])
    with pytest.raises(TypeError, match=r"PreemptionCheckpoint cannot be in a CallbackGroup"):
        CallbackGroup([PreemptionCheckpoint()])
    with pytest.raises(TypeError, match=r"CallbackGroup takes Lightning callbacks; got 'throughput' \(str\)"):
        CallbackGroup(["throughput"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"more than one member keeps its state under \['Counter'\]"):
        CallbackGroup([Counter(), Counter()])
    with pytest.raises(ValueError, match=r"CallbackGroup\(name=''\) must be a non-empty string"):
        CallbackGroup([Counter()], name="")
    # The command line's arrangement: the group where its first member was, the others kept in order.
    console, save, throughput, preempt = ConsoleLogger(), ModelCheckpoint(), Throughput(), PreemptionCheckpoint()
    arranged = group_callbacks([console, save, throughput, preempt])
    assert [type(c) for c in arranged] == [CallbackGroup, ModelCheckpoint, PreemptionCheckpoint]
    assert arranged[0].callbacks == [throughput, console]  # the console last: it prints what the others published
    assert arranged[0].needs_model_flops  # the strategy's question, answered for the members
    assert group_callbacks([console, save]) == [console, save]  # one alone is not grouped
    nested = CallbackGroup([CallbackGroup([console]), throughput])
    assert nested.callbacks == [throughput, console]
