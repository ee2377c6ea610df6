"""Sharded checkpoints through Lightning's own API: every rank writes its part, directories committed
atomically, verified on load, resharded to any layout, no pickles read."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import random
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.distributed import run_distributed
from helpers.lightning import quiet_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_scale  # noqa: F401
import lightning_scale.core.checkpoint.shard_reader as shard_reader
from lightning_scale.core.checkpoint.format import verify
from lightning_scale.core.checkpoint.sharded import read_tensor_metadata
from lightning_scale.core.checkpoint.state import decode, encode
from lightning_scale.data import TextDataModule
from lightning_scale.models import GPTConfig, GPTLightningModule
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.plugins._rng import collect_rng_states, restore_rng_states
from lightning_scale.plugins.checkpoint_io import load_from_checkpoint, load_full_checkpoint
from lightning_scale.strategies import HybridParallelStrategy

TINY = GPTConfig(n_layers=2, d_model=16, n_heads=2, block_size=8, tie_embeddings=True)


# ---------------------------------------------------------------- JSON state, RNG, safety (no processes)


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Shape:
    width: int
    tags: tuple[str, ...]


def test_non_tensor_state_round_trips_through_json_with_tensors_taken_out() -> None:
    state = {
        "epoch": 3,
        "lr": 1e-3,
        "inf": math.inf,
        "betas": (0.9, 0.95),
        "by_int": {1: "a", 2: "b"},
        "dtype": torch.bfloat16,
        "path": Path("/tmp/x"),
        "shape": Shape(2, ("a",)),
        "color": Color.RED,
        "blob": b"\x00\xff",
        "scalar": np.float32(0.5),
        "score": torch.tensor(0.25),
        "nested": [{"m": torch.arange(3)}],
    }
    tensors: dict[str, torch.Tensor] = {}
    doc = encode(state, tensors, prefix="extra")
    assert sorted(tensors) == ["extra/nested/0/m", "extra/score"]
    back = decode(json.loads(json.dumps(doc, allow_nan=False)), tensors)
    assert back["betas"] == (0.9, 0.95) and back["by_int"] == {1: "a", 2: "b"} and back["inf"] == math.inf
    assert back["dtype"] is torch.bfloat16 and back["path"] == Path("/tmp/x") and back["blob"] == b"\x00\xff"
    assert back["shape"] == Shape(2, ("a",)) and back["color"] is Color.RED and back["scalar"] == 0.5
    assert back["score"] is tensors["extra/score"] and back["nested"][0]["m"] is tensors["extra/nested/0/m"]


def test_state_json_cannot_hold_is_refused_naming_where_it_is_except_hyper_parameters_kept_as_repr() -> None:
    with pytest.raises(TypeError, match=r"Cannot store extra/callbacks/mine/fn \(a function\)"):
        encode({"callbacks": {"mine": {"fn": lambda: 0}}}, {}, prefix="extra")
    with pytest.warns(RuntimeWarning, match=r"extra/hyper_parameters/net holds a Linear"):
        doc = encode(
            {"hyper_parameters": {"net": torch.nn.Linear(1, 1)}},
            {},
            prefix="extra",
            lenient=lambda p: p[0] == "hyper_parameters",
        )
    assert decode(doc, {})["hyper_parameters"]["net"].startswith("Linear(")


def test_a_dataclass_whose_module_is_not_imported_comes_back_as_its_fields_without_importing_it() -> None:
    doc = {"__ls__": "dataclass", "v": ["no_such_module_xyz:Config", {"a": 1}]}
    assert decode(doc, {}) == {"a": 1}


def test_random_states_round_trip() -> None:
    states = json.loads(json.dumps(collect_rng_states()))
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    restore_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected


def test_options_are_checked_when_made() -> None:
    with pytest.raises(
        ValueError, match=r"keep_last=0 must be a positive integer \(1 or more\)\. The newest checkpoint is always kept"
    ):
        ShardedCheckpointIO(keep_last=0)
    with pytest.raises(ValueError, match=r"keep_every=5 needs keep_last"):
        ShardedCheckpointIO(keep_every=5)
    with pytest.raises(ValueError, match=r"auto_resume='always' must be one of"):
        ShardedCheckpointIO(auto_resume="always")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"metadata must hold JSON values"):
        ShardedCheckpointIO(metadata={"when": object()})
    with pytest.raises(
        ValueError, match=r"checksum='xxh64' is not a checksum algorithm .* choose one of \('crc32', 'sha256'\)"
    ):
        ShardedCheckpointIO(checksum="xxh64")
    with pytest.raises(
        ValueError, match=r"thread_count=0 must be a positive integer \(1 or more\)\. It is the number of threads"
    ):
        ShardedCheckpointIO(thread_count=0)


# ---------------------------------------------------------------- Lightning's API, one process


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_step: int | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first_step is None:
            self.first_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))  # the global batch's, at every layout


class _StopAt(Callback):
    """Ends fit after ``step`` optimizer steps, as a crash would, while the LR schedule still spans max_steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit(
    root: Path,
    steps: int,
    *,
    stop_at: int | None = None,
    strategy: Any = None,
    devices: int = 1,
    callbacks: list[Callback] | None = None,
    ckpt_path: str | None = None,
    io: ShardedCheckpointIO | None = None,
    config: GPTConfig = TINY,
    module_cls: type = GPTLightningModule,
) -> tuple[_Losses, Any, Any]:
    seed_everything(0, verbose=False)
    losses = _Losses()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy or HybridParallelStrategy(checkpoint_io=io),
        precision="64-true",
        max_steps=steps,
        callbacks=[losses, *(callbacks or []), *([_StopAt(stop_at)] if stop_at else [])],
        enable_checkpointing=True,
        default_root_dir=root,
    )
    module = module_cls(config, learning_rate=3e-3, warmup_steps=2)
    trainer.fit(module, datamodule=TextDataModule(seq_len=8, global_batch_size=4), ckpt_path=ckpt_path)
    return losses, module, trainer


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _lightning_api(rank: int, world: int, out: str) -> dict[str, Any]:
    root = Path(out)
    result: dict[str, Any] = {}
    straight, straight_module, _ = _fit(root / "straight", 8)
    result["straight"] = straight.losses
    result["straight_state"] = {k: v.clone() for k, v in straight_module.state_dict().items()}

    # ModelCheckpoint: top-k by a metric, every n steps, save_last; removal deletes directories.
    ckpts = root / "top"
    top = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=2, monitor="train/loss", save_last=True)
    _fit(root / "a", 8, stop_at=6, callbacks=[top])
    result["top_dirs"] = _dirs(ckpts)
    result["top_manifests"] = {d: verify(ckpts / d)["global_step"] for d in _dirs(ckpts)}
    resumed, module, _ = _fit(
        root / "a", 8, callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)], ckpt_path="last"
    )
    result["from_last"], result["from_last_first_step"] = resumed.losses, resumed.first_step
    result["from_last_state"] = {k: v.clone() for k, v in module.state_dict().items()}

    # trainer.save_checkpoint and a whole-model load in one process.
    _, module, trainer = _fit(root / "b", 2)
    trainer.save_checkpoint(root / "manual")
    whole = load_full_checkpoint(root / "manual")
    result["manual_keys"] = sorted(whole)
    result["manual_equal"] = all(torch.equal(whole["state_dict"][k], v) for k, v in module.state_dict().items())
    reloaded = load_from_checkpoint(GPTLightningModule, root / "manual").state_dict()  # built in fp32
    result["reloaded_equal"] = reloaded.keys() == module.state_dict().keys() and all(
        torch.equal(v, module.state_dict()[k].float()) for k, v in reloaded.items()
    )

    # State JSON cannot hold: refused before anything is written.
    module.on_save_checkpoint = lambda checkpoint: checkpoint.update(mine={"lock": __import__("threading").Lock()})
    try:
        trainer.save_checkpoint(root / "refused")
        result["refused"] = "no error"
    except TypeError as err:
        result["refused"] = str(err)
    result["refused_exists"] = (root / "refused").exists() or any(p.name.startswith(".refused") for p in root.iterdir())

    # "latest" passes over a broken newest checkpoint with a warning naming it.
    every = root / "every"
    _fit(
        root / "c",
        4,
        callbacks=[ModelCheckpoint(dirpath=every, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
    )
    shard = next((every / "step=4.ckpt").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest, _, _ = _fit(
            root / "c", 6, callbacks=[ModelCheckpoint(dirpath=every, every_n_train_steps=100)], ckpt_path="latest"
        )
    result["latest_first_step"] = latest.first_step
    result["latest_warnings"] = [str(w.message) for w in caught if "broken checkpoint" in str(w.message)]

    # A relaunch (torchrun sets TORCHELASTIC_RESTART_COUNT) resumes from "latest" with no ckpt_path.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    try:
        auto, _, _ = _fit(root / "c", 6, callbacks=[ModelCheckpoint(dirpath=every, every_n_train_steps=100)])
    finally:
        del os.environ["TORCHELASTIC_RESTART_COUNT"]
    result["auto_first_step"] = auto.first_step

    # Retention: the newest 2 and every 4th step; ModelCheckpoint itself keeps everything.
    kept = root / "kept"
    _fit(
        root / "d",
        7,
        io=ShardedCheckpointIO(keep_last=2, keep_every=4),
        callbacks=[ModelCheckpoint(dirpath=kept, every_n_train_steps=1, save_top_k=-1, filename="{step}")],
    )
    result["kept"] = _dirs(kept)

    # A URL: fsspec's memory filesystem, which like an object store cannot rename a directory, so each
    # checkpoint is written in place and its manifest, written last, commits it.
    import contextlib
    import io as _io

    import fsspec

    from lightning_scale.cli.ckpt import main as ckpt_main
    from lightning_scale.core.checkpoint.format import scan

    remote = "memory://lightning-api/ckpts"

    def every_two() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=remote, every_n_train_steps=2, save_top_k=-1, filename="{step}")

    _fit(root / "e", 8, stop_at=6, io=ShardedCheckpointIO(keep_last=2), callbacks=[every_two()])
    memory = fsspec.filesystem("memory")
    result["remote_after_stop"] = sorted(p.rsplit("/", 1)[-1] for p in memory.ls("/lightning-api/ckpts", detail=False))
    memory.pipe_file(
        "/lightning-api/ckpts/step=8.ckpt/__0_0.distcp", b"partial"
    )  # a save that died before its manifest
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, module, _ = _fit(
            root / "e", 8, io=ShardedCheckpointIO(keep_last=2), callbacks=[every_two()], ckpt_path="latest"
        )
    result["remote_first_step"], result["remote_losses"] = resumed.first_step, resumed.losses
    result["remote_state"] = {k: v.clone() for k, v in module.state_dict().items()}
    result["remote_warnings"] = [str(w.message) for w in caught if "not a checkpoint" in str(w.message)]
    good, bad = scan(remote)
    result["remote_good"] = [(c.path.name, c.step) for c in good]
    result["remote_bad"] = [str(path) for path, _ in bad]
    out = _io.StringIO()
    with contextlib.redirect_stdout(out):
        result["remote_verify_status"] = ckpt_main(["verify", remote])
        ckpt_main(["consolidate", str(good[-1].path), str(root / "remote.safetensors")])
    result["remote_cli"] = out.getvalue()
    from safetensors.torch import load_file

    consolidated = load_file(root / "remote.safetensors")
    result["remote_consolidated_equal"] = (
        all(torch.equal(consolidated[k], v) for k, v in module.state_dict().items() if k in consolidated)
        and len(consolidated) > 0
    )
    return result


@pytest.fixture(scope="module")
def lightning_api(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning-api")
    (result,) = run_distributed(_lightning_api, 1, str(out), timeout=300)
    result["out"] = out
    return result


def test_model_checkpoint_writes_directories_keeps_top_k_and_last_and_removes_directories(lightning_api) -> None:
    # Steps 2, 4, 6 saved; the worst by train/loss removed (a directory); last.ckpt is a checkpoint too.
    dirs = lightning_api["top_dirs"]
    assert len(dirs) == 3 and "last.ckpt" in dirs, dirs
    assert lightning_api["top_manifests"]["last.ckpt"] == 6
    assert all(not d.startswith(".") for d in dirs)  # no staging or half-removed directory left


def test_resuming_from_last_continues_exactly(lightning_api) -> None:
    assert lightning_api["from_last_first_step"] == 6
    assert lightning_api["from_last"] == lightning_api["straight"][6:]
    for name, value in lightning_api["straight_state"].items():
        assert torch.equal(lightning_api["from_last_state"][name], value), name


def test_save_checkpoint_writes_a_directory_one_process_loads_whole(lightning_api) -> None:
    assert lightning_api["manual_equal"] and lightning_api["reloaded_equal"]
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "epoch", "global_step"} <= set(
        lightning_api["manual_keys"]
    )
    files = sorted(p.name for p in (lightning_api["out"] / "manual").iterdir())
    # Two shard files: ShardedCheckpointIO's thread_count=2 (a load reads and hashes them side by side).
    expected = [".metadata", "__0_0.distcp", "__0_1.distcp", "manifest.json", "rank-00000.json", "trainer_state.json"]
    assert files == expected, files


def test_state_that_json_cannot_hold_is_refused_before_anything_is_written(lightning_api) -> None:
    assert re.search(r"rank 0: Cannot store extra/mine/lock \(a lock\)", lightning_api["refused"]), lightning_api[
        "refused"
    ]
    assert not lightning_api["refused_exists"]


def test_latest_skips_a_corrupted_checkpoint_with_a_warning_naming_the_file(lightning_api) -> None:
    assert lightning_api["latest_first_step"] == 2
    (message,) = lightning_api["latest_warnings"]
    assert re.search(r"step=4\.ckpt.*__0_0\.distcp does not match its crc32", message), message


def test_a_relaunch_resumes_from_latest_with_no_ckpt_path(lightning_api) -> None:
    # The newest that verifies is step 2 (step 4 is the corrupted one).
    assert lightning_api["auto_first_step"] == 2


def test_retention_keeps_the_newest_and_every_nth(lightning_api) -> None:
    assert lightning_api["kept"] == ["step=4.ckpt", "step=6.ckpt", "step=7.ckpt"]


def test_checkpoints_at_a_url_save_retain_resume_from_latest_and_skip_a_save_that_died(lightning_api) -> None:
    r = lightning_api
    assert r["remote_after_stop"] == ["step=4.ckpt", "step=6.ckpt"], r["remote_after_stop"]  # keep_last=2
    # The directory left without a manifest is passed over, naming it; the run resumes at 6 and ends as
    # the run that never stopped.
    (warning,) = r["remote_warnings"]
    assert re.search(
        r"memory:///lightning-api/ckpts/step=8\.ckpt, not a checkpoint: .*manifest\.json is missing", warning
    )
    assert r["remote_first_step"] == 6 and r["remote_losses"] == r["straight"][6:]
    for name, value in r["straight_state"].items():
        assert torch.equal(r["remote_state"][name], value), name
    assert [step for _, step in r["remote_good"]] == [6, 8], r["remote_good"]
    assert r["remote_bad"] == ["memory:///lightning-api/ckpts/step=8.ckpt"]
    # lightning-scale-ckpt reads URLs: verify flags the broken directory, consolidate reads the newest.
    assert r["remote_verify_status"] == 1, r["remote_cli"]  # one directory there is not a checkpoint
    assert "BROKEN memory:///lightning-api/ckpts/step=8.ckpt: not a checkpoint" in r["remote_cli"], r["remote_cli"]
    assert "OK     memory:///lightning-api/ckpts/step=8-v1.ckpt" in r["remote_cli"], r["remote_cli"]
    assert r["remote_consolidated_equal"]


# ---------------------------------------------------------------- resharding: any layout to any other

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2-ddp": {"data_parallel": 2},
    "dp2-fsdp": {"data_parallel": 2, "data_parallel_mode": "fsdp"},
    "tp2": {"data_parallel": 1, "tensor_parallel": 2},
    "pp2": {"data_parallel": 1, "pipeline_parallel": 2, "microbatches": 2},
}


class _SaveAtStart(Callback):
    """Saves right after the checkpoint was restored: what this layout holds, as a checkpoint again."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


def _reshard(rank: int, world: int, out: str) -> dict[str, Any]:
    root = Path(out)
    result: dict[str, Any] = {}
    for name, kwargs in LAYOUTS.items():
        save = ModelCheckpoint(dirpath=root / name, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        losses, _, _ = _fit(
            root, 4, stop_at=2, strategy=HybridParallelStrategy(**kwargs), devices=world, callbacks=[save]
        )
        result[name] = losses.losses
    # These loads read each tensor straight into its destination wherever it can (no size floor),
    # where a load of the small test model would otherwise decode every one from a buffer.
    shard_reader._DIRECT_MIN = 0
    for source in LAYOUTS:
        for target, kwargs in LAYOUTS.items():
            if target == source:
                continue
            again = _SaveAtStart(root / f"{source}-as-{target}")
            losses, _, _ = _fit(
                root,
                4,
                strategy=HybridParallelStrategy(**kwargs),
                devices=world,
                callbacks=[again],
                ckpt_path=str(root / source / "step=2.ckpt"),
            )
            result[f"{source}->{target}"] = (losses.first_step, losses.losses)
    # Another model configuration: an error on every rank, also where only one pipeline stage lacks its blocks.
    for name, config in (
        ("deeper", dataclasses.replace(TINY, n_layers=4)),
        ("wider", dataclasses.replace(TINY, d_model=32)),
    ):
        try:
            _fit(
                root,
                4,
                strategy=HybridParallelStrategy(**LAYOUTS["pp2"]),
                devices=world,
                config=config,
                ckpt_path=str(root / "pp2" / "step=2.ckpt"),
            )
            result[name] = "no error"
        except (KeyError, ValueError) as err:
            result[name] = f"{type(err).__name__}: {err}"
    # A Hugging Face model at pp=2 (for `consolidate` -> from_pretrained).
    from test_huggingface import HFModule

    seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        devices=world,
        strategy=HybridParallelStrategy(data_parallel=1, pipeline_parallel=world, microbatches=2),
        max_steps=1,
        use_distributed_sampler=False,
    )
    trainer.fit(HFModule("llama"))
    trainer.save_checkpoint(root / "hf-llama")
    return result


@pytest.fixture(scope="module")
def resharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[float]]:
    out = tmp_path_factory.mktemp("reshard")
    results = run_distributed(_reshard, 2, str(out), timeout=600)
    reference, _, _ = _fit(out / "reference", 4, strategy="auto")
    return out, results[0], reference.losses


@pytest.mark.slow
def test_every_layout_trains_like_one_process_before_saving(resharded) -> None:
    _, result, reference = resharded
    for name in LAYOUTS:
        torch.testing.assert_close(result[name], reference[:2], rtol=1e-9, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("source", list(LAYOUTS))
def test_a_checkpoint_loads_at_every_other_layout_and_training_continues_the_same(resharded, source: str) -> None:
    _, result, reference = resharded
    for target in LAYOUTS:
        if target != source:
            first, losses = result[f"{source}->{target}"]
            assert first == 2, (source, target)
            # The data position (global batches) and every state carry over, at any dp.
            torch.testing.assert_close(losses, reference[2:], rtol=1e-9, atol=0, msg=f"{source}->{target}")


@pytest.mark.slow
@pytest.mark.parametrize("source", list(LAYOUTS))
def test_parameters_and_optimizer_state_are_identical_after_resharding(resharded, source: str) -> None:
    out, _, _ = resharded
    saved = load_full_checkpoint(out / source / "step=2.ckpt")
    for target in LAYOUTS:
        if target == source:
            continue
        again = load_full_checkpoint(out / f"{source}-as-{target}")
        assert again["state_dict"].keys() == saved["state_dict"].keys()
        for key, value in saved["state_dict"].items():
            assert torch.equal(again["state_dict"][key], value), (target, key)
        (mine,), (theirs,) = saved["optimizer_states"], again["optimizer_states"]
        assert theirs["state"].keys() == mine["state"].keys()
        for fqn, entries in mine["state"].items():
            for key, value in entries.items():
                assert torch.equal(theirs["state"][fqn][key], value), (target, fqn, key)
        assert theirs["param_groups"] == mine["param_groups"]
        assert again["lr_schedulers"] == saved["lr_schedulers"]


@pytest.mark.slow
def test_a_checkpoint_of_another_configuration_is_refused_on_every_rank_naming_what_differs(resharded) -> None:
    _, result, _ = resharded
    # 4 blocks at pp=2: the second stage's blocks 2-3 are not in the 2-block checkpoint; the first stage's are.
    assert re.search(r"KeyError: .*has no \['model/model\.blocks\.2\.", result["deeper"]), result["deeper"]
    assert re.search(
        r"ValueError: 'model/model\.tok_emb\.weight' has shape \(256, 16\) in the checkpoint .* and "
        r"\(256, 32\) here",
        result["wider"],
    ), result["wider"]


@pytest.mark.slow
def test_a_weight_tied_across_pipeline_stages_is_stored_once(resharded) -> None:
    out, _, _ = resharded
    keys = set(read_tensor_metadata(out / "pp2" / "step=2.ckpt"))
    assert "model/model.tok_emb.weight" in keys and "model/model.head.weight" not in keys
    assert not any(k.startswith("optim/0/model.head.weight/") for k in keys)
    manifest = verify(out / "pp2" / "step=2.ckpt")
    assert manifest["layout"] == {"dp": 1, "tp": 1, "pp": 2, "data_parallel_mode": "ddp"}
    assert manifest["tied"] == [["model.tok_emb.weight", "model.head.weight"]]


# ---------------------------------------------------------------- async saves, failures during a save

BIG = GPTConfig(
    n_layers=4, d_model=384, n_heads=2, block_size=8, tie_embeddings=True
)  # ~85 MB of state per rank at tp=2


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _full_state(trainer: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    state = {f"model/{k}": v for k, v in trainer.strategy.lightning_module_state_dict().items()}
    for fqn, entries in trainer.strategy.optimizer_state(trainer.optimizers[0])["state"].items():
        state.update({f"optim/{fqn}/{k}": v for k, v in entries.items()})
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _disk_full(*args: Any, **kwargs: Any) -> Any:
    raise OSError(28, "No space left on device")


def _read_only(*args: Any, **kwargs: Any) -> Any:
    raise PermissionError(13, "Permission denied")


def _async_cases(rank: int, world: int, out: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    root = Path(out)
    result: dict[str, Any] = {}
    io = ShardedCheckpointIO(async_save=True, keep_last=2)
    strategy = HybridParallelStrategy(data_parallel=1, tensor_parallel=world, checkpoint_io=io)
    _, module, trainer = _fit(root / "run", 2, strategy=strategy, devices=world, config=BIG)

    # Mutating every parameter and optimizer state right after save returns cannot tear the snapshot.
    before = _full_state(trainer)
    trainer.save_checkpoint(root / "ckpts" / "snap")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1000.0)
        for state in trainer.optimizers[0].state.values():
            for v in state.values():
                v.add_(1000.0) if isinstance(v, torch.Tensor) else None
    io.wait()
    torch.distributed.barrier()
    if rank == 0:
        whole = load_full_checkpoint(root / "ckpts" / "snap")
        flat = {f"model/{k}": v for k, v in whole["state_dict"].items()}
        names = [n for group in whole["lightning_scale"]["optimizer_param_names"][0] for n in group]
        for index, entries in whole["optimizer_states"][0]["state"].items():  # torch's form: by parameter number
            flat.update({f"optim/{names[index]}/{k}": v for k, v in entries.items()})
        result["snapshot_equal"] = {k: torch.equal(flat[k], v) for k, v in before.items()}
    with torch.no_grad():
        for p in module.parameters():
            p.sub_(1000.0)

    # 20 saves in a row: the host buffers are reused, memory stays flat after the second.
    rss = []
    for i in range(20):
        trainer.save_checkpoint(root / "ckpts" / f"s{i:02d}")
        rss.append(_rss_bytes())
    io.wait()
    result["rss"] = rss
    result["state_bytes"] = sum(v.numel() * v.element_size() for v in before.values()) // world
    result["kept"] = _dirs(root / "ckpts")

    # A failing write (full disk) surfaces at the next save, on every rank; nothing broken is left.
    original = FileSystemWriter.write_data
    FileSystemWriter.write_data = _disk_full
    try:
        trainer.save_checkpoint(root / "ckpts" / "full")  # returns: the write runs in the background
        result["returned"] = True
        try:
            trainer.save_checkpoint(root / "ckpts" / "after")
        except Exception as err:  # noqa: BLE001
            result["async_error"] = f"{type(err).__name__}: {err}"
        # The synchronous path raises at once.
        io.async_save = False
        try:
            trainer.save_checkpoint(root / "ckpts" / "sync-full")
        except Exception as err:  # noqa: BLE001
            result["sync_error"] = f"{type(err).__name__}: {err}"
        FileSystemWriter.write_data = _read_only
        try:
            trainer.save_checkpoint(root / "ckpts" / "read-only")
        except Exception as err:  # noqa: BLE001
            result["permission_error"] = f"{type(err).__name__}: {err}"
    finally:
        FileSystemWriter.write_data = original
    torch.distributed.barrier()
    result["after_failure"] = sorted(p.name for p in (root / "ckpts").iterdir())
    result["still_verify"] = [verify(root / "ckpts" / d)["global_step"] for d in _dirs(root / "ckpts")]

    # A URL, through DCP's fsspec writer and reader on both ranks (file://: the one fsspec filesystem
    # that two processes share here), async and sync; loaded back in place into perturbed weights.
    remote = f"file://{root}/remote"
    weights = {k: v for k, v in _full_state(trainer).items() if k.startswith("model/")}
    io.checksum = "sha256"  # the other algorithm, hashed as written (async and sync) and as read
    for mode in ("async", "sync"):
        io.async_save = mode == "async"
        trainer.save_checkpoint(f"{remote}/{mode}")
        io.wait()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
        trainer.strategy.load_checkpoint(f"{remote}/{mode}")
        after = _full_state(trainer)
        result[f"url_{mode}_equal"] = all(torch.equal(after[k], v) for k, v in weights.items())
    torch.distributed.barrier()
    result["url_dirs"] = _dirs(root / "remote")
    result["url_checksums"] = sorted(
        {
            k
            for d in result["url_dirs"]
            for e in verify(root / "remote" / d)["files"]
            for k in e
            if k not in ("path", "bytes")
        }
    )
    return result


@pytest.fixture(scope="module")
def async_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("async")
    return run_distributed(_async_cases, 2, str(out), timeout=300)[0]


def test_an_async_save_holds_the_values_from_before_save_returned(async_cases) -> None:
    equal = async_cases["snapshot_equal"]
    assert equal and all(equal.values()), [k for k, v in equal.items() if not v]


def test_twenty_async_saves_do_not_grow_host_memory_after_the_second(async_cases) -> None:
    rss, state = async_cases["rss"], async_cases["state_bytes"]
    print(f"RSS after each of 20 async saves (MB): {[round(r / 2**20, 1) for r in rss]}; state {state / 2**20:.0f} MB")
    # New buffers per save would add the whole state each time (18x by the last); the allocator moves RSS
    # by some MB either way (measured: +-10 MB around flat, on 82 MB of state).
    assert rss[-1] - rss[1] < 0.5 * state and max(rss[2:]) - rss[1] < 1.0 * state, (state, rss)
    assert async_cases["kept"] == ["s18", "s19"]  # keep_last=2 ran in the background too


def test_a_full_disk_or_a_permission_error_during_a_save_is_a_clear_error_and_earlier_checkpoints_stay_intact(
    async_cases,
) -> None:
    assert async_cases["returned"]
    for key in ("async_error", "sync_error"):
        message = async_cases[key]
        assert re.match(
            r"OSError: Saving the checkpoint .*ckpts/(full|sync-full) failed; earlier checkpoints are untouched",
            message,
        )
        assert "rank 0: OSError: [Errno 28] No space left on device" in message, message
    message = async_cases["permission_error"]
    assert "ckpts/read-only failed; earlier checkpoints are untouched" in message, message
    assert "rank 1: PermissionError: [Errno 13] Permission denied" in message, message
    # No staging directory, no partial checkpoint under the failed names; the last good ones verify.
    assert async_cases["after_failure"] == ["s18", "s19"], async_cases["after_failure"]
    assert async_cases["still_verify"] == [2, 2]


def test_a_url_checkpoint_is_written_and_read_by_every_rank_async_or_not(async_cases) -> None:
    assert async_cases["url_async_equal"] and async_cases["url_sync_equal"]
    assert async_cases["url_dirs"] == ["async", "sync"]  # committed by rename (file:// can), no staging left
    assert async_cases["url_checksums"] == ["sha256"]  # ShardedCheckpointIO.checksum changed mid-run, both paths


# ---------------------------------------------------------------- preemption


class _SignalDuringStep(Callback):
    """Sends ``signum`` to this process in the middle of optimizer step ``step`` (1-based), on one rank."""

    def __init__(self, step: int, rank: int, signum: int) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def _preempted(rank: int, world: int, out: str) -> dict[str, Any]:
    import signal

    from lightning_scale.callbacks import Preempted

    root = Path(out)
    dp2 = {"data_parallel": 2}
    straight, module, _ = _fit(root / "straight", 6, strategy=HybridParallelStrategy(**dp2), devices=world)
    result: dict[str, Any] = {"straight": straight.losses, "straight_state": _gathered(module)}
    try:
        # Only rank 1 is signalled, in the middle of step 3: both ranks finish it and stop after it.
        _fit(
            root / "run",
            6,
            strategy=HybridParallelStrategy(**dp2),
            devices=world,
            callbacks=[_SignalDuringStep(3, rank=1, signum=signal.SIGTERM)],
        )
        result["exit"] = None
    except Preempted as stop:
        result["exit"] = stop.code
    result["handler_restored"] = signal.getsignal(signal.SIGTERM) is not None
    result["dirs"] = _dirs(root / "run" / "checkpoints")
    resumed, module, _ = _fit(
        root / "run", 6, strategy=HybridParallelStrategy(**dp2), devices=world, ckpt_path="latest"
    )
    result["resumed"], result["first_step"] = resumed.losses, resumed.first_step
    result["resumed_state"] = _gathered(module)
    return result


def _gathered(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}  # dp only: every rank holds it all


@pytest.mark.slow
def test_sigterm_commits_a_checkpoint_at_the_step_reached_exits_with_143_and_resumes_bitwise(tmp_path: Path) -> None:
    from lightning_scale.plugins import PREEMPTION_EXIT_CODE

    results = run_distributed(_preempted, 2, str(tmp_path), timeout=300)
    for result in results:
        assert result["exit"] == PREEMPTION_EXIT_CODE == 143
        assert result["dirs"] == ["step-000003"]
        assert result["first_step"] == 3
        assert result["resumed"] == result["straight"][3:]
        for name, value in result["straight_state"].items():
            assert torch.equal(result["resumed_state"][name], value), name
    verify(tmp_path / "run" / "checkpoints" / "step-000003")


# ---------------------------------------------------------------- the command line: inspect, verify, consolidate


def _ckpt(*args: str) -> tuple[int, str]:
    import contextlib
    import io as _io

    from lightning_scale.cli.ckpt import main

    out = _io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


@pytest.mark.slow
def test_consolidate_streams_the_whole_weights_into_one_safetensors_file(resharded, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out, _, _ = resharded
    code, printed = _ckpt("consolidate", str(out / "pp2" / "step=2.ckpt"), str(tmp_path / "gpt.safetensors"))
    assert code == 0, printed
    weights = load_file(tmp_path / "gpt.safetensors")
    whole = load_full_checkpoint(out / "pp2" / "step=2.ckpt")["state_dict"]
    assert weights.keys() == whole.keys()  # the tied head included, under its own name
    for name, value in whole.items():
        assert torch.equal(weights[name], value), name
    code, _ = _ckpt(
        "consolidate", str(out / "pp2" / "step=2.ckpt"), str(tmp_path / "bf16.safetensors"), "--dtype", "bf16"
    )
    assert code == 0 and load_file(tmp_path / "bf16.safetensors")["model.tok_emb.weight"].dtype == torch.bfloat16


@pytest.mark.slow
def test_a_consolidated_hugging_face_model_loads_with_from_pretrained_and_gives_the_same_logits(
    resharded, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from test_huggingface import HFModule

    out, _, _ = resharded
    code, printed = _ckpt("consolidate", str(out / "hf-llama"), str(tmp_path / "hf"))
    assert code == 0, printed
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = HFModule("llama")
    trained.load_state_dict(load_full_checkpoint(out / "hf-llama")["state_dict"])
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = trained.model.eval()(input_ids=tokens).logits
        got = loaded(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("flip", r"__1_0\.distcp does not match its crc32"),
        ("truncate", r"__1_0\.distcp has \d+ bytes, the manifest says \d+: truncated"),
        ("delete-shard", r"__1_0\.distcp is missing"),
        ("delete-manifest", r"manifest\.json is missing"),
    ],
)
def test_verify_names_the_damaged_file_and_latest_falls_back(
    resharded, tmp_path: Path, damage: str, match: str
) -> None:
    import shutil

    out, _, _ = resharded
    root = tmp_path / "ckpts"
    root.mkdir()
    for name in ("step=2.ckpt",):
        shutil.copytree(out / "tp2" / name, root / "older")
        shutil.copytree(out / "tp2" / name, root / "newer")
    manifest = json.loads((root / "newer" / "manifest.json").read_text())
    manifest["global_step"] = 3  # newer than the other copy
    (root / "newer" / "manifest.json").write_text(json.dumps(manifest))
    shard = root / "newer" / "__1_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[7] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "delete-shard":
        shard.unlink()
    else:
        (root / "newer" / "manifest.json").unlink()
    code, printed = _ckpt("verify", str(root / "newer"))
    assert code == 1 and re.search(match, printed), printed
    with pytest.warns(RuntimeWarning, match=match):
        found = ShardedCheckpointIO().latest([root])
    assert found == root / "older"
    code, printed = _ckpt("verify", str(root / "older"))
    assert code == 0 and "OK" in printed


@pytest.mark.slow
def test_inspect_reports_the_layout_step_and_tensors(resharded) -> None:
    out, _, _ = resharded
    code, printed = _ckpt("inspect", str(out / "pp2" / "step=2.ckpt"), "--json", "--tensors")
    assert code == 0, printed
    info = json.loads(printed)
    assert info["global_step"] == 2 and info["layout"]["pp"] == 2 and info["world_size"] == 2
    assert info["by_kind"]["model"]["tensors"] == len([t for t in info["tensors"] if t["key"].startswith("model/")])
    assert {"model", "optim"} <= set(info["by_kind"])
