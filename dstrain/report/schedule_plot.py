"""Drawing simulated pipeline schedules the way the Zero Bubble and DualPipe papers do: one row per
rank, one block per action, forwards blue, backwards green, weight-gradient passes orange."""

from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from dstrain.parallel.pipeline_sim import Block, Timeline

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI

import matplotlib.pyplot as plt  # noqa: E402 (pyplot reads the backend when imported)

COLORS = {"F": "#3b75c4", "B": "#2e9e4f", "I": "#5cbf8a", "W": "#f08c2e"}
LABELS = {
    "F": "forward",
    "B": "backward (full)",
    "I": "backward (input grad)",
    "W": "backward (weight grad)",
}
MIN_LABEL_INCHES = 0.14  # narrower blocks go unlabelled rather than overprinted
WIDTH_INCHES = 14.0


def draw_timelines(
    timelines: dict[str, Timeline], path: Path, title: str, unit: str = "cost units"
) -> None:
    """Write a PNG (or any format matplotlib infers from `path`): one subplot per schedule,
    stacked and sharing the time axis, each titled with its bubble fraction."""
    heights = [0.45 * t.pp + 0.9 for t in timelines.values()]
    fig, axes = plt.subplots(
        len(timelines),
        1,
        sharex=True,
        squeeze=False,
        figsize=(WIDTH_INCHES, sum(heights) + 0.8),
        gridspec_kw={"height_ratios": heights},
    )
    span = max(t.makespan for t in timelines.values())
    for ax, (name, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
        _draw_one(ax, name, timeline, span)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    fig.legend(handles=_legend(timelines), loc="upper right", ncols=3, fontsize=8, frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_one(ax: Axes, name: str, timeline: Timeline, span: float) -> None:
    inches_per_unit = 0.85 * WIDTH_INCHES / span
    for rank, blocks in enumerate(timeline.blocks):
        for block in blocks:
            chunk = timeline.stages[rank].index(block.action.stage)
            _draw_block(ax, rank, block, chunk, inches_per_unit)
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.set_ylim(timeline.pp - 0.5, -0.5)  # rank 0 on top, as in the papers
    ax.set_xlim(0, span)
    ax.set_title(
        f"{name}: bubble {timeline.bubble_fraction:.1%}, makespan {timeline.makespan:g}",
        loc="left",
        fontsize=9,
    )


def _draw_block(ax: Axes, rank: int, block: Block, chunk: int, inches_per_unit: float) -> None:
    """Later chunks of a rank (the V's way back, interleaved's next stage) are lighter and
    hatched, so both legs of a V read apart."""
    width = block.end - block.start
    color = _lighter(COLORS[block.action.kind], 0.45 if chunk else 0.0)
    ax.barh(
        rank,
        width,
        left=block.start,
        height=0.8,
        color=color,
        edgecolor="black",
        linewidth=0.4,
        hatch="//" if chunk else None,
    )
    if width * inches_per_unit >= MIN_LABEL_INCHES:
        ax.text(
            block.start + width / 2,
            rank,
            str(block.action.microbatch),
            ha="center",
            va="center",
            fontsize=7,
        )


def _legend(timelines: dict[str, Timeline]) -> list[Patch]:
    kinds = {b.action.kind for t in timelines.values() for rank in t.blocks for b in rank}
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in kinds]
    if any(len(stages) > 1 for t in timelines.values() for stages in t.stages):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="later chunk"))
    return handles


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)
