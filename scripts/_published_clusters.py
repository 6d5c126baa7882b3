"""The clusters the published runs of ``bench_published.py`` ran on (``cluster_of``):
``grand_teton`` (torchtitan's H100 hosts), ``meta_h100`` (Meta's Llama 3 cluster), ``trainy_h200``
(Trainy's H200 hosts) and the presets of NVIDIA's systems (``dgx-h100``, ``dgx-b200``,
``gb200-nvl72``: NeMo, Megatron-Bridge, AutoModel).
"""

from __future__ import annotations

from nest_fx.cluster import Cluster

try:
    from nest_fx.cluster.presets import H100_NVLINK_BUS_BANDWIDTH
except ImportError:  # the cost model before the constant (--before-commit) is costed on the same clusters
    H100_NVLINK_BUS_BANDWIDTH = 360e9

GiB = 2**30


def meta_h100(gpus: int):
    """Meta's Llama 3 cluster (Grattafiori et al. 2024, sec. 3.3.1): 8 H100 SXM (80 GB HBM3,
    700 W) per server on NVLink (at NCCL's bus bandwidth, ``H100_NVLINK_BUS_BANDWIDTH``), RoCE at
    400 Gb/s (50 GB/s: the line rate; NCCL's 47 GB/s figure is InfiniBand NDR's, not stated for RoCE)
    per GPU inside a 3,072-GPU pod, 1:7 oversubscribed between pods; SXM peaks
    (NVIDIA's datasheet), 79.2 GiB as PyTorch reports it."""
    levels = [
        {"name": "node", "group_size": 8, "bandwidth": H100_NVLINK_BUS_BANDWIDTH, "latency": 5e-6},
        {"name": "pod", "group_size": min(3072, gpus), "bandwidth": 50e9, "latency": 1e-5},
    ]
    if gpus > 3072:
        levels.append(
            {"name": "cluster", "group_size": -(-gpus // 3072) * 3072, "bandwidth": 50e9 / 7, "latency": 2e-5}
        )
    return Cluster.from_dict(
        {
            "format": "nest-fx-cluster/1",
            "name": "meta-h100",
            "num_devices": gpus,
            "device": {
                "name": "H100-SXM-80GB",
                "memory_bytes": 85_031_714_816,
                "mem_bandwidth": 3.35e12,
                "peak_flops": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12},
            },
            "levels": levels,
        }
    )


def cluster_of(row):
    """The row's cluster."""
    if row.system == "llama3":
        return meta_h100(row.gpus)
    if row.system in ("nemo", "automodel"):
        return Cluster.preset(row.hardware, row.gpus)  # NVIDIA's systems: dgx-h100, dgx-b200, gb200-nvl72
    return trainy_h200(row.gpus) if row.hardware == "h200" else grand_teton(row.gpus)


def trainy_h200(gpus: int):
    """Trainy's hosts (TRAINY_SOURCE): 8 H200 SXM per host on NVLink, 400 Gb/s (ConnectX-7) per GPU
    between hosts (``_hosts_of_eight``); the H200 SXM datasheet (the H100 SXM's dense peaks, 141 GB
    HBM3e at 4.8 TB/s; 140 GiB as the dgx-h200 preset reads the card). Written out, not the preset,
    so that a cost model from before the preset (``--before-commit``) costs the same cluster."""
    device = {
        "name": "H200-SXM-141GB",
        "memory_bytes": 140 * GiB,
        "mem_bandwidth": 4.8e12,
        "peak_flops": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12},
    }
    return _hosts_of_eight("trainy-h200", gpus, device)


def grand_teton(gpus: int):
    """The source's cluster: 8 H100 per host on NVLink, 400 Gb/s per GPU between hosts
    (``_hosts_of_eight``), 95 GiB and 2.4 TB/s per GPU, the SXM/NVL midpoint peaks."""
    device = {
        "name": "H100-96GB-HBM2e-500W",
        "memory_bytes": 95 * GiB,
        "mem_bandwidth": 2.4e12,
        "peak_flops": {"bf16": 912e12, "fp16": 912e12, "fp32": 62e12, "fp8": 1825e12},
    }
    return _hosts_of_eight("grand-teton-h100", gpus, device)


def _hosts_of_eight(name: str, gpus: int, device: dict):
    """``gpus`` GPUs in hosts of 8 on NVLink4 (450 GB/s per GPU per direction, of which NCCL reaches
    ``H100_NVLINK_BUS_BANDWIDTH``), 400 Gb/s (50 GB/s, the line rate) RDMA per GPU between hosts,
    racks of 32 under a spine at the same rate."""
    levels = [
        {"name": "node", "group_size": 8, "bandwidth": H100_NVLINK_BUS_BANDWIDTH, "latency": 5e-6},
        {"name": "rack", "group_size": 32, "bandwidth": 50e9, "latency": 1e-5},
    ]
    if gpus > 32:
        levels.append({"name": "spine", "group_size": -(-gpus // 32) * 32, "bandwidth": 50e9, "latency": 1.5e-5})
    return Cluster.from_dict(
        {"format": "nest-fx-cluster/1", "name": name, "num_devices": gpus, "device": device, "levels": levels}
    )
