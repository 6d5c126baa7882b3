"""What a checkpoint holds and how it maps onto a model under any plan (no file layout, no
collectives: :mod:`nest_fx.apply.checkpoint` saves and loads, :mod:`nest_fx.apply.checkpoint_files`
owns the directory).

Keys do not depend on the plan: ``model.<fqn>``, ``optim.state.<fqn>.<key>``,
``optim.group.<fqn>``, ``train.scheduler``, ``train.data``, ``train.scaler``, ``train.rng.<rank>``
and ``train.dtensor_rng.<rank>`` (:mod:`nest_fx.apply.train_state`). Also here: the metadata
file's contents (:func:`meta`, :func:`read_meta`) and the model check.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from nest_fx.apply.agreement import distributed
from nest_fx.apply.checkpoint_files import META_FILE, CheckpointDamaged, CheckpointError, load_json
from nest_fx.apply.fingerprint import TensorSpec, difference, fingerprint, persistent_buffers, tensor_specs
from nest_fx.apply.fused_params import FusedCheckpointTensor, checkpoint_view, fused_layouts, saved_shape
from nest_fx.apply.train_state import (
    dtensor_rng_state,
    pack,
    rng_state,
    set_dtensor_rng_state,
    set_rng_state,
    stateful,
    unpack,
)
from nest_fx.plan.summary import plan_summary

FORMAT = "nest-fx-ckpt/2"
LEGACY_FORMAT = "nest-fx-ckpt/1"  # one directory, no manifest: still loaded (unverified, with a warning)
DCP_META_FILE = ".metadata"

# -- what is saved ----------------------------------------------------------------------------


def _chunks(target) -> List[nn.Module]:
    """The modules holding this rank's state: a ParallelModule's stage chunks, or the module."""
    return list(getattr(target, "chunks", None) or [target])


def model_tensors(target) -> Dict[str, torch.Tensor]:
    """{original name: parameter or persistent buffer} this rank holds (DTensors where sharded)."""
    out: Dict[str, torch.Tensor] = {}
    for name, p in target.named_parameters():
        out.setdefault(name, p.detach())
    for chunk in _chunks(target):
        for name, buf in persistent_buffers(chunk):
            out.setdefault(name, buf)
    return out


def _param_names(target, optimizer) -> Dict[int, str]:
    """id(parameter) -> name, for every parameter of ``optimizer`` (which must all be the target's)."""
    names = {id(p): name for name, p in target.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the module's; "
                    "fix: build the optimizer from pm.parameters() (after auto_parallelize)"
                )
    return names


def _group_hparams(group: dict) -> bytes:
    return pickle.dumps({k: v for k, v in group.items() if k != "params"})


def _fused_views(target, state: Dict[str, Any]) -> Dict[str, Any]:
    """Fused projections sharded by heads (and their optimizer state) go to DCP as the runs of the
    original tensor this rank holds, so the files hold the model's own layout (apply/fused_params.py)."""
    layouts = fused_layouts(_chunks(target))
    for key, value in state.items():
        if key.startswith("model."):
            name = key[len("model.") :]
        elif key.startswith("optim.state."):
            name = key[len("optim.state.") :].rpartition(".")[0]
        else:
            continue
        if name in layouts and isinstance(value, DTensor):
            state[key] = checkpoint_view(value, layouts[name])
    return state


def state_to_save(target, optimizer) -> Dict[str, Any]:
    return _fused_views(target, _state_dict_to_save(target, optimizer))


def _state_dict_to_save(target, optimizer) -> Dict[str, Any]:
    state: Dict[str, Any] = {f"model.{k}": v for k, v in model_tensors(target).items()}
    if optimizer is None:
        return state
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        hparams = _group_hparams(group)
        for p in group["params"]:
            name = names[id(p)]
            state[f"optim.group.{name}"] = hparams
            for key, value in optimizer.state.get(p, {}).items():
                if "." in key:
                    raise CheckpointError(f"optimizer state key {key!r} contains a '.'; it cannot be saved")
                state[f"optim.state.{name}.{key}"] = value
    return state


# -- what is loaded ---------------------------------------------------------------------------


def _check_shape(key: str, tensor: torch.Tensor, md, path: str, layout=None) -> None:
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{path}: {key} is not a tensor in the checkpoint; fix: load a checkpoint of this model")
    shape = tuple(saved_shape(tensor, layout))
    if tuple(md.size) != shape:
        raise CheckpointError(
            f"{path}: {key} has shape {tuple(md.size)} in the checkpoint but {shape} in the model; "
            "fix: load a checkpoint saved from the same model configuration"
        )


def _empty_state_tensor(param: torch.Tensor, md: TensorStorageMetadata, group: dict, layout=None) -> torch.Tensor:
    """A tensor to load an optimizer state entry into: laid out like the parameter (same DTensor
    placements) when it has the parameter's shape, else a plain tensor (e.g. Adam's ``step``)."""
    if tuple(md.size) == tuple(saved_shape(param, layout)):
        return torch.zeros_like(param.detach(), dtype=md.properties.dtype)
    on_device = group.get("capturable") or group.get("fused")
    device = param.device if on_device else torch.device("cpu")
    return torch.zeros(tuple(md.size), dtype=md.properties.dtype, device=device)


def state_to_load(target, optimizer, metadata: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The state dict DCP loads into: the model's own tensors (loaded in place) and fresh tensors
    for the optimizer state found in the checkpoint. Raises CheckpointError on a missing key."""
    return _fused_views(target, _state_dict_to_load(target, optimizer, metadata, path))


def _state_dict_to_load(target, optimizer, metadata: Dict[str, Any], path: str) -> Dict[str, Any]:
    state: Dict[str, Any] = {}
    missing: List[str] = []
    layouts = fused_layouts(_chunks(target))
    for name, tensor in model_tensors(target).items():
        key = f"model.{name}"
        if key not in metadata:
            missing.append(key)
            continue
        _check_shape(key, tensor, metadata[key], path, layouts.get(name))
        state[key] = tensor
    if missing:
        raise CheckpointError(
            f"{path} has no {', '.join(missing[:3])}{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}; "
            "fix: load a checkpoint of this model (keys are the original parameter names)"
        )
    if optimizer is None:
        return state
    if not any(k.startswith("optim.") for k in metadata):
        raise CheckpointError(
            f"{path} holds no optimizer state (it was saved without optimizer=); fix: "
            "load(path) without an optimizer, or save with save(path, optimizer)"
        )
    saved: Dict[str, List[str]] = {}
    for key in metadata:
        if key.startswith("optim.state."):
            name, _, entry = key[len("optim.state.") :].rpartition(".")
            saved.setdefault(name, []).append(entry)
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            if f"optim.group.{name}" in metadata:
                state[f"optim.group.{name}"] = b""  # replaced by the saved object
            current = optimizer.state.get(p, {})
            for entry in saved.get(name, []):
                key, md = f"optim.state.{name}.{entry}", metadata[f"optim.state.{name}.{entry}"]
                old = current.get(entry)
                if (
                    isinstance(old, torch.Tensor)
                    and tuple(saved_shape(old, layouts.get(name))) == tuple(md.size)
                    and old.dtype == md.properties.dtype
                ):
                    state[key] = old
                elif isinstance(md, TensorStorageMetadata):
                    state[key] = _empty_state_tensor(p, md, group, layouts.get(name))
                else:
                    state[key] = None  # a non-tensor entry, replaced by the saved object
    return state


def install_optimizer_state(target, optimizer, state: Dict[str, Any]) -> None:
    per_param: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("optim.state."):
            name, _, entry = key[len("optim.state.") :].rpartition(".")
            per_param.setdefault(name, {})[entry] = value.source if isinstance(value, FusedCheckpointTensor) else value
    names = _param_names(target, optimizer)
    for group in optimizer.param_groups:
        restored = None
        for p in group["params"]:
            name = names[id(p)]
            if name in per_param:
                optimizer.state[p] = per_param[name]
            else:
                optimizer.state.pop(p, None)  # no state was saved for it (never stepped)
            blob = state.get(f"optim.group.{name}")
            if restored is None and blob:
                restored = pickle.loads(blob)
        if restored:
            group.update({k: v for k, v in restored.items() if k != "params"})


# The keys are flat already. Unflattened, DCP also writes the non-tensor values it loads (the
# group hyperparameters) into the very dict passed to dcp.load, where they are picked up.
FLAT = {"flatten_state_dict": False, "flatten_sharded_tensors": False}


def run_dcp(fn, state: Dict[str, Any], **kwargs) -> None:
    """``dcp.save``/``dcp.load`` over the default group, or in this process alone without one."""
    if distributed():
        fn(state, **kwargs)
        return
    with warnings.catch_warnings():  # DCP warns that it runs in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, no_dist=True, **kwargs)


LOW_SPACE_BYTES = 64 << 20


def low_space(root: str) -> str:
    """`` (... disk full?)`` when the checkpoint filesystem is nearly full: PyTorch's writer does not
    always say so (``unexpected pos 704 vs 598``)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    return f" (its filesystem has {free / 2**20:.1f} MiB free: disk full?)" if free < LOW_SPACE_BYTES else ""


def dcp_failures(exc: CheckpointException) -> str:
    """``rank 1: OSError: [Errno 28] No space left on device; ...``: DCP's failures, one line each."""
    return "; ".join(
        f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}" for rank, (e, _) in sorted(exc.failures.items())
    )


# -- what the checkpoint says about itself ----------------------------------------------------


def model_specs(target) -> Dict[str, TensorSpec]:
    """The whole model's tensors: recorded by ``auto_parallelize`` before the split, or the module's."""
    specs = getattr(target, "model_specs", None)
    return specs if specs is not None else tensor_specs(target)


def checkpoint_meta(target, step: int, sequence: int, optimizer, scheduler, data) -> dict:
    plan = getattr(target, "plan", None)
    summary = plan_summary(plan, getattr(target, "num_microbatches", plan.num_microbatches)) if plan else None
    specs = model_specs(target)
    return {
        "format": FORMAT,
        "step": step,
        "sequence": sequence,
        "saved_at": time.time(),
        "world_size": dist.get_world_size() if distributed() else 1,
        "model": {"fingerprint": fingerprint(specs), "tensors": {n: [list(s), d] for n, (s, d) in specs.items()}},
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "scheduler": scheduler is not None,
        "data": data is not None,
        "plan_summary": summary,
        "plan": plan.to_dict() if plan is not None else None,
        "torch": torch.__version__,
    }


def read_meta(directory: str) -> dict:
    meta_path = os.path.join(directory, META_FILE)
    meta = load_json(meta_path, f"{directory} has no {META_FILE}; fix: load another checkpoint")
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(
            f"{meta_path}: format is {fmt!r}, this version reads {FORMAT!r}; fix: load it with the "
            "nest-fx version that wrote it"
        )
    step = meta.get("step")
    if fmt == FORMAT and not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise CheckpointDamaged(f"{meta_path}: step {step!r} is not a non-negative integer; the file is damaged")
    return meta


def check_model(target, meta: dict, source: str) -> None:
    """CheckpointError when the checkpoint holds another model (names or shapes differ)."""
    saved = (meta.get("model") or {}).get("tensors")
    if saved is None:
        return  # a legacy checkpoint: the per-key shape checks below still apply
    saved = {n: (tuple(s), d) for n, (s, d) in saved.items()}
    current = model_specs(target)
    if fingerprint(saved) != fingerprint(current):
        raise CheckpointError(
            f"{source} holds another model ({len(saved)} tensors, this model has {len(current)}; "
            f"{difference(saved, current)}); fix: load a checkpoint of this model, or build the "
            "model with the checkpoint's configuration"
        )


# -- besides the tensors: scheduler, data position, gradient scaler, random generators ----------

_TRAIN_OBJECTS = (("scheduler", "train.scheduler"), ("data", "train.data"), ("scaler", "train.scaler"))


def train_state_to_save(rank: int, scheduler, data, scaler=None) -> Dict[str, bytes]:
    """``train.*`` entries of this rank: its RNG states (and DTensor's RNG tracker), and the
    scheduler, data position and gradient scaler states given."""
    state = {f"train.rng.{rank}": pack(rng_state())}
    tracker = dtensor_rng_state()
    if tracker is not None:
        state[f"train.dtensor_rng.{rank}"] = pack(tracker)
    for (what, key), obj in zip(_TRAIN_OBJECTS, (scheduler, data, scaler)):
        if obj is not None:
            state[key] = pack(obj.state_dict())
    return state


def train_state_to_load(scheduler, data, scaler, metadata, meta: dict, rank: int, source: str) -> Dict[str, Any]:
    """The ``train.*`` entries to read: the objects asked for (CheckpointError when one was not
    saved) and the RNG states saved by rank ``rank mod`` the saving world size."""
    state: Dict[str, Any] = {}
    for (what, key), obj in zip(_TRAIN_OBJECTS, (scheduler, data, scaler)):
        if obj is None:
            continue
        stateful(obj, what)
        if key not in metadata:
            raise CheckpointError(
                f"{source} holds no {what} state (it was saved without {what}=); fix: load without "
                f"{what}=, or save with save(path, optimizer, {what}=...)"
            )
        state[key] = b""  # replaced by the saved object
    saved_world = int(meta.get("world_size") or 1)
    for prefix in ("train.rng.", "train.dtensor_rng."):
        key = f"{prefix}{rank % saved_world}"
        if key in metadata:
            state[key] = b""
    return state


def restore_train_state(target, state: Dict[str, Any], scheduler, data, scaler) -> None:
    """After DCP filled ``state``: load the objects' states and set the random generators."""
    for (_, key), obj in zip(_TRAIN_OBJECTS, (scheduler, data, scaler)):
        if obj is not None:
            obj.load_state_dict(unpack(state[key]))
    for key, value in state.items():
        if key.startswith("train.rng."):
            set_rng_state(unpack(value))
    for key, value in state.items():
        if key.startswith("train.dtensor_rng."):
            set_dtensor_rng_state(unpack(value), getattr(target, "mesh", None))
