"""Train a HuggingFace LlamaForCausalLM (built from a config, no download) with TP x PP.

    torchrun --standalone --nproc_per_node=4 examples/train_hf_llama.py             # TP2 x PP2
    torchrun --standalone --nproc_per_node=4 examples/train_hf_llama.py --pp 1 --sequence-parallel # TP2 x DP2 + SP

The TP pairs (q/k/v -> o, gate/up -> down) come from the tracer; nothing HF-specific is written.
"""

from __future__ import annotations

import torch

from _common import lm_loss, make_plan, parser, train

from nest_fx.apply import auto_parallelize
from nest_fx.models.hf import build_hf_model


def main() -> None:
    args = parser(__doc__, "hf:llama:hidden=128,layers=4,heads=4,kv=2,seq=64,vocab=512", tp=2, pp=2).parse_args()
    torch.manual_seed(0)
    model, cfg = build_hf_model(args.model, device="cpu", dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    example = {"input_ids": torch.zeros(args.batch, cfg.seq_len, dtype=torch.long)}
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
