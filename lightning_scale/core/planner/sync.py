"""What a data-parallel sync mode costs per step: Local SGD and DiLoCo against every-step all-reduce. No Lightning.

Every step (``every_step``), DDP all-reduces the gradients behind the last micro-batch's backward: the
``data_parallel`` term of :func:`~lightning_scale.core.planner.step_time.estimate_time`, at most
:attr:`~lightning_scale.core.planner.cluster.Efficiency.dp_overlap` of it hidden. The local modes drop that
all-reduce; each data-parallel replica steps alone, and every ``H`` (``every``) optimizer steps the replicas
exchange their parameters over the ``dp`` group:

- ``local_sgd``: the parameters averaged (one all-reduce of every parameter, blocking);
- ``diloco``: the pseudo-gradient (anchor - local parameters) averaged, then an outer Nesterov SGD step
  (the same bytes as ``local_sgd``);
- ``streaming_diloco``: the blocks split into ``F`` (``fragments``) fragments, one exchanged every
  ``H / F`` steps on a staggered schedule; with ``overlap`` each exchange runs behind the next inner step.

The mode is a :class:`~lightning_scale.core.parallel.sync_spec.SyncSpec`, the one the strategy runs
(:mod:`lightning_scale.core.parallel.sync`). The exchange is priced with the planner's own hierarchical
all-reduce (:func:`~lightning_scale.core.planner.collectives.collective_time`) over the same group and
placement as DDP's (``dp`` ranks ``tp * pp`` apart), of ``P x wire`` bytes: ``P`` the parameters of the
rank (the critical pipeline rank's, as the ``data_parallel`` term counts them), ``wire`` the bytes a
parameter takes on the wire (:data:`WIRE_BYTES`: the value's dtype, the parameter's or, for DiLoCo's
``anchor - parameters``, fp32 at least; or the compressed size plus one fp32 scale per
:data:`~lightning_scale.core.parallel.sync_exchange.QUANT_BLOCK` values for ``int8`` and ``int4``). Per
optimizer step::

    data_parallel = (F / H) * exchange(P * wire / F)               # blocking (F = 1 but for streaming)
    data_parallel = (F / H) * exposed(exchange(P * wire / F))      # streaming_diloco, overlap=True
    sync_update   = UPDATE_TRAFFIC[mode] * P * bytes(value) / H / HBM   (+ the (de)quantisation's traffic)

where ``exposed`` hides at most ``dp_overlap`` of an exchange behind one step's work (the step less its
``data_parallel`` and ``optimizer`` terms), as the planner hides DDP's. Every other term is the
estimate's. The exchange is one all-reduce of a flat buffer (one latency, where DDP pays one per 25 MiB
bucket); a compressed one is a reduce-scatter and an all-gather of the encoded values, which moves the
``2 (n - 1) / n`` of them per rank a ring all-reduce does, priced as one with two latencies.

This prices communication only. How many more tokens a local mode needs to reach the same loss is measured,
not predicted: :func:`break_even` takes it as ``penalty``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_scale.core.checks import check_positive_number
from lightning_scale.core.parallel.sync_exchange import QUANT_BLOCK
from lightning_scale.core.parallel.sync_spec import SyncSpec, sync_spec
from lightning_scale.core.planner.cluster import Cluster, Efficiency
from lightning_scale.core.planner.collectives import collective_time
from lightning_scale.core.planner.search import Estimate
from lightning_scale.core.planner.step_time import _DDP_BUCKET, _exposed

__all__ = ["UPDATE_TRAFFIC", "WIRE_BYTES", "SyncEstimate", "break_even", "sync_time"]

WIRE_BYTES: dict[str, float | None] = {"none": None, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
"""Bytes per exchanged value on the wire, per ``compression`` (``none``: the parameter's dtype; ``bf16``
never more than it); ``int8`` and ``int4`` also send one fp32 scale per
:data:`~lightning_scale.core.parallel.sync_exchange.QUANT_BLOCK` values."""
UPDATE_TRAFFIC = {"every_step": 0, "local_sgd": 4, "diloco": 12, "streaming_diloco": 12}
"""Device-memory traffic of one exchange's bookkeeping, in exchanged values' bytes per parameter:
``local_sgd`` copies the parameters into a flat buffer and back (4); DiLoCo forms the pseudo-gradient
(3: anchor and parameters read, result written), takes the outer Nesterov step on the anchor (momentum
3, step 4) and copies the anchor into the parameters (2). Order of magnitude: beside the exchange it is
small, and a fused kernel moves less."""
_SCALE_BYTES = 4.0  # one fp32 scale per quantisation block
_ERROR_FEEDBACK_BYTES = 4.0  # a compressed exchange keeps what its rounding lost, in fp32, per parameter


@dataclass(frozen=True)
class SyncEstimate:
    """One layout's step under a data-parallel sync mode, beside the same layout synchronised every step.
    Seconds are per optimizer step; bytes are what each data-parallel rank sends per step, averaged over
    the ``every`` steps between exchanges."""

    spec: SyncSpec
    terms: dict[str, float]
    """The estimate's terms with ``data_parallel`` the mode's exposed exchange per step, and ``sync_update``
    the exchange's bookkeeping (:data:`UPDATE_TRAFFIC`) per step."""
    every_step_time: float
    """Seconds per step with the gradients all-reduced every step (the estimate's, on its cluster)."""
    exchange: float
    """Seconds of one exchange (one fragment's under ``streaming_diloco``), before any overlap; every step:
    DDP's gradient all-reduce, before its overlap."""
    wire_bytes_per_parameter: float
    """Bytes on the wire per exchanged parameter (:data:`WIRE_BYTES`, with the quantisation's scales): the
    parameter's dtype uncompressed, fp32 at least where the exchange is ``anchor - parameters`` (DiLoCo)."""
    bytes_per_step: float
    """Each rank's bytes sent per step: ``2 (n - 1) / n`` of the exchanged buffer (a ring all-reduce, or a
    reduce-scatter and an all-gather, over the ``n`` data-parallel ranks), divided by ``every``."""
    every_step_bytes_per_step: float
    """Each rank's bytes sent per step by DDP's gradient all-reduce (``2 (n - 1) / n`` of the gradients);
    0 for the sharding modes, whose every-step communication is the estimate's and not repriced here."""
    extra_memory: float
    """Bytes per device the mode holds beyond every step's, not in the estimate's memory: the anchor
    (DiLoCo's, or a compressed Local SGD's) and DiLoCo's outer momentum, each fp32 at least, and a
    compressed exchange's fp32 error feedback (each value's, and the rank's averaged chunk's)."""
    tokens_per_sec: float
    """The global batch's tokens over :attr:`step_time`."""

    @property
    def step_time(self) -> float:
        return sum(self.terms.values())

    @property
    def time_saved(self) -> float:
        """Seconds per step less than every step's (negative: the mode is slower)."""
        return self.every_step_time - self.step_time

    @property
    def bytes_ratio(self) -> float:
        """Bytes sent per step against every step's: ``1 / H`` for an exchange in the gradients' dtype,
        less with compression (0 where every step's is not priced here)."""
        return self.bytes_per_step / self.every_step_bytes_per_step if self.every_step_bytes_per_step else 0.0

    def row(self) -> dict[str, object]:
        """The figures a report prints, as plain values."""
        return {
            "sync": self.spec.describe(),
            "step_time_s": self.step_time,
            "every_step_time_s": self.every_step_time,
            "time_saved_s": self.time_saved,
            "exchange_s": self.exchange,
            "bytes_per_step": self.bytes_per_step,
            "bytes_ratio": self.bytes_ratio,
            "extra_memory_gib": self.extra_memory / 2**30,
            "tokens_per_sec": self.tokens_per_sec,
        }


