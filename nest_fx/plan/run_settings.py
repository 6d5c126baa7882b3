"""The settings a plan is costed under but does not carry as its own fields (scope ``run``):
recorded in its constraints only (the memory headroom, the allocator's segments, the overlap
shares, the optimizer and its implementation). Part of :data:`nest_fx.plan.settings.SETTINGS`,
declared here to keep that module's size in bounds."""

from __future__ import annotations

from typing import Tuple

from nest_fx.plan.setting import Setting
from nest_fx.plan.vocabulary import (
    ALLOCATOR_SEGMENTS,
    EXPERT_DISPATCHES,
    EXPERT_ROUTINGS,
    OPTIMIZER_KERNELS,
    OPTIMIZER_NAMES,
    STAGE_OUTPUTS,
    STATE_BUFFERS,
    fraction_problem,
)

RUN_OPTIONS: Tuple[Setting, ...] = (
    # -- options recorded in the constraints only ----------------------------------------------
    Setting(
        "memory_headroom",
        float,
        0.05,
        "device memory to leave unused, a fraction in [0, 1) or a percentage "
        "(default 0.05: the CUDA context and allocator fragmentation), e.g. 0.1 or 10%",
        "option",
        scope="run",
        entry_check=fraction_problem,
        flag="--memory-headroom",
        metavar="F",
    ),
    Setting(
        "allocator_segments",
        str,
        "expandable",
        "the CUDA caching allocator's segments: expandable (PyTorch's expandable_segments:True, which "
        "nest-fx's runtime turns on unless PYTORCH_CUDA_ALLOC_CONF names expandable_segments) or fixed "
        "(PyTorch's default); what the allocator reserves beyond the live tensors is costed per mode, as "
        "measured on an H100 (docs/cost_model.md, Memory the allocator sees)",
        "option",
        scope="run",
        values=ALLOCATOR_SEGMENTS,
        flag="--allocator-segments",
    ),
    # overlap of communication with compute, as measured fractions (docs/cost_model.md, "Overlap")
    Setting(
        "overlap_tp_comm",
        float,
        0.0,
        "share of the TP collectives hidden under the stage's compute, 0..1 "
        "(0: DTensor TP, the runtime; 0.25: torchtitan's async TP, measured; 1: all)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-tp-comm",
        metavar="F",
    ),
    Setting(
        "overlap_ep_comm",
        float,
        0.0,
        "share of the expert all-to-alls hidden under compute, 0..1 (0: the runtime, which waits for them)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-ep-comm",
        metavar="F",
    ),
    Setting(
        "expert_dispatch",
        str,
        "",
        "what the expert all-to-alls send, to price another system's: slots (a row per routed "
        "(token, expert) pair or capacity slot: Megatron-LM's all-to-all dispatcher), per-rank (each token "
        "once per rank owning one of its experts: DeepEP's); '' = what nest-fx's runtime sends (the zoo MoE "
        "its capacity slots, HF stacked experts per rank), which it refuses to run otherwise "
        "(docs/cost_model.md, Expert dispatch)",
        "option",
        scope="run",
        values=("",) + EXPERT_DISPATCHES,
        flag="--expert-dispatch",
    ),
    Setting(
        "expert_routing",
        str,
        "",
        "how each token's k experts spread over the experts, which sets how many expert-parallel ranks a "
        "token is sent to where the runtime sends it once per rank (HF stacked experts): uniform (a learned "
        "router: the k experts anywhere), contiguous (k consecutive experts from a multiple of k, as NeMo "
        "AutoModel's balanced benchmark gate routes); '' = uniform (docs/cost_model.md, Expert dispatch)",
        "option",
        scope="run",
        values=("",) + EXPERT_ROUTINGS,
        flag="--expert-routing",
    ),
    Setting(
        "stage_outputs",
        str,
        "sharded",
        "what a pipelined runtime keeps of each chunk's output until the chunk's backward, to price another "
        "system's: sharded (its sequence shard where the stage ends on sequence-parallel blocks, else all of it: "
        "nest-fx's runtime and torchtitan), full (all of it), freed (nothing after the send: Megatron-LM); the "
        "runtime refuses a plan priced otherwise (docs/cost_model.md, Memory)",
        "option",
        scope="run",
        values=STAGE_OUTPUTS,
        flag="--stage-outputs",
    ),
    Setting(
        "state_buffers",
        str,
        "fsdp",
        "how data parallelism holds the model states it shards, to price another system's: fsdp (FSDP2: each "
        "unit's local shard beside its gathered copy, nest-fx's runtime and torchtitan), distributed-optimizer "
        "(Megatron-LM: whole bf16 parameter and gradient buffers, the fp32 states sharded); the runtime "
        "refuses a plan priced otherwise (docs/cost_model.md, Memory)",
        "option",
        scope="run",
        values=STATE_BUFFERS,
        flag="--state-buffers",
    ),
    Setting(
        "overlap_cp_comm",
        float,
        0.0,
        "share of the context-parallel key/value exchange hidden under "
        "attention, 0..1 (0: the runtime's all-gather before attention)",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-cp-comm",
        metavar="F",
    ),
    Setting(
        "overlap_grad_sync",
        float,
        1.0,
        "share of the FSDP/ZeRO gradient and parameter traffic that may run "
        "under the backward (FSDP2's prefetch and asynchronous reduce-scatter: 1), 0..1",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-grad-sync",
        metavar="F",
    ),
    Setting(
        "overlap_p2p",
        float,
        1.0,
        "share of the pipeline sends run under compute (the runtime's asynchronous sends: 1), 0..1",
        "option",
        scope="run",
        minimum=0.0,
        maximum=1.0,
        flag="--overlap-p2p",
        metavar="F",
    ),
    Setting(
        "optimizer",
        str,
        "adam",
        "the optimizer trained with: its state bytes and update traffic are costed "
        "(sgd is PyTorch's SGD without momentum)",
        "option",
        scope="run",
        values=OPTIMIZER_NAMES,
        flag="--optimizer",
    ),
    Setting(
        "optimizer_kernel",
        str,
        "",
        "how torch.optim runs the optimizer's step: for-loop, foreach or fused (one kernel); '' = torch's default: "
        "foreach on CUDA, for-loop on CPU (costed so per device; docs/cost_model.md, Optimizer step)",
        "option",
        scope="run",
        values=("",) + OPTIMIZER_KERNELS,
        flag="--optimizer-kernel",
    ),
)
