"""Peak dense FLOP/s per device, by chip and dtype, each row with its source and date. No Lightning.

Datasheets quote tensor-core figures "with sparsity" (2:4 structured), twice the dense rate that a
training matmul can reach; every number here is the **dense** one (the datasheet's halved where it
quotes sparse). A wrong peak silently gives a wrong MFU (other tables list the H200 at its sparse
2.0e15 bf16), so :func:`device_peak` returns ``None`` for a chip or dtype it does not know: the caller
warns and reports no MFU, or takes the user's override.

dtypes: ``"float64"``, ``"float32"``, ``"tf32"``, ``"bfloat16"``, ``"float16"``, ``"float8"``; each is
the rate of a *matmul* in that dtype. ``float64`` is the tensor-core (NVIDIA A100, H100, H200) or
matrix-core (AMD) rate where the chip has one (cuBLAS/rocBLAS DGEMM runs there), else the vector rate
(V100); chips whose FP64 is a small fraction of FP32 (L4, L40S, A10G, T4) have no ``float64`` entry.
``float32`` is an FP32 matmul with TF32 off: the non-tensor rate on NVIDIA, the FP32 matrix-core rate
on AMD. Per *torch device*: an MI250X is two devices (GCDs), each with half the card's rate.

Each :class:`Peak` has the URL of its source and the month (``YYYY-MM``) of that source's figures.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_scale.core.checks import check_positive_int

__all__ = [
    "PEAKS",
    "PEAK_FILE_ENV",
    "DTYPES",
    "Peak",
    "chip_of",
    "device_peak",
    "machine_key",
    "measured_peak",
    "processor",
    "recorded_peak",
]

DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")

T = 1e12


@dataclass(frozen=True)
class Peak:
    chip: str
    flops: dict[str, float]
    """Dense FLOP/s per dtype."""
    date: str
    """``YYYY-MM`` of the figures: the source's publication month, or where the document carries none,
    the month the chip was launched with them."""
    source: str
    """URL of the figures (and how they were derived from it: sparse halved, per GCD, ...)."""


_A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 40GB/80GB, SXM and PCIe alike; "
    "float64 = 'FP64 Tensor Core'; sparse halved)"
)
_H100 = (
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 datasheet; "
    "float64 = 'FP64 Tensor Core'; sparse halved; SXM float32/tf32/bf16/fp8 at the Hopper whitepaper's "
    "precision, as tabulated in https://glennklockwood.com/garden/processors/h100)"
)
_H200 = (
    "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446 (H200 datasheet, "
    "SC23; float64 = 'FP64 Tensor Core'; sparse halved)"
)
_VOLTA = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"

PEAKS: dict[str, Peak] = {
    p.chip: p
    for p in (
        Peak(
            "A100",
            {"float64": 19.5 * T, "float32": 19.5 * T, "tf32": 156 * T, "bfloat16": 312 * T, "float16": 312 * T},
            "2021-06",
            _A100,
        ),
        Peak(
            "H100 SXM",
            {
                "float64": 67 * T,
                "float32": 66.9 * T,
                "tf32": 494.7 * T,
                "bfloat16": 989.4 * T,
                "float16": 989.4 * T,
                "float8": 1978.9 * T,
            },
            "2023-03",
            _H100 + ", SXM column",
        ),
        Peak(
            "H100 PCIe",
            {
                "float64": 51 * T,
                "float32": 51.2 * T,
                "tf32": 378 * T,
                "bfloat16": 756 * T,
                "float16": 756 * T,
                "float8": 1513 * T,
            },
            "2023-03",
            _H100 + ", PCIe column",
        ),
        Peak(
            "H100 NVL",
            {
                "float64": 60 * T,
                "float32": 60 * T,
                "tf32": 417.5 * T,
                "bfloat16": 835.5 * T,
                "float16": 835.5 * T,
                "float8": 1670.5 * T,
            },
            "2023-03",
            _H100 + ", NVL column, per GPU",
        ),
        Peak(
            "H200 SXM",
            {
                "float64": 67 * T,
                "float32": 67 * T,
                "tf32": 494.7 * T,
                "bfloat16": 989.4 * T,
                "float16": 989.4 * T,
                "float8": 1978.9 * T,
            },
            "2023-11",
            _H200 + ", SXM column",
        ),
        Peak(
            "H200 NVL",
            {
                "float64": 60 * T,
                "float32": 60 * T,
                "tf32": 417.5 * T,
                "bfloat16": 835.5 * T,
                "float16": 835.5 * T,
                "float8": 1670.5 * T,
            },
            "2023-11",
            _H200 + ", NVL column",
        ),
        Peak(
            "B200",
            {"tf32": 1100 * T, "bfloat16": 2250 * T, "float16": 2250 * T, "float8": 4500 * T},
            "2024-03",
            "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU; sparse halved)",
        ),
        Peak(
            "GB200",
            {"tf32": 1250 * T, "bfloat16": 2500 * T, "float16": 2500 * T, "float8": 5000 * T},
            "2024-03",
            "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (NVL72 totals / 72 GPUs; sparse halved)",
        ),
        Peak(
            "L4",
            {"float32": 30.3 * T, "tf32": 60 * T, "bfloat16": 121 * T, "float16": 121 * T, "float8": 242.5 * T},
            "2023-03",
            "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet (sparse halved)",
        ),
        Peak(
            "L40S",
            {"float32": 91.6 * T, "tf32": 183 * T, "bfloat16": 362.05 * T, "float16": 362.05 * T, "float8": 733 * T},
            "2023-08",
            "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413 (sparse halved)",
        ),
        # Not the A10's figures (31.2/62.5/125): the A10G has 80 SMs at a higher clock but half-rate
        # 16-bit tensor math with FP32 accumulation, so its dense bf16/fp16 peak is 70, not 125.
        Peak(
            "A10G",
            {"float32": 35 * T, "tf32": 35 * T, "bfloat16": 70 * T, "float16": 70 * T},
            "2022-02",
            "https://d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf "
            "(NVIDIA/AWS A10G datasheet of 2022-02-17, as quoted: FP32 35, TF32 35, FP16 70 TFLOPS; the same "
            "figures in https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/; a bf16 matmul "
            "measured at 69.5 TFLOP/s on an A10G in https://github.com/zzc0721/torch-performance-test-data/issues/126, "
            "so 70 is the dense rate)",
        ),
        Peak(
            "V100 SXM2",
            {"float64": 7.8 * T, "float32": 15.7 * T, "float16": 125 * T},
            "2020-01",
            _VOLTA + " (no FP64 tensor cores: float64 is the vector rate)",
        ),
        Peak(
            "V100 PCIe",
            {"float64": 7 * T, "float32": 14 * T, "float16": 112 * T},
            "2020-01",
            _VOLTA + " (no FP64 tensor cores: float64 is the vector rate)",
        ),
        Peak(
            "T4",
            {"float32": 8.1 * T, "float16": 65 * T},
            "2018-09",
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
        ),
        Peak(
            "MI250X",
            {"float64": 47.85 * T, "float32": 47.85 * T, "bfloat16": 191.5 * T, "float16": 191.5 * T},
            "2021-11",
            "https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html (matrix-core "
            "rates: FP64/FP32 matrix 95.7, FP16/BF16 383 TFLOPS per card; per GCD, half the card)",
        ),
        Peak(
            "MI300X",
            {
                "float64": 163.4 * T,
                "float32": 163.4 * T,
                "tf32": 653.7 * T,
                "bfloat16": 1307.4 * T,
                "float16": 1307.4 * T,
                "float8": 2614.9 * T,
            },
            "2023-12",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (dense; float64 = "
            "'FP64 Matrix' 163.4, the vector rate is 81.7)",
        ),
    )
}

# Device names (torch.cuda.get_device_name) to chips, most specific first.
_NAMES: tuple[tuple[str, str], ...] = (
    (r"gb200", "GB200"),
    (r"b200", "B200"),
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200 SXM"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"a100", "A100"),
    (r"l40s", "L40S"),
    (r"\bl4\b", "L4"),
    (r"a10g", "A10G"),
    (r"v100.*pcie", "V100 PCIe"),
    (r"v100", "V100 SXM2"),
    (r"\bt4\b", "T4"),
    (r"mi300x", "MI300X"),
    (r"mi250x", "MI250X"),
)


def chip_of(device_name: str) -> str | None:
    """The chip of a device name (``"NVIDIA H100 80GB HBM3"`` -> ``"H100 SXM"``); None if unknown."""
    name = device_name.lower()
    return next((chip for pattern, chip in _NAMES if re.search(pattern, name)), None)


def device_peak(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of that name computing in ``dtype`` (None: not in the table)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}.")
    chip = chip_of(device_name)
    return None if chip is None else PEAKS[chip].flops.get(dtype)


_TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "tf32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MEASURED: dict[tuple[str, str, int, int], float] = {}
_SMALLEST = 128

PEAK_FILE_ENV = "LIGHTNING_SCALE_PEAK_FILE"
"""A JSON file of measured CPU peaks by machine (:func:`recorded_peak`); a sweep points its jobs at
its study's ``peaks.json``."""


