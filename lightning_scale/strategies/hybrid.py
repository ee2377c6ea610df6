"""``HybridParallelStrategy``: data x pipeline x tensor parallelism on one named DeviceMesh."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_scale.core.parallel.data_parallel import check_not_wrapped, wrap_ddp
from lightning_scale.core.parallel.deferred_init import DeferredInit
from lightning_scale.core.parallel.layout import Layout, init_layout_mesh, resolve_layout
from lightning_scale.core.telemetry.model_facts import ModelFacts
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.strategies._checkpoint_hooks import ShardedCheckpoints, elastic_attempt_store
from lightning_scale.strategies._collectives import WorldCollectives
from lightning_scale.strategies._deferred import DeferredModules
from lightning_scale.strategies._options import ParallelOptions
from lightning_scale.strategies._parallelize import (
    TENSOR_PARALLEL_PLAN_HOOK,
    count_recomputation,
    parallelize,
    tensor_parallel_plan,
)
from lightning_scale.strategies._pipeline import check_pipeline_module, example_batch, pipeline_batch, pipeline_spec_of
from lightning_scale.strategies._precision import MeshPrecision
from lightning_scale.strategies._state import ParallelState
from lightning_scale.strategies._steps import ParallelSteps

__all__ = ["HybridParallelStrategy", "TENSOR_PARALLEL_PLAN_HOOK"]

class HybridParallelStrategy(
    ParallelSteps, ShardedCheckpoints, WorldCollectives, DeferredModules, MeshPrecision, ParallelStrategy
):
    """Data x pipeline x tensor parallelism for an unmodified ``Trainer``.

    One ``DeviceMesh`` with dimension names ``("dp", "pp", "tp")``, ``tp`` innermost (for ``hsdp``
    the ``dp`` dimension is ``("dp_replicate", "dp_shard")``, flattened into ``dp`` for the
    sampler). Applied in this order: pipeline stage, tensor parallel, activation checkpointing,
    ``torch.compile``, data parallel. Tensor parallelism is torch's DTensor ``parallelize_module``
    with a plan from the LightningModule's ``tensor_parallel_plan`` hook or from the registry of
    known architectures (``lightning_scale.core.parallel.tensor_parallel.register_plan``; the reference GPT
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
        loss_name: where the pipeline's loss is logged (``pipeline_parallel > 1``, where the module's
            step methods are not called): a template with ``{stage}`` (``"{stage}_loss"``) or a mapping
            from ``"train"``/``"val"``/``"test"`` to names; default ``train/loss``, ``val/loss``, ``test/loss``.
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to
            ``DistributedDataParallel`` (plain data parallelism only; FSDP2 needs none of them).

    Precision is :class:`lightning_scale.plugins.MixedPrecision` (``Trainer(precision=...)``'s stock
    plugins are replaced by it): autocast, or FSDP2's ``MixedPrecisionPolicy`` under the FSDP modes,
    inside pipeline schedules too; clipping, ``train/grad_norm`` and the fp16 overflow decision share
    one all-reduce over the whole mesh.

    Gradient accumulation (``Trainer(accumulate_grad_batches=k)``) reduces gradients over ``dp``
    once per optimizer step, on the window's last micro-step, in every mode: DDP's ``no_sync``,
    FSDP2's ``set_requires_gradient_sync(False)`` (which keeps the window's gradients unsharded
    until then), and the same inside pipeline schedules.
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
        loss_name: str | Mapping[str, str] = "{stage}/loss",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
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
        given = locals()
        self.options = ParallelOptions(**{name: given[name] for name in ParallelOptions.names()})
        self._pipeline: PipelineRunner | None = None
        self._stashed_grads: list[tuple[Tensor, Tensor | None]] = []
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._layout: Layout | None = None
        self._device_mesh: DeviceMesh | None = None
        self._num_nodes = 1
        self._model_facts: ModelFacts | None = None

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
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline stages and schedule (``None`` without pipeline parallelism)."""
        return self._pipeline

    @property
    def model_facts(self) -> ModelFacts:
        """Parameter counts and FLOPs per token of the whole model, taken at set-up before it was cut
        (the same on every rank at every layout; :mod:`lightning_scale.core.telemetry.model_facts`)."""
        if self._model_facts is None:
            raise RuntimeError("The model's facts are known once the strategy set it up (Trainer.fit/validate/...).")
        return self._model_facts

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
        module = self.lightning_module
        assert module is not None
        hsdp = o.hsdp_split(layout.dp, self.num_nodes) if o.data_parallel_mode == "hsdp" else None
        state = ParallelState.of(module, layout, hsdp, o)
        if state is not None:
            # Another Trainer after the one that cut the module: its DTensors and stages live on that mesh.
            self._layout, self._device_mesh = state.layout, state.mesh
        elif self._device_mesh is None or layout != self._layout:
            # Once per layout: `trainer.validate` then `trainer.fit` reuse the mesh (and its groups).
            self._layout = layout
            self._device_mesh = init_layout_mesh(self.root_device.type, layout, hsdp)
            detail = f" ({o.data_parallel_mode})" if layout.dp > 1 else ""
            if hsdp is not None:
                detail = f" (hsdp: replicate {hsdp[0]} x shard {hsdp[1]})"
            rank_zero_info(f"HybridParallelStrategy: {layout}{detail} on {self.world_size} processes")
        # Users may read `self.device_mesh` in `configure_model`, as with ModelParallelStrategy.
        module._device_mesh = self._device_mesh
        if module._trainer is not None:
            self._install_checkpoint_path_resolver(module._trainer)

    def _setup_distributed(self) -> None:
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        store = elastic_attempt_store(self.world_size, self._timeout)
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.layout.pp > 1:
            # Here, not earlier: a model built in configure_model exists only now (still on the meta device).
            check_pipeline_module(module, self.layout.pp, self.options.loss_names)
        self.model = self.precision_plugin.convert_module(self.model)
        state = ParallelState.of(module, self.layout, None, None)
        self._model_facts = state.facts if state is not None and state.facts is not None else self._count(module, trainer)
        deferred = self._plan_or_move_to_device(module)
        self._parallelize(module, deferred)
        plugin = self.precision_plugin
        plugin.device = self.root_device.type
        # Clipping, train/grad_norm and the overflow decision: one all-reduce over the whole mesh.
        plugin.gradient_scope = self._gradient_scope()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            self._add_preemption_checkpoint(trainer)
        self.setup_precision_plugin()

    def _parallelize(self, module: LightningModule, deferred: DeferredInit | None = None) -> None:
        """Applied in this order: pipeline stage (prune to this rank's blocks), tensor parallel,
        activation checkpointing, ``torch.compile``, data parallel.

        A module set up before (``trainer.validate`` then ``trainer.fit``, or another Trainer at the
        same layout) is parallelised once; the pipeline's schedule and the DDP wrapper, which
        Lightning's own strategies also rebuild, are made again.
        """
        o, layout = self.options, self.layout
        state = ParallelState.of(module, layout, None, None)
        # With FSDP2 sharding, mixed precision is FSDP2's own policy (parameters cast for compute,
        # fp32 shards), not autocast over fp32 shards.
        sharded = layout.dp > 1 and o.data_parallel_mode != "ddp"
        policy = self.precision_plugin.fsdp_policy() if sharded else None
        if state is None:
            check_not_wrapped(module)
            self._pipeline = parallelize(
                module,
                o,
                layout,
                self.device_mesh,
                device=self.root_device,
                tensor_parallel_plan=lambda m: tensor_parallel_plan(m, layout.tp, o),
                example_batch=self._example_batch,
                mp_policy=policy,
                facts=self._model_facts,
            )
            untouched = layout.tp == 1 and layout.pp == 1 and (layout.dp == 1 or o.data_parallel_mode == "ddp")
            if not (untouched and o.activation_checkpointing == "none" and not o.compile):
                hsdp = o.hsdp_split(layout.dp, self.num_nodes) if o.data_parallel_mode == "hsdp" else None
                ParallelState(layout, hsdp, o, self.device_mesh, self._pipeline, policy, self._model_facts).attach(module)
            if deferred is not None:
                self._materialize(module, deferred)
        else:
            if state.mp_policy != policy:
                raise ValueError(
                    f"{type(module).__name__} was sharded by FSDP2 with mixed precision {state.mp_policy} by an earlier "
                    f"Trainer; this one asks for {policy} (precision={self.precision_plugin.precision!r}). Use the same "
                    "precision, or load the checkpoint into a fresh module."
                )
            self._pipeline = state.pipeline
        self.precision_plugin.fsdp_managed = policy is not None
        if self._pipeline is not None:
            # Fresh stages and schedules for this Trainer call: its micro-batch count and batch shape.
            self._pipeline.build(o.microbatches or 2 * layout.pp)
        if ParallelOptions.plain_ddp(layout, o.data_parallel_mode):
            # Plain data parallelism: Lightning's own path, DDP around the LightningModule; the base
            # strategy redirects training_step through the wrapper so its hooks run.
            self.model = wrap_ddp(
                module,
                self.device_mesh["dp"],
                backend=self.process_group_backend,
                compression=o.gradient_compression,
                powersgd_rank=o.powersgd_rank,
                powersgd_start_iter=o.powersgd_start_iter,
                **o.ddp_kwargs(),
            )

    def _count(self, module: LightningModule, trainer: Trainer) -> ModelFacts:
        """The whole model's facts, before it is cut; FLOPs counted on meta tensors with one training
        batch's shapes (``ModelFacts.measure``) when neither a hook nor a known config gives them, and
        what activation checkpointing recomputes (``ModelFacts.measure_recomputation``), when a callback
        wants them (``needs_model_flops``: ``Throughput``)."""
        facts = ModelFacts.of(module)
        wanted = any(getattr(callback, "needs_model_flops", False) for callback in trainer.callbacks)
        recomputes = self.options.activation_checkpointing != "none"
        if (facts.source == "none" or recomputes) and wanted and trainer.state.fn == TrainerFn.FITTING:
            batch = example_batch(trainer)
            if batch is not None:
                batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
                if facts.source == "none":
                    facts.measure(module, batch)
                count_recomputation(module, self.options, facts, batch)
        return facts

    def _example_batch(self) -> tuple[Any, Any] | None:
        """``(inputs, target)`` of one batch of this Trainer call's data, on the device, for timing blocks."""
        module = self.lightning_module
        batch = example_batch(module.trainer)
        if batch is None:
            raise ValueError(
                "partition='by_cost' times every block on a real batch at set-up, but this Trainer call has no "
                "batch to give (no datamodule or dataloaders, or an empty one). Pass the data to "
                "fit/validate/test/predict, or use partition='by_params'."
            )
        # As the loops prepare a batch before the step sees it.
        batch = module._on_before_batch_transfer(self.precision_plugin.convert_input(batch), dataloader_idx=0)
        batch = self.batch_to_device(batch)
        predicting = module.trainer.state.fn == TrainerFn.PREDICTING
        inputs, target, _ = pipeline_batch(module, batch, predicting=predicting, spec=pipeline_spec_of(module)[1])
        return inputs, target

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        # Not the base class's: it would move the sharded model to the CPU after every Trainer call.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()  # joins an AsyncCheckpointIO and raises what its saves raised

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

