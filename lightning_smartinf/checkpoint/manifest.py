"""Checkpoint directories that are either complete and intact or not taken at all.

Writing: every file goes into a hidden staging directory beside the target (``.NAME.partial-PID``), hashed and
fsynced as it is written; then ``manifest.json`` (every file's size and SHA-256, plus the caller's metadata, plus
its own hash) is written and fsynced, and only then is the staging directory renamed to the target. A process
killed at any moment leaves either the previous checkpoint or the new one under the target's name, never a mix.

Reading: the manifest and every file's size and hash are checked before anything is loaded; a missing, truncated
or altered file is reported by name. A target that vanished in the one window where an existing checkpoint is
being replaced (between its two renames) is recovered from the complete staging or replaced directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from lightning_smartinf.checkpoint.files import (
    FULL_ERRNOS,
    FileRecord,
    copy_file,
    disk_full,
    free_bytes,
    fsync_directory,
    hash_file,
    write_chunks,
)
from lightning_smartinf.errors import SmartInfError
from lightning_smartinf.storage.store import WrittenSum

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"  # what Lightning saves: loops, callbacks, hyper-parameters, module buffers
ENGINE_STATE = "offload"  # the engine's state files (engine/snapshot.py)
FORMAT = "smart_infinity-checkpoint"
VERSION = 1
COPY_THREADS = 4


class CheckpointError(SmartInfError, RuntimeError):
    """A path that is not a complete smart_infinity checkpoint."""


class CheckpointCorruptError(CheckpointError):
    """A complete checkpoint whose files no longer match their manifest."""


@dataclass
class Manifest:
    path: Path
    files: dict[str, FileRecord]
    meta: dict[str, Any]
    created: float

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.files.values())


def _newest_published(directory: Path) -> Path | None:
    """The published checkpoint (a directory with a manifest) under ``directory`` written last, for messages."""
    published = [d for d in directory.iterdir() if not d.name.startswith(".") and (d / MANIFEST).is_file()]
    return max(published, key=lambda d: (d / MANIFEST).stat().st_mtime, default=None)


def _staging_name(target: Path) -> Path:
    return target.parent / f".{target.name}.partial-{os.getpid()}"


def _replaced_name(target: Path) -> Path:
    return target.parent / f".{target.name}.replaced-{os.getpid()}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _body_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class CheckpointWriter:
    """Builds one checkpoint directory; ``publish`` makes it visible, leaving the ``with`` block otherwise removes
    the staging directory and keeps whatever was at the target before.

    Data parallel: rank 0's writer owns the staging directory; the other ranks join it (``staging=``), write their
    own files, and hand the records of ``finish()`` to rank 0, which ``add``s them before publishing."""

    def __init__(self, target: Path, nbytes: int, staging: Path | None = None) -> None:
        self.target = target.absolute()
        self.nbytes = nbytes
        self.owner = staging is None
        if staging is None:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            _clean_leftovers(self.target.parent, recover=False)
            staging = _staging_name(self.target)
            _remove(staging)
            if free_bytes(self.target.parent) < nbytes:
                raise disk_full(self.target, nbytes, "the checkpoint", _newest_published(self.target.parent))
            staging.mkdir()
        self.staging = staging
        self.files: dict[str, FileRecord] = {}
        self._pending: dict[str, Future[FileRecord]] = {}
        self._pool = ThreadPoolExecutor(max_workers=COPY_THREADS, thread_name_prefix="smartinf-ckpt")
        self._directories: set[Path] = {self.staging}
        self._started = time.perf_counter()
        self.seconds = 0.0

    def _destination(self, relative: str) -> Path:
        path = self.staging / relative
        if path.parent not in self._directories:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._directories.add(path.parent)
        return path

    def copy(self, source: Path, relative: str, expect: WrittenSum | None = None) -> Future[FileRecord]:
        """Copy ``source`` to ``relative`` inside the checkpoint (in a background thread), its bytes checked against
        ``expect`` (what the run wrote to it); done once copied."""
        future = self._pool.submit(copy_file, source, self._destination(relative), False, expect)
        self._pending[relative] = future
        return future

    def write(self, relative: str, data: bytes | memoryview) -> None:
        self.files[relative] = self._checked(lambda: write_chunks(self._destination(relative), [data]))

    def _checked(self, work: Any) -> Any:
        try:
            return work()
        except OSError as err:
            if err.errno in FULL_ERRNOS:
                kept = _newest_published(self.target.parent)
                raise disk_full(self.target, self.nbytes, "the checkpoint", kept) from err
            raise

    def finish(self) -> dict[str, FileRecord]:
        """Wait for every file this writer queued and make its directories durable; the records of all files."""
        for relative, future in self._pending.items():
            self.files[relative] = self._checked(future.result)
        self._pending.clear()
        for directory in sorted(self._directories, key=lambda p: -len(p.parts)):
            fsync_directory(directory)
        return dict(self.files)

    def add(self, files: dict[str, FileRecord]) -> None:
        """Records of files another rank wrote into this staging directory (its ``finish()``)."""
        self.files.update(files)

    def publish(self, meta: dict[str, Any]) -> Manifest:
        """Wait for every file, write the manifest, and rename the staging directory onto the target."""
        self.finish()
        created = time.time()
        body = {
            "format": FORMAT,
            "version": VERSION,
            "created": created,
            "files": {k: {"bytes": r.nbytes, "sha256": r.sha256} for k, r in sorted(self.files.items())},
            "meta": meta,
        }
        text = json.dumps({**body, "manifest_sha256": _body_hash(body)}, indent=1)
        self._checked(lambda: write_chunks(self.staging / MANIFEST, [text.encode()]))
        fsync_directory(self.staging)
        self._swap_into_place()
        self.seconds = time.perf_counter() - self._started
        return Manifest(self.target, dict(self.files), meta, created)

    def _swap_into_place(self) -> None:
        replaced = None
        if self.target.exists() or self.target.is_symlink():
            replaced = _replaced_name(self.target)
            _remove(replaced)
            os.rename(self.target, replaced)
        os.rename(self.staging, self.target)
        fsync_directory(self.target.parent)
        if replaced is not None:
            _remove(replaced)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        if err is not None and self.owner:
            _remove(self.staging)


def _read_manifest(path: Path) -> Manifest:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete smart_infinity checkpoint: it has no {MANIFEST} (a save that never "
            "finished, or not a checkpoint); resume from another one"
        )
    try:
        raw = json.loads(manifest_path.read_text())
        claimed = raw.pop("manifest_sha256")
        intact = raw.get("format") == FORMAT and claimed == _body_hash(raw)
    except (ValueError, KeyError, AttributeError, UnicodeDecodeError):
        intact = False
    if not intact:
        raise CheckpointCorruptError(f"checkpoint {path} is damaged and was not loaded: {MANIFEST} is altered")
    if raw["version"] > VERSION:
        raise CheckpointError(f"{path} was written by a newer lightning-smartinf (format {raw['version']})")
    files = {k: FileRecord(v["bytes"], v["sha256"]) for k, v in raw["files"].items()}
    return Manifest(path, files, raw["meta"], raw["created"])


def _recover(target: Path) -> None:
    """Put back a checkpoint that a killed save left under its staging or replaced name."""
    candidates = sorted(target.parent.glob(f".{target.name}.partial-*")) + sorted(
        target.parent.glob(f".{target.name}.replaced-*")
    )
    for candidate in candidates:
        try:
            _read_manifest(candidate)
        except CheckpointError:
            continue
        os.rename(candidate, target)
        fsync_directory(target.parent)
        log.warning("recovered checkpoint %s from %s (a save was killed while publishing it)", target, candidate)
        for older in target.parent.glob(f".{target.name}.replaced-*"):
            _remove(older)
        return


_HASHED: dict[tuple[str, int, int, int], str] = {}
"""SHA-256 of the files this process has hashed, by (path, size, mtime, inode): choosing the checkpoint to resume
from and then loading it read each file once, not twice (for a large model, that is most of the resume time)."""


def _sha256(file: Path, stat: os.stat_result) -> str:
    key = (str(file), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in _HASHED:
        if len(_HASHED) > 1 << 16:
            _HASHED.clear()
        _HASHED[key] = hash_file(file).sha256
    return _HASHED[key]


def verify_checkpoint(path: Path, select: Callable[[Manifest, str], bool] | None = None) -> Manifest:
    """The checkpoint's manifest, after checking every file's size and SHA-256 (or those ``select(manifest,
    relative path)`` keeps: a rank checks its own slice, not the others'); raises naming each bad file."""
    path = path.absolute()
    if not path.exists():
        _recover(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a smart_infinity checkpoint directory")
    manifest = _read_manifest(path)
    problems: list[str] = []

    def check(relative: str, record: FileRecord) -> str | None:
        file = path / relative
        if not file.is_file():
            return f"{relative}: missing"
        stat = file.stat()
        if stat.st_size != record.nbytes:
            change = "truncated" if stat.st_size < record.nbytes else "grown"
            return f"{relative}: {change} ({stat.st_size} bytes, {record.nbytes} written)"
        if _sha256(file, stat) != record.sha256:
            return f"{relative}: contents altered (SHA-256 mismatch)"
        return None

    with ThreadPoolExecutor(max_workers=COPY_THREADS) as pool:
        chosen = [item for item in manifest.files.items() if select is None or select(manifest, item[0])]
        for problem in pool.map(lambda item: check(*item), chosen):
            if problem:
                problems.append(problem)
    if problems:
        raise CheckpointCorruptError(
            f"checkpoint {path} is damaged and was not loaded: {'; '.join(problems)}; resume from another checkpoint"
        )
    return manifest


def _step_of(entry: Path, manifest: Manifest | None) -> tuple[int, float]:
    """Sort key of a candidate: its step (from the manifest, else from a ``stepN`` name) and its time."""
    if manifest is not None:
        return int(manifest.meta.get("global_step", 0)), manifest.created
    digits = re.search(r"step(\d+)", entry.name)
    return (int(digits.group(1)) if digits else -1), entry.stat().st_mtime


def _clean_leftovers(directory: Path, recover: bool = True) -> None:
    """Staging and replaced directories of saves whose process is gone: with ``recover``, a checkpoint that a kill
    left under such a name is first put back (``_recover``) and every other one removed; without (a new save
    starting), only the unfinished ones (no manifest) are removed."""
    for hidden in directory.glob(".*.*-*"):
        name, _, suffix = hidden.name[1:].rpartition(".")
        kind, _, pid = suffix.partition("-")
        if kind not in ("partial", "replaced") or not pid.isdigit():
            continue
        if recover and not (directory / name).exists():
            _recover(directory / name)
        if hidden.exists() and not _pid_alive(int(pid)) and (recover or not (hidden / MANIFEST).is_file()):
            log.warning("removing %s, left by a save of %s whose process (%s) is gone", hidden, name, pid)
            _remove(hidden)


def choose_checkpoint(directory: Path) -> tuple[Manifest | None, list[tuple[Path, str]]]:
    """The newest complete and intact checkpoint under ``directory`` (every file's hash checked), and each newer
    candidate that was skipped with the reason: a missing or altered manifest, a missing, truncated or altered
    file. Leftovers of killed saves are recovered or removed first; a directory with no manifest (a save or a
    removal that was killed) is reported, never deleted. Each skip is logged as a warning."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        return None, []
    _clean_leftovers(directory)
    candidates: list[tuple[tuple[int, float], Path, Manifest | None, str]] = []
    for entry in directory.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        manifest, reason = None, ""
        try:
            manifest = _read_manifest(entry)
        except CheckpointError as err:
            reason = str(err)
        candidates.append((_step_of(entry, manifest), entry, manifest, reason))
    skipped: list[tuple[Path, str]] = []
    for _, entry, manifest, reason in sorted(candidates, key=lambda c: c[0], reverse=True):
        if manifest is not None:
            try:
                return verify_checkpoint(entry), skipped
            except CheckpointError as err:
                reason = str(err)
        log.warning("skipping %s, newer than any intact checkpoint here: %s", entry, " ".join(reason.split()))
        skipped.append((entry, reason))
    return None, skipped


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete and intact checkpoint under ``directory`` (``choose_checkpoint``), or None."""
    chosen, skipped = choose_checkpoint(directory)
    if chosen is not None and skipped:
        log.warning("resuming from %s, the newest intact checkpoint (%d newer skipped)", chosen.path, len(skipped))
    return chosen.path if chosen is not None else None
