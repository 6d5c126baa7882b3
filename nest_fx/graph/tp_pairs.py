"""Find the column-parallel -> row-parallel linear pairs of each distinct block.

Megatron-style tensor parallelism (Shoeybi et al. 2019) shards a linear A by output features
(column) and the next linear B by input features (row), so only B's output needs an
all-reduce. A and B form a pair when B's input is computed from A's output by ops that act on
A's features independently: elementwise ops, reshapes into heads, rotary embeddings and
attention. We find them by walking backwards from every parameterised matmul over
floating-point data flow inside the block, stopping at other matmuls (the columns) and at
normalisations (a norm op, or an op combining its input with a mean/variance a few ops
upstream with no matmul in between, as hand-written RMSNorms do), which mix all features and so end the sharded region. Integer tensors (token
indices, routing slots) are not followed: they carry no features.

A router is a parameterised matmul whose output reaches ``topk`` within a few ops.
"""
from __future__ import annotations

from typing import Dict, List, Set

import networkx as nx

from nest_fx.graph.annotate import MATMUL_OPS
from nest_fx.graph.opgraph import Block, BlockPattern, TPPair

NORM_OPS = {"layernorm", "layer_norm", "native_layer_norm", "rmsnorm", "rms_norm", "mean", "var",
            "var_mean", "groupnorm", "group_norm", "batchnorm", "batch_norm"}
ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "softmax", "_softmax"}
_FLOAT = ("float", "bfloat16", "half", "complex")


def _is_float(data: dict) -> bool:
    dtypes = data.get("out_dtypes") or []
    return any(str(dt).startswith(_FLOAT) for dt in dtypes)


def _rel(fqn: str, block: Block) -> str:
    prefix = block.name + "."
    return fqn[len(prefix):] if block.kind == "block" and fqn.startswith(prefix) else fqn


def _linear_name(weight: str) -> str:
    return weight[: -len(".weight")] if weight.endswith(".weight") else weight


def find_pattern(graph: nx.DiGraph, block: Block) -> BlockPattern:
    """TP pairs and routers of one block (FQNs relative to the block)."""
    members: Set[str] = set(block.nodes)
    linears = [n for n in block.nodes if graph.nodes[n].get("weight")]
    pairs: List[TPPair] = []
    for row in linears:
        columns, through_attention = _columns_feeding(graph, row, members)
        if not columns:
            continue
        row_name = _rel(_linear_name(graph.nodes[row]["weight"]), block)
        col_names = sorted({_rel(_linear_name(graph.nodes[c]["weight"]), block) for c in columns})
        if any("expert" in n or any(p.isdigit() for p in n.split(".")) for n in [row_name, *col_names]):
            kind = "expert"
        else:
            kind = "attention" if through_attention else "mlp"
        pairs.append(TPPair(kind=kind, column=col_names, row=row_name))
    routers = sorted({_rel(_linear_name(graph.nodes[n]["weight"]), block)
                      for n in linears if _reaches_topk(graph, n, members)})
    pairs = [p for p in pairs if p.row not in routers and not set(p.column) & set(routers)]
    return BlockPattern(signature=block.signature, tp_pairs=_dedupe(pairs), routers=routers)


def _columns_feeding(graph: nx.DiGraph, row: str, members: Set[str]):
    columns: List[str] = []
    through_attention = False
    seen: Set[str] = set()
    stack = [p for p in graph.predecessors(row) if _is_float(graph.nodes[p])]
    while stack:
        node = stack.pop()
        if node in seen or node not in members:
            continue
        seen.add(node)
        data = graph.nodes[node]
        if data.get("weight"):
            columns.append(node)
            continue
        op = data.get("op", "")
        if op in NORM_OPS or _normalises(graph, node):
            continue
        if op in ATTENTION_OPS or (op in MATMUL_OPS and not data.get("weight")):
            through_attention = True
        stack.extend(p for p in graph.predecessors(node) if _is_float(graph.nodes[p]))
    return columns, through_attention


def _normalises(graph: nx.DiGraph, node: str, depth: int = 6) -> bool:
    """True when a feature reduction (mean/var/norm) lies a few ops upstream of ``node`` with no
    matmul in between, as in a hand-written RMSNorm ``(x * rsqrt(mean(x^2) + eps)) * w``."""
    def floats(n):
        return {p for p in graph.predecessors(n) if _is_float(graph.nodes[p])}

    frontier = floats(node)
    for _ in range(depth):
        if any(graph.nodes[n].get("op") in NORM_OPS for n in frontier):
            return True
        frontier = {p for n in frontier if not graph.nodes[n].get("weight") for p in floats(n)}
    return False


def _reaches_topk(graph: nx.DiGraph, start: str, members: Set[str], depth: int = 4) -> bool:
    frontier = {start}
    for _ in range(depth):
        frontier = {s for n in frontier for s in graph.successors(n) if s in members}
        if any(graph.nodes[n].get("op") == "topk" for n in frontier):
            return True
    return False


def _dedupe(pairs: List[TPPair]) -> List[TPPair]:
    out: Dict[tuple, TPPair] = {}
    for p in pairs:
        out.setdefault((p.kind, tuple(p.column), p.row), p)
    return list(out.values())


def find_patterns(graph: nx.DiGraph, blocks: List[Block]) -> Dict[str, BlockPattern]:
    """One pattern per distinct layer signature (computed on its first block)."""
    patterns: Dict[str, BlockPattern] = {}
    for block in blocks:
        if block.kind == "block" and block.signature not in patterns:
            patterns[block.signature] = find_pattern(graph, block)
    return patterns
