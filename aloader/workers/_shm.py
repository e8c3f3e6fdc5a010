"""The shared-memory transport between the loader and its worker processes.

A message is pickled with protocol 5. Every buffer of at least ``threshold`` bytes that the
pickler hands out of band (numpy arrays do, and so do CPU torch tensors here) is written into
one file under ``/dev/shm``, and so is the pickle stream itself when it is large; only a small
header crosses the pipe. The receiver maps the file and unpickles arrays that view the mapping,
so a batch is copied once (into the file, by the worker) and never pickled as bytes.

Segments are named ``aloader-{ns}.{pid}.{token}-{creator}-{random}``. The first part is the
owner's tag (:func:`owner`): ``pid`` runs the DataLoader, ``ns`` names its pid namespace
(containers may share ``/dev/shm``) and ``token`` is drawn at random once per process, so no
other process, even one that had the same pid, shares the prefix. ``creator`` tags who wrote the
file (a worker's pid, or the loader's pool) and ``random`` is drawn for each segment: names are
unpredictable, and one that exists already (``O_EXCL`` fails) is retried with another.
There are two kinds:

* one-shot segments, unlinked by the receiver as soon as it has opened them;
* recycled segments (batches from workers): allocating and freeing tmpfs pages costs several
  times the copy itself, so the receiver reports a segment once the last array viewing it is
  gone (:func:`decode`'s ``on_release``), the loader hands the name back with the worker's next
  task, and the worker writes its next batch into the same pages (:meth:`Codec.release`).

A segment outlives its use only when a process dies; :func:`sweep` removes those by the owner's
prefix (the loader's pool after a worker stops or dies, a worker whose loader died, the loader at
interpreter exit), which only this owner's processes write, and :func:`sweep_stale` removes the
segments of owners proven gone: same pid namespace, no such process, the file ours. Mappings
hold no file descriptor, however many batches the consumer keeps. These files are plain
``os.open`` files, not :mod:`multiprocessing.shared_memory` blocks, so that no resource tracker
unlinks or warns about segments that changed hands.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import ctypes
import errno
import io
import mmap
import os
import pickle
import secrets
import stat
import struct
import sys
import tempfile
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

__all__ = ("SHM_DIR", "Codec", "SharedTensorError", "decode", "owner", "prefix",
           "process_prefix", "sweep", "sweep_stale")

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _pid_namespace() -> str:
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return "0"


_NAME = f"aloader-{_pid_namespace()}."
# Tries at a fresh name when the one drawn exists (a collision, or a file planted there).
_NAME_TRIES = 16
# Buffers at least this large travel through shared memory; smaller ones ride in the pickle.
THRESHOLD = 64 * 1024
# Pickle streams larger than this go to shared memory too, so pipe messages stay small.
INLINE_LIMIT = 256 * 1024
_ALIGN = 64

_INLINE = 0  # flag byte: the pickle follows, no segment
_ONE_SHOT = 1  # a segment the receiver unlinks once opened
_RECYCLED = 2  # a segment the receiver reports back once released
_HEAD = struct.Struct("!BHI")  # flag, length of the segment name, number of table entries

_warned_full = False
# Held while a segment is being written: a worker whose loader died takes it for good before
# sweeping, so that no segment appears after the sweep.
WRITE_LOCK = threading.Lock()


_owner: str | None = None


def _after_fork() -> None:
    global WRITE_LOCK, _owner
    WRITE_LOCK = threading.Lock()  # another thread may have held it when this process forked
    _owner = None  # a forked child is another owner


os.register_at_fork(after_in_child=_after_fork)


def _token() -> str:
    return secrets.token_hex(8)


def owner() -> str:
    """This process's owner tag, ``{ns}.{pid}.{token}``: the names of the segments of its
    loaders start with it, and no other process's do."""
    global _owner
    if _owner is None:
        _owner = f"{_NAME[len('aloader-'):]}{os.getpid()}.{_token()}"
    return _owner


def prefix(owner: str, creator: int | str | None = None) -> str:
    """The name prefix of the segments of ``owner``'s loaders (written by ``creator``)."""
    if creator is None:
        return f"aloader-{owner}-"
    return f"aloader-{owner}-{creator}-"


def process_prefix(pid: int) -> str:
    """The name prefix of the segments of the loaders of process ``pid`` (this namespace)."""
    return f"{_NAME}{pid}."


