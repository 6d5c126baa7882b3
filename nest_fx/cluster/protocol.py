"""``ClusterModel``: what the cost model, the solver and the reports read of a cluster.

Three kinds of cluster implement it:

* :class:`~nest_fx.cluster.spec.Cluster`: identical devices on a hierarchy of network levels,
  costed by the hierarchical ring algorithms (``hierarchical_collectives``);
* :class:`~nest_fx.cluster.ordered.OrderedCluster`: a Cluster seen by a plan whose ranks run
  on other devices (a device order), the same formulas on the mapped rank sets;
* :class:`~nest_fx.cluster.topology.GraphCluster`: a graph of devices, switches and links,
  costed on its routes (``topology.algorithms``), with a hierarchy hint for ``span``.

Callers never ask which kind they hold: ``collective_time`` and ``p2p_time`` cost the
network (``collective_coefficients`` / ``p2p_coefficients`` give the affine form where there
is one, so a group is resolved once for all sizes), ``span`` / ``levels_spanned`` /
``level_index_of_group`` place a rank set on the
levels, and ``cost_key`` keys every memo of collective times (one key scheme, a string that
differs whenever the figures or the device order differ).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

if TYPE_CHECKING:  # types only: spec imports nothing from here
    from nest_fx.cluster.spec import DeviceSpec, LevelSpan, NetworkLevel


@runtime_checkable
class ClusterModel(Protocol):
    """A cluster as the cost model sees it (ranks are plan ranks; see the module docstring)."""

    name: str
    device: "DeviceSpec"
    num_devices: int
    levels: List["NetworkLevel"]

    @property
    def cost_key(self) -> str:
        """A string naming the network's figures and device order (the collective memo's key)."""

    def span(self, ranks: Sequence[int]) -> List["LevelSpan"]:
        """Per-level spread of a rank set, innermost level first."""

    def levels_spanned(self, ranks: Sequence[int]) -> List[Tuple["NetworkLevel", int]]:
        """``(level, fan-out)`` of a rank set for the levels it spans."""

    def level_index_of_group(self, ranks: Sequence[int]) -> int:
        """Index of the innermost level one of whose groups holds every rank of the set."""

    def collective_time(self, kind: str, ranks: Sequence[int], nbytes: float) -> float:
        """Seconds of collective ``kind`` over ``ranks`` on an ``nbytes`` buffer."""

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds of a send of ``nbytes`` from ``src`` to ``dst``."""

    def collective_coefficients(self, kind: str, ranks: Sequence[int]) -> Optional[Tuple[float, float]]:
        """(alpha, beta) when collective ``kind`` over ``ranks`` costs ``alpha + beta * S`` at
        every size S > 0 (hierarchical clusters), else None (ask :meth:`collective_time`)."""

    def p2p_coefficients(self, src: int, dst: int) -> Optional[Tuple[float, float]]:
        """(alpha, beta) of a send when it is affine in the size, else None."""
