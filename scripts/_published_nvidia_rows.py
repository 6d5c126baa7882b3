"""NVIDIA's published runs for ``bench_published.py``: NeMo's FP8 pre-training tables (24.12 rows
n1-n7, 24.07 rows n8-n10), Megatron-Bridge's (25.11, rows r1-r5: DGX H100, DGX B200, GB200 NVL72;
25.09, MoE row r6) and AutoModel's MoE run (row a1); the sources are described in ``bench_published.py``'s docstring."""

from __future__ import annotations

import dataclasses
from typing import List

from _published_row import Row

NEMO_SOURCE = (
    "NVIDIA NeMo Framework 24.12 user guide, Performance Benchmarks, pre-training at FP8 (DGX H100; "
    "docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html)"
)
NEMO_2407_SOURCE = (
    "NVIDIA NeMo Framework 24.07 Performance Benchmarks, pre-training at FP8 on DGX H100 "
    "(NVIDIA/NeMo docs/source/performance/performance_summary.md)"
)
BRIDGE_SOURCE = (
    "NVIDIA Megatron-Bridge performance summary, 25.11 and 25.09 NeMo containers, pre-training "
    "(NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md)"
)
AUTOMODEL_SOURCE = (
    "NVIDIA NeMo AutoModel performance summary, pre-training on DGX-H100 in BF16 (NVIDIA-NeMo/Automodel "
    "docs/performance-summary.md) with its config examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml"
)


def _megatron_row(key, table, model, hardware, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps) -> Row:
    """A Megatron-Core run as NeMo and Megatron-Bridge publish it (the settings in ``nvidia_rows``)."""
    dp = gpus // (tp * pp * cp)
    device = {"dgx-b200": "B200", "gb200-nvl72": "GB200"}.get(hardware, "GPUs")
    return Row(
        key,
        table,
        f"{model} {gpus} {device} TP {tp} PP {pp} CP {cp} VP {vp} GBS {gbs} MBS {mbs} seq {seq}",
        model,
        gpus,
        seq,
        gbs // dp,
        tps,
        0.0,
        fsdp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        recompute="none",
        float8=True,
        schedule="interleaved" if vp > 1 else "1f1b",
        virtual_stages=vp,
        system="nemo",
        backend="fused",
        zero=1,
        hardware=hardware,
        microbatch=mbs,
        reduce_bytes=2,
        cp_mode="ring",  # Transformer Engine's context parallelism: cp_comm_type p2p, its default
    )


