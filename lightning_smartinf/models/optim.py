"""The optimizers the command line offers (``optim.name``), with optional linear warmup, for any module."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_smartinf.errors import ConfigError


def configure(params: Iterable[torch.nn.Parameter], name: str, lr: float, betas: tuple[float, float],
              weight_decay: float, warmup_steps: int) -> Any:  # fmt: skip
    """What ``configure_optimizers`` returns: the optimizer, with a per-step warmup scheduler when asked."""
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=betas)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    elif name == "adagrad":
        opt = torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    else:
        raise ConfigError(f"optim.name={name!r} is not one of adamw, adam, sgd, adagrad")
    if not warmup_steps:
        return opt
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup_steps))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}
