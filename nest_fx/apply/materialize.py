"""Give a model started on ``meta`` its values, each rank only the part it owns.

After every rewrite of ``auto_parallelize`` (pipeline split, expert, tensor and data
parallelism) a rank's stage chunks hold exactly what the rank owns: DTensor shards (TP, EP,
FSDP) and plain tensors, all still on ``meta``. :func:`materialize` allocates them on the
device (``to_empty``), then fills each one:

* from the weights file (:class:`LoadedWeights`): the boxes of the original tensor the rank's
  shard holds come from the DTensor's placements (``compute_local_shape_and_global_offset``)
  and, for fused projections sharded by heads, from their layout
  (:func:`nest_fx.apply.fused_params.original_boxes`); each box is read from the file alone
  straight into the shard's storage (``read_into``: safetensors runs read with ``preadv``, the
  dtype converted through a staging buffer of at most 16 MiB, no mapping of the file).
* from the model's own initialisation, module by module, for what the file does not hold
  (non-persistent buffers: rotary tables) and for everything without a file. The module's
  tensors are allocated whole, one module at a time, on the device, filled with NaN, and the
  module's ``reset_parameters()`` then the root's ``_init_weights(module)`` (HF and the zoo)
  run on them, under a random generator seeded from ``(init_seed, module name)``; the rank
  keeps its boxes and drops the rest. A tensor no initialisation wrote (still NaN) is an
  :class:`ApplyError` naming it. The RNG rule (docs/runtime.md): every plan, world size and
  rank gives each tensor the same values (the one-device meta start included); deterministic
  initialisations (ones, zeros, rotary tables, constants) equal an eager build's exactly,
  random ones (normal, uniform, kaiming) only in distribution, since an eager build draws the
  whole model from one generator in construction order.

No rank holds more than its own tensors plus one module's tensors whole (during its
initialisation); the file is read box by box.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nest_fx.apply.checks import ApplyError
from nest_fx.apply.fused_params import fused_layouts, original_boxes
from nest_fx.apply.hf_names import Direct, Resolution, expected_tensors, read_box, resolve_sources, weight_problems
from nest_fx.apply.weights_in import is_nest_fx_checkpoint, open_weights

# wrappers activation checkpointing and torch.compile put between a module and its children
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass
class LoadedWeights:
    """A weights file opened and matched against the whole model, before anything changed."""

    path: str
    reader: object = None  # weights_in reader; None for a nest-fx checkpoint (loaded after)
    resolution: Optional[Resolution] = None
    checkpoint: bool = False

    @property
    def bytes_read(self) -> int:
        return getattr(self.reader, "bytes_read", 0)


def prepare_weights(path: str, model: nn.Module) -> LoadedWeights:
    """Open ``path`` and match it with ``model`` (whole, on any device): an :class:`ApplyError`
    listing the missing, unexpected and wrongly shaped tensors when it does not fit. Reads the
    file headers only, the same on every rank, so every rank raises the same error before the
    first collective."""
    path = str(path)
    if is_nest_fx_checkpoint(path):
        return LoadedWeights(path, checkpoint=True)
    reader = open_weights(path)
    resolution = resolve_sources(model, reader.specs(), path)
    ignore = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if ignore_unexpected:
        resolution.unexpected = [
            k for k in resolution.unexpected if not any(re.search(p, k) for p in ignore_unexpected)
        ]
    problems = weight_problems(model, resolution, ignore)
    if problems:
        raise ApplyError(
            f"weights={path} does not fit {type(model).__name__}: "
            + "; ".join(problems)
            + "; fix: pass the weights saved from this model (same config), or build the model from "
            "the config saved with them"
        )
    return LoadedWeights(path, reader, resolution)


def clean_name(name: str) -> str:
    """``name`` under the model's own module names (without the wrappers of activation
    checkpointing and torch.compile)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


@dataclass
class _Held:
    """One tensor this rank holds: its local storage and the boxes of the original it covers."""

    name: str
    tensor: torch.Tensor
    boxes: List[Tuple[List[int], List[int], int]] = field(default_factory=list)
    dim: int = 0

    @property
    def local(self) -> torch.Tensor:
        t = self.tensor.data if isinstance(self.tensor, nn.Parameter) else self.tensor
        return t._local_tensor if isinstance(t, DTensor) else t

    def target(self, box_index: int) -> torch.Tensor:
        """The part of the local storage box ``box_index`` fills (a view)."""
        offsets, sizes, start = self.boxes[box_index]
        local = self.local
        return local.narrow(self.dim, start, sizes[self.dim]) if len(self.boxes) > 1 or start else local

    def write(self, box_index: int, value: torch.Tensor) -> None:
        target = self.target(box_index)
        target.copy_(value.reshape(target.shape).to(target.dtype))


