"""The kernel backend a workload is costed with (the ``kernels`` plan setting).

A traced model is a graph of PyTorch ops; which kernels run them is a choice of the training
system, not of the model. Three backends, each a row of :data:`KERNEL_BACKENDS`:

``eager``    PyTorch ops as traced, one kernel each (nest-fx's runtime without ``compile``):
             every elementwise op reads and writes its tensors, an RMSNorm computed in fp32 keeps
             fp32 copies for backward, attention is the SDPA kernel the plan pins
             (``attention_kernel``: cuDNN's by default, or FlashAttention-2; measured rates in
             ``roofline.SDPA_ATTENTION``).
``compile``  ``torch.compile`` of each block (the runtime with ``compile``): inductor fuses each
             connected set of elementwise and reduction ops into one kernel
             (``runtime_costs.fusion_regions``); ``fusion`` is the share of the traffic saving
             of full fusion that a compiled block realises (below); AOTAutograd's min-cut
             partitioner saves for backward the cheapest tensors the region's backward can be
             recomputed from (``fused_activations``); attention is the same SDPA kernel.
``fused``    Hand-written fused kernels as Transformer Engine / Megatron-LM run them (fused
             RMSNorm, RoPE, SwiGLU, bias-dropout-add; cuDNN / FlashAttention-3 attention on
             Hopper): every elementwise region is one kernel at its boundary traffic
             (``fusion`` 1), a fused norm keeps its bf16 input and not its fp32 copies, a fused
             SwiGLU its two inputs and not its SiLU output, and the attention output projection
             saves the attention kernel's own output (Megatron-LM's core attention writes it as
             ``[s, b, heads x head_dim]``, which ``linear_proj`` reads without a copy: one
             tensor, not two); attention at cuDNN's measured causal rate on Hopper
             (``roofline.FUSED_ATTENTION``). Under FP8 a linear keeps its input for the weight
             gradient as the quantized copy (Transformer Engine's ``Linear`` saves the FP8
             tensor it multiplied), one byte an element, and the attention output is then kept
             twice (bf16 by the kernel, FP8 by the projection). A MoE layer's experts multiply
             the router weights into their activation before their second GEMM (Megatron-Core's
             ``GroupedMLP`` / ``TEGroupedMLP``: ``activation_func_with_probs``), so the sum of the
             expert outputs keeps none of them (``routed_weighting``). The loss on full logits is
             Megatron-LM's vocabulary-parallel cross entropy at every TP degree, its softmax turned
             into the gradient in place (``loss_terms``; ``loss_kernel=eager`` prices an op-by-op
             loss instead). For predicting those systems (``--kernels fused``); nest-fx's runtime
             does not run them.

Sources of the factors (``docs/cost_model.md``, "Kernel backends"):

* ``fusion`` of ``compile`` (0.5): measured from torchtitan's published H100 benchmark, the only
  public like-for-like compile/eager pair of one LLM training configuration we know of (Llama 3.1
  8B, FSDP, op-level SAC: tokens/s 6,667 / 5,762 = 1.157x on 8 GPUs and 6,514 / 5,605 = 1.162x on
  128; ``benchmarks/llama3_h100_202412_torchtitan.md``, Tables 1 and 3). Full fusion of this
  model's regions predicts 1.39x; 0.49 of its saving reproduces 1.157-1.162x (rounded to a half).
  Those two rows of ``scripts/bench_published.py`` are therefore not a held-out check of
  ``compile``.
* ``fusion`` of ``fused`` (1.0): hand-written fused kernels run each region as one pass over its
  inputs and outputs at the memory roofline the model charges every kernel (``e_mem``);
  Korthikanti et al. 2022 (sec. 5, the fused kernels of Megatron-LM) and the Transformer Engine
  documentation (fused norm + linear, fused SwiGLU) describe the fusion.
* Activations of fused runtimes: Korthikanti et al. 2022, Table 2: 34 bytes per token per hidden
  unit for a GPT block with fused kernels (its attention block keeps the attention output once,
  as the projection's input: "linear projection stores its input activations with size 2sbh").
  For a Llama block (bf16, no dropout) the tensors a fused runtime keeps are, in bytes per token
  per hidden unit: the two norm inputs 2 + 2, the two norm outputs 2 + 2, the rotated query 2
  and the keys and values 4 kv/heads, the attention output 2 (once), the SwiGLU's gate and up
  4 f/h and the down projection's input 2 f/h: 12 + 4 kv/heads + 6 f/h, 31.75 for Llama 3
  405B (f/h = 3.25, kv/heads = 1/16) and 34 for Llama 3 8B (3.5, 1/4), against 56-59 traced
  eagerly (``tests/unit/workload/test_kernels.py``, ``tests/unit/workload/test_fused_activations.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import networkx as nx


@dataclass(frozen=True)
class KernelBackend:
    """How one kernel backend prices a block (module docstring)."""

    name: str
    fusion: float  # share of the full-fusion time saving of each elementwise region realised (0: none)
    fused_activations: bool  # an elementwise region keeps only the min-cut tensors of its backward
    hopper_attention: bool  # attention at the fused rate on Hopper (roofline.FUSED_ATTENTION: cuDNN's, measured)
    fused_casts: bool  # Float8 casts fused into their producers (one pass, no extra launch)
    # the attention output projection reads the attention kernel's output in place, so the
    # tensor its weight gradient needs is the one the kernel saved (counted once)
    shared_attention_output: bool = False
    # a Float8 linear keeps its input for the weight gradient as the quantized copy, one byte an
    # element (Transformer Engine's Linear saves the FP8 tensor it multiplied; torchao, nest-fx's
    # runtime, keeps the bf16 input and quantizes it again in backward)
    fp8_saved_inputs: bool = False
    # the router weights multiply the experts' activation before their second GEMM (Megatron-Core's
    # grouped experts), not the expert outputs: nothing of those is kept (workload/routed_weighting.py)
    expert_probs_in_activation: bool = False
    # the loss on full logits is a vocabulary-parallel cross entropy at every TP degree, its kept
    # softmax turned into the gradient in place (Megatron-LM computes every loss so: workload/loss_terms.py)
    loss_in_place_always: bool = False


KERNEL_BACKENDS: Dict[str, KernelBackend] = {
    "eager": KernelBackend("eager", fusion=0.0, fused_activations=False, hopper_attention=False, fused_casts=False),
    "compile": KernelBackend("compile", fusion=0.5, fused_activations=True, hopper_attention=False, fused_casts=True),
    "fused": KernelBackend(
        "fused",
        fusion=1.0,
        fused_activations=True,
        hopper_attention=True,
        fused_casts=True,
        shared_attention_output=True,
        fp8_saved_inputs=True,
        expert_probs_in_activation=True,
        loss_in_place_always=True,
    ),
}
KERNELS = tuple(KERNEL_BACKENDS)  # the plan's vocabulary lists the same names (plan.vocabulary.KERNELS)


def kernel_backend(kernels: Optional[str] = None, compile: bool = False) -> KernelBackend:
    """The backend named ``kernels``; '' or None: ``compile`` when the plan compiles its
    blocks, else ``eager`` (what nest-fx's runtime runs). ValueError naming the backends."""
    name = kernels or ("compile" if compile else "eager")
    try:
        return KERNEL_BACKENDS[name]
    except KeyError:
        raise ValueError(f"kernels: {name!r}, use one of {list(KERNELS)}") from None


def region_kept_bytes(g, names, members, saved) -> float:
    """Bytes an elementwise region keeps for backward when fused: the cheapest set of tensors
    from which every tensor its ops saved can be recomputed inside the region (a minimum cut,
    as AOTAutograd's min-cut partitioner chooses), at most what the ops saved eagerly.

    ``g``: the traced graph; ``names``: the block's node names; ``members``: indices of the
    region's nodes; ``saved``: bytes each node of the block saved eagerly. A tensor is charged
    its ``out_bytes``; the region's inputs from outside it can be kept at their own size; the
    demand is every input of a node that saved something no larger than what it saved (the
    trace records how many bytes an op saved, not which inputs: RoPE's ``q * cos`` saves ``cos``
    and not ``q``)."""
    eager = sum(saved[k] for k in members)
    if eager <= 0:
        return 0.0
    inside = {names[k] for k in members}
    flow = nx.DiGraph()
    for name in inside:
        for pred in g.predecessors(name):
            flow.add_edge(("out", pred), ("in", name))  # uncapacitated: infinite
            if pred not in inside:
                flow.add_edge("source", ("in", pred))
    for name in {n for e in list(flow.edges) for n in e if isinstance(n, tuple) and n[0] == "in"}:
        flow.add_edge(name, ("out", name[1]), capacity=float(g.nodes[name[1]].get("out_bytes", 0.0)))
    demanded = False
    for k in members:
        if saved[k] > 0:
            for pred in g.predecessors(names[k]):
                if float(g.nodes[pred].get("out_bytes", 0.0)) <= saved[k] * (1 + 1e-6):
                    flow.add_edge(("out", pred), "sink")
                    demanded = True
    if not demanded or "source" not in flow:
        return eager
    try:
        cut, _ = nx.minimum_cut(flow, "source", "sink")
    except nx.NetworkXUnbounded:
        return eager
    return min(eager, float(cut))
