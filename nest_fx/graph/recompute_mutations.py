"""Whether a recompute policy can run on a traced model's in-place ops.

Activation checkpointing re-runs a block's forward in backward. Two kinds of the model's own
in-place ops break that:

* under every policy but ``none`` (``full``, ``every:<k>`` and the op-level ones), an in-place op
  of a checkpointed block on a tensor it gets from outside the block (its input, or a view of it:
  ``x.mul_(2)``, ``x += 1`` first thing in a layer): the recompute re-runs the op on the already
  mutated tensor and torch raises in backward ("one of the variables needed for gradient
  computation has been modified by an inplace operation");
* under the op-level policies (``selective``, ``op``, ``op:<policy>``:
  ``nest_fx.graph.recompute_policies``), an in-place op, in the block or after it, on a tensor the
  policy saved. ``torch.utils.checkpoint`` caches the outputs of the ops the policy saves and hands
  the cached tensors back to the recompute; mutated later (``h = self.fc(x); h.mul_(2)``,
  ``nn.ReLU(inplace=True)`` after a norm, a ResNet's ``out += identity``), torch raises in backward
  ("Tensor cached during selective activation checkpoint has been mutated"), or, where the mutation
  goes through a view that does not share the saved tensor's version counter (the ``_unsafe_view``
  after a bias-free linear's ``mm``), raises nothing and the recompute reads the mutated values:
  wrong gradients. ``full`` and ``every:<k>`` cache no op output.

:func:`recompute_mutation_problem` finds both on the trace: the tracer records per node the aten
ops it ran, whether each mutates an input, the storages its outputs live in and the storages it
created (``nest_fx.graph.annotate``). The checkpointed regions are the layer blocks' modules (or
each child of a grouped block), as ``apply.activation_checkpoint`` wraps them; the matmuls are
counted per region as the runtime counts them. Parameters and buffers mutated in place (BatchNorm's
running statistics) are not activations; fresh buffers the model fills in place (tensor factories),
ops inside attention and outputs the policy recomputes are not saved, so mutating them runs. Which
blocks of a stage ``every:<k>`` recomputes depends on the plan's cut: any layer block counts.

``F.rms_norm`` (called directly, or by ``torch.nn.RMSNorm``) traces off CUDA as ops of which two
are in place (``add_`` of the epsilon and ``rsqrt_`` on the mean); inside a checkpointed block the
runtime runs it out of place off CUDA (``apply.fused_norms.OutOfPlaceRMSNorms``) and as one kernel
on CUDA, so the in-place ops of those nodes are not the model's and are skipped here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from nest_fx.graph.recompute_policies import LAYER_POLICIES, cost_key, parse_recompute, saved_op_flags
from nest_fx.graph.rms_norms import NATIVE

SAC_POLICIES: Tuple[str, ...] = tuple(p for p in LAYER_POLICIES if p not in ("none", "full"))


def _region_of(module: str, regions: Sequence[str]) -> Optional[str]:
    """The checkpointed module ``module`` runs in (itself or an ancestor of it), else None."""
    for region in regions:
        if module == region or module.startswith(region + ".") or region == "":
            return region
    return None


def _runs_f_rms_norm(data: dict) -> bool:
    """The node is ``F.rms_norm`` (a functional call, or a ``torch.nn.RMSNorm`` module): the runtime
    runs it without the in-place ops its CPU decomposition traces (module docstring)."""
    return data.get("op") == "rms_norm" or data.get("rms_norm") == NATIVE


def _where(data: dict, name: str) -> str:
    return data.get("module") or f"<root> (node {name})"


def _regions(graph) -> Dict[str, str]:
    """Node -> the checkpointed region it runs in (``<block index>:<module>``), for the nodes of
    the layer blocks that run inside the block's module (or one of a grouped block's children)."""
    g = graph.graph
    regions: Dict[str, str] = {}
    for block in graph.layer_blocks:
        for name in block.nodes:
            region = _region_of(g.nodes[name].get("module", ""), block.modules)
            if region is not None:
                regions[name] = f"{block.index}:{region}"
    return regions


def _input_mutation(graph, regions: Dict[str, str]) -> Optional[Tuple[str, str, str]]:
    """(mutating module, its in-place op, the module whose output it is) for the first in-place op
    of a checkpointed region on an activation made outside the region (its input, or a view of it):
    the recompute re-runs the op on the already mutated tensor. Parameters and buffers (BatchNorm's
    running statistics) are not activations."""
    g = graph.graph
    maker: Dict[int, str] = {}  # activation storage -> the node that made it
    for name in g.nodes:
        data = g.nodes[name]
        if data.get("fx_op") == "placeholder":
            maker.update((int(s), name) for s in data.get("out_storages", ()))
        maker.update((int(s), name) for s in data.get("created", {}))
    for name in g.nodes:
        if name not in regions:
            continue
        for kind, outputs in _mutations(g, name):
            outside = next((maker[s] for s in outputs if s in maker and regions.get(maker[s]) != regions[name]), None)
            if outside is not None:
                return _where(g.nodes[name], name), kind, _where(g.nodes[outside], outside)
    return None


def _saved_mutation(graph, recompute: str, regions: Dict[str, str]) -> Optional[Tuple[str, str, str, str]]:
    """(mutating module, its in-place op, saving module, the saved op) for the first in-place op
    that mutates a storage the op-level policy ``recompute`` saves in a checkpointed region; None
    when there is none."""
    spec = parse_recompute(recompute)
    g = graph.graph
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


def recompute_mutation_problem(graph, recompute: str) -> str:
    """'' when ``recompute`` runs on the traced ``graph`` (an ``OpGraph``), else the module whose
    in-place op breaks it, the reason and the fix (module docstring): under every policy but
    ``none``, an in-place op of a checkpointed block on its own input; under the op-level policies
    (``selective``, ``op``, ``op:<policy>``), one on a tensor the policy saves. ``recompute`` must
    parse (``recompute_policy_problem``)."""
    kind = parse_recompute(recompute).kind
    if kind == "none":
        return ""
    regions = _regions(graph)
    found = _input_mutation(graph, regions)
    if found is not None:
        module, op, maker = found
        return (
            f"recompute={recompute}: module {module!r} mutates in place ({op}) a tensor it gets from outside its "
            f"checkpointed block (the output of {maker!r}); activation checkpointing re-runs the block in backward "
            "on the already mutated tensor (torch raises 'one of the variables needed for gradient computation has "
            f"been modified by an inplace operation'); fix: recompute none, or make {module!r} out of place"
        )
    if kind not in ("selective", "op"):
        return ""
    found = _saved_mutation(graph, recompute, regions)
    if found is None:
        return ""
    module, op, saver, saved_op = found
    others = [p for p in SAC_POLICIES if p != cost_key(recompute)]  # op:default is op
    runs = ", ".join(p for p in others if _saved_mutation(graph, p, regions) is None)
    also = f", {runs}" if runs else ""
    return (
        f"recompute={recompute}: module {module!r} mutates in place ({op}) the output of {saver!r} ({saved_op}), "
        "which this selective activation checkpointing policy saves for backward; torch would raise 'Tensor cached "
        "during selective activation checkpoint has been mutated' in backward, or recompute from the mutated "
        f"values; fix: recompute full, every:<k> or none{also}, or make {module!r} out of place"
    )
