"""aloader.sources._formats: record parsing, its bounds and the location of every malformed record.

Each format is read from files with chunk sizes that cut records anywhere, through the public
sources, and also fed to its decoder directly: a record split across chunks is the same
record, a malformed one is reported with its shard, line and byte offset (or skipped and
counted with ``skip_errors``), and a header that promises more than the shard holds fails at
once.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sourcetools import collect

from aloader import (
    BinaryRecords,
    JsonLines,
    NpyRows,
    RecordError,
    SourceError,
    SourceStats,
    TextLines,
)
from aloader.sources._formats import (
    BadRecords,
    BinaryDecoder,
    Decoder,
    JsonLinesDecoder,
    NpyDecoder,
    TextDecoder,
)

pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- through the sources


async def test_jsonl_blank_lines_and_whitespace(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  {"a": 2}  \r\n[3, 4]\n"five"\n   \n7')
    assert await collect(JsonLines(path)) == [{"a": 1}, {"a": 2}, [3, 4], "five", 7]
    assert await collect(JsonLines(path, chunk_size=5)) == [{"a": 1}, {"a": 2}, [3, 4],
                                                            "five", 7]


@pytest.mark.parametrize(("body", "bad_line"), [
    (b'1,2\n3\n', 1),          # two values on a line, though the chunk parses as an array
    (b'1\n{"a":\n2}\n', 2),     # a value spread over two lines
    (b'[1,\n2]\n3\n', 1),
    # As many values as lines, yet none of these lines holds one value on its own.
    (b'[1\n2]\n3,4\n', 1),
    (b'{"a":\n1} {"b": 2}\n', 1),
])
async def test_jsonl_lines_must_hold_one_value(
    tmp_path: Path, anyio_backend: str, body: bytes, bad_line: int
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(body)
    with pytest.raises(RecordError, match=f"line {bad_line}"):
        await collect(JsonLines(path))


async def test_jsonl_custom_loads(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    calls: list[str] = []

    def loads(text: str) -> Any:
        calls.append(text)
        return json.loads(text)

    assert await collect(JsonLines(path, loads=loads)) == [{"a": 1}, {"a": 2}]
    assert calls == ['{"a": 1}', '{"a": 2}']


async def test_binary_records(tmp_path: Path, anyio_backend: str) -> None:
    payloads = [os.urandom(n) for n in (0, 1, 5, 300, 17, 1000, 2, 0)] * 3
    for fmt in ("<I", ">Q", "<H"):
        path = tmp_path / f"r{fmt[1]}.bin"
        path.write_bytes(b"".join(struct.pack(fmt, len(p)) + p for p in payloads))
        for chunk_size in (5, 333, 1 << 18):
            got = await collect(BinaryRecords(path, header=fmt, chunk_size=chunk_size))
            assert got == payloads


async def test_npy_rows(tmp_path: Path, anyio_backend: str) -> None:
    arrays = {
        "a.npy": np.arange(60, dtype=np.float32).reshape(20, 3),
        "b.npy": np.arange(24, dtype=">i8").reshape(2, 3, 4),
        "c.npy": np.arange(7, dtype=np.int16),
        "d.npy": np.zeros(5, dtype=[("x", "<f4"), ("y", "<i2")]),
    }
    for name, array in arrays.items():
        np.save(tmp_path / name, array)
    for chunk_size in (5, 100, 1 << 18):
        for name, array in arrays.items():
            rows = await collect(NpyRows(tmp_path / name, chunk_size=chunk_size))
            assert len(rows) == len(array)
            np.testing.assert_array_equal(np.stack(rows), array)
    rows = await collect(NpyRows(tmp_path / "a.npy"))
    rows[0][0] = -1.0  # rows are writable
    assert rows[0].shape == (3,)


async def test_npy_version_2_header(tmp_path: Path, anyio_backend: str) -> None:
    array = np.arange(12.0).reshape(4, 3)
    path = tmp_path / "v2.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=(2, 0))
    np.testing.assert_array_equal(np.stack(await collect(NpyRows(path, chunk_size=7))), array)


async def test_bad_json_names_file_line_offset(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = b'{"i": 0}\n{"i": 1}\n'
    path.write_bytes(good + b'{"i": 2,,}\n{"i": 3}\n')
    seen: list[Any] = []
    with pytest.raises(RecordError) as info:
        async for record in JsonLines(path, chunk_size=4):
            seen.append(record)
    assert seen == [{"i": 0}, {"i": 1}]  # everything before the bad line arrives
    error = info.value
    assert isinstance(error, SourceError) and isinstance(error, ValueError)
    assert (error.source, error.line, error.offset) == (str(path), 3, len(good))
    assert f"{path}: line 3 (byte offset {len(good)}): invalid JSON" in str(error)


async def test_bad_utf8_line(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok\nalso ok\nbad \xff byte\nlast\n")
    with pytest.raises(RecordError, match=r"bad\.txt: line 3 \(byte offset 11\): cannot decode"):
        await collect(TextLines(path))
    source = TextLines(path, skip_errors=True)
    assert await collect(source) == ["ok", "also ok", "last"]
    assert source.stats.skipped == 1
    assert source.stats.skipped_errors[0].line == 3


async def test_skip_errors_counts(tmp_path: Path, anyio_backend: str) -> None:
    lines = []
    bad_lines = set()
    for i in range(500):
        if i % 37 == 5:
            lines.append(b'{"broken": ')
            bad_lines.add(i + 1)
        else:
            lines.append(json.dumps({"i": i}).encode())
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    for chunk_size in (11, 1 << 18):
        source = JsonLines(path, skip_errors=True, chunk_size=chunk_size)
        records = await collect(source)
        assert len(records) == 500 - len(bad_lines)
        assert source.stats.skipped == len(bad_lines)
        assert {e.line for e in source.stats.skipped_errors} == bad_lines
        assert source.stats.records == len(records)


async def test_binary_truncated_and_oversized(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "t.bin"
    records = [b"abc", b"defgh"]
    data = b"".join(struct.pack("<I", len(r)) + r for r in records)
    path.write_bytes(data + struct.pack("<I", 10) + b"xyz")
    seen: list[bytes] = []
    with pytest.raises(RecordError, match=rf"record 2 at byte offset {len(data)}: truncated"):
        async for record in BinaryRecords(path):
            seen.append(record)
    assert seen == records
    source = BinaryRecords(path, skip_errors=True)
    assert await collect(source) == records
    assert source.stats.skipped == 1

    path.write_bytes(data + struct.pack("<I", 1 << 30) + b"x" * 100)
    with pytest.raises(RecordError, match="more than max_record_bytes"):
        await collect(BinaryRecords(path, max_record_bytes=1000))


async def test_npy_errors(tmp_path: Path, anyio_backend: str) -> None:
    array = np.arange(30, dtype=np.int32).reshape(10, 3)
    np.save(tmp_path / "ok.npy", array)
    data = (tmp_path / "ok.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(data[:-5])
    with pytest.raises(RecordError, match=r"short\.npy: byte offset \d+: truncated array: "
                                          r"the shard ends after 9 of 10 rows"):
        await collect(NpyRows(tmp_path / "short.npy"))
    (tmp_path / "junk.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(RecordError, match="bad magic"):
        await collect(NpyRows(tmp_path / "junk.npy"))
    np.save(tmp_path / "f.npy", np.asfortranarray(array))
    with pytest.raises(SourceError, match="Fortran"):
        await collect(NpyRows(tmp_path / "f.npy"))
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError, match="Python objects"):
        await collect(NpyRows(tmp_path / "o.npy"))


async def test_line_too_long(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "long.txt"
    path.write_bytes(b"short\n" + b"x" * 5000 + b"\nafter\n")
    with pytest.raises(RecordError, match=r"line 2 \(byte offset 6\): line longer than"):
        await collect(TextLines(path, max_record_bytes=1000, chunk_size=100))
    source = TextLines(path, max_record_bytes=1000, chunk_size=100, skip_errors=True)
    assert await collect(source) == ["short", "after"]
    assert source.stats.skipped == 1


# --------------------------------------------------------------------------- hostile headers, lines


def npy_with_rows(rows: int, array: np.ndarray[Any, Any]) -> bytes:
    """``.npy`` bytes of ``array`` whose header claims ``rows`` rows."""
    buffer = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(array)
    header["shape"] = (rows, *array.shape[1:])
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + array.tobytes()


async def test_npy_promising_huge_rows_delivers_its_rows_then_fails(tmp_path: Path,
                                                                    anyio_backend: str) -> None:
    path = tmp_path / "huge.npy"
    rows = np.arange(80_000.0).reshape(20_000, 4)
    path.write_bytes(npy_with_rows(10**12, rows))
    source = NpyRows(path, chunk_size=4096)
    got: list[Any] = []
    with pytest.raises(RecordError, match=r"huge\.npy: byte offset 640128: truncated array: "
                                          r"the shard ends after 20000 of 1000000000000 rows "
                                          r"\(the header promises") as info:
        async for row in source:
            got.append(row)
    assert info.value.source == str(path) and info.value.offset == 640128
    # The rows the shard holds (as a truncated text shard's lines), nothing read beyond it.
    assert np.array_equal(np.stack(got), rows) and source.stats.records == 20_000

    skipping = NpyRows(path, skip_errors=True)
    assert len(await collect(skipping)) == 20_000 and skipping.stats.skipped == 1


async def test_npy_extra_data_fails_at_once(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "extra.npy"
    path.write_bytes(npy_with_rows(5, np.zeros((50, 2))))
    source = NpyRows(path, chunk_size=256)
    with pytest.raises(RecordError, match="unexpected bytes after the last row"):
        await collect(source)
    assert source.stats.records == 0


async def test_npy_empty_rows_in_bounded_blocks(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "empty.npy"
    path.write_bytes(npy_with_rows(10**12, np.zeros((0, 0))))
    source = NpyRows(path)
    iterator = source.__aiter__()
    row = await iterator.__anext__()
    assert row.shape == (0,)
    # Not 10**12 rows built at once: the header alone decides how many there are.
    assert source.stats.records <= 10**5
    await iterator.aclose()  # type: ignore[attr-defined]

    path.write_bytes(npy_with_rows(5, np.zeros((0, 0))))
    assert len(await collect(NpyRows(path))) == 5


@pytest.mark.parametrize("shape", [(-5,), (3, -1)])
async def test_npy_negative_dimension(tmp_path: Path, anyio_backend: str,
                                      shape: tuple[int, ...]) -> None:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": "<f8", "fortran_order": False, "shape": shape})
    path = tmp_path / "neg.npy"
    path.write_bytes(buffer.getvalue() + bytes(64))
    with pytest.raises(RecordError, match=r"neg\.npy: byte offset 8: bad \.npy header: "
                                          r"negative dimension"):
        await collect(NpyRows(path))


async def test_npy_header_longer_than_the_shard(tmp_path: Path, anyio_backend: str) -> None:
    path = tmp_path / "long.npy"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30) + b"{" * 100)
    source = NpyRows(path, chunk_size=16)
    with pytest.raises(RecordError, match=r"truncated \.npy header: it says"):
        await collect(source)
    assert source.stats.bytes <= 16


async def test_npy_malformed_header(tmp_path: Path, anyio_backend: str) -> None:
    for text in (b"{'descr': '<f8', 'shape': (3,)}", b"not a dict at all", b"{" * 50):
        header = text.ljust(118) + b"\n"
        path = tmp_path / "m.npy"
        path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header)
        with pytest.raises(RecordError, match=r"m\.npy: byte offset 8: bad \.npy header"):
            await collect(NpyRows(path))


async def test_binary_length_beyond_the_shard_fails_at_once(tmp_path: Path,
                                                            anyio_backend: str) -> None:
    path = tmp_path / "b.bin"
    path.write_bytes(struct.pack("<I", 3) + b"abc" + struct.pack("<I", 50 << 20)
                     + b"x" * (1 << 20))
    source = BinaryRecords(path, chunk_size=4096)
    with pytest.raises(RecordError, match=r"b\.bin: record 1 at byte offset 7: truncated "
                                          r"record: the shard ends 1048580 bytes into it "
                                          r"\(its header promises 4 \+ 52428800 bytes\)"):
        await collect(source)
    assert source.stats.records == 1 and source.stats.bytes <= 4096


@pytest.mark.parametrize("source_type", [TextLines, JsonLines])
async def test_one_huge_line(tmp_path: Path, anyio_backend: str, source_type: Any) -> None:
    path = tmp_path / "huge.jsonl"
    big = "y" * (16 << 20)
    path.write_bytes(b'"a"\n' + json.dumps(big).encode() + b'\n"z"')
    records = await collect(source_type(path, max_record_bytes=1 << 26))
    if source_type is TextLines:
        assert records == ['"a"', json.dumps(big), '"z"']
    else:
        assert records == ["a", big, "z"]


# Lines whose values json.loads gives in every corner of the format: what the fast parser
# takes must come out as the same Python objects, what it refuses must reach json.loads.
TRICKY_LINES = [
    '{"text": "caf\\u00e9 \u00e9 \u2713 \U0001f600 \\ud83d\\ude00",'
    ' "esc": "\\"\\\\\\/\\b\\f\\n\\r\\t"}',
    '"\\ud800 lone and \\udfff lone"',  # lone surrogates: json.loads keeps them
    '18446744073709551616', '-18446744073709551617', '1' + '0' * 300,  # ints beyond 64 bits
    '9223372036854775807', '-9223372036854775808', '0', '-0',
    '[0.1, -0.0, 1e-320, 2.2250738585072014e-308, 1.7976931348623157e308, 5e-324, 1E2, 1e+2]',
    '[0.30000000000000004, 123456789.123456789e-5, 3.141592653589793238462643383279]',
    '[1e400, -1e400, 1e-400]',  # beyond a float's range: infinities and 0.0, as json.loads
    '[NaN, Infinity, -Infinity]',  # not JSON, yet json.loads takes them
    '{"a": 1, "a": 2, "b": {}, "c": [], "d": [[[]]], "e": null, "f": true, "g": false}',
    '  \t {"padded": 1}  \t ',
    '"x' + 'y' * 5000 + '"',  # longer than the chunks below
    '""', '[]', '{}',
]


def _lines_file(path: Path, lines: list[str], *, crlf: bool = False,
                final_newline: bool = True) -> bytes:
    ending = "\r\n" if crlf else "\n"
    # Blank lines (empty and whitespace only) between the records.
    body = ending.join(line for item in lines for line in (item, "", "  ")) + (
        ending if final_newline else "")
    path.write_bytes(body.encode("utf-8"))
    return body.encode("utf-8")


def _json_loads_records(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


@pytest.mark.parametrize(("crlf", "final_newline"), [(False, True), (True, False)])
async def test_jsonl_values_are_those_of_json_loads(
    tmp_path: Path, anyio_backend: str, crlf: bool, final_newline: bool
) -> None:
    path = tmp_path / "tricky.jsonl"
    data = _lines_file(path, TRICKY_LINES, crlf=crlf, final_newline=final_newline)
    expected = _json_loads_records(data)
    assert len(expected) == len(TRICKY_LINES)
    for chunk_size in (7, 1000, 1 << 16):
        got = await collect(JsonLines(path, chunk_size=chunk_size))
        # repr tells 1 from 1.0 and True, -0.0 from 0.0, and shows NaN (NaN != NaN).
        assert repr(got) == repr(expected), chunk_size
        assert [type(x) for x in got] == [type(x) for x in expected]
    gz = tmp_path / "tricky.jsonl.gz"
    gz.write_bytes(gzip.compress(data))
    assert repr(await collect(JsonLines(gz, chunk_size=100))) == repr(expected)


async def test_jsonl_error_after_values_left_to_json_loads(tmp_path: Path, anyio_backend: str
                                                          ) -> None:
    # A chunk that msgspec refuses (NaN) and that also holds a malformed line: the location is
    # the malformed line's, and with skip_errors only it is skipped.
    lines = [b"1", b"NaN", b"", b"[1e999]", b"{bad", b"2"]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = sum(len(line) + 1 for line in lines[:4])
    with pytest.raises(RecordError, match=f"line 5 \\(byte offset {offset}\\): invalid JSON"
                       ) as info:
        await collect(JsonLines(path))
    assert (info.value.line, info.value.offset) == (5, offset)
    source = JsonLines(path, skip_errors=True)
    got = await collect(source)
    assert repr(got) == repr([1, float("nan"), [float("inf")], 2])
    assert source.stats.skipped == 1 and source.stats.skipped_errors[0].line == 5


@pytest.mark.parametrize("crlf", [False, True])
async def test_text_lines_tricky(tmp_path: Path, anyio_backend: str, crlf: bool) -> None:
    path = tmp_path / "tricky.txt"
    lines = ["caf\u00e9 \u2713 \U0001f600", "", "  ", "tab\there", "x" * 5000, "last"]
    ending = "\r\n" if crlf else "\n"
    path.write_bytes(ending.join(lines).encode("utf-8"))  # the last line has no newline
    for chunk_size in (3, 1000, 1 << 16):
        assert await collect(TextLines(path, chunk_size=chunk_size)) == lines


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_JSON_VALUES, min_size=1, max_size=8), ascii_only=st.booleans(),
       junk=st.lists(st.text("{}[]\",:0123456789.eE+-nulltrfaseNIy \\u", max_size=12),
                     max_size=3))
def test_a_line_decodes_exactly_as_json_loads(values: list[Any], ascii_only: bool,
                                              junk: list[str]) -> None:
    """Every line, valid or not, is decoded as json.loads decodes it, or refused as it is."""
    lines = [json.dumps(value, ensure_ascii=ascii_only) for value in values] + junk
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    expected: list[Any] = []
    bad: list[int] = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            expected.append(json.loads(line.decode("utf-8")))
        except ValueError:
            bad.append(number)
    stats = SourceStats()
    decoder = JsonLinesDecoder("s", BadRecords(True, stats), 1 << 20)
    got = _decode(decoder, [data])
    assert repr(got) == repr(expected)
    assert [error.line for error in stats.skipped_errors] == bad


# --------------------------------------------------------------------------- decoders, directly


def _decode(decoder: Decoder[Any], chunks: list[bytes]) -> list[Any]:
    """Every record of a shard fed as ``chunks``, ``finish()`` called until it returns none."""
    records: list[Any] = []
    for chunk in chunks:
        records += decoder.feed(chunk)
    while block := decoder.finish():
        records += block
    return records


def _cuts(data: bytes) -> Iterator[list[bytes]]:
    """The shard whole, byte by byte, and cut in two at every position."""
    yield [data]
    yield [data[i : i + 1] for i in range(len(data))]
    for cut in range(1, len(data)):
        yield [data[:cut], data[cut:]]


_NPY = io.BytesIO()
np.save(_NPY, np.arange(12, dtype="<i2").reshape(4, 3))

SHARDS: dict[str, tuple[Callable[[BadRecords], Decoder[Any]], bytes, list[Any]]] = {
    "text": (lambda bad: TextDecoder("s", bad, 1000), b"a\r\nbc\n\nd\xc3\xa9f",
             ["a", "bc", "", "d\u00e9f"]),
    "jsonl": (lambda bad: JsonLinesDecoder("s", bad, 1000), b'{"a": 1}\n\n[2, 3]\r\n"x"\n4',
              [{"a": 1}, [2, 3], "x", 4]),
    "binary": (lambda bad: BinaryDecoder("s", bad, 1000, "<H"),
               b"\x02\x00ab\x00\x00\x03\x00cde", [b"ab", b"", b"cde"]),
}


@pytest.mark.parametrize("kind", sorted(SHARDS))
def test_a_record_cut_anywhere_is_the_same_record(kind: str) -> None:
    make, data, expected = SHARDS[kind]
    for chunks in _cuts(data):
        decoder = make(BadRecords(False, SourceStats()))
        assert _decode(decoder, chunks) == expected, chunks
        assert decoder.pending is None


def test_npy_rows_cut_anywhere_are_the_same_rows() -> None:
    data = _NPY.getvalue()
    expected = np.arange(12, dtype="<i2").reshape(4, 3)
    for chunks in _cuts(data):
        decoder = NpyDecoder("s.npy", BadRecords(False, SourceStats()), 1000)
        decoder.set_size(len(data))
        np.testing.assert_array_equal(np.stack(_decode(decoder, chunks)), expected)
        assert decoder.pending is None


def test_a_malformed_line_is_located_however_the_shard_is_cut() -> None:
    good = b'{"i": 0}\n{"i": 1}\n'
    data = good + b'{"i": 2,,}\n{"i": 3}\n'
    for chunks in _cuts(data):
        decoder = JsonLinesDecoder("s.jsonl", BadRecords(False, SourceStats()), 1000)
        # The records before the bad line are delivered; the error waits in ``pending``.
        assert _decode(decoder, chunks) == [{"i": 0}, {"i": 1}]
        error = decoder.pending
        assert isinstance(error, RecordError)
        assert (error.source, error.line, error.offset) == ("s.jsonl", 3, len(good))
        assert str(error).startswith(f"s.jsonl: line 3 (byte offset {len(good)}): invalid JSON")
        assert decoder.feed(b'{"i": 4}\n') == []  # nothing after the error


def test_skipped_records_are_counted_and_the_last_errors_kept() -> None:
    stats = SourceStats()
    decoder = JsonLinesDecoder("s.jsonl", BadRecords(True, stats), 1000)
    data = b"".join(b"oops\n" if i % 2 else b"%d\n" % i for i in range(400))
    assert _decode(decoder, [data]) == list(range(0, 400, 2))
    assert decoder.pending is None
    assert stats.skipped == 200  # exact, though only the last errors are kept
    assert [error.line for error in stats.skipped_errors] == list(range(202, 401, 2))


def test_bad_records_policy() -> None:
    stats = SourceStats()
    error = RecordError("s: line 1: bad", source="s", offset=0, line=1)
    assert BadRecords(False, stats)(error) is False
    assert (stats.skipped, list(stats.skipped_errors)) == (0, [])
    assert BadRecords(True, stats)(error) is True
    assert (stats.skipped, list(stats.skipped_errors)) == (1, [error])


def test_a_line_longer_than_the_bound_is_not_kept() -> None:
    decoder = TextDecoder("s.txt", BadRecords(False, SourceStats()), 10)
    assert decoder.feed(b"short\n" + b"x" * 11) == ["short"]
    assert decoder.pending is not None
    assert (decoder.pending.line, decoder.pending.offset) == (2, 6)
    assert decoder._carry == []  # the oversized line's bytes are dropped at once


def test_stats_since_and_add_carry_a_workers_counts() -> None:
    worker, loader = SourceStats(), SourceStats()
    before = worker.counts()
    assert worker.since(before) is None
    error = RecordError("s: bad", source="s", offset=3)
    worker.records, worker.bytes, worker.skipped = 5, 40, 1
    worker.skipped_errors.append(error)
    delta = worker.since(before)
    assert delta == (0, 5, 40, 1, 0, 0, 0, 0, 0, 0, 0, 0, [error])
    assert delta is not None
    loader.add(delta)
    assert loader.counts() == (0, 5, 40, 1, 0, 0, 0, 0, 0, 0, 0, 0)
    assert list(loader.skipped_errors) == [error]
