"""Train a HuggingFace encoder-decoder (T5 by default, built from its config, no download) on its
own loss: train_step takes the model's inputs as a dict (input_ids, decoder_input_ids, labels).

    torchrun --standalone --nproc_per_node=4 examples/train_hf_seq2seq.py --auto   # the planner chooses
    torchrun --standalone --nproc_per_node=4 examples/train_hf_seq2seq.py --microbatches 2   # DP4
    torchrun --standalone --nproc_per_node=4 examples/train_hf_seq2seq.py --model hf:bart --auto

The task is to copy the source sequence: the loss falls within a few steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from _common import make_plan, parser

from nest_fx.apply import auto_parallelize
from nest_fx.graph import trace
from nest_fx.models import build_seeded


def main() -> None:
    args = parser(__doc__, "hf:t5", batch=16).parse_args()
    model, cfg = build_seeded(args.model)
    seq, vocab = 16, cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batch():
        source = torch.randint(2, vocab, (args.batch, seq), generator=gen)
        start = torch.full((args.batch, 1), getattr(cfg, "decoder_start_token_id", None) or 0)
        return {"input_ids": source, "decoder_input_ids": torch.cat([start, source[:, :-1]], 1), "labels": source}

    example = batch()
    graph = trace(model, (), example)  # labels included: the trace (and the plan) see the loss
    pm = auto_parallelize(
        model,
        example,
        global_batch_size=args.batch,
        graph=graph,
        plan=make_plan(args, len(graph.blocks)),
        timeout_s=args.timeout,
    )  # loss_fn=None
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    for step in range(args.steps):
        start = time.perf_counter()
        loss = pm.train_step(batch())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {float(loss):.4f}  ({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
