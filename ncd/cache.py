"""The cache of generated modules: `<cache dir>/<op id>.py`, each beside `<op id>.hmac`.

A cache entry is code that `ncd.load` imports, so the cache is held to what trusted tools require of code they
run: the directory and its entries must belong to the current user and be writable by no one else (else a
`CacheError` says which path and what to do); the directory is created 0700 and resolved to an absolute path once
per process (ncd/settings.py); and an entry is imported only if its `.hmac` sidecar authenticates its text: an
HMAC-SHA256 of (op id, text) under a random per-user key kept 0600 in the per-user cache root
(`default_cache_root()`), never inside NCD_CACHE_DIR. A missing, truncated, empty, garbage or planted entry -- or a
planted entry with a planted sidecar, as in a cloned repository used as NCD_CACHE_DIR -- fails the check and is
regenerated, never imported. The verified text itself is what runs (compiled from memory, no bytecode cache), so
the file cannot change between check and use.

Writes go to a temporary file renamed into place, so processes compiling one spec at once never see a torn file
(they write identical text; the last rename wins). Within a process, a lock per op id makes concurrent loads of one
spec render, write and execute it once; the others wait and get the finished module."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import importlib.util
import linecache
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .settings import absolute_path, default_cache_root, settings

KEY_NAME = "cache-key"  # in default_cache_root()
KEY_BYTES = 32
MAC_SUFFIX = ".hmac"
_IDENT = re.compile(r"[A-Za-z0-9_]{1,200}")  # op ids become file and module names
_WHAT_TO_DO = "set NCD_CACHE_DIR (or pass cache_dir=) to a directory that you own and only you can write"
_KEY_ADVICE = "set XDG_CACHE_HOME to a directory of yours (the cache key is kept in $XDG_CACHE_HOME/ncd)"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a planted FIFO must not block the open


class CacheError(Exception):
    """The cache directory, an entry in it, or the cache key cannot be used safely or at all; the message names
    the path and what to do. `ncd check` reports it with exit code 2."""


def _unusable(path: Path, what: str, err: OSError) -> CacheError:
    reason = "it is a file, not a directory" if isinstance(err, FileExistsError | NotADirectoryError) else (
        err.strerror or str(err))
    return CacheError(f"{what} {path} is not usable ({reason}): make it a writable directory, or {_WHAT_TO_DO}")


def _check_private(path: Path, st: os.stat_result, what: str, todo: str = _WHAT_TO_DO) -> None:
    """Refuse a path another user owns or that group or others may write: ncd would run code planted there."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows): nothing to compare
        return
    me = os.geteuid()
    if st.st_uid != me:
        raise CacheError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}); ncd imports code from "
                         f"its cache, so everything in it must be yours alone: remove it, or {todo}")
    if st.st_mode & 0o022:
        who = "group and others" if st.st_mode & 0o022 == 0o022 else "group" if st.st_mode & 0o020 else "others"
        raise CacheError(f"{what} {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}); ncd imports code "
                         f"from its cache, so only you may write it: run `chmod go-w {path}`, or {todo}")


def _private_directory(directory: Path, what: str) -> Path:
    """`directory`, created 0700 if missing; a CacheError if it cannot be created, is not a directory, or is not
    private to this user."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(directory)
    except OSError as err:
        raise _unusable(directory, what, err) from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{what} {directory} is not a directory: {_WHAT_TO_DO}")
    _check_private(directory, st, what)
    return directory


def cache_directory(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The absolute cache directory (`cache_dir`, else NCD_CACHE_DIR, else the per-user default), checked."""
    directory = absolute_path(os.fspath(cache_dir)) if cache_dir is not None else settings().cache_dir
    return _private_directory(directory, "cache directory")


# --- the per-user key -------------------------------------------------------------------------------------------

_KEYS: dict[Path, bytes] = {}
_KEY_LOCK = threading.Lock()


def cache_key() -> bytes:
    """This user's cache key (created on first use), read once per process."""
    root = default_cache_root()
    with _KEY_LOCK:
        if root not in _KEYS:
            _KEYS[root] = _load_key(root)
        return _KEYS[root]


def _load_key(root: Path) -> bytes:
    path = root / KEY_NAME
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(root)
    except OSError as err:
        return _ephemeral_key(path, err)
    if not stat.S_ISDIR(st.st_mode):
        return _ephemeral_key(path, NotADirectoryError(errno.ENOTDIR, "not a directory"))
    _check_private(root, st, "cache root", _KEY_ADVICE)
    try:
        for _ in range(3):
            found = _read_regular(path)
            if found is None:
                _create_key(path, replace=os.path.lexists(path))  # a link or no file: replaced
                continue
            data, st = found
            if st.st_uid != os.geteuid():
                _check_private(path, st, "cache key", _KEY_ADVICE)
            if st.st_mode & 0o077 or len(data) != KEY_BYTES:  # readable by others, or damaged: a fresh one
                _create_key(path, replace=True)
                continue
            return data
        raise OSError(errno.EIO, "the key file keeps changing")
    except OSError as err:
        return _ephemeral_key(path, err)


