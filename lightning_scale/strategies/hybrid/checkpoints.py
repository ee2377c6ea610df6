"""Checkpoints of ``HybridParallelStrategy``: sharded, every rank saving and loading only what it
holds (:class:`~lightning_scale.plugins.ShardedCheckpointIO`), resharding on load.

The state itself (DCP's sharded state dicts under the original names, tied weights once) is
:class:`lightning_scale.core.checkpoint.sharded_state.ShardedState`. Here: the IO plugin the strategy
needs, which checkpoint ``"latest"`` and an automatic resume mean, the manifest a save adds, and a
load of a whole-state file (``torch.save``, e.g. from a single-device run), memory-mapped so each
rank copies out its own shard.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lightning_scale.strategies.hybrid.collectives as collectives
from lightning_scale._lightning_compat import attached_trainer, should_accumulate, wrap_resume_start
from lightning_scale.core.checkpoint.format import read_manifest
from lightning_scale.core.checkpoint.full_state import load_full_model_state, load_full_optimizer_state
from lightning_scale.core.checkpoint.sharded_state import ShardedState
from lightning_scale.core.checkpoint.storage import RemotePath
from lightning_scale.core.checkpoint.ties import names_under
from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.integrations.huggingface import is_hf_model
from lightning_scale.plugins._rng import restore_rng_states
from lightning_scale.plugins.checkpoint_io import ShardedCheckpointIO, restarted

__all__ = ["ShardedCheckpoints", "sharded_state", "step_batch", "unwrapped_optimizer"]


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (others as they are)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def sharded_state(module: LightningModule, runner: PipelineRunner | None) -> ShardedState:
    """The sharded state of ``module`` as ``runner`` (``None``: no pipeline) cut it: a pipeline knows the
    names of each weight tied across its stages (a rank may hold one copy only)."""
    return ShardedState(module, names_under(module, runner.root, runner.tied_groups) if runner is not None else None)


class ShardedCheckpoints:
    """Saving and loading through the strategy's checkpoint IO plugin (``io``, as the strategy has it
    when asked: a user may set another one later), every rank taking part.

    State: ``resumed_by_latest``, the checkpoint ``"latest"`` (or an automatic resume) chose for the
    running ``fit``: loading it makes this run continue that checkpoint's run; ``resumed_manifest``, the
    manifest of the checkpoint the running ``fit`` resumed from, until :meth:`check_global_batch` read it.
    """

    def __init__(self) -> None:
        self.resumed_by_latest: str | None = None
        self.resumed_manifest: dict[str, Any] | None = None

    @staticmethod
    def sharded(io: CheckpointIO) -> ShardedCheckpointIO:
        """``io``; ``ValueError`` unless it writes sharded checkpoints."""
        if not isinstance(io, ShardedCheckpointIO):
            raise ValueError(
                f"HybridParallelStrategy saves and loads sharded checkpoints, with every rank writing its own part; "
                f"checkpoint_io={type(io).__name__} writes whole files from one rank. Use "
                "lightning_scale.plugins.ShardedCheckpointIO (the default; it has async saves and retention of its own)."
            )
        return io

    # ------------------------------------------------------------------ which checkpoint

    def install_path_resolver(self, trainer: Trainer) -> None:
        """``ckpt_path="latest"``, and ``ckpt_path=None`` after a restart (``auto_resume``), become the newest
        checkpoint that verifies. Lightning passes the path to ``resume_start`` only, so that is wrapped,
        once per Trainer; the path is resolved with the plugin its strategy has then."""
        self.sharded(trainer.strategy.checkpoint_io)
        wrap_resume_start(trainer, lambda path: self.resolve_ckpt_path(trainer, trainer.strategy.checkpoint_io, path))

    def resolve_ckpt_path(self, trainer: Trainer, checkpoint_io: CheckpointIO, path: Any) -> Any:
        """``"latest"`` (and an automatic resume): the checkpoint ``ShardedCheckpointIO.latest`` names.
        ``fit`` needs a full checkpoint; ``validate``/``test``/``predict`` may take a weights-only one.
        A fit that resumes this way continues the checkpoint's run (``ShardedCheckpointIO.continue_run``)."""
        io = self.sharded(checkpoint_io)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.resumed_by_latest = self.resumed_manifest = None  # (a fit that failed after its load left one)
        wanted = path == "latest" or (
            path is None
            and fitting
            and (io.auto_resume is True or (io.auto_resume == "on_restart" and _any_restarted(trainer)))
        )
        if not wanted:
            return path
        roots = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
        found = io.latest(roots, weights_only=not fitting)
        if found is not None and fitting:
            self.resumed_by_latest = str(found)
        if found is None:
            where = ", ".join(str(r) for r in io.search_roots(roots)) or "(no ModelCheckpoint dirpath, no dirpath)"
            if path == "latest":
                rank_zero_warn(f'ckpt_path="latest": no checkpoint that verifies in {where}; starting from scratch.')
            return None
        if path is None:
            rank_zero_info(f"Resuming from the latest checkpoint, {found} (auto_resume={io.auto_resume!r}).")
        return str(found)

    # ------------------------------------------------------------------ save

    def save(
        self,
        checkpoint_io: CheckpointIO,
        checkpoint: dict[str, Any],
        filepath: Any,
        state: ShardedState,
        *,
        layout: Layout,
        data_parallel_mode: str,
        storage_options: Any | None = None,
        data_parallel_sync: Mapping[str, Any] | None = None,
    ) -> None:
        """Every rank writes its own shards; the manifest records the layout, the wandb run, the tied
        weights (``state.groups()``: stored once under the first name; a whole-model load gives every
        name the tensor), a Hugging Face model's config, and ``storage_options`` (a mapping of JSON values)."""
        io = self.sharded(checkpoint_io)
        io.process_group = None
        module = state.module
        if _inside_accumulation_window(module):
            rank_zero_warn(
                f"Not saving {filepath}: the fit is inside a gradient-accumulation window, whose gradients no checkpoint "
                "holds (a resume would drop them, or, at another data-parallel size, be refused). Lightning's "
                "ModelCheckpoint asks for this after a resume with accumulate_grad_batches > 1 (it saves the resumed "
                "step again on the window's first micro-batch); that step's checkpoint exists already."
            )
            return
        manifest: dict[str, Any] = {
            "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "data_parallel_mode": data_parallel_mode},
            "wandb_run_id": _wandb_run_id(module),
            "tied": state.groups(),
            "huggingface": _huggingface(module),
            "batch": step_batch(attached_trainer(module), layout.dp),
        }
        if data_parallel_sync is not None:
            manifest["data_parallel_sync"] = dict(data_parallel_sync)
        if storage_options is not None:
            if not isinstance(storage_options, Mapping):
                raise TypeError(
                    f"storage_options={storage_options!r}: HybridParallelStrategy stores a mapping of JSON values in the "
                    "checkpoint's manifest (under 'storage_options'); pass a dict or None."
                )
            manifest["storage_options"] = dict(storage_options)
        io.save_checkpoint(checkpoint, filepath, storage_options=manifest)

    # ------------------------------------------------------------------ load

    def load(
        self,
        checkpoint_io: CheckpointIO,
        checkpoint_path: Any,
        weights_only: bool | None,
        state: ShardedState,
        optimizers: list[Any],
        *,
        layout: Layout,
        world_size: int,
        strategy_state: Callable[[Mapping[str, Any], bool], dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A whole-state file (``torch.save``, local or at a URL) as it is, or a sharded checkpoint into
        what this rank holds: ``state``'s module (a LightningModule, loaded as strictly as it asks) and,
        for ``fit``, ``optimizers``' states, reshaped as this rank holds them. ``strategy_state(manifest,
        fitting)``: the strategy's own entries to load besides (``{}``: none), or a ``ValueError``."""
        io = self.sharded(checkpoint_io)
        whole = self._load_file(io, checkpoint_path, weights_only)
        if whole is not None:
            return whole
        module, trainer = state.module, attached_trainer(state.module)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        template: dict[str, Any] = {"state_dict": state.model_state()}
        if fitting and optimizers:
            template["optimizer_states"] = [state.optimizer_state(o) for o in optimizers]
        if strategy_state is not None:
            own = strategy_state(read_manifest(io.as_path(checkpoint_path)), fitting)
            if own:
                template["strategy_state"] = own
        at = {"layout": layout, "world_size": world_size}
        return self._load_sharded(io, checkpoint_path, template, strict=module.strict_loading, fitting=fitting, **at)

    @staticmethod
    def _load_file(io: ShardedCheckpointIO, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """A whole-state file, loaded on every rank; ``None`` for a sharded checkpoint (a directory)."""
        path = io.as_path(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
        if isinstance(path, RemotePath) and path.is_file():
            with path.open("rb") as f:
                return torch.load(f, map_location="cpu", weights_only=weights_only)
        if isinstance(path, Path) and path.is_file():
            # Memory-mapped, so each rank reads only the pages it keeps.
            if zipfile.is_zipfile(path):
                return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        return None

    def _load_sharded(
        self,
        io: ShardedCheckpointIO,
        checkpoint_path: Any,
        template: dict[str, Any],
        *,
        strict: bool,
        fitting: bool,
        layout: Layout,
        world_size: int,
    ) -> dict[str, Any]:
        """A ``fit`` records where it resumed from; random-number states are restored at the saving layout only."""
        io.process_group = None
        checkpoint = io.load_checkpoint(checkpoint_path, template=template, strict=strict)
        info = checkpoint["lightning_scale"]
        if fitting:
            self.resumed_manifest = info["manifest"]
            io.resumed_from = io.as_path(info["path"])
            if self.resumed_by_latest == info["path"]:
                io.continue_run(info["manifest"])
        _restore_rng(info, layout, world_size)
        return checkpoint

    @staticmethod
    def load_model_state(state: ShardedState, checkpoint: Mapping[str, Any], *, strict: bool, partial: bool) -> None:
        """The checkpoint's model state into ``state.module``: a whole-state file's (each rank copying out
        what it holds), or a sharded checkpoint's. ``partial``: a pipeline stage takes the entries it holds."""
        if "lightning_scale" not in checkpoint:
            load_full_model_state(state.module, checkpoint["state_dict"], strict=strict, partial=partial)
        else:
            state.load_model_state(checkpoint["state_dict"], strict=strict, partial=partial)

    @staticmethod
    def load_optimizer_states(
        state: ShardedState, optimizers: list[Any], checkpoint: Mapping[str, Any], *, partial: bool
    ) -> None:
        """The checkpoint's optimizer states into ``optimizers`` (in order), as :meth:`load_model_state`."""
        states = checkpoint["optimizer_states"]
        if "lightning_scale" not in checkpoint:
            for optimizer, saved in zip(optimizers, states, strict=True):
                load_full_optimizer_state(state.module, optimizer, saved, partial=partial)
            return
        if len(states) != len(optimizers):
            raise ValueError(
                f"The checkpoint has {len(states)} optimizer states and configure_optimizers built {len(optimizers)}."
            )
        for optimizer, saved in zip(optimizers, states):
            state.load_optimizer_state(optimizer, saved)

    def check_global_batch(self, trainer: Trainer, dp: int, policy: str) -> None:
        """At the start of a ``fit`` resumed from a checkpoint saved at another data-parallel size: the same
        samples per optimizer step as the saved run, or ``ValueError`` (``policy="refuse"``; every rank alike,
        from the same figures) or a warning (``"allow"``). A loader whose batch size cannot be read is warned of."""
        manifest, self.resumed_manifest = self.resumed_manifest or {}, None
        layout = manifest.get("layout")
        saved_dp = layout.get("dp") if isinstance(layout, Mapping) else None
        if type(saved_dp) is not int or saved_dp == dp:
            return
        saved, now = _recorded(manifest.get("batch")), step_batch(trainer, dp)
        differs = saved is not None and now is not None and now["samples"] != saved["samples"]
        # Decided alike on every rank (a loader whose batch differs between ranks must not stop some of them only).
        anywhere = bool(
            collectives.reduce(
                torch.tensor([int(differs)], device=trainer.strategy.root_device), reduce_op="max"
            ).item()
        )
        if anywhere and not differs and policy == "refuse":
            raise ValueError(
                "This fit resumes a checkpoint saved at another data-parallel size, and another rank's training loader "
                "makes an optimizer step of another number of samples than the checkpoint's run: see that rank's error."
            )
        if saved is None or now is None:
            rank_zero_warn(
                f"This fit resumes a checkpoint saved at data_parallel={saved_dp} at data_parallel={dp}, and whether an "
                "optimizer step still trains on as many samples cannot be told: "
                + (
                    "the checkpoint does not record it (saved by an older version, or from a loader without an integer "
                    "batch_size)."
                    if saved is None
                    else "the training loader has no integer batch_size."
                )
                + " Check that loader batch x data-parallel ranks x accumulate_grad_batches is what it was."
            )
            return
        if not differs:
            return
        message = (
            f"This fit resumes a checkpoint whose optimizer steps trained on {_describe(saved)}; at data_parallel={dp} this "
            f"fit's would train on {_describe(now)}: another global batch, so it would not continue that run "
            f"as one process would. {_keeping(saved['samples'], now)}lightning_scale.data.TextDataModule(global_batch_size=..., "
            "micro_batch_size=...) keeps it at every size by itself. To train on with the new global batch, pass "
            "HybridParallelStrategy(global_batch_change='allow')."
        )
        if policy == "refuse":
            raise ValueError(message)
        rank_zero_warn(message)


def step_batch(trainer: Trainer | None, dp: int) -> dict[str, int] | None:
    """What an optimizer step of the running ``fit`` trains on: the training loader's ``batch_size`` (per
    data-parallel rank) x ``dp`` x ``accumulate_grad_batches``; ``None`` outside a fit, or for a loader without an
    integer ``batch_size`` (a ``batch_sampler`` of its own, several loaders)."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    batch = getattr(trainer.train_dataloader, "batch_size", None)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        return None
    accumulate = int(trainer.accumulate_grad_batches)
    for callback in trainer.callbacks:  # its epoch's value, which it sets only when the epoch starts
        if isinstance(callback, GradientAccumulationScheduler):
            accumulate = int(callback.get_accumulate_grad_batches(trainer.current_epoch))
    return {
        "loader_batch": batch,
        "data_parallel": dp,
        "accumulate_grad_batches": accumulate,
        "samples": batch * dp * accumulate,
    }


def _recorded(batch: Any) -> dict[str, int] | None:
    """A manifest's ``batch`` as :func:`step_batch` wrote it, else ``None`` (nothing read from a file is trusted)."""
    keys = ("loader_batch", "data_parallel", "accumulate_grad_batches", "samples")
    if not isinstance(batch, Mapping) or not all(type(batch.get(k)) is int and batch[k] >= 1 for k in keys):
        return None
    return {k: batch[k] for k in keys}


def _describe(batch: Mapping[str, int]) -> str:
    return (
        f"{batch['samples']} samples ({batch['loader_batch']} per loader batch x data_parallel={batch['data_parallel']} "
        f"x accumulate_grad_batches={batch['accumulate_grad_batches']})"
    )


def _keeping(samples: int, now: Mapping[str, int]) -> str:
    """The settings that give ``samples`` per optimizer step at this run's data-parallel size."""
    ways = []
    per_rank = now["loader_batch"] * now["data_parallel"]
    if samples % per_rank == 0:
        ways.append(f"Trainer(accumulate_grad_batches={samples // per_rank})")
    if samples % (now["data_parallel"] * now["accumulate_grad_batches"]) == 0:
        ways.append(f"a loader batch_size of {samples // (now['data_parallel'] * now['accumulate_grad_batches'])}")
    return f"Keep {samples} samples a step with {' or '.join(ways)}. " if ways else ""


def _inside_accumulation_window(module: LightningModule) -> bool:
    trainer = attached_trainer(module)
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING and should_accumulate(trainer)


def _any_restarted(trainer: Trainer) -> bool:
    """Whether any rank is a relaunch (collective: every rank must take the same path into ``latest``). Under an
    elastic launch a node that joins (again) starts its workers with ``TORCHELASTIC_RESTART_COUNT=0`` while the
    others count their restarts."""
    flag = torch.tensor([int(restarted())], device=trainer.strategy.root_device)
    return bool(collectives.reduce(flag, reduce_op="max").item())


def _restore_rng(info: Mapping[str, Any], layout: Layout, world_size: int) -> None:
    saved = info["manifest"].get("layout", {})
    here = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    same = {k: saved.get(k) for k in here} == here and info["manifest"].get("world_size") == world_size
    if same and info.get("rng") is not None:
        restore_rng_states(info["rng"])
    elif not same:
        rank_zero_info(
            f"The checkpoint was saved at {saved}; this run is {here}: random-number states are not restored "
            "(each rank keeps its own seed)."
        )


def _huggingface(module: LightningModule) -> dict[str, Any] | None:
    """The Hugging Face model inside ``module`` (its name, class and config), for ``consolidate`` to write HF files."""
    for name, sub in module.named_modules():
        if is_hf_model(sub):
            return {"prefix": name, "class": type(sub).__name__, "config": json.loads(sub.config.to_json_string())}
    return None


def _wandb_run_id(module: LightningModule) -> str | None:
    for logger in getattr(attached_trainer(module), "loggers", None) or []:
        if type(logger).__name__ == "WandbLogger":
            run_id = logger.version  # the run's id once it started, else the one it was given
            return str(run_id) if run_id else None
    return None
