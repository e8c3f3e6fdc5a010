"""``python -m aloader``: see :mod:`aloader._cli`."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
