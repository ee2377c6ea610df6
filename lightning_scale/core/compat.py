"""Every private torch API lightning-scale uses, each behind one named shim.

"Private" here means a ``_``-prefixed name or module, an undocumented attribute patched or read at
run time, or a file layout torch does not document. Each shim's docstring names the API, why it is
needed and the public alternative, if any. All were written against :data:`WRITTEN_AGAINST`
(torch has no stable contract for them), and ``tests/test_compat.py`` holds one canary per entry of
:data:`SHIMS`: after an upgrade, the canary of each API that changed fails and names it, instead of
a run failing far from the cause. The canaries are what justifies the upper bound on torch in
``pyproject.toml``.

A leaf of ``core``: torch and the standard library only, and every part of ``core`` may import it.
Private modules are imported when a shim is called, not when this module is imported, so an upgrade
that drops one breaks only what uses it, with a :class:`PrivateAPIMissing` naming the shim.

:class:`Shim` is also what :mod:`lightning_scale._lightning_compat` registers Lightning's in.
"""

from __future__ import annotations

import importlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DCP_DATA_FILE",
    "DCP_METADATA_FILE",
    "PIPELINE_STAGE_COMPUTE",
    "SHIMS",
    "TORCH_LAYOUT_PICKLE_NAME",
    "TORCH_SAVE_RECORDS",
    "TORCH_SAVE_REBUILD_TENSOR",
    "TORCH_SAVE_STORAGE_DTYPES",
    "TORCH_VERSION",
    "WRITTEN_AGAINST",
    "PrivateAPIMissing",
    "Shim",
    "apply_to_tensors",
    "copy_state_dict",
    "create_cpu_state_dict",
    "dcp_fsspec_filesystem",
    "dcp_memory_format_encoding",
    "dcp_metadata_file",
    "dcp_storage_info_type",
    "flatten_mesh",
    "foreach_mul_",
    "foreach_norm",
    "memory_tracker",
    "forward_action_types",
    "fsdp_replicate",
    "gradient_sync_held_off",
    "keep_lowered_actions",
    "mesh_group_registry",
    "module_buffers",
    "module_children",
    "module_hooks_suspended",
    "module_parameters",
    "private_api",
    "strip_protocol",
]

TORCH_VERSION = "2.13.0"
"""The torch release every shim here was written and checked against."""
WRITTEN_AGAINST = f"torch {TORCH_VERSION}"
FSSPEC_VERSION = "2026.9.0"
"""fsspec (a dependency of torch, whose DCP fsspec layer hands out fsspec filesystems): :func:`strip_protocol`."""


@dataclass(frozen=True)
class Shim:
    """One entry of a compat module's ``SHIMS``, checked by the canary of the same name in
    ``tests/test_compat.py``.

    ``targets``: the private APIs, as dotted names (``Class().attr``: an attribute of the instances;
    ``Class.attr``: of the class); each belongs to one entry only, so removing it fails one canary.
    ``shims``: the names in the compat module that reach them. ``written_against``: the release.
    """

    targets: tuple[str, ...]
    shims: tuple[str, ...]
    written_against: str = WRITTEN_AGAINST


class PrivateAPIMissing(ImportError):
    """A private API a shim needs is not in the installed release."""


def private_api(module: str, name: str, *, shim: str, written_against: str = WRITTEN_AGAINST) -> Any:
    """``module.name`` (imported now), or a :class:`PrivateAPIMissing` naming ``shim`` (``module.function``
    of a compat module) and the release it was written against."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise PrivateAPIMissing(
            f"lightning-scale's shim {shim} needs {module}.{name}, which the installed release does not have "
            f"(written against {written_against}; tests/test_compat.py checks every private API the package uses). "
            f"Install the release it was written against, or a newer lightning-scale."
        ) from err


def _private(module: str, name: str, shim: str) -> Any:
    return private_api(module, name, shim=f"{__name__}.{shim}")


# ---------------------------------------------------------------- device mesh


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh._flatten(name)``: a new 1-D dimension ``name`` over all of ``mesh``'s dimensions, registered
    on the root mesh (``root["name"]`` works after). Private ``DeviceMesh._flatten``: HSDP's
    ``(dp_replicate, dp_shard)`` is one ``dp`` for the sampler and the loss. No public alternative."""
    return mesh._flatten(name)


