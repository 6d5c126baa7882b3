"""One published run as ``bench_published.py`` costs it: its measurement and the configuration it
ran (``Row``). The rows themselves: ``_published_rows.py`` and ``_published_nvidia_rows.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

GiB = 2**30


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
    hardware: str = (
        "grand-teton"  # grand-teton (torchtitan's H100 hosts), h200 (Trainy's), or a preset (NVIDIA's systems)
    )
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
    # how the system's context parallelism runs attention (plan.cp_mode): "ring", chunk-pair calls
    # merged by log-sum-exp (torch's context_parallel, Transformer Engine's P2P ring); '': the keys
    # gathered whole (nest-fx's default, Meta's all-gather CP)
    cp_mode: str = ""

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.fsdp

    @property
    def pp_microbatches(self) -> int:
        """How many microbatches a pipelined row splits its local batch into. torchtitan (9dec370,
        ``build_pipeline_schedule``): ``pipeline_parallel_microbatches`` unset = the PP degree, for
        the interleaved schedule too (its tables set no count); PP degree x stages per rank only
        since pytorch/torchtitan PR #781 (2025-01-07, "PP is using the pipeline_parallel_degree as
        the default number of microbatches when it should be pipeline_parallel_degree *
        len(stages)"), after the benchmark's commit. Meta's rows: microbatch 1 (assumed; the paper
        states no microbatch size)."""
        if self.pp == 1:
            return 1
        if self.system == "llama3":
            return self.local_batch
        return self.pp

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
        AutoModel's ``MaskedCrossEntropy`` is an op-by-op loss too, and Meta's stack states none
        (``eager``, as priced before the ``fused`` backend's in-place loss); Megatron's
        vocabulary-parallel loss (NeMo, Megatron-Bridge) works in place at every TP degree, as the
        ``fused`` backend prices it ('')."""
        if self.compiled_loss:
            return "compile"
        return "eager" if self.system in ("torchtitan", "automodel", "llama3") else ""

    @property
    def published(self) -> float:
        """The published figure compared: model TFLOP/s per GPU where the source gives that, else
        tokens/s per GPU."""
        return self.tflops_per_gpu or self.tps_per_gpu
