"""Checks on a state directory before anything is written to it: it exists, is writable, and has room."""

from __future__ import annotations

import shutil
from pathlib import Path


def prepare_directory(path: Path, needed: int, check_space: bool) -> None:
    """Create ``path`` and make sure it can hold ``needed`` bytes, failing before anything is written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"offload.nvme_path={str(path)!r} cannot be created: {err.strerror}") from err
    probe = path / ".smartinf_write_probe"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise PermissionError(
            f"offload.nvme_path={str(path)!r} is not writable ({err.strerror}); point it at a directory you own"
        ) from err
    if not check_space:
        return
    reusable = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    free = shutil.disk_usage(path).free + reusable
    if needed > free:
        raise OSError(
            f"offload.nvme_path={str(path)!r} has {free / 2**30:.2f} GiB free but the offloaded state needs "
            f"{needed / 2**30:.2f} GiB: free space, choose another path, or set offload.params=cpu / "
            "offload.grads=cpu to keep those in host memory"
        )
