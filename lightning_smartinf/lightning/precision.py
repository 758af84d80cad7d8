"""The precision plugin smart_infinity runs under: autocast as Lightning's, scaling and clipping by the engine.

Gradients never stay on ``param.grad`` (they leave block by block into the engine's store), so Lightning's
GradScaler unscale and ``clip_grad_norm_`` would see nothing. This plugin hands the loss to the engine's
backward, records ``gradient_clip_val`` for the engine, and runs the engine's step after the closure.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from typing_extensions import override

from lightning_smartinf.errors import ConfigError

if TYPE_CHECKING:
    from lightning_smartinf.engine.engine import OffloadEngine

PARAM_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class SmartInfinityPrecision(Precision):
    def __init__(self, precision: str, device_type: str) -> None:
        if precision not in PARAM_DTYPES:
            raise ConfigError(
                f"smart_infinity supports precision {', '.join(PARAM_DTYPES)}; Trainer(precision={precision!r}) "
                "is not one of them"
            )
        self.precision = precision  # type: ignore[assignment]
        self.device_type = device_type
        self.engine: OffloadEngine | None = None
        self._backward_done = False
        """A schedule ran this batch's backward inside training_step (``skip_next_backward``)."""

    def skip_next_backward(self) -> None:
        """The batch's backward ran already (a vertical pass) or has nothing to do (a batch held for its window):
        Lightning's backward call that follows does nothing."""
        self._backward_done = True

    @property
    def param_dtype(self) -> torch.dtype:
        return PARAM_DTYPES[self.precision]

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "32-true":
            context: Any = nullcontext()
        else:
            context = torch.autocast(self.device_type, dtype=self.param_dtype, cache_enabled=False)
        with context:
            yield

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        assert self.engine is not None, "the smart_infinity engine is built in Strategy.setup"
        if self._backward_done:
            self._backward_done = False
            return
        self.engine.backward(tensor)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        assert self.engine is not None
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            self.engine.discard_gradients()  # training_step returned None: Lightning skipped backward, so no step
            return None
        self.engine.step()
        return closure_result

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0 or self.engine is None:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ConfigError(
                "smart_infinity clips by the global gradient norm only: use gradient_clip_algorithm='norm'"
            )
        self.engine.configure_step(clip_norm=float(clip_val))

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.engine is not None and self.engine.scaler is not None:
            return self.engine.scaler.state_dict()
        return {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and self.engine is not None and self.engine.scaler is not None:
            self.engine.scaler.load_state_dict(state_dict)
