"""Collate: turn a list of samples into one batch (numpy in, numpy out; torch in, torch out).

This is ``torch.utils.data._utils.collate`` for numpy: the same lookup order, the same
container rebuilding and the same error messages, but leaves become numpy arrays instead of
tensors. torch is never imported here; torch is reached through ``sys.modules`` (tensors exist
only if torch is imported already).

Invariant: the mode is decided once per batch, from the first sample. A batch whose first
sample holds a torch tensor anywhere in its structure is collated in *torch mode*, with
torch's own leaf functions (every number and numpy array becomes a tensor), so the batch is
exactly what ``torch.utils.data.default_collate`` gives; any other batch is collated in *numpy
mode*, where leaves become numpy arrays with the dtypes torch would give its tensors.
"""

from __future__ import annotations

import copy
import importlib
import numbers
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from operator import itemgetter
from typing import Any, overload

import numpy as np

__all__ = (
    "ColumnBatch",
    "CollateFnMap",
    "collate",
    "collate_float_fn",
    "collate_int_fn",
    "collate_numpy_array_fn",
    "collate_numpy_scalar_fn",
    "collate_str_fn",
    "collate_tensor_fn",
    "default_collate",
    "default_collate_err_msg_format",
    "default_collate_fn_map",
    "default_convert",
)


