"""The time of one collective over a group of devices of a cluster, hierarchically. No Lightning.

A group of ``n`` ranks, ``stride`` apart in the mesh (the tensor-parallel group is consecutive ranks,
the pipeline's ``tp`` apart, the data-parallel ``tp * pp`` apart), has ``g`` members on each of the
``N`` nodes it spans (:func:`placement`). Within one node its collectives run over the ``intra`` link.
Across nodes NCCL runs one channel per NIC: each ring (or tree) crosses between nodes on its own NIC,
the node's share inside each ring moving over NVLink, so the whole node's NICs work in parallel. The
group's bus bandwidth is then the slower of the intra-node link and its ``g`` members' share of the
node's NICs (``g * nic_share``; :attr:`~lightning_scale.core.planner.cluster.Cluster.nic_share`), which
is what nccl-tests measures (bus bandwidth close to the node's aggregate NIC bandwidth for a group of
whole nodes: ~96 GB/s with 4 HDR NICs a node, ~350 GB/s with 8 NDR).

A ring all-reduce of ``B`` bytes moves ``2 (n - 1) / n * B`` per device at that bus bandwidth, an
all-gather or reduce-scatter (``B`` the gathered size) ``(n - 1) / n * B``. Latency: ``g - 1`` steps on
the intra-node link and, across nodes, ``N - 1`` ring steps, or for an all-reduce the ``2 log2 N`` of
NCCL's tree when that is fewer (NCCL chooses the faster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_scale.core.planner.cluster import Cluster, Efficiency

__all__ = ["Placement", "collective_time", "describe_group", "placement", "point_to_point_bandwidth"]

KINDS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}
"""Bytes moved per device in units of ``(n - 1) / n`` of the buffer, per collective kind."""


@dataclass(frozen=True)
class Placement:
    size: int
    per_node: int
    """Members on each node the group spans."""
    nodes: int


def placement(cluster: Cluster, size: int, stride: int) -> Placement:
    """Where a group of ``size`` ranks ``stride`` apart lies: ranks fill a node before the next (the
    launchers' order), so ``devices_per_node // stride`` members share a node (at least 1)."""
    per_node = max(1, min(size, cluster.devices_per_node // stride))
    return Placement(size, per_node, math.ceil(size / per_node))


def _intra(cluster: Cluster, eff: Efficiency) -> float:
    """Achieved bytes/s per device of the intra-node link (a CPU's processes sharing cores slow it)."""
    return cluster.intra.bandwidth * eff.intra_link / cluster.device.slowdown


def _nics(cluster: Cluster, eff: Efficiency, per_node: int) -> float:
    """Achieved bytes/s of ``per_node`` devices' share of their node's NICs."""
    return per_node * cluster.nic_share * eff.inter_link / cluster.device.slowdown


def _bus_bandwidth(cluster: Cluster, eff: Efficiency, where: Placement) -> float:
    """Achieved bytes/s per device of the group's collectives."""
    if where.nodes == 1:
        return _intra(cluster, eff)
    inter = _nics(cluster, eff, where.per_node)
    return min(_intra(cluster, eff), inter) if where.per_node > 1 else inter


def collective_time(
    cluster: Cluster, eff: Efficiency, kind: str, nbytes: float, size: int, stride: int, messages: int = 1
) -> float:
    """Seconds for ``messages`` collectives of ``kind`` (:data:`KINDS`) moving ``nbytes`` in all (each
    device's buffer, or the gathered size) over a group of ``size`` ranks ``stride`` apart."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    where = placement(cluster, size, stride)
    transfer = KINDS[kind] * (size - 1) / size * nbytes / _bus_bandwidth(cluster, eff, where)
    lag = eff.latency * cluster.device.slowdown
    steps = (where.per_node - 1) * cluster.intra.latency
    if where.nodes > 1:
        ring = where.nodes - 1
        hops = min(ring, 2 * math.ceil(math.log2(where.nodes))) if kind == "all_reduce" else ring
        steps += hops * cluster.inter.latency
    return transfer + messages * steps * lag


def point_to_point_bandwidth(cluster: Cluster, eff: Efficiency, crosses_nodes: bool) -> tuple[float, float]:
    """(achieved bytes/s, latency) of one device sending to another: over the intra-node link, or over
    its share of the node's NICs."""
    lag = eff.latency * cluster.device.slowdown
    if crosses_nodes:
        return _nics(cluster, eff, 1), cluster.inter.latency * lag
    return _intra(cluster, eff), cluster.intra.latency * lag


def describe_group(cluster: Cluster, eff: Efficiency, size: int, stride: int) -> dict[str, float | str]:
    """What a group's collectives run over, for ``--explain``: its members per node, its nodes, the link
    that limits it and the achieved bus bandwidth (bytes/s per device)."""
    where = placement(cluster, size, stride)
    bandwidth = _bus_bandwidth(cluster, eff, where)
    if where.nodes == 1:
        link = cluster.intra.name
    else:
        nics = where.per_node * cluster.nics_per_node / cluster.devices_per_node
        link = (
            f"{cluster.inter.name} x {nics:g} NIC(s) per node"
            if bandwidth < _intra(cluster, eff)
            else cluster.intra.name
        )
    return {"group": size, "per_node": where.per_node, "nodes": where.nodes, "link": link, "bus_bandwidth": bandwidth}
