"""Kept graphs on storage: a block's saved activations written to disk as its forward ends, read back for backward.

Once the memory the host budget leaves holds no more kept graphs, a block's backward would recompute its forward: a
quarter more compute for it, and with nothing kept at all the step is 8/6 of the compute the bound counts. The disk
is seldom busy all the step (at GPT-350M, sequence 256, the state traffic of the overlapped step takes about 5 s of
a 13 s compute), so the graph is kept anyway with its saved tensors on storage: each (block, micro-batch) graph's
activation storages are packed into one page-aligned buffer when its forward ends, written through the engine's
store (O_DIRECT, checksummed under ``offload.verify_io``), and read back one block ahead of its backward. The bytes
are copied, not recomputed, so gradients equal the in-memory kept graph's bit for bit. Parameters a graph saved stay
references (``kept.py``); graph inputs and small tensors stay in memory.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lightning_smartinf import trace
from lightning_smartinf.storage.aligned import Allocator, align_up, typed_view
from lightning_smartinf.storage.store import TensorStore, done_future
from lightning_smartinf.trace import IO_CPU

log = logging.getLogger(__name__)

GRAPHS = "graphs"
SEGMENT_ALIGNMENT = 64
"""Byte alignment of each storage in a graph's buffer (any dtype's element, and the vector units')."""


@dataclass(frozen=True)
class Spilled:
    """A saved tensor whose storage went to disk: where it lies in its graph's buffer, and its view of it."""

    owner: GraphSpill
    key: tuple[int, int]
    segment: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    """The tensor's storage offset, in elements of ``dtype``."""

    def tensor(self) -> torch.Tensor:
        return self.owner.load(self)


PackFn = Callable[[torch.Tensor], "Spilled | None"]


@dataclass
class _Graph:
    """One (block, micro-batch) graph's saved storages: held until ``flush``, then on disk, then read back."""

    sources: list[torch.Tensor] = field(default_factory=list)
    """Until the flush: one tensor per storage, viewing all of it as bytes."""
    offsets: list[int] = field(default_factory=list)
    devices: list[torch.device] = field(default_factory=list)
    nbytes: int = 0
    buffer: torch.Tensor | None = None
    write: Future[None] | None = None
    read: Future[None] | None = None
    loaded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Segments moved back to a GPU (on a CPU device, views of the buffer)."""


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """All of ``tensor``'s storage as a flat uint8 tensor (shares memory)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Buffers:
    """Reused page-aligned buffers by size (rounded to whole MiB): the engine's allocator may hand out page-locked
    memory, which is costly to get and must be freed explicitly. A buffer comes back when its write is done or its
    graph's backward is: autograd drops the tensors it unpacked from it when their backward node has run."""

    def __init__(self, allocator: Allocator) -> None:
        self._allocator = allocator
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = align_up(nbytes, 2**20)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return self._allocator.allocate(size)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append(buffer)

    def close(self) -> None:
        with self._lock:
            for buffers in self._free.values():
                for buffer in buffers:
                    self._allocator.free(buffer)
            self._free.clear()


