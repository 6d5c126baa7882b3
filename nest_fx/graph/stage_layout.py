"""Which modules each block of the layer chain uses, and what crosses each pipeline cut.

The tracer groups a model's ops into the chain ``[head, <container>.0, ..., tail]``; a pipeline
stage owns a contiguous range of it. The runtime (``nest_fx.graph.stage_modules``) builds a
stage by keeping the modules its blocks use and running the model's *own* forward, with every
other module replaced by a stand-in. This module reads, from the traced graph alone:

* the **layout**: the modules of each layer block (its layer ``model.layers.3``, or for a group
  of ``nn.Sequential`` children, ``Block.members``, every child of the group), the top-most
  parameterised module outside the layer container of every other op (``model.embed_tokens``,
  ``lm_head``; the head and tail children of a root ``nn.Sequential``) with the blocks that use
  it, and the parameters that blocks on different stages share. A parameter
  used by the head and the tail only (tied input/output embeddings) is kept on the first and
  the last stage, as Megatron-LM does; any other sharing across blocks is a problem.
* the **cuts**: between blocks ``c-1`` and ``c`` a stage boundary passes one activation (the
  value block ``c`` reads first) and, beside it, values that are tensor outputs of modules
  (``side_values``: an encoder's output every decoder layer reads, T5's position biases).
  Every other value computed by blocks before the cut and read after it must be one the later
  stage recomputes itself from the model's inputs: root forward code and parameter-free modules
  (causal and sliding-window masks, rotary tables, position ids) run on every stage. A second
  value computed by the model's own forward code from a stage's modules (``h * 2`` of the
  embedding kept for a skip connection) cannot cross, and the cut is refused naming it. The
  activation enters block ``c`` as the input of its first module (a group's first child) and
  nothing else after the cut may read it; before the tail it is the output of the last layer
  block's last module.

A layer container that is an ``nn.Sequential`` subclass with its own ``forward`` is refused:
stages are cut between its children as if ``nn.Sequential.forward`` ran them in order, each on
the previous one's output (groups of them form the layers), which that forward need not do.

:class:`~nest_fx.plan.support.ParallelSupport.pp_problem` refuses pipelining when any cut or the
layout has a problem, so the planner never offers a split the runtime would run wrong.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch.nn as nn


def _ancestors(path: str) -> List[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(len(parts) + 1)]


def untie_advice(model: nn.Module) -> str:
    """How to untie a model's input and output embeddings, in its own config's words."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings") and not hasattr(config, "tie_embeddings"):
        return "untie them with tie_word_embeddings=False in the HuggingFace config"
    if config is not None and hasattr(config, "tie_embeddings"):
        return "untie them with tie_embeddings=false in the model spec"
    return "give each module its own parameter"


@dataclass
class StageLayout:
    """The modules of a model by chain block (see the module docstring).

    ``layers``: chain block index -> name of that layer block (its module path ``model.layers.3``,
    or ``2..5`` for a group of ``nn.Sequential`` children).
    ``modules``: chain block index -> the modules of that layer block in call order
    (``Block.modules``): the layer (``("model.layers.3",)``) or the group's children
    (``("2", "3", "4", "5")``).
    ``owned``: parameterised module path outside the layer container -> chain blocks using it.
    ``unused``: parameterised modules no traced op uses (kept on every stage, never trained); one
    whose parameters are all tied to used modules' is ``owned`` by the blocks using them.
    ``shared``: canonical name -> every name of a parameter the head and the tail both use
    (tied embeddings): the first and the last stage each keep it and sum its gradient.
    ``root_params``: parameter of a container's ancestor (class token, position embedding used by
    the model's own forward code) -> the chain block whose ops use it: the stage owning that
    block keeps it, the others hold a NaN stand-in tensor (what they compute from it is discarded).
    ``problem``: why the model cannot be cut at all ("" when it can); ``cut_problems``: per cut
    index ``c`` (between blocks ``c-1`` and ``c``), why that cut is impossible; ``activations``:
    per possible cut, the traced shape and dtype of the activation crossing it; ``side_values``:
    per possible cut, the other values crossing it, each ``(module, shape, dtype, passed)``: a
    tensor of the output of ``module`` (an encoder's output, the position bias T5's first layer
    returns; ``passed``: a value of an earlier layer that ``module``, the layer before the cut,
    returns as it got it), in the order the model computes them.
    """

    container: str
    num_blocks: int
    layers: Dict[int, str] = field(default_factory=dict)
    modules: Dict[int, Tuple[str, ...]] = field(default_factory=dict)
    owned: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    unused: List[str] = field(default_factory=list)
    shared: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    problem: str = ""
    cut_problems: Dict[int, str] = field(default_factory=dict)
    activations: Dict[int, Tuple[Tuple[int, ...], str]] = field(default_factory=dict)
    root_params: Dict[str, int] = field(default_factory=dict)
    side_values: Dict[int, List[Tuple[str, Tuple[int, ...], str, bool]]] = field(default_factory=dict)

    def modules_in(self, start: int, end: int) -> List[str]:
        """Module paths (layers and parameterised head/tail modules) blocks ``[start, end)`` use."""
        keep = [p for p, blocks in self.owned.items() if any(start <= b < end for b in blocks)]
        return keep + [p for b in range(start, end) for p in self.modules.get(b, ())]

    def layer_modules(self) -> List[str]:
        """The modules of every layer block, in chain order."""
        return [p for modules in self.modules.values() for p in modules]

    def entry_module(self, block: int) -> str:
        """The module of layer block ``block`` whose input is the activation entering it."""
        return self.modules[block][0]

    def exit_module(self, block: int) -> str:
        """The module of layer block ``block`` whose output leaves it."""
        return self.modules[block][-1]

    def first_problem(self) -> str:
        """The layout's problem, else the first cut's, else ""."""
        if self.problem:
            return self.problem
        return self.cut_problems[min(self.cut_problems)] if self.cut_problems else ""


