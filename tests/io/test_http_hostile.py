"""Attacks on aloader.io._http with hostile servers: a 200 (the whole body, or a part labelled
200) to a Range request, a length that changes between attempts, a wrong Content-Range,
``Content-Encoding: gzip`` on a plain shard resumed from a checkpoint, chunked bodies cut
anywhere (at their very end too), a Content-Length shorter or longer than the body, cuts at
many offsets, a server that stops sending in the middle of a body, a redirect loop, error
statuses, a line without a newline. Each must give every record once, or a clear error
naming the URL: never a record lost or repeated, never a hang."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faulty_server import FaultyServer
from sourcetools import collect, interrupted
from test_http import Scripted, jsonl, reply
from test_tar import make_tar, samples

from aloader import FetchError, JsonLines, RecordError, TarShards, TextLines

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]

FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.02, "timeout": 10.0}
BODY = jsonl(300)  # {"i": 0..299, "pad": ...} lines


@pytest.fixture
def server() -> Iterator[Scripted]:
    scripted = Scripted()
    yield scripted
    scripted.close()


def ids(records: list[Any]) -> list[int]:
    return [record["i"] for record in records]


def asked_from(handler: Any) -> int:
    """The first byte an open ``Range: bytes=N-`` asks for (0 without a Range)."""
    header = handler.headers.get("Range")
    return 0 if header is None else int(header[6:].partition("-")[0])


def partial(handler: Any, body: bytes, status: int = 206, **kwargs: Any) -> None:
    """Answer the request's open range of ``body`` with its Content-Range."""
    start = asked_from(handler)
    reply(handler, status, body[start:], headers={
        "Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"}, **kwargs)


def chunked(handler: Any, data: bytes, *, terminated: bool = True, piece: int = 500) -> None:
    """Answer 200 with ``data`` in chunked transfer coding; not ``terminated``: hang up
    before the last (empty) chunk."""
    handler.send_response(200)
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for start in range(0, len(data), piece):
        part = data[start : start + piece]
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
    if terminated:
        handler.wfile.write(b"0\r\n\r\n")
    else:
        handler.close_connection = True
    handler.wfile.flush()


# --------------------------------------------------------------------------- ranges ignored


async def test_a_200_with_the_whole_body_to_a_range_request_repeats_nothing(
        server: Scripted, anyio_backend: str) -> None:
    def route(handler: Any, n: int) -> None:  # ranges ignored; the first two answers cut
        reply(handler, 200, BODY, send=[777, 2000][n] if n < 2 else None)

    url = server.route("a.jsonl", route)
    assert ids(await collect(JsonLines(url, chunk_size=256, **FAST))) == list(range(300))
    assert [asked for _, asked in server.requests] == [None, "bytes=777-", "bytes=2000-"]


async def test_a_checkpoint_resumed_where_the_server_ignores_ranges(
        server: Scripted, anyio_backend: str) -> None:
    url = server.route("c.jsonl", lambda h, n: reply(h, 200, BODY))
    rest, _ = await interrupted(lambda: JsonLines(url, chunk_size=256, **FAST), 123)
    assert ids(rest) == list(range(123, 300))
    assert server.requests[-1][1] is not None  # asked for the rest, got the whole body


async def test_a_part_labelled_200_is_not_taken_for_the_whole_body(
        server: Scripted, anyio_backend: str) -> None:
    """A proxy answering a range with its part, but as 200 (with a Content-Range): taking it
    for the whole body and skipping what was read would lose records silently."""
    def route(handler: Any, n: int) -> None:
        if n == 0:
            reply(handler, 200, BODY, send=500)
        else:
            partial(handler, BODY, status=200)

    url = server.route("p.jsonl", route)
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))


async def test_a_length_that_changes_between_attempts_is_an_error(
        server: Scripted, anyio_backend: str) -> None:
    """No ETag to tell: the length is the only sign that the resumed body is another one."""
    longer = jsonl(400)

    def route(handler: Any, n: int) -> None:
        if n == 0:
            reply(handler, 200, BODY, send=700)
        else:
            partial(handler, longer)

    url = server.route("l.jsonl", route)
    with pytest.raises(FetchError, match=rf"l\.jsonl: the resource changed on the server .*"
                                         rf"length {len(BODY)} became {len(longer)}.* at byte "
                                         r"offset 700") as info:
        await collect(JsonLines(url, **FAST))
    assert info.value.source == url and info.value.offset == 700


