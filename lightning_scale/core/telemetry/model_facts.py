"""What a whole model is, known on every rank after it is cut: parameter counts and FLOPs per token.

:meth:`ModelFacts.of` reads them from the **whole** module, once, before pipeline pruning and
tensor or FSDP sharding (or from a module whose parameters are DTensors, which report their global
size): afterwards a pipeline stage holds only its blocks. No Lightning.

FLOPs per token, in order of preference:

1. the module's hook ``flops_per_token(seq_len) -> float`` (training FLOPs, forward and backward,
   per token at that sequence length). It is called during training, after the model is cut:
   compute it from the model's config or from these facts, not from the module's parameters;
2. the analytic count of :mod:`lightning_scale.core.telemetry.flops` for a decoder transformer whose
   config gives layers, heads and width (the reference GPT's ``GPTConfig``, Hugging Face configs);
   mixture-of-experts configs are left out (only the routed experts' share of ``N`` runs);
3. a count by ``torch.utils.flop_counter.FlopCounterMode`` of one training step (``training_step``,
   else ``forward``, and the backward) of the module on meta tensors (nothing computed, nothing
   allocated) with an example batch's shapes, taken before the cut: valid at that batch's sequence
   length.

None of these applies: ``flops_per_token`` returns ``None`` and MFU is not reported.

Hardware FLOPs add what activation checkpointing makes the backward recompute. That is counted, not
assumed: torch's non-reentrant checkpoint stops re-running a block's forward as soon as the tensors
its backward needs are regenerated (a block's last linear layer, whose output nothing saves, is not
recomputed), and the layers outside the blocks (embeddings, the head) are never recomputed.
:meth:`ModelFacts.measure_recomputation` counts, with ``FlopCounterMode`` over one training step on
meta tensors with every block wrapped by the package's own checkpointing, the FLOPs each block's
recomputation costs; ``checkpointed_blocks`` says which blocks a run wraps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_scale.core.compat import module_hooks_suspended
from lightning_scale.core.parallel.blocks import apply_activation_checkpointing
from lightning_scale.core.telemetry.flops import (
    matmul_parameters,
    measured_flops_per_token,
    transformer_flops_per_token,
)

__all__ = [
    "FLOPS_HOOK",
    "ModelFacts",
    "Recomputation",
    "TransformerShape",
    "batch_shape",
    "meta_step",
    "transformer_shape",
]

FLOPS_HOOK = "flops_per_token"

_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class TransformerShape:
    n_layers: int
    n_heads: int
    """Query heads."""
    head_dim: int


def _config_of(module: nn.Module) -> Any:
    """The first ``config`` attribute on the module or its submodules (HF models, the reference GPT)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and not isinstance(config, (Mapping, str)):
            return config
    return None


