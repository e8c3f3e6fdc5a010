"""``python -m aloader`` (or ``aloader``): the ``demo``, ``profile`` and ``bench`` commands,
``--version``.

Owns the command line: its parser and the dispatch to the commands. The commands' code lives
elsewhere and is imported only when its command runs: the demo in :mod:`aloader._demo` (part of
the installed package, so ``demo`` runs after any install), the benchmarks' engine in
``benchmarks/engine.py`` of a source checkout (found beside the package; an installed copy
without the checkout says so).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from . import __version__

__all__ = ("load_bench_engine", "main")

# The source checkout the package was imported from, when it was (an editable install or a
# run from the repository root): the benchmarks live there, not in the package.
_CHECKOUT = Path(__file__).resolve().parents[1]
# The name the engine is loaded under, once per process (sys.modules holds it).
_ENGINE_MODULE = "aloader_bench_engine"


def load_bench_engine() -> ModuleType | None:
    """The benchmarks' engine (``benchmarks/engine.py`` of the checkout), or None without one.

    Returns:
        The engine module (``WORKLOADS``, ``run_bench``, ``format_table``, ``Row``), loaded on
        first use; None when aloader was not imported from a source checkout.
    """
    path = _CHECKOUT / "benchmarks" / "engine.py"
    # pyproject.toml beside it: a site-packages/benchmarks of another project is not ours.
    if not (path.is_file() and (_CHECKOUT / "pyproject.toml").is_file()):
        return None
    loaded = sys.modules.get(_ENGINE_MODULE)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(_ENGINE_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_ENGINE_MODULE] = module  # before running it: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_ENGINE_MODULE]
        raise
    return module


def _bench(engine: ModuleType, args: argparse.Namespace) -> int:
    import numpy as np

    def log(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    workloads: list[str] = args.workloads or ["all"]
    started = time.perf_counter()
    rows = engine.run_bench(workloads, quick=args.quick, repeat=args.repeat,
                            with_torch=not args.no_torch, log=log)
    elapsed = time.perf_counter() - started
    print(f"aloader loader benchmarks ({', '.join(workloads)}{', quick' if args.quick else ''}): "
          f"best of {args.repeat} per figure, ratios against limits measured in the same run; "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}")
    print()
    print(engine.format_table(rows))
    print()
    missed = [row.workload for row in rows if row.met is False]
    print(f"{len(rows)} rows in {elapsed:.0f} s; targets missed: {len(missed)}")
    for name in missed:
        print(f"  MISSED: {name}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"should be a positive integer, but got {text}")
    return value


def _one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """An argument type for each word of a ``nargs="*"`` list that must be one of
    ``choices``. (``choices=`` itself checks the empty list's default as a whole before
    Python 3.12: ``invalid choice: []`` for no word at all.)"""
    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(repr, choices))})")
        return text

    return check


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"should be a number >= 0, but got {text}")
    return value


def _parser(workloads: Sequence[str] | None) -> argparse.ArgumentParser:
    """The parser; ``workloads``: the engine's, None when no engine was loaded."""
    parser = argparse.ArgumentParser(
        prog="python -m aloader",
        description="aloader: an asyncio-native streaming data loader.",
    )
    parser.add_argument("--version", action="version", version=f"aloader {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="the main job: an async dataset with simulated latency vs sequential fetching, "
             "then JSON Lines shards streamed from a local HTTP server and from s3://",
        description="Part 1 streams an async dataset with simulated network latency through "
                    "the DataLoader and compares with fetching the items one after another. "
                    "Part 2 starts an HTTP server on 127.0.0.1 serving generated shards with "
                    "latency and streams them through the sharded, shuffled JsonLines source "
                    "and the DataLoader (`python -m aloader demo-http --help` for its options). "
                    "Part 3 streams such shards from s3:// on a local S3 server (moto, with "
                    "latency; skipped when moto is not installed).",
    )
    demo.add_argument("--only", choices=("latency", "http", "s3"), default=None,
                      help="run one part only")
    demo.add_argument("--items", type=_positive_int, default=20_000,
                      help="items (default 20000)")
    demo.add_argument("--latency-ms", type=_non_negative_float, default=5.0,
                      help="mean latency of one fetch in ms, +- 50%% jitter (default 5)")
    demo.add_argument("--concurrency", type=_positive_int, default=256,
                      help="max_concurrency: fetches in flight (default 256)")
    demo.add_argument("--batch-size", type=_positive_int, default=32,
                      help="batch size (default 32)")
    demo.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio",
                      help="event loop to run on (default asyncio)")

    commands.add_parser(
        "demo-http",
        help="part 2 of the demo on its own, with its options",
        add_help=False,
    )

    profile = commands.add_parser(
        "profile",
        help="run one epoch of your DataLoader and show where its time goes",
        description="Import MODULE (a dotted name importable from the current directory, or "
                    "a path to a .py file), call FACTORY() (a function returning an "
                    "aloader.DataLoader), run one epoch with a progress line, then print the "
                    "per-stage table of DataLoader.stats() and its bottleneck verdict.",
    )
    profile.add_argument("target", metavar="MODULE:FACTORY",
                         help="e.g. examples/profile_factory.py:make_loader")
    profile.add_argument("--batches", type=_positive_int, default=None,
                         help="stop after this many batches (default: the whole epoch)")
    profile.add_argument("--trace", metavar="PATH", default=None,
                         help="also write the epoch's timings to PATH as a Chrome trace "
                              "(open it in https://ui.perfetto.dev or chrome://tracing)")

    bench = commands.add_parser(
        "bench",
        help="measure the loader against the limits of its workloads (from a source checkout)",
        description="Print a markdown table of the loader's throughput on each workload, as a "
                    "ratio against its limit measured in the same run. io: async dataset and "
                    "the sync `for` facade; sync: a synchronous dataset doing blocking I/O in "
                    "threads; mem: in-memory ArrayDataset; lag: event-loop lag while a "
                    "synchronous dataset loads. The workloads live in benchmarks/engine.py of "
                    "a source checkout of aloader.",
    )
    if workloads is None:
        bench.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                           help="the workloads (needs a source checkout of aloader)")
    else:
        bench.add_argument("workloads", nargs="*", type=_one_of([*workloads, "all"]),
                           metavar="WORKLOAD",
                           help=f"any of {', '.join([*workloads, 'all'])} (default all)")
    bench.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    bench.add_argument("--repeat", type=_positive_int, default=3,
                       help="runs per figure, best kept (default 3)")
    bench.add_argument("--no-torch", action="store_true", help="skip torch's figures")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo-http"]:
        from ._demo import streaming_main

        return streaming_main(argv[1:])
    # The options before the command take no value: the first other word is the command.
    command = next((word for word in argv if not word.startswith("-")), None)
    engine = load_bench_engine() if command == "bench" else None
    args = _parser(None if engine is None else engine.WORKLOADS).parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo_main

        return demo_main(args)
    if args.command == "profile":
        from ._demo._profile import main as profile_main

        return profile_main(args.target, batches=args.batches, trace=args.trace)
    if engine is None:
        print(f"python -m aloader bench: the benchmarks are not installed with the package; "
              f"run it from a source checkout of aloader (`pip install -e .` there), where "
              f"benchmarks/engine.py lies beside the package (not found under {_CHECKOUT})",
              file=sys.stderr)
        return 2
    return _bench(engine, args)
