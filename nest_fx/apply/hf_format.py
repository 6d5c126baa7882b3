"""The HuggingFace directory format, without a process group: names, shards, files, the destination.

What ``save_pretrained`` / ``nest-fx export --to hf`` write into ``DIR`` is what
``transformers`` ``PreTrainedModel.save_pretrained`` writes for the same weights:

* tensor names as HF saves them. The source names are the model's own (``model_specs``: its
  parameters and persistent buffers, a tied weight once, under its first name). For a
  ``transformers`` model a parameter-free copy of it on ``meta`` (:func:`hf_skeleton`) decides
  the rest with HF's own functions: ``remove_tied_weights_from_state_dict`` (which name of a
  tied pair is kept) and ``revert_weight_conversion`` (the renames and splits HF applies when it
  saves, e.g. Mixtral's stacked ``mlp.experts.gate_up_proj`` back to
  ``block_sparse_moe.experts.<e>.w1/w3.weight``). Other models keep their own names.
* ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards of at most
  ``max_shard_size`` bytes each (a tensor larger than that gets a shard of its own, as HF does)
  and ``model.safetensors.index.json`` (``metadata.total_size``, ``metadata.total_parameters``,
  ``weight_map``); every shard carries the ``{"format": "pt"}`` metadata.
* ``config.json`` (and ``generation_config.json`` for models that generate) for HF models, with
  ``use_cache`` back at its config class's default (nest-fx turns the cache off for training).

:class:`ExportLayout` is the whole plan of the files, computed from names, shapes and dtypes
alone (the same on every rank, before anything is read): which source tensors go into which
file. A source tensor and every output tensor made from it land in the same file, so each file
is written from its own sources only.

The destination (:func:`prepare_destination`, :func:`publish_destination`): ``DIR`` must not
exist, or be an empty directory; anything else is refused with :class:`ExportError` unless
``overwrite=True``, which replaces ``DIR`` as a whole. The files are written into a temporary
sibling ``.<name>.tmp-export-<token>`` and appear under ``DIR`` by one rename once all are
complete, so ``DIR`` holds either its old content or the whole export, never a mix.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from nest_fx.apply.checkpoint_files import fsync_dir, write_json
from nest_fx.apply.fingerprint import TensorSpec
from nest_fx.common.errors import NestFxError
from nest_fx.models.hf_config import require_transformers

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
SAFETENSORS_METADATA = {"format": "pt"}
TMP_MARK = ".tmp-export-"
OLD_MARK = ".old-export-"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class ExportError(NestFxError, ValueError):
    """An export cannot be written (destination, size, names); the message names the fix."""


def parse_size(size) -> int:
    """Bytes of ``max_shard_size``: an int, or ``"5GB"`` (10^9, as HF reads it), ``"500MiB"`` (2^20)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ExportError(
            f"max_shard_size={size!r} is not a size; fix: pass bytes (int) or a string like '5GB' or '500MiB'"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# -- the model's HF identity -------------------------------------------------------------------


def hf_class_and_config(module: nn.Module):
    """(model class, config) of a ``transformers`` model (or a stage of one, which keeps its class;
    FSDP2's ``FSDP<Name>`` wrapper class is looked through), or (None, None) for other models."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not hasattr(module, "can_generate"):
        return None, None
    for cls in type(module).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls, config
    return None, None


def hf_skeleton(cls, config) -> nn.Module:
    """A parameter-free copy of the model on ``meta``: HF's naming functions walk its modules."""
    with torch.device("meta"):
        return cls(config)


@dataclass
class ExportLayout:
    """The output files, and the source tensors each is made from.

    ``files``: file name -> output names, in file order; ``sources``: output name -> the source
    name it is made from; ``shapes``: output name -> shape; ``source_specs``: source name ->
    (shape, dtype); ``origin``: source name -> the model's own name (they differ for a tied pair
    HF keeps under its other name); ``skeleton``: the meta model HF's reverse conversion runs
    with (None: names are kept); ``dtype``: floating tensors are written in it (None: their own)."""

    files: Dict[str, List[str]]
    sources: Dict[str, str]
    shapes: Dict[str, Tuple[int, ...]]
    source_specs: Dict[str, TensorSpec]
    origin: Dict[str, str]
    dtype: Optional[torch.dtype] = None
    skeleton: Optional[nn.Module] = None
    total_size: int = 0
    total_parameters: int = 0

    def file_sources(self, file: str) -> List[str]:
        """The source names one file is made from (a source split over two files feeds both)."""
        return list(dict.fromkeys(self.sources[o] for o in self.files[file]))

    def weight_map(self) -> Dict[str, str]:
        """{output name: file} for the index."""
        return {out: f for f, outs in self.files.items() for out in outs}

    def index(self) -> Optional[dict]:
        """The ``model.safetensors.index.json`` content, or None for a single file."""
        if len(self.files) <= 1:
            return None
        return {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": dict(sorted(self.weight_map().items())),
        }


def _meta_tensor(spec: TensorSpec) -> torch.Tensor:
    shape, dtype = spec
    return torch.empty(tuple(shape), dtype=_dtype(dtype), device="meta")


def _hf_sources(skeleton: nn.Module, specs: Mapping[str, TensorSpec]) -> Dict[str, str]:
    """{source name: the name HF keeps for it}: the model's names, where a tied pair is kept under
    HF's choice of name. ExportError when the model's tensors are not the skeleton's."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict  # optional 'hf' extra

    state = skeleton.state_dict()
    kept = set(remove_tied_weights_from_state_dict(dict(state), skeleton))
    aliases: Dict[int, List[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    group_of = {name: names for names in aliases.values() for name in names}
    mapping: Dict[str, str] = {}
    for name in specs:
        if name in kept:
            mapping[name] = name
            continue
        twin = [n for n in group_of.get(name, []) if n in kept]
        if not twin:
            raise ExportError(
                f"{name} is a tensor of the trained model but not of {type(skeleton).__name__} as "
                "transformers builds it from its config; fix: export a model built from its "
                "transformers config"
            )
        mapping[name] = twin[0]
    missing = sorted(kept - set(mapping.values()))
    if missing:
        raise ExportError(
            f"{type(skeleton).__name__} has tensors the trained model lacks: {missing[:3]}; fix: export "
            "a model built from its transformers config"
        )
    return mapping


def _reverse_conversion(skeleton: nn.Module):
    """HF's save-time weight conversions of the skeleton's class (None when there are none)."""
    from transformers.conversion_mapping import get_model_conversion_mapping  # optional 'hf' extra
    from transformers.core_model_loading import PrefixChange

    found = [c for c in get_model_conversion_mapping(skeleton, add_legacy=False) if not isinstance(c, PrefixChange)]
    return found or None


def convert_names(skeleton: Optional[nn.Module], tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors under the names (and splits) HF saves them with: HF's own
    ``revert_weight_conversion`` on ``tensors`` (whose names are those HF keeps)."""
    if skeleton is None:
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion  # optional 'hf' extra

    return revert_weight_conversion(skeleton, dict(tensors))


def _split(outputs: Sequence[str], nbytes: Mapping[str, int], limit: int) -> List[List[str]]:
    """HF's split (huggingface_hub ``split_state_dict_into_shards_factory``): in order, a new file
    when the next tensor would pass ``limit``; a tensor larger than ``limit`` gets a file of its own."""
    files, current, size = [], [], 0
    for name in outputs:
        if nbytes[name] > limit:
            files.append([name])
            continue
        if current and size + nbytes[name] > limit:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes[name]
    if current:
        files.append(current)
    return files


def export_layout(
    specs: Mapping[str, TensorSpec],
    max_shard_size,
    hf_model: Optional[Tuple[type, object]] = None,
    dtype: Optional[torch.dtype] = None,
) -> ExportLayout:
    """Plan the output files of a model with tensors ``specs`` (see the module docstring): the
    files, names and order ``transformers`` ``save_pretrained`` gives the same model.

    ``hf_model``: (class, config) of a ``transformers`` model, None for another model (its own
    names, in the specs' order). ``dtype``: the dtype floating tensors are written in."""
    limit = parse_size(max_shard_size)
    skeleton, sources, order = None, {name: name for name in specs}, list(specs)
    if hf_model is not None and hf_model[0] is not None:
        require_transformers()
        skeleton = hf_skeleton(*hf_model)
        sources = _hf_sources(skeleton, specs)
        kept = set(sources.values())
        order = [n for n in skeleton.state_dict() if n in kept]  # HF's order: the module's state dict
        conversions = _reverse_conversion(skeleton)
        if conversions is not None:
            skeleton._weight_conversions = conversions  # computed once: HF reads it on every revert
        else:
            skeleton = None  # nothing to convert: names are kept
    source_specs = {sources[n]: tuple(specs[n]) for n in specs}
    origin = {sources[n]: n for n in specs}
    if skeleton is not None:
        whole = convert_names(skeleton, {n: _meta_tensor(source_specs[n]) for n in order})
        shapes = {out: tuple(t.shape) for out, t in whole.items()}
        made_from: Dict[str, str] = {}
        for name in order:
            for out, t in convert_names(skeleton, {name: _meta_tensor(source_specs[name])}).items():
                made_from[out] = name
                if shapes.get(out) != tuple(t.shape):
                    raise ExportError(
                        f"{type(skeleton).__name__}: transformers converts {name} together with other "
                        "weights when it saves, which a file-by-file export cannot reproduce; fix: "
                        "report it to nest-fx"
                    )
        if set(made_from) != set(shapes):
            raise ExportError(
                f"{type(skeleton).__name__}: the weights transformers saves are not made one source "
                "tensor at a time; fix: report it to nest-fx"
            )
        outputs = list(whole)
    else:
        made_from = {n: n for n in order}
        shapes = {n: tuple(source_specs[n][0]) for n in order}
        outputs = list(order)
    out_dtype = {o: _out_dtype(source_specs[made_from[o]], dtype) for o in outputs}
    nbytes = {o: _numel(shapes[o]) * torch.empty((), dtype=out_dtype[o]).element_size() for o in outputs}
    files = _split(outputs, nbytes, limit)
    if len(files) == 1:
        named = {WEIGHTS_NAME: files[0]}
    else:
        named = {SHARD_NAME.format(index=i + 1, count=len(files)): f for i, f in enumerate(files)}
    params = sum(_numel(shapes[o]) for o in outputs)
    return ExportLayout(named, made_from, shapes, source_specs, origin, dtype, skeleton, sum(nbytes.values()), params)


def _out_dtype(spec: TensorSpec, dtype: Optional[torch.dtype]) -> torch.dtype:
    own = _dtype(spec[1])
    return dtype if dtype is not None and own.is_floating_point else own


def write_file(layout: ExportLayout, directory: str, file: str, tensors: Dict[str, torch.Tensor]) -> int:
    """Write one output file from its source tensors (``layout.file_sources(file)``: full, in the
    model's own layout); returns its bytes. ExportError when a tensor is not the planned one."""
    from safetensors.torch import save_file  # a dependency of the 'hf' extra

    if layout.dtype is not None:
        tensors = {n: t.to(layout.dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    converted = convert_names(layout.skeleton, tensors) if layout.skeleton is not None else tensors
    out = {}
    for name in layout.files[file]:
        t = converted.get(name)
        if t is None or tuple(t.shape) != layout.shapes[name]:
            raise ExportError(
                f"{file}: {name} is {'missing' if t is None else f'of shape {tuple(t.shape)}'}, "
                f"planned {layout.shapes[name]}; fix: report it to nest-fx"
            )
        out[name] = t.contiguous()
    del converted
    path = os.path.join(directory, file)
    save_file(out, path, metadata=dict(SAFETENSORS_METADATA))
    return os.path.getsize(path)


def write_config(directory: str, hf_model, dtype: torch.dtype) -> List[str]:
    """``config.json`` (and ``generation_config.json`` for generating models) as HF writes them."""
    cls, config = hf_model
    config = config.__class__.from_dict(config.to_dict())
    # nest-fx turns the key/value cache off for training; the exported model gets its class's default
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if hasattr(part, "use_cache"):
            part.use_cache = getattr(type(part)(), "use_cache", part.use_cache)
    config.architectures = [cls.__name__]
    config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(directory)
    written = ["config.json"]
    if getattr(cls, "can_generate", None) is not None and cls.can_generate():
        from transformers import GenerationConfig  # optional 'hf' extra

        GenerationConfig.from_model_config(config).save_pretrained(directory)
        written.append("generation_config.json")
    return written


# -- the destination ---------------------------------------------------------------------------


def _siblings(final: str, mark: str) -> List[str]:
    parent, base = os.path.split(final)
    prefix = f".{base}{mark}"
    try:
        return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return []


def prepare_destination(final: str, overwrite: bool) -> str:
    """Check ``final`` and make the temporary directory the export is written into; returns it.
    Leftovers of an interrupted export to the same ``final`` are removed first."""
    if os.path.exists(final) and not os.path.isdir(final):
        raise ExportError(f"cannot export to {final}: it is a file; fix: pass a directory path")
    if os.path.isdir(final) and os.listdir(final) and not overwrite:
        raise ExportError(
            f"refusing to export into {final}: it is a non-empty directory and its files would be "
            "replaced; fix: choose a new or empty directory, or pass overwrite=True (--overwrite) to "
            "replace it as a whole"
        )
    parent = os.path.dirname(final) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ExportError(
            f"cannot create {parent} ({e.strerror or e}); fix: pass a directory this job can write"
        ) from None
    for stale in _siblings(final, TMP_MARK):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}{TMP_MARK}{uuid.uuid4().hex[:12]}")
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise ExportError(
            f"cannot write into {parent} ({e.strerror or e}); fix: pass a directory this job can write"
        ) from None
    return tmp


def publish_destination(tmp: str, final: str, index: Optional[dict]) -> None:
    """The finished export appears under ``final`` by one rename (an existing ``final`` is set
    aside first and deleted after: ``prepare_destination`` allowed it)."""
    if index is not None:
        write_json(os.path.join(tmp, INDEX_NAME), index)
    aside = None
    if os.path.isdir(final):
        if os.listdir(final):
            aside = os.path.join(
                os.path.dirname(final) or ".", f".{os.path.basename(final)}{OLD_MARK}{uuid.uuid4().hex[:12]}"
            )
            os.rename(final, aside)
        else:
            os.rmdir(final)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
