"""A DataLoader's checkpoints: the state :meth:`DataLoader.state_dict` returns, checked and
applied by :meth:`DataLoader.load_state_dict`, and the record of the latest epoch a state is
made from.

Invariant: a state is JSON builtins only (``json`` and ``pickle`` take it), never sample data;
loading checks everything before it applies anything, so a rejected state leaves the loader
as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from .._tuning import Controller
from ..data._distributed import default_place
from ..data._random import restore_rng, rng_state
from ..pipeline._failures import Failures, is_skip_key, json_index
from ..streams._stream import Stream
from ..workers._rngs import check_rngs, rngs_to_json
from ._epochs import AlreadyDelivered, MapEpochs, Progress, StateTypeError

if TYPE_CHECKING:
    from ._dataloader import DataLoader

__all__ = ("STATE_FORMAT", "STATE_VERSION", "load_state", "place_of", "state_of")

STATE_FORMAT = "aloader.DataLoader"
STATE_VERSION = 1


def _json_copy(value: Any) -> Any:
    """A copy of a state made of JSON builtins (tuples become lists)."""
    if isinstance(value, dict):
        return {key: _json_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        # A torch generator's state is 5056 ints: copied at C speed.
        if value and type(value[0]) is int and type(value[-1]) is int:
            return list(value)
        return [_json_copy(item) for item in value]
    return value


def place_of(loader: DataLoader[Any]) -> tuple[int, int]:
    """``(rank, world_size)`` of ``loader``'s share of the data: those its data is split for
    (its ``DistributedSampler``'s, its sharded stream's: a data-parallel group of a larger
    job has its own), else torch.distributed's initialized process group's, else
    ``RANK``/``WORLD_SIZE`` (torchrun's), else ``(0, 1)``."""
    kind = getattr(loader, "_kind", None)
    sampler = kind._distributed() if isinstance(kind, MapEpochs) else None
    if sampler is not None:
        return sampler.rank, sampler.num_replicas
    dataset = loader.dataset
    worlds = dataset._worlds() if isinstance(dataset, Stream) else []
    if worlds:
        return worlds[0][0], worlds[0][1]
    return default_place(None, None)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(eq=False)
class _EpochRecord:
    """What a checkpoint says about the latest epoch: what it was drawn from and what the
    consumer received of it. The loader keeps it (not the epoch's iterator, which must stay
    droppable); the iterator updates it as it hands out batches.

    Invariant: ``prefix`` is the number of batches from the epoch's start all received, and
    ``beyond`` holds the numbers of those received after it; ``yielded`` is their total.
    """

    epoch: int
    rng: dict[str, Any]  # the loader generator's state before this epoch drew anything
    base_seed: int | None  # the epoch's base seed when not drawn (persistent workers' one)
    length: int | None  # the epoch's batches (map-style), or None
    skip: AlreadyDelivered  # what a resumed epoch leaves out
    prefix: int = 0
    beyond: set[int] = field(default_factory=set)
    yielded: int = 0
    meta: Any = None  # the metadata of the latest batch received (iterable datasets)
    done: bool = False  # the iterator reached the end of the epoch
    # Called once the epoch has ended for its consumer (see finish()).
    on_done: Callable[[int], None] | None = None
    failures: Failures | None = None  # the epoch's failure budget (None without max_failures)

    def __post_init__(self) -> None:
        self.prefix = self.skip.prefix
        self.beyond = set(self.skip.delivered)
        self.yielded = self.prefix + len(self.beyond)

    def received(self, number: int, meta: Any = None) -> None:
        self.yielded += 1
        self.meta = meta
        if number != self.prefix:
            self.beyond.add(number)
            return
        prefix = number + 1
        beyond = self.beyond
        while prefix in beyond:
            beyond.discard(prefix)
            prefix += 1
        self.prefix = prefix

    def finish(self) -> None:
        """The consumer reached the epoch's end."""
        if not self.done:
            self.done = True
            if self.on_done is not None:
                self.on_done(self.epoch)

    @property
    def at_end(self) -> bool:
        """The epoch has ended (its iterator said so): a state is the next epoch's start.
        After its last batch and before that, a state is this epoch's empty rest, as
        torchdata's: a loop that saves the loader's state with its epoch number inside the
        epoch resumes that epoch, not the next one."""
        return self.done


def kind_name(dataloader: DataLoader[Any]) -> str:
    return "map" if isinstance(dataloader._kind, MapEpochs) else "iterable"


def dataset_length(dataloader: DataLoader[Any]) -> int | None:
    try:
        return len(dataloader.dataset)
    except TypeError:
        return None


def state_of(dataloader: DataLoader[Any]) -> dict[str, Any]:
    """``dataloader.state_dict()`` (see :meth:`DataLoader.state_dict`)."""
    pending = dataloader._resume_state
    if pending is not None:
        return cast(dict[str, Any], _json_copy(pending))
    record = dataloader._record
    if record is None or record.at_end:
        pool = dataloader._pool
        seed = dataloader._resume_seed
        if pool is not None and pool.persistent and not (pool.closed or pool.broken):
            seed = int(pool.setup.base_seed)
        epoch = dataloader._epochs_started if record is None else record.epoch + 1
        progress = Progress(epoch, 0, frozenset(), None, True)
        rng: dict[str, Any] = rng_state(dataloader._rng)
    else:
        seed = record.base_seed
        progress = Progress(record.epoch, record.yielded, frozenset(record.beyond),
                            record.meta, False)
        rng = cast(dict[str, Any], _json_copy(record.rng))
    failures: dict[str, Any] = {"count": 0, "indices": []}
    if record is not None and not record.at_end and record.failures is not None:
        failures = record.failures.state(with_indices=isinstance(dataloader._kind, MapEpochs))
    kind = kind_name(dataloader)
    if isinstance(dataloader._kind, MapEpochs):
        sub = dataloader._kind.state_dict(progress)
    else:
        sub = cast(Any, dataloader._kind).state_dict(progress)
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "kind": kind,
        "rank": list(place_of(dataloader)),  # which part of a job's data (merge_rank_states)
        "epoch": progress.epoch,
        "yielded": progress.yielded,
        "loader": {
            "rng": rng,
            "base_seed": seed,
            "sample_seed": dataloader.sample_seed,
            "batch_size": dataloader.batch_size,
            "drop_last": dataloader.drop_last,
            "dataset_length": dataset_length(dataloader),
        },
        kind: _json_copy(sub),
        "failures": failures,
        "concurrency": _tuning_state(dataloader),
        **_workers_entry(dataloader, record is None or record.at_end),
    }


