"""Calibration: the efficiency factors of one system fitted to step times measured on it. No Lightning.

A run of ``lightning-scale-train`` with ``HybridParallelStrategy`` records in its ``results.json`` the
planner's inputs for that run (the model's shape, the workload, the layout as a
:class:`~lightning_scale.core.planner.layout.Candidate`, the cluster and the peak FLOP/s it used) next to
the step time it measured (:func:`planner_record`). :func:`fit_efficiency` fits the
:class:`~lightning_scale.core.planner.cluster.Efficiency` factors that make the predicted step times of
such :class:`Observation` s closest to the measured ones (least squares of the log ratio: a run twice
too slow weighs as one twice too fast), and :func:`save_calibration` stores them per system (device
and links) in a JSON file that :func:`calibrated` reads back for later plans.

Nothing in a record or in the store is trusted: each field is checked to be a plain number, string or
boolean of the expected kind before anything is built from it (``ValueError`` naming the file and
field otherwise); no code is imported or run from either.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from lightning_scale.core.planner.cluster import CLUSTERS, CPU_EFFICIENCY, LINKS, Cluster, Device, Efficiency
from lightning_scale.core.planner.layout import Candidate, Workload
from lightning_scale.core.planner.shape import ModelShape
from lightning_scale.core.planner.step_time import estimate_time

__all__ = [
    "CALIBRATION_ENV",
    "CPU_FITTED",
    "FITTED",
    "Observation",
    "calibrated",
    "calibration_key",
    "calibration_path",
    "cluster_from_record",
    "default_fit",
    "fit_efficiency",
    "load_calibration",
    "observation_from_record",
    "planner_record",
    "save_calibration",
]

CALIBRATION_ENV = "LIGHTNING_SCALE_CALIBRATION"
"""The JSON file calibrations are stored in (default ``~/.cache/lightning_scale/calibration.json``)."""

FITTED = ("compute", "overhead", "intra_link")
"""What :func:`fit_efficiency` fits by default on a GPU system: few runs pin three factors, and these three
set a step's time there (the rate of its matmuls, its fixed cost per block and micro-batch, the bytes/s its
collectives achieve within a node); ``--fit`` adds others (``latency``, ``collective_overhead``,
``dp_overlap``, ``inter_link``, ...) when the runs vary them."""

CPU_FITTED = ("compute", "overhead", "framework_collectives")
"""The default on a CPU host: its gloo link is measured (:data:`~lightning_scale.core.planner.cluster.LINKS`),
and what its tensor-parallel and FSDP collectives cost beyond the link (``framework_collectives``: their
copies run on the cores the processes share) is what varies from host to host."""


def default_fit(cluster: Cluster, observations: Sequence[Observation] = ()) -> tuple[str, ...]:
    """The factors calibration fits on ``cluster``'s system unless told: :data:`CPU_FITTED` on a CPU host,
    else :data:`FITTED`; and ``float8_gemm`` when an observation trained float8 linears (``benchmarks/gpu_check.py``'s
    fp8 run): the float8 speed-up measured beside bf16 runs replaces the default's (ml-engineering's
    achievable-matmul table, :attr:`~lightning_scale.core.planner.cluster.Efficiency.float8_gemm`)."""
    base = CPU_FITTED if cluster.device.chip == "cpu" else FITTED
    return (*base, "float8_gemm") if any(o.candidate.float8 for o in observations) else base


_GRIDS: dict[str, Sequence[float]] = {
    "compute": [0.05 * 1.25**k for k in range(20)],  # 0.05 .. 3.5 (a CPU's measured peak may be beaten)
    "overhead": [0.0] + [1e-6 * 1.5**k for k in range(34)],  # 0, 1 us .. 0.9 s per block
    "intra_link": [0.01 * 1.4**k for k in range(20)],
    "inter_link": [0.01 * 1.4**k for k in range(20)],
    "dp_overlap": [k / 10 for k in range(10)],
    "latency": [0.25 * 1.6**k for k in range(20)],
    "collective_overhead": [0.0] + [1e-6 * 1.6**k for k in range(28)],
    "forward_overhead": [0.1 * 1.25**k for k in range(12)],
    "framework_collectives": [1.4**k for k in range(20)],  # 1 .. 600 times the link's time
    "memory": [0.05 * 1.4**k for k in range(12)],
    "matmul_half": [4.0 * 2**k for k in range(8)],
    "float8_gemm": [0.3 * 1.15**k for k in range(12)],  # 0.3 .. 1.4 of the default's relative rate
}


@dataclass(frozen=True)
class Observation:
    """One measured run: what the planner needs to predict its step time, and the time measured."""

    shape: ModelShape
    workload: Workload
    candidate: Candidate
    step_time: float
    """Seconds per optimizer step, measured."""
    peak: float | None = None
    """Peak FLOP/s per device the prediction uses (a CPU's measured one); None: the device's table row."""
    name: str = ""


def planner_record(
    shape: ModelShape, workload: Workload, candidate: Candidate, cluster: Cluster, peak: float | None
) -> dict[str, Any]:
    """The planner's inputs for one run, as plain JSON values (``results.json``'s ``planner.inputs``)."""
    device = {**asdict(cluster.device), "flops": dict(cluster.device.flops)}
    return {
        "shape": asdict(shape),
        "workload": asdict(workload),
        "candidate": asdict(candidate),
        "cluster": {
            "key": calibration_key(cluster),
            "name": cluster.name,
            "devices_per_node": cluster.devices_per_node,
            "nodes": cluster.nodes,
            "nics_per_node": cluster.nics_per_node,
            "device": device,
            "intra": cluster.intra.name,
            "inter": cluster.inter.name,
        },
        "peak_flops": peak,
    }


def cluster_from_record(record: Any, where: str) -> Cluster:
    """The cluster a :func:`planner_record` was made on (its device rebuilt field by field, its links by
    name from :data:`~lightning_scale.core.planner.cluster.LINKS`); ``ValueError`` naming ``where``."""
    if not isinstance(record, Mapping) or not isinstance(record.get("device"), Mapping):
        raise ValueError(f"{where}: planner.inputs.cluster is not a cluster record.")
    device = dict(record["device"])
    flops = device.pop("flops", {})
    if not isinstance(flops, Mapping) or not all(isinstance(k, str) and _number(v) for k, v in flops.items()):
        raise ValueError(f"{where}: planner.inputs.cluster.device.flops is not a mapping of dtypes to numbers.")
    price = device.pop("price_key", None)
    if price is not None and not isinstance(price, str):
        raise ValueError(f"{where}: planner.inputs.cluster.device.price_key={price!r} is not a string.")
    built = _typed(
        Device,
        device,
        f"{where}: planner.inputs.cluster.device",
        price_key=price,
        flops=tuple(sorted((k, float(v)) for k, v in flops.items())),
    )
    links = []
    for side in ("intra", "inter"):
        name = record.get(side)
        if name not in LINKS:
            raise ValueError(f"{where}: planner.inputs.cluster.{side}={name!r} is not a known link ({sorted(LINKS)}).")
        links.append(LINKS[name])
    sizes = {k: record.get(k) for k in ("devices_per_node", "nodes")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
        raise ValueError(f"{where}: planner.inputs.cluster sizes {sizes} are not integers.")
    name = record.get("name") if isinstance(record.get("name"), str) else "recorded"
    preset = next((c for c in CLUSTERS.values() if c.device.name == built.name), None)
    nics = record.get(
        "nics_per_node", preset.with_size(devices_per_node=sizes["devices_per_node"]).nics_per_node if preset else 1
    )
    if not isinstance(nics, int) or isinstance(nics, bool) or nics < 1:
        raise ValueError(f"{where}: planner.inputs.cluster.nics_per_node={nics!r} is not a positive integer.")
    return Cluster(
        built, sizes["devices_per_node"], sizes["nodes"], links[0], links[1], name, base_efficiency(built), nics
    )


def base_efficiency(device: Device) -> Efficiency:
    """What a device's system achieves before calibration: a CPU's defaults, a preset's, else the defaults."""
    if device.chip == "cpu":
        return CPU_EFFICIENCY
    return next((c.efficiency for c in CLUSTERS.values() if c.device.name == device.name), Efficiency())


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _typed(cls: type, doc: Any, where: str, **checked: Any) -> Any:
    """``cls(**doc, **checked)`` for a dataclass of plain fields, each value of ``doc`` checked against
    its field's type (``checked``: fields the caller checked)."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected an object, found {type(doc).__name__}.")
    known = {f.name: f for f in fields(cls) if f.name not in checked}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} for {cls.__name__}.")
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
    for key, value in doc.items():
        if value is None and str(known[key].type).endswith("| None"):
            continue
        kind = kinds.get(str(known[key].type).split(" ")[0])
        if kind is None or isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ValueError(f"{where}.{key}={value!r} is not a plain {known[key].type}.")
    try:
        return cls(**doc, **checked)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def observation_from_record(record: Mapping[str, Any], step_time: float, where: str, name: str = "") -> Observation:
    """An :class:`Observation` from a :func:`planner_record` and the measured step time; ``ValueError``
    naming ``where`` (the file) and the field when the record is not one."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: planner.inputs is not an object.")
    peak = record.get("peak_flops")
    if peak is not None and (not _number(peak) or peak <= 0):
        raise ValueError(f"{where}: planner.inputs.peak_flops={peak!r} is not a positive number.")
    if not _number(step_time) or not step_time > 0:
        raise ValueError(f"{where}: the measured step time {step_time!r} is not a positive number.")
    return Observation(
        _typed(ModelShape, record.get("shape"), f"{where}: planner.inputs.shape"),
        _typed(Workload, record.get("workload"), f"{where}: planner.inputs.workload"),
        _typed(Candidate, record.get("candidate"), f"{where}: planner.inputs.candidate"),
        float(step_time),
        None if peak is None else float(peak),
        name,
    )