async def test_a_whole_body_of_another_length_on_resumption_is_an_error(
        server: Scripted, anyio_backend: str) -> None:
    def route(handler: Any, n: int) -> None:
        reply(handler, 200, BODY if n == 0 else BODY + BODY[:100], send=700 if n == 0 else None)

    url = server.route("w.jsonl", route)
    with pytest.raises(FetchError, match="the resource changed on the server"):
        await collect(JsonLines(url, **FAST))


@pytest.mark.parametrize("content_range", ["bytes 0-4/5", "bytes 701-9999/10000", "junk", None])
async def test_a_wrong_content_range_is_an_error(server: Scripted, anyio_backend: str,
                                                 content_range: str | None) -> None:
    def route(handler: Any, n: int) -> None:
        if n == 0:
            reply(handler, 200, BODY, send=700)
        else:
            headers = {} if content_range is None else {"Content-Range": content_range}
            reply(handler, 206, BODY[700:], headers=headers)

    url = server.route("r.jsonl", route)
    with pytest.raises(FetchError, match=r"r\.jsonl: asked for bytes from 700, but the server "
                                         r"sent Content-Range") as info:
        await collect(JsonLines(url, **FAST))
    assert info.value.status_code == 206 and len(server.requests) == 2  # not retried


# --------------------------------------------------------------------------- content codings


async def test_a_gzip_coded_plain_shard_resumed_from_a_checkpoint(
        server: Scripted, anyio_backend: str) -> None:
    """``Content-Encoding: gzip`` on a .jsonl (decoded on the fly): a checkpoint's offset
    counts decoded bytes, so a Range of the coded bytes is of no use; the body is read from
    its start and the decoded bytes before the offset skipped."""
    coded = gzip.compress(BODY)

    def route(handler: Any, n: int) -> None:
        start = asked_from(handler)  # a store answers a Range with coded bytes
        reply(handler, 206 if start else 200, coded[start:], headers={
            "Content-Encoding": "gzip",
            **({"Content-Range": f"bytes {start}-{len(coded) - 1}/{len(coded)}"}
               if start else {})})

    url = server.route("g.jsonl", route)
    for k in (1, 99, 250, 299):
        rest, _ = await interrupted(lambda: JsonLines(url, chunk_size=128, **FAST), k)
        assert ids(rest) == list(range(k, 300))


# --------------------------------------------------------------------------- framing


async def test_chunked_bodies_whole_and_cut(server: Scripted, anyio_backend: str) -> None:
    url = server.route("whole.jsonl", lambda h, n: chunked(h, BODY))
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))
    cut = 1234  # inside a chunk and a line

    def route(handler: Any, n: int) -> None:
        if n == 0:
            chunked(handler, BODY[:cut], terminated=False)
        else:
            partial(handler, BODY)

    url = server.route("cut.jsonl", route)
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))
    assert server.requests[-1] == ("cut.jsonl", f"bytes={cut}-")


async def test_a_chunked_body_cut_after_its_last_byte_is_complete(
        server: Scripted, anyio_backend: str) -> None:
    """Every byte came, but not the last (empty) chunk: the retry's Range asks for nothing
    more, and the 416 that answers it names the length already read: the body is whole."""
    def route(handler: Any, n: int) -> None:
        if n == 0:
            chunked(handler, BODY, terminated=False)
        else:
            reply(handler, 416, headers={"Content-Range": f"bytes */{len(BODY)}"})

    url = server.route("end.jsonl", route)
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))


async def test_a_416_naming_a_shorter_length_is_an_error(server: Scripted,
                                                        anyio_backend: str) -> None:
    def route(handler: Any, n: int) -> None:
        if n == 0:
            chunked(handler, BODY[:2000], terminated=False)
        else:
            reply(handler, 416, headers={"Content-Range": "bytes */1000"})

    url = server.route("short.jsonl", route)
    with pytest.raises(FetchError, match=r"short\.jsonl: HTTP 416 .* at byte offset 2000"):
        await collect(JsonLines(url, **FAST))


async def test_a_content_length_shorter_than_the_body_spoils_no_other_response(
        server: Scripted, anyio_backend: str) -> None:
    """The bytes past the announced length stay on the keep-alive connection; they look like
    a response of their own: the next request on that connection must not take them."""
    smuggled = b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"i": 999}\n'
    first = server.route("first.jsonl", lambda h, n: reply(h, 200, BODY + smuggled,
                                                            length=len(BODY)))
    second = server.route("second.jsonl", lambda h, n: reply(h, 200, jsonl(50)))
    records = await collect(JsonLines([first, second], **FAST))
    assert ids(records) == list(range(300)) + list(range(50))


