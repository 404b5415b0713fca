"""One layout of `benchmarks/parallel_layouts.py`, on this rank (under torchrun, or alone).

argv: OUT_DIR SPEC, SPEC a JSON object {"overrides": [...], "warmup": W, "steps": N}. Builds
`Trainer(config)`, runs W warm-up steps and N timed steps through `trainer._one_step()` (a
barrier before and after the timed ones), then one extra micro-step by hand (forward, loss,
backward) to count the model state this rank holds, and writes `rank{r}.json`:

- seconds, tokens: wall time and global target tokens of the timed steps;
- peak_rss_mb: `ru_maxrss`, after everything above (one fresh process per layout, so it is this
  layout's own high-water mark, Python and torch included); rss_after_imports_mb: the same
  right after this file's imports;
- state: bytes of parameters, gradients and optimizer states held at the end of the forward
  ("fwd") and at the end of the backward ("bwd") of that micro-step, and the largest total seen
  while gradients land during that backward ("in_bwd", see BackwardPeak). Counted by storage, each
  storage once: a DTensor counts its local shard, FSDP2 parameters count their sharded data plus
  any all-gathered (unsharded) copy that is alive at that moment, and FSDP2's gradients are views
  of one reduce-scatter buffer per block, counted whole. Optimizer states are those of this
  rank. Gradients are `p.grad` (DDP's are views of its buckets, `gradient_as_bucket_view`;
  ddp_bucket_bytes reports the buckets' sizes when DDP says them);
- params: per parameter name (as registered after the backward), its local and global bytes,
  its gradient's local bytes and placements, and whether it is sharded over `tp` or `ep`;
- per_name (one process only): each parameter's parameter, gradient and optimizer-state bytes.
"""

import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from dstrain.config.load import load_config
from dstrain.parallel.distributed import shutdown
from dstrain.train.loss import TokenCounts, loss_terms
from dstrain.train.step import grad_sync
from dstrain.train.trainer import Trainer