def held_tensors(chunks: Sequence[nn.Module]) -> Tuple[Dict[str, _Held], Dict[str, _Held]]:
    """({name: parameter}, {name: buffer}) this rank holds, under the whole model's names, with
    the boxes of the original tensors their local shards cover."""
    layouts = {clean_name(k): v for k, v in fused_layouts(chunks).items()}
    params: Dict[str, _Held] = {}
    buffers: Dict[str, _Held] = {}
    seen = set()
    for chunk in chunks:
        for raw, p in chunk.named_parameters():
            name = clean_name(raw)
            if id(p) in seen or name in params:
                continue
            seen.add(id(p))
            params[name] = _entry(name, p, layouts.get(name))
        for raw, b in chunk.named_buffers():
            name = clean_name(raw)
            if id(b) not in seen and name not in buffers:
                seen.add(id(b))
                buffers[name] = _entry(name, b, None)
    return params, buffers


def _entry(name: str, t: torch.Tensor, layout) -> _Held:
    value = t.data if isinstance(t, nn.Parameter) else t
    if isinstance(value, DTensor):
        return _Held(name, t, original_boxes(value, layout), layout.dim if layout is not None else 0)
    return _Held(name, t, [([0] * t.dim(), list(t.shape), 0)])


def to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device)``, then every parameter or buffer slot that shared one tensor
    before (tied embeddings) shares the new one again: ``Module._apply`` replaces a parameter
    per slot when it cannot swap its storage in place (meta to a device next to DTensors)."""
    groups: Dict[int, List[Tuple[nn.Module, str, str]]] = {}
    for sub in module.modules():
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(sub, kind).items():
                if t is not None:
                    groups.setdefault(id(t), []).append((sub, kind, key))
    module.to_empty(device=device)
    for slots in groups.values():
        first, kind, key = slots[0]
        keep = getattr(first, kind)[key]
        for sub, sub_kind, sub_key in slots[1:]:
            getattr(sub, sub_kind)[sub_key] = keep


def module_seed(seed: int, module: str) -> int:
    """The generator seed of ``module``'s initialisation (the same on every rank and plan)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{module}".encode()).digest()[:8], "little") % (2**63 - 1)


