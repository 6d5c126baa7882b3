"""Per-device training memory: model states, transformer activations, a stage's memory terms
and whether they fit (the pipeline's in-flight activations: ``cost/inflight.py``).

Pure functions on numbers (bytes). Sources:
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
        Models" (SC'20) -- model states and their sharding over data parallelism.
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
        (MLSys'23) -- activation bytes per transformer layer, Table 2.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from nest_fx.cost.arg_checks import require_amount, require_choice, require_int, require_number
from nest_fx.cost.arrays import Count, positive_part
from nest_fx.cost.optimizers import MASTER_WEIGHT_BYTES, optimizer_cost, resolved_kernel, step_cost
from nest_fx.cost.options import CostOptions
from nest_fx.cost.stage_terms import LayerTerms

RECOMPUTE_MODES = ("none", "selective", "full")
Amount = Count  # bytes or parameter counts: a number, or an array of them


# -- model states ---------------------------------------------------------------------------


def optimizer_bytes_per_param(optimizer: str = "adam", master_weights: bool = True, state_bytes: float = 4) -> float:
    """Optimizer-state bytes per parameter (the ZeRO paper's K): fp32 state tensors
    (``nest_fx.cost.optimizers``) plus the fp32 master copy of the weights in mixed precision.

    Adam/AdamW: momentum m (4) + variance v (4) + master (4): K = 12 (Rajbhandari et al. 2020,
    sec. 3.1), 8 without master weights. ``sgd-momentum``: momentum (4) + master (4) = 8, 4
    without. ``sgd`` (PyTorch's default, no momentum): the master copy alone, 4, or 0.
    ``state_bytes``: the width of the state tensors (4: fp32; 2: bf16, as ``bf16-true`` keeps them).
    """
    return optimizer_cost(optimizer).state_bytes * state_bytes / 4 + (MASTER_WEIGHT_BYTES if master_weights else 0)


def model_state_bytes(
    num_params: float,
    *,
    zero_stage: int,
    dp: int,
    optimizer: str = "adam",
    param_dtype_bytes: float = 2,
    grad_dtype_bytes: float = 2,
    master_weights: bool = True,
    state_dtype_bytes: float = 4,
) -> Dict[str, float]:
    """Bytes per device of weights, gradients and optimizer states (keys weights, grads, optimizer, total).

    Per parameter: ``param_dtype_bytes`` of weights, ``grad_dtype_bytes`` of gradients and
    K = :func:`optimizer_bytes_per_param` of optimizer states. Mixed-precision Adam is the ZeRO
    paper's 2 + 2 + 12 = 16 bytes/param; fp32 Adam (``param_dtype_bytes=4,
    grad_dtype_bytes=4, master_weights=False``) is 4 + 4 + 8. ZeRO (Rajbhandari et al. 2020,
    sec. 5, Figure 1) divides by the data-parallel degree ``dp``: stage 1 the optimizer states,
    stage 2 also the gradients, stage 3 also the weights:

        ZeRO-0: (2 + 2 + K) psi    ZeRO-1: (2 + 2) psi + K psi / dp
        ZeRO-2: 2 psi + (2 + K) psi / dp    ZeRO-3: (2 + 2 + K) psi / dp

    ``num_params`` is the parameter count held by this device before ZeRO sharding (i.e. after
    tensor/pipeline partitioning, Narayanan et al. 2021).
    """
    psi = require_number(num_params, "num_params")
    require_int(dp, "dp", 1)
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage: must be one of [0, 1, 2, 3], got {zero_stage!r}")
    pbytes = require_number(param_dtype_bytes, "param_dtype_bytes", positive=True)
    gbytes = require_number(grad_dtype_bytes, "grad_dtype_bytes", positive=True)
    k = optimizer_bytes_per_param(optimizer, master_weights, state_dtype_bytes)
    out = {
        "weights": psi * pbytes / (dp if zero_stage >= 3 else 1),
        "grads": psi * gbytes / (dp if zero_stage >= 2 else 1),
        "optimizer": psi * k / (dp if zero_stage >= 1 else 1),
    }
    out["total"] = out["weights"] + out["grads"] + out["optimizer"]
    return out


def effective_zero_stage(zero_stage: int, num_stages: int, pp_shard_grads: bool = False) -> int:
    """The ZeRO stage whose memory a plan really has. Under pipelining, FSDP2 inside
    ``torch.distributed.pipelining`` keeps every stage's gathered parameters and unsharded
    gradients from the first microbatch to the last backward (the schedule turns resharding and
    gradient reduction off until then), so ZeRO-2 and ZeRO-3 hold what ZeRO-1 holds (and
    communicate as ZeRO-1 does: one all-gather, one reduce-scatter per step). DeepSpeed refuses
    ZeRO-2/3 with pipelining for the same reason. With ``pp_shard_grads`` the runtime keeps
    FSDP's gradient reduction on for every microbatch (``apply.pipeline.ShardedGradStage``):
    the plan's ZeRO stage holds, as it does without pipelining."""
    require_int(num_stages, "num_stages", 1)
    return min(zero_stage, 1) if num_stages > 1 and not pp_shard_grads else zero_stage


def fsdp_unsharded_bytes(
    num_params: Amount,
    root_params: Amount,
    unit_params: Amount,
    *,
    zero_stage: int,
    dp: int,
    param_dtype_bytes: float = 2,
    grad_dtype_bytes: float = 2,
) -> Tuple[Amount, Amount]:
    """(parameter bytes, gradient bytes) FSDP2 (``fully_shard`` per block, then the stage root)
    holds on top of :func:`model_state_bytes` during forward/backward, per device.

    ``num_params``: the stage's parameters per device before ZeRO sharding; ``root_params``: those
    outside every block (embedding, final norm, LM head: the root unit); ``unit_params``: the
    largest block's. With psi = num_params, R = root_params, U = unit_params (bytes: x dtype):

        ZeRO-0   0, 0
        ZeRO-1   psi / dp, 0: the local shard stays allocated next to the gathered copy (the
                 paper's ZeRO-1 counts the gathered psi and psi gradients; both are there)
        ZeRO-2   psi / dp as ZeRO-1; gradients R + U + max(R, U): the unsharded gradients of the
                 root (reduced at the root's post-backward, the very end) and of one block,
                 and the flat copy a reduce-scatter stages them in
        ZeRO-3   R + 2U gathered: the root, the block computing and the block prefetched during
                 backward; gradients as ZeRO-2

    The gradient bytes build up as backward frees activations and peak at its end, when the
    root is reduced; :func:`stage_memory` counts the larger of the two. Pass the
    :func:`effective_zero_stage`. With ``dp == 1`` nothing is sharded: (0, 0). The parameter
    counts may be numpy arrays (the solver's stage tables); the results are then arrays.
    """
    psi = require_amount(num_params, "num_params")
    root = require_amount(root_params, "root_params")
    unit = require_amount(unit_params, "unit_params")
    require_int(dp, "dp", 1)
    pbytes = require_number(param_dtype_bytes, "param_dtype_bytes", positive=True)
    gbytes = require_number(grad_dtype_bytes, "grad_dtype_bytes", positive=True)
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage: must be one of [0, 1, 2, 3], got {zero_stage!r}")
    if zero_stage == 0 or dp == 1:
        return 0.0 * psi, 0.0 * psi
    if zero_stage == 1:
        return psi * pbytes / dp, 0.0 * psi
    grads = (root + unit + np.maximum(root, unit)) * gbytes
    params = psi * pbytes / dp if zero_stage == 2 else (root + 2 * unit) * pbytes
    return params, grads


def optimizer_step_bytes(
    updated_params: Amount, optimizer: str = "adam", kernel: str = "foreach", largest_tensor: Amount = 0.0
) -> Amount:
    """Scratch bytes of one optimizer step on ``updated_params`` (the locally updated
    parameters: 1/dp of them under ZeRO >= 1) run by ``kernel`` (``optimizer_kernel``, resolved:
    ``for-loop``, ``foreach`` or ``fused``; ``nest_fx.cost.optimizers``). PyTorch's foreach
    Adam/AdamW builds the denominator sqrt(v) + eps for all parameters at once: one fp32 tensor
    the size of the parameters, 4 bytes each. Its for-loop holds two fp32 temporaries of one
    tensor and the previous tensor's denominator: at most 12 bytes per element of
    ``largest_tensor`` (the largest parameter tensor's local elements). SGD and the fused
    kernels update in place: 0. It is allocated after backward, when activations are gone (see
    :func:`stage_memory`)."""
    cost = step_cost(optimizer, kernel)
    updated = require_amount(updated_params, "updated_params")
    largest = require_amount(largest_tensor, "largest_tensor")
    return cost.scratch_bytes * updated + cost.tensor_scratch_bytes * largest


# -- activations ----------------------------------------------------------------------------


def korthikanti_activation_bytes(
    seq: int,
    microbatch: int,
    hidden: int,
    heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    dtype_bytes: float = 2,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per device (Korthikanti 2022, Table 2).

    With s = ``seq``, b = ``microbatch``, h = ``hidden``, a = ``heads``, t = ``tp``:

        none       no SP: sbh (10 + 24/t + 5as/(ht))   (t = 1: sbh (34 + 5as/h), eq. 1)
                   SP:    sbh/t (34 + 5as/h)
        selective  no SP: sbh (10 + 24/t)               (the 5as/h attention-core term is recomputed)
                   SP:    sbh (34/t)
        full       no SP: 2sbh                          (only the layer input is kept)
                   SP:    2sbh/t

    The paper's constants count 2-byte (fp16/bf16) activations and 1-byte dropout masks; the
    result is scaled by ``dtype_bytes / 2`` (approximate for the masks when dtype_bytes != 2).
    The "10" is the part plain tensor parallelism leaves replicated (layer-norm inputs, dropout
    outputs and masks); sequence parallelism shards it too.
    """
    s = require_int(seq, "seq", 1)
    b = require_int(microbatch, "microbatch", 1)
    h = require_int(hidden, "hidden", 1)
    a = require_int(heads, "heads", 1)
    t = require_int(tp, "tp", 1)
    require_choice(recompute, "recompute", RECOMPUTE_MODES)
    scale = require_number(dtype_bytes, "dtype_bytes", positive=True) / 2
    sbh = s * b * h
    attention = 5 * a * s / h  # the 5as/h term: attention scores, softmax, its dropout
    if recompute == "full":
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    else:
        core = 0.0 if recompute == "selective" else attention
        if sequence_parallel:
            per_layer = sbh / t * (34 + core)
        else:
            per_layer = sbh * (10 + 24 / t + core / t)
    return per_layer * scale


# -- a stage's memory --------------------------------------------------------------------

_STATES_CACHE: Dict[tuple, Tuple[float, float, float, float]] = {}


_STATE_KEYS = ("weights", "grads", "optimizer", "total")


def held_grad_bytes(zero: int, pipelined: bool, options: CostOptions) -> float:
    """Bytes per element of the gradients a stage holds between backward and the optimizer step.

    With fp32 master weights (``options.master_weights``: bf16-mixed) the gradients are held in
    fp32 whatever the compute dtype: nest-fx's runtime casts each parameter to bf16 inside
    autograd, so the gradient of the cast lands, cast back, in the fp32 parameter's ``.grad``
    (``apply/precision.py``), and FSDP2 under ``MixedPrecisionPolicy(reduce_dtype=fp32)``
    reduces each bf16 gradient in fp32 into the fp32 sharded parameter's gradient; measured on an
    H100, 4 microbatches accumulated: 37.32 GiB allocated, 34.55 priced at the parameters' 2 bytes
    (``results/gpu/bench_gpu_runtime_h100_runtime_default.json``, row ``accumulate``): the
    larger of ``options.grad_bytes`` and ``options.reduce_dtype_bytes()`` (4). Megatron-LM's
    fp32 main gradients and Meta's Llama 3 stack (Grattafiori et al. 2024, sec. 3.3.4: "FP32
    gradient accumulation during backward computation over multiple micro-batches") do the same.
    Without master weights (fp32, bf16-true): ``options.grad_bytes``. Under pipelining
    ``torch.distributed.pipelining`` turns gradient sync off until the last backward (ZeRO-2/3
    run as ZeRO-1, :func:`effective_zero_stage`) and FSDP2 accumulates each unsharded gradient in
    its ``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``); a pipelined ZeRO-2/3 plan
    (possible only with ``pp_shard_grads``) accumulates the reduce-scattered shards: the same
    bytes, 1/dp of them."""
    if options.master_weights or (pipelined and zero >= 1):
        return float(max(options.grad_bytes, options.reduce_dtype_bytes()))
    return float(options.grad_bytes)


def model_states(params: Count, zero: int, dp: int, options: CostOptions, pipelined: bool = False) -> Dict[str, Count]:
    """``memory.model_state_bytes`` under the cost options, gradients held as
    :func:`held_grad_bytes` says (``pipelined``: the plan has more than one pipeline stage);
    for an array, per distinct entry (memoised: the solver's tables ask for the same parameter
    counts over and over)."""
    grad_bytes = held_grad_bytes(zero, pipelined, options)
    if not isinstance(params, np.ndarray):
        return model_state_bytes(
            params,
            zero_stage=zero,
            dp=dp,
            optimizer=options.optimizer,
            param_dtype_bytes=options.param_bytes,
            grad_dtype_bytes=grad_bytes,
            master_weights=options.master_weights,
            state_dtype_bytes=options.state_bytes,
        )
    values, inverse = np.unique(params.ravel(), return_inverse=True)
    rows = np.empty((len(values), len(_STATE_KEYS)))
    for j, v in enumerate(values.tolist()):
        key = (
            v,
            zero,
            dp,
            options.optimizer,
            options.param_bytes,
            grad_bytes,
            options.master_weights,
            options.state_bytes,
        )
        row = _STATES_CACHE.get(key)
        if row is None:
            if len(_STATES_CACHE) > 1_000_000:
                _STATES_CACHE.clear()
            states = model_states(v, zero, dp, options, pipelined)
            row = _STATES_CACHE[key] = tuple(states[k] for k in _STATE_KEYS)
        rows[j] = row
    return {k: rows[inverse, c].reshape(params.shape) for c, k in enumerate(_STATE_KEYS)}


MEMORY_TERMS = (
    "weights",
    "grads",
    "optimizer",
    "activations",
    "buffers",
    "fsdp_unsharded",
    "optimizer_step",
    "allocator_cache",
)


def working_sets(
    terms: LayerTerms, zero: int, dp: int, options: CostOptions, device=None
) -> Tuple[Count, Count, Count]:
    """(FSDP unsharded parameter bytes, FSDP unsharded gradient bytes, optimizer scratch bytes)
    of a stage: ``memory.fsdp_unsharded_bytes`` of its dense parameters at ``zero`` (the
    effective stage) and ``memory.optimizer_step_bytes`` of the parameters it updates, its step
    run as ``options.optimizer_kernel`` runs on ``device`` (a ``DeviceSpec``; None: a GPU's).
    The for-loop's largest tensor is bounded by the stage's largest FSDP unit (its largest block,
    or its embedding, norm and head: exact where the largest tensor is a layer's only one, as an
    embedding is), sharded over ``dp`` under ZeRO >= 1 (FSDP2 shards every tensor). Megatron-LM's
    distributed optimizer (``options.state_buffers``) holds no FSDP working set under ZeRO-1: its
    parameter shard is a view of the whole bf16 buffer."""
    dense = terms.params - terms.expert_params
    params, grads = fsdp_unsharded_bytes(
        dense,
        terms.root_params,
        terms.unit_params,
        zero_stage=zero,
        dp=dp,
        param_dtype_bytes=options.param_bytes,
        grad_dtype_bytes=options.grad_bytes,
    )
    if options.state_buffers == "distributed-optimizer" and zero <= 1:
        params, grads = 0.0 * params, 0.0 * grads
    shard = dp if zero >= 1 else 1
    scratch = optimizer_step_bytes(
        terms.params / shard,
        options.optimizer,
        resolved_kernel(options.optimizer_kernel, device),
        np.maximum(terms.unit_params, terms.root_params) / shard,
    )
    return params, grads, scratch


def held_per_microbatch(
    act: Count, out_bytes: Count, pp: int, virtual_stages: int, options: CostOptions, sp_degree: int = 1
) -> Count:
    """Bytes a pipelined stage holds per in-flight microbatch of its layers: their activations
    ``act`` plus its ``virtual_stages`` chunk outputs of ``out_bytes`` each, as the runtime keeps
    them until the chunk's backward (``options.stage_outputs``): torch's ``PipelineStage`` caches
    each output in ``fwd_cache``, ``1 / sp_degree`` of it where sequence-parallel blocks hand on
    their shard (nest-fx's runtime and torchtitan, "sharded"), the whole tensor where stages end
    on full sequences ("full"); nothing where the runtime frees it after the send ("freed": Megatron-LM's
    ``deallocate_output_tensor``; Meta's Llama 3 stack, Grattafiori et al. 2024, sec. 3.3.2).
    Without pipelining, the activations alone."""
    if pp == 1 or options.stage_outputs == "freed":
        return act
    share = 1.0 / sp_degree if options.stage_outputs == "sharded" else 1.0
    return act + virtual_stages * out_bytes * share


def stage_memory(
    states: Dict[str, Count],
    expert_states: Dict[str, Count],
    held_act: Count,
    layer_peak: Count,
    out_bytes: Count,
    unsharded_params: Count = 0.0,
    unsharded_grads: Count = 0.0,
    optimizer_scratch: Count = 0.0,
    *,
    num_microbatches: int,
    options: Optional[CostOptions] = None,
    buffers: Optional[Count] = None,
) -> Dict[str, Count]:
    """Per-device memory terms of a stage at its peak (see module docstring) and their total;
    ``held_act``: the in-flight activations (``inflight.held_activation_bytes``).

    The peak is model states + the larger of the forward/backward working set (activations,
    buffers, FSDP's unsharded parameters and gradients) and the optimizer step's scratch, which
    is allocated after backward has freed the former. ``optimizer_step`` is what the scratch
    adds beyond the forward/backward working set, so the terms still sum to the peak.

    With one microbatch nothing accumulates: backward writes the gradients as it frees the
    activations, so the peak is at its start (all activations, no gradients yet) or at its end
    (all gradients, no activations), and the terms are those of the larger moment. With more,
    the gradients of the first microbatch are there while the others' activations are. FSDP's
    unsharded gradients build up as a microbatch's backward frees its activations (the root's
    are reduced last): ``fsdp_unsharded`` is the gathered parameters plus what those gradients
    add beyond the activations.

    ``options`` (None: neither term below): with ``master_weights`` the ``weights`` term is bf16
    casts of fp32 master weights (bf16-mixed: nest-fx's
    runtime casts in autograd, FSDP2 gathers in bf16), freed once backward is done, so the optimizer
    step may use their bytes (measured on an H100 with full recompute, where the step is the peak:
    44.03 GiB allocated, 43.95 priced without the casts, 48.34 with them;
    ``results/gpu/bench_gpu_runtime_h100_runtime_default.json``, row ``recompute``).

    ``buffers``: the pipeline's receive buffers (``cost.recv_buffers``); None: one ``out_bytes``
    each way.

    ``allocator_cache``: what the CUDA caching allocator keeps cached at the peak besides the
    live tensors, ``options.allocator_peak_share`` of the largest one-layer working set ``layer_peak``
    (``CostOptions.allocator_peak_share``, measured: ``nest_fx.cost.allocator``); the other terms
    sum to the live (allocated) bytes, :func:`live_bytes`."""
    mem = {k: states[k] + expert_states[k] for k in ("weights", "grads", "optimizer")}
    grads = mem["grads"]  # all there during the optimizer step
    mem["activations"] = held_act + layer_peak
    if num_microbatches == 1:
        grads_later = mem["grads"] >= mem["activations"]
        mem["activations"], mem["grads"] = (
            np.where(grads_later, 0.0, mem["activations"]),
            np.where(grads_later, mem["grads"], 0.0),
        )
        if not isinstance(grads_later, np.ndarray):
            mem["activations"], mem["grads"] = float(mem["activations"]), float(mem["grads"])
    mem["buffers"] = 2 * out_bytes if buffers is None else buffers  # cost.recv_buffers: the pipeline's
    late = unsharded_grads - mem["activations"]
    mem["fsdp_unsharded"] = unsharded_params + positive_part(late)
    during = mem["grads"] + mem["activations"] + mem["buffers"] + mem["fsdp_unsharded"]
    if options is not None and options.master_weights:
        during = during + mem["weights"]
    excess = grads + optimizer_scratch - during
    mem["optimizer_step"] = positive_part(excess)
    mem["allocator_cache"] = (options.allocator_peak_share if options is not None else 0.0) * layer_peak
    mem["total"] = sum(mem[k] for k in MEMORY_TERMS)
    return mem


def live_bytes(breakdown: Mapping[str, Count]) -> Count:
    """The live (allocated) bytes of a stage's memory breakdown: its total less what the
    allocator keeps cached (``torch.cuda.max_memory_allocated``'s counterpart)."""
    return breakdown["total"] - breakdown.get("allocator_cache", 0.0)


# -- capacity -------------------------------------------------------------------------------


def usable_bytes(device_memory_bytes: float, options: CostOptions) -> float:
    """Bytes a stage's memory total (live bytes and ``allocator_cache``) may reach on one device:
    its memory times ``options.usable_memory_fraction`` (the CUDA context, NCCL's buffers and
    cuBLAS workspaces, outside PyTorch's allocator, take the rest), over ``1 +
    options.allocator_overhead`` (:func:`reserved_bytes`): a plan fits when what the allocator
    reserves fits."""
    return device_memory_bytes * options.usable_memory_fraction / (1.0 + options.allocator_overhead)


def reserved_bytes(allocated_bytes: Count, options: CostOptions) -> Count:
    """Bytes PyTorch's caching allocator reserves (``torch.cuda.max_memory_reserved``) at a peak
    whose memory total is ``allocated_bytes`` (the live bytes and the ``allocator_cache`` term):
    ``(1 + allocator_overhead)`` times (``nest_fx.cost.allocator``; docs/cost_model.md)."""
    return allocated_bytes * (1.0 + options.allocator_overhead)


def check_fits(breakdown: Mapping[str, float], capacity_bytes: float) -> Tuple[bool, Optional[str]]:
    """``(total <= capacity_bytes, binding term)``: the binding term is the largest entry when the
    breakdown does not fit, else None.

    ``breakdown`` maps term names to bytes; a ``"total"`` entry, if present, is not a term and
    must equal the sum of the others (a stale total raises ValueError).
    """
    capacity = require_number(capacity_bytes, "capacity_bytes")
    terms = {k: require_number(v, f"breakdown[{k!r}]") for k, v in breakdown.items() if k != "total"}
    if not terms:
        raise ValueError("breakdown: needs at least one term besides 'total'")
    total = sum(terms.values())
    if "total" in breakdown and not math.isclose(breakdown["total"], total, rel_tol=1e-9, abs_tol=1.0):
        raise ValueError(f"breakdown['total']: {breakdown['total']!r} is not the sum of the terms ({total!r})")
    if total <= capacity:
        return True, None
    return False, str(max(terms, key=terms.__getitem__))
