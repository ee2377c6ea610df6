"""The reference GPT: presets, checks, attention against a plain reference, stable names."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_scale.models import GPT, PRESETS, GPTConfig, GPTLightningModule


def test_tiny_is_under_one_million_parameters() -> None:
    assert GPT("tiny").num_parameters() < 1_000_000


def test_gpt2_124m_matches_gpt2_small() -> None:
    with torch.device("meta"):
        model = GPT("gpt2-124m")
    assert model.config.vocab_size == 50257 and model.config.tie_embeddings
    assert model.num_parameters() == 124_439_808  # GPT-2 small, tied head counted once
    assert abs(model.num_parameters() - 124e6) / 124e6 < 0.01


@pytest.mark.parametrize(("name", "expected"), [("350m", 354.8e6), ("1.3b", 1.316e9), ("7b", 6.738e9)])
def test_large_presets_instantiate_on_meta(name: str, expected: float) -> None:
    with torch.device("meta"):
        model = GPT(name)
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() == pytest.approx(expected, rel=0.005)


def test_meta_model_materialises_with_init_weights() -> None:
    config = GPTConfig(positional="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    out = model(torch.randint(0, 256, (2, 16)))
    assert torch.isfinite(out).all()
    assert model.rope_cos.shape == (config.block_size, config.head_dim // 2)


def _reference_attention(attn: torch.nn.Module, x: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    b, t, d = x.shape
    hd = d // n_heads
    q = attn.wq(x).view(b, t, n_heads, hd).transpose(1, 2)
    k = attn.wk(x).view(b, t, n_kv, hd).transpose(1, 2).repeat_interleave(n_heads // n_kv, dim=1)
    v = attn.wv(x).view(b, t, n_kv, hd).transpose(1, 2).repeat_interleave(n_heads // n_kv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    y = F.softmax(scores, dim=-1) @ v
    return attn.wo(y.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_explicit_softmax_reference(n_kv_heads: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_kv_heads=n_kv_heads))
    attn = model.blocks["0"].attn
    x = torch.randn(2, 12, 128)
    torch.testing.assert_close(attn(x, None), _reference_attention(attn, x, 4, n_kv_heads), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"positional": "rope"}, {"mlp": "swiglu", "norm": "rmsnorm"}, {"bias": True, "tie_embeddings": False}],
)
def test_outputs_are_causal(overrides: dict) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**overrides)).eval()
    tokens = torch.randint(0, 256, (1, 20))
    changed = tokens.clone()
    changed[0, 15:] = (changed[0, 15:] + 1) % 256
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_parameter_names_survive_removing_blocks() -> None:
    model = GPT(GPTConfig(n_layers=4))
    names = set(dict(model.named_parameters()))
    for key in ("0", "1"):
        del model.blocks[key]
    remaining = set(dict(model.named_parameters()))
    assert "blocks.3.attn.wq.weight" in remaining and remaining < names
    assert not any(n.startswith(("blocks.0.", "blocks.1.")) for n in remaining)


def test_tied_head_shares_the_embedding() -> None:
    tied, untied = GPT(GPTConfig()), GPT(GPTConfig(tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_parameters() - tied.num_parameters() == 256 * 128


def test_sequence_longer_than_context_is_rejected() -> None:
    model = GPT(GPTConfig(block_size=8))
    with pytest.raises(ValueError, match=r"Sequence length 9 exceeds the model's context block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"d_model": 130},
            r"d_model=130 is not divisible by n_heads=4.*n_heads in \[1, 2, 5, 10, 13, 26, 65, 130\].*d_model in \[128, 132\]",
        ),
        ({"n_kv_heads": 3}, r"n_kv_heads=3 must divide n_heads=4.*Use n_kv_heads in \[1, 2, 4\]"),
        ({"positional": "alibi"}, r"positional='alibi' is not one of 'learned', 'rope'"),
        ({"mlp": "relu"}, r"mlp='relu' is not one of 'gelu', 'swiglu'"),
        ({"d_model": 120, "n_heads": 40, "positional": "rope"}, r"head_dim=d_model/n_heads=3 must be even"),
        ({"n_layers": 0}, r"GPTConfig\.n_layers=0 must be a positive integer \(1 or more\)\.$"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\)"),
    ],
)
def test_bad_config_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"Unknown GPT preset 'gpt5'. Valid presets: '1.3b', '350m', '7b', 'gpt2-124m', 'small', 'tiny'",
    ):
        GPTConfig.from_preset("gpt5")
    with pytest.raises(ValueError, match="Unknown GPT preset 'huge'"):
        GPT("huge")


def test_config_from_mapping_rejects_unknown_fields() -> None:
    assert GPTConfig.coerce(dataclasses.asdict(PRESETS["tiny"])) == PRESETS["tiny"]
    with pytest.raises(ValueError, match=r"Unknown GPTConfig fields \['n_layer'\]"):
        GPTConfig.coerce({"n_layer": 2})


def test_lightning_module_round_trips_its_config_through_hparams(tmp_path) -> None:
    module = GPTLightningModule(GPTConfig(n_layers=2), learning_rate=1e-3)
    torch.save({"hparams": dict(module.hparams)}, tmp_path / "h.pt")
    hparams = torch.load(tmp_path / "h.pt")["hparams"]
    rebuilt = GPTLightningModule(**hparams)
    assert rebuilt.config == module.config and rebuilt.hparams.learning_rate == 1e-3


def test_lightning_module_rejects_bad_optimiser_settings() -> None:
    with pytest.raises(ValueError, match="learning_rate must be positive, got 0"):
        GPTLightningModule("tiny", learning_rate=0)
    with pytest.raises(ValueError, match=r"betas must be two numbers"):
        GPTLightningModule("tiny", betas=(0.9,))


@pytest.mark.gpu
def test_gpt_trains_a_step_on_cuda_in_bf16() -> None:
    model = GPT(GPTConfig(positional="rope", n_kv_heads=2)).cuda()
    tokens = torch.randint(0, 256, (4, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