def _unlink(name: str) -> None:
    # Gone already (another process swept it first), or someone else's file.
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(SHM_DIR, name))


def sweep(name_prefix: str) -> None:
    """Unlink every segment whose name starts with ``name_prefix``."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(name_prefix):
            _unlink(name)


def sweep_stale() -> None:
    """Unlink the segments of loaders whose process is gone (all of them were killed).

    A segment goes only when that is proven: its name has this pid namespace (a pid means
    nothing in another one), no process has that pid (one that does may have reused it: the
    segment stays), and the file is a regular file of this user (never another's, never a link).
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    alive: dict[int, bool] = {}
    uid = os.getuid()
    for name in names:
        if not name.startswith(_NAME):
            continue
        pid_text, dot, _ = name[len(_NAME) :].partition(".")
        if not (dot and pid_text.isdigit()):
            continue
        pid = int(pid_text)
        if pid not in alive:
            try:
                os.kill(pid, 0)
                alive[pid] = True
            except ProcessLookupError:
                alive[pid] = False
            except OSError:  # someone else's process: alive
                alive[pid] = True
        if alive[pid]:
            continue
        try:
            info = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
            _unlink(name)


def _tensor_from_numpy(array: Any, dtype: str | None = None) -> Any:
    import torch

    tensor = torch.from_numpy(array)
    return tensor if dtype is None else tensor.view(getattr(torch, dtype))


# numpy's dtype of each itemsize, to carry the bits of a tensor whose dtype numpy lacks.
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.complex128}


