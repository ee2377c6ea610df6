"""Telemetry of the data-parallel exchange (issue 40): ``SyncMonitor``'s ``train/sync/*`` and its run record,
``StepTimeBreakdown``'s ``sync`` part, the report's plots against tokens, time and bytes, and the Hydra options
and ``experiment=sync_sweep`` (one process; the strategy's exchange is a fake with ``sync_stats``)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lightning import quiet_trainer
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.strategies import SingleDeviceStrategy
from PIL import Image

import lightning_scale.callbacks._steps as _steps
from lightning_scale.callbacks import StepTimeBreakdown, SyncMonitor, Throughput
from lightning_scale.callbacks.group import group_callbacks
from lightning_scale.cli.job_config import instantiate
from lightning_scale.cli.report import build_report
from lightning_scale.cli.report_plots import PALETTE
from lightning_scale.cli.report_sync import is_sync_study, sync_label, sync_points
from lightning_scale.cli.results import SUMMARY_METRICS, sync_record
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.strategies import HybridParallelStrategy

CONFIG = GPTConfig(n_layers=1, d_model=16, n_heads=2, block_size=8)
BYTES, BLOCKED = 1000.0, 0.1  # what the fake exchange sends and blocks, every optimizer step
TICK = 0.25  # every clock reading advances this much


class SyncingStrategy(SingleDeviceStrategy):
    """One process with ``HybridParallelStrategy``'s ``sync_stats``: an exchange inside every optimizer step,
    after the update, of ``BYTES`` in one all-reduce round that blocks the loop ``BLOCKED`` seconds. Its counters
    start at 0, or at ``resumed`` steps' (a strategy that counts on from the checkpoint it resumed)."""

    def __init__(self, resumed: int = 0) -> None:
        super().__init__(device=torch.device("cpu"))
        self.stepped = resumed

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        self.stepped += 1
        return out

    def sync_stats(self) -> dict[str, Any]:
        n = self.stepped
        return {"mode": "diloco", "every": 1, "bytes_sent": BYTES * n, "exchanges": n, "blocked_s": BLOCKED * n}


