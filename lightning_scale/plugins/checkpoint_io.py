"""``ShardedCheckpointIO``: Lightning checkpoints that every rank writes and reads its own part of.

A checkpoint is a directory (``../shared/DESIGN.md``): DCP shard files with every tensor of the
model, the optimizers and the rest of the training state; ``trainer_state.json`` (rank 0: loops,
callbacks, LR schedulers, precision scaler, hyper-parameters, optimizer hyper-parameters, the
rest of what ``on_save_checkpoint`` hooks added); ``rank-NNNNN.json`` (every rank's random-number
states); and ``manifest.json``, written last, that makes it a checkpoint. See
:class:`ShardedCheckpointIO`.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from torch import Tensor
from typing_extensions import override

from lightning_scale.core.checkpoint.checksums import DEFAULT_CHECKSUM, check_checksum
from lightning_scale.core.checkpoint.format import retained
from lightning_scale.core.checkpoint.latest import first_that_verifies
from lightning_scale.core.checkpoint.sharded import StagingWriter, save_sharded, verify_distributed
from lightning_scale.core.checkpoint.storage import AnyPath, as_path
from lightning_scale.core.checks import check_positive_int
from lightning_scale.core.parallel.groups import distributed
from lightning_scale.plugins._checkpoint_layout import (
    EXTRA,
    TRAINER_STATE,
    add_optimizer_layout,
    json_bytes,
    optimizer_layout,
    split_checkpoint,
    versions,
)
from lightning_scale.plugins._checkpoint_load import (
    load_from_checkpoint,
    load_full_checkpoint,
    load_into,
    rank_file,
    read_whole,
)
from lightning_scale.plugins._checkpoint_selection import (
    candidates,
    new_run_id,
    prune,
    remove_dir,
    restarted,
    run_id_from_environment,
)
from lightning_scale.plugins._rng import collect_rng_states

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "ShardedCheckpointIO",
    "load_from_checkpoint",
    "load_full_checkpoint",
    "restarted",
]

PREEMPTION_EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM
# The other statuses a relaunch reads: HANG_EXIT_CODE = 75 (core.resilience.watchdog: a training step stalled),
# STRAGGLER_EXIT_CODE = 76 (core.resilience.stragglers: a rank stayed slow; restart without its host).
_AUTO_RESUME = (True, False, "on_restart")


class ShardedCheckpointIO(CheckpointIO):
    """Checkpoints as directories that every rank writes its own shards into, committed atomically.

    Used by :class:`~lightning_scale.strategies.HybridParallelStrategy` (its default
    ``checkpoint_io``): Lightning's ``ModelCheckpoint``, ``trainer.save_checkpoint(path)`` and
    ``Trainer.fit(ckpt_path=...)`` work as ever, with a directory in place of each ``.ckpt`` file.
    Every rank takes part in each save and load (the strategy calls this on every rank), writing
    and reading only what it holds; a checkpoint saved at one layout loads at any other.

    Args:
        keep_last: after each save, delete all but the newest ``keep_last`` of this run's checkpoints
            in the same directory (None: keep everything; ``ModelCheckpoint(save_top_k=...)`` still
            applies). Another run's checkpoints there are never deleted.
        keep_every: with ``keep_last``, also keep every checkpoint whose step is a multiple of it.
            The checkpoint the run resumed from is never deleted, nor the run's newest full one.
        auto_resume: when ``Trainer.fit`` gets no ``ckpt_path``, resume from ``"latest"`` (in the
            ``ModelCheckpoint`` directories and ``dirpath``: this run's newest full checkpoint that
            verifies, else the newest of the run that saved most recently):
            ``"on_restart"`` (default) when the process is a relaunch (torchrun ``--max-restarts``,
            a requeued SLURM job), ``True`` always, ``False`` never.
        run_id: the id every manifest records as this run's (``"latest"`` and retention go by it);
            default: the launcher's job id (torchrun ``--rdzv-id``, SLURM's job id), which restarts
            keep, else a new id per process. A fit resumed through ``"latest"`` continues the
            checkpoint's run: retention then counts that run's checkpoints as this one's.
        dirpath: another directory ``"latest"`` looks in (where a preemption checkpoint goes when
            there is no ``ModelCheckpoint``).
        async_save: ``save_checkpoint`` returns once this rank's tensors are copied into host buffers
            (reused from one save to the next while the tensors keep their shapes and dtypes; on CUDA
            pinned, and filled by non-blocking copies on a side stream that the compute stream, not the
            host, waits for: :class:`~lightning_scale.core.checkpoint.host_staging.HostStager`); DCP
            writes them, and the manifest and rename commit them, in a background thread whose
            collectives run on a process group of their own (gloo), so training goes on meanwhile. One
            save is in flight at a time: the next save, a load and teardown wait for it, and raise what
            it raised. With ``ModelCheckpoint``, prefer ``save_last="link"`` (a second save of the same
            step would wait for the first).
        preemption: add a :class:`~lightning_scale.callbacks.PreemptionCheckpoint` to every ``fit``
            that has none (SIGTERM/SIGUSR1: finish the step, commit a checkpoint, exit with
            :data:`PREEMPTION_EXIT_CODE`).
        thread_count: writer threads, and so shard files, per rank (DCP ``FileSystemWriter``). Saves
            and loads hash a rank's files side by side, one checksum stream per file, and read or
            write two files at once, so 2 (default) is faster than one file would be.
        checksum: the manifest's checksum of every file, ``"crc32"`` (default; zlib's CRC-32, about
            3 GB/s per core) or ``"sha256"`` (about 1.4 GB/s, and a digest that resists tampering
            where the manifest itself is trusted). Either loads whatever a checkpoint was saved with.
        metadata: JSON values stored in every manifest (``metadata`` key), e.g. a run name.
        fsspec_options: options for fsspec's ``url_to_fs`` when checkpoints go to a URL
            (``ModelCheckpoint(dirpath="s3://bucket/run")``): credentials, endpoint, ...

    Remote storage: any fsspec URL works once its filesystem package is installed (``s3fs``,
    ``gcsfs``, ...). Object stores cannot rename a directory, so there a checkpoint is written in
    place and its manifest, one object written last, commits it; a directory without it is not a
    checkpoint. Saving again under the same name (``last``) deletes the old one first.

    Loading runs no code a checkpoint chose and reads only what its manifest vouches for:
    non-tensor state is JSON (:mod:`lightning_scale.core.checkpoint.state`), DCP's own metadata is
    read by an unpickler that resolves only DCP's classes (:mod:`lightning_scale.core.checkpoint.dcp_metadata`),
    a pickled item is refused, and every file read must be listed in the manifest, with its checksum,
    inside the checkpoint directory.
    """

    def __init__(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        auto_resume: bool | Literal["on_restart"] = "on_restart",
        dirpath: str | os.PathLike | None = None,
        async_save: bool = False,
        preemption: bool = True,
        thread_count: int = 2,
        checksum: str = DEFAULT_CHECKSUM,
        metadata: Mapping[str, Any] | None = None,
        fsspec_options: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ) -> None:
        if keep_last is not None:
            retained([], keep_last=keep_last, keep_every=keep_every)  # validates both
        elif keep_every is not None:
            raise ValueError(f"keep_every={keep_every!r} needs keep_last (how many of the newest to keep) as well.")
        if auto_resume not in _AUTO_RESUME or not isinstance(auto_resume, (bool, str)):
            raise ValueError(f"auto_resume={auto_resume!r} must be one of {_AUTO_RESUME}.")
        check_positive_int(
            "thread_count", thread_count, fix="It is the number of threads writing a rank's shard files."
        )
        if metadata is not None:
            try:
                json.dumps(dict(metadata))
            except TypeError as err:
                raise TypeError(f"metadata must hold JSON values only: {err}") from None
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise TypeError(f"run_id={run_id!r} must be a non-empty string (or None: the launcher's job id).")
        if fsspec_options is not None and not isinstance(fsspec_options, Mapping):
            raise TypeError(f"fsspec_options={fsspec_options!r} must be a mapping (fsspec's storage options) or None.")
        self.fsspec_options = dict(fsspec_options or {})
        self.run_id: str = run_id or run_id_from_environment() or new_run_id()
        """What this run's manifests record as its id (rank 0's is the one written and compared)."""
        self.lineage: list[str] = []
        """The earlier runs this one continues (it resumed one of their checkpoints through ``"latest"``):
        retention counts their checkpoints as this run's."""
        self.keep_last, self.keep_every = keep_last, keep_every
        self.auto_resume = auto_resume
        self.dirpath = self.as_path(dirpath) if dirpath is not None else None
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save={async_save!r} must be True or False.")
        self.async_save = async_save
        self.preemption = bool(preemption)
        self.thread_count = thread_count
        self.checksum = check_checksum(checksum)
        self.metadata = dict(metadata or {})
        self._writer: StagingWriter | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._async_group: Any = None
        self._just_verified: str | None = None  # what `latest` verified, so the load that follows hashes nothing again
        self.process_group: dist.ProcessGroup | None = None
        """The processes that save and load together (None: the world); the strategy sets it."""
        self.resumed_from: AnyPath | None = None
        """The checkpoint this run loaded; retention and removal never delete it."""

    def as_path(self, path: Any) -> AnyPath:
        """``path`` as a local ``Path`` or, for a URL, a :class:`~lightning_scale.core.checkpoint.storage.RemotePath`."""
        return as_path(path, self.fsspec_options)

    # ------------------------------------------------------------------ collectives

    def _broadcast(self, obj: Any) -> Any:
        if not distributed(self.process_group):
            return obj
        box = [obj]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if distributed(self.process_group) else 0

    # ------------------------------------------------------------------ save

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Every rank: write ``checkpoint`` as the directory ``path`` (rank 0's path is used).

        ``checkpoint["state_dict"]`` holds this rank's tensors (DTensor shards, its pipeline stage)
        and ``checkpoint["optimizer_states"]`` DCP's per-parameter-name optimizer state dicts, as
        :class:`HybridParallelStrategy` gives them. ``storage_options``: a mapping of JSON values
        stored in the manifest (the strategy passes the layout)."""
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                f"storage_options must be a mapping of JSON values for the manifest, got {type(storage_options).__name__}."
            )
        self.wait()  # one save in flight at most; raises what the previous one raised
        path, token = self._broadcast((str(path), uuid.uuid4().hex[:12]))
        path = self.as_path(path)
        if path.is_file() or path.is_symlink():
            raise FileExistsError(
                f"{path} exists and is a file or link, not a checkpoint directory; remove it or save elsewhere."
            )
        rank = self._rank()
        try:
            tensors, doc, problem = *split_checkpoint(checkpoint, rank), ""
        except TypeError as err:
            tensors, doc, problem = {}, None, f"rank {rank}: {err}"
        parts: list[Any] = [(problem, optimizer_layout(checkpoint))]
        if distributed(self.process_group):
            # Every rank learns of a state that cannot be saved before any rank enters DCP's collectives;
            # rank 0 learns every rank's parameter order (a pipeline stage holds only its own).
            parts = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(parts, (problem, optimizer_layout(checkpoint)), group=self.process_group)
        problem = next((p for p, _ in parts if p), "")
        if problem:
            raise TypeError(problem)
        add_optimizer_layout(doc, [layout for _, layout in parts])
        files = {rank_file(rank): json_bytes({"rank": rank, "rng": collect_rng_states()})}
        if rank == 0:
            files[TRAINER_STATE] = json_bytes(doc)
        metadata = {
            "global_step": int(checkpoint.get("global_step", 0)),
            "epoch": int(checkpoint.get("epoch", 0)),
            "world_size": dist.get_world_size(self.process_group) if distributed(self.process_group) else 1,
            "versions": versions(checkpoint),
            "run_id": self.run_id,
            "continues": self.lineage,
            # Lightning leaves the optimizers out of a weights-only save: such a checkpoint cannot resume fit.
            "weights_only": "optimizer_states" not in checkpoint,
            **dict(storage_options or {}),
            "metadata": self.metadata,
        }
        if not self.async_save:
            self._write(path, tensors, files, metadata, token, self.process_group, None)
            return
        if self._writer is None:
            self._writer = StagingWriter(thread_count=self.thread_count, checksum=self.checksum)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lightning-scale-checkpoint")
            if distributed(self.process_group):
                # Collective, once: every rank makes its first async save together.
                ranks = dist.get_process_group_ranks(self.process_group) if self.process_group is not None else None
                self._async_group = dist.new_group(ranks=ranks, backend="gloo")
        # The snapshot: the model's and optimizers' tensors into the reused host buffers, the rest
        # (small, and keyed by names that change from save to save) cloned.
        big = {k: v for k, v in tensors.items() if not k.startswith(f"{EXTRA}/")}
        staged = self._writer.stage(big)
        staged.update({k: v.detach().clone() for k, v in tensors.items() if k.startswith(f"{EXTRA}/")})
        assert self._executor is not None
        self._pending = self._executor.submit(
            self._write, path, staged, files, metadata, token, self._async_group, self._writer
        )

    def _write(
        self,
        path: AnyPath,
        tensors: Mapping[str, Tensor],
        files: Mapping[str, bytes],
        metadata: Mapping[str, Any],
        token: str,
        group: Any,
        writer: StagingWriter | None,
    ) -> None:
        if writer is not None:  # an async save: its device-to-host copies may still be under way (CUDA)
            writer.synchronize_staging()
        save_sharded(
            path,
            tensors,
            files=files,
            metadata=metadata,
            token=token,
            group=group,
            thread_count=self.thread_count,
            writer=writer,
            checksum=self.checksum,
        )
        if self.keep_last is not None and self._rank() == 0:
            self.apply_retention(path.parent)
        if distributed(group):
            dist.barrier(group=group)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def apply_retention(self, root: AnyPath) -> list[AnyPath]:
        """Delete this run's checkpoints in ``root`` beyond ``keep_last``/``keep_every`` (rank 0 only);
        returns them. Another run's, the resumed-from and the run's newest full checkpoint are kept."""
        assert self.keep_last is not None
        protect = [self.resumed_from] if self.resumed_from is not None else []
        runs = {self.run_id, *self.lineage}
        return prune(root, run_ids=runs, keep_last=self.keep_last, keep_every=self.keep_every, protect=protect)

    def continue_run(self, manifest: Mapping[str, Any]) -> None:
        """This run resumed the checkpoint of ``manifest`` through ``"latest"``: it continues that
        checkpoint's run (and the runs that one continued), whose checkpoints retention now counts."""
        earlier = [manifest.get("run_id"), *(manifest.get("continues") or [])]
        self.lineage = list(dict.fromkeys(r for r in earlier if isinstance(r, str) and r and r != self.run_id))

    # ------------------------------------------------------------------ load

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        template: Mapping[str, Any] | None = None,
        strict: bool = True,
        verified: bool = False,
    ) -> dict[str, Any]:
        """The Lightning checkpoint dict of the directory ``path``, verified first.

        ``template``: ``{"state_dict": {...}, "optimizer_states": [...]}`` with this rank's tensors in
        the structure :meth:`save_checkpoint` took; they are loaded in place from whatever layout the
        checkpoint has, and the returned dict holds them. Without one (a single process reading a
        checkpoint), every tensor comes back whole on the CPU. ``strict``: every template tensor
        must be in the checkpoint. Collective when a process group is set.
        """
        self.wait()
        if template is None:  # one process reading a checkpoint whole: no collectives
            return read_whole(self.as_path(path), verified=verified)
        path = self.as_path(self._broadcast(str(path)))
        check = not verified and str(path) != self._just_verified
        self._just_verified = None
        return load_into(path, template, group=self.process_group, strict=strict, verified=not check)

    # ------------------------------------------------------------------ latest, removal

    def search_roots(self, roots: Iterable[Any]) -> list[AnyPath]:
        """Where ``"latest"`` looks: ``roots`` (the ``ModelCheckpoint`` directories) and ``dirpath``."""
        out: list[AnyPath] = []
        for root in [*roots, self.dirpath]:
            if root is not None and self.as_path(root) not in out:
                out.append(self.as_path(root))
        return out

    def latest(self, roots: Iterable[Any], *, weights_only: bool = False) -> AnyPath | None:
        """The checkpoint ``"latest"`` names under ``roots``, by the rule of
        :func:`lightning_scale.core.checkpoint.latest.latest` over sharded checkpoints (collective: rank 0
        lists them, every rank checksums a share): this run's newest that verifies (:attr:`run_id`, and the
        runs it continues), then the other runs', the one that saved most recently first. Weights-only
        checkpoints only with ``weights_only`` (what ``validate``/``test``/``predict`` need). Each broken
        one passed over, and each directory that looks like a checkpoint but is not one, gets a warning
        naming it."""
        self.wait()
        found: list[str] = []
        if self._rank() == 0:
            roots = self.search_roots(roots)
            runs = {self.run_id, *self.lineage}
            found = [str(p) for p in candidates(roots, run_ids=runs, weights_only=weights_only)]
        chosen = first_that_verifies(self._broadcast(found), self._verify_collectively, warn=self._rank() == 0)
        self._just_verified = chosen
        return None if chosen is None else self.as_path(chosen)

    def _verify_collectively(self, candidate: str) -> None:
        verify_distributed(self.as_path(candidate), group=self.process_group)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint (a directory: hidden by a rename first, then deleted; a link: the link only).
        The checkpoint the run resumed from is kept, with a warning."""
        path = self.as_path(path)
        if self.resumed_from is not None and path.exists() and not path.is_symlink():
            if path.resolve() == self.resumed_from.resolve():
                warnings.warn(f"Not deleting {path}: this run resumed from it.", RuntimeWarning, stacklevel=2)
                return
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            remove_dir(path)

    @override
    def teardown(self) -> None:
        """Wait for the save in flight and raise what it raised (the strategy calls this after every Trainer call)."""
        self.wait()
