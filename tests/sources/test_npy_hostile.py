"""Attacks on aloader.sources._formats' NpyDecoder and BinaryDecoder with hostile files, where the
shard's size is known (a local file) and where it is not (a compressed shard, a chunked HTTP
body): a header claiming 10**12 rows or rows of gigabytes, Fortran order, object dtypes
whose pickle must never be loaded, a header longer than the file, data cut at every offset,
length prefixes that lie. The whole rows before the damage, then a located error; never an
allocation of what a header claims, never a partial row, never a pickle run."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sourcetools import collect, write
from test_formats import npy_with_rows

from aloader import BinaryRecords, NpyRows, RecordError, SourceError, SourceStats
from aloader.sources._formats import BadRecords, BinaryDecoder, NpyDecoder

pytestmark = [pytest.mark.hostile, pytest.mark.anyio]


def npy(array: np.ndarray[Any, Any], **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, **kwargs)
    return buffer.getvalue()


def npy_header(header: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def feed_all(decoder: Any, data: bytes, piece: int = 1 << 12, size: bool = True
             ) -> tuple[list[Any], RecordError | None]:
    if size:
        decoder.set_size(len(data))
    out: list[Any] = []
    for start in range(0, len(data), piece):
        if decoder.pending is not None:
            break
        out += decoder.feed(data[start : start + piece])
    if decoder.pending is None:
        while block := decoder.finish():
            out += block
    return out, decoder.pending


def npy_decoder(max_record_bytes: int = 1 << 26) -> NpyDecoder:
    return NpyDecoder("x.npy", BadRecords(False, SourceStats()), max_record_bytes)


# --------------------------------------------------------------------------- npy


def test_a_header_claiming_10_12_rows_allocates_nothing_of_it() -> None:
    data = npy_with_rows(10**12, np.zeros((2000, 4)))
    for size in (True, False):
        tracemalloc.start()
        try:
            rows, error = feed_all(npy_decoder(), data, size=size)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert error is not None
        assert "truncated array: the shard ends after 2000 of 1000000000000 rows" in str(error)
        assert len(rows) == 2000  # the rows the shard holds, then the error
        assert peak < 4 << 20, peak


async def test_a_compressed_npy_claiming_10_12_rows(tmp_path: Path, anyio_backend: str) -> None:
    path = write(tmp_path, "huge.npy.gz", gzip.compress(npy_with_rows(10**12, np.ones((50, 2)))))
    source = NpyRows(path)
    with pytest.raises(RecordError, match=r"huge\.npy\.gz: .*truncated array: the shard ends "
                                          r"after 50 of 1000000000000 rows"):
        await collect(source)


@pytest.mark.parametrize("shape", [(3, 10**10, 10**10), (2, 1 << 40)])
def test_rows_of_astronomic_size_are_refused_before_any_allocation(shape: tuple[int, ...]
                                                                   ) -> None:
    data = npy_header({"descr": "<f8", "fortran_order": False, "shape": shape}) + bytes(64)
    with pytest.raises(SourceError, match=r"x\.npy: rows of \d+ bytes exceed max_record_bytes"):
        feed_all(npy_decoder(), data, size=False)


@pytest.mark.parametrize("size", [True, False])
def test_fortran_order(size: bool) -> None:
    array = np.arange(12.0).reshape(4, 3)
    with pytest.raises(SourceError, match="Fortran-ordered"):
        feed_all(npy_decoder(), npy(np.asfortranarray(array)), size=size)
    # One dimension: the same bytes in either order.
    data = npy_header({"descr": "<f8", "fortran_order": True, "shape": (5,)}) + \
        np.arange(5.0).tobytes()
    rows, error = feed_all(npy_decoder(), data, size=size)
    assert error is None and [float(row) for row in rows] == [0, 1, 2, 3, 4]


class _Tripwire:
    """Unpickling it creates a file: a pickle that was loaded leaves a trace."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("kind", ["object", "a field", "a subarray"])
async def test_object_dtypes_are_refused_and_never_unpickled(
        tmp_path: Path, anyio_backend: str, kind: str) -> None:
    trace = tmp_path / "unpickled"
    if kind == "object":
        array = np.array([_Tripwire(trace), 1, 2], dtype=object)
    elif kind == "a field":
        array = np.zeros(3, dtype=[("x", "<i4"), ("o", "O")])
        array[0] = (1, _Tripwire(trace))
    else:
        array = np.zeros(3, dtype=[("sub", "O", (2,))])
        array["sub"][0, 0] = _Tripwire(trace)
    data = npy(array, allow_pickle=True)
    assert b"touch" in data  # the pickle follows the header
    path = write(tmp_path, "o.npy", data)
    for source in (NpyRows(path), NpyRows(path, skip_errors=True)):
        with pytest.raises(SourceError, match=r"o\.npy: arrays of Python objects"):
            await collect(source)
    assert not trace.exists()
    pickle.loads(pickle.dumps(_Tripwire(trace)))  # the tripwire itself works
    assert trace.exists()


