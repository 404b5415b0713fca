"""`dstrain plan --calibrate RUN_DIR...`: fit the planner's efficiency and bandwidth constants to
measured runs, and set measured against predicted.

From each run directory: the resolved config (model, layout), summary.json (world size, device)
and the log lines of metrics.jsonl after the first (which holds the warm-up), medians of:
the forward, backward and optimizer phases less the communication exposed inside them (the
work the compute model predicts), time/step_s, the exposed seconds per mesh axis
(comm/<axis>/exposed_fraction x step), and memory/model_states_mb.

The device: a GPU the hardware table knows by its driver name, or, on a CPU, one built from the
run: its peak is the run's own (throughput/tflops_per_device over throughput/mfu: the measured
matmul peak MFU uses), its memory bandwidth and loopback "link" nominal values that the fitted
efficiencies scale (200 GB/s: the caches a small model's weights live in; 5 GB/s).

Fitted (coordinate descent on a log scale, least squares of log(predicted / measured)): the
compute constants (matmul, attention and memory-streaming efficiencies, per-layer overhead)
against that work, then the intra-node bandwidth efficiency, latency, overlap (the share of
compute that really hides communication) and a factor per kind of collective against the
exposed communication. Model states are
not fitted: they are counted, and must agree as they are.
"""

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dstrain.config.flavors import resolve_model_args
from dstrain.config.load import load_config
from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.hardware import GPUSpec, gpu_from_device_name
from dstrain.planner.comm import CommConstants
from dstrain.planner.compute import ComputeConstants
from dstrain.planner.estimate import Constants, estimate
from dstrain.planner.layout import Cluster, Layout, layout_from_config
from dstrain.planner.memory import GiB, resting_model_states

CPU_MEMORY_TBPS = 0.2  # nominal: cache bandwidth (small models live in cache); fitted share of it
CPU_LOOPBACK_GBPS = 5.0  # nominal gloo over loopback; bw_efficiency_intra scales it
# What a fitted constant may become: the scales on the kernel tables' efficiencies (which the
# planner caps at the whole peak) and the physical shares stay in range.
BOUNDS = {
    "gemm_scale": (0.02, 2.0),
    "attention_scale": (0.01, 3.0),
    "memory_efficiency": (0.02, 1.0),
    "layer_overhead_s": (1e-6, 0.05),
    "bw_efficiency_intra": (0.005, 1.0),
    "alpha_intra_s": (1e-7, 1e-2),
    "overlap": (0.0, 1.0),
    "all_reduce_factor": (0.1, 10.0),
    "gather_factor": (0.1, 10.0),
    "all_to_all_factor": (0.1, 10.0),
    "p2p_factor": (0.1, 10.0),
}
AXES = {"dp": ("dp",), "tp": ("tp",), "ep": ("ep",), "pp": ("pp",), "cp": ("cp",)}
COMPUTE_FIT = ("gemm_scale", "attention_scale", "memory_efficiency", "layer_overhead_s")
COMM_FIT = (
    "bw_efficiency_intra",
    "alpha_intra_s",
    "overlap",
    "all_reduce_factor",
    "gather_factor",
    "all_to_all_factor",
    "p2p_factor",
)
STEPS = (0.0, 0.25, 0.5, 0.8, 1.25, 2.0, 4.0)  # 0: overlap can vanish (bounds keep the rest)


@dataclass(frozen=True)
class Measured:
    work_s: float  # forward, backward and optimizer phases, less the communication inside them
    step_s: float
    exposed_s: dict[str, float]
    model_states_bytes: float


@dataclass(frozen=True)
class Run:
    path: Path
    args: ModelArgs
    layout: Layout
    cluster: Cluster
    measured: Measured


def run_summary(path: Path) -> dict:
    """A run's summary.json, which must name its world size."""
    summary = _json(path / "summary.json")
    if "world_size" not in summary:
        raise UserError(
            f"{path}/summary.json has no world_size (a run from before dstrain 0.1's planner)",
            "train the run again to calibrate with it",
        )
    return summary


def read_run(path: Path, summary: dict, series: Mapping[str, Any]) -> Run:
    """`series`: the run's metrics per key, each with `.steps` and `.values` (the report's
    reader, `report.run_data.load_run`, gives them; the planner sits below it)."""
    config = load_config(path / "config.toml").config
    world = int(summary["world_size"])
    lines = _after_warmup(path, series)
    layout = layout_from_config(config, world)
    cluster = _cluster(summary, config, lines, world)
    return Run(path, resolve_model_args(config.model), layout, cluster, _measured(lines))


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}", "pass a finished run directory") from None


def _after_warmup(path: Path, series: Mapping[str, Any]) -> dict[str, list[float]]:
    """Each key's values after the first log line (which holds the warm-up)."""
    steps = sorted({step for s in series.values() for step in s.steps})
    if len(steps) < 2:
        raise UserError(
            f"{path}/metrics.jsonl has {len(steps)} log line(s); calibration skips the first "
            "(warm-up)",
            "train at least 2 log intervals (metrics.log_interval x 2 steps)",
        )
    first = steps[0]
    return {
        key: [v for step, v in zip(s.steps, s.values, strict=True) if step > first]
        for key, s in series.items()
    }


def _median(lines: dict[str, list[float]], key: str, default: float = 0.0) -> float:
    values = lines.get(key)
    return statistics.median(values) if values else default


