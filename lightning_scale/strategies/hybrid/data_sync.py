"""The strategy's side of ``data_parallel_sync``: which parameters form each fragment, the periodic
synchronisation after every optimizer step (:class:`~lightning_scale.core.parallel.sync.PeriodicSync`),
the global model for validation and at the end of a fit, the exchange's telemetry, and what a
checkpoint holds of it.

A checkpoint of a periodic mode holds:

- ``state_dict``: the global model (DiLoCo's anchor, or the replicas' mean for Local SGD), what
  ``load_from_checkpoint``, ``validate`` and ``test`` load;
- ``strategy_state`` (``strategy/sync/...`` keys of the sharded checkpoint): the anchors and the outer
  momentum (one copy, as the replicas hold them alike) and, per replica ``r``, ``replica{r}/model/...``
  (its own parameters and buffers), ``replica{r}/optim{i}/...`` (its inner optimizer's state, numbers as
  0-d tensors) and ``replica{r}/residual|pending/...`` (error feedback, an exchange in flight);
- the manifest's ``data_parallel_sync``: the mode, the data-parallel size and the schedule.

A fit resumes from it at the same data-parallel size and mode only (each replica takes its own part
back): another size would have to invent or drop replicas' parameters and optimizer states, so it is
refused with the rule. A checkpoint of ``every_step`` may start a periodic fit (post-local SGD): the
anchors start from the loaded model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_scale.core.checkpoint.sharded_state import ShardedState
from lightning_scale.core.parallel.sync import PeriodicSync, local_tensor
from lightning_scale.core.parallel.sync_exchange import EmulatedLink, ExchangeStats, ring_bytes
from lightning_scale.core.parallel.sync_spec import SyncSpec
from lightning_scale.core.pipeline.runner import PipelineRunner
from lightning_scale.strategies.hybrid.pipeline_hooks import PIPELINE_SPEC_HOOK, pipeline_spec_of

__all__ = ["DataParallelSync", "check_fragments", "fragments_of"]

_PREFIX = "sync"


def _block_prefixes(module: nn.Module, runner: PipelineRunner | None) -> list[str] | None:
    """The whole model's blocks in order, as name prefixes relative to ``module`` (``None``: it declares none)."""
    from lightning_scale.core.pipeline.spec import find_registered_spec

    if runner is not None:
        root_name, spec = pipeline_spec_of(module)
    else:
        hook = getattr(module, PIPELINE_SPEC_HOOK, None)
        found = hook() if callable(hook) else find_registered_spec(module)
        if found is None:
            return None
        root_name, spec = found
    return [f"{root_name}.{b}." if root_name else f"{b}." for b in spec.blocks]


def check_fragments(module: nn.Module, fragments: int, runner: PipelineRunner | None = None) -> list[str]:
    """The model's block prefixes (see :func:`fragments_of`), after checking that ``fragments`` of them can be
    formed: ``ValueError`` when the model declares no blocks or has fewer than ``fragments``. The strategy
    runs it on the LightningModule before its launcher starts any process."""
    prefixes = _block_prefixes(module, runner)
    if prefixes is None:
        raise ValueError(
            f"streaming_diloco(fragments={fragments}) splits the model's blocks into fragments, but "
            f"{type(module).__name__} declares none: define `{PIPELINE_SPEC_HOOK}(self)` (it lists the blocks) or "
            "use fragments=1 (DiLoCo)."
        )
    if fragments > len(prefixes):
        raise ValueError(
            f"streaming_diloco(fragments={fragments}) needs at least one block per fragment; "
            f"{type(module).__name__} has {len(prefixes)} blocks. Use fragments <= {len(prefixes)}."
        )
    return prefixes


