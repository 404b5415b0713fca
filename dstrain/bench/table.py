"""The report as text, in nccl-tests' layout (one table per op), and as JSON (the report dict).

Columns and number formats are nccl-tests' (src/common.cu): time in us with 2, 1 or 0 decimals
below 100, below 10000 and above; bandwidths in GB/s with 2 decimals; the footer's "Avg bus
bandwidth" is the mean busbw over the sizes.
"""

from typing import Any

from dstrain.bench.results import BUSBW_CHECK
from dstrain.bench.sizes import human

_HEAD = "#{:>11}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}"
_ROW = "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6.2f}  {:>6.2f}  {:>6}"


def format_time(us: float) -> str:
    """nccl-tests' time column: 7 wide, fewer decimals as the number grows."""
    if us >= 10000:
        return f"{us:7.0f}"
    if us >= 100:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def op_table(op: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"# {op}",
        _HEAD.format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"),
        _HEAD.format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""),
    ]
    for row in rows:
        lines.append(
            _ROW.format(
                row["bytes"],
                row["count"],
                row["type"],
                row["redop"],
                row["root"],
                format_time(row["time_us"]),
                row["algbw"],
                row["busbw"],
                row["wrong"],
            )
        )
    wrong = sum(row["wrong"] for row in rows)
    avg = sum(row["busbw"] for row in rows) / len(rows) if rows else 0.0
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {avg:g}")
    return lines


def render(report: dict[str, Any]) -> str:
    lines = _header(report)
    for op, rows in report["ops"].items():
        lines += ["#", *op_table(op, rows)]
    lines += ["#", *_stragglers(report)]
    if report.get("gemm"):
        lines += ["#", *_gemm(report)]
    lines += ["#", *_verdict(report)]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _header(report: dict[str, Any]) -> list[str]:
    n, world = report["group_size"], report["world_size"]
    if report["axis"]:
        where = (
            f"axis {report['axis']} of {report['layout']}: {len(report['groups'])} group(s) of "
            f"n={n} running at once: {' '.join(str(g) for g in report['groups'])}"
        )
    else:
        where = f"the whole world, n={n}"
    iters = "auto (20, fewer above 4M on CPU)" if report["iters"] is None else report["iters"]
    warmup = "auto (5, fewer above 4M on CPU)" if report["warmup"] is None else report["warmup"]
    lines = [
        f"# dstrain bench comm: {world} ranks, {report['backend']} on {report['device']}, {where}",
        f"# warmup {warmup}, iters {iters}, validation on, time = mean over ranks",
        "#",
        "# Using devices",
    ]
    for r in report["ranks"]:
        lines.append(f"#  Rank {r['rank']:2d} Pid {r['pid']:7d} on {r['host']:>10} {r['device']}")
    return lines


def _stragglers(report: dict[str, Any]) -> list[str]:
    ratio = report["straggler_ratio"]
    head = f"# Stragglers (a rank's own time > {ratio:g}x the median of the ranks):"
    if not report["stragglers"]:
        return [f"{head} none"]
    lines = [head]
    for s in report["stragglers"]:
        lines.append(
            f"#   {s['op']}: rank {s['rank']} ({s['host']}) at {s['sizes']} of {s['of_sizes']} "
            f"sizes, worst {s['worst_ratio']:.2f}x at {human(s['worst_bytes'])}"
        )
    return lines


def _gemm(report: dict[str, Any]) -> list[str]:
    gemm = report["gemm"]
    peak = gemm["peak_tflops"]
    per_rank = "  ".join(
        f"rank {r}: {t:.3f}" + (f" ({100 * t / peak:.0f}% of peak)" if peak else "")
        for r, t in enumerate(gemm["tflops"])
    )
    lines = [
        f"# GEMM {gemm['dtype']} {gemm['size']}^3, all ranks at once (TFLOP/s): {per_rank}",
    ]
    for s in gemm["slow"]:
        lines.append(
            f"#   slow device: rank {s['rank']} ({s['host']}) {s['tflops']:.3f} TFLOP/s, "
            f"{s['ratio']:.2f}x the median"
        )
    return lines


def _verdict(report: dict[str, Any]) -> list[str]:
    if report["min_busbw"] is None and report["passed"]:
        return ["# Result: OK (all results correct; no --min-busbw given)"]
    if report["passed"]:
        return [f"# Result: PASS ({BUSBW_CHECK} >= {report['min_busbw']:g} GB/s)"]
    lines = ["# Result: FAIL"]
    lines += [f"#   {failure}" for failure in report["failures"]]
    lines.append(f"#   fix: {report['fix']}")
    return lines
