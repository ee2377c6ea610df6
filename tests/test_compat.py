"""Canaries for every private torch and Lightning API the package uses.

Each entry of ``lightning_scale.core.compat.SHIMS`` and ``lightning_scale.core.compat_c10d.SHIMS`` (torch's) and
``lightning_scale._lightning_compat.SHIMS`` (Lightning's) has a canary here of the same name that checks its targets are still there, with the
shape the shims rely on (attributes, signatures, enum members, the layouts of files), against the
release it was written against. After an upgrade, the canary of each API that changed fails, naming
it. The canaries justify the upper bounds on torch and lightning in ``pyproject.toml``.

Each canary is a plain function that looks its targets up when called, so it can run against a
patched library: removing a target (``monkeypatch.delattr``) makes exactly that entry's canary fail
(``test_removing_a_target_fails_exactly_its_canary``). Attributes of instances (``Class().attr`` in a
target) are looked up on a probe instance of their own per entry.

``tests/test_private_apis.py`` scans the package's source, so a new private use has to go through a
shim (and get a canary) to pass.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
import pickle
import pickletools
import re
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib
import torch
from torch import nn

from lightning_scale import _lightning_compat as lc
from lightning_scale.core import compat as tc
from lightning_scale.core import compat_c10d as c10d

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "lightning_scale"
COMPAT_MODULES = (tc, c10d, lc)
SHIMS: dict[str, tc.Shim] = {**tc.SHIMS, **c10d.SHIMS, **lc.SHIMS}


# ---------------------------------------------------------------- resolving targets


def _import_prefix(dotted: str) -> tuple[Any, list[str]]:
    """The longest importable module of ``dotted`` and the names after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:cut])), parts[cut:]
        except ImportError:
            continue
    raise AssertionError(f"nothing of {dotted} can be imported")


@cache
def _owner_class(path: str) -> Any:
    obj, rest = _import_prefix(path)
    for name in rest:
        obj = getattr(obj, name)
    return obj


def _split(target: str) -> tuple[str, bool, str]:
    """``(owner path, of instances?, attribute)`` of a target."""
    owner, _, attr = target.rpartition(".")
    return owner.removesuffix("()"), owner.endswith("()"), attr


