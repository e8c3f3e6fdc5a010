"""How workers start by default: a PyTorch script changed only in its import runs.

Each test runs a program in a fresh interpreter (a script, ``python -c``), as a user would: no
``if __name__ == "__main__":`` guard, lambdas, local functions and classes of ``__main__`` as
dataset, transform, collate_fn and worker_init_fn. The main module must run exactly once (it
appends a line to a file at top level), and modules it imported must be in the workers without
being imported again (``helper_mod`` appends a line when imported). Timeouts are hang guards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

GUARD = 120  # seconds: a hang guard (importing torch on a loaded machine takes a while)
ROOT = Path(__file__).resolve().parents[2]

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

HELPER = """
import os
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper.count"), "a") as f:
    f.write("imported\\n")
VALUE = 7
"""

# The user's program: top-level code only.
PROGRAM = """
{torch_import}import dataclasses, os, sys
import helper_mod
import aloader

with open("main.count", "a") as f:
    f.write("ran\\n")
print("top of main", flush=False)  # buffered (a pipe): must be written once, not by workers


@dataclasses.dataclass
class Sample:
    value: int
    worker_has_helper: bool
    worker_has_torch: bool
    pid: int


class Squares:
    def __init__(self, n, transform):
        self.n = n
        self.transform = transform

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return Sample(self.transform(index), "helper_mod" in sys.modules,
                      "torch" in sys.modules, os.getpid())


def make_init(path):
    def init(worker_id):  # a local function
        with open(path, "a") as f:
            f.write(f"{{worker_id}} {{helper_mod.VALUE}}\\n")
    return init


loader = aloader.DataLoader(Squares(10, lambda i: i * i), batch_size=4, num_workers=2,
                            collate_fn=lambda samples: samples, timeout=60,
                            worker_init_fn=make_init("init.log"))
epochs = []
for epoch in range(3):
    batches = list(loader)
    assert all(type(s) is Sample for b in batches for s in b), "samples are the main's class"
    epochs.append([[s.value for s in b] for b in batches])
    workers = {{s.pid for b in batches for s in b}}
    assert workers and os.getpid() not in workers
    assert all(s.worker_has_helper for b in batches for s in b)
    assert all(s.worker_has_torch == ("torch" in sys.modules) for b in batches for s in b)

# A class redefined after the first loader (a notebook cell run again): the new one is used.
class Squares(Squares):
    def __getitem__(self, index):
        sample = super().__getitem__(index)
        sample.value = -sample.value
        return sample

redefined = [[s.value for s in b] for b in aloader.DataLoader(
    Squares(4, lambda i: i), batch_size=2, num_workers=2, collate_fn=lambda s: s)]
print(json.dumps({{"epochs": epochs, "redefined": redefined}}))
"""


def run_program(tmp_path: Path, *, command: str, torch_import: bool, prelude: str = "") -> Any:
    (tmp_path / "helper_mod.py").write_text(HELPER)
    source = prelude + PROGRAM.format(torch_import="import torch\n" if torch_import else "")
    source = source.replace("import dataclasses, os, sys", "import dataclasses, json, os, sys")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    if command == "script":
        script = tmp_path / "main.py"
        script.write_text(source)
        args = [sys.executable, str(script)]
    else:
        args = [sys.executable, "-c", source]
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("top of main") == 1, done.stdout
    assert (tmp_path / "main.count").read_text() == "ran\n"  # the main module ran once
    assert (tmp_path / "helper.count").read_text() == "imported\n"  # no worker imported it
    inits = sorted((tmp_path / "init.log").read_text().split("\n")[:-1])
    assert inits == ["0 7", "0 7", "0 7", "1 7", "1 7", "1 7"]  # 3 epochs x 2 workers
    return json.loads(done.stdout.splitlines()[-1])


EXPECTED = {"epochs": [[[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]] * 3,
            "redefined": [[0, -1], [-2, -3]]}
TORCH = [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_TORCH,
                                                            reason="torch not installed"))]


@pytest.mark.parametrize("torch_import", TORCH)
def test_script_without_main_guard(tmp_path: Path, torch_import: bool) -> None:
    assert run_program(tmp_path, command="script", torch_import=torch_import) == EXPECTED


def test_python_c_without_main_guard(tmp_path: Path) -> None:
    assert run_program(tmp_path, command="-c", torch_import=False) == EXPECTED


def test_threads_running_at_construction_still_never_rerun_main(tmp_path: Path) -> None:
    # Forking is unsafe now: the workers come from the exec'd fork server, with the same
    # guarantees (only the modules are imported again there, so helper_mod is not checked).
    prelude = "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), " \
              "daemon=True).start()\n"
    (tmp_path / "helper_mod.py").write_text(HELPER)
    source = prelude + PROGRAM.format(torch_import="").replace(
        "import dataclasses, os, sys", "import dataclasses, json, os, sys").replace(
        'assert all(s.worker_has_helper for b in batches for s in b)', "")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    done = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "main.count").read_text() == "ran\n"
    assert json.loads(done.stdout.splitlines()[-1]) == EXPECTED


# A loader without workers iterated first: its `for` runs on a private loop, in a thread, with a
# thread of fetches (a plain dataset's, with a timeout): the loader with workers built after it
# still forks the template (it holds that loop for the fork), so no worker imports a module
# again.
EARLY_LOADER = """
import threading
import aloader as _aloader


class _Plain:
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return index


