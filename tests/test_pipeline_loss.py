"""The pieces that make a pipeline train what one process trains, checked without a process group:
the micro-batch loss weighting (-100 labels), parameters outside every declared module, and a
Hugging Face model's batches (extra inputs, target conventions) and stage forward under a user's cut.
(The same things end to end, against one process: ``test_huggingface.py`` and ``test_pipeline_semantics.py``.)"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.models import TinyViT
from torch import nn

from lightning_scale.core.pipeline.loss import MicroBatchLoss, split_microbatches
from lightning_scale.core.pipeline.spec import (
    PipelineSpec,
    StageForward,
    labelled_tokens,
    prune_to_stage,
    removed_module_called,
    undeclared_parameters,
    with_registered_forward,
)

transformers = pytest.importorskip("transformers")

from lightning_scale.integrations.huggingface import (  # noqa: E402
    HFBatches,
    causal_lm_loss,
    causal_lm_tokens,
    hf_pipeline_spec,
)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _masked_prompts(batch: int = 8, length: int = 12, vocab: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, length, vocab, dtype=torch.float64, generator=generator, requires_grad=True)
    target = torch.randint(0, vocab, (batch, length), generator=generator)
    for row, prompt in enumerate([1, 9, 3, 11, 0, 7, 2, 5][:batch]):  # prompts of different lengths, masked
        target[row, :prompt] = -100
    return logits, target


def _pipelined(loss: MicroBatchLoss, logits: torch.Tensor, target: Any, n: int) -> torch.Tensor:
    """What the last stage computes: the schedule's loss call on each micro-batch, summed."""
    indices = loss.set_targets(target, n)
    return sum(loss(out, i) for out, i in zip(logits.tensor_split(n), indices.tensor_split(n), strict=True))  # type: ignore[return-value]


@pytest.mark.parametrize("microbatches", [2, 4])
def test_micro_batches_weighted_by_labelled_tokens_give_the_whole_batchs_loss_and_gradient(microbatches: int) -> None:
    logits, target = _masked_prompts()
    whole = _lm_loss(logits, target)
    (expected,) = torch.autograd.grad(whole, logits)
    # The micro-batches hold different numbers of labelled tokens: their plain mean is another objective.
    means = torch.stack(
        [
            _lm_loss(o, t)
            for o, t in zip(logits.tensor_split(microbatches), target.tensor_split(microbatches), strict=True)
        ]
    )
    assert abs(float(means.mean() - whole)) > 1e-3
    loss = MicroBatchLoss(_lm_loss, labelled_tokens)
    pipelined = _pipelined(loss, logits, target, microbatches)
    torch.testing.assert_close(pipelined, whole, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(pipelined, logits)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_a_micro_batch_with_nothing_labelled_adds_zero_loss_and_zero_gradient_not_nan() -> None:
    logits, target = _masked_prompts()
    target[:4] = -100  # the first micro-batch of two: nothing to learn from (its own mean would be 0/0)
    whole = _lm_loss(logits, target)
    (expected,) = torch.autograd.grad(whole, logits)
    pipelined = _pipelined(MicroBatchLoss(_lm_loss, labelled_tokens), logits, target, 2)
    (grad,) = torch.autograd.grad(pipelined, logits)
    torch.testing.assert_close(pipelined, whole, rtol=1e-12, atol=0)
    assert torch.isfinite(grad).all() and not grad[:4].any()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_loss_scale_multiplies_every_weighted_micro_batch_loss() -> None:
    logits, target = _masked_prompts()
    loss = MicroBatchLoss(_lm_loss, labelled_tokens)
    loss.scale = 0.25
    torch.testing.assert_close(_pipelined(loss, logits, target, 2), 0.25 * _lm_loss(logits, target), rtol=1e-12, atol=0)


def test_without_a_token_count_micro_batches_count_equally_and_ignored_labels_are_refused() -> None:
    logits, target = _masked_prompts()
    full = target.clamp(min=0)
    loss = MicroBatchLoss(_lm_loss, None)
    torch.testing.assert_close(_pipelined(loss, logits, full, 2), _lm_loss(logits, full), rtol=1e-12, atol=0)
    with pytest.raises(
        ValueError,
        match=re.escape("target holds -100")
        + r".*Give the spec `loss_tokens=lightning_scale.core.pipeline.spec.labelled_tokens`",
    ):
        loss.set_targets(target, 2)


def test_targets_of_any_structure_are_split_like_the_inputs() -> None:
    t = torch.arange(8).reshape(4, 2)
    parts = split_microbatches({"labels": t, "weights": (t * 2, "tag")}, 2)
    assert len(parts) == 2
    torch.testing.assert_close(parts[1]["labels"], t[2:])
    torch.testing.assert_close(parts[0]["weights"][0], t[:2] * 2)
    assert parts[0]["weights"][1] == parts[1]["weights"][1] == "tag"


# ---------------------------------------------------------------- parameters outside the declared modules


def test_parameters_set_on_the_root_are_found_as_held_by_every_stage() -> None:
    vit = TinyViT()
    spec = PipelineSpec(
        blocks=[f"blocks.{i}" for i in range(4)], first=["patch_embed"], last=["norm", "head"], loss_fn=F.cross_entropy
    )
    assert undeclared_parameters(vit, spec) == ["cls_token", "pos_embed"]
    pruned = prune_to_stage(copy.deepcopy(vit), spec, [2, 3], is_first=False, is_last=True)
    assert {"cls_token", "pos_embed"} <= {n for n, _ in pruned.named_parameters()}  # a copy on the last stage too


# ---------------------------------------------------------------- Hugging Face batches and stage forward


def _llama(**overrides: Any) -> nn.Module:
    shape = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(shape | overrides))).double()


