"""``ClusterError``: a malformed cluster or topology description, or an impossible query on one."""

from __future__ import annotations

from nest_fx.common.errors import NestFxError


class ClusterError(NestFxError, ValueError):
    """A malformed cluster description; the message names the field path and what is expected."""
