"""The straggler action (issue 27): ``StragglerMonitor(action="restart")`` stops a run whose rank stays slower
than ``factor`` x the median at ``patience`` logging intervals in a row: a checkpoint of that step, the
rank and its host in ``stragglers/exclude.json``, every process ends with ``STRAGGLER_EXIT_CODE``; a rank
slower only within the factor never triggers it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import DistributedTestError, run_distributed
from helpers.lightning import quiet_trainer
from helpers.models import StackModule
from lightning.pytorch import Callback, seed_everything
from torch.utils.data import DataLoader, TensorDataset, default_collate

from lightning_scale.callbacks import STRAGGLER_EXIT_CODE, StragglerMonitor
from lightning_scale.core.checkpoint.format import verify
from lightning_scale.core.resilience import HANG_EXIT_CODE, SlowStreaks, record_exclusion
from lightning_scale.plugins import PREEMPTION_EXIT_CODE
from lightning_scale.plugins import STRAGGLER_EXIT_CODE as PLUGINS_STRAGGLER_EXIT_CODE
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

LOG_EVERY, PATIENCE = 2, 3
# With two ranks the median is their mean, so a rank's ratio is below 2 and above FACTOR when its time is over
# FACTOR / (2 - FACTOR) = 1.86x the other's: 50 ms more stays above it while the other rank's own wait (~10-20 ms
# here, under the neighbours' load) is under 58 ms.
FACTOR = 1.3


# ---------------------------------------------------------------- the options, the streaks, the record


def test_the_exit_code_is_its_own_and_bad_options_name_the_fix() -> None:
    assert STRAGGLER_EXIT_CODE == PLUGINS_STRAGGLER_EXIT_CODE == 76
    assert len({STRAGGLER_EXIT_CODE, HANG_EXIT_CODE, PREEMPTION_EXIT_CODE}) == 3
    monitor = StragglerMonitor()
    assert (monitor.action, monitor.patience) == ("warn", 3)
    with pytest.raises(ValueError, match=r"action='stop' is not an action\. Pass 'warn' .* or 'restart' .* status 76"):
        StragglerMonitor(action="stop")  # type: ignore[arg-type]
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(
            ValueError, match=rf"patience={bad!r} must be an integer of 1 or more: .* \(e\.g\. patience=3\)"
        ):
            StragglerMonitor(action="restart", patience=bad)  # type: ignore[arg-type]


def test_only_consecutive_intervals_of_the_same_rank_count() -> None:
    streaks = SlowStreaks(patience=3)
    assert streaks.update({1: 1.8}) == {} and streaks.update({1: 1.9, 2: 1.7}) == {}
    assert streaks.update({2: 1.6}) == {}  # rank 1 was not slow at this interval: it starts again
    assert (streaks.count(1), streaks.count(2)) == (0, 2)
    assert streaks.update({2: 1.65, 0: 2.0}) == {2: [1.7, 1.6, 1.65]}
    assert SlowStreaks(patience=1).update({0: 3.0, 3: 2.0}) == {0: [3.0], 3: [2.0]}


def test_the_exclusion_keeps_every_host_excluded_so_far_and_appends_an_event(tmp_path: Path) -> None:
    first = record_exclusion(tmp_path, {"event": "straggler", "step": 6}, ["node-a"])
    second = record_exclusion(tmp_path, {"event": "straggler", "step": 12}, ["node-b", "node-a"])
    assert (first["exclude"], second["exclude"]) == (["node-a"], ["node-a", "node-b"])
    assert json.loads((tmp_path / "exclude.json").read_text()) == second
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [6, 12] and all("exclude" not in e for e in events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "exclude.json"]  # no staging file left


# ---------------------------------------------------------------- two processes, a rank slowed on purpose


class SlowCollate:
    """The slowdown: batch assembly (the DataLoader's ``collate_fn``, in the training process) sleeps
    ``delay_s[rank]``, as a slow disk or CPU on one host would. The monitor's ``local`` measure sees it: the
    next batch is fetched between one batch's end and the next one's start, its data wait."""

    def __init__(self, delay_s: dict[int, float]) -> None:
        self.delay_s = delay_s

    def __call__(self, samples: list[Any]) -> Any:
        time.sleep(self.delay_s.get(int(os.environ["RANK"]), 0.0))
        return default_collate(samples)


def _fit(
    root: str, delay_s: dict[int, float], steps: int, patience: int, probe: bool, strategy: Any = None
) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    tokens = torch.randint(0, 256, (64, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, collate_fn=SlowCollate(delay_s))
    monitor = StragglerMonitor(factor=FACTOR, probe=probe, action="restart", patience=patience)
    trainer = quiet_trainer(
        devices=2,
        strategy=strategy or HybridParallelStrategy(data_parallel=2),
        max_steps=steps,
        log_every_n_steps=LOG_EVERY,
        default_root_dir=root,
        callbacks=[monitor],
    )
    ratios = MaxRatios()
    trainer.callbacks.append(ratios)
    trainer.fit(StackModule(), train_dataloaders=data)  # StragglerRestart (a SystemExit) ends the process here
    return {"step": trainer.global_step, "max_ratios": ratios.values, "flagged": monitor.flagged}


class MaxRatios(Callback):
    """``stragglers/max_ratio`` at each logging step (after the monitor published it)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % LOG_EVERY == 0:
            self.values.append(float(trainer.callback_metrics["stragglers/max_ratio"]))


def _rank_one_slow(rank: int, world: int, root: str) -> dict[str, Any]:
    return _fit(root, {1: 0.05}, steps=4 * LOG_EVERY * PATIENCE, patience=PATIENCE, probe=True)


def test_a_rank_slowed_50ms_a_batch_checkpoints_names_its_host_and_both_processes_exit_76(tmp_path: Path) -> None:
    """Rank 1's batches take 50 ms longer to assemble; factor 1.3, patience 3, a logging step every 2 steps:
    at the third logging step (global step 6) every rank commits ``step-000006``, rank 0 names rank 1 and
    its host in ``exclude.json``, and both processes exit with 76 (the run was to last 24 steps)."""
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_rank_one_slow, 2, str(tmp_path), timeout=120)
    assert failure.value.exit_codes == {0: STRAGGLER_EXIT_CODE, 1: STRAGGLER_EXIT_CODE}, failure.value
    assert str(failure.value).count("StragglerRestart: 76") == 2, failure.value
    trigger = PATIENCE * LOG_EVERY
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{trigger:06d}"]
    assert verify(checkpoints / f"step-{trigger:06d}")["global_step"] == trigger  # every file, checksummed
    loaded = load_full_checkpoint(checkpoints / f"step-{trigger:06d}")
    assert loaded["global_step"] == trigger and set(loaded["state_dict"]) == set(StackModule().state_dict())
    assert len(loaded["optimizer_states"]) == 1  # a full checkpoint: the run resumes from it
    record = json.loads((tmp_path / "stragglers" / "exclude.json").read_text())
    (straggler,) = record["stragglers"]
    assert (straggler["rank"], straggler["host"], record["exclude"]) == (
        1,
        socket.gethostname(),
        [socket.gethostname()],
    )
    assert len(straggler["ratios"]) == PATIENCE and all(FACTOR < r < 2.0 for r in straggler["ratios"]), straggler
    assert (record["step"], record["exit_code"], record["patience"], record["log_every_n_steps"]) == (
        trigger,
        76,
        PATIENCE,
        LOG_EVERY,
    )
    assert record["checkpoint"] == str(checkpoints / f"step-{trigger:06d}")
    (event,) = [json.loads(line) for line in (tmp_path / "stragglers" / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "straggler" and event["stragglers"] == record["stragglers"]


def _rank_one_five_percent_slower(rank: int, world: int, root: str) -> dict[str, Any]:
    return _fit(root, {0: 0.05, 1: 0.0525}, steps=8 * LOG_EVERY, patience=PATIENCE, probe=False)


def test_a_rank_slower_only_within_the_factor_never_triggers_and_the_run_completes(tmp_path: Path) -> None:
    """Both ranks wait 50 ms for each batch, rank 1 5 % longer (52.5 ms): 8 logging intervals with
    patience 3, and it never triggers. The probe is off: on this shared 2-core machine it times the
    neighbours' load; the slowdown tested here is the data wait's."""
    results = run_distributed(_rank_one_five_percent_slower, 2, str(tmp_path), timeout=120)
    for result in results:
        assert result["step"] == 8 * LOG_EVERY and len(result["max_ratios"]) == 8, result
        # Rank 1 seen slower (1.024 expected), within the factor. A single interval may go over it when the
        # machine is loaded (measured with two busy loops beside the ranks); never PATIENCE in a row.
        assert 1.0 < sorted(result["max_ratios"])[4] < 1.1, result
    assert results[0]["max_ratios"] == results[1]["max_ratios"]  # every rank decides from the same figures
    assert not (tmp_path / "stragglers").exists() and not (tmp_path / "checkpoints").exists()


def _rank_one_slow_under_ddp(rank: int, world: int, root: str) -> dict[str, Any]:
    return _fit(root, {1: 0.05}, steps=8 * LOG_EVERY, patience=2, probe=False, strategy="ddp")


def test_under_lightnings_ddp_strategy_the_checkpoint_is_lightnings_own_file(tmp_path: Path) -> None:
    """A strategy the package did not choose: Lightning's ``DDPStrategy`` and its one-file format. Patience 2:
    the checkpoint ``step-000004.ckpt``, which ``torch.load`` reads with the step and the optimizer state."""
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_rank_one_slow_under_ddp, 2, str(tmp_path), timeout=120)
    assert failure.value.exit_codes == {0: STRAGGLER_EXIT_CODE, 1: STRAGGLER_EXIT_CODE}, failure.value
    trigger = 2 * LOG_EVERY
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{trigger:06d}.ckpt"]
    loaded = torch.load(tmp_path / "checkpoints" / f"step-{trigger:06d}.ckpt", weights_only=False)
    assert loaded["global_step"] == trigger and len(loaded["optimizer_states"]) == 1
    record = json.loads((tmp_path / "stragglers" / "exclude.json").read_text())
    assert [(s["rank"], s["host"]) for s in record["stragglers"]] == [(1, socket.gethostname())]
    assert record["step"] == trigger and record["checkpoint"].endswith(f"step-{trigger:06d}.ckpt")


def test_the_probe_leaves_the_trainings_random_state_alone() -> None:
    from lightning_scale.callbacks.stragglers import _probe

    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    assert _probe(torch.device("cpu")) > 0
    assert torch.equal(torch.rand(3), expected)  # a probe at a logging step changes no dropout mask after it
