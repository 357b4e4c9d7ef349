"""``python -m rallypoint`` and the ``rallypoint`` script: see ``rallypoint._cli._main``."""

import sys

from rallypoint._cli._main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
