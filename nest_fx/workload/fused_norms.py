"""RMSNorms priced as the one fused op PyTorch runs (``F.rms_norm``; ``plan.norm_kernel``).

The tracer tags the nodes of every module ``F.rms_norm`` computes (``graph/rms_norms.py``:
``rms_norm`` = ``native`` for ``torch.nn.RMSNorm``, ``model`` for the model's own code that the
runtime swaps, ``apply/fused_norms.py``). With the ``eager`` kernel backend, a norm the runtime
runs fused is priced as one op instead of its traced decomposition (:func:`norm_groups` finds
each module's nodes, :func:`fused_nodes` and :func:`fused_times` re-price them):

* time, memory-bound passes (CUDA's ``_fused_rms_norm`` and its backward, which shares PyTorch's
  layer-norm kernels): forward, one kernel reading ``x`` and writing ``y`` and the fp32 ``rstd``
  (one value per row); backward, two kernels: the input gradient (reads ``x``, ``dy``, ``rstd``
  and the weight, writes ``dx``), then the weight gradient's reduction over the rows (reads ``x``,
  ``dy`` and ``rstd`` again, writes the weight-sized gradient); about :data:`FORWARD_FLOPS` and
  :data:`BACKWARD_FLOPS` per element at the vector rate. Applied to the nodes' times as the
  analytical model's ratio fused / unfused (as ``runtime_costs`` applies compile), so measured op
  times are scaled the same way;
* saved for backward: ``x`` in its dtype and ``rstd`` in fp32, 4 bytes per row (torch's
  ``derivatives.yaml``: ``_fused_rms_norm``'s backward takes ``input``, ``weight``, ``result1``;
  the weight is a parameter, not an activation). Assumed no other op saves ``x`` (true of the
  residual stream a transformer block normalises);
* kept by an op-level recompute policy: ``y`` and ``rstd`` where the policy saves the norm's ops
  (``selective``: every output but the attention core's), nothing where it recomputes them.

``norm_kernel=memory-efficient`` (``apply/fused_norms.py``: nest-fx's own autograd function, as
apex's ``FusedRMSNorm(memory_efficient=True)`` and Megatron-LM's ``--memory-efficient-layer-norm``
run it) keeps the norm's output ``y`` and ``rstd`` instead of ``x``: the backward recovers the
normalised input as ``y / weight``; nest-fx's backward runs op by op (about 56 bytes per element in
bf16 against the fused backward's 10: :meth:`NormGroup.output_saving_backward_bytes`), priced so
under the eager backend. ``y`` is what the projections reading it save anyway (the
trace charges a tensor to the first node saving it: :attr:`NormGroup.y_saved`), so such a norm
keeps ``rstd`` alone. It swaps ``torch.nn.RMSNorm`` too, and runs on every device (its forward is
``aten._fused_rms_norm`` on CUDA, the same fp32 formula out of place elsewhere; its backward its
own). Under the ``fused`` backend (predicting systems
that run such norms, e.g. Meta's Llama 3 stack) every norm keeps ``rstd`` (and ``y`` where no reader
saves it) instead of what its region's min cut would keep for it
(``block_facts.BlockFacts.region_kept_lean``); with ``compile`` it is not run
(:func:`norm_kernel_problem`).

Which norms run fused in a variant (:func:`fused_groups`): ``native`` ones always, ``model`` ones
when the plan's ``norm_kernel`` is '' or ``fused``; never one tensor parallelism shards (a norm
under sequence parallelism, whose input is a DTensor, or a per-head norm inside a TP region: the
runtime keeps the model's code there), never on a device where ``F.rms_norm`` has no fused
kernel (``roofline.AnalyticalCompute.fused_rms_norm``: torch's CPU backend decomposes it). The
``compile`` and ``fused`` backends fuse the norm's whole region already (``runtime_costs``; their
min cut keeps the norm's input too): their bytes stay; their time saving is reckoned from the
eager runtime's, the fused norm included (``RuntimeCosts.apply``'s ``base``), so ``compile``
realises its share of what is left and ``fused`` is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from typing import Dict, List, Sequence, Tuple

from nest_fx.graph.rms_norms import NATIVE
from nest_fx.workload.kernels import region_kept_bytes

RSTD_BYTES = 4  # fp32 reciprocal root mean square, one per row
FORWARD_FLOPS = 4.0  # per element: square, sum, times rstd, times weight
BACKWARD_FLOPS = 8.0  # per element: the input gradient's terms and the weight gradient's product and sum
# kernels of the memory-efficient norm's backward on CUDA (apply/output_saving_norm.py): the upcast,
# dy * y, its mean, dy * w, y / w, the multiply-subtract, dx, the weight gradient's sum and division
OUTPUT_SAVING_BACKWARD_KERNELS = 9


@dataclass(frozen=True)
class NormGroup:
    """The nodes of one traced RMSNorm module and the tensors its fused op reads and writes."""

    module: str
    kind: str  # "native" | "model" (graph.rms_norms)
    members: Tuple[int, ...]  # node indices in the block, execution order
    x_bytes: float  # the input, in its dtype
    y_bytes: float  # the output
    rows: float  # rows normalised (one rstd each)
    elements: float  # elements of the input
    weight_bytes: float
    y_saved: bool = False  # a node reading the output saved it (a projection's input): memory-efficient keeps it free

    def scaled(self, k: float) -> "NormGroup":
        """The same norm with activations and weight ``k`` times as wide (``block_facts.scaled_facts``)."""
        return dataclass_replace(
            self, x_bytes=self.x_bytes * k, y_bytes=self.y_bytes * k, weight_bytes=self.weight_bytes * k
        )

    @property
    def rstd_bytes(self) -> float:
        return self.rows * RSTD_BYTES

    def output_saving_backward_bytes(self, share: float) -> float:
        """Bytes the memory-efficient norm's backward moves as nest-fx runs it
        (``apply/output_saving_norm.py``: op by op in fp32, :data:`OUTPUT_SAVING_BACKWARD_KERNELS`
        kernels): per element, with ``e`` the activation width, ``dy`` upcast (``e + 4``, none in
        fp32), ``dy * y`` (``8 + e``), its row mean (4), ``dy * w`` (8), ``y / w`` (``e + 4``), the
        fused multiply-subtract (12), ``dx`` written (``4 + e``) and the weight gradient's row sum
        (4): ``3 e + 44`` plus the upcast, 56 bytes in bf16 where the fused backward moves 10; the
        weight read and its gradient written."""
        e = self.x_bytes / self.elements if self.elements else 0.0
        per_element = 3 * e + 44 + (e + 4 if e < 4 else 0.0)
        return per_element * self.elements * share + 2 * self.weight_bytes

    def output_saving_bytes(self) -> float:
        """What the norm keeps for backward when it keeps its output (``norm_kernel=memory-efficient``):
        ``rstd``, and ``y`` unless a reader saved it already."""
        return self.rstd_bytes + (0.0 if self.y_saved else self.y_bytes)

    def forward_bytes(self, share: float) -> float:
        """Bytes the fused forward moves on ``share`` of the traced rows."""
        return (self.x_bytes + self.y_bytes + self.rstd_bytes) * share + self.weight_bytes

    def backward_bytes(self, share: float) -> float:
        """Bytes the fused backward's two kernels move: x, dy, rstd read and dx written, then x, dy,
        rstd read again for the weight gradient; the weight read, its gradient written."""
        return (3 * self.x_bytes + 2 * self.y_bytes + 2 * self.rstd_bytes) * share + 2 * self.weight_bytes


def norm_groups(g, nodes: Sequence[str]) -> List[NormGroup]:
    """One :class:`NormGroup` per RMSNorm module the tracer tagged among a block's ``nodes``
    (node attribute ``rms_norm``); its input is the largest tensor read from outside the module,
    its output what the module hands on."""
    by_module: Dict[str, List[int]] = {}
    for k, name in enumerate(nodes):
        d = g.nodes[name]
        if d.get("rms_norm"):
            by_module.setdefault(d.get("module", ""), []).append(k)
    groups = []
    for module, members in by_module.items():
        inside = {nodes[k] for k in members}
        x_bytes = max(
            (
                float(g.nodes[p].get("out_bytes", 0.0))
                for k in members
                for p in g.predecessors(nodes[k])
                if p not in inside
            ),
            default=0.0,
        )
        outs = [
            nodes[k]
            for k in members
            if not any(True for _ in g.successors(nodes[k])) or any(s not in inside for s in g.successors(nodes[k]))
        ]
        last = g.nodes[outs[-1]] if outs else g.nodes[nodes[members[-1]]]
        y_bytes = float(last.get("out_bytes", 0.0))
        readers = [r for o in outs for r in g.successors(o) if r not in inside]
        y_saved = any(float(g.nodes[r].get("saved_bytes", 0.0)) >= y_bytes * (1 - 1e-6) > 0 for r in readers)
        shape = (last.get("out_shapes") or [[]])[0]
        width = shape[-1] if shape else 0
        elements = 1.0
        for s in shape:
            elements *= s
        groups.append(
            NormGroup(
                module=module,
                kind=g.nodes[nodes[members[0]]]["rms_norm"],
                members=tuple(members),
                x_bytes=x_bytes,
                y_bytes=y_bytes,
                rows=elements / width if width else 0.0,
                elements=elements if width else 0.0,
                weight_bytes=sum(float(g.nodes[nodes[k]].get("param_bytes", 0.0)) for k in members),
                y_saved=y_saved,
            )
        )
    return [grp for grp in groups if grp.rows > 0 and grp.x_bytes > 0]


def fused_groups(
    groups: Sequence[NormGroup], nodes: Sequence, *, model_norms_fused: bool, sharded: bool, tp: int
) -> List[NormGroup]:
    """The groups that run as ``F.rms_norm`` in a variant (module docstring): ``sharded`` when
    sequence parallelism shards the block's norms; a group with a node in a TP region under
    ``tp > 1`` is sharded too."""
    if sharded:
        return []
    return [
        grp
        for grp in groups
        if (grp.kind == NATIVE or model_norms_fused) and not (tp > 1 and any(nodes[k].tp for k in grp.members))
    ]


def fused_nodes(nodes: List, groups: Sequence[NormGroup], keeps_output: bool = False) -> List:
    """``nodes`` (``block_facts.NodeCost``) with each group's saved and kept bytes those of the
    fused op (module docstring), charged to its first node; its recompute share 1 where a policy
    recomputes it, else 0. ``keeps_output``: the norms keep their output, not their input
    (``norm_kernel=memory-efficient``)."""
    if not groups:
        return nodes
    out = list(nodes)
    for grp in groups:
        policies = set().union(*(nodes[k].kept for k in grp.members))
        kept = {
            p: (grp.y_bytes + grp.rstd_bytes) if any(nodes[k].kept.get(p, 0.0) for k in grp.members) else 0.0
            for p in policies
        }
        for k in grp.members:
            is_first = k == grp.members[0]
            kept_for_backward = grp.output_saving_bytes() if keeps_output else grp.x_bytes + grp.rstd_bytes
            saved = kept_for_backward if is_first else 0.0
            out[k] = dataclass_replace(
                nodes[k],
                saved=saved,
                saved_flash=saved,
                saved_whole=0.0,
                kept={p: (b if is_first else 0.0) for p, b in kept.items()},
                recomputed={p: 0.0 if b else 1.0 for p, b in kept.items()},
            )
    return out


def fused_times(
    timing,
    nodes: Sequence,
    groups: Sequence[NormGroup],
    shares: Sequence[float],
    times: List[Tuple[float, float]],
    output_saving: bool = False,
) -> List[Tuple[float, float]]:
    """``times`` (forward, backward per node) with each group's nodes scaled by the analytical
    model's fused / unfused ratio, forward and backward apart (module docstring).
    ``output_saving``: the backward is the memory-efficient norm's op-by-op backward
    (:meth:`NormGroup.output_saving_backward_bytes`), not the fused kernel's."""
    if not groups:
        return times
    out = list(times)
    backward = timing.backward_factor
    for grp in groups:
        share = shares[grp.members[0]]
        unfused = sum(
            timing.op_seconds(nodes[k].flops * shares[k], nodes[k].bytes_moved * shares[k], nodes[k].matmul)
            for k in grp.members
        )
        if unfused <= 0:
            continue
        elements = grp.elements * share
        fwd = timing.op_seconds(FORWARD_FLOPS * elements, grp.forward_bytes(share), False)
        if output_saving:
            moved, launches = grp.output_saving_backward_bytes(share), OUTPUT_SAVING_BACKWARD_KERNELS - 1
        else:  # two kernels: the input gradient, then the weight gradient (one launch more)
            moved, launches = grp.backward_bytes(share), 1
        bwd = timing.op_seconds(BACKWARD_FLOPS * elements, moved, False) + launches * timing.launch_s
        for k in grp.members:
            out[k] = (out[k][0] * fwd / unfused, out[k][1] * bwd / (backward * unfused))
    return out


