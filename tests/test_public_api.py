"""Every public name is exported, documented and importable from the top level."""

from __future__ import annotations

import inspect

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
    for name in aloader.__all__:
        obj = getattr(aloader, name)
        module = getattr(obj, "__module__", None)
        if module is not None and (inspect.isclass(obj) or inspect.isfunction(obj)):
            assert module.startswith("aloader._"), f"{name} is defined in {module}"


def test_torch_not_imported_at_module_load() -> None:
    import subprocess
    import sys

    code = "import sys, aloader; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
