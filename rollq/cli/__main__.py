"""``python -m rollq.cli``: the ``rollq`` command."""

import sys

from .main import main

sys.exit(main())
