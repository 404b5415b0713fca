"""Published training runs (`dstrain/planner/published/*.yaml`) and what the planner predicts
for each: the validation table `dstrain plan --validate` scores and the test suite checks.

Every entry comes from a primary source (a training report, a paper, an official README's
scaling table, a vendor's performance summary), with its URL, the row it was read from and the
conventions the source counts in. Throughput is compared in tokens/s per GPU, which has no
convention: a source that states TFLOP/s per GPU (or MFU) is turned into tokens/s by its own
FLOP formula (`FLOP_CONVENTIONS`), so a source that counts recomputation or the full attention
square is not compared against dstrain's model FLOPs.
"""

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dstrain.config.hf_config import model_args_from_hf
from dstrain.config.model_args import ModelArgs
from dstrain.errors import UserError
from dstrain.hardware import gpu_spec
from dstrain.model.flops import training_flops_per_token
from dstrain.planner.engines import ENGINES
from dstrain.planner.estimate import Constants, Estimate, estimate
from dstrain.planner.kernels import SUSTAINED_SHARE
from dstrain.planner.layout import ATTENTION_KERNELS, Cluster, Layout
from dstrain.planner.legal import trainer_errors
from dstrain.planner.memory import MEMORY_COUNTS, GiB

PUBLISHED = Path(__file__).parent / "published"
BUBBLE_COUNTS = ("mean", "busiest")  # over the pipeline ranks, or the busiest rank's alone
WITHIN = 0.25  # the share of runs within 25 % is the second throughput figure


def _megatron(args: ModelArgs, seq: int, factor: int, head_share: int) -> float:
    """Narayanan et al. 2021 (arXiv 2104.04473) eq. 3 per token: factor x l h^2 (1 + s/6h +
    V/(head_share l h)); factor 96 / share 16 counts the recomputed forward, 72 / 12 does not
    (Korthikanti et al. 2022, arXiv 2205.05198, sec. 6: model FLOPs)."""
    layers, h, v = args.num_layers, args.dim, args.vocab_size
    return factor * layers * h * h * (1 + seq / (6 * h) + v / (head_share * layers * h))


# How a source counts the FLOPs of one training token, by the name its entry gives.
FLOP_CONVENTIONS: dict[str, Callable[[ModelArgs, int, float], float]] = {
    # dstrain's own: 6N + causal attention, no recompute (`model/flops.py`)
    "dstrain": lambda args, seq, params: training_flops_per_token(args, seq),
    # Megatron-LM's formula with the recomputed forward (hardware FLOPs under full recompute)
    "megatron-recompute": lambda args, seq, params: _megatron(args, seq, 96, 16),
    # Megatron-LM's model FLOPs (no recompute counted)
    "megatron": lambda args, seq, params: _megatron(args, seq, 72, 12),
    # 6 x the source's (activated) parameter count, no attention term
    "6N": lambda args, seq, params: 6 * params,
    # PaLM appendix B: 6N + 12 L H Q T, the full (non-causal) attention square
    "6N+attention": lambda args, seq, params: (
        6 * params + 12 * args.num_layers * args.num_heads * _head_dim(args) * seq
    ),
}


def _head_dim(args: ModelArgs) -> int:
    return args.head_dim or args.dim // args.num_heads


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source_key: str
    source: str
    url: str
    args: ModelArgs
    params: float  # the source's own parameter count (activated, for MoE)
    cluster: Cluster
    layout: Layout
    measured: dict[str, float]
    convention: str  # FLOP_CONVENTIONS key for measured TFLOP/s or MFU
    kind: str  # "dense" or "moe"
    memory_counts: str = "device"  # how the source read its peak (memory.MEMORY_COUNTS)
    bubble_counts: str = "mean"  # the bubble over all pipeline ranks, or the busiest's

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """Measured throughput per GPU: stated, or from TFLOP/s (or MFU x the dense peak the
        source divides by) through the source's FLOP formula."""
        m = self.measured
        if m.get("tokens_per_s_per_gpu"):
            return m["tokens_per_s_per_gpu"]
        tflops = m.get("model_tflops_per_gpu")
        if not tflops and m.get("mfu"):
            tflops = m["mfu"] * self.cluster.gpu.peak_tflops(self.layout.precision)
        if not tflops:
            return None
        per_token = FLOP_CONVENTIONS[self.convention](self.args, self.layout.seq_len, self.params)
        return tflops * 1e12 / per_token


