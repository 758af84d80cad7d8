"""Asynchronous file I/O backends: DeepSpeed's async I/O op (libaio, O_DIRECT) or a thread pool of pread/pwrite.

Both take page-aligned uint8 buffers whose length is a multiple of 4096 and return futures, so the layers above
overlap I/O with compute without knowing which backend runs. Each worker thread owns its own DeepSpeed handle:
``sync_pread``/``sync_pwrite`` release the GIL, and a handle serialises its requests behind one mutex.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import os
import queue
import resource
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from lightning_smartinf.errors import ConfigError, SetupError, ShortReadError, StorageError
from lightning_smartinf.extras import available, missing
from lightning_smartinf.ops import load_op
from lightning_smartinf.storage.aligned import ALIGNMENT, Allocator, PageAligned, align_up, aligned_bytes
from lightning_smartinf.trace import traced_io

log = logging.getLogger(__name__)


def bytes_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview over a uint8 CPU tensor, for os.preadv/pwritev."""
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]


class IOBackend(Protocol):
    name: str
    direct: bool
    allocator: Allocator

    def read(self, path: Path, buffer: torch.Tensor, urgent: bool = False) -> Future[None]:
        """Fill ``buffer`` from ``path``; ``urgent`` requests are served before every queued non-urgent one."""
        ...

    def write(self, path: Path, buffer: torch.Tensor) -> Future[None]: ...

    def close(self) -> None: ...


class RequestQueue:
    """Worker threads serving I/O requests urgent first, in submission order within each class.

    Compute waits on a few reads (a block's parameters, a checkpoint) while the optimizer step keeps a long queue of
    state reads and writes in flight; a plain FIFO pool would put those few behind the step's whole queue. Workers are
    daemon threads, so a queue nobody closed cannot hold the interpreter open; each open queue registers its own
    ``close`` to run at exit (as ``concurrent.futures`` drains its pools), so a write already submitted is not lost."""

    _URGENT, _NORMAL, _STOP = 0, 1, 2

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Future[None] | None, Callable[[], None] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        self._closed = False
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    def submit(self, work: Callable[[], None], urgent: bool) -> Future[None]:
        future: Future[None] = Future()
        self._queue.put((self._URGENT if urgent else self._NORMAL, next(self._order), future, work))
        return future

    def _serve(self) -> None:
        while True:
            _, _, future, work = self._queue.get()
            if future is None or work is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)
            else:
                future.set_result(None)

    def close(self) -> None:
        """Serve everything queued, then stop the workers (once; later calls return at once)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for _ in self._threads:
            self._queue.put((self._STOP, next(self._order), None, None))
        for thread in self._threads:
            thread.join()


def supports_o_direct(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (tmpfs and some overlay filesystems cannot)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".o_direct_probe_{uuid.uuid4().hex}"
    buffer = aligned_bytes(ALIGNMENT)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, bytes_view(buffer), 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def io_error(err: OSError, action: str, path: Path, nbytes: int) -> StorageError:
    """``err`` restated with what was being done: ``action`` ("writing"/"reading"), the bytes and the path, the
    errno by name, and for a full disk what to do."""
    name = errno.errorcode.get(err.errno or 0, "error")
    hint = ": free space there or point offload.nvme_path at a larger disk" if err.errno == errno.ENOSPC else ""
    return StorageError(err.errno, f"{action} {nbytes} bytes {'to' if action == 'writing' else 'from'} {path} "
                                f"failed: {err.strerror or err} ({name}){hint}")  # fmt: skip


class ShortTransfer(StorageError):
    """A read or write that moved fewer bytes than asked, already named with its path and counts."""


def short_transfer(action: str, path: Path, done: int, nbytes: int) -> ShortTransfer:
    return ShortTransfer(errno.EIO, f"{action} {nbytes} bytes {'to' if action == 'writing' else 'from'} {path} stopped "
                              f"at {done} bytes (EIO): the storage under it is failing or full")  # fmt: skip


def check_readable(path: Path, nbytes: int) -> None:
    """A read of ``nbytes`` from ``path`` must find them all: a short file is an error, never zeros."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise io_error(err, "reading", path, nbytes) from err
    if size < nbytes:
        raise ShortReadError(
            f"reading {nbytes} bytes from {path}: the file holds only {size} (truncated or never written)"
        )


