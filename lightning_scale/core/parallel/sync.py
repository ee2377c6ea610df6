"""Periodic synchronisation of data-parallel replicas: Local SGD, DiLoCo and Streaming DiLoCo
(:class:`PeriodicSync`, run by the strategy after every optimizer step; the modes are
:class:`~lightning_scale.core.parallel.sync_spec.SyncSpec`'s).

Between synchronisations each replica (a ``dp`` coordinate: its tensor-parallel shards and pipeline
stages together) trains alone, no gradient reduced over ``dp``. At a synchronisation of fragment f:

- Local SGD, uncompressed: ``p <- mean_dp(p)``.
- DiLoCo: ``delta = mean_dp(anchor - p)``; the outer optimizer (``torch.optim.SGD``, Nesterov momentum)
  steps ``anchor`` with gradient ``delta``; ``p <- anchor``. Local SGD with compression is the same with
  ``anchor <- anchor - delta`` (outer_lr 1, no momentum): the change since the last synchronisation is
  what compresses well, not the parameters.

The anchor is kept in fp32 at least (the parameters' dtype if wider). Every replica starts from the
first replica's parameters (broadcast when attached). Validation sees the global model (the anchor,
or the replicas' mean for Local SGD) through :meth:`PeriodicSync.global_model`, and :meth:`PeriodicSync.close`
synchronises every fragment with local progress left when a fit ends, so the model the fit leaves is one.

State (:meth:`state` / :meth:`load`): the step count, each fragment's last synchronisation, the anchors
and the outer momentum (the same on every replica), and per replica the error-feedback residuals and
an exchange in flight (its input, restarted on load), so a run resumed between synchronisations goes
on exactly as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_scale.core.parallel.sync_exchange import EmulatedLink, Exchange, ExchangeStats
from lightning_scale.core.parallel.sync_spec import SyncSpec

__all__ = ["PeriodicSync", "local_tensor"]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p`` (a DTensor's local shard), sharing its storage."""
    if isinstance(p, DTensor):
        with torch.no_grad():  # the shard itself, not an autograd view of it
            return p.to_local()
    return p.data


