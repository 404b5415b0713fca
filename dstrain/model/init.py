"""Initial weights that do not depend on the parallel layout or the device.

Why our own: torch has no layout-invariant initialiser. DTensor's RNG tracker refuses CPU meshes
(every rank would draw the same numbers for its own shard), and on CUDA its draws still depend on
the placements (pytorch#168058); `trunc_normal_` on a DTensor is a layout-dependent rejection
loop. torchtitan offers a seed checkpoint instead. Here every parameter is cut into fixed blocks
of rows of its *global* shape; block b of parameter `name` is drawn on the CPU from its own
generator, seeded by (seed, name, b). A rank fills only the blocks that overlap the part of the
global tensor it holds (`LocalBox`: a TP/EP/FSDP shard, or the whole tensor), and copies the
overlap into its local storage. So the same seed gives the same weights, bit for bit once
gathered, under every layout and on every device, and no rank ever draws a whole large tensor:
it draws at most one block (BLOCK_ELEMENTS) beyond its shard at a time.

Distributions (GPT-2/Megatron): projections normal(0, 0.02) truncated at 3 std, output
projections (`wo`, `w2`, also of the experts) scaled by 1/sqrt(2 x layers); the embedding
normal(0, 1); norms ones; RoPE tables computed; MoE balancing biases and counters zero.

This file imports no torch.distributed: the parallel layer passes `local_box`, which knows
DTensors.
"""

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

INIT_STD = 0.02
BLOCK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per drawn block
# Module-name segments that wrappers insert (activation checkpointing, torch.compile, DDP): the
# one-process name, which seeds the draws, is what remains without them.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "module")
# The pipeline's MTP copy of the embedding starts equal to the embedding.
ALIASES = {"mtp_embed.weight": "embed.weight"}


@dataclass(frozen=True)
class LocalBox:
    """What a rank holds of a global tensor: `local` (its storage, written in place) covers
    `local.shape` elements from `offset` in each dim of `global_shape`."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]


def whole(tensor: torch.Tensor) -> LocalBox:
    """A plain tensor is all of itself."""
    return LocalBox(tensor, tuple(tensor.shape), (0,) * tensor.dim())


Draw = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def truncated_normal(std: float) -> Draw:
    def draw(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        out = torch.empty(shape)
        return nn.init.trunc_normal_(out, std=std, a=-3 * std, b=3 * std, generator=generator)

    return draw


def normal(std: float) -> Draw:
    def draw(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    return draw


def canonical_name(name: str) -> str:
    """The one-process name of a parameter seen through wrappers."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    joined = ".".join(parts)
    return ALIASES.get(joined, joined)


def block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill(box: LocalBox, name: str, seed: int, draw: Draw) -> None:
    """Write into `box.local` its part of the global tensor that `draw` gives `name`."""
    local, shape, offset = box.local, box.global_shape, box.offset
    if local.numel() == 0:
        return
    row = math.prod(shape[1:])
    rows = max(1, BLOCK_ELEMENTS // max(row, 1))
    lo, hi = offset[0], offset[0] + local.shape[0]
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for block in range(lo // rows, -(-hi // rows)):
        start, stop = block * rows, min((block + 1) * rows, shape[0])
        generator = torch.Generator().manual_seed(block_seed(seed, name, block))
        values = draw((stop - start, *shape[1:]), generator)
        first, last = max(lo, start), min(hi, stop)
        local[first - lo : last - lo].copy_(values[(slice(first - start, last - start), *rest)])


def init_parameters(
    model: nn.Module, seed: int, local_box: Callable[[torch.Tensor], LocalBox] = whole
) -> None:
    """Initialise every parameter and buffer of `model` (after `to_empty`), whatever part of
    the global tensors this process holds."""
    num_layers = model.args.num_layers
    out_std = INIT_STD / math.sqrt(2 * num_layers)
    for name, param in model.named_parameters():
        key = canonical_name(name)
        draw = _draw_for(key, param, out_std)
        box = local_box(param)
        if draw is None:
            with torch.no_grad():
                box.local.fill_(1.0)
        else:
            fill(box, key, seed, draw)
    reset_buffers(model)


def _draw_for(key: str, param: torch.Tensor, out_std: float) -> Draw | None:
    """The distribution of one parameter by its one-process name; None: ones (norms)."""
    last = key.rsplit(".", 2)
    if key.endswith("embed.weight"):
        return normal(1.0)
    if param.dim() == 1:
        return None
    owner = last[-2] if len(last) >= 2 else ""
    if param.dim() == 3:  # grouped experts: w1, w2, w3 [E, ...]
        return truncated_normal(out_std if last[-1] == "w2" else INIT_STD)
    return truncated_normal(out_std if owner in ("wo", "w2") else INIT_STD)


@torch.no_grad()
def reset_buffers(model: nn.Module) -> None:
    """RoPE tables computed; balancing biases, load counters and the aux-loss record zero."""
    for module in model.modules():
        if type(module).__name__ == "RotaryEmbedding":
            module.reset_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(("expert_bias", "tokens_per_expert", "last_aux_loss")):
            buffer.zero_()
