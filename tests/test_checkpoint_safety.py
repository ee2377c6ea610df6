"""A checkpoint is data: loading one runs no code it chose and reads only what its manifest vouches for.

One tiny real checkpoint is written once (one process); every hostile variant is derived from a copy
by rewriting files, with the manifest rewritten to match wherever that is the attack (the attacker
controls the whole directory, so the unpickler and the path rules, not the checksums, must refuse
it). Each variant goes through every entry point: ``lightning-scale-ckpt inspect``, ``verify``,
``consolidate``, ``load_full_checkpoint`` and ``Trainer.fit(ckpt_path=...)``. None may run the
payload (it would create a marker file), open a file outside the checkpoint directory (an audit hook
records every ``open``), or resolve a name the payload chose through ``pickle``'s own lookup.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lightning import quiet_trainer
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.cli.ckpt import main as ckpt_main
from lightning_scale.core.checkpoint.checksums import file_checksum
from lightning_scale.core.checkpoint.format import MANIFEST, CheckpointCorruptError
from lightning_scale.plugins.checkpoint_io import load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy


class Tiny(LightningModule):
    """Two parameter groups, a tied weight and an LR scheduler: what an optimizer's state holds, small."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied: one parameter under two names
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(torch.relu(self.norm(self.a(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def _data(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)

    def train_dataloader(self) -> DataLoader:
        return self._data()

    def val_dataloader(self) -> DataLoader:
        return self._data()


def _trainer(steps: int, strategy: Any = None, **kwargs: Any) -> Any:
    seed_everything(0, verbose=False)
    return quiet_trainer(
        strategy=strategy or HybridParallelStrategy(), max_steps=steps, use_distributed_sampler=False, **kwargs
    )


# ---------------------------------------------------------------- the hostile family


MARKER_NAME = "PWNED"


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _stack_global(module: str, name: str, command: str) -> bytes:
    """``module`` then a dotted ``name`` through STACK_GLOBAL, called with ``command`` (protocol 4)."""
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + _str(command) + b"\x85R."


def _global(module: str, name: str, command: str) -> bytes:
    """The same through the older GLOBAL opcode (a protocol-4 stream still resolves dotted names)."""
    return b"\x80\x04c" + module.encode() + b"\n" + name.encode() + b"\n" + _str(command) + b"\x85R."


def _getattr_chain(command: str) -> bytes:
    """``getattr(__import__("os"), "system")(command)``."""
    imported = b"cbuiltins\n__import__\n" + _str("os") + b"\x85R"
    return b"\x80\x02cbuiltins\ngetattr\n" + imported + _str("system") + b"\x86R" + _str(command) + b"\x85R."


class _Reduce:
    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return self.fn, self.args


def _rehash(ckpt: Path, *names: str) -> None:
    """Rewrite the manifest's entries of ``names`` to match the files: what an attacker who controls the
    whole directory does, so that only the loader's own rules stand in the way."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for entry in manifest["files"]:
        if entry["path"] in names:
            file = ckpt / entry["path"]
            entry["bytes"] = file.stat().st_size
            entry["crc32"] = file_checksum(file, "crc32")
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _metadata(ckpt: Path) -> Any:
    # Our own, just written by the fixture: trusted, so the plain unpickler reads it here.
    return pickle.loads((ckpt / ".metadata").read_bytes())


def _write_metadata(ckpt: Path, data: bytes, *, rehash: bool = True) -> None:
    (ckpt / ".metadata").write_bytes(data)
    if rehash:
        _rehash(ckpt, ".metadata")


def _retarget(ckpt: Path, relative: str) -> None:
    """Point the first stored item of ``.metadata`` at ``relative`` (manifest rewritten to match)."""
    metadata = _metadata(ckpt)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = relative
    _write_metadata(ckpt, pickle.dumps(metadata))


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("__0_*.distcp"))[0]


def _outside_copy(ckpt: Path, outside: Path, flip: bool = True) -> Path:
    """A copy of a shard outside the checkpoint, a weight changed (a load reading it would change a weight)."""
    data = bytearray(_shard(ckpt).read_bytes())
    if flip:
        data[len(data) // 2] ^= 0x40
    target = outside / _shard(ckpt).name
    target.write_bytes(bytes(data))
    return target


def _dotted(module: str, name: str) -> Callable[[Path, Path, str], str]:
    def make(ckpt: Path, outside: Path, command: str) -> str:
        _write_metadata(ckpt, _stack_global(module, name, command))
        return rf"\.metadata refers to {module}\.{name}, which is not one of the classes DCP metadata is made of"

    return make


def _v_global(ckpt: Path, outside: Path, command: str) -> str:
    _write_metadata(ckpt, _global("torch.distributed.checkpoint.metadata", "os.system", command))
    return r"\.metadata refers to torch\.distributed\.checkpoint\.metadata\.os\.system, which is not one of the classes"


def _v_reduce(ckpt: Path, outside: Path, command: str) -> str:
    _write_metadata(ckpt, pickle.dumps(_Reduce(os.system, command)))
    return rf"\.metadata refers to {os.system.__module__}\.system, which is not one of the classes"


def _v_eval(ckpt: Path, outside: Path, command: str) -> str:
    _write_metadata(ckpt, pickle.dumps(_Reduce(eval, f"__import__('os').system({command!r})")))
    return r"\.metadata refers to builtins\.eval, which is not one of the classes"


def _v_getattr(ckpt: Path, outside: Path, command: str) -> str:
    _write_metadata(ckpt, _getattr_chain(command))
    return r"\.metadata refers to builtins\.getattr, which is not one of the classes"


def _v_naive(ckpt: Path, outside: Path, command: str) -> str:
    # The payload without the manifest rewritten, padded to the file's recorded size (pickle ignores
    # what follows its end): only the checksum, checked before anything is unpickled, stops it.
    payload = _stack_global("torch.distributed.checkpoint.metadata", "os.system", command)
    size = (ckpt / ".metadata").stat().st_size
    _write_metadata(ckpt, payload + b" " * (size - len(payload)), rehash=False)
    return r"\.metadata does not match its crc32"


def _v_parent(ckpt: Path, outside: Path, command: str) -> str:
    copy = _outside_copy(ckpt, outside)
    _retarget(ckpt, f"../{outside.name}/{copy.name}")
    return r"\.metadata stores '.*' in '\.\./outside/__0_\d\.distcp', a path outside the checkpoint directory"


def _v_absolute(ckpt: Path, outside: Path, command: str) -> str:
    _retarget(ckpt, str(_outside_copy(ckpt, outside)))
    return r"\.metadata stores '.*' in '/.*/outside/__0_\d\.distcp', a path outside the checkpoint directory"


def _v_unlisted(ckpt: Path, outside: Path, command: str) -> str:
    # A shard copy with a weight changed, inside the directory but not in the manifest.
    data = bytearray(_shard(ckpt).read_bytes())
    data[len(data) // 2] ^= 0x40
    (ckpt / "__0_9.distcp").write_bytes(bytes(data))
    _retarget(ckpt, "__0_9.distcp")
    return r"\.metadata stores '.*' in '__0_9\.distcp', which manifest\.json does not list"


def _v_pickled_item(ckpt: Path, outside: Path, command: str) -> str:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    shard = _shard(ckpt)
    offset = shard.stat().st_size
    payload = pickle.dumps(_Reduce(os.system, command))
    with open(shard, "ab") as f:  # the payload appended to a listed shard, which then verifies
        f.write(payload)
    metadata = _metadata(ckpt)
    metadata.state_dict_metadata["extra/payload"] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex("extra/payload")] = _StorageInfo(shard.name, offset, len(payload))
    _write_metadata(ckpt, pickle.dumps(metadata))
    _rehash(ckpt, shard.name)
    return r"\.metadata stores 'extra/payload' as a pickled \(BYTE_IO\) item"


def _v_manifest_escape(ckpt: Path, outside: Path, command: str) -> str:
    # A manifest entry with no "..": its first part is a link to a directory outside (plain "../" and
    # absolute entries: tests/test_checkpoint_format.py).
    secret = outside / "secret.bin"
    secret.write_bytes(b"secret")
    (ckpt / "sub").symlink_to(outside, target_is_directory=True)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    entry = {"path": "sub/secret.bin", "bytes": 6, "crc32": file_checksum(secret, "crc32")}
    manifest["files"] = sorted([entry, *manifest["files"]], key=lambda e: e["path"])
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    return r"sub/secret\.bin is a link to .*/outside/secret\.bin, outside the checkpoint directory"


def _v_shard_link(ckpt: Path, outside: Path, command: str) -> str:
    # The same bytes (the manifest still matches), but the file is a link leading out of the directory.
    shard = _shard(ckpt)
    target = _outside_copy(ckpt, outside, flip=False)
    shard.unlink()
    shard.symlink_to(target)
    return rf"{shard.name} is a link to .*/outside/{shard.name}, outside the checkpoint directory"


def _v_metadata_link(ckpt: Path, outside: Path, command: str) -> str:
    (outside / ".metadata").write_bytes((ckpt / ".metadata").read_bytes())
    (ckpt / ".metadata").unlink()
    (ckpt / ".metadata").symlink_to(outside / ".metadata")
    return r"\.metadata is a link to .*/outside/\.metadata, outside the checkpoint directory"


def _v_manifest_link(ckpt: Path, outside: Path, command: str) -> str:
    (outside / MANIFEST).write_text((ckpt / MANIFEST).read_text())
    (ckpt / MANIFEST).unlink()
    (ckpt / MANIFEST).symlink_to(outside / MANIFEST)
    return r"manifest\.json is a link to .*/outside/manifest\.json, outside the checkpoint directory"


HOSTILE: dict[str, Callable[[Path, Path, str], str]] = {
    "dotted-os-system-via-dcp-metadata": _dotted("torch.distributed.checkpoint.metadata", "os.system"),
    "dotted-os-system-via-dcp-filesystem": _dotted("torch.distributed.checkpoint.filesystem", "os.system"),
    "dotted-os-system-via-pathlib": _dotted("pathlib", "os.system"),
    "dotted-via-an-allowed-class": _dotted("torch", "Size.__class__"),
    "dotted-through-global-opcode": _v_global,
    "reduce-os-system": _v_reduce,
    "builtins-eval": _v_eval,
    "builtins-getattr-chain": _v_getattr,
    "naive-rewrite-caught-by-checksum": _v_naive,
    "shard-path-through-parent": _v_parent,
    "shard-path-absolute": _v_absolute,
    "shard-not-in-manifest": _v_unlisted,
    "pickled-byte-io-item": _v_pickled_item,
    "manifest-lists-a-file-through-a-link": _v_manifest_escape,
    "shard-is-a-link-leading-out": _v_shard_link,
    "metadata-is-a-link-leading-out": _v_metadata_link,
    "manifest-is-a-link-leading-out": _v_manifest_link,
}


_RECORDING: list[dict[str, list[str]]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _RECORDING:
        return
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDING[-1]["opened"].append(os.fsdecode(args[0]))
    elif event == "pickle.find_class":
        _RECORDING[-1]["found"].append(f"{args[0]}.{args[1]}")


@contextlib.contextmanager
def _watched() -> Iterator[dict[str, list[str]]]:
    """Every path opened and every name pickle's own ``find_class`` resolved, while inside."""
    if not getattr(sys, "_lightning_scale_audit", False):  # an audit hook cannot be removed: one per process
        sys.addaudithook(_audit)
        sys._lightning_scale_audit = True  # type: ignore[attr-defined]
    seen: dict[str, list[str]] = {"opened": [], "found": []}
    _RECORDING.append(seen)
    try:
        yield seen
    finally:
        _RECORDING.remove(seen)


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ckpt_main(list(args))
    return code, out.getvalue()


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real sharded checkpoint of :class:`Tiny` after 2 steps, written by one process."""
    root = tmp_path_factory.mktemp("real")
    trainer = _trainer(2)
    trainer.fit(Tiny())
    trainer.save_checkpoint(root / "ckpt")
    return root / "ckpt"


def _entry_points(ckpt: Path, out: Path) -> dict[str, tuple[bool, str]]:
    """``{entry point: (refused, message)}``."""
    results: dict[str, tuple[bool, str]] = {}
    for name, args in (
        ("inspect", ("inspect", str(ckpt))),
        ("verify", ("verify", str(ckpt))),
        ("consolidate", ("consolidate", str(ckpt), str(out / "weights.safetensors"))),
    ):
        code, printed = _cli(*args)
        results[name] = (code != 0, printed)

    def fit() -> str:
        trainer = _trainer(3)
        trainer.fit(Tiny(), ckpt_path=str(ckpt))
        return f"resumed, trained to step {trainer.global_step}"

    for name, load in (("load_full_checkpoint", lambda: sorted(load_full_checkpoint(ckpt))), ("fit", fit)):
        try:
            results[name] = (False, str(load()))
        except CheckpointCorruptError as err:
            results[name] = (True, str(err))
    return results


def test_an_intact_copy_passes_every_entry_point(real_checkpoint: Path, tmp_path: Path) -> None:
    """The control: the same entry points accept the checkpoint the hostile ones are derived from."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(real_checkpoint, ckpt)
    with _watched() as seen:
        results = _entry_points(ckpt, tmp_path)
    assert not any(refused for refused, _ in results.values()), results
    assert results["fit"][1] == "resumed, trained to step 3"
    assert "optimizer_states" in results["load_full_checkpoint"][1]
    assert (tmp_path / "weights.safetensors").is_file()
    assert seen["found"] == []  # DCP's metadata read with no name resolved by pickle's own lookup


@pytest.mark.parametrize("variant", list(HOSTILE))
def test_a_hostile_checkpoint_is_refused_by_every_entry_point_naming_the_file_and_rule_with_no_side_effect(
    real_checkpoint: Path, tmp_path: Path, variant: str
) -> None:
    ckpt, outside, out = tmp_path / "ckpt", tmp_path / "outside", tmp_path / "out"
    shutil.copytree(real_checkpoint, ckpt)
    outside.mkdir()
    out.mkdir()
    marker = tmp_path / MARKER_NAME
    rule = HOSTILE[variant](ckpt, outside, f"touch {marker}")
    with _watched() as seen:
        results = _entry_points(ckpt, out)
    opened = [p for p in seen["opened"] if Path(p).resolve().is_relative_to(outside.resolve())]
    found = seen["found"]
    assert not marker.exists(), f"the {variant} payload ran"
    assert opened == [], f"files outside the checkpoint were opened: {opened}"
    assert found == [], f"pickle's own lookup resolved {sorted(set(found))}"
    for entry, (refused, message) in results.items():
        assert refused, f"{entry} accepted the {variant} checkpoint: {message}"
        assert str(ckpt) in message and re.search(rule, message), f"{entry}: {message}"
    assert list(out.iterdir()) == []  # consolidate wrote nothing
