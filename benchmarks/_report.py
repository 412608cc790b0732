"""What each benchmark script does with its results: print the Markdown, and with ``--out``
write ``<out>.json`` and ``<out>.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: str | None, data: dict[str, Any], md: str) -> None:
    """Print ``md``; with ``out``, write ``data`` to ``<out>.json`` and ``md`` to ``<out>.md``."""
    print(md)
    if out:
        Path(out + ".json").write_text(json.dumps(data, indent=1))
        Path(out + ".md").write_text(md)
