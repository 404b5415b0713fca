"""The runs of `benchmarks/bench_comm_overhead.py` on this rank (under torchrun).

argv: OUT_FILE SPEC, SPEC a JSON object {"rounds": R, "big_rounds": B, "sizes": "1K:64M",
"factor": F}. For each op (all_reduce, send_recv) and size, R rounds (B for sizes of 16M and
more) of three blocks in an order that rotates every round:
- harness: `dstrain.bench.timing.measure` on the call prepared by `dstrain.bench.ops.prepare`,
  exactly what `bench comm` times;
- bare: the same number of warm-up calls, a barrier, then a perf_counter around a plain loop of
  `dist.all_reduce(t)` (or one isend/irecv batch and its waits) on tensors of the same size;
- bare again: the same bare loop once more, a control: its spread around `bare` is the noise.
Rank 0 writes {"op/bytes/calls": {mode: [s per call per round]}, "accounting": {...}} to
OUT_FILE, the accounting being the harness's own cost per call, timed around a no-op collective
(no noise from the network): its `call` wrapper minus the bare call.
"""

import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.bench.ops import layout, prepare
from dstrain.bench.sizes import parse_sizes
from dstrain.bench.timing import CPU_BYTES_PER_SIZE, ITERS, WARMUP, iterations, measure
from dstrain.parallel.distributed import shutdown

CPU = torch.device("cpu")
MODES = ("harness", "bare", "bare again")


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    seconds: dict = {}
    for op in ("all_reduce", "send_recv"):
        for size in parse_sizes(spec["sizes"], spec["factor"]):
            lay = layout(op, size, dist.get_world_size(), 4)
            warmup = iterations(None, WARMUP, lay.bytes, "cpu", CPU_BYTES_PER_SIZE // 4)
            iters = iterations(None, ITERS, lay.bytes, "cpu", CPU_BYTES_PER_SIZE)
            call = prepare(op, lay, None, CPU, "float").call
            rounds = spec["rounds"] if lay.bytes < 16 * 1024**2 else spec["big_rounds"]
            runs: dict[str, list[float]] = {mode: [] for mode in MODES}
            for r in range(rounds):
                for mode in MODES[r % 3 :] + MODES[: r % 3]:
                    if mode == "harness":
                        runs[mode].append(measure(call, warmup=warmup, iters=iters, device=CPU))
                    else:
                        runs[mode].append(_bare_loop(op, lay.count, warmup, iters))
            seconds[f"{op}/{lay.bytes}/{iters}"] = runs
    seconds["accounting"] = _accounting()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(seconds))
    shutdown(0)


def _bare_loop(op: str, count: int, warmup: int, iters: int) -> float:
    """Seconds per call of the plain torch.distributed loop, written out as a user would."""
    send, recv = torch.zeros(count), torch.zeros(count)
    rank, n = dist.get_rank(), dist.get_world_size()
    pair = [
        dist.P2POp(dist.isend, send, (rank + 1) % n),
        dist.P2POp(dist.irecv, recv, (rank - 1) % n),
    ]
    if op == "all_reduce":
        for _ in range(warmup):
            dist.all_reduce(send)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(send)
        return (time.perf_counter() - started) / iters
    for _ in range(warmup):
        for work in dist.batch_isend_irecv(pair):
            work.wait()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        for work in dist.batch_isend_irecv(pair):
            work.wait()
    return (time.perf_counter() - started) / iters


def _accounting(n: int = 200_000) -> dict[str, float]:
    """The harness's per-call cost beyond the collective itself: its all_reduce `call` is a
    functools.partial of the collective, timed here around a no-op of the same signature."""

    def collective(tensor, op=None, group=None, async_op=False):
        return None

    tensor = torch.zeros(1)
    wrapped = partial(collective, tensor, group=None)
    timings = []
    for fn in (wrapped, lambda: collective(tensor)):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        timings.append((time.perf_counter() - started) / n)
    started = time.perf_counter()
    for _ in range(n):
        collective(tensor)
    inline = (time.perf_counter() - started) / n
    return {"partial_s": timings[0], "inline_s": inline}


if __name__ == "__main__":
    main()
