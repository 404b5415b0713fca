"""The report's figures, one PNG each, drawn only when a run logged their data.

Every line figure is one row of LINE_FIGURES (which metric keys, which axis) drawn by one helper;
with two runs, run B overlays run A dashed, in the same colour per key. The expert-load heatmap
has a panel per run that logged MoE loads.
"""

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import TwoSlopeNorm
from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

from dstrain.report.run_data import RunData

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI

import matplotlib.pyplot as plt  # noqa: E402 (pyplot reads the backend when imported)

# Targets of the configuration guides: above them a layout is worth changing.
COMM_TARGET = 0.15
BUBBLE_TARGET = 0.05
RUN_STYLES = ("-", (0, (6, 3)))  # run A solid, run B dashed
TARGET_STYLE = (0, (2, 2))
DPI = 100
LOG_SPAN = 20.0  # max / min of a figure's values above which a log scale reads better
MAX_LABELLED_CELLS = 256  # larger heatmaps are read by colour alone


@dataclass(frozen=True)
class LineFigure:
    name: str  # the PNG's stem
    title: str
    ylabel: str
    keys: str  # regular expression the metric keys match in full
    percent: bool = False  # values are fractions, shown as %
    log_if_wide: bool = False  # log scale when the values span more than LOG_SPAN
    target: float | None = None  # a guide's target, drawn as a dashed line


LINE_FIGURES = (
    LineFigure(
        "loss",
        "Training loss (and validation, where evaluated)",
        "cross-entropy (nats)",
        r"loss/(main|mtp|max_over_dp)|eval/loss",
    ),
    LineFigure("eval_ppl", "Validation perplexity", "perplexity", r"eval/ppl", log_if_wide=True),
    LineFigure("lr", "Learning rate", "learning rate", r"optim/lr"),
    LineFigure(
        "grad_norm",
        "Gradient norm before clipping",
        "global L2 norm",
        r"optim/grad_norm",
        log_if_wide=True,
    ),
    LineFigure("tokens_per_s", "Throughput", "tokens / s (global)", r"throughput/tokens_per_s"),
    LineFigure(
        "mfu", "Model FLOPs utilisation", "MFU (% of device peak)", r"throughput/mfu", percent=True
    ),
    LineFigure(
        "comm",
        "Exposed communication (ranks blocked in collectives), total and per mesh axis",
        "share of step time",
        r"comm/(\w+/)?exposed_fraction(_max)?",
        percent=True,
        target=COMM_TARGET,
    ),
    LineFigure(
        "bubble",
        "Pipeline bubble: measured and closed form for the measured costs",
        "idle share of pipeline time",
        r"pipeline/bubble_fraction(_theory)?",
        percent=True,
        target=BUBBLE_TARGET,
    ),
    LineFigure("memory", "Memory, max over ranks", "MB", r"memory/\w+_mb", log_if_wide=True),
    LineFigure("time", "Time per step, by phase", "seconds per step", r"time/\w+_s"),
)
HEATMAP = "expert_load"
FIGURE_NAMES = tuple(f.name for f in LINE_FIGURES) + (HEATMAP,)


@dataclass(frozen=True)
class Plot:
    name: str
    title: str

    @property
    def file(self) -> str:
        return f"{self.name}.png"


def draw_report(runs: list[RunData], labels: list[str], out: Path) -> tuple[list[Plot], list[str]]:
    """Write every figure some run has data for into `out`; return the plots written and the
    names of the figures skipped for lack of data (their stale PNGs are removed)."""
    plots, skipped = [], []
    for figure in LINE_FIGURES:
        if draw_lines(figure, runs, labels, out / f"{figure.name}.png"):
            plots.append(Plot(figure.name, figure.title))
        else:
            skipped.append(figure.name)
    if draw_expert_load(runs, labels, out / f"{HEATMAP}.png"):
        plots.append(Plot(HEATMAP, "Expert load per MoE layer"))
    else:
        skipped.append(HEATMAP)
    for name in skipped:
        (out / f"{name}.png").unlink(missing_ok=True)
    return plots, skipped


def draw_lines(figure: LineFigure, runs: list[RunData], labels: list[str], path: Path) -> bool:
    """One line per matching key and run; False (nothing written) when no run has such a key."""
    keys = matching_keys(figure.keys, runs)
    if not keys:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = dict(zip(keys, itertools.cycle(plt.get_cmap("tab10").colors), strict=False))
    for run, label, style in zip(runs, labels, RUN_STYLES, strict=False):
        for key in (k for k in keys if k in run.series):
            series = run.series[key]
            name = key if len(runs) == 1 else f"{key} ({label})"
            marker = "o" if len(series.steps) == 1 else None
            line = {"color": colors[key], "linestyle": style, "marker": marker, "label": name}
            ax.plot(series.steps, series.values, **line)
    if figure.target is not None:
        label = f"target {figure.target:.0%}"
        ax.axhline(figure.target, color="crimson", linestyle=TARGET_STYLE, label=label)
    _style_axes(ax, figure, title=_title(figure.title, labels))
    _save(fig, path)
    return True


