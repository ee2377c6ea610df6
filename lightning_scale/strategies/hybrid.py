"""``HybridParallelStrategy``: data x pipeline x tensor parallelism on one named DeviceMesh."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_scale.core.data_parallel import check_not_wrapped, register_compression
from lightning_scale.core.grad_norm import clip_grad_norm_, total_grad_norm
from lightning_scale.core.layout import MESH_DIMS, Layout, resolve_layout
from lightning_scale.strategies._checkpoint import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_scale.strategies._options import ParallelOptions
from lightning_scale.strategies._parallelize import TENSOR_PARALLEL_PLAN_HOOK, parallelize, tensor_parallel_plan
from lightning_scale.strategies._pipeline import PipelineRunner

__all__ = ["HybridParallelStrategy", "TENSOR_PARALLEL_PLAN_HOOK"]

_PARALLELIZED = "_lightning_scale_layout"  # set on a LightningModule once its parameters are parallelised

class HybridParallelStrategy(ParallelStrategy):
    """Data x pipeline x tensor parallelism for an unmodified ``Trainer``.

    One ``DeviceMesh`` with dimension names ``("dp", "pp", "tp")``, ``tp`` innermost (for ``hsdp``
    the ``dp`` dimension is ``("dp_replicate", "dp_shard")``, flattened into ``dp`` for the
    sampler). Applied in this order: pipeline stage, tensor parallel, activation checkpointing,
    ``torch.compile``, data parallel. Tensor parallelism is torch's DTensor ``parallelize_module``
    with a plan from the LightningModule's ``tensor_parallel_plan`` hook or from the registry of
    known architectures (``lightning_scale.core.tensor_parallel.register_plan``; the reference GPT
    is registered). The sampler Lightning injects splits data over ``dp`` only.

    Args:
        data_parallel: replicas of the model; ``"auto"`` fills the world.
        tensor_parallel: ranks each layer is split over; ``"auto"``: the processes of one node.
        pipeline_parallel: pipeline stages (``"auto"``: what data and tensor parallelism leave).
            Built with ``torch.distributed.pipelining``; the model declares its blocks through a
            ``pipeline_spec`` hook or the registry (the reference GPT is registered).
        data_parallel_mode: ``"ddp"`` (replicas; plain DDP when nothing else cuts the model, else
            FSDP2 ``replicate``), ``"fsdp"`` (FSDP2 ``fully_shard``: parameters, gradients and optimizer
            state sharded, ZeRO-3-like), ``"fsdp_grad_op"`` (parameters kept gathered from forward to
            backward, ZeRO-2-like), ``"hsdp"`` (replicated over ``hsdp_replicate`` x sharded over
            ``hsdp_shard``; ``"auto"``: replicate across nodes, shard within one).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` and ``"interleaved_zero_bubble"``
            (``virtual_stages`` stages per rank, round robin), ``"zbv"`` and ``"dualpipev"`` (two stages
            per rank in a V: rank ``r`` runs stages ``r`` and ``2p - 1 - r``); torch's schedules.
        microbatches: micro-batches per step; must divide the per-replica batch (default ``2 * pipeline_parallel``).
        virtual_stages: stages per rank for the interleaved schedules (the blocks must divide into
            ``pipeline_parallel * virtual_stages`` equal stages).
        partition: ``"by_layers"`` (equal block counts), ``"by_params"`` (balanced parameter counts) or
            ``"by_cost"`` (blocks timed forward+backward on a real batch at set-up; slowest stage minimised).
        sequence_parallel: shard norms and the residual stream on the sequence between layers
            (for plans that honour it, like the reference GPT's).
        loss_parallel: keep logits sharded on the vocabulary into the loss; training, validation
            and test steps and the backward run under ``torch.distributed.tensor.parallel.loss_parallel``.
        activation_checkpointing: ``"none"``, ``"full"`` (every block recomputes its activations in
            backward) or ``"selective"`` (every ``activation_checkpointing_every``-th block).
        compile: ``torch.compile`` each block.
        gradient_compression: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"`` (rank
            ``powersgd_rank``, after ``powersgd_start_iter`` uncompressed steps): DDP communication
            hooks, for ``data_parallel_mode="ddp"`` without tensor or pipeline parallelism.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        data_parallel: int | Literal["auto"] = "auto",
        tensor_parallel: int | Literal["auto"] = 1,
        pipeline_parallel: int | Literal["auto"] = 1,
        *,
        data_parallel_mode: str = "ddp",
        hsdp_replicate: int | Literal["auto"] = "auto",
        hsdp_shard: int | Literal["auto"] = "auto",
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int = 2,
        partition: str = "by_layers",
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 2,
        compile: bool = False,
        gradient_compression: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = ParallelOptions(
            data_parallel=data_parallel,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            data_parallel_mode=data_parallel_mode,
            hsdp_replicate=hsdp_replicate,
            hsdp_shard=hsdp_shard,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            partition=partition,
            sequence_parallel=bool(sequence_parallel),
            loss_parallel=bool(loss_parallel),
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every,
            compile=bool(compile),
            gradient_compression=gradient_compression,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        self._pipeline: PipelineRunner | None = None
        self._pipeline_batch: Any = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._layout: Layout | None = None
        self._device_mesh: DeviceMesh | None = None
        self._num_nodes = 1

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # Lightning's accelerator connector sets this from Trainer(num_nodes=...).
        self._num_nodes = num_nodes

    # ------------------------------------------------------------------ what Lightning asks

    @property
    def is_distributed(self) -> bool:
        # Lightning only knows its own strategies as distributed; without this no sampler is
        # injected and `self.log(..., sync_dist=True)` does not reduce.
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes are set up (Trainer.fit/validate/...).")
        return self._device_mesh

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the processes are set up (Trainer.fit/validate/...).")
        return self._layout

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights load into the parallelised model, optimizer state into the real optimizers.
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # ------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()
        o = self.options
        layout = resolve_layout(
            self.world_size,
            devices_per_node=self.num_processes,
            data_parallel=o.data_parallel,
            tensor_parallel=o.tensor_parallel,
            pipeline_parallel=o.pipeline_parallel,
        )
        o.check_layout(layout)
        if self._device_mesh is None or layout != self._layout:
            # Once per layout: `trainer.validate` then `trainer.fit` reuse the mesh (and its groups)
            # that the module's DTensors already live on.
            self._layout = layout
            device_type = self.root_device.type
            if o.data_parallel_mode == "hsdp":
                # dp split into (replicate, shard) for HSDP, and flattened back into "dp" for the sampler.
                replicate, shard = o.hsdp_split(layout.dp, self.num_nodes)
                names = ("dp_replicate", "dp_shard", *MESH_DIMS[1:])
                mesh = init_device_mesh(device_type, (replicate, shard, layout.pp, layout.tp), mesh_dim_names=names)
                mesh["dp_replicate", "dp_shard"]._flatten("dp")
                detail = f" (hsdp: replicate {replicate} x shard {shard})"
            else:
                mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
                detail = f" ({o.data_parallel_mode})" if layout.dp > 1 else ""
            self._device_mesh = mesh
            rank_zero_info(f"HybridParallelStrategy: {layout}{detail} on {self.world_size} processes")
        assert self.lightning_module is not None
        # Users may read `self.device_mesh` in `configure_model`, as with ModelParallelStrategy.
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_distributed(self) -> None:
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # Lightning clips through the precision plugin with torch's clip_grad_norm_, which fails on
        # a mix of DTensor and plain gradients; clip by the norm over every shard and stage instead.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize(self.lightning_module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _norm_scope(self, optimizer: Any) -> tuple[list[Tensor], dict[str, Any]]:
        """The optimizer's parameters, and how their global norm is taken (over stages, ties once)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self._pipeline is None:
            return params, {}
        skip = self._pipeline.excluded_from_norm()
        return params, {
            "group": self.device_mesh["pp"].get_group(),
            "norm_parameters": [p for p in params if id(p) not in skip],
        }

    def gradient_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The norm of the whole model's gradients (every shard, replica and stage), equal on every rank."""
        params, scope = self._norm_scope(optimizer)
        return total_grad_norm(scope.get("norm_parameters", params), norm_type, scope.get("group"))

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        params, scope = self._norm_scope(optimizer)
        clip_grad_norm_(params, clip_val, **scope)

    def _parallelize(self, module: LightningModule) -> None:
        """Applied in this order: pipeline stage (prune to this rank's blocks), tensor parallel,
        activation checkpointing, ``torch.compile``, data parallel.

        A module set up before (``trainer.validate`` then ``trainer.fit``) is parallelised once;
        only the DDP wrapper, which Lightning's own strategies also rebuild, is made again.
        """
        done = getattr(module, _PARALLELIZED, None)
        if done is not None and done != self.layout:
            raise ValueError(
                f"{type(module).__name__} was parallelised for {done} and cannot be set up again for {self.layout}; "
                "build a new module (or load its checkpoint) for another layout."
            )
        if done is None:
            check_not_wrapped(module)
            setattr(module, _PARALLELIZED, self.layout)
            self._pipeline = parallelize(
                module,
                self.options,
                self.layout,
                self.device_mesh,
                device=self.root_device,
                tensor_parallel_plan=lambda m: tensor_parallel_plan(m, self.layout.tp, self.options),
                example_batch=self._example_batch,
            )
        if self.layout.dp > 1 and self.layout.tp == 1 and self.layout.pp == 1 and self.options.data_parallel_mode == "ddp":
            # Plain data parallelism: Lightning's own path, DDP around the LightningModule; the base
            # strategy redirects training_step through the wrapper so its hooks run.
            kwargs: dict[str, Any] = {}
            if self.options.gradient_compression == "powersgd" and self.process_group_backend == "gloo":
                # PowerSGD's hook starts its second all-reduce from the first one's future callback;
                # on gloo that races with the next bucket's all-reduce and the ranks' collectives
                # mismatch ("Received data size doesn't match expected size"). One bucket avoids it.
                kwargs["bucket_cap_mb"] = 2**20
            ddp = nn.parallel.DistributedDataParallel(module, device_mesh=self.device_mesh["dp"], **kwargs)
            register_compression(
                ddp,
                self.options.gradient_compression,
                self.device_mesh["dp"].get_group(),
                powersgd_rank=self.options.powersgd_rank,
                powersgd_start_iter=self.options.powersgd_start_iter,
            )
            self.model = ddp

    def _example_batch(self) -> Any:
        """One training batch from the datamodule (its setup hook has run), for timing blocks."""
        trainer = self.lightning_module.trainer
        if trainer.datamodule is None:
            return None
        batch = next(iter(trainer.datamodule.train_dataloader()))
        return self.batch_to_device(batch)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps

    def _loss_context(self) -> contextlib.AbstractContextManager[None]:
        if self.options.loss_parallel and self.layout.tp > 1:
            return loss_parallel()
        return contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            # Lightning zeroes gradients between training_step and backward: the schedule (forward
            # and backward together) runs in `backward`. The module's training_step is not called.
            self._pipeline_batch = args[0]
            return torch.zeros((), device=self.root_device, requires_grad=True)
        with self._loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_eval(args[0], "val/loss")
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipeline_eval(args[0], "test/loss")
        with self._loss_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            # The model's output for the batch's inputs (its predict_step would need the whole model).
            return self._pipeline.predict_step(args[0])
        return super().predict_step(*args, **kwargs)

    def _pipeline_eval(self, batch: Any, name: str) -> Tensor:
        assert self._pipeline is not None
        with self._loss_context():
            loss = self._pipeline.eval_step(batch)
        # Already the mean over replicas, on every rank (the pipeline's one collective).
        self.lightning_module.log(name, loss, prog_bar=True)
        return loss

    @override
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            assert self.lightning_module is not None
            with self._loss_context():
                loss = self._pipeline.train_step(
                    self._pipeline_batch, self.lightning_module.trainer.accumulate_grad_batches
                )
            self._pipeline_batch = None
            # Every rank logs the last stage's loss, already averaged over replicas by the pipeline.
            self.lightning_module.log("train/loss", loss, prog_bar=True)
            return closure_loss
        # loss_parallel's cross entropy must also be differentiated inside the context.
        with self._loss_context():
            return super().backward(closure_loss, *args, **kwargs)

    # ------------------------------------------------------------------ collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        # Over the world: tensor- and pipeline-parallel ranks of a replica log equal values,
        # so the world mean is the data-parallel mean. Unlike Lightning's helper, no barrier
        # before the all-reduce (the all-reduce synchronises already).
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        group = _group.WORLD if group is None else group
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if isinstance(reduce_op, str) and not mean:
            op = getattr(torch.distributed.ReduceOp, reduce_op.upper())
        else:
            op = torch.distributed.ReduceOp.SUM if mean or reduce_op is None else reduce_op
        torch.distributed.all_reduce(tensor, op=op, group=group)
        if mean:
            size = torch.distributed.get_world_size(group)
            return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    # Full (gathered) tensors under the original names, so a checkpoint loads at any layout.

    def _pp_group(self) -> Any:
        return self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return full_model_state(self.lightning_module, self._pp_group())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict, partial=self.layout.pp > 1)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer), self._pp_group())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            load_full_optimizer_state(
                self.lightning_module, getattr(optimizer, "_optimizer", optimizer), state, partial=self.layout.pp > 1
            )

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hybrid", cls, description="data x tensor x pipeline parallelism (lightning-scale)")
        strategy_registry.register(
            "pipeline",
            cls,
            description="pipeline parallelism over all processes (lightning-scale)",
            data_parallel=1,
            pipeline_parallel="auto",
        )
        strategy_registry.register(
            "tensor_parallel",
            cls,
            description="tensor parallelism over all processes of a node (lightning-scale)",
            tensor_parallel="auto",
        )

