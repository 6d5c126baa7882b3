"""Cross-rank agreement: one small all-gather on the default group before work that every rank
must do the same way.

Each rank contributes a record of named fields (a plan digest, the model fingerprint, the batch,
the optimizer's hyperparameters, a checkpoint step, ...) and the error it hit while preparing,
if any. After the one ``all_gather_object`` every rank takes the same decision: if any rank
failed, all raise that rank's error; if a field differs between ranks, all raise an
:class:`AgreementError` naming the field and which ranks hold which value. Nobody is left
waiting in a collective its peers never enter, and settings that differ between ranks (one
rank with 10x the learning rate, another batch size) fail before training instead of silently
training diverging replicas.

A field is compared among the ranks that send it. Its key may carry a *scope* after
:data:`SCOPE_SEP` (not shown in messages), so that, e.g., a parameter group's learning rate is
compared only between ranks holding the same parameters.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

import torch.distributed as dist

from nest_fx.apply.checks import ApplyError
from nest_fx.common.errors import NestFxError
from nest_fx.common.fileio import BRIEF_CHARS

SCOPE_SEP = "\x1f"


class AgreementError(ApplyError):
    """Ranks were started with different settings; the message names the field and the ranks."""


def distributed() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def gather(obj: Any) -> List[Any]:
    """``obj`` of every rank, in rank order (one ``all_gather_object`` on the default group)."""
    if not distributed() or dist.get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank_list(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2, 5``; one rank -> ``rank 3``."""
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def first_difference(records: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """A message naming the first field (in the first rank's order) whose values differ between
    the ranks that sent it, or None when all agree."""
    keys: Dict[str, None] = {}
    for record in records:
        keys.update(dict.fromkeys(record))
    for key in keys:
        by_value: Dict[str, List[int]] = {}
        for rank, record in enumerate(records):
            if key in record:
                by_value.setdefault(repr(record[key]), []).append(rank)
        if len(by_value) > 1:
            holders = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            values = "; ".join(f"{rank_list(ranks)} {_cut(text)}" for text, ranks in holders)
            return f"{key.split(SCOPE_SEP)[0]}: {values}"
    return None


def _cut(text: str) -> str:
    return text if len(text) <= BRIEF_CHARS else text[: BRIEF_CHARS - 3] + "..."


def agree(
    fields: Mapping[str, Any],
    *,
    what: str,
    error: Optional[BaseException] = None,
    error_cls: Type[Exception] = AgreementError,
    shared: Any = None,
) -> List[Any]:
    """Gather ``fields``, ``error`` and ``shared`` from every rank and decide the same on all of them.

    Raises, on every rank: this rank's own ``error`` if it had one; else ``error_cls`` naming
    the first rank that failed and its error; else :class:`AgreementError` naming the first field
    that differs (``what`` says what was being agreed on). ``shared`` is not compared: returns
    every rank's ``shared``, in rank order.
    """
    message = None if error is None else f"{type(error).__name__}: {' '.join(str(error).split())}"
    records = gather({"fields": dict(fields), "error": message, "shared": shared})
    if error is not None:
        if isinstance(error, NestFxError):
            raise error
        raise error_cls(message) from error
    for rank, record in enumerate(records):
        if record["error"] is not None:
            raise error_cls(f"rank {rank} failed: {record['error']}")
    difference = first_difference([r["fields"] for r in records])
    if difference is not None:
        raise AgreementError(
            f"ranks disagree on {difference} ({what}); fix: start every rank with the same "
            "arguments, environment and code (the same command line)"
        )
    return [r["shared"] for r in records]