def _spec(estimate: Estimate, spec: SyncSpec | str | Mapping[str, Any]) -> SyncSpec:
    """``spec`` read as the strategy reads ``data_parallel_sync`` (its checks name the value and the fix),
    and refused for a layout that cannot run it."""
    spec = sync_spec(spec)
    candidate = estimate.candidate
    if spec.periodic and (candidate.dp_mode != "ddp" or candidate.cp > 1):
        raise ValueError(
            f"{spec.describe()} needs replicas: layout {candidate.name} is dp_mode={candidate.dp_mode!r}"
            f"{f' with cp={candidate.cp}' if candidate.cp > 1 else ''}. Price it on a layout with "
            "dp_mode='ddp' and cp=1 (only data_parallel_mode='ddp' supports the local modes)."
        )
    return spec


def _with_inter_bandwidth(cluster: Cluster, bandwidth: float) -> Cluster:
    return dataclasses.replace(cluster, inter=dataclasses.replace(cluster.inter, bandwidth=bandwidth))


def _every_step_data_parallel(estimate: Estimate, cluster: Cluster, eff: Efficiency) -> tuple[float, float, float]:
    """(exposed seconds, seconds, bytes each rank sends) of DDP's gradient all-reduce per step, as
    :func:`~lightning_scale.core.planner.step_time.estimate_time` computes it, on ``cluster``'s links."""
    inputs, d = estimate.time.inputs, estimate.candidate.data_shards
    if d <= 1:
        return 0.0, 0.0, 0.0
    grads = inputs["parameters_per_rank"] * inputs["gradient_bytes"]
    stride = estimate.candidate.tp * estimate.candidate.pp
    reduce = collective_time(cluster, eff, "all_reduce", grads, d, stride, max(1, math.ceil(grads / _DDP_BUCKET)))
    return _exposed(reduce, inputs["microbatch_s"] * 2 / 3, eff.dp_overlap), reduce, 2 * (d - 1) / d * grads


