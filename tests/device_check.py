"""A GPU run's device rules, checked on a CPU-only machine.

NCCL serves only CUDA tensors: a tensor the code builds on the default device (the CPU) or moves
to the host, then hands to a collective, crashes a GPU run and passes on gloo. To see that
failure class here, the run's device is `meta`, a device that is not the CPU and needs no GPU:
the model and the batches live there, torch's fake process group takes the collectives, and
`device_check()` records every collective with the devices of its tensors. Meta tensors hold no
data, so inside the block `.item()` and `.tolist()` answer 1 (True for bools); each such read
(and each copy of a device tensor to the host) is recorded too: on a GPU each is a host sync.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
# Every collective reaches the dispatcher as an op of these namespaces, whoever calls it:
# torch.distributed's (c10d.allreduce_, c10d.send, c10d.recv_, ...), the functional ones
# (_c10d_functional.*: context parallelism's gather, the EP dispatch, DTensor's TP collectives),
# and pipeline p2p. Recorded there, not by wrapping Python functions a caller may have imported.
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


class _Scalars(TorchDispatchMode):
    """`.item()` of a data-less tensor: a plausible constant instead of an error; its copy to
    the host (after a collective, to read the result): ones. Each is a host sync on a GPU, and
    is counted."""

    def __init__(self, recorded: "Recorded") -> None:
        super().__init__()
        self.recorded = recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES and func._opname not in NOT_COLLECTIVES:
            values = (*args, *kwargs.values())
            devices = tuple(t.device.type for value in values for t in _tensors(value))
            self.recorded.calls.append((f"{func.namespace}.{func._opname}", devices))
            return func(*args, **kwargs)
        source = args[0] if args else None
        if func is torch.ops.aten._local_scalar_dense.default and source.is_meta:
            self.recorded.syncs.append("item")
            dtype = source.dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        to_host = func is torch.ops.aten._to_copy.default and source.is_meta
        if to_host and torch.device(kwargs.get("device") or "meta").type == "cpu":
            self.recorded.syncs.append("to host")
            return torch.ones(source.shape, dtype=kwargs.get("dtype") or source.dtype)
        return func(*args, **kwargs)


def _tolist(original, recorded: "Recorded", answer: "Answer | None"):
    @functools.wraps(original)
    def tolist(self: torch.Tensor):
        if not self.is_meta:
            return original(self)
        recorded.syncs.append("tolist")
        given = answer(self) if answer is not None else None
        if given is not None:
            return given
        ones = torch.ones(self.shape, dtype=torch.int64)
        return ones.bool().tolist() if self.dtype == torch.bool else ones.tolist()

    return tolist


@dataclass
class Recorded:
    calls: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)  # device -> host reads (host syncs on a GPU)

    def off_device(self) -> list[tuple[str, tuple[str, ...]]]:
        """The collectives that got a tensor on another device than the run's."""
        return [(op, devs) for op, devs in self.calls if any(d != DEVICE.type for d in devs)]


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


# What a meta tensor's `.tolist()` answers, where ones would not do (split sizes must add up to
# the rows they split); None: ones.
Answer = Callable[[torch.Tensor], list | None]


@contextlib.contextmanager
def device_check(
    world_size: int = 2, rank: int = 0, answer: Answer | None = None
) -> Iterator[Recorded]:
    """Inside: a fake process group of `world_size`, data-less scalars, and a record of every
    collective's tensor devices (as "namespace.op", e.g. "c10d.allreduce_"). Put the model and
    its inputs on `DEVICE`."""
    recorded = Recorded()
    # A fake backend for meta too: pipeline p2p (batch_isend_irecv) asks for the tensors' device.
    dist.init_process_group(
        "cpu:fake,meta:fake", rank=rank, world_size=world_size, store=FakeStore()
    )
    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = _tolist(tolist, recorded, answer)
    try:
        with _Scalars(recorded):
            yield recorded
    finally:
        torch.Tensor.tolist = tolist
        dist.destroy_process_group()
