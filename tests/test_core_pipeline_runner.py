"""PipelineRunner in one process: a pipeline of one rank runs every schedule (one stage, or several
on the rank), so its losses, gradients and outputs are checked against the model run whole."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_scale.core.pipeline import block_costs
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.core.pipeline.spec import PipelineSpec, StageForward, labelled_tokens

CPU = torch.device("cpu")
BLOCKS = [f"blocks.{i}" for i in range(4)]


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


class _Net(nn.Module):
    """emb -> 4 blocks -> head, skipping what a stage removed; ``shift`` is an extra input every block adds."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks:
            x = torch.tanh(block(x)) + (0 if shift is None else shift)
        return x if self.head is None else self.head(x)


def _spec(**overrides: Any) -> PipelineSpec:
    return PipelineSpec(**{"blocks": BLOCKS, "first": ["emb"], "last": ["head"], "loss_fn": _mse, **overrides})


def _runner(
    model: nn.Module, mesh: DeviceMesh, schedule: str = "gpipe", microbatches: int = 2, **kwargs: Any
) -> PipelineRunner:
    kwargs.setdefault("partition", "by_layers")
    runner = PipelineRunner(
        model, kwargs.pop("spec", _spec()), mesh, schedule=schedule, microbatches=microbatches, device=CPU, **kwargs
    )
    runner.build()
    return runner


def _batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3), torch.randn(size, 2)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_training_step_gives_the_whole_models_loss_and_the_scaled_gradients(
    world_of_one: DeviceMesh, schedule: str
) -> None:
    torch.manual_seed(0)
    whole = _Net()
    model = copy.deepcopy(whole)
    runner = _runner(model, world_of_one, schedule)
    x, target = _batch()
    shift = torch.randn(4, 4)  # an extra model input: split into micro-batches, needed by every stage

    loss = runner.train_step(x, target, scale=3.0, kwargs={"shift": shift})

    reference = _mse(whole(x, shift=shift), target)
    reference.backward()
    assert loss.dtype == torch.float64 and loss.shape == ()
    torch.testing.assert_close(loss.float(), reference.detach())
    # The loss scale multiplies the gradients; they are not divided by the micro-batch count.
    expected = {n: 3.0 * g for n, g in _grads(whole).items()}
    torch.testing.assert_close(_grads(model), expected)
    assert runner.timer.read()[2] == 1


# Not interleaved: torch's forward-only interleaved step fails when consecutive stages share a rank,
# which only a pipeline of one rank does.
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv", "dualpipev"])
def test_evaluation_and_prediction_give_the_whole_models_loss_and_output_and_no_gradient(
    world_of_one: DeviceMesh, schedule: str
) -> None:
    torch.manual_seed(0)
    whole = _Net()
    model = copy.deepcopy(whole)
    runner = _runner(model, world_of_one, schedule)
    x, target = _batch()

    loss = runner.eval_step(x, target)
    output = runner.predict_step(x)

    with torch.no_grad():
        expected = whole(x)
    torch.testing.assert_close(loss.float(), _mse(expected, target))
    torch.testing.assert_close(output, expected)
    assert all(g is None for g in _grads(model).values())
    assert runner.timer.read()[2] == 0  # only training steps are timed


def test_micro_batches_count_by_their_labelled_tokens_like_the_whole_batch(world_of_one: DeviceMesh) -> None:
    torch.manual_seed(0)
    whole = _Net()
    model = copy.deepcopy(whole)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)

    runner = _runner(model, world_of_one, spec=_spec(loss_fn=loss_fn, loss_tokens=labelled_tokens))
    x = torch.randn(4, 3)
    target = torch.tensor([1, 0, -100, 0])  # micro-batch 0 holds 2 labelled positions, micro-batch 1 one

    loss = runner.train_step(x, target, scale=1.0)

    reference = loss_fn(whole(x), target)  # the mean over the 3 labelled positions, not a mean of means
    reference.backward()
    torch.testing.assert_close(loss.float(), reference.detach())
    torch.testing.assert_close(_grads(model), _grads(whole))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens if self.emb is None else self.emb(tokens)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x if self.head is None else self.head(x)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_a_weight_tied_across_stages_of_one_rank_gets_the_one_process_gradient(
    world_of_one: DeviceMesh, schedule: str
) -> None:
    torch.manual_seed(0)
    whole = _Tied()
    model = copy.deepcopy(whole)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    runner = _runner(model, world_of_one, schedule, spec=_spec(loss_fn=loss_fn))
    tokens, target = torch.randint(0, 5, (4, 6)), torch.randint(0, 5, (4, 6))

    assert runner.tied_groups == [["emb.weight", "head.weight"]]
    loss = runner.train_step(tokens, target, scale=1.0)

    reference = loss_fn(whole(tokens), target)
    reference.backward()
    torch.testing.assert_close(loss.float(), reference.detach())
    torch.testing.assert_close(_grads(model), _grads(whole))
    assert runner.excluded_from_norm() == set()  # one rank holds the only copy


