"""One rule for ``"latest"`` (:mod:`lightning_scale.core.checkpoint.latest`), on checkpoints the package did
not choose: ``.ckpt`` files plain Lightning's ``ModelCheckpoint`` wrote under its own names, a torn or
corrupted newest one, modification times that disagree with steps, sharded and ``.ckpt`` checkpoints in
one directory, and several runs in one directory."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_scale.core.checkpoint.format import MANIFEST
from lightning_scale.core.checkpoint.latest import Candidate, candidates, latest, resume_order
from lightning_scale.core.checkpoint.sharded import save_sharded


@pytest.fixture(scope="module")
def lightning_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What plain Lightning writes (its BoringModel, one process): ``full/`` every 2 steps with its own
    names and ``last.ckpt``, ``weights/`` every 3 with ``save_weights_only=True``."""
    out = tmp_path_factory.mktemp("lightning")
    checkpoints = [
        ModelCheckpoint(dirpath=out / "full", every_n_train_steps=2, save_top_k=-1, save_last=True),
        ModelCheckpoint(dirpath=out / "weights", every_n_train_steps=3, save_top_k=-1, save_weights_only=True),
    ]
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=checkpoints,
    )
    trainer.fit(BoringModel())
    assert sorted(p.name for p in (out / "full").iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]
    return out


@pytest.fixture
def full(lightning_dirs: Path, tmp_path: Path) -> Path:
    """A copy of ``full/`` this test may break (modification times kept)."""
    return Path(shutil.copytree(lightning_dirs / "full", tmp_path / "checkpoints"))


def _set_mtime(path: Path, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    os.utime(path, (when, when))


def _flip_tensor_byte(path: Path) -> None:
    """Corrupt one byte of a tensor's data in a ``torch.save`` archive: its header still loads."""
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 0)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26 : record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(data))


def _sharded(path: Path, step: int, *, run_id: str | None = None, saved_s: float | None = None) -> Path:
    tensors = {"model/w": torch.randn(8, 4), "optimizer/w": torch.ones(4)}
    metadata = {"global_step": step, **({"run_id": run_id} if run_id else {})}
    save_sharded(path, tensors, metadata=metadata, token="t")
    if saved_s is not None:
        manifest = json.loads((path / MANIFEST).read_text())
        (path / MANIFEST).write_text(json.dumps({**manifest, "created_unix_s": saved_s}))
    return path


def test_plain_lightnings_checkpoints_are_read_by_their_step_and_state_not_their_names(lightning_dirs: Path) -> None:
    found = latest([lightning_dirs / "full"])
    assert found is not None and found.format == "lightning" and found.step == 6
    # last.ckpt holds step 6 too (saved after the step's own file: the newer save of equal steps).
    assert found.path.name in ("last.ckpt", "epoch=0-step=6.ckpt")
    assert torch.load(found.path, weights_only=True)["global_step"] == 6
    # Saved with the weights only: nothing a fit can resume, what validate/test may take.
    assert latest([lightning_dirs / "weights"]) is None
    weights = latest([lightning_dirs / "weights"], weights_only=True)
    assert weights is not None and weights.path.name == "epoch=0-step=6.ckpt" and weights.weights_only


def test_a_torn_newest_checkpoint_falls_back_to_the_previous_good_one(full: Path) -> None:
    (full / "last.ckpt").unlink()
    newest = full / "epoch=0-step=6.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a save killed half way
    with pytest.warns(
        RuntimeWarning, match=r"Skipping a file that is not a checkpoint: .*epoch=0-step=6\.ckpt does not load"
    ):
        found = latest([full])
    assert found is not None and found.path == full / "epoch=0-step=4.ckpt"
    # A flipped bit in the tensors: the header loads, the archive's CRC-32 does not match.
    _flip_tensor_byte(full / "epoch=0-step=4.ckpt")
    assert torch.load(full / "epoch=0-step=4.ckpt", mmap=True, weights_only=True)["global_step"] == 4
    with pytest.warns(RuntimeWarning, match=r"broken checkpoint .*epoch=0-step=4\.ckpt: .* does not match its CRC-32"):
        found = latest([full])
    assert found is not None and found.path == full / "epoch=0-step=2.ckpt"


def test_steps_decide_not_modification_times(full: Path) -> None:
    # An old checkpoint restored from a backup (cp without -p): the newest file holds the oldest step.
    shutil.copy(full / "epoch=0-step=2.ckpt", full / "restored.ckpt")
    _set_mtime(full / "epoch=0-step=6.ckpt", 3600)
    _set_mtime(full / "last.ckpt", 3600)
    found = latest([full])
    assert found is not None and found.step == 6
    # Equal steps: the newer save.
    _set_mtime(full / "last.ckpt", 10)
    assert latest([full]).path.name == "last.ckpt"  # type: ignore[union-attr]
    _set_mtime(full / "epoch=0-step=6.ckpt", 5)
    assert latest([full]).path.name == "epoch=0-step=6.ckpt"  # type: ignore[union-attr]
    # A link (save_last="link") counts once, as its target.
    (full / "last.ckpt").unlink()
    (full / "last.ckpt").symlink_to("epoch=0-step=6.ckpt")
    assert [c.path.name for c in candidates([full])][:2] == ["epoch=0-step=6.ckpt", "epoch=0-step=4.ckpt"]


