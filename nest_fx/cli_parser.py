"""The ``nest-fx`` argument parser: the commands, their flags and the argument types (``--dtype``,
positive counts, seconds), each handled by ``cli_commands`` or ``cli_profile``.

Only torch-free modules are imported: ``--help`` and argument errors are answered before torch
loads (``nest_fx.cli``).
"""

from __future__ import annotations

import argparse

from nest_fx.cli_commands import cmd_explain, cmd_export, cmd_plan, cmd_simulate, cmd_trace
from nest_fx.cli_profile import cmd_profile, int_list
from nest_fx.common.limits import MAX_COUNT
from nest_fx.plan.setting_flags import add_constraint_flags, add_option_flag
from nest_fx.plan.settings import OPTIONS, OVERLAPS, SIMULATED_RUN_OPTIONS

DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}

MODEL_HELP = (
    "zoo name (llama2-7b, ...), spec (gpt:hidden=..,layers=..), plain model (mlp:.., cnn:..), any "
    "transformers architecture as hf:<model_type>[:field=value,...] (its default config shrunk to a tiny "
    "model; e.g. hf:qwen2:hidden_size=64,num_hidden_layers=2, hf:t5, hf:vit, hf:mixtral-8x7b), or "
    "hf-config:PATH[:field=value,...] for a local config.json"
)


