"""How much host memory this process may still use: the machine's available memory, or less under a cgroup limit
(v1 ``memory.limit_in_bytes`` or v2 ``memory.max``), since a container's limit is what the kernel enforces; and
giving freed heap memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from pathlib import Path

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_headroom(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Limit minus usage of the tightest memory cgroup this process is in, or None without a limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):  # v1
            base = root / "memory" / relative
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        elif hierarchy == "0" and not controllers:  # v2 (unified)
            base = root / relative if (root / "cgroup.controllers").exists() else root / "unified" / relative
            files = ("memory.max", "memory.current")
        else:
            continue
        try:
            limit_text = (base / files[0]).read_text().strip()
            usage = int((base / files[1]).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 writes "no limit" as a huge number
            continue
        found.append(int(limit_text) - usage)
    return max(min(found), 0) if found else None


def host_available_bytes() -> int:
    """Bytes of host memory this process can still take without swapping or meeting its cgroup's limit."""
    available = int(psutil.virtual_memory().available)
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None  # glibc only
    return trim  # type: ignore[no-any-return]


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing). After glibc frees
    one large block it raises its mmap threshold to that size, so the next blocks of that size come from the heap,
    whose freed pages it keeps: a loop over same-sized blocks (set-up, one block at a time) then grows the process
    by a few blocks at random. Trimming after each block keeps it at one."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
