"""Weights tied across pipeline stages (a GPT's token embedding and output head).

Cutting a model into stages gives each rank that holds one of the sharing modules its own copy
of the weight. Their gradients must be summed over just the ranks holding a copy before the
optimizer step, so every copy gets the single-process gradient and the copies stay equal; and the
weight must count once in the global gradient norm.

The sum runs once per optimizer step, after the last micro-step of a gradient-accumulation
window: each copy's gradient accumulates its own stage's contributions over the window, and
summing after every micro-step would count the earlier ones again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["TiedCopies", "check_ties_for_data_parallel"]


def check_ties_for_data_parallel(
    tied: Sequence[Sequence[str]], stage_of: Callable[[str], int | None], ranks: Sequence[int], schedule: str
) -> None:
    """Refuse a weight that two stages of one rank share when data parallelism wraps each stage on its own.

    ``stage_of(name)``: the stage holding a parameter (None: outside every declared module);
    ``ranks[s]``: the pipeline rank of stage ``s``. Every rank decides alike (no communication).
    """
    for names in tied:
        by_rank: dict[int, set[int]] = {}
        for stage in {s for s in map(stage_of, names) if s is not None}:
            by_rank.setdefault(ranks[stage], set()).add(stage)
        if any(len(on_rank) > 1 for on_rank in by_rank.values()):
            raise ValueError(
                f"Parameters {list(names)} are one weight shared by two pipeline stages of one rank (a tied embedding "
                f"and output head under schedule={schedule!r}). With data parallelism each stage is wrapped on its "
                "own, which would break the tie: untie the weights (GPT: tie_embeddings=False) or use a schedule "
                "that puts the first and last stage on different ranks (gpipe, 1f1b, interleaved_1f1b, "
                "interleaved_zero_bubble)."
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TiedCopies:
    """This rank's copies of weights that other pipeline ranks hold too.

    Args:
        root: the pruned module of this rank (after :func:`~lightning_scale.core.pipeline.spec.prune_to_stage`).
        tied: the names of each shared parameter, found on the whole model before pruning.
        mesh: the full device mesh; its ``"pp"`` dimension is the pipeline.
        device: where the bookkeeping collective runs.

    Construction is collective over the whole mesh (``new_group``): every rank creates the
    process group of holders of every pipeline row, in the same order. Names, not parameter
    objects, are kept: tensor and data parallelism replace the parameters afterwards.
    """

    def __init__(self, root: nn.Module, tied: Sequence[Sequence[str]], mesh: DeviceMesh, device: torch.device) -> None:
        self._root = root
        pp_mesh = mesh["pp"]
        pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        present = {n for n, _ in root.named_parameters(remove_duplicate=False)}
        # Which pipeline ranks hold each tied group: the same answer on every rank of the mesh.
        holds = torch.zeros(len(tied), pp_size, dtype=torch.int32, device=device)
        for i, names in enumerate(tied):
            holds[i, pp_rank] = int(any(n in present for n in names))
        if tied:
            dist.all_reduce(holds, group=pp_mesh.get_group())
        names_dims = list(mesh.mesh_dim_names or ())
        rows = mesh.mesh.movedim(names_dims.index("pp"), -1).reshape(-1, pp_size).tolist()
        groups: dict[tuple[int, ...], ProcessGroup | None] = {}
        # (parameter name, group of holders, counted): `counted` marks the one copy (on the lowest
        # pipeline rank) that enters the global gradient norm.
        self.copies: list[tuple[str, ProcessGroup | None, bool]] = []
        for i, names in enumerate(tied):
            holders = tuple(r for r in range(pp_size) if holds[i, r])
            if len(holders) < 2:
                continue  # the whole group lives on one rank: nothing to sum
            if holders not in groups:
                mine = None
                for row in rows:
                    members = [row[r] for r in holders]
                    group = dist.new_group(members)
                    if dist.get_rank() in members:
                        mine = group
                groups[holders] = mine
            here = [n for n in names if n in present]
            if here:
                self.copies.append((here[0], groups[holders], pp_rank == holders[0]))

    def all_reduce_grads(self) -> None:
        """Sum each copy's gradient over the ranks holding one (a copy without a gradient adds zeros)."""
        for name, group, _ in self.copies:
            param = self._root.get_parameter(name)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif isinstance(param, DTensor) and param.grad.placements != param.placements:
                # Under tensor parallelism a copy's gradient may come back laid out otherwise than its
                # weight (an embedding sharded on the vocabulary gets a replicated one): sum like with like.
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
            dist.all_reduce(_local(param.grad), group=group)

    def excluded_from_norm(self) -> set[int]:
        """ids of copies that another rank already counts in the global gradient norm."""
        return {id(self._root.get_parameter(n)) for n, _, counted in self.copies if not counted}
