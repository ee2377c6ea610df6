"""The shape of a decoder transformer, as much as the planner needs: counts of parameters, of the
weights that multiply activations, and the widths activations have.

Read from the reference GPT's ``GPTConfig`` or a Hugging Face decoder config (Llama, Mistral, Qwen2,
GPT-2, GPT-NeoX and the like), both by attribute name, so no model code is imported. No Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_scale.core.checks import check_positive_int

__all__ = ["ModelShape", "model_shape"]

_GATED_ACTS = ("silu", "swiglu", "swish", "geglu")
_BIASED = ("gpt2", "gpt_neox", "gpt_bigcode")
"""Hugging Face model types whose linears and norms all carry biases (their configs have no flag)."""


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    gated_mlp: bool = False
    """Three MLP matrices (SwiGLU: gate, up, down) instead of two."""
    tied: bool = False
    """The output head shares the token embedding's weight."""
    bias: bool = False
    learned_positions: int = 0
    """Rows of a learned position embedding (0: rotary or none)."""
    layernorm: bool = True
    """LayerNorm rather than RMSNorm (a LayerNorm has a bias when the model has biases)."""
    name: str = "model"

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            check_positive_int(f"ModelShape.{field}", getattr(self, field))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelShape: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}; "
                "grouped-query attention shares each key/value head among a whole number of query heads."
            )

    # -- parameters -----------------------------------------------------------------------------

    @property
    def attention_width(self) -> int:
        """Query heads times their width (the output projection's input)."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def block_matmul_parameters(self) -> int:
        """Weights of one block's linear layers."""
        d = self.d_model
        attention = d * self.attention_width * 2 + d * self.kv_width * 2
        mlp = (3 if self.gated_mlp else 2) * d * self.d_ff
        return attention + mlp

    @property
    def _norm_parameters(self) -> int:
        """One norm: a weight, and a bias for a LayerNorm of a model with biases."""
        return self.d_model * (2 if self.layernorm and self.bias else 1)

    @property
    def block_parameters(self) -> int:
        norms = 2 * self._norm_parameters
        biases = (
            (
                self.attention_width
                + 2 * self.kv_width
                + self.d_model
                + self.d_ff * (2 if self.gated_mlp else 1)
                + self.d_model
            )
            if self.bias
            else 0
        )
        return self.block_matmul_parameters + norms + biases

    @property
    def embedding_parameters(self) -> int:
        """Token (and learned position) embeddings."""
        return (self.vocab_size + self.learned_positions) * self.d_model

    @property
    def head_parameters(self) -> int:
        """The output head's own weight (0 when tied) and the final norm."""
        return self._norm_parameters + (0 if self.tied else self.vocab_size * self.d_model)

    @property
    def parameters(self) -> int:
        return self.n_layers * self.block_parameters + self.embedding_parameters + self.head_parameters

    @property
    def matmul_parameters(self) -> int:
        """``N`` of the FLOPs count: every linear weight, the head's matmul included even when tied."""
        return self.n_layers * self.block_matmul_parameters + self.vocab_size * self.d_model

    # -- FLOPs ----------------------------------------------------------------------------------

    def block_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward and backward) of one block per token: ``6 n + 12 H Q T`` (see
        :mod:`lightning_scale.core.telemetry.flops`; full attention product, as ``FlopCounterMode`` counts)."""
        return 6.0 * self.block_matmul_parameters + 12.0 * self.attention_width * seq_len

    def attention_flops_per_token(self, seq_len: int) -> float:
        """The ``12 H Q T`` of :meth:`block_flops_per_token`: attention's two products, forward and
        backward, over the full sequence (a causal kernel executes half of it)."""
        return 12.0 * self.attention_width * seq_len

    def elementwise_bytes_per_token(self, activation_bytes: int, residual_bytes: int) -> float:
        """Bytes one block's memory-bound operators read and write per token in eager PyTorch, forward
        and backward (the backward about twice the forward: each reads its input and the output's
        gradient and writes the input's). Per token, the forward: two norms (read ``d``, write ``d``)
        and two residual adds (read ``2 d``, write ``d``) at the residual stream's width ``r``; at the
        activation width ``a``: queries, keys and values copied heads-major (``2 (H + 2 K) Q``), the
        attention's output copied back (``2 H Q``), rotary embeddings on queries and keys (read and
        write, and the tables: ``3 (H + K) Q``), the MLP's activation (``2 F``; gated ``5 F``: SiLU,
        then the product of two). Biases are added inside the matmuls."""
        d, q = self.d_model, self.head_dim
        residual = (2 * 2 + 2 * 3) * d * residual_bytes
        heads = 2 * (self.n_heads + 2 * self.n_kv_heads) * q + 2 * self.n_heads * q
        rotary = 0 if self.learned_positions else 3 * (self.n_heads + self.n_kv_heads) * q
        mlp = (5 if self.gated_mlp else 2) * self.d_ff
        return 3.0 * (residual + (heads + rotary + mlp) * activation_bytes)

    def float8_cast_elements_per_token(self) -> float:
        """Elements a block scales and casts to float8 per token: the inputs of its linears in the forward
        (``2 d + H Q + F``: the norms' outputs feed the query/key/value and MLP input projections) and the
        gradients of their outputs in the backward (``(H + 2 K) Q + d + F`` or ``2 F`` gated, ``+ d``)."""
        q = self.head_dim
        forward = 2 * self.d_model + self.n_heads * q + self.d_ff
        backward = (
            (self.n_heads + 2 * self.n_kv_heads) * q + 2 * self.d_model + self.d_ff * (2 if self.gated_mlp else 1)
        )
        return float(forward + backward)

    def loss_bytes_per_token(self, activation_bytes: int) -> float:
        """Bytes the loss moves per token over the vocabulary: forward, the head's output written
        (``a``), cast to fp32 (``a + 4``), the log-softmax read and written (``8``); backward, its
        gradient from the saved output and the incoming gradient (``12``) and the cast back (``4 + a``)."""
        return self.vocab_size * (3 * activation_bytes + 28)

    def gemm_size(self, tokens: float, tp: int = 1) -> float:
        """The blocks' matmuls' effective size at ``tokens`` rows a micro-batch, their columns split over
        ``tp`` ranks: the FLOP-weighted harmonic mean of each matmul's ``1 / (1/M + 1/N + 1/K)`` (its
        FLOPs per element it reads and writes; about its smallest dimension when one is much smaller than
        the others, larger when all are large). The backward's two matmuls of each weight have the same
        three dimensions. Per matmul, ``(M, N, K)``: queries, keys and values ``(T, (H + 2 K) Q / tp, d)``,
        the output projection ``(T, d, H Q / tp)``, the MLP's input (each of a gated MLP's two)
        ``(T, F / tp, d)`` and output ``(T, d, F / tp)``."""
        d, q, f = self.d_model, self.head_dim, self.d_ff
        qkv = (self.n_heads + 2 * self.n_kv_heads) * q
        gemms = [  # (FLOPs weight, N, K)
            (d * qkv, qkv / tp, d),
            (d * self.n_heads * q, d, self.n_heads * q / tp),
            ((2 if self.gated_mlp else 1) * d * f, f / tp, d),
            (d * f, d, f / tp),
        ]
        total = sum(w for w, _, _ in gemms)
        inverse = sum(w * (1 / tokens + 1 / max(n, 1.0) + 1 / max(k, 1.0)) for w, n, k in gemms) / total
        return 1.0 / inverse

    def head_gemm_size(self, tokens: float, tp: int = 1) -> float:
        """The head's matmul ``(T, V / tp, d)`` as :meth:`gemm_size` measures it."""
        return 1.0 / (1 / tokens + tp / self.vocab_size + 1 / self.d_model)

    def head_flops_per_token(self) -> float:
        return 6.0 * self.vocab_size * self.d_model

    def flops_per_token(self, seq_len: int) -> float:
        return self.n_layers * self.block_flops_per_token(seq_len) + self.head_flops_per_token()


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def model_shape(config: Any, name: str | None = None) -> ModelShape:
    """The shape of a ``GPTConfig``, a Hugging Face decoder config (or a dict of either's fields).

    Raises a ``ValueError`` naming the fields it could not find (mixture-of-experts configs are
    refused: only the routed experts' share of the MLP runs per token, which this shape cannot say)."""
    if isinstance(config, ModelShape):
        return config
    if any(_first(config, f) for f in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")):
        raise ValueError(
            f"{type(config).__name__} is a mixture-of-experts config; the planner models dense decoders only."
        )
    layers = _first(config, "n_layers", "num_hidden_layers", "n_layer")
    width = _first(config, "d_model", "hidden_size", "n_embd")
    heads = _first(config, "n_heads", "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    missing = [
        n for n, v in (("layers", layers), ("width", width), ("heads", heads), ("vocab_size", vocab)) if v is None
    ]
    if missing:
        raise ValueError(
            f"Cannot read a decoder's shape from {type(config).__name__}: no {', '.join(missing)} "
            "(looked for n_layers/num_hidden_layers/n_layer, d_model/hidden_size/n_embd, "
            "n_heads/num_attention_heads/n_head, vocab_size). Pass a ModelShape instead."
        )
    kv = _first(config, "kv_heads", "n_kv_heads", "num_key_value_heads") or heads
    head_dim = _first(config, "head_dim") or width // heads
    act = str(_first(config, "mlp", "hidden_act", "activation_function") or "gelu").lower()
    gated = any(g in act for g in _GATED_ACTS)
    d_ff = _first(config, "ff_dim", "intermediate_size", "n_inner", "d_ff") or 4 * width
    tied = _first(config, "tie_embeddings", "tie_word_embeddings")
    positional = _first(config, "positional")
    learned = 0
    if positional == "learned":
        learned = _first(config, "block_size") or 0
    elif positional is None and _first(config, "n_positions") and not _first(config, "rope_theta", "rotary_pct"):
        learned = _first(config, "n_positions")  # GPT-2
    norm = str(
        _first(config, "norm") or ("layernorm" if _first(config, "layer_norm_epsilon", "layer_norm_eps") else "rmsnorm")
    )
    return ModelShape(
        n_layers=int(layers),
        d_model=int(width),
        n_heads=int(heads),
        n_kv_heads=int(kv),
        head_dim=int(head_dim),
        d_ff=int(d_ff),
        vocab_size=int(vocab),
        gated_mlp=gated,
        tied=bool(tied) if tied is not None else True,
        bias=bool(_first(config, "bias", "attention_bias") or _first(config, "model_type") in _BIASED),
        learned_positions=int(learned),
        layernorm=norm == "layernorm",
        name=name or type(config).__name__,
    )
