"""FP8 against bf16 on the same run: the debug model's loss curve, DeepSeek-V3's 0.25 % bound.

Four runs of the debug flavor, same seed (so the same initial weights and the same batches),
on a corpus of Python standard-library sources: bf16; fp8 (train.precision = fp8: E4M3 GEMMs
with 1x128 / 128x128 scales, emulated on a CPU); the fp8 path with bf16 in place of E4M3 (the
same tiles, scales, 128-chunked fp32 accumulation and backward, only the rounding format
changed: what the machinery costs apart from E4M3's 3 mantissa bits); and bf16 with another
seed, whose distance from the first bf16 run is the run-to-run noise.

Each curve is smoothed by a moving average over `--window` steps. Printed, after the first 10 %
of steps (the warm-up, where the curves fall fastest): the mean and the largest relative gap
|fp8 - bf16| / bf16 of the smoothed curves, and the same for the other seed; and the final
smoothed losses. `--png` draws the curves and the relative gap.

`--locate` adds two runs with E4M3 on one side of every GEMM only (forward, or dgrad and wgrad)
and bf16 rounding on the other, to say which side costs the loss.

`--seeds 42 43 44` runs the bf16 / fp8 pair once per seed and compares the seed-averaged
curves as well as each pair. On a model this small one run's curve wanders by about 1 % from
the batch order alone (the "another seed" control), and an fp8 / bf16 pair from the same seed
drifts apart by a fraction of that from any difference in rounding (the bf16-rounding control
drifts as far). Averaging pairs over seeds keeps what fp8 does to the loss every time and
averages out where in the run the drift happens to peak. The controls run for the first seed
only; `--no-controls` skips them.

Usage: python benchmarks/fp8_convergence.py [--steps 300] [--window 20] [--png out.png]
           [--set k=v ...] [--locate] [--seeds S ...] [--no-controls]
"""

import argparse
import contextlib
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.config.load import load_config  # noqa: E402
from dstrain.model import fp8 as fp8_kernels  # noqa: E402
from dstrain.train.trainer import Trainer  # noqa: E402

CORPUS_BYTES = 3_000_000


