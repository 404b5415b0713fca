"""The six collectives of nccl-tests as torch.distributed calls on one process group.

Sizes, counts and bus bandwidth follow nccl-tests exactly (NVIDIA/nccl-tests doc/PERFORMANCE.md;
src/common.cu `setupArgs`, and `*GetCollByteCount` / `*GetBw` in src/all_reduce.cu,
all_gather.cu, reduce_scatter.cu, alltoall.cu, broadcast.cu, sendrecv.cu):
- a requested size S bytes is count = S // typesize elements; all_gather, reduce_scatter and
  all_to_all round it down to a multiple of n and pass count // n per rank (per peer);
- the "size" column is the larger of the send and receive buffers, so the full n-rank buffer for
  all_gather, reduce_scatter and all_to_all (recvcount x typesize x n for all_gather); the
  "count" column is the count argument of the NCCL call: per rank for all_gather and
  reduce_scatter, per peer for all_to_all, the whole buffer otherwise;
- algbw = size / time (GB = 1e9 bytes); busbw = algbw x factor: 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast and send_recv, where n
  is the size of the group that ran (not the world size).
send_recv is nccl-tests' sendrecv: every rank sends to the next rank of its group and receives
from the previous one (a ring; on a pp axis, consecutive stages).

Correctness (#wrong) is nccl-tests' `-c 1`: after the timed calls, every rank fills its input
with a pattern of its own (`pattern`), runs one more call, and counts the output elements that
differ from the expected result.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}
REDOPS = {"all_reduce": "sum", "reduce_scatter": "sum"}  # the others print "none"
ROOTS = {"broadcast": 0}  # group rank of the root; the others print -1
TORCH_DTYPES = {"float": torch.float32, "bfloat16": torch.bfloat16}
_SPLIT = ("all_gather", "reduce_scatter", "all_to_all")  # count is split over the n ranks


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` on a group of n ranks."""
    return BUS_FACTORS[op](n)


@dataclass(frozen=True)
class Layout:
    """One size of one op: nccl-tests' size and count columns, and the buffers' elements."""

    bytes: int
    count: int
    numel_in: int
    numel_out: int


def layout(op: str, size: int, n: int, typesize: int) -> Layout:
    count = size // typesize
    if op not in _SPLIT:
        return Layout(count * typesize, count, count, count)
    per = count // n
    numel_in, numel_out = {
        "all_gather": (per, per * n),
        "reduce_scatter": (per * n, per),
        "all_to_all": (per * n, per * n),
    }[op]
    return Layout(per * n * typesize, per, numel_in, numel_out)


@dataclass
class Prepared:
    """`call` runs the op once and does nothing else (it is what the timed loop repeats);
    `check` fills the inputs with the rank's pattern, runs once and returns the wrong elements."""

    call: Callable[[], object]
    check: Callable[[], int]


def prepare(
    op: str, lay: Layout, group: dist.ProcessGroup | None, device: torch.device, dtype: str
) -> Prepared:
    """Buffers for `lay` on `device` (zeros: the timed calls' speed does not depend on the data),
    and the call on `group` (None: the whole world)."""
    n, g = dist.get_world_size(group), dist.get_rank(group)
    zeros = partial(torch.zeros, device=device, dtype=TORCH_DTYPES[dtype])
    inp, out = zeros(lay.numel_in), zeros(lay.numel_out)
    return _BUILDERS[op](inp, out, group, n, g, lay.count)


def pattern(rank: int, numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Rank r's input: (r + 1) + (i % 5). Small integers, exact in bf16 for sums over <= 8 ranks."""
    index = torch.arange(offset, offset + numel, device=device)
    return (rank + 1 + index % 5).float()


def _summed(n: int, numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """The sum over ranks 0..n-1 of `pattern`."""
    index = torch.arange(offset, offset + numel, device=device)
    return (n * (n + 1) // 2 + n * (index % 5)).float()


def count_wrong(out: torch.Tensor, expected: torch.Tensor) -> int:
    rtol = 1e-6 if out.dtype == torch.float32 else 1 / 128
    # .item() is a host-device sync; it runs after the timed calls.
    return int((~torch.isclose(out.float(), expected, rtol=rtol, atol=0)).sum().item())


def _all_reduce(inp, out, group, n, g, count) -> Prepared:
    call = partial(dist.all_reduce, inp, group=group)

    def check() -> int:
        inp.copy_(pattern(g, count, inp.device))
        call()
        return count_wrong(inp, _summed(n, count, inp.device))

    return Prepared(call, check)


def _all_gather(inp, out, group, n, g, count) -> Prepared:
    call = partial(dist.all_gather_into_tensor, out, inp, group=group)

    def check() -> int:
        inp.copy_(pattern(g, count, inp.device))
        call()
        expected = torch.cat([pattern(r, count, inp.device) for r in range(n)])
        return count_wrong(out, expected)

    return Prepared(call, check)


def _reduce_scatter(inp, out, group, n, g, count) -> Prepared:
    call = partial(dist.reduce_scatter_tensor, out, inp, group=group)

    def check() -> int:
        inp.copy_(pattern(g, count * n, inp.device))
        call()
        return count_wrong(out, _summed(n, count, inp.device, offset=g * count))

    return Prepared(call, check)


def _all_to_all(inp, out, group, n, g, count) -> Prepared:
    call = partial(dist.all_to_all_single, out, inp, group=group)

    def check() -> int:
        inp.copy_(pattern(g, count * n, inp.device))
        call()
        # Block j of the output is block g of rank j's input.
        expected = torch.cat([pattern(j, count, inp.device, offset=g * count) for j in range(n)])
        return count_wrong(out, expected)

    return Prepared(call, check)


def _broadcast(inp, out, group, n, g, count) -> Prepared:
    call = partial(dist.broadcast, inp, src=_global(group, ROOTS["broadcast"]), group=group)

    def check() -> int:
        inp.copy_(pattern(0, count, inp.device) if g == 0 else torch.full_like(inp, -1.0))
        call()
        return count_wrong(inp, pattern(0, count, inp.device))

    return Prepared(call, check)


def _send_recv(inp, out, group, n, g, count) -> Prepared:
    # One batch of isend + irecv: NCCL needs the pair grouped, or two ranks that both send first
    # deadlock; gloo runs them as two independent requests.
    p2p = [
        dist.P2POp(dist.isend, inp, _global(group, (g + 1) % n), group=group),
        dist.P2POp(dist.irecv, out, _global(group, (g - 1) % n), group=group),
    ]

    def call() -> None:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()

    def check() -> int:
        inp.copy_(pattern(g, count, inp.device))
        out.fill_(-1.0)
        call()
        return count_wrong(out, pattern((g - 1) % n, count, inp.device))

    return Prepared(call, check)


def _global(group: Any, group_rank: int) -> int:
    """The global rank of a group member: `src=`/`peer=` take global ranks on every torch we
    support, where the group-rank keywords (group_src, group_peer) are newer."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


_BUILDERS = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "broadcast": _broadcast,
    "send_recv": _send_recv,
}
