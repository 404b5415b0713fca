"""The communication timer on 2 gloo ranks: rank 1 arrives late by LATE seconds at each kind of
collective, so rank 0 must measure about LATE blocked seconds on that collective's axis, and rank
1 about none."""

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.parallel import DistributedDataParallel

from dstrain.metrics.comm_timer import CommTimer
from tests.distributed.harness import worker_main

LATE = 0.3


def late() -> None:
    if dist.get_rank() == 1:
        time.sleep(LATE)


class LateInBackward(torch.autograd.Function):
    """Identity; rank 1's backward through it sleeps (between two layers' gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        late()
        return grad


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.second(LateInBackward.apply(self.first(x)))


def measure(out_dir):
    pair = dist.new_group([0, 1])  # stands for a tensor-parallel group
    axes = {dist.group.WORLD.group_name: "world", pair.group_name: "tp"}
    timer = CommTimer(torch.device("cpu"), axes)
    timer.start()
    result = {}
    x = torch.ones(1000)

    def case(name, body):
        timer.take()
        body()
        exposed, moved = timer.take()
        result[name] = {"exposed": exposed, "bytes": moved}

    def blocking():
        late()
        dist.all_reduce(x)

    def asynchronous():  # rank 0 blocks in wait(), not in the call
        late()
        work = dist.all_reduce(x, async_op=True)
        work.wait()

    def paused():
        with timer.pause():
            late()
            dist.all_reduce(x)

    def functional():
        y = funcol.all_reduce(x if dist.get_rank() == 0 else _late_tensor(x), "sum", pair)
        (y + 1).sum()  # first use waits

    def ddp_backward():
        torch.manual_seed(0)
        model = DistributedDataParallel(TwoLayers(), bucket_cap_mb=1000)
        timer.watch_ddp(model)
        model(torch.ones(4, 8)).sum().backward()
        timer.backward_done()

    def ddp_no_sync():
        torch.manual_seed(0)
        model = DistributedDataParallel(TwoLayers())
        timer.watch_ddp(model)
        with model.no_sync():
            out = model(torch.ones(4, 8))
        out.sum().backward()  # no all-reduce: nothing is exposed, whoever is late
        timer.backward_done()

    for name, body in [
        ("blocking", blocking),
        ("async", asynchronous),
        ("paused", paused),
        ("functional", functional),
        ("ddp", ddp_backward),
        ("ddp_no_sync", ddp_no_sync),
    ]:
        case(name, body)
        dist.barrier()
    return result


def _late_tensor(x):
    late()
    return x


if __name__ == "__main__":
    worker_main(measure)