def norm_kernel_problem(norm_kernel: str, backend: str) -> str:
    """'' when RMSNorms run as ``norm_kernel`` says under the kernel ``backend`` (eager, compile,
    fused), else why not and the fix: ``memory-efficient`` norms are an autograd function choosing
    what backward keeps (the output, not the input), and torch.compile's min-cut partitioner
    chooses the saved tensors of a compiled block itself, so what is priced would not be what runs."""
    if norm_kernel == "memory-efficient" and backend == "compile":
        return (
            "norm_kernel=memory-efficient with compile: torch.compile's partitioner chooses what a compiled "
            "block keeps for backward, so the norms would not keep what was priced; fix: norm_kernel '' "
            "(fused), or compile=false"
        )
    return ""


def region_kept_lean(g, names, regions, saved: List[float], norms: List[NormGroup]) -> List[float]:
    """Per region, the bytes it keeps fused when its RMSNorms keep their output instead of their
    input (``norm_kernel=memory-efficient``): the min cut of what the region's
    other ops saved, plus each norm's :meth:`NormGroup.output_saving_bytes`."""
    in_norm = {k for grp in norms for k in grp.members}
    rest = [0.0 if k in in_norm else b for k, b in enumerate(saved)]
    out = []
    for members, _ in regions:
        inside = set(members)
        own = sum(grp.output_saving_bytes() for grp in norms if grp.members[0] in inside)
        out.append(region_kept_bytes(g, names, members, rest) + own)
    return out
