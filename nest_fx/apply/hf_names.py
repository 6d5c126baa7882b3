"""Which tensors of a weights file make each tensor of the module: names as the module has them.

:func:`resolve_sources` maps every tensor the model expects (parameters under their first
name, persistent buffers) to where its values are in the file:

* :class:`Direct`: one file tensor, of the same shape (a torch state dict, a nest-fx model, a
  HF model saved in its current layout).
* :class:`Stacked`: HF MoE experts saved one module per expert (``...experts.3.w1.weight``)
  that transformers 5 stacks into one tensor (``...experts.gate_up_proj``, ``[E, 2I, H]``): the
  target's row ``e`` is the concatenation along ``concat_dim`` of part ``j``'s expert-``e``
  tensor. A rank reads only the experts and rows of its box.

HuggingFace names go through transformers' own key conversions, as ``from_pretrained`` does:
the model's conversion mapping (``transformers.conversion_mapping``: renamings such as
Mixtral's ``block_sparse_moe`` -> ``mlp``, and converters of which :class:`Stacked` covers the
stack-then-concatenate kind), a user ``_checkpoint_conversion_mapping``, legacy
``LayerNorm.gamma/beta``, and the base-model prefix added or stripped (``model.``). A tied
tensor (``lm_head.weight`` tied to ``model.embed_tokens.weight``) is read under either of its
names; a file holding both is fine. Converters of another kind (split, transpose, permute)
are refused by name: their output is not a box of the file's tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from nest_fx.apply.checks import ApplyError

Spec = Tuple[Tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Direct:
    """The file tensor ``key``."""

    key: str
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Stacked:
    """``target[e] = cat([parts[j][e] for j], dim=concat_dim - 1)``: file keys per part and expert."""

    parts: Tuple[Tuple[str, ...], ...]
    concat_dim: int  # in the target's dims (>= 1); 0 when there is one part
    part_shapes: Tuple[Tuple[int, ...], ...]  # one expert's tensor of each part

    @property
    def shape(self) -> Tuple[int, ...]:
        base = list(self.part_shapes[0])
        if len(self.parts) > 1:
            base[self.concat_dim - 1] = sum(s[self.concat_dim - 1] for s in self.part_shapes)
        return (len(self.parts[0]), *base)


@dataclass
class Resolution:
    """Where each expected tensor comes from, and what the file has that the model does not."""

    sources: Dict[str, object]
    unexpected: List[str]
    aliases: Dict[str, str]  # every name of a tensor -> its first name (the key of ``sources``)

    def source(self, name: str):
        """Where the tensor ``name`` (any of its names) comes from, or None."""
        return self.sources.get(self.aliases.get(name, name))


def read_box(reader, source, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of the target tensor ``source`` describes."""
    if isinstance(source, Direct):
        return reader.read(source.key, offsets, sizes)
    experts = []
    for e in range(offsets[0], offsets[0] + sizes[0]):
        inner_off, inner_size = list(offsets[1:]), list(sizes[1:])
        if len(source.parts) == 1:
            experts.append(reader.read(source.parts[0][e], inner_off, inner_size))
            continue
        d = source.concat_dim - 1
        lo, hi, base, pieces = inner_off[d], inner_off[d] + inner_size[d], 0, []
        for keys, shape in zip(source.parts, source.part_shapes):
            start, end = max(lo, base), min(hi, base + shape[d])
            if start < end:
                off, size = list(inner_off), list(inner_size)
                off[d], size[d] = start - base, end - start
                pieces.append(reader.read(keys[e], off, size))
            base += shape[d]
        experts.append(torch.cat(pieces, d))
    return torch.stack(experts, 0)


def expected_tensors(model: nn.Module) -> Tuple[Dict[str, Spec], Dict[str, str]]:
    """({name: (shape, dtype)} of the parameters (first names) and persistent buffers of
    ``model``, {every name of a parameter or buffer: its first name})."""
    expected: Dict[str, Spec] = {}
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(p), name)
        aliases[name] = canonical
        expected.setdefault(canonical, (tuple(p.shape), p.dtype))
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf, b in module._buffers.items():
            if b is None or leaf in module._non_persistent_buffers_set:
                continue
            name = f"{path}.{leaf}" if path else leaf
            canonical = first.setdefault(id(b), name)
            aliases[name] = canonical
            expected.setdefault(canonical, (tuple(b.shape), b.dtype))
    return expected, aliases


