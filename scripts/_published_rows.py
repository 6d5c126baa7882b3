"""The published runs' data for ``bench_published.py``: every row (``published_rows``: torchtitan's,
Trainy's and Meta's here, NVIDIA's in ``_published_nvidia_rows.py``; each a ``Row``,
``_published_row.py``) and the models they ran (``MODELS``); the clusters they ran on are in
``_published_clusters.py``.

Imported by ``bench_published.py`` (which re-exports these names) and by the tests of the cost
model's published-run terms; the sources are described in ``bench_published.py``'s docstring.
"""

from __future__ import annotations

from typing import List, Optional

from _published_nvidia_rows import AUTOMODEL_SOURCE, BRIDGE_SOURCE, NEMO_2407_SOURCE, NEMO_SOURCE, nvidia_rows
from _published_row import GiB, Row

__all__ = [
    "AUTOMODEL_SOURCE",
    "BRIDGE_SOURCE",
    "GiB",
    "LLAMA3_SOURCE",
    "MODELS",
    "NEMO_2407_SOURCE",
    "NEMO_SOURCE",
    "Row",
    "SOURCE",
    "SOURCES",
    "TRAINY_SOURCE",
    "published_rows",
    "rows_named",
]
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26)"
TRAINY_SOURCE = (
    "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, H200, torchtitan e7c0cae, "
    "torch 2.8.0a0+5228986c39, June 2025)"
)
LLAMA3_SOURCE = "Grattafiori et al. 2024, The Llama 3 Herd of Models, Table 4 (Llama 3 405B pre-training, H100 80 GB)"
SOURCES = (SOURCE, TRAINY_SOURCE, NEMO_SOURCE, NEMO_2407_SOURCE, BRIDGE_SOURCE, AUTOMODEL_SOURCE, LLAMA3_SOURCE)
MODELS = {
    "8b": "llama:hidden=4096,layers=32,heads=32,kv=8,ffn=14336,vocab=128256,rope_theta=500000",
    "70b": "llama3-70b",
    "405b": "llama:hidden=16384,layers=126,heads=128,kv=8,ffn=53248,vocab=128256,rope_theta=500000",
    "l2-7b": "llama2-7b",
    "l2-13b": "llama:hidden=5120,layers=40,heads=40,ffn=13824,vocab=32000",
    "l2-70b": "llama:hidden=8192,layers=80,heads=64,kv=8,ffn=28672,vocab=32000",
    "70b-l3": "llama3-70b",
    "gpt3-175b": "gpt3-175b",
    # NeMo's GPT-3 5B / 20B (GPTConfig5B / 20B: LayerNorm, GELU, learned positions, biases) and Nemotron-3 8B
    # (Nemotron3Config8B: LayerNorm, squared ReLU, half the head dimensions rotated, vocabulary 256,000)
    "gpt3-5b": "gpt:hidden=4096,layers=24,heads=32,ffn=16384,seq=2048,vocab=50257",
    "gpt3-20b": "gpt:hidden=6144,layers=44,heads=48,ffn=24576,seq=2048,vocab=50257",
    "nemotron-8b": "llama:hidden=4096,layers=32,heads=32,ffn=16384,vocab=256000,norm=layernorm,activation=relu2,"
    "rotary_pct=0.5",
    # Qwen3-30B-A3B (its HF config): the per-head q/k RMSNorms are not modelled (2 x 128 weights a layer)
    "qwen3-30b-a3b": "llama:hidden=2048,layers=48,heads=32,kv=4,head_dim=128,vocab=151936,experts=128,topk=8,"
    "moe_ffn=768,rope_theta=1000000,norm_eps=0.000001",
}