def mesh_group_registry(mesh: Any) -> dict[str, Any] | None:
    """The process groups a ``DeviceMesh`` keeps by name (private ``DeviceMesh._pg_registry``, torch >= 2.10),
    or None. Cleared at exit so that the groups' worker threads can be joined. No public alternative."""
    registry = getattr(mesh, "_pg_registry", None)
    return registry if isinstance(registry, dict) else None


# ---------------------------------------------------------------- pipeline schedules


PIPELINE_STAGE_COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""The ``PipelineStage`` methods torch's schedules call for every micro-batch's compute, through the stage
instance (so an instance attribute of the same name wraps them: ``core.pipeline.timing``). Undocumented
methods of the private ``_PipelineStageBase``; no public hook times a stage's compute."""


def forward_action_types() -> frozenset[Any]:
    """The lowered-schedule action types a forward-only step keeps: forward, its sends and receives, and
    FSDP's unshard/reshard. Private ``torch.distributed.pipelining.schedules._ComputationType``: torch 2.13's
    ``eval()`` on V-shaped schedules still runs backward actions (``core.pipeline.schedules``). No public
    alternative."""
    kind = _private("torch.distributed.pipelining.schedules", "_ComputationType", "forward_action_types")
    return frozenset({kind.FORWARD, kind.SEND_F, kind.RECV_F, kind.UNSHARD, kind.RESHARD})


def keep_lowered_actions(schedule: Any, keep: Callable[[Any], bool]) -> None:
    """Keep only the actions whose ``computation_type`` ``keep`` accepts in ``schedule``'s lowered order.

    Undocumented ``pipeline_order_with_comms`` of the private ``_PipelineScheduleRuntime`` (what the
    multi-stage schedules run, rank by rank) and the private ``_Action.computation_type``. No public
    alternative: torch builds a schedule's order from its class alone.
    """
    lowered = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if keep(a.computation_type)] for rank, actions in lowered.items()
    }


@contextmanager
def gradient_sync_held_off(module: Any) -> Iterator[None]:
    """While inside, ``module.set_requires_gradient_sync(...)`` (an FSDP2 module) turns synchronisation off
    whatever it is asked.

    torch's ``PipelineStage.perform_reduce_grad`` (undocumented, of the private ``_PipelineStageBase``;
    every schedule calls it at the end of its step) turns FSDP's gradient synchronisation back on before
    reducing; ``core.pipeline.schedules.GradSyncStage`` overrides it and, on an accumulation micro-step,
    runs torch's inside this so that gradients accumulate unsharded. No public alternative (torch has no
    "no_sync" for schedules).
    """
    set_sync = type(module).set_requires_gradient_sync

    def no_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        set_sync(module, False, recurse=recurse)

    module.__dict__["set_requires_gradient_sync"] = no_sync
    try:
        yield
    finally:
        del module.__dict__["set_requires_gradient_sync"]


# ---------------------------------------------------------------- data parallelism


def fsdp_replicate(module: nn.Module, *, mesh: Any) -> Any:
    """FSDP2's ``replicate`` (DDP-like replicas built on FSDP2, so it composes with tensor parallelism and
    pipeline stages): private module ``torch.distributed._composable.replicate_with_fsdp``. Public
    alternative: none in torch 2.13 (``torch.distributed.fsdp`` exports ``fully_shard`` only)."""
    replicate = _private("torch.distributed._composable.replicate_with_fsdp", "replicate", "fsdp_replicate")
    return replicate(module, mesh=mesh)


# ---------------------------------------------------------------- nn.Module internals