def test_causal_lm_loss_scores_every_position_of_already_shifted_targets_passed_as_longer_labels() -> None:
    logits, target = _masked_prompts()
    batches = HFBatches(_llama().model)
    inputs = torch.cat([torch.zeros(8, 1, dtype=torch.long), target[:, :-1].clamp(min=0)], dim=1)
    target = torch.where(target == -100, target, torch.cat([inputs[:, 1:], target[:, -1:]], dim=1))
    _, labels, kwargs = batches((inputs, target))
    assert batches.convention == "shifted" and kwargs == {} and labels.shape == (8, 13)
    torch.testing.assert_close(causal_lm_loss(logits, labels), _lm_loss(logits, target), rtol=1e-12, atol=0)


def test_hf_pairs_conventions_are_told_apart_on_the_data_and_a_batch_fitting_neither_is_refused() -> None:
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    labels = tokens[:, :-1].clone()
    labels[:, :3] = -100
    batches = HFBatches(_llama().model)
    _, out, _ = batches((tokens[:, :-1], labels))
    assert batches.convention == "labels" and out is labels
    assert "(input_ids, labels) pairs whose labels are transformers' (unshifted" in batches.describe()
    with pytest.raises(ValueError, match="already shifted, but the batches before were unshifted labels"):
        batches((tokens[:, :-1], tokens[:, 1:]))
    with pytest.raises(
        ValueError,
        match=re.escape("neither transformers' labels (equal to input_ids at every labelled position")
        + r".*nanoGPT convention.*Pass \{'input_ids', 'labels'\} dicts",
    ):
        HFBatches(_llama().model)((tokens[:, :-1], torch.flip(tokens[:, 1:], [1])))
    with pytest.raises(ValueError, match="fits both conventions"):
        HFBatches(_llama().model)((torch.full((2, 8), 5), torch.full((2, 8), 5)))


def test_hf_dict_entries_the_model_takes_reach_every_stage_and_others_are_left_out() -> None:
    tokens = torch.randint(0, 64, (2, 8))
    batch = {
        "input_ids": tokens,
        "labels": tokens,
        "position_ids": tokens * 0,
        "attention_mask": torch.ones_like(tokens),
        "idx": torch.arange(2),
    }
    inputs, labels, kwargs = HFBatches(_llama().model)(batch)
    assert inputs is tokens and labels is tokens and sorted(kwargs) == ["attention_mask", "position_ids"]


def _user_spec(loss_fn: Any = _lm_loss) -> PipelineSpec:
    return PipelineSpec(
        blocks=[f"model.layers.{i}" for i in range(4)],
        first=["model.embed_tokens"],
        last=["model.norm", "lm_head"],
        loss_fn=loss_fn,
    )


def test_a_users_own_cut_of_an_hf_model_runs_with_the_familys_stage_forward_and_position_ids() -> None:
    model = _llama()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(9))])
    with torch.no_grad():
        whole = model(input_ids=tokens, position_ids=positions).logits
    spec = with_registered_forward(model, _user_spec())
    family = hf_pipeline_spec(model)
    assert (
        spec.loss_fn is _lm_loss
        and spec.stage_forward is family.stage_forward
        and list(spec.identity) == ["model.norm"]
    )
    first = prune_to_stage(copy.deepcopy(model), spec, [0, 1], is_first=True, is_last=False)
    second = prune_to_stage(copy.deepcopy(model), spec, [2, 3], is_first=False, is_last=True)
    with torch.no_grad():
        hidden = StageForward(first, spec.stage_forward)(tokens, position_ids=positions)
        chained = StageForward(second, spec.stage_forward)(hidden, position_ids=positions)
    torch.testing.assert_close(chained, whole, rtol=0, atol=0)
    # Without the family's forward, the first stage's own forward calls the final norm it no longer has.
    plain = prune_to_stage(copy.deepcopy(model), _user_spec(), [0, 1], is_first=True, is_last=False)
    with pytest.raises(TypeError, match="'NoneType' object is not callable") as caught:
        plain(input_ids=tokens)
    # What the runner says instead, for a model no registered family covers: the module and the fixes.
    message = removed_module_called(caught.value, plain, _user_spec(), ["model.norm", "lm_head"])
    assert message is not None and message.startswith(
        "A pipeline stage's forward called ['model.norm'] (`hidden_states = self.norm(hidden_states)`)"
    )
    assert "list it in the spec's identity=[...]" in message and "stage_forward(module, *inputs, **kwargs)" in message
    assert removed_module_called(TypeError("unsupported operand"), plain, _user_spec(), ["model.norm"]) is None
    # A spec with no loss of its own takes the family's: loss, token count and batches.
    completed = with_registered_forward(model, _user_spec(None))
    assert completed.loss_fn is causal_lm_loss and completed.loss_tokens is causal_lm_tokens
    assert isinstance(completed.split_batch, HFBatches)
