"""Page-aligned host buffers and a fixed pool of them.

O_DIRECT needs the buffer address, the length and the file offset aligned to the logical block size. torch's
allocator gives 64-byte alignment, so buffers come from anonymous ``mmap`` (page aligned) and are viewed as
tensors. The pool is allocated once; its size, not the model, bounds the engine's host memory.
"""

from __future__ import annotations

import mmap
import threading
from typing import Protocol

import torch

ALIGNMENT = 4096


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def aligned_bytes(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``align_up(nbytes)`` bytes, pinned for fast device copies when asked."""
    size = allocated_bytes(nbytes)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8, count=size)
    if pin and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        cudart.cudaHostRegister(tensor.data_ptr(), size, 0)
    return tensor


def typed_view(raw: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of a raw byte buffer, as ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return raw[: numel * itemsize].view(dtype)


class Allocator(Protocol):
    """Where I/O buffers come from. An I/O backend may have memory of its own that it reads and writes in place."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def free(self, buffer: torch.Tensor) -> None: ...


class PageAligned:
    """Anonymous page-aligned memory (``aligned_bytes``); the garbage collector frees it."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin

    def allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_bytes(nbytes, pin=self.pin)

    def free(self, buffer: torch.Tensor) -> None:
        pass


def allocated_bytes(nbytes: int) -> int:
    """Bytes an allocation of ``nbytes`` takes (``aligned_bytes``, ``PageLocked``): whole pages, at least one."""
    return max(align_up(nbytes), ALIGNMENT)


class BufferPool:
    """A fixed set of equally sized aligned buffers; ``acquire`` blocks until one is free (back-pressure)."""

    @staticmethod
    def planned_bytes(count: int, nbytes: int) -> int:
        """``total_bytes`` of a pool of ``count`` buffers of ``nbytes``, before it is made."""
        return count * align_up(nbytes)

    def __init__(self, count: int, nbytes: int, allocator: Allocator | None = None) -> None:
        if count < 1:
            raise ValueError(f"BufferPool needs at least one buffer, got count={count}")
        self.nbytes = align_up(nbytes)
        self._allocator = allocator or PageAligned()
        self._free = [self._allocator.allocate(self.nbytes) for _ in range(count)]
        self.count = count
        self._cond = threading.Condition()
        self._closed = False

    @property
    def total_bytes(self) -> int:
        return self.count * self.nbytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.nbytes:
            raise ValueError(f"request of {nbytes} bytes exceeds the pool's buffer size {self.nbytes}")
        with self._cond:
            while not self._free and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("this buffer pool was closed with its engine")
            return self._free.pop()

    def try_acquire(self) -> torch.Tensor | None:
        """A free buffer, or None at once when all are in use (for optional work such as prefetch)."""
        with self._cond:
            return self._free.pop() if self._free and not self._closed else None

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            if self._closed:  # handed back after close (a late write-back): free it now
                self._allocator.free(buffer)
                return
            self._free.append(buffer)
            self._cond.notify()

    @property
    def available(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        """Return the buffers to their allocator. Call when none is in use any more; one still out is left to
        leak rather than be freed under its user."""
        with self._cond:
            free, self._free = self._free, []
            self._closed = True
            self._cond.notify_all()
        for buffer in free:
            self._allocator.free(buffer)
