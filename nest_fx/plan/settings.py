"""Every plan setting, declared once: name, type, allowed values, default, doc, flag and role.

Made from these declarations (nothing else lists the settings):

* :class:`nest_fx.plan.Plan`'s fields, their defaults and the type and value checks of a plan
  file (``Plan.from_dict``, ``Plan.validate``);
* the vocabulary of :class:`nest_fx.plan.constraints.Constraints` (``fix``/``min``/``max`` of the
  degrees and flags, the lists of allowed values, the training options);
* the constraint flags of ``nest-fx plan`` (``add_constraint_flags``) and their conversion
  into constraints (``constraints_data``), and the plan flags of ``examples/_common.py``
  (``nest_fx.plan.setting_flags``);
* the search space: the planner's options (``SolverOptions``: one field per setting with a
  :attr:`Setting.search`, e.g. ``tp_degrees``, ``zero_stages``, ``compile``, ``precision``) and
  its per-configuration settings (``GlobalConfig``), both in ``nest_fx.solver.space``.

The type of a declaration, its roles and scopes: :class:`~nest_fx.plan.setting.Setting`.
Only the standard library and ``nest_fx.common`` are imported: the command line builds its
parser from this module before it imports torch. Adding a setting: docs/architecture.md,
"Adding a setting".
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from nest_fx.plan.setting import (  # noqa: F401  (re-exported: plan.py, the planner and tests import them from here)
    ROLES,
    SCOPES,
    UNSEARCHED,
    Setting,
    add_fields,
    fields_of,
)
from nest_fx.plan.vocabulary import (
    ANY_INTERLEAVE,
    ATTENTION_KERNELS,
    KERNELS,
    LOSS_KERNELS,
    NORM_KERNELS,
    PLACEMENTS,
    PRECISIONS,
)
from nest_fx.plan.vocabulary import SCHEDULES, zero_problem
from nest_fx.plan.vocabulary import microbatch_size_problem, placement_problem, recompute_problem, schedule_problem
from nest_fx.plan.run_settings import RUN_OPTIONS

# every per-layer policy and a ladder of layer intervals; the search drops those another policy
# beats in both time and memory (solver.range_classes.undominated_modes)
SEARCHED_RECOMPUTE = ("none", "op:matmuls", "op", "op:attention", "selective", "full", "every:2", "every:3", "every:4")

SETTINGS: Tuple[Setting, ...] = (
    # -- degrees (searched; Constraints fix/min/max) ------------------------------------------
    Setting(
        "tp",
        int,
        1,
        "tensor-parallel degree of a stage",
        "degree",
        scope="stage",
        minimum=1,
        example_flag="--tp",
        search=(1, 2, 4, 8),
    ),
    Setting(
        "pp",
        int,
        1,
        "pipeline stages (the number of stages)",
        "degree",
        scope="derived",
        minimum=1,
        example_flag="--pp",
    ),
    Setting("dp", int, 1, "data-parallel replicas of the pipeline", "degree", minimum=1),
    Setting(
        "ep",
        int,
        1,
        "expert-parallel degree: ep consecutive replicas split the experts (divides dp)",
        "degree",
        minimum=1,
        example_flag="--ep",
        search=None,
    ),
    Setting(
        "cp",
        int,
        1,
        "context parallel: each stage replica's sequence is split over cp x tp devices",
        "degree",
        minimum=1,
        example_flag="--cp",
        search=(1, 2, 4, 8),
    ),
    Setting(
        "zero",
        int,
        0,
        "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (FSDP2; e.g. 3)",
        "choice",
        values=(0, 1, 2, 3),
        allowed="zero_stages",
        flag="--zero",
        metavar="Z[,Z]",
        entry_check=zero_problem,
        example_flag="--zero",
        search=(0, 1, 2, 3),
    ),
    Setting(
        "cp_mode",
        str,
        "allgather",
        "how context parallelism exchanges K/V: allgather (gathered before "
        "attention) or ring (blocks passed around the CP ring, each transfer under the previous block's "
        "attention); the planner keeps allgather",
        "record",
        values=("allgather", "ring"),
    ),
    Setting(
        "dp_shard",
        int,
        0,
        "HSDP: shard over groups of dp_shard consecutive replicas, replicate across; 0 = all of dp",
        "degree",
        minimum=0,
        example_flag="--dp-shard",
    ),
    # -- flags (Constraints fix) ---------------------------------------------------------------
    Setting(
        "loss_parallel",
        bool,
        False,
        "vocabulary-parallel cross-entropy over the last stage's TP group",
        "flag",
        example_flag="--loss-parallel",
        search=None,
    ),
    Setting(
        "compile",
        bool,
        False,
        "torch.compile each block (costed: fused elementwise ops, fewer launches; docs/cost_model.md)",
        "flag",
        flag="--compile",
        example_flag="--compile",
        search=False,
    ),
    Setting(
        "float8",
        bool,
        False,
        "Float8 linears (torchao) on devices with fp8 tensor cores (costed: fp8 GEMM "
        "rate, casts, fp8 weight all-gathers; docs/cost_model.md)",
        "flag",
        flag="--float8",
        search=False,
    ),
    Setting(
        "async_tp",
        bool,
        False,
        "async TP: PyTorch's micro-pipelined TP (inductor fuses sequence parallelism's "
        "all-gather / reduce-scatter with the matmuls over symmetric memory); needs tp > 1, sequence_parallel, "
        "compile and CUDA (costed: TP collectives under the stage's compute; docs/cost_model.md)",
        "flag",
        flag="--async-tp",
        search=False,
    ),
    Setting(
        "pp_shard_grads",
        bool,
        False,
        "pipelined FSDP keeps ZeRO-2/3's sharded gradients: every microbatch's gradients are "
        "reduce-scattered after its backward and accumulated sharded in the reduce dtype, as Llama 3's FSDP "
        "shards them (costed: m reduce-scatters per step, no unsharded gradients held); off: "
        "torch.distributed.pipelining's default, unsharded gradients held until the last microbatch (pipelined "
        "ZeRO-2/3 hold ZeRO-1's memory). No effect without pipelining or below zero 2; not with the split-backward "
        "schedules (docs/cost_model.md)",
        "flag",
        flag="--pp-shard-grads",
        search=False,
    ),
    # -- training options (costed, never relaxed) ----------------------------------------------
    Setting(
        "precision",
        str,
        "",
        "fp32 | bf16-mixed (bf16 parameters and compute, fp32 master weights, "
        "optimizer states and gradient reduction) | bf16-true (everything bf16); '' = not recorded (costed "
        "as the cost options say; the runtime keeps the model's dtype). Planner default: bf16-mixed on "
        "devices with bf16 matrix units, fp32 elsewhere",
        "option",
        values=("",) + PRECISIONS,
        flag="--precision",
        example_flag="--precision",
        search=None,
    ),
    Setting(
        "kernels",
        str,
        "",
        "the kernel backend the plan is costed with: eager (PyTorch ops one kernel each: "
        "nest-fx's runtime), compile (torch.compile per block: the runtime with compile), fused (Transformer "
        "Engine / Megatron-LM fused norm, RoPE, SwiGLU and FlashAttention-3 attention: to predict those "
        "systems); '' = compile when compile is set, else eager (docs/cost_model.md, Kernel backends)",
        "option",
        values=("",) + KERNELS,
        flag="--kernels",
        search=None,
    ),
    Setting(
        "attention_kernel",
        str,
        "",
        "PyTorch SDPA's fused attention kernel on CUDA, which the runtime pins and the cost model prices at its "
        "measured rate: cudnn (PyTorch's own choice on Hopper/Blackwell since torch 2.11), flash "
        "(FlashAttention-2: PyTorch's choice before, e.g. torchtitan's 2024 runs); '' = cudnn. Calls that kernel "
        "cannot run (fp32, some masks) fall back to PyTorch's next choice. Not used by kernels=fused "
        "(FlashAttention-3 rates) (docs/cost_model.md, Attention kernels)",
        "option",
        values=("",) + ATTENTION_KERNELS,
        flag="--attention-kernel",
        search=None,
    ),
    Setting(
        "norm_kernel",
        str,
        "",
        "how the runtime runs the model's RMSNorms that F.rms_norm computes (found by a probe: HF Llama/Qwen/"
        "Mistral-style, Meta's reference, the zoo's; not Gemma's 1 + weight): fused (PyTorch's F.rms_norm, one "
        "kernel each way on CUDA, keeping the input and an fp32 statistic per row), model (the model's own code, "
        "e.g. fp32 op by op with fp32 copies kept), memory-efficient (as apex's memory_efficient norms and "
        "Megatron-LM's --memory-efficient-layer-norm: the norm keeps its output, which the projections reading "
        "it keep anyway, instead of its input: 2 bytes per token per hidden unit less per bf16 norm, torch.nn."
        "RMSNorm included; not with compile; refused for a weight with zero entries); '' = fused. Norms sharded "
        "by sequence parallelism keep the model's code; torch.nn.RMSNorm is F.rms_norm unless memory-efficient "
        "(docs/cost_model.md, Kernel backends)",
        "option",
        values=("",) + NORM_KERNELS,
        flag="--norm-kernel",
        search=None,
    ),
    Setting(
        "loss_kernel",
        str,
        "",
        "how the runtime runs the loss on full logits: eager (the loss function as given; a token cross "
        "entropy keeps fp32 log-probabilities and its backward two fp32 logit-sized gradients), compile "
        "(torch.compile'd, as torchtitan does since April 2025: its fused cross entropy keeps the logits in their "
        "dtype and its backward writes only their gradient, 12 of 16 bytes per bf16 logit less at the peak); "
        "'' = eager. Under loss parallelism the vocabulary-parallel loss runs: in place (its backward turns the "
        "kept softmax into the gradient) unless eager, which computes the gradient in new tensors as an op-by-op "
        "loss such as PyTorch's DTensor loss_parallel does (docs/cost_model.md, The loss; Loss parallel)",
        "option",
        values=("",) + LOSS_KERNELS,
        flag="--loss-kernel",
        search=None,
    ),
    Setting("seq_len", int, 0, "the sequence length the plan was made for; 0 = not recorded", "record", minimum=0),
    # -- choices (Constraints lists of allowed values) -----------------------------------------
    Setting(
        "microbatch_size",
        int,
        1,
        "sequences per microbatch (e.g. 2)",
        "choice",
        minimum=1,
        allowed="microbatch_sizes",
        flag="--microbatch",
        metavar="B[,B]",
        entry_check=microbatch_size_problem,
        search=(1, 2, 4, 8),
    ),
    Setting(
        "num_microbatches",
        int,
        1,
        "microbatches per step and replica",
        "record",
        minimum=1,
        example_flag="--microbatches",
    ),
    Setting(
        "schedule",
        str,
        "1f1b",
        "pipeline schedule: 1f1b, gpipe, interleaved or interleaved-zb (the "
        "planner's interleave factors), interleaved:V, interleaved-zb:V, zbv or dualpipev",
        "choice",
        values=SCHEDULES,
        allowed="schedules",
        flag="--schedule",
        metavar="S[,S]",
        entry_check=schedule_problem,
        example_flag="--schedule",
        # dualpipev is searched when named (--schedule): torch runs its paired forward and backward one
        # after the other, so it costs zbv's time with more memory (cost/schedules.py), never better
        search=(("1f1b", 1), ("interleaved", ANY_INTERLEAVE), ("interleaved-zb", ANY_INTERLEAVE), ("zbv", 2)),
    ),
    Setting(
        "virtual_stages",
        int,
        1,
        "model chunks per device (the interleaved schedules' v; 2 for zbv and dualpipev)",
        "record",
        minimum=1,
    ),
    Setting(
        "sequence_parallel",
        bool,
        False,
        "shard TP activations on the sequence dim between regions",
        "flag",
        example_flag="--sequence-parallel",
        search=True,
    ),
    Setting(
        "placement",
        str,
        "stage-major",
        "how stages and replicas sit on the rank order",
        "choice",
        values=PLACEMENTS,
        allowed="placements",
        flag="--placement",
        metavar="P[,P]",
        entry_check=placement_problem,
        search=PLACEMENTS,
    ),
    Setting(
        "recompute",
        str,
        "none",
        "activation recomputation of a stage: none, full, every:K (every K-th "
        "block), op (torchtitan's op-level selective checkpointing), op:POLICY, selective (attention core "
        "only); the planner tries all, dropping those never better in time and memory",
        "choice",
        scope="stage",
        allowed="recompute",
        flag="--recompute",
        metavar="R[,R]",
        entry_check=recompute_problem,
        example_flag="--recompute",
        search=SEARCHED_RECOMPUTE,
    ),
    # -- records -------------------------------------------------------------------------------
    Setting("model", str, "", "the model the plan was made for", "record"),
    Setting("model_fingerprint", str, "", "chain_fingerprint of the model's layer chain; '' = not recorded", "record"),
    Setting(
        "num_layers",
        int,
        0,
        "length of the workload chain the stage ranges index; 0 = not recorded",
        "record",
        minimum=0,
    ),
    Setting("world_size", int, 0, "devices of the cluster it was planned for; 0 = not recorded", "record", minimum=0),
    Setting("cluster", str, "", "the cluster it was planned for: preset NAME:DEVICES or a cluster file path", "record"),
    Setting(
        "device_order",
        list,
        None,
        "plan rank r runs on cluster rank device_order[r]; absent = identity",
        "record",
        optional=True,
        annotation="Optional[List[int]]",
    ),
    Setting(
        "constraints",
        dict,
        None,
        "what the user fixed or bounded when planning (absent: nothing)",
        "record",
        optional=True,
        annotation="Optional[Constraints]",
    ),
    Setting(
        "predicted",
        dict,
        None,
        "what the planner predicted (step time, memory, ...)",
        "record",
        factory=dict,
        annotation="Dict[str, float]",
    ),
    Setting("notes", str, "", "free text", "record"),
) + RUN_OPTIONS

BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
PLAN_SETTINGS = tuple(s for s in SETTINGS if s.scope == "plan")
STAGE_SETTINGS = tuple(s for s in SETTINGS if s.scope == "stage")
DEGREES = tuple(s.name for s in SETTINGS if s.role == "degree")  # tp, pp, dp, ep, cp, dp_shard
FLAGS = tuple(
    s.name for s in SETTINGS if s.role == "flag"
)  # loss_parallel, compile, float8, async_tp, pp_shard_grads, sequence_parallel
CHOICES = tuple(s for s in SETTINGS if s.role == "choice")  # each with its Constraints list
OPTIONS = tuple(s for s in SETTINGS if s.role == "option")  # precision, kernels, optimizer, memory_headroom, overlap_*
# the overlap shares (CostOptions fields of the same names; docs/cost_model.md, "Overlap")
OVERLAPS = tuple(s.name for s in SETTINGS if s.name.startswith("overlap_"))
# the other run options ``simulate`` takes as flags, recorded in the plan's constraints beside the shares
SIMULATED_RUN_OPTIONS = ("optimizer_kernel", "expert_dispatch", "expert_routing", "stage_outputs", "state_buffers")
# run options that price another system's runtime: nest-fx's runtime runs only their defaults and refuses a
# plan priced with any other value (nest_fx.plan.priced_only); recorded in a plan only when given
PRICED_ONLY_OPTIONS = ("expert_dispatch", "stage_outputs", "state_buffers")
SEARCHED = tuple(s for s in SETTINGS if s.search is not UNSEARCHED)  # each a field of the planner's options
# flags the planner never turns on: the user's choice of how to train, costed when set (compile, float8, async_tp)
COSTED_FLAGS = tuple(s.name for s in SEARCHED if s.role == "flag" and s.search is False)


def setting(name: str) -> Setting:
    """The declaration of ``name``; KeyError naming the known settings."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown setting {name!r}; known: {sorted(BY_NAME)}") from None


def default(name: str) -> Any:
    """The declared default of setting ``name``."""
    s = setting(name)
    return s.factory() if s.factory is not None else s.default


def value_problem(name: str, value: object) -> str:
    """'' when ``value`` is an allowed value of setting ``name``, else ``"<name>: <what is wrong>"``."""
    problem = setting(name).check(value)
    return f"{name}: {problem}" if problem else ""