class Logged(Callback):
    """The train/ metrics published at each logging step, with the step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if _steps.should_log(trainer):
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
            self.steps.append({"step": trainer.global_step, **metrics})


def _fit(
    strategy: Any, monitor: SyncMonitor, steps: int = 4, ckpt_path: Path | None = None
) -> tuple[list[dict[str, float]], Any]:
    seed_everything(0, verbose=False)
    logged = Logged()
    callbacks = group_callbacks([StepTimeBreakdown(), monitor])  # as lightning-scale-train hands them over
    trainer = quiet_trainer(max_steps=steps, strategy=strategy, callbacks=[*callbacks, logged], log_every_n_steps=2)
    module, data = GPTLightningModule(CONFIG, learning_rate=1e-2), TextDataModule(seq_len=8, global_batch_size=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return logged.steps, trainer


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += TICK
        return now[0]

    monkeypatch.setattr(_steps, "clock", clock)


# ---------------------------------------------------------------------------- the callbacks


def test_the_sync_part_is_taken_out_of_the_optimizer_span_and_the_parts_still_add_up(fake_clock: None) -> None:
    synced, _ = _fit(SyncingStrategy(), SyncMonitor())
    plain, _ = _fit(SingleDeviceStrategy(device=torch.device("cpu")), SyncMonitor())
    assert [s["step"] for s in synced] == [s["step"] for s in plain] == [2, 4]
    for with_sync, without in zip(synced, plain, strict=True):
        assert with_sync["train/step_time/sync"] == pytest.approx(BLOCKED)
        # The same spans (the patched clock ticks alike): the blocked seconds moved from optimizer to sync.
        assert with_sync["train/step_time/optimizer"] == pytest.approx(without["train/step_time/optimizer"] - BLOCKED)
        assert with_sync["train/step_time/total"] == pytest.approx(without["train/step_time/total"])
        parts = ("data", "compute", "comm", "optimizer", "checkpoint", "sync")
        assert with_sync["train/step_time/total"] == pytest.approx(
            sum(with_sync[f"train/step_time/{p}"] for p in parts)
        )
        # Lightning's strategies keep no sync_stats: no sync part and no train/sync/*, the other figures as before.
        assert "train/step_time/sync" not in without and not any(k.startswith("train/sync/") for k in without)


def test_the_monitor_logs_bytes_and_exchanges_per_step_and_the_total_per_process() -> None:
    logged, trainer = _fit(SyncingStrategy(), SyncMonitor())
    for at in logged:
        assert at["train/sync/bytes_per_step"] == pytest.approx(BYTES)
        assert at["train/sync/exchanges_per_step"] == pytest.approx(1.0)
        assert at["train/sync/bytes_total"] == pytest.approx(BYTES * at["step"])
    record = sync_record(trainer)  # what results.json's "sync" holds
    assert record is not None and (record["mode"], record["every"], record["steps"]) == ("diloco", 1, 4)
    assert (record["bytes_sent"], record["exchanges"], record["blocked_s"]) == pytest.approx(
        (4 * BYTES, 4, 4 * BLOCKED)
    )
    assert record["bytes_per_step"] == pytest.approx(BYTES)
    assert [(r[0], r[2]) for r in record["curve"]] == [(0, 0.0), (4, 4 * BYTES)]  # the fit's start and end
    assert record["curve"][0][1] == 0.0 < record["curve"][1][1] == pytest.approx(record["train_s"])
    assert {"train/sync/bytes_total", "train/sync/bytes_per_step", "train/step_time/sync"} <= set(SUMMARY_METRICS)


@pytest.mark.parametrize("counts_on", [False, True], ids=["strategy_from_0", "strategy_from_checkpoint"])
def test_a_resumed_fit_goes_on_from_the_checkpoints_totals_and_notes(
    tmp_path: Path, counts_on: bool, fake_clock: None
) -> None:
    _, trainer = _fit(SyncingStrategy(), SyncMonitor())
    trainer.save_checkpoint(tmp_path / "step4.ckpt")
    earlier = sync_record(trainer)
    # The strategy counts from 0 again (the monitor adds what its checkpoint state holds) or on from the
    # checkpoint's 4 steps (the monitor adds nothing): the same totals either way, and no window inflated.
    strategy = SyncingStrategy(resumed=4 if counts_on else 0)
    logged, trainer = _fit(strategy, SyncMonitor(), steps=8, ckpt_path=tmp_path / "step4.ckpt")
    assert [(s["step"], s["train/sync/bytes_total"]) for s in logged] == [(6, 6 * BYTES), (8, 8 * BYTES)]
    assert [s["train/sync/bytes_per_step"] for s in logged] == [BYTES, BYTES]
    assert [s["train/step_time/sync"] for s in logged] == pytest.approx([BLOCKED, BLOCKED])
    record = sync_record(trainer)
    assert (record["bytes_sent"], record["exchanges"], record["steps"]) == pytest.approx((8 * BYTES, 8, 8))
    assert [(p[0], p[2]) for p in record["curve"]] == [(0, 0.0), (4, 4 * BYTES), (8, 8 * BYTES)]
    # Training time goes on from the checkpoint's (taken after the first fit's end: a little later than its record).
    assert earlier["train_s"] <= record["curve"][1][1] < record["train_s"]


def test_without_sync_stats_the_monitor_logs_nothing_and_records_nothing() -> None:
    seed_everything(0, verbose=False)
    monitor, logged = SyncMonitor(), Logged()
    trainer = quiet_trainer(max_steps=2, callbacks=[Throughput(window=1), monitor, logged])  # the monitor last
    trainer.fit(GPTLightningModule(CONFIG), datamodule=TextDataModule(seq_len=8, global_batch_size=2))
    # Last among the telemetry, it still closes each step's round: Throughput's figures are there at every step.
    assert [s["step"] for s in logged.steps if "train/tokens" in s] == [1, 2]
    assert not any(k.startswith("train/sync/") for s in logged.steps for k in s)
    assert monitor.summary is None and sync_record(trainer) is None and monitor.state_dict() == {}


# ---------------------------------------------------------------------------- the report


def _job(study: Path, num: int, sync: str | None, every: int | None, recorded: bool = True) -> dict[str, Any]:
    """A completed job of a sync sweep: validation every 50 of 100 steps; with ``recorded``, the sync record of a
    run whose exchange sends 4000 / H bytes a step, 1 s a step of training."""
    overrides = ["experiment=sync_sweep"]
    if sync == "every_step":
        overrides.append("strategy.data_parallel_sync=every_step")
    elif sync is not None:
        overrides.append(f"strategy.data_parallel_sync={{mode:{sync},every:{every}}}")
    per_step = 4000.0 / (every or 1)
    doc: dict[str, Any] = {
        "status": "completed",
        "study": study.name,
        "job": num,
        "layout": "dp2-tp1-pp1",
        "layout_sizes": {"dp": 2, "tp": 1, "pp": 1},
        "world_size": 2,
        "overrides": overrides,
        "precision": "32-true",
        "global_batch_size": 16,
        "seq_len": 128,
        "tokens_per_sec": 1000.0 + num,
        "curves": {"train/loss": [[0, 5.5]], "val/loss": [[0, 5.6], [50, 3.0 + num / 10], [100, 2.5 + num / 10]]},
        "sync": None,
    }
    if recorded:
        mode = sync or "every_step"
        doc["sync"] = {
            "mode": mode,
            "every": every or 1,
            "bytes_sent": 100 * per_step,
            "curve": [
                [0, 0.0, 0.0],
                [25, 25.0, 25 * per_step],
                [50, 50.0, 50 * per_step],
                [100, 100.0, 100 * per_step],
            ],
        }
        if mode != "every_step":  # the record names it: the overrides need not
            doc["overrides"] = ["experiment=sync_sweep"]
    (study / str(num)).mkdir(parents=True)
    (study / str(num) / "results.json").write_text(json.dumps(doc))
    return doc


def _lines(path: Path) -> tuple[list[dict[str, str]], dict[str, list[list[float]]]]:
    """The PNG's ``Series`` (each of whose colours is drawn) and ``Lines`` text chunks."""
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 200
        series, lines = json.loads(img.text["Series"]), json.loads(img.text["Lines"])
        colours = {c for _, c in img.convert("RGB").getcolors(maxcolors=1 << 20)}
        assert img.text["Title"].startswith("Validation loss against")
    for s in series:
        assert tuple(int(s["color"][i : i + 2], 16) for i in (1, 3, 5)) in colours, (path.name, s)
    return series, lines


