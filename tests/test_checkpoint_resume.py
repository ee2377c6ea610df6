"""Which checkpoint ``"latest"`` resumes, what retention keeps in a reused directory, what
``lightning-scale-ckpt verify``/``consolidate`` report and write, and what a whole load gives.

All in this process (one device, :class:`~test_checkpoint_safety.Tiny`), each fit a few steps."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_checkpoint_safety import Tiny, _cli, _trainer

from lightning_scale.core.checkpoint.format import MANIFEST
from lightning_scale.core.checkpoint.sharded import save_sharded
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy


class Recorded(Tiny):
    """Tiny, recording which checkpoint directory it was loaded from."""

    loaded: list[str] = []

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        Recorded.loaded.append("/".join(Path(checkpoint["lightning_scale"]["path"]).parts[-2:]))


def _every(dirpath: Path, steps: int = 1, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=steps, save_top_k=-1, filename="{step}", **kwargs)


def _fit(steps: int, *callbacks: Any, io: ShardedCheckpointIO | None = None, ckpt_path: str | None = None) -> Any:
    trainer = _trainer(
        steps, HybridParallelStrategy(checkpoint_io=io), callbacks=list(callbacks), enable_checkpointing=True
    )
    trainer.fit(Recorded(), ckpt_path=ckpt_path)
    return trainer


def _rewrite(path: Path, **fields: Any) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, **fields}))


def test_latest_resumes_fit_from_a_full_checkpoint_and_lets_validate_take_a_weights_only_one(tmp_path: Path) -> None:
    full, weights = tmp_path / "full", tmp_path / "weights"
    # Step 2's weights-only save comes second: the newest checkpoint is a weights-only one.
    _fit(2, _every(full, 2), _every(weights, save_weights_only=True))
    Recorded.loaded.clear()
    callbacks = [_every(full, 2), _every(weights)]
    validating = _trainer(2, callbacks=callbacks, limit_val_batches=1, enable_checkpointing=True)
    validating.validate(Recorded(), ckpt_path="latest")
    trainer = _fit(3, _every(full, 2), _every(weights, save_weights_only=True), ckpt_path="latest")
    assert Recorded.loaded == ["weights/step=2.ckpt", "full/step=2.ckpt"]
    assert trainer.strategy.checkpoint_io.resumed_from == full / "step=2.ckpt"  # the full one, for fit
    assert trainer.global_step == 3
    assert json.loads((weights / "step=2.ckpt" / MANIFEST).read_text())["weights_only"] is True
    # A manifest of an earlier release does not say: its trainer_state.json does (no optimizer states).
    for path in weights.iterdir():
        manifest = json.loads((path / MANIFEST).read_text())
        del manifest["weights_only"]
        (path / MANIFEST).write_text(json.dumps(manifest))
    assert ShardedCheckpointIO().latest([full, weights]) == full / "step=2.ckpt"
    assert ShardedCheckpointIO().latest([full, weights], weights_only=True) == weights / "step=3.ckpt"


def test_retention_and_latest_go_by_the_run_never_by_another_runs_higher_steps(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    # An earlier run left checkpoints at higher steps in the directory this run reuses.
    _fit(2, _every(root))
    for step in (1, 2):
        old = root / f"old-{step}00"
        (root / f"step={step}.ckpt").rename(old)
        _rewrite(old, global_step=step * 100, run_id="earlier")
    io = ShardedCheckpointIO(keep_last=2)
    _fit(3, _every(root), io=io)
    assert sorted(p.name for p in root.iterdir()) == ["old-100", "old-200", "step=2.ckpt", "step=3.ckpt"]
    # This run's own newest, relaunched with the same id (torchrun --rdzv-id, a SLURM job): not step 200.
    assert ShardedCheckpointIO(run_id=io.run_id).latest([root]) == root / "step=3.ckpt"
    # A new run resuming with "latest" gets the most recently written one, and continues its run:
    # retention then counts that run's checkpoints as its own (the one it resumed from is kept).
    Recorded.loaded.clear()
    again = ShardedCheckpointIO(keep_last=2)
    _fit(5, _every(root), io=again, ckpt_path="latest")
    assert Recorded.loaded == ["ckpts/step=3.ckpt"] and again.lineage == [io.run_id]
    assert sorted(p.name for p in root.iterdir()) == ["old-100", "old-200", "step=3.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert json.loads((root / "step=5.ckpt" / MANIFEST).read_text())["continues"] == [io.run_id]


def test_a_run_is_the_launchers_job_whatever_its_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_scale.plugins._checkpoint_selection import run_id_from_environment

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert run_id_from_environment() is None and ShardedCheckpointIO().run_id != ShardedCheckpointIO().run_id
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default without --rdzv-id: every run's
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert ShardedCheckpointIO().run_id == "slurm-77"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert ShardedCheckpointIO().run_id == "slurm-70_3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-9")
    assert ShardedCheckpointIO().run_id == "torchrun-job-9"
    assert ShardedCheckpointIO(run_id="mine").run_id == "mine"
    with pytest.raises(TypeError, match=r"run_id='' must be a non-empty string \(or None: the launcher's job id\)"):
        ShardedCheckpointIO(run_id="")


def _saved(path: Path, **manifest: Any) -> Path:
    tensors = {"model/model.embed.weight": torch.randn(8, 4), "model/model.norm.weight": torch.ones(4)}
    return save_sharded(path, tensors, metadata={"global_step": 1, **manifest}, token="t")


def test_verify_reports_every_directory_that_looks_like_a_checkpoint_but_is_not_one(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    _saved(root / "good")
    half = root / "half"  # shards and DCP metadata, no manifest (a save that died, a deleted manifest)
    shutil.copytree(root / "good", half)
    (half / MANIFEST).unlink()
    garbled = root / "garbled"
    shutil.copytree(root / "good", garbled)
    (garbled / MANIFEST).write_text("{not json")
    (root / "logs").mkdir()
    (root / "logs" / "events.txt").write_text("not a checkpoint, nor looking like one")
    code, printed = _cli("verify", str(root))
    assert code == 1, printed
    lines = sorted(printed.splitlines())
    assert lines[0].startswith(f"BROKEN {garbled}: not a checkpoint: {garbled / MANIFEST} is not valid JSON"), lines
    assert lines[1].startswith(f"BROKEN {half}: not a checkpoint: {half / MANIFEST} is missing"), lines
    assert lines[2].startswith(f"OK     {root / 'good'} (step 1, 2 files)") and len(lines) == 3, lines


def test_consolidate_writes_the_file_named_and_a_hugging_face_directory_when_asked(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = {"model_type": "llama", "hidden_size": 4}
    ckpt = _saved(tmp_path / "hf", huggingface={"prefix": "model", "class": "LlamaForCausalLM", "config": config})
    code, printed = _cli("consolidate", str(ckpt), str(tmp_path / "out" / "weights.safetensors"))
    assert code == 0 and (tmp_path / "out" / "weights.safetensors").is_file(), printed
    assert sorted(load_file(tmp_path / "out" / "weights.safetensors")) == ["embed.weight", "norm.weight"]  # HF names
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["weights.safetensors"]
    code, printed = _cli("consolidate", str(ckpt), str(tmp_path / "dir"))
    assert code == 0 and sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "dir" / "config.json").read_text()) == config
    code, printed = _cli("consolidate", str(ckpt), str(tmp_path / "x.safetensors"), "--hf")
    assert code == 1 and "names a .safetensors file, but --hf writes a Hugging Face directory" in printed, printed
    plain = _saved(tmp_path / "plain")
    code, printed = _cli("consolidate", str(plain), str(tmp_path / "p"), "--hf")
    assert code == 1 and "holds no Hugging Face model (its manifest records none): drop --hf" in printed, printed
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "p").exists()


def test_load_full_checkpoint_gives_what_torch_load_gives_for_a_lightning_ckpt(tmp_path: Path) -> None:
    # The same module and data, 3 steps: one process with Lightning's own strategy and .ckpt file,
    # one with HybridParallelStrategy and a sharded directory.
    single = _trainer(3, "auto")
    single.fit(Tiny())
    single.save_checkpoint(tmp_path / "single.ckpt")
    sharded = _trainer(3)
    sharded.fit(Tiny())
    sharded.save_checkpoint(tmp_path / "sharded")
    expected = torch.load(tmp_path / "single.ckpt", weights_only=False)
    got = load_full_checkpoint(tmp_path / "sharded")
    ours = got.pop("lightning_scale")
    # HybridParallelStrategy's precision plugin saves its state ("MixedPrecision"), Lightning's none.
    assert set(got) == set(expected) | {"MixedPrecision"}, set(got) ^ set(expected)
    for key in set(expected) - {"state_dict", "optimizer_states"}:
        assert got[key] == expected[key], key
    torch.testing.assert_close(got["state_dict"], expected["state_dict"], rtol=0, atol=0)
    assert got["state_dict"]["b.weight"] is got["state_dict"]["a.weight"]  # tied: one tensor under both names
    (mine,), (theirs,) = got["optimizer_states"], expected["optimizer_states"]
    assert mine["param_groups"] == theirs["param_groups"]  # "params": the same indices, hyper-parameters equal
    assert list(mine["state"]) == list(theirs["state"]) == [0, 1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(mine["state"], theirs["state"], rtol=0, atol=0)
    # What Lightning does with it on a resume: a single-process optimizer takes it as its own.
    optimizer = Tiny().configure_optimizers()["optimizer"]
    optimizer.load_state_dict(mine)
    torch.testing.assert_close(optimizer.state_dict(), theirs, rtol=0, atol=0)
    # The names torch's form leaves out, group by group in the order of "params".
    expected_names = [["a.weight", "out.weight"], ["a.bias", "norm.weight", "norm.bias", "b.bias", "out.bias"]]
    assert ours["optimizer_param_names"] == [expected_names]


def test_a_single_device_lightning_checkpoint_resumes_under_the_strategy_like_one_process(tmp_path: Path) -> None:
    # Lightning's own file (torch.save; the optimizer state numbered by position, no names), written by
    # a plain Trainer, resumed by the strategy: the run continues as the plain Trainer resumed from it.
    _trainer(2, "auto", callbacks=[_every(tmp_path, 2)], enable_checkpointing=True).fit(Tiny())
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=True)
    assert "lightning_scale" not in saved and sorted(saved["optimizer_states"][0]["state"]) == [0, 1, 2, 3, 4, 5, 6]
    resumed = _trainer(4, HybridParallelStrategy())
    model = Tiny()
    resumed.fit(model, ckpt_path=str(tmp_path / "step=2.ckpt"))
    reference = Tiny()
    _trainer(4, "auto").fit(reference, ckpt_path=str(tmp_path / "step=2.ckpt"))
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)


class _Logged(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


class _OnDisk(Callback):
    """The rows of metrics.csv on disk after each step (what a SIGKILL at that moment leaves)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        steps = []
        if self.path.is_file():
            with open(self.path, newline="") as f:
                steps = [int(r["step"]) for r in csv.DictReader(f)]
        self.rows.append(steps)


def test_every_row_before_a_step_is_on_disk_when_it_ends(tmp_path: Path) -> None:
    # A run killed at any moment must leave the rows of the steps before its checkpoint, which the resumed
    # run does not train again. CSVLogger buffers flush_logs_every_n_steps rows, but Lightning's logger
    # connector saves the loggers after each logging step (what the CLI's record relies on; CsvHistory
    # must not change it): the rows are on disk a step later, whatever the flush interval.
    from lightning_scale.cli.results import CsvHistory

    logger = CSVLogger(tmp_path, name="", version="", flush_logs_every_n_steps=1000)
    probe = _OnDisk(tmp_path / "metrics.csv")
    trainer = _trainer(
        5,
        HybridParallelStrategy(),
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=True,
        callbacks=[_every(tmp_path / "ckpts", 2), CsvHistory(logger), probe],
    )
    trainer.fit(_Logged())
    assert probe.rows == [[], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
