"""Lightning's checkpoint hooks of ``HybridParallelStrategy``: sharded, every rank saving and loading
only what it holds (:class:`~lightning_scale.plugins.ShardedCheckpointIO`), resharding on load.

The state handed to Lightning (``lightning_module_state_dict``, ``optimizer_state``) is DCP's
sharded state dict under the original parameter names: DTensor shards, this rank's pipeline stage,
no gather. A weight tied across pipeline stages (a GPT's embedding and output head) is stored once
under its first name and loaded into every copy. A checkpoint *file* (``torch.save``, e.g. from a
single-device run) still loads: memory-mapped, each rank copying out its own shard.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_scale.core.checkpoint.full_state import load_full_model_state, load_full_optimizer_state
from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.checkpoint.storage import RemotePath
from lightning_scale.plugins._rng import restore_rng_states
from lightning_scale.plugins.checkpoint_io import ShardedCheckpointIO, restarted

__all__ = ["ShardedCheckpoints"]

_SHARDED = StateDictOptions(full_state_dict=False)
_RESOLVER = "_lightning_scale_resolves_ckpt_path"


def _storage(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr(), tuple(tensor.shape)


class ShardedCheckpoints:
    """Mixin for ``HybridParallelStrategy``: every rank takes part in every save and load."""

    layout: Layout
    device_mesh: DeviceMesh
    lightning_module: LightningModule
    model: Any
    optimizers: list[Any]
    _checkpoint_io: CheckpointIO | None
    _pipeline: Any
    options: Any
    global_rank: int
    world_size: int
    _resumed_by_latest: str | None = None  # the checkpoint "latest" chose for fit: this run continues its run

    # ------------------------------------------------------------------ the IO plugin

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _sharded_io(self) -> ShardedCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, ShardedCheckpointIO):
            raise ValueError(
                f"HybridParallelStrategy saves and loads sharded checkpoints, with every rank writing its own part; "
                f"checkpoint_io={type(io).__name__} writes whole files from one rank. Use "
                "lightning_scale.plugins.ShardedCheckpointIO (the default; it has async saves and retention of its own)."
            )
        return io

    def _install_checkpoint_path_resolver(self, trainer: Trainer) -> None:
        """``ckpt_path="latest"``, and ``ckpt_path=None`` after a restart (``auto_resume``), become the newest
        checkpoint that verifies. Lightning passes the path to ``resume_start`` only, so that is wrapped,
        once per Trainer."""
        self._sharded_io()
        connector = trainer._checkpoint_connector
        if getattr(connector, _RESOLVER, False):
            return
        original = connector.resume_start
        strategy = self

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            return original(strategy._resolve_ckpt_path(trainer, checkpoint_path), weights_only=weights_only)

        connector.resume_start = resume_start
        setattr(connector, _RESOLVER, True)

    def _add_preemption_checkpoint(self, trainer: Trainer) -> None:
        """A ``PreemptionCheckpoint`` for a ``fit`` that has none (``ShardedCheckpointIO(preemption=False)``: never)."""
        from lightning_scale.callbacks.preemption import PreemptionCheckpoint

        if self._sharded_io().preemption and not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())

    def _resolve_ckpt_path(self, trainer: Trainer, path: Any) -> Any:
        """``"latest"`` (and an automatic resume): the checkpoint ``ShardedCheckpointIO.latest`` names.
        ``fit`` needs a full checkpoint; ``validate``/``test``/``predict`` may take a weights-only one.
        A fit that resumes this way continues the checkpoint's run (``ShardedCheckpointIO.continue_run``)."""
        io = self._sharded_io()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._resumed_by_latest = None
        wanted = path == "latest" or (
            path is None and fitting and (io.auto_resume is True or (io.auto_resume == "on_restart" and restarted()))
        )
        if not wanted:
            return path
        roots = [getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks]
        found = io.latest(roots, weights_only=not fitting)
        if found is not None and fitting:
            self._resumed_by_latest = str(found)
        if found is None:
            where = ", ".join(str(r) for r in io.search_roots(roots)) or "(no ModelCheckpoint dirpath, no dirpath)"
            if path == "latest":
                rank_zero_warn(f'ckpt_path="latest": no checkpoint that verifies in {where}; starting from scratch.')
            return None
        if path is None:
            rank_zero_info(f"Resuming from the latest checkpoint, {found} (auto_resume={io.auto_resume!r}).")
        return str(found)

    # ------------------------------------------------------------------ state handed to Lightning

    def _tied_aliases(self, state: Mapping[str, Any]) -> dict[str, str]:
        """``{name: canonical name}`` for every entry of ``state`` that is a copy of a tied weight
        stored under another (its first) name."""
        aliases: dict[str, str] = {}
        if self._pipeline is not None:
            for names in self._pipeline_tied_groups():
                aliases.update({n: names[0] for n in names[1:] if n in state})
            return aliases
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                key = _storage(value)
                if key in first:
                    aliases[name] = first[key]
                else:
                    first[key] = name
        return aliases

    def _live_state(self) -> dict[str, Any]:
        """This rank's model state under the original names (wrappers' prefixes removed), no copies."""
        return get_model_state_dict(self.lightning_module, options=_SHARDED)

    def _pipeline_tied_groups(self) -> list[list[str]]:
        """The pipeline's tied weights under the LightningModule's names (the pipeline knows its root's)."""
        root = self._pipeline.root
        prefix = next((n for n, m in self.lightning_module.named_modules() if m is root), "")
        return [[f"{prefix}.{n}" if prefix else n for n in names] for names in self._pipeline.tied_groups]

    def _tied_groups(self) -> list[list[str]]:
        if self._pipeline is not None:
            return self._pipeline_tied_groups()
        groups: dict[str, list[str]] = {}
        for name, canonical in self._tied_aliases(self._live_state()).items():
            groups.setdefault(canonical, [canonical]).append(name)
        return list(groups.values())

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self._live_state()
        aliases = self._tied_aliases(state)
        return {aliases.get(k, k): v for k, v in state.items()}

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = get_optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), options=_SHARDED)
        # DCP names a shared parameter by one of its names (which one depends on the wrapping): the canonical one here.
        aliases = {n: names[0] for names in self._tied_groups() for n in names[1:]}
        return _rename_optimizer(state, aliases) if aliases else state

    # ------------------------------------------------------------------ save

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its own shards (Lightning's base class writes on rank 0 only)."""
        io = self._sharded_io()
        io.process_group = None
        layout = self.layout
        manifest: dict[str, Any] = {
            "layout": {
                "dp": layout.dp,
                "tp": layout.tp,
                "pp": layout.pp,
                "data_parallel_mode": self.options.data_parallel_mode,
            },
            "wandb_run_id": _wandb_run_id(self.lightning_module),
            # Stored once under the first name; a whole-model load gives every name the tensor.
            "tied": self._tied_groups(),
            "huggingface": _huggingface(self.lightning_module),
        }
        if storage_options is not None:
            if not isinstance(storage_options, Mapping):
                raise TypeError(
                    f"storage_options={storage_options!r}: HybridParallelStrategy stores a mapping of JSON values in the "
                    "checkpoint's manifest (under 'storage_options'); pass a dict or None."
                )
            manifest["storage_options"] = dict(storage_options)
        io.save_checkpoint(checkpoint, filepath, storage_options=manifest)

    # ------------------------------------------------------------------ load

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        io = self._sharded_io()
        path = io.as_path(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
        if isinstance(path, RemotePath) and path.is_file():
            with path.open("rb") as f:  # a whole-state file at a URL
                return torch.load(f, map_location="cpu", weights_only=weights_only)
        if isinstance(path, Path) and path.is_file():
            # A whole-state file (torch.save): memory-mapped, so each rank reads only the pages it keeps.
            if zipfile.is_zipfile(path):
                return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        io.process_group = None
        module = self.lightning_module
        template: dict[str, Any] = {"state_dict": self.lightning_module_state_dict()}
        trainer = module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and self.optimizers:
            template["optimizer_states"] = [self.optimizer_state(o) for o in self.optimizers]
        checkpoint = io.load_checkpoint(checkpoint_path, template=template, strict=module.strict_loading)
        info = checkpoint["lightning_scale"]
        if fitting:
            io.resumed_from = io.as_path(info["path"])
            if self._resumed_by_latest == info["path"]:
                io.continue_run(info["manifest"])
        self._restore_rng(info)
        return checkpoint

    def _restore_rng(self, info: Mapping[str, Any]) -> None:
        saved = info["manifest"].get("layout", {})
        here = {"dp": self.layout.dp, "tp": self.layout.tp, "pp": self.layout.pp}
        same = {k: saved.get(k) for k in here} == here and info["manifest"].get("world_size") == self.world_size
        if same and info.get("rng") is not None:
            restore_rng_states(info["rng"])
        elif not same:
            rank_zero_info(
                f"The checkpoint was saved at {saved}; this run is {here}: random-number states are not restored "
                "(each rank keeps its own seed)."
            )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "lightning_scale" not in checkpoint:
            load_full_model_state(
                self.lightning_module, checkpoint["state_dict"], strict=strict, partial=self.layout.pp > 1
            )
            return
        module = self.lightning_module
        state = dict(checkpoint["state_dict"])
        # Every local name of a tied weight takes the canonical entry.
        live = self._live_state()
        for name, canonical in self._tied_aliases(live).items():
            if canonical in state:
                state[name] = state[canonical]
        state = {k: v for k, v in state.items() if k in live} if self.layout.pp > 1 or not strict else state
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=False, strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if "lightning_scale" not in checkpoint:
            for optimizer, state in zip(self.optimizers, states, strict=True):
                load_full_optimizer_state(
                    self.lightning_module, getattr(optimizer, "_optimizer", optimizer), state, partial=self.layout.pp > 1
                )
            return
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint has {len(states)} optimizer states and configure_optimizers built {len(self.optimizers)}."
            )
        groups = self._tied_groups()
        for optimizer, state in zip(self.optimizers, states):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            if groups:
                # Back to the name DCP gives this rank's copy of each tied weight.
                live = get_optimizer_state_dict(self.lightning_module, optimizer, options=_SHARDED)
                used = {n for g in live["param_groups"] for n in g["params"]}
                reverse = {names[0]: n for names in groups for n in names[1:] if n in used}
                state = _rename_optimizer(state, reverse)
            set_optimizer_state_dict(self.lightning_module, optimizer, state, options=_SHARDED)


def elastic_attempt_store(world_size: int, timeout: Any) -> Any:
    """Under torchrun, the process group's store for this attempt: the agent's store, with a prefix per restart.

    torchrun keeps one store (``MASTER_PORT``) across ``--max-restarts`` relaunches and, with its agent
    store, adds no per-attempt prefix: a relaunched rank can read the address a dead rank of the previous
    attempt published and fail to connect (gloo: "Connection refused"). ``None`` outside torchrun.
    """
    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, **kwargs
    )
    return dist.PrefixStore(f"lightning_scale/attempt_{restart}", store)


def _rename_optimizer(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    return {
        "state": {names.get(k, k): v for k, v in state["state"].items()},
        "param_groups": [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in state["param_groups"]],
    }


def _huggingface(module: LightningModule) -> dict[str, Any] | None:
    """The Hugging Face model inside ``module`` (its name, class and config), for ``consolidate`` to write HF files."""
    import json

    from lightning_scale.integrations.huggingface import is_hf_model

    for name, sub in module.named_modules():
        if is_hf_model(sub):
            return {"prefix": name, "class": type(sub).__name__, "config": json.loads(sub.config.to_json_string())}
    return None


def _wandb_run_id(module: LightningModule) -> str | None:
    trainer = module._trainer
    for logger in getattr(trainer, "loggers", None) or []:
        if type(logger).__name__ == "WandbLogger":
            experiment = getattr(logger, "_experiment", None)
            run_id = getattr(experiment, "id", None) or getattr(logger, "_id", None)
            return str(run_id) if run_id else None
    return None
