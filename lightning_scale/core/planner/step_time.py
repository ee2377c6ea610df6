"""Time of one optimizer step, term by term. No Lightning.

For the critical pipeline rank (the one with the most blocks, the head's FLOPs on the last), each
operation at its own rate:

- ``compute``: the rank's GEMM FLOPs (``6 n`` per token and block, the head's ``6 V d`` on the last
  stage) divided by ``tp``, at the device's peak for the compute dtype times :attr:`Efficiency.compute`,
  scaled down for small matmuls (``n / (n + matmul_half)``, ``n`` the matmuls' size, their FLOPs per element
  moved: :meth:`~lightning_scale.core.planner.shape.ModelShape.gemm_size`, the head's ``head_gemm_size``);
- ``attention``: the ``12 H Q T`` per token and block that MFU counts
  (:meth:`~lightning_scale.core.planner.shape.ModelShape.attention_flops_per_token`); a fused causal
  kernel executes half of it at :attr:`Efficiency.attention` of the peak (less for short sequences:
  ``T / (T + attention_half)``); without one (``attention`` 0) the whole product runs at the GEMM rate;
- ``elementwise``: the eager operators' bytes (norms, residual adds, activations, rotary, head-major
  copies, the loss's softmax; :meth:`~lightning_scale.core.planner.shape.ModelShape.elementwise_bytes_per_token`)
  times :attr:`Efficiency.elementwise` (the loss's times :attr:`Efficiency.loss_traffic` where set), at
  :attr:`Efficiency.memory` of the device's memory bandwidth;
- ``recompute``: the forwards activation checkpointing runs again in the backward (a third of the
  checkpointed blocks' GEMMs, attention and traffic; their forward's share of the fixed cost is in ``overhead``);
- ``tensor_parallel``: per block and micro-batch, two all-reduces forward and two backward (all-gather
  plus reduce-scatter under sequence parallelism: the same bytes in twice the messages) of the block's
  activations, two more per recomputed block, and the vocabulary-parallel embedding's and loss's few,
  taking :attr:`Efficiency.framework_collectives` times the link's time and each also paying
  :attr:`Efficiency.collective_overhead` (DTensor issues them from Python); at most
  :attr:`Efficiency.tp_overlap` of it hidden behind the GEMMs;
- ``pipeline_transfers``: per micro-batch and stage of the rank (several under interleaved schedules) one
  activation forward and one gradient backward between neighbouring stages, over NVLink or, when the
  pipeline leaves the node, the device's share of the node's NICs;
- ``bubble``: the schedule's idle share (:func:`~lightning_scale.core.pipeline.partition.bubble_fraction`,
  the figure ``pipeline/bubble_predicted`` logs) of the pipeline's time; on a host whose processes
  outnumber its cores (``slowdown`` > 1) divided by ``slowdown``: while some stages wait, the others'
  processes have the idle cores and run that much faster;
- ``data_parallel``: the gradient all-reduce (``ddp``: one per 25 MiB bucket) behind the last
  micro-batch's backward; or FSDP2's parameter all-gathers, one per sharded unit, in the compute dtype
  under mixed precision (``fsdp``: each micro-batch's forward and backward; ``fsdp_grad_op``: each
  forward; under a pipeline once a step), prefetched behind the passes they serve, and the gradients'
  reduce-scatter in fp32 behind the last backward (``hsdp``: and the all-reduce between replicas);
  FSDP2's, issued from Python, take :attr:`Efficiency.framework_collectives` times the link's time and
  each pays :attr:`Efficiency.collective_overhead`; at most :attr:`Efficiency.dp_overlap` of each hidden;
- ``overhead``: per block and micro-batch, what is neither FLOPs nor bytes (kernel launches, the
  framework's Python: :attr:`Efficiency.overhead`, 0 until calibrated on a GPU), and the forward's share
  (:attr:`Efficiency.forward_overhead`) again per recomputed block, times the device's ``slowdown``
  (CPU processes sharing cores);
- ``activation_offload``: per micro-batch, the offloaded blocks' saved activations
  (:attr:`~lightning_scale.core.planner.layout.Candidate.offload_blocks`) copied to the host in the forward
  and back in the backward over the cluster's ``host`` link (an assumed PCIe Gen5 x16, 55 GB/s, unless
  given), :attr:`Efficiency.offload_overlap` of it hidden (0: ``save_on_cpu`` copies on the compute
  stream); none on a CPU, where the host is the device (the "copy" is the tensor itself);
- ``optimizer``: the update's memory traffic (parameters, gradients and states read, parameters
  and states written) at the device's memory bandwidth.

Collectives are timed hierarchically over the group's placement in the cluster
(:mod:`~lightning_scale.core.planner.collectives`): within a node over its link, across nodes over every
NIC of the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_scale.core.pipeline.partition import bubble_fraction
from lightning_scale.core.planner.cluster import Cluster, Efficiency
from lightning_scale.core.planner.collectives import (
    collective_time,
    describe_group,
    placement,
    point_to_point_bandwidth,
)
from lightning_scale.core.planner.layout import OPTIMIZERS, PRECISION_BYTES, Candidate, Workload
from lightning_scale.core.planner.memory import (
    block_activation_bytes,
    fsdp_mixed_precision,
    rank_blocks,
    residual_bytes,
)
from lightning_scale.core.planner.shape import ModelShape

__all__ = ["Efficiency", "TimeEstimate", "estimate_time"]  # Efficiency: defined with the clusters

_DDP_BUCKET = 25 * 2**20
"""``DistributedDataParallel``'s default bucket: one all-reduce per 25 MiB of gradients."""


