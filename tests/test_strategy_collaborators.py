"""``HybridParallelStrategy``'s collaborators, each on its own: one process, no Trainer (a one-process
gloo group where a collective is part of the behaviour)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_scale.core.checkpoint.sharded_state import ShardedState
from lightning_scale.core.parallel.data_parallel import gradient_sync_blocked
from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.pipeline.spec import PipelineSpec
from lightning_scale.core.precision.grad_norm import GradientScope, model_grad_norm
from lightning_scale.plugins import ShardedCheckpointIO
from lightning_scale.strategies import HybridParallelStrategy
from lightning_scale.strategies.hybrid import collectives
from lightning_scale.strategies.hybrid.checkpoints import ShardedCheckpoints
from lightning_scale.strategies.hybrid.deferred import DeferredBuilder
from lightning_scale.strategies.hybrid.mesh import LayoutMesh
from lightning_scale.strategies.hybrid.options import PRESETS, ParallelOptions
from lightning_scale.strategies.hybrid.pipeline_steps import PipelineSteps
from lightning_scale.strategies.hybrid.state import ParallelState


@pytest.fixture
def one_process_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield  # conftest destroys it


# ------------------------------------------------------------------ options, declared once


def test_the_signature_spells_out_every_option_as_parallel_options_declares_it() -> None:
    # The constructor's signature is written out (IDEs, type checkers and the API reference read it
    # statically); ParallelOptions declares the same options once more, with their checks: they must agree.
    params = inspect.signature(HybridParallelStrategy).parameters
    names = ParallelOptions.names()
    assert list(params)[: len(names)] == names
    lightning = ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"]
    assert list(params)[len(names) :] == [*lightning, "process_group_backend", "timeout"]
    declared = {f.name: f for f in dataclasses.fields(ParallelOptions) if f.init}
    hints, declared_hints = (
        typing.get_type_hints(HybridParallelStrategy.__init__),
        typing.get_type_hints(ParallelOptions),
    )
    for name in names:
        assert params[name].default == declared[name].default, name
        assert type(params[name].default) is type(declared[name].default), name  # 1 is not True
        assert hints[name] == declared_hints[name], (name, hints[name], declared_hints[name])
    sizes = ["data_parallel", "tensor_parallel", "pipeline_parallel"]
    assert [n for n, p in params.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY] == sizes
    assert not [p for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_the_docstring_documents_every_parameter_once() -> None:
    # mkdocstrings renders the Args section as the API reference's parameter table: one entry per parameter.
    doc = inspect.getdoc(HybridParallelStrategy) or ""
    section = doc.split("\nArgs:\n", 1)[1]
    documented = re.findall(r"^    (\w+): \S", section, flags=re.MULTILINE)
    assert documented == list(inspect.signature(HybridParallelStrategy).parameters)


def test_options_are_taken_by_position_and_by_name() -> None:
    strategy = HybridParallelStrategy(2, 2, schedule="gpipe", virtual_stages=3)
    assert (strategy.options.data_parallel, strategy.options.tensor_parallel) == (2, 2)
    assert strategy.options.schedule == "gpipe" and strategy.options.virtual_stages == 3
    assert HybridParallelStrategy(1, 1, 2).options.pipeline_parallel == 2
    assert HybridParallelStrategy(pipeline_parallel="auto").options.pipeline_parallel == "auto"
    # Every option reaches the checked options, not only the sizes.
    given = {"loss_name": "{stage}_loss", "hang_timeout": 30.0, "global_batch_change": "allow", "bucket_cap_mb": 5}
    options = HybridParallelStrategy(**given).options
    assert {name: getattr(options, name) for name in given} == given
    assert options == ParallelOptions(**given)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((), {"data_paralel": 2}, TypeError, r"unexpected keyword argument 'data_paralel'"),
        ((1, 1, 1, 1), {}, TypeError, r"takes from 1 to 4 positional arguments but 5 were given"),
        ((1, 1, 1), {"layout": "x"}, ValueError, r"layout='x' must be"),
        ((2,), {"data_parallel": 2}, TypeError, r"got multiple values for argument 'data_parallel'"),
        ((0,), {}, ValueError, r"data_parallel=0 must be a positive integer or 'auto'"),
        (("2",), {}, ValueError, r"data_parallel='2' must be a positive integer or 'auto'"),
    ],
)
def test_arguments_that_are_no_option_are_refused(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        HybridParallelStrategy(*args, **kwargs)


def test_ddp_keyword_arguments_leave_defaults_out_and_add_the_hooks_on_request() -> None:
    options = ParallelOptions(bucket_cap_mb=10, gradient_compression="powersgd", powersgd_rank=2)
    assert options.ddp_kwargs() == {"bucket_cap_mb": 10}
    assert options.ddp_kwargs(hooks=True) == {
        "bucket_cap_mb": 10,
        "compression": "powersgd",
        "powersgd_rank": 2,
        "powersgd_start_iter": 10,
        "gradient_as_bucket_view": True,  # the package's default, not DDP's, always given to wrap_ddp
    }


def test_the_registered_names_are_the_presets() -> None:
    assert {"hybrid", "pipeline", "tensor_parallel"} <= set(StrategyRegistry)
    for name, (_, options) in PRESETS.items():
        assert StrategyRegistry[name]["strategy"] is HybridParallelStrategy
        assert StrategyRegistry[name]["init_params"] == options
    strategy = StrategyRegistry.get("pipeline")
    assert (strategy.options.data_parallel, strategy.options.pipeline_parallel) == (1, "auto")


def test_a_strategy_before_set_up_says_what_is_not_known_yet() -> None:
    strategy = HybridParallelStrategy()
    assert strategy.pipeline is None
    for name in ("layout", "device_mesh", "model_facts"):
        with pytest.raises(RuntimeError, match="once"):
            getattr(strategy, name)


# ------------------------------------------------------------------ the mesh and what a module was cut for


def test_the_layout_mesh_is_made_once_per_layout_after_the_sizes_are_checked(one_process_group: None) -> None:
    mesh = LayoutMesh()
    sizes = {"world_size": 1, "devices_per_node": 1, "num_nodes": 1, "device_type": "cpu"}
    with pytest.raises(ValueError, match="data_parallel=2"):
        mesh.setup(nn.Module(), ParallelOptions(data_parallel=2), **sizes)
    with pytest.raises(RuntimeError, match="once the processes are set up"):
        mesh.mesh  # noqa: B018
    mesh.setup(nn.Module(), ParallelOptions(), **sizes)
    assert mesh.layout == Layout(1, 1, 1) and mesh.hsdp is None
    assert mesh.mesh.mesh_dim_names == ("dp", "pp", "tp")
    first = mesh.mesh
    mesh.setup(nn.Module(), ParallelOptions(), **sizes)
    assert mesh.mesh is first  # trainer.validate then trainer.fit: the same groups


@pytest.mark.parametrize(
    ("layout", "options", "needed"),
    [
        (Layout(1, 1, 1), {}, False),
        (Layout(2, 1, 1), {}, False),  # plain DDP: a wrapper made per Trainer call
        (Layout(2, 1, 1), {"data_parallel_mode": "fsdp"}, True),
        (Layout(1, 1, 2), {}, True),
        (Layout(1, 2, 1), {}, True),
        (Layout(1, 1, 1), {"activation_checkpointing": "full"}, True),
        (Layout(1, 1, 1), {"compile": True}, True),
    ],
)
def test_which_cut_modules_the_next_trainer_must_adopt(layout: Layout, options: dict, needed: bool) -> None:
    assert ParallelState.needed(layout, ParallelOptions(**options)) is needed


def test_a_module_sharded_with_another_precision_policy_is_refused() -> None:
    module = nn.Linear(2, 2)
    assert ParallelState.adopted(module, Layout(1, 1, 1), None, "32-true") is None
    ParallelState(Layout(1, 1, 1), None, ParallelOptions(), None, None, mp_policy="bf16 policy").attach(module)  # type: ignore[arg-type]
    assert ParallelState.adopted(module, Layout(1, 1, 1), "bf16 policy", "bf16-mixed") is not None
    with pytest.raises(ValueError, match=r"sharded by FSDP2 with mixed precision bf16 policy .* asks for None"):
        ParallelState.adopted(module, Layout(1, 1, 1), None, "32-true")


# ------------------------------------------------------------------ the pipeline's steps


class _Runner:
    """What PipelineSteps asks of a PipelineRunner."""

    def __init__(self) -> None:
        self.root = nn.Linear(2, 1)
        self.spec = PipelineSpec(blocks=["weight"], loss_fn=lambda output, target: output.sum())
        self.batches_described = False
        self.sync_grads = True
        self.scales: list[float] = []
        self.loss: Any = None
        self.metrics: dict[str, Any] = {}  # what the module's own step logged (none: it is not run here)

    def use_loss(self, loss: Any) -> None:
        self.loss = loss

    def train_step(self, inputs: Any, target: Any, scale: float, kwargs: dict) -> torch.Tensor:
        self.scales.append(scale)
        for p in self.root.parameters():
            p.grad = torch.ones_like(p)
        return torch.tensor(2.0, dtype=torch.float64)

    def eval_step(self, inputs: Any, target: Any, kwargs: dict) -> torch.Tensor:
        return torch.tensor(3.0)

    def predict_step(self, inputs: Any, kwargs: dict) -> Any:
        return inputs * 2


class _Module:
    """What PipelineSteps asks of a LightningModule: its trainer's loop position, and ``log``."""

    def __init__(self, batch_idx: int = 0, skip_backward: bool = False) -> None:
        self.logged: dict[str, torch.Tensor] = {}
        loop = SimpleNamespace(_skip_backward=skip_backward, epoch_loop=SimpleNamespace(batch_idx=batch_idx))
        self.trainer = SimpleNamespace(fit_loop=loop, accumulate_grad_batches=2)

    def log(self, name: str, value: torch.Tensor, prog_bar: bool = False) -> None:
        self.logged[name] = value


