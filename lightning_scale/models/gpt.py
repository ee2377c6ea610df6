"""Reference decoder-only transformer.

Parameter names are stable at every layout: the blocks live in an ``nn.ModuleDict`` keyed
``"0" .. "L-1"``, so removing blocks to build a pipeline stage leaves ``blocks.7.attn.wq.weight``
named exactly that, and a checkpoint saved at one (dp, pp, tp) loads at any other. Attention uses
separate ``wq``/``wk``/``wv`` projections and derives the local head count from the tensor shape,
so sharding the projections on heads (tensor parallelism) needs no change to ``forward``.

Module tree (``GPTConfig(n_layers=2)``)::

    tok_emb                     Embedding(vocab_size, d_model)
    pos_emb                     Embedding(block_size, d_model)      only positional="learned"
    blocks.{i}.attn_norm        LayerNorm | RMSNorm
    blocks.{i}.attn.{wq,wk,wv,wo}
    blocks.{i}.mlp_norm
    blocks.{i}.mlp.{fc,proj}    mlp="gelu"       or  blocks.{i}.mlp.{w1,w2,w3}   mlp="swiglu"
    norm
    head                        Linear(d_model, vocab_size); weight is tok_emb.weight when tied
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_scale.core.checks import check_positive_int, divisors, format_choices, suggest_multiples

__all__ = ["GPT", "GPTConfig", "PRESETS"]

_POSITIONAL = ("learned", "rope")
_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and options of :class:`GPT`. Every field is checked in ``__post_init__``."""

    vocab_size: int = 256
    """Number of token ids; 256 for the bundled byte-level data."""
    block_size: int = 256
    """Longest sequence the model accepts (its context)."""
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``n_heads`` (plain multi-head)."""
    d_model: int = 128
    d_ff: int | None = None
    """MLP hidden width; ``None`` means ``4 * d_model`` for gelu, LLaMA's ``8/3 * d_model``
    rounded up to a multiple of 256 for swiglu."""
    positional: str = "learned"
    """``"learned"`` (GPT-2 absolute embeddings) or ``"rope"`` (rotary, LLaMA)."""
    rope_theta: float = 10000.0
    norm: str = "layernorm"
    """``"layernorm"`` or ``"rmsnorm"``."""
    mlp: str = "gelu"
    """``"gelu"`` (GPT-2) or ``"swiglu"`` (LLaMA)."""
    bias: bool = False
    """Biases in linears and LayerNorms (GPT-2 has them)."""
    tie_embeddings: bool = True
    """Share the output head's weight with the token embedding."""
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layers", "n_heads", "d_model"):
            check_positive_int(f"GPTConfig.{name}", getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}, so heads would "
                f"have a fractional size. Use n_heads in {divisors(self.d_model)} or d_model in "
                f"{suggest_multiples(self.d_model, self.n_heads)}."
            )
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"GPTConfig: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (each key/value "
                f"head serves a whole group of query heads). Use n_kv_heads in {divisors(self.n_heads)}."
            )
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ValueError(f"GPTConfig.d_ff must be a positive integer or None, got {self.d_ff!r}")
        for name, allowed in (("positional", _POSITIONAL), ("norm", _NORMS), ("mlp", _MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of {format_choices(allowed)}.")
        if self.positional == "rope" and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig: rotary positions rotate pairs of channels, so head_dim=d_model/n_heads="
                f"{self.head_dim} must be even. Change d_model or n_heads, or use positional='learned'."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must lie in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ff_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return 256 * math.ceil(int(8 * self.d_model / 3) / 256)
        return 4 * self.d_model

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The named preset (see :data:`PRESETS`), with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"Unknown GPT preset {name!r}. Valid presets: {format_choices(PRESETS)}.")
        return dataclasses.replace(PRESETS[name], **overrides)

    @classmethod
    def coerce(cls, value: GPTConfig | Mapping[str, Any] | str) -> GPTConfig:
        """Accept a config, a mapping of its fields (e.g. from a checkpoint's hparams) or a preset name."""
        if isinstance(value, GPTConfig):
            return value
        if isinstance(value, str):
            return cls.from_preset(value)
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - fields)
            if unknown:
                raise ValueError(f"Unknown GPTConfig fields {unknown}. Valid fields: {sorted(fields)}.")
            return cls(**dict(value))
        raise TypeError(f"Expected a GPTConfig, a mapping of its fields or a preset name, got {type(value).__name__}")