class _Reader:
    """Reads a StageLayout from a model and its OpGraph."""

    def __init__(self, model: nn.Module, graph):
        self.model = model
        self.graph = graph
        self.container = graph.block_container
        self.above = set(_ancestors(self.container))
        self.modules = dict(model.named_modules())
        self.block_name = {b.index: b.name for b in graph.blocks}

    def top_of(self, path: str) -> Optional[str]:
        """The first module below the layer container's ancestors on ``path`` (None: root code),
        looking through ``ModuleList``/``ModuleDict`` holders, which run no code of their own
        (ConvNeXt's ``downsample_layers[i]``, one per stage, each used by its own block)."""
        for prefix in _ancestors(path)[1:]:
            if prefix not in self.above and not isinstance(self.modules.get(prefix), (nn.ModuleList, nn.ModuleDict)):
                return prefix
        return None

    def has_params(self, path: str) -> bool:
        module = self.modules.get(path)
        return module is not None and any(True for _ in module.parameters())

    def read(self) -> StageLayout:
        g = self.graph
        layout = StageLayout(container=self.container, num_blocks=len(g.blocks))
        layout.problem = self._container_problem()
        if layout.problem:
            return layout
        layout.layers = {b.index: b.name for b in g.blocks if b.kind == "block"}
        layout.modules = {b.index: tuple(b.modules) for b in g.blocks if b.kind == "block"}
        layer_paths = set(layout.layer_modules())
        blocks_of: Dict[str, Set[int]] = defaultdict(set)
        for b in g.blocks:
            for node in b.nodes:
                top = self.top_of(g.graph.nodes[node].get("module", ""))
                if top is not None:
                    blocks_of[top].add(b.index)
        layout.owned = {
            top: tuple(sorted(bs)) for top, bs in blocks_of.items() if top not in layer_paths and self.has_params(top)
        }
        for b, paths in layout.modules.items():
            blocks_of.update({path: {b} for path in paths})
        idle = [p for p in self._child_tops() if p not in blocks_of and p not in layer_paths and self.has_params(p)]
        tied = self._tied_holders(idle, blocks_of)
        layout.owned.update(tied)
        layout.unused = [p for p in idle if p not in tied]
        layout.problem = self._root_parameters(layout) or self._sharing(layout, blocks_of)
        if not layout.problem:
            layout.cut_problems = self._cuts(layout)
        return layout

    def _tied_holders(self, idle: List[str], blocks_of: Dict[str, Set[int]]) -> Dict[str, Tuple[int, ...]]:
        """Modules no op uses whose parameters are all tied to those of modules blocks use (BART's
        ``model.shared``, the embedding its encoder and decoder share): owned by those blocks, so a
        stage without them holds no stale copy of the weight."""
        blocks_of_param: Dict[int, Set[int]] = defaultdict(set)
        for path, blocks in blocks_of.items():
            for param in self.modules[path].parameters():
                blocks_of_param[id(param)] |= blocks
        held = {}
        for path in idle:
            if any(p.startswith(path + ".") for p in blocks_of):  # a holder of used modules (ModuleList)
                continue
            params = list(self.modules[path].parameters())
            if all(id(q) in blocks_of_param for q in params):
                held[path] = tuple(sorted(set().union(*(blocks_of_param[id(q)] for q in params))))
        return held

    def _container_problem(self) -> str:
        """Why the chain has no layer container a pipeline can cut ("" when it has one)."""
        if not any(b.kind == "block" for b in self.graph.blocks):
            return (
                "the tracer found no list of repeated layers (e.g. model.layers) to cut between; "
                "a pipeline needs one. fix: use pp=1"
            )
        container = self.modules.get(self.container)
        if isinstance(container, nn.Sequential) and type(container).forward is not nn.Sequential.forward:
            return (
                f"{self.container or 'the model'} is a {type(container).__name__}, an nn.Sequential with its own "
                "forward; pipeline stages are cut between its children as if nn.Sequential's forward ran "
                "them in order, each on the previous one's output, which that forward need not do. "
                "fix: use pp=1"
            )
        return ""

    def _child_tops(self) -> List[str]:
        """Every module directly below one of the container's ancestors (the candidates for tops)."""
        return [p for p in self.modules if p and p not in self.above and p.rpartition(".")[0] in self.above]

    def _root_parameters(self, layout: StageLayout) -> str:
        """Parameters of the container's ancestors (timm's ``cls_token``/``pos_embed``, used by the
        root forward code that runs on every stage) belong to the one block whose ops use them
        (``layout.root_params``); one used by several blocks is a problem."""
        used: Dict[str, Set[int]] = defaultdict(set)
        for _, d in self.graph.graph.nodes(data=True):
            for name in list(d.get("params", ())) + [p for p in d.get("input_params") or () if p]:
                used[name].add(d["block"])  # params: first use; input_params: every use
        root = [
            f"{path}.{n}" if path else n
            for path in sorted(self.above)
            if path in self.modules
            for n, _ in self.modules[path].named_parameters(recurse=False)
        ]
        for name in root:
            blocks = sorted(used.get(name, ()))
            if len(blocks) > 1:
                where = ", ".join(self.block_name[b] for b in blocks)
                return (
                    f"parameter {name} belongs to the module running the model's own forward code (on every "
                    f"pipeline stage) and is used by blocks {where} of the layer chain, which stages may "
                    "separate. fix: use pp=1, or use it in one place"
                )
            if blocks:
                layout.root_params[name] = blocks[0]
        return ""

    def _sharing(self, layout: StageLayout, blocks_of: Dict[str, Set[int]]) -> str:
        names: Dict[int, List[str]] = defaultdict(list)
        params: Dict[int, nn.Parameter] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
            params[id(p)] = p
        last = layout.num_blocks - 1
        for key, fqns in names.items():
            blocks: Set[int] = set()
            for fqn in fqns:
                top = self.top_of(fqn.rpartition(".")[0])
                blocks |= blocks_of.get(top, set()) if top else set()
            if len(blocks) <= 1:
                continue
            if blocks == {0, last} and self.graph.blocks[0].kind == "head" and self.graph.blocks[last].kind == "tail":
                layout.shared[fqns[0]] = tuple(fqns)
                continue
            where = ", ".join(self.block_name[b] for b in sorted(blocks))
            return (
                f"parameter {fqns[0]} (also {fqns[1:]}) is used by blocks {where} of the layer chain, which "
                f"pipeline stages may separate; only a parameter shared by the head and the tail (tied "
                f"embeddings) is kept on two stages. fix: {untie_advice(self.model)}, or use pp=1"
            )
        return ""

    def _entry_problem(self, layout: StageLayout, c: int, value: str, cut: str) -> str:
        """Whether the one activation crossing cut ``c`` is where the runtime exchanges it: the
        input of layer block ``c``'s first module and nothing else after the cut, or (before the
        tail) the output of the last layer block's last module."""
        g = self.graph.graph
        if c not in layout.layers:  # the cut before the tail: the last layer's output is replaced
            last = layout.exit_module(c - 1)
            if self.top_of(g.nodes[value].get("module", "")) != last:
                return (
                    f"a pipeline cut {cut}: the value reaching the tail is computed outside {last} "
                    f"({g.nodes[value].get('op')} in {g.nodes[value].get('module') or '<root>'}), but a stage "
                    "can only pass on the last layer's output. fix: use pp=1"
                )
            return ""
        layer = layout.entry_module(c)
        readers = [
            s
            for s in g.successors(value)
            if g.nodes[s]["block"] >= c and self.top_of(g.nodes[s].get("module", "")) != layer
        ]
        if readers:
            what = "; ".join(f"{g.nodes[r].get('op')} in {g.nodes[r].get('module') or '<root>'}" for r in readers)
            return (
                f"a pipeline cut {cut}: besides {layer}, code after the cut reads the activation entering it "
                f"({what}; e.g. a residual or skip connection written in the model's own forward), but a "
                f"stage can only replace {layer}'s input. fix: use pp=1"
            )
        return ""

    def _cuts(self, layout: StageLayout) -> Dict[int, str]:
        g = self.graph.graph
        owned = set(layout.owned) | set(layout.layer_modules())
        local: Set[str] = set()  # values computed by a stage's own modules (or from them)
        for node, d in g.nodes(data=True):
            top = self.top_of(d.get("module", ""))
            if top in owned or any(p in local for p in g.predecessors(node)):
                local.add(node)
        position = {n: i for i, n in enumerate(g.nodes)}
        problems: Dict[int, str] = {}
        last_use = {n: max((g.nodes[s]["block"] for s in g.successors(n)), default=-1) for n in local}
        for c in range(1, layout.num_blocks):
            carried = sorted((n for n in local if g.nodes[n]["block"] < c <= last_use[n]), key=position.get)
            cut = f"between {self.block_name[c - 1]} and {self.block_name[c]}"
            # the activation is the value the block after the cut reads first (its hidden state
            # enters its first op); the others must be outputs of modules (an encoder, an earlier
            # layer's extra outputs), which the stage passes beside it
            main = min(carried, key=lambda n: self._first_read(n, c, position), default=None)
            sides = [n for n in carried if n != main]
            loose = [n for n in sides if self._side_module(layout, n) is None]
            if not carried or loose:
                what = "; ".join(
                    f"{g.nodes[n].get('op')} in {g.nodes[n].get('module') or '<root>'} {g.nodes[n].get('out_shapes')}"
                    for n in (loose or carried)
                )
                problems[c] = (
                    f"a pipeline cut {cut} would have to pass {len(loose or carried)} values computed by the "
                    f"stage before it ({what or 'none'}) in the model's own forward code, but a stage passes "
                    "one activation and the outputs of its modules. fix: use pp=1"
                )
                continue
            problems.update({c: p for p in [self._entry_problem(layout, c, main, cut)] if p})
            data = g.nodes[main]
            if len(data.get("out_shapes") or ()) == 1:
                layout.activations[c] = (tuple(data["out_shapes"][0]), data["out_dtypes"][0])
            layout.side_values[c] = [self._side_value(layout, n, c) for n in sides]
        return problems

    def _first_read(self, node: str, c: int, position: Dict[str, int]) -> Tuple[int, int]:
        """Sort key: where block ``c`` first reads ``node`` (values it does not read last, the
        latest computed first)."""
        g = self.graph.graph
        reads = [position[s] for s in g.successors(node) if g.nodes[s]["block"] == c]
        return (min(reads), 0) if reads else (len(position), -position[node])

    def _side_value(self, layout: StageLayout, node: str, c: int) -> Tuple[str, Tuple[int, ...], str, bool]:
        """``(module, shape, dtype, passed)`` of a value crossing cut ``c`` beside the activation. A
        value an earlier layer computed reaches the layers after the cut as an output of the layer
        just before it, which passes it on (T5's position bias, returned by every layer): that
        layer is its module, with ``passed`` (the runtime checks it returns the very tensor it got)."""
        d = self.graph.graph.nodes[node]
        module = self._side_module(layout, node)
        passed = False
        if module in layout.layer_modules() and c - 1 in layout.layers and module != layout.exit_module(c - 1):
            module, passed = layout.exit_module(c - 1), True
        return (module, tuple(d["out_shapes"][0]), d["out_dtypes"][0], passed)

    def _side_module(self, layout: StageLayout, node: str) -> Optional[str]:
        """The module (a parameterised head module or a layer) whose output ``node`` is one tensor
        of, when ``node`` can be passed beside a cut's activation; None otherwise."""
        d = self.graph.graph.nodes[node]
        top = self.top_of(d.get("module", ""))
        if top is None or len(d.get("out_shapes") or ()) != 1:
            return None
        return top if top in layout.owned or top in layout.layer_modules() else None


def stage_layout(model: nn.Module, graph) -> StageLayout:
    """The :class:`StageLayout` of ``model`` traced as ``graph`` (an OpGraph)."""
    return _Reader(model, graph).read()