def measured_peak(
    dtype: str, device: str = "cpu", *, size: int = 1024, repeats: int = 7, seconds: float = 0.05
) -> float:
    """FLOP/s of ``size`` x ``size`` matmuls in ``dtype`` on ``device``: the median of ``repeats``
    timings of about ``seconds`` each, after a warm-up, so one busy moment does not set it (a single
    short timing of a small matmul made MFU exceed 1 on a loaded machine). Where one matmul of that
    size takes longer than ``seconds`` (a dtype without fast kernels on this device), the size is
    halved until it does not (down to 128), so measuring never takes more than about a second. The peak for devices
    without a datasheet figure (CPUs), at this process's thread count; measured once per (device,
    dtype, size, threads) in a process. See :func:`recorded_peak` to measure once per machine."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} cannot be measured; one of {tuple(_TORCH_DTYPES)}.")
    check_positive_int("size", size)
    check_positive_int("repeats", repeats)
    key = (device, dtype, size, torch.get_num_threads())
    if key not in _MEASURED:
        while True:
            a = torch.randn(size, size, device=device).to(_TORCH_DTYPES[dtype])
            b = torch.randn(size, size, device=device).to(_TORCH_DTYPES[dtype])
            torch.mm(a, b)  # warm-up: kernels chosen, threads started
            start = time.perf_counter()
            torch.mm(a, b)
            if time.perf_counter() - start <= seconds or size <= _SMALLEST:
                break
            # A dtype with no fast kernel here (float16 on most CPUs: 1.7 s per 1024^2 matmul, where
            # bfloat16 takes 0.01 s) would take minutes at this size: measure a smaller matmul.
            size //= 2
        rates = []
        for _ in range(repeats):
            calls, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds or calls < 2:
                torch.mm(a, b)
                calls += 1
            rates.append(2 * size**3 * calls / elapsed)
        _MEASURED[key] = statistics.median(rates)
    return _MEASURED[key]


def processor() -> str:
    """This host's processor model (``/proc/cpuinfo``'s model name, else what ``platform`` says)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        return model


