"""``HybridParallelStrategy``: data x pipeline x tensor parallelism for an unmodified ``Trainer``.

What the model provides: a tensor-parallel plan (its ``tensor_parallel_plan`` hook,
:data:`TENSOR_PARALLEL_PLAN_HOOK`, or the registry of known architectures,
``lightning_scale.core.parallel.tensor_parallel.register_plan``) and, for pipelines, activation
checkpointing and compile, its blocks (a ``pipeline_spec`` hook or
``lightning_scale.core.pipeline.spec.register_pipeline_spec``); the reference GPT is registered.

How it behaves: precision is :class:`lightning_scale.plugins.MixedPrecision` (``Trainer(precision=...)``'s
stock plugins are replaced by it): autocast, or FSDP2's ``MixedPrecisionPolicy`` under the FSDP modes,
inside pipeline schedules too; clipping, ``train/grad_norm`` and the fp16 overflow decision share one
all-reduce over the whole mesh. Gradient accumulation (``Trainer(accumulate_grad_batches=k)``) reduces
gradients over ``dp`` once per optimizer step, on the window's last micro-step, in every mode: DDP's
``no_sync``, FSDP2's ``set_requires_gradient_sync(False)`` (which keeps the window's gradients
unsharded until then), and the same inside pipeline schedules.

Who does what (each with its own state and tests; the strategy's overrides call them in order):

- :mod:`.strategy`: the one class, ``HybridParallelStrategy(ParallelStrategy)``;
- :mod:`.options`: every option, its default and its checks (``ParallelOptions``), and the registered names;
- :mod:`.mesh`: the resolved layout and its ``DeviceMesh`` (``LayoutMesh``);
- :mod:`.parallelize`: cutting the model, in the one documented order (``parallelize``);
- :mod:`.float8`: torchao's float8 linears in the blocks (``float8=``), imported only when asked for;
- :mod:`.state`: what a module was cut for, so that the next Trainer adopts it (``ParallelState``);
- :mod:`.deferred`: models built on the meta device, materialised after the cut (``DeferredBuilder``);
- :mod:`.pipeline_hooks`, :mod:`.pipeline_steps`: the model's pipeline hooks, and Lightning's steps
  when a pipeline runs the model (``PipelineSteps``, which holds the rank's runner);
- :mod:`.checkpoints`: the IO plugin, ``ckpt_path="latest"``, the manifest (``ShardedCheckpoints``),
  over :class:`lightning_scale.core.checkpoint.sharded_state.ShardedState`;
- :mod:`.collectives`: the process group and the collectives over the world.
"""

from lightning_scale.strategies.hybrid.parallelize import TENSOR_PARALLEL_PLAN_HOOK
from lightning_scale.strategies.hybrid.strategy import HybridParallelStrategy

__all__ = ["TENSOR_PARALLEL_PLAN_HOOK", "HybridParallelStrategy"]
