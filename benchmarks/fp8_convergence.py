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

Usage: python benchmarks/fp8_convergence.py [--steps 300] [--window 20] [--png out.png]
           [--set k=v ...] [--locate]
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
        bf16, bf16_s = run(root, "bf16", [*common, "train.precision=bf16"])
        fp8, fp8_s = run(root, "fp8", [*common, "train.precision=fp8"])
        with bf16_rounding():
            tiles, _ = run(root, "fp8_tiles_bf16", [*common, "train.precision=fp8"])
        seed, _ = run(root, "bf16_seed", [*common, "train.precision=bf16", "train.seed=7"])
        located = {}
        for direction in ("forward", "backward") if args.locate else ():
            with e4m3_only_in(direction):
                located[f"E4M3 in the {direction} only"], _ = run(
                    root, f"fp8_{direction}", [*common, "train.precision=fp8"]
                )
    skip = args.steps // 10
    curves = {
        name: smooth(v, args.window)
        for name, v in [
            ("bf16", bf16),
            ("fp8", fp8),
            ("fp8 path, bf16 rounding", tiles),
            ("bf16, seed 7", seed),
            *located.items(),
        ]
    }
    names = ("fp8", "fp8 path, bf16 rounding", "bf16, seed 7", *located)
    rel = {f"{name} vs bf16": gaps(curves[name], curves["bf16"], skip) for name in names}
    print(f"CPU: {cpu_label()}; {args.steps} steps, moving average over {args.window}")
    print("| runs | mean rel. gap | largest rel. gap | final smoothed loss |")
    print("|---|---|---|---|")
    for (label, values), run_name in zip(rel.items(), names, strict=True):
        mean = sum(values) / len(values)
        print(
            f"| {label} | {100 * mean:.3f} % | {100 * max(values):.3f} % | "
            f"{curves[run_name][-1]:.4f} vs {curves['bf16'][-1]:.4f} |"
        )
    print(f"time: bf16 {bf16_s:.0f} s, fp8 {fp8_s:.0f} s (fp8 / bf16 = {fp8_s / bf16_s:.2f}x)")
    if args.png:
        plot(args.png, curves, rel, skip)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
