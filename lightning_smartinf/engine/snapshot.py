"""What of an engine goes into a checkpoint, and how it comes back.

Saved, as of a step boundary: every subgroup's state files (fp32 master and optimizer state, as the updater keeps
them, from each state directory), the step counter, the loss scaler, the error-feedback residuals of top-k
compression, and the layout: which parameter sits where in which subgroup. The layout lets a resume check that
the checkpoint fits the model, and lets ``smartinf-export`` rebuild a plain state dict without the model's code.
16-bit parameters and gradients are not saved: the former are rebuilt from the masters, the latter are empty at
a step boundary.

A save is a snapshot (``take_snapshot``, at the step boundary, cheap) and its writing (``write_snapshot``, which may
run in the background while training goes on): the state stays live in its files and host tensors, and the
engine's fence (engine/fence.py) keeps the next step from rewriting a subgroup's state before it is copied.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from lightning_smartinf.checkpoint.files import copy_file, write_state_file
from lightning_smartinf.checkpoint.manifest import COPY_THREADS, CheckpointError, CheckpointWriter, Manifest
from lightning_smartinf.checkpoint.protocol import saved_parts
from lightning_smartinf.compress.topk import TopKCompressor
from lightning_smartinf.core import FROZEN, MASTER, Layout, owned_slots
from lightning_smartinf.ecosystem.adapters import lora_merges
from lightning_smartinf.engine.fence import FenceHold, StateFence
from lightning_smartinf.engine.loss_scale import DynamicLossScaler
from lightning_smartinf.engine.params import ParamStreamer
from lightning_smartinf.engine.relayout import SavedLayout, mappable
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.storage.aligned import aligned_bytes
from lightning_smartinf.storage.store import TieredStore, WrittenSum, stripe_of
from lightning_smartinf.update.base import Updater
from lightning_smartinf.update.optimizers import OptimizerRule
from lightning_smartinf.update.quant8 import FP32


class Stateful(Protocol):
    """The parts of an engine (``OffloadEngine`` is one) a snapshot reads and a restore sets."""

    model: nn.Module
    layout: Layout
    frozen_layout: Layout
    rule: OptimizerRule | None
    updater: Updater | None
    params: ParamStreamer
    frozen: ParamStreamer | None
    fence: StateFence
    scaler: DynamicLossScaler | None
    param_dtype: torch.dtype
    step_count: int

    @property
    def compressor(self) -> TopKCompressor | None: ...

    def wait_step(self) -> None: ...

    def written(self, path: Path) -> WrittenSum | None: ...

    def replaced(self, files: dict[Path, WrittenSum]) -> None: ...

RESIDUALS = "residuals.pt"


def _state_dirs(engine: Stateful) -> list[Path]:
    return engine.updater.state_directories() if engine.updater else []


def _kinds(engine: Stateful) -> tuple[str, ...]:
    return (MASTER, *(engine.rule.state_kinds if engine.rule else ()))


def _in_ram(engine: Stateful) -> TieredStore | None:
    """The updater's state store where ``offload.host_memory_budget`` put some subgroups' state in host memory."""
    store = getattr(engine.updater, "store", None)
    return store if isinstance(store, TieredStore) else None


def _ram_entries(engine: Stateful) -> list[tuple[str, str, str]]:
    """(kind, key, path inside the checkpoint) of the state held in host memory: named as its file would be, so a
    checkpoint does not depend on the placement (resume with another budget, export without the engine)."""
    tiered = _in_ram(engine)
    if tiered is None:
        return []
    stripes = len(_state_dirs(engine))
    return [(kind, sg.key, f"state{stripe_of(sg.key, stripes)}/{kind}/{sg.key}")
            for kind in _kinds(engine) for sg in engine.layout.subgroups if sg.key in tiered.host_keys]  # fmt: skip


def _ram_tensors(engine: Stateful) -> list[tuple[str, torch.Tensor, str]]:
    """(subgroup key, live tensor, path inside the checkpoint) of the state in host memory that exists: as with
    files, before the first step there are masters but no optimizer state yet."""
    tiered = _in_ram(engine)
    if tiered is None:
        return []
    return [(key, tiered.host.tensor(kind, key), relative) for kind, key, relative in _ram_entries(engine)
            if tiered.host.exists(kind, key)]  # fmt: skip


def state_files(engine: Stateful) -> list[tuple[str, Path, str]]:
    """(subgroup key, live file, path inside the checkpoint ``state{i}/{kind}/{subgroup}``) for every state file,
    in the order the step updates the subgroups (so a save in the background copies first what is needed first)."""
    tiered = _in_ram(engine)
    in_ram = tiered.host_keys if tiered is not None else frozenset()
    files = []
    for sg in engine.layout.subgroups:
        if sg.key in in_ram:  # a file left by an earlier run placed otherwise is stale
            continue
        for index, state_dir in enumerate(_state_dirs(engine)):
            for kind in _kinds(engine):
                live = state_dir / kind / sg.key
                if live.is_file():
                    files.append((sg.key, live, f"state{index}/{kind}/{sg.key}"))
    return files


def layout_record(engine: Stateful) -> dict[str, Any]:
    """The layout as plain data: enough to find any parameter's fp32 values in the saved master files; and, where
    the streamed blocks have frozen parameters (a LoRA base), their names and shapes, where each sits in the saved
    ``frozen/`` files (``frozen_layout``), and the LoRA merges ``smartinf-export --merge`` applies (listed only
    where there are any, so a checkpoint of a model without them matches its earlier signature)."""
    fixed = engine.frozen_layout
    frozen = [[s.name, list(s.shape)] for b in fixed.streamed for s in b.slots]
    merges = [[m.base, m.lora_a, m.lora_b, m.scaling, m.transpose] for m in lora_merges(engine.model)]
    extra: dict[str, Any] = {"frozen": frozen, "frozen_layout": {**blocks_record(fixed), "dtype": _frozen_dtype(
        engine)}} if frozen else {}  # fmt: skip
    return {
        **blocks_record(engine.layout),
        "aliases": parameter_aliases(engine.model),
        **extra,
        **({"merges": merges} if merges else {}),
    }


def blocks_record(layout: Layout) -> dict[str, Any]:
    """A layout's blocks (each parameter's name, offset, size and shape) and subgroups as plain data: what a
    checkpoint records of each rank's layout, and what engine/relayout.py re-cuts from."""
    return {
        "blocks": [{"name": b.name, "numel": b.numel, "params": [[s.name, s.offset, s.numel, list(s.shape)]
                                                                 for s in b.slots]} for b in layout.blocks],
        "subgroups": [[sg.key, sg.block, sg.param_group, sg.offset, sg.numel] for sg in layout.subgroups],
        **({"fp32_state": layout.fp32_state} if layout.fp32_state is not None else {}),
    }  # fmt: skip


