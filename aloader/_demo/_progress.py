"""The demos' live progress line: rewritten in place on a terminal, periodic lines otherwise."""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ("Progress",)


class Progress:
    """Batches, items and items/s of a running epoch.

    Args:
        out: where to write.
        total_items: items the epoch will deliver, when known.
        total_batches: batches it will deliver, when known.
        label: text in front of the figures (e.g. the epoch).
    """

    def __init__(self, out: TextIO, total_items: int | None, total_batches: int | None = None,
                 label: str = "") -> None:
        self.out = out
        self.tty = out.isatty()
        self.every = 0.05 if self.tty else 1.0
        self.total_items = total_items
        self.total_batches = total_batches
        self.label = label
        self.start = time.perf_counter()
        self.last = self.start
        self.width = 0

    def _line(self, batches: int, items: int, now: float) -> str:
        rate = items / max(now - self.start, 1e-9)
        total = self.total_batches
        done = (f"{batches:>{len(str(total))}}/{total}" if total is not None
                else f"{batches:>6,}")
        prefix = f"{self.label}  " if self.label else ""
        if self.total_items is None:
            shown = f"{items:>9,}"
        else:
            shown = f"{items:>{len(f'{self.total_items:,}')},}/{self.total_items:,}"
        return f"  {prefix}batches {done}  items {shown}  {rate:>10,.0f} items/s"

    def update(self, batches: int, items: int) -> None:
        """Show the figures, at most every ``every`` seconds."""
        now = time.perf_counter()
        if now - self.last < self.every:
            return
        self.last = now
        self._write(self._line(batches, items, now), final=False)

    def finish(self, batches: int, items: int) -> float:
        """Show the final figures; returns the seconds since the start."""
        now = time.perf_counter()
        self._write(self._line(batches, items, now), final=True)
        return now - self.start

    def _write(self, line: str, final: bool) -> None:
        if self.tty:
            pad = " " * max(0, self.width - len(line))
            self.width = len(line)
            self.out.write("\r" + line + pad + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()
