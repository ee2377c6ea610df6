"""``HybridParallelStrategy``: data x pipeline x tensor parallelism on one named DeviceMesh."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

import lightning_scale._lightning_compat as lc
import lightning_scale.strategies.hybrid.collectives as collectives
from lightning_scale.core.checkpoint.sharded_state import ShardedState
from lightning_scale.core.parallel.attention import describe_sdpa
from lightning_scale.core.parallel.data_parallel import check_not_wrapped, gradient_sync_blocked, wrap_ddp
from lightning_scale.core.parallel.layout import Layout
from lightning_scale.core.parallel.sync_exchange import EmulatedLink
from lightning_scale.core.parallel.sync_spec import SyncSpec
from lightning_scale.core.parallel.threads import ThreadChoice, share_cores
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.core.precision.grad_norm import GradientScope, model_grad_norm
from lightning_scale.core.telemetry.model_facts import ModelFacts
from lightning_scale.plugins._stock import as_mesh_precision
from lightning_scale.plugins.checkpoint_io import ShardedCheckpointIO
from lightning_scale.plugins.precision import MixedPrecision
from lightning_scale.strategies.hybrid.checkpoints import (
    ShardedCheckpoints,
    sharded_state,
)
from lightning_scale.strategies.hybrid.checkpoints import (
    unwrapped_optimizer as _unwrapped,
)
from lightning_scale.strategies.hybrid.data_sync import DataParallelSync, check_fragments
from lightning_scale.strategies.hybrid.deferred import DeferredBuilder
from lightning_scale.strategies.hybrid.mesh import LayoutMesh
from lightning_scale.strategies.hybrid.options import PRESETS, ParallelOptions
from lightning_scale.strategies.hybrid.parallelize import count_model_facts, parallelize
from lightning_scale.strategies.hybrid.pipeline_hooks import check_pipeline_module, timing_batch
from lightning_scale.strategies.hybrid.pipeline_loss import Refused
from lightning_scale.strategies.hybrid.pipeline_steps import PipelineSteps
from lightning_scale.strategies.hybrid.planning import AutoLayout, memory_and_float8_options
from lightning_scale.strategies.hybrid.resilience import Resilience
from lightning_scale.strategies.hybrid.state import ParallelState

__all__ = ["HybridParallelStrategy"]


class HybridParallelStrategy(ParallelStrategy):
    """Data x pipeline x tensor parallelism for an unmodified ``Trainer``.

    One ``DeviceMesh`` with dimension names ``("dp", "pp", "tp")``, ``tp`` innermost (``hsdp`` splits
    ``dp`` into ``("dp_replicate", "dp_shard")``); the sampler Lightning injects splits data over ``dp``.
    The model is cut and wrapped by :func:`.parallelize.parallelize`, whose docstring gives the order;
    :mod:`lightning_scale.strategies.hybrid` says what the model provides, how precision and gradient
    accumulation behave, and which collaborator does what.

    The three sizes are taken by position or by name, every other option by name only. Each option is
    checked (:class:`.options.ParallelOptions`, which declares the same names, types and defaults) before
    any process starts: a bad value raises ``ValueError`` naming it, the rule and the fix.

    Args:
        data_parallel: Replicas of the model; ``"auto"`` fills the world.
        tensor_parallel: Ranks each layer is split over; ``"auto"``: the processes of one node.
        pipeline_parallel: Pipeline stages (``"auto"``: what data and tensor parallelism leave). Built with
            ``torch.distributed.pipelining``; the model declares its blocks through a ``pipeline_spec`` hook or
            the registry (the reference GPT is registered).
        layout: ``"manual"``: the sizes and options given here; ``"auto"``: the planner chooses the sizes,
            data-parallel mode, pipeline schedule, micro-batches and activation checkpointing for this run's
            model, devices and batch (:mod:`.planning`); an option of those set to other than its default is a
            constraint the planner keeps.
        cluster: ``layout="auto"``: plan for this cluster preset (``lightning_scale.core.planner.CLUSTERS``, or
            ``"cpu"``) instead of the devices the processes see.
        data_parallel_mode: ``"ddp"`` (replicas; plain DDP when nothing else cuts the model, else FSDP2
            ``replicate``), ``"fsdp"`` (FSDP2 ``fully_shard``: parameters, gradients and optimizer state
            sharded, ZeRO-3-like), ``"fsdp_grad_op"`` (parameters kept gathered from forward to backward,
            ZeRO-2-like), ``"hsdp"`` (replicated over ``hsdp_replicate`` x sharded over ``hsdp_shard``).
        hsdp_replicate: Replicas of ``"hsdp"`` (``"auto"``: one per node).
        hsdp_shard: Shards of each ``"hsdp"`` replica (``"auto"``: the processes of one node).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` and ``"interleaved_zero_bubble"``
            (``virtual_stages`` stages per rank, round robin), ``"zbv"`` and ``"dualpipev"`` (two stages per
            rank in a V: rank ``r`` runs stages ``r`` and ``2p - 1 - r``); torch's schedules.
        microbatches: Micro-batches per step; must divide the per-replica batch (``None``:
            ``2 * pipeline_parallel``).
        virtual_stages: Stages per rank for the interleaved schedules (the blocks must divide into
            ``pipeline_parallel * virtual_stages`` equal stages).
        partition: ``"by_layers"`` (equal block counts), ``"by_params"`` (balanced parameter counts) or
            ``"by_cost"`` (blocks timed forward+backward on a real batch at set-up; slowest stage minimised).
        sequence_parallel: Shard norms and the residual stream on the sequence between layers (for plans that
            honour it, like the reference GPT's).
        loss_parallel: Keep logits sharded on the vocabulary into the loss; training, validation and test
            steps and the backward run under ``torch.distributed.tensor.parallel.loss_parallel``.
        activation_checkpointing: ``"none"``, ``"full"`` (every block recomputes its activations in backward)
            or ``"selective"`` (every ``activation_checkpointing_every``-th block).
        activation_checkpointing_every: Which blocks ``"selective"`` activation checkpointing wraps: every
            k-th of each pipeline rank's.
        compile: ``torch.compile`` each block (regional compilation): ``True``, ``False``, or ``"auto"`` (the
            default): on where the root device is CUDA, off on the CPU.
        float8: Train the linear layers inside the model's blocks in float8 through torchao (``"rowwise"`` or
            ``"tensorwise"`` scaling; ``None``: off; ``pip install lightning-scale[fp8]``): CUDA GPUs of compute
            capability >= 8.9 (H100, H200, L40S), emulated on the CPU (correctness, not speed); bf16 or fp32.
        activation_offload: Keep what blocks save for their backward in host memory (``save_on_cpu``): ``0``
            (off), ``N`` (each pipeline rank's first ``N`` blocks), a list of block indices, or ``"auto"`` (the
            planner's fewest blocks that make the layout fit the device's memory).
        gradient_compression: ``"none"``, ``"fp16"``, ``"bf16"`` or ``"powersgd"``: DDP communication hooks,
            for ``data_parallel_mode="ddp"`` without tensor or pipeline parallelism.
        powersgd_rank: The rank of PowerSGD's low-rank gradients.
        powersgd_start_iter: Steps PowerSGD runs uncompressed first.
        loss_name: Where the pipeline's loss is logged (``pipeline_parallel > 1``, where the module's step
            methods are not called): a template with ``{stage}`` (``"{stage}_loss"``) or a mapping from
            ``"train"``/``"val"``/``"test"`` to names; default ``train/loss``, ``val/loss``, ``test/loss``.
        find_unused_parameters: Passed to ``DistributedDataParallel`` (plain data parallelism only; FSDP2
            needs none of these four).
        static_graph: Passed to ``DistributedDataParallel``.
        bucket_cap_mb: Passed to ``DistributedDataParallel`` (``None``: DDP's 25).
        gradient_as_bucket_view: Passed to ``DistributedDataParallel`` (default ``True``, unlike DDP's own: the
            gradients are views of its buckets, no copy per step and one gradient's memory less).
        hang_timeout: The hang watchdog every ``fit`` runs: ``"auto"`` (a step is a hang past max(120 s, 10x
            the recent median step), 600 s for the first 3), seconds, a mapping of
            :class:`~lightning_scale.core.resilience.HangTimeout`'s fields, or ``0``/``False`` (off).
        global_batch_change: A ``fit`` resumed at another data-parallel size whose loader makes an optimizer
            step of another number of samples than the checkpoint's run (loader batch x data-parallel ranks x
            ``accumulate_grad_batches``): ``"refuse"`` (``ValueError`` at the fit's start, naming the settings
            that keep it) or ``"allow"`` (a warning; trains on).
        data_parallel_sync: How the data-parallel replicas agree: ``"every_step"`` (gradients averaged every
            step), ``"local_sgd"``, ``"diloco"`` or ``"streaming_diloco"`` (each replica trains alone and they
            synchronise every ``sync_every`` steps), a mapping of
            :class:`~lightning_scale.core.parallel.sync_spec.SyncSpec`'s fields, or a spec
            (``diloco(every=50)`` of :mod:`lightning_scale.core.parallel.sync_spec`). Periodic modes need
            ``data_parallel_mode="ddp"``; see ``docs/sync.md``.
        sync_every: H, the optimizer steps between synchronisations, for a mode given by name.
        emulated_link: ``{"bandwidth_mbps": ..., "latency_ms": ...}``: every data-parallel exchange (the
            every-step all-reduce too) takes at least as long as on that link (benchmarks, what-if studies).
        accelerator: Lightning's (set by the ``Trainer``).
        parallel_devices: Lightning's (set by the ``Trainer``).
        cluster_environment: Lightning's (set by the ``Trainer``).
        checkpoint_io: A :class:`~lightning_scale.plugins.ShardedCheckpointIO` (``None``: the default one).
        precision_plugin: Lightning's; a stock plugin becomes the equivalent
            :class:`~lightning_scale.plugins.MixedPrecision` (``None``: 32-bit).
        process_group_backend: The process group's (``None``: gloo on CPU, NCCL on GPU).
        timeout: The process group's timeout for collectives (``default_pg_timeout``: 30 minutes).
    """

    strategy_name = "hybrid"
    is_distributed = True  # else Lightning injects no sampler and `self.log(sync_dist=True)` does not reduce

    def __init__(
        self,
        data_parallel: int | Literal["auto"] = "auto",
        tensor_parallel: int | Literal["auto"] = 1,
        pipeline_parallel: int | Literal["auto"] = 1,
        *,
        layout: str = "manual",
        cluster: str | None = None,
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
        compile: bool | Literal["auto"] = "auto",
        float8: str | None = None,
        activation_offload: int | str | Sequence[int] = 0,
        gradient_compression: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        loss_name: str | Mapping[str, str] = "{stage}/loss",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = True,
        hang_timeout: str | float | Mapping[str, Any] = "auto",
        global_batch_change: str = "refuse",
        data_parallel_sync: str | Mapping[str, Any] | SyncSpec = "every_step",
        sync_every: int | None = None,
        emulated_link: Mapping[str, float] | EmulatedLink | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # The options, as ParallelOptions declares them (a test keeps this signature equal to its fields).
        given = locals()
        options = ParallelOptions(**{name: given[name] for name in ParallelOptions.names()})
        self._default_precision = MixedPrecision("32-true")  # without a plugin from the strategy or Trainer
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = options
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self.num_nodes = 1  # Lightning's accelerator connector sets it from Trainer(num_nodes=...)
        self._mesh = LayoutMesh()
        self._thread_choice: ThreadChoice | None = None  # taken in _configure_launcher
        self._model_facts: ModelFacts | None = None
        self._steps = PipelineSteps(self.options.loss_names)
        self._checkpoints, self._deferred = ShardedCheckpoints(), DeferredBuilder()
        self.auto_layout = AutoLayout()  # layout="auto": the planner's choice and predicted figures
        self.resilience = Resilience(self.options.hang_timeout)  # the hang watchdog and preemption, no callback
        self._sync = DataParallelSync(options.sync, options.emulated_link)  # data_parallel_sync

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:  # the processes of one node
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh.mesh

    @property
    def layout(self) -> Layout:
        return self._mesh.layout

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline stages and schedule (``None`` without pipeline parallelism)."""
        return self._steps.runner

    @property
    def model_facts(self) -> ModelFacts:
        """The whole model's parameter counts and FLOPs per token, taken before it was cut (equal everywhere)."""
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
    def restore_checkpoint_after_setup(self) -> bool:  # weights into the parallelised model, states into the optimizers
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def precision_plugin(self) -> MixedPrecision:
        """Always a :class:`~lightning_scale.plugins.MixedPrecision`: Lightning's stock plugins (what
        ``Trainer(precision="bf16-mixed")`` builds) are replaced by the equivalent one, others refused."""
        plugin = getattr(self, lc.PRECISION_PLUGIN_FIELD)
        return plugin if plugin is not None else self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # None stays None: Lightning's connector reads the field to tell a plugin given to the strategy from
        # one given to the Trainer.
        setattr(
            self, lc.PRECISION_PLUGIN_FIELD, None if precision_plugin is None else as_mesh_precision(precision_plugin)
        )

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if getattr(self, lc.CHECKPOINT_IO_FIELD) is None:
            setattr(self, lc.CHECKPOINT_IO_FIELD, ShardedCheckpointIO())
        return getattr(self, lc.CHECKPOINT_IO_FIELD)

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        setattr(self, lc.CHECKPOINT_IO_FIELD, io)

    @override
    def _configure_launcher(self) -> None:
        # At the Trainer's construction, in every process: the user's thread choice, before a launcher changes it.
        self._thread_choice = ThreadChoice.now()
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            lc.use_subprocess_launcher(self, self._before_launch)

    def _before_launch(self, trainer: Trainer | None) -> None:
        """In the launching process, before any other starts: what the module itself decides (the blocks a
        streaming DiLoCo splits into fragments). Processes a launcher like torchrun created check it at set-up."""
        module = trainer.lightning_module if trainer is not None else self.lightning_module
        if module is not None and self.options.sync.fragments > 1:
            check_fragments(module, self.options.sync.fragments)

    # ------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        # Before any work: the processes of a node share its cores (each launch path; a user's choice stands).
        share_cores(self.num_processes, self._thread_choice)
        super().setup_environment()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = collectives.default_backend(self.root_device)
        assert self.cluster_environment is not None
        collectives.init_world(self.cluster_environment, self._process_group_backend, self.world_size, self._timeout)
        module, trainer = self.lightning_module, lc.attached_trainer(self.lightning_module)
        assert module is not None
        if self.options.layout == "auto":  # the planner's choice, the same on every rank
            self.options = self.auto_layout.apply(self, trainer, module)
        sizes = {"world_size": self.world_size, "devices_per_node": self.num_processes, "num_nodes": self.num_nodes}
        self._mesh.setup(module, self.options, **sizes, device_type=self.root_device.type)
        lc.set_device_mesh(module, self.device_mesh)  # read in `configure_model`, as with ModelParallelStrategy
        if trainer is not None:
            self._checkpoints.install_path_resolver(trainer)

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
        # float8's device and precision, activation_offload="auto" (the planner): before the model is cut.
        self.options = memory_and_float8_options(self, trainer, module)
        cut_before = ParallelState.of(module, self.layout, None, None)
        self._model_facts = count_model_facts(module, trainer, self.options, cut_before)
        self._deferred.plan_or_move(module, self.root_device, self.model_to_device)
        self._parallelize(module)
        plugin = self.precision_plugin
        plugin.device = self.root_device.type
        # Clipping, train/grad_norm and the overflow decision: one all-reduce over the whole mesh (shards
        # count once per holder, copies once, each pipeline stage its own, tied copies once).
        excluded = self.pipeline.excluded_from_norm() if self.pipeline is not None else ()
        # A periodic data_parallel_sync: each replica's own norm (replicas differ), one decision for all. Plain
        # DDP: every gradient is the same on every rank once DDP reduced it, so each rank decides alone.
        o = self.options
        replica = "dp" if o.sync.periodic else None
        replicated = ParallelOptions.plain_ddp(self.layout, o.data_parallel_mode, o.sync.periodic)
        scope = {"excluded": excluded, "replica_dim": replica, "replicated": replicated}
        plugin.gradient_scope = GradientScope(self.device_mesh, stage_dim="pp", **scope)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.optimizers, self.lr_scheduler_configs = [], []  # the setter empties the LightningOptimizers too
            self.setup_optimizers(trainer)
            if self.options.sync.periodic and len(self.optimizers) != 1:
                raise ValueError(
                    f"data_parallel_sync={self.options.sync.describe()} counts the steps of one optimizer; "
                    f"configure_optimizers returned {len(self.optimizers)}. Use one optimizer, or 'every_step'."
                )
            hooked = self.options.emulated_link is not None and not self.options.sync.periodic
            self._sync.attach(module, self.device_mesh, self.pipeline, hooked=hooked)
        self.setup_precision_plugin()

    def _parallelize(self, module: LightningModule) -> None:
        """Cut a module no Trainer cut yet (:func:`parallelize`, then its meta tensors are materialised) or adopt
        an earlier Trainer's; then make what every Trainer call remakes: pipeline schedules, the DDP wrapper."""
        o, layout, plugin = self.options, self.layout, self.precision_plugin
        # With FSDP2 sharding, mixed precision is FSDP2's own policy (parameters cast for compute,
        # fp32 shards), not autocast over fp32 shards.
        policy = plugin.fsdp_policy() if layout.dp > 1 and o.data_parallel_mode != "ddp" else None
        state = ParallelState.adopted(module, layout, policy, plugin.precision)
        if state is None:
            check_not_wrapped(module)
            batch = partial(timing_batch, module, plugin.convert_input, self.batch_to_device)
            device, facts = self.root_device, self._model_facts
            kwargs = {"device": device, "timing_batch": batch, "mp_policy": policy, "facts": facts}
            runner = parallelize(module, o, layout, self.device_mesh, **kwargs)
            if ParallelState.needed(layout, o):
                ParallelState(layout, self._mesh.hsdp, o, self.device_mesh, runner, policy, facts).attach(module)
            self._deferred.materialize(module, device, runner.stage_modules() if runner is not None else ())
            rank_zero_info(describe_sdpa(device, str(plugin.precision)))  # the attention kernels this run can use
        self._steps.runner = runner = state.pipeline if state is not None else runner
        plugin.fsdp_managed = policy is not None
        if runner is not None:
            # Fresh stages and schedules for this Trainer call: its micro-batch count and batch shape.
            runner.build(o.microbatches or 2 * layout.pp)
        if ParallelOptions.plain_ddp(layout, o.data_parallel_mode, o.sync.periodic):
            # Plain data parallelism: Lightning's own path, DDP around the LightningModule; the base
            # strategy redirects training_step through the wrapper so its hooks run.
            backend = self.process_group_backend
            self.model = wrap_ddp(module, self.device_mesh["dp"], backend=backend, **o.ddp_kwargs(hooks=True))
            if o.emulated_link is not None:
                group = self.device_mesh["dp"].get_group()
                self.model.register_comm_hook(None, o.emulated_link.ddp_hook(group, self._sync.ddp_stats))

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules created here go on the meta device unless ``empty_init=False`` (:class:`.DeferredBuilder`)."""
        with self._deferred.init_context(self.root_device, self.precision_plugin.tensor_init_context, empty_init):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps (each beats the hang watchdog)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = lc.attached_trainer(self.lightning_module)
        if trainer is not None and trainer.training:  # the next batch: the step before ended
            self.resilience.at_step_boundary()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.resilience.at_step_boundary()  # (a training step fed by `dataloader_iter` has no batch_to_device)
        self.resilience.step_started()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.resilience.backward_started()
        super().pre_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        step = partial(super().optimizer_step, optimizer, model=model, **kwargs)
        result = self.resilience.optimizer_step(lambda c: step(closure=c), closure)
        self._sync.after_step()  # data_parallel_sync: a synchronisation when one is due
        return result

    def sync_stats(self) -> dict[str, Any]:
        """The data-parallel exchange so far, this rank's (cumulative since the fit started or the checkpoint it
        resumed): ``mode``, ``every``, ``bytes_sent``, ``exchanges``, ``blocked_s`` (seconds the loop waited
        on it; 0 under ``every_step``, whose reduction DDP overlaps with the backward)."""
        return self._sync.stats()

    def _loss_context(self) -> contextlib.AbstractContextManager[None]:
        # Vocabulary-sharded logits into the loss (loss_parallel); its backward must run inside too.
        return loss_parallel() if self.options.loss_parallel and self.layout.tp > 1 else contextlib.nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            with self._loss_context():
                return super().training_step(*args, **kwargs)
        # The precision plugin's autocast (Lightning's own steps enter it around the module's step);
        # with fp16 each micro-batch loss is multiplied by its loss scale inside the schedule.
        plugin, batch = self.precision_plugin, args[0] if args else kwargs["batch"]
        with plugin.train_step_context(), self._loss_context():
            optimizer = self.optimizers[0] if self.optimizers else None
            return self._steps.train(
                self.lightning_module, batch, optimizer, loss_scale=plugin.loss_scale, args=tuple(args[1:])
            )

    @override
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            with self._loss_context():
                return super().backward(closure_loss, *args, **kwargs)
        # The schedule ran the backward in training_step (each micro-batch loss multiplied by the
        # plugin's loss scale); the hooks run here, around the gradients it set aside.
        self.pre_backward(closure_loss)
        self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._steps.put_back_grads()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No data-parallel gradient reduction (nor tied-weight sum) on accumulation micro-steps:
        Lightning enters this around every micro-step but the last of a window."""
        pipelined = self.pipeline is not None
        blocked = self._steps.grad_sync_blocked() if pipelined else gradient_sync_blocked(self.lightning_module)
        with blocked, super().block_backward_sync():  # DistributedDataParallel's no_sync
            yield

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", self.precision_plugin.val_step_context, super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", self.precision_plugin.test_step_context, super().test_step, args, kwargs)

    def _eval_step(self, stage: str, context: Any, module_step: Any, args: Any, kwargs: Any) -> Any:
        """The pipeline's forward-only step under the precision plugin's ``context``, else the module's own."""
        if self.pipeline is not None:
            with context(), self._loss_context():
                return self._steps.evaluate(self.lightning_module, args[0], stage, tuple(args[1:]))
        with self._loss_context():
            return module_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            return self._steps.predict(self.lightning_module, args[0], self.precision_plugin.predict_step_context)
        # Vocabulary-sharded outputs (loss_parallel) are returned whole, as one process would.
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, lambda t: t.full_tensor())

    def gradient_norm(self, optimizer: Any, norm_type: float = 2.0) -> Tensor:
        """The norm of the whole model's gradients (every shard, replica and stage), equal on every rank."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return model_grad_norm(params, self.precision_plugin.gradient_scope, norm_type)

    # ------------------------------------------------------------------ collectives, over the world

    # Inside the module's own step on a pipeline's last stage (only that stage's ranks run it) they do not
    # communicate: reduce returns its input (what the step logs is averaged over replicas afterwards).

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self._steps.in_user_step:
            collectives.barrier(self.root_device if self.parallel_devices is not None else None)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._steps.in_user_step else collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor if self._steps.in_user_step else collectives.reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self._steps.in_user_step:
            raise Refused(
                "the step calls all_gather, which only the pipeline's last stage would enter; gather what you need "
                "in a hook that every rank runs (e.g. on_train_batch_end)."
            )
        return super().all_gather(tensor, group, sync_grads)

    # ------------------------------------------------------------------ checkpoints: each rank its part

    def _sharded_state(self) -> ShardedState:
        return sharded_state(self.lightning_module, self.pipeline)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The first thing Trainer.save_checkpoint asks for, before any on_save_checkpoint hook: the hang watchdog
        # times none of the checkpoint's dump and save (nor the rest of the step after it).
        self.resilience.pause()
        return self._sharded_state().model_state()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self._sharded_state().optimizer_state(_unwrapped(optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its own shards (Lightning's base class writes on rank 0 only)."""
        self.resilience.pause()  # a save is not a training step (also when called without the Trainer's dump)
        state, mode = self._sharded_state(), self.options.data_parallel_mode
        at = {"layout": self.layout, "data_parallel_mode": mode, "data_parallel_sync": self._sync.manifest()}
        # A periodic data_parallel_sync: the global model, and each replica's own state besides.
        checkpoint = self._sync.checkpoint(checkpoint, state, [_unwrapped(o) for o in self.optimizers])
        self._checkpoints.save(self.checkpoint_io, checkpoint, filepath, state, **at, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        state, optimizers = self._sharded_state(), [_unwrapped(o) for o in self.optimizers]
        at = {"layout": self.layout, "world_size": self.world_size}
        own = self._sync.template(self.layout.dp, state, optimizers)  # a periodic data_parallel_sync's state
        checkpoint = self._checkpoints.load(
            self.checkpoint_io, checkpoint_path, weights_only, state, optimizers, **at, strategy_state=own
        )
        self._sync.loaded(checkpoint.pop("strategy_state", {}))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self._checkpoints.load_model_state(self._sharded_state(), checkpoint, strict=strict, partial=self.layout.pp > 1)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        optimizers, partial_load = [_unwrapped(o) for o in self.optimizers], self.layout.pp > 1
        self._checkpoints.load_optimizer_states(self._sharded_state(), optimizers, checkpoint, partial=partial_load)
        self._sync.restore(self._sharded_state(), optimizers)  # each replica's own state, the schedule

    @override
    def on_train_start(self) -> None:
        trainer = lc.attached_trainer(self.lightning_module)
        # A resume at another data-parallel size keeps the global batch, or is refused.
        self._checkpoints.check_global_batch(trainer, self.layout.dp, self.options.global_batch_change)
        self.resilience.start(trainer, preemption=self._checkpoints.sharded(self.checkpoint_io).preemption)

    @override
    def on_validation_start(self) -> None:
        self.resilience.at_step_boundary()  # a preemption agreed in the step before: stop before validating
        trainer = lc.attached_trainer(self.lightning_module)
        self._sync.validation_started(trainer is not None and trainer.state.fn == TrainerFn.FITTING)
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        self._sync.validation_ended()  # (validation inside a fit saw the global model)
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        self.resilience.at_step_boundary()  # the last step's
        self.resilience.stop()
        self._sync.close()  # a periodic data_parallel_sync: every replica leaves the fit with the same model
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.resilience.stop()  # before Lightning's teardown, which may wait
        super().on_exception(exception)

    @override
    def teardown(self) -> None:  # not the base class's: it would move the sharded model to the CPU
        assert self.cluster_environment is not None and self.accelerator is not None
        self.resilience.stop()
        for part in (self.cluster_environment, self.precision_plugin, self.accelerator):
            part.teardown()
        self.checkpoint_io.teardown()  # joins an AsyncCheckpointIO and raises what its saves raised

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (description, options) in PRESETS.items():
            strategy_registry.register(name, cls, description=f"{description} (lightning-scale)", **options)
