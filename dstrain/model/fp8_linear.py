"""Which layers train in FP8, and the modules that do (DeepSeek-V3 section 3.3.1).

In FP8: the attention projections (MLA's wq_a, wq_b / wq, wkv_a, wkv_b, wo; MHA's wq, wk, wv,
wo), the dense and shared-expert SwiGLUs (w1, w2, w3), the MTP projection, and the routed
experts' grouped GEMMs. In bf16 (autocast): the embedding, the output head, the MoE router (in
fp32, as in every precision), the norms and the attention core (SDPA). Master weights and their
gradients stay fp32.

`apply_fp8` swaps the class of each such `nn.Linear` in place (same parameters, same names, so
checkpoints, TP styles and FSDP2 see what they saw before) and marks the routed experts. It runs
on a `meta` model before any parallelism. Under tensor parallelism `parallel/fp8_tp.py` gives
the sharded layers a forward on their local shards.
"""

import torch
from torch import nn

from dstrain.model.attention import MHA, MLA
from dstrain.model.ffn import FeedForward
from dstrain.model.fp8 import fp8_matmul
from dstrain.model.moe import GroupedExperts
from dstrain.model.transformer import MTPModule


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmul runs in FP8 (`fp8.Fp8Matmul`) on `fp8_backend`."""

    fp8_backend = "emulated"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul(x, self.weight, self.fp8_backend)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def fp8_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every linear the recipe puts in FP8."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, MLA | MHA | FeedForward):
            found += [
                (f"{name}.{child_name}", child)
                for child_name, child in module.named_children()
                if isinstance(child, nn.Linear)
            ]
        elif isinstance(module, MTPModule):
            found.append((f"{name}.proj", module.proj))
    return found


def apply_fp8(model: nn.Module, backend: str) -> int:
    """Put the recipe's GEMMs of `model` in FP8 on `backend`, in place; returns how many modules
    changed (linears and grouped experts)."""
    linears = fp8_linears(model)
    for _, linear in linears:
        linear.__class__ = Fp8Linear
        linear.fp8_backend = backend
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        module.fp8_backend = backend
    return len(linears) + len(experts)