async def test_a_content_length_longer_than_the_body_is_resumed_or_an_error(
        server: Scripted, anyio_backend: str) -> None:
    def route(handler: Any, n: int) -> None:  # promises 100 bytes more, every time
        start = asked_from(handler)
        if start >= len(BODY):
            reply(handler, 416, headers={"Content-Range": f"bytes */{len(BODY)}"})
        else:
            reply(handler, 200 if not start else 206, BODY[start:], length=len(BODY) + 100,
                  send=len(BODY), headers={"Content-Range": f"bytes {start}-"
                                           f"{len(BODY) + 99}/{len(BODY) + 100}"}
                  if start else {})

    url = server.route("long.jsonl", route)
    with pytest.raises(FetchError, match=r"long\.jsonl: HTTP 416 .*not retried"):
        await collect(JsonLines(url, **FAST))


@pytest.mark.parametrize("ranges", [True, False])
async def test_cuts_at_many_offsets_repeat_and_lose_nothing(
        serve: Callable[..., FaultyServer], anyio_backend: str, ranges: bool) -> None:
    lines = BODY.split(b"\n")
    boundary = len(lines[0]) + 1
    files = {"m.jsonl": BODY}
    server = serve(files, ranges=ranges)
    # At a line boundary, one byte either side of it, and the body's last byte.
    for after in (1, boundary - 1, boundary, boundary + 1, 5000, len(BODY) - 1):
        server.cut("m.jsonl", after)
    source = JsonLines(server.url("m.jsonl"), chunk_size=100, retries=10, **FAST)
    assert ids(await collect(source)) == list(range(300))
    assert source.stats.retries == len(server.requests) - 1 >= 5
    assert source.stats.bytes == len(BODY)


# --------------------------------------------------------------------------- stuck servers


async def test_a_server_that_stops_sending_mid_body_times_out_and_resumes(
        server: Scripted, anyio_backend: str) -> None:
    """``timeout`` (HttpOptions) bounds each read: a body that stops coming fails that
    attempt, and the next asks for the rest."""
    release = threading.Event()

    def route(handler: Any, n: int) -> None:
        if n == 0:
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(BODY)))
            handler.end_headers()
            handler.wfile.write(BODY[:1000])
            handler.wfile.flush()
            release.wait(10)  # stuck (until the test ends)
            handler.close_connection = True
        else:
            partial(handler, BODY)

    url = server.route("stuck.jsonl", route)
    try:
        records = await collect(JsonLines(url, backoff=0.01, timeout=0.2))
    finally:
        release.set()
    assert ids(records) == list(range(300))
    assert server.requests == [("stuck.jsonl", None), ("stuck.jsonl", "bytes=1000-")]


async def test_a_server_always_stuck_is_a_timeout_error(server: Scripted,
                                                        anyio_backend: str) -> None:
    release = threading.Event()

    def route(handler: Any, n: int) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(BODY)))
        handler.end_headers()
        handler.wfile.write(BODY[asked_from(handler):][:100])
        handler.wfile.flush()
        release.wait(10)
        handler.close_connection = True

    url = server.route("never.jsonl", route)
    try:
        with pytest.raises(FetchError, match=r"never\.jsonl: giving up after 2 failed attempts "
                                             r"at byte offset 100; last error: ReadTimeout"):
            await collect(JsonLines(url, retries=1, backoff=0.01, timeout=0.2))
    finally:
        release.set()


# --------------------------------------------------------------------------- redirects, statuses


async def test_a_redirect_loop_is_a_clear_error(server: Scripted, anyio_backend: str) -> None:
    url = server.route("loop.jsonl", lambda h, n: reply(h, 302,
                                                        headers={"Location": "/loop.jsonl"}))
    with pytest.raises(FetchError, match=r"loop\.jsonl: TooManyRedirects: .*redirect") as info:
        await collect(JsonLines(url, retries=3, **FAST))
    assert info.value.source == url
    assert len(server.requests) <= 21  # one loop followed, not retried


@pytest.mark.parametrize(("status", "message"), [
    (403, "HTTP 403 Forbidden (not retried)"),
    (404, "HTTP 404 Not Found (not retried)"),
    (500, "giving up after 2 failed attempts; last error: HTTP 500 Internal Server Error"),
])
async def test_error_statuses_are_distinct_errors_naming_the_url(
        server: Scripted, anyio_backend: str, status: int, message: str) -> None:
    url = server.route(f"e{status}.jsonl", lambda h, n: reply(h, status))
    with pytest.raises(FetchError) as info:
        await collect(JsonLines(url, retries=1, **FAST))
    assert str(info.value) == f"{url}: {message}"
    assert info.value.status_code == status and info.value.source == url
    assert len(server.requests) == (2 if status == 500 else 1)


