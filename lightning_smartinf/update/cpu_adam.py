"""DeepSpeed's CPU Adam op (AVX-512/AMX vectorised) on flat subgroup tensors, with torch's Adam semantics."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from lightning_smartinf.errors import ConfigError, SetupError
from lightning_smartinf.extras import available, missing
from lightning_smartinf.ops import load_op

log = logging.getLogger(__name__)
_ids = itertools.count(10_000)
"""Optimizer ids for the op's table, which is one per process (a C++ global): ids are unique per process too."""


class DeepSpeedCPUAdamKernel:
    """Calls ``adam_update`` of DeepSpeed's compiled cpu_adam op directly.

    The op keeps Adam's bias corrections as a running product (``beta ** step`` multiplied up one step at a time)
    while steps arrive one by one, and recomputes them with ``pow`` after any jump, such as a resume: a resumed
    run would then round differently from an uninterrupted one. So each optimizer step gets a fresh optimizer id
    (per mode), whose first call always takes the op's ``pow`` path: the corrections depend on the step number
    alone, and a resume is bit-exact."""

    def __init__(self) -> None:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        self._op: Any = load_op(CPUAdamBuilder())
        self._ids: dict[bool, tuple[int, int]] = {}
        """mode (adamw) -> (step, optimizer id)."""

    def _id(self, adamw: bool, step: int, beta1: float, beta2: float) -> int:
        held = self._ids.get(adamw)
        if held is not None and held[0] == step:
            return held[1]
        if held is not None:
            self._op.destroy_adam(held[1])
        opt_id = next(_ids)
        # lr/eps/wd given here are defaults (adam_update passes the live values every call); the betas are the
        # live ones, so that the first call's step (> 1) takes the pow path, and step 1 its equal product
        self._op.create_adam(opt_id, 1e-3, beta1, beta2, 1e-8, 0.0, adamw, False)
        self._ids[adamw] = (step, opt_id)
        return opt_id

    def update(
        self,
        adamw: bool,
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        hyper: dict[str, Any],
        step: int,
    ) -> None:
        beta1, beta2 = hyper["betas"]
        opt_id = self._id(adamw, step, beta1, beta2)
        self._op.adam_update(
            opt_id, step, hyper["lr"], beta1, beta2, hyper["eps"], hyper["weight_decay"], True,
            master, grad, exp_avg, exp_avg_sq,
        )  # fmt: skip

    def close(self) -> None:
        for _, opt_id in self._ids.values():
            self._op.destroy_adam(opt_id)
        self._ids.clear()


def load_cpu_adam(choice: str) -> DeepSpeedCPUAdamKernel | None:
    """The DeepSpeed kernel for ``update.host_adam`` (``auto``/``deepspeed``), or None for torch's."""
    if choice == "torch":
        return None
    if not available("deepspeed"):
        if choice == "deepspeed":
            raise ConfigError(missing("deepspeed", "update.host_adam=deepspeed"))
        log.info("%s; the host update uses torch's Adam", missing("deepspeed", "DeepSpeed's CPU Adam"))
        return None
    try:
        return DeepSpeedCPUAdamKernel()
    except Exception as err:  # noqa: BLE001 - the op may fail to compile on this machine
        if choice == "deepspeed":
            raise SetupError(f"update.host_adam=deepspeed but DeepSpeed's cpu_adam op did not load: {err}") from err
        log.warning("DeepSpeed cpu_adam op unavailable (%s); the host update uses torch's Adam", err)
        return None
