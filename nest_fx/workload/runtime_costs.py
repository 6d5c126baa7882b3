"""What the kernel backend (``compile``, ``fused``: ``nest_fx.workload.kernels``) and Float8
linears change in a block's op times (plan fields ``kernels``, ``compile`` and ``float8``;
``Workload.for_runtime``).

torch.compile (inductor, the runtime compiles each block's forward): every maximal connected set
of a block's elementwise and reduction nodes (anything but matmuls and attention) runs as one
fused kernel: its FLOPs as before, its memory traffic only the tensors that cross the set's
boundary (read once, written once), one launch. Ansel et al. 2024 ("PyTorch 2: Faster Machine
Learning Through Dynamic Python Bytecode Transformation and Graph Compilation", ASPLOS) describe
inductor's fusion of pointwise and reduction ops into one kernel per chain. The backward keeps
the forward's ratio (``backward_factor`` of the fused forward in the analytical model). A
backend realises the share ``fusion`` of that saving (``kernels.KERNEL_BACKENDS``: compile's
measured, 1 for hand-written fused kernels).

Float8 (torchao ``convert_to_float8_training``, tensorwise dynamic scaling: the blocks' linears
whose sizes are multiples of 16): the three GEMMs of each linear (forward, input gradient,
weight gradient) run at the device's fp8 rate on fp8 operands (1 byte per element, bf16
output), and each operand is cast first: an amax pass and a cast pass over the bf16 tensor
(read 2 + read 2 + write 1 = 5 bytes per element, two kernels) in eager mode, one fused pass (3
bytes per element, no extra launch) under torch.compile; the backward also transposes the saved
fp8 input and weight (read 1 + write 1 each). FSDP all-gathers the Float8 linears' weights in
fp8 (torchtitan's ``enable_fsdp_float8_all_gather``; ``LayerCost.fp8_params``). Activations
are costed as in bf16 (the saved inputs stay bf16). Sources: the torchao float8 README (recipes,
casts, fp8 all-gather); the fp8 peak is the device's (``DeviceSpec.peak_flops["fp8"]``, H100:
1979 TFLOP/s dense, the datasheet).

Both are applied to the variant's node times as ratios of the analytical model (fused over
unfused, fp8 over bf16), so measured op times (a profile) are scaled the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Set, Tuple

from nest_fx.workload.kernels import KERNEL_BACKENDS, KernelBackend

CAST_BYTES_EAGER = 5.0  # bytes per element: amax pass (read 2) + cast pass (read 2, write 1)
CAST_BYTES_COMPILED = 3.0  # one fused pass: read 2, write 1
TRANSPOSE_BYTES = 2.0  # an fp8 tensor transposed for a backward GEMM: read 1, write 1
FP8_BYTES = 1.0
FP8_MULTIPLE = 16  # torchao converts linears whose in and out features are multiples of 16


@dataclass(frozen=True)
class RuntimeCosts:
    """The kernel backend and whether Float8 linears a workload is costed with (module docstring)."""

    backend: KernelBackend = field(default_factory=lambda: KERNEL_BACKENDS["eager"])
    float8: bool = False
    # the model's own RMSNorms run as F.rms_norm (plan.norm_kernel '' or fused; workload/fused_norms.py)
    model_norms_fused: bool = True
    # every unsharded RMSNorm keeps its output, not its input (plan.norm_kernel memory-efficient)
    norm_keeps_output: bool = False
    # the loss on full logits runs torch.compile'd (plan.loss_kernel compile; workload/loss_terms.py)
    loss_compiled: bool = False
    # the vocabulary-parallel loss computes its gradient in place (plan.loss_kernel other than eager)
    loss_in_place: bool = True

    @property
    def fuses(self) -> bool:
        """Whether elementwise regions run fused (any backend but eager)."""
        return self.backend.fusion > 0

    def float8_node(self, block_kind: str, n) -> bool:
        """Whether node ``n`` of a block is a linear torchao converts to Float8."""
        if not self.float8 or block_kind != "block" or not n.linear_dims[1]:
            return False
        _, features_in, features_out = n.linear_dims
        return features_in % FP8_MULTIPLE == 0 and features_out % FP8_MULTIPLE == 0

    def param_counts(self, block_kind: str, nodes: Sequence, tp: int, ep: int) -> Tuple[float, float, float, float]:
        """(parameters, parameter bytes, expert parameters, Float8 parameters) per device of a
        block's ``nodes`` at TP degree ``tp`` and EP degree ``ep`` (``TracedSource.cost``)."""
        params = param_bytes = expert_params = fp8_params = 0.0
        for n in nodes:
            epdiv = ep if n.expert else 1
            node_params = (n.params - n.tp_params + n.tp_params / tp) / epdiv
            params += node_params
            param_bytes += (n.param_bytes - n.tp_param_bytes + n.tp_param_bytes / tp) / epdiv
            if n.expert:
                expert_params += node_params
            if self.float8_node(block_kind, n):
                fp8_params += node_params
        return params, param_bytes, expert_params, fp8_params

    def apply(
        self,
        source,
        block,
        nodes: Sequence,
        times: List[Tuple[float, float]],
        tp: int,
        mbs: int,
        sp: bool,
        cp: int,
        base: Optional[Sequence[float]] = None,
    ) -> List[Tuple[float, float]]:
        """``times`` (forward, backward per node of ``block``) under torch.compile and Float8.
        ``base``: the analytical forward time of each node as the eager runtime runs it (its
        fused RMSNorms: ``fused_norms``), the baseline a region's saving is reckoned from; None:
        every node's own op time."""
        if block.kind != "block" or not (self.fuses or self.float8):
            return times
        timing = source.timing
        out = list(times)
        shares = source.node_shares(block, tp, mbs, sp, cp)
        if self.fuses:
            realised = self.backend.fusion
            for members, boundary in source.facts(block.index).regions:
                unfused = sum(
                    base[k]
                    if base is not None
                    else timing.op_seconds(nodes[k].flops * shares[k], nodes[k].bytes_moved * shares[k], False)
                    for k in members
                )
                flops = sum(nodes[k].flops * shares[k] for k in members)
                nbytes = sum(b * shares[k] for k, b in boundary)
                ratio = timing.op_seconds(flops, nbytes, False) / unfused if unfused > 0 else 1.0
                ratio = 1.0 - realised * (1.0 - ratio)
                for k in members:
                    out[k] = (out[k][0] * ratio, out[k][1] * ratio)
        if self.float8:
            if not getattr(timing, "fp8_flops", 0.0):
                raise ValueError("float8: the device has no fp8 tensor-core rate (DeviceSpec.peak_flops['fp8'])")
            for k, n in enumerate(nodes):
                if self.float8_node(block.kind, n):
                    out[k] = self._float8(timing, n, shares[k], n.params / (tp if n.tp else 1), out[k])
        return out

    def _float8(self, timing, n, share: float, weights: float, times: Tuple[float, float]) -> Tuple[float, float]:
        """A linear's (forward, backward) seconds with fp8 GEMMs and the casts of their operands;
        ``share``: the variant's share of the traced activations, ``weights``: the rank's weight
        elements."""
        rows, features_in, features_out = n.linear_dims
        x, w, y = rows * features_in * share, weights, rows * features_out * share
        flops = n.flops * share
        bf16 = timing.op_seconds(flops, n.bytes_moved * share, True)
        fp8 = timing.op_seconds(flops, (x + w) * FP8_BYTES + 2 * y, True, fp8=True)
        ratio = fp8 / bf16 if bf16 > 0 else 1.0
        per_cast = CAST_BYTES_COMPILED if self.backend.fused_casts else CAST_BYTES_EAGER
        launches = 0 if self.backend.fused_casts else 2
        fwd_cast = timing.memory_seconds((x + w) * per_cast, 2 * launches)
        bwd_cast = timing.memory_seconds(y * per_cast + (x + w) * TRANSPOSE_BYTES, launches + 2)
        return times[0] * ratio + fwd_cast, times[1] * ratio + bwd_cast


