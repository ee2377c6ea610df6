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

import lightning_scale.callbacks._telemetry as telemetry
from lightning_scale.callbacks import CallbackGroup, ConsoleLogger, CostMonitor, PreemptionCheckpoint, Throughput, each_callback
from lightning_scale.callbacks.group import HOOKS, group_callbacks
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule

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
        trainer = _fit(callbacks, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=1, logger=logger,
                       enable_checkpointing=True)  # fmt: skip
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            lrs = [(row["step"], row["lr-AdamW/pg1"]) for row in csv.DictReader(f) if row.get("lr-AdamW/pg1")]
        runs[grouped] = (recorder.calls, counter.batches, lrs, [type(c).__name__ for c in each_callback(trainer)])
    apart, grouped_run = runs[False], runs[True]
    assert grouped_run[0] == apart[0]
    assert {"on_save_checkpoint", "on_validation_batch_end", "on_sanity_check_start", "on_fit_end", "teardown"} <= {h for h, _ in apart[0]}
    assert grouped_run[1] == apart[1] == 4
    assert grouped_run[2] == apart[2] and len(apart[2]) == 4
    assert "Recorder" in grouped_run[3] and "LearningRateMonitor" in grouped_run[3]


def test_a_groups_checkpoint_keeps_each_members_state_and_loads_one_written_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "clock", lambda: 0.0)  # cost by steps only: no time passes
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
    assert set(saved[group.state_key]) == {"Counter", "CostMonitor"} and saved[group.state_key]["Counter"] == {"batches": 4}
    assert "Counter" not in saved
    again = Counter()
    _fit([CallbackGroup([again, CostMonitor(price_per_device_hour=1.0)], name="mine")], steps=5, ckpt_path=save.best_model_path)
    assert again.batches == 4 + 1


def test_what_lightning_or_the_package_finds_by_type_stays_out_of_a_group() -> None:
    with pytest.raises(TypeError, match=r"ModelCheckpoint cannot be in a CallbackGroup: .* Pass it to Trainer\(callbacks="):
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