def _frozen_dtype(engine: Stateful) -> str:
    assert engine.frozen is not None
    return str(engine.frozen.dtype).removeprefix("torch.")


def parameter_aliases(model: nn.Module) -> dict[str, str]:
    """Second names of shared parameters (``state_dict`` lists each name), mapped to the name the layout uses."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _signature(engine: Stateful) -> dict[str, Any]:
    return {
        "layout": layout_record(engine),
        "optimizer": engine.rule.name if engine.rule else None,
        "state_directories": len(_state_dirs(engine)),
        "state_precision": _precision(engine),
    }


def planned_signature(rule: str | None, precision: str, layout: Layout, frozen_layout: Layout) -> dict[str, Any]:
    """What set-up knows of its engine's signature before anything is written: enough to tell whether a checkpoint
    can be re-cut onto it (``signature_differences(exact=False)``)."""
    frozen = [[s.name, list(s.shape)] for b in frozen_layout.streamed for s in b.slots]
    return {"layout": {**blocks_record(layout), **({"frozen": frozen} if frozen else {})}, "optimizer": rule,
            "state_directories": 0, "state_precision": precision if rule else FP32}  # fmt: skip


def refuse_unmappable(manifest: Manifest, current: dict[str, Any]) -> None:
    """Fail, in one line naming what differs, where ``manifest``'s state cannot be restored onto ``current``."""
    differences = signature_differences(saved_parts(manifest)[0][1]["signature"], current, exact=False)
    if differences:
        raise ConfigError(
            f"checkpoint {manifest.path} was written with another configuration: {'; '.join(differences)}; "
            "resume with the configuration it was saved with"
        )


def _precision(engine: Stateful) -> str:
    """``offload.state_precision`` of the engine's optimizer state (fp32 where the updater has no other)."""
    return str(getattr(engine.updater, "precision", FP32))