def fragments_of(
    module: nn.Module, fragments: int, runner: PipelineRunner | None, tied: Sequence[Sequence[str]] = ()
) -> list[list[tuple[str, torch.Tensor]]]:
    """This rank's ``(name, parameter)`` pairs in each of ``fragments`` contiguous fragments of the
    model's blocks; parameters outside the blocks (embeddings, final norm, head) go with fragment 0, a
    weight tied across pipeline stages with its first name's fragment (every copy synchronised at once)."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if fragments == 1:
        return [params]
    prefixes = check_fragments(module, fragments, runner)

    def fragment(name: str) -> int:
        for b, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                return b * fragments // len(prefixes)
        return 0

    first = {name: names[0] for names in tied for name in names}
    out: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(fragments)]
    for name, p in params:
        out[fragment(first.get(name, name))].append((name, p))
    return out


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor of ``param``'s shape here) as the checkpoint stores ``param``: a DTensor of
    its mesh and placements when it is one (each tensor-parallel rank its shard)."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


class DataParallelSync:
    """``spec`` run for the strategy (``every_step``: only the byte count of DDP's reduction)."""

    def __init__(self, spec: SyncSpec, link: EmulatedLink | None) -> None:
        self.spec, self.link = spec, link
        self.runner: PeriodicSync | None = None
        self.ddp_stats = ExchangeStats()  # every_step: counted by the emulated link's hook, else per step
        self._per_step = 0.0
        self._counted_by_hook = False
        self._dp_rank = 0
        self._params: dict[str, torch.Tensor] = {}
        self._loaded: tuple[Any, dict[str, Any]] | None = None  # (manifest entry, loaded state) until restored
        self._validating: contextlib.ExitStack | None = None

    @property
    def periodic(self) -> bool:
        return self.spec.periodic

    def attach(self, module: nn.Module, mesh: DeviceMesh, runner: PipelineRunner | None, *, hooked: bool) -> None:
        """At a fit's set-up, after the model was cut: the fragments and their synchronisation (every
        replica starts from the first's parameters). ``hooked``: every_step's all-reduces go through the
        emulated link's DDP hook, which counts them."""
        dp = mesh["dp"]
        self._dp_rank = dp.get_local_rank()
        self._counted_by_hook = hooked
        self.ddp_stats.bytes_sent, self.ddp_stats.exchanges, self.ddp_stats.blocked_s = 0.0, 0, 0.0  # (the hook's)
        self._params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self.periodic:
            payload = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in self._params.values())
            self._per_step = ring_bytes(payload, dp.size())
            return
        tied = runner.tied_groups if runner is not None else ()
        fragments = fragments_of(module, self.spec.fragments, runner, tied)
        self.runner = PeriodicSync(self.spec, fragments, dp.get_group(), link=self.link)

    def after_step(self) -> None:
        if self.runner is not None:
            self.runner.after_step()
        else:  # every step: one exchange (DDP's buckets), its bytes counted by the emulated link's hook if any
            self.ddp_stats.exchanges += 1
            if not self._counted_by_hook:
                self.ddp_stats.bytes_sent += self._per_step

    def stats(self) -> dict[str, Any]:
        """Cumulative per rank since the fit started (or the checkpoint it resumed): bytes sent for the
        data-parallel exchange, exchanges, seconds blocked on them."""
        s = self.runner.stats if self.runner is not None else self.ddp_stats
        return {
            "mode": self.spec.mode,
            "every": self.spec.every,
            "bytes_sent": s.bytes_sent,
            "exchanges": s.exchanges,
            "blocked_s": s.blocked_s,
        }

    @contextlib.contextmanager
    def global_model(self) -> Generator[None, None, None]:
        """Validation inside a fit sees the global model."""
        if self.runner is None:
            yield
            return
        with self.runner.global_model():
            yield

    def validation_started(self, fitting: bool) -> None:
        """Validation inside a fit sees the global model, until :meth:`validation_ended`."""
        if self.runner is not None and fitting and self._validating is None:
            self._validating = contextlib.ExitStack()
            self._validating.enter_context(self.global_model())

    def validation_ended(self) -> None:
        if self._validating is not None:
            stack, self._validating = self._validating, None
            stack.close()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    # ------------------------------------------------------------------ checkpoints

    def manifest(self) -> dict[str, Any] | None:
        return None if self.runner is None else self.runner.info() | {"stats": self.stats()}

    def global_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each synchronised parameter's value replaced by the global model's."""
        runner = self.runner
        if runner is None:
            return dict(state_dict)
        values = runner.global_values()
        by_storage = {
            local_tensor(p).data_ptr(): (p, values[f][i])
            for f, ps in enumerate(runner.params)
            for i, p in enumerate(ps)
        }
        out = {}
        for name, value in state_dict.items():
            hit = by_storage.get(local_tensor(value).data_ptr()) if isinstance(value, torch.Tensor) else None
            out[name] = _like(hit[1].to(local_tensor(hit[0]).dtype), hit[0]) if hit is not None else value
        return out

    def _flat(self, state: ShardedState, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
        """The ``strategy_state`` entries: live tensors (a save reads them; a load fills them in place)."""
        runner = self.runner
        assert runner is not None
        out: dict[str, torch.Tensor] = {}
        params = {n: p for ns, ps in zip(runner.names, runner.params) for n, p in zip(ns, ps)}
        for part, tensors in runner.replicated_state().items():
            for name, t in tensors.items():
                out[f"{_PREFIX}/{part}/{name}"] = _like(t, params[name])
        replica = f"{_PREFIX}/replica{self._dp_rank}"
        for part, tensors in runner.replica_state().items():
            for name, t in tensors.items():
                out[f"{replica}/{part}/{name}"] = _like(t, params[name])
        rank = torch.distributed.get_rank()
        for f, t in runner.chunk_state().items():  # each rank's own (the same layout resumes them)
            out[f"{replica}/chunk/{f}/rank{rank}"] = t
        with runner.local_model():
            for name, value in state.model_state().items():
                out[f"{replica}/model/{name}"] = value
        for i, optimizer in enumerate(optimizers):
            for fqn, entries in state.optimizer_state(optimizer).get("state", {}).items():
                for key, value in entries.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        value = torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else torch.int64)
                    if isinstance(value, torch.Tensor):
                        out[f"{replica}/optim{i}/{fqn}/{key}"] = value
        return out

    def checkpoint(
        self, checkpoint: dict[str, Any], state: ShardedState, optimizers: Sequence[torch.optim.Optimizer]
    ) -> dict[str, Any]:
        """What a periodic mode saves of a Lightning checkpoint dict: the global model as ``state_dict``, and
        (a full checkpoint) each replica's own state as ``strategy_state``; ``checkpoint`` itself otherwise."""
        if self.runner is None or "state_dict" not in checkpoint:
            return checkpoint
        checkpoint = {**checkpoint, "state_dict": self.global_state(checkpoint["state_dict"])}
        if "optimizer_states" in checkpoint:
            checkpoint["strategy_state"] = self._flat(state, optimizers)
        return checkpoint

    def check_resume(self, saved: Mapping[str, Any] | None, dp: int, fitting: bool) -> None:
        """``ValueError`` for a fit that cannot resume the checkpoint's synchronisation (``saved``: its manifest's)."""
        if not fitting:
            return
        if saved is None:
            return  # every_step (or older): a periodic fit starts its anchors from the loaded model
        spec = SyncSpec(**saved["spec"])
        if self.runner is None:
            raise ValueError(
                f"The checkpoint was saved under data_parallel_sync={spec.describe()}: each of its {saved['dp']} replicas "
                "has its own parameters and optimizer state, and data_parallel_sync='every_step' trains one model. "
                f"Resume with the same data_parallel_sync, or load its global model (weights) into a new fit."
            )
        world = torch.distributed.get_world_size()
        if spec.compression != "none" and saved.get("world") != world:
            raise ValueError(
                f"The checkpoint was saved under data_parallel_sync={spec.describe()} by {saved.get('world')} processes; "
                f"this fit has {world}. The compressed exchange's error feedback belongs to each process's chunk of the "
                "average, so it resumes with the same processes and layout only. Resume with the saved layout."
            )
        same = (spec.mode, spec.fragments, spec.compression) == (
            self.spec.mode,
            self.spec.fragments,
            self.spec.compression,
        )
        if saved["dp"] != dp or not same:
            raise ValueError(
                f"The checkpoint was saved under data_parallel_sync={spec.describe()} at data_parallel={saved['dp']}; "
                f"this fit runs {self.spec.describe()} at data_parallel={dp}. A periodic mode resumes at the same "
                "data-parallel size, mode, fragments and compression only: each replica takes back its own parameters and inner "
                "optimizer state, which another size would have to invent or drop. Resume at "
                f"data_parallel={saved['dp']} with {spec.mode}, or load the checkpoint's global model (weights) into a "
                "new fit."
            )

    def template(
        self, dp: int, state: ShardedState, optimizers: Sequence[torch.optim.Optimizer]
    ) -> Callable[[Mapping[str, Any], bool], dict[str, torch.Tensor]]:
        """For :meth:`ShardedCheckpoints.load`: given a checkpoint's manifest, what to load of it besides the
        model and the optimizers (``{}``: nothing), or a ``ValueError`` for a fit that cannot resume it."""

        def own(manifest: Mapping[str, Any], fitting: bool) -> dict[str, torch.Tensor]:
            saved = manifest.get("data_parallel_sync")
            self.check_resume(saved, dp, fitting)
            self._loaded = (saved, {}) if fitting and self.runner is not None else None
            return self._template(saved, state, optimizers) if fitting else {}

        self._loaded = None
        return own

    def loaded(self, values: dict[str, Any]) -> None:
        """The entries :meth:`template` asked for, loaded (kept for :meth:`restore`)."""
        if self._loaded is not None:
            self._loaded = (self._loaded[0], values)

    def _template(
        self, saved: Mapping[str, Any] | None, state: ShardedState, optimizers: Sequence[torch.optim.Optimizer]
    ) -> dict[str, torch.Tensor]:
        if saved is None or self.runner is None:
            return {}
        self.runner.prepare_pending(saved["pending"])
        flat = self._flat(state, optimizers)
        # The replica's own parameters and optimizer state into copies: the global model and the shared
        # optimizer state are loaded into the live ones after, and this replica's own replace them last.
        own = (f"{_PREFIX}/replica{self._dp_rank}/model/", f"{_PREFIX}/replica{self._dp_rank}/optim")
        return {k: v.detach().clone() if k.startswith(own) else v for k, v in flat.items()}

    def restore(self, state: ShardedState, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """After the global model and the optimizers were loaded: each replica's own part back, and the schedule."""
        runner, found, self._loaded = self.runner, self._loaded, None
        if runner is None or found is None:
            return
        saved, loaded = found
        if saved is None:
            runner.restart_from_params()
            return
        replica = f"{_PREFIX}/replica{self._dp_rank}"

        def part(prefix: str) -> dict[str, Any]:
            return {k[len(prefix) + 1 :]: v for k, v in loaded.items() if k.startswith(prefix + "/")}

        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        model = part(f"{replica}/model")
        state.load_model_state(model, strict=False, partial=True)
        for i, optimizer in enumerate(optimizers):
            template = state.optimizer_state(optimizer)
            flat = part(f"{replica}/optim{i}")
            for fqn, entries in template.get("state", {}).items():
                for key, value in list(entries.items()):
                    got = flat.get(f"{fqn}/{key}")
                    if got is None:
                        continue
                    entries[key] = type(value)(got.item()) if isinstance(value, (int, float)) else got
            state.load_optimizer_state(optimizer, template)
        replicated = {p: {k: local(v) for k, v in part(f"{_PREFIX}/{p}").items()} for p in ("anchor", "outer_momentum")}
        own = {p: {k: local(v) for k, v in part(f"{replica}/{p}").items()} for p in ("residual", "pending")}
        rank = torch.distributed.get_rank()
        chunks = {k.split("/")[0]: v for k, v in part(f"{replica}/chunk").items() if k.endswith(f"/rank{rank}")}
        runner.load(dict(saved), replicated, own, chunks)
        runner.stats.bytes_sent = float(saved["stats"]["bytes_sent"])
        runner.stats.exchanges = int(saved["stats"]["exchanges"])
        runner.stats.blocked_s = float(saved["stats"]["blocked_s"])
