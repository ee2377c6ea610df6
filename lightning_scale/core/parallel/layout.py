"""How a world of processes is cut into data, pipeline and tensor parallel groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_scale.core.checks import divisors
from lightning_scale.core.compat import flatten_mesh

__all__ = ["MESH_DIMS", "Layout", "check_size", "init_layout_mesh", "resolve_layout"]

MESH_DIMS = ("dp", "pp", "tp")
"""Mesh dimension names, outermost first. ``tp`` is innermost so that on a GPU node the ranks of
one tensor-parallel group are neighbours and share the fastest links (NVLink)."""

Size = int | Literal["auto"]


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp, self.pp, self.tp)

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}"


def check_size(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive integer or ``"auto"``."""
    if value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer or 'auto'")


def resolve_layout(
    world_size: int,
    *,
    data_parallel: Size = "auto",
    tensor_parallel: Size = 1,
    pipeline_parallel: Size = 1,
    devices_per_node: int | None = None,
) -> Layout:
    """Sizes of the (dp, pp, tp) mesh for ``world_size`` processes.

    ``"auto"`` rules: ``tensor_parallel="auto"`` takes the processes of one node (tensor
    parallelism wants the fastest links), divided by a fixed ``pipeline_parallel`` if that
    would not fit; ``pipeline_parallel="auto"`` takes what a fixed ``data_parallel`` and the
    tensor size leave (1 when ``data_parallel`` is ``"auto"`` too); ``data_parallel="auto"`` takes
    whatever remains. The product must equal ``world_size``.
    """
    for name, value in (
        ("data_parallel", data_parallel),
        ("tensor_parallel", tensor_parallel),
        ("pipeline_parallel", pipeline_parallel),
    ):
        check_size(name, value)
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if pipeline_parallel == "auto":
        fixed_tp = tensor_parallel if isinstance(tensor_parallel, int) else 1
        pipeline_parallel = world_size // (data_parallel * fixed_tp) if isinstance(data_parallel, int) else 1
        pipeline_parallel = max(pipeline_parallel, 1)
    pp = pipeline_parallel
    if tensor_parallel == "auto":
        node = devices_per_node or world_size
        budget = world_size // (pp * (data_parallel if isinstance(data_parallel, int) else 1)) or 1
        tensor_parallel = max(d for d in divisors(node) if d <= budget)
    tp = tensor_parallel
    if data_parallel == "auto":
        if world_size % (pp * tp):
            raise ValueError(
                f"pipeline_parallel={pp} x tensor_parallel={tp} = {pp * tp} does not divide the {world_size} "
                f"processes of this run, so data_parallel='auto' has no whole size. Use a tensor x pipeline size "
                f"among the divisors of {world_size}: {divisors(world_size)}. Under an elastic launch (torchrun "
                f"--nnodes=MIN:MAX) every world the job can shrink or grow to must be a multiple of {pp * tp}: choose "
                f"MIN, MAX and --nproc-per-node so that each nodes x processes-per-node is."
            )
        data_parallel = world_size // (pp * tp)
    layout = Layout(dp=data_parallel, pp=pp, tp=tp)
    if layout.world_size != world_size:
        raise ValueError(
            f"data_parallel={layout.dp} x pipeline_parallel={layout.pp} x tensor_parallel={layout.tp} = "
            f"{layout.world_size} processes, but this run has {world_size} (devices x num_nodes). Make the product "
            f"{world_size}, e.g. data_parallel='auto' to fill it (as an elastic launch, whose world changes at a "
            f"restart, needs), or start {layout.world_size} processes."
        )
    return layout


def init_layout_mesh(device_type: str, layout: Layout, hsdp: tuple[int, int] | None = None) -> DeviceMesh:
    """The ``(dp, pp, tp)`` device mesh of ``layout`` over all processes (a collective).

    ``hsdp=(replicate, shard)``: the data-parallel dimension is two, ``("dp_replicate", "dp_shard")``,
    for HSDP, and flattened back into ``"dp"`` (the sampler's and the loss's replicas).
    """
    if hsdp is None:
        return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
    replicate, shard = hsdp
    if replicate * shard != layout.dp:
        raise ValueError(f"hsdp {replicate} x {shard} does not make data_parallel={layout.dp}")
    names = ("dp_replicate", "dp_shard", *MESH_DIMS[1:])
    mesh = init_device_mesh(device_type, (replicate, shard, layout.pp, layout.tp), mesh_dim_names=names)
    flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
    return mesh