def _steps() -> tuple[PipelineSteps, _Runner, torch.optim.Optimizer]:
    steps = PipelineSteps({"train": "train/loss", "val": "v", "test": "t"})
    steps.runner = runner = _Runner()
    return steps, runner, torch.optim.SGD(runner.root.parameters(), lr=0.1)


def test_a_windows_first_step_sets_its_gradients_aside_until_backward() -> None:
    steps, runner, optimizer = _steps()
    for p in runner.root.parameters():
        p.grad = torch.full_like(p, 7.0)  # the previous step's: released before the schedule runs
    module = _Module(batch_idx=0)
    loss = steps.train(module, (torch.ones(1, 2), torch.ones(1)), optimizer, loss_scale=4.0)
    assert runner.scales == [2.0]  # the loss scale, over the accumulation window
    assert loss.dtype == torch.float32  # the model's precision, as its own step would return it
    assert module.logged["train/loss"].dtype == torch.float64 and float(module.logged["train/loss"]) == 2.0
    assert all(p.grad is None for p in runner.root.parameters())  # Lightning's zero_grad finds none
    steps.put_back_grads()
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in runner.root.parameters())
    assert steps.stashed == []


def test_a_later_micro_step_keeps_its_gradients_and_a_forward_only_step_runs_no_backward() -> None:
    steps, runner, optimizer = _steps()
    steps.train(_Module(batch_idx=1), (torch.ones(1, 2), torch.ones(1)), optimizer)
    assert steps.stashed == [] and all(p.grad is not None for p in runner.root.parameters())
    loss = steps.train(_Module(skip_backward=True), (torch.ones(1, 2), torch.ones(1)), optimizer)
    assert float(loss) == 3.0 and runner.scales == [0.5]


