"""One MoE layer on 2 gloo ranks: what each rank computes, saves and sends (see moe_parallel.py).

argv: OUT_DIR ITERS WARMUP. Writes OUT_DIR/rank<r>.json: per case, the routed rows this rank's
local experts received per micro-batch, the bytes the rank saved for backward in the MoE, the
forward EP all-to-all payload it sends (dispatch and combine of its token copies), and per timed
iteration (forward + backward) its wall seconds and the seconds it sat blocked on the ep axis
(the trainer's communication timer).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dstrain.config.model_args import ModelArgs
from dstrain.config.parallel_dims import ParallelDims
from dstrain.metrics.comm_timer import CommTimer, axis_of_groups
from dstrain.model.moe import MoE
from dstrain.parallel.expert_parallel import apply_ep
from dstrain.parallel.mesh import build_meshes
from dstrain.parallel.moe_tokens import TokenShare

BATCH, SEQ = 4, 256
ARGS = dict(dim=256, moe_inter_dim=256, num_routed_experts=8, num_activated_experts=2)


def main() -> None:
    out, iters, warmup = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp_meshes = build_meshes(_dims(tp=2, dp_shard=1), "cpu")
    dp_meshes = build_meshes(_dims(tp=1, dp_shard=2), "cpu")
    results = {}
    # Part 4: the routed work per rank at tp1 (two ranks, two micro-batches) and tp2 (two ranks,
    # one micro-batch), repeated or split over tp. No shared experts: routed work alone.
    routed = ModelArgs(**ARGS, num_shared_experts=0)
    for name, meshes, split in (
        ("tp1_ep2", dp_meshes, False),
        ("tp2_ep2_repeat", tp_meshes, False),
        ("tp2_ep2_split", tp_meshes, True),
    ):
        same_tokens = meshes is tp_meshes  # tp ranks see the same micro-batch
        results[name] = run(routed, meshes, same_tokens, split, False, iters, warmup)
    # Part 3: the shared experts behind the dispatch, on vs off, interleaved (ep2, tp1).
    shared = ModelArgs(**ARGS, num_shared_experts=2)
    for round_ in range(3):
        for overlap in (False, True):
            name = f"ep2_shared_overlap_{'on' if overlap else 'off'}"
            got = run(shared, dp_meshes, False, False, overlap, iters, warmup if round_ == 0 else 1)
            results.setdefault(name, {"seconds": [], "ep_seconds": []})
            results[name]["seconds"] += got["seconds"]
            results[name]["ep_seconds"] += got["ep_seconds"]
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _dims(tp: int, dp_shard: int) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, ep=2, world_size=2)


def run(args, meshes, same_tokens, split, overlap, iters, warmup) -> dict:
    torch.manual_seed(0)
    moe = MoE(args)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    apply_ep(moe, meshes["ep"], overlap_shared=overlap)
    if split:
        moe.token_share = TokenShare(meshes["tp"])
    rows = []
    local = moe.experts._local_experts

    def counted(x, counts):
        rows.append(x.size(0))
        return local(x, counts)

    moe.experts._local_experts = counted
    # The token copies this rank dispatches (and gets back combined): the all-to-all payload.
    dispatched = []
    moe.experts.register_forward_pre_hook(lambda _m, args: dispatched.append(args[0]))
    torch.manual_seed(1 if same_tokens else 1 + dist.get_rank())
    x = torch.randn(BATCH, SEQ, args.dim, requires_grad=True)
    timer = CommTimer(torch.device("cpu"), axis_of_groups(meshes))
    timer.start()
    seconds, ep_seconds, saved, sent = [], [], 0, 0
    for i in range(warmup + iters):
        dist.barrier()
        timer.take()
        rows.clear()
        dispatched.clear()
        started = time.perf_counter()
        counter = _SavedBytes()
        with counter:
            out = moe(x)
        out.square().mean().backward()
        elapsed = time.perf_counter() - started
        exposed, _ = timer.take()
        if i >= warmup:
            seconds.append(elapsed)
            ep_seconds.append(exposed["ep"])
            saved = counter.bytes
            sent = sum(2 * t.numel() * t.element_size() for t in dispatched)
    timer.stop()
    return {
        "rows": sum(rows),
        "saved_bytes": saved,
        "ep_bytes": sent,
        "seconds": seconds,
        "ep_seconds": ep_seconds,
        "median_s": statistics.median(seconds),
    }


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd saves for backward inside the block."""

    def __init__(self) -> None:
        self.bytes, self._seen = 0, set()
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            try:
                key = t.untyped_storage().data_ptr()
            except RuntimeError:  # a tensor subclass without storage
                return t
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t


if __name__ == "__main__":
    main()