def _price(estimate: Estimate, cluster: Cluster, eff: Efficiency, spec: SyncSpec) -> SyncEstimate:
    """``spec``'s step on ``cluster`` (the estimate's, or the same with other inter-node links): every term
    but the data-parallel one is the estimate's."""
    inputs, candidate = estimate.time.inputs, estimate.candidate
    every_dp, reduce, every_bytes = _every_step_data_parallel(estimate, cluster, eff)
    rest = estimate.time.step_time - estimate.time.terms["data_parallel"]
    terms = {**estimate.time.terms, "data_parallel": every_dp, "sync_update": 0.0}
    params, pbytes, d = inputs["parameters_per_rank"], inputs["parameter_bytes"], candidate.data_shards
    if not spec.periodic:
        wire, exchange, sent, extra = inputs["gradient_bytes"], reduce, every_bytes, 0.0
    else:
        h, f, compressed = spec.every, spec.fragments, spec.compression != "none"
        # DiLoCo (and a compressed Local SGD) exchange anchor - parameters, the anchor fp32 at least.
        anchored = spec.outer or compressed
        value = max(pbytes, 4) if anchored else pbytes
        wire = WIRE_BYTES[spec.compression]
        wire = value if wire is None else min(wire, value)
        if spec.compression in ("int8", "int4"):
            wire += _SCALE_BYTES / QUANT_BLOCK
        fragment = params * wire / f
        # One all-reduce of the flat buffer; compressed, a reduce-scatter and an all-gather (the same bytes).
        exchange = collective_time(
            cluster, eff, "all_reduce", fragment, d, candidate.tp * candidate.pp, 2 if compressed else 1
        )
        # Hidden behind the next inner step's work (forward, backward, bubble; not the update it waits on).
        window = rest - estimate.time.terms["optimizer"]
        exposed = _exposed(exchange, window, eff.dp_overlap) if spec.overlap else exchange
        traffic = UPDATE_TRAFFIC[spec.mode] * value + (2 * (value + wire) if compressed else 0.0)
        terms["data_parallel"] = f / h * exposed
        terms["sync_update"] = traffic * params / h / inputs["memory_bandwidth"] if d > 1 else 0.0
        sent = 2 * (d - 1) / d * params * wire / h if d > 1 else 0.0
        momentum = spec.outer and spec.outer_momentum > 0
        feedback = _ERROR_FEEDBACK_BYTES * (1 + 1 / d) if compressed else 0.0  # each value's, and its averaged chunk's
        extra = params * (value * (anchored + momentum) + feedback)
    step = sum(terms.values())
    return SyncEstimate(
        spec=spec,
        terms=terms,
        every_step_time=rest + every_dp,
        exchange=exchange,
        wire_bytes_per_parameter=wire,
        bytes_per_step=sent,
        every_step_bytes_per_step=every_bytes,
        extra_memory=extra,
        tokens_per_sec=estimate.tokens_per_sec * estimate.time.step_time / step,
    )