def test_evaluation_and_prediction_run_the_pipeline() -> None:
    steps, runner, _ = _steps()
    module = _Module()
    assert float(steps.evaluate(module, (torch.ones(1, 2), torch.ones(1)), "val")) == 3.0
    assert "v" in module.logged and runner.batches_described
    entered = []

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        entered.append(True)
        yield

    assert torch.equal(steps.predict(module, torch.ones(2), context), torch.full((2,), 2.0))
    assert entered == [True]


def test_gradient_sync_is_blocked_inside_only() -> None:
    steps, runner, _ = _steps()
    with pytest.raises(KeyError), steps.grad_sync_blocked():
        assert runner.sync_grads is False
        raise KeyError
    assert runner.sync_grads is True
    with pytest.raises(RuntimeError, match="has no pipeline runner"):
        PipelineSteps({}).evaluate(_Module(), None, "val")


def test_fsdp_gradient_sync_is_blocked_inside_only(one_process_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(2, 2))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    with mock.patch.object(model[0], "set_requires_gradient_sync") as switch:
        with gradient_sync_blocked(model):
            assert switch.call_args_list == [mock.call(False, recurse=False)]
        assert switch.call_args_list[-1] == mock.call(True, recurse=False)


# ------------------------------------------------------------------ deferred initialisation


