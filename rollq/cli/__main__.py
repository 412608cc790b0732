"""``python -m rollq.cli``: the ``rollq`` command."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