# --------------------------------------------------------------------------- a huge line


async def test_a_huge_line_without_a_newline_is_bounded_by_max_record_bytes(
        server: Scripted, anyio_backend: str) -> None:
    """The source promises a line of at most ``max_record_bytes``: beyond, a located error
    (or, skipping errors, the line is dropped up to its newline, never held whole)."""
    huge = b'{"i": -1, "pad": "' + b"x" * (4 << 20)
    url = server.route("huge.jsonl", lambda h, n: reply(h, 200, huge))
    with pytest.raises(RecordError, match=r"huge\.jsonl: line 1 \(byte offset 0\): line longer "
                                          r"than max_record_bytes \(65536 bytes\)"):
        await collect(JsonLines(url, max_record_bytes=1 << 16, **FAST))
    body = jsonl(3) + huge + b'"}\n' + json.dumps({"i": 3}).encode() + b"\n"
    url = server.route("skip.jsonl", lambda h, n: reply(h, 200, body))
    source = JsonLines(url, max_record_bytes=1 << 16, skip_errors=True, **FAST)
    assert ids(await collect(source)) == [0, 1, 2, 3]
    assert source.stats.skipped == 1
    # TextLines alike (the line decoder is shared)
    source_text = TextLines(url, max_record_bytes=1 << 16, skip_errors=True, **FAST)
    assert len(await collect(source_text)) == 4


async def test_a_tar_without_a_length_cut_between_members_is_an_error(
        server: Scripted, anyio_backend: str) -> None:
    """A body with neither Content-Length nor chunked framing, cut: HTTP cannot tell it from
    a whole one (the module's limits); the tar's missing end-of-archive block does."""
    raw = make_tar(samples(0, 6))
    cut = 6 * 1024  # after the second sample's members, before the end blocks
    url = server.route("t.tar", lambda h, n: reply(h, 200, raw[:cut], length=None))
    got: list[Any] = []
    with pytest.raises(RecordError, match=r"t\.tar: .*truncated"):
        async for sample in TarShards(url, **FAST):
            got.append(sample)
    assert [sample["__key__"] for sample in got] == ["000000"]  # the second may go on


def transfer_coded(handler: Any, coded: bytes, coding: str) -> None:
    """200 with ``Transfer-Encoding: {coding}, chunked`` (a hop-by-hop coding: rare, legal)."""
    handler.send_response(200)
    handler.send_header("Transfer-Encoding", f"{coding}, chunked")
    handler.end_headers()
    handler.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded))
    handler.wfile.flush()


async def test_a_transfer_coding_is_decoded_or_refused_never_parsed_raw(
        server: Scripted, anyio_backend: str) -> None:
    """aiohttp (asyncio) hands a gzip transfer coding on undone, httpx (trio) refuses it: the
    coded bytes must never be read as the shard's (as latin-1 lines they all "parse")."""
    body = "".join(f"ligne {i} é\n" for i in range(200)).encode("latin-1")
    url = server.route("te.txt", lambda h, n: transfer_coded(h, gzip.compress(body), "gzip"))
    expected = body.decode("latin-1").splitlines()
    try:
        lines = await collect(TextLines(url, encoding="latin-1", retries=1, **FAST))
    except FetchError as exc:  # httpx: "Only Transfer-Encoding: chunked is supported"
        assert anyio_backend == "trio" and "Transfer-Encoding" in str(exc)
    else:
        assert lines == expected
    url = server.route("tc.txt", lambda h, n: transfer_coded(h, b"\x1f\x9d junk", "compress"))
    with pytest.raises(FetchError, match=r"tc\.txt: .*(Transfer-Encoding 'compress'|"
                                         r"Transfer-Encoding: chunked is supported)"):
        await collect(TextLines(url, encoding="latin-1", retries=1, **FAST))


async def test_a_200_with_a_content_range_that_does_not_parse_is_the_whole_body(
        server: Scripted, anyio_backend: str) -> None:
    url = server.route("odd.jsonl", lambda h, n: reply(h, 200, BODY,
                                                       headers={"Content-Range": "bytes */7"}))
    assert ids(await collect(JsonLines(url, **FAST))) == list(range(300))