def signature_differences(saved: dict[str, Any], current: dict[str, Any], exact: bool = True) -> list[str]:
    """What differs between a checkpoint's signature and this engine's, in the user's terms (empty: they match).
    ``exact=False``: only what keeps the state from being re-cut onto this engine's layout (engine/relayout.py):
    another rank count, subgroup size or number of state directories is then no difference."""
    found = []
    if saved["optimizer"] != current["optimizer"]:
        found.append(f"optimizer {saved['optimizer']} (this run: {current['optimizer']})")
    saved_precision = saved.get("state_precision", FP32)  # written before 8-bit state: fp32
    if saved_precision != current["state_precision"]:
        found.append(f"offload.state_precision={saved_precision} (this run: {current['state_precision']}; a "
                     "resume keeps the state's precision)")  # fmt: skip
    elif saved["layout"].get("fp32_state") != current["layout"].get("fp32_state"):
        found.append("other parameters keeping fp32 state beside the 8-bit state (offload.min_8bit_size, "
                     "offload.fp32_embedding_state; a checkpoint written before those keys quantized every parameter)")
    if exact and saved["state_directories"] != current["state_directories"]:
        found.append(f"{saved['state_directories']} state directories, one per update device or offload.nvme_path "
                     f"entry (this run: {current['state_directories']})")  # fmt: skip
    old, new = saved["layout"], current["layout"]
    old_params = {p[0]: p[3] for b in old["blocks"] for p in b["params"]}
    new_params = {p[0]: p[3] for b in new["blocks"] for p in b["params"]}
    if old_params != new_params:
        changed = sorted(n for n in old_params.keys() & new_params.keys() if old_params[n] != new_params[n])
        only_old = sorted(old_params.keys() - new_params.keys())
        only_new = sorted(new_params.keys() - old_params.keys())
        parts = [f"{n} {old_params[n]} (this run: {new_params[n]})" for n in changed[:3]]
        if only_old:
            parts.append(f"{len(only_old)} parameter(s) this model lacks, e.g. {only_old[0]}")
        if only_new:
            parts.append(f"no values for {len(only_new)} parameter(s) of this model, e.g. {only_new[0]}")
        found.append("another model: " + ", ".join(parts))
    elif exact and old != new:
        found.append(f"{len(old['subgroups'])} subgroups (this run: {len(new['subgroups'])}): another "
                     "offload.subgroup_size or another parameter order")  # fmt: skip
    elif not exact:
        found += mappable(old, new)
        if old.get("frozen", []) != new.get("frozen", []):
            found.append("other frozen parameters in the streamed blocks")
    return found