@dataclass
class Prediction:
    run: PublishedRun
    estimate: Estimate
    # the layout's own faults (not dstrain's trainer's limits) and "does not fit", with the floor
    impossible: list[str] = field(default_factory=list)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.estimate.tokens_per_s / self.run.layout.world

    @property
    def predicted_bubble(self) -> float:
        """The bubble as the source counts it (`PublishedRun.bubble_counts`)."""
        e = self.estimate
        return e.busiest_bubble if self.run.bubble_counts == "busiest" else e.bubble_fraction

    def cells(self, sep: str = "/") -> tuple[str, str, str]:
        """(throughput, memory, bubble) as printed: published`sep`predicted (error); "" where
        the source measured none."""
        run, errors = self.run, self.errors()
        measured = run.tokens_per_s_per_gpu
        throughput = memory = bubble = ""
        if measured:
            throughput = (
                f"{measured:,.0f}{sep}{self.tokens_per_s_per_gpu:,.0f} "
                f"({errors['throughput']:+.0%})"
            )
        if "memory" in errors:
            predicted = self.estimate.memory.counted(run.memory_counts) / GiB
            memory = (
                f"{run.measured['peak_memory_gib']:.1f}{sep}{predicted:.1f} "
                f"({errors['memory']:+.0%})"
            )
        if "bubble" in errors:
            bubble = f"{run.measured['bubble']:.3f}{sep}{self.predicted_bubble:.3f}"
        return throughput, memory, bubble

    def errors(self) -> dict[str, float]:
        """Relative errors (predicted / measured - 1) of throughput and memory, and the bubble's
        absolute error, for what the source measured."""
        out = {}
        measured = self.run.tokens_per_s_per_gpu
        if measured:
            out["throughput"] = self.tokens_per_s_per_gpu / measured - 1
        if self.run.measured.get("peak_memory_gib"):
            measured_gib = self.run.measured["peak_memory_gib"]
            predicted = self.estimate.memory.counted(self.run.memory_counts)
            out["memory"] = predicted / GiB / measured_gib - 1
        if self.run.measured.get("bubble") is not None:
            out["bubble"] = self.predicted_bubble - self.run.measured["bubble"]
        return out


def load(directory: Path = PUBLISHED) -> list[PublishedRun]:
    """The runs of every *.yaml in `directory`; a bad file or entry is one clear error."""
    paths = sorted(directory.glob("*.yaml")) if directory.is_dir() else []
    if not paths:
        raise UserError(
            f"{directory}: no *.yaml files of published runs",
            "give a folder of YAML lists in the format of dstrain/planner/published/README.md",
        )
    runs = []
    for path in paths:
        try:
            entries = yaml.safe_load(path.read_text(encoding="utf-8")) or []
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise UserError(f"{path}: not readable YAML ({exc})", "fix the file") from None
        if not isinstance(entries, list):
            raise UserError(f"{path}: not a YAML list of runs", "make it a list of entries")
        for entry in entries:
            origin = f"{path.name}: {entry.get('id', '?') if isinstance(entry, dict) else entry}"
            try:
                runs.append(_run(entry, origin))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise UserError(
                    f"{origin}: {type(exc).__name__}: {exc}",
                    "every entry needs id, source_key, source, url, model, params_b, gpu, "
                    "num_gpus and layout (dstrain/planner/published/README.md)",
                ) from None
    ids = [r.id for r in runs]
    if len(ids) != len(set(ids)):
        raise UserError(f"duplicate ids in {directory}", "give every entry its own id")
    return runs


