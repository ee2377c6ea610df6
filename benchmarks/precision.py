"""The fp16 loss scaler's cost: MixedPrecision against torch's GradScaler and against no scaler.

    python benchmarks/precision.py                          # GPT-2 124M, AdamW, one process, all cores
    python benchmarks/precision.py --preset tiny --steps 2  # a quick look

In one run, on the same model, batch, AdamW and gradient clipping (``gradient_clip_val=1.0``),
one process:
- none: Lightning's fp32 ``Precision`` (torch's ``clip_grad_norm_``), no loss scaling (the closure
  run before ``optimizer.step()``, as the AMP plugins do);
- ours: ``lightning_scale.plugins.MixedPrecision("fp16-mixed")``: loss scaled, gradients unscaled,
  one norm serving clipping and the overflow decision, skip logic, ``precision/*`` logged;
- torch: Lightning's ``MixedPrecision("16-mixed")`` with ``torch.amp.GradScaler``.
On CPU fp16 matmuls are emulated (~12x slower than fp32), which would bury the scaler under
compute: every variant computes in fp32 (autocast off) and scales, so the difference is the
scaler's own work — unscale, overflow check, skip logic. Blocks alternate none/ours/torch (the
order rotating each round); the first ``--warmup`` steps of each block are dropped; medians reported.

Each step is split into the closure (forward and backward), the optimizer's update (timed by its
step hooks) and the rest: the plugin's own work (unscale, hooks, norm, clipping, decision).
``scaler_added_s`` is ours minus none of that work (none's is torch's ``clip_grad_norm_``);
``overhead_fraction = scaler_added_s / step(none)``; ``ratio_vs_torch_gradscaler`` divides whole
steps, ``plugin_work_ratio_vs_torch_gradscaler`` the plugins' own work. The physical bound of the added work is one
read and write of every gradient (the unscale, measured here as ``torch._foreach_mul_`` over the
model's gradients): ``fraction_of_bound = bound_s / scaler_added_s``.

Prints ``BENCH precision {json}`` last and writes benchmarks/results/precision.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS, StepTimer, emit
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.models import PRESETS, GPTConfig, GPTLightningModule
from lightning_scale.plugins import MixedPrecision

VARIANTS = ("none", "ours", "torch")


class _Timed:
    """Records, per optimizer step, the seconds spent after the closure (forward and backward) returned,
    and of those the precision plugin's own (without the optimizer's update, timed by its step hooks)."""

    post_closure: list[float]
    own: list[float]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        marks: dict[str, float] = {}
        if not getattr(optimizer, "_bench_hooks", False):
            optimizer.register_step_pre_hook(lambda *_: self._marks.__setitem__("pre", time.perf_counter()))
            optimizer.register_step_post_hook(lambda *_: self._marks.__setitem__("post", time.perf_counter()))
            optimizer._bench_hooks = True
        self._marks = marks

        def timed() -> Any:
            marks["closure_start"] = time.perf_counter()
            try:
                return closure()
            finally:
                marks["closure_end"] = time.perf_counter()

        start = time.perf_counter()
        out = super().optimizer_step(optimizer, model, timed, **kwargs)  # type: ignore[misc]
        total = time.perf_counter() - start
        in_closure = marks["closure_end"] - marks["closure_start"]
        update = marks["post"] - marks["pre"]
        self.post_closure.append(total - in_closure)
        self.own.append(total - in_closure - update)
        return out

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield  # fp32 compute: the loss is still scaled and the gradients unscaled


class _ClosureFirst(Precision):
    """Lightning's fp32 step with the closure run before ``optimizer.step()`` (as the AMP plugins do;
    the same for AdamW), so that the three variants split their steps the same way."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure()
        self._after_closure(model, optimizer)  # hooks, then torch's clip_grad_norm_
        return optimizer.step(**kwargs)


class NoScaler(_Timed, _ClosureFirst):
    def __init__(self) -> None:
        self.post_closure, self.own = [], []


class Ours(_Timed, MixedPrecision):
    def __init__(self) -> None:
        super().__init__("fp16-mixed")
        self.post_closure, self.own = [], []


class TorchGradScaler(_Timed, LightningMixedPrecision):
    def __init__(self) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        self.post_closure, self.own = [], []


PLUGINS = {"none": NoScaler, "ours": Ours, "torch": TorchGradScaler}


def _block(
    variant: str, module: GPTLightningModule, loader: DataLoader, steps: int, warmup: int
) -> tuple[list[float], list[float], list[float]]:
    timer, plugin = StepTimer(), PLUGINS[variant]()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        limit_val_batches=0,
        gradient_clip_val=1.0,
        plugins=[plugin],
    )
    trainer.fit(module, train_dataloaders=loader)
    return timer.times[warmup:], plugin.post_closure[warmup:], plugin.own[warmup:]


def _bound_s(module: GPTLightningModule, repeats: int = 5) -> float:
    """One in-place multiply of every gradient (what unscaling must at least cost), median seconds."""
    grads = [torch.ones_like(p) for p in module.parameters()]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch._foreach_mul_(grads, 0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2-124m", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of every block")
    parser.add_argument("--rounds", type=int, default=3, help="none/ours/torch rounds")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS / "precision.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config: GPTConfig = PRESETS[args.preset]
    tokens = torch.randint(0, config.vocab_size, (args.batch * (args.steps + args.warmup), args.seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    module = GPTLightningModule(config, learning_rate=1e-4, warmup_steps=1)

    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    post: dict[str, list[float]] = {v: [] for v in VARIANTS}
    own: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # each variant in each position
            step_times, post_times, own_times = _block(variant, module, loader, args.steps, args.warmup)
            steps[variant] += step_times
            post[variant] += post_times
            own[variant] += own_times
    step = {v: statistics.median(t) for v, t in steps.items()}
    after = {v: statistics.median(t) for v, t in post.items()}
    work = {v: statistics.median(t) for v, t in own.items()}
    # The optimizer's update (a memory-bound AdamW, the noisiest part of the step here) is left out.
    added = work["ours"] - work["none"]
    bound = _bound_s(module)
    report = {
        "model": {"preset": args.preset, "parameters": sum(p.numel() for p in module.parameters())},
        "batch": [args.batch, args.seq],
        "optimizer": "AdamW, gradient_clip_val=1.0",
        "device": f"cpu, {args.threads} threads, one process",
        "compute": (
            "fp32 with the loss scaled (fp16 matmuls are emulated on CPU, ~12x slower): the differences are the "
            "scaler's own work (unscale, overflow check, skip logic)"
        ),
        "samples_per_variant": len(steps["ours"]),
        "step_s": {v: round(t, 5) for v, t in step.items()},
        "after_closure_s": {v: round(t, 5) for v, t in after.items()},
        "plugin_work_s": {v: round(t, 5) for v, t in work.items()},
        "scaler_added_s": round(added, 5),
        "overhead_fraction": round(added / step["none"], 5),
        "ratio_vs_torch_gradscaler": round(step["ours"] / step["torch"], 4),
        "plugin_work_ratio_vs_torch_gradscaler": round(work["ours"] / work["torch"], 4),
        "bound_s": round(bound, 5),
        "fraction_of_bound": round(bound / added, 4) if added > 0 else None,
        "targets": {"overhead_fraction": "<= 0.02", "ratio_vs_torch_gradscaler": "<= 1.01"},
    }
    emit("precision", report, args.out)


if __name__ == "__main__":
    main()
