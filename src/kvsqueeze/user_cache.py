"""Where kvsqueeze keeps what it builds or fetches once per user: converted models, downloaded corpora."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_root() -> Path:
    """``$KVSQUEEZE_CACHE``, else ``$XDG_CACHE_HOME/kvsqueeze`` (default ``~/.cache/kvsqueeze``)."""
    if os.environ.get("KVSQUEEZE_CACHE"):
        return Path(os.environ["KVSQUEEZE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "kvsqueeze"