class ColumnBatch(Sequence[tuple[Any, ...]]):
    """A batch of samples stored column-wise, as vectorised ``__getitems__`` produce it.

    Sample ``i`` is ``tuple(column[i] for column in columns)``, so code that reads the batch as
    a sequence of samples works unchanged, while :func:`default_collate` returns the columns
    without unstacking and restacking them. It is no ``list``: a loader's ``collate_fn`` other
    than ``default_collate`` is given ``list(batch)``, as torch's loader gives it a list.
    """

    __slots__ = ("columns",)
    columns: tuple[Any, ...]

    def __init__(self, columns: Sequence[Any]) -> None:
        if not columns:
            raise ValueError("ColumnBatch needs at least one column")
        self.columns = tuple(columns)

    def __len__(self) -> int:
        return len(self.columns[0])

    @overload
    def __getitem__(self, index: int) -> tuple[Any, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> ColumnBatch: ...
    def __getitem__(self, index: int | slice) -> tuple[Any, ...] | ColumnBatch:
        if isinstance(index, slice):
            return ColumnBatch([column[index] for column in self.columns])
        return tuple(column[index] for column in self.columns)

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return zip(*self.columns, strict=True)

    def __repr__(self) -> str:
        return f"ColumnBatch(len={len(self)}, columns={len(self.columns)})"


CollateFnMap = dict[type | tuple[type, ...], Callable[..., Any]]

default_collate_err_msg_format = (
    "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"
)

# The dtype kinds torch's np_str_obj_array_pattern ("[SaUO]" searched in dtype.str) refuses:
# bytes, unicode and object.
_STR_OBJ_KINDS = frozenset("SUO")
# Kinds whose rows are numpy scalars that default_collate turns back into the same array.
_NUMERIC_KINDS = frozenset("biufc")


class _TorchTensorMeta(type):
    """Makes ``isinstance(x, _TorchTensor)`` mean "x is a torch.Tensor", without importing torch."""

    def __instancecheck__(cls, instance: object) -> bool:
        torch = sys.modules.get("torch")
        # A half-imported torch may lack Tensor yet; nothing can be a tensor then.
        tensor = getattr(torch, "Tensor", None)
        return tensor is not None and isinstance(instance, tensor)

    def __repr__(cls) -> str:
        return "<torch.Tensor, matched once torch is imported>"


class _TorchTensor(metaclass=_TorchTensorMeta):
    """Stand-in key for ``torch.Tensor`` in :data:`default_collate_fn_map` (never instantiated)."""


def collate(batch: Any, *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Collate a batch of samples, dispatching on the type of the first one (torch's ``collate``).

    The collate function for the first element is looked up by exact type in
    ``collate_fn_map``, then by ``isinstance`` over its keys in insertion order; each is called
    as ``fn(batch, collate_fn_map=collate_fn_map)``. Without a match, mappings are collated per
    key (same mapping type when it can be rebuilt), namedtuples per field (same type) and other
    sequences per position (a list for tuples, else the same sequence type when it can be
    rebuilt).

    A :class:`ColumnBatch` collated with the default map gives the list of columns directly:
    numeric and bool ndarray columns are returned as they are, other columns are collated.

    Args:
        batch: a sequence of samples, all of the same structure.
        collate_fn_map: element type (or tuple of types) -> collate function.

    Returns:
        The collated batch.

    Raises:
        TypeError: when no entry of ``collate_fn_map`` nor the container rules match.
        RuntimeError: when sequences in the batch differ in length.
    """
    # A list (what a loader collates, nearly always) is no ColumnBatch: ruled out before the
    # ABC's isinstance check, a Python-level call per batch.
    if type(batch) is not list and isinstance(batch, ColumnBatch) and collate_fn_map is not None:
        # Only under the untouched default rules (numpy's or torch's) may columns pass as is.
        tensor = None
        if collate_fn_map == _DEFAULT_ENTRIES or (
            (tensor := _tensor_type()) is not None
            and collate_fn_map == _torch_map(_DEFAULT_ENTRIES)
        ):
            columns = _collate_columns(batch, collate_fn_map, tensor)
            if columns is not None:
                return columns

    elem = batch[0]
    elem_type = type(elem)

    if collate_fn_map is not None:
        fn = collate_fn_map.get(elem_type)
        if fn is not None:
            return fn(batch, collate_fn_map=collate_fn_map)
        for collate_type, fn in collate_fn_map.items():
            if isinstance(elem, collate_type):
                return fn(batch, collate_fn_map=collate_fn_map)

    if isinstance(elem, Mapping):
        values = {
            key: collate(list(map(itemgetter(key), batch)), collate_fn_map=collate_fn_map)
            for key in elem
        }
        return _rebuild_mapping(elem, values)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
        return elem_type(
            *(
                collate(samples, collate_fn_map=collate_fn_map)
                for samples in zip(*batch, strict=False)
            )
        )
    if isinstance(elem, Sequence):
        if len(set(map(len, batch))) != 1:
            raise RuntimeError("each element in list of batch should be of equal size")
        collated = [
            collate(samples, collate_fn_map=collate_fn_map) for samples in zip(*batch, strict=False)
        ]
        return _rebuild_sequence(elem, collated)

    raise TypeError(default_collate_err_msg_format.format(elem_type))


def default_collate(batch: Any) -> Any:
    """Stack a batch of samples into numpy arrays (or tensors), keeping the samples' structure.

    **Torch mode**: when the first sample holds a torch tensor anywhere in its structure, the
    whole batch is collated as ``torch.utils.data.default_collate`` collates it, with torch's
    own leaf functions: tensors are stacked, numpy arrays and scalars become tensors, ``int`` an
    int64 tensor, ``float`` a float64 tensor, ``bool`` a bool tensor, in every nested mapping,
    namedtuple and sequence. So ``(tensor, int)`` samples give ``[tensor, int64 tensor]``, as
    torch's losses expect. (Entries a user added to or replaced in
    :data:`default_collate_fn_map` are kept in both modes.)

    **Numpy mode** (any other batch; torch is not needed): numpy's counterpart of torch's
    function, giving numpy arrays of the dtypes torch gives its tensors:

    * ndarray -> ``np.stack`` of the batch (dtype kept, several dtypes promoted as
      ``torch.stack`` promotes them; string, bytes and object dtypes refused);
    * numpy scalar -> array of that dtype; ``float`` -> float64, ``int`` -> int64 and ``bool``
      -> bool arrays;
    * a batch mixing number types (python and numpy scalars) is promoted as ``torch.tensor``
      promotes it (a 0-d array counting as a number of its dtype): left to right, python
      ``bool``/``int``/``float``/``complex`` counting as
      bool/int64/float32/complex64 (torch's default dtypes); a higher kind wins (bool < integer
      < floating < complex) and keeps its own precision (int64 with float32 gives float32, a
      python float with ``np.float16`` float32, ``[True, np.uint8(200)]`` uint8), equal kinds
      promote as numpy does (``uint8`` with ``int8`` gives int16); mixing uint16/32/64 with
      another integer or complex type raises torch's RuntimeError. When the first element is
      a python float the batch is float64, as in torch;
    * ``str`` / ``bytes`` -> the batch unchanged;
    * mapping -> mapping of collated values; namedtuple -> namedtuple of collated fields;
      other sequences -> collated positions (a list for tuples).

    Differences from torch in numpy mode, besides giving numpy arrays: python floats count as
    float32 even if ``torch.set_default_dtype`` changed torch's default; ``np.bool_`` mixed with
    integers gives integers (torch raises TypeError); a numpy complex after a python float is a
    TypeError (torch drops its imaginary part); uint64 and longdouble scalars and arrays are
    collated (torch refuses them), and arrays of several dtypes that numpy stacks in the first
    one's dtype are not checked further (``[int64 array, uint16 array]`` gives int64; torch
    refuses mixing uint16/32/64), while the others get ``torch.stack``'s dtype (int32 with
    float32 gives float32); no shared memory is used in workers. The mode is decided
    by the first sample, but a batch numpy mode refuses whose tensors first appear in a later
    sample (``[1, tensor(2)]``, a dataset returning tensors for some indices) is collated in
    torch mode, as torch collates it.

    Extend it by adding entries to :data:`default_collate_fn_map`.

    Args:
        batch: a sequence of samples, all of the same structure.

    Returns:
        The collated batch.

    Raises:
        TypeError: for an unsupported element type or a string/object array.
        RuntimeError: for arrays of different shapes or sequences of different lengths.
    """
    collate_fn_map = _map_for(batch)
    try:
        return collate(batch, collate_fn_map=collate_fn_map)
    except Exception:
        # Looked for only now: a batch numpy mode collates costs no pass over its samples.
        tensor = _tensor_type()
        if (collate_fn_map is not default_collate_fn_map or tensor is None
                or not any(_holds(sample, tensor) for sample in batch)):
            raise
    # Outside the except clause, so that torch's error is raised without numpy mode's.
    return collate(batch, collate_fn_map=_torch_map(default_collate_fn_map))


def default_convert(data: Any) -> Any:
    """Convert one sample the way ``torch.utils.data.default_convert`` does.

    When the sample holds a torch tensor anywhere, it is torch's ``default_convert`` itself:
    numpy arrays and scalars become tensors too. Otherwise numpy arrays and scalars stay as
    they are (torch would turn them into tensors); mappings, namedtuples and sequences are
    rebuilt with their items converted (tuples become lists), anything else is returned
    unchanged. Used when automatic batching is off.

    Args:
        data: a single sample.

    Returns:
        The converted sample.
    """
    tensor = _tensor_type()
    if tensor is not None and _holds(data, tensor):
        return importlib.import_module("torch.utils.data").default_convert(data)
    return _convert(data)


def _convert(data: Any) -> Any:
    if isinstance(data, (np.ndarray, np.generic)):
        return data
    if isinstance(data, Mapping):
        return _rebuild_mapping(data, {key: _convert(data[key]) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_convert(d) for d in data))
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return _rebuild_sequence(data, [_convert(d) for d in data])
    return data


def _tensor_type() -> type | None:
    """``torch.Tensor`` if torch is imported, else None (then no data can hold a tensor)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return tensor if isinstance(tensor, type) else None


