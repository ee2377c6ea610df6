"""The periodic exchange of :mod:`lightning_scale.core.parallel.sync`: averaging tensors over the
data-parallel group, uncompressed or compressed with error feedback, timed, counted, and delayed
as if over a slower link (:class:`EmulatedLink`).

- ``none``: one all-reduce of the flattened tensors (in their dtype) per dtype.
- ``bf16``, ``int8``, ``int4``: a reduce-scatter then an all-gather, each of encoded values: every
  rank sends rank j the j-th chunk of its encoded tensor (``all_to_all_single``), decodes the chunks
  it received, averages them in fp32, encodes its averaged chunk and all-gathers it. Ring all-reduce
  sends ``2 (n - 1) / n`` of the payload per rank; so does this, with the payload 2, 1 or 0.5 bytes a
  value (plus one fp32 scale per :data:`QUANT_BLOCK` values for the integers). What each encoding
  rounds away is kept and added to the next exchange of the same tensors (error feedback on both
  sides, as 1-bit Adam's compressed all-reduce does): the rank's own values' rounding with the rank
  (``residuals``), its averaged chunk's with the chunk's owner (``chunk_residual``), so no rounding
  error accumulates over exchanges.

Collectives are issued with ``async_op=True``: :meth:`Exchange.start` returns at once, :meth:`Exchange.finish`
waits (the training loop's blocked time). Bytes counted are what this rank sends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_scale.core.checks import check_positive_number

__all__ = ["QUANT_BLOCK", "EmulatedLink", "Exchange", "ExchangeStats", "decode", "encode", "ring_bytes"]

QUANT_BLOCK = 128
"""Values per absmax scale of the int8/int4 encodings."""
_LEVELS = {"int8": 127, "int4": 7}


def ring_bytes(payload: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce (or reduce-scatter + all-gather) of ``payload`` bytes over ``n``."""
    return 2.0 * (n - 1) / n * payload if n > 1 else 0.0


@dataclass(frozen=True)
class EmulatedLink:
    """A slower link than the machine's: each data-parallel exchange takes at least ``latency_ms``
    plus its bytes at ``bandwidth_mbps`` (megabits per second, as links are sold). For benchmarks and
    what-if studies of cross-region or Ethernet clusters on a fast one; the transfer itself still
    runs at the real link's speed, underneath the delay."""

    bandwidth_mbps: float
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        check_positive_number("emulated_link.bandwidth_mbps", self.bandwidth_mbps, unit="megabits per second")
        if isinstance(self.latency_ms, bool) or not isinstance(self.latency_ms, (int, float)) or self.latency_ms < 0:
            raise ValueError(f"emulated_link.latency_ms={self.latency_ms!r} must be a number of milliseconds >= 0.")

    @classmethod
    def of(cls, value: Any) -> EmulatedLink | None:
        """``None``, an :class:`EmulatedLink`, or a mapping of its fields (a YAML config's)."""
        if value is None or isinstance(value, EmulatedLink):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"bandwidth_mbps", "latency_ms"})
            if unknown or "bandwidth_mbps" not in value:
                raise ValueError(
                    f"emulated_link={dict(value)!r} needs bandwidth_mbps (and optionally latency_ms), nothing else; "
                    "e.g. {'bandwidth_mbps': 100, 'latency_ms': 20}."
                )
            return cls(**value)
        raise TypeError(
            f"emulated_link must be None or a mapping like {{'bandwidth_mbps': 100, 'latency_ms': 20}}, got {value!r}."
        )

    def seconds(self, nbytes: float) -> float:
        """The time ``nbytes`` sent by one rank take on this link."""
        return self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_mbps * 1e6)

    def ddp_hook(self, group: dist.ProcessGroup, stats: ExchangeStats) -> Any:
        """A DDP communication hook: the plain averaging all-reduce of each gradient bucket, completing
        no sooner than this link would carry it (the backward goes on meanwhile, as over a real link);
        its bytes go into ``stats``. Each bucket is delayed from its own start: buckets in flight together
        are not queued behind each other, which is kind to every-step training."""
        link = self

        def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            n = dist.get_world_size(group)
            sent = ring_bytes(buffer.numel() * buffer.element_size(), n)
            stats.bytes_sent += sent  # (exchanges: one a step, counted by the caller, as without the link)
            due = time.monotonic() + link.seconds(sent)
            future = dist.all_reduce(buffer.div_(n), group=group, async_op=True).get_future()

            def arrive(fut: torch.futures.Future[Any]) -> torch.Tensor:
                remaining = due - time.monotonic()
                if remaining > 0:
                    time.sleep(remaining)
                return fut.value()[0]

            return future.then(arrive)

        hook.__annotations__ = {
            "state": object,
            "bucket": dist.GradBucket,
            "return": torch.futures.Future[torch.Tensor],
        }
        return hook