def _dtype(name: str) -> str:
    """A --dtype value as fp32, bf16 or fp16 (the handlers make it a torch dtype)."""
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}: use one of {sorted(DTYPES)}")
    return DTYPES[name]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{value} is larger than nest-fx handles (at most {MAX_COUNT:,})")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser, from_plan: bool = False) -> None:
    """--model/--workload, --cluster, --seq, --dtype, --profile; ``from_plan``: each defaults to
    what the plan file records (simulate, explain)."""
    planned = " (default: the plan's)" if from_plan else ""
    p.add_argument("--model", help=MODEL_HELP + " (traced and costed analytically)" + planned)
    p.add_argument("--workload", metavar="FILE", help="a nest-fx-workload/1 layer table instead of --model")
    p.add_argument(
        "--cluster",
        required=not from_plan,
        help="preset (dgx-a100, dgx-h100, h100-spine-leaf, "
        "tpuv4-fat-tree, cpu-gloo) as NAME:DEVICES, a cluster or topology YAML/JSON file, or a "
        "topology generator: rail:NODES[xGPUS][,group=N,spines=S,oversub=R], "
        "fat-tree:NODES[xGPUS][,leaf=N,spines=S,oversub=R], torus:AxB[xC] (docs/topology.md)" + planned,
    )
    p.add_argument("--devices", type=_positive, help="device count for a preset (or NAME:DEVICES)")
    p.add_argument(
        "--seq",
        type=_positive,
        default=None,
        help="sequence length (default: "
        + (
            "the plan's, else the model's)"
            if from_plan
            else "the model's; an HF model's config positions (max_position_embeddings), at most 4096)"
        ),
    )
    p.add_argument(
        "--dtype",
        type=_dtype,
        help="training dtype (default: "
        + ("the plan's precision)" if from_plan else "bf16, recorded as precision bf16-mixed; fp32)"),
    )
    p.add_argument(
        "--profile",
        metavar="P.json",
        help="measured op times from `nest-fx profile` (the analytical model covers ops the profile lacks)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``nest-fx`` parser: one subcommand per handler, each with its flags."""
    parser = argparse.ArgumentParser(
        prog="nest-fx", description="Trace, cost and plan hybrid parallelism for PyTorch models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("trace", help="trace a model on meta tensors; per-block table")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--batch", type=_positive, default=1, help="batch size of the example input (default 1)")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, help="parameter/activation dtype (default bf16)")
    p.add_argument("--method", choices=("auto", "fx", "export"), default="auto", help="tracer (default auto)")
    p.add_argument("--leaf", action="append", metavar="FQN", help="treat this module as one op (repeatable)")
    p.add_argument("--all-blocks", action="store_true", help="one row per layer instead of grouping identical ones")
    p.add_argument("--json", metavar="FILE", help="write the OpGraph summary as JSON")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("plan", help="search the fastest plan that fits (NEST DP) and compare with baselines")
    _add_model_args(p)
    p.add_argument("--global-batch", type=_positive, default=4096, help="sequences per step (default 4096)")
    p.add_argument("--json", metavar="PLAN.json", help="write the plan (format nest-fx-plan/1)")
    p.add_argument(
        "--time-budget",
        type=_seconds,
        default=60.0,
        help="seconds for the search and the baselines: "
        "the best plan so far is returned when they run out, and the baselines stop with theirs (default 60)",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip the Megatron/torchtitan/Phaze/MCMC comparison")
    c = p.add_argument_group(
        "constraints", "what the plan must satisfy (recorded in the plan file; docs/solver.md#constraints)"
    )
    add_constraint_flags(c)  # one flag per declared setting (nest_fx.plan.settings)
    p.add_argument("--mcmc-evals", type=_positive, default=2000, help="MCMC baseline evaluations (default 2000)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "profile",
        help="measure per-op times of a model on this machine's device (JSON profile), "
        "or collective bandwidth per network level (--calibrate, cluster YAML)",
    )
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--out", required=True, help="profile JSON (or cluster YAML with --calibrate)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device to profile on (default: cuda when available)")
    p.add_argument(
        "--tp", type=int_list, default=[1], help="TP degrees whose local shard shapes to profile, e.g. 1,2,4,8"
    )
    p.add_argument("--mbs", type=int_list, default=[1], help="microbatch sizes to profile, e.g. 1,2,4")
    p.add_argument("--seq", type=_positive, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", type=_dtype, help="dtype (default bf16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per op (default 2)")
    p.add_argument("--repeats", type=_positive, default=5, help="timed runs per op; the median is kept (default 5)")
    p.add_argument("--append", action="store_true", help="add to an existing profile at --out (reuse its entries)")
    p.add_argument("--calibrate", action="store_true", help="measure collectives and fit the cluster's levels")
    p.add_argument(
        "--pairwise",
        action="store_true",
        help="with --calibrate: measure p2p bandwidth and latency "
        "between every pair of ranks and write a graph topology (nest-fx-topology/1) to --out; "
        "with --cluster its routes are derated to the measurements, without it the ranks get direct links",
    )
    p.add_argument("--cluster", help="with --calibrate: the cluster to fit (NAME:DEVICES or file)")
    p.add_argument("--devices", type=_positive, help="device count for a preset")
    p.add_argument(
        "--nproc", type=_positive, default=2, help="with --calibrate outside torchrun: local ranks (default 2)"
    )
    p.add_argument(
        "--sizes-kib",
        type=int_list,
        default=[4, 64, 1024, 4096, 16384],
        help="with --calibrate: message sizes in KiB (default 4,64,1024,4096,16384)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("simulate", help="predict step time and memory of a plan file")
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="a nest-fx-plan/1 file")
    _add_model_args(p, from_plan=True)
    p.add_argument("--json", metavar="FILE", help="write the prediction as JSON")
    p.add_argument(
        "--compile",
        action="store_true",
        help="cost the plan with torch.compile on (as if plan.compile were true; the file is not changed)",
    )
    p.add_argument(
        "--float8",
        action="store_true",
        help="cost the plan with Float8 linears (as if plan.float8 were true; the file is not changed)",
    )
    for s in OPTIONS:  # --precision, --kernels
        if s.scope == "plan":
            add_option_flag(
                p, s.name, f"cost the plan with this {s.name} instead of the plan's (the file is not changed): "
            )
    for name in OVERLAPS:
        add_option_flag(p, name, "cost the plan with this overlap share instead of the plan's: ")
    for name in SIMULATED_RUN_OPTIONS:  # optimizer_kernel, expert_dispatch, expert_routing
        add_option_flag(p, name, f"cost the plan with this {name.replace('_', ' ')} instead of the plan's: ")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "explain",
        help="a plan in words: rank layout per network level, memory bars, "
        "step-time breakdown, pipeline timeline (PNG)",
    )
    p.add_argument("plan", metavar="PLAN.json", help="a nest-fx-plan/1 file")
    _add_model_args(p, from_plan=True)
    p.add_argument("--png", metavar="OUT.png", help="draw the pipeline timeline (needs matplotlib: extra 'plot')")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser(
        "export",
        help="write a checkpoint's model as HuggingFace safetensors shards, their index and "
        "config.json (transformers from_pretrained loads the directory)",
    )
    p.add_argument(
        "checkpoint", metavar="CKPT", help="a checkpoint directory (its newest checkpoint) or a step directory"
    )
    p.add_argument("--to", choices=("hf",), required=True, help="the format (hf: HuggingFace safetensors)")
    p.add_argument("directory", metavar="DIR", help="where to write; must not exist or be empty (see --overwrite)")
    p.add_argument(
        "--model", help="the model the checkpoint holds (default: the spec its plan recorded); " + MODEL_HELP
    )
    p.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file: 5GB (default), 500MiB, ...")
    p.add_argument(
        "--dtype", type=_dtype, default=None, help="write floating tensors in this dtype (default: as saved)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR as a whole")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of the checkpoint's files (sizes are still checked)",
    )
    p.set_defaults(func=cmd_export)
    return parser
