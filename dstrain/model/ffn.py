"""Dense feed-forward blocks: SwiGLU (DeepSeek, Llama) and GELU (GPT-2, BLOOM).

SwiGLU: w2(silu(w1 x) * w3 x). The shared experts of a MoE layer are one SwiGLU of width
num_shared_experts x moe_inter_dim. TP shards w1/w3 by column and w2 by row.
"""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, kind: str = "swiglu") -> None:
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if kind == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
