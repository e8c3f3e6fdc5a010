"""The worker protocol's messages: typed at both ends, plain tuples of ints on the socket."""

from __future__ import annotations

import os

import numpy as np

from aloader.workers import _shm
from aloader.workers._worker import SETUP_JOB, Kind, Reply, Request, Status


def test_request_crosses_the_codec_unchanged() -> None:
    codec = _shm.Codec(_shm.owner(), "ptest")
    request = Request(Kind.NEXT, 3, 1, None, ["seg"], 2)
    back = Request.of(_shm.decode(codec.encode(request.wire())))
    assert back == request
    assert back.kind is Kind.NEXT
    assert back.loader_epoch == 2


def test_reply_crosses_the_codec_unchanged() -> None:
    codec = _shm.Codec(_shm.owner(), os.getpid(), tensors=True)
    batch = np.arange(6).reshape(2, 3)
    back = Reply.of(_shm.decode(codec.encode(Reply(5, Status.OK, batch, None).wire())))
    assert (back.job, back.status, back.stats) == (5, Status.OK, None)
    assert back.status is Status.OK
    np.testing.assert_array_equal(back.value, batch)
    assert Reply.of(Reply(SETUP_JOB, Status.READY, None).wire()).status is Status.READY


def test_the_wire_carries_plain_ints_not_classes() -> None:
    # A NamedTuple or an enum member would pickle by reference, at two to three times the cost.
    request = Request(Kind.TASK, 0, 0, [1, 2], [], 0).wire()
    reply = Reply(0, Status.END, None).wire()
    assert type(request) is tuple and type(reply) is tuple
    assert type(request[0]) is int and type(reply[1]) is int


def test_kinds_and_statuses_are_distinct_types() -> None:
    assert set(Kind) == {Kind.TASK, Kind.NEXT, Kind.ROLLBACK}
    assert [s.name for s in Status] == ["READY", "FAILED", "OK", "ERROR", "END"]
    assert not isinstance(Kind.TASK, Status)
