"""Tier 0 of the search: every admissible (global config, pipeline depth) pair with a lower bound
on its step time that needs no network model (``solver.search`` refines it; the baselines
enumerate the same pairs)."""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import numpy as np

from nest_fx.cluster.protocol import ClusterModel
from nest_fx.cost import memory
from nest_fx.cost.memory import model_states
from nest_fx.cost.step_time import pipeline_span, tail_terms
from nest_fx.solver.space import GlobalConfig, SolverOptions, global_configs, stage_counts
from nest_fx.workload.types import Workload

def _replica_work(workload: Workload, g: GlobalConfig) -> Tuple[float, float]:
    """(per-microbatch fwd + bwd seconds, per-device parameters) of one replica at g's variant."""
    work = params = 0.0
    for i in range(len(workload)):
        c = workload.cost(i, g.tp, g.ep, g.mbs, g.sp)
        work += c.fwd_s + c.bwd_s
        params += c.num_params
    return work, params


def candidates(workload: Workload, cluster: ClusterModel, global_batch: int, options: SolverOptions,
               deadline: Optional[float] = None):
    """(LB, g, p) for every admissible pair that passes the memory screen, sorted by LB (tier 0
    of the module docstring); only those enumerated before ``deadline`` (a
    ``time.perf_counter()`` value) when it passes."""
    capacity = memory.usable_bytes(cluster.device.memory_bytes, options.cost)
    works: Dict[tuple, Tuple[float, float]] = {}
    screens: Dict[tuple, np.ndarray] = {}
    out = []
    for k, g in enumerate(global_configs(workload, cluster, global_batch, options)):
        if deadline is not None and k % 256 == 0 and time.perf_counter() > deadline:
            break
        key = (g.tp, g.ep, g.mbs, g.sp)
        if key not in works:
            works[key] = _replica_work(workload, g)
        work, params = works[key]
        depths = np.array(stage_counts(workload, cluster, g, global_batch, options), dtype=np.intp)
        if not depths.size:
            continue
        screen_key = (params, g.zero, g.dp, int(depths[-1]))
        if screen_key not in screens:  # fits[p]: the leanest model states of p stages fit
            every = np.arange(1, int(depths[-1]) + 1, dtype=float)
            screens[screen_key] = np.concatenate(
                [[False], model_states(params / every, g.zero, g.dp, options.cost)["total"] <= capacity])
        depths = depths[screens[screen_key][depths]]
        t_opt = tail_terms(0.0, 0.0, 0.0, params / depths, g.dp, g.zero, cluster, options.cost)[1]
        lbs = pipeline_span(work / depths, work, g.microbatches(global_batch), g.schedule, g.v) + t_opt
        out.extend((lb, g, p) for lb, p in zip(lbs.tolist(), depths.tolist()))
    out.sort(key=lambda x: x[0])
    return out
