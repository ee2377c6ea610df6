"""Peak tensor memory per device of one training step, term by term. No Lightning.

The terms, for the most loaded pipeline rank (the first holds the most micro-batches in flight and the
embedding; the last the head and the logits; both are evaluated and the larger is the peak), or for
the pipeline rank asked for:

- ``parameters``, ``gradients``, ``optimizer``: the rank's parameters (its blocks, divided by ``tp``;
  the embedding on the first stage and the head on the last, vocabulary-parallel under ``tp``), each
  in its dtype (:data:`~lightning_scale.core.planner.layout.PRECISION_BYTES`), divided by the
  data-parallel shard for the modes that shard them (``fsdp``: all three; ``fsdp_grad_op``: gradients
  and optimizer state, the parameters stay gathered from the forward to the backward; ``hsdp``: like
  ``fsdp`` over its shard group; ``ddp``: none). The gradients of the step before: Lightning frees them
  between the forward and the backward (it zeroes them after ``training_step``), so without a pipeline
  they are held with the forward's activations and count beyond what only the backward allocates
  before its own (the loss's backward, FSDP's backward buffers; under full checkpointing the peak is a
  block recomputed in the backward, beside the new gradients of the blocks after it: counted in
  full). A pipeline step frees them before its schedule runs; when every forward runs before the
  first backward (GPipe; 1F1B with no more micro-batches than ``p - rank``), that backward allocates
  the gradients as it frees one micro-batch's activations of one stage, and they count beyond those.
  FSDP under a pipeline keeps them unsharded until the last micro-batch's reduce-scatter;
- ``cast_weights``: under mixed precision autocast keeps a 16-bit copy of every weight a matmul used
  until the backward is done;
- ``fsdp_buffers``: FSDP2's unsharded parameters and gradients. Without a pipeline: the gathered
  parameters of the block in use and the one prefetched, one block's unsharded gradients before their
  reduce-scatter, and the modules outside the blocks (embeddings, final norm, head), gathered from the
  forward to the end of the backward; the loss's backward is over before the last block is gathered
  again, so of it and the second block's parameters and gradients only the larger counts. Under a
  pipeline every parameter of the rank stays gathered for all micro-batches of the step. ``ddp``
  beside tensor or pipeline parallelism is FSDP2's ``replicate``, which gathers every parameter into
  a copy of its own (over a shard group of one), held from the forward to the end of the backward;
- ``ddp_buckets``: plain DDP (``ddp`` alone) keeps the gradients in flat buckets of its own, kept
  between steps (``gradient_as_bucket_view=True``, the strategy's default: the gradients are views of
  them, so ``gradients`` is 0 here and nothing of them is freed between steps);
- ``activations``: what one block saves for its backward per micro-batch (below), times the blocks
  of the rank, times the micro-batches the schedule keeps in flight on that rank; checkpointed blocks
  save only their input; offloaded blocks (``Candidate.offload_blocks``: ``save_on_cpu``) none on the
  device: their activations are in host memory, and each comes back in the backward once the blocks
  after it freed theirs, so the reload adds nothing to the peak;
- ``recompute``: a checkpointed block's activations rebuilt in the backward (with the gradient
  arriving at its output), beyond what the blocks after it and the loss freed by then;
- ``logits``: the last stage's output and loss for a micro-batch (log-probabilities saved in fp32 and
  the inputs of the final norm and of the head, for each micro-batch in flight there, plus the logits
  and their gradient while the loss runs);
- ``pipeline_buffers``: the receive buffers a pipeline stage allocates for every micro-batch
  (activations forward, their gradients backward);
- ``optimizer_step``: the optimizer's temporaries (AdamW's foreach update, torch's default on CUDA,
  holds one buffer the size of all parameters; its per-parameter loop, the default on CPU, the size of
  the largest), counted in the optimizer step's peak (with DDP's buckets), which is taken against the
  step's forward and backward peak;
- ``framework``: a constant for what the runtime holds besides tensors (0 for tensor memory).

Activations saved by one pre-norm decoder block per token, with ``a`` bytes per 16/32-bit matmul
output and ``r`` per element of the residual stream (fp32 under mixed precision): the two norms'
inputs (``2 r d``; an RMSNorm also keeps its normalised input, another ``2 r d``: torch computes
``rms_norm`` in steps on CPU, as Hugging Face's ``LlamaRMSNorm`` does everywhere), divided by ``tp``
under sequence parallelism; the inputs of the linears they feed, never divided (DTensor gathers the
sequence before the projections and autograd keeps the gathered input): ``2 a d``, or under autocast
one 16-bit copy per linear, each casting its input itself (``(3 + 1) a d``, ``(3 + 2) a d`` gated);
queries, keys and values (``a (H + 2 K) Q``), attention's output (``a H Q``; after rotary embeddings,
which write the queries heads-major and the kernel its output alike, also the contiguous copy the
output projection reads, another ``a H Q``) and its log-sum-exp (``4 H``), the MLP's hidden
activations (``2 a F``, or ``4 a F`` gated), all divided by ``tp``. Attention is taken as a fused
(flash or memory-efficient) kernel, which keeps no ``T x T`` matrix.

Under FSDP2's mixed precision (a sharding mode with a mixed precision: :func:`fsdp_mixed_precision`) the
block's activations, its gathered parameters and unsharded gradients are 16-bit and no autocast copy
exists. A context-parallel layout (``cp``, planned only) holds ``1 / cp`` of every sequence, and shards
over the data x context ranks.

Checked against torch's ``MemTracker`` on real steps of this package in one and several processes
(``benchmarks/planner.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_scale.core.planner.layout import OPTIMIZERS, PRECISION_BYTES, Candidate, Workload
from lightning_scale.core.planner.shape import ModelShape

__all__ = [
    "MemoryEstimate",
    "block_activation_bytes",
    "estimate_memory",
    "fewest_offloaded_blocks",
    "fsdp_mixed_precision",
    "in_flight",
    "rank_blocks",
    "residual_bytes",
]


@dataclass(frozen=True)
class MemoryEstimate:
    terms: dict[str, float]
    """Bytes per term at the peak (see the module doc)."""
    rank: str
    """Which pipeline rank peaks: ``"first"`` or ``"last"`` (``"only"`` without a pipeline); for a
    pipeline rank asked for, ``"rank N"`` when it is neither."""
    inputs: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def dominant(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


def rank_blocks(shape: ModelShape, pp: int) -> int:
    """Blocks on the most loaded pipeline rank (an even cut; the first ranks take the remainder)."""
    return math.ceil(shape.n_layers / pp)


def in_flight(candidate: Candidate, microbatches: int, rank: int) -> float:
    """Micro-batches' activations (in units of the rank's whole set of blocks) that pipeline rank
    ``rank`` holds at its peak: GPipe all of them; 1F1B ``p - rank``; the interleaved and V-shaped
    schedules ``(2 (p - rank - 1) + (v - 1) p + 1)`` chunks of ``1/v`` of the blocks (Narayanan et
    al. 2021's warm-up count)."""
    p, m = candidate.pp, microbatches
    if p == 1:
        return 1.0
    if candidate.schedule == "gpipe":
        return float(m)
    if candidate.schedule == "1f1b":
        return float(min(m, p - rank))
    v = candidate.stages_per_rank
    chunks = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    return chunks / v


def fsdp_mixed_precision(workload: Workload, candidate: Candidate) -> bool:
    """Whether FSDP2's ``MixedPrecisionPolicy`` runs the mixed precision instead of autocast: the sharding
    modes under a mixed precision (what the package's precision plugin does). The block's inputs and
    weights are then cast to the compute dtype once (its activations, gathered parameters and unsharded
    gradients are 16-bit; no per-linear autocast copies), the shards, their gradients and the optimizer
    state stay fp32, and gradients are reduced in fp32."""
    pbytes, _, a = PRECISION_BYTES[workload.precision]
    return candidate.dp_mode in ("fsdp", "fsdp_grad_op", "hsdp") and candidate.data_shards > 1 and pbytes > a


def residual_bytes(workload: Workload, candidate: Candidate) -> int:
    """Bytes per element of the residual stream (fp32 under autocast, 16-bit under FSDP2's mixed
    precision, which casts each block's input) and of the norms' inputs."""
    if fsdp_mixed_precision(workload, candidate):
        return PRECISION_BYTES[workload.precision][2]
    return 4 if workload.precision in ("32-true", "bf16-mixed", "16-mixed") else 2


def _block_activation_bytes(shape: ModelShape, workload: Workload, candidate: Candidate) -> tuple[float, float]:
    """(bytes one block saves per micro-batch, bytes a checkpointed block keeps: its input)."""
    pbytes, _, a = PRECISION_BYTES[workload.precision]
    r = residual_bytes(workload, candidate)
    t = candidate.tp
    sp = t if candidate.sequence_parallel else 1
    tokens = candidate.micro_batch * workload.seq_len / candidate.cp  # context parallel: a part of each sequence
    d, q = shape.d_model, shape.head_dim
    norms = 2 * d * r * (1 if shape.layernorm else 2) + 16  # inputs (RMSNorm's normalised input too), statistics
    autocast = pbytes > a and not fsdp_mixed_precision(workload, candidate)
    readers = (3 + (2 if shape.gated_mlp else 1)) if autocast else 2  # autocast: every linear casts its own copy
    attention = a * (shape.n_heads + 2 * shape.n_kv_heads) * q + 4 * shape.n_heads
    attention += a * shape.n_heads * q * (1 if shape.learned_positions else 2)  # output, and the copy after rotary
    mlp = a * shape.d_ff * (4 if shape.gated_mlp else 2)
    per_token = norms / sp + readers * a * d + (attention + mlp) / t
    block_input = r * d / sp
    return per_token * tokens, block_input * tokens


def block_activation_bytes(shape: ModelShape, workload: Workload, candidate: Candidate) -> float:
    """Bytes one (not checkpointed) block saves for its backward per micro-batch: what offloading moves."""
    return _block_activation_bytes(shape, workload, candidate)[0]


def _rank_parameters(shape: ModelShape, candidate: Candidate, first: bool, last: bool) -> tuple[float, float]:
    """(parameters on the rank, of which in linear weights) after the tensor-parallel cut."""
    t = candidate.tp
    blocks = rank_blocks(shape, candidate.pp)
    norms = shape.block_parameters - shape.block_matmul_parameters
    params = blocks * (shape.block_matmul_parameters / t + norms)
    matmul = blocks * shape.block_matmul_parameters / t
    if first or (last and shape.tied):
        params += shape.embedding_parameters / t
    if last:
        params += shape.head_parameters / t
        matmul += shape.vocab_size * shape.d_model / t
    return params, matmul


def _shards(candidate: Candidate) -> tuple[int, int, int]:
    """Divisors of (parameters, gradients, optimizer state) by the data-parallel mode."""
    if candidate.dp_mode == "fsdp":
        return candidate.data_shards, candidate.data_shards, candidate.data_shards
    if candidate.dp_mode == "fsdp_grad_op":
        return 1, candidate.data_shards, candidate.data_shards
    if candidate.dp_mode == "hsdp":
        s = candidate.hsdp_shard
        return s, s, s
    return 1, 1, 1


def _rank_estimate(
    shape: ModelShape, workload: Workload, candidate: Candidate, rank: int, *, framework: float
) -> dict[str, float]:
    p = candidate.pp
    first, last = rank == 0, rank == p - 1
    if candidate.schedule in ("zbv", "dualpipev") and p > 1:
        first = last = rank == 0  # V-shaped: rank 0 runs the first and the last stage
    pbytes, gbytes, a = PRECISION_BYTES[workload.precision]
    r = residual_bytes(workload, candidate)
    mixed = fsdp_mixed_precision(workload, candidate)
    gathered = a if mixed else pbytes  # FSDP2 gathers (and computes gradients) in the compute dtype
    params, matmul = _rank_parameters(shape, candidate, first, last)
    p_shard, g_shard, o_shard = _shards(candidate)
    blocks = rank_blocks(shape, p)
    norms = shape.block_parameters - shape.block_matmul_parameters  # replicated under tensor parallelism
    block_params = shape.block_matmul_parameters / candidate.tp + norms
    terms: dict[str, float] = {
        "parameters": params * pbytes / p_shard,
        "gradients": params * gbytes / g_shard,
        "optimizer": params * pbytes * OPTIMIZERS[workload.optimizer] / o_shard,
        "cast_weights": matmul * a if pbytes > a and not mixed else 0.0,
        "fsdp_buffers": 0.0,
        "ddp_buckets": 0.0,
    }
    backward_only = 0.0  # what the backward allocates before the new gradients (the loss's, FSDP's buffers)
    if candidate.dp_mode in ("fsdp", "hsdp") and p_shard > 1 and p > 1:
        # Gathered once for every micro-batch of the step; gradients accumulated unsharded (in the reduce
        # dtype, fp32) and reduce-scattered after the last.
        terms["fsdp_buffers"] = params * gathered
        terms["gradients"] = params * gbytes
    elif candidate.dp_mode in ("fsdp", "hsdp") and p_shard > 1:
        # In the backward: the next block gathered, this one's unsharded gradients (and, under mixed
        # precision, their copy in the reduce dtype the reduce-scatter reads).
        backward_only = block_params * (gathered + (a + gbytes if mixed else gbytes))
        terms["fsdp_buffers"] = block_params * gathered + backward_only + (params - blocks * block_params) * gathered
    elif candidate.dp_mode == "fsdp_grad_op" and candidate.data_shards > 1:
        terms["fsdp_buffers"] = block_params * (a + gbytes if mixed else gbytes)
        if mixed:  # the fp32 shards, and the 16-bit gathered copy held from the forward to the backward
            terms["parameters"] = params * (pbytes / candidate.data_shards + a)
    elif candidate.dp_mode == "ddp" and candidate.data_shards > 1 and candidate.tp == p == 1:
        terms["ddp_buckets"], terms["gradients"] = params * gbytes, 0.0  # the gradients are views of the buckets
    elif candidate.dp_mode == "ddp" and candidate.data_shards > 1:
        terms["fsdp_buffers"] = params * pbytes  # FSDP2's replicate: a gathered copy, forward to backward
    m = candidate.microbatches(workload)
    saved, kept = _block_activation_bytes(shape, workload, candidate)
    checkpointed = candidate.checkpointed_blocks(blocks)
    per_microbatch = (blocks - checkpointed) * saved + checkpointed * kept
    held = in_flight(candidate, m, rank)
    terms["activations"] = held * (per_microbatch - candidate.offloaded_blocks(blocks) * saved)
    terms["logits"] = 0.0
    if last:
        tokens = candidate.micro_batch * workload.seq_len / candidate.cp
        logits = tokens * shape.vocab_size / candidate.tp
        head = tokens * shape.d_model * (r / (candidate.tp if candidate.sequence_parallel else 1) + a)
        last_held = in_flight(candidate, m, p - 1) if p > 1 else 1.0
        terms["logits"] = last_held * (logits * 4 + head) + logits * (8 + a)
        # The loss's backward is over before FSDP gathers the last block again: the larger of the two.
        overlap = min(backward_only, logits * (8 + a))
        terms["fsdp_buffers"] -= overlap
        backward_only += logits * (8 + a) - overlap
    # A checkpointed block's activations are rebuilt in the backward once the blocks after it have
    # freed theirs, and the loss its logits: only what exceeds that adds to the peak.
    last_checkpointed = (
        0
        if checkpointed == 0
        else (blocks - 1 if candidate.checkpointing == "full" else candidate.checkpoint_every * (checkpointed - 1))
    )
    freed = (blocks - 1 - last_checkpointed) * saved if checkpointed else 0.0
    gradient = 2 * kept * (candidate.tp if candidate.sequence_parallel else 1)  # the block's output gradient, twice
    terms["recompute"] = max(0.0, saved + gradient - freed - terms["logits"]) if checkpointed else 0.0
    terms["pipeline_buffers"] = 0.0
    if p > 1:
        tokens = candidate.micro_batch * workload.seq_len / candidate.cp
        width = shape.d_model / (candidate.tp if candidate.sequence_parallel else 1)
        chunks = candidate.stages_per_rank
        terms["pipeline_buffers"] = 2 * m * chunks * tokens * width * a
    if p == 1 and m == 1 and candidate.checkpointing != "full":
        # Lightning frees the last step's gradients between the forward and the backward: they are held
        # with the forward's activations, and count beyond what only the backward allocates. (Under full
        # checkpointing the forward keeps next to nothing: the peak is a block recomputed in the
        # backward, beside the new gradients of the blocks after it.)
        terms["gradients"] = max(0.0, terms["gradients"] - backward_only)
    elif p > 1 and held >= m:
        # Every forward runs before the first backward, which allocates the gradients as it frees one
        # micro-batch's activations (of one stage): counted beyond those only.
        terms["gradients"] = max(0.0, terms["gradients"] - per_microbatch / candidate.stages_per_rank)
    terms["framework"] = framework
    return terms


def estimate_memory(
    shape: ModelShape,
    workload: Workload,
    candidate: Candidate,
    *,
    framework: float = 0.0,
    foreach: bool = True,
    pipeline_rank: int | None = None,
) -> MemoryEstimate:
    """The peak bytes per device of one training step (after the first: optimizer state exists).

    ``foreach``: the optimizer updates all parameters at once (torch's default on CUDA), holding a
    temporary of their size; ``False`` (its default on CPU): one parameter at a time.
    ``pipeline_rank``: the estimate for that pipeline rank (``0 .. pp - 1``; its data- and
    tensor-parallel peers hold the same); by default the larger of the first and the last."""
    ranks = [0] if candidate.pp == 1 else [0, candidate.pp - 1]
    if pipeline_rank is not None:
        if not 0 <= pipeline_rank < candidate.pp:
            raise ValueError(
                f"pipeline_rank={pipeline_rank} is not a pipeline rank of {candidate.name} (pp={candidate.pp}): "
                f"use 0 to {candidate.pp - 1}, or None for the most loaded."
            )
        ranks = [pipeline_rank]
    best: tuple[float, dict[str, float], int, float] | None = None
    for rank in ranks:
        terms = _rank_estimate(shape, workload, candidate, rank, framework=framework)
        params, matmul = _rank_parameters(shape, candidate, rank == 0, rank == candidate.pp - 1)
        pbytes, gbytes, _ = PRECISION_BYTES[workload.precision]
        p_shard, g_shard, o_shard = _shards(candidate)
        if foreach:
            temporary = params * pbytes / o_shard
        else:  # one parameter at a time: the largest
            temporary = (
                pbytes
                * max(shape.vocab_size, shape.d_ff, shape.attention_width)
                * shape.d_model
                / candidate.tp
                / o_shard
            )
        step = (
            params * pbytes / p_shard
            + params * gbytes / g_shard  # (under plain DDP: its buckets, which the gradients are views of)
            + params * pbytes * OPTIMIZERS[workload.optimizer] / o_shard
            + (temporary if OPTIMIZERS[workload.optimizer] else 0.0)
            + framework
        )
        step_peak = step - sum(terms.values())
        terms["optimizer_step"] = max(0.0, step_peak)
        total = sum(terms.values())
        if best is None or total > best[0]:
            best = (total, terms, rank, params)
    assert best is not None
    _, terms, rank, params = best
    where = "only" if candidate.pp == 1 else {0: "first", candidate.pp - 1: "last"}.get(rank, f"rank {rank}")
    saved, _ = _block_activation_bytes(shape, workload, candidate)
    m = candidate.microbatches(workload)
    inputs = {
        "microbatches": m,
        "parameters_on_rank": params,
        "blocks_on_rank": rank_blocks(shape, candidate.pp),
        "offloaded_blocks_on_rank": candidate.offloaded_blocks(rank_blocks(shape, candidate.pp)),
        "block_activation_bytes_per_microbatch": saved,
        "microbatches_in_flight": in_flight(candidate, m, rank),
        "fsdp_mixed_precision": float(fsdp_mixed_precision(workload, candidate)),
    }
    return MemoryEstimate(terms, where, inputs)


def fewest_offloaded_blocks(
    shape: ModelShape, workload: Workload, candidate: Candidate, device_memory: float, **kwargs: Any
) -> tuple[int | None, list[float]]:
    """The fewest blocks per pipeline rank (``Candidate.offload_blocks``, from each rank's first) whose saved
    activations in host memory make ``candidate`` fit ``device_memory`` bytes (``None``: not even all of them),
    and the estimated peak for each count from 0 to the rank's blocks (``kwargs``: :func:`estimate_memory`'s)."""
    totals = [
        estimate_memory(shape, workload, replace(candidate, offload_blocks=n), **kwargs).total
        for n in range(rank_blocks(shape, candidate.pp) + 1)
    ]
    return next((n for n, total in enumerate(totals) if total <= device_memory), None), totals