def test_the_report_plots_validation_loss_against_tokens_time_and_bytes_one_line_per_mode_and_h(tmp_path: Path) -> None:
    study = tmp_path / "multirun" / "sync-00000000"
    _job(study, 0, "diloco", 50)
    _job(study, 1, "every_step", None)
    _job(study, 2, "local_sgd", 10)
    _job(study, 3, "diloco", 10)
    _job(study, 4, "local_sgd", 50, recorded=False)  # named by its overrides; no time or bytes
    report = build_report(study)
    names = ["every_step", "diloco H=10", "diloco H=50", "local_sgd H=10", "local_sgd H=50"]
    series, tokens = _lines(report.plots["val_loss_vs_tokens"])
    assert [s["name"] for s in series] == names and [s["color"] for s in series] == list(PALETTE[:5])
    assert tokens["diloco H=50"] == [[0, 5.6], [50 * 16 * 128, 3.0], [100 * 16 * 128, 2.5]]  # step x batch x seq
    series, seconds = _lines(report.plots["val_loss_vs_time"])
    assert [s["name"] for s in series] == names[:4]  # the job without a record is left out, with a note
    assert seconds["every_step"] == [[0, 5.6], [50, 3.1], [100, 2.6]]
    series, sent = _lines(report.plots["val_loss_vs_bytes"])
    assert [s["name"] for s in series] == names[:4]
    assert sent["every_step"] == [[0, 5.6], [50 * 4000, 3.1], [100 * 4000, 2.6]]
    assert sent["diloco H=50"] == [[0, 5.6], [50 * 80, 3.0], [100 * 80, 2.5]]
    md = report.markdown.read_text()
    for name in ("val_loss_vs_tokens", "val_loss_vs_time", "val_loss_vs_bytes"):
        assert f"(plots/{name}.png)" in md
    assert "No sync record" in md and "local_sgd H=50" in md
    assert len(report.plots) == 2 + 3  # throughput and loss curves (nothing else recorded), and these three


def test_a_study_that_does_not_compare_synchronisation_gets_none_of_these_plots(tmp_path: Path) -> None:
    study = tmp_path / "multirun" / "plain-00000000"
    jobs = [_job(study, n, None, None, recorded=False) for n in range(2)]
    assert not is_sync_study(jobs)
    assert not {"val_loss_vs_tokens", "val_loss_vs_time", "val_loss_vs_bytes"} & set(build_report(study).plots)


def test_the_line_names_come_from_the_record_else_the_overrides() -> None:
    assert sync_label({"sync": {"mode": "streaming_diloco", "every": 50}}) == "streaming_diloco H=50"
    assert sync_label({"sync": {"mode": "every_step", "every": 1}}) == "every_step"
    assert sync_label({"overrides": ["strategy.data_parallel_sync=diloco", "strategy.sync_every=50"]}) == "diloco H=50"
    assert sync_label({"overrides": ["strategy.data_parallel_sync={mode:local_sgd,every:10,outer_lr:0.7}"]}) == (
        "local_sgd H=10"
    )
    assert sync_label({"overrides": ["strategy.data_parallel_sync=local_sgd"]}) == "local_sgd"
    assert sync_label({"overrides": []}) == "every_step"
    assert is_sync_study([{"overrides": ["strategy.sync_every=10"]}, {"overrides": ["strategy.sync_every=50"]}])


