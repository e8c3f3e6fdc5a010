"""Worker processes (``num_workers=2``) against the 2-core limit and PyTorch, in one run.

Run: ``python benchmarks/bench_workers.py [cpu] [ttfb] [mem] [rss] [--quick]`` (all sections by
default; about a minute). PyTorch's rows need torch (``pip install torch==2.13.0`` takes the CPU
build); without it they are skipped. Every figure is measured in this run, each contender
interleaved with the others and given the best of several rounds, since other processes share
the cores.

- cpu: 1,000 items of ~0.7 ms GIL-holding Python work (``anchors_torch_spdl.py``'s
  ``cpu_work``), batch 32, num_workers=2, with ``import torch`` at the top of this script:
  each epoch starting its workers (as torch's anchor), and persistent workers (the epoch after
  a warm-up one), for aloader and torch alike. The limit is the same work with no loader, the
  tightest program found: two processes forked by a template (a fork of this
  process made once, as aloader's workers start), each taking the next batch number from a
  pipe as it comes free, making that batch (32 items, ``np.stack``) and sending it as one
  record of a socket, received and counted here in order; once with the processes started
  each epoch (the limit of both loaders' per-epoch rows), once with them started once (the
  limit of the persistent rows). Shown beside it: the simpler limit (two processes
  forked from this one per run, batch ``k`` by process ``k % 2``, their exits waited for),
  the anchors' limit (two cores at the single-item speed measured in this process) and two
  bare processes computing half the items each. aloader / torch and aloader / limit are given
  as the ratio of the bests and as the median of each round's own ratio (the two run next to
  each other). A second table gives the CPU time per epoch of the main process (starting
  workers each epoch costs it: forking this process, pickling a setup) and of persistent
  workers (the limit's too), which shows what each loader costs beside the items' own work.
- ttfb: time to the first batch of the cpu dataset with 2 workers, each measured in a fresh
  process of this script whose main module imports torch at the top, or does not (aloader
  only: torch's loader needs torch): the first loader of the process iterated at once (and
  0.5 s after its creation), a new loader later on, and the next epoch of persistent workers.
  Workers that re-imported the main module would pay torch's import at every start.
- mem: the 200,000 x 128 float32 table, shuffled, batch 256, 2 workers; plus 4 MiB batches
  (rows of 4,096 float32), which must cross in shared memory rather than pickled.
- rss: peak memory of the 2 workers over one epoch of a 1 GiB float32 table (persistent
  workers, so their high-water marks can be read before they stop): RSS, and the part that is
  private to each worker (USS), which is what grows into extra copies of the dataset.

Nothing heavy happens at import (workers started with ``spawn`` would import this file).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import numpy as np

# The aloader of the checkout this script is in (its probes' too), not whichever one is
# installed: a worktree's run would otherwise measure the editable install's.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The main module imports torch at the top, as a training script does (workers that
# re-imported it paid for that at every start); only the ttfb probes that measure a main
# module without torch leave it out.
if "--no-torch" not in sys.argv and ("--probe" not in sys.argv or "--import-torch" in sys.argv):
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401

CPU_ITERS = 20_000
N_CPU = 1_000
ROUNDS = 4


def cpu_work(i: int) -> np.ndarray[Any, Any]:
    s = 0
    for k in range(CPU_ITERS):
        s += (k * i) % 7
    return np.full(16, s, dtype=np.float32)


class CpuDataset:
    """A map-style dataset for both loaders (torch takes anything with the two methods)."""

    def __len__(self) -> int:
        return N_CPU

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        return cpu_work(index)


def _count(batches: Iterable[Any]) -> int:
    n = 0
    for batch in batches:
        n += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
    return n


def _rate(make: Callable[[], Iterable[Any]]) -> float:
    """Items per second of one epoch, workers' start included."""
    start = time.perf_counter()
    loader = make()
    n = _count(loader)
    return n / (time.perf_counter() - start)


