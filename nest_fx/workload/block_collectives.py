"""What a block's trace says about its TP collectives beyond the regions' counts
(``block_facts`` reads these): the vocabulary-parallel nodes of the head and tail, the stacked
expert modules the runtime runs on local shards (their all-reduces), and whether a block's last
forward collective feeds nothing that is saved (then a recompute never re-runs it)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import networkx as nx

from nest_fx.graph.tp_inputs import stacked_pair
from nest_fx.graph.tp_regions import vocab_parallel_lookup


def stacked_experts(g, block, pattern) -> Tuple[Tuple[float, Tuple[float, ...], bool], ...]:
    """(output bytes, floating input bytes, nothing saved after it) of each stacked-expert module
    of the block: the nodes inside the module that feed nodes outside it, the floating tensors
    from outside it that its nodes read (what ``apply.tp_styles.LocalShards`` reduces forward and
    copies to TP), and whether no node of the block below its outputs saves a tensor."""
    out = []
    members = set(block.nodes)
    for pair in pattern.tp_pairs if pattern else []:
        if pair.problem or pair.kind != "expert" or not stacked_pair(pair):
            continue
        owner = block.fqn(pair.row.rpartition(".")[0])
        inside = {n for n in block.nodes if (g.nodes[n].get("module") or "").startswith(owner)}
        ends = [n for n in inside if any(s not in inside for s in g.successors(n))]
        sent = sum(g.nodes[n].get("out_bytes", 0.0) for n in ends)
        below = set().union(*(nx.descendants(g, n) for n in ends)) & members - inside if ends else set()
        unsaved = all(g.nodes[n].get("saved_bytes", 0.0) == 0 for n in below)
        taken = sorted(
            {p for n in inside for p in g.predecessors(n) if p not in inside and p in members},
            key=block.nodes.index,
        )
        floats = tuple(
            g.nodes[p].get("out_bytes", 0.0)
            for p in taken
            if str((g.nodes[p].get("out_dtypes") or [""])[0]).startswith(("float", "bfloat"))
        )
        out.append((sent, floats, unsaved))
    return tuple(out)


def tail_unsaved(g, block_nodes: List[str], dense_rows: List[str]) -> bool:
    """Whether nothing the block's last TP row feeds (inside the block) saves a tensor for
    backward: then its forward collective, the row output's all-reduce (SP: reduce-scatter),
    is the last thing a recompute of the block would run and never needs to."""
    if not dense_rows:
        return False
    order = {n: k for k, n in enumerate(block_nodes)}
    last = max(dense_rows, key=order.__getitem__)
    below = nx.descendants(g, last) & set(block_nodes)
    return all(g.nodes[n].get("saved_bytes", 0.0) == 0 for n in below)


def vocab_parallel_nodes(graph, block) -> Dict[str, str]:
    """{node: "rowwise" | "colwise"} that vocabulary parallelism shards in a head or tail block,
    as the runtime does (``nest_fx.apply.tensor_parallel.vocab_parallel_modules``): the head's
    embedding lookups and the tail's output linears. A tied LM head (the tracer counts its
    shared weight once, under the embedding) stays replicated with the largest embedding."""
    g = graph.graph
    if block.kind == "head":
        found = {n: "rowwise" for n in block.nodes if vocab_parallel_lookup(g.nodes[n])}
        tail = next((b for b in graph.blocks if b.kind == "tail"), None)
        tied = tail is not None and any(tied_linear(g.nodes[n]) for n in tail.nodes)
        if tied and found:
            found.pop(max(found, key=lambda n: g.nodes[n].get("num_params", 0)))
        return found
    if block.kind == "tail":
        return {
            n: "colwise"
            for n in block.nodes
            if g.nodes[n].get("op") == "linear" and g.nodes[n].get("weight") and not tied_linear(g.nodes[n])
        }
    return {}


def tied_linear(d: dict) -> bool:
    """A linear whose weight the tracer counted elsewhere (an LM head tied to the embedding; it
    may hold a bias of its own: BERT's ``cls.predictions``)."""
    return d.get("op") == "linear" and bool(d.get("weight")) and d["weight"] not in (d.get("params") or [])
