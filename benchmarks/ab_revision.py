"""Import the ``rollq`` package of a git revision beside the working tree's, for benchmarks
that compare before and after a change in one run (``submit_ab.py``, ``drain_ab.py``)."""

from __future__ import annotations

import importlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def import_revision(rev: str) -> ModuleType:
    """``rollq`` at ``rev``, imported as the package ``rollq_before`` (its Lua scripts too).
    ``rev`` may also be a folder that holds a ``rollq`` package (``git archive REV rollq``
    unpacked, for a machine whose clone lacks the revision)."""
    tmp = Path(tempfile.mkdtemp(prefix="rollq-ab-"))
    if (Path(rev) / "rollq" / "__init__.py").is_file():
        shutil.copytree(Path(rev) / "rollq", tmp / "rollq")
    else:
        tar = subprocess.run(["git", "archive", rev, "rollq"], cwd=ROOT, check=True, capture_output=True).stdout
        tarfile.open(fileobj=io.BytesIO(tar)).extractall(tmp, filter="data")
    (tmp / "rollq").rename(tmp / "rollq_before")
    conn = tmp / "rollq_before" / "connection.py"
    text = conn.read_text()
    if 'resources.files("rollq")' not in text:
        sys.stderr.write(f"warning: {rev}'s connection.py does not read its Lua scripts as expected; it runs the working tree's\n")
    conn.write_text(text.replace('resources.files("rollq")', 'resources.files("rollq_before")'))
    sys.path.insert(0, str(tmp))
    return importlib.import_module("rollq_before")
