"""What every rank must decide alike at the end of a step, in one collective and one host sync.

After the backward, three questions have answers that only some ranks can see: did any gradient
overflow (fp16: each rank checks its own shards, layers or experts), was any rank told to stop
(SIGTERM), and what are the global loss and gradient norm (the guard judges them). One tiny
all-reduce (MAX) over the whole world joins the two flags; the loss and norm are already global.
Then one read to the host (`.tolist()`) gives all four to Python, which must know them to decide
whether to step and whether to go on. That read is the step's one unavoidable host sync on the
single-process path.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Verdict:
    loss: float
    grad_norm: float
    finite: bool  # no rank's gradients overflowed
    preempted: bool  # some rank got SIGTERM


def agree(
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    overflow: torch.Tensor | None,
    preempting: bool,
) -> Verdict:
    """`overflow`: this rank's non-finite flag (a 0-dim tensor on the run's device; None when
    no loss scaler checks); `preempting`: this rank was signalled."""
    device = loss.device
    local = torch.zeros(2, dtype=torch.float32, device=device)
    if overflow is not None:
        local[0] = overflow.to(torch.float32)
    if preempting:
        local[1] = 1.0
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # on the run's device: NCCL serves it
    figures = torch.cat([loss.detach().float().reshape(1), grad_norm.float().reshape(1), local])
    value, norm, overflowed, stop = figures.tolist()  # host sync: Python decides from these
    return Verdict(value, norm, finite=overflowed == 0.0, preempted=stop > 0.0)