def matching_keys(pattern: str, runs: list[RunData]) -> list[str]:
    """The keys any run logged that match `pattern`, totals (fewer `/`) before their parts."""
    keys = {key for run in runs for key in run.series if re.fullmatch(pattern, key)}
    return sorted(keys, key=lambda k: (k.count("/"), k))


def _style_axes(ax: Axes, figure: LineFigure, title: str) -> None:
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(figure.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if figure.percent:
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        ax.set_ylim(bottom=0)
    elif figure.log_if_wide and _span(ax) > LOG_SPAN:
        ax.set_yscale("log")
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.6g}"))
    entries = len(ax.get_legend_handles_labels()[1])
    if entries > 4:  # many lines: a legend beside the plot hides none of them
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=8)


def _span(ax: Axes) -> float:
    """max / min of the drawn values; 0 when some value is not positive (no log scale then)."""
    values = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in ax.lines])
    values = values[np.isfinite(values)]
    return float(values.max() / values.min()) if values.size and values.min() > 0 else 0.0


def _title(title: str, labels: list[str]) -> str:
    return title if len(labels) == 1 else f"{title}\n{labels[0]} (solid) vs {labels[1]} (dashed)"


def relative_load(lines: list[list[float]]) -> np.ndarray:
    """Each expert's tokens, averaged over the logged lines, over the layer's mean: 1.0 is a fair
    share, 0 a dead expert. NaN for a layer that routed no token at all."""
    per_expert = np.asarray(lines, dtype=float).mean(axis=0)
    mean = per_expert.mean()
    return per_expert / mean if mean > 0 else np.full_like(per_expert, np.nan)


def load_matrix(expert_load: dict[str, list[list[float]]]) -> tuple[list[str], np.ndarray]:
    """Rows = MoE layers (in block order), columns = experts, values = relative_load; a layer
    with fewer experts than the widest is padded with NaN."""
    layers = sorted(expert_load, key=_natural_key)
    width = max(len(expert_load[layer][0]) for layer in layers)
    matrix = np.full((len(layers), width), np.nan)
    for row, layer in enumerate(layers):
        values = relative_load(expert_load[layer])
        matrix[row, : len(values)] = values
    return layers, matrix


def _natural_key(name: str) -> list[int | str]:
    """layer2 before layer10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def draw_expert_load(runs: list[RunData], labels: list[str], path: Path) -> bool:
    """A heatmap panel per run with MoE loads, side by side on one colour scale."""
    panels = [(run, label) for run, label in zip(runs, labels, strict=True) if run.expert_load]
    if not panels:
        return False
    matrices = [load_matrix(run.expert_load) for run, _ in panels]
    top = max([2.0, *(float(np.nanmax(m)) for _, m in matrices if not np.isnan(m).all())])
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    width = max(m.shape[1] for _, m in matrices)
    height = max(m.shape[0] for _, m in matrices)
    fig, axes = plt.subplots(
        1,
        len(panels),
        squeeze=False,
        figsize=(min(20, 2.5 + len(panels) * (1.5 + 0.5 * width)), 2.2 + 0.45 * height),
        layout="constrained",
    )
    for ax, (run, label), (layers, matrix) in zip(axes[0], panels, matrices, strict=True):
        image = _draw_heatmap(ax, layers, matrix, norm)
        logged = max(len(lines) for lines in run.expert_load.values())
        ax.set_title(f"{label}: mean of {logged} logged step(s)", fontsize=9)
    fig.colorbar(image, ax=list(axes[0]), label="tokens / layer mean (1 = fair share)")
    fig.suptitle(
        "Expert load: tokens per expert over the layer's mean, averaged over the logged steps",
        fontsize=10,
    )
    _save(fig, path, tight=False)
    return True


def _draw_heatmap(ax: Axes, layers: list[str], matrix: np.ndarray, norm: TwoSlopeNorm):
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="lightgray")  # bad: no such expert here
    image = ax.imshow(matrix, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(layers)), layers, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    if matrix.size <= MAX_LABELLED_CELLS:
        for (row, col), value in np.ndenumerate(matrix):
            if not np.isnan(value):
                color = "white" if abs(norm(value) - 0.5) > 0.3 else "black"  # on a dark cell
                ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=7, color=color)
    return image


def _save(fig: plt.Figure, path: Path, tight: bool = True) -> None:
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
