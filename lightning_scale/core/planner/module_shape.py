"""A decoder's :class:`~lightning_scale.core.planner.shape.ModelShape` read off the module itself, for a
model that carries no config the planner knows (a user's own ``nn.Module`` or ``LightningModule``).

Build it on the meta device (``with torch.device("meta"): module = MyModel()``): only shapes are read.

- the blocks: the ``ModuleList``/``ModuleDict``/``Sequential`` with the most parameters whose children are
  all one class with the same parameter shapes (``n_layers`` = their number);
- the token embedding: the ``nn.Embedding`` outside the blocks that the output head maps back to (else the
  first registered): ``vocab_size`` rows of ``d_model``; another one as wide is a learned position embedding;
- in one block, the 2-D weights: the MLP's down projection is the widest ``(d_model, d_ff)`` one, its up
  (and gate) projections the ``(d_ff, d_model)`` ones (a fused ``(2 d_ff, d_model)`` one is gated); the rest
  is attention, whose output projection's input width is the query heads' and the remainder the keys' and
  values' (so fused ``qkv`` weights and ``nn.MultiheadAttention`` read alike);
- heads: an attribute of the block or its children (``n_heads``, ``num_heads``, ``n_head``,
  ``num_attention_heads``, or ``head_dim``/``head_size`` to divide by);
- the head: an ``nn.Linear`` outside the blocks of ``(vocab_size, d_model)``, tied when it is the
  embedding's weight or absent.

The shape's parameter count must equal the module's within 1%, else the module is refused (naming both
counts): the planner never plans for a model it misread. No Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from lightning_scale.core.planner.shape import ModelShape

__all__ = ["module_shape"]

_HEADS = ("n_heads", "num_heads", "n_head", "num_attention_heads")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
_HEAD_DIM = ("head_dim", "head_size")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_FIX = "give the module a `config` (a GPTConfig, a Hugging Face config) or pass a ModelShape"


def _signature(module: nn.Module) -> tuple[type, tuple[tuple[str, tuple[int, ...]], ...]]:
    return type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def _blocks(module: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    best_size = 0
    for container in module.modules():
        if not isinstance(container, _CONTAINERS):
            continue
        children = list(container.children())
        if not children or len({_signature(c) for c in children}) != 1 or not _signature(children[0])[1]:
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best, best_size = children, size
    return best


def _attribute(modules: Iterator[nn.Module], names: tuple[str, ...]) -> int | None:
    for module in modules:
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def module_shape(module: nn.Module, name: str | None = None) -> ModelShape:
    """The decoder shape of ``module`` (see the module doc); ``ValueError`` saying what could not be read."""
    label = name or type(module).__name__
    blocks = _blocks(module)
    if not blocks:
        raise ValueError(
            f"The planner found no transformer blocks in {label} (a ModuleList/ModuleDict/Sequential of identical "
            f"modules with parameters). A model built in `configure_model` does not exist yet when the layout is "
            f"chosen: build it in `__init__` (on the meta device, it costs nothing), or {_FIX}."
        )
    inside = {id(m) for b in blocks for m in b.modules()}
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    if not embeddings:
        raise ValueError(
            f"The planner found no token embedding (an nn.Embedding outside the blocks) in {label}; {_FIX}."
        )
    outside = [m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    heads_out = {(m.out_features, m.in_features) for m in outside}
    # The token embedding: the one the output head maps back to, else the first registered (tok_emb, wte, embed_tokens).
    token = next((e for e in embeddings if (e.num_embeddings, e.embedding_dim) in heads_out), embeddings[0])
    vocab, d = token.num_embeddings, token.embedding_dim
    positions = sum(e.num_embeddings for e in embeddings if e is not token and e.embedding_dim == d)
    block = blocks[0]
    weights = [tuple(p.shape) for p in block.parameters() if p.dim() == 2]
    downs = [w[1] for w in weights if w[0] == d and w[1] != d]
    d_ff = max(downs, default=d)
    ups = [w for w in weights if w[1] == d and w[0] in (d_ff, 2 * d_ff)]
    mlp = d * d_ff + sum(a * b for a, b in ups)
    gated = len(ups) >= 2 or any(w[0] == 2 * d_ff for w in ups)
    if not ups:
        raise ValueError(
            f"The planner found no MLP in {label}'s blocks (a ({d_ff}, {d}) weight beside the ({d}, {d_ff}) one); {_FIX}."
        )
    attention = sum(a * b for a, b in weights) - mlp
    block_modules = list(block.modules())
    heads_named = _attribute(iter(block_modules), _HEADS)
    head_dim_named = _attribute(iter(block_modules), _HEAD_DIM)
    # The output projection's input is the query heads' width: d_model in nearly every model, else another
    # dimension of an attention weight; the keys' and values' width is what the attention weights leave.
    widths = [d, *sorted({x for w in weights for x in w if x not in (d, d_ff, 2 * d_ff)})]
    read = None
    for width in widths:
        kv_width = attention // (2 * d) - width
        heads = heads_named or (width // head_dim_named if head_dim_named else None)
        if heads and width % heads == 0 and kv_width >= 1 and kv_width % (width // heads) == 0:
            read = width, kv_width, heads
            break
    if read is None:
        raise ValueError(
            f"The planner cannot tell {label}'s attention heads: give its attention module an `n_heads` (or "
            f"`head_dim`) attribute, or {_FIX}. (Read: d_model {d}, d_ff {d_ff}, {attention:,} attention weights, "
            f"heads {heads_named}, head_dim {head_dim_named}.)"
        )
    width, kv_width, heads = read
    head_dim = width // heads
    kv_heads = _attribute(iter(block_modules), _KV_HEADS) or kv_width // head_dim
    head = next((m for m in outside if tuple(m.weight.shape) == (vocab, d)), None)
    shape = ModelShape(
        n_layers=len(blocks),
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        vocab_size=vocab,
        gated_mlp=gated,
        tied=head is None or head.weight is token.weight,
        bias=any(p.dim() == 1 and p.numel() != d for p in block.parameters()),
        learned_positions=positions,
        layernorm=any(isinstance(m, nn.LayerNorm) for m in block_modules),
        name=label,
    )
    counted = sum(p.numel() for p in module.parameters())
    if abs(shape.parameters - counted) > 0.01 * counted:
        raise ValueError(
            f"The planner read {label} as {shape} with {shape.parameters:,} parameters, but it has {counted:,}: "
            f"it is not a decoder whose shape can be read off its modules; {_FIX}."
        )
    return shape