def test_a_new_micro_batch_count_rebuilds_the_schedules_and_accepts_a_new_batch_shape(world_of_one: DeviceMesh) -> None:
    torch.manual_seed(0)
    whole = _Net()
    model = copy.deepcopy(whole)
    runner = _runner(model, world_of_one, "1f1b")
    runner.train_step(*_batch(4), scale=1.0)
    model.zero_grad(set_to_none=True)

    runner.build(microbatches=4)
    x, target = _batch(8)
    loss = runner.train_step(x, target, scale=1.0)

    assert runner.microbatches == 4
    reference = _mse(whole(x), target)
    reference.backward()
    torch.testing.assert_close(loss.float(), reference.detach())
    torch.testing.assert_close(_grads(model), _grads(whole))
    assert runner.timer.read()[2] == 2


def test_one_stage_runs_the_pruned_root_itself(world_of_one: DeviceMesh) -> None:
    model = _Net()
    runner = _runner(model, world_of_one, "gpipe")
    assert runner.num_stages == 1 and runner.local_stages == [0] and runner.is_first and runner.is_last
    assert runner.root is model and runner.stage_modules() == [model]
    assert runner.block_modules() == list(model.blocks)
    assert runner.partition.ranges == ((0, 4),)
    assert runner.describe() == (
        "Pipeline: 1 stages on 1 ranks (1 per rank), partition by_layers, blocks per stage [4], stage costs "
        "[106.0], predicted bubble 0.0% (gpipe, 2 micro-batches)"
    )  # 16 parameters in emb, 4 x 20 in the blocks, 10 in head


def test_several_stages_on_a_rank_run_views_of_their_own_blocks(world_of_one: DeviceMesh) -> None:
    model = _Net()
    runner = _runner(model, world_of_one, "interleaved_1f1b")
    assert runner.num_stages == 2 and runner.local_stages == [0, 1]
    assert runner.partition.ranges == ((0, 2), (2, 4)) and runner.partition.costs == (56.0, 50.0)
    first, second = runner.stage_modules()
    assert first is not model and second is not model
    assert [n for n, _ in first.named_parameters()] == [
        "emb.weight",
        "emb.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    ]
    assert first.head is None and second.emb is None
    assert second.blocks[0] is model.blocks[2]  # shared, not copied
    assert runner.describe() == (
        "Pipeline: 2 stages on 1 ranks (2 per rank), partition by_layers, blocks per stage [2, 2], stage costs "
        "[56.0, 50.0], predicted bubble 0.0% (interleaved_1f1b, 2 micro-batches)"
    )


def test_a_spec_with_a_stage_forward_runs_each_stage_through_it(world_of_one: DeviceMesh) -> None:
    calls: list[int] = []

    def stage_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.size(0))
        return module(x)

    model = _Net()
    runner = _runner(model, world_of_one, "gpipe", spec=_spec(stage_forward=stage_forward))
    (stage,) = runner.stage_modules()
    assert isinstance(stage, StageForward) and stage.module is model
    runner.train_step(*_batch(4), scale=1.0)
    assert calls[-2:] == [2, 2]  # one call per micro-batch of 2 samples


def test_by_params_weighs_blocks_by_their_parameter_counts(world_of_one: DeviceMesh) -> None:
    model = _Net()
    model.blocks[0] = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))  # 60 parameters
    runner = _runner(model, world_of_one, "interleaved_1f1b", partition="by_params")
    # Blocks weigh [60, 20, 20, 20], emb 16 on the first stage, head 10 on the last: the cut after
    # block 0 gives stages of 76 and 70; by_layers' cut after block 1 would give 96 and 50.
    assert runner.partition.ranges == ((0, 1), (1, 4)) and runner.partition.costs == (76.0, 70.0)


