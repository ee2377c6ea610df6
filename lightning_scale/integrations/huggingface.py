"""Hugging Face ``transformers`` decoder models, unmodified: a LightningModule that just wraps one
(``self.model = LlamaForCausalLM(config)``) trains at any (dp, tp, pp) with no hook written.

- **Tensor parallelism** takes the plan the model carries (``model._tp_plan``, built by transformers
  from ``config.base_model_tp_plan`` and the head's plan), its style names mapped to torch's DTensor
  styles (:data:`HF_STYLES`). A style without a DTensor equivalent here is refused, naming those
  that have one; the head counts must divide by the tensor-parallel size.
- **Pipeline parallelism** cuts the model's own ``nn.ModuleList`` of layers (kept layers keep their
  index names) for the families in :data:`PIPELINE_FAMILIES`. A stage runs the model's own base
  ``forward``: the first stage from ``input_ids``, later stages from the hidden state (as
  ``inputs_embeds``); the final norm is an identity off the last stage, the LM head runs on the
  last only. The loss is transformers' causal-LM loss (:func:`causal_lm_loss`: labels as transformers
  expects them, unshifted; positions labelled -100 ignored), in the logits' precision (float32 at
  least; transformers' own always computes in float32, which in a float64 run rounds), over the
  batch's labelled tokens however they fall into micro-batches. Batches need no ``pipeline_batch``
  hook (:class:`HFBatches`): ``{"input_ids", "labels", ...}`` dicts, whose other entries the model's
  forward takes (``position_ids`` of packed sequences, ``attention_mask``) reach every stage; and
  ``(input_ids, targets)`` pairs, whose targets may be transformers' labels or already shifted
  (the nanoGPT convention), told apart on the data.

Nothing here imports ``transformers``: models are recognised by their class's module
(``transformers.…``), so ``import lightning_scale`` stays light and works without the extra.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_scale.core.checks import divisors, format_choices
from lightning_scale.core.compat import module_children
from lightning_scale.core.parallel.tensor_parallel import register_plan
from lightning_scale.core.pipeline.spec import IGNORE_INDEX, PipelineSpec, labelled_tokens, register_pipeline_spec

__all__ = [
    "HFBatches",
    "HF_STYLES",
    "PIPELINE_FAMILIES",
    "causal_lm_loss",
    "causal_lm_tokens",
    "hf_pipeline_spec",
    "hf_tensor_parallel_plan",
    "is_hf_model",
    "unsupported_pipeline_family",
]

HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # The LM head: vocabulary-sharded weight, logits gathered whole for the model's own loss.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    # The token embedding: vocabulary-sharded rows, the looked-up vectors summed whole.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""transformers' tensor-parallel style names that map onto torch's DTensor styles."""

PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` of the decoder families whose base ``forward`` runs a stage unchanged:
``embed_tokens``, ``layers`` (an ``nn.ModuleList``), ``norm``, ``rotary_emb``, and ``inputs_embeds``
taken as they are (families that rescale embeddings inside ``forward``, like Gemma's, do not)."""


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (known by its class's module)."""
    return (
        type(module).__module__.startswith("transformers.")
        and hasattr(module, "config")
        and hasattr(module, "base_model_prefix")
    )


def _model_type(module: nn.Module) -> str:
    return str(getattr(module.config, "model_type", type(module).__name__))


# ---------------------------------------------------------------- tensor parallelism


def _has_plan(module: nn.Module) -> bool:
    return is_hf_model(module) and bool(
        getattr(module, "tp_plan", None) or getattr(module.config, "base_model_tp_plan", None)
    )


def hf_tensor_parallel_plan(
    model: nn.Module, tp_size: int, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> dict[str, ParallelStyle]:
    """The model's own plan as DTensor styles. ``sequence_parallel``/``loss_parallel`` do not apply:
    transformers' plans keep the residual stream replicated and gather the logits."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", getattr(config, "num_key_value_heads", None) or heads),
    ):
        if isinstance(value, int) and value % tp_size:
            raise ValueError(
                f"{type(model).__name__} has {name}={value}, which tensor_parallel={tp_size} does not divide: each "
                f"rank must hold whole attention heads. Use tensor_parallel in {divisors(value)}."
            )
    plan = dict(getattr(model, "tp_plan", None) or {})  # transformers' public view of its private `_tp_plan`
    if not plan:
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        plan = {(f"{prefix}.{k}" if base is not None else k): v for k, v in (config.base_model_tp_plan or {}).items()}
    unknown = {k: v for k, v in plan.items() if v not in HF_STYLES}
    if unknown:
        raise ValueError(
            f"{type(model).__name__}'s tensor-parallel plan uses style(s) {sorted(set(unknown.values()))} (for "
            f"{sorted(unknown)[:4]}), which lightning-scale cannot apply. Supported transformers styles: "
            f"{format_choices(HF_STYLES)}. Define a tensor_parallel_plan hook on the LightningModule, or use "
            "tensor_parallel=1."
        )
    return {k: HF_STYLES[v]() for k, v in plan.items()}


# ---------------------------------------------------------------- pipeline parallelism


def _supported_causal_lm(module: nn.Module) -> bool:
    return (
        is_hf_model(module)
        and type(module).__name__.endswith("ForCausalLM")
        and _model_type(module) in PIPELINE_FAMILIES
    )


def unsupported_pipeline_family(module: nn.Module) -> str | None:
    """Why a module holding a Hugging Face model cannot be pipelined without a hook (``None``: it can,
    or it holds none)."""
    for name, sub in module.named_modules():
        if is_hf_model(sub) and not _supported_causal_lm(sub):
            return (
                f"{name or type(module).__name__} is a Hugging Face {type(sub).__name__} (model_type="
                f"{_model_type(sub)!r}); pipeline stages are registered for the *ForCausalLM models of the "
                f"{', '.join(PIPELINE_FAMILIES)} families"
            )
    return None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean next-token cross entropy of ``model(input_ids, labels=labels).loss``: ``labels`` unshifted
    (position ``t`` predicts ``labels[t + 1]``), ``ignore_index`` positions left out; computed in the
    logits' precision, float32 at least. ``labels`` may be one position longer than the logits (the
    token after the last input included: how :class:`HFBatches` passes already-shifted targets)."""
    logits = logits[:, : labels.size(1) - 1].flatten(0, 1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=ignore_index)


def causal_lm_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The positions :func:`causal_lm_loss` averages over: the labels after the first not equal to -100."""
    return labelled_tokens(labels[:, 1:])


# Base-model arguments a batch does not choose: the first stage's input and the pipeline's own settings.
_NOT_FROM_BATCH = {"input_ids", "inputs_embeds", "labels", "use_cache", "cache", "past_key_values", "return_dict"}


class HFBatches:
    """``split_batch`` for a transformers causal LM: ``(input_ids, labels, kwargs)`` of a batch.

    - A dict: ``input_ids``, ``labels`` (default: the inputs; transformers' convention, unshifted), and
      as ``kwargs`` (for every stage) the entries the base model's ``forward`` takes by name
      (``position_ids``: packed sequences; ``attention_mask``: padding). Other entries are not used.
    - An ``(input_ids, targets)`` pair: the targets are transformers' labels when they equal the inputs
      at every labelled position, or already shifted (``targets[:, t]`` is the token after
      ``input_ids[:, t]``, the nanoGPT convention) when they equal the inputs moved by one; these
      become labels one position longer (the first input prepended), so :func:`causal_lm_loss` scores
      every position against its target. A batch fitting neither is refused, naming both and the dict
      form; one fitting both (no position tells them apart) takes the convention of the batches before.
    """

    def __init__(self, base: nn.Module) -> None:
        params = inspect.signature(base.forward).parameters
        self.model_inputs = (
            frozenset(name for name, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
            - _NOT_FROM_BATCH
        )
        self.convention: str | None = None  # of (input_ids, targets) pairs, once a batch showed it

    def describe(self) -> str:
        pairs = {
            None: "(input_ids, targets) pairs: whether targets are transformers' labels or already shifted is read "
            "from the first batch",
            "labels": "(input_ids, labels) pairs whose labels are transformers' (unshifted; position t predicts "
            "labels[:, t+1])",
            "shifted": "(input_ids, targets) pairs whose targets are already shifted (targets[:, t] is the token "
            "after input_ids[:, t]: every position is scored against its target)",
        }[self.convention]
        return (
            f"transformers batches: {{'input_ids', 'labels'}} dicts (labels unshifted; entries the model's forward "
            f"takes, of {sorted(self.model_inputs)}, go to every stage), or {pairs}"
        )

    def __call__(self, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        if isinstance(batch, Mapping) and "input_ids" in batch:
            kwargs = {k: v for k, v in batch.items() if k in self.model_inputs and isinstance(v, torch.Tensor)}
            return batch["input_ids"], batch.get("labels", batch["input_ids"]), kwargs
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, targets = batch
            if self._shifted(inputs, targets):
                # transformers' labels for the window and the token after it: label t + 1 is target t.
                return inputs, torch.cat([inputs[:, :1], targets], dim=1), {}
            return inputs, targets, {}
        raise TypeError(
            f"A Hugging Face model's pipeline takes {{'input_ids', 'labels'}} dicts or (input_ids, targets) pairs, got "
            f"a {type(batch).__name__}. Define `pipeline_batch(self, batch) -> (inputs, target)` on the LightningModule."
        )

    def _shifted(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        if (
            not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor))
            or inputs.shape != targets.shape
        ):
            raise ValueError(
                f"(input_ids, targets) pairs for a Hugging Face model need targets of the inputs' shape, got "
                f"{tuple(getattr(inputs, 'shape', ()))} and {tuple(getattr(targets, 'shape', ()))}."
            )
        labelled = targets != IGNORE_INDEX
        as_labels = bool(((targets == inputs) | ~labelled).all())
        shifted = bool(((targets[:, :-1] == inputs[:, 1:]) | ~labelled[:, :-1]).all())
        if as_labels != shifted:
            seen = "shifted" if shifted else "labels"
            if self.convention not in (None, seen):
                raise ValueError(
                    f"This (input_ids, targets) batch's targets are {'already shifted' if shifted else 'unshifted labels'}, "
                    f"but the batches before were {'already shifted' if self.convention == 'shifted' else 'unshifted labels'}: "
                    "one dataset should keep one convention. Pass {'input_ids', 'labels'} dicts (transformers' convention)."
                )
            self.convention = seen
        elif as_labels and self.convention is None and bool(labelled.any()):
            raise ValueError(
                "This (input_ids, targets) batch fits both conventions (its tokens repeat), so the pipeline cannot tell "
                "whether its targets are transformers' labels or already shifted. Pass {'input_ids', 'labels'} dicts "
                "(transformers' convention), or define pipeline_batch(self, batch) on the LightningModule."
            )
        elif not as_labels:
            raise ValueError(
                "The (input_ids, targets) pairs fed to this Hugging Face model are neither transformers' labels (equal "
                "to input_ids at every labelled position; position t predicts labels[:, t+1]) nor already shifted "
                "(targets[:, t] == input_ids[:, t+1], the nanoGPT convention), so the pipeline cannot tell what "
                "its loss should compare. Pass {'input_ids', 'labels'} dicts (transformers' convention), or define "
                "`pipeline_batch(self, batch) -> (inputs, target)` and a pipeline_spec whose loss_fn fits your targets."
            )
        return self.convention == "shifted"


def _check_layer_types(base: nn.Module) -> None:
    # The base forward picks each layer's attention mask by the layer's position in the list, which
    # on a later stage is not its index in the model: the kept layers' types must line up.
    types = getattr(base.config, "layer_types", None)
    if not types:
        return
    kept = [int(k) for k in module_children(base.layers)]
    if any(types[position] != types[index] for position, index in enumerate(kept)):
        raise ValueError(
            f"{type(base).__name__} mixes attention types across layers ({sorted(set(types))}); its forward "
            "looks each layer's type up by its position in the list, which a pipeline stage changes. Use "
            "pipeline_parallel=1, or one attention type for every layer."
        )


def _stage_forward(model: nn.Module, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    base = getattr(model, model.base_model_prefix)
    _check_layer_types(base)
    first = {"input_ids": inputs} if base.embed_tokens is not None else {"inputs_embeds": inputs}
    # Called as the model's own forward calls it (no `use_cache` of ours): whether a cache exists
    # changes transformers' attention mask for packed position_ids.
    hidden = base(**first, **kwargs).last_hidden_state
    head = getattr(model, "lm_head", None)
    return head(hidden) if head is not None else hidden


def hf_pipeline_spec(model: nn.Module) -> PipelineSpec:
    """Cut between the decoder layers; embedding on the first stage, final norm and LM head on the last."""
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    return PipelineSpec(
        blocks=[f"{prefix}.layers.{i}" for i in range(len(base.layers))],
        first=[f"{prefix}.embed_tokens"],
        last=[f"{prefix}.norm", "lm_head"],
        identity=[f"{prefix}.norm"],
        loss_fn=causal_lm_loss,
        loss_tokens=causal_lm_tokens,
        stage_forward=_stage_forward,
        split_batch=HFBatches(base),
    )


register_plan(_has_plan, hf_tensor_parallel_plan)
register_pipeline_spec(_supported_causal_lm, hf_pipeline_spec)
