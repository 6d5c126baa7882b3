"""Pipeline parallelism: split the model at the plan's stage boundaries and run a PP schedule.

How a stage module is made. The tracer already told us the workload chain: the head block,
the layer blocks ``<container>.<i>`` and the tail block, with the module of every op. A stage
``[start, end)`` keeps

* the layer blocks in its range: the layer container (e.g. ``layers`` or ``model.layers``) is
  replaced by a :class:`LayerSubset`, a ``ModuleList`` that stores only those layers *under
  their original indices*, so parameter names (``layers.5.attn.q_proj.weight``) and state dicts
  do not change;
* the head's parameterised modules (``embed``; ``model.embed_tokens``) when it owns index 0,
  else they become ``nn.Identity`` so the stage's input (the previous stage's hidden state)
  flows through unchanged;
* the tail's parameterised modules (``norm``, ``lm_head``) when it owns the last index, else
  ``nn.Identity``.

Parameter-free head modules (a rotary-embedding table, mask construction) keep running on
every stage: they recompute position tables from the hidden state's shape.

Why the module is split this way rather than by cutting the fx graph: the tracer captures
with ``torch.export`` when fx cannot trace a model (every HF model), which yields an
aten-level graph whose submodules no longer exist as ``nn.Module`` s, so ``parallelize_module``
(TP) and ``fully_shard`` (FSDP) could not be applied to it and parameter names would change.
Hollowing the original module keeps the model's own forward (one code path for a traced or an
exported model), its parameter objects and names, and lets TP/FSDP/checkpointing work on the
real submodules. The fx graph still decides *where* the boundaries are (the blocks) and which
modules belong to the head and tail. Limitation: a model whose head or tail does parameter-
free arithmetic at its top level on the hidden state (e.g. a ``* sqrt(hidden)`` scale written
in the root forward) would apply it on every stage; such models need an fx-level split.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from nest_fx.apply.checks import ApplyError
from nest_fx.plan.support import head_tail_modules


class LayerSubset(nn.ModuleList):
    """The layers a stage owns, registered under their original indices; iterates in order."""

    def __init__(self, layers: Dict[int, nn.Module]):
        nn.Module.__init__(self)
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __getitem__(self, idx):
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    def indices(self) -> List[int]:
        return [int(k) for k in self._modules]


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, module)


def _logits(output):
    """The tensor a stage passes on: the model output itself, ``.logits``, or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    for attr in ("logits", "last_hidden_state"):
        value = output.get(attr) if isinstance(output, dict) else getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the output tensor in a {type(output).__name__}")


def tensor_output(output):
    return _logits(output)


def _output_hook(module, args, output):
    return _logits(output)


def layer_index(block_name: str, container: str) -> int:
    rest = block_name[len(container) + 1:] if container else block_name
    return int(rest.split(".", 1)[0])


def stage_blocks(graph, start: int, end: int) -> List[str]:
    return [b.name for b in graph.blocks[start:end] if b.kind == "block"]


def split_stages(model: nn.Module, graph, ranges: Sequence[Tuple[int, int]]) -> List[nn.Module]:
    """One stage module per layer range [start, end) of the workload chain (see module docstring).

    With one range the model is hollowed in place (no copy); with several (interleaved chunks on
    one rank) a parameter-free skeleton is copied per chunk and the owned parts moved in.
    """
    n = len(graph.blocks)
    container = graph.block_container
    head, tail = head_tail_modules(model, graph)
    originals = {p: model.get_submodule(p) for p in head + tail}
    layer_mods = {layer_index(b.name, container): model.get_submodule(b.name)
                  for b in graph.blocks if b.kind == "block"}
    stages: List[nn.Module] = []
    if len(ranges) > 1:
        # strip everything parameterised, copy the skeleton per chunk
        for p in head + tail:
            _set_submodule(model, p, nn.Identity())
        if container:
            _set_submodule(model, container, LayerSubset({}))
        skeleton = model
    for start, end in ranges:
        target = copy.deepcopy(skeleton) if len(ranges) > 1 else model
        owned = {layer_index(b, container): layer_mods[layer_index(b, container)] for b in stage_blocks(graph, start, end)}
        if container:
            _set_submodule(target, container, LayerSubset(owned))
        for p in head:
            _set_submodule(target, p, originals[p] if start == 0 else nn.Identity())
        for p in tail:
            _set_submodule(target, p, originals[p] if end == n else nn.Identity())
        target.register_forward_hook(_output_hook)
        stages.append(target)
    return stages


def interleaved_ranges(plan, num_layers: int) -> List[List[Tuple[int, int]]]:
    """Chunks per device for the interleaved schedule: device i keeps its plan layer count
    ``end_i - start_i`` split into ``v`` near-equal chunks; chunks are laid along the chain in
    the order (chunk 0 of devices 0..p-1), (chunk 1 of devices 0..p-1), ... Returns
    ``chunks[i] = [(start, end) of chunk 0, chunk 1, ...]`` for device (stage) i."""
    v = plan.virtual_stages
    sizes = []
    for i, s in enumerate(plan.stages):
        count = s.end - s.start
        if count < v:
            raise ApplyError(f"stages[{i}] has {count} layers, fewer than virtual_stages={v} chunks; fix: "
                             f"lower virtual_stages or give the stage more layers")
        sizes.append([count * (c + 1) // v - count * c // v for c in range(v)])
    chunks: List[List[Tuple[int, int]]] = [[] for _ in plan.stages]
    pos = 0
    for c in range(v):
        for i in range(plan.pp):
            chunks[i].append((pos, pos + sizes[i][c]))
            pos += sizes[i][c]
    assert pos == num_layers
    return chunks


def make_schedule(plan, stage_modules: Sequence[nn.Module], stage_indices: Sequence[int], num_stages: int,
                  n_microbatches: int, loss_fn: Callable, pp_group, device: torch.device):
    """PipelineStages for this rank's chunks and the plan's schedule over them."""
    stages = [PipelineStage(m, idx, num_stages, device, group=pp_group)
              for m, idx in zip(stage_modules, stage_indices)]
    if plan.schedule == "interleaved":
        return stages, ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    cls = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
    return stages, cls(stages[0], n_microbatches, loss_fn=loss_fn)
