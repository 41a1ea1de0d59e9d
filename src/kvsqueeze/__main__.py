"""``python -m kvsqueeze``: the same as the ``kvsqueeze`` command."""

import sys

from .cli import main

sys.exit(main())
