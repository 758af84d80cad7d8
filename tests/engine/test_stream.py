"""The eager update stream: arrival order during backward, forward order for what is left once backward ends."""

from __future__ import annotations

import threading

import pytest

from lightning_smartinf.engine.layout import Subgroup
from lightning_smartinf.engine.stream import UpdateStream


def sg(index: int, block: int) -> Subgroup:
    return Subgroup(index=index, block=block, param_group=0, offset=0, numel=1)


def test_arrival_order_while_open_then_forward_order() -> None:
    stream = UpdateStream()
    taken: list[int] = []
    it = iter(stream)
    for s in (sg(7, 3), sg(8, 3)):  # the last block finishes backward first
        stream.put(s)
    taken += [next(it).index, next(it).index]  # FIFO: nothing else has arrived
    for s in (sg(5, 2), sg(6, 2), sg(3, 1), sg(4, 1), sg(0, 0), sg(1, 0)):
        stream.put(s)
    taken.append(next(it).index)  # still open: arrival order
    stream.close()  # backward is over; the resident layers (block 0) and block 1 are needed first
    taken += [s.index for s in it]
    assert taken == [7, 8, 5, 0, 1, 3, 4, 6]


def test_the_consumer_waits_for_work_and_ends_at_close() -> None:
    stream = UpdateStream()
    seen: list[int] = []
    consumer = threading.Thread(target=lambda: seen.extend(s.index for s in stream))
    consumer.start()
    stream.put(sg(2, 1))
    stream.close()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and seen == [2]


def test_joining_a_closed_stream_is_an_error() -> None:
    stream = UpdateStream()
    stream.close()
    with pytest.raises(RuntimeError, match="already closed"):
        stream.put(sg(0, 0))
