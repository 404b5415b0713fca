"""What a checkpoint costs the training loop: sync vs async saves vs none, side by side.

One process, the debug flavor (a 23 MB checkpoint with the optimizer state), seq_len 128, global
batch 16: for each mode a fresh run of N steps saving every K steps through the trainer's own
`_one_step` and `save_checkpoint`, then the final wait for any save in flight. Rounds alternate
the modes (median of R per mode), because this machine is noisy. Columns:

- loop: wall time of the N steps, the saves and the final wait; vs none;
- blocked: how long each `save_checkpoint` call held the loop (sync: write + fsync + sha256 +
  publish; async: the CPU staging copy only, the rest runs in background threads);
- step: the median step time, which shows what the background work takes from the steps on a
  machine where the same cores do both.

Usage: python benchmarks/checkpoint_overlap.py [--steps N] [--every K] [--rounds R]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu import cpu_label  # noqa: E402  (benchmarks/cpu.py)

from dstrain.config.load import load_config  # noqa: E402
from dstrain.train.trainer import Trainer  # noqa: E402

MODES = {
    "none": ["checkpoint.enable=false"],
    "sync": ["checkpoint.async_mode=disabled"],
    "async": ["checkpoint.async_mode=async"],
}


def one_run(root: Path, mode: str, index: int, steps: int, every: int) -> dict[str, float]:
    overrides = [
        "data.source=embedded",
        f"run.root={root}",
        f"run.name={mode}-{index}",
        f"train.steps={steps}",
        "train.seq_len=128",
        "train.micro_batch_size=4",
        "train.global_batch_size=16",
        "metrics.tensorboard=false",
        *MODES[mode],
    ]
    trainer = Trainer(load_config(None, overrides).config)
    step_s, blocked_s = [], []
    started = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        trainer._one_step()
        step_s.append(time.perf_counter() - begin)
        if mode != "none" and trainer.step % every == 0:
            begin = time.perf_counter()
            trainer.save_checkpoint()
            blocked_s.append(time.perf_counter() - begin)
    trainer.checkpoints.close()
    return {
        "loop": time.perf_counter() - started,
        "blocked": statistics.median(blocked_s) if blocked_s else 0.0,
        "step": statistics.median(step_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_label()}")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            for mode in MODES:
                runs[mode].append(one_run(Path(tmp), mode, index, args.steps, args.every))

    def median(mode: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[mode])

    base = median("none", "loop")
    print(f"{args.steps} steps, a checkpoint every {args.every}, median of {args.rounds} rounds")
    print("| mode | loop s | vs none | blocked per save ms | median step ms |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        loop = median(mode, "loop")
        print(
            f"| {mode} | {loop:.2f} | {loop / base:.3f}x | {1000 * median(mode, 'blocked'):.0f} "
            f"| {1000 * median(mode, 'step'):.0f} |"
        )


if __name__ == "__main__":
    main()
