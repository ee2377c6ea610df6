"""The layout and device mesh of ``HybridParallelStrategy``, made once the processes exist."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_scale.core.parallel.layout import Layout, init_layout_mesh, resolve_layout
from lightning_scale.core.resilience.elastic import check_launched_world
from lightning_scale.strategies.hybrid.options import ParallelOptions
from lightning_scale.strategies.hybrid.state import ParallelState

__all__ = ["LayoutMesh"]


class LayoutMesh:
    """The resolved ``(dp, pp, tp)`` layout and its named ``DeviceMesh``.

    State: ``layout``, ``mesh`` (``RuntimeError`` before :meth:`setup`) and ``hsdp`` (the
    ``(replicate, shard)`` split of ``dp`` under ``hsdp``, else ``None``); the mesh (and its process
    groups) is kept while the layout stays the same (``trainer.validate`` then ``trainer.fit``).
    """

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self._mesh: DeviceMesh | None = None
        self.hsdp: tuple[int, int] | None = None

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the processes are set up (Trainer.fit/validate/...).")
        return self._layout

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists once the processes are set up (Trainer.fit/validate/...).")
        return self._mesh

    def setup(
        self,
        module: nn.Module,
        options: ParallelOptions,
        *,
        world_size: int,
        devices_per_node: int,
        num_nodes: int,
        device_type: str,
    ) -> None:
        """Resolve the layout for this world (``"auto"`` sizes filled in: under an elastic launch, at every
        restart) and check the options against it; adopt the
        mesh ``module`` was cut on by an earlier Trainer, else make one (once per layout). Collective
        over the world when a mesh is made."""
        o = options
        check_launched_world(world_size, num_nodes=num_nodes, devices_per_node=devices_per_node)
        layout = resolve_layout(
            world_size,
            devices_per_node=devices_per_node,
            data_parallel=o.data_parallel,
            tensor_parallel=o.tensor_parallel,
            pipeline_parallel=o.pipeline_parallel,
        )
        o.check_layout(layout)
        self.hsdp = hsdp = o.hsdp_split(layout.dp, num_nodes) if o.data_parallel_mode == "hsdp" else None
        state = ParallelState.of(module, layout, hsdp, o)
        if state is not None:
            # Another Trainer after the one that cut the module: its DTensors and stages live on that mesh.
            self._layout, self._mesh = state.layout, state.mesh
        elif self._mesh is None or layout != self._layout:
            self._layout = layout
            self._mesh = init_layout_mesh(device_type, layout, hsdp)
            detail = f" ({o.data_parallel_mode})" if layout.dp > 1 else ""
            if hsdp is not None:
                detail = f" (hsdp: replicate {hsdp[0]} x shard {hsdp[1]})"
            rank_zero_info(f"HybridParallelStrategy: {layout}{detail} on {world_size} processes")
