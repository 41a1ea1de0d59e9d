"""The one exception base of kvsqueeze's user-facing errors.

Everything a user can cause by what they pass in (a cache name, a path, a setting, a missing optional library)
raises a :class:`KvsqueezeError`; the command line turns it into one line on stderr and exit code 2.  Anything
else (a ``RuntimeError`` from a broken invariant) is a bug and keeps its traceback.

``KvsqueezeError`` subclasses ``ValueError``: the package has always reported bad input as ``ValueError``, so
every existing ``except ValueError`` (callers', the dispatcher's, tests') keeps working unchanged.
"""

from __future__ import annotations


class KvsqueezeError(ValueError):
    """Base class of every error kvsqueeze raises for bad input or a missing optional library."""


class UnknownCacheError(KvsqueezeError):
    """A ``--kv`` value that is no preset, spec string, JSON spec, artifact directory or registered peer."""


class CacheSpecError(KvsqueezeError):
    """A spec string or JSON cache description that names a cache but describes it wrongly."""


class ArtifactError(KvsqueezeError):
    """A calibration artifact that cannot be found unambiguously, or cannot be read."""


class MissingDependencyError(KvsqueezeError):
    """An optional library needed for what was asked is not installed (the message says how to install it)."""


class UnsupportedCacheError(KvsqueezeError):
    """A valid cache used where it cannot work (a peer where only kvsqueeze's own caches can be built)."""


class DiskWriteError(KvsqueezeError):
    """An output could not be written: the disk (or a quota, or the file-size limit) is full, or the target is
    read-only.  Nothing partial is left behind and what was there before is unchanged."""


class CacheEditError(KvsqueezeError):
    """A cache edit (crop, batch reorder / select / repeat) asked with arguments the cache cannot apply."""