def machine_key(dtype: str, processes_per_machine: int) -> str:
    """What a measured CPU peak depends on: host, processor model, threads per process, processes
    sharing the machine, and dtype."""
    return f"{socket.gethostname()}|{processor()}|threads={torch.get_num_threads()}|processes={processes_per_machine}|{dtype}"


def _read_peak(path: Path, key: str) -> float | None:
    try:
        record = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None  # absent or unreadable: measured (again) and rewritten
    value = record.get("flops") if isinstance(record, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def recorded_peak(path: str | os.PathLike[str] | None, key: str, measure: Callable[[], float]) -> tuple[float, bool]:
    """The peak recorded under ``key`` in the JSON file ``path``, else ``measure()`` recorded there;
    ``(peak, measured_now)``. ``measure`` runs outside the file's lock, so the processes sharing a
    machine measure at once, as they will train; the first figure recorded is then everyone's, and
    the jobs of a study share one denominator for MFU. ``path=None``: measured, nothing recorded."""
    if path is None:
        return measure(), True
    path = Path(path)
    found = _read_peak(path, key)
    if found is not None:
        return found, False
    peak = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _read_peak(path, key)
        if found is not None:
            return found, False
        try:
            records = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            records = {}
        if not isinstance(records, dict):
            records = {}
        records[key] = {"flops": peak, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(records, indent=2))
        os.replace(tmp, path)
        return peak, True
