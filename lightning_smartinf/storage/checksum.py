"""The sums that catch a disk returning other bytes than it was given: XXH3-64, through the ``xxhash`` package.

The engine sums every byte of state, parameters, gradients and kept graphs it writes, and checks every read of them
(``offload.verify_io``): about 13 GB per iteration for GPT-350M at sequence 128 with everything on storage. On a CPU
host that work shares the cores with compute, so its speed is the step's: XXH3 sums 28 GB/s on one core here,
CRC-32C (the CPU's crc32 instruction, the ``crc32c`` package, used before) 15.6 GB/s; both release the GIL. It is a
64-bit hash, not a cryptographic one: it catches flipped bits, torn and lost writes; a checkpoint's SHA-256 guards
against a file changed on purpose.
"""

from __future__ import annotations

import xxhash

NAME = "XXH3-64"


def checksum(data: bytes | memoryview) -> int:
    """The sum of ``data`` (a bytes-like object, read in place)."""
    return int(xxhash.xxh3_64_intdigest(data))


def describe(value: int) -> str:
    """How an error message names a sum."""
    return f"{NAME} {value:016x}"


class RunningChecksum:
    """The sum of a stream of chunks, equal to ``checksum`` of their concatenation."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, chunk: bytes | memoryview) -> None:
        self._state.update(chunk)

    def with_tail(self, tail: bytes | memoryview) -> int:
        """The sum of everything so far plus ``tail``, leaving this one as it was (a prefix that ends mid-chunk)."""
        state = self._state.copy()
        state.update(tail)
        return int(state.intdigest())

    def value(self) -> int:
        return int(self._state.intdigest())
