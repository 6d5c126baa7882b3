"""Whether an op-level recompute policy can run on a traced model: no in-place op may mutate a
tensor the policy saved.

Under selective activation checkpointing (``selective``, ``op``, ``op:<policy>``:
``nest_fx.graph.recompute_policies``) ``torch.utils.checkpoint`` caches the outputs of the ops the
policy saves and hands the cached tensors back when the block re-runs its forward in backward.
When the model's own code later mutates such a tensor in place (``h = self.fc(x); h.mul_(2)``,
``nn.ReLU(inplace=True)`` after a norm, a ResNet's ``out += identity``), torch raises in backward
("Tensor cached during selective activation checkpoint has been mutated"); where the mutation goes
through a view that does not share the saved tensor's version counter (the ``_unsafe_view`` after
a bias-free linear's ``mm``) nothing raises and the recompute reads the mutated values: wrong
gradients. ``full`` and ``every:<k>`` cache nothing (the whole block re-runs from its input) and
``none`` leaves autograd alone: both run such code as the model does.

:func:`mutated_saved_problem` finds this on the trace: the tracer records per node the aten ops
it ran, whether each mutates an input, and the storages its outputs live in
(``nest_fx.graph.annotate``). Walking the graph in execution order, the storages the policy saves
in each checkpointed region (a layer block's module, or each child of a grouped block, as
``apply.activation_checkpoint`` wraps them; the matmuls counted per region as the runtime counts
them) are collected; an in-place op anywhere later whose output is one of them is refused. Fresh
buffers the model fills in place (tensor factories), ops inside attention and outputs the policy
recomputes are not saved, so mutating them runs.

``F.rms_norm`` (called directly, or by ``torch.nn.RMSNorm``) traces off CUDA as ops of which two
are in place (``add_`` of the epsilon and ``rsqrt_`` on the mean); inside a checkpointed block the
runtime runs it out of place off CUDA (``apply.fused_norms.OutOfPlaceRMSNorms``) and as one kernel
on CUDA, so the in-place ops of those nodes are not the model's and are skipped here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from nest_fx.graph.recompute_policies import LAYER_POLICIES, cost_key, parse_recompute, saved_op_flags

SAC_POLICIES: Tuple[str, ...] = tuple(p for p in LAYER_POLICIES if p not in ("none", "full"))
NATIVE_RMS_NORM = "native"  # graph.rms_norms.NATIVE: a torch.nn.RMSNorm (its forward is F.rms_norm)


def _region_of(module: str, regions: Sequence[str]) -> Optional[str]:
    """The checkpointed module ``module`` runs in (itself or an ancestor of it), else None."""
    for region in regions:
        if module == region or module.startswith(region + ".") or region == "":
            return region
    return None


def _runs_f_rms_norm(data: dict) -> bool:
    """The node is ``F.rms_norm`` (a functional call, or a ``torch.nn.RMSNorm`` module): the runtime
    runs it without the in-place ops its CPU decomposition traces (module docstring)."""
    return data.get("op") == "rms_norm" or data.get("rms_norm") == NATIVE_RMS_NORM


def _where(data: dict, name: str) -> str:
    return data.get("module") or f"<root> (node {name})"


def _first_mutation(graph, recompute: str) -> Optional[Tuple[str, str, str, str]]:
    """(mutating module, its in-place op, saving module, the saved op) for the first in-place op
    that mutates a storage ``recompute`` saves in a checkpointed region; None when there is none."""
    spec = parse_recompute(recompute)
    g = graph.graph
    regions: Dict[str, str] = {}  # node -> its checkpointed region
    for block in graph.layer_blocks:
        for name in block.nodes:
            region = _region_of(g.nodes[name].get("module", ""), block.modules)
            if region is not None:
                regions[name] = f"{block.index}:{region}"
    # the ops of each region in execution order, and whether the policy keeps each one's outputs
    region_ops: Dict[str, List[Tuple[str, int]]] = {}
    for name in g.nodes:
        if name in regions:
            ops = g.nodes[name].get("aten_ops", ())
            region_ops.setdefault(regions[name], []).extend((name, j) for j in range(len(ops)))
    keeps: Dict[Tuple[str, int], bool] = {}
    for entries in region_ops.values():
        ops = [g.nodes[name]["aten_ops"][j] for name, j in entries]
        keeps.update(zip(entries, saved_op_flags(spec, ops)))
    saved: Dict[int, Tuple[str, str]] = {}  # storage -> (node, op kind) that saved it
    for name in g.nodes:
        data = g.nodes[name]
        for kind, outputs in _mutations(g, name):
            hit = next((saved[s] for s in outputs if s in saved), None)
            if hit is not None:
                return _where(data, name), kind, _where(g.nodes[hit[0]], hit[0]), hit[1]
        for j, (kind, _mutable, outputs) in enumerate(data.get("aten_ops", ())):
            if keeps.get((name, j)):
                for s in outputs:
                    saved.setdefault(s, (name, kind))
    return None


def _mutations(g, name: str) -> List[Tuple[str, Sequence[int]]]:
    """(op, storages it writes) for the in-place ops node ``name`` runs in eager: its recorded
    mutable aten ops (none for ``F.rms_norm``, :func:`_runs_f_rms_norm`) and, for an augmented
    assignment fx traced out of place (``in_place_on``: ``graph.tracer.mark_augmented_assignments``),
    the write into its first operand."""
    data = g.nodes[name]
    out: List[Tuple[str, Sequence[int]]] = []
    target = data.get("in_place_on")
    if target in g:
        out.append((f"{data.get('op', '')}= (augmented assignment)", g.nodes[target].get("out_storages", ())))
    if not _runs_f_rms_norm(data):
        out += [(kind, outputs) for kind, mutable, outputs in data.get("aten_ops", ()) if mutable]
    return out


def mutated_saved_problem(graph, recompute: str) -> str:
    """'' when ``recompute`` runs on the traced ``graph`` (an ``OpGraph``), else the module whose
    in-place op mutates a tensor the policy saves, the reason and the fix (module docstring).
    Only the op-level policies (``selective``, ``op``, ``op:<policy>``) save op outputs;
    ``recompute`` must parse (``recompute_policy_problem``)."""
    if parse_recompute(recompute).kind not in ("selective", "op"):
        return ""
    found = _first_mutation(graph, recompute)
    if found is None:
        return ""
    module, op, saver, saved_op = found
    others = [p for p in SAC_POLICIES if p != cost_key(recompute)]  # op:default is op
    runs = ", ".join(p for p in others if _first_mutation(graph, p) is None)
    also = f", {runs}" if runs else ""
    return (
        f"recompute={recompute}: module {module!r} mutates in place ({op}) the output of {saver!r} ({saved_op}), "
        "which this selective activation checkpointing policy saves for backward; torch would raise 'Tensor cached "
        "during selective activation checkpoint has been mutated' in backward, or recompute from the mutated "
        f"values; fix: recompute full, every:<k> or none{also}, or make {module!r} out of place"
    )
