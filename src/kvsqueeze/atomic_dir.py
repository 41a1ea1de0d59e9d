"""Write a directory so that readers see either the old one or the complete new one, never a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_directory(dest: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling of ``dest`` to write into.  When the block ends normally it takes
    ``dest``'s place (an existing ``dest`` is moved aside first, so the swap is two renames, then removed); when
    the block raises, the temporary directory is removed and ``dest`` is left as it was."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
