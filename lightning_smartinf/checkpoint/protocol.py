"""The checkpoint protocol a strategy follows: save on one rank or many, verify before loading, unpublish before
deleting. What goes into the directory comes from the caller (``write_state``), so this layer knows files and ranks,
not the engine; collectives are torch.distributed's, used only with more than one rank."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_smartinf.checkpoint.files import fsync_directory
from lightning_smartinf.checkpoint.manifest import (
    ENGINE_STATE,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    CheckpointWriter,
    Manifest,
    verify_checkpoint,
)
from lightning_smartinf.storage.space import human_bytes

log = logging.getLogger(__name__)

WriteState = Callable[[CheckpointWriter, str], dict[str, Any]]
"""Writes a rank's offloaded state under a prefix of the writer's directory; returns what to record of it."""


def _broadcast(obj: Any, group: Any) -> Any:
    holder = [obj]
    dist.broadcast_object_list(holder, 0, group=group)
    return holder[0]


def save(target: Path, trainer_state: bytes, step: int, nbytes: int, write_state: WriteState, rank: int = 0,
         world: int = 1, group: Any = None) -> tuple[Manifest | None, float]:  # fmt: skip
    """Write checkpoint ``target`` (``nbytes``: this rank's state) so that it appears under that name only once
    complete on every rank; return its manifest (on rank 0; None elsewhere) and the seconds it took. ``group``:
    the process group of the save's collectives (a save on a background thread needs one of its own)."""
    if world == 1:
        with CheckpointWriter(target, nbytes + len(trainer_state)) as writer:
            writer.write(TRAINER_STATE, trainer_state)
            engine = write_state(writer, ENGINE_STATE)
            manifest = writer.publish({"engine": engine, "global_step": step})
        return manifest, writer.seconds
    return _save_partitioned(target, trainer_state, step, nbytes, write_state, rank, world, group)


def _save_partitioned(target: Path, trainer_state: bytes, step: int, nbytes: int, write_state: WriteState,
                      rank: int, world: int, group: Any) -> tuple[Manifest | None, float]:  # fmt: skip
    """Every rank writes its slices under ``offload/rank{r}`` of rank 0's staging directory; rank 0 adds the
    trainer state and publishes once all ranks' files are durable (a shared filesystem, as DeepSpeed assumes).
    A failure on any rank fails the save on every rank and leaves the previous checkpoint in place."""
    started = time.perf_counter()
    sizes: list[int] = [0] * world
    dist.all_gather_object(sizes, nbytes, group=group)
    writer: CheckpointWriter | None = None
    opened: tuple[Path | None, str | None] = (None, None)
    if rank == 0:
        try:
            writer = CheckpointWriter(target, sum(sizes) + len(trainer_state))
            opened = (writer.staging, None)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            opened = (None, f"{type(err).__name__}: {err}")
    staging, failure = _broadcast(opened, group)
    if staging is None:
        raise CheckpointError(f"rank 0 could not start checkpoint {target}: {failure}")
    part = writer or CheckpointWriter(target, sizes[rank], staging=staging)
    result: tuple[Any, Any, str | None] = (None, None, None)
    try:
        meta = write_state(part, f"{ENGINE_STATE}/rank{rank}")
        result = (part.finish(), meta, None)
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        result = (None, None, f"rank {rank}: {type(err).__name__}: {err}")
    results: list[Any] = [None] * world
    dist.all_gather_object(results, result, group=group)
    failures = [r[2] for r in results if r[2] is not None]
    with part:
        if failures:
            raise CheckpointError(f"checkpoint {target} not written; the previous one is kept: {'; '.join(failures)}")
        manifest = None
        if writer is not None:
            writer.write(TRAINER_STATE, trainer_state)
            for files, _, _ in results[1:]:
                writer.add(files)
            manifest = writer.publish({"ranks": [r[1] for r in results], "world_size": world, "global_step": step})
    dist.barrier(group=group)  # the checkpoint exists for every rank once save returns
    return manifest, time.perf_counter() - started


def remove(path: Path) -> None:
    """Unpublish first (drop the manifest), then delete: a kill halfway leaves no half checkpoint that looks
    complete."""
    (path / MANIFEST).unlink(missing_ok=True)
    if path.is_dir():
        fsync_directory(path)
    shutil.rmtree(path, ignore_errors=True)


def open_checkpoint(path: Path, rank: int = 0, world: int = 1) -> Manifest:
    """Verify every file this rank will read against the manifest: the shared ones and its own slice where the
    checkpoint was written by ``world`` ranks; every rank's slices where it was written by another number of ranks
    (a restore then re-partitions them: engine/relayout.py)."""
    started = time.perf_counter()
    mine, others = f"{ENGINE_STATE}/rank{rank}/", f"{ENGINE_STATE}/rank"

    def read_here(saved: Manifest, relative: str) -> bool:
        same = saved.meta.get("world_size", 1) == world
        return not same or relative.startswith(mine) or not relative.startswith(others)

    manifest = verify_checkpoint(path, read_here)
    saved_world = manifest.meta.get("world_size", 1)
    part = "this rank's slice and the shared files" if saved_world == world > 1 else f"{len(manifest.files)} files"
    log.info(
        "smart_infinity: verified %s of %s (%s in all) in %.2f s", part, manifest.path,
        human_bytes(manifest.nbytes), time.perf_counter() - started,
    )  # fmt: skip
    if saved_world != world:
        log.info("smart_infinity: %s was written by %d rank(s); this run has %d: its state is re-partitioned as it "
                 "is restored", manifest.path, saved_world, world)  # fmt: skip
    return manifest


def saved_parts(manifest: Manifest) -> list[tuple[str, dict[str, Any]]]:
    """Where each saved rank's offloaded state lies in the checkpoint, and what was recorded of it."""
    if "ranks" in manifest.meta:
        return [(f"{ENGINE_STATE}/rank{r}", meta) for r, meta in enumerate(manifest.meta["ranks"])]
    return [(ENGINE_STATE, manifest.meta["engine"])]
