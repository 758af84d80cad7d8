"""Checks on a state directory before anything is written to it: it exists, is writable, and has room."""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning_smartinf.errors import NotWritableError, StorageError


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def prepare_directory(path: Path, needed: int, check_space: bool, key: str = "offload.nvme_path") -> None:
    """Create ``path`` (the value of config key ``key``) and make sure it can hold ``needed`` bytes, failing before
    anything is written."""
    blocker = next((p for p in (path, *path.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is" if blocker == path else f"lies under {str(blocker)!r}, which is"
        raise StorageError(f"{key}={str(path)!r} {what} a regular file, not a directory: point {key} at a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StorageError(f"{key}={str(path)!r} cannot be created: {err.strerror}") from err
    probe = path / ".smartinf_write_probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise NotWritableError(
            f"{key}={str(path)!r} is not writable ({err.strerror}); point it at a directory you own"
        ) from err
    if not check_space:
        return
    reusable = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    free = shutil.disk_usage(path).free + reusable
    if needed > free:
        raise StorageError(
            f"{key}={str(path)!r} has {human_bytes(free)} free but the offloaded state needs {human_bytes(needed)}: "
            "free space or choose another path (offload.params=cpu / offload.grads=cpu keep those in host memory)"
        )
