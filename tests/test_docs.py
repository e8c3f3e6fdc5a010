"""The guides in docs/ say what the code does: every ```python block of a page runs, in order,
as one program (in a fresh process, in an empty directory, on small data), and the API
reference names every public name.

The object store guide's blocks read ``s3://my-bucket/train/``: moto's S3 server on 127.0.0.1
holds it, reached through the environment variables the guide describes. A page whose blocks
import torch is skipped without torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aloader

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)

# What the object store guide reads: s3://my-bucket/train/shard-0000i.jsonl.
BUCKET = "my-bucket"


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of ``page``, in order."""
    return _BLOCK.findall(page.read_text())


PAGES = sorted(page.name for page in DOCS.glob("*.md") if python_blocks(DOCS / page.name))


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """The environment of a program reading ``s3://my-bucket/`` on a local S3 server."""
    from sourcetools import local_s3

    from aloader._demo import make_jsonl_shards

    objects = {f"train/{name}": body for name, body in make_jsonl_shards(4, 50).items()}
    with local_s3(BUCKET, objects) as server:
        yield server.env()


def run_page(name: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run ``name``'s python blocks as one program in ``tmp_path``; its output."""
    program = "\n\n".join(python_blocks(DOCS / name))
    if "import torch" in program and importlib.util.find_spec("torch") is None:
        pytest.skip(f"{name} imports torch")
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])])
    environment.update(env or {})
    (tmp_path / "guide.py").write_text(program)
    done = subprocess.run([sys.executable, "guide.py"], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("name", [page for page in PAGES if page != "object-stores.md"])
def test_guide_runs(name: str, tmp_path: Path) -> None:
    run_page(name, tmp_path)


def test_object_store_guide_runs(tmp_path: Path, s3_env: dict[str, str]) -> None:
    run_page("object-stores.md", tmp_path, s3_env)


def test_api_reference_names_every_public_name() -> None:
    documented = set(re.findall(r"^::: aloader\.(\w+)$", (DOCS / "api.md").read_text(),
                                re.MULTILINE))
    assert documented == set(aloader.__all__)


def test_guides_are_in_the_site() -> None:
    nav: Any = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert f": {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
