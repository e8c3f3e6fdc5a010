"""A shard's identity in a checkpoint: which version of the shard a position was taken in.

A position inside a shard (a byte offset, record counts) holds only for the bytes it was
taken in. So a sharded source's state names the shard it points into by identity: a local
file's size and modification time (``{"size": ..., "mtime_ns": ...}``), a remote object's
size and version (``{"size": ..., "version": ...}``: its ETag, or ``"lm:"`` and its
Last-Modified where the store sends no ETag; an object store's generation shows in its ETag).
Resuming after the shard changed is a ``ValueError`` naming the shard, never records read at
the wrong place: a file is compared when the state is loaded, a remote object when its first
answer arrives (its store is not asked before). A state without an identity (taken by an
older version, or of a remote shard whose store sent no size) is not compared.

Invariant: an identity is JSON builtins, made only from what the shard's own metadata says.
"""

from __future__ import annotations

import os
from typing import Any

from ..io._cache import Version, make_version
from ..streams._positions import _bad_state

__all__ = ("check_identity", "file_identity", "same_version", "version_identity")

_WHERE = "shards"


def file_identity(path: str) -> dict[str, int] | None:
    """A local file's identity now, or None when it cannot be looked at (the read that
    follows says why)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns}


def version_identity(version: Version | None) -> dict[str, Any] | None:
    """A remote object's identity from its version (size, ETag or Last-Modified)."""
    if version is None:
        return None
    return {"size": version[0], "version": version[1]}


def _describe(identity: dict[str, Any]) -> str:
    parts = [f"size {identity.get('size')}"]
    if "mtime_ns" in identity:
        parts.append(f"modified at {identity['mtime_ns']} ns")
    if identity.get("version") is not None:
        parts.append(f"version {identity['version']!r}")
    return ", ".join(parts)


def changed(name: str, saved: dict[str, Any], now: dict[str, Any]) -> ValueError:
    """The error of a shard that is not the one a state was taken in."""
    return _bad_state(_WHERE, "identity", f"says shard {name!r} had {_describe(saved)} when the "
                      f"state was saved, but it has {_describe(now)} now: it changed since, so "
                      "the state's offset and record counts no longer hold in it (resume from "
                      "a state taken after the change, or from its start)")


def check_identity(at: dict[str, Any], name: str, remote: bool, compressed: bool
                   ) -> dict[str, Any] | None:
    """Validate a position's ``identity`` (absent or None: not compared); a local file is
    compared with the file now, and the position's ``offset`` with the shard's size (an
    uncompressed shard's: a compressed one's offsets are in its decompressed content).

    Raises:
        ValueError: the identity is malformed, the file is not the one the state was taken
            in, or the offset is past the shard's end (each names its field).
    """
    identity = at.get("identity")
    if identity is None:
        return None
    if not isinstance(identity, dict) or not isinstance(identity.get("size"), int) \
            or isinstance(identity.get("size"), bool) or identity["size"] < 0:
        raise _bad_state(_WHERE, "identity", f"should be a dict with the shard's size, but is "
                         f"{identity!r}")
    allowed = {"size", "version"} if remote else {"size", "mtime_ns"}
    if set(identity) - allowed:
        raise _bad_state(_WHERE, "identity", f"has fields {sorted(set(identity) - allowed)} "
                         f"that a {'remote' if remote else 'local'} shard's identity has not")
    if not remote and not isinstance(identity.get("mtime_ns"), int):
        raise _bad_state(_WHERE, "identity", f"should hold a local file's mtime_ns, but is "
                         f"{identity!r}")
    if remote and not isinstance(identity.get("version"), (str, type(None))):
        raise _bad_state(_WHERE, "identity", f"should hold a version string or None, but is "
                         f"{identity!r}")
    if not compressed and at.get("offset", 0) > identity["size"]:
        raise _bad_state(_WHERE, "offset", f"is {at['offset']}, past the end of shard "
                         f"{name!r} ({identity['size']} bytes when the state was saved)")
    if not remote:
        now = file_identity(name)
        if now is not None and now != identity:
            raise changed(name, identity, now)
    return identity


def same_version(name: str, saved: dict[str, Any] | None, size: int | None,
                 etag: str | None, last_modified: str | None) -> dict[str, Any] | None:
    """A remote shard's identity from its first answer, checked against the saved one.

    Raises:
        ValueError: the object is not the version the state was taken in.
    """
    now = version_identity(make_version(size, etag, last_modified))
    if saved is not None and now is not None and (
            now["size"] != saved["size"]
            or (None not in (now["version"], saved["version"])
            and now["version"] != saved["version"])):
        raise changed(name, saved, now)
    return now
