"""Tensor (+ sequence) parallelism from the TP pairs the tracer found; no per-model plan.

For every block the stage owns, ``graph.patterns[block.signature].tp_pairs`` lists the column
units and the row unit they feed (Megatron-style pairs), every parameter to shard with its dim
(fused projections part by part), and what else runs per head (``graph/tp_flow.py``, ``graph/tp_flow_ops.py``). We apply
``parallelize_module`` with the styles of :mod:`nest_fx.apply.tp_styles`: ``ColumnShard`` on
the columns and ``RowShard`` on the row (any projecting module: ``nn.Linear``, HF ``Conv1D``,
``x @ weight.T``), ``LocalShards`` on a module holding 3-D expert weights, ``SequenceParallel``
(on the heads dim) on per-head norms, ``WholeWidthNorm`` on norms over a whole projection
(:mod:`nest_fx.apply.tp_wide_norm`: statistics all-reduced), ``ColwiseParallel`` on per-head tables,
``HeadParams`` on per-head parameters of the region module itself (Swin's
``relative_position_bias_table``) and ``MultiheadShard`` on an ``nn.MultiheadAttention`` (its
forward replaced by a head-sharded one);
per-head inputs (ALiBi) are sliced on entry to the region; the module whose input all of a
region's columns read (``graph.tp_inputs.once_input``) takes it as one replicated DTensor, so
their input gradients are all-reduced once per region (Megatron's f), not once per column.
Outputs are local tensors, so the code between the
linears (attention, activation) runs on the local shard; the region module of an attention pair
counts local heads (``graph.tp_regions.localise_head_counts``: head-count attributes and a copy
of a HF config with its head counts divided).

Sequence parallelism (Korthikanti et al. 2022), when ``plan.sequence_parallel``: inside a stage,
activations between the TP regions are sharded on the sequence dim (dim 1). Each pair's
*region* (the lowest common ancestor module of its linears, e.g. ``attn``/``mlp``) all-gathers
its input on entry (a DTensor, so the backward is a reduce-scatter) and its row linear
reduce-scatters the output (``RowwiseParallel(output_layouts=Shard(1))``). Parameterised
modules of the block outside every region (the norms) become ``SequenceParallel`` modules
(their weights are replicated DTensors whose partial gradients DTensor all-reduces). The head
(embedding) and the tail (final norm, LM head, loss) see full sequences: the first block after
the head slices the sequence, the last block before the tail all-gathers it back. Under
pipelining a stage boundary between two layer blocks carries the shard (Megatron-LM's and
torchtitan's sequence-parallel stages): the sending stage's last block keeps its shard
(``shard_out``), the receiving stage's first block takes it as is (``shard_in``), so each TP rank
sends ``1/t`` of the sequence to its peer and no collective runs at the boundary; a stage that
holds only the tail gathers what it receives (:func:`gather_received`), the all-gather the last
block would otherwise run. A cut after the head, or one passing values beside the activation
(``StageLayout.side_values``), carries the full sequence (:func:`sharded_cut`). An MoE region
(expert pairs plus a router) gathers to a plain local tensor, runs routing and experts
replicated, and slices its output back.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nest_fx.apply.tp_styles import ColumnShard, HeadParams, LocalShards, MultiheadShard, RowShard, SharedHeadsColumn
from nest_fx.apply.tp_wide_norm import WholeWidthNorm
from nest_fx.graph.opgraph import TPParam
from nest_fx.graph.tp_inputs import once_input, prepares_input_once
from nest_fx.graph.tp_regions import block_regions, head_input_hook, localise_head_counts, vocab_parallel_lookup


def _is_under(name: str, prefixes: Iterable[str]) -> bool:
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


# -- sequence-parallel hooks -----------------------------------------------------------------


def _first_tensor_arg(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return "arg", 0, args[0]
    for key in ("hidden_states", "x", "hidden", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return "kw", key, kwargs[key]
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return "kw", key, value
    raise ValueError("sequence parallelism: no tensor input found for a region")


def _replace_arg(args, kwargs, where, key, value):
    if where == "arg":
        args = (value, *args[1:])
    else:
        kwargs = dict(kwargs)
        kwargs[key] = value
    return args, kwargs


def _gather_seq_pre_hook(mesh: DeviceMesh, local_output: bool):
    def hook(module, args, kwargs):
        where, key, x = _first_tensor_arg(args, kwargs)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        x = x.redistribute(mesh, [Replicate()])
        if local_output:
            x = x.to_local()
        return _replace_arg(args, kwargs, where, key, x)

    return hook


def _replicated_input_pre_hook(mesh: DeviceMesh):
    """Megatron's f for a module whose input all of a region's columns read (``graph.tp_inputs``):
    the input enters as one replicated DTensor, so the columns' partial input gradients add up
    locally (DTensor keeps their sum partial) and one all-reduce in ``from_local``'s backward
    completes it, where each column would otherwise all-reduce its own."""

    def hook(module, args, kwargs):
        where, key, x = _first_tensor_arg(args, kwargs)
        if isinstance(x, DTensor) or not x.is_floating_point():
            return None
        return _replace_arg(args, kwargs, where, key, DTensor.from_local(x, mesh, [Replicate()], run_check=False))

    return hook


def _scatter_seq_output_hook(mesh: DeviceMesh):
    """Replicated (full-sequence) output -> local sequence shard; backward all-gathers."""

    def hook(module, args, output):
        def conv(t):
            if isinstance(t, DTensor):
                return t.redistribute(mesh, [Shard(1)]).to_local()
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

        return _map_first_output(output, conv)

    return hook


def _map_first_output(output, conv):
    """Apply ``conv`` to a tensor output, or to the first element of a tuple output."""
    if isinstance(output, torch.Tensor):
        return conv(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (conv(output[0]), *output[1:])
    return output


def _shard_seq_pre_hook(mesh: DeviceMesh):
    """A stage's first block that reads full sequences (after the head, or a cut carrying them):
    full sequence in -> local sequence shard."""

    def hook(module, args, kwargs):
        where, key, x = _first_tensor_arg(args, kwargs)
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()
        return _replace_arg(args, kwargs, where, key, x)

    return hook


def _gather_seq_output_hook(mesh: DeviceMesh):
    """A stage's last block before the tail or a cut carrying full sequences (and what a
    tail-only stage receives): local sequence shard out -> full sequence."""

    def hook(module, args, output):
        def conv(t):
            return DTensor.from_local(t, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

        return _map_first_output(output, conv)

    return hook


def sharded_cut(graph, cut: int, side_values) -> bool:
    """Whether pipeline cut ``cut`` (between chain blocks ``cut - 1`` and ``cut``) carries the
    sequence shard of each TP rank under sequence parallelism: the block before it is a layer
    block (its output is a shard; the head's is the full sequence) and the cut passes nothing
    beside the activation (``side_values``: the route's ``side_in`` / ``side_out`` there). The
    sending and the receiving stage ask the same question of the same cut."""
    return 0 < cut < len(graph.blocks) and graph.blocks[cut - 1].kind == "block" and not side_values


def gather_received(module: nn.Module, path: str, mesh: DeviceMesh) -> None:
    """A stage holding only the tail received the last layer's sequence shard at ``path`` (the
    layer's stand-in, whose output the stage replaces by what it received): all-gather it to the
    full sequence the tail reads (backward: each rank keeps its part of the gradient)."""
    module.get_submodule(path).register_forward_hook(_gather_seq_output_hook(mesh))


# -- vocabulary parallelism (head and tail) --------------------------------------------------


def vocab_parallel_modules(module: nn.Module, graph, start: int, end: int) -> Dict[str, str]:
    """{module FQN: "rowwise" | "colwise"} of the embeddings in the head and the output linears
    in the tail among blocks ``start:end`` that vocabulary parallelism shards (Megatron's
    vocabulary-parallel embedding and LM head). A parameter shared by two of them (tied
    embeddings) stays replicated: one tensor cannot be sharded for both uses."""
    present = dict(module.named_modules())
    found: Dict[str, str] = {}
    for block in graph.blocks[start:end]:
        if block.kind not in ("head", "tail"):
            continue
        for node in block.nodes:
            d = graph.graph.nodes[node]
            path = d.get("module", "")
            sub = present.get(path)
            if block.kind == "head" and vocab_parallel_lookup(d) and isinstance(sub, nn.Embedding):
                found[path] = "rowwise"
            elif block.kind == "tail" and d.get("op") == "linear" and isinstance(sub, nn.Linear):
                found[path] = "colwise"
    owners: Dict[int, List[str]] = {}
    for name, sub in present.items():
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    tied = {n for names in owners.values() if len(names) > 1 for n in names}
    return {name: kind for name, kind in found.items() if name not in tied}


def apply_vocab_parallel(module: nn.Module, graph, start: int, end: int, tp_mesh: DeviceMesh) -> Dict[str, str]:
    """Shard the head's embeddings by rows (vocabulary; the partial outputs are all-reduced) and
    the tail's output linears by columns (the logits are all-gathered, so any loss function
    sees full logits), over ``tp_mesh``. Returns what was sharded (see
    :func:`vocab_parallel_modules`)."""
    if tp_mesh.size() == 1:
        return {}
    targets = vocab_parallel_modules(module, graph, start, end)
    styles = {
        name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if kind == "rowwise"
        else ColwiseParallel(output_layouts=Replicate())
        for name, kind in targets.items()
    }
    if styles:
        parallelize_module(module, tp_mesh, styles, src_data_rank=None)
    return targets


# -- random numbers ----------------------------------------------------------------------------


def share_rng_state(tp_mesh: DeviceMesh) -> None:
    """Give every rank of the TP group the random-number state of its first rank (CPU and CUDA).

    Outside the TP regions the ranks hold the same activations; dropout there must draw the same
    mask on each, or the replicas silently drift apart (the runtime does not ask ranks to share a
    seed). Inside a region each rank's dropout then draws the same mask pattern for its own heads
    (correlated across ranks, as with one seed per TP group)."""
    group = tp_mesh.get_group()
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    dist.broadcast_object_list(states, group_src=0, group=group)
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


# -- main entry ------------------------------------------------------------------------------


def _pair_styles(pair, present: Dict[str, nn.Module], sp_here: bool) -> Dict[str, object]:
    """{module path (relative to the block): ParallelStyle} sharding one TP pair (see tp_styles)."""
    styles: Dict[str, object] = {}
    if pair.leaf:  # nn.MultiheadAttention: its own parameters, a head-sharded forward (graph.tp_mha)
        if pair.leaf in present:
            styles[pair.leaf] = MultiheadShard({spec.name[len(pair.leaf) + 1 :]: spec for spec in pair.params})
        return styles
    by_owner: Dict[str, Dict[str, TPParam]] = {}
    modules = set(pair.column) | {pair.row}
    for spec in pair.params:
        unit = next((m for m in modules if spec.name.startswith(m + ".")), None)
        owner = unit if unit is not None and unit in present else spec.name.rpartition(".")[0]
        by_owner.setdefault(owner, {})[spec.name[len(owner) + 1 :] if owner else spec.name] = spec
    wide: Dict[str, Dict[str, TPParam]] = {norm: {} for norm in pair.wide_norms}
    for owner, params in by_owner.items():
        if owner not in present:
            continue  # e.g. an expert another EP rank holds
        if owner in wide:
            wide[owner] = params
        elif owner not in modules and pair.kind != "expert":  # per-head tables of the region module (Swin)
            styles[owner] = HeadParams(params)
        elif owner not in modules:  # 3-D expert parameters: the module runs on its local shards
            styles[owner] = LocalShards(params)
        elif owner == pair.row:
            styles[owner] = RowShard(params, output_layouts=Shard(1)) if sp_here else RowShard(params)
        elif any(spec.whole for spec in params.values()):  # multi-query: shared key/value rows kept whole
            styles[owner] = SharedHeadsColumn(params)
        else:
            styles[owner] = ColumnShard(params)
    for norm, params in wide.items():
        if norm in present:
            styles[norm] = WholeWidthNorm(params)
    for norm, dim in pair.head_norms.items():
        if norm in present:
            styles[norm] = SequenceParallel(sequence_dim=dim, use_local_output=True)
    for table in pair.head_tables:
        if table in present:
            styles[table] = ColwiseParallel()
    return styles


def _block_modules(root: nn.Module, block) -> Dict[str, nn.Module]:
    """{path relative to the block (``Block.rel``): module} of a layer or a group of children."""
    if not block.members:
        return dict(root.get_submodule(block.name).named_modules())
    modules = dict(root.named_modules())
    return {
        block.rel(f"{m}.{path}" if path else m): sub
        for m in block.members
        if m in modules
        for path, sub in modules[m].named_modules()
    }


def owned_blocks(graph, names: Sequence[str]) -> List:
    """The layer blocks of ``graph`` named in ``names`` (block names or, for a group of children,
    its members), in chain order."""
    wanted = set(names)
    return [b for b in graph.layer_blocks if wanted & set(b.modules) or b.name in wanted]


def apply_tensor_parallel(
    module: nn.Module,
    graph,
    block_names: Sequence[str],
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    shard_in: bool = False,
    shard_out: bool = False,
) -> Dict[str, str]:
    """Shard the TP pairs of the blocks ``block_names`` (FQNs in ``module``) over ``tp_mesh``.

    Under ``sequence_parallel`` the first block slices the sequence unless ``shard_in`` (a
    pipeline stage receiving the previous stage's shard) and the last one gathers it unless
    ``shard_out`` (a stage handing its shard on); see :func:`sharded_cut`.

    Returns {module FQN: "colwise" | "rowwise" | "local" | "head_norm" | "head_table" | "head_param" |
    "multihead" | "wide_norm"} of what
    was sharded (for reports and tests).
    """
    tp = tp_mesh.size()
    if tp == 1:
        return {}
    applied: Dict[str, str] = {}
    owned = owned_blocks(graph, block_names)
    kinds = {
        ColumnShard: "colwise",
        SharedHeadsColumn: "colwise",
        RowShard: "rowwise",
        LocalShards: "local",
        SequenceParallel: "head_norm",
        ColwiseParallel: "head_table",
        HeadParams: "head_param",
        MultiheadShard: "multihead",
        WholeWidthNorm: "wide_norm",
    }
    for index, block in enumerate(owned):
        name = block.name
        pattern = graph.patterns.get(block.signature)
        if pattern is None:
            continue
        regions = block_regions(pattern)
        present = _block_modules(module, block)
        styles = {}
        for region, kind, pairs in regions:
            sp_here = sequence_parallel and kind != "expert"
            heads = []
            for pair in pairs:
                styles.update(_pair_styles(pair, present, sp_here))
                heads += [h for h in pair.head_inputs if h not in heads]
            target = present.get(region)
            if kind == "attention" and target is not None:
                localise_head_counts(target, tp)
            if heads and target is not None:
                target.register_forward_pre_hook(head_input_hook(heads, tp, tp_mesh.get_local_rank()), with_kwargs=True)
            once = once_input(kind, pairs)
            if not sequence_parallel and once and once in present:
                present[once].register_forward_pre_hook(_replicated_input_pre_hook(tp_mesh), with_kwargs=True)
        if styles:
            # weights are already identical on the TP ranks (broadcast): each keeps its slice, no scatter
            parallelize_module(
                module, tp_mesh, {block.fqn(p): style for p, style in styles.items()}, src_data_rank=None
            )
            applied.update({block.fqn(p): kinds[type(style)] for p, style in styles.items()})
        if not sequence_parallel:
            continue
        block_mod = module.get_submodule(name)  # a layer module: checks refuse sequence parallel for groups
        # Sequence parallel: regions gather their input, norms outside regions run sharded.
        region_paths = [r for r, _, _ in regions]
        for region, kind, pairs in regions:
            target = present[region] if region else block_mod
            if kind == "expert":
                target.register_forward_pre_hook(_gather_seq_pre_hook(tp_mesh, local_output=True), with_kwargs=True)
                target.register_forward_hook(_scatter_seq_output_hook(tp_mesh))
            else:
                # a region that cannot take its input once as a DTensor (another reader inside it would
                # mix a DTensor with plain tensors) gathers to a plain tensor; its columns reduce alone
                local = not prepares_input_once(region, kind, pairs, sequence_parallel=True)
                target.register_forward_pre_hook(_gather_seq_pre_hook(tp_mesh, local_output=local), with_kwargs=True)
        sp_modules = {}
        for sub_name, sub in block_mod.named_modules():
            if not sub_name or _is_under(sub_name, region_paths):
                continue
            if any(True for _ in sub.parameters(recurse=False)) and not any(
                _is_under(sub_name, [k]) for k in sp_modules
            ):
                sp_modules[sub_name] = SequenceParallel(use_local_output=True)
        if sp_modules:
            parallelize_module(block_mod, tp_mesh, sp_modules, src_data_rank=None)
        if index == 0 and not shard_in:
            block_mod.register_forward_pre_hook(_shard_seq_pre_hook(tp_mesh), with_kwargs=True)
        if index == len(owned) - 1 and not shard_out:
            block_mod.register_forward_hook(_gather_seq_output_hook(tp_mesh))
    return applied
