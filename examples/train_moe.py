"""Train a small zoo mixture-of-experts model with expert parallelism.

    torchrun --standalone --nproc_per_node=4 examples/train_moe.py            # DP4 with EP4
    torchrun --standalone --nproc_per_node=4 examples/train_moe.py --ep 2 --tp 2

Each rank holds experts/ep experts; tokens reach them through an all_to_all of the
[batch, experts, capacity, hidden] dispatch buffer.
"""

from __future__ import annotations

import torch

from _common import lm_loss, make_plan, parser, train

from nest_fx.apply import auto_parallelize
from nest_fx.models import build_model


def main() -> None:
    args = parser(
        __doc__, "moe:hidden=128,layers=2,heads=4,seq=64,vocab=512,experts=4,top_k=2", ep=4, microbatches=2
    ).parse_args()
    torch.manual_seed(0)
    model, cfg = build_model(args.model, device="cpu", dtype=torch.float32)
    example = torch.zeros(args.batch, cfg.seq_len, dtype=torch.long)
    pm = auto_parallelize(
        model,
        example,
        global_batch_size=args.batch,
        loss_fn=lm_loss,
        plan=make_plan(args, cfg.layers + 2),
        timeout_s=args.timeout,
    )
    train(pm, args, cfg.seq_len, cfg.vocab_size)


if __name__ == "__main__":
    main()