def _conversions(model: nn.Module) -> Tuple[list, list, Optional[str]]:
    """(renamings, converters, base-model prefix) transformers applies when loading ``model``."""
    try:
        from transformers import PreTrainedModel  # only for HF models (the optional 'hf' extra)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], [], None
    if not isinstance(model, PreTrainedModel):
        return [], [], None
    user = getattr(model, "_checkpoint_conversion_mapping", None) or None
    transforms = get_model_conversion_mapping(model, key_mapping=user)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, getattr(model, "base_model_prefix", None) or None


def _with_prefix(name: str, prefix: Optional[str], known: Dict[str, str]) -> str:
    """``name`` with the base-model prefix added or stripped when that makes it a module name."""
    if name in known or not prefix:
        return name
    if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in known:
        return name[len(prefix) + 1 :]
    if f"{prefix}.{name}" in known:
        return f"{prefix}.{name}"
    return name


def _stack_kind(converter) -> Optional[int]:
    """The concatenation dim of a stack-then-concatenate converter (0 when it only stacks), or
    None for any other kind."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) == 1:
        return 0
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        return ops[1].dim
    return None


def _expert_index(pattern: str, key: str) -> Optional[int]:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, key)
    return int(match.group(1)) if match and match.groups() else None


def resolve_sources(model: nn.Module, file_specs: Dict[str, Spec], where: str) -> Resolution:
    """Map the expected tensors of ``model`` to the tensors of a file with ``file_specs``."""
    expected, aliases = expected_tensors(model)
    renamings, converters, prefix = _conversions(model)
    sources: Dict[str, object] = {}
    unexpected: List[str] = []
    stacks: Dict[str, Tuple[object, int, Dict[int, Dict[int, str]]]] = {}
    for key in file_specs:
        name = key
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        matched = None
        for converter in converters:
            target, pattern = converter.rename_source_key(name)
            if pattern is not None:
                matched = (converter, target, pattern)
                break
        if matched is None:
            canonical = aliases.get(_with_prefix(name, prefix, aliases))
            if canonical is None:
                unexpected.append(key)
            elif canonical not in sources or name == canonical:
                sources[canonical] = Direct(key, file_specs[key][0])
            continue
        converter, target, pattern = matched
        canonical = aliases.get(_with_prefix(target, prefix, aliases))
        kind = _stack_kind(converter)
        originals = list(getattr(converter, "_original_source_patterns", converter.source_patterns))
        part = next((j for j, p in enumerate(originals) if _expert_index(p, name) is not None), None)
        if canonical is None:
            unexpected.append(key)
            continue
        if kind is None or part is None:
            raise ApplyError(
                f"weights={where}: transformers converts {key} into {canonical} with "
                f"{[type(op).__name__ for op in converter.operations]}, which the sliced reader "
                "does not do; fix: load the model once with from_pretrained and save it with "
                "torch.save(model.state_dict(), PATH), then pass weights=PATH"
            )
        entry = stacks.setdefault(canonical, (converter, kind, {}))
        entry[2].setdefault(part, {})[_expert_index(originals[part], name)] = key
    for canonical, (converter, kind, parts) in stacks.items():
        count = len(getattr(converter, "_original_source_patterns", converter.source_patterns))
        experts = sorted({e for p in parts.values() for e in p})
        complete = len(parts) == count and all(sorted(p) == list(range(len(experts))) for p in parts.values())
        if not complete:
            unexpected.extend(k for p in parts.values() for k in p.values())
            continue
        keys = tuple(tuple(parts[j][e] for e in experts) for j in range(count))
        sources[canonical] = Stacked(keys, kind, tuple(file_specs[k[0]][0] for k in keys))
    return Resolution(sources, sorted(unexpected), aliases)


def weight_problems(model: nn.Module, resolution: Resolution, ignore_missing: Sequence[str] = ()) -> List[str]:
    """Lines naming the missing, unexpected and wrongly shaped tensors (empty when the file fits)."""
    expected, _ = expected_tensors(model)
    missing = [n for n in expected if n not in resolution.sources and not any(re.search(p, n) for p in ignore_missing)]
    shapes = [
        f"{n}: file {list(s.shape)}, model {list(expected[n][0])}"
        for n, s in resolution.sources.items()
        if n in expected and tuple(s.shape) != expected[n][0]
    ]
    lines = []
    for label, items in (
        ("missing from the file", missing),
        ("in the file but not in the model", resolution.unexpected),
        ("wrong shape", shapes),
    ):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            lines.append(f"{label}: {shown}")
    return lines
