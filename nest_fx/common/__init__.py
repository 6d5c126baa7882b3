"""What every step of the pipeline shares: the error base class, reading user files, input limits."""

from nest_fx.common.errors import NestFxError

__all__ = ["NestFxError"]
