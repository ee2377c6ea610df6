"""The machines a plan is made for: a device type, devices per node, nodes, and the links between them.

Each figure carries its source. A link's bandwidth is *per port and per direction*: within a node what
one device can push while every device of its group does the same (NVLink, PCIe, gloo's loopback),
between nodes what one NIC carries. A node has :attr:`Cluster.nics_per_node` NICs: NCCL drives all of
them at once (one channel per NIC; the ring or tree crosses between nodes on every NIC in parallel),
so a collective's group that leaves the node is limited by its members' share of the node's NICs, not
by one NIC (:func:`~lightning_scale.core.planner.collectives.collective_time`). Achieved bandwidth is
lower than these nominal figures; the planner multiplies them by an efficiency
(:class:`~lightning_scale.core.planner.step_time.Efficiency`) that calibration fits per link class.

No Lightning; the peak FLOP/s come from :mod:`lightning_scale.core.telemetry.peaks`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, replace

import torch

from lightning_scale.core.checks import check_positive_int, check_positive_number, format_choices
from lightning_scale.core.telemetry.cost import PRICES as PRICES_BY_KEY
from lightning_scale.core.telemetry.cost import Price
from lightning_scale.core.telemetry.peaks import PEAKS, chip_of, measured_peak, processor

__all__ = [
    "A100_FLASH",
    "CLUSTERS",
    "DEVICES",
    "HOPPER",
    "HOST_LINK",
    "LINKS",
    "Cluster",
    "Device",
    "Efficiency",
    "Link",
    "cluster",
    "cpu_cluster",
    "local_cluster",
]

GiB = 2**30
GB = 1e9


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float
    """Bytes/s per device and direction (nominal)."""
    latency: float
    """Seconds per message step of a collective."""
    source: str


@dataclass(frozen=True)
class Device:
    name: str
    chip: str
    """The row of :data:`~lightning_scale.core.telemetry.peaks.PEAKS` (``"cpu"``: measured, no row)."""
    memory: float
    """Bytes a program can allocate (what ``torch.cuda.get_device_properties().total_memory`` reports)."""
    memory_bandwidth: float
    """Bytes/s of device memory (HBM/GDDR): the optimizer step and other elementwise work run at this rate."""
    price_key: str | None
    """The row of :data:`~lightning_scale.core.telemetry.cost.PRICES` (None: no price)."""
    source: str
    flops: tuple[tuple[str, float], ...] = ()
    """Measured dense FLOP/s per dtype, ahead of the table (a CPU's: it has no datasheet row)."""
    slowdown: float = 1.0
    """Processes' threads per core (CPU processes outnumbering the cores): their framework work runs this
    many times slower, as their matmuls do (which the measured ``flops`` already show)."""

    def peak(self, dtype: str) -> float | None:
        """Dense peak FLOP/s of a matmul in ``dtype`` (None: neither measured nor in the table)."""
        measured = dict(self.flops).get(dtype)
        if measured is not None:
            return measured
        row = PEAKS.get(self.chip)
        return None if row is None else row.flops.get(dtype)


_NV = "https://www.nvidia.com/en-us/data-center/"
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "H100 SXM 80GB",
            "H100 SXM",
            79.6 * GiB,
            3.35e12,
            "H100 SXM",
            _NV + "h100/ (80 GB HBM3 at 3.35 TB/s; 79.6 GiB as torch reports it)",
        ),
        Device(
            "H200 SXM 141GB",
            "H200 SXM",
            139.8 * GiB,
            4.8e12,
            "H200 SXM",
            _NV + "h200/ (141 GB HBM3e at 4.8 TB/s; 139.8 GiB as torch reports it)",
        ),
        Device("A100 SXM 80GB", "A100", 79.2 * GiB, 2.039e12, "A100 80GB", _NV + "a100/ (80 GB HBM2e at 2,039 GB/s)"),
        Device("A100 SXM 40GB", "A100", 39.4 * GiB, 1.555e12, "A100 40GB", _NV + "a100/ (40 GB HBM2 at 1,555 GB/s)"),
        Device("L4", "L4", 22.0 * GiB, 300e9, "L4", _NV + "l4/ (24 GB GDDR6 at 300 GB/s)"),
        Device("L40S", "L40S", 44.4 * GiB, 864e9, "L40S", _NV + "l40s/ (48 GB GDDR6 at 864 GB/s)"),
    )
}

LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink4", 450 * GB, 5e-6, _NV + "nvlink/ (NVLink 4: 900 GB/s per GPU, both directions)"),
        Link("nvlink3", 300 * GB, 5e-6, _NV + "nvlink/ (NVLink 3: 600 GB/s per GPU, both directions)"),
        Link(
            "ib-ndr",
            50 * GB,
            10e-6,
            "https://www.nvidia.com/en-us/networking/infiniband/ (NDR 400 Gb/s per HCA; a DGX H100 has 8, one per GPU)",
        ),
        Link(
            "ib-hdr",
            25 * GB,
            10e-6,
            "https://www.nvidia.com/en-us/networking/infiniband/ (HDR 200 Gb/s per HCA; a DGX A100 has 8, one per GPU)",
        ),
        Link("pcie4", 25 * GB, 10e-6, "PCIe 4.0 x16: 32 GB/s per direction nominal, about 25 GB/s through the host"),
        Link("ethernet-100g", 12.5 * GB, 30e-6, "100 Gb/s Ethernet, one port per node shared by its GPUs"),
        Link(
            "gloo-loopback",
            0.5 * GB,
            500e-6,
            "gloo over TCP on one host, measured (torch 2.13, two processes of "
            "one thread on a 2-core AMD EPYC host at load average 1, 2026-12-04): all-gathers and reduce-scatters of 1 to 16 MB "
            "at 0.3 to 0.6 GB/s per device, all-reduces at about 1 GB/s, a 4 kB collective in 0.5 ms",
        ),
        Link("ethernet-10g", 1.25 * GB, 100e-6, "10 Gb/s Ethernet between CPU hosts"),
    )
}


HOST_LINK = Link(
    "pcie5-host",
    55 * GB,
    10e-6,
    "PCIe Gen5 x16 between a GPU and pinned host memory: 64 GB/s per direction nominal, about 55 GB/s achieved "
    "(an assumed default: H100/H200 SXM hosts; a PCIe 4 host reaches about 25 GB/s)",
)


@dataclass(frozen=True)
class Efficiency:
    """The achieved fractions of nominal rates, per system (device and interconnect)."""

    compute: float = 0.7
    """Fraction of the peak FLOP/s a large matmul (GEMM) reaches in a training step."""
    matmul_half: float = 128.0
    """The smallest GEMM dimension at which a matmul reaches half of ``compute``'s rate."""
    attention: float = 0.0
    """Fraction of the peak FLOP/s a fused attention kernel (flash, cuDNN or memory-efficient SDPA)
    reaches at long sequences, on the FLOPs it executes: under a causal mask it skips the masked half,
    so it executes half of the ``12 H Q T`` per token that MFU counts. 0: no fused kernel, the full
    product runs as plain matmuls at the GEMM rate (Megatron-LM in 2021; a CPU's)."""
    attention_half: float = 0.0
    """The sequence length at which attention reaches half of ``attention``'s rate (short sequences leave
    the kernel's tiles and the GPU's SMs part idle); 0: the same rate at every length."""
    elementwise: float = 0.0
    """How many times the eager operators' traffic (:meth:`~lightning_scale.core.planner.shape.ModelShape.
    elementwise_bytes_per_token`: norms, residual adds, activations, rotary, head-major copies, the loss's
    softmax) a step moves through device memory: 1 for eager PyTorch, less where a compiler fuses them;
    0: not modelled (a CPU's calibrated ``overhead`` carries it)."""
    loss_traffic: float | None = None
    """How many times eager PyTorch's cross-entropy traffic (:meth:`~lightning_scale.core.planner.shape.
    ModelShape.loss_bytes_per_token`) the loss moves, where it differs from ``elementwise`` (a framework
    that fuses the blocks' operators but not the loss's); None: ``elementwise``."""
    intra_link: float = 0.7
    inter_link: float = 0.7
    latency: float = 1.0
    """Achieved latency of a collective's step as a multiple of the link's nominal one."""
    dp_overlap: float = 0.8
    """Share of the data-parallel communication hidden behind the compute it can overlap."""
    tp_overlap: float = 0.0
    """Share of the tensor-parallel communication hidden behind the GEMMs around it (Transformer Engine's
    userbuffer overlap, torch's async TP); 0 for DTensor's plain collectives, which run in turn."""
    pipeline_scatter_gather: bool = False
    """Pipeline sends split over the tensor-parallel ranks (each sends ``1 / tp`` of the activation, the
    receivers all-gather it over the intra-node link: Megatron-LM's scatter/gather optimisation, Narayanan
    et al. 2021, section 4.1); False: every tensor-parallel rank sends the whole activation (torch's
    pipelining). Under sequence parallelism the activation is split anyway."""
    memory: float = 0.7
    """Fraction of the memory bandwidth elementwise kernels reach (the optimizer update, ``elementwise``)."""
    offload_overlap: float = 0.0
    """Share of activation offloading's host transfers hidden behind compute: 0, as torch's ``save_on_cpu``
    copies on the compute stream (pinned and non-blocking for the host, but in turn with the kernels)."""
    float8_gemm: float = 0.88
    """A float8 GEMM's share of the float8 peak relative to ``compute``'s of the bf16 peak: ml-engineering's
    maximum achievable matmul FLOPS on H100 SXM, 1402.6 of 1979 TFLOP/s in float8 (0.709) against 794.5 of
    989 in bf16 (0.803)."""
    overhead: float = 0.0
    """Seconds per block and micro-batch, forward and backward, that are neither FLOPs nor bytes: kernel
    launches and the framework's Python (tens of microseconds a block on a GPU hidden behind its
    kernels; on a CPU, where every operator runs in the calling thread, a large share of small models' time)."""
    forward_overhead: float = 0.5
    """The forward's share of ``overhead``, which a block recomputed under activation checkpointing pays
    again: its operators run once more from Python (the backward's run in autograd's C++ engine)."""
    framework_collectives: float = 1.0
    """How many times the link's time (bytes and latency alike) a collective issued from Python by DTensor
    (tensor parallelism) or FSDP2 (its gathers and reduce-scatters) takes: they allocate their outputs and
    copy and redistribute buffers around the transfer, where DDP reduces its flat buckets from C++ and the
    pipeline sends the activation as it is. About 1 for large NCCL collectives; several times the link on
    a CPU, where those copies run on the cores the processes share (calibration fits it there)."""
    collective_overhead: float = 0.0
    """Seconds per collective issued from Python by DTensor (tensor parallelism) or FSDP (its gathers and
    reduce-scatters), beyond the link's latency: redistribution, copy-in and copy-out. Not paid by
    DDP's buckets or the pipeline's sends, which torch's C++ issues."""
    source: str = "defaults (not calibrated)"

    def link(self, cluster: Cluster, link: Link) -> float:
        """Achieved bytes/s per device of ``link``; a CPU's collectives copy on the cores its processes
        share, so they slow down with the matmuls (the device's ``slowdown``)."""
        return (
            link.bandwidth * (self.intra_link if link is cluster.intra else self.inter_link) / cluster.device.slowdown
        )