def transformer_shape(config: Any) -> TransformerShape | None:
    """Layers, query heads and head width from a ``GPTConfig`` or a Hugging Face config (``None``: not
    a plain decoder transformer's config, or a mixture of experts)."""
    if config is None or any(getattr(config, name, None) for name in _MOE_FIELDS):
        return None

    def first(*names: str) -> Any:
        return next((v for v in (getattr(config, n, None) for n in names) if isinstance(v, int) and v > 0), None)

    layers = first("n_layers", "num_hidden_layers", "n_layer")
    heads = first("n_heads", "num_attention_heads", "n_head")
    width = first("d_model", "hidden_size", "n_embd")
    if layers is None or heads is None or width is None:
        return None
    head_dim = first("head_dim") or width // heads
    return TransformerShape(layers, heads, head_dim)


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(samples, tokens per sample)`` of a batch: its token tensor is the batch itself, the first
    element of a tuple or list, or a mapping's ``input_ids`` (else its first tensor). Integer (token
    id) tensors have ``numel / samples`` tokens per sample; floating-point inputs (features, images)
    count one per sample. ``None`` when no tensor is found."""
    tokens = batch
    if isinstance(batch, (tuple, list)):  # (checked first: the usual batch, and cheaper than the Mapping check)
        tokens = batch[0] if batch else None
    elif isinstance(batch, Mapping):
        tokens = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    if not isinstance(tokens, torch.Tensor):
        return None
    shape = tokens.shape  # (read once: called every training step)
    if not shape:
        return None
    samples, dtype = shape[0], tokens.dtype
    if dtype.is_floating_point or dtype.is_complex:
        return samples, 1
    return samples, (math.prod(shape[1:]) if samples else 0)


@dataclass(frozen=True)
class Recomputation:
    """What activation checkpointing makes the backward recompute, counted by ``FlopCounterMode`` over
    one training step on meta tensors (:meth:`ModelFacts.measure_recomputation`)."""

    seq_len: int
    """Tokens per sample of the counted step."""
    model_flops: float
    """Training FLOPs per token of the step without any recomputation, as the counter counts them."""
    blocks: tuple[float, ...]
    """Per block, in the model's block order: FLOPs per token that re-running its forward adds to the
    backward when the block is checkpointed."""


@dataclass
class ModelFacts:
    """Counts of the whole model (see the module doc). ``parameters`` counts each tied weight once;
    ``non_embedding_parameters`` leaves out ``nn.Embedding`` tables (token and position);
    ``matmul_parameters`` is ``N`` of ``6N``: the linear layers' weights, a tied head included."""

    parameters: int
    non_embedding_parameters: int
    matmul_parameters: int
    shape: TransformerShape | None = None
    hook: Callable[[int], float] | None = field(default=None, repr=False)
    measured: tuple[int, float] | None = None
    """``(seq_len, flops per token)`` counted by ``FlopCounterMode`` at set-up."""
    recomputation: Recomputation | None = None
    """Per block, the FLOPs its checkpointing recomputes (``None``: not counted)."""
    checkpointed_blocks: tuple[int, ...] = ()
    """Indices (in the model's block order) of the blocks activation checkpointing wraps, on every
    pipeline stage together."""
    _cache: dict[int, float | None] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, module: nn.Module) -> ModelFacts:
        params = {id(p): p for p in module.parameters()}
        embeddings = {
            id(sub.weight) for sub in module.modules() if isinstance(sub, nn.Embedding) and id(sub.weight) in params
        }
        total = sum(p.numel() for p in params.values())
        hook = getattr(module, FLOPS_HOOK, None)
        return cls(
            parameters=total,
            non_embedding_parameters=total - sum(params[i].numel() for i in embeddings),
            matmul_parameters=matmul_parameters(module),
            shape=transformer_shape(_config_of(module)),
            hook=hook if callable(hook) else None,
        )

    @property
    def source(self) -> str:
        """Where :meth:`flops_per_token` comes from: ``"hook"``, ``"analytic"``, ``"measured"`` or ``"none"``."""
        if self.hook is not None:
            return "hook"
        if self.shape is not None:
            return "analytic"
        return "measured" if self.measured is not None else "none"

    def flops_per_token(self, seq_len: int, *, causal: bool = False) -> float | None:
        """Training FLOPs (forward and backward) per token at ``seq_len`` tokens per sample."""
        key = seq_len * 2 + causal
        if key not in self._cache:
            self._cache[key] = self._flops(seq_len, causal)
        return self._cache[key]

    def _flops(self, seq_len: int, causal: bool) -> float | None:
        if self.hook is not None:
            value = float(self.hook(seq_len))
            if not value > 0:
                raise ValueError(f"{FLOPS_HOOK}({seq_len}) returned {value!r}; it must be a positive number of FLOPs.")
            return value
        if self.shape is not None:
            s = self.shape
            return transformer_flops_per_token(
                self.matmul_parameters, s.n_layers, s.n_heads, s.head_dim, seq_len, causal=causal
            )
        return self.measured[1] if self.measured is not None else None

    def recomputed_share(self) -> float | None:
        """What recomputing the ``checkpointed_blocks`` adds to a training step, as a share of the step's
        model FLOPs (both counted at ``recomputation.seq_len``): ``0.0`` when no block is checkpointed,
        ``None`` when blocks are but their recomputation was not counted."""
        if not self.checkpointed_blocks:
            return 0.0
        r = self.recomputation
        return None if r is None else sum(r.blocks[i] for i in self.checkpointed_blocks) / r.model_flops

    def recomputed_flops_per_token(self, seq_len: int, *, causal: bool = False) -> float | None:
        """FLOPs per token that activation checkpointing adds to a training step at ``seq_len`` (hardware
        FLOPs minus model FLOPs): :meth:`recomputed_share` of :meth:`flops_per_token`. At the counted
        length, with a model count equal to the counter's (the analytic count of the reference GPT), it
        is the counter's own figure; at other lengths, or ``causal``, it scales with the model count."""
        share = self.recomputed_share()
        if not share or self.recomputation is None:
            return share
        model = self.flops_per_token(seq_len, causal=causal)
        return share * (model if model is not None else self.recomputation.model_flops)

    def measure(self, module: nn.Module, batch: Any) -> bool:
        """Count the FLOPs of one training step of ``module`` on meta copies of its tensors and of
        ``batch``'s (:func:`meta_step`): its ``training_step(batch, 0)`` when it has one (a
        LightningModule; ``log``/``log_dict`` silenced), else its ``forward``. ``False`` when the
        module cannot run so (it needs real values: data-dependent shapes, ``.item()``)."""
        shape = batch_shape(batch)
        if shape is None or shape[0] * shape[1] == 0:
            return False
        methods = ["training_step", "forward"] if callable(getattr(module, "training_step", None)) else ["forward"]
        for method in methods:
            try:
                flops = measured_flops_per_token(lambda: meta_step(module, batch, method), shape[0] * shape[1])
            except Exception:
                continue
            if flops > 0:
                self.measured = (shape[1], flops)
                self._cache.clear()
                return True
        return False

    def measure_recomputation(self, module: nn.Module, batch: Any, blocks: Sequence[nn.Module]) -> bool:
        """Count, in one training step of ``module`` on meta tensors (as :meth:`measure`), what each of
        ``blocks`` costs the backward when it is checkpointed: every block is wrapped by the package's
        own activation checkpointing (non-reentrant ``torch.utils.checkpoint``) for the step, and the
        FLOPs ``FlopCounterMode`` counts while the backward re-runs a block's forward are that block's.
        The blocks are restored afterwards. ``False`` when the step cannot run on meta tensors."""
        from torch.utils.flop_counter import FlopCounterMode

        shape = batch_shape(batch)
        if shape is None or shape[0] * shape[1] == 0 or not blocks:
            return False
        tokens = shape[0] * shape[1]
        counter = FlopCounterMode(display=False)
        recomputed = [0.0] * len(blocks)
        in_backward = [False]

        def counted(index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                if not in_backward[0]:
                    return forward(*args, **kwargs)
                before = counter.get_total_flops()
                try:  # the recomputation ends early by raising once the saved tensors are regenerated
                    return forward(*args, **kwargs)
                finally:
                    recomputed[index] += counter.get_total_flops() - before

            return run

        methods = ["training_step", "forward"] if callable(getattr(module, "training_step", None)) else ["forward"]
        saved = [dict(block.__dict__) for block in blocks]
        try:
            for index, block in enumerate(blocks):
                # The count wraps the block's own forward, inside the checkpoint: it sees the recomputation.
                block.forward = counted(index, block.forward)  # type: ignore[method-assign]
                apply_activation_checkpointing([block], "full")
            for method in methods:
                recomputed[:], in_backward[0] = [0.0] * len(blocks), False
                try:
                    with counter:
                        meta_step(module, batch, method, before_backward=lambda: in_backward.__setitem__(0, True))
                except Exception:
                    continue
                total = counter.get_total_flops()
                if total > 0:
                    self.recomputation = Recomputation(
                        seq_len=shape[1],
                        model_flops=(total - sum(recomputed)) / tokens,
                        blocks=tuple(f / tokens for f in recomputed),
                    )
                    return True
            return False
        finally:
            for block, before in zip(blocks, saved):
                _restore_attributes(block, before)


def _restore_attributes(module: nn.Module, before: Mapping[str, Any]) -> None:
    """Undo what was set on ``module`` itself since ``before`` (a copy of its ``__dict__``)."""
    for name in [n for n in module.__dict__ if n not in before]:
        del module.__dict__[name]
    for name, value in before.items():
        if module.__dict__.get(name) is not value:
            module.__dict__[name] = value


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _first_float(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((t for t in map(_first_float, values) if t is not None), None)


_SILENCED = ("log", "log_dict")


def meta_step(
    module: nn.Module, batch: Any, method: str = "forward", *, before_backward: Callable[[], None] | None = None
) -> None:
    """One forward (``method="forward"``: the batch itself, a tuple's first element, or a mapping's
    items as keyword arguments) or ``training_step(batch, 0)``, then a backward, with every parameter,
    buffer and input on the meta device: ``torch.func.functional_call`` swaps them in, so the module's
    own tensors are not touched. For ``training_step``, ``log`` and ``log_dict`` do nothing meanwhile.
    The backward runs while the meta tensors are still swapped in (a checkpointed block recomputes its
    forward then); ``before_backward`` is called between the two."""
    state = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad and t.is_floating_point())
        for name, t in [*module.named_parameters(), *module.named_buffers()]
    }
    batch = _to_meta(batch)

    def backward(output: Any) -> None:
        loss = _first_float(output)
        if loss is None:
            raise ValueError(f"{type(module).__name__}.{method} returned no floating-point tensor to differentiate.")
        if before_backward is not None:
            before_backward()
        loss.float().sum().backward()

    # The modules' own forward and backward hooks do not see the meta run (a user's hook recording
    # activations would record meta tensors).
    with module_hooks_suspended(module):
        _call(module, state, batch, method, backward)


def _call(
    module: nn.Module, state: dict[str, torch.Tensor], batch: Any, method: str, backward: Callable[[Any], None]
) -> None:
    """``functional_call`` of a stand-in ``forward`` that runs the step and its ``backward``, both with
    ``state`` swapped in."""
    if method == "forward":
        if isinstance(batch, Mapping):
            args, kwargs = (), dict(batch)
        else:
            args, kwargs = ((batch[0],) if isinstance(batch, (tuple, list)) else (batch,)), {}
        forward = module.forward

        def step() -> Any:
            return forward(*args, **kwargs)
    else:
        training_step = getattr(module, method)

        def step() -> Any:
            return training_step(batch, 0)

    patched = {"forward": lambda: backward(step()), **{name: lambda *a, **k: None for name in _SILENCED}}
    saved = {name: module.__dict__[name] for name in patched if name in module.__dict__}
    module.__dict__.update(patched)
    try:
        torch.func.functional_call(module, state, ())
    finally:
        for name in patched:
            module.__dict__.pop(name, None)
        module.__dict__.update(saved)
