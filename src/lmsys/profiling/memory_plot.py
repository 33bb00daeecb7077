"""The memory timeline as a PNG (matplotlib, no display): allocated bytes over allocator events, the
phases shaded and labelled, the peak marked."""

from __future__ import annotations

from pathlib import Path

from lmsys.core.parsing import MiB, format_bytes
from lmsys.profiling.memory_analysis import PHASE_LABELS, Timeline
from lmsys.profiling.memory_capture import END, INIT
from lmsys.profiling.phases import BWD_STEP, FWD_STEP, OPTIM_STEP

_PHASE_COLORS = {INIT: "#dddddd", FWD_STEP: "#9ecae1", BWD_STEP: "#fdae6b", OPTIM_STEP: "#a1d99b", END: "#eeeeee"}


def render_png(timeline: Timeline, path: Path, *, title: str) -> Path:
    """Allocated memory over allocator events, phases shaded and labelled, the peak marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    values = timeline.values
    scale, unit = (2**30, "GiB") if max(values) >= 2**30 else (MiB, "MiB")
    ys = [v / scale for v in values]
    fig = Figure(figsize=(11, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    # State k (after k events) is drawn on [k, k+1); the event that leads to state k belongs to the
    # phase holding event k-1, so a phase whose events are p..q-1 covers x from p+0.5 to q+0.5.
    seen = set()
    for p in timeline.phases:
        left = p.start + 0.5 if p.start > 0 else 0
        ax.axvspan(left, p.end - 0.5, color=_PHASE_COLORS.get(p.name, "#eeeeee"), alpha=0.55, lw=0)
        if p.start > 0:
            ax.axvline(left, color="#555555", lw=0.6, ls="--")
        seen.add(p.name)
    ax.step(range(len(ys)), ys, where="post", color="#08306b", lw=1.2)
    peak_i = timeline.peak_index
    ax.plot([peak_i], [ys[peak_i]], "o", color="#cb181d", ms=7, zorder=5)
    at = timeline.phase_at(peak_i)
    where_txt = f" ({at.label}, step {at.step})" if at and at.name != INIT else (f" ({at.label})" if at else "")
    right_half = peak_i > 0.6 * len(ys)
    ax.annotate(f"peak {format_bytes(values[peak_i])}{where_txt}", (peak_i, ys[peak_i]),
                xytext=(-8 if right_half else 8, -14), textcoords="offset points", color="#cb181d", fontsize=9,
                ha="right" if right_half else "left")
    ax.set_xlim(0, max(len(ys) - 0.5, 1))
    ax.set_ylim(0, max(ys) * 1.12 if max(ys) > 0 else 1)
    ax.set_xlabel("allocator events (allocations and frees, in order)")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title(title + (" — OOM" if timeline.oom else ""), fontsize=11)
    handles = [Patch(color=_PHASE_COLORS[n], alpha=0.55, label=PHASE_LABELS[n])
               for n in (INIT, FWD_STEP, BWD_STEP, OPTIM_STEP) if n in seen]
    if handles:
        ax.legend(handles=handles, loc="upper left", fontsize=8, ncol=len(handles), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    from lmsys.core.files import save_figure

    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, what="--out-dir")  # whole or not at all
    return path
