"""The published runs' data for ``bench_published.py``: each row's measurement and configuration
(``Row``, ``published_rows``) and the models they ran (``MODELS``); the clusters they ran on are in
``_published_clusters.py``.

Imported by ``bench_published.py`` (which re-exports these names) and by the tests of the cost
model's published-run terms; the sources are described in ``bench_published.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

GiB = 2**30
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26)"
TRAINY_SOURCE = (
    "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, H200, torchtitan e7c0cae, "
    "torch 2.8.0a0+5228986c39, June 2025)"
)
NEMO_SOURCE = (
    "NVIDIA NeMo Framework 24.12 user guide, Performance Benchmarks, pre-training at FP8 (DGX H100; "
    "docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/performance_summary.html)"
)
AUTOMODEL_SOURCE = (
    "NVIDIA NeMo AutoModel performance summary, pre-training on DGX-H100 in BF16 (NVIDIA-NeMo/Automodel "
    "docs/performance-summary.md) with its config examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml"
)
LLAMA3_SOURCE = "Grattafiori et al. 2024, The Llama 3 Herd of Models, Table 4 (Llama 3 405B pre-training, H100 80 GB)"
MODELS = {
    "8b": "llama:hidden=4096,layers=32,heads=32,kv=8,ffn=14336,vocab=128256,rope_theta=500000",
    "70b": "llama3-70b",
    "405b": "llama:hidden=16384,layers=126,heads=128,kv=8,ffn=53248,vocab=128256,rope_theta=500000",
    "l2-7b": "llama2-7b",
    "l2-13b": "llama:hidden=5120,layers=40,heads=40,ffn=13824,vocab=32000",
    "l2-70b": "llama:hidden=8192,layers=80,heads=64,kv=8,ffn=28672,vocab=32000",
    "70b-l3": "llama3-70b",
    "gpt3-175b": "gpt3-175b",
    # Qwen3-30B-A3B (its HF config): the per-head q/k RMSNorms are not modelled (2 x 128 weights a layer)
    "qwen3-30b-a3b": "llama:hidden=2048,layers=48,heads=32,kv=4,head_dim=128,vocab=151936,experts=128,topk=8,"
    "moe_ffn=768,rope_theta=1000000,norm_eps=0.000001",
}


@dataclass
class Row:
    """One published measurement and the configuration it ran."""

    key: str
    table: str
    label: str
    model: str
    gpus: int
    seq: int
    local_batch: int
    tps_per_gpu: float
    memory_gib: float
    fsdp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    recompute: str = "op"
    compile: bool = False
    float8: bool = False
    async_tp: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    notes: List[str] = field(default_factory=list)
    # torchtitan (Grand Teton H100 96 GB, 500 W; Trainy H200), nemo (DGX H100) or llama3 (Meta's H100 80 GB, 700 W)
    system: str = "torchtitan"
    tflops_per_gpu: float = 0.0  # what the source publishes instead of tokens/s (model TFLOP/s per GPU); 0: tokens/s
    backend: str = ""  # the kernel backend the system ran, when not torchtitan's eager / compile
    zero: int = 3
    loss_parallel: Optional[bool] = None  # None: with TP (torchtitan's default)
    pp_shard_grads: bool = False  # pipelined FSDP reduce-scatters every microbatch (Meta's sharded gradients)
    hardware: str = "grand-teton"  # grand-teton (torchtitan's H100 hosts), meta-h100, or h200 (Trainy's hosts)
    # torchtitan compiles its loss with --training.compile since PR #1033 (April 2025): the June 2025 rows
    compiled_loss: bool = False
    # the CUDA caching allocator's segments (nest_fx.cost.allocator): torchtitan's run_train.sh sets
    # expandable segments; a run launched with torchrun directly has PyTorch's default, fixed
    allocator_segments: str = "expandable"
    microbatch: int = 0  # sequences per microbatch where the source states it (NeMo's MBS); 0: derived
    reduce_bytes: int = 4  # bytes per gradient element held and reduced (NeMo's rows: bf16)
    ep: int = 1  # expert-parallel degree (inside the data-parallel ranks)
    precision: str = ""  # the plan's precision where the row's dtypes are that setting's; '': the cost options'
    expert_dispatch: str = ""  # what the expert all-to-alls send (DeepEP: per-rank); '': nest-fx's runtime
    expert_routing: str = ""  # how a token's experts spread over them (the expert_routing setting)

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.fsdp

    @property
    def pp_microbatches(self) -> int:
        """How many microbatches a pipelined row splits its local batch into. torchtitan (9dec370,
        ``build_pipeline_schedule``): ``pipeline_parallel_microbatches`` unset = the total number
        of stages, PP degree x stages per rank (its tables set no count). Meta's rows: microbatch
        1 (assumed; the paper states no microbatch size)."""
        if self.pp == 1:
            return 1
        if self.system == "llama3":
            return self.local_batch
        return self.pp * self.virtual_stages

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step and replica: NeMo's rows accumulate GBS / (DP x MBS) of their stated
        MBS, pipelined or not; the others as ``pp_microbatches``."""
        return self.local_batch // self.microbatch if self.microbatch else self.pp_microbatches

    @property
    def bf16(self) -> bool:
        return not self.float8

    @property
    def kernels(self) -> str:
        """The kernel backend the row's system ran (nest_fx.workload.kernels): torchtitan runs
        PyTorch's eager ops, or torch.compile'd blocks; Meta's Llama 3 stack fused kernels."""
        return self.backend or ("compile" if self.compile else "eager")

    @property
    def attention_kernel(self) -> str:
        """SDPA's attention kernel the row ran: torchtitan's December 2024 runs used a torch nightly
        whose SDPA picked FlashAttention-2 on H100 (cuDNN's attention was opt-in then: pytorch/pytorch
        PR #138522, issue #142132 on 2.6.0.dev20241204), and so did Trainy's June 2025 runs on torch
        2.8.0a0 (cuDNN became SDPA's default on sm90 with PR #162073, September 2025, for 2.9);
        Meta's fused stack is priced by ``kernels``."""
        return "flash" if self.system == "torchtitan" else ""

    @property
    def norm_kernel(self) -> str:
        """How the row's RMSNorms ran: torchtitan's December 2024 torch nightly had no fused CUDA
        RMSNorm (``F.rms_norm`` decomposed into its ops; the fused ``_fused_rms_norm`` came with
        pytorch/pytorch PR #153666, May 2025), so its eager norms kept their fp32 copies:
        ``model``. Meta's Llama 3 stack: ``memory-efficient`` (each norm keeps its output, which the
        projections reading it keep anyway, not its input), derived from sec. 3.3.2: "we proactively
        deallocate tensors that will not be used for future computation, including the input and
        output tensors of each pipeline stage", and a stage there is one layer whose first op is
        its attention norm: that stage input is needed by nothing in backward only if the norm keeps
        its output, as apex's memory-efficient norms do (Megatron-LM's --memory-efficient-layer-norm).
        Costed with the norms keeping their input instead (``fused``), m1 / m3 need 77.3 / 77.9 GiB
        of 79.2 (docs/cost_model.md, "Seventh run")."""
        if self.system in ("nemo", "automodel"):
            return ""  # Transformer Engine's fused RMSNorm keeps its input and rstd, as F.rms_norm does
        return "model" if self.system == "torchtitan" else "memory-efficient"

    @property
    def loss_kernel(self) -> str:
        """How the row's loss ran (``plan.loss_kernel``): torchtitan's compiled loss (rows w), else
        torchtitan's under loss parallelism is PyTorch's DTensor ``loss_parallel``, an op-by-op
        cross-entropy on the sharded logits (``eager``: two fp32 gradients in backward);
        Megatron's vocabulary-parallel loss (NeMo) works in place, as nest-fx's does ('')."""
        if self.compiled_loss:
            return "compile"
        return "eager" if self.system == "torchtitan" else ""

    @property
    def published(self) -> float:
        """The published figure compared: model TFLOP/s per GPU where the source gives that, else
        tokens/s per GPU."""
        return self.tflops_per_gpu or self.tps_per_gpu


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
    # NeMo's FP8 pre-training table (NEMO_SOURCE), the dense Llama and GPT-3 rows: GPUs, GBS, MBS,
    # sequence length, TP, PP, CP, VP as stated; tokens/s per GPU; no memory figure (they ran: they
    # must fit). Megatron-Core with Transformer Engine: fused kernels, fp8 GEMMs, sequence
    # parallelism with TP, the vocabulary-parallel loss, the distributed optimizer (ZeRO-1), pipeline
    # outputs freed after their send (Megatron's deallocate_output_tensor), layers split evenly.
    # Gradients held and reduced in bf16: NeMo's performance script for the Llama 3 8B row sets
    # grad_reduce_in_fp32 = False ("bf16 grad dtype"; NVIDIA/NeMo scripts/llm/performance/llama3_8b.py),
    # the launcher's FP8 Llama 2 examples optim.grad_sync_dtype=bf16. Assumed (not stated): no
    # activation recompute, TP communication not hidden (the share Transformer Engine's userbuffers
    # overlap hides is not sourced), the DGX H100 preset's network.
    for key, model, gpus, gbs, mbs, seq, tp, pp, cp, vp, tps in (
        ("n1", "l2-7b", 8, 128, 1, 4096, 1, 1, 1, 1, 16934),
        ("n2", "l2-13b", 16, 128, 1, 4096, 1, 4, 1, 10, 8715),
        ("n3", "l2-70b", 64, 128, 1, 4096, 4, 4, 1, 20, 1728),
        ("n4", "8b", 8, 128, 1, 8192, 1, 1, 2, 1, 12273),
        ("n5", "70b-l3", 64, 128, 1, 8192, 4, 4, 2, 5, 1524),
        ("n6", "gpt3-175b", 128, 256, 1, 2048, 4, 8, 1, 6, 716),
        ("n7", "gpt3-175b", 512, 2048, 2, 2048, 4, 8, 1, 6, 825),
    ):
        dp = gpus // (tp * pp * cp)
        rows.append(
            Row(
                key,
                "NeMo",
                f"{model} {gpus} GPUs TP {tp} PP {pp} CP {cp} VP {vp} GBS {gbs} MBS {mbs} seq {seq}",
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
                hardware="dgx-h100",
                microbatch=mbs,
                reduce_bytes=2,
            )
        )
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
