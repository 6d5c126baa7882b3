"""Named clusters: DGX A100/H100/H200/B200, GB200 NVL72, the NEST paper's H100 spine-leaf and TPUv4 fat tree, and the
CPU test machine. Each builder takes a device count; :meth:`Cluster.preset` looks them up in
:data:`PRESETS`. Hardware figures are from the datasheets and the NEST paper, as each builder's
docstring says (see docs/cluster_format.md)."""

from __future__ import annotations

from typing import List, Tuple

from nest_fx.cluster.spec import PRESETS, Cluster, DeviceSpec, NetworkLevel

GiB = 2**30

NODE, RACK = 8, 32  # NEST's hierarchy: 8 devices per node, 4 nodes per rack

# The ring formulas (hierarchical_collectives) take the bus bandwidth a level's collectives reach
# (nccl-tests' busbw), so the DGX presets carry NCCL's achieved figures, not the link rates; each
# as NCCL's maintainers state it on the NCCL / nccl-tests issue trackers:
# NVLink4 through NVSwitch (DGX H100 / H200), link rate 450 GB/s per GPU per direction: "360 GB/s
# is exactly what we'd expect on H100" (all-gather and all-reduce on 8 GPUs; nccl-tests #326, 2025).
H100_NVLINK_BUS_BANDWIDTH = 360e9
# NVLink3 (DGX A100), link rate 300 GB/s: 12 links of ~20 GB/s effective, "~230 GB/s" (nccl-tests #149, 2023).
A100_NVLINK_BUS_BANDWIDTH = 230e9
# One NDR 400 Gb/s InfiniBand NIC per GPU (DGX H100 / H200; ConnectX-7 on B200 / GB200), line rate
# 50 GB/s: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (nccl-tests #290, 2025): the middle.
NDR_400G_BUS_BANDWIDTH = 47e9
# One HDR 200 Gb/s NIC per GPU (DGX A100), line rate 25 GB/s: "24GB/s inter-node" (nccl #412, 2023).
HDR_200G_BUS_BANDWIDTH = 24e9
# NVLink5 (B200, GB200 NVL72) doubles NVLink4's link rate (900 GB/s per GPU per direction); no
# NCCL figure is used for it, so it is assumed to reach NVLink4's share (0.8).
NVLINK5_BUS_BANDWIDTH = 900e9 * H100_NVLINK_BUS_BANDWIDTH / 450e9


