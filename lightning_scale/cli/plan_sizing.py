"""``lightning-scale-plan --budget-usd/--budget-hours/--budget-flops``: the model and tokens a budget buys.

The scaling law (:mod:`lightning_scale.core.planner.sizing`) gives the compute-optimal parameters and
tokens for the budget's FLOPs; the nearest reference GPT preset is planned on the cluster, and its
best layout's MFU turns dollars or hours into FLOPs again, until the choice settles (a few rounds).
``plan.law=fit`` fits the law to the losses of finished runs in ``plan.fit_studies`` (sweep folders:
each job's ``results.json``, with ``summary.json`` for its parameter count).

Imports no other ``cli`` module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_scale.core.checks import format_choices
from lightning_scale.core.planner import Cluster, Workload, model_shape, plan
from lightning_scale.core.planner.sizing import LAWS, ScalingLaw, fit_law
from lightning_scale.models import PRESETS

__all__ = ["describe", "law_named", "runs_of_studies", "size_for_budget"]


def runs_of_studies(folders: Sequence[str | Path]) -> list[tuple[float, float, float]]:
    """``(parameters, tokens trained, final validation loss)`` of every completed job in the studies."""
    runs = []
    for folder in folders:
        for results in sorted(Path(folder).glob("*/results.json")):
            record = json.loads(results.read_text())
            summary_path = results.with_name("summary.json")
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
            n = record.get("num_parameters", summary.get("num_parameters"))
            loss = record.get("final_val_loss")
            needed = (n, loss, record.get("global_step"), record.get("global_batch_size"), record.get("seq_len"))
            if record.get("status") == "completed" and all(v is not None for v in needed):
                runs.append(
                    (
                        float(n),
                        float(record["global_step"] * record["global_batch_size"] * record["seq_len"]),
                        float(loss),
                    )
                )
    return runs


def law_named(name: str, studies: Sequence[str]) -> ScalingLaw:
    if name == "fit":
        if not studies:
            raise ValueError(
                "plan.law=fit fits the law to finished runs: name their sweep folders in plan.fit_studies=[DIR,...]."
            )
        return fit_law(runs_of_studies(studies))
    if name not in LAWS:
        raise ValueError(f"plan.law={name!r} is not a law the planner knows: {format_choices([*LAWS, 'fit'])}.")
    return LAWS[name]


def size_for_budget(
    law: ScalingLaw,
    system: Cluster,
    workload: Workload,
    *,
    usd: float | None = None,
    hours: float | None = None,
    flops: float | None = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """The compute-optimal parameters and tokens for one budget, the nearest preset, its best layout,
    and the hours and dollars it takes on ``system``."""
    given = [k for k, v in (("usd", usd), ("hours", hours), ("flops", flops)) if v is not None]
    if len(given) != 1:
        raise ValueError(
            f"Give exactly one budget (--budget-usd, --budget-hours or --budget-flops); got {given or 'none'}."
        )
    peak = system.device.peak(workload.compute_dtype)
    price = system.device_price()
    if usd is not None and price is None:
        raise ValueError(
            f"No price for {system.device.name}: give --budget-hours or --budget-flops instead of dollars."
        )
    mfu, out = 0.4, {}
    for _ in range(rounds):
        if flops is not None:
            compute = flops
        else:
            wall = hours if hours is not None else usd / (price.usd_per_device_hour * system.world_size)  # type: ignore[union-attr, operator]
            if peak is None:
                raise ValueError(
                    f"No peak FLOP/s for {system.device.name} in {workload.compute_dtype}: give --budget-flops."
                )
            compute = wall * 3600 * system.world_size * peak * mfu
        n, d = law.optimal(compute)
        preset = min(PRESETS, key=lambda k: abs(math.log(model_shape(PRESETS[k]).parameters / n)))
        shape = model_shape(PRESETS[preset], preset)
        tokens = compute / (6 * shape.parameters)
        ranked = plan(
            shape, workload, system, token_budget=tokens, context_parallel=(1,), float8=(False,)
        )  # what trains
        best = ranked[0]
        out = {
            "law": law.source,
            "budget_flops": compute,
            "optimal_parameters": n,
            "optimal_tokens": d,
            "predicted_loss": law.loss(n, d),
            "preset": preset,
            "preset_parameters": shape.parameters,
            "preset_tokens": tokens,
            "layout": best.name,
            "fits": best.fits,
            "mfu": best.mfu,
            "hours": best.hours_to_budget,
            "usd": best.usd_to_budget,
        }
        if not best.fits or abs(best.mfu - mfu) < 0.01:
            break
        mfu = best.mfu
    if flops is None and best.fits:
        # The preset trains for the whole budget at its best layout's rate: the tokens follow from the time.
        wall = hours if hours is not None else usd / (price.usd_per_device_hour * system.world_size)  # type: ignore[union-attr, operator]
        out.update(
            preset_tokens=wall * 3600 * best.tokens_per_sec,
            hours=wall,
            usd=wall * price.usd_per_device_hour * system.world_size if price else None,
        )
    return out


def describe(sizing: dict[str, Any]) -> str:
    usd = "-" if sizing["usd"] is None else f"${sizing['usd']:,.0f}"
    return (
        f"compute-optimal for {sizing['budget_flops']:.3g} FLOPs ({sizing['law']}): {sizing['optimal_parameters'] / 1e9:.3g}B "
        f"parameters on {sizing['optimal_tokens'] / 1e9:.3g}B tokens (predicted loss {sizing['predicted_loss']:.3f}); nearest "
        f"preset model={sizing['preset']} ({sizing['preset_parameters'] / 1e9:.3g}B) on {sizing['preset_tokens'] / 1e9:.3g}B "
        f"tokens: best layout {sizing['layout']}{'' if sizing['fits'] else ' (does NOT fit)'}, MFU {sizing['mfu']:.1%}, "
        f"{sizing['hours']:,.1f} hours, {usd}"
    )
