"""torch's schedules by name, the skipped gradient reduction on accumulation micro-steps, and the
forward-only V-shaped schedule, on a pipeline of one rank (one process)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from lightning_scale.core.pipeline.partition import SCHEDULES
from lightning_scale.core.pipeline.schedules import GradSyncStage, build_schedule, forward_only_schedule, make_stages

CPU = torch.device("cpu")


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _stages(mesh: DeviceMesh, count: int, sync: list[bool] | None = None) -> list[GradSyncStage]:
    modules = [nn.Linear(2, 2) for _ in range(count)]
    if sync is None:
        return make_stages(modules, range(count), count, CPU, mesh["pp"].get_group())  # type: ignore[return-value]
    return make_stages(modules, range(count), count, CPU, mesh["pp"].get_group(), lambda: sync[0])  # type: ignore[return-value]


# (name, stages per rank, torch's class): every schedule the package offers.
CASES = [
    ("gpipe", 1, ScheduleGPipe),
    ("1f1b", 1, Schedule1F1B),
    ("interleaved_1f1b", 2, ScheduleInterleaved1F1B),
    ("interleaved_zero_bubble", 2, ScheduleInterleavedZeroBubble),
    ("zbv", 2, ScheduleZBVZeroBubble),
    ("dualpipev", 2, ScheduleDualPipeV),
]


def test_every_schedule_the_package_offers_is_checked_here() -> None:
    assert sorted(name for name, _, _ in CASES) == sorted(SCHEDULES)


@pytest.mark.parametrize(("name", "count", "cls"), CASES)
def test_each_schedule_is_torchs_by_name_and_leaves_the_gradients_unscaled(
    world_of_one: DeviceMesh, name: str, count: int, cls: type
) -> None:
    stages = _stages(world_of_one, count)
    assert [type(s) for s in stages] == [GradSyncStage] * count and [s.stage_index for s in stages] == list(
        range(count)
    )
    schedule = build_schedule(name, stages, 2, _mse)
    assert type(schedule) is cls and schedule.scale_grads is False and schedule._n_microbatches == 2


def test_a_one_stage_schedule_refuses_several_stages_and_an_unknown_name_is_refused(world_of_one: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"^schedule='1f1b' runs one stage per rank, got 2$"):
        build_schedule("1f1b", _stages(world_of_one, 2), 2, _mse)
    with pytest.raises(ValueError, match=r"^Unknown pipeline schedule 'pipedream'$"):
        build_schedule("pipedream", _stages(world_of_one, 1), 2, _mse)


def test_make_stages_needs_one_stage_index_per_module(world_of_one: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is longer than argument 1"):
        make_stages([nn.Linear(2, 2)], [0, 1], 2, CPU, world_of_one["pp"].get_group())


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"])
def test_evaluation_runs_the_training_schedule_itself_outside_the_v_shapes(world_of_one: DeviceMesh, name: str) -> None:
    stages = _stages(world_of_one, 1 if name in ("gpipe", "1f1b") else 2)
    training = build_schedule(name, stages, 2, _mse)
    assert forward_only_schedule(name, [], 2, _mse, training) is training


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_a_v_shaped_schedule_evaluates_with_the_forward_actions_of_zbv_on_stages_of_its_own(
    world_of_one: DeviceMesh, name: str
) -> None:
    training = build_schedule(name, _stages(world_of_one, 2), 4, _mse)
    own = _stages(world_of_one, 2)
    schedule = forward_only_schedule(name, own, 4, _mse, training)

    assert type(schedule) is ScheduleZBVZeroBubble and schedule is not training and schedule._stages == own
    full = ScheduleZBVZeroBubble(_stages(world_of_one, 2), 4, loss_fn=_mse).pipeline_order_with_comms
    forward = {"F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}
    kept = {rank: [str(a) for a in actions] for rank, actions in schedule.pipeline_order_with_comms.items()}
    assert kept == {
        rank: [str(a) for a in actions if a.computation_type.value in forward] for rank, actions in full.items()
    }
    # One rank, 2 stages, 4 micro-batches: every forward in the training order, within the unshard and
    # reshard of each stage; no backward, no gradient reduction.
    assert kept == {
        0: ["0UNSHARD", "1UNSHARD", "0F0", "1F0", "0F1", "1F1", "0F2", "1F2", "0F3", "1F3", "1RESHARD", "0RESHARD"]
    }


def _sharded(mesh: DeviceMesh) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    module = copy.deepcopy(whole)
    fully_shard(module, mesh=mesh["dp"])
    return whole, module


def test_an_fsdp_stage_keeps_its_gradients_unreduced_until_the_last_micro_step(world_of_one: DeviceMesh) -> None:
    whole, module = _sharded(world_of_one)
    sync = [False]
    stages = make_stages([module], [0], 1, CPU, world_of_one["pp"].get_group(), lambda: sync[0])
    schedule = build_schedule("gpipe", stages, 2, _mse)
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(2)]

    schedule.step(batches[0][0], target=batches[0][1])
    # Reduction skipped: FSDP keeps the unsharded gradients to itself, the parameters have none yet.
    assert all(p.grad is None for p in module.parameters())
    assert "set_requires_gradient_sync" not in module.__dict__  # the stand-in is gone after the step

    schedule.eval(batches[0][0], target=batches[0][1])  # a forward-only step in the window reduces nothing
    assert all(p.grad is None for p in module.parameters())

    sync[0] = True
    schedule.step(batches[1][0], target=batches[1][1])

    # The window's last step reduces both micro-steps' gradients: each step sums its two micro-batches'
    # losses (scale_grads=False).
    for x, target in batches:
        for part_x, part_target in zip(x.chunk(2), target.chunk(2)):
            _mse(whole(part_x), part_target).backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in module.parameters()]
    torch.testing.assert_close(grads, [p.grad for p in whole.parameters()])


def test_a_stage_that_is_not_fsdp_reduces_as_torch_does_whatever_the_flag(
    world_of_one: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.pipelining import PipelineStage

    calls: list[int] = []
    monkeypatch.setattr(PipelineStage, "perform_reduce_grad", lambda self, factor: calls.append(factor))
    (stage,) = _stages(world_of_one, 1, sync=[False])
    stage.perform_reduce_grad(3)
    assert calls == [3]
