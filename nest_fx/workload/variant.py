"""A workload variant: what a layer's cost depends on besides the layer (the plan settings of the
same names, ``nest_fx.plan.settings``), the key of every per-variant cost cache."""

from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
    """What a layer's cost depends on besides the layer: the plan settings of the same names
    (``nest_fx.plan.settings``). A tuple (hashable, cheap as a cache key)."""

    tp: int = 1
    ep: int = 1
    microbatch_size: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    loss_parallel: bool = False

    @classmethod
    def of(cls, *values, **names) -> "Variant":
        """A Variant from a Variant, from its values in field order, or by name; the short names
        ``mbs``, ``sp``, ``lp`` of earlier versions are accepted for ``microbatch_size``,
        ``sequence_parallel`` and ``loss_parallel``."""
        if len(values) == 1 and not names and type(values[0]) is cls:
            return values[0]
        for short, name in _SHORT_NAMES.items():
            if short in names:
                names[name] = names.pop(short)
        return cls(*values, **names)


_SHORT_NAMES = {"mbs": "microbatch_size", "sp": "sequence_parallel", "lp": "loss_parallel"}


def sized_variant(values: tuple, names: dict) -> Variant:
    """:meth:`Workload.variant_problem`'s arguments (a Variant, or tp, ep, sequence_parallel, cp,
    loss_parallel: no microbatch size, which every variant has) as a Variant."""
    if len(values) == 1 and not names and type(values[0]) is Variant:
        return values[0]
    fields = ("tp", "ep", "sequence_parallel", "cp", "loss_parallel")
    return Variant.of(**dict(zip(fields, values)), **names)
