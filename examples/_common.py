"""Shared bits of the examples: command-line plan options, synthetic data, the training loop."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from nest_fx.apply.losses import lm_loss  # noqa: F401  (the examples' loss, re-exported for them)
from nest_fx.plan import uniform_plan
from nest_fx.plan.setting_flags import example_flags, example_values

_NAMES = {"microbatches": "num_microbatches"}  # the examples' keyword for a setting


def parser(description: str, model: str, **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=model, help="zoo spec or hf: name")
    p.add_argument("--steps", type=int, default=defaults.get("steps", 8))
    p.add_argument("--batch", type=int, default=defaults.get("batch", 16), help="global batch (sequences)")
    # the plan flags (--tp, --pp, --ep, --cp, --zero, --dp-shard, --microbatches, --schedule, --recompute,
    # --sequence-parallel, --loss-parallel, --compile, --precision): one per declared setting
    example_flags(p, {"num_microbatches": 4, **{_NAMES.get(k, k): v for k, v in defaults.items()}})
    p.add_argument("--auto", action="store_true", help="no plan: auto_parallelize runs the NEST planner")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save", metavar="DIR", help="save model + optimizer to DIR after training")
    p.add_argument("--resume", metavar="DIR", help="load a checkpoint (saved under any plan) before training")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective may wait before failing (default: $NEST_FX_TIMEOUT_S or 600)",
    )
    return p


def make_plan(args, num_layers: int):
    """A uniform plan from the flags; dp fills the launched world."""
    if args.auto:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_replica = args.tp * args.pp * args.cp
    if world % per_replica:
        raise SystemExit(f"WORLD_SIZE={world} is not a multiple of tp*pp*cp={per_replica}")
    dp = world // per_replica
    given = example_values(args)  # every plan setting an example flag sets, by its name
    microbatches = given["num_microbatches"]
    mbs = args.batch // (dp * microbatches)
    if mbs < 1 or args.batch % (dp * microbatches):
        raise SystemExit(f"--batch {args.batch} must be a multiple of dp*microbatches = {dp * microbatches}")
    return uniform_plan(
        num_layers, dp=dp, microbatch_size=mbs, virtual_stages=2 if args.schedule == "interleaved" else 1, **given
    )


def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    """Learnable synthetic text, the same on every rank (the runtime takes this rank's shard):
    a random start token, then t -> (7 t + 3) mod vocab, so the loss visibly falls."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = (7 * tokens[:, t] + 3) % vocab
        yield tokens[:, :-1], tokens[:, 1:]


def train(pm, args, seq: int, vocab: int) -> None:
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, foreach=False)
    rank = dist.get_rank()
    first = 0
    if args.resume:
        first = pm.load(args.resume, opt)["step"] or 0
        if rank == 0:
            print(f"resumed from {args.resume} at step {first}", flush=True)
    batches = synthetic_batches(first + args.steps, args.batch, seq, vocab)
    for step, (x, y) in enumerate(batches):
        if step < first:  # the data a resumed run already trained on
            continue
        start = time.perf_counter()
        loss = pm.train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(
                f"step {step}: loss {float(loss):.4f}  {args.batch * seq / elapsed:,.0f} tokens/s "
                f"({elapsed * 1e3:.0f} ms)",
                flush=True,
            )
    if args.save:
        pm.save(args.save, opt, step=first + args.steps)
        if rank == 0:
            print(f"saved {args.save} at step {first + args.steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