def nvidia_rows() -> List[Row]:
    """NVIDIA's rows (module docstring)."""
    rows = []
    # NeMo's FP8 pre-training table (NEMO_SOURCE), the dense Llama and GPT-3 rows: GPUs, GBS, MBS,
    # sequence length, TP, PP, CP, VP as stated; tokens/s per GPU; no memory figure (they ran: they
    # must fit). Megatron-Core with Transformer Engine: fused kernels, fp8 GEMMs, sequence
    # parallelism with TP, the vocabulary-parallel loss (in place), the distributed optimizer (ZeRO-1
    # with whole bf16 parameter and gradient buffers: ``state_buffers``), pipeline outputs freed after
    # their send (Megatron's deallocate_output_tensor), layers split evenly.
    # Gradients held and reduced in bf16: NeMo's performance script for the Llama 3 8B row sets
    # grad_reduce_in_fp32 = False ("bf16 grad dtype"; NVIDIA/NeMo scripts/llm/performance/llama3_8b.py),
    # the launcher's FP8 Llama 2 examples optim.grad_sync_dtype=bf16. Assumed (not stated): no
    # activation recompute, TP communication not hidden (the recipes turn on Transformer Engine's
    # userbuffers TP overlap, Megatron-Bridge's COMM_OVERLAP_CONFIG_MAP, but no source gives the share
    # it hides: scripts/bench_published_sensitivity.py prices the rows with each share), the DGX
    # H100 preset's network.
    for key, model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps in (
        ("n1", "l2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16934),
        ("n2", "l2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8715),
        ("n3", "l2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1728),
        ("n4", "8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12273),
        ("n5", "70b-l3", 64, 128, 1, 8192, 4, 4, 2, 5, 1524),
        ("n6", "gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 716),
        ("n7", "gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, 825),
    ):
        rows.append(_megatron_row(key, "NeMo", model, "dgx-h100", gpus, gbs, mbs, seq, tp, pp, cp, vp, tps))
    # NeMo 24.07's table (NEMO_2407_SOURCE), the rows of models the 24.12 table has not: the same
    # stack, settings and assumptions as above (its Llama rows are within 1% of 24.12's). Left out:
    # Nemotron-22B (no published configuration of its shape) and Nemotron-4 340B (TP 8 PP 8 VP 12,
    # DP 2: costed at 79.7 GiB on its first stage without recompute, 76 usable; its recompute and
    # fp8-weight settings are not stated, and they decide whether it fits).
    # Not modelled: their GPT-3 configurations' dropout 0.1 (hidden and attention; the launcher's
    # gpt3/5b.yaml, 20b.yaml) and vocabulary padded to 50,304.
    for key, model, gpus, gbs, mbs, seq, tp, tps in (
        ("n8", "gpt3-5b", 64, 2048, 4, 2048, 1, 22521),
        ("n9", "gpt3-20b", 64, 256, 2, 2048, 2, 5851),
        ("n10", "nemotron-8b", 64, 256, 4, 4096, 2, 12701),
    ):
        rows.append(_megatron_row(key, "NeMo 24.07", model, "dgx-h100", gpus, gbs, mbs, seq, tp, 1, 1, 1, tps))
    # Megatron-Bridge 25.11's table (BRIDGE_SOURCE), FP8 with current scaling (torchao's tensorwise
    # Float8 is that recipe), the dense Llama rows whose configuration it states whole: the stack and
    # assumptions as NeMo's (no recompute: none is set in their presets for these rows), Megatron-Core's
    # distributed optimizer holding whole bf16 buffers (``state_buffers``). Left out: the 8B DGX H100
    # row (recompute of 5 of 32 layers, not a per-stage policy), the 405B GB200 row (TP 4 PP 16 VP 4,
    # DP 4: costed at 202 GiB against 165 usable; the presets in that repository state no recompute
    # or offloading for it), the MoE rows (GPT-OSS: attention sinks; Qwen3-235B: its row misses a column;
    # Qwen3-30B-A3B on 16 H100, 5,275 tokens/s: token-dropless, half the throughput of the same
    # configuration's token-drop run in the 25.09 table, row r6, which nest-fx's capacity-slot MoE computes;
    # what slows the dropless run, on H100 and B200 but not GB200, is not stated).
    # Not modelled: the B200 / GB200 8B rows' full-iteration CUDA graphs (the repository's presets; the
    # launches they save are priced, about 2% of r3 / r4: docs/cost_model.md, "Fourteenth run").
    for key, model, hardware, gpus, gbs, mbs, tp, pp, cp, vp, tps in (
        ("r1", "70b", "dgx-h100", 64, 128, 1, 4, 8, 1, 5, 1602),
        ("r2", "405b", "dgx-h100", 1024, 512, 1, 8, 8, 2, 8, 292),
        ("r3", "8b", "dgx-b200", 8, 128, 2, 1, 1, 1, 1, 30624),
        ("r4", "8b", "gb200-nvl72", 8, 128, 2, 1, 1, 1, 1, 31508),
        ("r5", "405b", "dgx-b200", 128, 64, 1, 4, 8, 2, 8, 661),
    ):
        rows.append(_megatron_row(key, "Megatron-Bridge", model, hardware, gpus, gbs, mbs, 8192, tp, pp, cp, vp, tps))
    # Megatron-Bridge 25.09's table (BRIDGE_SOURCE), DGX H100: Qwen3-30B-A3B "(tokendrop)", 16 GPUs, GBS 512,
    # MBS 2, sequence 4096, PP 2, VP 24, EP 8, no TP / CP / FSDP, 10,494 tokens/s per GPU; the table's FP8
    # (its note gives the H100 FP8 recipes). Stated in its performance scripts (scripts/performance/configs/
    # qwen3/qwen3_llm_pretrain.py): no recompute, bf16 gradients (grad_reduce_in_fp32 False), routing forced
    # balanced. Token drop at Megatron's capacity factor 1 under balanced routing is the zoo MoE's capacity
    # buffer at capacity 1; Megatron-Core's alltoall dispatcher sends one row per routed pair (``slots``).
    # Priced as Megatron-Core's MoE layer (the ``fused`` backend: router weights in the experts' activation,
    # FP8 linear inputs kept quantized, the loss in place). Assumed: the expert all-to-all exposed (the
    # recipes' ``moe_a2a_overlap`` hides some of it; no share of it is measured), the DGX H100 network.
    row = _megatron_row("r6", "Megatron-Bridge", "qwen3-30b-a3b", "dgx-h100", 16, 512, 2, 4096, 1, 2, 1, 24, 10494)
    rows.append(dataclasses.replace(row, ep=8))
    # AutoModel's MoE row (AUTOMODEL_SOURCE): Qwen3-30B-A3B on one DGX H100, BF16, 12,040 tokens/s
    # per GPU (21.77 s a step). Stated in the table and its config: GBS 512, local batch 4 (16
    # accumulation steps), sequence 4096, EP 8 inside FSDP 8, no TP / PP / CP; Transformer Engine
    # attention, linears and RMSNorm (``fused``), DeepEP's dispatch (``enable_deepep``: a token sent
    # once to each rank owning one of its experts, ``expert_dispatch=per-rank``), activation
    # checkpointing of whole blocks (``full``), torch.optim.Adam; FSDP2 with
    # reshard_after_forward=False (its MoE parallelizer's default: ZeRO-2); a balanced stand-in gate
    # (``fake_balanced_gate``: every expert gets its share, the zoo MoE at capacity 1; without noise,
    # its FakeBalancedGate gives token t experts 8t ... 8t + 7 mod 128, all on one of the 8 ranks:
    # ``expert_routing=contiguous``). Assumed (not stated): parameters in the HF config's bf16, so
    # Adam's states are bf16 too (``bf16-true``); the loss as nest-fx's eager one (their
    # MaskedCrossEntropy without fp32 upcast keeps less).
    rows.append(
        Row(
            "a1",
            "AutoModel",
            "qwen3-30b-a3b 8 GPUs EP 8 FSDP 8 GBS 512 MBS 4 seq 4096",
            "qwen3-30b-a3b",
            8,
            4096,
            64,
            12040,
            0.0,
            fsdp=8,
            recompute="full",
            system="automodel",
            backend="fused",
            zero=2,
            hardware="dgx-h100",
            microbatch=4,
            ep=8,
            precision="bf16-true",
            expert_dispatch="per-rank",
            expert_routing="contiguous",
        )
    )
    return rows