def module_parameters(module: nn.Module) -> dict[str, Any]:
    """``module``'s own parameter table, live (private ``nn.Module._parameters``): read and written in place
    to swap tensors without ``register_parameter``'s checks or a hook firing. Public, read-only:
    ``named_parameters(recurse=False)`` (which skips ``None`` entries and repeats)."""
    return module._parameters


def module_buffers(module: nn.Module) -> dict[str, Any]:
    """``module``'s own buffer table, live (private ``nn.Module._buffers``); see :func:`module_parameters`.
    Public, read-only: ``named_buffers(recurse=False)``."""
    return module._buffers


def module_children(module: nn.Module) -> dict[str, Any]:
    """``module``'s own table of children, live (private ``nn.Module._modules``): a pipeline stage deletes
    entries without renumbering a ``ModuleList``. Public, read-only: ``named_children()`` (which skips
    ``None`` entries and repeats)."""
    return module._modules


def apply_to_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """``module._apply(fn)``: ``fn`` on every parameter and buffer of the tree, parameters kept as
    parameters (what ``.to()`` and ``.to_empty()`` run). Private ``nn.Module._apply``: only the meta
    tensors are replaced, which ``to_empty`` (every tensor) cannot do."""
    return module._apply(fn)


_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextmanager
def module_hooks_suspended(module: nn.Module) -> Iterator[None]:
    """The forward and backward hooks of every module in ``module``'s tree do not run while inside (a run
    on meta tensors that a user's hook must not see). Private ``nn.Module._forward_hooks``,
    ``_forward_pre_hooks``, ``_backward_hooks`` and ``_backward_pre_hooks``. No public alternative
    (``torch.nn.modules.module`` has global hooks only)."""
    saved = [
        (sub, name, getattr(sub, name)) for sub in module.modules() for name in _HOOK_TABLES if getattr(sub, name, None)
    ]
    for sub, name, _ in saved:
        setattr(sub, name, OrderedDict())
    try:
        yield
    finally:
        for sub, name, hooks in saved:
            setattr(sub, name, hooks)


# ---------------------------------------------------------------- gradients


