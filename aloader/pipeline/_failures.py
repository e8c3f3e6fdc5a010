"""The failure budget: how many samples an epoch may lose to errors before it fails.

``DataLoader(max_failures=...)``: an int is a count per epoch, a float in (0, 1) a fraction of
the epoch's samples. With a budget, a sample whose fetch raises is left out of its batch (the
batch is shorter; a batch that loses every sample is skipped), counted, and logged (rate
limited, to ``aloader.loader``); once more samples failed than the budget allows, the epoch
fails with :class:`~aloader.FailureBudgetExceeded`, whose ``__cause__`` is the last error. The
default 0 keeps torch's behaviour: the first error is raised with its own type.

Invariant: every sample of the epoch is either delivered in its batch or recorded here (its
index in :attr:`Failures.indices`), never both, never neither; what is recorded is only what
raised. :class:`Failures` is the one place that counts and decides; the pipeline asks it
(:meth:`Failures.record`) for each failed sample. It is thread-safe: fetch threads record too.

Where a sample's error is seen:

* map-style, item by item (async datasets, ``max_concurrency``): the item's fetch;
* map-style, a batch per call (``__getitems__``, or a plain batch fetch): a failing call is
  retried item by item (``__getitems__([i])``, or ``dataset[i]``) to find the bad samples;
* iterable datasets: a ``__next__`` that raises is counted (its index is the sample's number
  in the epoch) and pulling goes on. A generator cannot go on after raising: its error is
  raised as is (a stream built of generators, too: let its sources skip malformed records
  with ``skip_errors=True``, which the budget then counts);
* streaming sources with ``skip_errors=True``: each record they skip counts against the
  budget, as a failed sample with index None (the source's own ``stats.skipped`` counts it
  too). Without a budget they skip as before and nothing is counted here. A fraction without
  a length applies to the records they read, skipped ones included (they read ahead of the
  samples pulled, and a skipped record was attempted, as a failed fetch is);
* worker processes: a worker applies the same rules with an unlimited budget of its own and
  reports what failed with each answer; the loader records it here, so the budget is the
  epoch's across all workers.

Checkpoints (:meth:`DataLoader.state_dict`): the state's ``"failures"`` entry holds the
failures the budget absorbed so far in the epoch, ``{"count": N, "indices": [...]}`` (JSON
builtins: ints, or the dataset's own JSON-able indices; tuples become lists), including those
of batches fetched ahead of the consumer. A resumed epoch's budget starts from that count and
those indices (:meth:`Failures.restore`), and a sample of the remaining batches whose index is
among them is left out of its batch without fetching it (:class:`KnownFailed`) and without
counting it again: it was counted when it failed. With a sampler that draws each index at most
once an epoch, the resumed epoch then delivers and counts exactly as the uninterrupted one (an
index drawn twice, by a sampler with replacement, is left out and counted once). The failure
that exceeded the budget is not recorded: a resumed epoch fetches it again, and fails there as
the uninterrupted one did. Iterable datasets record the count only (their indices are sample
numbers, not something a resumed replica could leave out): ``indices`` is empty.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._exceptions import FailureBudgetExceeded
from .._log import RateLimited, brief, loader_log

if TYPE_CHECKING:
    from .._epoch_setup import EpochSetup
    from .._stats import Collector

__all__ = (
    "KEEP_ERRORS",
    "KNOWN_FAILED",
    "Failures",
    "KnownFailed",
    "check_max_failures",
    "is_skip_key",
    "json_index",
    "resumable",
    "skip_key",
)

# Errors kept on a FailureBudgetExceeded besides its cause (the count is exact regardless).
KEEP_ERRORS = 16


def check_max_failures(value: object) -> int | float:
    """The ``max_failures`` argument, checked: an int >= 0 or a float in (0, 1).

    Raises:
        TypeError: neither an int nor a float (bools are refused too).
        ValueError: a negative int, or a float outside (0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            "max_failures should be an int (a count of samples per epoch) or a float in (0, 1) "
            f"(a fraction of the epoch's samples), but got max_failures={value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(
                f"max_failures should be a non-negative integer, but got max_failures={value!r}"
            )
        return value
    if not 0 < value < 1:
        raise ValueError(
            "max_failures as a float is a fraction of the epoch's samples and should be in "
            f"(0, 1), but got max_failures={value!r}"
        )
    return value


class _KnownFailedKey:
    """The type of :data:`KNOWN_FAILED` (pickled by reference: a worker sees the same one)."""

    def __reduce__(self) -> str:
        return "KNOWN_FAILED"

    def __repr__(self) -> str:
        return "KNOWN_FAILED"


#: The key of a job whose every sample failed before a resume: it publishes NO_BATCH unfetched
#: (it keeps its place, and its batch number, as the uninterrupted epoch's skipped batch).
KNOWN_FAILED: Any = _KnownFailedKey()