def fusion_regions(g, names: Sequence[str], fusible: Sequence[bool]) -> List[Tuple[List[int], List[Tuple[int, float]]]]:
    """Maximal connected sets of a block's fusible nodes (indices into ``names``), each with the
    bytes crossing its boundary as (node index, bytes) pairs: the outputs of producers outside the
    set that it reads (charged to the reading node) and its outputs read outside it (or by
    nothing: the block's output)."""
    index = {name: k for k, name in enumerate(names)}
    parent = list(range(len(names)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for k, name in enumerate(names):
        if not fusible[k]:
            continue
        for succ in g.successors(name):
            j = index.get(succ)
            if j is not None and fusible[j]:
                parent[find(j)] = find(k)
    groups: dict = {}
    for k in range(len(names)):
        if fusible[k]:
            groups.setdefault(find(k), []).append(k)
    out = []
    for members in groups.values():
        inside: Set[str] = {names[k] for k in members}
        boundary: List[Tuple[int, float]] = []
        seen: Set[str] = set()
        for k in members:
            for pred in g.predecessors(names[k]):
                if pred not in inside and pred not in seen:
                    seen.add(pred)
                    boundary.append((k, float(g.nodes[pred].get("out_bytes", 0.0))))
            consumers = list(g.successors(names[k]))
            if not consumers or any(c not in inside for c in consumers):
                boundary.append((k, float(g.nodes[names[k]].get("out_bytes", 0.0))))
        out.append((sorted(members), boundary))
    return out
