"""Real process groups for the tests: start ``world_size`` processes with torchrun's
environment and a ``gloo`` group on 127.0.0.1, run one scenario in each, bounded in time.

The launcher (:func:`launch`) binds the rendezvous store's socket itself, on 127.0.0.1, and
hands it to rank 0 (torch's ``TCPStore`` with ``master_listen_fd``; torchrun's own store
listens on every interface), sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``... as torchrun does, and kills every process of a run that
outlives its guard (a hang fails the test; it never stalls CI). Each rank writes what it saw
to ``<folder>/<scenario>-<rank>.json`` and its output to ``<folder>/<scenario>-<rank>.log``.

The scenarios (:data:`SCENARIOS`) run in the child processes; every step of an epoch ends
with a collective (:func:`step`): every rank tells whether it has a batch and which samples,
so a rank that runs out early is seen (and recorded) instead of hanging the others.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

N_MAP = 60  # map-style samples: 15 per rank on 4 ranks, 5 batches of 3
BATCH = 3
TAKEN = 2  # steps the killed job takes before its checkpoint
SHARDS = 12


# --------------------------------------------------------------------------- the launcher


@dataclass
class RankRun:
    rank: int
    returncode: int
    log: str
    result: Any  # the rank's JSON result, or None if it wrote none


def launch(world_size: int, scenario: str, folder: Path, *, guard: float = 150,
           **options: Any) -> list[RankRun]:
    """Run ``scenario`` on ``world_size`` processes; each rank's exit code, output and
    result. Every process is killed once ``guard`` seconds have passed (then AssertionError
    with their output)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    (folder / f"{scenario}.options.json").write_text(json.dumps(options))
    for stale in folder.glob(f"{scenario}-*.json"):  # an earlier run's results
        stale.unlink()
    paths = os.pathsep.join([str(ROOT), str(HERE), *filter(None, [os.environ.get(
        "PYTHONPATH")])])
    procs = []
    try:
        for rank in range(world_size):
            env = {**os.environ, "PYTHONPATH": paths,
                   # torchrun's environment, one node.
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                   "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                   "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
                   "TORCHELASTIC_RUN_ID": "aloader-tests",
                   "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                   "ALOADER_STORE_FD": str(listener.fileno()) if rank == 0 else ""}
            with open(folder / f"{scenario}-{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", f"import ranktools; ranktools.child({scenario!r}, "
                     f"{str(folder)!r})"], env=env, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(listener.fileno(),) if rank == 0 else (),
                    start_new_session=True))
        listener.close()
        deadline = time.monotonic() + guard
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{scenario} on {world_size} ranks still ran after "
                                     f"{guard} s (a hang):\n" + _logs(folder, scenario,
                                                                    world_size)) from None
    finally:
        listener.close()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    runs = []
    for rank, proc in enumerate(procs):
        found = folder / f"{scenario}-{rank}.json"
        runs.append(RankRun(rank, proc.returncode,
                            (folder / f"{scenario}-{rank}.log").read_text(errors="replace"),
                            json.loads(found.read_text()) if found.exists() else None))
    return runs


def _logs(folder: Path, scenario: str, world_size: int) -> str:
    return "\n".join(f"--- rank {rank}:\n" + (folder / f"{scenario}-{rank}.log").read_text(
        errors="replace")[-3000:] for rank in range(world_size))


def explain(runs: list[RankRun]) -> str:
    return "\n".join(f"--- rank {run.rank} (exit {run.returncode}):\n{run.log[-3000:]}"
                     for run in runs)


# --------------------------------------------------------------------------- data


def write_shards(folder: Path) -> list[str]:
    """Shards of unequal lengths; record ``{"s": shard, "r": number}``."""
    paths = []
    for s in range(SHARDS):
        path = folder / f"part-{s:02d}.jsonl"
        path.write_text("".join(json.dumps({"s": s, "r": r}) + "\n"
                                for r in range(6 + (5 * s) % 9)))
        paths.append(str(path))
    return paths


def all_records(folder: Path) -> list[list[int]]:
    return sorted([s, r] for s in range(SHARDS) for r in range(6 + (5 * s) % 9))


# --------------------------------------------------------------------------- in the ranks


def as_list(samples: list[Any]) -> list[Any]:
    return list(samples)


def record(r: dict[str, Any]) -> list[int]:
    return [int(r["s"]), int(r["r"])]


class Dying:
    """A map-style dataset whose sample ``at`` ends the worker process that fetches it on
    rank ``rank`` (a crash: no exception, no goodbye)."""

    def __init__(self, n: int, rank: int, at: int) -> None:
        self.n, self.rank, self.at = n, rank, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.at and int(os.environ["RANK"]) == self.rank:
            os._exit(7)
        return index


def _group() -> None:
    """This process's gloo group: the launcher's store socket (rank 0), 127.0.0.1 only."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=60)
    options: dict[str, Any] = {}
    if rank == 0:
        options["master_listen_fd"] = int(os.environ["ALOADER_STORE_FD"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timeout, use_libuv=False, **options)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def step(batches: Iterator[Any]) -> tuple[list[Any], list[bool]]:
    """One step: every rank's batch (None: it has none left) and who has one."""
    batch = next(batches, None)
    everyone = gather(batch)
    return everyone, [b is not None for b in everyone]