def write_corpus(path: Path) -> None:
    """The first CORPUS_BYTES of the standard library's modules, in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for source in sorted(stdlib.glob("*.py")):
        text = source.read_text(errors="replace")
        parts.append(text)
        size += len(text)
        if size >= CORPUS_BYTES:
            break
    path.write_text("".join(parts))


def run(root: Path, name: str, settings: list[str]) -> tuple[list[float], float]:
    config = load_config(None, [*settings, f"run.name={name}"]).config
    start = time.perf_counter()
    Trainer(config).train()
    seconds = time.perf_counter() - start
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r["loss/main"] for r in map(json.loads, lines) if "loss/main" in r], seconds


def smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def mean_curve(curves: list[list[float]]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*curves, strict=True)]


def gaps(a: list[float], b: list[float], skip: int) -> list[float]:
    return [abs(x - y) / y for x, y in zip(a[skip:], b[skip:], strict=True)]


def plot(path: Path, curves: dict[str, list[float]], rel: dict[str, list[float]], skip: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for label, values in curves.items():
        top.plot(range(1, len(values) + 1), values, label=label, linewidth=1.2)
    top.set_ylabel("training loss (smoothed)")
    top.legend()
    top.set_title("debug model, FP8 (DeepSeek-V3 blockwise recipe) vs bf16")
    for label, values in rel.items():
        bottom.plot(range(skip + 1, skip + len(values) + 1), [100 * v for v in values], label=label)
    bottom.axhline(0.25, color="red", linestyle="--", linewidth=1, label="0.25 % (V3 report)")
    bottom.set_ylabel("relative gap to bf16 (%)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@contextlib.contextmanager
def bf16_rounding():
    """The fp8 path with its E4M3 cast replaced by a bf16 one (`fp8._cast`, private: a
    diagnostic only). The operands keep their 1x128 / 128x128 scales, so they are bf16 numbers
    times a scale; the GEMMs, chunking and autograd are unchanged."""
    original = fp8_kernels._cast
    fp8_kernels._cast = _bf16
    try:
        yield
    finally:
        fp8_kernels._cast = original


@contextlib.contextmanager
def e4m3_only_in(direction: str):
    """E4M3 in one direction of every FP8 GEMM, bf16 rounding in the other ("forward": the
    backward's dgrad and wgrad operands round to bf16; "backward": the forward's do). Same
    tiles, scales and chunking: it says which side of the recipe costs the loss."""
    original_cast, original_backward = fp8_kernels._cast, fp8_kernels.Fp8Matmul.backward
    outside, inside = (original_cast, _bf16) if direction == "forward" else (_bf16, original_cast)

    def backward(ctx, grad_y):
        fp8_kernels._cast = inside
        try:
            return original_backward(ctx, grad_y)
        finally:
            fp8_kernels._cast = outside

    fp8_kernels._cast = outside
    fp8_kernels.Fp8Matmul.backward = staticmethod(backward)
    try:
        yield
    finally:
        fp8_kernels._cast, fp8_kernels.Fp8Matmul.backward = original_cast, original_backward


def _bf16(x_scaled: torch.Tensor) -> torch.Tensor:
    return x_scaled.to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument(
        "--locate",
        action="store_true",
        help="also run E4M3 in the forward only and in the backward only",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[42],
        help="one bf16 / fp8 pair per seed; several compare the seed-averaged curves too",
    )
    parser.add_argument(
        "--no-controls",
        action="store_true",
        help="skip the bf16-rounding and another-seed control runs",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root / "corpus.txt")
        common = [
            f"data.source={root / 'corpus.txt'}",
            f"data.cache_dir={root / 'cache'}",
            f"run.root={root / 'runs'}",
            f"train.steps={args.steps}",
            "train.seq_len=128",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "lr.warmup_steps=30",
            "metrics.log_interval=1",
            "metrics.tensorboard=false",
            "checkpoint.enable=false",
            *args.overrides,
        ]
        pairs, seconds = [], [0.0, 0.0]
        for seed in args.seeds:
            seeded = [*common, f"train.seed={seed}"]
            bf16, bf16_s = run(root, f"bf16_{seed}", [*seeded, "train.precision=bf16"])
            fp8, fp8_s = run(root, f"fp8_{seed}", [*seeded, "train.precision=fp8"])
            pairs.append((seed, bf16, fp8))
            seconds = [seconds[0] + bf16_s, seconds[1] + fp8_s]
        first = [*common, f"train.seed={args.seeds[0]}"]
        controls = {}
        if not args.no_controls:
            with bf16_rounding():
                controls["fp8 path, bf16 rounding"], _ = run(
                    root, "fp8_tiles_bf16", [*first, "train.precision=fp8"]
                )
            other = max(args.seeds) + 1000
            controls[f"bf16, seed {other}"], _ = run(
                root, "bf16_other_seed", [*common, "train.precision=bf16", f"train.seed={other}"]
            )
        for direction in ("forward", "backward") if args.locate else ():
            with e4m3_only_in(direction):
                controls[f"E4M3 in the {direction} only"], _ = run(
                    root, f"fp8_{direction}", [*first, "train.precision=fp8"]
                )
    skip = args.steps // 10
    seed0, bf16, _ = pairs[0]
    bf16_mean = mean_curve([b for _, b, _ in pairs])
    fp8_mean = mean_curve([f for _, _, f in pairs])
    print(f"CPU: {cpu_label()}; {args.steps} steps, moving average over {args.window}")
    print("| runs | mean rel. gap | largest rel. gap | final smoothed loss |")
    print("|---|---|---|---|")
    rows = [(f"fp8 vs bf16, seed {s}", f, b) for s, b, f in pairs]
    rows += [(f"{name} vs bf16, seed {seed0}", v, bf16) for name, v in controls.items()]
    averaged = len(pairs) > 1
    if averaged:
        rows.append((f"fp8 vs bf16, mean of {len(pairs)} seeds", fp8_mean, bf16_mean))
    curves, rel = {}, {}
    for label, values, reference in rows:
        ours, theirs = smooth(values, args.window), smooth(reference, args.window)
        gap = gaps(ours, theirs, skip)
        print(
            f"| {label} | {100 * sum(gap) / len(gap):.3f} % | {100 * max(gap):.3f} % | "
            f"{ours[-1]:.4f} vs {theirs[-1]:.4f} |"
        )
        rel[label] = gap
    suffix = " (seed mean)" if averaged else ""
    curves[f"bf16{suffix}"] = smooth(bf16_mean, args.window)
    curves[f"fp8{suffix}"] = smooth(fp8_mean, args.window)
    if not averaged:
        curves.update({name: smooth(v, args.window) for name, v in controls.items()})
    print(
        f"time: bf16 {seconds[0]:.0f} s, fp8 {seconds[1]:.0f} s "
        f"(fp8 / bf16 = {seconds[1] / seconds[0]:.2f}x)"
    )
    if args.png:
        plot(args.png, curves, rel, skip)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