early = _aloader.DataLoader(_Plain(), batch_size=4, timeout=60)
assert [b.tolist() for b in early] == [[0, 1, 2, 3], [4, 5]]
assert threading.active_count() > 1, threading.enumerate()
"""


@pytest.mark.parametrize("torch_import", TORCH)
def test_a_loader_iterated_before_does_not_stop_the_template(tmp_path: Path,
                                                             torch_import: bool) -> None:
    assert run_program(tmp_path, command="script", torch_import=torch_import,
                       prelude=EARLY_LOADER) == EXPECTED


@pytest.mark.parametrize("uvloop", ["0", "1"])
def test_the_held_loop_goes_on_after_the_fork(tmp_path: Path, uvloop: str) -> None:
    program = EARLY_LOADER + textwrap.dedent("""
        from aloader.workers import _spawn
        loader = _aloader.DataLoader(_Plain(), batch_size=4, num_workers=2, timeout=60)
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]
        assert _spawn.SERVER.template  # a fork of this process, not the exec'd server
        for _ in range(3):  # the loop held for the fork runs its loader's epochs again
            assert [b.tolist() for b in early] == [[0, 1, 2, 3], [4, 5]]
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), ALOADER_UVLOOP=uvloop)
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


ASYNC_PROGRAM = """
import sys
import anyio, sniffio
import aloader
from aloader._backend import current_backend


class Plain:
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return (index, str(current_backend()))


class Async:
    def __len__(self):
        return 4

    async def __getitem__(self, index):
        await anyio.sleep(0)
        return (index, str(current_backend()) + "/" + sniffio.current_async_library())


async def main():
    out = []
    for dataset in (Plain(), Async()):
        loader = aloader.DataLoader(dataset, batch_size=2, num_workers=2, timeout=60,
                                    collate_fn=lambda samples: samples)
        out.append([sample async for batch in loader for sample in batch])
    print(out)


anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_loader_built_inside_an_event_loop(tmp_path: Path, backend: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", ASYNC_PROGRAM, backend], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    # A plain worker runs no event loop; an async one runs its own on asyncio.
    plain = [(i, "None") for i in range(4)]
    in_async = [(i, "asyncio/asyncio") for i in range(4)]
    assert done.stdout.strip() == str([plain, in_async])


STDIN_PROGRAM = """
import subprocess, sys
import aloader

child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); print('eof')"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
loader = aloader.DataLoader(list(range(8)), batch_size=4, num_workers=2)
print([b.tolist() for b in loader], flush=True)
child.stdin.close()  # the child sees EOF only if no other process holds the pipe's write end
try:
    child.wait(timeout=20)
except subprocess.TimeoutExpired:
    child.kill()
    print("no EOF")
else:
    print(child.stdout.read().strip())
"""


def test_pipes_of_the_user_process_do_not_stay_open(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", STDIN_PROGRAM], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[[0, 1, 2, 3], [4, 5, 6, 7]]", "eof"]


def test_template_is_shared_and_exits_with_the_process(tmp_path: Path) -> None:
    program = textwrap.dedent("""
        import aloader
        from aloader.workers import _spawn
        a = aloader.DataLoader(list(range(4)), batch_size=2, num_workers=1)
        pid = _spawn.SERVER._forkserver_pid
        assert _spawn.SERVER.template
        b = aloader.DataLoader(list(range(4)), batch_size=2, num_workers=1)
        assert [x.tolist() for x in a] == [x.tolist() for x in b] == [[0, 1], [2, 3]]
        assert _spawn.SERVER._forkserver_pid == pid
        print(pid)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    # run() returned, so stdout reached EOF: the template, which shares it, is exiting.
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + GUARD
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "gone"
        if state in ("gone", "Z", "X"):
            break
        assert time.monotonic() < deadline, f"the template {pid} still runs"
        time.sleep(0.01)


TRACKER_PROGRAM = """
import aloader


class UsesSharedMemory:
    def __len__(self):
        return 4

    def __getitem__(self, index):
        from multiprocessing import shared_memory

        block = shared_memory.SharedMemory(create=True, size=16)
        block.buf[0] = index
        value = block.buf[0]
        block.close()
        block.unlink()
        return value


print([b.tolist() for b in aloader.DataLoader(UsesSharedMemory(), batch_size=2, num_workers=2)])
"""


def test_workers_may_use_multiprocessing_shared_memory(tmp_path: Path) -> None:
    # The template's workers get no resource tracker of the loader's: one starts if needed.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-W", "error", "-c", TRACKER_PROGRAM], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[0, 1], [2, 3]]"
    assert "resource_tracker" not in done.stderr, done.stderr


class _Surroundings:
    """A sample: what the worker sees of its process (an environment variable, the working
    directory)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> tuple[str | None, str | None, str]:
        return (os.environ.get("ALOADER_TEST_LATER"), os.environ.get("ALOADER_TEST_GONE"),
                os.getcwd())


def _seen(loader: Any) -> set[tuple[str | None, str | None, str]]:
    return {tuple(sample) for sample in loader}


def test_workers_see_the_environment_and_directory_of_their_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aloader

    monkeypatch.setenv("ALOADER_TEST_GONE", "set before")
    monkeypatch.delenv("ALOADER_TEST_LATER", raising=False)
    loader = aloader.DataLoader(_Surroundings(), batch_size=None, num_workers=2,
                                collate_fn=tuple)
    assert _seen(loader) == {(None, "set before", os.getcwd())}  # the template runs now
    monkeypatch.setenv("ALOADER_TEST_LATER", "set after")  # credentials, an endpoint...
    monkeypatch.delenv("ALOADER_TEST_GONE")
    monkeypatch.chdir(tmp_path)
    now = {("set after", None, str(tmp_path))}
    assert _seen(loader) == now  # the next epoch's workers
    again = aloader.DataLoader(_Surroundings(), batch_size=None, num_workers=2,
                               collate_fn=tuple, persistent_workers=True)
    assert _seen(again) == now
    again.close()