class _HalfInitialised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)  # the bias is left as it is


def test_modules_are_created_on_the_meta_device_unless_asked_not_to() -> None:
    builder = DeferredBuilder()
    with builder.init_context(torch.device("cpu"), contextlib.nullcontext, None):
        assert nn.Linear(2, 2).weight.is_meta
    with builder.init_context(torch.device("cpu"), contextlib.nullcontext, False):
        assert not nn.Linear(2, 2).weight.is_meta


def test_a_real_module_is_moved_and_a_meta_one_planned() -> None:
    builder, move = DeferredBuilder(), mock.Mock()
    assert builder.plan_or_move(nn.Linear(2, 2), torch.device("cpu"), move) is False
    assert move.call_count == 1 and builder.plan is None
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert builder.plan_or_move(meta, torch.device("cpu"), move) is True
    assert move.call_count == 1 and builder.plan is not None


def test_each_rank_materialises_its_part_once(one_process_group: None) -> None:
    builder = DeferredBuilder()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    builder.plan_or_move(model, torch.device("cpu"), mock.Mock())
    builder.materialize(model, torch.device("cpu"))
    assert builder.plan is None
    assert all(not p.is_meta and torch.isfinite(p).all() for p in model.parameters())
    builder.materialize(model, torch.device("cpu"))  # nothing left to do


def test_an_initialiser_that_leaves_a_tensor_unset_is_refused(one_process_group: None) -> None:
    builder = DeferredBuilder()
    with torch.device("meta"):
        model = _HalfInitialised()
    builder.plan_or_move(model, torch.device("cpu"), mock.Mock())
    with pytest.raises(ValueError, match=r"left 1 tensors uninitialised: \['lin.bias: _HalfInitialised._init_weights"):
        builder.materialize(model, torch.device("cpu"))


# ------------------------------------------------------------------ collectives over the world


def test_collectives_before_the_process_group_exists_return_their_input(monkeypatch: pytest.MonkeyPatch) -> None:
    collectives.barrier(None)
    assert collectives.broadcast({"a": 1}) == {"a": 1}
    value = torch.tensor([3.0])
    assert collectives.reduce(value) is value and collectives.reduce("x") == "x"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert collectives.elastic_attempt_store(2, None) is None


def test_reduce_takes_op_names_ops_and_means(one_process_group: None) -> None:
    collectives.barrier(torch.device("cpu"))
    assert collectives.broadcast([1, 2]) == [1, 2]
    assert float(collectives.reduce(torch.tensor([3.0]), reduce_op="mean")) == 3.0
    assert float(collectives.reduce(torch.tensor([3.0]), reduce_op="sum")) == 3.0
    assert float(collectives.reduce(torch.tensor([3.0]), reduce_op=dist.ReduceOp.MAX)) == 3.0
    mean = collectives.reduce(torch.tensor([3]), reduce_op="avg")
    assert mean.dtype == torch.int64 and int(mean) == 3


def test_the_gradient_norm_counts_every_gradient_once() -> None:
    a, b = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    norm = model_grad_norm([a, b], GradientScope())
    assert norm.dtype == torch.float64 and float(norm) == 5.0


# ------------------------------------------------------------------ checkpoints


def _trainer(tmp_path: Path, fn: TrainerFn = TrainerFn.FITTING) -> Any:
    return SimpleNamespace(
        strategy=SimpleNamespace(checkpoint_io=ShardedCheckpointIO()),
        state=SimpleNamespace(fn=fn),
        checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path))],
        callbacks=[],
        _checkpoint_connector=SimpleNamespace(resume_start=mock.Mock()),
    )


