"""Train a small zoo GPT on synthetic tokens with a hybrid plan.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py                 # TP2 x DP2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --tp 1 --pp 2   # PP2 x DP2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py --auto          # the planner chooses

Prints the global-batch loss and tokens/s on rank 0.
"""

from __future__ import annotations

import torch

from _common import lm_loss, make_plan, parser, train

from nest_fx.apply import auto_parallelize
from nest_fx.models import build_model


def main() -> None:
    args = parser(__doc__, "gpt:hidden=128,layers=4,heads=4,seq=64,vocab=512", tp=2).parse_args()
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