def _quiet_trainer() -> Any:
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@cache
def _hyper_module_class() -> type:
    from lightning.pytorch import LightningModule

    class HyperModule(LightningModule):
        """A LightningModule that saves its hyperparameters."""

        def __init__(self, a: int = 1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(1, 1)

    return HyperModule


def _hyper_module(a: int = 1) -> Any:
    return _hyper_module_class()(a)


def _torch_module() -> nn.Module:
    module = nn.Sequential(nn.Identity())
    module.register_parameter("p", nn.Parameter(torch.zeros(1)))
    module.register_buffer("b", torch.zeros(1))
    module.register_forward_hook(lambda *_: None)
    return module


def _device_mesh() -> Any:
    """A 1-process mesh, its process group gone again (the mesh keeps its group registry)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    finally:
        if own:
            dist.destroy_process_group()


def _strategy() -> Any:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return SingleDeviceStrategy(device=torch.device("cpu"))


def _wandb_logger() -> Any:
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(offline=True)


PROBES: dict[str, Callable[[], Any]] = {
    "torch.distributed.device_mesh.DeviceMesh": _device_mesh,
    "torch.nn.Module": _torch_module,
    "lightning.pytorch.Trainer": _quiet_trainer,
    "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector": (
        lambda: _quiet_trainer()._checkpoint_connector
    ),
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop": lambda: _quiet_trainer().fit_loop.epoch_loop,
    "lightning.pytorch.loops.fit_loop._FitLoop": lambda: _quiet_trainer().fit_loop,
    "lightning.pytorch.loops.evaluation_loop._EvaluationLoop": lambda: _quiet_trainer().validate_loop,
    "lightning.pytorch.loops.prediction_loop._PredictionLoop": lambda: _quiet_trainer().predict_loop,
    "lightning.pytorch.LightningModule": _hyper_module,
    "lightning.pytorch.core.mixins.hparams_mixin.HyperparametersMixin": _hyper_module,
    "lightning.pytorch.strategies.Strategy": _strategy,
    "lightning.pytorch.loggers.WandbLogger": _wandb_logger,
}
"""How to make an instance of each class a target names an attribute of instances of. A class missing
here (a pipeline schedule needs stages and a process group) is checked from its source instead."""


@cache
def probe(entry: str, owner: str) -> Any:
    """The instance of ``owner`` (a class's dotted name) that ``entry``'s canary and removal use: one per
    entry, so removing an attribute from it touches no other entry's canary."""
    made = PROBES[owner]()
    assert isinstance(made, _owner_class(owner)), (owner, type(made))
    return made


def target_owner(entry: str, target: str) -> Any:
    """The object holding ``target``'s attribute: its module, its class, or ``entry``'s probe instance."""
    owner, of_instances, _ = _split(target)
    return probe(entry, owner) if of_instances else _owner_class(owner)


def removable(target: str) -> bool:
    owner, of_instances, _ = _split(target)
    return not of_instances or owner in PROBES


def present(entry: str) -> None:
    """Every target of ``entry`` is there (those of instances without a probe: checked by the canary)."""
    for target in SHIMS[entry].targets:
        if removable(target):
            owner = target_owner(entry, target)
            attr = _split(target)[2]
            assert hasattr(owner, attr), f"{target} is gone"


@cache
def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _globals(data: bytes) -> set[tuple[str, str]]:
    """The ``(module, name)`` pairs a pickle refers to."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            module, name = arg.split(" ", 1)
            found.add((module, name))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


# ---------------------------------------------------------------- torch's canaries


def _schedules() -> Any:
    return importlib.import_module("torch.distributed.pipelining.schedules")


def canary_flatten_mesh() -> None:
    present("flatten_mesh")
    from torch.distributed.device_mesh import DeviceMesh

    assert _params(DeviceMesh._flatten)[:2] == ["self", "mesh_dim_name"], inspect.signature(DeviceMesh._flatten)


def canary_mesh_group_registry() -> None:
    present("mesh_group_registry")
    mesh = probe("mesh_group_registry", "torch.distributed.device_mesh.DeviceMesh")
    assert isinstance(tc.mesh_group_registry(mesh), dict)


def canary_pipeline_stage_compute() -> None:
    present("pipeline_stage_compute")
    from torch.distributed.pipelining import PipelineStage

    source = _source(_schedules())
    for name in tc.PIPELINE_STAGE_COMPUTE:
        assert callable(getattr(PipelineStage, name, None)), f"PipelineStage.{name} is gone"
        # Called through the stage instance, so that an instance attribute wraps it.
        assert re.search(rf"stage\.{name}\(", source), f"torch's schedules no longer call stage.{name}(...)"


def canary_forward_action_types() -> None:
    present("forward_action_types")
    kinds = tc.forward_action_types()
    assert {kind.name for kind in kinds} == {"FORWARD", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}


def canary_keep_lowered_actions() -> None:
    present("keep_lowered_actions")
    schedules = _schedules()
    runtime = schedules._PipelineScheduleRuntime
    assert issubclass(schedules.ScheduleZBVZeroBubble, runtime)
    assert issubclass(schedules.ScheduleDualPipeV, runtime)
    assert "self.pipeline_order_with_comms" in _source(runtime), (
        "the lowered order is no longer pipeline_order_with_comms"
    )
    kept, dropped = object(), object()
    schedule = SimpleNamespace(
        pipeline_order_with_comms={0: [schedules._Action(0, kept, 0), schedules._Action(1, dropped, 0)]}
    )
    tc.keep_lowered_actions(schedule, lambda kind: kind is kept)
    assert [a.stage_index for a in schedule.pipeline_order_with_comms[0]] == [0]


def canary_perform_reduce_grad() -> None:
    present("perform_reduce_grad")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    reduce = PipelineStage.perform_reduce_grad
    assert _params(reduce) == ["self", "grad_scale_factor"], inspect.signature(reduce)
    assert "set_requires_gradient_sync(True)" in _source(reduce), "perform_reduce_grad no longer turns FSDP sync on"
    assert ".perform_reduce_grad(" in _source(_schedules()), "torch's schedules no longer call perform_reduce_grad"
    signature = inspect.signature(FSDPModule.set_requires_gradient_sync)
    assert list(signature.parameters)[:2] == ["self", "requires_gradient_sync"]
    assert signature.parameters["recurse"].kind is inspect.Parameter.KEYWORD_ONLY

    class Module:
        asked: list[bool] = []

        def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
            self.asked.append(requires_gradient_sync)

    module = Module()
    with tc.gradient_sync_held_off(module):
        module.set_requires_gradient_sync(True)
    module.set_requires_gradient_sync(True)
    assert module.asked == [False, True]


def canary_fsdp_replicate() -> None:
    present("fsdp_replicate")
    replicate = importlib.import_module("torch.distributed._composable.replicate_with_fsdp").replicate
    parameters = inspect.signature(replicate).parameters
    assert "mesh" in parameters and parameters["mesh"].kind is inspect.Parameter.KEYWORD_ONLY


def canary_memory_tracker() -> None:
    present("memory_tracker")
    tracker = tc.memory_tracker()()
    assert callable(tracker.track_external) and callable(tracker.get_tracker_snapshot)
    with tracker:
        kept = torch.ones(1024)  # 4 KiB of live tensor storage, counted at its peak
    assert sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values()) >= kept.numel() * 4


def canary_default_store() -> None:
    present("default_store")
    import torch.distributed as dist

    if dist.is_initialized():  # a group this process already has: its store is what the shim must give
        assert isinstance(c10d.default_store(), dist.Store)
        return
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found, keys = c10d.default_store(), store.num_keys()
        found.set("lightning_scale/canary", "1")  # a key of the group's own store (under the group's prefix)
        assert (
            isinstance(found, dist.Store) and found.check(["lightning_scale/canary"]) and store.num_keys() == keys + 1
        )
    finally:
        dist.destroy_process_group()


def canary_flight_recorder_json() -> None:
    present("flight_recorder_json")
    parsed = json.loads(c10d.flight_recorder_json(nccl=False))
    # "entries" too once a collective was recorded (tests/test_hang.py reads a recorded trace's pg_status).
    assert {"pg_status", "version"} <= set(parsed) and isinstance(parsed["pg_status"], dict), sorted(parsed)
    if torch.distributed.is_nccl_available():  # CUDA builds: the NCCL recorder's dump too
        assert isinstance(c10d.flight_recorder_json(nccl=True), bytes)


def _module_table(entry: str, shim: Callable[[nn.Module], dict], public: str) -> None:
    present(entry)
    module = probe(entry, "torch.nn.Module")
    table = shim(module)
    assert isinstance(table, dict) and table is shim(module), "not the module's own live table"
    assert dict(table) == dict(getattr(module, public)(**({} if public == "named_children" else {"recurse": False})))


def canary_module_parameters() -> None:
    _module_table("module_parameters", tc.module_parameters, "named_parameters")


def canary_module_buffers() -> None:
    _module_table("module_buffers", tc.module_buffers, "named_buffers")


def canary_module_children() -> None:
    _module_table("module_children", tc.module_children, "named_children")


def canary_apply_to_tensors() -> None:
    present("apply_to_tensors")
    module = nn.Linear(2, 2, device="meta")
    tc.apply_to_tensors(module, lambda t: torch.zeros_like(t, device="cpu") if t.is_meta else t)
    assert isinstance(module.weight, nn.Parameter) and module.weight.device.type == "cpu"


def canary_module_hooks_suspended() -> None:
    present("module_hooks_suspended")
    module = probe("module_hooks_suspended", "torch.nn.Module")
    tables = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    assert all(isinstance(getattr(module, name), dict) for name in tables)
    hooks = dict(module._forward_hooks)
    assert hooks, "the probe's forward hook is not in _forward_hooks"
    with tc.module_hooks_suspended(module):
        assert not module._forward_hooks
    assert dict(module._forward_hooks) == hooks


def canary_foreach_norm() -> None:
    present("foreach_norm")
    (norm,) = tc.foreach_norm([torch.tensor([3.0, 4.0], dtype=torch.float16)], 2.0, dtype=torch.float32)
    assert norm.dtype == torch.float32 and float(norm) == 5.0


def canary_foreach_mul_() -> None:
    present("foreach_mul_")
    tensors = [torch.ones(2), torch.ones(3)]
    tc.foreach_mul_(tensors, 0.5)
    assert all(bool((t == 0.5).all()) for t in tensors)


def canary_create_cpu_state_dict() -> None:
    present("create_cpu_state_dict")
    state = {"a": torch.ones(2, 3)}
    copy = tc.create_cpu_state_dict(state, pin_memory=False)
    assert copy["a"] is not state["a"] and copy["a"].shape == (2, 3) and copy["a"].device.type == "cpu"


def canary_copy_state_dict() -> None:
    present("copy_state_dict")
    copy = {"a": torch.zeros(2)}
    out = tc.copy_state_dict({"a": torch.ones(2)}, copy)
    assert out["a"] is copy["a"] and bool((copy["a"] == 1).all())


def canary_dcp_fsspec_filesystem() -> None:
    present("dcp_fsspec_filesystem")
    import fsspec

    layer = tc.dcp_fsspec_filesystem()
    assert "path" in _params(layer.init_path)
    layer.init_path("memory://lightning-scale-canary/checkpoint")
    assert isinstance(layer.fs, fsspec.AbstractFileSystem)


def canary_strip_protocol() -> None:
    present("strip_protocol")
    import fsspec

    assert isinstance(inspect.getattr_static(fsspec.AbstractFileSystem, "_strip_protocol"), classmethod)
    assert tc.strip_protocol(fsspec.filesystem("memory"), "memory://bucket/run") == "/bucket/run"


def canary_dcp_file_names() -> None:
    present("dcp_file_names")
    filesystem = importlib.import_module("torch.distributed.checkpoint.filesystem")
    assert filesystem._metadata_fn == tc.DCP_METADATA_FILE
    assert tc.DCP_DATA_FILE.fullmatch(f"__3_12{filesystem.DEFAULT_SUFFIX}")
    source = _source(filesystem)
    assert '_StoragePrefix(f"__{' in source, "DCP no longer prefixes data files with __<rank>_"
    assert 'f"__{rank}{_metadata_fn}"' in source, "DCP no longer names a rank's own metadata __<rank>.metadata"
    assert tc.dcp_metadata_file(3) == "__3.metadata"


def canary_dcp_storage_info_type() -> None:
    present("dcp_storage_info_type")
    info = tc.dcp_storage_info_type()
    assert [f.name for f in dataclasses.fields(info)] == ["relative_path", "offset", "length", "transform_descriptors"]
    # What a .metadata pickle names it by (checkpoints written before must keep loading).
    assert (info.__module__, info.__qualname__) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def canary_dcp_memory_format_encoding() -> None:
    present("dcp_memory_format_encoding")
    from torch.distributed.checkpoint.metadata import TensorProperties

    encoding = tc.dcp_memory_format_encoding()
    assert set(encoding.__members__) >= {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}
    assert (encoding.__module__, encoding.__qualname__) == (
        "torch.distributed.checkpoint.metadata",
        "_MEM_FORMAT_ENCODING",
    )
    assert "_MEM_FORMAT_ENCODING" in _source(TensorProperties.__getstate__)


def canary_torch_layout_pickle_name() -> None:
    present("torch_layout_pickle_name")
    assert _globals(pickle.dumps(torch.strided)) == {tc.TORCH_LAYOUT_PICKLE_NAME}
    module, name = tc.TORCH_LAYOUT_PICKLE_NAME
    assert getattr(importlib.import_module(module), name)("torch.strided") is torch.strided


class _Rebuild(pickle.Unpickler):
    """What a ``data.pkl`` asks for, as data: calls are ``("call", (module, name), args)``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        return lambda *args: ("call", (module, name), args)

    def persistent_load(self, pid: Any) -> Any:
        return pid


def canary_torch_save_layout() -> None:
    present("torch_save_layout")
    for storage, dtype in tc.TORCH_SAVE_STORAGE_DTYPES.items():
        buffer = io.BytesIO()
        torch.save(torch.zeros(2, 3, dtype=dtype), buffer)
        with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
            records = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            assert set(records) <= tc.TORCH_SAVE_RECORDS and {"data.pkl", "data/0"} <= set(records), sorted(records)
            assert all(info.compress_type == zipfile.ZIP_STORED for info in records.values())
            data = archive.read(records["data.pkl"])
        assert _globals(data) == {tc.TORCH_SAVE_REBUILD_TENSOR, ("torch", storage), ("collections", "OrderedDict")}
        rebuilt = _Rebuild(io.BytesIO(data)).load()
        assert rebuilt == (
            "call",
            tc.TORCH_SAVE_REBUILD_TENSOR,
            (("storage", storage, "0", "cpu", 6), 0, (2, 3), (3, 1), False, OrderedDict()),
        )


# ---------------------------------------------------------------- Lightning's canaries


def canary_checkpoint_connector() -> None:
    present("checkpoint_connector")
    connector = lc.checkpoint_connector(probe("checkpoint_connector", "lightning.pytorch.Trainer"))
    assert type(connector).__name__ == "_CheckpointConnector"


def canary_resume_start() -> None:
    present("resume_start")
    module = importlib.import_module("lightning.pytorch.trainer.connectors.checkpoint_connector")
    signature = inspect.signature(module._CheckpointConnector.resume_start)
    assert list(signature.parameters) == ["self", "checkpoint_path", "weights_only"], signature
    # Called through the instance, so that an instance attribute wraps it.
    assert "self.resume_start(checkpoint_path, weights_only=weights_only)" in _source(module)
    calls: list[Any] = []
    trainer = SimpleNamespace(
        _checkpoint_connector=SimpleNamespace(resume_start=lambda p, weights_only: calls.append((p, weights_only)))
    )
    lc.wrap_resume_start(trainer, lambda path: f"resolved {path}")
    lc.wrap_resume_start(trainer, lambda path: "twice")  # once per trainer
    trainer._checkpoint_connector.resume_start("latest", weights_only=False)
    assert calls == [("resolved latest", False)]


def canary_restore_training_state() -> None:
    present("restore_training_state")
    connector = probe(
        "restore_training_state", "lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector"
    )
    assert connector._loaded_checkpoint == {}
    for name in ("restore_model", "restore_precision_plugin_state", "restore_optimizers_and_schedulers"):
        assert _params(getattr(type(connector), name)) == ["self"], name


def canary_logger_connector() -> None:
    present("logger_connector")
    trainer = probe("logger_connector", "lightning.pytorch.Trainer")
    connector_type = _owner_class(
        "lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector"
    )
    assert isinstance(inspect.getattr_static(connector_type, "should_update_logs"), property)
    assert _params(connector_type.log_metrics)[:3] == ["self", "metrics", "step"]
    assert lc.should_update_logs(trainer) is True
    assert lc.should_update_logs(object(), missing=True) is True


def canary_should_accumulate() -> None:
    present("should_accumulate")
    assert _params(
        _owner_class("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop")._should_accumulate
    ) == ["self"]
    assert lc.should_accumulate(probe("should_accumulate", "lightning.pytorch.Trainer")) is False


def canary_batches_that_stepped() -> None:
    present("batches_that_stepped")
    loop = probe("batches_that_stepped", "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop")
    assert loop._batches_that_stepped == 0
    assert "_batches_that_stepped" in loop.on_save_checkpoint(), "a checkpoint no longer restores it"
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop))
    assert lc.batches_that_stepped(trainer, 3) == 3 == loop._batches_that_stepped
    loop._batches_that_stepped = 4
    assert lc.batches_that_stepped(trainer) == 4
    lc.batches_that_stepped(trainer, 0)


