"""The public names presented as the package's own: ``aloader.DataLoader``, not the private
module that defines it.

:func:`present_as` sets ``__module__`` on every exported class and function (httpx does the
same in its ``__init__``), so that reprs, ``help()``, documentation tools, tracebacks and
pickles name the import path users write. Pickles stay loadable: ``pickle`` and
``cloudpickle`` look a class or function up by ``__module__`` and ``__qualname__``, and
``aloader`` exports each one under that name.

Invariant: what resolved before still resolves. ``typing.get_type_hints`` (doc tools,
validators) evaluates a class's annotations, which are strings (``from __future__ import
annotations``), in the namespace of the module its ``__module__`` names; each string of an
exported class's own annotations becomes a ``ForwardRef`` bound to the module that defines the
class (as ``TypedDict`` binds its own), so they resolve where they were written. Functions and
methods need nothing: they are evaluated in their own ``__globals__``.

The cost, shared with httpx: ``inspect.getsource`` finds a class's file through its
``__module__``, so on an exported class it raises ``OSError`` (a function's or method's source
is still found, through its code object).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import ForwardRef

__all__ = ("present_as",)


def present_as(module: str, objects: Iterable[object]) -> None:
    """Make each class and function of ``objects`` say it lives in ``module``.

    Args:
        module: the public module's name (``"aloader"``), which must export every one of
            ``objects`` under its ``__qualname__``.
        objects: the exported objects; those that are neither classes nor functions (a dict,
            a type alias) are left as they are.
    """
    for obj in objects:
        if isinstance(obj, type):
            own = inspect.get_annotations(obj)  # this class's own, not its bases'
            if any(isinstance(hint, str) for hint in own.values()):
                obj.__annotations__ = {
                    name: ForwardRef(hint, is_argument=False, module=obj.__module__,
                                     is_class=True) if isinstance(hint, str) else hint
                    for name, hint in own.items()
                }
            obj.__module__ = module
        elif inspect.isfunction(obj):
            obj.__module__ = module