def lockstep(loader: Any) -> dict[str, Any]:
    """One epoch, a collective per step, until no rank has a batch: every rank's samples,
    and at each step which ranks had a batch."""
    batches = iter(loader)
    seen: list[Any] = []
    flags: list[list[bool]] = []
    while True:
        everyone, has = step(batches)
        if not any(has):
            return {"samples": seen, "flags": flags}
        flags.append(has)
        seen.extend(x for b in everyone if b is not None for x in b)


def map_loader(workers: int, dataset: Any = None) -> Any:
    import aloader

    data = list(range(N_MAP)) if dataset is None else dataset
    sampler = aloader.DistributedSampler(data, shuffle=True, seed=7)
    return aloader.DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers,
                              collate_fn=as_list, persistent_workers=workers > 0)


def stream_loader(folder: Path, workers: int, **options: Any) -> Any:
    import aloader

    options.setdefault("even_ranks", None if "records_per_rank" in options else False)
    source = aloader.JsonLines(sorted(str(p) for p in folder.glob("part-*.jsonl")),
                               shuffle_shards=True, seed=3, chunk_size=64, **options)
    return aloader.DataLoader(source.shuffle(8, seed=1).map(record), batch_size=BATCH,
                              num_workers=workers, collate_fn=as_list)


def epochs_scenario(folder: Path, options: dict[str, Any]) -> Any:
    """Whole epochs on every rank (num_workers 0 and 2), then the job killed mid-epoch
    right after a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    import aloader

    out: dict[str, Any] = {}
    for workers in (0, 2):
        loader = map_loader(workers)
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            out[f"map-{workers}-{epoch}"] = lockstep(loader)
        out[f"stream-{workers}"] = [lockstep(loader) for loader in [stream_loader(
            folder, workers)] for _ in range(2)]
        out[f"quota-{workers}"] = lockstep(stream_loader(folder, workers, records_per_rank=17))
    # The job to kill: TAKEN steps, a checkpoint, one more step (lost), then SIGKILL.
    mapped, streamed = map_loader(2), stream_loader(folder, 2)
    mapped.sampler.set_epoch(0)
    batches = [iter(mapped), iter(streamed)]
    before: list[Any] = []
    for _ in range(TAKEN):
        for it in batches:
            everyone, has = step(it)
            assert all(has)
            before.extend(x for b in everyone for x in b)
    dcp.save({"map": aloader.DistributedState(mapped),
              "stream": aloader.DistributedState(streamed)},
             checkpoint_id=str(folder / "checkpoint"))
    out["before"] = before
    _write(folder, "epochs", out)
    for it in batches:
        step(it)  # delivered after the checkpoint: lost with the job
    os.kill(os.getpid(), signal.SIGKILL)  # a rank still in the step sees its peers gone


def resume_scenario(folder: Path, options: dict[str, Any]) -> Any:
    """The killed job's checkpoint loaded by this world: the rest of the epoch, then one
    whole epoch."""
    import torch.distributed.checkpoint as dcp

    import aloader

    workers = options["workers"]
    mapped, streamed = map_loader(workers), stream_loader(folder, workers)
    dcp.load({"map": aloader.DistributedState(mapped),
              "stream": aloader.DistributedState(streamed)},
             checkpoint_id=str(folder / "checkpoint"))
    out = {"map-rest": lockstep(mapped), "stream-rest": lockstep(streamed)}
    mapped.sampler.set_epoch(1)
    out["map-next"] = lockstep(mapped)
    out["stream-next"] = lockstep(streamed)
    return out


def failing_scenario(folder: Path, options: dict[str, Any]) -> Any:
    """Rank 1's loader loses a worker in the third step: every rank must end in an
    error, none hang."""
    dataset = Dying(N_MAP, rank=1, at=-1)
    loader = map_loader(2, dataset)
    dataset.at = list(loader.sampler)[2 * BATCH]  # in rank 1's third batch
    batches = iter(loader)
    _write(folder, "failing", {"started": True})
    while True:
        _, has = step(batches)
        if not any(has):
            return {"finished": True}  # never: the test fails on it


SCENARIOS: dict[str, Callable[[Path, dict[str, Any]], Any]] = {
    "epochs": epochs_scenario, "resume": resume_scenario, "failing": failing_scenario}


def _write(folder: Path, scenario: str, result: Any) -> None:
    path = folder / f"{scenario}-{os.environ['RANK']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)


def child(scenario: str, folder: str) -> None:
    """A rank's process: join the group, run the scenario, write its result."""
    import torch.distributed as dist

    where = Path(folder)
    options = json.loads((where / f"{scenario}.options.json").read_text())
    _group()
    result = SCENARIOS[scenario](where, options)
    _write(where, scenario, result)
    dist.barrier()
    dist.destroy_process_group()
