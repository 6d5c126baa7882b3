"""What an exact resume needs besides weights and optimizer state: the data position, the
learning-rate scheduler and the random number generators.

A checkpoint saves, next to the tensors (:mod:`nest_fx.apply.checkpoint`):

* ``data``: any object with ``state_dict()`` / ``load_state_dict()``: :class:`EpochBatches`
  below, torchdata's ``StatefulDataLoader``, or the user's own sampler;
* ``scheduler``: a ``torch.optim.lr_scheduler`` scheduler (or anything with the same two methods);
* ``scaler``: a gradient scaler (``torch.amp.GradScaler``: its scale and growth tracker);
* the random number generators of every rank (:func:`rng_state`): torch's CPU generator, the
  CUDA generators, Python's ``random`` and NumPy's global generator; and DTensor's RNG tracker
  (:func:`dtensor_rng_state`): in PyTorch 2.13 it keeps no generator of its own but advances the
  device generator's Philox offset by each random op's global size, so that TP ranks draw
  disjoint parts of one dropout mask; what is saved is that generator state and the tracker's
  switch, and on restore the tracker is created *without* its first-use broadcast of rank 0's
  state, which would otherwise overwrite every other rank's restored offset.

So a run interrupted mid-epoch continues with the same batches, learning rates and random
draws as if it had not stopped, under any plan. The states are pickled: a checkpoint is trusted
data, and its files are checked against the manifest's sha256 before anything is unpickled.
"""

from __future__ import annotations

import pickle
import random
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch
import torch.distributed.tensor._random as dtensor_random

from nest_fx.common.errors import NestFxError


class DataStateError(NestFxError, ValueError):
    """A data or scheduler state that cannot be saved or restored."""


def pack(obj: Any) -> bytes:
    """Bytes of a state (pickled)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes) -> Any:
    """A state from :func:`pack`'s bytes (only from a verified checkpoint)."""
    return pickle.loads(blob)  # noqa: S301 - the checkpoint's files were verified against its manifest


def rng_state() -> Dict[str, Any]:
    """This process's random number generator states."""
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s result (the CUDA part only where CUDA is in use)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def dtensor_rng_state() -> Optional[Dict[str, Any]]:
    """DTensor's RNG tracker on this rank (None when no random op on a DTensor created one:
    always on CPU, where DTensor draws from the CPU generator :func:`rng_state` saves)."""
    tracker = dtensor_random._rng_tracker
    if tracker is None:
        return None
    state: Dict[str, Any] = {"enabled": bool(tracker.distribute_region_enabled), "device": str(tracker._device)}
    if isinstance(tracker, dtensor_random.OffsetBasedRNGTracker):
        state["device_state"] = tracker._get_device_state().cpu()
    return state


def set_dtensor_rng_state(state: Optional[Dict[str, Any]], mesh) -> None:
    """Restore :func:`dtensor_rng_state`'s result; ``mesh`` (the module's DeviceMesh) creates the
    tracker when this process has none yet, without synchronising it from rank 0."""
    if state is None:
        return
    tracker = dtensor_random._rng_tracker
    if (
        tracker is None
        and mesh is not None
        and "device_state" in state
        and torch.device(state["device"]).type == mesh.device_type
    ):
        tracker = dtensor_random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
        dtensor_random._rng_tracker = tracker
    if tracker is None:
        return
    tracker.distribute_region_enabled = state["enabled"]
    if "device_state" in state and isinstance(tracker, dtensor_random.OffsetBasedRNGTracker):
        tracker._set_device_state(state["device_state"])


def stateful(obj: Any, what: str) -> None:
    """NestFxError unless ``obj`` has ``state_dict`` and ``load_state_dict`` (checked before a save
    or load starts)."""
    if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
        raise DataStateError(
            f"{what}= needs an object with state_dict() and load_state_dict(), got "
            f"{type(obj).__name__}; fix: pass e.g. nest_fx.apply.EpochBatches, torchdata's "
            "StatefulDataLoader, a torch LR scheduler or torch.amp.GradScaler"
        )


class EpochBatches:
    """Global batches of sample indices, shuffled anew every epoch, whose position can be saved.

    ``next(batches)`` is a ``LongTensor`` of ``batch_size`` indices into a dataset of
    ``num_samples`` samples; epoch ``e`` is a permutation drawn from ``(seed, e)`` and cut into
    ``num_samples // batch_size`` batches (the rest is dropped: every step has the full global
    batch). Iteration never ends; ``epoch`` and ``batch`` say where it is. ``state_dict()`` /
    ``load_state_dict()`` save and restore the position, so a resumed run gets the very batches
    the interrupted one would have had. The batches do not depend on the number of ranks: every
    rank draws the same global batch and ``train_step`` takes its data-parallel share.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if not (isinstance(num_samples, int) and isinstance(batch_size, int) and 0 < batch_size <= num_samples):
            raise DataStateError(f"EpochBatches: need 0 < batch_size ({batch_size}) <= num_samples ({num_samples})")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.epoch = 0
        self.batch = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.num_samples // self.batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.batch >= len(self):
            self.epoch, self.batch = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        start = self.batch * self.batch_size
        self.batch += 1
        return self._order[start : start + self.batch_size]

    def state_dict(self) -> Dict[str, int]:
        """The position: the next batch is batch ``batch`` of epoch ``epoch``."""
        return {
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "batch": self.batch,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position; DataStateError when the dataset or batch size changed."""
        for key in ("num_samples", "batch_size", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise DataStateError(
                    f"EpochBatches: the checkpoint's data position is for {key}={state.get(key)!r}, "
                    f"this run has {getattr(self, key)!r}; fix: resume with the same dataset, global "
                    "batch and seed"
                )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._order = self._permutation(self.epoch)