def canary_update_learning_rates() -> None:
    present("update_learning_rates")
    module = importlib.import_module("lightning.pytorch.loops.training_epoch_loop")
    assert _params(module._TrainingEpochLoop._update_learning_rates) == [
        "self",
        "interval",
        "update_plateau_schedulers",
    ]
    assert re.search(r"self\._update_learning_rates\(\s*interval=", _source(module)), (
        "no longer called through the instance"
    )
    trainer = probe("update_learning_rates", "lightning.pytorch.Trainer")
    lc.wrap_update_learning_rates(trainer, lambda interval: interval == "step")
    assert trainer.fit_loop.epoch_loop._update_learning_rates("epoch", update_plateau_schedulers=False) is None


def canary_broadcast_sigterm_tensor() -> None:
    present("broadcast_sigterm_tensor")
    module = importlib.import_module("lightning.pytorch.loops.training_epoch_loop")
    assert _params(module._TrainingEpochLoop._broadcast_sigterm_tensor) == ["self"]
    assert "self._broadcast_sigterm_tensor()" in _source(module), "no longer called through the instance"
    loop = probe("broadcast_sigterm_tensor", "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop")
    assert lc.idle_sigterm_broadcast(loop) and "_broadcast_sigterm_tensor" in vars(loop)
    lc.restore_sigterm_broadcast(loop)
    assert "_broadcast_sigterm_tensor" not in vars(loop)