def test_validation_between_the_noted_steps_is_interpolated_and_outside_them_left_out() -> None:
    job = {
        "curves": {"val/loss": [[10, 4.0], [30, 3.0], [90, 2.0]]},
        "sync": {"curve": [[0, 0.0, 0.0], [20, 10.0, 100.0], [40, 30.0, 300.0]]},
    }
    points = sync_points(job)
    assert points["seconds"] == [(5.0, 4.0), (20.0, 3.0)] and points["bytes"] == [(50.0, 4.0), (200.0, 3.0)]
    assert "tokens" not in points  # no batch size or sequence length recorded


# ---------------------------------------------------------------------------- Hydra


def _compose(*overrides: str) -> Any:
    GlobalHydra.instance().clear()
    with initialize_config_module("lightning_scale.conf", version_base="1.3"):
        return compose("config", overrides=["run_dir=unused", *overrides], return_hydra_config=True)


def _sweep_jobs(*overrides: str) -> list[list[str]]:
    """The override lists Hydra's basic sweeper makes of the preset's ``params`` and ``overrides``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in _compose(*overrides).hydra.sweeper.params.items()]
    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides([*params, *overrides]), None)
    return batch


def test_the_sync_sweep_runs_each_mode_and_h_once_on_two_data_parallel_processes() -> None:
    jobs = _sweep_jobs("experiment=sync_sweep")
    assert [[o for o in job if o.startswith("strategy.")] for job in jobs] == [
        ["strategy.data_parallel_sync=every_step"],
        ["strategy.data_parallel_sync={mode:local_sgd,every:10}"],
        ["strategy.data_parallel_sync={mode:local_sgd,every:50}"],
        ["strategy.data_parallel_sync={mode:diloco,every:10}"],
        ["strategy.data_parallel_sync={mode:diloco,every:50}"],
    ]
    labels = [sync_label({"overrides": job}) for job in jobs]
    assert labels == ["every_step", "local_sgd H=10", "local_sgd H=50", "diloco H=10", "diloco H=50"]
    for job in jobs:
        cfg = _compose(*job)
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN" and cfg.strategy._target_.endswith("HybridParallelStrategy")
        assert (cfg.trainer.devices, cfg.trainer.accelerator, cfg.strategy.data_parallel) == (2, "cpu", 2)
        assert set(cfg.logger) == {"csv", "wandb"} and "sync" in cfg.callbacks
        sync = cfg.strategy.data_parallel_sync
        every = 1 if sync == "every_step" else sync.every
        assert cfg.trainer.val_check_interval % every == 0  # validated right after an exchange
        assert cfg.trainer.max_steps // cfg.trainer.val_check_interval >= 4  # enough points for a curve


def _strategy_kwargs(cfg: Any) -> dict[str, Any]:
    """What ``lightning-scale-train`` would pass ``HybridParallelStrategy`` (as plain values)."""
    return instantiate(cfg.strategy, _target_="builtins.dict", checkpoint_io=None)


def test_the_hybrid_configs_sync_options_reach_the_strategys_arguments() -> None:
    defaults = _strategy_kwargs(_compose())
    assert (defaults["data_parallel_sync"], defaults["sync_every"], defaults["emulated_link"]) == (
        "every_step",
        None,
        None,
    )
    given = _strategy_kwargs(_compose("strategy.data_parallel_sync=diloco", "strategy.sync_every=50"))
    assert (given["data_parallel_sync"], given["sync_every"]) == ("diloco", 50)
    mapping = _strategy_kwargs(
        _compose(
            "strategy.data_parallel_sync={mode:diloco,every:50,outer_lr:0.7,nesterov:true}",
            "strategy.emulated_link={bandwidth_mbps:100,latency_ms:20}",
        )
    )
    assert mapping["data_parallel_sync"] == {"mode": "diloco", "every": 50, "outer_lr": 0.7, "nesterov": True}
    assert type(mapping["data_parallel_sync"]) is dict and mapping["emulated_link"] == {
        "bandwidth_mbps": 100,
        "latency_ms": 20,
    }


@pytest.mark.skipif(
    "data_parallel_sync" not in inspect.signature(HybridParallelStrategy).parameters,
    reason="HybridParallelStrategy(data_parallel_sync=...) has not landed yet (issue 40)",
)
def test_the_strategy_takes_the_configs_sync_options() -> None:
    for overrides in (
        ("strategy.data_parallel_sync=diloco", "strategy.sync_every=50"),
        (
            "strategy.data_parallel_sync={mode:local_sgd,every:10}",
            "strategy.emulated_link={bandwidth_mbps:100,latency_ms:20}",
        ),
    ):
        strategy = instantiate(_compose(*overrides).strategy)
        assert isinstance(strategy, HybridParallelStrategy) and callable(strategy.sync_stats)