def _run(entry: dict[str, Any], origin: str) -> PublishedRun:
    lay = dict(entry["layout"])
    lay.pop("assumed", None)
    schedule = lay.pop("schedule", None) or "1f1b"
    # Most of the table ran on Megatron-LM or a fork of it: an entry names another engine.
    lay.setdefault("engine", "megatron")
    layout = Layout(**{k: v for k, v in lay.items() if v is not None}, schedule=schedule)
    cluster = Cluster(
        gpu_spec(entry["gpu"]),
        entry["num_gpus"],
        entry.get("gpus_per_node") or 8,
        entry.get("inter_node_gbps") or _network(entry["gpu"]),
    )
    if layout.world != cluster.num_gpus:
        raise UserError(
            f"{origin}: dp x tp x pp x cp = {layout.world}, not num_gpus {cluster.num_gpus}",
            "fix the entry's layout",
        )
    memory_counts = entry.get("memory_counts") or "device"
    bubble_counts = entry.get("bubble_counts") or "mean"
    for value, allowed, key in (
        (layout.attention, ATTENTION_KERNELS, "layout.attention"),
        (memory_counts, MEMORY_COUNTS, "memory_counts"),
        (bubble_counts, BUBBLE_COUNTS, "bubble_counts"),
        (layout.engine, tuple(ENGINES), "layout.engine"),
    ):
        if value not in allowed:
            raise UserError(f"{origin}: {key} {value!r}", f"use one of {', '.join(allowed)}")
    args = model_args_from_hf(entry["model"], origin)
    return PublishedRun(
        id=entry["id"],
        source_key=entry["source_key"],
        source=entry["source"],
        url=entry["url"],
        args=args,
        params=float(entry["params_b"]) * 1e9,
        cluster=cluster,
        layout=layout,
        measured={k: v for k, v in (entry.get("measured") or {}).items() if v is not None},
        convention=entry.get("flop_convention") or "dstrain",
        kind="moe" if args.num_routed_experts else "dense",
        memory_counts=memory_counts,
        bubble_counts=bubble_counts,
    )


def _network(gpu: str) -> float:
    """GB/s per GPU where a source does not say: NVIDIA's reference nodes, one NIC per GPU (DGX
    A100: 8 x 200 Gb/s HDR; DGX H100/H200 and H800 clusters: 8 x 400 Gb/s NDR)."""
    return 25.0 if gpu.upper().startswith("A100") else 50.0


def predict(run: PublishedRun, consts: Constants | None = None) -> Prediction:
    result = estimate(run.args, run.layout, run.cluster, consts or Constants())
    refusals = trainer_errors(run.args, run.layout, run.cluster)
    result.illegal = [f.message for f in refusals]
    impossible = [f.message for f in refusals if not f.trainer_limit]
    if result.memory_verdict == "does not fit":
        impossible.append(
            f"does not fit: at least {result.memory.floor / GiB:.1f} GiB > "
            f"{result.hbm_bytes / GiB:.1f} GiB"
        )
    return Prediction(run, result, impossible)


@dataclass
class Score:
    count: dict[str, int]
    throughput_median: float  # median |relative error|
    throughput_within: float  # share of runs within WITHIN
    memory_median: float
    bubble_mean: float  # mean absolute error
    impossible: int  # published runs the planner calls impossible

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def score(predictions: Iterable[Prediction]) -> Score:
    predictions = list(predictions)
    by = {name: [] for name in ("throughput", "memory", "bubble")}
    for p in predictions:
        for name, error in p.errors().items():
            by[name].append(abs(error))
    return Score(
        count={name: len(v) for name, v in by.items()} | {"runs": len(predictions)},
        throughput_median=_median(by["throughput"]),
        throughput_within=(
            sum(e <= WITHIN for e in by["throughput"]) / len(by["throughput"])
            if by["throughput"]
            else math.nan
        ),
        memory_median=_median(by["memory"]),
        bubble_mean=statistics.fmean(by["bubble"]) if by["bubble"] else math.nan,
        impossible=sum(bool(p.impossible) for p in predictions),
    )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# Ranges: how far the planner has been off on published runs like the one asked about.
