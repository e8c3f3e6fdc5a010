"""ParquetRows' rows made from the columns' values (``_row_maker``) rather than by
``RecordBatch.to_pylist``: the same dicts, keys in the same order, values equal and of the
same types, whatever the schema (nested values, nulls, dictionaries, names that are not
identifiers), and pyarrow's own conversion where the maker declines."""

from __future__ import annotations

import datetime
import decimal
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from sourcetools import collect

import aloader.sources._parquet as parquet_module
from aloader import DataLoader, ParquetRows

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None,
                                reason="pyarrow is not installed")

# Names a naive code generator would break on: quotes, backslashes, braces, a newline,
# a keyword, digits first, non-ASCII, an empty name.
ODD_NAMES = ["it's", 'say "hi"', "back\\slash", "}{", "line\nbreak", "class", "0x", "名前",
             ""]


def same_rows(got: list[Any], expected: list[Any]) -> None:
    """Equal, and also equal in key order and in the type of every value (1 == 1.0 == True
    would hide a changed conversion)."""
    assert got == expected
    for a, b in zip(got, expected, strict=True):
        assert list(a) == list(b)
        assert [type(v) for v in a.values()] == [type(v) for v in b.values()]


def rich_table(rows: int) -> Any:
    import pyarrow as pa

    ids = list(range(rows))
    return pa.table({
        "i64": pa.array(ids, pa.int64()),
        "i8n": pa.array([None if i % 3 == 0 else i % 100 for i in ids], pa.int8()),
        "u32": pa.array(ids, pa.uint32()),
        "f32": pa.array([i / 4 for i in ids], pa.float32()),
        "f64n": pa.array([None if i % 5 == 0 else i * 0.5 for i in ids], pa.float64()),
        "flag": pa.array([i % 2 == 0 for i in ids], pa.bool_()),
        "text": [f"row {i}" for i in ids],
        "blob": pa.array([bytes([i % 256]) * 3 for i in ids], pa.binary()),
        "big": pa.array([str(i) * 2 for i in ids], pa.large_string()),
        "dict": pa.array([f"k{i % 4}" for i in ids]).dictionary_encode(),
        "when": pa.array([datetime.datetime(2020, 1, 1) + datetime.timedelta(seconds=i)
                          for i in ids], pa.timestamp("us")),
        "day": pa.array([datetime.date(2021, 1, 1 + i % 28) for i in ids], pa.date32()),
        "money": pa.array([decimal.Decimal(i) / 100 for i in ids], pa.decimal128(10, 2)),
        "point": [{"x": float(i), "y": None if i % 4 == 0 else -i} for i in ids],
        "tags": [[i, i + 1][: i % 3] if i % 7 else None for i in ids],
        "kv": pa.array([[("a", i)] for i in ids], pa.map_(pa.string(), pa.int64())),
        "none": pa.array([None] * rows, pa.null()),
    })


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_made_rows_are_to_pylist(rows: int) -> None:
    """Every width the maker writes out (1 to 8 columns), over every kind of column."""
    import pyarrow as pa

    table = rich_table(rows)
    batch = pa.record_batch([c.combine_chunks() for c in table.columns],
                            names=table.column_names)
    for width in range(1, 9):
        for first in range(0, batch.num_columns - width + 1, 3):
            part = batch.select(list(range(first, first + width)))
            make = parquet_module._row_maker(tuple(part.schema.names))
            assert make is not None
            same_rows(make([c.to_pylist() for c in part.columns]), part.to_pylist())
    same_rows(parquet_module._rows_of(batch), batch.to_pylist())  # pyarrow's: 18 columns
    assert len(batch.to_pylist()) == rows


def test_odd_names_are_data_not_code() -> None:
    import pyarrow as pa

    batch = pa.record_batch({name: [i, None, i * 2] for i, name in enumerate(ODD_NAMES)})
    for first in range(0, len(ODD_NAMES), 8):
        part = batch.select(list(range(first, min(first + 8, len(ODD_NAMES)))))
        make = parquet_module._row_maker(tuple(part.schema.names))
        assert make is not None
        same_rows(make([c.to_pylist() for c in part.columns]), part.to_pylist())