#: A sample whose fetch failed within the budget, in its job's samples until the job collates:
#: left out of the batch.
_FAILED: Any = object()


def json_index(index: Any) -> Any:
    """A failed sample's index as JSON builtins, for a checkpoint (tuples become lists;
    numpy integers become ints).

    Raises:
        ValueError: the index is of a type JSON cannot hold (named in the message).
    """
    if index is None or isinstance(index, (bool, int, float, str)):
        return int(index) if isinstance(index, int) and not isinstance(index, bool) else index
    if isinstance(index, (list, tuple)):
        return [json_index(item) for item in index]
    if isinstance(index, dict) and all(isinstance(key, str) for key in index):
        return {key: json_index(item) for key, item in index.items()}
    item = getattr(index, "item", None)  # a numpy scalar
    if callable(item) and getattr(index, "ndim", None) == 0:
        value = item()
        if isinstance(value, (bool, int, float, str)):
            return value
    raise ValueError(
        f"cannot record the failed sample index {index!r} in the state: its type "
        f"{type(index).__name__} is not JSON-serialisable (a checkpoint holds JSON builtins: "
        "int, float, str, bool, None, lists and str-keyed dicts of them)"
    )


def skip_key(error: BaseException) -> list[Any] | None:
    """Where a source skipped a malformed record, as a failure's index: ``["skipped", shard,
    offset]`` (the record's shard and byte offset), or None where the error does not say.

    A checkpoint of an iterable epoch keeps these (its only indices): a resumed epoch reads
    again what its sources had read ahead of the consumer, and a record skipped there before
    the checkpoint, counted then, is not counted twice.
    """
    source, offset = getattr(error, "source", None), getattr(error, "offset", None)
    if isinstance(source, str) and isinstance(offset, int) and not isinstance(offset, bool):
        return ["skipped", source, offset]
    return None


def is_skip_key(index: Any) -> bool:
    """Whether a failure's index is a :func:`skip_key`."""
    return (isinstance(index, (list, tuple)) and len(index) == 3 and index[0] == "skipped"
            and isinstance(index[1], str) and isinstance(index[2], int))


def _hashable(index: Any) -> Any:
    """``index`` comparable with its JSON form (lists and tuples alike, dicts by items)."""
    if isinstance(index, (list, tuple)):
        return tuple(_hashable(item) for item in index)
    if isinstance(index, dict):
        return tuple(sorted((key, _hashable(item)) for key, item in index.items()))
    try:
        hash(index)
    except TypeError:
        return repr(index)
    return index


class KnownFailed:
    """The indices that failed before a resume: the remaining keys leave them out.

    Args:
        indices: the failed indices, as a checkpoint holds them.
        auto_batch: whether keys are index batches (else single indices).
    """

    def __init__(self, indices: list[Any], auto_batch: bool) -> None:
        self._known = {_hashable(index) for index in indices}
        self._auto_batch = auto_batch

    def key(self, key: Any) -> Any:
        """``key`` without the known failed indices; :data:`KNOWN_FAILED` when none is left."""
        known = self._known
        if not self._auto_batch:
            return KNOWN_FAILED if _hashable(key) in known else key
        items = key.tolist() if hasattr(key, "tolist") else list(key)
        keep = [_hashable(index) not in known for index in items]
        if all(keep):
            return key
        if not any(keep):
            return KNOWN_FAILED
        if hasattr(key, "tolist"):  # an index array stays one
            return key[keep]
        return [index for index, kept in zip(items, keep, strict=True) if kept]

    def keys(self, keys: Any) -> Any:
        """The keys of a sync or async iterator, filtered by :meth:`key`."""
        if hasattr(keys, "__anext__"):
            return self._akeys(keys)
        return map(self.key, keys)

    async def _akeys(self, keys: Any) -> Any:
        async for key in keys:
            yield self.key(key)


def resumable(source: object) -> bool:
    """Whether an iterator can still be pulled from after its ``__next__`` raised.

    A generator (sync or async) is finished once it raised, and a stream's iterator ends at
    its first error: pulling on would end the epoch early without a word. Any other iterator
    is taken at its word: it raised for one sample and goes on.
    """
    if getattr(source, "_take", None) is not None:
        return False
    for frame in ("gi_frame", "ag_frame"):
        if hasattr(source, frame):
            return getattr(source, frame) is not None
    return True


