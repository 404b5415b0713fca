"""index.html of a report: the summary table, the plots and the config, in one self-contained
page (no external CSS, script or font: cluster nodes and CI have no internet).

Every <img> records whether it loaded in `data-state` ("loaded" or "broken") and, when broken,
shows "plot missing: NAME", so neither a reader nor a browser test mistakes a gap for a plot.
"""

import html
import math
from pathlib import Path
from typing import Any

from dstrain.report.plots import Plot
from dstrain.report.run_data import RunData

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.75em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 2em 0; }
img { max-width: 100%; }
.missing { color: #b00020; font-weight: bold; }
.note { color: #666; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
"""
ON_LOAD = "this.dataset.state='loaded'"
ON_ERROR = "this.dataset.state='broken';this.nextElementSibling.hidden=false"
PERCENT_WORDS = ("fraction", "mfu", "goodput")


def write_index(
    out: Path, runs: list[RunData], labels: list[str], plots: list[Plot], skipped: list[str]
) -> Path:
    title = "dstrain report: " + " vs ".join(labels)
    body = [
        f"<h1>{_esc(title)}</h1>",
        _sources(runs, labels),
        "<h2>Summary</h2>",
        _summary_table(runs, labels),
        *(_figure(plot) for plot in plots),
        _skipped(skipped),
        "<h2>Config</h2>",
        *(_config(run, label) for run, label in zip(runs, labels, strict=True)),
    ]
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def _sources(runs: list[RunData], labels: list[str]) -> str:
    items = []
    for run, label in zip(runs, labels, strict=True):
        note = " (last line cut short by a kill: skipped)" if run.truncated_tail else ""
        items.append(f"<li>{_esc(label)}: <code>{_esc(str(run.path))}</code>{_esc(note)}</li>")
    return '<ul class="note">' + "".join(items) + "</ul>"


def _summary_table(runs: list[RunData], labels: list[str]) -> str:
    """One row per scalar key of any run's summary.json; a column per run."""
    summaries = [run.summary or {} for run in runs]
    keys = list(dict.fromkeys(k for s in summaries for k, v in s.items() if _is_scalar(v)))
    missing = [label for run, label in zip(runs, labels, strict=True) if run.summary is None]
    note = "".join(
        f'<p class="note">{_esc(label)}: no summary.json (the run is still going or did not '
        "finish)</p>"
        for label in missing
    )
    if not keys:
        return note
    head = "".join(f"<th>{_esc(label)}</th>" for label in labels)
    rows = "".join(
        f"<tr><td><code>{_esc(key)}</code></td>"
        + "".join(f"<td>{_esc(format_value(key, s.get(key)))}</td>" for s in summaries)
        + "</tr>"
        for key in keys
    )
    return f"{note}<table><tr><th>summary.json</th>{head}</tr>{rows}</table>"


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def format_value(key: str, value: Any) -> str:
    """Fractions as %, seconds and MB with their unit, big numbers with thousands separators."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    if any(word in key for word in PERCENT_WORDS):
        return f"{value:.1%}"
    if key.endswith("_mb"):
        return f"{value:,.0f} MB"
    if key.endswith("_s") and not key.endswith("per_s"):
        return f"{value:,.1f} s"
    return f"{value:,.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def _figure(plot: Plot) -> str:
    return (
        f'<figure id="{_esc(plot.name)}">\n<h2>{_esc(plot.title)}</h2>\n'
        f'<img src="{_esc(plot.file)}" alt="{_esc(plot.title)}" data-state="loading" '
        f'onload="{ON_LOAD}" onerror="{ON_ERROR}">\n'
        f'<p class="missing" hidden>plot missing: {_esc(plot.file)}</p>\n</figure>'
    )


def _skipped(skipped: list[str]) -> str:
    if not skipped:
        return ""
    return (
        f'<p class="note">Not logged by the run(s), so not drawn: {_esc(", ".join(skipped))}.</p>'
    )


def _config(run: RunData, label: str) -> str:
    if run.config_text is None:
        return f'<p class="note">{_esc(label)}: no config.toml</p>'
    return (
        f"<details><summary>config.toml of {_esc(label)}</summary>"
        f"<pre>{_esc(run.config_text)}</pre></details>"
    )


def _esc(text: str) -> str:
    return html.escape(text, quote=True)
