"""Analytical compute model: a roofline per op with documented efficiency assumptions.

For planning without a GPU. An op doing ``F`` FLOPs and moving ``Q`` bytes takes

    t = max(F / (P * e_mm(F)), Q / (W * e_mem)) + t_launch        (roofline, Williams et al. 2009)

with ``P`` the device's peak FLOP/s for the training dtype (tensor cores for matmuls, the
vector rate ``P * vector_fraction`` for other ops), ``W`` its memory bandwidth, and

    e_mm(F) = e_max * F / (F + F_half)

a saturating GEMM efficiency: large GEMMs reach ``e_max`` of peak, a GEMM of ``F_half``
FLOPs reaches half of that. Defaults (``e_max`` 0.75, ``F_half`` 2 GFLOP, ``e_mem`` 0.7,
5 us per kernel) are the usual figures for A100 cuBLAS and elementwise kernels; they are
assumptions, written down here, and checked end to end against Narayanan et al. 2021's GPT-3
175B throughput in ``tests/unit/cost/test_published.py``. On Hopper the GEMM ramp is measured
(``scripts/bench_gpu_kernels.py``, section ``gemm``: 40 bf16 GEMMs of the Llama 3 linears' shapes at
512-16,384 tokens on an H200): the least-squares fit keeps ``e_max`` 0.75 and gives ``F_half`` 11
GFLOP (mean error 6.4%, against 17.2% with 2 GFLOP), i.e. a ramp of 11 us at the bf16 peak:
:data:`GEMM_RAMP_S`, ``F_half = peak x 11 us`` in the dtype computed in. Backward ops cost twice their forward
(two GEMMs per forward GEMM: input gradient and weight gradient).

Fused attention kernels are costed apart, at the rate measured for the kernel that runs
(``attention_efficiency`` replaces ``e_max`` for them; the GEMM figure elsewhere), forward and
backward apart (the backward runs five GEMMs for the forward's two, the scores recomputed: 2.5 x
the forward's FLOPs, Dao 2023, sec. 3.1.2; ``attention_backward_factor`` is that 2.5 scaled by the
forward / backward rates). PyTorch's SDPA has two fused kernels on Hopper, :data:`SDPA_ATTENTION`:

* ``cudnn`` (cuDNN's fused attention): PyTorch's own choice on Hopper and Blackwell once the cuDNN it
  bundles is newer than 9.15 (torch >= 2.11; before, cuDNN was opt-in after the 2.5 bugs, pytorch
  PR #138522), and the kernel nest-fx's runtime pins (``plan.attention_kernel``, ``apply/sdpa_kernel.py``);
* ``flash`` (FlashAttention-2): PyTorch's choice before that (torchtitan's 2024 benchmarks ran it).
  Dao 2023 gives 73% of an A100's peak forward; on Hopper FlashAttention-2 does not use the
  asynchronous tensor-core instructions (Shah et al. 2024, "FlashAttention-3", sec. 1): 35% of an
  H100's peak.

Both rates are measured (``scripts/bench_gpu_kernels.py``, section ``sdpa``, on an H200 with torch
2.11 / cuDNN 9.x: ``results/gpu/bench_gpu_kernels_h200.json``): causal bf16 attention, head
dimension 128, 32 heads, 8K-131K tokens, the median over the three lengths: flash forward 0.34,
backward 0.32 of the bf16 peak; cuDNN forward 0.64, backward 0.52. An H100 has the H200's compute
(the same SMs and clocks; only the memory differs), so the H200's compute-bound rates are used for both.

Under the ``fused`` kernel backend (``nest_fx.workload.kernels``: Transformer Engine / Megatron-LM
with cuDNN or FlashAttention-3 attention) attention on Hopper runs at the measured causal rate of
cuDNN's fused attention above (forward 0.64, backward 0.52: Transformer Engine's fused attention
is cuDNN's), :data:`FUSED_ATTENTION`, applied by :meth:`AnalyticalCompute.with_kernels`. Until
2026-11-27 it was FlashAttention-3's headline figure, 0.75 / 0.55 (740 TFLOP/s, Shah et al. 2024,
sec. 4.1), which is its best forward without a causal mask; training attention is causal.

Blackwell (B200, GB200) has no rate measured here; its rates come from published measurements
(:data:`GEMM_EFFICIENCY`, :data:`GEMM_RAMP_S`, :data:`DERIVED_ATTENTION`). Its datasheet peaks
with the A100-era defaults (``e_max`` 0.75, ``F_half`` 2 GFLOP, attention at ``e_max``) priced
NVIDIA's B200 / GB200 runs 17-32% too fast:

* GEMMs: vLLM's kernel benchmark (``benchmarks/kernels/bench_fp8_gemm.py``, its ``torch-bf16``
  column: cuBLAS through torch) on a B200, in vllm-project/vllm PRs #18778 and #19566 (2025): six
  bf16 GEMMs of Llama 3.1 8B's linears (N x K = 6144 x 4096 and 4096 x 4096) at 512-16,384 tokens,
  1,336-1,513 TFLOP/s. The fit of ``e_max F / (F + F_half)`` (least mean relative error, as the
  Hopper fit) gives ``e_max`` 0.674 and ``F_half`` 3.4 GFLOP (a ramp of 1.5 us at 2.25 PFLOP/s),
  mean error 1.3% (the defaults: 14.2%). The best shape of all reaches 77.6% (Bekman's "Maximum
  Achievable Matmul FLOPS" table, stas00/ml-engineering: B200 1,745 of 2,250 TFLOP/s; H100 80.3%).
* GB200 runs B200's kernels with a higher datasheet peak (2.5 PFLOP/s bf16) that its measured best
  matmul does not follow: 1,822 TFLOP/s (72.9%) in the same table, 1.044 x the B200's. Its rates are
  the B200's as fractions of its own peak scaled by 0.940 = (1,822 / 2,500) / (1,745 / 2,250).
* Attention: "FlashAttention-4" (arXiv 2603.05451, 2026): on Blackwell the
  exponential units and shared-memory bandwidth did not grow with the tensor cores, so the forward
  is bound by the softmax's exponentials and the backward by shared-memory traffic; the fastest
  kernel reaches at best 71.7% of the B200's bf16 peak (1,613 TFLOP/s), and cuDNN 9.13 is up to 1.3x
  slower. FlashAttention-3's best on an H100 is 74.8% (740 TFLOP/s). The Hopper fractions measured
  here (cuDNN causal 0.64 / 0.52, FlashAttention-2 0.34 / 0.32) are scaled by 0.958 = 71.7 / 74.8
  on a B200 (x 0.940 on a GB200): derived, not measured on Blackwell.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Optional, Tuple

from nest_fx.common.device_family import device_entry
from nest_fx.workload.attention_share import ATTENTION_HALF_RATE_TOKENS

# PyTorch SDPA's fused kernels: {kernel: ((device family, forward, backward fraction of peak), ...)},
# measured (module docstring); other devices: DERIVED_ATTENTION, else e_max
SDPA_ATTENTION = {
    "cudnn": (("H100", 0.64, 0.52), ("H200", 0.64, 0.52)),
    "flash": (("H100", 0.34, 0.32), ("H200", 0.34, 0.32)),
}
# devices whose attention rates are a measured device's scaled (module docstring, "Blackwell"):
# (device family, measured device family, scale of its fractions of peak)
B200_ATTENTION_SCALE = round((1613 / 2250) / (740 / 989), 3)  # FlashAttention-4's best / FlashAttention-3's
GB200_RATE_SCALE = round((1822 / 2500) / (1745 / 2250), 3)  # the GB200's best matmul share / the B200's
DERIVED_ATTENTION = (("B200", "H100", B200_ATTENTION_SCALE), ("GB200", "H100", B200_ATTENTION_SCALE * GB200_RATE_SCALE))
# the GEMM ramp: a GEMM of F FLOPs reaches e_max F / (F + F_half) of peak with F_half = peak x this
# time (device family, seconds), measured or sourced (module docstring); other devices: F_half 2 GFLOP
GEMM_RAMP_S = (("H100", 11e-6), ("H200", 11e-6), ("B200", 1.5e-6), ("GB200", 1.5e-6))
# e_max where it is not the default 0.75 (device family, e_max), sourced (module docstring)
GEMM_EFFICIENCY = (("B200", 0.674), ("GB200", round(0.674 * GB200_RATE_SCALE, 3)))
# the kernel a plan that names none is priced with: what the runtime pins (plan.attention_kernel '')
DEFAULT_ATTENTION_KERNEL = "cudnn"
# (device family, forward, backward fraction of peak) of fused attention under kernels=fused:
# cuDNN's measured causal rates (module docstring)
FUSED_ATTENTION = SDPA_ATTENTION["cudnn"]
ATTENTION_BACKWARD_FACTOR = 2.5
# a device named so runs torch's CPU backend, where F.rms_norm decomposes into its ops (workload/fused_norms.py)
DECOMPOSED_NORM_DEVICE = "cpu"


@dataclass
class AnalyticalCompute:
    """Roofline op timing for one device type and dtype (see module docstring)."""

    peak_flops: float  # FLOP/s of the training dtype on tensor cores
    mem_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.75
    matmul_half_flops: float = 2e9
    matmul_ramp_s: Optional[float] = None  # F_half = peak x this, where measured (GEMM_RAMP_S); None: as given
    memory_efficiency: float = 0.7
    vector_fraction: float = 0.125  # non-matmul FLOP/s as a fraction of peak (CUDA cores vs tensor cores)
    launch_s: float = 5e-6
    backward_factor: float = 2.0
    fp8_flops: float = 0.0  # FLOP/s of fp8 tensor cores (Float8 linears); 0 = none
    attention_efficiency: Optional[float] = None  # fused attention's e_max; None: matmul_efficiency
    attention_backward_factor: float = ATTENTION_BACKWARD_FACTOR
    # per SDPA kernel: (forward, backward) e_max on this device (SDPA_ATTENTION); empty: none measured
    sdpa_attention: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    peaks: Dict[str, float] = field(default_factory=dict)  # the device's peak FLOP/s per dtype (in_dtype)
    vector_share: float = 0.125  # non-matmul FLOP/s as a fraction of the device's fastest rate (for_device)
    fa3_attention: Optional[Tuple[float, float]] = None  # (forward, backward) e_max under kernels=fused
    # fused attention's rate by call length: k / (k + this) of the long-call rate (attention_share)
    attention_half_tokens: float = ATTENTION_HALF_RATE_TOKENS
    # F.rms_norm runs one fused kernel each way (CUDA's _fused_rms_norm); torch's CPU backend decomposes it
    fused_rms_norm: bool = True
    rates_source: str = ""  # where the kernel rates come from (for_device: rates_source)

    @classmethod
    def for_device(cls, device, dtype: str = "bf16", **overrides) -> "AnalyticalCompute":
        """Defaults for a ``DeviceSpec`` (from ``nest_fx.cluster``) and a dtype name. Non-matmul
        ops run at ``vector_fraction`` of the device's fastest (matrix-unit) rate, at most the
        dtype's own peak (fp32 on a GPU: its fp32 rate). Attention rates and the GEMM ramp: the
        device's ``kernel_rates`` where its cluster file sets them, else this module's tables."""
        fp8 = float(device.peak_flops.get("fp8", 0.0))
        name = device.name
        sdpa = {k: row for k, table in SDPA_ATTENTION.items() if (row := _values(table, name)) is not None}
        fa3 = _values(FUSED_ATTENTION, name)
        derived = _values(DERIVED_ATTENTION, name)
        if derived and not sdpa:
            measured, scale = derived
            sdpa = {
                kernel: tuple(round(r * scale, 3) for r in _values(table, measured))
                for kernel, table in SDPA_ATTENTION.items()
            }
            fa3 = sdpa.get("cudnn")  # Transformer Engine's fused attention is cuDNN's
        ramp = (_values(GEMM_RAMP_S, name) or (None,))[0]
        top = (_values(GEMM_EFFICIENCY, name) or (cls.matmul_efficiency,))[0]
        half_tokens = cls.attention_half_tokens
        rates = getattr(device, "kernel_rates", None)  # the device's own measured rates replace the tables'
        source = rates_source(name, rates is not None)
        if rates is not None:
            sdpa.update({k: tuple(v) for k, v in rates.attention.items() if k != "fused"})
            fa3 = tuple(rates.attention["fused"]) if "fused" in rates.attention else fa3
            ramp = rates.gemm_ramp if rates.gemm_ramp is not None else ramp
            top = rates.gemm_efficiency if rates.gemm_efficiency is not None else top
            half_tokens = rates.attention_half_tokens if rates.attention_half_tokens is not None else half_tokens
        peaks = {str(k): float(v) for k, v in device.peak_flops.items()}
        share = overrides.pop("vector_fraction", cls.vector_fraction)
        peak = device.peak(dtype)
        fields = dict(
            peak_flops=peak,
            matmul_efficiency=top,
            matmul_half_flops=ramp * peak if ramp else cls.matmul_half_flops,
            matmul_ramp_s=ramp,
            mem_bandwidth=device.mem_bandwidth,
            fp8_flops=fp8,
            sdpa_attention=sdpa,
            peaks=peaks,
            vector_share=share,
            fa3_attention=fa3,
            attention_half_tokens=half_tokens,
            vector_fraction=_vector_fraction(peaks, share, peak),
            fused_rms_norm=not name.lower().startswith(DECOMPOSED_NORM_DEVICE),
            rates_source=source,
        )
        timing = cls(**{**fields, **overrides})
        return timing if "attention_efficiency" in overrides else timing.with_kernels(False)

    def in_dtype(self, dtype: str) -> "AnalyticalCompute":
        """The same device computing in ``dtype`` (its peak from :attr:`peaks`); ValueError when
        the device lists no rate for it."""
        if dtype not in self.peaks:
            raise ValueError(f"the device lists no peak FLOP/s for {dtype!r} (known: {sorted(self.peaks)})")
        peak = self.peaks[dtype]
        half = self.matmul_ramp_s * peak if self.matmul_ramp_s else self.matmul_half_flops
        return replace(
            self,
            peak_flops=peak,
            matmul_half_flops=half,
            vector_fraction=_vector_fraction(self.peaks, self.vector_share, peak),
        )

    def with_kernels(self, hopper_attention: bool, attention_kernel: str = "") -> "AnalyticalCompute":
        """This timing under a kernel backend: with ``hopper_attention`` (``kernels=fused``) fused
        attention at FlashAttention-3's rates, else at the measured rates of SDPA's
        ``attention_kernel`` (cudnn, flash; '' = :data:`DEFAULT_ATTENTION_KERNEL`), where the
        device has those figures; forward and backward apart (the backward factor 2.5 x forward /
        backward rate)."""
        rates = self.fa3_attention if hopper_attention else None
        if rates is None:
            rates = self.sdpa_attention.get(attention_kernel or DEFAULT_ATTENTION_KERNEL)
        if rates is None:
            return self
        fwd, bwd = rates
        factor = ATTENTION_BACKWARD_FACTOR * fwd / bwd
        if (self.attention_efficiency, self.attention_backward_factor) == (fwd, factor):
            return self
        return replace(self, attention_efficiency=fwd, attention_backward_factor=factor)

    def matmul_eff(self, flops: float, attention: bool = False) -> float:
        """e_mm(F) = e_max * F / (F + F_half); ``attention``: a fused attention kernel's e_max."""
        top = self.matmul_efficiency
        if attention and self.attention_efficiency is not None:
            top = self.attention_efficiency
        return top * flops / (flops + self.matmul_half_flops) if flops > 0 else 0.0

    def op_seconds(
        self, flops: float, bytes_moved: float, matmul: bool, fp8: bool = False, attention: bool = False
    ) -> float:
        """Forward time of one op (roofline plus launch overhead); 0 for ops that do nothing.
        ``fp8``: a matmul on fp8 tensor cores (``fp8_flops``, same efficiency curve);
        ``attention``: a fused attention kernel (``attention_efficiency``)."""
        if flops <= 0 and bytes_moved <= 0:
            return 0.0
        if matmul and flops > 0:
            peak = self.fp8_flops if fp8 else self.peak_flops
            compute = flops / (peak * self.matmul_eff(flops, attention))
        else:
            compute = flops / (self.peak_flops * self.vector_fraction)
        memory = bytes_moved / (self.mem_bandwidth * self.memory_efficiency)
        return max(compute, memory) + self.launch_s

    def memory_seconds(self, bytes_moved: float, launches: int = 1) -> float:
        """Time of memory-bound work moving ``bytes_moved`` in ``launches`` kernels."""
        return bytes_moved / (self.mem_bandwidth * self.memory_efficiency) + launches * self.launch_s

    def to_dict(self) -> dict:
        return asdict(self)