def _workers_entry(dataloader: DataLoader[Any], between: bool) -> dict[str, Any]:
    """Between epochs of live persistent workers, each one's global generators as the next
    epoch will find them (``{"workers": {"num_workers": W, "rngs": [...]}}``, see
    :mod:`aloader.workers._rngs`); else nothing."""
    pool = dataloader._pool
    if not between or pool is None or not pool.persistent or pool.closed or pool.broken \
            or any(rng is None for rng in pool.rngs):
        return {}
    return {"workers": {"num_workers": pool.num_workers,
                        "rngs": [rngs_to_json(rng) for rng in pool.rngs]}}


def _tuning_state(dataloader: DataLoader[Any]) -> dict[str, Any] | None:
    """``"auto"`` concurrency's controller state (None without it): this process's, or with
    worker processes the one a worker reported last."""
    if dataloader._tuner_state is not None:
        return dict(dataloader._tuner_state)
    tuner = dataloader._tuner
    if tuner is None:
        return None
    stats = dataloader._stats
    reported = None if stats is None else stats.last_worker_tuning()
    if reported is not None:
        tuner.load_state_dict(reported)
    return tuner.state_dict()


def _load_tuning(dataloader: DataLoader[Any], state: dict[str, Any] | None) -> None:
    """A checkpoint's controller state (checked): the next epoch starts from it (the
    controller's, or the one the next epoch's plan makes: see
    :func:`~aloader.loader._start.fetch_plan`)."""
    if state is None or dataloader.max_concurrency != "auto":
        return
    if dataloader._tuner is not None:
        dataloader._tuner.load_state_dict(state)
    else:
        dataloader._tuner_state = state