RSS_AFTER_IMPORTS_MB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
WRAPPER_PREFIXES = ("module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def main() -> None:
    out_dir, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    config = load_config(None, spec["overrides"]).config
    trainer = Trainer(config)
    seconds, tokens = timed_steps(trainer, spec["warmup"], spec["steps"])
    snapshots, per_name = measure_micro_step(trainer)
    result = {
        "world_size": trainer.world.world_size,
        "seconds": seconds,
        "tokens": tokens,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_after_imports_mb": RSS_AFTER_IMPORTS_MB,
        "state": snapshots,
        "params": param_layout(trainer.model),
        "per_name": per_name,
        "ddp_bucket_bytes": ddp_bucket_bytes(trainer.model),
    }
    (out_dir / f"rank{trainer.world.rank}.json").write_text(json.dumps(result))
    shutdown(0)


def timed_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[float, int]:
    for _ in range(warmup):
        trainer._one_step()
    _barrier()
    start = time.perf_counter()
    tokens = sum(trainer._one_step().tokens for _ in range(steps))
    # The last rank to finish closes the window: tokens/s is the layout's, not one rank's.
    _barrier()
    return time.perf_counter() - start, tokens


def measure_micro_step(trainer: Trainer) -> tuple[dict, dict]:
    """One micro-batch by hand. After the previous step's `zero_grad(set_to_none=True)` there are
    no gradients at the end of the forward; the optimizer states exist since the first step."""
    model, args = trainer.model, trainer.model_args
    micro_batch = trainer.loader.next_step()[0]
    labels = micro_batch[:, 1:]
    # Local counts: the loss's scale changes no tensor's size.
    counts = TokenCounts.of([labels], args.num_mtp_modules)
    model.train()
    # A first micro-batch of several: ZeRO-1 defers its gradient sync (and keeps the gathered
    # weights) until the last one, so its unsharded gradients show at "bwd".
    with grad_sync(model, last=False, defer=trainer.dp.defer_sync):
        outputs = model(micro_batch[:, :-1])
    after_fwd = held_bytes(model, trainer.optimizer)
    total, _ = loss_terms(outputs, labels, counts, args.mtp_loss_weight)
    sampler = BackwardPeak(model, trainer.optimizer)
    total.backward()
    sampler.remove()
    after_bwd = held_bytes(model, trainer.optimizer)
    per_name = per_name_bytes(model, trainer.optimizer) if trainer.world.world_size == 1 else {}
    return {"fwd": after_fwd, "in_bwd": sampler.peak, "bwd": after_bwd}, per_name


class BackwardPeak:
    """The largest `held_bytes` seen each time a gradient lands during the backward
    (post-accumulate-grad hooks on every leaf: plain, DTensor, FSDP2's sharded parameters (FSDP
    calls their hooks after the reduce-scatter) and its unsharded ones (autograd does)). It
    catches what lives only inside the backward: whole gradients before their reduce-scatter,
    gathered parameters not yet resharded."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.peak = {"params": 0, "grads": 0, "optim": 0}
        leaves = {id(t): t for t in _leaves(model) if t.requires_grad}
        self.handles = [t.register_post_accumulate_grad_hook(self._sample) for t in leaves.values()]

    def _sample(self, _param: torch.Tensor) -> None:
        now = held_bytes(self.model, self.optimizer)
        if sum(now.values()) > sum(self.peak.values()):
            self.peak = now

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _leaves(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    for fsdp_param in _fsdp_params(model):
        yield fsdp_param.sharded_param
        if hasattr(fsdp_param, "_unsharded_param"):
            yield fsdp_param._unsharded_param


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    seen: set[int] = set()
    params = _storage_bytes(_param_tensors(model), seen)
    grads = _storage_bytes(_grad_tensors(model), seen)
    states = _storage_bytes(_state_tensors(optimizer), seen)
    return {"params": params, "grads": grads, "optim": states}


def _param_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()  # FSDP2 registers the unsharded ones while they are gathered
    for fsdp_param in _fsdp_params(model):
        yield fsdp_param.sharded_param
        yield from fsdp_param.all_gather_outputs  # freed (0 bytes) once resharded


def _grad_tensors(model: nn.Module) -> Iterator[torch.Tensor | None]:
    for p in model.parameters():
        yield p.grad
    for fsdp_param in _fsdp_params(model):
        yield fsdp_param.sharded_param.grad
        if hasattr(fsdp_param, "_unsharded_param"):
            yield fsdp_param._unsharded_param.grad


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _fsdp_params(model: nn.Module) -> Iterator:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                yield from group.fsdp_params


def _storage_bytes(tensors: Iterator[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def param_layout(model: nn.Module) -> dict[str, dict]:
    """Per parameter (as registered now: FSDP2's sharded ones after the backward): local and
    global bytes, and whether its placement shards it over the `tp` or the `ep` mesh axis."""
    layout = {}
    for name, p in model.named_parameters():
        sharded_over: set[str] = set()
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            sharded_over = {
                n for n, x in zip(names, p.placements, strict=True) if isinstance(x, Shard)
            }
        grad = p.grad
        layout[_plain_name(name)] = {
            "local": _nbytes(_local(p)),
            "global": _nbytes(p),
            "grad_local": _nbytes(_local(grad)) if grad is not None else 0,
            "grad_placements": str(getattr(grad, "placements", "")),
            "tp": "tp" in sharded_over,
            "ep": "ep" in sharded_over,
        }
    return layout


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def per_name_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[int]]:
    """One process only: [parameter, gradient, optimizer state] bytes per parameter name."""
    state = optimizer.state
    out = {}
    for name, p in model.named_parameters():
        states = [v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        out[_plain_name(name)] = [
            _nbytes(p),
            _nbytes(p.grad) if p.grad is not None else 0,
            sum(_nbytes(v) for v in states),
        ]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def ddp_bucket_bytes(model: nn.Module) -> int | None:
    """DDP's own flat gradient buckets (one copy of the gradients it all-reduces), if known."""
    if not hasattr(model, "_get_ddp_logging_data"):
        return None
    sizes = model._get_ddp_logging_data().get("bucket_sizes")
    if not isinstance(sizes, str) or not sizes:
        return None
    return sum(int(s) for s in sizes.split(","))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
