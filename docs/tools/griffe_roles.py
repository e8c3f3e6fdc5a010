"""A griffe extension for the API reference: aloader's docstrings cross-reference in Sphinx's
roles (``:class:`DataLoader```, ``:meth:`~aloader.Stream.state_dict```), which Markdown would
print as they are. Each role becomes a code span, linked to its page entry when it names a
public name of ``aloader``; a paragraph ending in ``::`` (a literal block follows) ends in
``:``. Loaded by mkdocs.yml's mkdocstrings options; not part of the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

import aloader

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)
_PUBLIC = frozenset(aloader.__all__)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if short else target
    name = target.removeprefix("aloader.")
    if name in _PUBLIC:
        return f"[`{shown}`][aloader.{name}]"
    return f"`{shown}`"


def markdown(text: str) -> str:
    """``text`` (a docstring) with its Sphinx roles and literal-block markers in Markdown."""
    return _LITERAL.sub(r"\1:", _ROLE.sub(_role, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded (see the module's description)."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
