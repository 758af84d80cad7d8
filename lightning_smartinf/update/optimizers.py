"""The optimizers the engine can run, read from the torch optimizer the LightningModule configured.

The torch optimizer stays the user's handle: its ``param_groups`` (and so LR schedulers) are read at every step,
but its ``step()`` is never called; the engine applies the same math to flat subgroups. Host math calls torch's
own functional optimizers, so semantics (bias correction, dampening, nesterov, lr_decay, ...) are torch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Adagrad, Adam, AdamW, Optimizer
from torch.optim import adagrad as adagrad_fn
from torch.optim import adam as adam_fn
from torch.optim import adamw as adamw_fn
from torch.optim import sgd as sgd_fn

from lightning_smartinf.errors import ConfigError

SUPPORTED = "torch.optim.Adam, AdamW, SGD (with or without momentum) and Adagrad"
LAST_STEP = "last_step"
"""Catch-up's extra per-element state: the optimizer step the element last moved at."""


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor per subgroup: its name and the value it starts at."""

    kind: str
    init: float


@dataclass(frozen=True)
class OptimizerRule:
    name: str
    """``adam``, ``adamw``, ``sgd`` or ``adagrad``."""
    states: tuple[StateSpec, ...]

    @property
    def state_kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.states)


def rule_for(optimizer: Optimizer) -> OptimizerRule:
    """Identify the optimizer and the state it keeps, or fail naming what is supported."""
    groups = optimizer.param_groups
    for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
        if any(g.get(flag, False) for g in groups):
            raise ConfigError(f"{type(optimizer).__name__}({flag}=True) is not supported by smart_infinity")
    if isinstance(optimizer, AdamW):
        return OptimizerRule("adamw", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0)))
    if isinstance(optimizer, Adam):
        decoupled = any(g.get("decoupled_weight_decay", False) for g in groups)
        name = "adamw" if decoupled else "adam"
        return OptimizerRule(name, (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0)))
    if isinstance(optimizer, SGD):
        has_momentum = any(g["momentum"] != 0 for g in groups)
        return OptimizerRule("sgd", (StateSpec("momentum_buffer", 0.0),) if has_momentum else ())
    if isinstance(optimizer, Adagrad):
        inits = {g["initial_accumulator_value"] for g in groups}
        if len(inits) > 1:
            raise ConfigError("Adagrad param groups with different initial_accumulator_value are not supported")
        return OptimizerRule("adagrad", (StateSpec("sum", float(inits.pop())),))
    raise TypeError(f"smart_infinity supports {SUPPORTED}; configure_optimizers returned {type(optimizer).__name__}")


def with_catch_up(rule: OptimizerRule) -> OptimizerRule:
    """The rule SmartComp's catch-up runs on the devices: Adam's state plus the step each element last moved."""
    if rule.name not in ("adam", "adamw"):
        raise ConfigError(
            f"compression.catch_up=true runs Adam's update on the devices; the optimizer is {rule.name}: use "
            "torch.optim.Adam or AdamW, or set compression.catch_up=false"
        )
    return OptimizerRule(rule.name, (*rule.states, StateSpec(LAST_STEP, 0.0)))


def hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """A snapshot of each param group's hyper-parameters (without the params), taken at step time."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def torch_update(
    rule: OptimizerRule,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    hyper: dict[str, Any],
    step: int,
) -> None:
    """Update ``master`` and ``state`` in place with torch's functional optimizer, for optimizer step ``step``."""
    steps = [torch.tensor(float(step - 1))]
    if rule.name in ("adam", "adamw"):
        beta1, beta2 = hyper["betas"]
        fn = adamw_fn.adamw if rule.name == "adamw" else adam_fn.adam
        fn(
            [master], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], steps,
            foreach=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=hyper["lr"],
            weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False,
        )  # fmt: skip
    elif rule.name == "sgd":
        buffers: list[torch.Tensor | None] = [None if step == 1 else state.get("momentum_buffer")]
        sgd_fn.sgd(
            [master], [grad], buffers, foreach=False, weight_decay=hyper["weight_decay"],
            momentum=hyper["momentum"], lr=hyper["lr"], dampening=hyper["dampening"],
            nesterov=hyper["nesterov"], maximize=False,
        )  # fmt: skip
        if "momentum_buffer" in state and buffers[0] is not None:
            state["momentum_buffer"].copy_(buffers[0])
    elif rule.name == "adagrad":
        adagrad_fn.adagrad(
            [master], [grad], [state["sum"]], steps, foreach=False, lr=hyper["lr"],
            weight_decay=hyper["weight_decay"], lr_decay=hyper["lr_decay"], eps=hyper["eps"], maximize=False,
        )  # fmt: skip
    else:
        raise AssertionError(rule.name)