def test_a_mixed_directory_takes_the_format_the_caller_loads(full: Path) -> None:
    _sharded(full / "step-000003", 3, run_id="hybrid-run")
    _sharded(full / "step-000008", 8, run_id="hybrid-run")
    only_ckpt, only_sharded = latest([full], formats=["lightning"]), latest([full], formats=["sharded"])
    assert only_ckpt is not None and only_ckpt.step == 6 and only_ckpt.format == "lightning"
    assert only_sharded is not None and only_sharded.path == full / "step-000008" and only_sharded.format == "sharded"
    # Both formats: the run that saved most recently (the sharded one, committed after Lightning's files).
    both = latest([full])
    assert both is not None and both.path == full / "step-000008"
    # Its newest broken: the same run's previous checkpoint, not another run's.
    shard = next(p for p in (full / "step-000008").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.warns(RuntimeWarning, match=r"broken checkpoint .*step-000008: .* truncated"):
        both = latest([full])
    assert both is not None and both.path == full / "step-000003"


def test_the_run_comes_first_then_the_run_that_saved_last(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    # An earlier run reached step 200; a run started again from scratch in the same directory saved last.
    _sharded(root / "old-100", 100, run_id="earlier", saved_s=1000.0)
    _sharded(root / "old-200", 200, run_id="earlier", saved_s=2000.0)
    _sharded(root / "new-10", 10, run_id="again", saved_s=3000.0)
    _sharded(root / "new-20", 20, run_id="again", saved_s=4000.0)
    order = [c.path.name for c in candidates([root])]
    assert order == ["new-20", "new-10", "old-200", "old-100"]
    assert [c.path.name for c in candidates([root], run_ids=["earlier"])] == ["old-200", "old-100", "new-20", "new-10"]
    # Every checkpoint of the run broken: the other run's, rather than nothing.
    for name in ("old-200", "old-100"):
        (root / name / MANIFEST).write_text(
            json.dumps({**json.loads((root / name / MANIFEST).read_text()), "files": [{"path": "gone", "bytes": 1}]})
        )
    with pytest.warns(RuntimeWarning, match="old-100"):
        found = latest([root], run_ids=["earlier"])
    assert found is not None and found.path.name == "new-20"


def test_the_order_as_a_pure_function() -> None:
    def c(name: str, step: int, saved: float, run: str | None = None) -> Candidate:
        return Candidate(Path(name), "sharded", step, saved, run, False)

    # Inside a run: step, then time (a copy's newer time does not pass a higher step).
    found = [c("copy-of-2", 2, 50.0), c("4", 4, 10.0), c("last", 4, 11.0)]
    assert [str(x) for x in resume_order(found)] == ["last", "4", "copy-of-2"]
    # Across runs: the run's own first, then the run whose newest save is the latest.
    found = [c("a-9", 9, 1.0, "a"), c("b-3", 3, 5.0, "b"), c("b-2", 2, 4.0, "b"), c("files-7", 7, 3.0)]
    assert [str(x) for x in resume_order(found)] == ["b-3", "b-2", "files-7", "a-9"]
    assert [str(x) for x in resume_order(found, run_ids=["a"])] == ["a-9", "b-3", "b-2", "files-7"]


def test_an_unknown_format_is_refused_naming_the_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"formats=\('zip',\): pass one or more of 'lightning', 'sharded'\."):
        latest([tmp_path], formats=["zip"])
    with pytest.raises(ValueError, match=r"formats=\(\): pass one or more of"):
        latest([tmp_path], formats=[])


def test_the_deprecated_paths_keep_their_signatures_and_follow_the_rule(tmp_path: Path) -> None:
    # 0.1.0's format.latest(root) and resume_order(checkpoints) return format.Checkpoint objects; a script written
    # against them keeps working, warned, with the one rule's answer.
    from lightning_scale.core.checkpoint import format as old
    from lightning_scale.core.checkpoint.format import scan

    root = tmp_path / "ckpts"
    _sharded(root / "a-100", 100, run_id="earlier", saved_s=1000.0)
    _sharded(root / "b-20", 20, run_id="again", saved_s=2000.0)
    with pytest.warns(DeprecationWarning, match=r"format\.latest` moved to `lightning_scale\.core\.checkpoint\.latest"):
        found = old.latest(root)
    assert found is not None and found.path.name == "b-20" and found.step == 20
    with pytest.warns(DeprecationWarning, match=r"format\.resume_order` moved"):
        order = old.resume_order(scan(root)[0], run_ids=["earlier"])
    assert [c.path.name for c in order] == ["a-100", "b-20"]