def canary_skip_backward() -> None:
    present("skip_backward")
    assert isinstance(
        inspect.getattr_static(_owner_class("lightning.pytorch.loops.fit_loop._FitLoop"), "_skip_backward"), property
    )
    assert lc.skips_backward(probe("skip_backward", "lightning.pytorch.Trainer")) is False


def canary_data_source() -> None:
    present("data_source")
    for target in SHIMS["data_source"].targets:
        source = lc.loop_data_source(target_owner("data_source", target))
        assert callable(source.is_defined) and callable(source.dataloader), target


def canary_accelerator_connector() -> None:
    present("accelerator_connector")
    from lightning.fabric.plugins.environments import ClusterEnvironment

    environment = lc.cluster_environment(probe("accelerator_connector", "lightning.pytorch.Trainer"))
    assert isinstance(environment, ClusterEnvironment)


def canary_module_trainer() -> None:
    present("module_trainer")
    assert lc.attached_trainer(probe("module_trainer", "lightning.pytorch.LightningModule")) is None


def canary_module_device_mesh() -> None:
    present("module_device_mesh")
    module = probe("module_device_mesh", "lightning.pytorch.LightningModule")
    mesh = object()
    lc.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh  # what the public property returns
    lc.set_device_mesh(module, None)


def canary_on_before_batch_transfer() -> None:
    present("on_before_batch_transfer")
    from lightning.pytorch import LightningModule

    assert _params(LightningModule._on_before_batch_transfer) == ["self", "batch", "dataloader_idx"]
    assert lc.before_batch_transfer(LightningModule(), [1, 2]) == [1, 2]


