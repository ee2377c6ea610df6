"""Models built on the meta device: where ``HybridParallelStrategy`` creates them, and how each rank
materialises its part once the model is cut and sharded (``lightning_scale.core.parallel.deferred_init``)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

import lightning_scale.strategies.hybrid.collectives as collectives
from lightning_scale.core.compat import apply_to_tensors
from lightning_scale.core.parallel.deferred_init import DeferredInit

__all__ = ["DeferredBuilder"]


class DeferredBuilder:
    """Creates modules on the meta device and materialises each rank's part of them.

    State: ``plan``, the deferred tensors of the module being set up, from :meth:`plan_or_move` until
    :meth:`materialize` (``None``: the module has none, or it was materialised).
    """

    def __init__(self) -> None:
        self.plan: DeferredInit | None = None

    @contextmanager
    def init_context(
        self,
        device: torch.device,
        tensor_init_context: Callable[[], AbstractContextManager[object]],
        empty_init: bool | None,
    ) -> Generator[None, None, None]:
        """Modules created here (``configure_model``, ``trainer.init_module()``) go on the meta device
        unless ``empty_init=False`` (then on ``device``), under the precision plugin's
        ``tensor_init_context``. Weights loaded into them here would be lost: load them with ``ckpt_path``."""
        with torch.device("meta") if empty_init is not False else device, tensor_init_context():
            yield

    def plan_or_move(self, module: nn.Module, device: torch.device, move: Callable[[], None]) -> bool:
        """A module with tensors on the meta device is planned, not moved (``True``): it is cut and
        sharded first, then :meth:`materialize` gives each rank its part; its real tensors go to
        ``device`` now. Any other module is moved by ``move()`` (``False``)."""
        self.plan = DeferredInit.plan(module)
        if self.plan is None:
            move()
        else:
            apply_to_tensors(module, lambda t: t if t.is_meta else t.to(device))
        return self.plan is not None

    def materialize(self, module: nn.Module, device: torch.device, extra_roots: Sequence[nn.Module] = ()) -> None:
        """Allocate and initialise this rank's part of the planned module, seeded alike on every rank
        (``extra_roots``: modules outside ``module`` that hold parts of it, e.g. pipeline stages).
        Collective over the world; a no-op without a plan."""
        deferred, self.plan = self.plan, None
        if deferred is None:
            return
        seed = int(collectives.broadcast(torch.initial_seed()))  # unseeded processes differ; rank 0's wins
        problems = deferred.materialize(module, device, seed, extra_roots=list(extra_roots))
        everyone: list[list[str]] = [[] for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(everyone, problems)
        found = sorted({p for rank in everyone for p in rank})
        if found:
            raise ValueError(
                f"Deferred initialisation left {len(found)} tensors uninitialised: {found[:5]}. The initialiser that "
                "ran for each module must set all of its parameters and buffers: extend it (reset_parameters() or "
                "the model's _init_weights(module)), or create that module on a real device."
            )
        rank_zero_info(f"Deferred initialisation: {deferred.num_tensors} tensors, each rank materialised its own part")
