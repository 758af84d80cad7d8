"""Dynamic loss scaling for fp16 with torch.amp.GradScaler's rules, applied by the engine's step.

The engine cannot let GradScaler unscale ``param.grad`` (gradients live in the store), so it keeps the same state
machine: scale the loss, skip the step and back off on overflow, grow after ``growth_interval`` clean steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


def inverse_scale(scaler: DynamicLossScaler | None) -> float:
    """GradScaler's fp32 reciprocal of the loss scale (1 without one), which clip_grad_norm_'s fp32 coefficient
    then sees applied to the norm."""
    scale = scaler.scale if scaler is not None else 1.0
    return float(torch.tensor(scale, dtype=torch.float64).reciprocal().float())
