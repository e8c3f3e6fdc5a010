"""The programs in examples/ run as a user runs them (a fresh process each), on small data:
the training loop killed and resumed gives the uninterrupted run's batches and weights, the
S3 stream reads each shard from the store once and later epochs from the cache, the trio
program finishes with every item once. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sourcetools import local_s3, object_gets

from aloader._demo import make_jsonl_shards

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """``python examples/<script> args...`` in ``cwd``, with this checkout first on the path."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])])
    environment.update(env or {})
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd,
                          env=environment, capture_output=True, text=True, timeout=240)
    if check:
        assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done


def steps(record: Path) -> list[list[int]]:
    """The batches of a run's record, by step; a step recorded twice (done again after a
    resume) counts as its last recording."""
    by_step: dict[int, list[int]] = {}
    for line in record.read_text().splitlines():
        entry = json.loads(line)
        by_step[entry["step"]] = entry["indices"]
    assert sorted(by_step) == list(range(1, len(by_step) + 1))
    return [by_step[step] for step in sorted(by_step)]


def final_weights(output: str) -> list[float]:
    line = next(line for line in output.splitlines() if line.startswith("final weights"))
    return [float(word) for word in line.split()[2:]]


def test_training_loop_killed_and_resumed_gives_the_uninterrupted_batches(
        tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the training example needs torch")
    whole = run("train_checkpoint.py", "--checkpoint", "whole.pt", "--record", "whole.jsonl",
                cwd=tmp_path)
    # Killed (SIGKILL) after step 25 with two workers; the last checkpoint is step 20's.
    killed = run("train_checkpoint.py", "--checkpoint", "cut.pt", "--record", "cut.jsonl",
                 "--num-workers", "2", "--kill-at-step", "25", cwd=tmp_path, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run("train_checkpoint.py", "--checkpoint", "cut.pt", "--record", "cut.jsonl",
                  cwd=tmp_path)
    assert "resumed at step 20, in epoch 1" in resumed.stdout
    expected = steps(tmp_path / "whole.jsonl")
    assert len(expected) == 3 * 512 // 32
    assert steps(tmp_path / "cut.jsonl") == expected
    assert final_weights(resumed.stdout) == pytest.approx(final_weights(whole.stdout),
                                                           abs=1e-5)


def test_s3_stream_reads_each_shard_once_then_from_the_cache(tmp_path: Path) -> None:
    shards = make_jsonl_shards(6, 100)
    with local_s3("examples", {f"train/{name}": body for name, body in shards.items()}) as s3:
        s3.proxy.reset()
        done = run("s3_cache_stream.py", "s3://examples/train/*.jsonl", "--cache-dir",
                   str(tmp_path / "cache"), "--epochs", "3", "--batch-size", "64",
                   cwd=tmp_path, env=s3.env())
        gets = object_gets(s3, "examples")
    lines = done.stdout.splitlines()
    assert lines[0] == "6 shards under s3://examples/train/*.jsonl"
    for epoch in range(3):
        assert lines[1 + epoch].startswith(f"epoch {epoch}: 600 records in 10 batches")
    assert "cache misses 6, hits 12" in lines[3]
    assert gets == 6  # the first epoch's downloads; the later epochs made no object request


def test_trio_program_runs(tmp_path: Path) -> None:
    pytest.importorskip("trio")
    done = run("trio_app.py", "--items", "300", "--latency-ms", "2", cwd=tmp_path)
    assert "part 1: 300 items" in done.stdout and "every item once" in done.stdout
    assert "part 2: 200 records from 4 shards, 400 words" in done.stdout
    assert "part 3: 200 concurrent requests answered" in done.stdout