def test_only_a_sharded_checkpoint_io_is_taken(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint_io=TorchCheckpointIO writes whole files from one rank"):
        ShardedCheckpoints.sharded(TorchCheckpointIO())
    with pytest.raises(ValueError, match="checkpoint_io=TorchCheckpointIO writes whole files from one rank"):
        at = {"layout": Layout(1, 1, 1), "world_size": 1}
        ShardedCheckpoints().load(TorchCheckpointIO(), tmp_path, None, ShardedState(nn.Linear(1, 1)), [], **at)
    io = ShardedCheckpointIO()
    assert ShardedCheckpoints.sharded(io) is io


def test_latest_resolves_to_none_with_a_warning_when_nothing_verifies(tmp_path: Path) -> None:
    io, checkpoints = ShardedCheckpointIO(auto_resume=False), ShardedCheckpoints()
    trainer = _trainer(tmp_path)
    assert checkpoints.resolve_ckpt_path(trainer, io, "some.ckpt") == "some.ckpt"
    assert checkpoints.resolve_ckpt_path(trainer, io, None) is None  # auto_resume=False: nothing looked for
    with pytest.warns(
        UserWarning, match='ckpt_path="latest": no checkpoint that verifies in .*; starting from scratch'
    ):
        assert checkpoints.resolve_ckpt_path(trainer, io, "latest") is None
    assert checkpoints.resumed_by_latest is None


def test_the_path_resolver_is_installed_once_per_trainer(tmp_path: Path) -> None:
    checkpoints, trainer = ShardedCheckpoints(), _trainer(tmp_path)
    original = trainer._checkpoint_connector.resume_start
    checkpoints.install_path_resolver(trainer)
    wrapped = trainer._checkpoint_connector.resume_start
    checkpoints.install_path_resolver(trainer)
    assert trainer._checkpoint_connector.resume_start is wrapped
    wrapped("given.ckpt")
    original.assert_called_once_with("given.ckpt", weights_only=None)
    trainer.strategy.checkpoint_io = TorchCheckpointIO()  # the plugin the strategy has when resuming
    with pytest.raises(ValueError, match="writes whole files from one rank"):
        wrapped("latest")


def test_the_strategy_adds_no_resilience_callback_to_a_fit(tmp_path: Path) -> None:
    # The watchdog and the preemption handling are the strategy's own collaborator, called from its methods.
    strategy = HybridParallelStrategy()
    assert strategy.resilience.policy is not None and strategy.resilience.watchdog is None  # started by on_train_start
    assert HybridParallelStrategy(hang_timeout=0).resilience.policy is None
    assert not hasattr(ShardedCheckpoints, "add_preemption_checkpoint")
    assert HybridParallelStrategy.__mro__[1].__name__ == "ParallelStrategy"  # one base class, no mixin


def test_storage_options_must_be_a_mapping_for_the_manifest() -> None:
    io, checkpoints = mock.Mock(spec=ShardedCheckpointIO), ShardedCheckpoints()
    state = ShardedState(LightningModule(), tied=[["a", "b"]])
    kwargs = {"layout": Layout(1, 1, 1), "data_parallel_mode": "ddp"}
    with pytest.raises(TypeError, match=r"storage_options=\['x'\]: .* pass a dict or None"):
        checkpoints.save(io, {}, "path", state, **kwargs, storage_options=["x"])
    checkpoints.save(io, {}, "path", state, **kwargs, storage_options={"k": 1})
    manifest = io.save_checkpoint.call_args.kwargs["storage_options"]
    assert manifest["layout"] == {"dp": 1, "tp": 1, "pp": 1, "data_parallel_mode": "ddp"}
    assert manifest["tied"] == [["a", "b"]] and manifest["storage_options"] == {"k": 1}
    assert manifest["huggingface"] is None and manifest["wandb_run_id"] is None


def test_a_whole_state_file_and_a_sharded_checkpoint_load_through_the_same_call() -> None:
    source, target = nn.Linear(2, 2), nn.Linear(2, 2)
    state = ShardedState(target)
    ShardedCheckpoints.load_model_state(state, {"state_dict": source.state_dict()}, strict=True, partial=False)
    assert torch.equal(target.weight, source.weight)
    sharded = {"state_dict": {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "lightning_scale": {}}
    ShardedCheckpoints.load_model_state(state, sharded, strict=True, partial=False)
    assert not target.weight.any()
    optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="The checkpoint has 2 optimizer states and configure_optimizers built 1"):
        two = {"optimizer_states": [{}, {}], "lightning_scale": {}}
        ShardedCheckpoints.load_optimizer_states(state, [optimizer], two, partial=False)


def test_a_whole_state_file_is_loaded_as_it_is(tmp_path: Path) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "whole.ckpt")
    state, at = ShardedState(nn.Linear(1, 1)), {"layout": Layout(1, 1, 1), "world_size": 1}
    loaded = ShardedCheckpoints().load(ShardedCheckpointIO(), tmp_path / "whole.ckpt", None, state, [], **at)
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))
