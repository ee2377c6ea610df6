"""The user's own step under pipeline parallelism: ``training_step`` (and ``validation_step``,
``test_step``) runs on the last stage, once per micro-batch, with the model's output in place of its
forward.

Nothing of the user's loss is dropped: a second term (a z-loss, a regulariser on the logits), label
smoothing, a weight that follows the schedule, ``self.log`` of each term all happen as in one
process. The step is called with the micro-batch (the batch as the loader gave it, split along dim 0);
when it calls the pipeline's root module (``self.model(x)``, or ``self(x)`` when the LightningModule
itself is cut), the call returns this stage's output for that micro-batch instead of running a
forward. The step's loss then trains the stage exactly: its gradient with respect to the output is
taken here and handed to the schedule's backward (a stand-in loss with that gradient and the step's
value), and each micro-batch counts by the same weight as the spec's loss would (its share of the
labelled positions, or an equal share).

What would make the pipelined loss differ from the step's in one process is refused, on every rank,
before the optimizer steps (:meth:`StepLoss.finish`, raised by the runner):

- the step feeds the model something other than the pipeline's inputs, calls it more than once, or
  never calls it;
- the loss depends on parameters other than through the output (an auxiliary loss the blocks keep,
  like a mixture-of-experts router loss, or a penalty on the weights): the last stage holds only its
  own blocks. An auxiliary term carried *in the output* (``return logits, aux``) is exact;
- the whole batch's loss is not the weighted sum of its micro-batches' (checked on the first batch
  and on the first whose micro-batches hold different numbers of labelled positions, on the two that
  differ most): e.g. a term averaged over every position beside a cross entropy over the labelled
  ones, or a statistic of the whole batch;
- a logged value whose whole-batch value is not the weighted mean of the micro-batches' (same check);
- the step raises, returns None (skipping a step), or calls a collective of the strategy other than
  ``reduce`` (which, inside, returns its input: the values logged are averaged over replicas anyway).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_scale.core.pipeline.loss import MicroBatchLoss, tensors_of, zero_loss
from lightning_scale.core.pipeline.spec import PipelineSpec
from lightning_scale.core.pipeline.structure import flatten, rebuild

__all__ = ["StepLoss"]

Split = Callable[[Any], tuple[Any, Any, dict[str, Any]]]
Logged = dict[str, tuple[Tensor, dict[str, Any], float]]
"""Name -> (value in float64, the options of ``self.log``, the rounding of the value's own dtype)."""


_CALL = "_lightning_scale_pipeline_call"
_LOSS = "\0loss"  # the step's own loss among the values of a micro-batch (never a logged name)
_INTERCEPTING: dict[type, type] = {}


def _intercepting(cls: type) -> type:
    """``cls`` whose call (and ``forward``) answers with the pipeline's output (:class:`_Call`)."""
    if cls not in _INTERCEPTING:

        def intercepted(this: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return this.__dict__[_CALL](this, args, kwargs)

        _INTERCEPTING[cls] = type(cls.__name__, (cls,), {"__call__": intercepted, "forward": intercepted})
    return _INTERCEPTING[cls]


class Refused(Exception):
    """The step cannot be pipelined exactly; the message says why and what to do."""


def _eps(value: Tensor) -> float:
    """The rounding of ``value``'s dtype (of float32 for integers)."""
    return torch.finfo(value.dtype if value.is_floating_point() else torch.float32).eps


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _foreign_leaves(loss: Tensor, allowed: set[int]) -> list[Tensor]:
    """Tensors requiring grad that ``loss`` depends on other than ``allowed`` (by id): parameters
    reached not through the stage's output."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None and id(var) not in allowed:
            found.append(var)
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return found


def _cat(a: Any, b: Any) -> Any:
    """Two micro-batches (tensors inside tuples, lists, dicts) as one, along dim 0."""
    if isinstance(a, Tensor):
        return torch.cat([a, b])
    if isinstance(a, (tuple, list)):
        return type(a)(_cat(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping):
        return {k: _cat(a[k], b[k]) for k in a}
    return a


class _Call:
    """One call of the step: what the root's call must receive and returns, and what it was given."""

    def __init__(self, given: Any, expected: list[Tensor], target: Any, spec: PipelineSpec) -> None:
        self.given, self.expected, self.target, self.spec = given, expected, target, spec
        self.calls = 0

    def __call__(self, root: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise Refused(
                "the step calls the model more than once per batch; the pipeline runs one forward per micro-batch. "
                "Compute every term from one call's output."
            )
        labels = kwargs.get("labels")
        passed = tensors_of((list(args), {k: v for k, v in kwargs.items() if k != "labels"}))
        same = len(passed) == len(self.expected) and all(
            p.shape == e.shape and torch.equal(p, e) for p, e in zip(passed, self.expected, strict=True)
        )
        if not same:
            raise Refused(
                f"the step feeds {type(root).__name__} other tensors than the pipeline's first stage receives "
                f"({len(passed)} given, {len(self.expected)} from pipeline_batch): under pipeline parallelism the first "
                "stage runs the model on pipeline_batch(batch)'s inputs. Make pipeline_batch return exactly what "
                "training_step passes to the model (a third element, a dict, for keyword inputs)."
            )
        transformers = any(c.__name__ == "PreTrainedModel" for c in type(root).__mro__)
        if labels is None and not (transformers and isinstance(self.given, Tensor)):
            return self.given
        return self._model_output(root, labels)

    def _model_output(self, root: torch.nn.Module, labels: Tensor | None) -> Any:
        """A transformers model returns a ``ModelOutput``; called with ``labels`` it computes its loss inside:
        the registered family's loss (the spec's, which is transformers' own) on the logits."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            return CausalLMOutputWithPast(logits=self.given)
        target = self.target if isinstance(self.target, Tensor) else None
        family = getattr(self.spec.loss_fn, "__module__", "").startswith("lightning_scale.integrations")
        if not (family and target is not None and torch.equal(labels, target) and isinstance(self.given, Tensor)):
            raise Refused(
                f"the step passes labels to {type(root).__name__}, whose loss inside the model the pipeline cannot "
                "run (its last stage gets the output of the blocks, not the labels). Compute the loss in the step from "
                "the output's logits, or use a Hugging Face causal LM whose batches give those labels as the target."
            )
        assert self.spec.loss_fn is not None  # a registered family's spec has its loss
        return CausalLMOutputWithPast(loss=self.spec.loss_fn(self.given, labels), logits=self.given)


class StepLoss(MicroBatchLoss):
    """The module's own step as the last stage's loss, one micro-batch at a time.

    Args:
        module: the LightningModule.
        root: the module the pipeline runs (pruned to this rank's stages).
        spec: the pipeline spec (its ``loss_tokens`` weighs the micro-batches).
        split: ``pipeline_batch``: a (micro-)batch's ``(inputs, target, kwargs)``.
        inside: a context in which the strategy's own collectives do not communicate.

    Call :meth:`begin` before each schedule step with the step method and its arguments.
    """

    def __init__(
        self,
        module: LightningModule,
        root: torch.nn.Module,
        spec: PipelineSpec,
        split: Split,
        inside: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        assert spec.loss_fn is not None  # the runner refuses a spec without one
        super().__init__(spec.loss_fn, spec.loss_tokens)
        self.module, self.root, self.spec, self.split, self.inside = module, root, spec, split, inside
        self.method, self.args, self.training, self.own = "training_step", (), True, True
        self.refusal: str | None = None
        self.logged: dict[int, Logged] = {}
        self._stash: dict[int, Any] = {}
        self._pair: tuple[int, int] | None = None
        self._checked = {"training_step": False, "validation_step": False, "test_step": False}
        self._names = {id(p): n for n, p in root.named_parameters()}

    def target_of(self, target: Any) -> Any:
        return self.split(target)[1]

    def begin(self, method: str, args: tuple[Any, ...], training: bool, *, own: bool = True) -> None:
        """Before a schedule step: the module's ``method`` with ``args`` after the batch (``own``: the module
        defines it; else the spec's loss runs, as it does for a module without the method)."""
        self.method, self.args, self.training, self.own = method, args, training, own
        self.refusal, self.logged, self._stash = None, {}, {}

    def set_targets(self, target: Any, microbatches: int) -> Tensor:
        indices = super().set_targets(target, microbatches)
        self._pair = self._pair_to_check()
        return indices

    def _pair_to_check(self) -> tuple[int, int] | None:
        """The two micro-batches whose labelled counts differ most, on the first batch and on the first
        batch where they differ at all (then the weighting is proven); else none."""
        if len(self.weights) < 2 or not self.own or self._checked[self.method] is True:
            return None
        low = min(range(len(self.weights)), key=lambda i: self.weights[i])
        high = max(range(len(self.weights)), key=lambda i: self.weights[i])
        if self.weights[low] == self.weights[high]:
            return None if self._checked[self.method] == "first" else (0, 1)
        return (low, high)

    def __call__(self, output: Any, index: Tensor) -> Tensor:
        output = self.rebuild(output)
        if self.predicting:
            return tensors_of(output)[0].new_zeros(())
        i = int(index)
        weight = self.weights[i]
        if weight == 0.0 or self.refusal is not None:
            return zero_loss(output)
        if not self.own:
            return self.loss_fn(output, self.target_of(self.targets[i])) * (weight * self.scale)
        try:
            surrogate, logged = self._step(output, self.targets[i], grads=self.training, factor=weight * self.scale)
        except Exception as err:  # noqa: BLE001 - every rank raises it after the schedule, not this one alone
            self.refusal = self._explain(err)
            return zero_loss(output)
        self.logged[i] = logged
        if self._pair is not None and i in self._pair:
            leaves, description = flatten(output)
            self._stash[i] = ([t.detach() for t in leaves], description, self.targets[i])
        return surrogate

    def _explain(self, err: BaseException) -> str:
        where = f"{type(self.module).__name__}.{self.method}"
        if isinstance(err, Refused):
            return f"Under pipeline parallelism {where} cannot be run exactly: {err}"
        trace = "".join(traceback.format_exception(err, limit=-4)).rstrip()
        return f"{where} raised on the pipeline's last stage (run there once per micro-batch):\n{trace}"

    @contextlib.contextmanager
    def _calling(self, call: _Call) -> Generator[Logged, None, None]:
        """Inside: the root's call returns the stage's output, ``self.log`` records, collectives are off."""
        root, module = self.root, self.module
        original = type(root)
        logged: Logged = {}

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise Refused(f"self.log({name!r}, ...) with positional options; pass them by keyword.")
            if not isinstance(value, (Tensor, int, float)):
                raise Refused(
                    f"self.log({name!r}) of a {type(value).__name__}: under pipeline parallelism each micro-batch's "
                    "value is logged as their weighted mean, which needs a number or a scalar tensor."
                )
            value = torch.as_tensor(_local(value) if isinstance(value, Tensor) else value).detach()
            if value.numel() != 1:
                raise Refused(f"self.log({name!r}) of a tensor of shape {tuple(value.shape)}; log a scalar.")
            kept = {k: v for k, v in kwargs.items() if k not in ("sync_dist", "sync_dist_group", "rank_zero_only")}
            logged[name] = (value.reshape(()).to(torch.float64), kept, _eps(value))

        root.__dict__[_CALL] = call
        root.__class__ = _intercepting(original)
        module.log = log  # type: ignore[method-assign]
        try:
            with self.inside():
                yield logged
        finally:
            root.__class__ = original
            del root.__dict__[_CALL]
            del module.log

    def _step(self, output: Any, raw: Any, *, grads: bool, factor: float = 1.0) -> tuple[Tensor, dict[str, Any]]:
        """``(stand-in loss, logged)`` of the step on one micro-batch given the stage's ``output``: its value
        is the step's loss times ``factor`` (the micro-batch's weight times the loss scale), its gradient
        with respect to the output the step's loss's times ``factor`` (scaled before any cast, as the
        spec's loss would be)."""
        leaves, description = flatten(output)
        trainable = [grads and t.is_floating_point() and t.requires_grad for t in leaves]
        stand_ins = [t.detach().requires_grad_(g) for t, g in zip(leaves, trainable, strict=True)]
        inputs, target, kwargs = self.split(raw)
        call = _Call(rebuild(stand_ins, description), tensors_of([inputs, kwargs]), target, self.spec)
        with self._calling(call) as logged:
            result = getattr(self.module, self.method)(raw, *self.args)
        loss = result.get("loss") if isinstance(result, Mapping) else result
        if call.calls == 0:
            raise Refused(
                f"the step never calls {type(self.root).__name__} (the module the pipeline runs), so the pipeline "
                "cannot tell which of its computations is the model's forward. Call that module once on the batch."
            )
        if loss is None:
            if self.training:
                raise Refused("the step returned None (skip this batch), which a pipeline cannot do per micro-batch.")
            return zero_loss(output), logged
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise Refused(f"the step returned {type(loss).__name__}, not a scalar loss tensor.")
        logged[_LOSS] = (_local(loss.detach()).reshape(()).to(torch.float64), {}, _eps(loss))
        if not grads:
            return zero_loss(output) + _local(loss.detach()).to(torch.float64) * factor, logged
        wanted = [s for s, g in zip(stand_ins, trainable, strict=True) if g]
        foreign = _foreign_leaves(loss, {id(s) for s in wanted})
        if foreign:
            names = sorted({self._names.get(id(t), "the stage's input activations") for t in foreign})
            raise Refused(
                f"its loss depends on {names[:4]} other than through the model's output (an auxiliary loss kept by the "
                "model's blocks, like a router's load-balancing loss, or a penalty on the weights): the last pipeline "
                "stage holds only its own blocks. Carry such a term in the model's output (each block adds its term to "
                "a running total it passes on with the hidden state; the model returns (logits, aux)), and put weight "
                "penalties in the optimizer (weight_decay)."
            )
        if not loss.requires_grad:
            raise Refused("its loss does not depend on the model's output (no gradient would reach the model).")
        found = torch.autograd.grad(loss * factor, wanted, allow_unused=True)
        real = [t for t, g in zip(leaves, trainable, strict=True) if g]
        parts = [(_local(o) * _local(g)).sum() for o, g in zip(real, found, strict=True) if g is not None]
        surrogate = torch.stack([p.to(torch.float64) for p in parts]).sum() if parts else zero_loss(output)
        value = _local(loss.detach()).to(torch.float64) * factor
        return surrogate - surrogate.detach() + value, logged

    def finish(self) -> tuple[str | None, dict[str, tuple[Tensor, Any]]]:
        if self.refusal is None and self._pair is not None and len(self._stash) == 2:
            try:
                self._check_pair()
            except Exception as err:  # noqa: BLE001 - raised on every rank by the runner
                self.refusal = self._explain(err)
        if self.refusal is not None:
            return self.refusal, {}
        names = [[n for n in v if n != _LOSS] for v in self.logged.values()]
        if any(n != names[0] for n in names):
            return self._explain(Refused(f"its micro-batches logged different names ({names})")), {}
        metrics = {}
        for name in names[0] if names else []:
            value = sum(self.weights[i] * logged[name][0] for i, logged in self.logged.items())
            metrics[name] = (torch.as_tensor(value, dtype=torch.float64), self.logged[next(iter(self.logged))][name][1])
        return None, metrics

    def _check_pair(self) -> None:
        """The step on two micro-batches together against their weighted sum (loss and every logged value),
        in float64 where the step keeps the output's precision."""
        a, b = self._pair  # type: ignore[misc]
        counts = [self.weights[a], self.weights[b]]
        wa, wb = (c / sum(counts) for c in counts) if sum(counts) else (0.5, 0.5)

        (leaves_a, description, raw_a), (leaves_b, _, raw_b) = self._stash[a], self._stash[b]

        def run(outputs: list[list[Tensor]], raw: Any) -> dict[str, Any]:
            leaves = [torch.cat(list(ts)) for ts in zip(*outputs, strict=True)]  # DTensors stay DTensors
            leaves = [t.double() if t.is_floating_point() else t for t in leaves]
            return self._step(rebuild(leaves, description), raw, grads=False)[1]

        first, second = run([leaves_a], raw_a), run([leaves_b], raw_b)
        whole = run([leaves_a, leaves_b], _cat(raw_a, raw_b))
        for name, (together, _, eps) in whole.items():
            what = "the loss" if name == _LOSS else f"the logged {name!r}"
            if name not in first or name not in second:
                continue
            first_value, second_value = first[name][0], second[name][0]
            expected = wa * first_value + wb * second_value
            tolerance = max(1e-10, 200 * max(eps, first[name][2], second[name][2])) * max(1.0, abs(float(expected)))
            if abs(float(together) - float(expected)) > tolerance:
                raise Refused(
                    f"{what} of two micro-batches together is {float(together):.10g}, not the weighted sum of theirs "
                    f"({float(expected):.10g}, weights {wa:.4g} and {wb:.4g}: "
                    f"{'their shares of the labelled positions the spec counts' if self.loss_tokens else 'equal'}), "
                    "so splitting the batch into micro-batches would change it. Each term must be a mean over what "
                    "the spec's loss_tokens counts (or, without loss_tokens, over every position): e.g. average an "
                    "auxiliary term over the labelled positions too, not over all of them; no statistic of the whole "
                    "batch."
                )
        self._checked[self.method] = True if counts[0] != counts[1] else "first"