def published_rows() -> List[Row]:
    """Tables 1-6 of the source, row by row."""
    rows = []
    for t, gpus, tps in (
        ("1", 8, (5762, 82.4, 6667, 77.0, 8532, 76.8)),
        ("3", 128, (5605, 67.0, 6514, 62.0, 8380, 61.8)),
    ):
        for k, (label, comp, f8) in enumerate(
            (("FSDP", False, False), ("FSDP + compile", True, False), ("FSDP + compile + Float8", True, True))
        ):
            rows.append(
                Row(
                    f"t{t}.{k + 1}",
                    t,
                    f"8B {gpus} GPUs {label}",
                    "8b",
                    gpus,
                    8192,
                    2,
                    tps[2 * k],
                    tps[2 * k + 1],
                    fsdp=gpus,
                    compile=comp,
                    float8=f8,
                )
            )
    for k, (fsdp, cp, seq, tps, mem) in enumerate(
        ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0), (1, 8, 262144, 548, 84.5))
    ):
        rows.append(
            Row(
                f"t2.{k + 1}",
                "2",
                f"8B 8 GPUs FSDP {fsdp} CP {cp} seq {seq}",
                "8b",
                8,
                seq,
                1,
                tps,
                mem,
                fsdp=fsdp,
                cp=cp,
                recompute="full",
                compile=True,
                float8=True,
                cp_mode="ring",  # torch's context_parallel (the note on the t6 rows)
            )
        )
    for k, (label, atp, tps, mem) in enumerate((("2D", False, 829, 71.9), ("2D + AsyncTP", True, 876, 67.6))):
        rows.append(
            Row(
                f"t4.{k + 1}",
                "4",
                f"70B 256 GPUs FSDP 32 TP 8 {label}",
                "70b",
                256,
                8192,
                16,
                tps,
                mem,
                fsdp=32,
                tp=8,
                recompute="full",
                compile=True,
                float8=True,
                async_tp=atp,
            )
        )
    for k, (label, schedule, v, tps, mem) in enumerate(
        (("1F1B", "1f1b", 1, 100, 82.5), ("Interleaved 1F1B", "interleaved", 2, 128, 72.7))
    ):
        rows.append(
            Row(
                f"t5.{k + 1}",
                "5",
                f"405B 512 GPUs FSDP 8 TP 8 PP 8 {label}",
                "405b",
                512,
                8192,
                32,
                tps,
                mem,
                fsdp=8,
                tp=8,
                pp=8,
                recompute="full",
                compile=True,
                float8=True,
                async_tp=True,
                schedule=schedule,
                virtual_stages=v,
            )
        )
    for k, (fsdp, cp, seq, tps, mem) in enumerate(
        ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9), (2, 4, 131072, 31, 77.1), (1, 8, 262144, 16, 84.9))
    ):
        rows.append(
            Row(
                f"t6.{k + 1}",
                "6",
                f"405B 512 GPUs FSDP {fsdp} TP 8 PP 8 CP {cp} seq {seq}",
                "405b",
                512,
                seq,
                8,
                tps,
                mem,
                fsdp=fsdp,
                tp=8,
                pp=8,
                cp=cp,
                recompute="full",
                compile=True,
                float8=True,
                async_tp=True,
                # torch's context_parallel at the benchmark's commit: _templated_ring_attention runs cp
                # chunk-pair SDPA calls merged by log-sum-exp (the keys all-gathered once forward,
                # the key/value gradients passed around the ring backward)
                cp_mode="ring",
            )
        )
    # Trainy's H200 runs (TRAINY_SOURCE): Llama 3.1 8B on 4 and 8 hosts of 8 H200, FSDP over all
    # GPUs, local batch 2, torch.compile, Float8 tensorwise with the weights all-gathered in fp8
    # (enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp); what the command
    # line leaves to torchtitan's llama3_8b.toml: sequence length 8192, selective op-level SAC; the loss
    # torch.compile'd with the blocks (``--training.compile`` compiles both since torchtitan PR #1033,
    # April 2025; the December 2024 rows ran it eagerly). The published command runs torchrun
    # directly, not torchtitan's run_train.sh, which is what sets expandable segments: PyTorch's default
    # (fixed) segments are assumed (the environment is not published).
    # Memory: the max reserved GiB torchtitan logs. Not fitted: held out from every factor.
    for k, (gpus, tps, mem) in enumerate(((32, 10938, 47.96), (64, 10753, 46.97))):
        rows.append(
            Row(
                f"w{k + 1}",
                "H200",
                f"8B {gpus} H200 FSDP + compile + Float8",
                "8b",
                gpus,
                8192,
                2,
                tps,
                mem,
                fsdp=gpus,
                compile=True,
                float8=True,
                hardware="h200",
                compiled_loss=True,
                allocator_segments="fixed",
            )
        )
    rows += nvidia_rows()
    # Grattafiori et al. 2024 ("The Llama 3 Herd of Models"), Table 4 and sec. 3.3: Llama 3 405B on
    # H100 80 GB (700 W), BF16, TP 8 x CP x PP 16 x DP; batch size per DP replica; TFLOP/s per GPU.
    # Stated there: interleaved pipeline schedule, FSDP sharding optimizer states and gradients
    # but not the weights after forward (ZeRO-1/2 memory under PP), asynchronous pipeline sends,
    # gradients reduce-scattered in fp32 (sec. 3.3.4), "pre-train Llama 3 on 8K sequences without
    # activation checkpointing". Derived: 8 model chunks per rank, one layer each: "we reduce one
    # Transformer layer each from the first and the last stages ... the first model chunk on the
    # first stage has only the embedding, and the last model chunk on the last stage has only
    # output projection and loss calculation" holds only with one layer per chunk (126 blocks +
    # embedding + output = 128 = 16 ranks x 8 chunks). ZeRO-2 with ``pp_shard_grads``: "shards
    # optimizer states and gradients, but for model shards we do not reshard after forward" (sec.
    # 3.3.2), the gradients reduce-scattered after each microbatch and accumulated sharded in fp32
    # (sec. 3.3.4: "FP32 gradient accumulation during backward computation over multiple
    # micro-batches"). Assumed (not stated): microbatch 1 (32 / 16 / 16 microbatches), no loss
    # parallel, fused kernels.
    # The long-context row's DP is 8 (GPUs / (TP CP PP) = 16,384 / 2,048 and 16M tokens /
    # (16 x 131,072)).
    for k, (gpus, cp, dp, seq, per_dp, tflops) in enumerate(
        ((8192, 1, 64, 8192, 32, 430), (16384, 1, 128, 8192, 16, 400), (16384, 16, 8, 131072, 16, 380))
    ):
        rows.append(
            Row(
                f"m{k + 1}",
                "L3",
                f"405B {gpus} GPUs TP 8 CP {cp} PP 16 DP {dp} seq {seq}",
                "405b",
                gpus,
                seq,
                per_dp,
                0.0,
                0.0,
                fsdp=dp,
                tp=8,
                pp=16,
                cp=cp,
                recompute="none",
                schedule="interleaved",
                virtual_stages=8,
                system="llama3",
                tflops_per_gpu=tflops,
                backend="fused",
                zero=2,
                pp_shard_grads=True,
                loss_parallel=False,
            )
        )
    return rows


def rows_named(keys: Optional[List[str]]) -> List[Row]:
    """The rows whose key is one of ``keys`` or starts with one (``t5``: t5.1, t5.2; ``n1``: n1
    and n10); all of them when ``keys`` is empty or None."""
    return [r for r in published_rows() if not keys or any(r.key.startswith(k) for k in keys)]