def _log_errors(observations: Sequence[Observation], cluster: Cluster, efficiency: Efficiency) -> list[float]:
    return [
        math.log(
            estimate_time(o.shape, o.workload, o.candidate, cluster, efficiency, peak=o.peak).step_time / o.step_time
        )
        for o in observations
    ]


def _loss(observations: Sequence[Observation], cluster: Cluster, efficiency: Efficiency) -> float:
    return sum(e * e for e in _log_errors(observations, cluster, efficiency))


def fit_efficiency(
    observations: Sequence[Observation],
    cluster: Cluster,
    *,
    fit: Sequence[str] | None = None,
    base: Efficiency | None = None,
) -> Efficiency:
    """The factors ``fit`` (of :class:`Efficiency`; default :func:`default_fit`) that minimise the squared
    log errors of the predicted step times, the others kept from ``base`` (default: the cluster's): a grid
    over all of them, then Nelder and Mead's simplex from the best point. ``ValueError`` for no observations
    or an unknown factor."""
    if not observations:
        raise ValueError("fit_efficiency needs at least one measured run; found none.")
    fit = default_fit(cluster, observations) if fit is None else tuple(fit)
    unknown = sorted(set(fit) - set(_GRIDS))
    if unknown:
        raise ValueError(f"fit={unknown} are not factors calibration fits; valid: {sorted(_GRIDS)}.")
    start = base or cluster.efficiency
    best, best_loss = start, _loss(observations, cluster, start)
    coarse = [g[:: max(1, len(g) // 8)] for g in (_GRIDS[f] for f in fit)]  # about 8 values each
    for values in itertools.product(*coarse):
        trial = replace(start, **dict(zip(fit, values, strict=True)))
        loss = _loss(observations, cluster, trial)
        if loss < best_loss:
            best, best_loss = trial, loss
    best = _nelder_mead(observations, cluster, best, fit)
    errors = _log_errors(observations, cluster, best)
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    return replace(
        best,
        source=f"calibrated on {len(observations)} measured run(s) of {cluster.name} "
        f"({', '.join(fit)} fitted; rms log error {rms:.3f})",
    )


def _nelder_mead(
    observations: Sequence[Observation], cluster: Cluster, start: Efficiency, fit: Sequence[str]
) -> Efficiency:
    """Refine ``start`` by Nelder and Mead's simplex over the logarithms of the fitted factors (each
    stays positive; ``dp_overlap`` below 1)."""

    def at(point: Sequence[float]) -> Efficiency:
        # Each factor within its grid's physical range (framework_collectives >= 1: a collective is never
        # faster than the link it runs over, whose speed is measured); 0 stays reachable for additive terms.
        values = {
            f: min(max(math.exp(x), _GRIDS[f][0] if _GRIDS[f][0] > 0 else 0.0), _GRIDS[f][-1])
            for f, x in zip(fit, point, strict=True)
        }
        if "dp_overlap" in values:
            values["dp_overlap"] = min(values["dp_overlap"], 0.99)
        return replace(start, **values)

    def loss(point: Sequence[float]) -> float:
        return _loss(observations, cluster, at(point))

    origin = [math.log(max(getattr(start, f), _GRIDS[f][1] if _GRIDS[f][0] == 0 else 1e-12)) for f in fit]
    simplex = [origin] + [[x + (0.5 if i == k else 0.0) for i, x in enumerate(origin)] for k in range(len(fit))]
    scored = sorted(((loss(p), p) for p in simplex), key=lambda item: item[0])
    for _ in range(400 * len(fit)):
        (best, _), (worst_loss, worst) = scored[0], scored[-1]
        centre = [sum(p[i] for _, p in scored[:-1]) / len(fit) for i in range(len(fit))]
        reflected = [c + (c - w) for c, w in zip(centre, worst, strict=True)]
        r_loss = loss(reflected)
        if r_loss < best:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst, strict=True)]
            e_loss = loss(expanded)
            scored[-1] = (e_loss, expanded) if e_loss < r_loss else (r_loss, reflected)
        elif r_loss < scored[-2][0]:
            scored[-1] = (r_loss, reflected)
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst, strict=True)]
            c_loss = loss(contracted)
            if c_loss < worst_loss:
                scored[-1] = (c_loss, contracted)
            else:  # shrink towards the best point
                top = scored[0][1]
                scored = [scored[0]] + [
                    (loss(q), q)
                    for q in ([t + 0.5 * (x - t) for t, x in zip(top, p, strict=True)] for _, p in scored[1:])
                ]
        scored.sort(key=lambda item: item[0])
        if (
            scored[-1][0] - scored[0][0] < 1e-14
            and max(abs(a - b) for _, p in scored for a, b in zip(p, scored[0][1])) < 1e-6
        ):
            break
    return at(scored[0][1])


