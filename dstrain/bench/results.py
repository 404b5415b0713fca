"""Turning every rank's measurements into the report (rank 0 only; plain Python, no torch).

Each rank sends one record: its host, its group, per op and size its own seconds per call and
its wrong elements, and its GEMM TFLOP/s. The table's time is the mean over the ranks, as
nccl-tests reports by default (`-a 1`). A rank is a straggler at a size when its own time is more
than `ratio` times the median of all ranks' times; a slow device when its GEMM TFLOP/s are below
the median divided by `ratio`.
"""

import statistics
from collections.abc import Sequence
from typing import Any

BUSBW_CHECK = "busbw at the largest size of each op"
FIX_SLOW = (
    "a collective below --min-busbw: check the links and the NCCL environment with `dstrain "
    "doctor` (NCCL_SOCKET_IFNAME / NCCL_IB_HCA, GPU topology with `nvidia-smi topo -m`), look "
    "at the stragglers above, or lower --min-busbw to what this fabric is rated for"
)
FIX_WRONG = (
    "wrong results are a broken fabric, driver or NCCL build: rerun with NCCL_DEBUG=INFO, run "
    "`dstrain doctor`, and take the named hosts out of the job"
)


def find_stragglers(times: Sequence[float], ratio: float) -> list[int]:
    """The indices whose time is more than `ratio` x the median time."""
    median = statistics.median(times)
    return [i for i, t in enumerate(times) if median > 0 and t > ratio * median]


def op_rows(
    op: str,
    sizes: Sequence[dict[str, int]],
    records: Sequence[dict[str, Any]],
    *,
    dtype: str,
    factor: float,
    redop: str,
    root: int,
    ratio: float,
) -> list[dict[str, Any]]:
    """One row per size: nccl-tests' columns plus the per-rank times and the stragglers."""
    rows = []
    for i, size in enumerate(sizes):
        times = [record["ops"][op][i]["time_s"] for record in records]
        seconds = statistics.fmean(times)
        algbw = size["bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        median = statistics.median(times)
        rows.append(
            {
                **size,
                "type": dtype,
                "redop": redop,
                "root": root,
                "time_us": 1e6 * seconds,
                "algbw": algbw,
                "busbw": algbw * factor,
                "wrong": sum(record["ops"][op][i]["wrong"] for record in records),
                "rank_time_us": [1e6 * t for t in times],
                "stragglers": [
                    _named(records[r], ratio=times[r] / median)
                    for r in find_stragglers(times, ratio)
                ],
            }
        )
    return rows


def gemm_summary(records: Sequence[dict[str, Any]], ratio: float) -> dict[str, Any]:
    tflops = [record["gemm_tflops"] for record in records]
    median = statistics.median(tflops)
    slow = [i for i, t in enumerate(tflops) if t < median / ratio]
    return {
        "tflops": tflops,
        "median_tflops": median,
        "slow": [_named(records[i], tflops=tflops[i], ratio=tflops[i] / median) for i in slow],
    }


def verdict(ops: dict[str, list[dict[str, Any]]], min_busbw: float | None) -> dict[str, Any]:
    """Failed when any result is wrong, or when `min_busbw` is given and an op's busbw at its
    largest size is below it."""
    failures, fixes = [], []
    wrong = {op: sum(row["wrong"] for row in rows) for op, rows in ops.items()}
    for op, count in wrong.items():
        if count:
            failures.append(f"{op}: {count} wrong elements")
    if any(wrong.values()):
        fixes.append(FIX_WRONG)
    if min_busbw is not None:
        for op, rows in ops.items():
            if rows and rows[-1]["busbw"] < min_busbw:
                failures.append(
                    f"{op}: busbw {rows[-1]['busbw']:.2f} GB/s at {rows[-1]['bytes']} B is "
                    f"below --min-busbw {min_busbw:g} GB/s"
                )
        if len(failures) > sum(1 for count in wrong.values() if count):
            fixes.append(FIX_SLOW)
    return {
        "min_busbw": min_busbw,
        "checked": BUSBW_CHECK,
        "passed": not failures,
        "failures": failures,
        "fix": "; ".join(fixes),
    }


def straggler_summary(ops: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per op and rank: at how many sizes the rank was a straggler, and its worst ratio."""
    summary = []
    for op, rows in ops.items():
        by_rank: dict[int, dict[str, Any]] = {}
        for row in rows:
            for s in row["stragglers"]:
                entry = by_rank.setdefault(
                    s["rank"], {"op": op, "rank": s["rank"], "host": s["host"], "sizes": 0}
                )
                entry["sizes"] += 1
                if s["ratio"] > entry.get("worst_ratio", 0):
                    entry.update(worst_ratio=s["ratio"], worst_bytes=row["bytes"])
        summary.extend(entry | {"of_sizes": len(rows)} for entry in by_rank.values())
    return summary


def _named(record: dict[str, Any], **values: float) -> dict[str, Any]:
    return {"rank": record["rank"], "host": record["host"], **values}
