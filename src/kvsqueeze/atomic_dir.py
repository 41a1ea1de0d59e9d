"""Atomic writes: readers see either the old output or the complete new one, never a half-written one.

A folder is written into a hidden staging sibling ``.NAME.tmp-<pid>-<rand>`` that takes ``NAME``'s place at the
end; a single file likewise (temporary file, then ``os.replace``).  A writer killed outright (SIGKILL, power loss)
cannot remove its staging entry, so every write first removes the staging entries in the same folder whose writer
process is gone: the pid in the name says which.  Out-of-space and read-only errors become one
:class:`~kvsqueeze.errors.DiskWriteError` line.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DiskWriteError

FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
DENIED = {errno.EACCES, errno.EROFS, errno.EPERM}
# .NAME.tmp-<pid>-<rand> (being written) and .NAME.old-<pid>-<rand> (the previous NAME, during a two-rename swap)
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")
# bench's report folders as older versions staged them (no pid): removed once they are an hour old
_LEGACY_BENCH = re.compile(r"^\.\d{8}-\d{6}(-\d+)?\.partial$")
LEGACY_AGE_S = 3600


def staging_path(dest: Path, kind: str = "tmp") -> Path:
    return dest.parent / f".{dest.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _legacy(entry: str, name: str | None) -> bool:
    """A staging name older versions used for ``name`` (mkdtemp's ``.NAME.tmp-XXXXXXXX``, mkstemp's
    ``.NAME.XXXXXXXX.tmp``): without a pid, only its age says it is stale.  Matched for the name being written
    only, so another program's hidden files are never taken for ours."""
    if _LEGACY_BENCH.match(entry):
        return True
    if name is None or not entry.startswith(f".{name}."):
        return False
    rest = entry[len(name) + 2:]
    return re.fullmatch(r"tmp-[A-Za-z0-9_]{8}|[A-Za-z0-9_]{8}\.tmp", rest) is not None


def clean_stale(folder: Path, name: str | None = None) -> list[Path]:
    """Remove the staging entries in ``folder`` left by writers that no longer run (best effort); a previous
    ``NAME`` moved aside by a writer killed mid-swap is put back when ``NAME`` is missing.  Entries of older
    versions (no pid) are removed for ``name`` once they are an hour old.  Returns what it removed or restored."""
    done = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return done
    now = time.time()
    for entry in entries:
        m = _STAGING.match(entry.name)
        try:
            if m is not None and not _alive(int(m["pid"])):
                original = folder / m["name"]
                if m["kind"] == "old" and not os.path.lexists(original):
                    os.replace(entry, original)
                else:
                    _remove(entry)
                done.append(entry)
            elif m is None and _legacy(entry.name, name) and now - entry.lstat().st_mtime > LEGACY_AGE_S:
                _remove(entry)
                done.append(entry)
        except OSError:
            continue  # another writer's cleanup got there first, or no permission: not ours to fix
    return done


def _errno_of(exc: BaseException) -> int | None:
    """The out-of-space / read-only errno behind ``exc``: an OSError, or a library error (safetensors' Rust
    writer) whose text carries ``(os error N)``; causes and contexts are followed."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in FULL | DENIED:
            return exc.errno
        m = re.search(r"os error (\d+)", str(exc))
        if m and int(m[1]) in FULL | DENIED:
            return int(m[1])
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def disk_error(exc: BaseException, dest: str | Path | None) -> DiskWriteError | None:
    """The one-line DiskWriteError for ``exc`` when it is a full disk or a read-only target, else None."""
    if isinstance(exc, DiskWriteError):
        return exc
    code = _errno_of(exc)
    if code is None:
        return None
    what = f"cannot write {dest}" if dest is not None else "cannot write the output"
    fix = ("free some space (or raise the quota / file-size limit) and run again" if code in FULL
           else "choose a writable location")
    return DiskWriteError(f"{what}: {os.strerror(code)} [{errno.errorcode.get(code, code)}]; nothing was "
                          f"written there and what was there before is unchanged; {fix}")


@contextmanager
def disk_errors(dest: str | Path) -> Iterator[None]:
    """Turn a full-disk or read-only OSError raised in the block into a DiskWriteError naming ``dest``."""
    try:
        yield
    except Exception as exc:
        err = disk_error(exc, dest)
        if err is None or err is exc:
            raise
        raise err from exc


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _commit(tmp: Path, dest: Path, keep_existing: bool) -> None:
    if os.path.lexists(dest):
        if keep_existing:  # a cache entry another writer completed first: theirs is as good
            _remove(tmp)
        elif _exchange(tmp, dest):
            _remove(tmp)  # now holds the previous dest
        else:
            old = staging_path(dest, "old")
            os.replace(dest, old)  # a writer killed here leaves .old: the next write puts it back
            os.replace(tmp, dest)
            _remove(old)
        return
    try:
        os.replace(tmp, dest)
    except OSError:
        if not (keep_existing and dest.exists()):  # a concurrent writer winning the race is fine for a cache
            raise
        _remove(tmp)


@contextmanager
def _staged(dest: Path, create: Callable[[Path], None], commit: Callable[[Path, Path], None]) -> Iterator[Path]:
    """The staging both writers share: stale staging cleaned, a fresh entry made by ``create``, ``commit`` run
    when the block ends normally, the entry removed when it raises; full-disk / read-only errors as
    DiskWriteError naming ``dest``."""
    with disk_errors(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(dest.parent, dest.name)
        tmp = staging_path(dest)
        create(tmp)
    try:
        with disk_errors(dest):
            yield tmp
            commit(tmp, dest)
    except BaseException:
        _remove(tmp)
        raise


@contextmanager
def staged_directory(dest: str | Path, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a fresh staging sibling of ``dest`` to write into.  When the block ends normally it takes ``dest``'s
    place in one rename (an existing ``dest`` is swapped out, then removed; with ``keep_existing`` an existing
    ``dest`` wins instead); when the block raises, the staging folder is removed and ``dest`` is left as it was.
    A full disk or read-only target raises DiskWriteError."""
    with _staged(Path(dest), Path.mkdir, lambda tmp, d: _commit(tmp, d, keep_existing)) as tmp:
        yield tmp


def _empty_file(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask applies, unlike mkstemp


@contextmanager
def staged_file(dest: str | Path) -> Iterator[Path]:
    """Yield a staging path next to ``dest`` (an empty file, created with the usual permissions) to write;
    it replaces ``dest`` when the block ends normally and is removed when it raises."""
    with _staged(Path(dest), _empty_file, os.replace) as tmp:
        yield tmp


def write_file_atomic(dest: str | Path, data: bytes | str) -> Path:
    """Write ``data`` as ``dest`` atomically; returns ``dest``."""
    with staged_file(dest) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(dest)