class _QueuedBackend:
    """What both backends share: requests go through a ``RequestQueue`` to the subclass's blocking ``_read`` and
    ``_write``, which run on its worker threads."""

    _requests: RequestQueue

    def _read(self, path: Path, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def _write(self, path: Path, buffer: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, path: Path, buffer: torch.Tensor, urgent: bool = False) -> Future[None]:
        work = traced_io(lambda: self._read(path, buffer), "read", path, buffer.numel(), urgent)
        return self._requests.submit(work, urgent)

    def write(self, path: Path, buffer: torch.Tensor) -> Future[None]:
        work = traced_io(lambda: self._write(path, buffer), "write", path, buffer.numel(), False)
        return self._requests.submit(work, urgent=False)

    def close(self) -> None:
        self._requests.close()


class ThreadPoolIO(_QueuedBackend):
    """pread/pwrite from worker threads; O_DIRECT when the filesystem allows it, buffered otherwise."""

    def __init__(self, threads: int, direct: bool) -> None:
        self.direct = direct
        self.allocator: Allocator = PageAligned()
        self.name = f"threads(pread/pwrite{', O_DIRECT' if direct else ', buffered'}, {threads} threads)"
        self._requests = RequestQueue(threads, "smartinf-io")
        self._flag = os.O_DIRECT if direct else 0

    def _read(self, path: Path, buffer: torch.Tensor) -> None:
        view = bytes_view(buffer)
        try:
            fd = os.open(path, os.O_RDONLY | self._flag)
            try:
                done = 0
                while done < len(view):
                    n = os.preadv(fd, [view[done:]], done)
                    if n == 0:
                        raise ShortReadError(f"reading {len(view)} bytes from {path}: the file ends at {done} bytes "
                                       "(truncated or never written)")  # fmt: skip
                    done += n
            finally:
                os.close(fd)
        except StorageError:  # already names the path and bytes
            raise
        except OSError as err:
            raise io_error(err, "reading", path, len(view)) from err

    def _write(self, path: Path, buffer: torch.Tensor) -> None:
        view = bytes_view(buffer)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | self._flag, 0o644)
            try:
                done = 0
                while done < len(view):
                    n = os.pwritev(fd, [view[done:]], done)
                    if n <= 0:
                        raise short_transfer("writing", path, done, len(view))
                    done += n
            finally:
                os.close(fd)
        except ShortTransfer:
            raise
        except StorageError:  # already names the path and bytes
            raise
        except OSError as err:
            raise io_error(err, "writing", path, len(view)) from err


CAP_IPC_LOCK = 14