@pytest.mark.parametrize("size", [True, False])
def test_a_header_longer_than_the_file(size: bool) -> None:
    header = npy_header({"descr": "<f8", "fortran_order": False, "shape": (4,)})
    rows, error = feed_all(npy_decoder(), header[:-20], piece=7, size=size)
    assert rows == [] and error is not None and "truncated .npy header" in str(error)
    # A version 2 header saying 4 GiB, the size unknown: refused at once, not waited for.
    big = b"\x93NUMPY\x02\x00" + struct.pack("<I", (1 << 32) - 1) + b"{" * 100
    decoder = npy_decoder()
    assert decoder.feed(big) == []
    assert decoder.pending is not None and "exceeds max_record_bytes" in str(decoder.pending)


@pytest.mark.parametrize("size", [True, False])
def test_data_cut_at_every_offset_gives_whole_rows_then_an_error(size: bool) -> None:
    array = np.arange(24, dtype="<i2").reshape(8, 3)
    data = npy(array)
    header = len(data) - array.nbytes
    for cut in range(header, len(data)):
        rows, error = feed_all(npy_decoder(), data[:cut], piece=5, size=size)
        whole = (cut - header) // 6
        assert error is not None and "truncated array" in str(error), cut
        assert len(rows) == whole, cut
        assert all(np.array_equal(row, array[i]) for i, row in enumerate(rows))
    rows, error = feed_all(npy_decoder(), data, piece=5, size=size)
    assert error is None and np.array_equal(np.stack(rows), array)


# --------------------------------------------------------------------------- binary


def binary_decoder(header: str = "<I", limit: int = 1 << 20) -> BinaryDecoder:
    return BinaryDecoder("x.bin", BadRecords(False, SourceStats()), limit, header)


@pytest.mark.parametrize("size", [True, False])
def test_binary_length_prefixes_that_lie(size: bool) -> None:
    ok = struct.pack("<I", 3) + b"abc"
    huge = ok + struct.pack("<I", 0xFFFFFFFF) + b"rest"
    rows, error = feed_all(binary_decoder(), huge, size=size)
    assert rows == [b"abc"] and error is not None
    assert "record 1 at byte offset 7: its length header says 4294967295 bytes" in str(error)
    negative = ok + struct.pack("<q", -5) + b"rest"
    rows, error = feed_all(binary_decoder("<q", 1 << 20), struct.pack("<q", 3) + b"abc"
                           + negative[7:], size=size)
    assert rows == [b"abc"] and error is not None and "says -5 bytes" in str(error)
    # Within the limit but beyond the shard: found at once when the size is known.
    beyond = ok + struct.pack("<I", 1 << 19) + b"x" * 100
    decoder = binary_decoder()
    if size:
        decoder.set_size(len(beyond))
    rows = decoder.feed(beyond)
    assert rows == [b"abc"]
    if not size:
        assert decoder.pending is None
        decoder.finish()
    assert decoder.pending is not None and "truncated record" in str(decoder.pending)


@pytest.mark.parametrize("size", [True, False])
def test_binary_cut_at_every_offset(size: bool) -> None:
    records = [bytes([i]) * i for i in range(1, 9)]
    data = b"".join(struct.pack("<I", len(r)) + r for r in records)
    ends = [sum(4 + len(r) for r in records[: i + 1]) for i in range(len(records))]
    for cut in range(len(data)):
        rows, error = feed_all(binary_decoder(), data[:cut], piece=3, size=size)
        whole = sum(1 for end in ends if end <= cut)
        assert rows == records[:whole], cut
        assert (error is None) == (cut in (0, *ends)), cut


async def test_binary_records_bomb_of_a_compressed_length(tmp_path: Path,
                                                         anyio_backend: str) -> None:
    """A .gz whose one record claims 60 MiB of zeros (within max_record_bytes) then stops:
    the size is unknown, so the record is gathered, then refused as truncated."""
    data = struct.pack("<I", 60 << 20) + bytes(1 << 20)
    path = write(tmp_path, "b.bin.gz", gzip.compress(data))
    with pytest.raises(RecordError, match=r"b\.bin\.gz: record 0 at byte offset 0: truncated"):
        await collect(BinaryRecords(path))
