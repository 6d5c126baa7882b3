#!/usr/bin/env python
"""Pipeline parallelism on HuggingFace families: parity, wrong number, crash or refusal.

    python scripts/pp_families.py                        # every family, PP2 on 2 CPU ranks
    python scripts/pp_families.py --world 4              # PP2 x DP2 on 4 ranks
    python scripts/pp_families.py --only qwen2,gemma2 --label before --out results/pp_families_before.json

For each family a tiny model is built from a ``transformers`` config (no download; dropout off, so
the runs are deterministic) and trained for 3 SGD steps under a PP2 plan (1F1B, 4 microbatches)
with ``nest_fx.testing.equivalence``, against the same weights and data on one device. Outcome:

* ``parity``  losses of every step, full gradients and final parameters within 1e-5;
* ``wrong``   the run finished, but some number differs by more (or is NaN);
* ``refused`` nest-fx refused the plan before training (a ``NestFxError``; its message is kept);
* ``crash``   any other error (the failing rank's last traceback line is kept).

Writes ``--out`` (default ``results/pp_families.json``) and prints a table. ``--compare`` adds
the outcome column of an earlier JSON (e.g. the same script run on an older nest-fx, with its
package first on ``PYTHONPATH``), which is how the before/after table in ``docs/runtime.md``
was made.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict

from nest_fx.apply.launch import launch
from nest_fx.common.errors import NestFxError
from nest_fx.testing import equivalence

from _bench_common import write_json

TOL = 1e-5
LLAMA_LIKE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)
# 3 sliding-window layers then a full one (Gemma3's 5:1 pattern, shortened): a stage whose layer
# list restarted at 0 would give its layers the wrong types
SLIDING = ["sliding_attention"] * 3 + ["full_attention"]
BERT_LIKE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    task="masked-lm",
)

# one config each for the tied and the untied form of a family
GEMMA3 = dict(
    model_type="gemma3_text",
    head_dim=16,
    sliding_window=6,
    layer_types=SLIDING,
    attn_implementation="eager",
    **LLAMA_LIKE,
)
GPT2 = dict(
    model_type="gpt2",
    vocab_size=128,
    n_embd=64,
    n_layer=4,
    n_head=4,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=0,
    eos_token_id=0,
    use_cache=False,
)

FAMILIES: Dict[str, Dict[str, Any]] = {
    "llama": dict(model_type="llama", **LLAMA_LIKE),
    "mistral (sliding window)": dict(model_type="mistral", sliding_window=6, **LLAMA_LIKE),
    "qwen2 (sliding/full layers)": dict(
        model_type="qwen2",
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"] * 3,
        tie_word_embeddings=False,
        **{**LLAMA_LIKE, "num_hidden_layers": 6},
    ),
    "qwen3": dict(model_type="qwen3", head_dim=16, tie_word_embeddings=False, **LLAMA_LIKE),
    "gemma (tied, scaled embedding)": dict(model_type="gemma", head_dim=16, attn_implementation="eager", **LLAMA_LIKE),
    "gemma2 (untied, softcap)": dict(
        model_type="gemma2",
        head_dim=16,
        sliding_window=6,
        final_logit_softcapping=2.0,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **LLAMA_LIKE,
    ),
    "gemma3 (untied, sliding/full layers)": dict(GEMMA3, tie_word_embeddings=False),
    "gemma3 (tied, sliding/full layers)": GEMMA3,
    "cohere2 (untied, sliding/full layers)": dict(
        model_type="cohere2", sliding_window=6, layer_types=SLIDING, tie_word_embeddings=False, **LLAMA_LIKE
    ),
    "ministral (sliding/full layers)": dict(
        model_type="ministral", head_dim=16, sliding_window=6, layer_types=SLIDING, **LLAMA_LIKE
    ),
    "olmo3 (sliding/full layers)": dict(model_type="olmo3", sliding_window=6, layer_types=SLIDING, **LLAMA_LIKE),
    "phi3": dict(model_type="phi3", pad_token_id=0, **LLAMA_LIKE),
    "mixtral (MoE)": dict(
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="batched_mm",
        **LLAMA_LIKE,
    ),
    "gpt_oss (MoE, sinks, sliding/full)": dict(
        model_type="gpt_oss",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        layer_types=SLIDING,
        experts_implementation="batched_mm",
        attn_implementation="eager",
        **LLAMA_LIKE,
    ),
    "gpt2 (tied)": GPT2,
    "gpt2 (untied)": dict(GPT2, tie_word_embeddings=False),
    "gpt_neo (tied, local/global layers)": dict(
        model_type="gpt_neo",
        vocab_size=128,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        attention_types=[[["global", "local"], 2]],
        attn_implementation="eager",
        window_size=6,
        max_position_embeddings=64,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    ),
    "opt (tied)": dict(
        model_type="opt",
        vocab_size=128,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    ),
    "bloom (tied, alibi)": dict(
        model_type="bloom",
        vocab_size=128,
        hidden_size=64,
        n_layer=4,
        n_head=4,
        attn_implementation="eager",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    ),
    "falcon (tied)": dict(
        model_type="falcon",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    ),
    "bert (masked LM, tied)": dict(model_type="bert", **BERT_LIKE),
    "bert (masked LM, untied)": dict(model_type="bert", tie_word_embeddings=False, **BERT_LIKE),
    "roberta (masked LM, tied)": dict(model_type="roberta", pad_token_id=1, **BERT_LIKE),
    "distilbert (masked LM, tied)": dict(
        model_type="distilbert",
        vocab_size=128,
        dim=64,
        n_layers=4,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        task="masked-lm",
    ),
}


def _attempt(spec: Dict[str, Any]) -> Dict[str, Any]:
    """equivalence() on this rank; a NestFxError (a refusal before training) becomes a result."""
    try:
        return equivalence(spec)
    except NestFxError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}


def _root_cause(message: str) -> str:
    """The error line of a failed launch that caused it: the failing ranks' last lines, skipping
    the broken-connection errors of ranks whose peer died first."""
    head, *tails = message.split("\nrank ")
    lines = [[line for line in head.splitlines() if line.strip()][-1]] + [t.partition(": ")[2] for t in tails]
    return next((line for line in lines if "gloo" not in line and "Connection" not in line), lines[0])


def run_family(name: str, world: int, timeout: float) -> Dict[str, Any]:
    """Outcome of one family under PP2 (x DP2 on 4 ranks)."""
    plan = {"pp": 2, "dp": world // 2, "microbatch_size": 2 // (world // 2), "num_microbatches": 4, "schedule": "1f1b"}
    spec = {"model": name, "hf_config": FAMILIES[name], "plan": plan, "batch": 8, "seq": 16, "steps": 3, "lr": 0.5}
    start = time.monotonic()
    try:
        results = launch(_attempt, world, spec, timeout=timeout)
    except RuntimeError as exc:
        return {
            "outcome": "crash",
            "detail": _root_cause(str(exc))[:300],
            "seconds": round(time.monotonic() - start, 1),
        }
    seconds = round(time.monotonic() - start, 1)
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        return {"outcome": "refused", "detail": refused[0][:400], "seconds": seconds}
    worst = {k: max(r[k] for r in results) for k in ("loss_diff", "grad_diff", "param_diff")}
    ok = all(v < TOL for v in worst.values())  # False for NaN too
    return {
        "outcome": "parity" if ok else "wrong",
        "detail": ", ".join(f"{k}={v:.1e}" for k, v in worst.items()),
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4), help="2: PP2; 4: PP2 x DP2")
    parser.add_argument("--only", default="", help="comma-separated family name prefixes")
    parser.add_argument("--label", default="after", help="name of this run in the JSON")
    parser.add_argument("--out", default=os.path.join("results", "pp_families.json"))
    parser.add_argument("--compare", default="", help="an earlier JSON whose outcomes are shown beside")
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    names = [n for n in FAMILIES if not args.only or any(n.startswith(p) for p in args.only.split(","))]
    before = {}
    if args.compare:
        with open(args.compare) as fh:
            before = json.load(fh)["families"]
    rows = {}
    for name in names:
        rows[name] = run_family(name, args.world, args.timeout)
        print(
            f"{name:38s} {rows[name]['outcome']:8s} {rows[name]['seconds']:6.1f}s  {rows[name]['detail'][:150]}",
            flush=True,
        )
    write_json(args.out, {"label": args.label, "world": args.world, "tolerance": TOL, "families": rows}, quiet=True)
    print(f"\n| family | {'before | ' if before else ''}{args.label} |")
    print(f"|---|{'---|' if before else ''}---|")
    for name, row in rows.items():
        old = f" {before.get(name, {}).get('outcome', '-')} |" if before else ""
        print(f"| {name} |{old} {row['outcome']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