def _gpu_levels(
    devices: int, node: Tuple[float, float], rack: Tuple[float, float], spine: Tuple[float, float]
) -> List[NetworkLevel]:
    """node (8) / rack (32) / spine (devices rounded up to 32; omitted when <= 32) levels.

    Each tuple is (bandwidth bytes/s per device per direction, latency s). Latencies are
    assumptions of the usual order: ~5 us for an NVLink/intra-node message, ~10 us for one
    InfiniBand hop through a leaf switch, ~15 us through the spine.
    """
    levels = [NetworkLevel("node", NODE, *node), NetworkLevel("rack", RACK, *rack)]
    spine_size = max(-(-devices // RACK) * RACK, RACK)
    if spine_size > RACK:
        levels.append(NetworkLevel("spine", spine_size, *spine))
    return levels


def _nics(bus_bandwidth: float) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """The rack and spine levels of a non-blocking fat tree with one NIC per GPU: the NIC's bus
    bandwidth at both, 10 us through a leaf, 15 us through the spine."""
    return (bus_bandwidth, 1e-5), (bus_bandwidth, 1.5e-5)


A100_80GB = DeviceSpec(
    # A100-SXM4-80GB datasheet: dense tensor-core peaks; "80GB" is taken as 80 GiB of HBM2e.
    name="A100-SXM4-80GB",
    memory_bytes=80 * GiB,
    peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    mem_bandwidth=2.039e12,
)
H100_SXM = DeviceSpec(
    # H100-SXM5 datasheet, dense (no sparsity) peaks; 80 GiB HBM3 at 3.35 TB/s.
    name="H100-SXM5-80GB",
    memory_bytes=80 * GiB,
    peak_flops={"fp32": 67e12, "tf32": 494.5e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
    mem_bandwidth=3.35e12,
)
H200_SXM = DeviceSpec(
    # H200-SXM datasheet: the H100's compute (dense peaks), 141 GB HBM3e at 4.8 TB/s; memory as
    # nvidia-smi reports it on the card (143,771 MiB: results/gpu/bench_gpu_kernels_h200.json's run).
    name="H200-SXM-141GB",
    memory_bytes=140 * GiB,
    peak_flops=dict(H100_SXM.peak_flops),
    mem_bandwidth=4.8e12,
)
B200 = DeviceSpec(
    # DGX B200 datasheet, per GPU (system figures / 8), dense peaks (half the sparse figures):
    # FP8 72 PFLOP/s sparse -> 4.5 PFLOP/s dense, BF16/FP16 2.25 PFLOP/s, TF32 1.1 PFLOP/s,
    # FP32 75 TFLOP/s; 1,440 GB HBM3e -> 180 GB at 8 TB/s (64 TB/s per system).
    name="B200-SXM-180GB",
    memory_bytes=180e9,
    peak_flops={"fp32": 75e12, "tf32": 1.1e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp8": 4.5e15},
    mem_bandwidth=8e12,
)
GB200 = DeviceSpec(
    # GB200 NVL72 datasheet, per GPU (rack figures / 72), dense peaks (half the sparse figures):
    # FP8 720 PFLOP/s sparse -> 5 PFLOP/s dense, BF16/FP16 360 -> 2.5 PFLOP/s, TF32 180 -> 1.25
    # PFLOP/s, FP32 5,760 TFLOP/s -> 80 TFLOP/s; 13.4 TB HBM3e -> 186 GB at 8 TB/s (576 TB/s per rack).
    name="GB200-186GB",
    memory_bytes=186e9,
    peak_flops={"fp32": 80e12, "tf32": 1.25e15, "bf16": 2.5e15, "fp16": 2.5e15, "fp8": 5e15},
    mem_bandwidth=8e12,
)
NVL72 = 72  # GPUs in one GB200 NVLink domain


def _dgx_a100(devices: int) -> Cluster:
    """DGX A100: NVLink3 (300 GB/s per GPU per direction) inside a node; 8x HDR 200 Gb/s IB per node
    (25 GB/s per GPU) across nodes on a non-blocking fat tree (same rate at rack and spine); the
    levels carry NCCL's figures, ``A100_NVLINK_BUS_BANDWIDTH`` and ``HDR_200G_BUS_BANDWIDTH``."""
    return Cluster(
        "dgx-a100",
        _copy(A100_80GB),
        devices,
        _gpu_levels(devices, (A100_NVLINK_BUS_BANDWIDTH, 5e-6), *_nics(HDR_200G_BUS_BANDWIDTH)),
    )


def _dgx_h100(devices: int) -> Cluster:
    """DGX H100: NVLink4 (450 GB/s per GPU per direction, of which NCCL's collectives reach
    ``H100_NVLINK_BUS_BANDWIDTH``); 8x NDR 400 Gb/s IB per node (50 GB/s per GPU, of which NCCL
    reaches ``NDR_400G_BUS_BANDWIDTH``)."""
    levels = _gpu_levels(devices, (H100_NVLINK_BUS_BANDWIDTH, 5e-6), *_nics(NDR_400G_BUS_BANDWIDTH))
    return Cluster("dgx-h100", _copy(H100_SXM), devices, levels)


def _dgx_h200(devices: int) -> Cluster:
    """DGX H200: the DGX H100's network (NVLink4 at NCCL's ``H100_NVLINK_BUS_BANDWIDTH``, 8x NDR
    400 Gb/s IB per node) around H200 GPUs."""
    levels = _gpu_levels(devices, (H100_NVLINK_BUS_BANDWIDTH, 5e-6), *_nics(NDR_400G_BUS_BANDWIDTH))
    return Cluster("dgx-h200", _copy(H200_SXM), devices, levels)


def _dgx_b200(devices: int) -> Cluster:
    """DGX B200: NVLink5 1.8 TB/s per GPU bidirectional = 900 GB/s per direction inside a node;
    8x ConnectX-7 400 Gb/s per node = 50 GB/s per GPU across nodes (non-blocking fat tree). The
    levels carry ``NVLINK5_BUS_BANDWIDTH`` and ``NDR_400G_BUS_BANDWIDTH``."""
    levels = _gpu_levels(devices, (NVLINK5_BUS_BANDWIDTH, 5e-6), *_nics(NDR_400G_BUS_BANDWIDTH))
    return Cluster("dgx-b200", _copy(B200), devices, levels)


def _gb200_nvl72(devices: int) -> Cluster:
    """GB200 NVL72: one NVLink5 domain of 72 GPUs at 900 GB/s per GPU per direction (130 TB/s
    per rack bidirectional), then one ConnectX-7 400 Gb/s NIC per GPU (50 GB/s) between racks on
    a non-blocking fabric. Levels: ``nvl72`` (72 devices) and ``fabric`` (all devices, rounded up
    to whole racks; left out for a single rack), carrying ``NVLINK5_BUS_BANDWIDTH`` and
    ``NDR_400G_BUS_BANDWIDTH``."""
    levels = [NetworkLevel("nvl72", NVL72, NVLINK5_BUS_BANDWIDTH, 5e-6)]
    fabric = max(-(-devices // NVL72) * NVL72, NVL72)
    if fabric > NVL72:
        levels.append(NetworkLevel("fabric", fabric, NDR_400G_BUS_BANDWIDTH, 1.5e-5))
    return Cluster("gb200-nvl72", _copy(GB200), devices, levels)


def _h100_spine_leaf(devices: int) -> Cluster:
    """The NEST paper's H100 spine-leaf cluster, figures as the paper states them: node 900 GB/s,
    leaf (rack) 12.5 GB/s, spine 50 GB/s, 90 GiB per device. The spine is faster than the leaf
    in the paper's figures; they are kept as given, not "corrected"."""
    device = DeviceSpec("H100 (NEST spine-leaf)", 90 * GiB, dict(H100_SXM.peak_flops), H100_SXM.mem_bandwidth)
    return Cluster(
        "h100-spine-leaf", device, devices, _gpu_levels(devices, (900e9, 5e-6), (12.5e9, 1e-5), (50e9, 1.5e-5))
    )


def _tpuv4_fat_tree(devices: int) -> Cluster:
    """TPUv4 on a fat tree, NEST figures: 900/100/400 GB/s (node/rack/spine), 64 GiB per device,
    bf16 275 TFLOP/s, HBM 1.2 TB/s. Only bf16 is listed: the MXUs have no native fp32 rate."""
    device = DeviceSpec("TPUv4", 64 * GiB, {"bf16": 275e12}, 1.2e12)
    return Cluster(
        "tpuv4-fat-tree", device, devices, _gpu_levels(devices, (900e9, 5e-6), (100e9, 1e-5), (400e9, 1.5e-5))
    )


def _cpu_gloo(devices: int) -> Cluster:
    """The test machine: a device is one CPU process under gloo. 8 GiB, ~50 GFLOP/s, 10 GB/s memory,
    one "host" level (shared-memory/loopback TCP) at ~2 GB/s, 50 us per message. Rough figures;
    bf16/fp16 are listed at the fp32 rate so plans for this machine do not depend on the dtype."""
    device = DeviceSpec("cpu", 8 * GiB, {"fp32": 50e9, "bf16": 50e9, "fp16": 50e9}, 10e9)
    return Cluster("cpu-gloo", device, devices, [NetworkLevel("host", devices, 2e9, 5e-5)])


def _copy(device: DeviceSpec) -> DeviceSpec:
    return DeviceSpec(
        device.name, device.memory_bytes, dict(device.peak_flops), device.mem_bandwidth, device.kernel_rates
    )


PRESETS.update(
    {
        "dgx-a100": _dgx_a100,
        "dgx-h100": _dgx_h100,
        "dgx-h200": _dgx_h200,
        "dgx-b200": _dgx_b200,
        "gb200-nvl72": _gb200_nvl72,
        "h100-spine-leaf": _h100_spine_leaf,
        "tpuv4-fat-tree": _tpuv4_fat_tree,
        "cpu-gloo": _cpu_gloo,
    }
)