def test_by_cost_cuts_on_the_measured_block_times(world_of_one: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[Any] = []

    def measure_costs(
        root: nn.Module, spec: PipelineSpec, batch: Any, microbatches: int
    ) -> tuple[list[float], float, float]:
        measured.append((batch, microbatches))
        return [0.25, 0.5, 0.125, 0.125], 0.0625, 0.03125

    monkeypatch.setattr(block_costs, "measure_costs", measure_costs)
    batch = _batch(4)
    runner = _runner(_Net(), world_of_one, "interleaved_1f1b", partition="by_cost", example_batch=batch)
    assert measured == [(batch, 2)]
    assert runner.partition.ranges == ((0, 1), (1, 4)) and runner.partition.costs == (0.3125, 0.78125)
    assert "stage costs [0.3125, 0.7812] s, predicted bubble" in runner.describe()


def test_parameters_outside_the_declared_modules_are_named_and_kept_on_the_stage(world_of_one: DeviceMesh) -> None:
    model = _Net()
    model.gain = nn.Parameter(torch.ones(()))
    runner = _runner(model, world_of_one, "interleaved_1f1b")
    assert runner.shared_parameters == ["gain"]
    assert runner.describe().endswith("; on every stage, kept in step: ['gain']")
    assert runner._stage_of(runner.spec, "gain") is None
    assert [
        runner._stage_of(runner.spec, n) for n in ("emb.weight", "blocks.1.bias", "blocks.2.weight", "head.bias")
    ] == [0, 0, 1, 1]


class _Counting(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        if self.emb is not None:
            self.seen += x.size(0)
        return super().forward(x, shift)


def test_a_buffer_outside_the_declared_modules_that_training_changes_is_refused(world_of_one: DeviceMesh) -> None:
    runner = _runner(_Counting(), world_of_one, "gpipe")
    with pytest.raises(
        ValueError, match=re.escape("Buffers ['seen'] of _Counting lie outside every module its pipeline spec")
    ):
        runner.train_step(*_batch(4), scale=1.0)


def test_a_buffer_outside_the_declared_modules_that_training_leaves_alone_is_accepted(world_of_one: DeviceMesh) -> None:
    model = _Net()
    model.register_buffer("fixed", torch.arange(3.0))
    runner = _runner(model, world_of_one, "gpipe")
    runner.train_step(*_batch(4), scale=1.0)
    assert torch.equal(model.fixed, torch.arange(3.0))


class _Unconditional(_Net):
    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(x)  # fails on a stage without the embedding
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x if self.head is None else self.head(x)


# The rank holds the first and the last stage: the embedding is missing from the second stage's view only.
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_a_forward_calling_a_module_its_stage_removed_is_told_which_and_how_to_fix_it(
    world_of_one: DeviceMesh, schedule: str
) -> None:
    runner = _runner(_Unconditional(), world_of_one, schedule)
    with pytest.raises(ValueError, match=re.escape("A pipeline stage's forward called ['emb'] (`x = self.emb(x)")):
        runner.train_step(*_batch(4), scale=1.0)


def test_a_spec_without_a_loss_is_refused(world_of_one: DeviceMesh) -> None:
    with pytest.raises(ValueError, match="The pipeline spec has no loss_fn; the last stage needs one"):
        _runner(_Net(), world_of_one, spec=_spec(loss_fn=None))


def test_by_cost_needs_an_example_batch_of_one_input_tensor(world_of_one: DeviceMesh) -> None:
    with pytest.raises(
        ValueError, match=r"partition='by_cost' times every block on a real batch, but no example batch"
    ):
        _runner(_Net(), world_of_one, partition="by_cost")
    x, target = _batch(4)
    with pytest.raises(
        ValueError, match=r"partition='by_cost' times blocks on a single inputs tensor; use 'by_params'"
    ):
        _runner(_Net(), world_of_one, partition="by_cost", example_batch=((x, x), target))


def test_batches_must_keep_their_shape_and_split_into_equal_micro_batches(world_of_one: DeviceMesh) -> None:
    runner = _runner(_Net(), world_of_one)
    with pytest.raises(ValueError, match=r"microbatches=2 does not divide the per-replica batch of 3 samples"):
        runner.train_step(*_batch(3), scale=1.0)
    runner = _runner(_Net(), world_of_one)
    runner.train_step(*_batch(4), scale=1.0)
    message = "the first batch had inputs of shape (4, 3), this one (6, 3). Use fixed-length sequences"
    with pytest.raises(ValueError, match=re.escape(message)):
        runner.train_step(*_batch(6), scale=1.0)
    with pytest.raises(TypeError, match="Pipeline inputs must be a tensor or a tuple of tensors .*, got list"):
        runner.eval_step([torch.randn(4, 3)], torch.randn(4, 2))  # type: ignore[arg-type]


def test_extra_inputs_named_like_the_schedules_own_arguments_are_refused(world_of_one: DeviceMesh) -> None:
    runner = _runner(_Net(), world_of_one)
    x, target = _batch(4)
    with pytest.raises(ValueError, match=re.escape("extra model inputs ['losses', 'target'] have names that torch's")):
        runner.train_step(x, target, scale=1.0, kwargs={"target": x, "losses": x, "shift": x})
    with pytest.raises(ValueError, match=re.escape("extra model inputs ['target'] have names")):
        runner.predict_step(x, kwargs={"target": x})
