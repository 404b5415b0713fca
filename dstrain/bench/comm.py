"""One `bench comm` run on this rank: the sweep over ops and sizes on this rank's group, the
correctness check, the GEMM check, then one gather of everything to rank 0 (outside every timed
block), which assembles the report.

Groups: without an axis every op runs on the whole world. With an axis the mesh is built from the
config's parallel section (`dstrain.parallel.mesh`, as the trainer builds it) and each rank runs
on its group of that axis; all groups run at once, as in training, and n is the group's size.
"""

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dstrain.bench import results
from dstrain.bench.gemm import gemm_settings, gemm_tflops
from dstrain.bench.ops import REDOPS, ROOTS, TORCH_DTYPES, Layout, bus_factor, layout, prepare
from dstrain.bench.sizes import human
from dstrain.bench.spec import CommSpec
from dstrain.bench.timing import CPU_BYTES_PER_SIZE, ITERS, WARMUP, iterations, measure
from dstrain.parallel.distributed import World
from dstrain.parallel.mesh import build_meshes


def run_comm(spec: CommSpec, world: World) -> dict[str, Any] | None:
    """Run the whole benchmark on this rank; rank 0 returns the report, the others None."""
    group, ranks = _group(spec, world)
    n = len(ranks)
    plan = _plan(spec, n, world.device)
    record: dict[str, Any] = {
        "rank": world.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": _device_name(world.device),
        "group": ranks,
        "ops": {},
    }
    total = sum(len(sizes) for sizes in plan.values())
    with _progress(total, world.is_main and spec.progress) as bar:
        for op, sizes in plan.items():
            record["ops"][op] = []
            for size in sizes:
                bar.now(f"{op} {human(size['bytes'])}")
                record["ops"][op].append(_one_size(op, size, spec, group, world.device))
                bar.advance()
    record["gemm_tflops"] = gemm_tflops(world.device) if spec.gemm else 0.0
    gathered: list[Any] | None = [None] * world.world_size if world.is_main else None
    dist.gather_object(record, gathered, dst=0)
    if gathered is None:
        return None
    return _report(spec, world, plan, gathered, n)


def _group(spec: CommSpec, world: World) -> tuple[dist.ProcessGroup | None, list[int]]:
    """This rank's group (None: the world) and its global ranks."""
    if spec.axis is None:
        return None, list(range(world.world_size))
    assert spec.dims is not None, "an axis needs the layout's dims"
    mesh = build_meshes(spec.dims, world.device.type)[spec.axis]
    return mesh.get_group(), mesh.mesh.flatten().tolist()


def _plan(spec: CommSpec, n: int, device: torch.device) -> dict[str, list[dict[str, int]]]:
    """Per op, the sizes that hold at least one element per rank (nccl-tests skips the others),
    with their iteration counts; identical on every rank."""
    typesize = torch.tensor([], dtype=TORCH_DTYPES[spec.dtype]).element_size()
    plan = {}
    for op in spec.ops:
        sizes = []
        for size in spec.sizes:
            lay = layout(op, size, n, typesize)
            if lay.numel_in and lay.numel_out:
                sizes.append(
                    {
                        **asdict(lay),
                        "warmup": iterations(
                            spec.warmup, WARMUP, lay.bytes, device.type, CPU_BYTES_PER_SIZE // 4
                        ),
                        "iters": iterations(
                            spec.iters, ITERS, lay.bytes, device.type, CPU_BYTES_PER_SIZE
                        ),
                    }
                )
        plan[op] = sizes
    return plan


def _one_size(
    op: str, size: dict[str, int], spec: CommSpec, group: Any, device: torch.device
) -> dict[str, float]:
    """This rank's seconds per call and wrong elements for one op at one size."""
    lay = Layout(size["bytes"], size["count"], size["numel_in"], size["numel_out"])
    prepared = prepare(op, lay, group, device, spec.dtype)
    seconds = measure(prepared.call, warmup=size["warmup"], iters=size["iters"], device=device)
    return {"time_s": seconds, "wrong": prepared.check()}


def _report(spec: CommSpec, world: World, plan: dict, records: list[Any], n: int) -> dict[str, Any]:
    ratio = spec.straggler_ratio
    ops = {
        op: results.op_rows(
            op,
            sizes,
            records,
            dtype=spec.dtype,
            factor=bus_factor(op, n),
            redop=REDOPS.get(op, "none"),
            root=ROOTS.get(op, -1),
            ratio=ratio,
        )
        for op, sizes in plan.items()
    }
    groups = sorted({tuple(record["group"]) for record in records})
    gemm = None
    if spec.gemm:
        gemm = gemm_settings(world.device) | results.gemm_summary(records, ratio)
    report = {
        "world_size": world.world_size,
        "backend": world.backend,
        "device": world.device.type,
        "axis": spec.axis,
        "layout": spec.dims.describe() if spec.dims else None,
        "group_size": n,
        "groups": [list(g) for g in groups],
        "dtype": spec.dtype,
        "warmup": spec.warmup,
        "iters": spec.iters,
        "straggler_ratio": ratio,
        "ranks": [{k: r[k] for k in ("rank", "host", "pid", "device")} for r in records],
        "ops": ops,
        "avg_busbw": {
            op: sum(row["busbw"] for row in rows) / len(rows) for op, rows in ops.items() if rows
        },
        "stragglers": results.straggler_summary(ops),
        "gemm": gemm,
    }
    return report | results.verdict(ops, spec.min_busbw)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class _Bar:
    """A live bar on rank 0's terminal (stderr); nothing elsewhere or when not a terminal."""

    def __init__(self, total: int, enabled: bool) -> None:
        console = Console(stderr=True, highlight=False)
        self.bar = Progress(
            TextColumn("bench comm"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[now]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not (enabled and console.is_terminal),
            transient=True,
        )
        self.task = self.bar.add_task("comm", total=total, now="")

    def now(self, text: str) -> None:
        self.bar.update(self.task, now=text)

    def advance(self) -> None:
        self.bar.advance(self.task)


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[_Bar]:
    bar = _Bar(total, enabled)
    with bar.bar:
        yield bar
