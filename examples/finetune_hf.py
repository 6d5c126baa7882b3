"""Fine-tune a pretrained HuggingFace model: start on meta, load the weights, train, export.

    torchrun --standalone --nproc_per_node=4 examples/finetune_hf.py \\
        --weights /tmp/qwen2-small --plan /tmp/qwen2-plan.json \\
        --checkpoint /tmp/qwen2-ckpt --out /tmp/qwen2-finetuned

``--weights``: a directory ``transformers`` ``save_pretrained`` wrote (``config.json`` and
safetensors, one file or shards with their index). The model is built on ``meta`` from its
``config.json`` (no rank ever holds the whole model), ``auto_parallelize(..., weights=DIR)``
reads each rank's shards only, and after training ``pm.save_pretrained(--out)`` writes what
``transformers`` ``from_pretrained`` loads. ``--plan``: a plan file from ``nest-fx plan
hf-config:DIR/config.json ... --json PLAN``; without it the planner chooses. The data is a
fixed random token stream (replace ``batches`` with your own loader); the model computes its
own loss from ``labels``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from nest_fx.apply import auto_parallelize
from nest_fx.models import build_model
from nest_fx.plan import Plan


def batches(vocab: int, batch: int, seq: int, seed: int = 0):
    """Synthetic token batches (every rank draws the same global batch)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        yield {"input_ids": ids, "labels": ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True, help="a save_pretrained directory (config.json + safetensors)")
    p.add_argument("--plan", help="a plan file (nest-fx plan ... --json PLAN); default: the planner's choice")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--checkpoint", help="also save a nest-fx checkpoint here (resumable under any plan)")
    p.add_argument("--out", required=True, help="where save_pretrained writes the fine-tuned model")
    p.add_argument("--max-shard-size", default="5GB")
    args = p.parse_args()

    model, config = build_model(f"hf-config:{os.path.join(args.weights, 'config.json')}", device="meta")
    data = batches(config.vocab_size, args.batch, args.seq)
    plan = Plan.load(args.plan) if args.plan else None
    pm = auto_parallelize(
        model,
        next(batches(config.vocab_size, args.batch, args.seq)),
        global_batch_size=args.batch,
        plan=plan,
        weights=args.weights,
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    for step in range(args.steps):
        loss = pm.train_step(next(data))
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {float(loss):.4f}", flush=True)
    if args.checkpoint:
        pm.save(args.checkpoint, opt)
    out = pm.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    if dist.get_rank() == 0:
        print(f"wrote {out}: {', '.join(sorted(os.listdir(out)))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