def _entry(entry: Any, name: str) -> Mapping[str, Any] | None:
    """A state's optional entry ``name``: None when absent, else a dict (a StateTypeError)."""
    if entry is not None and not isinstance(entry, Mapping):
        raise StateTypeError(f"state field {name!r} should be a dict, "
                             f"but got {type(entry).__name__}")
    return entry


def _check_workers(dataloader: DataLoader[Any], entry: Any) -> list[Any] | None:
    """A state's ``"workers"`` entry, checked: the generators to give the next persistent
    workers, or None (none saved, or this loader's workers are not as many persistent ones:
    they start as seeded)."""
    entry = _entry(entry, "workers")
    if entry is None:
        return None
    count, rngs = entry.get("num_workers"), entry.get("rngs")
    if not (_is_int(count) and count > 0):
        raise StateTypeError(f"state field 'workers.num_workers' should be a positive int, "
                             f"but got {count!r}")
    if not isinstance(rngs, list) or len(rngs) != count:
        raise ValueError(f"state field 'workers.rngs' should list {count} workers' "
                         f"generators, but is {type(rngs).__name__}")
    for rng in rngs:
        check_rngs(rng, "workers.rngs")
    if not dataloader.persistent_workers or dataloader.num_workers != count:
        return None
    return list(rngs)