class GraphSpill:
    """Saved activations of kept graphs on storage, keyed by (block position, micro-batch).

    ``packer(key, inputs)`` gives the pack function of one graph's forward (``kept.parameter_references`` calls it
    for every saved tensor that is not a parameter); ``flush(key)`` writes the graph once its forward is done;
    ``prefetch(keys)`` starts reads ahead of backward; ``release(key)`` after its backward; ``clear()`` between
    iterations. Writes in flight are bounded by ``in_flight`` bytes (the forward waits for the oldest beyond it)."""

    def __init__(self, store: TensorStore, allocator: Allocator, in_flight: int = 256 * 2**20) -> None:
        self.store, self.in_flight = store, in_flight
        self._buffers = _Buffers(allocator)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._writing: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()
        self.written = 0
        """Bytes written since construction (one graph's payload each)."""

    def packer(self, key: tuple[int, int], inputs: list[torch.Tensor]) -> PackFn:
        """The pack function of graph ``key``: a saved tensor whose storage is not one of ``inputs``' (they stay
        alive as the graph's leaves anyway) is held for the flush and replaced by a ``Spilled`` reference; anything
        else returns None (kept as it is). Small tensors go too: a graph is one request whatever its pieces."""
        graph = self._graphs.setdefault(key, _Graph())
        skip = {x.untyped_storage().data_ptr() for x in inputs}
        segments: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> Spilled | None:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in skip or not storage.nbytes() or tensor.layout != torch.strided:
                return None
            if ptr not in segments:
                segments[ptr] = len(graph.sources)
                graph.offsets.append(graph.nbytes)
                graph.devices.append(tensor.device)
                graph.sources.append(_storage_bytes(tensor))
                graph.nbytes += align_up(storage.nbytes(), SEGMENT_ALIGNMENT)
            return Spilled(self, key, segments[ptr], tensor.dtype, tensor.size(), tensor.stride(),
                           int(tensor.storage_offset()))  # fmt: skip

        return pack

    def flush(self, key: tuple[int, int]) -> None:
        """Graph ``key``'s forward is done: copy its storages into one buffer and write it (the forward's
        activations are freed as the copy ends); waits for the oldest writes beyond ``in_flight`` bytes."""
        graph = self._graphs.get(key)
        if graph is None or not graph.sources:
            return
        buffer = self._buffers.acquire(graph.nbytes)
        with trace.span("copy graph", IO_CPU, bytes=graph.nbytes):
            for offset, source in zip(graph.offsets, graph.sources, strict=True):
                buffer[offset : offset + source.numel()].copy_(source)
        graph.sources.clear()
        graph.buffer = buffer
        graph.write = self.store.write(GRAPHS, _name(key), buffer, graph.nbytes)
        self.written += graph.nbytes
        self._writing.append(key)
        self._reap(self.in_flight)

    def _reap(self, limit: int) -> None:
        """Hand back the buffers of finished writes, waiting for the oldest while more than ``limit`` bytes are
        still being written."""
        while self._writing:
            graph = self._graphs.get(self._writing[0])
            if graph is None or graph.write is None or graph.read is not None:
                self._writing.popleft()
                continue
            pending = sum(self._graphs[k].nbytes for k in self._writing if k in self._graphs)
            if not graph.write.done() and pending <= limit:
                return
            graph.write.result()
            assert graph.buffer is not None
            self._buffers.release(graph.buffer)
            graph.buffer = None
            self._writing.popleft()

    def prefetch(self, keys: list[tuple[int, int]], urgent: bool = False) -> None:
        """Start reading the graphs ``keys`` back (each once; a graph still being written is waited for)."""
        for key in keys:
            with self._lock:
                graph = self._graphs.get(key)
                if graph is None or graph.read is not None or graph.write is None:
                    continue
                graph.write.result()
                if graph.buffer is None:  # its write buffer went back: read into another
                    graph.buffer = self._buffers.acquire(graph.nbytes)
                    graph.read = self.store.read(GRAPHS, _name(key), graph.buffer, graph.nbytes, urgent)
                else:  # still holding the bytes it wrote: no read needed
                    graph.read = done_future()

    def load(self, saved: Spilled) -> torch.Tensor:
        """The saved tensor, from its graph's buffer (read now if no prefetch started it)."""
        graph = self._graphs[saved.key]
        if graph.read is None:
            self.prefetch([saved.key], urgent=True)
        assert graph.read is not None and graph.buffer is not None
        graph.read.result()
        with self._lock:
            segment = graph.loaded.get(saved.segment)
            if segment is None:
                start = graph.offsets[saved.segment]
                end = graph.offsets[saved.segment + 1] if saved.segment + 1 < len(graph.offsets) else graph.nbytes
                segment = graph.buffer[start:end]
                if graph.devices[saved.segment].type != "cpu":
                    segment = segment.to(graph.devices[saved.segment])
                graph.loaded[saved.segment] = segment
        typed = typed_view(segment, saved.dtype, segment.numel() // saved.dtype.itemsize)
        return typed.as_strided(saved.size, saved.stride, typed.storage_offset() + saved.offset)

    def release(self, key: tuple[int, int]) -> None:
        """Graph ``key``'s backward is done: its buffer may serve another graph."""
        with self._lock:
            graph = self._graphs.pop(key, None)
        if graph is None:
            return
        graph.loaded.clear()
        try:  # a failed request is over too: its buffer may go back either way
            if graph.read is not None:
                graph.read.result()
            elif graph.write is not None:
                graph.write.result()
        finally:
            if graph.buffer is not None:
                self._buffers.release(graph.buffer)

    def clear(self) -> None:
        """Drop every graph (the end of an iteration, or a failed one): outstanding I/O is waited for first."""
        errors = []
        for key in list(self._graphs):
            try:
                self.release(key)
            except OSError as err:  # a failed read of a graph nobody needs any more
                errors.append(err)
        self._writing.clear()
        if errors:
            log.warning("smart_infinity: %d kept-graph request(s) failed after their graphs were dropped: %s",
                        len(errors), errors[0])  # fmt: skip

    def close(self) -> None:
        self.clear()
        self._buffers.close()


def _name(key: tuple[int, int]) -> str:
    return f"b{key[0]}m{key[1]}"