def sync_time(
    estimate: Estimate,
    cluster: Cluster,
    spec: SyncSpec | str | Mapping[str, Any] = "every_step",
    *,
    efficiency: Efficiency | None = None,
) -> SyncEstimate:
    """``estimate``'s layout stepped under ``spec`` on ``cluster`` (the cluster and ``efficiency`` the
    estimate was made with; default the cluster's). ``spec``: a
    :class:`~lightning_scale.core.parallel.sync_spec.SyncSpec` (``diloco(every=500)``), or what the
    strategy's ``data_parallel_sync`` takes (``"every_step"``, a mapping of the spec's fields). See the
    module doc for the formula.

    Raises ``ValueError`` for a spec the strategy refuses (its own message), for a local mode on a layout
    that is not plain replicas (``dp_mode='ddp'``, ``cp=1``), and for a cluster or efficiency other than
    the estimate's, naming the value and what to pass."""
    spec = _spec(estimate, spec)
    eff = efficiency or cluster.efficiency
    if estimate.candidate.dp_mode != "ddp":  # every step under a sharding mode: the estimate as it is
        return SyncEstimate(
            spec=spec,
            terms={**estimate.time.terms, "sync_update": 0.0},
            every_step_time=estimate.time.step_time,
            exchange=0.0,  # FSDP's gathers and reduce-scatters: in the estimate's inputs, not repriced here
            wire_bytes_per_parameter=0.0,
            bytes_per_step=0.0,
            every_step_bytes_per_step=0.0,
            extra_memory=0.0,
            tokens_per_sec=estimate.tokens_per_sec,
        )
    priced = _price(estimate, cluster, eff, spec)
    if not math.isclose(priced.every_step_time, estimate.time.step_time, rel_tol=1e-9, abs_tol=1e-15):
        raise ValueError(
            f"The estimate of {estimate.name} was not made on this cluster and efficiency: its step is "
            f"{estimate.time.step_time:.6g} s, here every step's is {priced.every_step_time:.6g} s. Pass the "
            "cluster and efficiency= the estimate was made with."
        )
    return priced


def break_even(
    estimate: Estimate,
    cluster: Cluster,
    spec: SyncSpec | str | Mapping[str, Any],
    *,
    penalty: float = 1.0,
    efficiency: Efficiency | None = None,
) -> float:
    """The inter-node link bandwidth below which ``spec``'s local mode reaches a fixed token count sooner
    than every step: nominal bytes/s **per NIC**, one direction (the unit of
    :attr:`~lightning_scale.core.planner.cluster.Link.bandwidth`: a node's is ``cluster.nics_per_node``
    times it; the cluster's own is ``cluster.inter.bandwidth``; a data-parallel group with ``g`` members a
    node achieves ``g * nics_per_node / devices_per_node * inter_link`` times it per rank, at most the
    intra-node link's share).

    ``penalty``: the tokens the mode needs for the loss every step reaches in one token (measured, not
    predicted: 1.0 counts the tokens equal). The mode wins at a bandwidth where ``penalty * step(mode) <
    step(every_step)``, each from :func:`sync_time` with the cluster's inter-node link at that bandwidth and
    every other term the estimate's (pipeline sends that cross nodes are held at the cluster's figure).
    Found on a grid from 1e-6 to 1e6 times the cluster's bandwidth, 20 points a decade, then by bisection
    of the highest crossing. ``math.inf``: the mode wins at every bandwidth (e.g. a data-parallel group
    inside one node, where the inter-node link carries nothing, and the mode is faster there); ``0.0``: at
    none. Raises ``ValueError`` as :func:`sync_time` does, for ``every_step`` and for a ``penalty`` that is
    not a positive number."""
    check_positive_number(
        "penalty", penalty, fix="It is the mode's tokens per every-step token to the same loss (1.0: equal)."
    )
    spec = _spec(estimate, spec)
    if not spec.periodic:
        raise ValueError(
            "data_parallel_sync='every_step' is what break_even compares against. Pass a local mode: "
            "local_sgd(every=H), diloco(every=H) or streaming_diloco(every=H, fragments=F)."
        )
    sync_time(estimate, cluster, spec, efficiency=efficiency)  # the estimate was made on this cluster
    eff = efficiency or cluster.efficiency

    def margin(log_bandwidth: float) -> float:
        """Positive where the mode wins: every step's time to the tokens less the mode's."""
        priced = _price(estimate, _with_inter_bandwidth(cluster, math.exp(log_bandwidth)), eff, spec)
        return priced.every_step_time - penalty * priced.step_time

    center = math.log(cluster.inter.bandwidth)
    grid = [center + math.log(10.0) * (k / 20 - 6) for k in range(241)]
    wins = [margin(x) > 0 for x in grid]
    if all(wins):
        return math.inf
    if not any(wins):
        return 0.0
    high = max(k for k, w in enumerate(wins) if w)
    if high == len(grid) - 1:  # wins on the fastest links of the range, loses on some slower one
        return math.inf
    lo, hi = grid[high], grid[high + 1]
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if margin(mid) > 0 else (lo, mid)
    return math.exp(lo)
