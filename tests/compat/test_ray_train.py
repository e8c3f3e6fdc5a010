"""aloader.from_ray against a local Ray (``ray.init(num_cpus=2)``): a Dataset, the parts of a
``streaming_split``, and Ray Train's TorchTrainer on 2 CPU workers running
examples/ray_train.py, whose workers load their shard through aloader.

Ray runs in a process of its own (ray_session.py beside this file, one Ray session for the
module: starting Ray costs seconds), never in the test process: Ray's daemons, threads and
actors, and Ray Train's SIGINT handler (which turns a later Ctrl-C into a call to a dead
actor) end with that process. A hard time limit kills it and everything it started. Where
unprivileged namespaces are allowed (``unshare -rn``), it runs in a network namespace with
only a loopback interface, so that the ports Ray's daemons bind on all interfaces cannot be
reached from elsewhere; where they are not, it runs as a plain process, and the tests run
all the same. Ray is given a random token (its token authentication) and a
session folder of its own, removed afterwards: nothing is left in ``~/.ray`` or ``/tmp/ray``.

Skipped where Ray is not installed (``pip install "aloader[ray]"``), and the Ray Train case
where Ray Train or torch is not.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import ray_session  # beside this file; imports no Ray

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PROGRAM = Path(ray_session.__file__)  # run as a program; imported only for its constants
# Hang guards (seconds), never timing assertions: the session takes about half a minute on
# two busy cores, most of it Ray Train's.
SESSION_LIMIT = 220
PROBE_LIMIT = 30
GUARD = SESSION_LIMIT + PROBE_LIMIT + 40

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,  # never imported here
                       reason="Ray is not installed (pip install 'aloader[ray]')"),
    pytest.mark.timeout(GUARD),
]


@functools.cache
def namespace() -> tuple[str, ...]:
    """The command prefix that runs a program in a network namespace of its own with only a
    loopback interface (and a PID namespace, so that killing it kills all Ray started), or
    ``()`` where this machine does not allow one: the session then runs as a plain process."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--user", "--map-root-user", "--net", "--pid", "--kill-child",
              "--mount-proc")
    try:
        probe = subprocess.run([*prefix, sys.executable, str(PROGRAM), "--probe"],
                               capture_output=True, timeout=PROBE_LIMIT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if probe.returncode == 0 else ()


def run_session(cases: list[str]) -> dict[str, Any]:
    """Run ray_session.py with ``cases``; its JSON lines by case, with ``"stderr"``'s tail,
    ``"timed_out"`` and ``"returncode"``. A session that ends shuts Ray down; one that hangs,
    or whose test is stopped, is killed with all it started; one whose test process dies
    kills itself (see ray_session.exit_with_parent)."""
    work = Path(tempfile.mkdtemp(prefix="aloader-ray-"))  # short: Ray's socket paths go in it
    try:
        (work / "session").mkdir()
        prefix = namespace()
        env = {
            **os.environ,
            # Ray's workers import the example and aloader from the paths the driver has.
            "PYTHONPATH": os.pathsep.join(
                [str(EXAMPLES), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "ALOADER_RAY_NETNS": "1" if prefix else "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Token authentication with a token of this session's, not one saved in ~/.ray.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # Starting Ray Train's worker group (two processes importing torch) on two busy
            # cores can pass Ray's 60 s default: the session's own limit is the guard.
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(SESSION_LIMIT),
        }
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            process = subprocess.Popen(
                [*prefix, sys.executable, str(PROGRAM), str(work / "session"), *cases],
                stdin=subprocess.PIPE, stdout=out, stderr=err, env=env,
                start_new_session=True)  # its stdin closes when this process ends
            timed_out = False
            try:
                process.wait(SESSION_LIMIT)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if process.returncode is None:  # hung, or this test was stopped (not reaped
                    # yet, so its pid is still its own): it, and Ray's daemons and workers.
                    ray_session.kill_tree(process.pid)
                    process.wait()
                assert process.stdin is not None
                process.stdin.close()
        lines = (work / "stdout").read_text().splitlines()
        stderr = (work / "stderr").read_text(errors="replace")
        if timed_out or process.returncode:
            # Why Ray hung or failed is in its daemons' logs (a worker that cannot start is
            # only in raylet.err): their tails, before the folder goes.
            logs = work / "session" / "ray" / "session_latest" / "logs"
            for log in sorted(logs.glob("*.err")) if logs.is_dir() else ():
                if text := log.read_text(errors="replace").strip():
                    stderr += f"\n--- {log.name}:\n{text[-2000:]}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {line["case"]: line for line in map(json.loads, lines)}
    report["stderr"] = stderr[-12000:]
    report["timed_out"] = timed_out
    report["returncode"] = process.returncode
    return report


@pytest.fixture(scope="module")
def session() -> dict[str, Any]:
    report = run_session(["dataset", "split", "train"])  # the trainer last: the heaviest
    if "skip" in report.get("session", {}):
        pytest.skip(f"Ray cannot run here: {report['session']['skip']}")
    return report


def case(report: dict[str, Any], name: str) -> Any:
    """The result of case ``name``, or the test fails with what the session said."""
    line = report.get(name)
    if line is None:
        what = "timed out" if report["timed_out"] else f"exited with {report['returncode']}"
        pytest.fail(f"the Ray session {what} before case {name!r} ended; its stderr:\n"
                    f"{report['stderr']}")
    if "error" in line:
        pytest.fail(f"case {name!r} raised in the Ray session:\n{line['error']}")
    result = line["result"]
    if "skip" in result:
        pytest.skip(result["skip"])
    # Every loader of the case was closed or dropped: aloader left no thread behind in Ray's
    # driver.
    assert result["leftover_threads"] == []
    return result


def test_the_session_runs_apart_and_ends_cleanly(session: dict[str, Any]) -> None:
    assert session["returncode"] == 0 and "session" in session, session["stderr"]
    if namespace():  # only loopback: Ray's daemons cannot be reached from elsewhere
        assert session["session"] == {"case": "session", "isolated": True,
                                      "interfaces": ["lo"]}
    else:
        assert session["session"]["isolated"] is False
    assert "ray" not in sys.modules  # the test process never ran Ray


def test_a_dataset_every_row_once_and_resume_by_counting(session: dict[str, Any]) -> None:
    result = case(session, "dataset")
    assert result["full"] == list(range(300))
    assert result["square_1"] == [i * i for i in range(32, 64)]
    assert result["state"]["iterable"]["replicas"][0]["state"]["position"] == {
        "stage": "count", "skip": 96}
    assert result["resumed"] == list(range(96, 300))


def test_the_parts_of_a_streaming_split(session: dict[str, Any]) -> None:
    result = case(session, "split")
    assert result["errors"] == []
    seen = result["seen"]
    assert sorted(seen[0] + seen[1]) == list(range(400))
    assert len(seen[0]) == len(seen[1]) == 200  # equal=True


def test_ray_train_torch_trainer_example(session: dict[str, Any]) -> None:
    result = case(session, "train")
    assert result["error"] is None
    assert result["metrics"]["epoch"] == 1
    assert result["metrics"]["loss"] < 1.0
    records = result["records"]
    for epoch in range(2):
        parts = [records[f"{epoch}-{rank}"] for rank in (0, 1)]
        assert len(parts[0]) == len(parts[1]) == ray_session.ROWS // 2  # Ray Train's equal split
        assert sorted(parts[0] + parts[1]) == list(range(ray_session.ROWS))
    for rank in (0, 1):  # each worker's loader state, between epochs: it resumes anywhere
        state = result["loader_states"][f"loader-{rank}"]
        assert state["iterable"]["mode"] == "between"
        assert state["epoch"] == 2
