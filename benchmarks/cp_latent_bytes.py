"""Context parallelism's attention traffic: MLA's latent all-gather against a ring of full K/V.

One DeepSeek-V3 MLA layer (bf16, V3's dims) runs forward and backward on one rank of a cp group
on torch's fake process group, under fake tensors (no memory, no compute): the collectives it
issues are recorded with their tensors' sizes (`_Recorder`), so the latent's bytes are measured
from the calls themselves. The ring's are the bytes of the full keys and values a ring rotates:
each of the cp - 1 steps passes on a rank's K [L, H, qk_nope + qk_rope] and V [L, H, v] in
forward, and in backward the same again plus their gradients (torch's ring attention backward),
with L, H and the head dims those this layer computes.

    python benchmarks/cp_latent_bytes.py [--seq 32768] [--cp 8]
"""

import argparse

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.config.flavors import flavor_args
from dstrain.model.attention import MLA
from dstrain.model.rope import RotaryEmbedding
from dstrain.parallel.context_parallel import ContextShard

MiB = 2**20


class _Recorder(TorchDispatchMode):
    """The functional collectives dispatched, with the bytes each moves through this rank:
    an all-gather receives its output less its own input, a reduce-scatter sends its input less
    its own output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name.endswith(("all_gather_into_tensor", "reduce_scatter_tensor")):
            big, small = (out, args[0]) if "gather" in name else (args[0], out)
            nbytes = (big.numel() - small.numel()) * big.element_size()
            self.calls.append((name.rsplit(".", 1)[-1], nbytes))
        return out


def measure(seq: int, cp: int) -> dict[str, float]:
    rank = 1
    dist.init_process_group("fake", rank=rank, world_size=cp)
    try:
        args = flavor_args("deepseek-v3")
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            mla = MLA(args)
            rope = RotaryEmbedding(args, args.qk_rope_head_dim)
        torch.set_default_dtype(torch.float32)
        recorder = _Recorder()
        with FakeTensorMode(allow_non_fake_inputs=True):
            mla.to_empty(device="cpu")
            rope.to_empty(device="cpu")
            shard = ContextShard(dist.group.WORLD, cp, rank)
            mla.context = shard
            local = seq // cp
            x = torch.empty(1, local, args.dim, dtype=torch.bfloat16, requires_grad=True)
            cos, sin = rope(local, shard.positions(local).expand(1, -1))
            with recorder:
                mla(x, cos, sin).sum().backward()
    finally:
        dist.destroy_process_group()
    heads = args.num_heads
    kv_bytes = local * heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim) * 2
    ring_forward = (cp - 1) * kv_bytes
    latent = sum(n for _, n in recorder.calls)
    return {
        "calls": len(recorder.calls),
        "latent_bytes": latent,
        "ring_bytes": 3 * ring_forward,  # forward K/V; backward K/V and their gradients
        "latent_values_per_token": args.kv_lora_rank + args.qk_rope_head_dim,
        "kv_values_per_token": kv_bytes // (2 * local),
    }


def main() -> None:
    from benchmarks.cpu import cpu_label

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=8)
    opts = parser.parse_args()
    print(f"# {cpu_label()} (counted, not timed)")
    r = measure(opts.seq, opts.cp)
    print(
        f"DeepSeek-V3 MLA, one layer, seq {opts.seq}, cp {opts.cp}, bf16, per rank per step:\n"
        f"  latent all-gather + reduce-scatter ({r['calls']} collectives): "
        f"{r['latent_bytes'] / MiB:,.1f} MiB ({r['latent_values_per_token']} values per token)\n"
        f"  ring of full K/V (forward, backward K/V and gradients): {r['ring_bytes'] / MiB:,.1f} "
        f"MiB ({r['kv_values_per_token']} values per token)\n"
        f"  ring / latent: {r['ring_bytes'] / r['latent_bytes']:.1f}x; x 61 layers: latent "
        f"{61 * r['latent_bytes'] / 2**30:,.2f} GiB, ring {61 * r['ring_bytes'] / 2**30:,.1f} GiB"
    )


if __name__ == "__main__":
    main()