def canary_hparams_initial() -> None:
    present("hparams_initial")
    module = probe("hparams_initial", "lightning.pytorch.core.mixins.hparams_mixin.HyperparametersMixin")
    lc.set_initial_hparam(module, "config", {"n": 1})
    assert module.hparams_initial["config"] == {"n": 1}  # what loggers record


def canary_subprocess_launcher() -> None:
    present("subprocess_launcher")
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import Strategy

    launchers = importlib.import_module("lightning.pytorch.strategies.launchers")
    assert _params(launchers._SubprocessScriptLauncher)[:3] == ["cluster_environment", "num_processes", "num_nodes"]
    assert _params(Strategy._configure_launcher) == ["self"]
    connector = importlib.import_module("lightning.pytorch.trainer.connectors.accelerator_connector")
    assert "self.strategy._configure_launcher()" in _source(connector), "Lightning no longer calls the hook"
    strategy = probe("subprocess_launcher", "lightning.pytorch.strategies.Strategy")
    assert strategy.launcher is strategy._launcher  # what the public property returns
    stand_in = SimpleNamespace(cluster_environment=LightningEnvironment(), num_processes=1, num_nodes=1)
    lc.use_subprocess_launcher(stand_in)
    assert isinstance(stand_in._launcher, launchers._SubprocessScriptLauncher)


