"""Tied weights in checkpoints (``core.checkpoint.ties``) and a parallelised module's sharded state under
the original names (``core.checkpoint.sharded_state``): plain functions and one process, no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_scale.core.checkpoint.sharded_state import ShardedState
from lightning_scale.core.checkpoint.ties import (
    aliases_of_groups,
    groups_of_aliases,
    names_under,
    rename_optimizer_state,
    storage_aliases,
    with_aliases_filled,
)


class Tied(nn.Module):
    """A token embedding and an output head sharing one weight, as a GPT ties them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def _stepped(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    return optimizer


def test_storage_aliases_name_every_later_entry_sharing_a_tensor() -> None:
    shared, other = torch.zeros(4), torch.zeros(4)
    state = {"a": shared, "b": other, "c": shared, "d": shared, "e": "not a tensor"}
    assert storage_aliases(state) == {"c": "a", "d": "a"}
    # A view of another shape over the same storage is a different entry.
    assert storage_aliases({"a": shared, "v": shared.view(2, 2)}) == {}


def test_aliases_and_groups_convert_both_ways() -> None:
    groups = [["emb.weight", "head.weight", "lm.weight"], ["x"]]
    assert aliases_of_groups(groups) == {"head.weight": "emb.weight", "lm.weight": "emb.weight"}
    assert aliases_of_groups(groups, present=["head.weight"]) == {"head.weight": "emb.weight"}
    assert groups_of_aliases({"head.weight": "emb.weight", "lm.weight": "emb.weight"}) == [groups[0]]


def test_names_under_prefixes_a_submodules_names() -> None:
    outer = nn.Sequential(nn.Linear(1, 1), Tied())
    assert names_under(outer, outer[1], [["emb.weight", "head.weight"]]) == [["1.emb.weight", "1.head.weight"]]
    assert names_under(outer, outer, [["0.weight"]]) == [["0.weight"]]


def test_aliases_are_filled_from_their_canonical_entry_when_present() -> None:
    state = {"emb.weight": 1, "mid.bias": 2}
    filled = with_aliases_filled(state, {"head.weight": "emb.weight", "x": "missing"})
    assert filled == {"emb.weight": 1, "mid.bias": 2, "head.weight": 1}
    assert state == {"emb.weight": 1, "mid.bias": 2}  # not changed in place


def test_an_optimizer_state_is_renamed_in_its_state_and_param_groups() -> None:
    state = {"state": {"a": 1, "b": 2}, "param_groups": [{"lr": 0.1, "params": ["a", "b"]}]}
    renamed = rename_optimizer_state(state, {"b": "c"})
    assert renamed == {"state": {"a": 1, "c": 2}, "param_groups": [{"lr": 0.1, "params": ["a", "c"]}]}


def test_a_tied_weight_is_stored_once_under_its_first_name() -> None:
    model = Tied()
    optimizer = _stepped(model)
    state = ShardedState(model)
    assert state.groups() == [["emb.weight", "head.weight"]]
    saved = state.model_state()
    assert set(saved) == {"emb.weight", "mid.weight", "mid.bias"}
    assert saved["emb.weight"].data_ptr() == model.emb.weight.data_ptr()  # no copy
    saved_optimizer = state.optimizer_state(optimizer)
    names = saved_optimizer["param_groups"][0]["params"]
    assert "emb.weight" in names and "head.weight" not in names


def test_a_saved_state_loads_into_every_copy_of_a_tied_weight() -> None:
    source, target = Tied(), Tied()
    saved = ShardedState(source).model_state()
    ShardedState(target).load_model_state(saved)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
    assert target.head.weight is target.emb.weight


def test_an_optimizer_state_round_trips_through_the_canonical_names() -> None:
    source, target = Tied(), Tied()
    source_optimizer, target_optimizer = _stepped(source), _stepped(target)
    saved = ShardedState(source).optimizer_state(source_optimizer)
    ShardedState(target).load_optimizer_state(target_optimizer, saved)
    for (_, want), (_, got) in zip(source_optimizer.state.items(), target_optimizer.state.items(), strict=True):
        assert torch.equal(want["exp_avg"], got["exp_avg"])


def test_a_pipeline_stage_names_its_ties_and_loads_only_what_it_holds() -> None:
    # A stage holding only the head: shared storage cannot tell it is tied, the pipeline's groups do.
    stage = nn.Module()
    stage.head = nn.Linear(3, 5, bias=False)
    state = ShardedState(stage, tied=[["emb.weight", "head.weight"]])
    saved = state.model_state()
    assert list(saved) == ["emb.weight"]  # stored under the canonical name
    weight = torch.arange(15.0).reshape(5, 3)
    state.load_model_state({"emb.weight": weight, "mid.bias": torch.zeros(3)}, partial=True)
    assert torch.equal(stage.head.weight, weight)
    with pytest.raises(RuntimeError, match="mid.bias"):
        state.load_model_state({"emb.weight": weight, "mid.bias": torch.zeros(3)}, strict=True, partial=False)


def test_a_pipeline_without_ties_never_looks_at_shared_storage() -> None:
    model = Tied()
    assert ShardedState(model, tied=[]).aliases(ShardedState(model).live()) == {}
    assert ShardedState(model, tied=[]).groups() == []
