"""Context parallelism (`parallel.cp`): each sequence split over the cp ranks, attention over the
whole sequence by gathering what each token contributes to the keys and values.

Layout (load balance): a sequence of S tokens is cut into 2N chunks of S / 2N; cp rank r holds
chunks r and 2N-1-r, side by side (torch's head-tail order, `_HeadTailLoadBalancer`). Under a
causal mask the queries of chunk c see c + 1/2 chunks of keys, so every rank's two chunks see
(r + 1/2) + (2N - 1 - r + 1/2) = 2N chunks: the same attention work on every rank.

Attention: all-gather, not a ring. MLA's keys and values are functions of a per-token latent,
kv_lora_rank + qk_rope_head_dim values (576 in DeepSeek-V3) against heads x (qk + v head dims)
for the full keys and values (40,960): each rank gathers the latent (the RoPE key already
rotated at its tokens' own positions), then runs `kv_norm` and `wkv_b` on the whole sequence
locally. The gather is torch's functional all-gather, and its backward the reduce-scatter of the
latent's gradient (`_GatherSequence`): each rank gets back the gradient of its own tokens'
latents, summed over the ranks whose queries used them.

Why not torch's own context-parallel API (`torch.distributed.tensor.experimental
.context_parallel`): it rotates full K and V around a ring inside SDPA's CUDA kernels (flash,
efficient, cuDNN); MLA's latent never reaches SDPA, the ring has no hook to send it instead, and
the CPU's SDPA kernels are not among those it patches. The load-balanced order is torch's.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dstrain.model.attention import MHA, MLA
from dstrain.model.moe import MoE
from dstrain.model.transformer import Transformer
from dstrain.parallel.mesh import Meshes


@dataclass(frozen=True)
class ContextShard:
    """This rank's place in its cp group: `size` ranks, this one `rank`."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    # (length, end, device) -> chunk_mask's mask, built once: it depends on positions only
    masks: dict[tuple[int, int, str], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions [L] of this rank's `local_len` tokens (its two chunks)."""
        return _chunk_positions(self.rank, self.size, local_len, device)

    def all_positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The positions [L x size] of every rank's tokens, in the order `gather` lays them."""
        return torch.cat(
            [_chunk_positions(r, self.size, local_len, device) for r in range(self.size)]
        )

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of a whole sequence along `dim` (tokens, labels)."""
        length = x.size(dim)
        if length % (2 * self.size):
            raise ValueError(f"sequence of {length} does not split into 2 x cp={self.size} chunks")
        index = self.positions(length // self.size, x.device)
        return x.index_select(dim, index)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of `x` along `dim`, in sequence order: every rank's tokens
        gathered, then put in place. Its backward reduce-scatters the gradient back to each
        rank's own tokens."""
        if self.size == 1:
            return x
        local_len = x.size(dim)
        gathered = _GatherSequence.apply(x, dim, self.group)
        order = self.all_positions(local_len, x.device).argsort()
        return gathered.index_select(dim, order)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the cp ranks (statistics: no gradient flows back through it)."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", self.group))

    def causal_mask(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, 1, L, L x size] bool: this rank's queries against the whole sequence's keys
        (`gather`'s order), causal by position: the pairs it attends, its share of the work
        (attention itself runs chunk by chunk, `model/attention._attention`)."""
        q = self.positions(local_len, device)
        k = torch.arange(local_len * self.size, device=device)
        return (q[:, None] >= k[None, :])[None, None]

    def chunk_mask(self, length: int, end: int, device: torch.device | str) -> torch.Tensor:
        """[1, 1, length, end] bool: a chunk's queries, at positions end - length .. end - 1,
        against the keys 0 .. end - 1, causal (bottom-right). Built once per chunk and device:
        every layer and micro-batch attends with the same one, as the positions never change
        (where no fused kernel applies the bias itself: `model/attention._bottom_right`)."""
        key = (length, end, str(device))
        if key not in self.masks:
            keys = torch.arange(end, device=device)
            queries = torch.arange(end - length, end, device=device)
            self.masks[key] = (keys[None, :] <= queries[:, None])[None, None]
        return self.masks[key]

    def query_chunks(self, local_len: int) -> list[tuple[slice, int]]:
        """This rank's two chunks: (their rows of the local tokens, their first position)."""
        chunk = local_len // 2
        tail = 2 * self.size - 1 - self.rank
        return [(slice(0, chunk), self.rank * chunk), (slice(chunk, local_len), tail * chunk)]


def _chunk_positions(
    rank: int, size: int, local_len: int, device: torch.device | str
) -> torch.Tensor:
    if local_len % 2:
        raise ValueError(f"{local_len} local tokens do not make two equal chunks")
    chunk = local_len // 2
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail_start = (2 * size - 1 - rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` in forward, reduce-scatter of the gradient in backward: torch's
    `all_gather_single_autograd` does the same, but its backward calls the collective inside
    autograd's C++ where the comm timer (`metrics/comm_timer.py`) does not see it; here both
    go through the functional collectives' Python API, so the cp axis's bytes count both."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        gathered = funcol.all_gather_single(x.contiguous(), gather_dim=dim, group=group)
        return funcol.wait_tensor(gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        part = funcol.reduce_scatter_single(
            grad.contiguous(), "sum", scatter_dim=ctx.dim, group=ctx.group
        )
        return funcol.wait_tensor(part), None, None


def context_shard(meshes: Meshes | None) -> ContextShard | None:
    """This rank's cp group, None without context parallelism."""
    if meshes is None or meshes.dims.cp == 1:
        return None
    mesh = meshes["cp"]
    return ContextShard(mesh.get_group(), mesh.size(), mesh.get_local_rank())


def apply_context_parallel(model: torch.nn.Module, shard: ContextShard) -> None:
    """Make `model` (a Transformer, or a pipeline stage's chunk of one) run on this rank's part
    of each sequence: its RoPE positions, every attention module's gather and mask, and every
    MoE's balance-loss statistics."""
    for module in model.modules():
        if isinstance(module, Transformer | MLA | MHA | MoE):
            module.context = shard
