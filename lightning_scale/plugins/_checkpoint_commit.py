"""A checkpoint taken outside ``ModelCheckpoint``'s schedule, to stop the run at (a preemption signal, a straggler
restart): where it goes, how it is committed on every rank, and the SLURM requeue that may follow. Used by
``HybridParallelStrategy``'s own preemption handling and by the callbacks for other strategies
(:class:`~lightning_scale.callbacks.PreemptionCheckpoint`, :class:`~lightning_scale.callbacks.StragglerMonitor`),
through the Trainer and the :class:`~lightning_scale.plugins.ShardedCheckpointIO` (or Lightning's own format)."""

from __future__ import annotations

import os
import subprocess

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_scale._lightning_compat import cluster_environment
from lightning_scale.core.checkpoint.format import checkpoint_name
from lightning_scale.core.checkpoint.storage import AnyPath, as_path
from lightning_scale.plugins.checkpoint_io import ShardedCheckpointIO

__all__ = ["checkpoint_dir", "commit_checkpoint", "requeue"]


def checkpoint_dir(trainer: Trainer, dirpath: str | os.PathLike | None = None) -> AnyPath:
    """Where a checkpoint taken outside ``ModelCheckpoint``'s schedule goes: ``dirpath``, else the first
    ``ModelCheckpoint``'s directory, else ``ShardedCheckpointIO(dirpath=...)``, else
    ``<default_root_dir>/checkpoints``."""
    io = trainer.strategy.checkpoint_io
    sharded = isinstance(io, ShardedCheckpointIO)
    convert = io.as_path if sharded else as_path
    if dirpath is not None:
        return convert(dirpath)
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            return convert(callback.dirpath)
    if sharded and io.dirpath is not None:
        return io.dirpath
    return convert(trainer.default_root_dir) / "checkpoints"


def commit_checkpoint(trainer: Trainer, dirpath: str | os.PathLike | None = None) -> AnyPath:
    """On every rank: save a full checkpoint of this step, ``step-NNNNNN`` in :func:`checkpoint_dir`, through
    the Trainer (sharded, verified and atomic under ``ShardedCheckpointIO``), wait until it is committed (an
    async save included) and meet at a barrier. The run resumes from it (``ckpt_path="latest"``)."""
    name = checkpoint_name(trainer.global_step)
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, ShardedCheckpointIO):
        name += ".ckpt"  # Lightning's own format, one file: named as Lightning names them, so "latest" finds it
    path = checkpoint_dir(trainer, dirpath) / name
    trainer.save_checkpoint(path, weights_only=False)  # a full checkpoint: the run resumes from it
    if isinstance(io, ShardedCheckpointIO):
        io.wait()  # committed before the process goes
    trainer.strategy.barrier("commit_checkpoint")
    return path


def requeue(trainer: Trainer) -> None:
    """Under SLURM with Lightning's ``auto_requeue`` (the default), requeue this job (``scontrol requeue``):
    from global rank 0, before the process exits. Elsewhere nothing."""
    environment = cluster_environment(trainer)
    if not trainer.is_global_zero or not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return
    job = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    if not job:
        return
    result = subprocess.run(["scontrol", "requeue", job], check=False)
    if result.returncode != 0:
        rank_zero_warn(f"scontrol requeue {job} failed with exit code {result.returncode}.")