def _strategy_field(entry: str, field: str) -> None:
    present(entry)
    strategy = probe(entry, "lightning.pytorch.strategies.Strategy")
    assert getattr(strategy, field) is None  # None: none given to the strategy
    connector = importlib.import_module("lightning.pytorch.trainer.connectors.accelerator_connector")
    assert f"self._strategy_flag.{field}" in _source(connector), f"Lightning's connector no longer reads {field}"


def canary_strategy_precision_plugin_field() -> None:
    _strategy_field("strategy_precision_plugin_field", lc.PRECISION_PLUGIN_FIELD)


def canary_strategy_checkpoint_io_field() -> None:
    _strategy_field("strategy_checkpoint_io_field", lc.CHECKPOINT_IO_FIELD)


def canary_after_closure() -> None:
    present("after_closure")
    from lightning.pytorch.plugins.precision import Precision

    assert _params(Precision._after_closure) == ["self", "model", "optimizer"]


def canary_init_dist_connection() -> None:
    present("init_dist_connection")
    distributed = importlib.import_module("lightning.fabric.utilities.distributed")
    assert _params(distributed._init_dist_connection)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert (
        inspect.signature(distributed._init_dist_connection).parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    )


def canary_migrate_checkpoint() -> None:
    present("migrate_checkpoint")
    import lightning

    migrated = lc.migrate_checkpoint({"state_dict": {}, "pytorch-lightning_version": "2.1.0"})
    assert migrated["pytorch-lightning_version"] == lightning.__version__


