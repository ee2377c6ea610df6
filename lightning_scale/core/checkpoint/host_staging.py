"""Staging a save's tensors into host memory that is kept from one save to the next: :class:`HostStager`.

An async save must snapshot the training state before training changes it, and should cost the
training loop as little as possible. Here the snapshot goes into host buffers that are reused while
the tensors keep their shapes and dtypes (no allocation, and no pinning, after the first save); on
CUDA they are pinned and filled by non-blocking copies on a side stream, so the host returns at once
and the writer thread waits for the copies (:meth:`HostStager.synchronize`) instead of the training
loop. No Lightning, no process group.

torch's own ``torch.distributed.checkpoint.staging.DefaultStager`` does the same for ``dcp.async_save``,
but its non-blocking option refuses to run without an accelerator (so the CPU path would differ from
the CUDA one), its cache is keyed by the identity of the source storages, and its async staging hands
the training loop a future to wait on before it next changes a tensor, which Lightning's loop has no
place for. Here the compute stream itself waits for the copies (a GPU-side wait, queued before any
later in-place update), which keeps every later change of a staged tensor out of the snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["HostStager"]


def _local(value: Tensor) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _signature(value: Tensor) -> tuple[Any, ...]:
    """What a buffer must match to be reused for ``value``: the local shape and dtype, and for a DTensor its
    global shape and placements (the buffer is a DTensor of the same layout)."""
    local = _local(value)
    if isinstance(value, DTensor):
        return (tuple(local.shape), local.dtype, tuple(value.shape), tuple(value.placements), id(value.device_mesh))
    return (tuple(local.shape), local.dtype)


class HostStager:
    """Copies a flat state dict of tensors (or DTensors) into host buffers and returns them, ready to write.

    Args:
        reuse: keep the buffers for the next :meth:`stage`, which refills the buffer of every key whose
            tensor kept its local shape and dtype (and, for a DTensor, its layout) and allocates the rest.
            False: new buffers on every call.
        pin_memory: page-lock the buffers (faster, non-blocking device-to-host copies). Default: where
            CUDA is available; True without CUDA is refused.

    On CUDA, :meth:`stage` queues the copies on a side stream after everything the compute stream queued
    before the call, records an event, and makes the compute stream wait for that event: the host does
    not wait, later kernels that change the staged tensors (the optimizer step) run after the copies, and
    the source tensors' memory is not reused before the copies are done. The thread that writes the
    buffers calls :meth:`synchronize` first. On the CPU the copies are plain, synchronous ones.

    Attributes ``last_stage_s`` (host seconds the last :meth:`stage` took) and ``last_reused`` (whether it
    allocated nothing) describe the last call.
    """

    def __init__(self, *, reuse: bool = True, pin_memory: bool | None = None) -> None:
        if not isinstance(reuse, bool):
            raise TypeError(f"reuse={reuse!r} must be True or False.")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory={pin_memory!r} must be True, False or None (pinned where CUDA is available).")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs CUDA (page-locked memory is a CUDA allocation) and CUDA is not available; "
                "pass pin_memory=None (pinned where CUDA is available) or False."
            )
        self.reuse, self.pin_memory = reuse, pin_memory
        self._buffers: dict[str, tuple[tuple[Any, ...], Tensor]] = {}
        self._streams: dict[int, Any] = {}
        self._pending: list[Any] = []
        self.last_stage_s = 0.0
        self.last_reused = False

    def _buffer(self, key: str, value: Tensor) -> tuple[Tensor, bool]:
        signature = _signature(value)
        kept = self._buffers.get(key) if self.reuse else None
        if kept is not None and kept[0] == signature:
            return kept[1], True
        # empty_like keeps a DTensor a DTensor (same mesh and placements, its local part on the host).
        buffer = torch.empty_like(value, device="cpu", pin_memory=self.pin_memory)
        if self.reuse:
            self._buffers[key] = (signature, buffer)
        return buffer, False

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    @torch.no_grad()
    def stage(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``state_dict``'s tensors copied into the host buffers (a new dict; the buffers are this stager's,
        overwritten by the next call, so write them before staging again)."""
        begin = time.perf_counter()
        self.synchronize()  # a previous call's copies, should nobody have waited for them
        for key, value in state_dict.items():
            if not isinstance(value, Tensor):
                raise TypeError(f"state_dict[{key!r}] is a {type(value).__name__}; only tensors are staged.")
        if self.reuse:  # keys that are gone free their buffers
            self._buffers = {k: v for k, v in self._buffers.items() if k in state_dict}
        staged: dict[str, Tensor] = {}
        on_device: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
        reused = True
        for key, value in state_dict.items():
            buffer, kept = self._buffer(key, value)
            reused &= kept
            staged[key] = buffer
            source, target = _local(value).detach(), _local(buffer)
            if source.is_cuda:
                on_device.setdefault(source.device, []).append((source, target))
            else:
                target.copy_(source)
        for device, pairs in on_device.items():
            self._copy_from_cuda(device, pairs)
        self.last_stage_s, self.last_reused = time.perf_counter() - begin, reused
        return staged

    def _copy_from_cuda(self, device: torch.device, pairs: list[tuple[Tensor, Tensor]]) -> None:
        compute = torch.cuda.current_stream(device)
        side = self._stream(device)
        side.wait_stream(compute)  # the copies see every update queued before the save
        with torch.cuda.stream(side):
            for source, target in pairs:
                target.copy_(source, non_blocking=self.pin_memory)
                source.record_stream(side)  # its memory is not handed out again before the copy ran
        done = torch.cuda.Event()
        done.record(side)
        compute.wait_event(done)  # later changes of these tensors run after the copies; the host goes on
        self._pending.append(done)

    def synchronize(self) -> None:
        """Wait until the copies of the last :meth:`stage` are in the host buffers (a no-op on the CPU)."""
        pending, self._pending = self._pending, []
        for event in pending:
            event.synchronize()

    def buffers(self) -> dict[str, Tensor]:
        """The kept host buffers by key (empty when ``reuse`` is False)."""
        return {k: v for k, (_, v) in self._buffers.items()}
