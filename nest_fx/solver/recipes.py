"""Hand-written recipes as their authors run them, costed by the same model as every planner.

* :func:`megatron`: Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", sec. 3 takeaways; Korthikanti et al. 2022 for
  sequence parallelism and selective recomputation):

  - tensor parallelism inside a node (t in 1, 2, 4, 8), pipeline parallelism across nodes, the
    smallest model-parallel size M = t * p whose model fits (more TP first at equal M: takeaways
    1 and 2); data parallelism over the rest, d = N / M (Megatron-LM requires the world size to
    be a multiple of M, and d must divide the global batch);
  - Megatron's stage split: the transformer blocks evenly over the p stages (p must divide
    their number, as Megatron-LM asserts), the embedding on the first stage and the output
    layer on the last (:func:`block_split`), ranks in Megatron's order (TP innermost, PP
    outermost: ``stage-major``);
  - the interleaved schedule by its rules: v model chunks per device where v divides the blocks
    per stage and the microbatches are a multiple of p; v = 1 is plain 1F1B;
  - the microbatch size tuned per model (takeaway 3: it depends on the model, p, d and B): the
    fastest of 1, 2, 4, 8, with the fastest v;
  - selective recomputation with sequence parallelism, full recomputation only when selective
    does not fit (Korthikanti et al. 2022, Megatron-LM's practice since); the distributed
    optimizer (ZeRO-1).

* :func:`torchtitan`: the torchtitan Llama 3 recipes (``llama3_8b/70b/405b.toml``): FSDP2 over
  every device (ZeRO-3); tensor parallelism 8 from 70B parameters with full activation
  checkpointing; pipeline parallelism (1F1B, microbatch 1, FSDP without resharding) for the
  405B class; op-level selective activation checkpointing (``op``, torchtitan's policy) below
  70B; loss parallel with TP (torchtitan's default). When the recipe's shape does not fit, the
  next one is taken, as its users do (full checkpointing, then 1D -> 2D -> 3D parallelism); the
  local batch (microbatch size) is tuned like Megatron's. Experts are not expert-parallel
  (torchtitan's default degree 1).

Both compute the cross-entropy over vocabulary shards under TP (Megatron-LM's vocabulary-parallel
cross-entropy, torchtitan's loss parallel) where the model allows it, and run torch.compile and
Float8 when the options ask for them (``SolverOptions.compile``, ``float8``).
"""

from __future__ import annotations

import time
from typing import Iterator, List, Optional, Sequence, Tuple

from nest_fx.common.arith import divisors
from nest_fx.plan import Plan, StagePlan
from nest_fx.solver.baseline_result import Baseline, evaluate
from nest_fx.solver.space import SolverOptions
from nest_fx.workload import Variant, Workload

MICROBATCH_SIZES = (1, 2, 4, 8)  # what a recipe's user tries
TP_DEGREES = (1, 2, 4, 8)
TORCHTITAN_TP_FROM = 64e9  # parameters: the 70B recipe and up use TP 8
TORCHTITAN_PP_FROM = 300e9  # parameters: the 405B class adds pipeline parallelism


def block_split(workload: Workload, p: int) -> Optional[List[Tuple[int, int]]]:
    """Megatron's p stages: the blocks evenly (None when p does not divide their number), the
    layers before the first block (embedding) on the first stage, those after the last block
    (final norm, output layer) on the last. Ranges of the workload chain."""
    blocks = [i for i, layer in enumerate(workload.layers) if layer.kind == "block"]
    if not blocks or p < 1 or len(blocks) % p:
        return None
    per = len(blocks) // p
    bounds = [blocks[0] + k * per for k in range(p + 1)]
    bounds[0], bounds[-1] = 0, len(workload)
    return list(zip(bounds[:-1], bounds[1:]))


def _num_blocks(workload: Workload) -> int:
    return sum(layer.kind == "block" for layer in workload.layers)