def _initializers(root: nn.Module) -> List[Callable[[nn.Module], None]]:
    """What initialises one module: its ``reset_parameters``, then the root's ``_init_weights``."""

    def own(module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    found = [own]
    root_init = getattr(root, "_init_weights", None)
    if callable(root_init):
        found.append(root_init)
    return found


def _whole_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with its own tensors allocated whole on ``device`` (NaN-filled where floating),
    its children left as they are (on meta: writes to them are no-ops)."""
    temp = nn.Module.__new__(type(module))
    temp.__dict__ = dict(module.__dict__)
    temp._parameters = {
        k: None if p is None else nn.Parameter(_filled(p, device), requires_grad=p.requires_grad)
        for k, p in module._parameters.items()
    }
    temp._buffers = {k: None if b is None else _filled(b, device) for k, b in module._buffers.items()}
    return temp


def _ancestor_views(skeleton: nn.Module, path: str, temp: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, view) of each ancestor of module ``path``, nearest first: a shallow copy whose
    descendant at ``path`` is ``temp``, everything else the skeleton's (on meta). An ancestor's
    initialisation that rescales its descendants (HF GPT-2 scales every ``c_proj.weight`` by
    ``1/sqrt(2 * layers)`` from the block) so reaches ``temp``'s tensors and nothing else."""
    parts = path.split(".") if path else []
    views: List[Tuple[str, nn.Module]] = []
    child = temp
    for i in range(len(parts) - 1, -1, -1):
        above = ".".join(parts[:i])
        original = skeleton.get_submodule(above)
        view = nn.Module.__new__(type(original))
        view.__dict__ = dict(original.__dict__)
        view._modules = dict(original._modules)
        view._modules[parts[i]] = child
        views.append((above, view))
        child = view
    return views


def _filled(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_floating_point():
        return torch.full(t.shape, math.nan, dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _initialised_copy(
    skeleton: nn.Module, path: str, device: torch.device, seed: int, inits: List[Callable[[nn.Module], None]]
) -> nn.Module:
    """The skeleton's module ``path`` with its own tensors whole on ``device`` as the model's
    initialisation sets them: its ``reset_parameters`` and the root's ``_init_weights`` (also on
    each ancestor) under generators seeded from ``(seed, path)``, so the same values on every
    rank, plan and call on one kind of device (module docstring)."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    temp = _whole_copy(skeleton.get_submodule(path), device)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(module_seed(seed, path))
        for init in inits:
            init(temp)
        if len(inits) > 1:  # the root's _init_weights on each ancestor, as apply() runs it after the children
            for above, view in _ancestor_views(skeleton, path, temp):
                torch.manual_seed(module_seed(seed, f"{path}<{above}"))
                inits[-1](view)
    return temp


def _initialised_tensor(temp: nn.Module, path: str, name: str) -> torch.Tensor:
    """The tensor ``name`` (its leaf in ``temp``, the initialised copy of module ``path``), an
    :class:`ApplyError` when the module holds no such tensor or its initialisation left it unset."""
    leaf = name.rpartition(".")[2]
    full = temp._parameters.get(leaf) if leaf in temp._parameters else temp._buffers.get(leaf)
    if full is None:
        raise ApplyError(f"materialising {name}: the module {path or '<root>'} holds no tensor {leaf}")
    full = full.detach()
    if full.is_floating_point() and bool(torch.isnan(full).any()):
        raise ApplyError(
            f"starting on meta: {name} is not set by the model's initialisation "
            f"({type(temp).__name__} has no reset_parameters and _init_weights leaves it); "
            "fix: pass weights=, or give the module a reset_parameters() that sets it"
        )
    return full


@torch.no_grad()
def initial_value(skeleton: nn.Module, name: str, device: torch.device, seed: int) -> torch.Tensor:
    """The whole tensor ``name`` of the model started on meta (``skeleton``) as :func:`materialize`
    gives it on ``device`` from ``init_seed=seed``: the same initialisation under the same
    generators, so the same values (what ``apply/norm_weights.py`` checks before the first collective)."""
    path = _owner(name)
    return _initialised_tensor(_initialised_copy(skeleton, path, device, seed, _initializers(skeleton)), path, name)


@torch.no_grad()
def _initialise(skeleton: nn.Module, wanted: Dict[str, List[_Held]], device: torch.device, seed: int) -> None:
    """Run the model's initialisation on each module owning a tensor of ``wanted`` ({module name:
    held tensors}) and copy the rank's boxes out (module docstring)."""
    inits = _initializers(skeleton)
    for path, _ in skeleton.named_modules():
        held = wanted.get(path)
        if not held:
            continue
        temp = _initialised_copy(skeleton, path, device, seed, inits)
        for h in held:
            full = _initialised_tensor(temp, path, h.name)
            for i, (offsets, sizes, _) in enumerate(h.boxes):
                h.write(i, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def _load(held: _Held, reader, source) -> None:
    """Fill ``held``'s boxes from the weights: a tensor stored as it is (``Direct``) is read
    straight into the local storage (``reader.read_into``: no copy of the box on the way, the
    dtype converted piece by piece); stacked or concatenated sources (per-expert files) are
    assembled first (``read_box``)."""
    for i, (offsets, sizes, _) in enumerate(held.boxes):
        target = held.target(i)
        if isinstance(source, Direct) and hasattr(reader, "read_into") and list(target.shape) == list(sizes):
            reader.read_into(source.key, offsets, sizes, target)
        else:
            held.write(i, read_box(reader, source, offsets, sizes))


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def materialize(
    chunks: Sequence[nn.Module],
    skeleton: Optional[nn.Module],
    device: torch.device,
    weights: Optional[LoadedWeights] = None,
    init_seed: int = 0,
) -> Dict[str, int]:
    """Allocate this rank's tensors of ``chunks`` on ``device`` when they are on meta and give
    them values (module docstring). ``skeleton``: the whole model as built (on meta), whose
    modules initialise what the weights do not hold (None: nothing to initialise, the chunks
    are already on a device). Returns counts: tensors read, initialised, bytes read."""
    for chunk in chunks:
        if any(t.device.type == "meta" for t in list(chunk.parameters()) + list(chunk.buffers())):
            to_empty_keeping_ties(chunk, device)
    params, buffers = held_tensors(chunks)
    from_file: List[_Held] = []
    to_init: Dict[str, List[_Held]] = {}
    resolution = weights.resolution if weights is not None else None
    aliases = expected_tensors(skeleton)[1] if skeleton is not None else {}
    for h in list(params.values()) + list(buffers.values()):
        if resolution is not None and resolution.source(h.name) is not None:
            from_file.append(h)
        elif weights is not None and weights.checkpoint and h.name in params:
            continue  # the checkpoint loader fills parameters after the ParallelModule exists
        elif skeleton is not None:
            h.name = aliases.get(h.name, h.name)  # a tied tensor is initialised by its first owner
            to_init.setdefault(_owner(h.name), []).append(h)
    with torch.no_grad():
        for h in from_file:
            _load(h, weights.reader, resolution.source(h.name))
        close = getattr(weights.reader, "close", None) if weights is not None else None
        if close is not None:
            close()  # the files and the staging buffer (a later read opens them again)
    if to_init:
        _initialise(skeleton, to_init, device, init_seed)
    return {
        "read": len(from_file),
        "initialised": sum(len(v) for v in to_init.values()),
        "bytes_read": weights.bytes_read if weights is not None else 0,
    }
