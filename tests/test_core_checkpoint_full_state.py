"""Loading a whole-model state (a single-device run's) into a model and optimizer, in place."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_scale.core.checkpoint.full_state import load_full_model_state, load_full_optimizer_state


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 2)).sum().backward()
        optimizer.step()
    return model, optimizer


def _fresh() -> nn.Module:
    torch.manual_seed(1)
    return _Net()


def test_every_tensor_is_copied_into_the_models_own_storage() -> None:
    trained, _ = _trained()
    model = _fresh()
    weight = model.emb.weight
    load_full_model_state(model, trained.state_dict())
    assert model.emb.weight is weight  # in place: optimizers and hooks keep their references
    for name, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert int(model.norm.num_batches_tracked) == 2


def test_missing_and_unexpected_keys_are_named_unless_not_strict() -> None:
    state = _trained()[0].state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["head.bias"]
    message = (
        "Error(s) in loading state_dict for _Net: missing keys ['head.bias'], unexpected keys ['extra.weight']. "
        "Pass strict=False to load the matching entries only."
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        load_full_model_state(_fresh(), state)
    model = _fresh()
    bias = model.head.bias.detach().clone()
    load_full_model_state(model, state, strict=False)
    assert torch.equal(model.head.bias, bias) and torch.equal(model.head.weight, state["head.weight"])


def test_a_pipeline_stage_takes_the_entries_it_holds() -> None:
    state = _trained()[0].state_dict()
    stage = _fresh()
    stage.emb = None  # a later stage: the embedding lives elsewhere
    load_full_model_state(stage, state, partial=True)
    assert torch.equal(stage.head.weight, state["head.weight"])
    with pytest.raises(RuntimeError, match=re.escape("unexpected keys ['emb.weight', 'emb.bias']")):
        load_full_model_state(stage, state)


def test_a_tensor_of_another_shape_is_refused_with_both_shapes() -> None:
    state = _trained()[0].state_dict()
    state["head.weight"] = torch.zeros(2, 3)
    message = (
        "size mismatch for head.weight: copying a tensor of shape (2, 3) from the checkpoint, the shape in the "
        "current model is (1, 3)."
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        load_full_model_state(_fresh(), state)


class _WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: Any = None

    def get_extra_state(self) -> Any:
        return {"steps": 0}

    def set_extra_state(self, state: Any) -> None:
        self.seen = state


def test_extra_state_goes_to_the_modules_own_loader() -> None:
    model = nn.Sequential(_WithExtra())
    state = {**model.state_dict(), "0._extra_state": {"steps": 7}}
    load_full_model_state(model, state)
    assert model[0].seen == {"steps": 7}


def test_a_sharded_parameter_takes_its_own_shard(world_of_one: DeviceMesh) -> None:
    trained = _trained()[0].state_dict()
    model = _fresh()
    mesh = world_of_one["tp"]
    model.emb.weight = nn.Parameter(distribute_tensor(model.emb.weight.detach(), mesh, [Shard(0)]))
    storage = model.emb.weight.to_local().data_ptr()
    load_full_model_state(model, trained)
    assert isinstance(model.emb.weight, DTensor) and model.emb.weight.placements == (Shard(0),)
    assert model.emb.weight.to_local().data_ptr() == storage  # copied into the shard it holds
    assert torch.equal(model.emb.weight.full_tensor(), trained["emb.weight"])


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def test_an_optimizer_state_by_parameter_name_loads_whole_or_for_a_stage() -> None:
    trained, optimizer = _trained()
    state = _by_name(trained, optimizer)
    assert sorted(state["state"]) == ["emb.bias", "emb.weight", "head.bias", "head.weight", "norm.bias", "norm.weight"]

    model = copy.deepcopy(trained)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_full_optimizer_state(model, fresh, state)
    loaded = _by_name(model, fresh)
    assert loaded["param_groups"][0]["lr"] == 0.1
    for name, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["state"][name][key], value), (name, key)

    stage = copy.deepcopy(trained)
    stage.emb = None
    stage.norm = None
    mine = torch.optim.AdamW(stage.parameters(), lr=0.5)
    load_full_optimizer_state(stage, mine, state, partial=True)
    loaded = _by_name(stage, mine)
    assert sorted(loaded["state"]) == ["head.bias", "head.weight"]
    assert torch.equal(loaded["state"]["head.weight"]["exp_avg"], state["state"]["head.weight"]["exp_avg"])
    assert loaded["param_groups"][0]["params"] == ["head.weight", "head.bias"]


def test_torchs_own_optimizer_state_numbered_by_position_loads_by_name() -> None:
    # What a single-device Lightning run saves: optimizer.state_dict(), entries numbered, no names.
    trained, optimizer = _trained()
    numbered = optimizer.state_dict()
    assert sorted(numbered["state"]) == [0, 1, 2, 3, 4, 5]
    model = copy.deepcopy(trained)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_full_optimizer_state(model, fresh, numbered)
    assert fresh.param_groups[0]["lr"] == 0.1
    for name, entry in _by_name(trained, optimizer)["state"].items():
        for key, value in entry.items():
            assert torch.equal(_by_name(model, fresh)["state"][name][key], value), (name, key)
    assert fresh.state_dict()["state"].keys() == numbered["state"].keys()
    for index, entry in numbered["state"].items():
        assert torch.equal(fresh.state_dict()["state"][index]["exp_avg_sq"], entry["exp_avg_sq"])


def test_a_numbered_optimizer_state_with_param_names_loads_even_for_a_stage() -> None:
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=0.1)  # torch records param_names
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    numbered = optimizer.state_dict()
    assert numbered["param_groups"][0]["param_names"][0] == "emb.weight"
    stage = copy.deepcopy(model)
    stage.emb = None
    stage.norm = None
    mine = torch.optim.AdamW(stage.parameters(), lr=0.5)
    load_full_optimizer_state(stage, mine, numbered, partial=True)
    assert torch.equal(_by_name(stage, mine)["state"]["head.weight"]["exp_avg"], numbered["state"][4]["exp_avg"])


def test_a_numbered_optimizer_state_that_cannot_be_matched_is_refused() -> None:
    trained, optimizer = _trained()
    numbered = optimizer.state_dict()
    stage = copy.deepcopy(trained)
    stage.emb = None
    with pytest.raises(ValueError, match=r"numbered by their position .* Resume it once with pipeline_parallel=1"):
        load_full_optimizer_state(stage, torch.optim.AdamW(stage.parameters()), numbered, partial=True)
    model = copy.deepcopy(trained)
    split = torch.optim.AdamW([{"params": [model.emb.weight]}, {"params": list(model.parameters())[1:]}])
    with pytest.raises(
        ValueError, match=r"groups of \[6\] parameters and configure_optimizers built groups of \[1, 5\]"
    ):
        load_full_optimizer_state(model, split, numbered)