def _aloader(dataset: Any, **kwargs: Any) -> Any:
    import aloader

    return aloader.DataLoader(dataset, **kwargs)


def _torch(dataset: Any, **kwargs: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(dataset, **kwargs)


def _has_torch() -> bool:
    if "--no-torch" in sys.argv:
        return False
    try:
        import torch.utils.data  # noqa: F401
    except ImportError:
        print("torch not installed: skipping its rows")
        return False
    return True


def _best(contenders: dict[str, Callable[[], float]], rounds: int,
          each: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Best of ``rounds`` for each contender, interleaved round by round (every round's
    figures appended to ``each`` too, when given)."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in contenders.items():
            figure = run()
            best[name] = max(best.get(name, 0.0), figure)
            if each is not None:
                each.setdefault(name, []).append(figure)
    return best


def _table(title: str, rows: list[tuple[str, str, str]]) -> None:
    print(f"\n### {title}\n")
    print("| row | figure | ratio |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")


# cpu ---------------------------------------------------------------------------------------------
BATCH = 32


def _half(start: int) -> None:
    for i in range(start, N_CPU, 2):
        cpu_work(i)


def _bare_processes() -> float:
    """Items per second of two processes that each compute half the items, with no loader:
    what the two cores deliver in this run, start included."""
    import multiprocessing

    # Plain forks: these children only compute, whatever threads the loaders left idle here.
    context: Any = multiprocessing.get_context("fork")
    begin = time.perf_counter()
    processes = [context.Process(target=_half, args=(k,)) for k in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    return N_CPU / (time.perf_counter() - begin)


def _batches_to(conn: Any, worker: int) -> None:
    """Worker ``worker`` of :func:`_bare_batches`: its whole batches, stacked, over ``conn``."""
    for start in range(worker * BATCH, N_CPU, 2 * BATCH):
        batch = np.stack([cpu_work(i) for i in range(start, min(start + BATCH, N_CPU))])
        conn.send_bytes(batch.tobytes())
    conn.close()


def _bare_batches(exits: bool = True) -> float:
    """Items per second of the loaders' work with no loader, the plainest way: two processes
    forked from this one, batch ``k`` made by process ``k % 2`` (32 items, ``np.stack``), sent
    over a socket pair and received here in order, start included, and their exits unless
    not ``exits`` (an info row: :class:`_Limit` is the tighter program the table takes as its
    limit)."""
    import multiprocessing

    context: Any = multiprocessing.get_context("fork")
    begin = time.perf_counter()
    pairs = [context.Pipe() for _ in range(2)]
    processes = [context.Process(target=_batches_to, args=(pairs[k][1], k)) for k in range(2)]
    for process, (_, theirs) in zip(processes, pairs, strict=True):
        process.start()
        theirs.close()
    n = 0
    for k in range(N_BATCHES):
        n += len(np.frombuffer(pairs[k % 2][0].recv_bytes(), np.float32)) // 16
    if exits:
        for process in processes:
            process.join()
    rate = n / (time.perf_counter() - begin)
    for process in processes:
        process.join()
    return rate


N_BATCHES = (N_CPU + BATCH - 1) // BATCH
_END = N_BATCHES  # the ticket that ends a worker's epoch
_QUIT = N_BATCHES + 1  # the ticket that ends a persistent worker
_HEADER = 4  # a result's batch number, little-endian, before the batch's bytes


def _limit_worker(tickets: int, results: socket.socket, persistent: bool) -> None:
    """A worker of :class:`_Limit`: takes the next batch number from the ``tickets`` pipe
    (every read of 4 bytes is one whole ticket: the loader process writes them in one go),
    makes that batch and sends it as one record, until its epoch's end ticket (persistent: the
    next epoch's tickets then, until its quit ticket)."""
    results.send(os.getpid().to_bytes(_HEADER, "little"))
    while True:
        raw = os.read(tickets, 4)  # b"": the loader process is gone
        k = int.from_bytes(raw, "little") if raw else _QUIT
        if k == _QUIT or (k == _END and not persistent):
            return
        if k == _END:
            continue
        start = k * BATCH
        batch = np.stack([cpu_work(i) for i in range(start, min(start + BATCH, N_CPU))])
        results.sendmsg([k.to_bytes(_HEADER, "little"), batch])


def _serve_limit(control: socket.socket) -> NoReturn:
    """The template of :class:`_Limit`: forks a worker for each request on ``control``
    (``b"E"``: one epoch's, ``b"P"``: persistent, with the ticket pipe's read end and the
    results socket), until ``b"Q"``. (Told rather than shown EOF: processes forked from the
    loader process since, torch's workers among them, hold copies of its ends.)"""
    code = 0
    try:
        # As aloader's template: never collected here, so the workers' collections never touch
        # (and copy) the pages of what this process had; the workers are reaped by the kernel.
        gc.freeze()
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        while True:
            message, fds, _, _ = socket.recv_fds(control, 1, 2)
            if message in (b"Q", b""):
                break
            if os.fork() == 0:
                control.close()
                worker = 0
                try:
                    _limit_worker(fds[0], socket.socket(fileno=fds[1]), message == b"P")
                except BaseException:
                    worker = 1
                    sys.excepthook(*sys.exc_info())
                os._exit(worker)
            for fd in fds:
                os.close(fd)
    except BaseException:
        code = 1
    os._exit(code)


class _Limit:
    """The tightest program found for the loaders' work with no loader: two worker
    processes forked by a template, a single-threaded fork of this process made once (as
    aloader's workers start: no fork of this process per epoch, no multiprocessing machinery),
    taking batch numbers from one pipe as each becomes free (dynamic: a worker held back by
    another program does less of the epoch) and sending each batch (32 items, ``np.stack``) as
    one record of one ``SOCK_SEQPACKET`` socket, received here and counted in order. An epoch
    ends with its last batch received: the workers' exit is not waited for on the clock (as
    neither loader waits for it in the epoch), but it is before the next run starts."""

    def __init__(self) -> None:
        self._control, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            self._control.close()
            _serve_limit(theirs)
        theirs.close()
        self._template = pid
        self._persistent: tuple[list[int], socket.socket] | None = None

    def _start(self, kind: bytes, static: bool = False) -> tuple[list[int], socket.socket]:
        """Two workers of ``kind`` (``b"E"`` or ``b"P"``): the write ends of their ticket pipes
        (one they share, or one each when ``static``) and the results socket (whose first
        record from each worker is its pid)."""
        pipes = [os.pipe() for _ in range(2 if static else 1)]
        results, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for worker in range(2):
            socket.send_fds(self._control, [kind], [pipes[worker % len(pipes)][0],
                                                    theirs.fileno()])
        for read, _ in pipes:
            os.close(read)
        theirs.close()
        return [write for _, write in pipes], results

    @staticmethod
    def _epoch(tickets: list[int], results: socket.socket) -> int:
        """Hand out one epoch's tickets (one pipe: taken as workers come free; one each: batch
        ``k`` by worker ``k % 2``) and receive its batches in order; the items seen (a record
        of a batch number alone is a starting worker's pid)."""
        for worker, pipe in enumerate(tickets):
            numbers = [*range(worker, N_BATCHES, len(tickets)), *[_END] * (2 // len(tickets))]
            os.write(pipe, b"".join(k.to_bytes(4, "little") for k in numbers))
        early: dict[int, bytes] = {}
        n = 0
        for k in range(N_BATCHES):
            while k not in early:
                record = results.recv(_HEADER + BATCH * 16 * 4)
                if len(record) > _HEADER:
                    early[int.from_bytes(record[:_HEADER], "little")] = record
            n += len(np.frombuffer(early.pop(k), np.float32, offset=_HEADER)) // 16
        return n

    def each_epoch(self, static: bool = False) -> float:
        """Items per second of an epoch whose two workers start with it (its start included);
        batch ``k`` by worker ``k % 2`` when ``static``."""
        begin = time.perf_counter()
        tickets, results = self._start(b"E", static)
        n = self._epoch(tickets, results)
        rate = n / (time.perf_counter() - begin)
        for pipe in tickets:
            os.close(pipe)
        while results.recv(_HEADER + BATCH * 16 * 4):  # the workers have exited at EOF
            pass
        results.close()
        return rate

    def persistent(self) -> tuple[Callable[[], float], list[int]]:
        """An epoch of two workers started once (after a warm-up epoch, as the loaders'), and
        their pids."""
        tickets, results = self._start(b"P")
        pids = [int.from_bytes(results.recv(_HEADER), "little") for _ in range(2)]
        self._persistent = tickets, results
        self._epoch(tickets, results)

        def run() -> float:
            begin = time.perf_counter()
            n = self._epoch(tickets, results)
            return n / (time.perf_counter() - begin)

        return run, pids

    def close(self) -> None:
        if self._persistent is not None:
            (tickets,), results = self._persistent
            os.write(tickets, b"".join(_QUIT.to_bytes(4, "little") for _ in range(2)))
            os.close(tickets)
            results.close()
        self._control.send(b"Q")
        self._control.close()
        os.waitpid(self._template, 0)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _worker_pids(loader: Any) -> list[int]:
    """The worker processes of a loader of either kind, once it has iterated (persistent)."""
    if type(loader).__module__.startswith("aloader"):
        return [w.process.pid for w in loader._pool.workers]
    return [w.pid for w in loader._iterator._workers]


def _single() -> float:
    """Two cores at the single-item speed of this process, as ``anchors_torch_spdl.py``
    measures it (100 items)."""
    start = time.perf_counter()
    for i in range(100):
        cpu_work(i)
    return 2 / ((time.perf_counter() - start) / 100)


def bench_cpu(rounds: int, torch: bool) -> None:
    # Forked first, while only this thread runs, as aloader forks its template at its first
    # loader with workers.
    tight = _Limit()
    try:
        _bench_cpu(rounds, torch, tight)
    finally:
        tight.close()


def _bench_cpu(rounds: int, torch: bool, tight: _Limit) -> None:
    """The cpu section, ``tight`` its limit's processes."""
    cpu: dict[str, list[tuple[float, float, float]]] = {}  # (wall, main CPU, workers' CPU)

    def timed(name: str, epoch: Callable[[], float], pids: list[int]) -> Callable[[], float]:
        def run() -> float:
            workers = [_cpu_of(pid) for pid in pids]
            main = time.process_time()
            rate = epoch()
            main = time.process_time() - main
            spent = sum(_cpu_of(pid) - before for pid, before in zip(pids, workers, strict=True))
            cpu.setdefault(name, []).append((N_CPU / rate, main, spent))
            return rate

        return run

    def persistent(name: str, factory: Callable[..., Any]) -> Callable[[], float]:
        loader = factory(CpuDataset(), batch_size=BATCH, num_workers=2, persistent_workers=True)
        _count(loader)  # a warm-up epoch starts the workers; the timed ones reuse them
        return timed(name, lambda: _rate(lambda: loader), _worker_pids(loader))

    # Workers started each epoch: the main process's CPU only (its workers are gone at the
    # end), which shows what starting them costs it (forking this process, pickling a setup).
    contenders: dict[str, Callable[[], float]] = {
        "limit": timed("limit", tight.each_epoch, []),
        "limit persistent": timed("limit persistent", *tight.persistent()),
        "single": _single,
        "bare": _bare_processes,
        "limit static": lambda: tight.each_epoch(static=True),
        "batches": timed("simpler limit", _bare_batches, []),
        "batches, exits off": lambda: _bare_batches(exits=False),
        "aloader": timed("aloader", lambda: _rate(lambda: _aloader(
            CpuDataset(), batch_size=BATCH, num_workers=2)), []),
        "aloader persistent": persistent("aloader persistent", _aloader),
    }
    if torch:
        contenders["torch"] = timed("torch", lambda: _rate(
            lambda: _torch(CpuDataset(), batch_size=BATCH, num_workers=2)), [])
        contenders["torch persistent"] = persistent("torch persistent", _torch)
    _aloader(CpuDataset(), batch_size=BATCH, num_workers=2)  # the fork server starts once
    each: dict[str, list[float]] = {}
    best = _best(contenders, rounds, each)
    lim = best["limit"]
    rows = [("limit, workers started each epoch: 2 processes forked by a template (a fork of "
             "this process made once), taking batch numbers from a pipe as they come free, "
             "batches (32 items, np.stack) sent as records of one socket, counted in order, "
             "no loader", f"{lim:,.0f} items/s", "1.00"),
            ("limit, 2 persistent workers: the same 2 processes started once",
             f"{best['limit persistent']:,.0f} items/s",
             f"{best['limit persistent'] / lim:.2f}"),
            ("(2 processes forked from this process, batch k by process k % 2, sent over a "
             "socket pair, received in order, exits waited for: the simpler limit)",
             f"{best['batches']:,.0f} items/s", f"{best['batches'] / lim:.2f}"),
            ("(the same, its processes' exits not waited for on the clock)",
             f"{best['batches, exits off']:,.0f} items/s",
             f"{best['batches, exits off'] / lim:.2f}"),
            ("(the limit with batch k by worker k % 2, as both loaders route their batches)",
             f"{best['limit static']:,.0f} items/s", f"{best['limit static'] / lim:.2f}"),
            ("(2 cores x single-item speed in this process, the anchors' limit)",
             f"{best['single']:,.0f} items/s", f"{best['single'] / lim:.2f}"),
            ("(2 bare processes forked from this process, half the items each, no batches)",
             f"{best['bare']:,.0f} items/s", f"{best['bare'] / lim:.2f}")]
    for kind, label in (("", "num_workers=2"), (" persistent", "2 persistent workers")):
        # Each loader against the limit of its kind: per-epoch start against per-epoch start.
        of = best["limit" + kind]
        rows.append((f"aloader {label} (of the limit{kind})",
                     f"{best['aloader' + kind]:,.0f} items/s",
                     f"{best['aloader' + kind] / of:.2f}"))
        paired = np.median(np.divide(each["aloader" + kind], each["limit" + kind]))
        rows.append((f"(aloader {label} / limit{kind}: median of the rounds' ratios)", "",
                     f"{paired:.2f}"))
        if torch:
            rows.append((f"torch {label} (of the limit{kind})",
                         f"{best['torch' + kind]:,.0f} items/s",
                         f"{best['torch' + kind] / of:.2f}"))
            rows.append((f"aloader / torch, {label}", "",
                         f"{best['aloader' + kind] / best['torch' + kind]:.2f}"))
            # The two ran next to each other in every round: on a machine whose speed drifts
            # the median of the rounds' own ratios is steadier than the ratio of the bests.
            paired = np.median(np.divide(each["aloader" + kind], each["torch" + kind]))
            rows.append((f"(aloader / torch, {label}: median of the rounds' ratios)", "",
                         f"{paired:.2f}"))
    imported = "torch imported" if "torch" in sys.modules else "torch not imported"
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    _table(f"cpu: 1,000 items x ~0.7 ms of Python, batch 32, 2 workers, {imported} in the "
           f"main module (ratio: of the limit of workers started each epoch unless said; load "
           f"average {load})", rows)
    rows = []
    for name, runs in sorted(cpu.items(), key=lambda item: "persistent" in item[0]):
        wall, main, workers = (float(np.median(column)) for column in zip(*runs, strict=True))
        if "persistent" in name:
            rows.append((name, f"main {main * 1e3:.0f} ms, workers {workers:.2f} s, "
                         f"wall {wall:.2f} s", f"{workers / (2 * wall):.2f}"))
        else:
            rows.append((name, f"main {main * 1e3:.0f} ms, wall {wall:.2f} s", ""))
    _table("cpu: CPU time per epoch, median of the rounds above: the main process's, and the "
           "workers' where they persist (ratio: the workers' CPU over 2 x wall, below 1 where a "
           "worker waited or another program ran)", rows)


# ttfb --------------------------------------------------------------------------------------------
def _first_batch(make: Callable[[], Any]) -> float:
    start = time.perf_counter()
    iterator = iter(make())
    next(iterator)
    elapsed = time.perf_counter() - start
    del iterator
    return elapsed


def _persistent_second(factory: Callable[..., Any]) -> float:
    loader = factory(CpuDataset(), batch_size=32, num_workers=2, persistent_workers=True)
    for _ in loader:
        pass
    elapsed = _first_batch(lambda: loader)
    loader = None  # the workers stop
    return elapsed


_PROBES = {  # label: (loader, whether the main module imports torch)
    "aloader": ("aloader", False),
    "aloader, import torch": ("aloader", True),
    "torch": ("torch", True),
}


def _probe(which: str, import_torch: bool, pause: float, early: bool = False
           ) -> dict[str, float]:
    command = [sys.executable, __file__, "--probe", which, str(pause)]
    if import_torch:
        command.append("--import-torch")
    if early:
        command.append("--early")
    out = subprocess.run(command, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    cold, new, persistent = (float(v) for v in out.stdout.split()[-3:])
    return {"cold": cold, "new": new, "persistent": persistent}


def bench_ttfb(rounds: int, torch: bool) -> None:
    probes = {k: v for k, v in _PROBES.items() if torch or v[0] == "aloader"}
    results: dict[str, dict[str, list[float]]] = {
        n: {"cold": [], "cold_later": [], "new": [], "persistent": []} for n in probes}
    for _ in range(rounds):
        for name, (which, import_torch) in probes.items():
            at_once = _probe(which, import_torch, 0.0)
            later = _probe(which, import_torch, 0.5)
            results[name]["cold"].append(at_once["cold"])
            results[name]["cold_later"].append(later["cold"])
            results[name]["new"] += [at_once["new"], later["new"]]
            results[name]["persistent"] += [at_once["persistent"], later["persistent"]]
    # A script that ran a loader without workers first (a validation pass, a first try): its
    # `for` left a private loop and a fetch thread running when the loader with workers comes.
    early: dict[str, list[float]] = {"aloader": [], "torch": []}
    for _ in range(rounds):
        for which in early if torch else ("aloader",):
            early[which].append(_probe(which, True, 0.0, early=True)["cold"])
    labels = {"cold": "first loader of a fresh process, iterated at once",
              "cold_later": "first loader of a fresh process, iterated 0.5 s after creation",
              "new": "a new loader (workers start)",
              "persistent": "next epoch, persistent workers"}
    rows = []
    for case, label in labels.items():
        theirs = float(np.median(results["torch"][case])) if torch else None
        for name in probes:
            if name == "torch":
                continue
            ours = float(np.median(results[name][case]))
            main = "main imports torch" if _PROBES[name][1] else "main does not import torch"
            if theirs is not None:
                rows.append((f"{label} ({main})",
                             f"{ours * 1e3:.1f} ms (torch {theirs * 1e3:.1f} ms)",
                             f"{theirs / ours:.2f}"))
            else:
                rows.append((f"{label} ({main})", f"{ours * 1e3:.1f} ms", ""))
    ours = float(np.median(early["aloader"]))
    label = ("first loader with workers, after a num_workers=0 loader ran and is kept "
             "(main imports torch)")
    if torch:
        theirs = float(np.median(early["torch"]))
        rows.append((label, f"{ours * 1e3:.1f} ms (torch {theirs * 1e3:.1f} ms)",
                     f"{theirs / ours:.2f}"))
    else:
        rows.append((label, f"{ours * 1e3:.1f} ms", ""))
    _table("time to first batch, cpu dataset, 2 workers, median (ratio: torch / aloader, "
           ">1 is faster)", rows)


# mem ---------------------------------------------------------------------------------------------
def bench_mem(rounds: int, torch: bool) -> None:
    import aloader

    table = np.random.default_rng(0).standard_normal((200_000, 128), dtype=np.float32)
    wide = np.random.default_rng(1).standard_normal((16_384, 4096), dtype=np.float32)
    rows = []
    for label, data in (("200,000 x 128 float32, batch 256 (128 KiB)", table),
                        ("16,384 x 4,096 float32, batch 256 (4 MiB)", wide)):
        contenders: dict[str, Callable[[], float]] = {
            "aloader": lambda d=data: _rate(lambda: _aloader(  # type: ignore[misc]
                aloader.ArrayDataset(d), batch_size=256, shuffle=True, num_workers=2)),
        }
        if torch:
            import torch as torch_module
            from torch.utils.data import TensorDataset

            tensor = torch_module.from_numpy(data)
            contenders["torch"] = lambda t=tensor: _rate(lambda: _torch(  # type: ignore[misc]
                TensorDataset(t), batch_size=256, shuffle=True, num_workers=2))
        best = _best(contenders, rounds)
        if torch:
            rows.append((label, f"{best['aloader']:,.0f} items/s (torch {best['torch']:,.0f})",
                         f"{best['aloader'] / best['torch']:.2f}"))
        else:
            rows.append((label, f"{best['aloader']:,.0f} items/s", ""))
    _table("mem: shuffled in-memory table, 2 workers, workers' start included "
           "(ratio: aloader / torch)", rows)


# rss ---------------------------------------------------------------------------------------------
def _memory(pid: int) -> tuple[int, int, int]:
    """(RSS high-water mark, PSS, private copies) of a process, in bytes.

    Private copies are the pages only this process maps, outside shared-memory files (tmpfs
    pages count as private and dirty when a single process maps them, yet they are not copies),
    plus the copy-on-write copies made inside those files: the worker's own copies of the
    dataset and of what it made, which is what grows with copy-on-read.
    """
    pss = private = 0
    counted: tuple[str, ...] = ()
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            key = parts[0]
            if not key.endswith(":"):  # a mapping's header: address range, perms, ..., path
                path = parts[5] if len(parts) > 5 else ""
                shm = path.startswith(("/dev/shm/", "/memfd:"))
                counted = ("Anonymous:",) if shm else ("Private_Clean:", "Private_Dirty:")
            elif key == "Pss:":
                pss += int(parts[1]) * 1024
            elif key in counted:
                private += int(parts[1]) * 1024
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return hwm, pss, private


class _Sampler:
    """Samples the workers' memory while an epoch runs; keeps the peaks."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.peak: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def sample(self) -> None:
        for pid in list(self.pids):
            try:
                values = _memory(pid)
            except (OSError, StopIteration, KeyError):
                continue
            peak = self.peak.setdefault(pid, [0, 0, 0])
            for i, value in enumerate(values):
                peak[i] = max(peak[i], value)

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return [max(p[i] for p in self.peak.values()) for i in range(3)]


def _identity(batch: Any) -> Any:
    return batch


def _rss_epoch(name: str, dataset: Any) -> tuple[list[int], float]:
    """Peak memory of the most demanding worker over one epoch, and the epoch's seconds."""
    sampler = _Sampler()
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"batch_size": 256, "num_workers": 2, "persistent_workers": True}
    if isinstance(dataset, list):
        kwargs["collate_fn"] = _identity
    if name == "aloader":
        loader = _aloader(dataset, **kwargs)
        iterator = iter(loader)
        next(iterator)
        sampler.pids = [w.process.pid for w in loader._pool.workers]
    else:
        loader = _torch(dataset, **kwargs)
        iterator = iter(loader)
        next(iterator)
        sampler.pids = [w.pid for w in iterator._workers]
    for _ in iterator:
        pass
    elapsed = time.perf_counter() - start
    peaks = sampler.stop()
    del iterator, loader
    return peaks, elapsed


def bench_rss(torch: bool) -> None:
    import aloader

    gib = 1 << 30
    mib = 1 << 20
    table = np.random.default_rng(2).standard_normal((gib // 4096, 1024), dtype=np.float32)
    records = [os.urandom(4096) for _ in range(gib // 4096)]
    cases: list[tuple[str, Callable[[str], Any]]] = [
        ("1 GiB float32 table", lambda name: aloader.ArrayDataset(table) if name == "aloader"
         else _torch_tensor_dataset(table)),
        ("1 GiB list of 4 KiB bytes objects", lambda name: records),
    ]
    rows = []
    for label, make in cases:
        ours, ours_s = _rss_epoch("aloader", make("aloader"))
        text = [f"{v / mib:,.0f}" for v in ours]
        if torch:
            theirs, theirs_s = _rss_epoch("torch", make("torch"))
            text = [f"{a} (torch {b / mib:,.0f})" for a, b in zip(text, theirs, strict=True)]
        rows.append((f"{label}: peak RSS / PSS / private copies, MiB", " / ".join(text),
                     f"epoch {ours_s:.1f} s" + (f" (torch {theirs_s:.1f} s)" if torch else "")))
    _table("worker memory over one epoch, 2 persistent workers, the larger of the two", rows)
    print("\nThe table is one copy in shared memory that aloader's workers map copy-on-write "
          "(torch's share the parent's pages through fork): neither copies it. A list of "
          "Python objects is copied into each of aloader's workers at start; torch's workers "
          "copy the pages they read (copy-on-read, pytorch/pytorch#13246).")


def _torch_tensor_dataset(table: np.ndarray[Any, Any]) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.from_numpy(table))


def _probe_main(which: str, pause: float) -> None:
    """Times to the first batch in this fresh process: its first loader, iterated ``pause``
    seconds after its creation (aloader forks its workers' template on creation); then a new
    loader (median of 3); then the next epoch of persistent workers (median of 3)."""
    factory = _aloader if which == "aloader" else _torch
    if which == "torch":
        import torch.utils.data  # noqa: F401  (imports are not the loader's start)
    else:
        import aloader  # noqa: F401
    # The collection that `import torch` leaves due (~90 ms over its heap) is paid by whichever
    # allocates next: settle it here for both loaders, as a real script's setup would.
    kept = None
    if "--early" in sys.argv:
        kept = factory(CpuDataset(), batch_size=32)  # kept: its loop and threads go on
        for _ in kept:
            pass
    gc.collect()
    loader = factory(CpuDataset(), batch_size=32, num_workers=2)
    time.sleep(pause)
    cold = _first_batch(lambda: loader)
    loader = None  # its workers stop
    if kept is not None:  # only the first loader is of interest
        print(cold, 0.0, 0.0)
        return
    new = float(np.median([_first_batch(
        lambda: factory(CpuDataset(), batch_size=32, num_workers=2)) for _ in range(3)]))
    persistent = float(np.median([_persistent_second(factory) for _ in range(3)]))
    print(cold, new, persistent)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    rounds = 2 if quick else ROUNDS
    sections = args or ["cpu", "ttfb", "mem", "rss"]
    torch = _has_torch()
    started = time.perf_counter()
    if "cpu" in sections:
        bench_cpu(rounds, torch)
    if "ttfb" in sections:
        bench_ttfb(3 if not quick else 1, torch)
    if "mem" in sections:
        bench_mem(max(2, rounds - 2), torch)
    if "rss" in sections:
        bench_rss(torch)
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    if "--probe" in sys.argv:
        at = sys.argv.index("--probe")
        _probe_main(sys.argv[at + 1], float(sys.argv[at + 2]))
    else:
        main()
