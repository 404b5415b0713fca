"""The runs of `benchmarks/metrics_overhead.py` on this rank (under torchrun).

argv: OUT_FILE SPEC, SPEC a JSON object {"overrides": [...], "block": B, "rounds": R, "warmup": W}.
One Trainer; after W warm-up steps, R rounds of three blocks of B steps each, in an order that
rotates every round:
- off: no probes (phase and communication timers paused), no metrics;
- default: probes on, the metrics processor and the sinks (JSONL, TensorBoard) once per block,
  as with metrics.log_interval = B;
- every step: probes on, processor and sinks after every step.
Each block's wall time per step goes to OUT_FILE (rank 0) as {mode: [s/step per block]}, and the
time of each log line (processor + sinks) as {"log_line": [s, ...]}.
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from dstrain.config.load import load_config
from dstrain.metrics.probes import NO_PROBES
from dstrain.metrics.processor import Window
from dstrain.parallel.distributed import shutdown
from dstrain.train.progress import TrainProgress
from dstrain.train.trainer import Trainer

MODES = ("off", "default", "every step")


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    trainer = Trainer(load_config(None, spec["overrides"]).config)
    probes, progress = trainer.probes, TrainProgress(10**6, 0, enabled=False)
    for _ in range(spec["warmup"]):
        trainer._one_step()
    seconds: dict[str, list[float]] = {mode: [] for mode in (*MODES, "log_line")}
    for r in range(spec["rounds"]):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            trainer.probes = NO_PROBES if mode == "off" else probes
            paused = probes.comm.pause() if mode == "off" and probes.comm else None
            if paused is not None:
                paused.__enter__()
            seconds[mode].append(_block(trainer, spec["block"], mode, progress, seconds))
            if paused is not None:
                paused.__exit__(None, None, None)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(seconds))
    shutdown(0)


def _block(
    trainer: Trainer, steps: int, mode: str, progress: TrainProgress, seconds: dict
) -> float:
    """Seconds per step of `steps` steps, metrics included (log lines also go to `seconds`)."""
    dist.barrier()
    started = time.perf_counter()
    window = Window()
    for i in range(steps):
        window.start()
        result = trainer._one_step()
        window.stop(result.tokens)
        if mode == "every step" or (mode == "default" and i == steps - 1):
            logged = time.perf_counter()
            trainer._log_metrics(result, window, progress)
            seconds["log_line"].append(time.perf_counter() - logged)
    dist.barrier()
    return (time.perf_counter() - started) / steps


if __name__ == "__main__":
    main()
