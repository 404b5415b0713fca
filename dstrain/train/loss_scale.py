"""fp16 dynamic loss scaling with DeepSpeed's semantics (initial 2**power, double after `window`
clean steps, halve after `hysteresis` overflows, never below `min_loss_scale`).

Written here rather than using torch.amp.GradScaler because DeepSpeed configs, which we import,
define hysteresis and a minimum scale that GradScaler has no notion of.
"""

from typing import Any

import torch

from dstrain.config.schema import LossScaleConfig


class LossScaler:
    def __init__(self, cfg: LossScaleConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.dynamic = cfg.loss_scale == 0
        self.scale = cfg.loss_scale or 2.0**cfg.initial_scale_power
        self.window, self.hysteresis = cfg.loss_scale_window, cfg.hysteresis
        self.min_scale = cfg.min_loss_scale
        self.clean_steps = 0
        self.overflows_left = cfg.hysteresis

    def loss_multiplier(self) -> float:
        return self.scale if self.enabled else 1.0

    def unscale(
        self, params: list[torch.Tensor], device: torch.device, factor: float = 1.0
    ) -> torch.Tensor | None:
        """Multiply gradients by factor / scale (the factor: `step.backward_scale`); returns this
        rank's overflow flag (a 0-dim tensor on `device`, 1 when a gradient is not finite), or
        None when loss scaling is off. Every rank holds other gradients (shards under FSDP,
        layers under PP, experts under EP): the flags are joined over the world
        (`train/agreement.py`), and `update` takes the verdict."""
        if not self.enabled:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.int32, device=device)
        # On the local tensors: a foreach op refuses DTensors mixed with plain tensors (the
        # experts under EP beside DDP's parameters), and to_local() shares their storage.
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        torch._foreach_mul_(local, factor / self.scale)
        return (~torch.stack([g.isfinite().all() for g in local]).all()).to(torch.int32)

    def update(self, finite: bool) -> None:
        """The step's agreed verdict moves the scale (DeepSpeed's rules)."""
        if self.enabled:
            self._update(finite)

    def _update(self, finite: bool) -> None:
        """DeepSpeed's DynamicLossScaler.update_scale, without consecutive_hysteresis."""
        if not self.dynamic:
            return
        if finite:
            self.clean_steps += 1
            if self.clean_steps % self.window == 0:
                self.scale *= 2.0
                self.overflows_left = self.hysteresis
            return
        self.clean_steps = 0
        if self.overflows_left <= 1:
            self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.overflows_left -= 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "overflows_left": self.overflows_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows_left = int(state["overflows_left"])
