"""Weights tied across pipeline stages: which ties data parallelism refuses, and which ranks' copies
are summed, in which groups, counted once in the norm (the collectives stand in for the other ranks)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_scale.core.pipeline import ties
from lightning_scale.core.pipeline.partition import stage_ranks
from lightning_scale.core.pipeline.ties import TiedCopies, check_ties_for_data_parallel

GPT_TIE = [["tok_emb.weight", "head.weight"]]


def _stage_of(name: str) -> int | None:
    return {"tok_emb.weight": 0, "head.weight": 3, "cls": None}[name]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"])
def test_a_tie_between_stages_on_different_ranks_is_accepted(schedule: str) -> None:
    ranks = stage_ranks(schedule, 2 if schedule.startswith("interleaved") else 4, 4)
    assert ranks[0] != ranks[3]
    check_ties_for_data_parallel(GPT_TIE, _stage_of, ranks, schedule)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_tie_between_two_stages_of_one_rank_is_refused_with_the_ways_out(schedule: str) -> None:
    ranks = stage_ranks(schedule, 2, 4)
    assert ranks == [0, 1, 1, 0]
    message = (
        f"Parameters ['tok_emb.weight', 'head.weight'] are one weight shared by two pipeline stages of one rank (a "
        f"tied embedding and output head under schedule={schedule!r}). With data parallelism each stage is wrapped "
        "on its own, which would break the tie: untie the weights (GPT: tie_embeddings=False)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_ties_for_data_parallel(GPT_TIE, _stage_of, ranks, schedule)


def test_names_outside_every_stage_and_ties_within_one_stage_are_accepted() -> None:
    # `cls` lies outside every declared module (every stage keeps it, the runner syncs it); a tie inside
    # one stage is one parameter of one wrapped module.
    check_ties_for_data_parallel([["tok_emb.weight", "cls"]], _stage_of, [0, 1, 1, 0], "zbv")
    check_ties_for_data_parallel([["a.weight", "b.weight"]], lambda name: 1, [0, 1, 1, 0], "zbv")


class _FakeDist:
    """The collectives of one rank of a (dp, pp, tp) mesh, the other ranks played by ``holders``:
    for each tied group, the pipeline ranks that hold a copy. A gradient sum doubles the gradient
    (one other copy with the same gradient)."""

    def __init__(self, rank: int, holders: list[set[int]]) -> None:
        self.rank, self.holders = rank, holders
        self.created: list[list[int]] = []
        self.reduced: list[tuple[Any, Any]] = []

    def get_rank(self) -> int:
        return self.rank

    def new_group(self, members: list[int]) -> tuple[int, ...]:
        self.created.append(members)
        return tuple(members)

    def all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        self.reduced.append((tensor, group))
        if tensor.dtype == torch.int32:  # the holders table: every pipeline rank's answers
            tensor.zero_()
            for i, ranks in enumerate(self.holders):
                for r in ranks:
                    tensor[i, r] = 1
        else:
            tensor.mul_(2)


class _FakeMesh:
    def __init__(self, shape: tuple[int, int, int], rank: int) -> None:
        self.mesh = torch.arange(shape[0] * shape[1] * shape[2]).reshape(shape)
        self.mesh_dim_names = ("dp", "pp", "tp")
        pp_rank = int((self.mesh == rank).nonzero()[0, 1])
        self._pp = SimpleNamespace(size=lambda: shape[1], get_local_rank=lambda: pp_rank, get_group=lambda: "pp group")

    def __getitem__(self, name: str) -> Any:
        assert name == "pp"
        return self._pp


def _stage(*held: str) -> nn.Module:
    root = nn.Module()
    for name in held:
        root.add_module(name, nn.Linear(2, 2, bias=False))
    return root


TIED = [["tok_emb.weight", "head.weight"], ["a.weight", "b.weight"]]


@pytest.mark.parametrize(
    ("shape", "rank", "groups", "mine"),
    [
        # dp=2 x pp=2: rows of the pipeline are global ranks (0, 1) and (2, 3).
        ((2, 2, 1), 2, [[0, 1], [2, 3]], (2, 3)),
        # pp=2 x tp=2: each tensor-parallel shard has its own pipeline row, (0, 2) and (1, 3).
        ((1, 2, 2), 1, [[0, 2], [1, 3]], (1, 3)),
    ],
)
def test_the_first_pipeline_rank_holding_a_tied_weight_counts_it_and_every_row_gets_a_group(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int, int],
    rank: int,
    groups: list[list[int]],
    mine: tuple[int, ...],
) -> None:
    fake = _FakeDist(rank, holders=[{0, 1}, {0}])  # the second tie lives on pipeline rank 0 alone
    monkeypatch.setattr(ties, "dist", fake)
    root = _stage("tok_emb", "a", "b")
    copies = TiedCopies(root, TIED, _FakeMesh(shape, rank), torch.device("cpu"))  # type: ignore[arg-type]

    assert fake.reduced[0][1] == "pp group"  # the holders table is summed over the pipeline only
    assert fake.created == groups
    assert copies.copies == [("tok_emb.weight", mine, True)]
    assert copies.excluded_from_norm() == set()


def test_a_later_pipeline_rank_sums_its_copy_but_leaves_it_out_of_the_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDist(1, holders=[{0, 1}, {0}])
    monkeypatch.setattr(ties, "dist", fake)
    root = _stage("head")
    copies = TiedCopies(root, TIED, _FakeMesh((1, 2, 1), 1), torch.device("cpu"))  # type: ignore[arg-type]

    assert copies.copies == [("head.weight", (0, 1), False)]
    assert copies.excluded_from_norm() == {id(root.head.weight)}

    root.head.weight.grad = torch.full((2, 2), 1.5)
    copies.all_reduce_grads()
    assert torch.equal(root.head.weight.grad, torch.full((2, 2), 3.0))
    assert fake.reduced[-1][1] == (0, 1)


def test_a_copy_without_a_gradient_adds_zeros_to_the_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDist(0, holders=[{0, 1}, set()])
    monkeypatch.setattr(ties, "dist", fake)
    root = _stage("tok_emb")
    copies = TiedCopies(root, TIED, _FakeMesh((1, 2, 1), 0), torch.device("cpu"))  # type: ignore[arg-type]
    copies.all_reduce_grads()
    assert torch.equal(root.tok_emb.weight.grad, torch.zeros(2, 2))
    (grad, group) = fake.reduced[-1]
    assert grad is root.tok_emb.weight.grad and group == (0, 1)


def test_without_ties_nothing_is_communicated(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeDist(0, holders=[])
    monkeypatch.setattr(ties, "dist", fake)
    copies = TiedCopies(_stage("tok_emb"), [], _FakeMesh((1, 2, 1), 0), torch.device("cpu"))  # type: ignore[arg-type]
    copies.all_reduce_grads()
    assert copies.copies == [] and fake.reduced == [] and fake.created == []
