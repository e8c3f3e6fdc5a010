"""aloader prints nothing and logs to ``aloader`` and its children: skipped samples (rate
limited), HTTP retries, worker deaths and restarts, a slow first batch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from faulty_server import FaultyServer, make_jsonl_shards
from test_failures import Sync  # the same failing dataset

import aloader
from aloader import DataLoader
from aloader._log import RateLimited, brief


def test_nothing_is_printed_without_configuration() -> None:
    code = (
        "import aloader\n"
        "class D:\n"
        "    def __len__(self): return 8\n"
        "    def __getitem__(self, i):\n"
        "        if i == 3: raise ValueError(i)\n"
        "        return i\n"
        "print(sum(len(b) for b in aloader.DataLoader(D(), batch_size=2, max_failures=1)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "7\n" and result.stderr == ""


def test_skipped_samples_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    bad = set(range(0, 200, 2))  # 100 failures
    with caplog.at_level(logging.WARNING, logger="aloader.loader"):
        got = list(DataLoader(Sync(bad, 200), batch_size=10, collate_fn=list,
                              max_failures=100))
    assert sum(map(len, got)) == 100
    records = [r for r in caplog.records if r.name == "aloader.loader"]
    # The first 10 in full, then a summary (at once, then at most every 30 s), and the
    # epoch's summary at its end: the count, the budget, the first and last errors.
    assert len(records) == 12
    assert records[0].getMessage() == "skipped sample 0: ValueError: bad sample 0"
    assert records[10].getMessage().startswith("skipped 1 more samples; the last: skipped "
                                               "sample 20")
    assert records[11].getMessage() == (
        "the epoch ended with 100 failed samples, within the failure budget "
        "(max_failures=100); the first: ValueError: bad sample 0; the last: ValueError: bad "
        "sample 198")


def test_rate_limited_summaries() -> None:
    now = [0.0]
    logger = logging.getLogger("aloader.test")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        limited = RateLimited(logger, first=2, every=10.0, clock=lambda: now[0])
        for i in range(6):
            now[0] = float(i)
            limited.log(logging.INFO, "event %d", i, summary="%(count)d more, last: %(last)s")
        now[0] = 12.0
        limited.log(logging.INFO, "event %d", 6, summary="%(count)d more, last: %(last)s")
    finally:
        logger.removeHandler(handler)
    assert seen == ["event 0", "event 1", "1 more, last: event 2", "4 more, last: event 6"]
    assert limited.events == 7


def test_brief() -> None:
    assert brief(ValueError("x")) == "ValueError: x"
    assert brief(ValueError("Caught ValueError in worker.\nTraceback\nValueError: x\n")) == (
        "ValueError: x")


def test_worker_samples_logged_in_the_loader(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aloader"):
        list(DataLoader(Sync({5}), batch_size=4, collate_fn=list, max_failures=1,
                        num_workers=2))
    messages = [r.getMessage() for r in caplog.records if r.name == "aloader.loader"]
    assert messages == ["skipped sample 5: ValueError: bad sample 5",
                        "the epoch ended with 1 failed sample, within the failure budget "
                        "(max_failures=1); the first: ValueError: bad sample 5; the last: "
                        "ValueError: bad sample 5"]


class Dying:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            os._exit(3)
        return i


def test_worker_death_and_restart_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    dl = DataLoader(Dying(), batch_size=2, num_workers=2, persistent_workers=True)
    with caplog.at_level(logging.INFO, logger="aloader"):
        with pytest.raises(aloader.WorkerError):
            list(dl)
        with pytest.raises(aloader.WorkerError):
            list(dl)
    dl.close()
    workers = [r for r in caplog.records if r.name == "aloader.workers"]
    assert any(r.levelno == logging.ERROR and "exited unexpectedly with exit code 3"
               in r.getMessage() for r in workers)
    assert any("restarting the persistent workers" in r.getMessage() for r in workers)


def test_slow_first_batch(caplog: pytest.LogCaptureFixture,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import aloader.loader._dataloader

    class Slow(Sync):
        def __getitem__(self, i: int) -> int:
            if i == 0:
                time.sleep(0.2)
            return i

    monkeypatch.setattr(aloader.loader._dataloader, "SLOW_FIRST_BATCH", 0.05)
    with caplog.at_level(logging.WARNING, logger="aloader.loader"):
        list(DataLoader(Slow(set(), 8), batch_size=2))
    messages = [r.getMessage() for r in caplog.records if r.name == "aloader.loader"]
    assert len(messages) == 1 and messages[0].startswith("the first batch took")


@pytest.fixture
def server() -> Iterator[Any]:
    srv = FaultyServer(make_jsonl_shards(1, 5)).start()
    try:
        yield srv
    finally:
        srv.close()


def test_http_retries_are_logged(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    name = next(iter(server.files))
    server.fail(name, 503, times=2)
    source = aloader.JsonLines(server.urls, retries=3, backoff=0.01, max_backoff=0.05)
    with caplog.at_level(logging.INFO, logger="aloader.http"):
        assert sum(len(b) for b in DataLoader(source, batch_size=2, collate_fn=list)) == 5
    retries = [r.getMessage() for r in caplog.records if r.name == "aloader.http"]
    assert len(retries) == 2
    assert "(attempt 2 of 4)" in retries[0] and "503" in retries[0]
    assert "(attempt 3 of 4)" in retries[1]
