"""One local Ray session, in a process of its own, running aloader.from_ray's cases for
tests/compat/test_ray_train.py, which starts it (``sys.executable``) and checks what it prints.

Ray changes the process that calls ``ray.init`` for good: it starts daemons (a GCS server, a
raylet, workers) that bind gRPC ports, moves the driver into a process group of its own where
the kernel cannot tie the daemons' fate to it (macOS), and Ray Train's ``fit()`` replaces the
process's SIGINT handler with one that calls a controller actor (after the run, a Ctrl-C
raises Ray's "Can't find actor" error, or starts a new local Ray instance, in place of
KeyboardInterrupt). None of that may reach the test process.

Usage: ``python ray_session.py WORK CASE...`` where WORK is an empty folder (Ray's session
files, Ray Train's storage, the workers' records) and each CASE one of :data:`CASES`. Each
case prints one JSON line ``{"case": name, "result": ...}`` or ``{"case": name, "error":
traceback}`` on the standard output, which carries nothing else (Ray's own output goes to
the standard error); the first line, ``{"case": "session", ...}``, describes the session, or
says why none could start (``"skip"``: Ray Data is not installed).

With ``ALOADER_RAY_NETNS=1`` in the environment, the program runs in a network namespace of
its own (``unshare -rn``) whose loopback is down: it brings it up first. ``python
ray_session.py --probe`` only does that, and exits with 0 where it works.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The rows of the Ray Train case.
ROWS = 1024
# The names of aloader's threads: a loader's private loop, and the threads that pull from Ray.
ALOADER_THREADS = ("aloader-loop", "AnyIO worker thread")


def loopback_up() -> None:
    """Bring the namespace's loopback interface up (``ip link set lo up``, without ``ip``)."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def kill_tree(root: int) -> None:
    """Kill every process descended from ``root``, then its process group, then ``root``
    (this process too): Ray's workers and agents make process groups of their own, and its
    agents outlive their raylet. In a PID namespace, killing its first process kills all."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):  # Linux; elsewhere the group only
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], list(children.get(root, ()))
    while todo:
        tree.append(pid := todo.pop())
        todo.extend(children.get(pid, ()))
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(root, signal.SIGKILL)


def exit_with_parent() -> None:
    """End the session as soon as the test process ends, however it ends (killed too): the
    test keeps the writing end of this process's standard input open, which its end closes.
    Ray's daemons share the driver's fate, and in a PID namespace everything dies with it."""

    stdin = os.dup(0)  # read raw, in a descriptor of its own: sys.stdin is closed at exit

    def watch() -> None:
        while os.read(stdin, 4096):
            pass
        kill_tree(os.getpid())  # Ray's agents outlive their raylet: this process's tree
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def leftover_threads() -> list[str]:
    """aloader's threads still alive once every loader of a case is gone (none may be)."""
    gc.collect()
    deadline = time.monotonic() + 10  # a closing loop's thread may still be ending
    while True:
        names = [t.name for t in threading.enumerate() if t.name in ALOADER_THREADS]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def ids(batches: list[Any]) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


def dataset_case(work: Path) -> dict[str, Any]:
    """A Dataset read twice in order, and a loader resumed from a state saved mid-epoch."""
    import ray.data

    import aloader

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # Ray's order repeats: counting is exact
    dataset = ray.data.range(300, override_num_blocks=6).map(
        lambda row: {"id": row["id"], "square": row["id"] ** 2})
    loader = aloader.DataLoader(aloader.from_ray(dataset), batch_size=32)
    full = list(loader)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    iterator.close()
    resumed = aloader.DataLoader(aloader.from_ray(dataset), batch_size=32)
    resumed.load_state_dict(state)
    return {"full": ids(full), "square_1": full[1]["square"].tolist(),
            "resumed": ids(list(resumed)), "state": state}


def split_case(work: Path) -> dict[str, Any]:
    """The two parts of a ``streaming_split``, each through its own loader, at once."""
    import ray.data

    import aloader

    parts = ray.data.range(400, override_num_blocks=8).streaming_split(2, equal=True)
    seen: list[list[int]] = [[], []]
    errors: list[str] = []

    def consume(k: int) -> None:  # Ray needs every part consumed at once
        try:
            for batch in aloader.DataLoader(aloader.from_ray(parts[k]), batch_size=25):
                seen[k].extend(int(i) for i in batch["id"])
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # the test's hard timeout ends a hang
    return {"seen": seen, "errors": errors}


def train_case(work: Path) -> dict[str, Any]:
    """examples/ray_train.py: Ray Train's TorchTrainer on 2 CPU workers, loading with aloader."""
    try:
        import ray.train  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        return {"skip": f"{exc.name} is not installed"}
    import ray_train  # examples/ray_train.py, on the PYTHONPATH the test gives

    record = work / "record"
    record.mkdir()
    # 1,024 rows: 16 steps an epoch, so that the second epoch's loss is far below 1 whatever
    # the initial weights and the order Ray splits the rows in (with 256 rows, 4 steps, about
    # one run in a hundred ended above 1).
    result = ray_train.main(rows=ROWS, epochs=2, workers=2, storage=str(work / "runs"),
                            record=str(record))
    checkpoint = Path(result.checkpoint.path) if result.checkpoint is not None else None
    return {
        "error": None if result.error is None else repr(result.error),
        "metrics": {k: result.metrics.get(k) for k in ("epoch", "loss")},
        "records": {path.stem: json.loads(path.read_text()) for path in record.iterdir()},
        "loader_states": {} if checkpoint is None else {
            path.stem: json.loads(path.read_text()) for path in checkpoint.glob("loader-*.json")},
    }


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "dataset": dataset_case, "split": split_case, "train": train_case}


def main(work: Path, cases: list[str]) -> None:
    # The standard output carries the cases' JSON only: what Ray, its daemons and its workers
    # print (they inherit the descriptors) goes to the standard error.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(line: dict[str, Any]) -> None:
        out.write(json.dumps(line) + "\n")

    exit_with_parent()
    isolated = os.environ.get("ALOADER_RAY_NETNS") == "1"
    if isolated:
        loopback_up()
    try:
        import ray
        import ray.data
    except ImportError as exc:
        say({"case": "session", "skip": f"{exc.name} is not installed"})
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", _temp_dir=str(work / "ray"))
    ray.data.DataContext.get_current().enable_progress_bars = False
    say({"case": "session", "isolated": isolated,
         "interfaces": sorted(name for _, name in socket.if_nameindex())})
    try:
        for name in cases:
            try:
                result = CASES[name](work)
            except BaseException:
                say({"case": name, "error": traceback.format_exc()})
            else:
                result["leftover_threads"] = leftover_threads()
                say({"case": name, "result": result})
    finally:
        ray.shutdown()
        out.close()


def probe() -> None:
    """Whether this namespace can serve Ray: its loopback comes up and takes a listener."""
    loopback_up()
    with socket.create_server(("127.0.0.1", 0)):
        pass


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        probe()
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