PRESETS: dict[str, GPTConfig] = {
    # Under 1M parameters: tests and the 3-minute quickstart on 2 CPU cores.
    "tiny": GPTConfig(vocab_size=256, block_size=256, n_layers=4, n_heads=4, d_model=128),
    # ~10.9M parameters on bytes: CPU benchmarks.
    "small": GPTConfig(vocab_size=256, block_size=512, n_layers=6, n_heads=6, d_model=384),
    # GPT-2 small (Radford et al. 2019): 124,439,808 parameters with tied embeddings.
    "gpt2-124m": GPTConfig(vocab_size=50257, block_size=1024, n_layers=12, n_heads=12, d_model=768, bias=True),
    # GPT-2 medium: 354.8M.
    "350m": GPTConfig(vocab_size=50257, block_size=1024, n_layers=24, n_heads=16, d_model=1024, bias=True),
    # GPT-3 XL shape (Brown et al. 2020, table 2.1): 1.3B.
    "1.3b": GPTConfig(vocab_size=50257, block_size=2048, n_layers=24, n_heads=16, d_model=2048, bias=True),
    # LLaMA-2 7B shape (Touvron et al. 2023): 6.74B, rotary, RMSNorm, SwiGLU, untied.
    "7b": GPTConfig(
        vocab_size=32000,
        block_size=4096,
        n_layers=32,
        n_heads=32,
        d_model=4096,
        d_ff=11008,
        positional="rope",
        norm="rmsnorm",
        mlp="swiglu",
        tie_embeddings=False,
        norm_eps=1e-5,
    ),
}


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def _rotary_tables(config: GPTConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.block_size, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, head_dim); rotate channel pairs (i, i + head_dim/2), the LLaMA/NeoX layout.
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        kv_dim = config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wk = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.wv = nn.Linear(config.d_model, kv_dim, bias=config.bias)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wo._residual_output = True  # initialised with GPT-2's 1/sqrt(2L) scaled std

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary[0][:seq], rotary[1][:seq]
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.size(1) != k.size(1),
        )
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.kind = config.mlp
        if config.mlp == "swiglu":
            self.w1 = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
            self.w3 = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
            self.w2 = nn.Linear(config.ff_dim, config.d_model, bias=config.bias)
            self.w2._residual_output = True
        else:
            self.fc = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
            self.proj = nn.Linear(config.ff_dim, config.d_model, bias=config.bias)
            self.proj._residual_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = Attention(config)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rotary))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits`` of shape ``(batch, seq, vocab)``.

    Instantiate under ``torch.device("meta")`` to plan a large preset without memory, then call
    :meth:`init_weights` after ``to_empty(device=...)``.
    """

    def __init__(self, config: GPTConfig | Mapping[str, Any] | str = "tiny") -> None:
        super().__init__()
        self.config = config = GPTConfig.coerce(config)
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model) if config.positional == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm = _norm(config)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        # Not persistent: derived from the config, so checkpoints hold parameters only.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer: GPT-2's scheme, residual outputs scaled by 1/sqrt(2L)."""
        for module in self.modules():
            self._init_weights(module)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors (one of this model's modules, or the model itself).

        The per-module form of :meth:`init_weights`, which deferred initialisation calls for one
        module at a time (``lightning_scale.core.parallel.deferred_init``; Hugging Face models name theirs
        the same way)."""
        cfg = self.config
        if isinstance(module, nn.Linear):
            residual = getattr(module, "_residual_output", False)
            std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if residual else cfg.init_std
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()
        elif module is self and cfg.positional == "rope":
            self.rope_cos, self.rope_sin = _rotary_tables(cfg, device=self.rope_cos.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``.

        On a pipeline stage some modules are removed (``None``): without ``tok_emb`` the input is
        already the hidden state ``(batch, seq, d_model)``; without ``head`` the hidden state is
        returned.
        """
        seq = tokens.size(1)
        if seq > self.config.block_size:
            raise ValueError(
                f"Sequence length {seq} exceeds the model's context block_size={self.config.block_size}. "
                f"Shorten the sequences (data.seq_len) or raise model.block_size."
            )
        x = tokens
        if self.tok_emb is not None:
            x = self.tok_emb(tokens)
            if self.pos_emb is not None:
                x = x + self.pos_emb(torch.arange(seq, device=tokens.device))
            x = self.drop(x)
        rotary = (self.rope_cos, self.rope_sin) if self.config.positional == "rope" else None
        for block in self.blocks.values():
            x = block(x, rotary)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied head counts once); optionally without token/position embeddings."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            for emb in (self.tok_emb, self.pos_emb):
                total -= emb.weight.numel() if emb is not None else 0
        return total
