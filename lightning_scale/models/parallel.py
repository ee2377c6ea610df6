"""The reference GPT's tensor-parallel plan and pipeline spec, registered through the same public
API any model uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_scale.core.checks import divisors
from lightning_scale.core.parallel.tensor_parallel import register_plan
from lightning_scale.core.pipeline.spec import PipelineSpec, labelled_tokens, register_pipeline_spec
from lightning_scale.models.gpt import GPT

__all__ = ["gpt_pipeline_spec", "gpt_tensor_parallel_plan", "language_model_loss"]


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the targets not equal to -100, computed in at least fp32."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


def gpt_pipeline_spec(model: GPT) -> PipelineSpec:
    """Cut between transformer blocks; embeddings on the first stage, final norm and head on the last."""
    first = ["tok_emb"] + (["pos_emb"] if model.pos_emb is not None else [])
    return PipelineSpec(
        blocks=[f"blocks.{key}" for key in model.blocks],
        first=first,
        last=["norm", "head"],
        loss_fn=language_model_loss,
        loss_tokens=labelled_tokens,
    )


def gpt_tensor_parallel_plan(
    model: GPT, tp_size: int, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """Megatron-style plan: heads and MLP columns split over ``tp_size`` ranks.

    - attention: ``wq``/``wk``/``wv`` column-parallel (each rank holds ``n_heads/tp`` query and
      ``n_kv_heads/tp`` key/value heads), ``wo`` row-parallel; MLP: up-projections column-,
      down-projection row-parallel. One all-reduce (or reduce-scatter + all-gather with sequence
      parallelism) per sub-layer, forward and backward.
    - embedding and output head sharded on the vocabulary (a tied pair shares one sharded weight);
      learned positions sharded on positions.
    - ``sequence_parallel``: norms and residual stream sharded on the sequence between sub-layers.
    - ``loss_parallel``: logits stay sharded on the vocabulary into the loss (no all-gather of
      ``batch x seq x vocab``); the loss must run under ``torch.distributed.tensor.parallel.loss_parallel``
      (the strategy does this).
    """
    cfg = model.config
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("vocab_size", cfg.vocab_size)):
        if value % tp_size:
            raise ValueError(
                f"GPT {name}={value} is not divisible by tensor_parallel={tp_size}: each rank must hold a whole share. "
                f"Use tensor_parallel in {divisors(value)} or change model.{name}."
            )
    if cfg.ff_dim % tp_size:
        raise ValueError(f"GPT d_ff={cfg.ff_dim} is not divisible by tensor_parallel={tp_size}; change model.d_ff.")
    if cfg.positional == "learned" and cfg.block_size % tp_size:
        raise ValueError(f"GPT block_size={cfg.block_size} is not divisible by tensor_parallel={tp_size}.")

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "blocks.*.attn.wq": ColwiseParallel(),
        "blocks.*.attn.wk": ColwiseParallel(),
        "blocks.*.attn.wv": ColwiseParallel(),
        "blocks.*.attn.wo": RowwiseParallel(output_layouts=seq),
    }
    if cfg.positional == "learned":
        # Rows are positions: with the sequence sharded each rank looks up its own slice.
        plan["pos_emb"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
        )
    if cfg.mlp == "swiglu":
        plan |= {
            "blocks.*.mlp.w1": ColwiseParallel(),
            "blocks.*.mlp.w3": ColwiseParallel(),
            "blocks.*.mlp.w2": RowwiseParallel(output_layouts=seq),
        }
    else:
        plan |= {"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel(output_layouts=seq)}
    if sequence_parallel:
        plan |= {
            "blocks.*.attn_norm": SequenceParallel(),
            "blocks.*.mlp_norm": SequenceParallel(),
            "norm": SequenceParallel(),
            # Gather the sequence before the projections: (x, rotary) -> x replicated.
            "blocks.*.attn": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "blocks.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
    return plan


register_plan(GPT, gpt_tensor_parallel_plan)
register_pipeline_spec(GPT, gpt_pipeline_spec)
