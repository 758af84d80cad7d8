"""The trained weights back in the user's module between stages, and the engine's again at the next one.

While a stage runs, the engine owns the parameters: resident ones are views of its 16-bit buffer, streamed ones are
empty except while their block runs. At the end of fit, validate, test or predict the module should behave as after
plain Lightning (``state_dict()``, ``model(x)``, ``save_pretrained``), so ``give`` puts every trained value back in
its parameter, in the parameter's original dtype, block by block from the fp32 masters (``offload.return_weights``
= ``module``). A model too large for host memory gets meta tensors instead (``meta``): every use fails loudly, and
the values stay in the engine's state, for an export. ``auto`` picks ``module`` when the weights fit in half of the
host memory still available. ``take`` at the next stage's set-up hands them back to the engine, whose state stays
authoritative: a change made to the module's weights in between is not seen by the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from lightning_smartinf.core import Block, ParamSlot
from lightning_smartinf.engine.build import EngineParts
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.memory import host_available_bytes
from lightning_smartinf.schedule.horizontal import BlockHooks
from lightning_smartinf.storage.space import human_bytes

log = logging.getLogger(__name__)


class WeightHandback:
    """Moves the parameters between the engine and the module (see the module docstring)."""

    def __init__(self, parts: EngineParts, model: nn.Module, device: torch.device, hooks: BlockHooks,
                 masters: Callable[[Block], torch.Tensor], wait: Callable[[], None]) -> None:  # fmt: skip
        """``masters``: a block's fp32 masters, gathered; ``wait``: until an overlapped step has finished."""
        self.parts, self.model, self.device = parts, model, device
        self.hooks, self.masters, self.wait = hooks, masters, wait
        self.slots = [slot for block in parts.layout.blocks for slot in block.slots]
        self.frozen_slots = [slot for block in parts.frozen_layout.blocks for slot in block.slots]
        """Frozen parameters of the streamed blocks: read back from their files (never kept aside in memory)."""
        self._frozen_sums: list[float] = []
        """Each handed-back frozen parameter's sum: ``take`` refuses a stage whose frozen weights were changed."""
        self.given: str | None = None
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._originals = parts.originals

    @property
    def nbytes(self) -> int:
        """Host bytes of every engine-owned parameter in its original dtype, the streamed frozen ones included."""
        return sum(s.nbytes for s in self.slots + self.frozen_slots)

    def resolve(self, mode: str) -> str:
        if mode != "auto":
            return mode
        available = host_available_bytes()
        return "module" if 2 * self.nbytes <= available else "meta"

    def give(self, mode: str) -> str:
        """End of a stage: the module's parameters hold their trained values (``module``) or meta tensors
        (``meta``); the blocks' ``forward`` are the module's own again. Returns the mode used."""
        if self.given is not None:
            return self.given
        self.wait()
        for streamer in self.parts.streamers:
            streamer.release_all()
        self.hooks.unwrap()
        chosen = self.resolve(mode)
        if self.parts.updater is None and self._originals is None:  # nothing to fill from: meta-built, not trained
            chosen = "meta"
        if chosen == "module":
            self._fill()
        else:
            self._to_meta(mode)
        self.given = chosen
        return chosen

    def _fill(self) -> None:
        self._fill_frozen()
        if self._originals is not None:
            for slot, original in zip(self.slots, self._originals, strict=True):
                slot.param.data = original
            return
        for block in self.parts.layout.blocks:
            flat = self.masters(block)
            for slot in block.slots:
                value = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                slot.param.data = value.to(device=self.device, dtype=slot.dtype, copy=True)

    def _fill_frozen(self) -> None:
        """The streamed blocks' frozen parameters, read block by block from their files into tensors of their own."""
        frozen = self.parts.frozen
        if frozen is None:
            return
        self._frozen_sums = []
        for block in self.parts.frozen_layout.streamed:
            flat = frozen.read_block(block.index)
            for slot in block.slots:
                value = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                slot.param.data = value.to(device=self.device, copy=True)
                self._frozen_sums.append(_checksum(slot.param.data))

    def _to_meta(self, mode: str) -> None:
        """Replace each engine-owned Parameter by a meta Parameter (one new object per shared one, so tied weights
        stay tied); the originals are kept for ``take``, since the optimizer holds them."""
        replacement = {id(s.param): _meta_like(s) for s in self.slots + self.frozen_slots}
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and id(param) in replacement:
                    self._swapped.append((module, name, param))
                    module._parameters[name] = replacement[id(param)]
        why = "offload.return_weights=meta" if mode == "meta" else (
            f"offload.return_weights=auto: the weights take {human_bytes(self.nbytes)}, more than half of the "
            f"{human_bytes(host_available_bytes())} of host memory available"
        )  # fmt: skip
        log.warning(
            "smart_infinity: %s, so the module's parameters are meta tensors now; the trained values stay in %s. "
            "Write them out with trainer.strategy.export(DIR) (safetensors, block by block), or "
            "trainer.save_checkpoint(PATH) then `smartinf-export PATH OUT`; or set offload.return_weights=module "
            "to have them in the module",
            why, self.parts.root,
        )  # fmt: skip

    def changed_status(self) -> list[str]:
        """Parameters whose ``requires_grad`` differs from what set-up laid out (changed between stages): the
        engine must be built anew for them to take effect."""
        now = {name: p.requires_grad for name, p in self.model.named_parameters()}
        return ([s.name for s in self.slots if not now.get(s.name, True)]
                + [s.name for s in self.frozen_slots if now.get(s.name, False)])  # fmt: skip

    def _check_frozen_unchanged(self) -> None:
        """A frozen weight changed in the module since it was handed back would not be seen (the engine streams
        what it stored at set-up): refuse before anything is written."""
        if self.given != "module" or not self._frozen_sums:
            return
        for slot, before in zip(self.frozen_slots, self._frozen_sums, strict=True):
            if _checksum(slot.param.data) != before:
                raise ConfigError(
                    f"the frozen parameter {slot.name} changed in the module since the last stage ended; "
                    "smart_infinity streams the frozen weights it stored at set-up and would not see the change: "
                    "start a new Trainer (and strategy) to train with new frozen weights"
                )

    def take(self) -> None:
        """Start of the next stage: the engine owns the parameters again (its state is the current one)."""
        if self.given is None:
            return
        self._check_frozen_unchanged()
        for module, name, param in self._swapped:
            module._parameters[name] = param
        self._swapped.clear()
        for streamer in self.parts.streamers:
            streamer.attach()
        self.hooks.wrap()
        self.given = None

    def keep_in_module(self) -> None:
        """Before the engine closes while the module lives on (an evaluation engine replaced by one for fit): the
        module's parameters hold their values, whichever mode the last stage gave them back in."""
        if self.given != "module":
            self.take()
            self.give("module")


def _checksum(tensor: torch.Tensor) -> float:
    return float(tensor.detach().double().sum())


def _meta_like(slot: ParamSlot) -> nn.Parameter:
    return nn.Parameter(torch.empty(slot.shape, dtype=slot.dtype, device="meta"), slot.param.requires_grad)
