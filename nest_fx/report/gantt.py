"""Draw pipeline schedule events as a Gantt chart (PNG). Needs matplotlib (extra ``plot``)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from nest_fx.report.plotting import require_pyplot
from nest_fx.report.timeline import Event

FWD_COLORS = ("#4c72b0", "#8fb0de", "#27456f", "#b8cdea")
BWD_COLORS = ("#dd8452", "#f2b58e", "#9c4f22", "#f7d2b9")
SYNC_COLOR, OPT_COLOR = "#8c8c8c", "#55a868"


def _time_unit(span: float) -> Tuple[float, str]:
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def draw_gantt(events: Sequence[Event], path: str, *, num_stages: int, title: str = "",
               tails: Optional[Sequence[Tuple[float, float]]] = None, marker: Optional[float] = None) -> None:
    """Write a Gantt chart of ``events`` to ``path``: one row per stage (stage 0 on top),
    forward blocks blue, backward orange (shades per interleaved chunk).

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
    groups = {}
    for e in events:
        colors = FWD_COLORS if e.phase == "F" else BWD_COLORS
        groups.setdefault((e.stage, colors[e.chunk % len(colors)]), []).append(e)
    for (stage, color), evs in groups.items():
        ax.broken_barh([(e.start * scale, (e.end - e.start) * scale) for e in evs], (stage - 0.4, 0.8),
                       facecolors=color, edgecolors="white", linewidth=0.3)
        if label:
            for e in evs:
                ax.text((e.start + e.end) / 2 * scale, stage, str(e.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
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
    chunks = sorted({e.chunk for e in events})
    if len(chunks) > 1:  # interleaved: one shade per model chunk
        handles = [Patch(color=colors[c % len(colors)], label=f"{name} chunk {c}")
                   for name, colors in (("forward", FWD_COLORS), ("backward", BWD_COLORS)) for c in chunks]
    else:
        handles = [Patch(color=FWD_COLORS[0], label="forward"), Patch(color=BWD_COLORS[0], label="backward")]
    if tails:
        handles += [Patch(color=SYNC_COLOR, label="DP sync (exposed)"), Patch(color=OPT_COLOR, label="optimizer")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
