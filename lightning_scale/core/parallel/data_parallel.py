"""Data parallelism over a model that tensor and pipeline parallelism may already have cut (the
per-block transforms applied before it are in :mod:`lightning_scale.core.parallel.blocks`).

Modes (``DATA_PARALLEL_MODES``), all torch's own:

- ``ddp``: every replica holds the whole (stage of the) model and gradients are averaged. Plain
  ``DistributedDataParallel`` when nothing else cuts the model (it takes communication hooks:
  gradient compression); FSDP2's ``replicate`` otherwise, which keeps DTensor parameters and
  knows pipeline schedules.
- ``fsdp``: FSDP2 ``fully_shard``: parameters, gradients and optimizer state sharded over the
  replicas, parameters gathered per block for forward and again for backward (ZeRO-3).
- ``fsdp_grad_op``: the same, but gathered parameters are kept from forward to backward (ZeRO-2's
  communication at ZeRO-3's memory between steps).
- ``hsdp``: ``fully_shard`` on a 2-D mesh: replicated across the first dimension (nodes), sharded
  across the second.

Units are the model's blocks (each its own all-gather / reduce-scatter group, so memory peaks at
one block's full parameters), then the modules that run them (embeddings, norm and head go with
those). With pipeline parallelism every micro-batch of a step reuses the gathered parameters:
``reshard_after_forward=False``, and the schedule syncs gradients on the last micro-batch only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_scale.core.checks import format_choices
from lightning_scale.core.compat import fsdp_replicate

__all__ = [
    "COMPRESSIONS",
    "DATA_PARALLEL_MODES",
    "apply_data_parallel",
    "has_persistent_buffers",
    "bf16_all_reduce_hook",
    "check_not_wrapped",
    "gradient_sync_blocked",
    "register_compression",
    "wrap_ddp",
]

DATA_PARALLEL_MODES = ("ddp", "fsdp", "fsdp_grad_op", "hsdp")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def check_not_wrapped(module: nn.Module) -> None:
    """Raise ``ValueError`` if any submodule is already wrapped for data parallelism or sharded."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    kinds = (
        (nn.parallel.DistributedDataParallel, "DistributedDataParallel"),
        (FSDP1, "FullyShardedDataParallel (FSDP1)"),
        (FSDPModule, "fully_shard/replicate (FSDP2)"),
    )
    for cls, label in kinds:
        wrapped = [n or type(module).__name__ for n, m in module.named_modules() if isinstance(m, cls)]
        if wrapped:
            raise ValueError(
                f"Modules {wrapped[:3]} are already wrapped in {label}. Pass the bare model: the strategy applies "
                "tensor, pipeline and data parallelism itself (choose the mode with data_parallel_mode)."
            )


@contextlib.contextmanager
def gradient_sync_blocked(module: nn.Module) -> Generator[None, None, None]:
    """No FSDP2 gradient reduction inside, for every ``fully_shard``/``replicate`` module in ``module``
    (gradient accumulation's micro-steps; the window's gradients stay unsharded until the last)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_requires_gradient_sync(True, recurse=False)


def apply_data_parallel(
    mode: str,
    mesh: DeviceMesh,
    blocks: Sequence[nn.Module],
    roots: Sequence[nn.Module],
    *,
    pipelined: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Apply FSDP2 ``replicate`` (mode ``ddp``) or ``fully_shard`` bottom-up: each block, then each root.

    ``mesh``: the 1-D data-parallel mesh, or for ``hsdp`` the 2-D (replicate, shard) mesh.
    ``roots``: the modules whose forward runs the blocks (a pipeline rank with several stages has
    one per stage); parameters outside the blocks are grouped with them.
    ``mp_policy``: ``fully_shard``'s mixed precision. Blocks keep their outputs in the compute dtype;
    the roots' outputs (what the loss, or the next pipeline stage, receives) come back in fp32, as
    under autocast, where the residual stream and the loss stay fp32.
    """
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel_mode={mode!r} is not one of {format_choices(DATA_PARALLEL_MODES)}.")
    if mode == "ddp":
        for module in [*blocks, *roots]:
            fsdp_replicate(module, mesh=mesh)
        return
    from torch.distributed.fsdp import fully_shard

    # Pipelined: the gathered parameters serve every micro-batch of the step.
    reshard = mode == "fsdp" and not pipelined
    block_policy = mp_policy or MixedPrecisionPolicy()
    root_policy = block_policy
    if block_policy.param_dtype is not None and block_policy.output_dtype is None:
        root_policy = dataclasses.replace(block_policy, output_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=block_policy)
    for root in roots:
        fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=root_policy)