def _create_key(path: Path, replace: bool) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(KEY_BYTES))
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):  # atomic create-if-absent: a process that loses the race
                os.link(tmp, path)  # reads the winner's key
    finally:
        Path(tmp).unlink(missing_ok=True)


def _ephemeral_key(path: Path, err: OSError) -> bytes:
    """A key for this process only: entries written by other processes fail its check and are regenerated, which
    costs time, never safety."""
    warnings.warn(f"ncd: cannot keep the cache key at {path} ({err.strerror or err}); compiled ops are "
                  f"regenerated in every process: make {path.parent} a writable directory you own, or set "
                  "XDG_CACHE_HOME", RuntimeWarning, stacklevel=4)
    return os.urandom(KEY_BYTES)


# --- entries ----------------------------------------------------------------------------------------------------


def _mac(key: bytes, ident: str, data: bytes) -> bytes:
    return hmac.new(key, b"ncd-cache-entry\0" + ident.encode() + b"\0" + data, hashlib.sha256).hexdigest().encode()


def _read_regular(path: Path) -> tuple[bytes, os.stat_result] | None:
    """A file's bytes and status; None when it is missing, a symbolic link (never followed) or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return None
        raise
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        return (handle.read(), st) if stat.S_ISREG(st.st_mode) else None


def _read_file(path: Path) -> tuple[bytes, os.stat_result] | None:
    """A cache file's bytes and status; None when it is missing or no regular file (then it is rewritten). An entry
    another user owns or others may write is a CacheError."""
    try:
        found = _read_regular(path)
    except OSError as err:
        raise _unusable(path, "cache entry", err) from None
    if found is not None:
        _check_private(path, found[1], "cache entry")
    return found


def _read_verified(target: Path, ident: str, key: bytes) -> tuple[str, os.stat_result] | None:
    """The entry's text if its sidecar authenticates it; None for a missing, damaged or planted entry."""
    entry = _read_file(target)
    if entry is None:
        return None
    sidecar = _read_file(target.with_name(target.name + MAC_SUFFIX))
    if sidecar is None or not hmac.compare_digest(sidecar[0].strip(), _mac(key, ident, entry[0])):
        return None
    try:
        return entry[0].decode("utf-8"), entry[1]
    except UnicodeDecodeError:
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _store(target: Path, ident: str, text: str, key: bytes) -> os.stat_result:
    data = text.encode("utf-8")
    try:
        _write_atomically(target, data)
        _write_atomically(target.with_name(target.name + MAC_SUFFIX), _mac(key, ident, data) + b"\n")
        return os.stat(target)
    except OSError as err:
        raise _unusable(target.parent, "cache directory", err) from None


def store_spec(text: str, name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Spec text generated by ncd (e.g. `GroupRational`'s), kept as `<cache dir>/specs/<name>.ncd` so that its op
    has a file to be loaded from; rewritten unless it holds `text`, never written through a planted link."""
    if not _IDENT.fullmatch(name):
        raise ValueError(f"spec names are ASCII letters, digits or '_', got {name!r}")
    path = _private_directory(cache_directory(cache_dir) / "specs", "cache directory") / f"{name}.ncd"
    found = _read_file(path)
    if found is None or found[0] != text.encode("utf-8"):
        try:
            _write_atomically(path, text.encode("utf-8"))
        except OSError as err:
            raise _unusable(path.parent, "cache directory", err) from None
    return path


# --- import -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Loaded:
    module: ModuleType
    text: str


_LOADED: dict[str, _Loaded] = {}
_LOCKS: dict[str, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_for(ident: str) -> threading.RLock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(ident, threading.RLock())


def _execute(ident: str, target: Path, text: str, st: os.stat_result) -> ModuleType:
    """Run the verified `text` as module `ncd_generated_<ident>` with `target` as its file. Triton's JIT reads
    kernel source through linecache, which is seeded with the same text (kept while the file is unchanged)."""
    name = f"ncd_generated_{ident}"
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    code = compile(text, str(target), "exec", dont_inherit=True)
    linecache.cache[str(target)] = (st.st_size, st.st_mtime, text.splitlines(keepends=True), str(target))
    sys.modules[name] = module  # as importlib does: the module can find itself while it runs (dataclasses)
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_generated(ident: str, render: Callable[[], str], cache_dir: str | os.PathLike[str] | None = None
                     ) -> tuple[ModuleType, Path]:
    """Import generated module `ident` from the cache, rendering and writing it first if its entry is missing or
    fails its check. Triton's JIT reads kernel source from files, so generated code always lives in a real file.
    Returns the module and its file."""
    if not _IDENT.fullmatch(ident):
        raise ValueError(f"op ids are 1-200 ASCII letters, digits or '_', got {ident!r}")
    target = cache_directory(cache_dir) / f"{ident}.py"
    key = cache_key()
    with _lock_for(ident):
        loaded = _LOADED.get(ident)
        stored = _read_verified(target, ident, key)
        if stored is None:
            text = loaded.text if loaded is not None else render()
            st = _store(target, ident, text, key)
        else:
            text, st = stored
        if loaded is None:
            loaded = _LOADED[ident] = _Loaded(_execute(ident, target, text, st), text)
        return loaded.module, target
