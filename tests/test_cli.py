"""``python -m aloader demo`` and ``bench`` run to completion and print what they promise."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import aloader
from aloader._cli import load_bench_engine, main
from aloader._demo import RemoteDataset

_engine = load_bench_engine()
assert _engine is not None, "the tests run from a source checkout"
Row, format_table, run_bench = _engine.Row, _engine.format_table, _engine.run_bench

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_demo_runs_and_reports() -> None:
    result = run("-m", "aloader", "demo", "--items", "200", "--latency-ms", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Streaming 200 items" in out
    assert "batches 7/7  items 200/200" in out  # ceil(200 / 32) batches, every item
    assert "sequential:" in out
    assert "aloader:  200 items in" in out
    assert "speed-up:" in out
    assert "every item delivered exactly once: yes" in out


def test_demo_not_a_tty_prints_plain_lines() -> None:
    result = run("-m", "aloader", "demo", "--items", "64", "--latency-ms", "0",
                 "--batch-size", "16", "--concurrency", "4")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout
    assert "batches 4/4  items 64/64" in result.stdout
    assert "timing all 64" in result.stdout  # fewer items than the sample: nothing estimated


def test_demo_on_trio() -> None:
    assert main(["demo", "--items", "40", "--latency-ms", "0.5", "--backend", "trio"]) == 0


def test_version() -> None:
    result = run("-m", "aloader", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"aloader {aloader.__version__}\n"


def test_version_has_one_source_and_a_console_script() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]  # read from aloader.__version__, not repeated
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "aloader.__version__"}
    assert project["project"]["scripts"] == {"aloader": "aloader._cli:main"}
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])  # what the `aloader` script runs
    assert exit_.value.code == 0


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--items", "0"],
        ["demo", "--latency-ms", "-1"],
        ["demo", "--concurrency", "x"],
        ["bench", "nosuch"],
        ["bench", "--repeat", "0"],
    ],
)
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bench_without_workloads_parses_as_all(capsys: pytest.CaptureFixture[str]) -> None:
    from aloader._cli import _parser

    parser = _parser(_engine.WORKLOADS)
    assert parser.parse_args(["bench"]).workloads == []  # (Python 3.11: "invalid choice: []")
    assert parser.parse_args(["bench", "io", "all"]).workloads == ["io", "all"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "io", "nosuch"])
    assert "argument WORKLOAD: invalid choice: 'nosuch' (choose from 'io'" in (
        capsys.readouterr().err)


def test_bench_io_quick() -> None:
    result = run("-m", "aloader", "bench", "io", "--quick")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = "| workload | aloader items/s | limit items/s | ratio | target | torch items/s |"
    assert header in lines
    assert any(line.startswith("| io: async dataset, max_concurrency=512, N=2,000 |")
               for line in lines)
    assert any(line.startswith("| io: same, through the sync `for` facade") for line in lines)
    assert any(line.startswith("| io: same, vs the anchors' gather program") for line in lines)
    rows = [line for line in lines if line.startswith("| io")]
    # The limit, the anchors' gather program, trio; the sync `for` (with uvloop: `async for` on
    # it and the sync `for` on either private loop).
    has = importlib.util.find_spec
    assert len(rows) == 2 + bool(has("trio")) + (4 if has("uvloop") else 1)
    for line in rows:
        assert line.count("|") == 7, line  # six cells
    assert "rows in" in result.stdout


def test_bench_script_wraps_the_cli() -> None:
    result = run("benchmarks/bench_loader.py", "sync", "--quick", "--no-torch", "--repeat", "1")
    assert result.returncode == 0, result.stderr
    assert "| sync io: sync dataset, blocking time.sleep" in result.stdout
    assert "- (skipped)" in result.stdout


def test_run_bench_mem_and_lag_rows() -> None:
    rows = run_bench(["mem", "lag"], quick=True, repeat=1, with_torch=False)
    names = [row.workload for row in rows]
    assert names[0].startswith("mem: ArrayDataset 20,000 x 128")
    assert [n for n in names if n.startswith("lag:")] == [
        "lag: sync dataset, 2 ms blocking sleep/item, batch 32, N=160",
        "lag: sync dataset, 2 ms GIL-holding work/item, batch 32, N=160",
    ]
    for row in rows:
        assert row.aloader > 0
        assert row.limit is not None and row.limit > 0
    assert "lag p50" in rows[-1].ratio and "p99" in rows[-1].ratio


def test_run_bench_rejects_unknown_workload() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        run_bench(["nosuch"])
    with pytest.raises(ValueError, match="repeat"):
        run_bench(["io"], repeat=0)


def test_format_table() -> None:
    row = Row("w", 1234.5, None, "", "0.50x", ">= 0.6x: MISSED", "-", False)
    assert format_table([row]).splitlines() == [
        "| workload | aloader items/s | limit items/s | ratio | target | torch items/s |",
        "|---|---|---|---|---|---|",
        "| w | 1,234 | - | 0.50x | >= 0.6x: MISSED | - |",
    ]


@pytest.mark.anyio
async def test_remote_dataset_payload(anyio_backend: str) -> None:
    dataset = RemoteDataset(3, latency=0.0001)
    assert len(dataset) == 3
    item = await dataset[2]
    assert item.dtype.name == "float32" and item.shape == (16,)
    assert (item == 2).all()


def test_importing_the_cli_and_bench_does_not_import_torch() -> None:
    code = ("import sys, aloader._cli, aloader.__main__, aloader._demo; "
            "assert aloader._cli.load_bench_engine() is not None; "
            "assert 'torch' not in sys.modules")
    assert run("-c", code).returncode == 0


def test_importing_the_cli_imports_neither_the_demo_nor_the_bench_engine() -> None:
    code = ("import sys, aloader._cli, aloader.__main__; "
            "loaded = [m for m in sys.modules if m == 'aloader._demo' or "
            "m.startswith('aloader._demo.') or m in ('http.server', 'aloader_bench_engine')]; "
            "assert not loaded, loaded")
    result = run("-c", code)
    assert result.returncode == 0, result.stderr


def test_version_and_demo_help_import_neither_the_demo_nor_the_bench_engine() -> None:
    code = ("import sys, aloader._cli\n"
            "for argv in (['--version'], ['demo', '--help'], ['--help']):\n"
            "    try:\n"
            "        aloader._cli.main(argv)\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, (argv, exc.code)\n"
            "loaded = [m for m in sys.modules if m.startswith('aloader._demo') or "
            "m in ('http.server', 'aloader_bench_engine')]\n"
            "assert not loaded, loaded\n")
    result = run("-c", code)
    assert result.returncode == 0, result.stderr


def test_bench_outside_a_source_checkout_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An installed copy: site-packages holds the package and no benchmarks/ beside it.
    monkeypatch.setattr("aloader._cli._CHECKOUT", tmp_path)
    assert load_bench_engine() is None
    assert main(["bench", "io", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "benchmarks/engine.py" in err
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])  # the help still says what the command needs
    assert info.value.code == 0
    assert "source checkout" in capsys.readouterr().out


def test_bench_engine_loads_once() -> None:
    assert load_bench_engine() is load_bench_engine() is _engine


def test_every_subpackage_is_installed() -> None:
    # `python -m aloader demo` after a plain (non-editable) `pip install .` needs aloader._demo
    # in the wheel: every package directory under aloader/ is listed for setuptools.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for init in (ROOT / "aloader").rglob("__init__.py")}
    assert "aloader._demo" in found
    assert found <= listed, sorted(found - listed)


def test_demo_ends_with_the_stage_table_and_verdict() -> None:
    result = run("-m", "aloader", "demo", "--only", "latency", "--items", "200",
                 "--latency-ms", "1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    table = out[out.index("Where the loader's time went"):]
    assert "stage" in table and "fetch" in table and "collate" in table
    assert "200 items, 7 batches, 0 failed" in table
    assert "bottleneck: " in table


def test_profile_the_example_factory() -> None:
    result = run("-m", "aloader", "profile", "examples/profile_factory.py:make_loader")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "batches 25/25  items       400" in out  # the progress line
    assert "400 items, 25 batches, 0 failed" in out
    assert "bottleneck: fetch latency: 4 of 4 fetches in flight, raise max_concurrency" in out


def test_profile_writes_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    result = run("-m", "aloader", "profile", "examples/profile_factory.py:make_loader",
                 "--trace", str(path))
    assert result.returncode == 0, result.stderr
    assert f"trace: {path}" in result.stdout
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(1 for e in events if e["name"] == "wait") == 25


def test_profile_by_module_name_and_batches(tmp_path: Path) -> None:
    (tmp_path / "my_loader.py").write_text(
        "import aloader\n"
        "def make():\n"
        "    return aloader.DataLoader(list(range(100)), batch_size=10)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "aloader", "profile", "my_loader:make", "--batches", "3"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "30 items, 3 batches, 0 failed" in result.stdout


@pytest.mark.parametrize(("target", "said"), [
    ("no_colon", "expected module:factory (a function returning a DataLoader), but got "
                 "'no_colon'"),
    ("examples/profile_factory.py:make_loadr",
     "no function 'make_loadr' in examples/profile_factory.py; did you mean 'make_loader'?"),
    ("no_such_module:make", "no module named 'no_such_module'"),
    ("examples/no_such_file.py:make", "no file examples/no_such_file.py"),
])
def test_profile_a_mistyped_target_says_so_in_one_line(target: str, said: str) -> None:
    result = run("-m", "aloader", "profile", target)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2
    assert len(lines) == 1 and lines[0].startswith(f"aloader profile: {said}"), result.stderr


def test_demo_s3_part_without_moto_says_skipped_and_succeeds() -> None:
    # None in sys.modules makes `import moto...` raise ImportError, as if not installed.
    code = ("import sys; sys.modules['moto'] = sys.modules['moto.server'] = None; "
            "from aloader._cli import main; sys.exit(main(['demo', '--only', 's3']))")
    result = run("-c", code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout  # --only s3: no other part ran
    assert "S3 streaming demo: skipped, moto is not installed" in lines[0]
    assert 'pip install "moto[server]"' in lines[0]