def bf16_all_reduce_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: all-reduce the gradient bucket in bfloat16, then cast back.

    torch's ``bf16_compress_hook`` is refused by DDP (by its name) unless the backend is NCCL or
    XCCL, although gloo all-reduces bfloat16 tensors; this one works with every backend. bfloat16 keeps fp32's
    range with 8 bits of mantissa: each all-reduce rounds gradients to about 3 significant digits.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


# DDP checks a hook's annotations against the real classes; postponed (string) annotations fail it.
bf16_all_reduce_hook.__annotations__ = {
    "process_group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_compression(
    ddp: nn.parallel.DistributedDataParallel,
    kind: str,
    group: dist.ProcessGroup,
    *,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
) -> Any:
    """Register a gradient-compression communication hook on a DDP module; returns the hook state.

    ``fp16``/``bf16``: all-reduce in half precision (half the bytes). ``powersgd``: rank-``r``
    low-rank approximation with error feedback (Vogels et al. 2019), plain all-reduce for the first
    ``powersgd_start_iter`` steps.
    """
    if kind not in COMPRESSIONS:
        raise ValueError(f"gradient_compression={kind!r} is not one of {format_choices(COMPRESSIONS)}.")
    if kind == "none":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return group
    if kind == "bf16":
        ddp.register_comm_hook(group, bf16_all_reduce_hook)
        return group
    state = powerSGD_hook.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=powersgd_start_iter,
        use_error_feedback=True,
        warm_start=True,
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return state


def has_persistent_buffers(module: nn.Module) -> bool:
    """Whether any buffer of ``module`` is saved in its state dict (``persistent=True``, the default)."""
    names = {name for name, _ in module.named_buffers()}
    return bool(names & set(module.state_dict(keep_vars=True)))


def wrap_ddp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    backend: str | None,
    compression: str = "none",
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 10,
    **ddp_kwargs: Any,
) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel`` over the 1-D data-parallel ``mesh`` with gradient ``compression``.

    DDP broadcasts rank 0's buffers before every forward (a collective per step) only when the model
    has persistent buffers, the state a forward may update (BatchNorm's statistics); non-persistent
    ones (causal masks, rotary tables) are constants every rank builds alike. ``broadcast_buffers``
    (``forward_sync_buffers``) in
    ``ddp_kwargs`` decides otherwise.

    ``ddp_kwargs`` go to DDP (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ...).
    """
    if compression == "powersgd" and backend == "gloo":
        # PowerSGD's hook starts its second all-reduce from the first one's future callback; on gloo
        # that races with the next bucket's all-reduce and the ranks' collectives mismatch
        # ("Received data size doesn't match expected size"). One bucket avoids it.
        if "bucket_cap_mb" in ddp_kwargs:
            raise ValueError(
                f"bucket_cap_mb={ddp_kwargs['bucket_cap_mb']!r} cannot be combined with gradient_compression="
                "'powersgd' on the gloo backend, which needs all gradients in one bucket. Remove bucket_cap_mb."
            )
        ddp_kwargs["bucket_cap_mb"] = 2**20
    if "broadcast_buffers" not in ddp_kwargs and "forward_sync_buffers" not in ddp_kwargs:
        ddp_kwargs["forward_sync_buffers"] = has_persistent_buffers(module)
    ddp = nn.parallel.DistributedDataParallel(module, device_mesh=mesh, **ddp_kwargs)
    register_compression(
        ddp, compression, mesh.get_group(), powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter
    )
    return ddp