def test_no_code_is_made_from_a_schema() -> None:
    """The row maker executes no generated code (a file's names must never reach exec):
    the module calls neither exec, eval nor compile."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(parquet_module))
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"exec", "eval", "compile"}


def test_the_maker_declines_what_pyarrow_should_make() -> None:
    """No columns, a name twice (to_pylist keeps the first name's place and the last
    column's value), more than 8 columns: pyarrow's own to_pylist."""
    assert parquet_module._row_maker(()) is None
    assert parquet_module._row_maker(("a", "b", "a")) is None
    wide = tuple(f"c{i}" for i in range(9))
    assert parquet_module._row_maker(wide) is None
    assert parquet_module._row_maker(wide[:-1]) is not None


async def test_parquet_rows_of_a_rich_file_are_pyarrows(tmp_path: Path,
                                                        anyio_backend: str) -> None:
    import pyarrow.parquet as pq

    table = rich_table(1000)
    path = tmp_path / "rich.parquet"
    pq.write_table(table, path, row_group_size=300)
    expected = pq.read_table(path).to_pylist()
    source = ParquetRows(path, batch_rows=128)
    same_rows(await collect(source), expected)
    chosen = ParquetRows(path, columns=["point", "i8n", "kv"], batch_rows=1000)
    same_rows(await collect(chosen), pq.read_table(path, columns=["point", "i8n", "kv"])
              .to_pylist())


async def test_odd_names_through_a_file_and_a_loader(tmp_path: Path,
                                                     anyio_backend: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "odd.parquet"
    pq.write_table(pa.table({name: list(range(i, i + 50)) for i, name in enumerate(ODD_NAMES)}),
                   path, row_group_size=20)
    expected = pq.read_table(path).to_pylist()
    batches = [b async for b in DataLoader(ParquetRows(path, batch_rows=16), batch_size=8,
                                           collate_fn=list)]
    same_rows([row for batch in batches for row in batch], expected)


async def test_duplicate_names_keep_pyarrows_rows(tmp_path: Path, anyio_backend: str) -> None:
    """A file with a column name twice: pyarrow's own rows (the maker declines)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "dup.parquet"
    table = pa.Table.from_arrays([pa.array([1, 2]), pa.array(["x", "y"]), pa.array([3, 4])],
                                 names=["a", "b", "a"])
    pq.write_table(table, path)
    same_rows(await collect(ParquetRows(path)), pq.ParquetFile(path).read().to_pylist())


def collections_while_making(piece: Any) -> tuple[list[Any], int]:
    """_rows_of(piece), and the collections the cyclic collector started inside it."""
    import gc
    import sys

    inside = 0

    def watch(phase: str, info: dict[str, Any]) -> None:
        nonlocal inside
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is parquet_module._rows_of.__code__:
                inside += phase == "start"
                return
            frame = frame.f_back  # type: ignore[assignment]

    gc.callbacks.append(watch)
    try:
        rows = parquet_module._rows_of(piece)
    finally:
        gc.callbacks.remove(watch)
    return rows, inside


def test_no_collection_while_a_piece_is_made() -> None:
    """4096 rows allocate ~4100 dicts: with the collector running, several young
    collections would start inside the piece; paused, none, and it runs again after."""
    import gc

    import pyarrow as pa

    piece = pa.record_batch({"a": list(range(4096)), "b": [[i] for i in range(4096)]})
    assert gc.isenabled()
    rows, inside = collections_while_making(piece)
    assert inside == 0
    assert gc.isenabled()
    same_rows(rows, piece.to_pylist())


def test_a_collector_turned_off_stays_off() -> None:
    import gc

    import pyarrow as pa

    piece = pa.record_batch({"a": list(range(10))})
    gc.disable()
    try:
        assert parquet_module._rows_of(piece) == piece.to_pylist()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failing_piece_turns_the_collector_on_again() -> None:
    """A value Python cannot hold (a timestamp past datetime's range) raises pyarrow's error
    from inside the paused piece; the collector is on again after it."""
    import gc

    import pyarrow as pa

    piece = pa.record_batch({"t": pa.array([0, 2**62], pa.timestamp("us"))})
    with pytest.raises(OverflowError):
        parquet_module._rows_of(piece)
    assert gc.isenabled()