def _data_parallel(global_batch: int, model_parallel: int, devices: int) -> Optional[int]:
    """The DP degree of a recipe: every device used (both recipes require the world size to be a
    multiple of the model-parallel size), so ``devices / model_parallel``; None when that does not
    divide the devices or the global batch."""
    if devices % model_parallel or global_batch % (devices // model_parallel):
        return None
    return devices // model_parallel


def _expert_parallel(workload: Workload, tp: int, dp: int) -> int:
    """Megatron's expert parallelism: the largest degree dividing the experts and dp."""
    if not workload.is_moe:
        return 1
    return max(
        (
            e
            for e in divisors(max(workload.dims.num_experts, 1))
            if dp % e == 0 and workload.supports(Variant(tp, e, sequence_parallel=tp > 1))
        ),
        default=1,
    )


def _plan(
    workload: Workload,
    cluster,
    ranges: Sequence[Tuple[int, int]],
    tp: int,
    dp: int,
    ep: int,
    zero: int,
    mbs: int,
    m: int,
    recompute: str,
    options: SolverOptions,
    schedule: str = "1f1b",
    v: int = 1,
) -> Plan:
    lp = tp > 1 and workload.supports(Variant(tp, ep, sequence_parallel=True, loss_parallel=True))
    return Plan(
        stages=[StagePlan(a, b, tp, recompute) for a, b in ranges],
        dp=dp,
        ep=ep,
        zero=zero,
        loss_parallel=lp,
        compile=options.compile,
        float8=options.float8,
        async_tp=options.async_tp,
        precision=options.precision or "",
        kernels=options.kernels or "",
        attention_kernel=options.attention_kernel or "",
        norm_kernel=options.norm_kernel or "",
        loss_kernel=options.loss_kernel or "",
        microbatch_size=mbs,
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=v,
        sequence_parallel=tp > 1,
        placement="stage-major",
        model=workload.model,
        model_fingerprint=workload.fingerprint,
        num_layers=len(workload),
        world_size=cluster.num_devices,
    )


def interleave_factors(blocks_per_stage: int, p: int, m: int) -> List[int]:
    """Megatron's legal model chunks per device: 1 (plain 1F1B) and every v >= 2 dividing the
    blocks per stage, when there are stages to interleave and m is a multiple of p."""
    if p < 2 or m % p:
        return [1]
    return [1] + [v for v in divisors(blocks_per_stage) if v >= 2]


def fastest(
    workload: Workload, cluster, options: SolverOptions, plans: Iterator[Plan]
) -> Tuple[Optional[Plan], object, int]:
    """(plan, result, evaluations) of the fastest plan that fits among ``plans``; the first plan
    is the leanest of a shape: when it does not fit, the shape is skipped."""
    best_plan, best, evals = None, None, 0
    for k, plan in enumerate(plans):
        evals += 1
        result = evaluate(plan, workload, cluster, options)
        if result is None and k == 0:
            break
        if result is not None and (best is None or result.step_s < best.step_s):
            best_plan, best = plan, result
    return best_plan, best, evals


def _batch_splits(global_batch: int, dp: int) -> Iterator[Tuple[int, int]]:
    """(microbatch size, microbatches) of a per-replica batch, leanest first."""
    per_replica = global_batch // dp
    for mbs in MICROBATCH_SIZES:
        if per_replica % mbs == 0:
            yield mbs, per_replica // mbs


def megatron_plans(
    workload: Workload, cluster, global_batch: int, tp: int, p: int, recompute: str, options: SolverOptions
) -> Iterator[Plan]:
    """Megatron-LM's plans of one shape (t = ``tp``, p) on every device: its block split, the
    distributed optimizer, sequence parallelism with TP, every microbatch size and legal
    interleave factor, leanest first (microbatch 1, v = 1); nothing when the shape does not
    divide the devices, the batch or the blocks."""
    dp, ranges = _data_parallel(global_batch, tp * p, cluster.num_devices), block_split(workload, p)
    if dp is None or ranges is None:
        return
    ep = _expert_parallel(workload, tp, dp)
    for mbs, m in _batch_splits(global_batch, dp):
        for v in interleave_factors(_num_blocks(workload) // p, p, m):
            yield _plan(
                workload,
                cluster,
                ranges,
                tp,
                dp,
                ep,
                1,
                mbs,
                m,
                recompute,
                options,
                "interleaved" if v > 1 else "1f1b",
                v,
            )


def megatron(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    deadline: Optional[float] = None,
) -> Baseline:
    """Megatron-LM's recipe (module docstring); no plan when the search for the smallest shape
    that fits passes ``deadline`` (a ``time.perf_counter()`` value)."""
    options = options or SolverOptions()
    node, n = cluster.levels[0].group_size, cluster.num_devices
    blocks = _num_blocks(workload)
    tps = [t for t in TP_DEGREES if t <= node and t <= n and workload.supports(Variant(t, sequence_parallel=t > 1))]
    shapes = sorted(
        ((t, p) for t in tps for p in (divisors(blocks) if blocks else [1]) if t * p <= n),
        key=lambda x: (x[0] * x[1], -x[0]),
    )
    evals = 0
    for recompute in ("selective", "full"):
        for tp, p in shapes:
            if deadline is not None and time.perf_counter() > deadline:
                return Baseline("megatron", None, None, evals)
            if _data_parallel(global_batch, tp * p, n) is None or block_split(workload, p) is None:
                continue
            plan, result, k = fastest(
                workload, cluster, options, megatron_plans(workload, cluster, global_batch, tp, p, recompute, options)
            )
            evals += k
            if plan is not None:
                return Baseline("megatron", plan, result, evals)
    return Baseline("megatron", None, None, evals)


def _torchtitan_shapes(workload: Workload, cluster) -> Iterator[Tuple[int, int]]:
    """(tp, pp) in the order torchtitan's recipes escalate: FSDP alone, + TP 8, + PP; starting
    from the model's size class."""
    node, n = cluster.levels[0].group_size, cluster.num_devices
    tp = max(
        (t for t in TP_DEGREES if t <= min(node, n) and workload.supports(Variant(t, sequence_parallel=t > 1))),
        default=1,
    )
    params = workload.num_params
    blocks = _num_blocks(workload)
    steps = [(1, 1), (tp, 1)] + [(tp, p) for p in divisors(blocks) if p >= 2]
    start = 0 if params < TORCHTITAN_TP_FROM else (1 if params < TORCHTITAN_PP_FROM else 2)
    seen = set()
    for shape in steps[start:]:
        if shape not in seen and shape[0] * shape[1] <= n:
            seen.add(shape)
            yield shape


def torchtitan(
    workload: Workload,
    cluster,
    global_batch: int,
    options: Optional[SolverOptions] = None,
    deadline: Optional[float] = None,
) -> Baseline:
    """torchtitan's Llama 3 recipes (module docstring)."""
    options = options or SolverOptions()
    sac = workload.num_params < TORCHTITAN_TP_FROM
    evals = 0
    for tp, p in _torchtitan_shapes(workload, cluster):
        dp = _data_parallel(global_batch, tp * p, cluster.num_devices)
        ranges = block_split(workload, p) if p > 1 else [(0, len(workload))]
        if dp is None or ranges is None:
            continue
        for recompute in ("op", "full") if sac and tp == 1 and p == 1 else ("full",):
            if deadline is not None and time.perf_counter() > deadline:
                return Baseline("torchtitan", None, None, evals)
            splits = [(1, global_batch // dp)] if p > 1 else list(_batch_splits(global_batch, dp))
            plans = (
                _plan(workload, cluster, ranges, tp, dp, 1, 3 if p == 1 else 1, mbs, m, recompute, options)
                for mbs, m in splits
                if p == 1 or m >= p
            )
            plan, result, k = fastest(workload, cluster, options, plans)
            evals += k
            if plan is not None:
                return Baseline("torchtitan", plan, result, evals)
    return Baseline("torchtitan", None, None, evals)
