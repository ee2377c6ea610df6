"""Which checkpoint ``lightning-scale-train`` resumes from (``ckpt_path``), under every strategy it offers.

``"latest"`` means one thing everywhere: :func:`lightning_scale.core.checkpoint.latest.latest` (the
run's own highest step that verifies, then the run that saved most recently). ``HybridParallelStrategy``
resolves it itself, collectively, among its sharded checkpoint directories, and resumes a relaunched
process on its own (``ShardedCheckpointIO(auto_resume="on_restart")``). Lightning's own strategies
(``strategy=ddp``) know neither, so for them both happen here, among Lightning's ``.ckpt`` files.
A sweep job that ran before resumes from its ``"latest"`` too (:func:`resumable_checkpoint`).
Imports nothing else from ``cli`` (see ``cli/__init__.py``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from lightning_scale.core.checkpoint.latest import latest
from lightning_scale.core.deprecation import moved_message
from lightning_scale.plugins.checkpoint_io import restarted

__all__ = ["check_checkpoint_path", "checkpoint_formats", "resumable_checkpoint", "resume_checkpoint"]


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


def checkpoint_formats(cfg: DictConfig) -> tuple[str, ...]:
    """The checkpoint formats the run's strategy loads, for ``"latest"``: ``("sharded",)`` under
    ``HybridParallelStrategy``, ``("lightning",)`` (``.ckpt`` files) under Lightning's strategies, none
    under DeepSpeed (directories of its own format)."""
    if _sharded(cfg):
        return ("sharded",)
    return () if "deepspeed" in _strategy_target(cfg).lower() else ("lightning",)


def resume_checkpoint(cfg: DictConfig) -> str | None:
    """What ``Trainer.fit(ckpt_path=...)`` gets. Under ``HybridParallelStrategy``, ``"latest"`` (and a
    relaunch with no ``ckpt_path``) is resolved by the strategy, collectively; under Lightning's
    strategies it is resolved here (among ``.ckpt`` files), the same on every rank: no
    rank writes a checkpoint before every rank has started."""
    path = cfg.get("ckpt_path")
    if _sharded(cfg):
        return path if path in (None, "latest") else _existing_checkpoint(cfg)
    if path is None and restarted() and "deepspeed" not in _strategy_target(cfg).lower():
        path = "latest"  # a relaunch resumes, as ShardedCheckpointIO(auto_resume="on_restart") does under hybrid
    if path != "latest":
        return None if path is None else _existing_checkpoint(cfg)
    roots = _checkpoint_roots(cfg)
    found = latest(roots, formats=checkpoint_formats(cfg), warn=getattr(rank_zero_only, "rank", 0) == 0)
    if found is None:
        rank_zero_warn(
            f"ckpt_path='latest': no .ckpt file with training state that verifies in {', '.join(map(str, roots))}; "
            "starting from scratch."
        )
        return None
    return str(found.path)


def resumable_checkpoint(cfg: DictConfig) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, the wandb run id it records) for a sweep job that ran before: its
    ``"latest"`` in the run's checkpoint directories, in the format its strategy loads (under DeepSpeed,
    whose checkpoints ``"latest"`` does not read, ``last.ckpt`` when there is one)."""
    roots = _checkpoint_roots(cfg)
    formats = checkpoint_formats(cfg)
    if not formats:
        last = roots[0] / "last.ckpt"
        return (str(last) if last.exists() else None), None
    found = latest(roots, formats=formats)
    if found is None:
        return None, None
    recorded = found.manifest.get("wandb_run_id")
    return str(found.path), recorded if isinstance(recorded, str) else None


def latest_lightning_checkpoint(roots: list[Path]) -> Path | None:
    """Deprecated: ``lightning_scale.core.checkpoint.latest.latest(roots, formats=("lightning",))`` (the one rule
    of "latest"). The ``.ckpt`` file it names, as 0.1.0 returned it."""
    warnings.warn(
        moved_message(f"{__name__}.latest_lightning_checkpoint", "lightning_scale.core.checkpoint.latest.latest"),
        DeprecationWarning,
        stacklevel=2,
    )
    found = latest(roots, formats=("lightning",))
    return Path(found.path) if found is not None else None
