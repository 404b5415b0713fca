"""One layout of `benchmarks/parallel_layouts.py`, on this rank (under torchrun, or alone).

argv: OUT_DIR SPEC, SPEC a JSON object {"overrides": [...], "warmup": W, "steps": N}. Builds
`Trainer(config)`, runs W warm-up steps and N timed steps through `trainer._one_step()` (a
barrier before and after the timed ones), then one extra micro-step by hand (forward, loss,
backward) to count the model state this rank holds, and writes `rank{r}.json`:

- seconds, tokens: wall time and global target tokens of the timed steps;
- peak_rss_mb: `ru_maxrss`, after everything above (one fresh process per layout, so it is this
  layout's own high-water mark, Python and torch included);
- after_fwd, after_bwd: bytes of parameters, gradients and optimizer states held at the end of
  the forward and at the end of the backward of that micro-step. Counted by storage, each
  storage once: a DTensor counts its local shard, FSDP2 parameters count their sharded data plus
  any all-gathered (unsharded) copy that is alive at that moment, and FSDP2's gradients are views
  of one reduce-scatter buffer per block, counted whole. Optimizer states are those of this
  rank (`ZeroRedundancyOptimizer.optim.state` under ZeRO-1). Gradients are `p.grad` only: DDP's
  reducer also keeps flat gradient buckets of its own, which Python cannot reach (reported
  separately as ddp_bucket_bytes when DDP says their sizes);
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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard

from dstrain.config.load import load_config
from dstrain.parallel.distributed import shutdown
from dstrain.train.loss import TokenCounts, loss_terms
from dstrain.train.trainer import Trainer

WRAPPER_PREFIXES = ("module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def main() -> None:
    out_dir, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    config = load_config(None, spec["overrides"]).config
    trainer = Trainer(config)
    seconds, tokens = timed_steps(trainer, spec["warmup"], spec["steps"])
    after_fwd, after_bwd, per_name = measure_micro_step(trainer)
    result = {
        "world_size": trainer.world.world_size,
        "seconds": seconds,
        "tokens": tokens,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "after_fwd": after_fwd,
        "after_bwd": after_bwd,
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


def measure_micro_step(trainer: Trainer) -> tuple[dict, dict, dict]:
    """One micro-batch by hand. After the previous step's `zero_grad(set_to_none=True)` there are
    no gradients at the end of the forward; the optimizer states exist since the first step."""
    model, args = trainer.model, trainer.model_args
    micro_batch = trainer.loader.next_step()[0]
    labels = micro_batch[:, 1:]
    # Local counts: the loss's scale changes no tensor's size.
    counts = TokenCounts.of([labels], args.num_mtp_modules)
    model.train()
    outputs = model(micro_batch[:, :-1])
    after_fwd = held_bytes(model, trainer.optimizer)
    total, _ = loss_terms(outputs, labels, counts, args.mtp_loss_weight)
    total.backward()
    after_bwd = held_bytes(model, trainer.optimizer)
    per_name = per_name_bytes(model, trainer.optimizer) if trainer.world.world_size == 1 else {}
    return after_fwd, after_bwd, per_name


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
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    for state in inner.state.values():
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
            sharded_over = {n for n, pl in zip(names, p.placements, strict=True) if _shards(pl)}
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


def _shards(placement: object) -> bool:
    return isinstance(placement, Shard)


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
