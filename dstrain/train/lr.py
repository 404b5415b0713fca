"""Learning-rate schedules: linear warmup, then constant, cosine, linear, or warmup-stable-decay.

WSD (Hu et al. 2024, MiniCPM): hold the peak, then decay linearly over the last
`wsd_decay_ratio` of the post-warmup steps. Every schedule ends at `min_lr_ratio` x peak.
"""

import math

import torch

from dstrain.config.schema import LRConfig


def lr_factor(step: int, cfg: LRConfig, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        start = cfg.warmup_start_ratio
        return start + (1 - start) * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay_steps))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "linear":
        return 1 - (1 - floor) * progress
    if cfg.schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    stable = 1 - cfg.wsd_decay_ratio
    if progress <= stable:
        return 1.0
    return 1 - (1 - floor) * (progress - stable) / max(cfg.wsd_decay_ratio, 1e-12)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
