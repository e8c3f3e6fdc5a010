"""Every public name is exported, documented and importable from the top level."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import site
import subprocess
import sys
import types
import typing
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

import aloader


def test_all_names_exist() -> None:
    for name in aloader.__all__:
        assert hasattr(aloader, name), name


def test_no_duplicates_in_all() -> None:
    assert len(set(aloader.__all__)) == len(aloader.__all__)


def test_public_objects_have_docstrings() -> None:
    for name in aloader.__all__:
        obj = getattr(aloader, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_public_objects_live_in_private_modules() -> None:
    # Each public name is defined in a private module and imported into aloader/__init__.py
    # (which defines nothing of its own); every class and function says it is aloader's
    # (``__module__``: reprs, help(), docs and pickles name aloader.X, see aloader._public).
    init = ast.parse(Path(aloader.__file__).read_text())
    homes = {
        alias.asname or alias.name: node.module or ""
        for node in init.body if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }
    for name in aloader.__all__:
        obj = getattr(aloader, name)
        home = homes.get(name)
        assert home is not None, f"{name} is not imported from a private module"
        assert any(p.startswith("_") for p in home.split(".")), f"{name} is defined in {home}"
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "aloader", f"{name} says it lives in {obj.__module__}"
            assert getattr(importlib.import_module(f"aloader.{home}"), name) is obj, name


def test_torch_not_imported_at_module_load() -> None:
    code = "import sys, aloader; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- Public typing: every type a public signature or docstring names is importable from aloader --

# A type may come from here without being re-exported: the standard library, numpy, typing.
_FOREIGN_TOPS = frozenset(sys.stdlib_module_names) | {"builtins", "numpy", "typing_extensions"}


def _exported_ids() -> set[int]:
    return {id(getattr(aloader, name)) for name in aloader.__all__}


def _types_in(hint: object) -> Iterator[object]:
    """Every class named anywhere inside ``hint`` (``list[X] | None`` gives list, X, NoneType)."""
    if isinstance(hint, typing.TypeVar) or hint is Ellipsis:
        return
    if isinstance(hint, list):  # Callable's argument list
        for item in hint:
            yield from _types_in(item)
        return
    origin = typing.get_origin(hint)
    if origin is not None:
        if isinstance(origin, type):
            yield origin
        for arg in typing.get_args(hint):
            yield from _types_in(arg)
        return
    if isinstance(hint, type):
        yield hint


def _public_hints() -> Iterator[tuple[str, object]]:
    """(where, hint) for the parameters, returns and public attributes of every public name."""
    for name in aloader.__all__:
        obj = getattr(aloader, name)
        if inspect.isfunction(obj):
            for param, hint in typing.get_type_hints(obj).items():
                yield f"{name}:{param}", hint
            continue
        if not inspect.isclass(obj):
            continue
        for klass in obj.__mro__:
            if not (klass.__module__ == "aloader" or klass.__module__.startswith("aloader.")):
                continue
            for attr, value in vars(klass).items():
                if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                    continue
                if isinstance(value, staticmethod | classmethod):
                    value = value.__func__
                if isinstance(value, property):
                    value = value.fget
                if inspect.isfunction(value):
                    for param, hint in typing.get_type_hints(value).items():
                        yield f"{name}.{attr}:{param}", hint
            # Public attribute annotations only: private ones may name TYPE_CHECKING-only types.
            public = {k: v for k, v in vars(klass).get("__annotations__", {}).items()
                      if not k.startswith("_")}
            namespace = vars(sys.modules[klass.__module__])
            for attr, hint in typing.get_type_hints(
                types.SimpleNamespace(__annotations__=public), globalns=dict(namespace)
            ).items():
                yield f"{name}.{attr}", hint


def test_public_signatures_resolve_at_runtime() -> None:
    # typing.get_type_hints (used by doc tools and validators) evaluates every public hint.
    assert list(_public_hints())


def test_public_signatures_name_only_exported_types() -> None:
    exported = _exported_ids()
    missing: dict[str, list[str]] = {}
    for where, hint in _public_hints():
        for cls in _types_in(hint):
            module = getattr(cls, "__module__", "")
            qualname = f"{module}.{getattr(cls, '__qualname__', cls)}"
            if module.startswith("aloader"):
                if id(cls) not in exported:
                    missing.setdefault(qualname, []).append(where)
            elif module.split(".")[0] not in _FOREIGN_TOPS:
                missing.setdefault(qualname, []).append(where)
    assert not missing, f"types in public signatures that aloader does not export: {missing}"


_ROLE = re.compile(r":(?:class|exc|func|meth|attr|data):`~?([\w.]+)`|``([A-Z]\w+)``")


def test_public_docstrings_name_only_exported_types() -> None:
    defined: dict[str, object] = {}
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("aloader.") and module is not None:
            for key, value in vars(module).items():
                if inspect.isclass(value) and (value.__module__ == "aloader"
                                               or value.__module__.startswith("aloader.")):
                    defined.setdefault(key, value)
    exported = _exported_ids()
    docs: list[tuple[str, str]] = [("aloader", aloader.__doc__ or "")]
    for name in aloader.__all__:
        obj = getattr(aloader, name)
        docs.append((name, inspect.getdoc(obj) or ""))
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                documented = callable(value) or isinstance(value, property)
                public = not attr.startswith("_") or attr in ("__init__", "__aiter__", "__iter__")
                if public and documented:
                    docs.append((f"{name}.{attr}", inspect.getdoc(value) or ""))
    missing: dict[str, list[str]] = {}
    for where, doc in docs:
        for match in _ROLE.finditer(doc):
            dotted = match.group(1) or match.group(2)
            if dotted.startswith("aloader._") and dotted.count(".") == 1:
                continue  # a module reference (:mod:) written as a class role
            cls = defined.get(dotted.rsplit(".", 1)[-1])
            if cls is not None and id(cls) not in exported:
                missing.setdefault(dotted, []).append(where)
    assert not missing, f"types named in public docstrings that aloader does not export: {missing}"


@pytest.mark.skipif(
    importlib.util.find_spec("pyright") is None or shutil.which("node") is None,
    reason="needs pyright (pip install pyright) and node",
)
def test_pyright_type_completeness(tmp_path: Path) -> None:
    # pyright --verifytypes reads the package from an environment, as a user's checker would: a
    # venv whose only path entry for aloader is this checkout (an editable install's .pth line).
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    (site_dir,) = env_dir.glob("lib/python*/site-packages")
    repo = Path(aloader.__file__).resolve().parent.parent
    (site_dir / "aloader_checkout.pth").write_text(
        "\n".join([str(repo), *site.getsitepackages()]) + "\n"
    )
    environ = {
        **os.environ,
        "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(env_dir),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pyright", "--verifytypes", "aloader", "--ignoreexternal",
         "--outputjson"],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=240, check=False,
    )
    report = json.loads(done.stdout)["typeCompleteness"]
    assert Path(report["packageRootDirectory"]) == repo / "aloader", report
    assert report["completenessScore"] == 1.0, [
        (s["name"], [d["message"] for d in s["diagnostics"]])
        for s in report["symbols"] if s["diagnostics"]
    ]