def rates_source(name: str, cluster_file: bool = False) -> str:
    """Where the kernel rates of a device called ``name`` come from, in words: its cluster file's
    ``device.kernel_rates``, the tables' measured or derived rows, or the defaults."""
    if cluster_file:
        return "kernel rates from the cluster file (device.kernel_rates; the tables for the rest)"
    if device_entry(SDPA_ATTENTION["cudnn"], name):
        return "kernel rates measured on this GPU type (results/gpu/)"
    if device_entry(DERIVED_ATTENTION, name):
        return "kernel rates derived from published measurements (docs/cost_model.md, Blackwell)"
    return "no kernel rates measured for this device: e_max 0.75 (docs/cluster_format.md, device.kernel_rates)"


def _values(table, name: str) -> Optional[tuple]:
    """The values of ``table``'s row for the device called ``name`` (:func:`device_entry` less its
    name part); None when no row is its."""
    entry = device_entry(table, name)
    return entry[1:] if entry else None


def _vector_fraction(peaks: Dict[str, float], share: float, peak: float) -> float:
    """Non-matmul FLOP/s as a fraction of ``peak``: ``share`` of the fastest non-fp8 rate of
    ``peaks``, at most ``peak`` itself."""
    top = max((v for k, v in peaks.items() if k != "fp8"), default=peak)
    return min(1.0, share * top / peak)