def may_lock(nbytes: int) -> bool:
    """Whether this process may page-lock ``nbytes`` more: RLIMIT_MEMLOCK allows it or CAP_IPC_LOCK lifts it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or nbytes <= soft:
        return True
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    caps = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(caps, 16) >> CAP_IPC_LOCK & 1)


class PageLocked:
    """Page-locked buffers from DeepSpeed's pinned-tensor manager (one per process, shared by all handles).

    DeepSpeed's aio reads and writes a CPU buffer in place only when it is torch-pinned or one of these; any other
    buffer goes through a bounce buffer that is allocated, mlocked, copied and unlocked on every request, which
    costs CPU time that training needs (measured: GPT-350M vertical iterations 1.4x faster with these)."""

    def __init__(self, module: Any, handle_args: tuple[Any, ...]) -> None:
        self._handle = module.aio_handle(*handle_args)
        self._locked: dict[int, int] = {}
        self._lock = threading.Lock()
        self._warned = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        size = max(align_up(nbytes), ALIGNMENT)
        with self._lock:
            if not may_lock(sum(self._locked.values()) + size):
                if not self._warned:
                    self._warned = True
                    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
                    log.warning("the page-locked memory limit (ulimit -l: %d KiB) is below the engine's I/O buffers: "
                                "DeepSpeed's aio copies every request through a bounce buffer, which is slower; "
                                "raise it (ulimit -l unlimited, or memlock in /etc/security/limits.conf)",
                                soft // 1024)  # fmt: skip
                return aligned_bytes(size)
            buffer = self._handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            self._locked[buffer.data_ptr()] = size
        return buffer  # type: ignore[no-any-return]

    def free(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._locked.pop(buffer.data_ptr(), None) is not None:
                self._handle.free_cpu_locked_tensor(buffer)


class DeepSpeedAIO(_QueuedBackend):
    """DeepSpeed's ``aio_handle`` (libaio, O_DIRECT), one handle per worker thread."""

    def __init__(
        self, directory: Path, threads: int, intra_op_parallelism: int, block_size: int, queue_depth: int
    ) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self._module: Any = load_op(AsyncIOBuilder())
        self._handle_args = (block_size, queue_depth, False, True, intra_op_parallelism)
        self._first_write(directory)
        self.allocator: Allocator = PageLocked(self._module, self._handle_args)
        self._local = threading.local()
        self._requests = RequestQueue(threads, "smartinf-aio")
        self.direct = True
        self.name = (
            f"deepspeed-aio(libaio, O_DIRECT, {threads} handles x intra_op_parallelism={intra_op_parallelism}, "
            f"block_size={block_size}, queue_depth={queue_depth})"
        )

    def _first_write(self, directory: Path) -> None:
        """One write from this thread before any worker exists. DeepSpeed's ``sync_pwrite`` logs an SSD-endurance
        warning inside a ``std::call_once`` while holding the GIL; when two threads make their first writes at once,
        the second waits in ``call_once`` holding the GIL that the first needs to finish logging: a deadlock.
        Running the ``call_once`` here, alone, makes it a no-op for the workers."""
        probe = directory / f".aio_probe_{uuid.uuid4().hex}"
        try:
            self._module.aio_handle(*self._handle_args).sync_pwrite(aligned_bytes(ALIGNMENT), str(probe))
        finally:
            probe.unlink(missing_ok=True)

    def _handle(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = self._module.aio_handle(*self._handle_args)
        return handle

    def _read(self, path: Path, buffer: torch.Tensor) -> None:
        # the op checks no byte count, and a read past a file's end aborts the process in C++: check first
        check_readable(path, buffer.numel())
        if self._handle().sync_pread(buffer, str(path)) < 0:
            raise StorageError(errno.EIO, f"reading {buffer.numel()} bytes from {path} failed in DeepSpeed's aio (EIO)")

    def _write(self, path: Path, buffer: torch.Tensor) -> None:
        """The op reports no byte count (a write to a full disk "succeeds" short), so the file's blocks are
        reserved first with ``posix_fallocate``, which fails with ENOSPC where the write would fall short, and the
        file's size is checked after."""
        nbytes = buffer.numel()
        reserve(path, nbytes)
        if self._handle().sync_pwrite(buffer, str(path)) < 0:
            raise StorageError(errno.EIO, f"writing {nbytes} bytes to {path} failed in DeepSpeed's aio (EIO)")
        try:
            size = path.stat().st_size
        except OSError as err:
            raise io_error(err, "writing", path, nbytes) from err
        if size < nbytes:
            raise short_transfer("writing", path, size, nbytes)


def reserve(path: Path, nbytes: int) -> None:
    """Make sure ``path`` has ``nbytes`` allocated (a no-op for a file rewritten in place at its size). Opened
    read-write: where the file system has no ``fallocate`` (FUSE, NFS), glibc emulates it by reading each block's
    first byte before writing it, which fails with EBADF on a write-only descriptor (seen retrying a failed write
    on a file the first attempt had partly extended)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except StorageError:  # already names the path and bytes
        raise
    except OSError as err:
        raise io_error(err, "writing", path, nbytes) from err


def make_backend(
    kind: str, directory: Path, threads: int, intra_op_parallelism: int, block_size: int, queue_depth: int
) -> IOBackend:
    """Build the I/O backend named by ``offload.io_backend`` (``auto``, ``aio`` or ``threads``) for ``directory``."""
    direct = supports_o_direct(directory)
    if not direct:
        log.warning(
            "%s does not support O_DIRECT (tmpfs or an overlay filesystem?): using buffered pread/pwrite; "
            "put offload.nvme_path on an ext4/xfs NVMe mount for real throughput",
            directory,
        )
        if kind == "aio":
            raise ConfigError(f"offload.io_backend=aio needs O_DIRECT, which {directory} does not support")
        return ThreadPoolIO(threads, direct=False)
    if kind in ("auto", "aio") and not available("deepspeed"):
        if kind == "aio":
            raise ConfigError(missing("deepspeed", "offload.io_backend=aio (DeepSpeed's libaio op)"))
        log.info("%s; using the thread-pool backend", missing("deepspeed", "DeepSpeed's libaio I/O"))
    elif kind in ("auto", "aio"):
        try:
            return DeepSpeedAIO(directory, threads, intra_op_parallelism, block_size, queue_depth)
        except Exception as err:  # noqa: BLE001 - the op may fail to compile; fall back unless it was demanded
            if kind == "aio":
                raise SetupError(f"offload.io_backend=aio but DeepSpeed's async_io op did not load: {err}") from err
            log.warning("DeepSpeed async_io op unavailable (%s); using the thread-pool backend", err)
    return ThreadPoolIO(threads, direct=True)


@dataclass(frozen=True)
class IOSettings:
    """How to reach one directory's disk: ``offload.io_backend``, ``io_threads`` and the ``aio_*`` keys (these
    defaults are ``OffloadConfig``'s; the engine passes the config's values)."""

    kind: str = "auto"
    threads: int = 4
    intra_op_parallelism: int = 1
    block_size: int = 1_048_576
    queue_depth: int = 32


def backend_for(directory: Path, settings: IOSettings | None = None) -> IOBackend:
    """The backend ``settings`` ask for under ``directory`` (the defaults for commands that probe a disk without
    an engine)."""
    s = settings or IOSettings()
    return make_backend(s.kind, directory, s.threads, s.intra_op_parallelism, s.block_size, s.queue_depth)
