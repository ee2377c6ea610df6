"""The private ``torch.distributed`` (c10d) APIs the hang watchdog uses, each behind one named shim.

A sibling of :mod:`lightning_scale.core.compat` (which holds every other private torch API, and
:class:`~lightning_scale.core.compat.Shim`), following its pattern: each shim's docstring names the API,
why it is needed and the public alternative, if any; all were written against
:data:`~lightning_scale.core.compat.WRITTEN_AGAINST`, and ``tests/test_compat.py`` holds one canary per
entry of :data:`SHIMS`. Private names are looked up when a shim is called, so a release without one
breaks only what uses it, with a :class:`~lightning_scale.core.compat.PrivateAPIMissing` naming the shim.

A leaf of ``core`` beside ``compat``: torch, the standard library and ``compat`` only.
"""

from __future__ import annotations

from typing import Any

from lightning_scale.core.compat import Shim, private_api

__all__ = ["SHIMS", "default_store", "flight_recorder_json"]

_C10D = "torch.distributed.distributed_c10d"
_C10D_C = "torch._C._distributed_c10d"


def default_store() -> Any:
    """The key-value store the default process group was created with (``init_process_group``'s
    rendezvous store, a ``PrefixStore`` per torchrun attempt): private
    ``torch.distributed.distributed_c10d._get_default_store``. The hang watchdog's ranks reach each
    other through it while every process group is stuck in a collective. Public alternative: a new
    ``TCPStore`` client to ``MASTER_ADDR:MASTER_PORT``, which only the ``env://`` rendezvous provides
    (and which misses torchrun's per-attempt prefix)."""
    return private_api(_C10D, "_get_default_store", shim=f"{__name__}.default_store")()


def flight_recorder_json(*, nccl: bool) -> bytes:
    """The flight recorder's trace (the last collectives of every process group of this process, their
    sequence numbers and states) as JSON: private ``torch._C._distributed_c10d._dump_fr_trace_json``
    (gloo and other CPU backends; recorded when ``TORCH_FR_BUFFER_SIZE`` > 0) or, with ``nccl``,
    ``_dump_nccl_trace_json`` (CUDA builds only; ``TORCH_NCCL_TRACE_BUFFER_SIZE``). No public
    alternative (``torch.distributed.debug``'s server fetches the same dump over HTTP)."""
    name = "_dump_nccl_trace_json" if nccl else "_dump_fr_trace_json"
    return private_api(_C10D_C, name, shim=f"{__name__}.flight_recorder_json")(True, False)


SHIMS: dict[str, Shim] = {
    "default_store": Shim((f"{_C10D}._get_default_store",), ("default_store",)),
    # The NCCL dump exists in CUDA builds only, so the canary checks the CPU one (the same recorder's).
    "flight_recorder_json": Shim((f"{_C10D_C}._dump_fr_trace_json",), ("flight_recorder_json",)),
}
"""The private c10d APIs the package uses: entry name (its canary's id) -> :class:`~lightning_scale.core.compat.Shim`."""
