"""The base of every error nest-fx raises for a user's mistake.

Each step of the pipeline has its own error class (``ClusterError``, ``WorkloadError``,
``PlanError``, ``ApplyError``, ``CheckpointError``, ...), each a :class:`NestFxError`, so the
command line catches one type and prints its message as one ``error:`` line. The classes also
keep the standard base they had (``ValueError`` for bad values, ``ImportError`` for a missing
extra), so code that catches those still does.
"""

from __future__ import annotations


class NestFxError(Exception):
    """A mistake in what the user gave nest-fx (a name, a file, an option, a plan that does not
    fit); the message names the problem and the fix."""


class ModelError(NestFxError, ValueError):
    """A model name, spec or configuration nest-fx cannot build."""


class MissingDependency(NestFxError, ImportError):
    """An optional extra (``nest-fx[hf]``, ``nest-fx[plot]``) is needed and not installed."""


class UserError(NestFxError):
    """A mistake on the command line itself (a missing or conflicting option, an unwritable
    output); printed like every other :class:`NestFxError`."""
