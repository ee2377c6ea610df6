"""Cutting a model into pipeline stages: names stay, chained stages equal the whole model."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_scale.core.pipeline.partition import balanced_partition
from lightning_scale.core.pipeline.spec import PipelineSpec, find_registered_spec, prune_to_stage
from lightning_scale.models import GPT, GPTConfig, GPTLightningModule, gpt_pipeline_spec


def _names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize(
    "config",
    [GPTConfig(n_layers=4), GPTConfig(n_layers=4, positional="rope", mlp="swiglu", tie_embeddings=False)],
    ids=["learned-tied", "rope-untied"],
)
@pytest.mark.parametrize("stages", [2, 4])
def test_chained_stages_equal_the_whole_model_and_keep_every_name(config: GPTConfig, stages: int) -> None:
    torch.manual_seed(0)
    full = GPT(config).eval()
    spec = gpt_pipeline_spec(full)
    part = balanced_partition([1.0] * len(spec.blocks), stages)
    pieces = [
        prune_to_stage(copy.deepcopy(full), spec, part.blocks(s), is_first=s == 0, is_last=s == stages - 1)
        for s in range(stages)
    ]
    tokens = torch.randint(0, 256, (2, 12))
    x = tokens
    for piece in pieces:
        x = piece(x)
    torch.testing.assert_close(x, full(tokens), rtol=0, atol=0)
    # No renaming: every stage's names are the full model's, and together they are all of them.
    assert set().union(*(_names(p) for p in pieces)) == _names(full)
    assert "blocks.3.attn.wq.weight" in _names(pieces[-1])
    assert "tok_emb.weight" not in _names(pieces[-1]) and "head.weight" not in _names(pieces[0])


def test_the_lightning_module_finds_the_registered_gpt_spec() -> None:
    found = find_registered_spec(GPTLightningModule(GPTConfig(n_layers=3)))
    assert found is not None
    root, spec = found
    assert root == "model" and list(spec.blocks) == ["blocks.0", "blocks.1", "blocks.2"]
    assert list(spec.first) == ["tok_emb", "pos_emb"] and list(spec.last) == ["norm", "head"]


def test_a_model_without_a_spec_finds_none() -> None:
    assert find_registered_spec(nn.Sequential(nn.Linear(2, 2))) is None


@pytest.mark.parametrize("container", [nn.ModuleList, nn.Sequential])
def test_pruning_a_module_list_keeps_the_indices_as_names_and_iterates_the_kept_blocks(container: type) -> None:
    model = nn.Module()
    originals = [nn.Linear(2, 2) for _ in range(4)]
    model.layers = nn.ModuleList(originals) if container is nn.ModuleList else nn.Sequential(*originals)
    spec = PipelineSpec(blocks=[f"layers.{i}" for i in range(4)])
    prune_to_stage(model, spec, [1, 2], is_first=False, is_last=True)
    # Names as in the whole model (checkpoints stay layout-free); no renumbering.
    assert [n for n, _ in model.named_parameters()] == [f"layers.{i}.{p}" for i in (1, 2) for p in ("weight", "bias")]
    # The model's own `for layer in self.layers` / `self.layers[:n]` / `len` see this stage's blocks.
    assert list(model.layers) == originals[1:3] and len(model.layers) == 2
    assert model.layers[0] is originals[1] and model.layers[-1] is originals[2]
    assert list(model.layers[:4]) == originals[1:3]
    x = torch.randn(1, 2)
    if container is nn.Sequential:
        torch.testing.assert_close(model.layers(x), originals[2](originals[1](x)))
    else:
        with pytest.raises(TypeError, match=r"module list holds only its own layers.*would reuse a name"):
            model.layers.append(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"blocks": []}, r"needs at least one block"),
        ({"blocks": ["a", "b"], "first": ["a"]}, r"names \['a'\] more than once"),
    ],
)
def test_bad_specs_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineSpec(**kwargs)


def test_a_spec_naming_missing_modules_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"names modules that do not exist: \['blocks.9'\]"):
        prune_to_stage(
            GPT(GPTConfig(n_layers=2)), PipelineSpec(blocks=["blocks.0", "blocks.9"]), [0], is_first=True, is_last=True
        )


def test_stage_views_run_their_blocks_and_share_everything_with_the_rank_module() -> None:
    """A rank of a V-shaped schedule at pp=2 over 4 stages holds stages 0 and 3: one module, two views."""
    from lightning_scale.core.pipeline.spec import stage_view

    torch.manual_seed(0)
    full = GPT(GPTConfig(n_layers=4)).eval()
    spec = gpt_pipeline_spec(full)
    rank0 = prune_to_stage(copy.deepcopy(full), spec, [0, 3], is_first=True, is_last=True)
    before = _names(rank0)
    first = stage_view(rank0, spec, [0], is_first=True, is_last=False)
    last = stage_view(rank0, spec, [3], is_first=False, is_last=True)
    # The rank's module is untouched; the views hold only their part, under the original names.
    assert _names(rank0) == before == {n for n in _names(full) if not n.startswith(("blocks.1.", "blocks.2."))}
    assert {n.split(".")[0] for n in _names(first)} == {"tok_emb", "pos_emb", "blocks"}
    assert {n for n in _names(first) if n.startswith("blocks.")} == {
        n for n in _names(full) if n.startswith("blocks.0.")
    }
    assert "head.weight" in _names(last) and "tok_emb.weight" not in _names(last)
    # Shared, not copied: the tied embedding/head is one parameter in the module and both views.
    assert first.tok_emb.weight is last.head.weight is rank0.tok_emb.weight
    assert first.blocks["0"] is rank0.blocks["0"]
    # Chained with the model's middle blocks, the views compute the whole model.
    middle = prune_to_stage(copy.deepcopy(full), spec, [1, 2], is_first=False, is_last=False)
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(last(middle(first(tokens))), full(tokens), rtol=0, atol=0)


# ---------------------------------------------------------------- block timing for partition="by_cost"


def test_block_timing_waits_for_the_device_around_every_clock_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accelerators run kernels asynchronously: a clock read without a device sync times the launches.
    from lightning_scale.core.pipeline import block_costs

    synced: list[str] = []
    monkeypatch.setattr(block_costs, "synchronize", lambda device: synced.append(device.type))
    # The clock reads (start, end) of each piece's two runs: block 0, block 1, the first, the last modules.
    reads = iter([0.0, 3.0, 3.0, 5.0, 10.0, 14.0, 20.0, 22.5, 30.0, 31.0, 40.0, 40.5, 50.0, 50.75, 60.0, 61.0])
    monkeypatch.setattr(block_costs, "time", SimpleNamespace(perf_counter=lambda: next(reads)))
    model = GPT(GPTConfig(n_layers=2, d_model=16, n_heads=2, block_size=8))
    tokens = torch.randint(0, 256, (4, 8))
    weights, first, last = block_costs.measure_costs(model, gpt_pipeline_spec(model), (tokens, tokens), 2, repeats=2)
    assert (weights, first, last) == ([2.0, 2.5], 0.5, 0.75)  # the faster of each piece's two runs
    assert next(reads, None) is None  # two clock reads per run, nothing else timed
    pieces = 2 + 1 + 1  # each block, the first modules, the last modules with the loss
    assert synced == ["cpu"] * (pieces * 2 * 2)  # before and after each of `repeats` timings


def test_block_timing_leaves_no_trace_in_the_run() -> None:
    from lightning_scale.core.pipeline.block_costs import measure_costs

    model = GPT(GPTConfig(n_layers=2, d_model=16, n_heads=2, block_size=8, dropout=0.1))
    model.train()
    model.blocks["1"].eval()  # a user's own mix of modes is restored as it was
    tokens = torch.randint(0, 256, (4, 8))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    measure_costs(model, gpt_pipeline_spec(model), (tokens, tokens), 2, repeats=1)
    torch.testing.assert_close(torch.rand(3), expected)  # dropout drew no random numbers
    assert model.training and model.blocks["0"].training and not model.blocks["1"].training
    assert all(p.grad is None for p in model.parameters())


def test_synchronize_uses_the_accelerator_of_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_scale.core.pipeline.block_costs import synchronize

    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    synchronize(torch.device("cuda", 1))
    synchronize(torch.device("cpu"))  # nothing to wait for
    assert calls == [("cuda", torch.device("cuda", 1))]