A100_MEGATRON = Efficiency(
    compute=0.6,
    matmul_half=64.0,
    intra_link=0.78,
    inter_link=0.78,
    dp_overlap=0.0,
    pipeline_scatter_gather=True,
    source="A100 defaults (Megatron-LM), not calibrated: links at nccl-tests' 8 x A100 NVLink all-reduce (234.9 "
    "of 300 GB/s); pipeline sends scattered over the tensor-parallel ranks (Narayanan et al. 2021, 4.1); no "
    "data-parallel overlap "
    "(Megatron-LM reduced its gradients after the backward until 2023); compute and matmul_half fitted on a grid "
    "to the 10 rows of Narayanan et al. 2021, Table 1 (lightning_scale.core.planner.published): Megatron-LM on "
    "DGX A100",
)


@dataclass(frozen=True)
class Cluster:
    device: Device
    devices_per_node: int
    nodes: int
    intra: Link
    """Between the devices of one node."""
    inter: Link
    """Between nodes."""
    name: str = "custom"
    efficiency: Efficiency = field(default_factory=Efficiency)
    """What this system achieves of its nominal rates (defaults until calibrated)."""
    nics_per_node: int = 1
    """The node's ports on the ``inter`` link (a DGX: one NIC per GPU; Ethernet hosts: usually one)."""
    price: Price | None = None
    """The offer a plan prices with (None: the device's default offer in the price table)."""
    host: Link = HOST_LINK
    """Between a device and its host's (pinned) memory: activation offloading's copies."""

    def __post_init__(self) -> None:
        check_positive_int("devices_per_node", self.devices_per_node, fix="It is the devices of one node.")
        check_positive_int("nodes", self.nodes, fix="It is the number of nodes.")
        check_positive_int(
            "nics_per_node", self.nics_per_node, fix="It is the NICs of one node on the inter-node link."
        )
        check_positive_number("device memory", self.device.memory)

    def device_price(self) -> Price | None:
        """The price a plan uses: :attr:`price`, else the table's default for the device (None: no row)."""
        return self.price or PRICES_BY_KEY.get(self.device.price_key or "")

    @property
    def nic_share(self) -> float:
        """Nominal inter-node bytes/s per device: the node's NICs shared by its devices."""
        return self.inter.bandwidth * self.nics_per_node / self.devices_per_node

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    def link(self, group_span: int) -> Link:
        """The link a group of consecutive ranks spanning ``group_span`` devices talks over."""
        return self.intra if group_span <= self.devices_per_node else self.inter

    def with_size(self, *, nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
        """The same system with other sizes; a node of more or fewer devices keeps each device's share of
        the NICs (a DGX's one per GPU), at least one per node."""
        per_node = devices_per_node or self.devices_per_node
        nics = max(1, self.nics_per_node * per_node // self.devices_per_node)
        return replace(self, nodes=nodes or self.nodes, devices_per_node=per_node, nics_per_node=nics)


HOPPER = Efficiency(
    compute=0.65,
    matmul_half=256.0,
    attention=0.343,
    attention_half=576.0,
    elementwise=1.0,
    memory=0.8,
    intra_link=0.7,
    inter_link=0.85,
    source="H100/H200 defaults, not calibrated: attention from FlashAttention-2 on H100 (causal, head dim 128, "
    "forward and backward: 265 TFLOP/s at 2k, 328 at 16k); inter-node from nccl-tests (~350 GB/s bus bandwidth "
    "on nodes of 8 H200s with 8 NDR NICs); GEMM size from XLA's H100 table; the GEMM rate (0.65 of the peak) "
    "fitted to Megatron-Core's H100 weak-scaling table (docs/planner.md, Constants)",
)
"""H100/H200 systems before calibration."""
A100_FLASH = dataclasses.replace(
    A100_MEGATRON,
    attention=0.625,
    attention_half=530.0,
    elementwise=1.0,
    memory=0.8,
    dp_overlap=Efficiency.dp_overlap,
    pipeline_scatter_gather=False,
    source="A100 defaults (flash attention), not calibrated: the GEMM rate and size of A100_MEGATRON (fitted on "
    "Narayanan et al. 2021), links at nccl-tests' 8 x A100 NVLink all-reduce (234.9 of 300 GB/s); attention from "
    "FlashAttention-2 on A100 (causal, head dim 128, forward and backward: 155 TFLOP/s at 2k, 189 at 16k), eager "
    "elementwise traffic at 0.8 of HBM; data-parallel communication overlapped as DDP and FSDP2 do; whole "
    "activations sent between pipeline stages, as torch's pipelining does",
)
"""A100 systems: Megatron's fitted GEMM and link constants, attention and eager elementwise traffic from kernel
benchmarks."""


def _preset(
    name: str, device: str, per_node: int, intra: str, inter: str, efficiency: Efficiency | None = None, nics: int = 1
) -> Cluster:
    return Cluster(DEVICES[device], per_node, 1, LINKS[intra], LINKS[inter], name, efficiency or Efficiency(), nics)


CLUSTERS: dict[str, Cluster] = {
    c.name: c
    for c in (
        _preset("h100-sxm", "H100 SXM 80GB", 8, "nvlink4", "ib-ndr", HOPPER, nics=8),
        _preset("h200-sxm", "H200 SXM 141GB", 8, "nvlink4", "ib-ndr", HOPPER, nics=8),
        _preset("a100-sxm-80", "A100 SXM 80GB", 8, "nvlink3", "ib-hdr", A100_FLASH, nics=8),
        _preset("a100-sxm-40", "A100 SXM 40GB", 8, "nvlink3", "ib-hdr", A100_FLASH, nics=8),
        _preset("l4-pcie", "L4", 8, "pcie4", "ethernet-100g"),
        _preset("l40s-pcie", "L40S", 8, "pcie4", "ethernet-100g"),
    )
}
"""One node of each usual system; :func:`cluster` sets the node count."""


_LINKS_OF_CHIP = {
    "H100 SXM": ("nvlink4", "ib-ndr", 8),
    "H200 SXM": ("nvlink4", "ib-ndr", 8),
    "A100": ("nvlink3", "ib-hdr", 8),
}
"""The links (and NICs per node) of the usual systems built on a chip; any other chip: PCIe within a node,
one Ethernet port between."""


def local_cluster(
    device_type: str,
    *,
    devices_per_node: int,
    nodes: int = 1,
    device_name: str | None = None,
    device_memory: float | None = None,
    peak_flops: dict[str, float] | None = None,
) -> Cluster:
    """The cluster a run is on, from what its processes see: a CUDA device's name and memory (its chip's
    row of :data:`DEVICES` nearest that memory, the links of that chip's usual system) or this CPU host
    (:func:`cpu_cluster`).
    Raises ``ValueError`` for a device no row describes, naming the override."""
    if device_type == "cpu":
        return cpu_cluster(devices_per_node=devices_per_node, nodes=nodes, peak_flops=peak_flops or {})
    chip = chip_of(device_name or "")
    rows = [d for d in DEVICES.values() if d.chip == chip]
    if not rows:
        raise ValueError(
            f"The planner has no device row for {device_name!r} ({device_type}); known: {format_choices(DEVICES)}. "
            "Name the cluster instead (HybridParallelStrategy(layout='auto', cluster='h100-sxm'), or plan with "
            "lightning-scale-plan cluster=<preset>)."
        )
    device = min(rows, key=lambda d: abs(d.memory - (device_memory or d.memory)))  # a chip sold in two sizes
    intra, inter, nics = _LINKS_OF_CHIP.get(chip or "", ("pcie4", "ethernet-100g", 1))
    preset = next((c for c in CLUSTERS.values() if c.device is device), None)
    efficiency = preset.efficiency if preset is not None else Efficiency()
    if device_memory:
        device = replace(device, memory=float(device_memory))
    return Cluster(
        device,
        devices_per_node,
        nodes,
        LINKS[intra],
        LINKS[inter],
        f"local-{chip}",
        efficiency,
        max(1, nics * devices_per_node // 8) if nics > 1 else 1,
    )


def _host_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return kib * 1024.0
    except (OSError, StopIteration, ValueError):
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


CPU_EFFICIENCY = Efficiency(
    compute=1.0,
    matmul_half=16.0,
    intra_link=1.0,
    inter_link=1.0,
    dp_overlap=0.0,
    memory=1.0,
    overhead=0.0,
    source="CPU defaults, not calibrated: the measured matmul rate, gloo's measured bandwidth and latency, no overlap (gloo runs in "
    "the training thread's turn); calibrate to fit this host",
)


def _threads_per_core(processes: int) -> float:
    """How many of ``processes`` processes' threads share each core of this host (at least 1)."""
    return max(1.0, processes * torch.get_num_threads() / (os.cpu_count() or 1))


def cpu_peaks(processes: int, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict[str, float]:
    """Each of ``processes`` processes' matmul rate on this host: one process's measured rate
    (:func:`~lightning_scale.core.telemetry.peaks.measured_peak`, at its thread count) times its share of
    the cores when the processes' threads outnumber them."""
    return {dtype: measured_peak(dtype) / _threads_per_core(processes) for dtype in dtypes}


def cpu_cluster(*, devices_per_node: int, nodes: int = 1, peak_flops: dict[str, float] | None = None) -> Cluster:
    """This host's CPUs as ``devices_per_node`` processes: each holds an equal share of the host's memory;
    ``peak_flops`` is each process's matmul rate per dtype while all of them run (what
    ``train/peak_flops_measured`` logs; default :func:`cpu_peaks`); gloo over loopback within the host,
    Ethernet between hosts. The device is named after the processor, so calibrations are per model."""
    check_positive_int("devices_per_node", devices_per_node, fix="It is the processes of one host.")
    if peak_flops is None:
        peak_flops = cpu_peaks(devices_per_node)
    memory = _host_memory() / devices_per_node
    slowdown = _threads_per_core(devices_per_node)
    device = Device(
        f"CPU ({processor()})",
        "cpu",
        memory,
        10 * GB,
        None,
        "this host: /proc/meminfo shared by its processes; 10 GB/s of memory bandwidth as an order of magnitude",
        tuple(sorted(peak_flops.items())),
        slowdown,
    )
    return Cluster(
        device, devices_per_node, nodes, LINKS["gloo-loopback"], LINKS["ethernet-10g"], "cpu", CPU_EFFICIENCY
    )


def cluster(name: str, *, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
    """A preset with ``nodes`` nodes (and optionally another number of devices per node); ``"cpu"``: this
    host (:func:`cpu_cluster`, its peak measured now)."""
    if name == "cpu":
        return cpu_cluster(devices_per_node=devices_per_node or 1, nodes=nodes)
    if name not in CLUSTERS:
        raise ValueError(
            f"Unknown cluster {name!r}. Presets: {format_choices(CLUSTERS)}, or 'cpu' (this host); or build a Cluster from a Device "
            f"(lightning_scale.core.planner.cluster.DEVICES) and two Links."
        )
    check_positive_int("nodes", nodes, fix="It is the number of nodes.")
    return CLUSTERS[name].with_size(nodes=nodes, devices_per_node=devices_per_node)
