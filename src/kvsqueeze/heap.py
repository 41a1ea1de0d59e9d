"""Handing freed memory back to the operating system.

glibc keeps freed heap memory mapped (and raises its mmap threshold as large buffers are freed, so later ones come
from the heap too): after a forward pass over a long chunk, the activations' pages stay in the process's resident
set, interleaved with the cache blocks allocated meanwhile, and the peak of a chunked prefill grows chunk after
chunk although the live tensors do not.  ``malloc_trim(0)`` returns every free page, not only the heap's top.
It costs milliseconds, so it is called after multi-token steps only (a prefill chunk costs seconds).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_libc = None
_checked = False


def _trim():
    global _libc, _checked
    if not _checked:
        _checked = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:  # not glibc (macOS, musl without the symbol, Windows): nothing to do
            _libc = None
    return _libc


def release_freed_memory(collect: bool = False) -> None:
    """Return free heap pages to the OS (glibc only; elsewhere a no-op).  ``collect`` runs the garbage collector
    first, for measurements that must not see memory kept by unreachable objects."""
    if collect:
        gc.collect()
    lib = _trim()
    if lib is not None:
        lib.malloc_trim(0)
