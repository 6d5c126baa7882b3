"""The profile file (``format: nest-fx-profile/1``): measured per-op costs on one device.

Entries are keyed by *op signature* (op kind, input and output shapes, dtypes, literal
arguments), not by model or node name, so a profile taken on one model serves every model
that runs the same ops at the same shapes (e.g. all Llama-shaped blocks of one width). See
docs/profiler.md for the fields.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import read_json

PROFILE_FORMAT = "nest-fx-profile/1"


class ProfileError(NestFxError, ValueError):
    """A malformed profile file; the message names the field and the fix."""


def op_key(attrs: dict) -> str:
    """Signature of one traced op (OpGraph node attributes): what decides its cost."""
    return "|".join(
        (
            str(attrs.get("op", "")),
            str(attrs.get("in_shapes", [])),
            str(attrs.get("out_shapes", [])),
            ",".join(attrs.get("in_dtypes", []) or attrs.get("out_dtypes", []) or []),
            str(attrs.get("consts", "")),
        )
    )


@dataclass
class OpEntry:
    """Measured cost of one op signature, per call (SI units).

    ``fwd_s``/``bwd_s`` are device seconds (the GPU's kernel time; on CPU the wall time);
    ``fwd_host_s``/``bwd_host_s`` the host's dispatch seconds (on CPU equal to the wall time;
    absent in older files, then taken equal to the device seconds)."""

    op: str
    fwd_s: float
    bwd_s: float
    peak_bytes: float
    flops: float = 0.0
    skipped: str = ""  # non-empty: not measured (e.g. "oom"); the analytical model is used
    fwd_host_s: Optional[float] = None
    bwd_host_s: Optional[float] = None

    @property
    def usable(self) -> bool:
        return not self.skipped and math.isfinite(self.fwd_s) and math.isfinite(self.bwd_s)

    @property
    def host(self) -> Tuple[float, float]:
        """(forward, backward) host seconds."""
        f = self.fwd_s if self.fwd_host_s is None or not math.isfinite(self.fwd_host_s) else self.fwd_host_s
        b = self.bwd_s if self.bwd_host_s is None or not math.isfinite(self.bwd_host_s) else self.bwd_host_s
        return f, b


def block_seconds(device: Sequence[Tuple[float, float]], host: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(forward, backward) seconds of a run of ops from their per-op (device, host) seconds.

    Eager PyTorch enqueues kernels from the host while the GPU runs earlier ones, so within a
    block the slower of the two sides sets the pace: ``max(sum of device, sum of host)``, per
    direction. On CPU both sums are the same wall times."""
    fwd = max(sum(d[0] for d in device), sum(h[0] for h in host))
    bwd = max(sum(d[1] for d in device), sum(h[1] for h in host))
    return fwd, bwd


_MEASURED = ("fwd_s", "bwd_s", "fwd_host_s", "bwd_host_s", "peak_bytes", "flops")


def _check_measured(entry: OpEntry, where: str) -> None:
    """ProfileError for a measured entry (``skipped`` empty) whose numbers are not finite and
    non-negative: a NaN is a broken measurement, never a silent "unmeasured" (an op that was not
    measured says so in ``skipped``, and the analytical model covers it)."""
    if entry.skipped:
        return
    for name in _MEASURED:
        value = getattr(entry, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ProfileError(
                f"{where}.{name}: {value} is not a finite non-negative number; a measured entry needs "
                "finite times (re-run `nest-fx profile`, or mark an unmeasured op with "
                "skipped: <reason>)"
            )


@dataclass
class Profile:
    """Per-op measurements of one device and dtype, plus per-block and whole-step checks."""

    device: str  # "cuda" | "cpu"
    device_name: str
    dtype: str
    torch_version: str
    cuda_version: str = ""
    ops: Dict[str, OpEntry] = field(default_factory=dict)
    blocks: List[dict] = field(default_factory=list)  # per (model, block, tp, mbs): sums and checks
    warnings: List[str] = field(default_factory=list)

    def lookup(self, key: str) -> Optional[OpEntry]:
        """The usable entry for an op signature, or None (then the analytical model is used)."""
        entry = self.ops.get(key)
        return entry if entry is not None and entry.usable else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = PROFILE_FORMAT
        d["ops"] = {k: asdict(v) for k, v in sorted(self.ops.items())}
        return d

    def save(self, path: str) -> None:
        """Write the JSON file (to a temporary name first, so a crash never leaves half a file)."""
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1, allow_nan=True)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Profile":
        return cls.from_dict(read_json(path, ProfileError, "profile"), where=path)

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> "Profile":
        """Parse and validate a ``nest-fx-profile/1`` dict."""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}: expected a JSON object written by `nest-fx profile`")
        fmt = data.get("format")
        if fmt != PROFILE_FORMAT:
            raise ProfileError(f"{where}: format is {fmt!r}, expected {PROFILE_FORMAT!r}: re-run `nest-fx profile`")
        for name in ("device", "device_name", "dtype", "torch_version"):
            if not isinstance(data.get(name), str):
                raise ProfileError(f"{where}.{name}: missing or not a string")
        ops_raw = data.get("ops", {})
        if not isinstance(ops_raw, dict):
            raise ProfileError(f"{where}.ops: expected an object {{op signature: entry}}")
        ops = {}
        for key, v in ops_raw.items():
            w = f"{where}.ops[{key!r}]"
            if not isinstance(v, dict):
                raise ProfileError(f"{w}: expected an object with fwd_s, bwd_s, peak_bytes")
            try:
                host = {k: float(v[k]) for k in ("fwd_host_s", "bwd_host_s") if v.get(k) is not None}
                ops[key] = OpEntry(
                    op=str(v.get("op", "")),
                    fwd_s=float(v["fwd_s"]),
                    bwd_s=float(v["bwd_s"]),
                    peak_bytes=float(v.get("peak_bytes", 0.0)),
                    flops=float(v.get("flops", 0.0)),
                    skipped=str(v.get("skipped", "")),
                    **host,
                )
            except KeyError as exc:
                raise ProfileError(f"{w}: missing field {exc.args[0]!r}") from None
            except (TypeError, ValueError):
                raise ProfileError(
                    f"{w}: fwd_s, bwd_s, fwd_host_s, bwd_host_s, peak_bytes and flops must be numbers"
                ) from None
            _check_measured(ops[key], w)
        blocks = data.get("blocks", [])
        if not isinstance(blocks, list):
            raise ProfileError(f"{where}.blocks: expected a list")
        return cls(
            device=data["device"],
            device_name=data["device_name"],
            dtype=data["dtype"],
            torch_version=data["torch_version"],
            cuda_version=str(data.get("cuda_version", "")),
            ops=ops,
            blocks=blocks,
            warnings=[str(w) for w in data.get("warnings", [])],
        )

    def merge(self, other: "Profile") -> None:
        """Add ``other``'s entries (same device and dtype); existing entries win."""
        if (other.device_name, other.dtype) != (self.device_name, self.dtype):
            raise ProfileError(
                f"cannot merge a {other.device_name}/{other.dtype} profile into {self.device_name}/{self.dtype}"
            )
        for k, v in other.ops.items():
            self.ops.setdefault(k, v)
        self.blocks += other.blocks
        self.warnings += other.warnings
