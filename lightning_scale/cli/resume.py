"""Which checkpoint ``lightning-scale-train`` resumes from (``ckpt_path``), under every strategy it offers.

``HybridParallelStrategy`` resolves ``"latest"`` itself, collectively, among its sharded checkpoint
directories (the newest that verifies), and resumes a relaunched process on its own
(``ShardedCheckpointIO(auto_resume="on_restart")``). Lightning's own strategies (``strategy=ddp``)
know neither, so for them both happen here, in Lightning's format: a ``.ckpt`` file per checkpoint.
A sweep job that ran before resumes from its newest checkpoint (:func:`resumable_checkpoint`).
Imports nothing else from ``cli`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig

from lightning_scale.core.checkpoint.format import latest
from lightning_scale.plugins.checkpoint_io import restarted

__all__ = ["check_checkpoint_path", "latest_lightning_checkpoint", "resumable_checkpoint", "resume_checkpoint"]


def _strategy_target(cfg: DictConfig) -> str:
    return str((cfg.get("strategy") or {}).get("_target_", ""))


def _sharded(cfg: DictConfig) -> bool:
    """The run's strategy is ours: sharded checkpoint directories, its own ``"latest"`` and auto-resume."""
    return _strategy_target(cfg).endswith("HybridParallelStrategy")


def _existing_checkpoint(cfg: DictConfig) -> str:
    """``ckpt_path`` as a path ("last": ``last.ckpt`` in the checkpoint directory), which must exist."""
    path = cfg.ckpt_path
    if path == "last":
        path = str(_checkpoint_roots(cfg)[0] / "last.ckpt")
    if not Path(path).exists():
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path!r} points to {path}, which does not exist. Pass an existing checkpoint, "
            "or ckpt_path=latest (or last) together with the hydra.run.dir of the run to resume."
        )
    return str(path)


def check_checkpoint_path(cfg: DictConfig) -> None:
    """``ckpt_path`` is usable with the run's strategy (no file is read)."""
    path = cfg.get("ckpt_path")
    if path == "latest" and "deepspeed" in _strategy_target(cfg).lower():
        raise ValueError(
            "ckpt_path='latest' picks the newest checkpoint that loads among strategy=hybrid's sharded checkpoints or "
            "Lightning's .ckpt files (strategy=ddp); DeepSpeed writes checkpoint directories of its own format. With a "
            "deepspeed preset pass ckpt_path=last or the checkpoint directory itself; strategy=hybrid "
            "strategy.data_parallel_mode=fsdp supports ckpt_path=latest."
        )
    if path not in (None, "latest"):
        _existing_checkpoint(cfg)


def _checkpoint_roots(cfg: DictConfig) -> list[Path]:
    """Where this run's checkpoints are: every ``ModelCheckpoint``'s directory and ``<run_dir>/checkpoints``
    (where a preemption checkpoint goes without one)."""
    roots = [
        Path(node["dirpath"])
        for node in (cfg.get("callbacks") or {}).values()
        if node is not None and str(node.get("_target_", "")).endswith("ModelCheckpoint") and node.get("dirpath")
    ]
    return list(dict.fromkeys([*roots, Path(cfg.run_dir) / "checkpoints"]))


def latest_lightning_checkpoint(roots: list[Path]) -> Path | None:
    """``"latest"`` in Lightning's own format (a ``.ckpt`` file per checkpoint, e.g. ``strategy=ddp``): of
    the ``*.ckpt`` files in ``roots``, the one with the highest step (the newest of equal steps) that loads
    with ``torch.load(weights_only=True)`` and holds training state (optimizer and loops: a weights-only
    checkpoint cannot resume a run). Every file passed over gets a warning naming it and why."""
    found: list[tuple[int, float, Path]] = []
    seen: set[Path] = set()
    for root in roots:
        for file in sorted(root.glob("*.ckpt")) if root.is_dir() else []:
            real = file.resolve()  # last.ckpt may be a link to a checkpoint listed too
            if not real.is_file() or real in seen:
                continue
            seen.add(real)
            try:
                # Memory-mapped: the tensors are not read, only the archive's index and the pickled structure.
                state = torch.load(real, map_location="cpu", mmap=True, weights_only=True)
            except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
                rank_zero_warn(f"Skipping {file}, which does not load: {type(err).__name__}: {str(err)[:300]}")
                continue
            if not isinstance(state, dict) or not {"optimizer_states", "loops"} <= state.keys():
                rank_zero_warn(
                    f"Skipping {file}: no optimizer or loop state (saved with weights only?), nothing to resume."
                )
                continue
            found.append((int(state.get("global_step", -1)), real.stat().st_mtime, real))
    return max(found)[2] if found else None


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """What ``Trainer.fit(ckpt_path=...)`` gets. Under ``HybridParallelStrategy``, ``"latest"`` (and a
    relaunch with no ``ckpt_path``) is resolved by the strategy, collectively; under Lightning's
    strategies it is resolved here (:func:`latest_lightning_checkpoint`), the same on every rank: no
    rank writes a checkpoint before every rank has started."""
    path = cfg.get("ckpt_path")
    if _sharded(cfg):
        return path if path in (None, "latest") else _existing_checkpoint(cfg)
    if path is None and restarted() and "deepspeed" not in _strategy_target(cfg).lower():
        path = "latest"  # a relaunch resumes, as ShardedCheckpointIO(auto_resume="on_restart") does under hybrid
    if path != "latest":
        return None if path is None else _existing_checkpoint(cfg)
    roots = _checkpoint_roots(cfg)
    found = latest_lightning_checkpoint(roots)
    if found is None:
        rank_zero_warn(
            f"ckpt_path='latest': no checkpoint that loads in {', '.join(map(str, roots))}; starting from scratch."
        )
        return None
    return str(found)


def resumable_checkpoint(cfg: DictConfig) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, the wandb run id it records) for a sweep job that ran before, in its
    checkpoint directory: the newest sharded checkpoint that verifies, else ``last.ckpt``, else the newest
    ``.ckpt`` file."""
    node = (cfg.get("callbacks") or {}).get("checkpoint") or {}
    root = Path(node.get("dirpath") or Path(cfg.run_dir) / "checkpoints")
    if not root.is_dir():
        return None, None
    found = latest(root)  # sharded checkpoints: the newest that verifies
    if found is not None:
        return str(found.path), found.manifest.get("wandb_run_id")
    last = root / "last.ckpt"
    if last.is_file():
        return str(last), None
    files = sorted(root.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    return (str(files[-1]) if files else None), None
