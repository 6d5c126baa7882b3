"""Elastic training: a lost node means re-plan and resume; a node that comes back means grow.

Start the same command on every node (here two nodes of 2 ranks; the job runs on 1 or 2 nodes):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=2 --max_restarts=20 \\
        --rdzv_backend=c10d --rdzv_endpoint=node0:29500 --rdzv_id=job42 \\
        examples/train_elastic.py --ckpt /shared/ckpt --steps 1000 --save-every 50

On one machine, two agents stand for two nodes: run the command twice with
``--rdzv_endpoint=localhost:29500``, then kill one agent and its workers (``kill -9`` on its
process group): the other agent's ranks fail (a collective names the group that lost its peer),
torchrun restarts them with the ranks that are left, ``auto_parallelize(..., elastic=True)``
plans for the new world with the same global batch (more microbatches per rank), and
``pm.resume`` loads the newest checkpoint; start the agent again and torchrun restarts everyone
on the larger world. The loss curve is the single-device one: the data position, scheduler and
RNG states are in the checkpoint. Run it as plain ``python`` for that single-device curve.

With ``--rdzv_backend=c10d`` the node at ``--rdzv_endpoint`` holds the rendezvous store and must
survive. To survive the loss of any node, keep the rendezvous in etcd: ``pip install -e '.[etcd]'``,
an etcd server outside the nodes (``etcd --enable-v2``, Debian's ``etcd-server``), and
``--rdzv_backend=etcd-v2 --rdzv_endpoint=etcd0:2379`` on every node (tests/distributed/apply/test_elastic.py).

Rank 0 prints one line per step and, with ``--losses FILE``, appends it as JSON to FILE. Restart
policy and its limits: docs/runtime.md, "Elastic training".
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from nest_fx.apply import EpochBatches, auto_parallelize
from nest_fx.apply.losses import lm_loss
from nest_fx.models import build_seeded


def dataset(samples: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Learnable synthetic text: a random start token, then t -> (7 t + 3) mod vocab."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(samples, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (samples,), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = (7 * tokens[:, t] + 3) % vocab
    return tokens


def log_line(path: str, record: dict) -> None:
    """Append one JSON line durably (a node may die right after)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama:hidden=32,layers=2,heads=4,seq=16,vocab=64")
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint directory (shared by all nodes)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), the same on any world size")
    p.add_argument("--samples", type=int, default=64, help="dataset size (sequences)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-every", type=int, default=1, metavar="STEPS")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--pace", type=float, default=0.0, metavar="SECONDS", help="sleep after each step (to watch it)")
    p.add_argument("--losses", metavar="FILE", help="rank 0 appends one JSON line per step")
    p.add_argument("--timeout", type=float, default=None, help="collective timeout (default $NEST_FX_TIMEOUT_S or 600)")
    args = p.parse_args()

    model, cfg = build_seeded(args.model, seed=0)
    data = dataset(args.samples, cfg.seq_len, cfg.vocab_size)
    example = data[: args.batch, :-1]
    pm = auto_parallelize(
        model, example, global_batch_size=args.batch, loss_fn=lm_loss, elastic=True, timeout_s=args.timeout
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    batches = EpochBatches(args.samples, args.batch, seed=1)
    start = pm.resume(args.ckpt, opt, scheduler=sched, data=batches)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(
            f"world {world}, restart {restart}: {'resumed at step ' + str(start) if start else 'fresh start'}; "
            f"{pm.plan.dp} replicas x {pm.num_microbatches} microbatches",
            flush=True,
        )
    for step in range(start, args.steps):
        rows = data[next(batches)]
        loss = float(pm.train_step(rows[:, :-1], rows[:, 1:]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if rank == 0:
            print(f"step {step}: loss {loss:.6f} (world {world})", flush=True)
            if args.losses:
                log_line(
                    args.losses, {"step": step, "loss": loss, "world": world, "restart": restart, "time": time.time()}
                )
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            pm.save(args.ckpt, opt, scheduler=sched, data=batches, keep=args.keep, loss=loss)
        if args.pace:
            time.sleep(args.pace)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