def _measured(lines: dict[str, list[float]]) -> Measured:
    step = _median(lines, "time/step_s")
    exposed = {
        axis: sum(_median(lines, f"comm/{a}/exposed_fraction") for a in names) * step
        for axis, names in AXES.items()
    }
    phases = sum(_median(lines, f"time/{p}_s") for p in ("forward", "backward", "optimizer"))
    return Measured(
        work_s=max(phases - sum(exposed.values()), 0.1 * phases),
        step_s=step,
        exposed_s=exposed,
        model_states_bytes=_median(lines, "memory/model_states_mb") * 2**20,
    )


def _cluster(summary: dict, config, lines: dict[str, list[float]], world: int) -> Cluster:
    device = str(summary.get("device", "cpu"))
    gpu = gpu_from_device_name(device) if device != "cpu" else None
    if gpu is not None:
        per_node = min(world, config.cluster.gpus_per_node)
        return Cluster(gpu, world, per_node, config.cluster.inter_node_gbps or 50.0)
    mfu = _median(lines, "throughput/mfu")
    if mfu <= 0:
        raise UserError("the run logged no MFU, so its device's peak is unknown", "")
    peak = _median(lines, "throughput/tflops_per_device") / mfu
    return Cluster(cpu_device(peak, 1e3), world, world, CPU_LOOPBACK_GBPS)


def cpu_device(peak_tflops: float, memory_gb: float) -> GPUSpec:
    """A run's own CPU as the planner's device: its measured fp32 peak for every format it
    runs, gloo over loopback between ranks."""
    return GPUSpec(
        "cpu",
        peak_tflops,
        peak_tflops,
        None,
        peak_tflops,
        None,
        memory_gb,
        CPU_MEMORY_TBPS,
        CPU_LOOPBACK_GBPS,
        "loopback",
        "cpu",
    )


# ---- fitting ---------------------------------------------------------------------------------


def fit(runs: list[Run], start: Constants | None = None) -> Constants:
    consts = start or Constants()
    compute = _descend(consts.compute, COMPUTE_FIT, lambda c: _compute_error(runs, consts, c))
    consts = Constants(compute, consts.comm)
    if any(any(v > 0 for v in run.measured.exposed_s.values()) for run in runs):
        comm = _descend(consts.comm, COMM_FIT, lambda c: _comm_error(runs, consts, c))
        consts = Constants(compute, comm)
    return consts


def _descend(value, names: tuple[str, ...], error) -> object:
    """Multiplicative coordinate descent: each constant tries x0.25 .. x4 in turn while any
    move lowers the error, then finer steps (x0.8, x1.25) until none does."""
    best, best_error = value, error(value)
    for _ in range(12):
        improved = False
        for name in names:
            low, high = BOUNDS[name]
            for step in STEPS:
                moved = min(max(getattr(best, name) * step, low), high)
                trial = replace(best, **{name: moved})
                trial_error = error(trial)
                if trial_error < best_error * 0.999:
                    best, best_error, improved = trial, trial_error, True
        if not improved:
            break
    return best


def _compute_error(runs: list[Run], consts: Constants, compute: ComputeConstants) -> float:
    total = 0.0
    for run in runs:
        e = estimate(run.args, run.layout, run.cluster, Constants(compute, consts.comm))
        total += _log_error(e.compute_s + e.optimizer_s, run.measured.work_s)
    return total


def _comm_error(runs: list[Run], consts: Constants, comm: CommConstants) -> float:
    total = 0.0
    for run in runs:
        e = estimate(run.args, run.layout, run.cluster, Constants(consts.compute, comm))
        for axis, measured in run.measured.exposed_s.items():
            predicted = getattr(e.comm, axis).exposed_seconds + (
                e.comm.edp.exposed_seconds if axis == "dp" else 0.0
            )
            if measured > 0 or predicted > 0:
                total += _log_error(predicted + 1e-3, measured + 1e-3)
    return total


def _log_error(predicted: float, measured: float) -> float:
    if predicted <= 0 or measured <= 0:
        return 0.0
    return math.log(predicted / measured) ** 2


# ---- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    run: str
    layout: str
    states_measured_gib: float
    states_predicted_gib: float
    step_measured_s: float
    step_default_s: float
    step_calibrated_s: float
    comm_measured_s: float
    comm_calibrated_s: float

    @property
    def states_error(self) -> float:
        return self.states_predicted_gib / self.states_measured_gib - 1

    @property
    def step_error(self) -> float:
        return self.step_calibrated_s / self.step_measured_s - 1

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**data, "states_error": self.states_error, "step_error": self.step_error}


def compare(runs: list[Run], consts: Constants) -> list[Row]:
    rows = []
    for run in runs:
        before = estimate(run.args, run.layout, run.cluster)
        after = estimate(run.args, run.layout, run.cluster, consts)
        rows.append(
            Row(
                run=run.path.name,
                layout=run.layout.describe(),
                states_measured_gib=run.measured.model_states_bytes / GiB,
                states_predicted_gib=resting_model_states(run.args, run.layout) / GiB,
                step_measured_s=run.measured.step_s,
                step_default_s=before.step_time_s,
                step_calibrated_s=after.step_time_s,
                comm_measured_s=sum(run.measured.exposed_s.values()),
                comm_calibrated_s=after.comm.exposed_seconds if after.comm else 0.0,
            )
        )
    return rows