RESIDUALS = PUBLISHED / "residuals.json"  # written by the validation test (DSTRAIN_UPDATE_GOLDEN)
# The range is the 5th to 95th percentile of the planner's errors on the 30 most similar runs.
# Drawn only from the other sources, it holds 81.6 % of the runs (`leave_one_source_out`): an
# 80 % range out of sample, where the 10th-90th percentile of 12 neighbours held only 68 %.
NEIGHBOURS = 30
COVERAGE = (0.05, 0.95)


@dataclass(frozen=True)
class Features:
    """What makes two runs alike for the planner's error: the model's kind and activated size,
    the GPU count, whether it pipelines, the precision and the GPU generation."""

    kind: str
    params: float
    gpus: int
    pipelined: bool
    precision: str
    gpu: str

    def distance(self, other: "Features") -> float:
        return (
            abs(math.log10(self.params / other.params))
            + 0.1 * abs(math.log2(self.gpus / other.gpus))
            + 0.5 * (self.pipelined != other.pipelined)
            + 0.5 * (self.precision != other.precision)
            + 0.25 * (self.gpu != other.gpu)
            + 1.0 * (self.kind != other.kind)
        )


def features(args: ModelArgs, layout: Layout, cluster: Cluster) -> Features:
    from dstrain.model.flops import param_counts

    return Features(
        kind="moe" if args.num_routed_experts else "dense",
        params=float(param_counts(args).activated),
        gpus=layout.world,
        pipelined=layout.pp > 1,
        precision=layout.precision,
        gpu=cluster.gpu.name,
    )


def residuals(predictions: Iterable[Prediction]) -> list[dict[str, Any]]:
    """log(predicted / measured) throughput per published run, with its features."""
    out = []
    for p in predictions:
        measured = p.run.tokens_per_s_per_gpu
        if not measured:
            continue
        f = features(p.run.args, p.run.layout, p.run.cluster)
        out.append(
            {
                "id": p.run.id,
                "source_key": p.run.source_key,
                **f.__dict__,
                "log_error": math.log(p.tokens_per_s_per_gpu / measured),
            }
        )
    return out


def load_residuals() -> list[dict[str, Any]]:
    import json

    return json.loads(RESIDUALS.read_text(encoding="utf-8")) if RESIDUALS.exists() else []


def throughput_range(
    predicted: float,
    f: Features,
    table: list[dict[str, Any]],
    *,
    leave_out: str | None = None,
) -> tuple[float, float, int] | None:
    """The 80 % range of the measured throughput for a prediction of `predicted`, from the
    errors the planner made on the NEIGHBOURS most similar published runs (none of source
    `leave_out`); None without enough of them."""
    pool = [r for r in table if r["source_key"] != leave_out]
    if len(pool) < NEIGHBOURS:
        return None
    pool.sort(key=lambda r: f.distance(_features_of(r)))
    errors = sorted(r["log_error"] for r in pool[:NEIGHBOURS])
    low, high = (_quantile(errors, q) for q in COVERAGE)
    # measured = predicted / exp(error): the largest over-prediction gives the lower end
    return predicted / math.exp(high), predicted / math.exp(low), NEIGHBOURS


def _features_of(row: dict[str, Any]) -> Features:
    return Features(**{k: row[k] for k in Features.__dataclass_fields__})


