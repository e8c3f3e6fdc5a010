"""Batch formation: which queued requests make the next batch, and when a batch is full.

The batcher decides *when* a batch goes out (a free execution slot, then full or ``max_wait``
passed); :class:`_Formation` decides *what* goes out: the queue's requests in order of service
(:class:`_RequestQueue`), up to the budgets. A batch closes before the first request that does
not fit, so a later, smaller one never jumps ahead (no large item starves); requests whose
queue deadline passed are dropped on the way; preferred batch sizes cut it last.

The budgets:

* ``max_batch_size`` items (the default);
* ``max_batch_cost``: the sum of the items' ``cost(item)``, computed once per item when it is
  submitted (vLLM's ``max_num_batched_tokens``);
* ``batch_size_fn`` (Ray Serve's): ``batch_size_fn(items)`` of the batch, at most
  ``max_batch_size``, for sizes that are not sums (a padded length). Measured on each item alone
  when it is submitted, and on candidate batches by bisection (sizes grow with the items), so a
  batch costs O(log n) calls.

What a user's callback raises fails the caller it concerns: at submission, that caller; during
formation, the item whose addition made it raise (Ray's queue hangs there instead).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

from .._exceptions import BatchCostError
from ._checks import check_cost
from ._request import _RUNNING, _Request, _RequestQueue

__all__ = ("_Formation",)

_NEVER = sys.maxsize


class _Clock(Protocol):
    """The batcher's clock (its :class:`~aloader.serve._loop._LoopBinding`'s, which follows
    the loop it is bound to)."""

    now: Callable[[], float]


class _Formation:
    """The budgets of a batcher's batches, and the forming of each batch out of its queue.

    ``clock.now()`` is the time formation drops late requests and promotes old ones by (read
    only when they can matter); ``drop(request)`` answers a queued request whose deadline
    passed; ``fail(request, exc)`` a
    queued request that its ``batch_size_fn`` failed (the batcher's; both take the request out
    of the queue first where it is still there, see :meth:`take`).

    Thread-safety: none; the bound loop's tasks use it, one at a time.
    """

    __slots__ = (
        "allow_oversized", "budgeted", "clock", "cost_fn", "drop", "fail", "max_cost", "name",
        "preferred", "promote_after", "queue", "size_fn",
    )  # fmt: skip

    def __init__(
        self,
        queue: _RequestQueue,
        clock: _Clock,
        *,
        name: str,
        preferred: tuple[int, ...],
        size_fn: Callable[[list[Any]], Any] | None,
        cost_fn: Callable[[Any], Any] | None,
        max_cost: float,
        allow_oversized: bool,
        promote_after: float,
        drop: Callable[[_Request], None],
        fail: Callable[[_Request, BaseException], None],
    ) -> None:
        self.queue = queue
        self.clock = clock
        self.name = name
        self.preferred = preferred
        self.size_fn = size_fn
        self.cost_fn = cost_fn
        self.max_cost = max_cost
        self.allow_oversized = allow_oversized
        self.promote_after = promote_after
        self.drop = drop
        self.fail = fail
        # Formation takes the queue's head (O(batch)) unless a budget needs the items' costs.
        self.budgeted = size_fn is not None or cost_fn is not None

    def item_cost(self, item: Any, max_batch_size: int) -> float:
        """The item's ``cost`` (0 without one), after refusing an item that no batch could
        take; runs the user's callbacks in the caller, so what they raise is the caller's.

        Raises:
            BatchCostError: The item alone exceeds a budget (unless ``allow_oversized``).
        """
        oversized = None
        cost: float = 0
        if self.cost_fn is not None:
            cost = check_cost(self.cost_fn(item), "cost")
            if cost > self.max_cost:
                oversized = f"its cost {cost!r} alone exceeds max_batch_cost={self.max_cost!r}"
        if self.size_fn is not None:
            size = self.size_of([item])
            if size > max_batch_size:
                oversized = (
                    f"size of item ({size!r}, by batch_size_fn) is greater than "
                    f"max_batch_size={max_batch_size}"
                )
        if oversized is not None and not self.allow_oversized:
            raise self._refusal(oversized)
        return cost

    def _refusal(self, oversized: str) -> BatchCostError:
        return BatchCostError(
            f"batcher {self.name!r} refused an item: {oversized}; increase the budget, "
            "check the cost function, or pass allow_oversized=True to run such an item in "
            "a batch of its own"
        )

    def size_of(self, items: list[Any]) -> float:
        assert self.size_fn is not None
        return check_cost(self.size_fn(items), "batch_size_fn")

    def full(self, size: int, fill: int, now: float) -> bool:
        """Whether the batch forming now (at most ``size``; full at ``fill`` items) would go
        out without more waiting."""
        queue = self.queue
        if len(queue) >= fill or queue.cost >= self.max_cost:
            return True
        if self.size_fn is None:
            return False
        items = [request.item for request in queue.ordered(now - self.promote_after)]
        try:
            return self.size_of(items) >= size
        except Exception:
            return True  # take() finds the item that makes it raise

    def take(self, size: int) -> tuple[list[_Request], list[Any]]:
        """The next batch (at most ``size``), out of the queue and running: its requests and
        their items."""
        queue = self.queue
        batch: list[_Request]
        if self.budgeted or queue.deadlines or not (queue.levels is None or len(queue.order) < 2):
            batch = self._form(size, self.clock.now())
        else:
            # The order of service is the order of arrival and nothing else limits the batch.
            n = min(len(queue.fifo), size)
            if self.preferred and n >= self.preferred[0]:
                n = max(p for p in self.preferred if p <= n)
            if queue.levels is None:  # no level to keep in step, no cost: the dict alone
                popitem = queue.fifo.popitem
                batch = []
                items = []
                for _ in range(n):
                    request = popitem(last=False)[0]
                    request.state = _RUNNING
                    batch.append(request)
                    items.append(request.item)
                return batch, items
            pop = queue.pop_oldest
            batch = [pop() for _ in range(n)]
        items = []
        for request in batch:
            request.state = _RUNNING
            items.append(request.item)
        return batch, items

    def _form(self, size: int, now: float) -> list[_Request]:
        queue = self.queue
        limit = size if self.size_fn is None else _NEVER
        budget = self.max_cost
        batch: list[_Request] = []
        late: list[_Request] = []
        total: float = 0
        for request in queue.ordered(now - self.promote_after):
            if request.drop_at <= now:
                late.append(request)
                continue
            if len(batch) >= limit:
                break
            cost = request.cost
            if total + cost > budget:
                if not batch:
                    batch.append(request)  # oversized, allowed: a batch of its own
                break
            batch.append(request)
            total += cost
        for request in late:
            self.drop(request)
        if self.size_fn is not None and batch:
            batch = self._fit_size(batch, size)
        if self.preferred and len(batch) >= self.preferred[0]:
            batch = batch[: max(p for p in self.preferred if p <= len(batch))]
        for request in batch:
            queue.remove(request)
            if request.drop_timer is not None:
                request.drop_timer.cancel()
        return batch

    def _fit_size(self, batch: list[_Request], size: int) -> list[_Request]:
        """The longest head of ``batch`` that ``batch_size_fn`` measures at most ``size``.

        Sizes grow with the items (a sum, a padded length), so the cut is found by bisection.
        A call that raises is retried item by item, and the item whose addition raised fails
        its caller alone. A first request that alone exceeds ``size`` (it fit when submitted,
        under a larger ``max_batch_size`` or a size that changed) is refused here as when
        submitted, or runs alone with ``allow_oversized``.
        """
        items = [request.item for request in batch]
        try:
            if self.size_of(items) <= size:
                return batch
            fits, too_big = 0, len(items)
            while too_big - fits > 1:
                middle = (fits + too_big) // 2
                if self.size_of(items[:middle]) <= size:
                    fits = middle
                else:
                    too_big = middle
        except Exception:
            pass
        else:
            if fits or self.allow_oversized:
                return batch[: fits or 1]
            culprit = batch[0]
            self.queue.remove(culprit)
            self.fail(culprit, self._refusal(
                f"size of item (by batch_size_fn) is greater than max_batch_size={size}"
            ))  # fmt: skip
            return []  # the dispatcher forms the next batch from the rest
        for n in range(1, len(items) + 1):
            try:
                self.size_of(items[:n])
            except Exception as exc:
                culprit = batch[n - 1]
                self.queue.remove(culprit)
                self.fail(culprit, exc)
                return self._fit_size(batch[: n - 1], size) if n > 1 else []
        return self._fit_size(batch[:1], size)  # the sizes raise no more

