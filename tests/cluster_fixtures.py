"""Clusters the tests share (helpers on pytest's pythonpath, not tests themselves)."""

from __future__ import annotations

from nest_fx.cluster import Cluster


def h100ish(devices: int) -> Cluster:
    """8 devices per node on a fast link, a slower network above; 80 GiB each."""
    return Cluster.from_dict(
        {
            "format": "nest-fx-cluster/1",
            "name": "h100ish",
            "num_devices": devices,
            "device": {
                "name": "h100ish",
                "memory_bytes": 80 * 2**30,
                "mem_bandwidth": 3.35e12,
                "peak_flops": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
            },
            "levels": [
                {"name": "node", "group_size": 8, "bandwidth": 450e9, "latency": 5e-6},
                {"name": "spine", "group_size": devices, "bandwidth": 50e9, "latency": 1.5e-5},
            ],
        }
    )