class PeriodicSync:
    """Runs ``spec`` over the data-parallel ``group`` for this rank's parameters, given as ``fragments``:
    for each of ``spec.fragments`` fragments, the ``(name, parameter)`` pairs of it this rank holds (a
    pipeline rank may hold none of some fragment). Names are unique across the model (checkpoint keys)."""

    def __init__(
        self,
        spec: SyncSpec,
        fragments: Sequence[Sequence[tuple[str, torch.Tensor]]],
        group: dist.ProcessGroup,
        *,
        link: EmulatedLink | None = None,
    ) -> None:
        if not spec.periodic:
            raise ValueError(f"PeriodicSync runs periodic modes; {spec.describe()} is DDP's every-step reduction.")
        if len(fragments) != spec.fragments:
            raise ValueError(f"{spec.describe()} has {spec.fragments} fragments; {len(fragments)} given.")
        self.spec, self.group, self.link = spec, group, link
        self.n = dist.get_world_size(group)
        self.names = [[name for name, _ in fragment] for fragment in fragments]
        self.params = [[p for _, p in fragment] for fragment in fragments]
        self.stats = ExchangeStats()
        self.steps = 0
        self.last_sync = [0] * spec.fragments
        self._pending: dict[int, tuple[Exchange, list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self._stash: dict[int, list[torch.Tensor]] | None = None  # this replica's own, inside global_model()
        self._template_pending: list[int] = []
        self._broadcast_params()
        self.anchored = spec.outer or spec.compression != "none"
        self.anchors: list[list[torch.Tensor]] = [
            [self._wide(local_tensor(p)).clone() for p in ps] if self.anchored else [] for ps in self.params
        ]
        self.residuals: list[list[torch.Tensor]] = [
            [torch.zeros_like(a, dtype=torch.float32) for a in anchors] if spec.compression != "none" else []
            for anchors in self.anchors
        ]
        self.chunk_residuals: list[torch.Tensor | None] = [  # the averaged chunk this rank owns, per fragment
            torch.zeros(Exchange.chunk_numel(sum(a.numel() for a in anchors), self.n, spec.compression))
            if spec.compression != "none" and anchors
            else None
            for anchors in self.anchors
        ]
        self.outer: torch.optim.SGD | None = None
        everything = [a for anchors in self.anchors for a in anchors]
        if spec.outer and everything:
            momentum = spec.outer_momentum
            self.outer = torch.optim.SGD(
                everything, lr=spec.outer_lr, momentum=momentum, nesterov=spec.nesterov and momentum > 0
            )
            if (
                momentum > 0
            ):  # explicit zeros (SGD's first step from zeros equals its own start): always in a checkpoint
                for a in everything:
                    self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)

    @staticmethod
    def _wide(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.promote_types(t.dtype, torch.float32))

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        tensors = [local_tensor(p) for ps in self.params for p in ps]
        if tensors and self.n > 1:
            source = dist.get_global_rank(self.group, 0)
            for t in tensors:
                dist.broadcast(t, source, group=self.group)

    # ------------------------------------------------------------------ the schedule

    @torch.no_grad()
    def after_step(self) -> None:
        """After each optimizer step: apply the exchanges started at the step before (overlap), then
        start (and, without overlap, apply) those of the fragments due after this one."""
        self.steps += 1
        for f in sorted(self._pending):
            self._apply(f, *self._pending.pop(f))
        for f in self.spec.due(self.steps):
            exchange = self._start(f)
            if self.spec.overlap:
                self._pending[f] = exchange
            else:
                self._apply(f, *exchange)
            self.last_sync[f] = self.steps

    def _start(self, f: int) -> tuple[Exchange, list[torch.Tensor], list[torch.Tensor] | None]:
        """Start fragment ``f``'s exchange; returns it, its input and the residuals before it (a checkpoint's)."""
        locals_ = [local_tensor(p) for p in self.params[f]]
        if self.anchored:
            inputs = [a - self._wide(t) for a, t in zip(self.anchors[f], locals_)]
        else:
            inputs = [t.clone() for t in locals_]
        before = [r.clone() for r in self.residuals[f]] if self.residuals[f] else None
        return self._exchange(f, inputs), inputs, before

    def _exchange(self, f: int, inputs: list[torch.Tensor]) -> Exchange:
        residuals, chunk = self.residuals[f] or None, self.chunk_residuals[f]
        kind, stats = self.spec.compression, self.stats
        return Exchange(
            inputs, self.group, kind, stats, residuals=residuals, chunk_residual=chunk, link=self.link
        ).start()

    def _apply(self, f: int, exchange: Exchange, inputs: list[torch.Tensor], _before: Any) -> None:
        averages = exchange.finish()
        locals_ = [local_tensor(p) for p in self.params[f]]
        if not self.anchored:
            for t, mean in zip(locals_, averages):
                t.copy_(mean)
            return
        anchors = self.anchors[f]
        if self.outer is not None:
            for a, delta in zip(anchors, averages):
                a.grad = delta.to(a.dtype)
            self.outer.step()
            for a in anchors:
                a.grad = None
        else:
            for a, delta in zip(anchors, averages):
                a.sub_(delta.to(a.dtype))
        for t, a in zip(locals_, anchors):
            t.copy_(a)

    @torch.no_grad()
    def close(self) -> None:
        """At the end of a fit: finish exchanges in flight and synchronise every fragment trained since its
        last synchronisation, so every replica holds the same model."""
        for f in sorted(self._pending):
            self._apply(f, *self._pending.pop(f))
        for f in range(self.spec.fragments):
            if self.last_sync[f] < self.steps:
                self._apply(f, *self._start(f))
                self.last_sync[f] = self.steps

    # ------------------------------------------------------------------ the global model

    def _stale(self) -> list[int]:
        """Fragments whose parameters differ from the global model (trained since their last synchronisation)."""
        return [f for f in range(self.spec.fragments) if self.last_sync[f] < self.steps or f in self._pending]

    @torch.no_grad()
    def global_values(self) -> list[list[torch.Tensor]]:
        """The global model, per fragment (local tensors): the anchors, or for Local SGD the replicas' mean
        (an exchange, for the fragments trained since their last synchronisation)."""
        if self.anchored:
            return [list(anchors) for anchors in self.anchors]
        live = [[local_tensor(p) for p in ps] for ps in self.params]
        if self._stash is not None:  # inside global_model(): the parameters are it
            return live
        for f in self._stale():
            live[f] = Exchange(live[f], self.group, "none", self.stats, link=self.link).start().finish()
        return live

    @contextlib.contextmanager
    @torch.no_grad()
    def global_model(self) -> Generator[None, None, None]:
        """Inside, the parameters are the global model (:meth:`global_values`); this replica's own after."""
        stale = self._stale()
        if not stale or self._stash is not None:
            yield
            return
        values = self.global_values()
        self._stash = {f: [local_tensor(p).clone() for p in self.params[f]] for f in stale}
        for f in stale:
            for p, value in zip(self.params[f], values[f]):
                local_tensor(p).copy_(value)
        try:
            yield
        finally:
            self._restore_stash()

    def _restore_stash(self) -> None:
        stash, self._stash = self._stash, None
        for f, saved in (stash or {}).items():
            for p, value in zip(self.params[f], saved):
                local_tensor(p).copy_(value)

    @contextlib.contextmanager
    @torch.no_grad()
    def local_model(self) -> Generator[None, None, None]:
        """Inside, the parameters are this replica's own (also inside :meth:`global_model`, e.g. a checkpoint
        saved during validation)."""
        if self._stash is None:
            yield
            return
        current = {f: [local_tensor(p).clone() for p in self.params[f]] for f in self._stash}
        for f, saved in self._stash.items():
            for p, value in zip(self.params[f], saved):
                local_tensor(p).copy_(value)
        try:
            yield
        finally:
            for f, values in current.items():
                for p, value in zip(self.params[f], values):
                    local_tensor(p).copy_(value)

    # ------------------------------------------------------------------ state

    def replicated_state(self) -> dict[str, Any]:
        """What every replica holds alike: ``{"anchor": {name: t}, "outer_momentum": {name: t}}`` (local tensors)."""
        out: dict[str, Any] = {"anchor": {}, "outer_momentum": {}}
        for names, anchors in zip(self.names, self.anchors):
            for name, a in zip(names, anchors):
                out["anchor"][name] = a
                if self.outer is not None and "momentum_buffer" in self.outer.state[a]:
                    out["outer_momentum"][name] = self.outer.state[a]["momentum_buffer"]
        return out

    def replica_state(self) -> dict[str, Any]:
        """What this replica holds of its own: the residuals and the input of an exchange in flight (local tensors)."""
        residuals: dict[str, torch.Tensor] = {}
        pending: dict[str, torch.Tensor] = {}
        for f, (names, rs) in enumerate(zip(self.names, self.residuals)):
            in_flight = self._pending.get(f)
            before = in_flight[2] if in_flight is not None else None
            for i, name in enumerate(names):
                if rs:
                    residuals[name] = before[i] if before is not None else rs[i]
                if in_flight is not None:
                    pending[name] = in_flight[1][i]
                elif f in self._template_pending:  # a load's template: the saved exchange's input goes here
                    pending[name] = torch.empty_like(self._wide(local_tensor(self.params[f][i])))
        return {"residual": residuals, "pending": pending}

    def chunk_state(self) -> dict[str, torch.Tensor]:
        """The error feedback of the averaged chunks this rank owns (compressed exchanges), by fragment."""
        return {str(f): c for f, c in enumerate(self.chunk_residuals) if c is not None}

    def prepare_pending(self, fragments: Sequence[int]) -> None:
        """Before a load: :meth:`replica_state` holds room for the inputs of the exchanges in flight at the save."""
        self._template_pending = list(fragments)

    @torch.no_grad()
    def restart_from_params(self) -> None:
        """After the parameters were loaded from a checkpoint without this state (every_step's): the anchors
        start from them, nothing in flight, no residual, a new schedule."""
        self._pending.clear()
        self._broadcast_params()
        for f, ps in enumerate(self.params):
            for a, p in zip(self.anchors[f], ps):
                a.copy_(local_tensor(p))
            for r in self.residuals[f]:
                r.zero_()
            if self.chunk_residuals[f] is not None:
                self.chunk_residuals[f].zero_()
        if self.outer is not None:
            for state in self.outer.state.values():
                if "momentum_buffer" in state:
                    state["momentum_buffer"].zero_()
        self.steps, self.last_sync = 0, [0] * self.spec.fragments

    def info(self) -> dict[str, Any]:
        """The JSON part of the state."""
        return {
            "spec": self.spec.as_dict(),
            "dp": self.n,
            "world": dist.get_world_size(),
            "steps": self.steps,
            "last_sync": list(self.last_sync),
            "pending": sorted(self._pending),
        }

    @torch.no_grad()
    def load(
        self, info: dict[str, Any], replicated: dict[str, Any], replica: dict[str, Any], chunks: dict[str, Any]
    ) -> None:
        """Restore :meth:`info`, :meth:`replicated_state` and :meth:`replica_state` as saved (the tensors are
        the ones the state methods returned, loaded in place, or others of their shapes), and restart an
        exchange that was in flight."""
        self._pending.clear()
        self._template_pending = []
        self.steps = int(info["steps"])
        self.last_sync = [int(s) for s in info["last_sync"]]
        for f, names in enumerate(self.names):
            for i, name in enumerate(names):
                if self.anchored:
                    self.anchors[f][i].copy_(replicated["anchor"][name])
                if self.outer is not None and name in replicated["outer_momentum"]:
                    self.outer.state[self.anchors[f][i]]["momentum_buffer"].copy_(replicated["outer_momentum"][name])
                if self.residuals[f]:
                    self.residuals[f][i].copy_(replica["residual"][name])
        for key, value in chunks.items():
            self.chunk_residuals[int(key)].copy_(value)
        for f in info["pending"]:
            inputs = [replica["pending"][name].clone() for name in self.names[f]]
            before = [r.clone() for r in self.residuals[f]] if self.residuals[f] else None
            self._pending[f] = (self._exchange(f, inputs), inputs, before)