def load_state(dataloader: DataLoader[Any], state: Mapping[str, Any]) -> None:
    """``dataloader.load_state_dict(state)`` (see :meth:`DataLoader.load_state_dict`):
    everything is checked before anything is applied."""
    if not isinstance(state, Mapping):
        raise StateTypeError(f"state should be a dict, but got {type(state).__name__}")
    kind = kind_name(dataloader)
    expected = {"format": STATE_FORMAT, "version": STATE_VERSION, "kind": kind}
    for name, value in expected.items():
        if state.get(name) != value:
            raise ValueError(f"state field {name!r} differs: the state has "
                             f"{state.get(name)!r}, this loader expects {value!r}")
    for name in ("epoch", "yielded"):
        if name not in state:
            raise ValueError(f"state field {name!r} is missing")
        value = state.get(name)
        if not _is_int(value):
            raise StateTypeError(f"state field {name!r} should be an int, but got {value!r}")
        if value < 0:
            raise ValueError(f"state field {name!r} should be non-negative, "
                             f"but got {value}")
    if "loader" not in state:
        raise ValueError("state field 'loader' is missing")
    loader = state.get("loader")
    if not isinstance(loader, Mapping):
        raise StateTypeError(f"state field 'loader' should be a dict, "
                        f"but got {type(loader).__name__}")
    mine = {"batch_size": dataloader.batch_size, "drop_last": dataloader.drop_last,
            "dataset_length": dataset_length(dataloader)}
    for name, value in mine.items():
        if name not in loader:
            raise ValueError(f"state field 'loader.{name}' is missing")
        if loader[name] != value or type(loader[name]) is not type(value):
            raise ValueError(f"state field 'loader.{name}' differs: the state has "
                             f"{loader[name]!r}, this loader has {value!r}")
    seed = loader.get("base_seed")
    if seed is not None and not (_is_int(seed) and seed >= 0):
        raise StateTypeError(f"state field 'loader.base_seed' should be None or a "
                        f"non-negative int, but got {seed!r}")
    sample_seed = loader.get("sample_seed")
    if not (_is_int(sample_seed) and sample_seed >= 0):
        raise StateTypeError(f"state field 'loader.sample_seed' should be a non-negative int, "
                        f"but got {sample_seed!r}")
    try:
        restore_rng(dataloader._rng, loader.get("rng"), apply=False)
    except ValueError as exc:
        raise ValueError(f"state field 'loader.rng': {exc}") from None
    failed = _check_failures(dataloader, state.get("failures"))
    tuning = state.get("concurrency")
    if tuning is not None:
        try:
            Controller().load_state_dict(tuning)
        except ValueError as exc:
            raise ValueError(f"state field 'concurrency': {exc}") from None
    rngs = _check_workers(dataloader, state.get("workers"))
    if kind not in state:
        raise ValueError(f"state field {kind!r} is missing")
    sub = _json_copy(state[kind])
    skip: AlreadyDelivered | None = None
    if isinstance(dataloader._kind, MapEpochs):
        if isinstance(sub, dict):
            delivered = sub.get("delivered")
            prefix = sub.get("prefix")
            if (_is_int(prefix) and isinstance(delivered, list)
                    and prefix + len(delivered) != state["yielded"]):
                raise ValueError(
                    f"state field 'yielded' ({state['yielded']}) differs from the map "
                    f"part's prefix and delivered batches ({prefix} + {len(delivered)})"
                )
        # Checks all of its part before applying any.
        dataloader._kind.load_state_dict(sub, dataloader.num_workers)
        skip = dataloader._kind.loaded_skip
    else:
        dataloader._kind.load_state_dict(sub, dataloader.num_workers,
                                         dataloader.persistent_workers)
        # The batches already received: the resumed epoch's count goes on from them.
        skip = AlreadyDelivered(state["yielded"])
    # Everything is checked: apply. Live persistent workers have the old seeds.
    if dataloader._pool is not None:
        dataloader._pool.shutdown()
        dataloader._pool = None
    restore_rng(dataloader._rng, loader["rng"])
    dataloader.sample_seed = sample_seed
    dataloader._resume_seed = seed
    dataloader._epochs_started = state["epoch"]
    dataloader._resume_skip = skip
    dataloader._resume_failures = failed
    dataloader._resume_rngs = rngs
    dataloader._record = None
    _load_tuning(dataloader, None if tuning is None else _json_copy(dict(tuning)))
    copy = cast(dict[str, Any], _json_copy(dict(state)))
    dataloader._resume_state = copy


def _check_failures(dataloader: DataLoader[Any], failures: Any) -> tuple[int, list[Any]] | None:
    """A state's ``"failures"`` entry, checked: (count, indices), or None when there is
    nothing to restore (none recorded, or this loader has no budget: its epochs raise the
    first error, as torch's do). A state without the entry recorded none."""
    failures = _entry(failures, "failures")
    if failures is None:
        return None
    count, indices = failures.get("count"), failures.get("indices")
    if not (_is_int(count) and count >= 0):
        raise StateTypeError(f"state field 'failures.count' should be a non-negative int, "
                        f"but got {count!r}")
    if not isinstance(indices, list):
        raise StateTypeError(f"state field 'failures.indices' should be a list, "
                        f"but got {type(indices).__name__}")
    for index in indices:
        try:
            if json_index(index) != index or isinstance(index, tuple):
                raise ValueError(f"{index!r} is not in its JSON form")
        except ValueError as exc:
            raise StateTypeError(f"state field 'failures.indices' should hold JSON "
                                 f"builtins: {exc}") from None
    if len(indices) > count:
        raise ValueError(f"state field 'failures.indices' has {len(indices)} indices, "
                         f"more than 'failures.count' ({count})")
    if not isinstance(dataloader._kind, MapEpochs) and not all(map(is_skip_key, indices)):
        raise ValueError("state field 'failures.indices' of an iterable dataset should hold "
                         "only the records its sources skipped (['skipped', shard, offset]), "
                         f"but has {indices!r}")
    if not dataloader.max_failures or not count:
        return None
    return count, list(indices)