def calibration_key(cluster: Cluster) -> str:
    """What a calibration is stored under: the device and the two links' names."""
    return f"{cluster.device.name}|{cluster.intra.name}|{cluster.inter.name}"


def calibration_path(path: str | os.PathLike[str] | None = None) -> Path:
    if path is not None:
        return Path(path)
    env = os.environ.get(CALIBRATION_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lightning_scale" / "calibration.json"


def _read_store(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"The calibration file {path} is not readable JSON ({err}); remove it or recalibrate."
        ) from err
    if not isinstance(doc, dict):
        raise ValueError(
            f"The calibration file {path} does not hold an object of calibrations; remove it or recalibrate."
        )
    return doc


def save_calibration(
    cluster: Cluster,
    efficiency: Efficiency,
    observations: Iterable[Observation] = (),
    path: str | os.PathLike[str] | None = None,
) -> Path:
    """Store ``efficiency`` for ``cluster``'s system (atomically: a crash leaves the old file)."""
    target = calibration_path(path)
    store = _read_store(target)
    store[calibration_key(cluster)] = {
        **{f.name: getattr(efficiency, f.name) for f in fields(Efficiency)},
        "runs": [o.name for o in observations],
        "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(store, indent=1, sort_keys=True))
    os.replace(tmp, target)
    return target


def load_calibration(cluster: Cluster, path: str | os.PathLike[str] | None = None) -> Efficiency | None:
    """The stored :class:`Efficiency` of ``cluster``'s system, or None; ``ValueError`` for a stored entry
    that is not one (named with its file)."""
    target = calibration_path(path)
    entry = _read_store(target).get(calibration_key(cluster))
    if entry is None:
        return None
    where = f"{target}[{calibration_key(cluster)!r}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not an object; remove it or recalibrate.")
    stored = {k: v for k, v in entry.items() if k not in ("runs", "fitted_at")}
    checked = _typed(Efficiency, stored, where)
    # A factor the store lacks (stored before the planner had it) keeps the system's own default.
    return replace(base_efficiency(cluster.device), **{k: getattr(checked, k) for k in stored})


def calibrated(cluster: Cluster, path: str | os.PathLike[str] | None = None) -> Cluster:
    """``cluster`` with its stored calibration when there is one (its ``efficiency.source`` says so)."""
    found = load_calibration(cluster, path)
    return cluster if found is None else replace(cluster, efficiency=found)