def _holds(data: Any, tensor: type) -> bool:
    """Whether ``data`` is, or its mappings and sequences contain, an instance of ``tensor``."""
    if isinstance(data, tensor):
        return True
    if isinstance(data, (str, bytes, np.ndarray, np.generic, numbers.Number)):
        return False
    if isinstance(data, Mapping):
        return any(_holds(value, tensor) for value in data.values())
    if isinstance(data, Sequence):
        return any(_holds(item, tensor) for item in data)
    return False


def _map_for(batch: Any) -> CollateFnMap:
    """The map for ``batch``: torch's leaves if its first sample holds a tensor, else numpy's."""
    tensor = _tensor_type()
    if tensor is None or not _holds(batch[0], tensor):
        return default_collate_fn_map
    return _torch_map(default_collate_fn_map)


# torch's leaf functions for the keys whose default aloader replaces with a numpy one.
_TORCH_LEAVES: dict[Any, str] = {}
_torch_leaf_fns: dict[Any, Callable[..., Any]] | None = None


def _torch_map(entries: CollateFnMap) -> CollateFnMap:
    """``entries`` with each of aloader's numpy leaf functions replaced by torch's own."""
    global _torch_leaf_fns
    if _torch_leaf_fns is None:
        module = importlib.import_module("torch.utils.data._utils.collate")
        _torch_leaf_fns = {key: getattr(module, name) for key, name in _TORCH_LEAVES.items()}
    return {
        key: _torch_leaf_fns.get(key, fn) if _DEFAULT_ENTRIES.get(key) is fn else fn
        for key, fn in entries.items()
    }