def foreach_norm(tensors: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """``torch._foreach_norm``: each tensor's ``ord``-norm in ``dtype``, one kernel per device and dtype
    (what ``clip_grad_norm_`` runs). Public alternative: ``torch.linalg.vector_norm`` per tensor (one kernel
    each), or ``torch.nn.utils.get_total_norm`` (the total only, not each piece's)."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(tensors: list[torch.Tensor], scalar: float) -> None:
    """``torch._foreach_mul_``: every tensor multiplied in place by ``scalar`` in one kernel per device and
    dtype. Public alternative: ``Tensor.mul_`` per tensor."""
    torch._foreach_mul_(tensors, scalar)


def memory_tracker() -> Any:
    """``MemTracker`` (private ``torch.distributed._tools.mem_tracker``): a dispatch mode counting every live
    tensor's storage, the planner's memory reference. Public alternative: ``torch.cuda.max_memory_allocated`` (CUDA only)."""
    return _private("torch.distributed._tools.mem_tracker", "MemTracker", "memory_tracker")


# ---------------------------------------------------------------- distributed checkpoints (DCP)


def create_cpu_state_dict(state_dict: dict[str, Any], *, pin_memory: bool) -> dict[str, Any]:
    """CPU tensors shaped like ``state_dict``'s (pinned when asked), to stage a save into: private
    ``torch.distributed._state_dict_utils._create_cpu_state_dict`` (what DCP's own stager uses). Public
    alternative: ``torch.distributed.checkpoint.staging.DefaultStager`` stages whole saves, not into a
    cache a writer keeps."""
    create = _private("torch.distributed._state_dict_utils", "_create_cpu_state_dict", "create_cpu_state_dict")
    return create(state_dict, pin_memory=pin_memory)


def copy_state_dict(state_dict: dict[str, Any], copy: dict[str, Any]) -> dict[str, Any]:
    """Copy ``state_dict``'s tensors into ``copy``'s (:func:`create_cpu_state_dict`), returned: private
    ``torch.distributed._state_dict_utils._copy_state_dict``. Public alternative: as :func:`create_cpu_state_dict`."""
    return _private("torch.distributed._state_dict_utils", "_copy_state_dict", "copy_state_dict")(state_dict, copy)


def dcp_fsspec_filesystem() -> Any:
    """A new instance of DCP's fsspec filesystem layer (``init_path(url, **storage_options)`` then ``.fs``):
    private module ``torch.distributed.checkpoint._fsspec_filesystem``. Public alternative: its
    ``FsspecReader``/``FsspecWriter`` wrap it, but do not hand out the layer itself."""
    return _private("torch.distributed.checkpoint._fsspec_filesystem", "FileSystem", "dcp_fsspec_filesystem")()


def strip_protocol(fs: Any, url: str) -> str:
    """``url`` as a path on the fsspec filesystem ``fs`` (DCP's fsspec layer resolved it): fsspec's private
    ``AbstractFileSystem._strip_protocol`` (core imports torch only, and DCP's layer drops the path
    ``fsspec.core.url_to_fs`` returns). Public alternative: ``fsspec.core.url_to_fs(url)[1]``."""
    return fs._strip_protocol(url)


DCP_METADATA_FILE = ".metadata"
"""The name of DCP's metadata file (private ``torch.distributed.checkpoint.filesystem._metadata_fn``)."""


def dcp_metadata_file(rank: int | None = None) -> str:
    """DCP's metadata file, or rank ``rank``'s own (``__<rank>.metadata``, written by loads and saves without
    collectives): private ``torch.distributed.checkpoint.filesystem._metadata_fn`` and its undocumented
    per-rank prefix."""
    return DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"


DCP_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")
"""DCP's data files, ``__<rank>_<n>.distcp``: the prefix ``FileSystemWriter`` gives each rank and its
undocumented ``DEFAULT_SUFFIX``."""


def dcp_storage_info_type() -> type:
    """The class DCP's ``.metadata`` pickles where each item is stored: private
    ``torch.distributed.checkpoint.filesystem._StorageInfo``. Read by name (``__module__``, ``__qualname__``)
    from the pickle, so the class itself is what a safe unpickler must allow. No public alternative."""
    return _private("torch.distributed.checkpoint.filesystem", "_StorageInfo", "dcp_storage_info_type")


def dcp_memory_format_encoding() -> type:
    """The enum DCP's ``TensorProperties`` pickles its memory format as: private
    ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``. No public alternative."""
    return _private("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "dcp_memory_format_encoding")


TORCH_LAYOUT_PICKLE_NAME = ("torch.serialization", "_get_layout")
"""The ``(module, name)`` a pickled ``torch.layout`` (DCP's ``TensorProperties.layout``) is rebuilt by:
private ``torch.serialization._get_layout``. Only the name is relied on: a safe unpickler maps it to a
fixed table."""


# ---------------------------------------------------------------- the torch.save archive layout


TORCH_SAVE_REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
"""The ``(module, name)`` a ``torch.save``'d tensor's ``data.pkl`` rebuilds it with, from
``(storage, offset, size, stride, requires_grad, backward_hooks)``: private ``torch._utils._rebuild_tensor_v2``."""
TORCH_SAVE_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
"""The legacy storage class names (``torch.<name>``) ``data.pkl`` names in a storage's persistent id
``("storage", class, "0", location, numel)``, by dtype."""
TORCH_SAVE_RECORDS = frozenset(
    {"data.pkl", "data/0", "byteorder", "version", ".format_version", ".storage_alignment", ".data/serialization_id"}
)
"""The records of an uncompressed ``torch.save`` zip archive of one tensor (written by the private
``torch.serialization._save``), below the archive's top folder. The format is undocumented; a decoder
that reads the tensor's bytes in place (``core.checkpoint.saved_tensor``) relies on it. Public
alternative: ``torch.load`` (one copy more)."""


SHIMS: dict[str, Shim] = {
    "flatten_mesh": Shim(("torch.distributed.device_mesh.DeviceMesh._flatten",), ("flatten_mesh",)),
    "mesh_group_registry": Shim(("torch.distributed.device_mesh.DeviceMesh()._pg_registry",), ("mesh_group_registry",)),
    "pipeline_stage_compute": Shim(
        tuple(f"torch.distributed.pipelining.stage._PipelineStageBase.{name}" for name in PIPELINE_STAGE_COMPUTE),
        ("PIPELINE_STAGE_COMPUTE",),
    ),
    "forward_action_types": Shim(
        ("torch.distributed.pipelining.schedules._ComputationType",), ("forward_action_types",)
    ),
    "keep_lowered_actions": Shim(
        (
            "torch.distributed.pipelining.schedules._PipelineScheduleRuntime().pipeline_order_with_comms",
            "torch.distributed.pipelining.schedules._Action.computation_type",
        ),
        ("keep_lowered_actions",),
    ),
    "perform_reduce_grad": Shim(
        ("torch.distributed.pipelining.stage._PipelineStageBase.perform_reduce_grad",), ("gradient_sync_held_off",)
    ),
    "fsdp_replicate": Shim(("torch.distributed._composable.replicate_with_fsdp.replicate",), ("fsdp_replicate",)),
    "module_parameters": Shim(("torch.nn.Module()._parameters",), ("module_parameters",)),
    "module_buffers": Shim(("torch.nn.Module()._buffers",), ("module_buffers",)),
    "module_children": Shim(("torch.nn.Module()._modules",), ("module_children",)),
    "apply_to_tensors": Shim(("torch.nn.Module._apply",), ("apply_to_tensors",)),
    "module_hooks_suspended": Shim(
        tuple(f"torch.nn.Module().{name}" for name in _HOOK_TABLES), ("module_hooks_suspended",)
    ),
    "foreach_norm": Shim(("torch._foreach_norm",), ("foreach_norm",)),
    "foreach_mul_": Shim(("torch._foreach_mul_",), ("foreach_mul_",)),
    "memory_tracker": Shim(("torch.distributed._tools.mem_tracker.MemTracker",), ("memory_tracker",)),
    "create_cpu_state_dict": Shim(
        ("torch.distributed._state_dict_utils._create_cpu_state_dict",), ("create_cpu_state_dict",)
    ),
    "copy_state_dict": Shim(("torch.distributed._state_dict_utils._copy_state_dict",), ("copy_state_dict",)),
    "dcp_fsspec_filesystem": Shim(
        ("torch.distributed.checkpoint._fsspec_filesystem.FileSystem",), ("dcp_fsspec_filesystem",)
    ),
    "strip_protocol": Shim(
        ("fsspec.spec.AbstractFileSystem._strip_protocol",), ("strip_protocol",), f"fsspec {FSSPEC_VERSION}"
    ),
    "dcp_file_names": Shim(
        (
            "torch.distributed.checkpoint.filesystem._metadata_fn",
            "torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX",
        ),
        ("DCP_METADATA_FILE", "DCP_DATA_FILE", "dcp_metadata_file"),
    ),
    "dcp_storage_info_type": Shim(
        ("torch.distributed.checkpoint.filesystem._StorageInfo",), ("dcp_storage_info_type",)
    ),
    "dcp_memory_format_encoding": Shim(
        ("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",), ("dcp_memory_format_encoding",)
    ),
    "torch_layout_pickle_name": Shim(("torch.serialization._get_layout",), ("TORCH_LAYOUT_PICKLE_NAME",)),
    "torch_save_layout": Shim(
        ("torch._utils._rebuild_tensor_v2", "torch.serialization._save"),
        ("TORCH_SAVE_REBUILD_TENSOR", "TORCH_SAVE_STORAGE_DTYPES", "TORCH_SAVE_RECORDS"),
    ),
}
"""Every private torch API the package uses: entry name (its canary's id) -> :class:`Shim`."""
