"""Peak tensor memory per device of one training step, term by term. No Lightning.

The terms, for the most loaded pipeline rank (the first holds the most micro-batches in flight and the
embedding; the last the head and the logits; both are evaluated and the larger is the peak):

- ``parameters``, ``gradients``, ``optimizer``: the rank's parameters (its blocks, divided by ``tp``;
  the embedding on the first stage and the head on the last, vocabulary-parallel under ``tp``), each
  in its dtype (:data:`~lightning_scale.core.planner.layout.PRECISION_BYTES`), divided by the
  data-parallel shard for the modes that shard them (``fsdp``: all three; ``fsdp_grad_op``: gradients
  and optimizer state, the parameters stay gathered from the forward to the backward; ``hsdp``: like
  ``fsdp`` over its shard group; ``ddp``: none);
- ``cast_weights``: under mixed precision autocast keeps a 16-bit copy of every weight a matmul used
  until the backward is done;
- ``fsdp_buffers``: the gathered parameters of the block in use and the one prefetched, and one
  block's unsharded gradients before their reduce-scatter;
- ``activations``: what one block saves for its backward per micro-batch (below), times the blocks
  of the rank, times the micro-batches the schedule keeps in flight on that rank; checkpointed blocks
  save only their input;
- ``recompute``: a checkpointed block's activations rebuilt in the backward (with the gradient
  arriving at its output), beyond what the blocks after it and the loss freed by then;
- ``logits``: the last stage's output and loss for a micro-batch (log-probabilities saved in fp32 for
  each micro-batch in flight there, plus the logits and their gradient while the loss runs);
- ``pipeline_buffers``: the receive buffers a pipeline stage allocates for every micro-batch
  (activations forward, their gradients backward);
- ``optimizer_step``: the optimizer's temporaries (AdamW's foreach update, torch's default on CUDA,
  holds one buffer the size of all parameters; its per-parameter loop, the default on CPU, the size of
  the largest), counted in the optimizer step's peak, which is taken against the step's forward and
  backward peak;
- ``framework``: a constant for what the runtime holds besides tensors (0 for tensor memory).

Activations saved by one pre-norm decoder block per token, with ``a`` bytes per 16/32-bit matmul
output and ``r`` per element of the residual stream (fp32 under mixed precision): the two norms'
inputs (``2 r d``) and the two linears' inputs they feed (``2 a d``), both divided by ``tp`` only under
sequence parallelism; queries, keys and values (``a (H + 2 K) Q``), attention's output and the
contiguous copy of it the output projection reads (``2 a H Q``) and its log-sum-exp (``4 H``), the MLP's hidden
activations (``2 a F``, or ``4 a F`` gated), all divided by ``tp``. Attention is taken as a fused
(flash or memory-efficient) kernel, which keeps no ``T x T`` matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_scale.core.planner.layout import OPTIMIZERS, PRECISION_BYTES, Candidate, Workload
from lightning_scale.core.planner.shape import ModelShape

__all__ = ["MemoryEstimate", "estimate_memory", "in_flight", "rank_blocks"]


@dataclass(frozen=True)
class MemoryEstimate:
    terms: dict[str, float]
    """Bytes per term at the peak (see the module doc)."""
    rank: str
    """Which pipeline rank peaks: ``"first"`` or ``"last"`` (``"only"`` without a pipeline)."""
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


def _block_activation_bytes(shape: ModelShape, workload: Workload, candidate: Candidate) -> tuple[float, float]:
    """(bytes one block saves per micro-batch, bytes a checkpointed block keeps: its input)."""
    _, _, a = PRECISION_BYTES[workload.precision]
    r = 4 if workload.precision in ("32-true", "bf16-mixed", "16-mixed") else 2
    t = candidate.tp
    tokens = candidate.micro_batch * workload.seq_len
    d, q = shape.d_model, shape.head_dim
    replicated = shape.d_model * (2 * r + 2 * a) + 16  # two norms' inputs, two linears' inputs, norm stats
    sharded = a * (shape.n_heads + 2 * shape.n_kv_heads) * q + 2 * a * shape.n_heads * q + 4 * shape.n_heads
    sharded += a * shape.d_ff * (4 if shape.gated_mlp else 2)
    per_token = replicated / (t if candidate.sequence_parallel else 1) + sharded / t
    block_input = r * d / (t if candidate.sequence_parallel else 1)
    return per_token * tokens, block_input * tokens


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
        return candidate.dp, candidate.dp, candidate.dp
    if candidate.dp_mode == "fsdp_grad_op":
        return 1, candidate.dp, candidate.dp
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
    params, matmul = _rank_parameters(shape, candidate, first, last)
    p_shard, g_shard, o_shard = _shards(candidate)
    blocks = rank_blocks(shape, p)
    block_params = shape.block_parameters / candidate.tp
    terms: dict[str, float] = {
        "parameters": params * pbytes / p_shard,
        "gradients": params * gbytes / g_shard,
        "optimizer": params * pbytes * OPTIMIZERS[workload.optimizer] / o_shard,
        "cast_weights": matmul * a if pbytes > a else 0.0,
        "fsdp_buffers": 0.0,
    }
    if candidate.dp_mode in ("fsdp", "hsdp") and p_shard > 1:
        terms["fsdp_buffers"] = block_params * (2 * pbytes + gbytes)
    elif candidate.dp_mode == "fsdp_grad_op" and candidate.dp > 1:
        terms["fsdp_buffers"] = block_params * gbytes
    m = candidate.microbatches(workload)
    saved, kept = _block_activation_bytes(shape, workload, candidate)
    checkpointed = candidate.checkpointed_blocks(blocks)
    per_microbatch = (blocks - checkpointed) * saved + checkpointed * kept
    terms["activations"] = in_flight(candidate, m, rank) * per_microbatch
    terms["logits"] = 0.0
    if last:
        tokens = candidate.micro_batch * workload.seq_len
        vocab = shape.vocab_size / candidate.tp
        held = in_flight(candidate, m, p - 1) if p > 1 else 1.0
        terms["logits"] = tokens * vocab * (4 * held + 8 + a)
    # A checkpointed block's activations are rebuilt in the backward once the blocks after it have
    # freed theirs, and the loss its logits: only what exceeds that adds to the peak.
    last_checkpointed = 0 if checkpointed == 0 else (blocks - 1 if candidate.checkpointing == "full"
                                                    else candidate.checkpoint_every * (checkpointed - 1))  # fmt: skip
    freed = (blocks - 1 - last_checkpointed) * saved if checkpointed else 0.0
    gradient = 2 * kept * (candidate.tp if candidate.sequence_parallel else 1)  # the block's output gradient, twice
    terms["recompute"] = max(0.0, saved + gradient - freed - terms["logits"]) if checkpointed else 0.0
    terms["pipeline_buffers"] = 0.0
    if p > 1:
        tokens = candidate.micro_batch * workload.seq_len
        width = shape.d_model / (candidate.tp if candidate.sequence_parallel else 1)
        chunks = candidate.stages_per_rank
        terms["pipeline_buffers"] = 2 * m * chunks * tokens * width * a
    if p == 1 and m == 1:
        # Gradients replace activations block by block in the backward: the larger of the two, not both.
        grads, acts = terms["gradients"], terms["activations"] + terms["logits"]
        terms["gradients"] = max(0.0, grads - acts)
    terms["framework"] = framework
    return terms


def estimate_memory(
    shape: ModelShape, workload: Workload, candidate: Candidate, *, framework: float = 0.0,
    foreach: bool = True,
) -> MemoryEstimate:
    """The peak bytes per device of one training step (after the first: optimizer state exists).

    ``foreach``: the optimizer updates all parameters at once (torch's default on CUDA), holding a
    temporary of their size; ``False`` (its default on CPU): one parameter at a time."""
    ranks = [0] if candidate.pp == 1 else [0, candidate.pp - 1]
    best: tuple[float, dict[str, float], int] | None = None
    for rank in ranks:
        terms = _rank_estimate(shape, workload, candidate, rank, framework=framework)
        params, matmul = _rank_parameters(shape, candidate, rank == 0, rank == candidate.pp - 1)
        pbytes, gbytes, _ = PRECISION_BYTES[workload.precision]
        p_shard, g_shard, o_shard = _shards(candidate)
        if foreach:
            temporary = params * pbytes / o_shard
        else:  # one parameter at a time: the largest
            temporary = pbytes * max(shape.vocab_size, shape.d_ff, shape.attention_width) * shape.d_model / candidate.tp / o_shard
        step = (
            params * pbytes / p_shard + params * gbytes / g_shard
            + params * pbytes * OPTIMIZERS[workload.optimizer] / o_shard
            + (temporary if OPTIMIZERS[workload.optimizer] else 0.0) + framework
        )  # fmt: skip
        step_peak = step - sum(terms.values())
        terms["optimizer_step"] = max(0.0, step_peak)
        total = sum(terms.values())
        if best is None or total > best[0]:
            best = (total, terms, rank)
    assert best is not None
    _, terms, rank = best
    where = "only" if candidate.pp == 1 else ("first" if rank == 0 else "last")
    return MemoryEstimate(terms, where, {"microbatches": candidate.microbatches(workload)})