@dataclass(frozen=True)
class TimeEstimate:
    terms: dict[str, float]
    """Seconds per optimizer step, per term."""
    model_flops: float
    """Model FLOPs of one optimizer step (all devices; no recomputation)."""
    hardware_flops: float
    inputs: dict[str, float] = field(default_factory=dict)
    details: dict[str, dict[str, float | str]] = field(default_factory=dict)
    """Per term, what it was computed from (``lightning-scale-plan --explain`` prints them); empty unless
    :func:`estimate_time` was asked to ``explain``."""

    @property
    def step_time(self) -> float:
        return sum(self.terms.values())


def _exposed(seconds: float, window: float, overlap: float) -> float:
    """What of a collective's ``seconds`` is not hidden behind ``window`` seconds of compute, at most
    ``overlap`` of either."""
    return max(seconds - overlap * window, seconds * (1 - overlap))


def estimate_time(
    shape: ModelShape,
    workload: Workload,
    candidate: Candidate,
    cluster: Cluster,
    efficiency: Efficiency | None = None,
    *,
    peak: float | None = None,
    explain: bool = False,
) -> TimeEstimate:
    """The step time of ``candidate`` on ``cluster`` (at ``efficiency``, else the cluster's); ``peak``
    overrides the device's FLOP/s (a CPU's measured one); ``explain``: also each term's inputs
    (:attr:`TimeEstimate.details`; left out of a search's thousands of estimates)."""
    eff = efficiency or cluster.efficiency
    pbytes, gbytes, a = PRECISION_BYTES[workload.precision]
    peak = peak or cluster.device.peak(workload.compute_dtype)
    if not peak:
        raise ValueError(
            f"No peak FLOP/s for {cluster.device.name} in {workload.compute_dtype}: pass peak= (FLOP/s per device)."
        )
    t, p, c = candidate.tp, candidate.pp, candidate.cp
    d = candidate.data_shards  # the ranks gradients are reduced over (and FSDP shards across): data x context
    m = candidate.microbatches(workload)
    s = workload.seq_len
    tokens_mb = candidate.micro_batch * s / c  # context parallel: each rank a part of every sequence
    blocks = rank_blocks(shape, p)

    def gemm_rate(flops: float, size: float) -> float:  # a peak's achieved share for matmuls of that size
        return flops * eff.compute * size / (size + eff.matmul_half)

    size = shape.gemm_size(tokens_mb, t)
    rate = gemm_rate(peak, size)
    head_size = shape.head_gemm_size(tokens_mb, t)
    head_rate = gemm_rate(peak, head_size)
    if candidate.float8:  # the blocks' linears in float8; the head and attention stay in the compute dtype
        fp8 = cluster.device.peak("float8")
        if not fp8:
            raise ValueError(f"{cluster.device.name} has no float8 peak: plan float8 layouts on H100-class devices.")
        rate = gemm_rate(fp8 * eff.float8_gemm, size)
    # A fused causal attention kernel executes half the FLOPs MFU counts, at its own rate; without one
    # (``attention`` 0) the full product runs as plain matmuls.
    if eff.attention:
        attention_rate, executed = (
            peak * eff.attention * (s / (s + eff.attention_half) if eff.attention_half else 1.0),
            0.5,
        )
    else:
        attention_rate, executed = rate, 1.0

    attention_flops = shape.attention_flops_per_token(s) * tokens_mb / t
    gemm_flops = shape.block_flops_per_token(s) * tokens_mb / t - attention_flops
    block_time = gemm_flops / rate + attention_flops * executed / attention_rate
    recomputed = candidate.checkpointed_blocks(blocks)
    compute = blocks * gemm_flops / rate + shape.head_flops_per_token() * tokens_mb / t / head_rate
    attention = blocks * attention_flops * executed / attention_rate
    recompute = recomputed * block_time / 3
    # Memory-bound operators: norms, residual adds, activations, head-major copies, the loss's softmax.
    hbm = cluster.device.memory_bandwidth * eff.memory
    mixed = fsdp_mixed_precision(workload, candidate)
    residual = residual_bytes(workload, candidate)
    # Split over tensor parallelism (the norms' and residuals' only under sequence parallelism: the
    # difference is small beside the heads' and the MLP's); the loss's over the vocabulary-parallel head.
    block_bytes = shape.elementwise_bytes_per_token(a, residual) / t * tokens_mb
    if candidate.float8:  # each linear's input, weight and output gradient scaled (amax) and cast, unfused
        block_bytes += (shape.float8_cast_elements_per_token() * tokens_mb + 2 * shape.block_matmul_parameters) * 5 / t
    loss_traffic = eff.elementwise if eff.loss_traffic is None else eff.loss_traffic
    elementwise = (
        eff.elementwise * (blocks + recomputed / 3) * block_bytes
        + loss_traffic * shape.loss_bytes_per_token(a) / t * tokens_mb
    ) / hbm

    # A collective's step waits for every member to run: processes sharing cores wait their turn too.
    slowdown = cluster.device.slowdown
    issued = eff.collective_overhead * slowdown  # per collective DTensor or FSDP issues
    framework = eff.framework_collectives  # DTensor's and FSDP2's collectives, against the link's time
    tp_bytes = tokens_mb * shape.d_model * a
    # Per block, forward and backward: four all-reduces, or under sequence parallelism eight all-gathers
    # and reduce-scatters of the same bytes; a recomputed forward half as many again; the vocabulary-
    # parallel embedding and loss a few small ones per micro-batch.
    sp_messages = 2 if candidate.sequence_parallel else 1
    tp_collectives = sp_messages * (4 * blocks + 2 * recomputed) + 4
    tp_time = framework * collective_time(
        cluster, eff, "all_reduce", (4 * blocks + 2 * recomputed + 1) * tp_bytes, t, 1, tp_collectives
    )
    tp_time += tp_collectives * issued if t > 1 else 0.0
    tp_time = _exposed(tp_time, compute, eff.tp_overlap)

    # Context parallel (ring attention): each block's keys and values pass around the ring forward, and
    # again with their gradients backward, behind the attention they feed.
    cp_time = 0.0
    if c > 1:
        kv_bytes = 2 * shape.kv_width * tokens_mb * a / t
        cp_time = collective_time(
            cluster, eff, "all_gather", 3 * (blocks + recomputed) * c * kv_bytes, c, t * p, 3 * (blocks + recomputed)
        )
        cp_time = _exposed(cp_time, attention_flops * executed / attention_rate * (blocks + recomputed), eff.dp_overlap)

    p2p = 0.0
    if p > 1:
        bandwidth, latency = point_to_point_bandwidth(cluster, eff, placement(cluster, p, t).nodes > 1)
        width = shape.d_model / (t if candidate.sequence_parallel or eff.pipeline_scatter_gather else 1)
        # Each of the rank's stages (several under interleaved and V-shaped schedules) receives its input
        # and sends its output, forward and backward.
        sends = 2 * candidate.stages_per_rank
        p2p = sends * (tokens_mb * width * a / bandwidth + latency)

    # A recomputed forward runs the block's operators again: a third of its FLOPs, and the forward's share
    # of its fixed cost.
    overhead = (blocks + eff.forward_overhead * recomputed) * eff.overhead * slowdown
    offloaded = candidate.offloaded_blocks(blocks)
    offload_bytes = offloaded * block_activation_bytes(shape, workload, candidate)
    host_copies = cluster.device.chip != "cpu"  # a CPU's save_on_cpu keeps the tensor itself
    offload = 2 * offload_bytes / cluster.host.bandwidth * (1 - eff.offload_overlap) if host_copies else 0.0
    per_mb = compute + attention + elementwise + recompute + tp_time + cp_time + p2p + overhead + offload
    bubble = bubble_fraction(candidate.schedule, p, m, candidate.stages_per_rank) if p > 1 else 0.0
    pipeline = m * per_mb / (1 - bubble) if bubble < 1 else float("inf")

    params_rank = blocks * shape.block_parameters / t + (shape.embedding_parameters + shape.head_parameters) / t
    dp_time = 0.0
    dp_inputs: dict[str, float] = {}
    if d > 1:
        stride = t * p
        grads = params_rank * gbytes  # reduced in fp32 (FSDP2's reduce dtype under mixed precision)
        backward = per_mb * 2 / 3  # the last micro-batch's backward: where the gradients are reduced
        if candidate.dp_mode == "ddp":  # DDP's buckets: one flat buffer each, reduced from C++
            reduce = collective_time(
                cluster, eff, "all_reduce", grads, d, stride, max(1, math.ceil(grads / _DDP_BUCKET))
            )
            dp_time = _exposed(reduce, backward, eff.dp_overlap)
            dp_inputs = {
                "dp_reduce_s": reduce,
                "dp_gather_s": 0.0,
                "reduced_bytes": grads,
                "buckets": max(1, math.ceil(grads / _DDP_BUCKET)),
            }
        else:
            # One all-gather and one reduce-scatter per sharded unit (each block, and the root's rest);
            # FSDP2 gathers in the compute dtype under mixed precision.
            shard, units = (candidate.hsdp_shard if candidate.dp_mode == "hsdp" else d), blocks + 1
            # fsdp: a gather for each micro-batch's forward and backward; fsdp_grad_op keeps the forward's
            # for the backward, and under a pipeline every mode gathers once for all the micro-batches.
            gathers = 1 if p > 1 else (m if candidate.dp_mode == "fsdp_grad_op" else 2 * m)
            gathered = params_rank * (a if mixed else pbytes)
            gather = gathers * collective_time(cluster, eff, "all_gather", gathered, shard, stride, units)
            reduce = collective_time(cluster, eff, "reduce_scatter", grads, shard, stride, units)
            if candidate.dp_mode == "hsdp" and d > shard:  # the replicas: data x context ranks over the shard
                reduce += collective_time(cluster, eff, "all_reduce", grads / shard, d // shard, stride * shard, units)
            gather, reduce = framework * gather + gathers * units * issued, framework * reduce + units * issued
            # Gathers are prefetched behind the passes they serve (every micro-batch's forward, and backward
            # under fsdp; the first forward under a pipeline); the reduction only behind the last backward.
            window = per_mb / 3 if p > 1 else (m * per_mb / 3 if candidate.dp_mode == "fsdp_grad_op" else m * per_mb)
            dp_time = _exposed(gather, window, eff.dp_overlap) + _exposed(reduce, backward, eff.dp_overlap)
            dp_inputs = {
                "dp_reduce_s": reduce,
                "dp_gather_s": gather,
                "gathered_bytes": gathered,
                "gathers": gathers,
                "reduced_bytes": grads,
                "shard_group": shard,
            }

    states = OPTIMIZERS[workload.optimizer]
    o_shard = (
        d
        if candidate.dp_mode in ("fsdp", "fsdp_grad_op")
        else (candidate.hsdp_shard if candidate.dp_mode == "hsdp" else 1)
    )
    traffic = params_rank / o_shard * (2 * pbytes + gbytes + 2 * states * pbytes)
    optimizer = traffic / (cluster.device.memory_bandwidth * eff.memory)

    # Processes outnumbering the cores (``slowdown`` > 1): while a pipeline stage waits in its bubble, the
    # processes of the stages that run have its cores too, and run up to ``slowdown`` times faster than
    # when every process runs (one core each at most); the bubble, the busy stages' time, shrinks as much.
    # On a device of its own (a GPU: ``slowdown`` 1) nothing changes.
    terms = {
        "compute": m * compute,
        "attention": m * attention,
        "elementwise": m * elementwise,
        "recompute": m * recompute,
        "tensor_parallel": m * tp_time,
        "context_parallel": m * cp_time,
        "pipeline_transfers": m * p2p,
        "overhead": m * overhead,
        "activation_offload": m * offload,
        "bubble": (pipeline - m * per_mb) / slowdown,
        "data_parallel": dp_time,
        "optimizer": optimizer,
    }
    model_flops = shape.flops_per_token(s) * workload.tokens
    hardware_flops = (
        model_flops
        + recomputed / max(blocks, 1) * shape.n_layers * shape.block_flops_per_token(s) / 3 * workload.tokens
    )
    inputs = {
        "peak_flops": peak,
        "matmul_rate": rate,
        "head_rate": head_rate,
        "attention_rate": attention_rate,
        "memory_bandwidth": hbm,
        "microbatches": m,
        "bubble_fraction": bubble,
        "slowdown": slowdown,
        # What a data-parallel sync mode other than every step exchanges (lightning_scale.core.planner.sync).
        "parameters_per_rank": params_rank,
        "parameter_bytes": pbytes,
        "gradient_bytes": gbytes,
        "microbatch_s": per_mb,
        **dp_inputs,
    }
    if not explain:
        return TimeEstimate(terms, model_flops, hardware_flops, inputs)
    group = {k: v for k, v in describe_group(cluster, eff, d, t * p).items() if k != "group"} if d > 1 else {}
    details: dict[str, dict[str, float | str]] = {
        "compute": {
            "gemm_flops_per_microbatch": blocks * gemm_flops + shape.head_flops_per_token() * tokens_mb / t,
            "microbatches": m,
            "gemm_rate": rate,
            "gemm_size": size,
            "head_gemm_size": head_size,
            "head_rate": head_rate,
            "float8": str(candidate.float8),
        },
        "attention": {
            "flops_counted_per_microbatch": blocks * attention_flops,
            "executed_share": executed,
            "attention_rate": attention_rate,
            "seq_len": s,
        },
        "elementwise": {
            "bytes_per_microbatch": elementwise * hbm,
            "memory_bandwidth_achieved": hbm,
            "traffic_factor": eff.elementwise,
        },
        "recompute": {"checkpointed_blocks": recomputed, "blocks": blocks},
        "tensor_parallel": {
            **describe_group(cluster, eff, t, 1),
            "bytes_per_microbatch": (4 * blocks + 2 * recomputed + 1) * tp_bytes,
            "collectives_per_microbatch": tp_collectives if t > 1 else 0,
            "overlap": eff.tp_overlap,
        },
        "context_parallel": {
            **describe_group(cluster, eff, c, t * p),
            "kv_bytes_per_block": 2 * shape.kv_width * tokens_mb * a / t,
            "overlap": eff.dp_overlap,
        },
        "pipeline_transfers": {
            "sends_per_microbatch": 2 * candidate.stages_per_rank if p > 1 else 0,
            "bytes_per_send": tokens_mb * shape.d_model / (t if candidate.sequence_parallel else 1) * a
            if p > 1
            else 0.0,
            "crosses_nodes": str(p > 1 and placement(cluster, p, t).nodes > 1),
        },
        "bubble": {
            "schedule": candidate.schedule if p > 1 else "none",
            "bubble_fraction": bubble,
            "microbatches": m,
            "stages_per_rank": candidate.stages_per_rank,
        },
        "data_parallel": {"mode": candidate.dp_mode, "group": d, **group, **dp_inputs, "overlap": eff.dp_overlap},
        "overhead": {"seconds_per_block": eff.overhead, "slowdown": slowdown},
        "activation_offload": {
            "offloaded_blocks": offloaded,
            "bytes_per_microbatch": offload_bytes,
            "host_link": cluster.host.name if host_copies else "none (the CPU is the host)",
            "host_bandwidth": cluster.host.bandwidth,
            "overlap": eff.offload_overlap,
        },
        "optimizer": {"bytes": traffic, "memory_bandwidth_achieved": cluster.device.memory_bandwidth * eff.memory},
    }
    return TimeEstimate(terms, model_flops, hardware_flops, inputs, details)
