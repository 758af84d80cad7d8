"""DeepSpeed's CPU Adam op (AVX-512/AMX vectorised) on flat subgroup tensors, with torch's Adam semantics."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import torch

from lightning_smartinf.ops import load_op

log = logging.getLogger(__name__)
_ids = itertools.count(10_000)


class DeepSpeedCPUAdamKernel:
    """Calls ``adam_update`` of DeepSpeed's compiled cpu_adam op directly, one optimizer id per mode."""

    def __init__(self) -> None:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        self._op: Any = load_op(CPUAdamBuilder())
        self._ids: dict[bool, int] = {}

    def _id(self, adamw: bool) -> int:
        if adamw not in self._ids:
            self._ids[adamw] = next(_ids)
            # lr/betas/eps/wd given here are defaults; adam_update passes the live values every call.
            self._op.create_adam(self._ids[adamw], 1e-3, 0.9, 0.999, 1e-8, 0.0, adamw, False)
        return self._ids[adamw]

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
        self._op.adam_update(
            self._id(adamw), step, hyper["lr"], beta1, beta2, hyper["eps"], hyper["weight_decay"], True,
            master, grad, exp_avg, exp_avg_sq,
        )  # fmt: skip

    def close(self) -> None:
        for opt_id in self._ids.values():
            self._op.destroy_adam(opt_id)
        self._ids.clear()


def load_cpu_adam(choice: str) -> DeepSpeedCPUAdamKernel | None:
    """The DeepSpeed kernel for ``update.host_adam`` (``auto``/``deepspeed``), or None for torch's."""
    if choice == "torch":
        return None
    try:
        return DeepSpeedCPUAdamKernel()
    except Exception as err:  # noqa: BLE001 - the op may fail to compile on this machine
        if choice == "deepspeed":
            raise RuntimeError(f"update.host_adam=deepspeed but DeepSpeed's cpu_adam op did not load: {err}") from err
        log.warning("DeepSpeed cpu_adam op unavailable (%s); the host update uses torch's Adam", err)
        return None
