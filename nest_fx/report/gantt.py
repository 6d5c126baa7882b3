"""Draw pipeline schedule events as a Gantt chart (PNG). Needs matplotlib (extra ``plot``)."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from nest_fx.report.plotting import require_pyplot
from nest_fx.report.timeline import Event

FWD_COLORS = ("#4c72b0",)  # one chunk per stage: forward blue, backward orange
BWD_COLORS = ("#dd8452",)
# interleaved: one hue per model chunk (no grey or green: those are the tails); the forward solid,
# the backward a light tint of the same hue, hatched
CHUNK_COLORS = ("#1f77b4", "#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
SYNC_COLOR, OPT_COLOR = "#8c8c8c", "#55a868"


def _tint(color: str, amount: float = 0.55) -> str:
    """``color`` mixed with ``amount`` white."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def _text_color(color: str) -> str:
    """Black on light faces, white on dark ones (relative luminance)."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.55 else "white"


def _face(phase: str, chunk: int, interleaved: bool) -> Tuple[str, str, str]:
    """(face colour, edge and hatch colour, hatch) of a block."""
    if not interleaved:
        return (FWD_COLORS[0], "white", "") if phase == "F" else (BWD_COLORS[0], "white", "")
    hue = CHUNK_COLORS[chunk % len(CHUNK_COLORS)]
    return (hue, "white", "") if phase == "F" else (_tint(hue), hue, "////")


def _time_unit(span: float) -> Tuple[float, str]:
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def draw_gantt(
    events: Sequence[Event],
    path: str,
    *,
    num_stages: int,
    title: str = "",
    tails: Optional[Sequence[Tuple[float, float]]] = None,
    marker: Optional[float] = None,
) -> None:
    """Write a Gantt chart of ``events`` to ``path``: one row per stage (stage 0 on top),
    forward blocks blue, backward orange; interleaved, one hue per model chunk, the forward
    solid and the backward a hatched tint of it, each block labelled with its microbatch.

    ``tails[i]`` = (exposed DP sync, optimizer) seconds drawn after stage i's last block;
    ``marker`` draws a dashed vertical line (e.g. the cost model's pipeline time).
    """
    plt = require_pyplot()
    from matplotlib.patches import Patch

    ends = [max((e.end for e in events if e.stage == i), default=0.0) for i in range(num_stages)]
    horizon = max(ends[i] + (sum(tails[i]) if tails else 0.0) for i in range(num_stages))
    scale, unit = _time_unit(horizon)
    fig, ax = plt.subplots(figsize=(12, max(2.5, 0.35 * num_stages + 1.6)))
    label = len(events) <= 400
    chunks = sorted({e.chunk for e in events})
    interleaved = len(chunks) > 1
    groups = {}
    for e in events:
        groups.setdefault((e.stage,) + _face(e.phase, e.chunk, interleaved), []).append(e)
    for (stage, color, edge, hatch), evs in groups.items():
        ax.broken_barh(
            [(e.start * scale, (e.end - e.start) * scale) for e in evs],
            (stage - 0.4, 0.8),
            facecolors=color,
            edgecolors=edge,
            linewidth=0.3,
            hatch=hatch or None,
        )
        if label:
            for e in evs:
                text = f"{e.chunk}.{e.microbatch}" if len(chunks) > len(CHUNK_COLORS) else str(e.microbatch)
                ax.text(
                    (e.start + e.end) / 2 * scale,
                    stage,
                    text,
                    ha="center",
                    va="center",
                    fontsize=6,
                    color=_text_color(color),
                )
    if tails:
        for i, (sync, opt) in enumerate(tails):
            if sync > 0:
                ax.broken_barh([(ends[i] * scale, sync * scale)], (i - 0.4, 0.8), facecolors=SYNC_COLOR)
            if opt > 0:
                ax.broken_barh([((ends[i] + sync) * scale, opt * scale)], (i - 0.4, 0.8), facecolors=OPT_COLOR)
    if marker is not None:
        ax.axvline(marker * scale, color="black", linestyle="--", linewidth=0.8)
    ax.set_ylim(num_stages - 0.5, -0.5)
    ax.set_yticks(range(num_stages))
    ax.set_yticklabels([f"stage {i}" for i in range(num_stages)], fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=9)
    if interleaved:  # one hue per model chunk; forward solid, backward light and hatched
        handles = [
            Patch(color=CHUNK_COLORS[c % len(CHUNK_COLORS)], label=f"chunk {c}") for c in chunks[: len(CHUNK_COLORS)]
        ]
        handles += [
            Patch(facecolor="#333333", label="forward"),
            Patch(facecolor=_tint("#333333"), edgecolor="#333333", hatch="////", label="backward"),
        ]
    else:
        handles = [Patch(color=FWD_COLORS[0], label="forward"), Patch(color=BWD_COLORS[0], label="backward")]
    if tails:
        handles += [Patch(color=SYNC_COLOR, label="DP sync (exposed)"), Patch(color=OPT_COLOR, label="optimizer")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
