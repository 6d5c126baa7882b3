"""What the cost model takes besides the plan: :class:`CostOptions`."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Optional, Tuple

from nest_fx.cost.allocator import allocator_slack
from nest_fx.cost.optimizers import kernel_value_problem, optimizer_cost, step_cost
from nest_fx.plan.settings import OVERLAPS, setting

# device memory left unused: the CUDA context, NCCL buffers and cuBLAS workspaces (the declared
# default of the memory_headroom setting, nest_fx.plan.settings)
MEMORY_HEADROOM = setting("memory_headroom").default
USABLE_MEMORY_FRACTION = 1.0 - MEMORY_HEADROOM  # 0.95
# Async TP (torch's micro-pipelined all-gather/matmul and matmul/reduce-scatter, as torchtitan runs it
# with torch.compile) hides about a quarter of the TP collectives: measured from torchtitan's published
# H100 benchmark (Table 4: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8; AsyncTP 876 vs 829 tokens/s/GPU =
# 1.057x; the cost model reproduces 1.057x with 0.23 and 1.31x with full overlap). docs/cost_model.md
ASYNC_TP_OVERLAP = 0.25


@dataclass
class CostOptions:
    """Knobs of the cost model that are not part of the plan."""

    optimizer: str = "adam"  # a key of nest_fx.cost.optimizers.OPTIMIZERS: adam, adamw, sgd-momentum, sgd
    # how torch.optim runs its step: for-loop, foreach, fused; '' = torch's default on the device
    # (nest_fx.cost.optimizers.resolved_kernel: foreach on GPUs, the for-loop on CPUs)
    optimizer_kernel: str = ""
    param_bytes: int = 2  # training dtype (bf16)
    grad_bytes: int = 2
    master_weights: bool = True  # mixed precision keeps an fp32 copy of the weights in the optimizer
    # gradients as data parallelism reduces them (bytes per element); None: as held (grad_bytes).
    # bf16-mixed reduces in fp32 (FSDP2 MixedPrecisionPolicy(reduce_dtype=float32)): 4
    reduce_bytes: Optional[int] = None
    state_bytes: int = 4  # width of the optimizer's state tensors (bf16-true keeps them in bf16: 2)
    # Overlap of communication with compute, each a share in [0, 1] hidden under the compute that
    # can cover it (docs/cost_model.md, "Overlap"; the declared defaults of the overlap_* settings,
    # nest_fx.plan.settings: what nest-fx's runtime does). True/False read as 1/0.
    overlap_grad_sync: float = setting("overlap_grad_sync").default
    bytes_per_param_update: Optional[float] = None  # None: the optimizer's (KernelCost.update_bytes)
    optimizer_mem_efficiency: float = 0.7
    memory_headroom: float = MEMORY_HEADROOM  # the memory_headroom setting (one name everywhere)
    # the CUDA caching allocator's segment mode: what it reserves beyond the live tensors
    # (nest_fx.cost.allocator, measured; the allocator_segments setting: the runtime's default)
    allocator_segments: str = setting("allocator_segments").default
    # What a pipelined runtime keeps of each chunk's output from its forward to its backward
    # (memory.held_per_microbatch): "sharded" (nest-fx and torchtitan: torch's PipelineStage caches
    # it in fwd_cache, and under sequence parallelism a stage hands on its blocks' 1/t shard:
    # apply.tensor_parallel.sharded_cut), "full" (a runtime whose stages end on full sequences),
    # "freed" (Megatron-LM, Meta's Llama 3 stack: freed after the send)
    stage_outputs: str = setting("stage_outputs").default
    # How data parallelism holds the model states under ZeRO-1 (memory.working_sets): "fsdp"
    # (nest-fx, torchtitan: FSDP2 keeps each unit's local shard next to its gathered copy) or
    # "distributed-optimizer" (Megatron-LM: whole bf16 parameter and gradient buffers, only the fp32
    # master weights and the optimizer states sharded; the shard is a view of the buffer)
    state_buffers: str = setting("state_buffers").default
    # Pipeline sends run under compute: torch.distributed.pipelining issues them asynchronously
    # and waits only before the data is needed (results.microbatch_time).
    overlap_p2p: float = setting("overlap_p2p").default
    # TP collectives under the GEMMs (async TP, as torchtitan runs it with torch.compile: a measured
    # share); the runtime's DTensor TP does not overlap them (step_time.exposed_comms).
    overlap_tp_comm: float = setting("overlap_tp_comm").default
    overlap_ep_comm: float = setting("overlap_ep_comm").default  # expert all-to-alls
    # how a token's experts spread over them: the ranks a per-rank expert dispatch sends it to
    # (nest_fx.workload.expert_dispatch; the expert_routing setting)
    expert_routing: str = setting("expert_routing").default
    expert_dispatch: str = setting("expert_dispatch").default  # '': what the runtime sends
    overlap_cp_comm: float = setting("overlap_cp_comm").default  # context-parallel key/value exchange
    # Host-side work the runtime adds to each collective call, as (seconds per call, seconds per
    # byte of the collective's buffer): DTensor dispatch and copies around a TP/EP collective,
    # FSDP's copy-in/out and bookkeeping around each unit's all-gather/reduce-scatter.
    # 0 by default (on GPUs the host runs ahead of the device); profiler.runtime_overhead
    # measures them where they show (CPU ranks).
    tp_call_overhead: Tuple[float, float] = (0.0, 0.0)
    fsdp_call_overhead: Tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        optimizer_cost(self.optimizer)  # a ValueError naming the known optimizers
        problem = kernel_value_problem(self.optimizer_kernel)
        if problem:
            raise ValueError(problem)
        for name in OVERLAPS:
            value = float(getattr(self, name))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: a share in [0, 1], got {value!r}")
        allocator_slack(self.allocator_segments)  # a ValueError naming the modes
        for name in ("expert_routing", "expert_dispatch", "stage_outputs", "state_buffers"):
            if problem := setting(name).check(getattr(self, name)):
                raise ValueError(f"{name}: {problem}")

    @property
    def usable_memory_fraction(self) -> float:
        """Device memory the plan may use: 1 - ``memory_headroom``."""
        return 1.0 - self.memory_headroom

    @property
    def allocator_overhead(self) -> float:
        """Share of the priced live bytes the caching allocator reserves on top
        (``nest_fx.cost.allocator``, per ``allocator_segments``)."""
        return allocator_slack(self.allocator_segments).ratio

    @property
    def allocator_peak_share(self) -> float:
        """Share of a stage's largest one-layer backward working set the allocator keeps cached
        at the peak (``memory.stage_memory``'s ``allocator_cache`` term)."""
        return allocator_slack(self.allocator_segments).peak_share

    def update_bytes_per_param(self, device=None) -> float:
        """Bytes one optimizer step moves per updated parameter: ``bytes_per_param_update`` when
        set, else the optimizer's as ``optimizer_kernel`` runs it on ``device`` (a ``DeviceSpec``;
        ``nest_fx.cost.optimizers``)."""
        if self.bytes_per_param_update is not None:
            return self.bytes_per_param_update
        update = step_cost(self.optimizer, self.optimizer_kernel, device).update_bytes
        return update * self.state_bytes / 4  # the table counts fp32

    def reduce_dtype_bytes(self) -> int:
        """Bytes per gradient element data parallelism moves: ``reduce_bytes``, else ``grad_bytes``."""
        return self.reduce_bytes if self.reduce_bytes is not None else self.grad_bytes

    @classmethod
    def for_dtype(cls, dtype_bytes: int, **overrides) -> "CostOptions":
        """Options for training whose parameters are ``dtype_bytes`` wide: 2 (bf16/fp16) is mixed
        precision (fp32 master weights in the optimizer, the default); 4 is plain fp32 training,
        where the optimizer keeps no second copy of the weights (K = 8 for Adam)."""
        if dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes: 2 (bf16/fp16) or 4 (fp32), got {dtype_bytes!r}")
        fields = dict(param_bytes=dtype_bytes, grad_bytes=dtype_bytes, master_weights=dtype_bytes < 4)
        fields.update(overrides)
        return cls(**fields)


def with_async_tp(options: CostOptions) -> CostOptions:
    """``options`` as a plan with ``async_tp`` runs: at least ``ASYNC_TP_OVERLAP`` of the TP
    collectives under the matmuls (a larger ``overlap_tp_comm`` the user set is kept)."""
    return dataclasses.replace(options, overlap_tp_comm=max(float(options.overlap_tp_comm), ASYNC_TP_OVERLAP))
