"""Shared fixtures: traced zoo models are cached for the session (tracing llama2-7b takes ~1 s)."""

from __future__ import annotations

import functools
import time

import pytest
import torch.distributed as dist

from nest_fx.cluster import Cluster
from nest_fx.graph import trace
from nest_fx.models import build_any

# Short sequences keep the traces fast; block structure does not depend on seq.
ZOO_SEQ = 128


def traced_zoo(name: str, seq: int = ZOO_SEQ, batch: int = 1):
    """(model, cfg, args, OpGraph) of a zoo name or spec, built and traced on meta."""
    return _traced(name, seq, batch)  # positional: one cache entry however it is called


@functools.lru_cache(maxsize=None)
def _traced(name: str, seq: int, batch: int):
    model, cfg, args, kwargs = build_any(name, batch=batch, seq=seq, device="meta")
    graph = trace(model, args, kwargs, name=name)
    return model, cfg, args, graph


def pytest_collection_modifyitems(items):
    """The single-process tests first (tests/unit/ before tests/distributed/, which pytest collects
    first by name): a failure in a quick test shows before the multi-process runs. The sort is
    stable, so the order within each kind is the collected one."""
    items.sort(key=lambda item: "distributed" in item.path.parts)


@pytest.fixture(scope="session")
def zoo():
    """``zoo(name, seq=128, batch=1) -> (model, cfg, args, graph)``, cached across test files."""
    return traced_zoo


def tight_cluster(memory_gib: float, devices: int = 8) -> Cluster:
    """2 devices per node on a fast link, slow links above: pipelining and placement matter."""
    return Cluster.from_dict(
        {
            "format": "nest-fx-cluster/1",
            "name": "tight",
            "num_devices": devices,
            "device": {
                "name": "toy",
                "memory_bytes": memory_gib * 2**30,
                "peak_flops": {"bf16": 100e12, "fp32": 20e12},
                "mem_bandwidth": 1e12,
            },
            "levels": [
                {"name": "node", "group_size": 2, "bandwidth": 100e9, "latency": 5e-6},
                {"name": "rack", "group_size": 8, "bandwidth": 2e9, "latency": 2e-5},
            ],
        }
    )


@pytest.fixture
def single_rank():
    """For tests that let ``auto_parallelize`` create a one-rank process group: destroyed after."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class FakeClock:
    """A ``time.perf_counter`` that advances ``tick`` seconds at every reading: a deadline falls
    after a fixed number of the code's own clock readings, however loaded the machine is."""

    def __init__(self, tick: float):
        self.tick, self.now, self.reads = tick, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        """What a timed call "takes" on this clock."""
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch):
    """``fake_clock(tick=1e-3) -> FakeClock``, installed as ``time.perf_counter`` until the test ends
    (the solver and the baselines read their deadlines from ``time.perf_counter``)."""

    def install(tick: float = 1e-3) -> FakeClock:  # tick=0: time passes only by ``advance``
        clock = FakeClock(tick)
        monkeypatch.setattr(time, "perf_counter", clock)
        return clock

    return install