def module_state(engine: Stateful, module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s state dict less the parameters whose fp32 masters the engine holds (a checkpoint saves those as
    the engine's files): its buffers and the frozen parameters outside the streamed blocks."""
    owned = {id(slot.param) for slot in owned_slots(engine.layout, engine.frozen_layout)}
    trained = {name for name, p in module.named_parameters(remove_duplicate=False) if id(p) in owned}
    return {k: v for k, v in module.state_dict().items() if k not in trained}


def engine_nbytes(engine: Stateful) -> int:
    """Bytes a checkpoint of the engine's state takes."""
    compressor = engine.compressor
    residuals = sum(compressor.residual_bytes.values()) if compressor is not None else 0
    in_ram = sum(tensor.numel() for _, tensor, _ in _ram_tensors(engine))
    return (sum(live.stat().st_size for _, live, _ in state_files(engine)) + residuals + in_ram
            + frozen_nbytes(engine.frozen))  # fmt: skip


@dataclass
class EngineSnapshot:
    """The engine's state as of one step boundary, to be written while training goes on: the state files and
    in-memory state tensors are still live, each subgroup held by the fence until its copy is made; the rest
    (residuals, counters, layout) is captured here."""

    files: list[tuple[str, Path, str]]
    """(subgroup key, live file, path inside the checkpoint) of each state file."""
    sums: dict[Path, WrittenSum]
    """What the run wrote to each live file, as of the snapshot: each copy is checked against it."""
    tensors: list[tuple[str, torch.Tensor, str]]
    """(subgroup key, live host tensor, path inside the checkpoint) of the state held in host memory."""
    blobs: dict[str, bytes]
    meta: dict[str, Any]
    hold: FenceHold
    frozen: ParamStreamer | None = None
    """The streamed blocks' frozen parameters (a LoRA base), copied from their store into ``frozen/``: they never
    change, so the copy needs no fence."""

    @property
    def nbytes(self) -> int:
        return (sum(live.stat().st_size for _, live, _ in self.files) + sum(len(b) for b in self.blobs.values())
                + sum(t.numel() for _, t, _ in self.tensors) + frozen_nbytes(self.frozen))  # fmt: skip


def frozen_nbytes(frozen: ParamStreamer | None) -> int:
    """Bytes the frozen parameters of the streamed blocks take in a checkpoint."""
    return sum(sg.numel for sg in frozen.layout.subgroups) * frozen.itemsize if frozen is not None else 0


def _write_frozen(frozen: ParamStreamer, writer: CheckpointWriter, prefix: str) -> None:
    """Each frozen subgroup, read from its store (disk or the RAM tier), into ``frozen/{key}``."""
    for sg in frozen.layout.subgroups:
        payload = sg.numel * frozen.itemsize
        raw = aligned_bytes(payload)
        frozen.store.read(FROZEN, sg.key, raw, payload).result()
        writer.write(f"{prefix}/{FROZEN}/{sg.key}", raw[:payload].numpy().data)


def take_snapshot(engine: Stateful) -> EngineSnapshot:
    """Snapshot the engine at a step boundary (waiting for an overlapped step): until ``write_snapshot`` has copied
    a subgroup's state (or ``hold.close()`` gives up), the next step waits before touching it."""
    engine.wait_step()
    files = state_files(engine)
    tensors = _ram_tensors(engine)
    blobs = {}
    compressor = engine.compressor
    if compressor is not None and compressor.has_state:
        buffer = io.BytesIO()
        torch.save(compressor.state_dict(), buffer)
        blobs[RESIDUALS] = buffer.getvalue()
    meta = {
        "signature": _signature(engine),
        "step_count": engine.step_count,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
        "param_dtype": str(engine.param_dtype).removeprefix("torch."),
    }
    sums = {live: written for _, live, _ in files if (written := engine.written(live)) is not None}
    hold = engine.fence.hold([key for key, _, _ in files] + [key for key, _, _ in tensors])
    return EngineSnapshot(files, sums, tensors, blobs, meta, hold, engine.frozen)


def write_snapshot(snapshot: EngineSnapshot, writer: CheckpointWriter, prefix: str) -> dict[str, Any]:
    """Write the snapshot into ``writer`` under ``prefix``, releasing each subgroup as its copy is made; return
    the metadata for the manifest. The files copy on the writer's threads; ``writer.finish()`` waits for them."""
    hold = snapshot.hold
    for key, live, relative in snapshot.files:
        copied = writer.copy(live, f"{prefix}/{relative}", snapshot.sums.get(live))
        copied.add_done_callback(lambda _, key=key: hold.done(key))  # type: ignore[misc]
    for key, tensor, relative in snapshot.tensors:
        writer.write(f"{prefix}/{relative}", tensor.numpy().data.cast("B"))
        hold.done(key)
    for relative, data in snapshot.blobs.items():
        writer.write(f"{prefix}/{relative}", data)
    if snapshot.frozen is not None:
        _write_frozen(snapshot.frozen, writer, prefix)
    return snapshot.meta


def load_engine_state(engine: Stateful, manifest: Manifest) -> int:
    """Restore a verified checkpoint's engine state: this rank's own files where the checkpoint was written with
    this engine's layout (the same ranks, subgroups and state directories), else every saved rank's state re-cut
    onto this layout (engine/relayout.py). Returns the number of ranks that saved it."""
    parts = saved_parts(manifest)
    layout = engine.layout
    current = _signature(engine)
    own = parts[layout.rank] if len(parts) == layout.world else None
    engine.wait_step()
    if own is not None and not signature_differences(own[1]["signature"], current):
        _copy_own(engine, manifest.path / own[0])
    else:
        refuse_unmappable(manifest, current)
        _relayout(engine, manifest, parts)
    _restore_frozen(engine, manifest, parts)
    meta = parts[0][1]
    engine.step_count = meta["step_count"]
    if engine.scaler is not None and meta["loss_scaler"]:
        engine.scaler.load_state_dict(meta["loss_scaler"])
    republish_params(engine)
    return len(parts)


def _copy_own(engine: Stateful, root: Path) -> None:
    """Copy this rank's saved files into place (the checkpoint has this engine's layout)."""
    tiered = _in_ram(engine)
    for kind, key, relative in _ram_entries(engine):
        assert tiered is not None
        if not (root / relative).is_file():  # saved before the first step: no optimizer state yet
            continue
        data = torch.frombuffer(bytearray((root / relative).read_bytes()), dtype=torch.uint8)
        tiered.host.write(kind, key, data, data.numel())
    in_ram = tiered.host_keys if tiered is not None else frozenset()
    copies = []
    for index, state_dir in enumerate(_state_dirs(engine)):
        for kind in _kinds(engine):
            (state_dir / kind).mkdir(parents=True, exist_ok=True)
            for sg in engine.layout.subgroups:
                saved = root / f"state{index}" / kind / sg.key
                if saved.is_file() and sg.key not in in_ram:
                    copies.append((saved, state_dir / kind / sg.key))
    with ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="smartinf-restore") as pool:
        records = list(pool.map(lambda pair: copy_file(pair[0], pair[1], replace=True, checksum=True), copies))
    # the files were replaced behind the stores' backs: later reads are checked against what the copies wrote
    sums = {live: WrittenSum(record.nbytes, record.checksum)
            for (_, live), record in zip(copies, records, strict=True) if record.checksum is not None}  # fmt: skip
    engine.replaced(sums)
    compressor = engine.compressor
    if compressor is not None and compressor.has_state:
        compressor.load_state_dict(torch.load(root / RESIDUALS, weights_only=True))


def _relayout(engine: Stateful, manifest: Manifest, parts: list[tuple[str, dict[str, Any]]]) -> None:
    """Assemble every subgroup of this engine's layout from the saved ranks' subgroups that overlap it, one
    subgroup at a time, into its state file (or its host-memory slot)."""
    saved = SavedLayout([(manifest.path / prefix, meta["signature"]["layout"]) for prefix, meta in parts])
    tiered = _in_ram(engine)
    in_ram = tiered.host_keys if tiered is not None else frozenset()
    directories = _state_dirs(engine)
    sums: dict[Path, WrittenSum] = {}
    for sg in engine.layout.subgroups:
        quantized = sg.precision != FP32  # saved alike: the same rule laid out the saved subgroups' precisions
        for kind in _kinds(engine):
            data = saved.assemble_quantized(sg, kind) if quantized and kind != MASTER else saved.assemble(sg, kind)
            if data is None:  # saved before the first step: no optimizer state yet
                continue
            if sg.key in in_ram:
                assert tiered is not None
                tiered.host.write(kind, sg.key, data, data.numel())
                continue
            target = directories[stripe_of(sg.key, len(directories))] / kind / sg.key
            sums[target] = write_state_file(target, data.numpy().data)
    engine.replaced(sums)
    compressor = engine.compressor
    if compressor is not None and compressor.has_state:
        tables = [_residual_tables(manifest.path / prefix / RESIDUALS) for prefix, _ in parts]
        mine = compressor.state_dict()
        by_index = {sg.index: sg for sg in engine.layout.subgroups}
        compressor.load_state_dict({
            name: {index: saved.residuals(name, by_index[index], like, tables) for index, like in table.items()}
            for name, table in mine.items()
        })  # fmt: skip


def _restore_frozen(engine: Stateful, manifest: Manifest, parts: list[tuple[str, dict[str, Any]]]) -> None:
    """Put the checkpoint's frozen parameters of the streamed blocks (a LoRA base) in place of those set-up took
    from the init route, re-cut for this layout: the resumed run trains on the base the checkpoint was trained on,
    whatever ``init_from`` or the module's own weights now hold. A checkpoint written before it held them leaves
    the init route's values."""
    frozen = engine.frozen
    records = [meta["signature"]["layout"].get("frozen_layout") for _, meta in parts]
    if frozen is None or any(record is None for record in records):
        return
    saved = SavedLayout([(manifest.path / prefix, record) for (prefix, _), record in zip(parts, records, strict=True)],
                        element_bytes=frozen.itemsize, pattern=f"{FROZEN}/sg*")  # fmt: skip
    frozen.release_all()
    writes = []
    for sg in engine.frozen_layout.subgroups:
        data = saved.assemble(sg, FROZEN)
        if data is None:
            raise CheckpointError(f"checkpoint {manifest.path} lists frozen parameters but holds no file of them")
        raw = aligned_bytes(data.numel())
        raw.copy_(data)
        writes.append((raw, frozen.store.write(FROZEN, sg.key, raw, sg.numel * frozen.itemsize)))
        if len(writes) >= 4:  # a few in flight, each buffer alive until its write is done
            writes.pop(0)[1].result()
    for _, write in writes:
        write.result()


def _residual_tables(path: Path) -> dict[str, Any]:
    """A saved rank's top-k residuals, memory-mapped (read as they are sliced); an older file holds residuals only."""
    state = torch.load(path, weights_only=True, mmap=True)
    if state and all(isinstance(key, int) for key in state):
        return {"residual": state}
    return dict(state)


def republish_params(engine: Stateful) -> None:
    """Rewrite every 16-bit parameter from its fp32 master (after the masters were restored)."""
    assert engine.updater is not None
    engine.wait_step()
    engine.params.release_all()
    for sg in engine.layout.subgroups:
        engine.params.store_update(sg, engine.updater.read_master(sg))
    engine.params.flush()
    engine.params.gather_resident()
