"""Shared-memory segment names: unpredictable, never another's file, swept only when ours."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from aloader.workers import _shm

BIG = np.arange(100_000.0)  # out of band: every encode writes a segment


def written(codec: _shm.Codec, count: int) -> list[str]:
    names = []
    for _ in range(count):
        _shm.decode(codec.encode(BIG))  # unlinks the one-shot segment once opened
        assert codec.last_segment is not None
        names.append(codec.last_segment)
    return names


def test_names_are_distinct_and_unpredictable() -> None:
    codec = _shm.Codec(_shm.owner(), "test")
    names = written(codec, 20)
    assert len(set(names)) == 20
    assert all(name.startswith(codec.prefix) for name in names)
    suffixes = [name[len(codec.prefix) :] for name in names]
    assert all(len(s) == 16 and int(s, 16) >= 0 for s in suffixes)  # 64 random bits each
    assert not {str(i) for i in range(20)} & set(suffixes)  # no counter
    # Another codec of the same writer draws other names.
    assert not set(written(_shm.Codec(_shm.owner(), "test"), 20)) & set(names)


def test_owner_tag_is_random_per_process() -> None:
    tag = _shm.owner()
    assert tag == _shm.owner()
    pid_part = _shm.process_prefix(os.getpid())[len("aloader-") :]
    assert tag.startswith(pid_part) and len(tag) > len(pid_part) + 8
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a forked child is another owner
        os.write(write, _shm.owner().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    theirs = os.read(read, 200).decode()
    os.close(read)
    assert theirs != tag and theirs.startswith(_shm.process_prefix(child)[len("aloader-") :])


def test_a_name_that_exists_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = _shm.Codec(_shm.owner(), "test")
    planted = os.path.join(_shm.SHM_DIR, codec.prefix + "a" * 16)
    with open(planted, "wb") as f:
        f.write(b"not yours")
    draws = iter(["a" * 16, "a" * 16, "b" * 16])
    monkeypatch.setattr(_shm, "_token", lambda: next(draws))
    try:
        back = _shm.decode(codec.encode(BIG))
        np.testing.assert_array_equal(back, BIG)
        assert codec.last_segment == codec.prefix + "b" * 16
        with open(planted, "rb") as f:
            assert f.read() == b"not yours"  # never opened, written or removed
    finally:
        os.unlink(planted)


def test_no_free_name_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = _shm.Codec(_shm.owner(), "test")
    planted = os.path.join(_shm.SHM_DIR, codec.prefix + "c" * 16)
    open(planted, "wb").close()
    monkeypatch.setattr(_shm, "_token", lambda: "c" * 16)
    try:
        with pytest.raises(FileExistsError, match="no free segment name"):
            codec.encode(BIG)
    finally:
        os.unlink(planted)


def plant(name: str) -> str:
    path = os.path.join(_shm.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"x")
    return path


def test_sweep_removes_only_this_process_segments() -> None:
    mine = plant(_shm.prefix(_shm.owner(), "p0") + "0" * 16)
    # Another process that had (or, in another namespace, has) this pid: another token.
    same_pid = plant(_shm.process_prefix(os.getpid()) + "ffffffffffffffff-p0-" + "0" * 16)
    try:
        _shm.sweep(_shm.prefix(_shm.owner()))
        assert not os.path.exists(mine)
        assert os.path.exists(same_pid)
    finally:
        for path in (mine, same_pid):
            if os.path.exists(path):
                os.unlink(path)


def test_sweep_stale_removes_only_proven_dead_owners(tmp_path: Any) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = plant(_shm.process_prefix(gone.pid) + "0123456789abcdef-p0-" + "0" * 16)
    alive = plant(_shm.process_prefix(os.getppid()) + "0123456789abcdef-p0-" + "0" * 16)
    other_ns = plant("aloader-0." + str(gone.pid) + ".0123456789abcdef-p0-" + "0" * 16)
    not_aloader = plant(f"aloaderx-{gone.pid}-p0-0")
    link = os.path.join(_shm.SHM_DIR, _shm.process_prefix(gone.pid) + "0123456789abcdef-l-0")
    target = tmp_path / "target"
    target.write_text("keep")
    os.symlink(target, link)
    try:
        _shm.sweep_stale()
        assert not os.path.exists(stale)
        assert os.path.exists(alive)
        assert os.path.exists(other_ns)
        assert os.path.exists(not_aloader)
        assert os.path.lexists(link) and target.read_text() == "keep"  # never a link
    finally:
        for path in (stale, alive, other_ns, not_aloader, link):
            if os.path.lexists(path):
                os.unlink(path)