# The dtypes whose tensors torch's own pickle writes and cannot load back (its legacy storage
# format has no such dtype): never left to it.
_UNLOADABLE = ("uint16", "uint32", "uint64", "complex32", "float8_e4m3fn", "float8_e5m2",
               "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _unloadable(tensor: Any) -> bool:
    """Whether torch's own pickle of ``tensor`` cannot be loaded back (its dtype)."""
    return str(tensor.dtype).removeprefix("torch.") in _UNLOADABLE


def _reduce_tensor(obj: Any) -> Any:
    """A contiguous CPU tensor as a numpy array, so that its data goes out of band too.

    A dtype numpy lacks (bfloat16, float8, complex32) travels as the integers of its bits and
    is viewed back. A non-contiguous tensor goes through torch's pickle (which keeps its
    strides), except one of a dtype that pickle cannot load (``_UNLOADABLE``): it travels
    contiguous, its values the same; so does a conjugate or negative view of such a dtype,
    its bit resolved.
    """
    torch = sys.modules["torch"]
    if (
        type(obj) is torch.Tensor
        and obj.device.type == "cpu"
        and obj.layout == torch.strided
        and not obj.requires_grad
    ):
        if not obj.is_contiguous():
            if not _unloadable(obj):
                return NotImplemented
            obj = obj.contiguous()
        try:
            return _tensor_from_numpy, (obj.numpy(),)
        except TypeError:  # "Got unsupported ScalarType": a dtype numpy lacks
            bits = _BITS.get(obj.element_size())
            if bits is None:
                return NotImplemented
            view = obj.view(getattr(torch, np.dtype(bits).name)).numpy()
            return _tensor_from_numpy, (view, str(obj.dtype).removeprefix("torch."))
        except RuntimeError:  # a conjugate or negative bit set: torch's pickle keeps it...
            if not _unloadable(obj):
                return NotImplemented
            # ... but cannot load these dtypes back: the values travel, the bit resolved.
            return _reduce_tensor(obj.resolve_conj().resolve_neg())
    return NotImplemented


def _array_from(buffer: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """An array from its bytes, as numpy's own pickle rebuilds a C-ordered one
    (``numpy._core.numeric._frombuffer``): the same values, dtype, shape and writeability."""
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


# dtype kinds whose string (``dtype.str``: "<f8", "|b1", "<U10") names the dtype and whose
# arrays export a buffer; datetimes, structured, sub-array, object and user dtypes go
# through numpy's own reduction.
_PLAIN_KINDS = frozenset("biufcSU")


def _reduce_array(array: Any) -> Any:
    """A plain C-ordered array reduced to its buffer, dtype string and shape. numpy's own
    reduction pickles the dtype object (a class looked up by name, its arguments and state)
    and calls a Python function per array to rebuild it: of a collated batch's pickle, its
    few arrays cost more than its hundreds of strings, on both sides."""
    dtype = array.dtype
    if (dtype.kind in _PLAIN_KINDS and dtype.names is None and dtype.subdtype is None
            and dtype.metadata is None and dtype.itemsize and array.flags.c_contiguous):
        return _array_from, (pickle.PickleBuffer(array), dtype.str, array.shape)
    return array.__reduce_ex__(5)


class _Pickler(pickle.Pickler):
    """Protocol 5 with plain numpy arrays reduced by :func:`_reduce_array`; every other
    type as ``pickle.dumps`` reduces it (``copyreg``'s table behind this one)."""

    dispatch_table: Any = collections.ChainMap(  # noqa: RUF012 - read by the C pickler, never changed
        {np.ndarray: _reduce_array}, copyreg.dispatch_table)


class SharedTensorError(TypeError):
    """A tensor in shared memory (``share_memory_()``) met by a codec that refuses them: its
    copy in a worker would not see the other processes' writes, nor they its own."""


def _reduce_unshared_tensor(obj: Any) -> Any:
    """:func:`_reduce_tensor`, raising :class:`SharedTensorError` at a tensor in shared memory."""
    if isinstance(obj, sys.modules["torch"].Tensor) and obj.is_shared():
        raise SharedTensorError(
            f"a tensor in shared memory ({obj.dtype}, shape {tuple(obj.shape)}) would be copied")
    return _reduce_tensor(obj)


def _by_value_pickler() -> type[pickle.Pickler]:
    """cloudpickle's pickler, keeping the file name of the code it ships by value.

    cloudpickle names every such code object's file ``<dynamic-code>`` (for payloads that do
    not depend on where the code lives); a worker's traceback through a class or function of
    the user's script would then show no file and no source line, where torch's (forked)
    workers show both. The line numbers travel either way."""
    import cloudpickle
    from cloudpickle import cloudpickle as internals

    code_reduce = internals._code_reduce

    def reduce_code(code: types.CodeType) -> Any:
        rebuild, args = code_reduce(code)
        at = args.index("<dynamic-code>")  # co_filename's place, whatever the Python version
        return rebuild, (*args[:at], code.co_filename, *args[at + 1:])

    class Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
        dispatch_table = collections.ChainMap(  # noqa: RUF012 - read by the C pickler
            {types.CodeType: reduce_code}, cloudpickle.CloudPickler.dispatch_table)

    return Pickler


_TensorReducer = Callable[[Any], Any]
_picklers: dict[tuple[_TensorReducer | None, bool], type[pickle.Pickler]] = {}


def _pickler(reduce_tensor: _TensorReducer | None, by_value: bool) -> type[pickle.Pickler]:
    """The pickler class for a codec: :class:`_Pickler`, or cloudpickle's with ``by_value``
    (what is not importable by name, such as a lambda, a local function or anything defined
    in ``__main__``, goes by value); with ``reduce_tensor``, each object is offered to it
    first (CPU tensors as numpy arrays, :func:`_reduce_tensor`). Made once per kind."""
    key = (reduce_tensor, by_value)
    pickler = _picklers.get(key)
    if pickler is None:
        pickler = _by_value_pickler() if by_value else _Pickler
        if reduce_tensor is not None:
            reduce, base = reduce_tensor, pickler
            # cloudpickle's own reducer_override handles what the tensor reducer passes up.
            fallback = getattr(base, "reducer_override", None)

            class _TensorPickler(base):  # type: ignore[valid-type, misc]
                def reducer_override(self, obj: Any) -> Any:
                    reduced = reduce(obj)
                    if reduced is NotImplemented and fallback is not None:
                        return fallback(self, obj)
                    return reduced

            pickler = _TensorPickler
        _picklers[key] = pickler
    return pickler


ByValue = Literal["never", "fallback", "always"]


class Codec:
    """Encodes messages for one writer: names its segments, and recycles them if asked to.

    Args:
        owner: pid of the process that runs the DataLoader.
        creator: tag of the writer (a worker's pid, or the loader pool's tag).
        threshold: buffers at least this large go to shared memory.
        inline_limit: pickle streams larger than this go to shared memory.
        tensors: send CPU torch tensors out of band (costs a call per pickled object).
        shared_tensors: with ``tensors``, whether a tensor in shared memory may be copied;
            when not, :meth:`encode` raises :class:`SharedTensorError` at one.
        recycle: how many released segments to keep for reuse (0: one-shot segments).
    """

    def __init__(
        self,
        owner: str,
        creator: int | str,
        *,
        threshold: int = THRESHOLD,
        inline_limit: int = INLINE_LIMIT,
        tensors: bool = False,
        shared_tensors: bool = True,
        recycle: int = 0,
    ) -> None:
        self.prefix = prefix(owner, creator)
        self.threshold = threshold
        self.inline_limit = inline_limit
        self.tensors = tensors
        self.shared_tensors = shared_tensors
        self.recycle = recycle
        self.last_segment: str | None = None  # name of the latest segment written
        self._free: list[str] = []  # released segments, the most recent last

    def release(self, names: list[str]) -> None:
        """The receiver no longer maps these segments: reuse them, unlink the surplus."""
        self._free += names
        while len(self._free) > self.recycle:
            _unlink(self._free.pop(0))

    def encode(self, obj: Any, *, by_value: ByValue = "never") -> bytes:
        """Pickle ``obj`` into a pipe message, its large buffers into a segment.

        ``by_value`` says when cloudpickle pickles what is not importable by name by value:
        ``"never"``, ``"always"``, or ``"fallback"`` when the plain pickle fails (so that
        what is importable resolves, on the other side, to that side's own object).

        When shared memory is full the message falls back to an in-band pickle (and warns
        once), so a small ``/dev/shm`` slows loading down rather than failing it.
        """
        by_value_now = by_value == "always"
        try:
            data, out_of_band = self._dumps(obj, by_value_now, self.threshold)
        except Exception:
            if by_value != "fallback":
                raise
            by_value_now = True
            data, out_of_band = self._dumps(obj, by_value_now, self.threshold)
        if not out_of_band and len(data) <= self.inline_limit:
            return bytes((_INLINE,)) + data
        try:
            return self._write(data, out_of_band)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            _warn_full(exc)
            return bytes((_INLINE,)) + self._dumps(obj, by_value_now, None)[0]

    def _dumps(
        self, obj: Any, by_value: bool, threshold: int | None
    ) -> tuple[bytes, list[pickle.PickleBuffer]]:
        """The pickle of ``obj`` and its buffers of ``threshold`` bytes or more (None: none
        out of band)."""
        out_of_band: list[pickle.PickleBuffer] = []
        callback: Callable[[pickle.PickleBuffer], bool] | None = None
        if threshold is not None:

            def callback(buffer: pickle.PickleBuffer) -> bool:
                with buffer.raw() as view:
                    if view.nbytes < threshold:
                        return True  # in band
                out_of_band.append(buffer)
                return False

        reduce_tensor: _TensorReducer | None = None
        if self.tensors and "torch" in sys.modules:
            reduce_tensor = _reduce_tensor if self.shared_tensors else _reduce_unshared_tensor
        pickler = _pickler(reduce_tensor, by_value)
        stream = io.BytesIO()
        pickler(stream, protocol=5, buffer_callback=callback).dump(obj)
        return stream.getvalue(), out_of_band

    def _write(self, data: bytes, buffers: list[pickle.PickleBuffer]) -> bytes:
        inline = len(data) <= self.inline_limit
        # raw(): each buffer as flat bytes, whatever its shape and (C or F) order.
        views = [buffer.raw() for buffer in buffers] + ([] if inline else [memoryview(data)])
        try:
            table: list[int] = []
            offset = 0
            for view in views:
                table += (offset, view.nbytes)
                offset = -(-(offset + view.nbytes) // _ALIGN) * _ALIGN
            with WRITE_LOCK:
                fd, name = self._open(table[-2] + table[-1])
                try:
                    for view, position in zip(views, table[::2], strict=True):
                        done = 0
                        while done < view.nbytes:
                            done += os.pwrite(fd, view[done:], position + done)
                except BaseException:
                    _unlink(name)
                    raise
                finally:
                    os.close(fd)
        finally:
            for view in views:
                view.release()
        self.last_segment = name
        # The last entry is the pickle's place in the segment, or (0, 0) when it follows.
        if inline:
            table += (0, 0)
        encoded = name.encode()
        flag = _RECYCLED if self.recycle else _ONE_SHOT
        head = _HEAD.pack(flag, len(encoded), len(table) // 2)
        entries = struct.pack(f"!{len(table)}Q", *table)
        return head + encoded + entries + (data if inline else b"")

    def _open(self, size: int) -> tuple[int, str]:
        """A segment to write ``size`` bytes into: a released one when there is one."""
        while self._free:
            name = self._free.pop()
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            except FileNotFoundError:  # swept meanwhile
                continue
            if os.fstat(fd).st_size > 2 * size:  # do not hold on to a much larger batch's pages
                os.ftruncate(fd, size)
            return fd, name
        for _ in range(_NAME_TRIES):
            name = f"{self.prefix}{_token()}"
            try:
                fd = os.open(os.path.join(SHM_DIR, name),
                             os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:  # never open a file someone else made
                continue
            return fd, name
        raise FileExistsError(errno.EEXIST, f"no free segment name in {SHM_DIR} after "
                              f"{_NAME_TRIES} tries", os.path.join(SHM_DIR, self.prefix))


def decode(
    message: bytes | memoryview,
    *,
    unlink: bool = True,
    private: bool = False,
    on_release: Callable[[str], None] | None = None,
) -> Any:
    """Unpickle a message made by :meth:`Codec.encode`.

    Args:
        message: the pipe message.
        unlink: remove a one-shot segment once opened (the readers of a setup message shared by
            several workers pass False; the loader unlinks it once all have read it).
        private: map the segment copy-on-write, so that writes to the arrays stay in this
            process (a dataset shared by several workers); otherwise map it shared.
        on_release: called with a recycled segment's name once no array views it any more
            (from whichever thread drops the last one). Without it, recycled segments are
            unlinked once opened, like one-shot ones.
    """
    view = memoryview(message)
    flag = view[0]
    if flag == _INLINE:
        return pickle.loads(view[1:])
    _, name_length, entries = _HEAD.unpack_from(view)
    start = _HEAD.size
    name = bytes(view[start : start + name_length]).decode()
    start += name_length
    table = struct.unpack_from(f"!{2 * entries}Q", view, start)
    start += 16 * entries
    size = max(table[i] + table[i + 1] for i in range(0, 2 * entries, 2))
    recycled = flag == _RECYCLED and on_release is not None
    mapped = _map(name, size, unlink=unlink and not recycled, private=private,
                  on_release=on_release if recycled else None)
    data_offset, data_size = table[-2], table[-1]
    buffers = [mapped[table[i] : table[i] + table[i + 1]] for i in range(0, 2 * entries - 2, 2)]
    if data_size == 0 and data_offset == 0:
        return pickle.loads(view[start:], buffers=buffers)
    return pickle.loads(mapped[data_offset : data_offset + data_size], buffers=buffers)


def _map(
    name: str, size: int, *, unlink: bool, private: bool, on_release: Callable[[str], None] | None
) -> memoryview:
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDONLY if private else os.O_RDWR)
    try:
        if unlink:
            os.unlink(path)
        if private:
            mapping: Any = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            mapping = _map_shared(fd, size)
    finally:
        os.close(fd)
    if on_release is not None:
        weakref.finalize(mapping, on_release, name).atexit = False
    # The arrays unpickled from slices of this view keep the mapping alive; it is unmapped when
    # the last of them is gone.
    return memoryview(mapping).cast("B")


class _Libc:
    """libc's mmap and munmap: a mapping made here holds no file descriptor, unlike
    :class:`mmap.mmap`, so a consumer may keep thousands of batches."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


_libc: _Libc | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int) -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = _Libc()
        except (OSError, AttributeError):  # no libc to call: mmap.mmap keeps an fd each
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    block = (ctypes.c_char * size).from_address(address)
    weakref.finalize(block, _libc.munmap, address, size).atexit = False
    return block


def _warn_full(exc: OSError) -> None:
    global _warned_full
    if not _warned_full:
        _warned_full = True
        warnings.warn(
            f"aloader: shared memory in {SHM_DIR} is full ({exc.strerror}); batches now travel "
            "through the pipe, which is slower. Raise the shared memory limit (docker: "
            "--shm-size) to restore zero-copy transport.",
            RuntimeWarning,
            stacklevel=3,
        )
