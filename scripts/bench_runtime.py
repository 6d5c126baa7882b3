#!/usr/bin/env python
"""Runtime overhead of nest-fx's rewriter against the same plan written by hand.

    python scripts/bench_runtime.py                                  # dp0, dp1 (ZeRO-1), tp; 2 ranks
    python scripts/bench_runtime.py --cases tp --steps 20 --rounds 5
    python scripts/bench_runtime.py --dp-hand allreduce              # zero=0 baseline: flat all-reduce

For every case the same zoo model (fp32, CPU, gloo, one thread per rank) is built twice from one
seed on each of ``--world`` local ranks (``nest_fx.apply.launch.launch``):

* A, nest-fx: ``auto_parallelize(model, ..., plan=uniform_plan(...))`` then
  ``pm.train_step(x, y); opt.step(); opt.zero_grad()``;
* B, by hand, the same plan written with PyTorch directly:

  =====  ==========================================  =============================================
  case   plan                                        hand-written
  =====  ==========================================  =============================================
  dp0    DP=2, zero=0                                ``DistributedDataParallel`` (buffers constant,
                                                     ``broadcast_buffers=False``); ``--dp-hand
                                                     allreduce``: one flat all-reduce after backward
  dp1    DP=2, zero=1                                FSDP2 ``fully_shard`` per block, then the root,
                                                     ``reshard_after_forward=False``
  tp     TP=2                                        ``parallelize_module``: Colwise q/k/v/gate/up,
                                                     Rowwise o/down, vocabulary-parallel embedding
                                                     (Rowwise) and LM head (Colwise, logits gathered)
  =====  ==========================================  =============================================

Same weights, same batches (the global batch, each DP rank taking its rows), SGD, ``lm_loss``.
Both variants live in the same processes and their steps are interleaved (A, B, A, B, ...; the
variant going first alternates every round): ``--warmup`` steps each, then ``--rounds`` rounds of
``--steps`` timed steps each. A step is timed between two barriers (forward, backward, gradient
sync, optimizer step, zero_grad) and its time is the maximum over ranks. Reported: median and
mean per-step time, the ratio nest-fx / hand of the medians (target <= ``--target``, 1.05 from the
issue), the ratio per round (spread), and the largest difference between the two variants' global
losses over all steps. The hand variant's loss is averaged over ranks after the timed loop (a hand
loop would not all-reduce it every step; nest-fx's ``train_step`` does, one scalar all-reduce).

Writes ``results/bench_runtime.json``; exit status 1 when a case misses the target or the losses
disagree by more than ``--loss-tol``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from _bench_common import table as github_table, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = {
    "dp0": dict(dp=2, tp=1, zero=0, label="DP=2 zero=0"),
    "dp1": dict(dp=2, tp=1, zero=1, label="DP=2 zero=1 (FSDP2)"),
    "tp": dict(dp=1, tp=2, zero=0, label="TP=2"),
}
DEFAULT_MODEL = "llama:hidden=256,layers=4,heads=8,seq=128,vocab=1024"
TP_COLWISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up")
TP_ROWWISE = ("attn.o_proj", "mlp.down")


# -- the hand-written variants ------------------------------------------------------------------


class HandStep:
    """The plan written by hand: setup in __init__, one training step in __call__."""

    def __init__(self, model, case: Dict[str, Any], batch: int, lr: float, dp_hand: str):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp, self.flat_sync = case["dp"], False
        self.per = batch // self.dp
        mesh = init_device_mesh("cpu", (self.world,))
        if case["tp"] > 1:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            # vocabulary-parallel embedding and LM head, as torchtitan writes them (the plan's own)
            styles = {
                "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            }
            for i in range(len(model.layers)):
                styles.update({f"layers.{i}.{n}": ColwiseParallel() for n in TP_COLWISE})
                styles.update({f"layers.{i}.{n}": RowwiseParallel() for n in TP_ROWWISE})
            parallelize_module(model, mesh, styles)
            self.module = model
        elif case["zero"] >= 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            self.module = model
        elif dp_hand == "ddp":
            import warnings

            from torch.nn.parallel import DistributedDataParallel

            with warnings.catch_warnings():  # broadcast_buffers is deprecated in favour of forward_sync_buffers
                warnings.simplefilter("ignore", FutureWarning)
                self.module = DistributedDataParallel(model, broadcast_buffers=False)
        else:  # "allreduce": one flat all-reduce of every gradient after backward
            self.module, self.flat_sync = model, True
        self.params = list(model.parameters())
        self.opt = torch.optim.SGD(self.params, lr=lr)

    def __call__(self, x, y):
        import torch
        import torch.distributed as dist
        from nest_fx.apply.losses import lm_loss

        if self.dp > 1:
            lo = self.rank * self.per
            x, y = x[lo : lo + self.per], y[lo : lo + self.per]
        loss = lm_loss(self.module(x), y)
        loss.backward()
        if self.flat_sync:
            with torch.no_grad():
                grads = [p.grad for p in self.params]
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat)
                flat.div_(self.dp)
                for g, v in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(v)
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


class NestStep:
    """The plan applied by nest-fx."""

    def __init__(self, model, cfg, case: Dict[str, Any], batch: int, lr: float, example):
        import torch
        from nest_fx.apply import auto_parallelize
        from nest_fx.apply.losses import lm_loss
        from nest_fx.plan import uniform_plan

        plan = uniform_plan(
            cfg.layers + 2,
            dp=case["dp"],
            tp=case["tp"],
            zero=case["zero"],
            microbatch_size=batch // case["dp"],
            num_microbatches=1,
            world_size=case["dp"] * case["tp"],
        )
        self.pm = auto_parallelize(model, example, global_batch_size=batch, loss_fn=lm_loss, plan=plan, verbose=False)
        self.opt = torch.optim.SGD(self.pm.parameters(), lr=lr)

    def __call__(self, x, y):
        loss = self.pm.train_step(x, y)
        self.opt.step()
        self.opt.zero_grad()
        return loss


# -- one case on every rank -----------------------------------------------------------------------


def run_case(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from nest_fx.apply.distributed import init_distributed
    from nest_fx.models import build_seeded

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    case = CASES[spec["case"]]
    batch = spec["batch"]
    model, cfg = build_seeded(spec["model"], seed=0)
    hand_model = copy.deepcopy(model)  # same weights on both variants (and on every rank: same seed)
    seq = cfg.seq_len
    gen = torch.Generator().manual_seed(1234)
    data = [
        (
            torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen),
            torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen),
        )
        for _ in range(spec["batches"])
    ]

    t0 = time.perf_counter()
    nest = NestStep(model, cfg, case, batch, spec["lr"], data[0][0])
    dist.barrier()
    nest_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    hand = HandStep(hand_model, case, batch, spec["lr"], spec["dp_hand"])
    dist.barrier()
    hand_setup = time.perf_counter() - t0
    variants = {"nest": nest, "hand": hand}
    times: Dict[str, List[float]] = {"nest": [], "hand": []}
    rounds: Dict[str, List[int]] = {"nest": [], "hand": []}
    losses: Dict[str, List[torch.Tensor]] = {"nest": [], "hand": []}

    def step(name: str, index: int, timed: bool, round_index: int) -> None:
        x, y = data[index % len(data)]
        dist.barrier()
        start = time.perf_counter()
        loss = variants[name](x, y)
        dist.barrier()
        elapsed = time.perf_counter() - start
        losses[name].append(loss.detach().float().reshape(()))
        if timed:
            times[name].append(elapsed)
            rounds[name].append(round_index)

    index = 0
    for _ in range(spec["warmup"]):
        for name in ("nest", "hand"):
            step(name, index, False, -1)
        index += 1
    for r in range(spec["rounds"]):
        order = ("nest", "hand") if r % 2 == 0 else ("hand", "nest")
        for _ in range(spec["steps"]):
            for name in order:
                step(name, index, True, r)
            index += 1

    # max over ranks of every step time; global mean loss of the hand variant
    out: Dict[str, Any] = {"rank": rank, "nest_setup_s": nest_setup, "hand_setup_s": hand_setup}
    for name in ("nest", "hand"):
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[f"{name}_times"] = t.tolist()
        out[f"{name}_rounds"] = rounds[name]
    hand_losses = torch.stack(losses["hand"])
    dist.all_reduce(hand_losses)
    out["hand_losses"] = (hand_losses / world).tolist()
    out["nest_losses"] = torch.stack(losses["nest"]).tolist()
    return out


# -- driver ---------------------------------------------------------------------------------------


def summarise(name: str, spec: Dict[str, Any], result: Dict[str, Any], target: float, loss_tol: float) -> dict:
    nest_t, hand_t = result["nest_times"], result["hand_times"]
    nest_med, hand_med = statistics.median(nest_t), statistics.median(hand_t)
    per_round = []
    for r in range(spec["rounds"]):
        a = [t for t, k in zip(nest_t, result["nest_rounds"]) if k == r]
        b = [t for t, k in zip(hand_t, result["hand_rounds"]) if k == r]
        per_round.append(statistics.median(a) / statistics.median(b))
    loss_diff = max(abs(a - b) for a, b in zip(result["nest_losses"], result["hand_losses"]))
    ratio = nest_med / hand_med
    return {
        "case": name,
        "label": CASES[name]["label"],
        "hand_written": ("DDP" if spec["dp_hand"] == "ddp" else "flat all-reduce")
        if name == "dp0"
        else ("fully_shard per block + root" if name == "dp1" else "parallelize_module Colwise/Rowwise"),
        "nest_median_ms": nest_med * 1e3,
        "hand_median_ms": hand_med * 1e3,
        "nest_mean_ms": statistics.fmean(nest_t) * 1e3,
        "hand_mean_ms": statistics.fmean(hand_t) * 1e3,
        "nest_stdev_ms": statistics.stdev(nest_t) * 1e3 if len(nest_t) > 1 else 0.0,
        "hand_stdev_ms": statistics.stdev(hand_t) * 1e3 if len(hand_t) > 1 else 0.0,
        "ratio": ratio,
        "ratio_mean": statistics.fmean(nest_t) / statistics.fmean(hand_t),
        "ratio_per_round": per_round,
        "pass": ratio <= target,
        "loss_max_diff": loss_diff,
        "losses_agree": loss_diff <= loss_tol,
        "nest_setup_s": result["nest_setup_s"],
        "hand_setup_s": result["hand_setup_s"],
        "nest_times_ms": [t * 1e3 for t in nest_t],
        "hand_times_ms": [t * 1e3 for t in hand_t],
        "first_loss": result["nest_losses"][0],
        "last_loss": result["nest_losses"][-1],
    }


def table(rows: List[dict], target: float) -> str:
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["case"], "-", "-", "-", "-", "-", "FAIL (error)"])
            continue
        verdict = "pass" if r["pass"] else "FAIL"
        if not r["losses_agree"]:
            verdict += " (losses differ)"
        out.append(
            [
                f"{r['case']}: {r['label']}",
                f"{r['nest_median_ms']:.1f} ({r['nest_mean_ms']:.1f})",
                f"{r['hand_median_ms']:.1f} ({r['hand_mean_ms']:.1f})",
                f"{r['ratio']:.3f}",
                " ".join(f"{x:.3f}" for x in r["ratio_per_round"]),
                f"{r['loss_max_diff']:.1e}",
                verdict,
            ]
        )
    headers = [
        "case",
        "nest-fx ms median (mean)",
        "hand ms median (mean)",
        "ratio",
        "ratio per round",
        "loss max diff",
        f"<= {target:g}",
    ]
    return github_table(out, headers)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"zoo spec (default {DEFAULT_MODEL})")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows of --model's seq tokens)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --steps (the first variant alternates)")
    parser.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--dp-hand",
        choices=("ddp", "allreduce"),
        default="ddp",
        help="hand-written zero=0 baseline: DistributedDataParallel or one flat all-reduce",
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--target", type=float, default=1.05, help="max nest-fx / hand step-time ratio")
    parser.add_argument("--loss-tol", type=float, default=1e-4)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--json", default=os.path.join(ROOT, "results", "bench_runtime.json"))
    opts = parser.parse_args(argv)

    from nest_fx.apply.launch import launch

    rows = []
    started = time.perf_counter()
    for name in opts.cases:
        spec = dict(
            case=name,
            model=opts.model,
            batch=opts.batch,
            warmup=opts.warmup,
            steps=opts.steps,
            rounds=opts.rounds,
            batches=opts.batches,
            lr=opts.lr,
            dp_hand=opts.dp_hand,
        )
        t0 = time.perf_counter()
        try:
            results = launch(run_case, opts.world, spec, timeout=opts.timeout)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other cases
            print(f"{name}: {exc}", file=sys.stderr, flush=True)
            rows.append({"case": name, "error": str(exc).strip().splitlines()[-1]})
            continue
        row = summarise(name, spec, results[0], opts.target, opts.loss_tol)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"{name}: nest-fx {row['nest_median_ms']:.1f} ms, hand {row['hand_median_ms']:.1f} ms, "
            f"ratio {row['ratio']:.3f} (per round {', '.join(f'{x:.3f}' for x in row['ratio_per_round'])}), "
            f"loss max diff {row['loss_max_diff']:.2e}, {row['wall_s']:.0f} s",
            flush=True,
        )

    print()
    print(
        f"{opts.model}, fp32, CPU gloo, {opts.world} ranks x 1 thread, global batch {opts.batch}, SGD; "
        f"{opts.warmup} warm-up + {opts.rounds} x {opts.steps} timed steps per variant, interleaved"
    )
    print(table(rows, opts.target))
    for r in rows:
        if "error" not in r:
            print(
                f"  {r['case']}: loss max diff {r['loss_max_diff']:.2e} (first {r['first_loss']:.4f}, last "
                f"{r['last_loss']:.4f}); setup nest-fx {r['nest_setup_s']:.2f} s, hand {r['hand_setup_s']:.2f} s"
            )
    report = {
        "benchmark": "runtime overhead: nest-fx auto_parallelize vs the same plan by hand",
        "model": opts.model,
        "dtype": "fp32",
        "world_size": opts.world,
        "threads_per_rank": 1,
        "global_batch": opts.batch,
        "warmup": opts.warmup,
        "steps": opts.steps,
        "rounds": opts.rounds,
        "optimizer": f"SGD(lr={opts.lr})",
        "dp_hand": opts.dp_hand,
        "target_ratio": opts.target,
        "total_s": time.perf_counter() - started,
        "cases": rows,
    }
    write_json(opts.json, report, indent=2, quiet=True)
    print(f"wrote {os.path.relpath(opts.json)} ({report['total_s']:.0f} s)")
    ok = all("error" not in r and r["pass"] and r["losses_agree"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
