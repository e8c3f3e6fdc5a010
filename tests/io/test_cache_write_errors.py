"""Write errors of the shard cache (aloader.io._cache): a file size limit (``EFBIG``) and a full
disk (``ENOSPC``), real ones (``RLIMIT_FSIZE``; a 1 MiB tmpfs in a mount namespace of its
own). A write error only stops keeping the shard: every record streams from the store, the
temporary files are removed, one warning says why. Each runs in a child process (the limit
and the mount are the child's alone)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from faulty_server import FaultyServer, make_jsonl_shards

pytestmark = pytest.mark.hostile

ROOT = Path(__file__).resolve().parents[2]
SHARDS = make_jsonl_shards(3, 4000)  # ~420 KiB each, ids 0..11999

_CHILD = """
import json, logging, os, resource, sys
import anyio
from aloader import JsonLines

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
urls, cache, limit = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

async def main():
    source = JsonLines(urls, cache_dir=cache, timeout=30, backoff=0.01)
    ids = [record["id"] async for record in source]
    print(json.dumps({"ids": ids, "files": sorted(os.listdir(cache)),
                      "misses": source.stats.cache_misses}))

anyio.run(main)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _check(done: subprocess.CompletedProcess[str], urls: list[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(out["ids"]) == list(range(12000))  # every record, once
    assert not [name for name in out["files"] if ".tmp-" in name]  # nothing left behind
    assert out["misses"] == len(urls)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "not caching" in warnings[0], done.stderr[-3000:]
    return out


def test_a_file_size_limit_only_stops_caching(serve: Callable[..., FaultyServer],
                                              tmp_path: Path) -> None:
    server = serve(SHARDS)
    cache = tmp_path / "cache"
    cache.mkdir()
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(server.urls), str(cache),
                           str(64 << 10)], capture_output=True, text=True, env=_env(),
                          timeout=120)
    _check(done, server.urls)
    assert "File too large" in done.stderr
    assert not [path for path in cache.iterdir() if path.name.endswith(".shard")]


@pytest.mark.parametrize("full", ["bytes", "inodes"])
def test_a_full_disk_only_stops_caching(serve: Callable[..., FaultyServer],
                                        tmp_path: Path, full: str) -> None:
    """A 1 MiB tmpfs as the cache: the first two shards fit, the third's writes fail; or one
    of 6 inodes, where a lock, a note or a checksum file of the second shard cannot be
    made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    server = serve(SHARDS)
    cache = tmp_path / "cache"
    cache.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    options = "size=1m,mode=0755" + (",nr_inodes=6" if full == "inodes" else "")
    command = (f"mount -t tmpfs -o {options} tmpfs {cache} && exec {sys.executable} {script} "
               f"'{json.dumps(server.urls)}' {cache} 0")
    done = subprocess.run([unshare, "-rm", "sh", "-c", command], capture_output=True,
                          text=True, env=_env(), timeout=120)
    out = _check(done, server.urls)
    assert "No space left on device" in done.stderr
    kept = [name for name in out["files"] if isinstance(name, str) and name.endswith(".shard")]
    assert len(kept) == (2 if full == "bytes" else 1)
