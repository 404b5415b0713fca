"""The runs of `benchmarks/metrics_overhead.py` on this rank (under torchrun).

argv: OUT_FILE SPEC, SPEC a JSON object {"overrides": [...], "block": B, "rounds": R, "warmup": W}.
One Trainer; after W warm-up steps, R rounds of four blocks of B steps each, in an order that
rotates every round:
- off: no probes (phase and communication timers paused), no metrics;
- off again: the same, a control: its spread around `off` is the noise floor;
- default: probes on, the metrics processor and the sinks (JSONL, TensorBoard) once per block,
  as with metrics.log_interval = B;
- every step: probes on, processor and sinks after every step.
Each block's wall time per step goes to OUT_FILE (rank 0) as {mode: [s/step per block]}, with the
time of each log line (processor + sinks) as "log_line", and an accounting of the per-step probes:
spans opened per step (phases, timed collectives) and the cost of one phase span and of one pass
through the collective wrapper, timed around a no-op.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.config.load import load_config
from dstrain.metrics.probes import NO_PROBES
from dstrain.metrics.processor import Window
from dstrain.parallel.distributed import shutdown
from dstrain.train.progress import TrainProgress
from dstrain.train.trainer import Trainer

MODES = ("off", "off again", "default", "every step")


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    trainer = Trainer(load_config(None, spec["overrides"]).config)
    probes, progress = trainer.probes, TrainProgress(10**6, 0, enabled=False)
    for _ in range(spec["warmup"]):
        trainer._one_step()
    seconds: dict[str, list[float]] = {mode: [] for mode in (*MODES, "log_line")}
    for r in range(spec["rounds"]):
        for mode in MODES[r % 4 :] + MODES[: r % 4]:
            off = mode.startswith("off")
            trainer.probes = NO_PROBES if off else probes
            paused = probes.comm.pause() if off and probes.comm else None
            if paused is not None:
                paused.__enter__()
            seconds[mode].append(_block(trainer, spec["block"], mode, progress, seconds))
            if paused is not None:
                paused.__exit__(None, None, None)
    accounting = _accounting(trainer, probes, spec["block"], progress)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({**seconds, "accounting": accounting}))
    shutdown(0)


def _accounting(trainer: Trainer, probes, steps: int, progress: TrainProgress) -> dict:
    """Spans per step in a default block, and the cost of one span and one wrapper pass."""
    trainer.probes = probes
    counted = [probes.spans] + ([probes.comm.spans] if probes.comm else [])
    counts = [0] * len(counted)
    for i, spans in enumerate(counted):
        spans.stop = _counting(spans.stop, counts, i)
    _block(trainer, steps, "default", progress, {"log_line": []})
    per_step = [n / steps for n in counts]
    phase = _phase_cost(probes)
    wrapped = _wrapper_cost(probes)
    return {
        "phase_spans": per_step[0],
        "comm_spans": sum(per_step[1:]),
        "phase_s": phase,
        "wrapper_s": wrapped,
    }


def _counting(stop, counts: list[int], index: int):
    def counted(*args):
        counts[index] += 1
        return stop(*args)

    return counted


def _phase_cost(probes, n: int = 20000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        with probes.phase("forward"):
            pass
    return (time.perf_counter() - started) / n


def _wrapper_cost(probes, n: int = 20000) -> float:
    """One pass through the blocking-collective wrapper (argument binding, axis lookup, a span),
    around a no-op instead of a collective; minus the bare no-op."""
    from dstrain.metrics import comm_timer

    def collective(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = comm_timer._timed_dist(collective)
    if probes.comm is None:
        return 0.0
    tensor = torch.zeros(1)
    timings = []
    for fn in (wrapped, collective):
        started = time.perf_counter()
        for _ in range(n):
            fn(tensor, group=None)
        timings.append((time.perf_counter() - started) / n)
    probes.comm.spans.take()
    return timings[0] - timings[1]


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
