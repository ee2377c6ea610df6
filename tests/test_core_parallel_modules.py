"""Registry matching over a module tree and tied-parameter discovery (core.parallel.modules)."""

from __future__ import annotations

import re

import pytest
from torch import nn

from lightning_scale.core.parallel.modules import check_matcher, outermost_registered, tied_parameter_groups


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)


class _SubBlock(_Block):
    pass


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Block()
        self.rest = nn.ModuleList([_SubBlock(), nn.Sequential(_Block())])
        self.head = nn.Linear(2, 3)


def test_a_matcher_is_a_module_class_or_a_predicate() -> None:
    check_matcher("register", _Block)
    check_matcher("register", lambda module: True)
    message = "register needs an nn.Module subclass or a predicate on modules, got <class 'int'>"
    with pytest.raises(TypeError, match=re.escape(message)):
        check_matcher("register", int)
    with pytest.raises(
        TypeError, match=re.escape("register needs an nn.Module subclass or a predicate on modules, got 'Block'")
    ):
        check_matcher("register", "Block")


def test_subclasses_match_their_base_and_modules_inside_a_match_are_skipped() -> None:
    model = _Model()
    found = outermost_registered(model, {_Block: "block", nn.Linear: "linear"})
    assert [(name, entry) for name, _, entry in found] == [
        ("first", "block"),
        ("rest.0", "block"),
        ("rest.1.0", "block"),
        ("head", "linear"),
    ]
    assert found[1][1] is model.rest[0]


def test_the_most_derived_registered_class_wins_and_types_go_before_predicates() -> None:
    model = _Model()
    registry = {lambda m: isinstance(m, nn.Linear): "predicate", _Block: "block", _SubBlock: "sub"}
    found = outermost_registered(model, registry)
    assert [(name, entry) for name, _, entry in found] == [
        ("first", "block"),
        ("rest.0", "sub"),
        ("rest.1.0", "block"),
        ("head", "predicate"),
    ]


def test_a_matching_root_is_named_empty_and_hides_everything_inside() -> None:
    model = _Model()
    assert outermost_registered(model, {_Model: 1, _Block: 2}) == [("", model, 1)]
    assert outermost_registered(model, {nn.Conv1d: 1}) == []


def test_the_first_predicate_that_matches_gives_the_entry() -> None:
    def is_named_head(module: nn.Module) -> bool:
        return module.__class__ is nn.Linear and module.out_features == 3

    found = outermost_registered(_Model(), {is_named_head: "head", (lambda m: isinstance(m, nn.Linear)): "any"})
    assert [(name, entry) for name, _, entry in found] == [
        ("first.proj", "any"),
        ("rest.0.proj", "any"),
        ("rest.1.0.proj", "any"),
        ("head", "head"),
    ]


def test_tied_parameters_are_grouped_by_identity_in_registration_order() -> None:
    model = _Model()
    model.head = nn.Linear(2, 2)
    model.head.weight = model.first.proj.weight
    model.rest[0].proj.bias = model.first.proj.bias
    model.rest[1][0].proj.bias = model.first.proj.bias
    assert tied_parameter_groups(model) == [
        ["first.proj.weight", "head.weight"],
        ["first.proj.bias", "rest.0.proj.bias", "rest.1.0.proj.bias"],
    ]
    assert tied_parameter_groups(_Model()) == []