def canary_load_state() -> None:
    present("load_state")
    import lightning

    module = _hyper_module(a=1)
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": {"a": 2},
        "pytorch-lightning_version": lightning.__version__,
    }
    loaded = lc.load_module_state(type(module), checkpoint, strict=True)
    assert type(loaded) is type(module) and loaded.hparams.a == 2


def canary_wandb_experiment() -> None:
    present("wandb_experiment")
    logger = probe("wandb_experiment", "lightning.pytorch.loggers.WandbLogger")
    assert lc.wandb_run_started(logger) is False
    assert "self._experiment" in _source(type(logger).version.fget)


CANARIES: dict[str, Callable[[], None]] = {
    name.removeprefix("canary_"): fn for name, fn in list(globals().items()) if name.startswith("canary_")
}


# ---------------------------------------------------------------- the canaries, and that they can fail


@pytest.mark.parametrize("name", sorted(SHIMS))
def test_canary(name: str) -> None:
    shim = SHIMS[name]
    try:
        CANARIES[name]()
    except Exception as err:  # noqa: BLE001 - whatever changed, one message naming the API and the release
        pytest.fail(
            f"{name}: the private API {', '.join(shim.targets)} is not as it was in {shim.written_against} "
            f"({type(err).__name__}: {err}). Update the shim(s) {', '.join(shim.shims)} and this canary, then the bound in "
            "pyproject.toml.",
            pytrace=False,
        )


def test_every_shim_has_a_canary_and_every_canary_a_shim() -> None:
    assert not set(tc.SHIMS) & set(lc.SHIMS) and not set(c10d.SHIMS) & (set(tc.SHIMS) | set(lc.SHIMS))
    assert set(CANARIES) == set(SHIMS)


INFRASTRUCTURE = {
    "SHIMS",
    "Shim",
    "PrivateAPIMissing",
    "private_api",
    "WRITTEN_AGAINST",
    "TORCH_VERSION",
    "LIGHTNING_VERSION",
}


@pytest.mark.parametrize("module", COMPAT_MODULES, ids=lambda m: m.__name__)
def test_every_name_of_a_compat_module_is_registered_in_one_shim(module: Any) -> None:
    registered = [name for shim in module.SHIMS.values() for name in shim.shims]
    assert all(hasattr(module, name) for name in registered), [n for n in registered if not hasattr(module, n)]
    assert set(registered) == set(module.__all__) - INFRASTRUCTURE


