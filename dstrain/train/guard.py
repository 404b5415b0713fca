"""The numerics guard: a NaN/Inf loss or gradient norm, or a loss spike, does not reach the
weights. The step asks `allow(loss, grad_norm)` before the optimizer steps; a refused step's
update is dropped (`skip`), and the trainer then rolls back or stops if the policy says so.

Every rank judges the same global loss and norm, so every rank decides the same without talking.
fp16 overflows are the loss scaler's business (it skips and lowers the scale); the guard judges
their gradient norm only in fp32/bf16.
"""

import math
from typing import Any

from dstrain.config.schema import GuardConfig
from dstrain.errors import UserError

EMA_BETA = 0.9  # the running mean forgets a step's loss in ~10 steps


class NumericsGuard:
    def __init__(self, cfg: GuardConfig, fp16: bool) -> None:
        self.cfg, self.fp16 = cfg, fp16
        self.mean: float | None = None
        self.judged = 0
        self.consecutive = 0
        self.last_reason: str | None = None
        self.events = 0  # bad steps over the run, for the summary

    def allow(self, value: float, norm: float) -> bool:
        """True: apply the update. The global loss and gradient norm come to the host once per
        step, with the step's other verdicts (`train/agreement.py`)."""
        reason = self._judge(value, norm)
        self.last_reason = reason
        if reason is None:
            previous = value if self.mean is None else self.mean
            self.mean = EMA_BETA * previous + (1 - EMA_BETA) * value
            self.judged += 1
            self.consecutive = 0
            return True
        self.events += 1
        self.consecutive += 1
        if self.consecutive > self.cfg.max_consecutive or self.cfg.policy == "stop":
            raise UserError(
                f"numerics guard: {reason}"
                + (f" ({self.consecutive} bad steps in a row)" if self.consecutive > 1 else ""),
                "lower optim.lr or raise train.grad_clip, check the data, or resume from an "
                "earlier checkpoint (--resume PATH); guard.policy = skip/rollback keeps going",
                exit_code=1,
            )
        return False

    def _judge(self, loss: float, norm: float) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not self.fp16 and not math.isfinite(norm):
            return f"gradient norm is {norm}"
        factor, mean = self.cfg.spike_factor, self.mean
        warm = self.judged >= self.cfg.spike_warmup_steps
        if factor and mean and warm and loss > factor * mean:
            return f"loss spike: {loss:.4g} is {loss / mean:.1f}x its running mean {mean:.4g}"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "judged": self.judged, "events": self.events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.judged = state["mean"], int(state["judged"])
        self.events = int(state["events"])