@dataclass
class ExchangeStats:
    """Cumulative per rank: bytes sent, exchanges (rounds of collectives), seconds blocked waiting."""

    bytes_sent: float = 0.0
    exchanges: int = 0
    blocked_s: float = 0.0


def encode(values: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` (fp32, a multiple of :data:`QUANT_BLOCK` long for the integers) as ``kind`` sends them:
    (payload, scales). ``bf16``: the values in bfloat16; ``int8``/``int4``: absmax-scaled integers per
    block (int4: two to a byte), and the fp32 scale of each block."""
    if kind == "bf16":
        return values.to(torch.bfloat16), None
    levels = _LEVELS[kind]
    blocks = values.view(-1, QUANT_BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / levels
    q = torch.round(blocks / scales[:, None]).clamp_(-levels, levels).to(torch.int8)
    if kind == "int4":
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scales
    return q.view(-1), scales


def decode(payload: torch.Tensor, scales: torch.Tensor | None, kind: str) -> torch.Tensor:
    """The fp32 values :func:`encode` sent."""
    if kind == "bf16":
        return payload.to(torch.float32)
    if kind == "int4":
        low = (payload & 0x0F).to(torch.int16) - 8
        high = (payload >> 4).to(torch.int16) - 8
        q = torch.stack([low, high], dim=1).view(-1)
    else:
        q = payload
    assert scales is not None
    return (q.to(torch.float32).view(-1, QUANT_BLOCK) * scales[:, None]).view(-1)


class Exchange:
    """One averaging exchange of ``tensors`` over ``group`` (each rank's tensors alike in shape and
    dtype): :meth:`start`, then :meth:`finish` writes the averages into ``out``.

    ``residuals``: one fp32 buffer per tensor (error feedback of the compressed kinds), updated in place;
    ``chunk_residual``: the averaged chunk's (:meth:`chunk_numel` values, fp32), updated in place.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        kind: str,
        stats: ExchangeStats,
        *,
        residuals: Sequence[torch.Tensor] | None = None,
        chunk_residual: torch.Tensor | None = None,
        link: EmulatedLink | None = None,
    ) -> None:
        self.tensors, self.group, self.kind, self.stats, self.link = list(tensors), group, kind, stats, link
        self.residuals = list(residuals) if residuals is not None else None
        self.chunk_residual = chunk_residual
        self.n = dist.get_world_size(group)
        self._works: list[Any] = []
        self._due = 0.0
        self._started = False

    # ------------------------------------------------------------------ start

    def start(self) -> Exchange:
        sent = 0.0
        if self.kind == "none":
            self._buckets: list[tuple[list[int], torch.Tensor]] = []
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, t in enumerate(self.tensors):
                by_dtype.setdefault(t.dtype, []).append(i)
            for members in by_dtype.values():
                flat = torch.cat([self.tensors[i].reshape(-1) for i in members])
                self._buckets.append((members, flat))
                self._works.append(dist.all_reduce(flat, group=self.group, async_op=True))
                sent += ring_bytes(flat.numel() * flat.element_size(), self.n)
        else:
            sent = self._start_encoded()
        self.stats.bytes_sent += sent
        self.stats.exchanges += 1
        self._due = time.monotonic() + (self.link.seconds(sent) if self.link is not None else 0.0)
        self._started = True
        return self

    def _start_encoded(self) -> float:
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in self.tensors])
        if self.residuals is not None:
            flat += torch.cat([r.reshape(-1) for r in self.residuals])
        self._numel = flat.numel()
        padded = self.chunk_numel(self._numel, self.n, self.kind) * self.n
        flat = torch.nn.functional.pad(flat, (0, padded - self._numel))
        payload, scales = encode(flat, self.kind)
        if self.residuals is not None:  # what this rank's encoding lost, for its next exchange
            lost = (flat - decode(payload, scales, self.kind))[: self._numel]
            offset = 0
            for r in self.residuals:
                r.copy_(lost[offset : offset + r.numel()].view_as(r))
                offset += r.numel()
        self._recv = torch.empty_like(payload)
        self._works.append(dist.all_to_all_single(self._recv, payload, group=self.group, async_op=True))
        sent = payload.numel() * payload.element_size()
        if scales is not None:
            self._recv_scales = torch.empty_like(scales)
            self._works.append(dist.all_to_all_single(self._recv_scales, scales, group=self.group, async_op=True))
            sent += scales.numel() * scales.element_size()
        else:
            self._recv_scales = None
        return ring_bytes(sent, self.n)

    @staticmethod
    def chunk_numel(numel: int, n: int, kind: str) -> int:
        """Values in each rank's chunk of ``numel`` values encoded as ``kind`` over ``n`` ranks (padded)."""
        unit = n * (2 if kind == "bf16" else 2 * QUANT_BLOCK)
        return -(-numel // unit) * unit // n

    # ------------------------------------------------------------------ finish

    def finish(self, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Wait for the exchange and return the averages (written into ``out`` when given, else new tensors)."""
        if not self._started:
            raise RuntimeError("Exchange.finish() before start().")
        began = time.monotonic()
        for work in self._works:
            work.wait()
        averages = self._averages_plain() if self.kind == "none" else self._averages_encoded()
        remaining = self._due - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        self.stats.blocked_s += time.monotonic() - began
        if out is None:
            return averages
        for target, value in zip(out, averages, strict=True):
            target.copy_(value)
        return list(out)

    def _averages_plain(self) -> list[torch.Tensor]:
        averages: list[torch.Tensor | None] = [None] * len(self.tensors)
        for members, flat in self._buckets:
            flat /= self.n
            offset = 0
            for i in members:
                t = self.tensors[i]
                averages[i] = flat[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
        return averages  # type: ignore[return-value]

    def _averages_encoded(self) -> list[torch.Tensor]:
        n = self.n
        chunks = self._recv.view(n, -1)
        scales = self._recv_scales.view(n, -1) if self._recv_scales is not None else None
        mine = torch.stack([decode(chunks[j], scales[j] if scales is not None else None, self.kind) for j in range(n)])
        mean = mine.mean(dim=0)
        if self.chunk_residual is not None:
            mean += self.chunk_residual
        payload, mean_scales = encode(mean, self.kind)
        if self.chunk_residual is not None:
            self.chunk_residual.copy_(mean - decode(payload, mean_scales, self.kind))
        gathered = torch.empty(n * payload.numel(), dtype=payload.dtype, device=payload.device)
        works = [dist.all_gather_single(gathered, payload, group=self.group, async_op=True)]
        all_scales = None
        if mean_scales is not None:
            all_scales = torch.empty(n * mean_scales.numel(), dtype=torch.float32, device=payload.device)
            works.append(dist.all_gather_single(all_scales, mean_scales, group=self.group, async_op=True))
        for work in works:
            work.wait()
        flat = decode(gathered, all_scales, self.kind)[: self._numel]
        averages, offset = [], 0
        for t in self.tensors:
            averages.append(flat[offset : offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()
        return averages