def _rebuild_mapping(elem: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """Give ``values`` the mapping type of ``elem`` when torch would manage to, else a dict."""
    try:
        if isinstance(elem, MutableMapping):
            # The mapping type may carry extra state (defaultdict's factory): copy, then update.
            clone = copy.copy(elem)
            clone.update(values)
            return clone
        return type(elem)(values)  # type: ignore[call-arg]
    except TypeError:
        # No copy() / update(mapping) / __init__(mapping) for this type.
        return values


def _rebuild_sequence(elem: Sequence[Any], values: list[Any]) -> Any:
    """Give ``values`` the sequence type of ``elem`` like torch: tuples give lists."""
    if type(elem) is list or isinstance(elem, tuple):
        return values
    try:
        if isinstance(elem, MutableSequence):
            clone = copy.copy(elem)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(elem)(values)  # type: ignore[call-arg]
    except TypeError:
        # No copy() / __setitem__ / __init__(iterable) for this type (e.g. range).
        return values


def _collate_columns(
    batch: ColumnBatch, collate_fn_map: CollateFnMap, tensor: type | None
) -> list[Any] | None:
    """The columns of ``batch`` as default_collate would give them; None for the row-wise path.

    Under numpy's rules (``tensor`` None) numeric ndarray columns are already their stacked
    rows; under torch's (``tensor`` is ``torch.Tensor``) dense tensor columns are.
    """
    n = len(batch)
    columns = batch.columns
    if n == 0 or any(len(column) != n for column in columns):
        return None  # let the row-wise path raise its own error
    return [
        column
        if _is_stacked(column, tensor)
        # The row-wise path hands each column over as the tuple zip() makes.
        else collate(tuple(column), collate_fn_map=collate_fn_map)
        for column in columns
    ]


def _is_stacked(column: Any, tensor: type | None) -> bool:
    """Whether ``column`` equals the stack of its rows under numpy's or torch's rules."""
    if tensor is None:
        return type(column) is np.ndarray and column.dtype.kind in _NUMERIC_KINDS
    if not isinstance(column, tensor):
        return False
    dense: Any = column  # a torch.Tensor, typed without torch
    return not dense.is_nested and dense.layout is sys.modules["torch"].strided


def collate_tensor_fn(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Stack torch tensors with ``torch.stack`` (torch's ``collate_tensor_fn``).

    Unlike torch, no shared-memory output is allocated inside worker processes.

    Args:
        batch: torch tensors of equal shape.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A tensor with a new leading batch dimension.

    Raises:
        RuntimeError: for nested or sparse tensors, or tensors of different shapes.
    """
    torch = sys.modules["torch"]
    elem = batch[0]
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout in {
        torch.sparse_coo,
        torch.sparse_csr,
        torch.sparse_bsr,
        torch.sparse_csc,
        torch.sparse_bsc,
    }:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    return torch.stack(batch, 0)


def collate_numpy_array_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> np.ndarray[Any, Any]:
    """Stack numpy arrays along a new first axis, keeping their dtype (torch.stack's promotion
    for arrays of several dtypes).

    Args:
        batch: numpy arrays of equal shape.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        The stacked array (always a new plain ndarray).

    Raises:
        TypeError: for string, bytes or object arrays.
        RuntimeError: for arrays of different shapes, naming both shapes and their positions;
            for None (or another object torch infers no dtype for) beside 0-d arrays.
    """
    elem = batch[0]
    if elem.dtype.kind in _STR_OBJ_KINDS:
        raise TypeError(default_collate_err_msg_format.format(elem.dtype))
    try:
        # np.array equals np.stack on plain ndarrays and is several times faster on small ones;
        # subclasses (masked arrays...) keep np.stack's own handling.
        out = np.array(batch) if type(elem) is np.ndarray else np.stack(batch)
    except ValueError as exc:
        mismatch = _shape_mismatch(batch)
        if mismatch is None:
            raise
        raise mismatch from exc
    if out.dtype.kind in _STR_OBJ_KINDS:
        # A later element promoted the batch to strings or objects: torch's as_tensor of an
        # object that is no array, number or string (None...) is its RuntimeError.
        odd = [v for v in batch if not isinstance(v, np.ndarray)]
        if odd and type(odd[0]) is int:  # beyond int64, where torch's as_tensor overflows
            raise ValueError("Overflow when unpacking long long")
        if odd and _cannot_infer(odd[0]):
            raise _non_number_error(odd[0])
        raise TypeError(default_collate_err_msg_format.format(_first_str_obj_dtype(batch, out)))
    if out.dtype != elem.dtype:
        # Arrays of several dtypes. numpy widens across kinds (int32 with float32 is float64)
        # where torch.stack keeps the higher kind's own dtype (float32); when numpy's result
        # is the first array's dtype, torch's is too (same kind, or the first is the higher).
        dtype = _stacked_dtype(batch)
        if dtype is not None and dtype != out.dtype:
            # Cast each array once, as torch does, not through numpy's wider dtype.
            out = np.stack(batch, dtype=dtype, casting="unsafe")
    return out


def _stacked_dtype(batch: Sequence[Any]) -> np.dtype[Any] | None:
    """The dtype ``torch.stack`` gives arrays of these dtypes (None: a kind torch lacks).

    A number after the first array (a python float beside a 0-d array) counts as the tensor
    torch's ``as_tensor`` makes of it: of its default dtype (float32 for a float)."""
    result: np.dtype[Any] | None = None
    dtypes = (value.dtype if isinstance(value, np.ndarray) else _number_dtype(value)
              for value in batch)
    for dtype in dict.fromkeys(dtypes):
        if dtype is None or dtype.kind not in _NUMERIC_KINDS:
            return None
        result = dtype if result is None else _promote(result, dtype, tensors=True)
    return result


def collate_numpy_scalar_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> np.ndarray[Any, Any]:
    """Gather numpy scalars into a 1-D array of their dtype (``torch.as_tensor(batch)``).

    Scalars of several types (numpy's or python's) are promoted as torch promotes them; see
    :func:`default_collate`.

    Args:
        batch: numpy scalars (bool, number or object), possibly mixed with python numbers.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        The array of the scalars.

    Raises:
        TypeError: for a string, sequence or array among the numbers.
        RuntimeError: for a promotion torch refuses (uint16/32/64 with another integer type),
            or an element torch infers no dtype for (None, a dict: torch's message).
        ValueError: for a python int outside the int64 range in an integer batch.
    """
    if len(set(map(type, batch))) > 1:
        return _gather_numbers(batch)
    out = np.array(batch)
    if out.dtype.kind in _STR_OBJ_KINDS:
        raise TypeError(default_collate_err_msg_format.format(_first_non_number(batch)))
    return out


def collate_float_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> np.ndarray[Any, Any]:
    """Gather python floats into a float64 array (torch: ``torch.tensor(batch, dtype=float64)``).

    Args:
        batch: real numbers, the first a python float.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        A float64 array.

    Raises:
        TypeError: for an element that is not a real number.
    """
    out: np.ndarray[Any, Any] | None
    try:
        out = np.array(batch)
    except ValueError:  # a list or an array among the floats: torch's TypeError, below
        out = None
    if out is None or out.dtype.kind not in "biuf":
        bad = _first_non_number(batch, numbers.Real)
        if bad is not None:
            raise TypeError(default_collate_err_msg_format.format(bad))
        out = np.array([float(b) for b in batch])  # ints too large for int64
    return out.astype(np.float64, copy=False)


def collate_int_fn(
    batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None
) -> np.ndarray[Any, Any]:
    """Gather python ints into an int64 array (bools into a bool array), like ``torch.tensor``.

    A batch mixing number types is promoted as ``torch.tensor`` promotes it (python ints and
    floats give float32); see :func:`default_collate`.

    Args:
        batch: numbers, the first a python int or bool.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        An int64, bool or (mixed with other numbers) promoted array.

    Raises:
        ValueError: for an int outside the int64 range (torch's message).
        TypeError: for a string, sequence or array among the numbers.
        RuntimeError: for a promotion torch refuses (uint16/32/64 with another integer type),
            or an element torch infers no dtype for (None, a dict: torch's message).
    """
    # Only python ints, the common batch (labels), checked at C speed: a list's count
    # compares by identity first, where a set of the types hashed each one (~60k
    # instructions for 256 ints, against ~44k).
    types = _JUST_INT if list(map(type, batch)).count(int) == len(batch) else set(
        map(type, batch))
    if not types <= _INT_TYPES:
        return _gather_numbers(batch)
    if types == _JUST_INT:
        # Only python ints: fromiter gives the int64 array np.array would, without np.array's
        # dtype discovery pass (~40% fewer instructions per element); an int beyond int64
        # raises OverflowError where np.array would have given a uint64 or object array.
        try:
            return np.fromiter(batch, _INT64, len(batch))
        except OverflowError:
            pass
        raise ValueError("Overflow when unpacking long long")
    out = np.array(batch)
    kind = out.dtype.kind
    if kind == "i":
        return out.astype(np.int64, copy=False)
    if kind == "b":
        return out
    raise ValueError("Overflow when unpacking long long")


# What torch.tensor infers for python numbers: its default dtypes.
_PYTHON_DTYPES: dict[type, np.dtype[Any]] = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float32),
    complex: np.dtype(np.complex64),
}
_INT_TYPES = frozenset((int, bool))
_JUST_INT = frozenset((int,))
_INT64 = np.dtype(np.int64)
# bool < integer < floating < complex: the higher kind wins a promotion.
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
# The unsigned types torch promotes only to floating types.
_BAREBONES_UNSIGNED = frozenset(np.dtype(d) for d in (np.uint16, np.uint32, np.uint64))
_TORCH_NAMES = {
    np.dtype(d): name
    for d, name in (
        (np.bool_, "Bool"), (np.uint8, "Byte"), (np.int8, "Char"), (np.int16, "Short"),
        (np.int32, "Int"), (np.int64, "Long"), (np.uint16, "UInt16"), (np.uint32, "UInt32"),
        (np.uint64, "UInt64"), (np.float16, "Half"), (np.float32, "Float"),
        (np.float64, "Double"), (np.complex64, "ComplexFloat"), (np.complex128, "ComplexDouble"),
    )
}


def _number_dtype(value: Any) -> np.dtype[Any] | None:
    """The dtype torch infers for one number, or None for anything else."""
    dtype = _PYTHON_DTYPES.get(type(value))
    if dtype is not None:
        return dtype
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        # torch.tensor takes a 0-d array (np.mean's result) for a number of its dtype.
        return value.dtype if value.dtype.kind in _NUMERIC_KINDS else None
    for kind, dtype in _PYTHON_DTYPES.items():  # subclasses (IntEnum...), most specific first
        if isinstance(value, kind):
            return dtype
    return None


def _promote(a: np.dtype[Any], b: np.dtype[Any], *, tensors: bool = False) -> np.dtype[Any]:
    """torch's ``promoteTypes(a, b)`` on numpy dtypes: for scalars gathered by ``torch.tensor``,
    or (``tensors``) for tensors stacked by ``torch.stack``."""
    if a == b:
        return a
    if a in _BAREBONES_UNSIGNED or b in _BAREBONES_UNSIGNED:
        # torch's scalar inference keeps a complex128 it already holds (order-dependent);
        # torch.stack refuses it.
        if a.kind == "f" or (a == np.complex128 and not tensors):
            return a
        if b.kind == "f":
            return b
        raise RuntimeError(
            "Promotion for uint16, uint32, uint64 types is not supported, attempted to promote "
            f"{_TORCH_NAMES.get(a, a)} and {_TORCH_NAMES.get(b, b)}"
        )
    rank_a, rank_b = _KIND_RANK[a.kind], _KIND_RANK[b.kind]
    # A higher kind keeps its precision, except that complex takes a float's.
    if rank_a != rank_b and not (min(rank_a, rank_b) == 2 and max(rank_a, rank_b) == 3):
        return a if rank_a > rank_b else b
    return np.promote_types(a, b)


def _gather_numbers(batch: Sequence[Any]) -> np.ndarray[Any, Any]:
    """A batch of mixed python and numpy numbers as one array of torch's promoted dtype."""
    result: np.dtype[Any] | None = None
    for value in batch:
        dtype = _number_dtype(value)
        if dtype is None:
            raise _non_number_error(value)
        result = dtype if result is None else _promote(result, dtype)
    try:
        return np.array(batch, dtype=result)
    except OverflowError:  # a python int beyond the integer dtype
        raise ValueError("Overflow when unpacking long long") from None


def collate_str_fn(batch: Sequence[Any], *, collate_fn_map: CollateFnMap | None = None) -> Any:
    """Return a batch of strings or bytes unchanged.

    Args:
        batch: strings or bytes.
        collate_fn_map: unused; part of the collate-function signature.

    Returns:
        ``batch`` itself.
    """
    return batch


def _shape_of(value: Any) -> tuple[int, ...] | None:
    try:
        shape: tuple[int, ...] = np.shape(value)
        return shape
    except ValueError:  # a ragged nested list has no shape
        return None


def _shape_mismatch(batch: Sequence[Any]) -> RuntimeError | None:
    """torch.stack's error for the first element whose shape differs from the first one's."""
    first = _shape_of(batch[0])
    for i, value in enumerate(batch):
        shape = _shape_of(value)
        if shape != first:
            return RuntimeError(
                f"stack expects each array to be equal size, but got {first} at entry 0 "
                f"and {shape} at entry {i}"
            )
    return None


def _first_str_obj_dtype(batch: Sequence[Any], out: np.ndarray[Any, Any]) -> np.dtype[Any]:
    """The dtype of the first string/object element, to name it rather than the promoted one."""
    dtypes = (np.asarray(value).dtype for value in batch)
    return next((dtype for dtype in dtypes if dtype.kind in _STR_OBJ_KINDS), out.dtype)


def _cannot_infer(value: Any) -> bool:
    """Whether ``torch.tensor`` finds no dtype for ``value`` (its RuntimeError), as it does for
    None, mappings and other objects; strings, sequences, numpy values and tensors are not."""
    return not isinstance(value, (str, bytes, Sequence, np.ndarray, np.generic, _TorchTensor))


def _non_number_error(value: Any) -> Exception:
    """The error for ``value`` among a batch's numbers: torch's "Could not infer dtype of ..."
    RuntimeError where torch's tensor constructor raises it (a label that is sometimes None),
    else the TypeError naming its type."""
    if not _cannot_infer(value):
        return TypeError(default_collate_err_msg_format.format(type(value)))
    cls = type(value)
    # torch names the type by its C name: a class of Python code or a builtin by its name
    # alone, an extension type with its module ("decimal.Decimal").
    name = cls.__name__
    if not cls.__flags__ & _HEAP_TYPE and cls.__module__ != "builtins":
        name = f"{cls.__module__}.{name}"
    return RuntimeError(f"Could not infer dtype of {name}")


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: the class was made at run time (class statement)


def _first_non_number(batch: Sequence[Any], kind: type = numbers.Number) -> type | None:
    """The type of the first element that is not a ``kind`` number, or None."""
    return next((type(b) for b in batch if not isinstance(b, kind)), None)


# Same keys in the same order as torch's map, so isinstance lookups resolve alike.
default_collate_fn_map: CollateFnMap = {
    _TorchTensor: collate_tensor_fn,
    # ndarray and its subclasses (memmap...).
    np.ndarray: collate_numpy_array_fn,
    # numpy's scalar hierarchy minus the string scalars, which fall through to str / bytes.
    (np.bool_, np.number, np.object_): collate_numpy_scalar_fn,
    float: collate_float_fn,
    int: collate_int_fn,
    str: collate_str_fn,
    bytes: collate_str_fn,
}
# The untouched default map: a ColumnBatch takes the column fast path only under these rules.
_DEFAULT_ENTRIES: CollateFnMap = dict(default_collate_fn_map)
_TORCH_LEAVES.update(
    {
        np.ndarray: "collate_numpy_array_fn",
        (np.bool_, np.number, np.object_): "collate_numpy_scalar_fn",
        float: "collate_float_fn",
        int: "collate_int_fn",
    }
)
