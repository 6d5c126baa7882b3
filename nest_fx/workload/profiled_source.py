"""Workload costs from a measured profile, with the analytical model for whatever it lacks.

``ProfiledSource`` is a ``TracedSource`` whose per-node times come from a ``Profile`` when the
node's op signature *at the variant's local shapes* was measured. Those shapes come from a
meta-device trace of the TP-localised model at the variant's microbatch size (the same
construction the profiler ran, so the signatures match); block ``k`` of that trace stands for
every block of the full model with block ``k``'s signature, node by node. Nodes the profile
lacks, and whole blocks whose op sequence does not line up, fall back to the analytical
roofline. With sequence parallelism, ops outside the TP regions run on ``1/tp`` of the
sequence; their measured time is divided by ``tp`` (they are elementwise/norm ops, linear in
size). ``coverage()`` reports how much of the compute time is measured.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch

from nest_fx.workload.localise import LocaliseError, distinct_depth, local_graph
from nest_fx.workload.profile_file import Profile, block_seconds, op_key
from nest_fx.workload.traced_source import TracedSource
from nest_fx.workload.types import WorkloadError


class ProfiledSource(TracedSource):
    """A TracedSource whose node times come from ``profile`` where it has them."""

    def __init__(
        self,
        graph,
        timing,
        profile: Profile,
        *,
        model_name: str,
        seq: Optional[int],
        dtype: torch.dtype,
        attention: str = "flash",
    ):
        super().__init__(graph, timing, attention=attention)
        self.profile = profile
        self.model_name = model_name
        self.seq = seq
        self.dtype = dtype
        self._local: Dict[Tuple[int, int], object] = {}
        self._times: Dict[tuple, List[Tuple[float, float]]] = {}
        self.measured_s: Dict[tuple, Tuple[float, float]] = {}  # (measured, total) fwd+bwd seconds
        self.depth = distinct_depth(graph)

    def for_runtime(
        self,
        *,
        compile: bool = False,
        float8: bool = False,
        timing=None,
        byte_scale: float = 1.0,
        kernels: str = "",
        attention_kernel: str = "",
        norm_kernel: str = "",
        loss_kernel: str = "",
        cp_mode: str = "",
    ) -> "ProfiledSource":
        """As :meth:`TracedSource.for_runtime`; the measured times hold for the profile's dtype only
        (and for the attention kernel that ran when it was taken; ops it did not measure are priced
        with ``attention_kernel``)."""
        if timing is not None or byte_scale != 1.0:
            other = "--precision fp32" if self.profile.dtype == "fp32" else "--precision bf16-mixed or bf16-true"
            raise WorkloadError(
                f"the profile's times were measured in {self.profile.dtype}, not in the plan's "
                f"precision; fix: plan in the profile's ({other}), or re-profile (nest-fx profile "
                "--dtype ...)"
            )
        return super().for_runtime(
            compile=compile,
            float8=float8,
            kernels=kernels,
            attention_kernel=attention_kernel,
            norm_kernel=norm_kernel,
            loss_kernel=loss_kernel,
            cp_mode=cp_mode,
        )

    def _local_graph(self, tp: int, mbs: int):
        if (tp, mbs) not in self._local:
            try:
                self._local[(tp, mbs)] = local_graph(
                    self.model_name, tp, mbs, seq=self.seq, dtype=self.dtype, layers=self.depth
                )[0]
            except (LocaliseError, ValueError) as exc:
                warnings.warn(f"profile not used for tp={tp} mbs={mbs}: {exc}", stacklevel=2)
                self._local[(tp, mbs)] = None
        return self._local[(tp, mbs)]

    def _local_block(self, local, block):
        """The block of the local trace that stands for ``block`` of the full trace."""
        same_kind = [b for b in self.graph.blocks if b.kind == block.kind]
        first = next(b for b in same_kind if b.signature == block.signature)
        ordinal = same_kind.index(first)
        local_kind = [b for b in local.blocks if b.kind == block.kind]
        return local_kind[ordinal] if ordinal < len(local_kind) else None

    def node_times(self, block, tp: int, mbs: int, sp: bool) -> List[Tuple[float, float]]:
        key = (block.kind, block.signature, tp, mbs, sp)
        if key in self._times:
            return self._times[key]
        analytical = super().node_times(block, tp, mbs, sp)
        local = self._local_graph(tp, mbs)
        lblock = self._local_block(local, block) if local is not None else None
        g, lg = self.graph.graph, (local.graph if local is not None else None)
        if lblock is None or [g.nodes[n]["op"] for n in block.nodes] != [lg.nodes[n]["op"] for n in lblock.nodes]:
            if lblock is not None:
                warnings.warn(
                    f"profile not used for {block.name}: its ops do not line up with the profiled "
                    "model's; using the analytical model",
                    stacklevel=2,
                )
            times, measured = analytical, 0.0
        else:
            facts = self.facts(block.index).nodes
            times, hosts, measured = [], [], 0.0
            for fact, name, fallback in zip(facts, lblock.nodes, analytical):
                if lg.nodes[name].get("fx_op") in ("placeholder", "output"):
                    times.append((0.0, 0.0))  # no kernel runs
                    continue
                entry = self.profile.lookup(op_key(lg.nodes[name]))
                if entry is None:
                    times.append(fallback)
                    continue
                div = tp if (sp and block.kind == "block" and not fact.tp) else 1
                times.append((entry.fwd_s / div, entry.bwd_s / div))
                hosts.append((entry.host[0] / div, entry.host[1] / div))
                measured += (entry.fwd_s + entry.bwd_s) / div
            times, measured = _host_paced(times, hosts, measured)
        self.measured_s[key] = (measured, sum(f + b for f, b in times))
        self._times[key] = times
        return times

    def coverage(self, tp: int = 1, mbs: int = 1, sp: bool = False) -> float:
        """Share of one microbatch's forward+backward compute seconds, over the whole model for
        a variant, that comes from measurements (0..1); the rest is the analytical model."""
        measured = total = 0.0
        for block in self.graph.blocks:
            self.node_times(block, tp, mbs, sp)
            m, t = self.measured_s[(block.kind, block.signature, tp, mbs, sp)]
            measured, total = measured + m, total + t
        return measured / total if total else 0.0


def _host_paced(times: List[Tuple[float, float]], hosts: List[Tuple[float, float]], measured: float):
    """Stretch a block's per-node device times so each direction sums to ``block_seconds``: where
    the host dispatches slower than the GPU runs (small ops), the host sets the block's pace.
    The stretch is proportional, so the nodes keep their shares (attention's for recompute)."""
    device = (sum(t[0] for t in times), sum(t[1] for t in times))
    fwd, bwd = block_seconds(times, hosts)
    sf = fwd / device[0] if device[0] > 0 else 1.0
    sb = bwd / device[1] if device[1] > 0 else 1.0
    if sf == 1.0 and sb == 1.0:
        return times, measured
    stretched = [(f * sf, b * sb) for f, b in times]
    return stretched, measured + (fwd - device[0]) + (bwd - device[1])