class Failures:
    """One epoch's failed samples against its budget (see the module docstring).

    Args:
        budget: the checked ``max_failures`` (> 0), or ``math.inf`` (a worker's: it never
            fails, it reports).
        samples: the epoch's samples, when known (a fraction's base); None: the fraction
            applies to the samples attempted so far (:meth:`attempted`), once they number at
            least ``1 / fraction``.
        sources_of: finds the counters of a dataset's streams, whose skipped records count
            against the budget (:meth:`watch_sources`); None: no source is watched.
        stats: the epoch's statistics, which count the failures too (None: a worker's budget,
            which reports them instead).
    """

    def __init__(self, budget: int | float, samples: int | None = None, *,
                 sources_of: Callable[[object], list[Any]] | None = None,
                 stats: Collector | None = None) -> None:
        self.budget: int | float = budget
        self.samples = samples
        self.count: int = 0
        self.indices: list[Any] = []  # the failed samples' indices, in the order they failed
        self.errors: deque[BaseException] = deque(maxlen=KEEP_ERRORS)
        self.first: BaseException | None = None  # the epoch's first failure (this process's)
        self.seen: int = 0  # samples attempted (iterable epochs without a length)
        self.absorbed: int = 0  # the failures recorded before the budget was exceeded
        self._lock = threading.Lock()
        self._log = RateLimited(loader_log)
        self._exceeded: FailureBudgetExceeded | None = None
        # A worker's failures since its last answer: (index, error).
        self.unreported: list[tuple[Any, BaseException]] = []
        self._reported_seen = 0
        self.sources_of = sources_of
        self.stats = stats
        self._sources: list[Any] = []  # the streams' SourceStats whose skips count here
        self._skipped = 0
        # The records the watched sources read, skipped ones included, at the last check: a
        # skipped record is a sample attempted, as a failed fetch is, and the sources read
        # ahead of the samples pulled (so their skips are compared with what they read).
        self._read = 0
        self._read_before = 0  # what they had read before this epoch
        # Records the sources skipped before a checkpoint this epoch resumes (skip_key):
        # counted then, and not again when read again.
        self._counted_skips: set[tuple[Any, ...]] = set()

    @classmethod
    def for_epoch(cls, setup: EpochSetup, stats: Collector) -> Failures:
        """The budget of the epoch ``setup`` describes (which has one: ``max_failures``),
        counting into ``stats``, and going on from the failures of the checkpoint it
        resumes, if any."""
        failures = cls(setup.max_failures, setup.samples, sources_of=setup.sources_of,
                       stats=stats)
        if setup.resumed_failures is not None:
            failures.restore(*setup.resumed_failures)
        return failures

    @property
    def limit(self) -> float:
        """The failures allowed now: the count, or the fraction of the samples (rounded down;
        of the samples attempted so far once they number ``1 / fraction``, else no limit)."""
        return self._limit(final=False)

    def _limit(self, final: bool) -> float:
        budget = self.budget
        if isinstance(budget, int) or math.isinf(budget):
            return budget
        base = self.samples if self.samples is not None else self.tried
        if self.samples is None and not final and base < 1 / budget:
            return math.inf
        return math.floor(budget * base)

    @property
    def tried(self) -> int:
        """The samples attempted so far: pulled, or read by the watched sources (skipped
        records included), whichever is more."""
        return max(self.seen, self._read)

    def attempted(self, count: int) -> None:
        """``count`` more samples were attempted (for a fraction without a known length)."""
        self.seen += count

    def record(self, index: Any, error: BaseException) -> None:
        """Count sample ``index`` as failed with ``error``.

        Raises:
            FailureBudgetExceeded: the failures now exceed the budget (from ``error``); also
                for any failure after that, which is not counted: the epoch's count stays
                the one its error names (``stats().failures`` agrees with it).
        """
        with self._lock:
            if self._exceeded is not None:  # a fetch in flight when the budget ran out
                raise self._exceeded
            if self._counted_skips and is_skip_key(index):
                key = tuple(index)
                if key in self._counted_skips:
                    self._counted_skips.discard(key)  # counted before the checkpoint
                    return
            if self.first is None:
                self.first = error
            self.count += 1
            count = self.count
            if self.stats is not None:
                self.stats.failed = count
            if math.isinf(self.budget):  # a worker's: the loader keeps the record
                self.unreported.append((index, error))
            else:
                self.indices.append(index)
                self.errors.append(error)
            exceeded = self._exceeded is None and count > self.limit
            if self._exceeded is None and not exceeded:
                self.absorbed = count
        self._log.log(logging.WARNING, "skipped sample %r: %s", index, brief(error),
                      summary="skipped %(count)d more samples; the last: %(last)s")
        if exceeded:
            self._exceeded = self._exceed(error)
            loader_log.error("%s (%s)", self._exceeded, self._firsts())
        if self._exceeded is not None:
            raise self._exceeded

    def _allowed(self) -> str:
        """The budget, as messages name it."""
        budget = self.budget
        if isinstance(budget, float) and not math.isinf(budget):
            base = (f"the {self.tried} samples attempted" if self.samples is None
                    else f"{self.samples} samples")
            return f"max_failures={budget!r}: {self._limit(final=True):g} of {base}"
        return f"max_failures={budget}"

    def _firsts(self) -> str:
        """``the first: ...; the last: ...``, the epoch's first and last errors."""
        last = brief(self.errors[-1]) if self.errors else "unknown"
        first = brief(self.first) if self.first is not None else "before the resume"
        return f"the first: {first}; the last: {last}"

    def _exceed(self, error: BaseException) -> FailureBudgetExceeded:
        budget = self.budget
        allowed = self._allowed()
        exc = FailureBudgetExceeded(
            f"{self.count} samples failed in this epoch, more than the failure budget "
            f"({allowed}); the last error is the cause, the last {KEEP_ERRORS} are in .errors",
            count=self.count, budget=budget, errors=list(self.errors),
            indices=list(self.indices),
        )
        exc.__cause__ = error
        return exc

    def state(self, with_indices: bool) -> dict[str, Any]:
        """The ``"failures"`` entry of a checkpoint: the failures absorbed so far (see the
        module docstring), with their indices when ``with_indices`` (map-style).

        Raises:
            ValueError: an index JSON cannot hold.
        """
        with self._lock:
            count = self.absorbed
            # An iterable epoch's: where its sources skipped records (see skip_key).
            indices = self.indices[:count] if with_indices else [
                index for index in self.indices[:count] if is_skip_key(index)]
        return {"count": count, "indices": [json_index(index) for index in indices]}

    def restore(self, count: int, indices: Iterable[Any]) -> None:
        """Start from a checkpoint's failures: ``count`` absorbed, ``indices`` among them
        (a source's skipped records among them are not counted again when read again)."""
        self.count = self.absorbed = count
        self.indices = list(indices)
        self._counted_skips = {tuple(index) for index in indices if is_skip_key(index)}
        if self.stats is not None:
            self.stats.failed = count

    def finish(self) -> None:
        """The epoch has ended: a fraction of samples only known now may be exceeded; else,
        with failures, a summary is logged (the rate-limited log of each failure may have
        left most of them unsaid): their count, the budget, the first and last errors.

        Raises:
            FailureBudgetExceeded: the failures exceed the budget.
        """
        with self._lock:
            exceeded = self._exceeded is None and self.count > self._limit(final=True)
        if exceeded and self.errors:
            self._exceeded = self._exceed(self.errors[-1])
            loader_log.error("%s (%s)", self._exceeded, self._firsts())
            raise self._exceeded
        if self.count and self._exceeded is None:
            loader_log.warning("the epoch ended with %d failed sample%s, within the failure "
                               "budget (%s); %s", self.count, "s" if self.count > 1 else "",
                               self._allowed(), self._firsts())

    def watch_sources(self, dataset: object) -> None:
        """From now on, count the records that ``dataset``'s sources skip (``skip_errors``).

        The loader sets :attr:`sources_of` (:func:`aloader.streams._sourcestats.source_stats`,
        which this module cannot import: the streams import the pipeline, which imports this).
        """
        if self.sources_of is None:
            return
        self._sources = self.sources_of(dataset)
        self._skipped = sum(stats.skipped for stats in self._sources)
        self._read_before = self._skipped + sum(stats.records for stats in self._sources)

    def check_skipped(self) -> None:
        """Record the records the watched sources skipped since the last check.

        Raises:
            FailureBudgetExceeded: as :meth:`record`.
        """
        if not self._sources:
            return
        skipped = sum(stats.skipped for stats in self._sources)
        self._read = (sum(stats.records for stats in self._sources) + skipped
                      - self._read_before)
        new, self._skipped = skipped - self._skipped, skipped
        if new <= 0:
            return
        errors: list[BaseException] = []
        for stats in self._sources:
            errors.extend(stats.skipped_errors)
        errors = errors[-new:]
        for _ in range(new - len(errors)):  # older than the errors a source keeps
            self.record(None, RuntimeError("a source skipped a malformed record"))
        for error in errors:
            self.record(skip_key(error), error)

    def take_unreported(self) -> tuple[list[tuple[Any, BaseException]], int] | None:
        """A worker's failures and samples attempted since the last call (for its next
        answer), or None when there were neither."""
        seen = self.tried - self._reported_seen
        if not self.unreported and not seen:
            return None
        with self._lock:
            out, self.unreported = self.unreported, []
        self._reported_seen += seen
        return out, seen

    def __getstate__(self) -> dict[str, Any]:  # a plan's travels to the workers: a fresh one
        return {"budget": self.budget, "samples": self.samples, "sources_of": self.sources_of}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["budget"], state["samples"], sources_of=state["sources_of"])
