#!/usr/bin/env python
"""What running the model's own forward on every pipeline stage costs (one process, CPU).

    python scripts/bench_pipeline_stages.py                 # HF Llama-shaped, 24 layers, PP4
    python scripts/bench_pipeline_stages.py --layers 48 --pp 8 --hidden 512

Each stage of ``nest_fx.graph.stage_modules`` runs the model's root forward code and calls a
NaN stand-in for every layer before its first one. This builds a HuggingFace Llama from a config
(fp32, one thread), cuts it into ``--pp`` stages of equal layer counts, and times, interleaved
over ``--rounds`` rounds (median of ``--repeats`` calls each, forward only, no grad):

* the whole model's forward;
* each stage's forward (the activation fed in, the model's inputs given), and the sum over stages;
* one stand-in call (a layer's input signature looked up, its NaN output allocated).

Reported: the sum of the stages over the whole model (1.0 = no overhead; the stand-ins and the
root code every stage re-runs are the difference) and the stand-in cost. Writes
``results/bench_pipeline_stages.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from nest_fx.graph import trace
from nest_fx.graph.stage_modules import arm_stages, pack_inputs, split_stages
from nest_fx.testing import hf_model_from_config

from _bench_common import write_json


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _calls(module, args, kwargs, count: int) -> None:
    for _ in range(count):
        module(*args, **kwargs)  # each output freed before the next call, as in a model's loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join("results", "bench_pipeline_stages.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": args.seq,
        "use_cache": False,
    }
    model = hf_model_from_config(config).eval()
    tokens = torch.randint(0, 1024, (1, args.seq))
    graph = trace(model, (), {"input_ids": tokens})
    n = len(graph.blocks)
    bounds = [round(i * n / args.pp) for i in range(args.pp + 1)]
    ranges = list(zip(bounds, bounds[1:]))
    stages = split_stages(copy.deepcopy(model), graph, ranges)
    arm_stages(stages)
    packed = pack_inputs((), {"input_ids": tokens})
    with torch.no_grad():
        acts = [()]
        for stage in stages[:-1]:
            acts.append((stage(*acts[-1], **packed),))
        stand_in = stages[-1].get_submodule("model.layers.0")
        layer_args = (acts[1][0],)
        layer_kwargs = {
            "position_embeddings": model.model.rotary_emb(acts[1][0], torch.arange(args.seq)[None]),
            "attention_mask": None,
            "position_ids": torch.arange(args.seq)[None],
        }
        whole, per_stage, stand_ins = [], [[] for _ in stages], []
        for _ in range(args.rounds):
            whole.append(_median_ms(lambda: model(input_ids=tokens), args.repeats))
            for i, stage in enumerate(stages):
                per_stage[i].append(_median_ms(lambda: stage(*acts[i], **packed), args.repeats))
            stand_ins.append(
                1e3 * _median_ms(lambda: _calls(stand_in, layer_args, layer_kwargs, 100), args.repeats) / 100
            )
    result = {
        "config": vars(args),
        "ranges": ranges,
        "whole_ms": statistics.median(whole),
        "stage_ms": [statistics.median(t) for t in per_stage],
        "stand_in_us": statistics.median(stand_ins),
    }
    result["stages_over_whole"] = sum(result["stage_ms"]) / result["whole_ms"]
    print(f"Llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, PP{args.pp} {ranges}")
    print(f"whole model forward      {result['whole_ms']:8.2f} ms")
    for (start, end), t in zip(ranges, result["stage_ms"]):
        print(f"stage [{start:3d}, {end:3d})         {t:8.2f} ms")
    print(f"sum of stages / whole    {result['stages_over_whole']:8.3f}")
    print(f"one stand-in call        {result['stand_in_us']:8.1f} us")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