def test_every_target_belongs_to_one_entry_and_resolves() -> None:
    targets = [t for shim in SHIMS.values() for t in shim.targets]
    assert len(targets) == len(set(targets)), sorted(t for t in targets if targets.count(t) > 1)
    for target in targets:
        owner, _, _ = _split(target)
        assert inspect.isclass(_owner_class(owner)) or inspect.ismodule(_owner_class(owner)), target


def test_every_entry_names_its_release_and_can_be_removed() -> None:
    for name, shim in SHIMS.items():
        assert re.fullmatch(r"(torch|lightning|fsspec) \d+\.\d+\.\d+", shim.written_against), (
            name,
            shim.written_against,
        )
        assert any(removable(t) for t in shim.targets), f"{name}: no target the removal test can take away"


def _removals() -> Iterator[Any]:
    for name, shim in sorted(SHIMS.items()):
        for target in shim.targets:
            if removable(target):
                yield pytest.param(name, target, id=f"{name}:{target.rpartition('.')[2]}")


def _run_all() -> set[str]:
    failed = set()
    for name, canary in CANARIES.items():
        try:
            canary()
        except Exception:  # noqa: BLE001 - any failure counts
            failed.add(name)
    return failed


@pytest.mark.parametrize(("name", "target"), list(_removals()))
def test_removing_a_target_fails_exactly_its_canary(name: str, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run_all() == set()  # and every probe made, before anything is taken away
    owner = target_owner(name, target)
    attr = _split(target)[2]
    if inspect.isclass(owner):
        owner = next(c for c in owner.__mro__ if attr in vars(c))  # the class that defines it
    monkeypatch.delattr(owner, attr)
    assert _run_all() == {name}


# ---------------------------------------------------------------- the bounds the canaries justify


def _requirement(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (found,) = [r for r in deps if re.match(rf"{name}\b", r)]
    return found


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


@pytest.mark.parametrize(
    ("package", "version"),
    [("torch", tc.TORCH_VERSION), ("lightning", lc.LIGHTNING_VERSION)],
    ids=["torch", "lightning"],
)
def test_the_upper_bound_is_the_release_the_canaries_were_written_against(package: str, version: str) -> None:
    requirement = _requirement(package)
    assert re.search(rf",<{re.escape(_next_minor(version))}$", requirement), (
        f"pyproject.toml has {requirement!r}; the canaries were written against {package} {version}: bound it below "
        f"{_next_minor(version)} (or check the canaries against the newer release and move both)."
    )
    installed = importlib.import_module(package).__version__
    assert installed.split(".")[:2] == version.split(".")[:2], (
        f"{package} {installed} is installed, the canaries are for {version}"
    )


def test_should_update_logs_answers_as_lightnings_property_at_every_hook_of_a_fit() -> None:
    """The shim answers inside a training batch without the property's loop look-up: at each training hook
    of a fit with accumulation, validation inside the epoch, a stop requested mid-fit and no logging at all,
    it must say what ``_logger_connector.should_update_logs`` says."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Compare(Callback):
        def __init__(self, stop_at: int | None) -> None:
            self.stop_at, self.seen = stop_at, set()

        def _check(self, trainer: Trainer, *_: Any) -> None:
            expected = trainer._logger_connector.should_update_logs
            assert lc.should_update_logs(trainer) == expected, (trainer.global_step, trainer.state.stage)
            self.seen.add(expected)

        on_train_batch_start = on_before_optimizer_step = on_validation_batch_end = _check

        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            self._check(trainer)
            if trainer.fit_loop.epoch_loop.batch_progress.total.ready == self.stop_at:
                trainer.should_stop = True  # Lightning logs at the step a stop is requested at
                self._check(trainer)

    for every, stop_at, seen in ((3, 13, {True, False}), (0, None, {False})):
        compare = Compare(stop_at)
        trainer = Trainer(
            accelerator="cpu",
            max_steps=12,
            accumulate_grad_batches=2,
            log_every_n_steps=every,
            limit_train_batches=9,
            limit_val_batches=2,
            val_check_interval=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[compare],
        )
        trainer.fit(BoringModel())
        assert compare.seen == seen
