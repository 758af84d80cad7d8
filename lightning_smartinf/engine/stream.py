"""The eager update stream: subgroups whose gradients are final, in the order the update thread should take them.

While backward runs, subgroups arrive block by block from the last block and are taken in arrival order (they are
all there is). Once backward closes the stream, what the update thread has not reached yet is taken in forward
order instead: the next forward needs the resident layers and block 1 first and block L last, so updating the
earliest-needed first lets it start sooner, and the later blocks' updates run alongside it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from lightning_smartinf.engine.layout import Subgroup


class UpdateStream:
    """A closable queue of subgroups: FIFO while open, lowest (block, index) first once closed."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._items: list[Subgroup] = []
        self._closed = False

    def put(self, sg: Subgroup) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError(f"subgroup {sg.index} joined an update stream that backward already closed")
            self._items.append(sg)
            self._ready.notify()

    def close(self) -> None:
        """Backward is over: nothing more will join."""
        with self._ready:
            self._closed = True
            self._ready.notify()

    def __iter__(self) -> Iterator[Subgroup]:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._items) or self._closed)
                if not self._items:
                    return
                if self._closed:
                    self._items.sort(key=lambda sg: (sg.block, sg.index))
                sg = self._items.pop(0)
            yield sg