def _quantile(sorted_values: list[float], q: float) -> float:
    position = q * (len(sorted_values) - 1)
    below = math.floor(position)
    above = min(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * (position - below)


def leave_one_source_out(predictions: list[Prediction]) -> dict[str, Any]:
    """Each source's runs against ranges drawn only from the other sources: the share of
    measured throughputs inside their 80 % range (what the ranges promise), overall and per
    source, with each source's median error and share within 25 %. The planner's constants
    are not fitted to this table (they come from datasheets and microbenchmarks,
    `planner/compute.py`, `planner/comm.py`), so its point predictions are out of sample for
    every source already; the ranges are what is learnt from the table, and this is their
    held-out check."""
    table = residuals(predictions)
    per_source: dict[str, dict[str, list[float]]] = {}
    for row in table:
        predicted = math.exp(row["log_error"])  # measured is 1 in these units
        found = throughput_range(predicted, _features_of(row), table, leave_out=row["source_key"])
        mine = per_source.setdefault(row["source_key"], {"errors": [], "inside": []})
        mine["errors"].append(abs(math.expm1(row["log_error"])))
        mine["inside"].append(found is not None and found[0] <= 1.0 <= found[1])
    inside = [x for v in per_source.values() for x in v["inside"]]
    return {
        "range_coverage": sum(inside) / len(inside) if inside else math.nan,
        "runs": len(table),
        "by_source": {
            key: {
                "runs": len(v["errors"]),
                "median_error": statistics.median(v["errors"]),
                "within": sum(e <= WITHIN for e in v["errors"]) / len(v["errors"]),
                "range_coverage": sum(v["inside"]) / len(v["inside"]),
            }
            for key, v in sorted(per_source.items())
        },
    }


def attach_range(e: Estimate, args: ModelArgs, cluster: Cluster) -> None:
    """Sets `e.throughput_range` from the shipped residuals (nothing when there are none)."""
    if e.step_time_s and (table := load_residuals()):
        per_gpu = e.tokens_per_s / e.layout.world
        e.throughput_range = throughput_range(per_gpu, features(args, e.layout, cluster), table)


# The in-training share of the kernels' measured speed (`kernels.SUSTAINED_SHARE`): the one
# constant the point predictions learn from this table, fitted here and checked out of source.
SUSTAINED_RANGE = (0.5, 1.0)


def fit_sustained(runs: list[PublishedRun], *, leave_out: str | None = None) -> float:
    """The share that minimises the mean absolute log throughput error over `runs` (those of
    source `leave_out` excluded): a golden-section search, the error being unimodal in it.
    With no run to fit on, the shipped `SUSTAINED_SHARE`."""
    pool = [r for r in runs if r.tokens_per_s_per_gpu and r.source_key != leave_out]
    if not pool:  # nothing to fit on (a table of one source, left out): the shipped share
        return SUSTAINED_SHARE

    def error(share: float) -> float:
        consts = _with_sustained(share)
        return statistics.fmean(
            abs(math.log(predict_throughput(r, consts) / r.tokens_per_s_per_gpu)) for r in pool
        )

    low, high = SUSTAINED_RANGE
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = error(a), error(b)
    for _ in range(18):  # the bracket shrinks to 0.5 x 0.618^18 < 1e-4
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = error(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = error(b)
    return (low + high) / 2


def _with_sustained(share: float) -> Constants:
    return Constants(replace(Constants().compute, sustained=share))


def predict_throughput(run: PublishedRun, consts: Constants) -> float:
    """Predicted tokens/s per GPU of a published run under `consts` (no legality, no range)."""
    result = estimate(run.args, run.layout, run.cluster, consts)
    return result.tokens_per_s / run.layout.world


def leave_one_source_out_fit(runs: list[PublishedRun]) -> dict[str, Any]:
    """Each source predicted with the in-training share fitted on the other sources only: its
    median error and share within 25 %, and the fitted shares' spread. This is the held-out
    check of the one constant the point predictions learn from the table."""
    by_source: dict[str, dict[str, Any]] = {}
    errors: list[float] = []
    for key in sorted({r.source_key for r in runs if r.tokens_per_s_per_gpu}):
        share = fit_sustained(runs, leave_out=key)
        consts = _with_sustained(share)
        mine = [
            abs(predict_throughput(r, consts) / r.tokens_per_s_per_gpu - 1)
            for r in runs
            if r.source_key == key and r.tokens_per_s_per_gpu
        ]
        errors += mine
        by_source[key] = {
            "sustained": share,
            "runs": len(mine),
            "median_error": statistics.median(mine),
            "within": sum(e <= WITHIN for e in mine) / len(mine),
        }
    shares = [v["sustained"] for v in by_source.values()] or [SUSTAINED_SHARE]
    return {
        "median_error": _median(errors),
        "within": sum(e <= WITHIN for e in errors) / len(errors) if errors else math.nan,
        "runs": len(errors),
        "sustained_range": (min(shares), max(shares)),
        "by_source": by_source,
    }
