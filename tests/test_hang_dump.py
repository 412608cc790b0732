"""A test that hits its timeout dumps every asyncio task's stack (tests/helpers/hang_dump.py):
a pytest run of a test that hangs in a coroutine, under both of pytest-timeout's methods."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

HANGING = '''
import asyncio

import pytest


async def the_commit_that_never_comes(event):
    await event.wait()


async def swap(event):
    await asyncio.create_task(the_commit_that_never_comes(event), name="late-commit")


@pytest.mark.asyncio
@pytest.mark.timeout(1)
async def test_hangs():
    await swap(asyncio.Event())
'''


def run_hanging(tmp_path: Path, method: str, plugin: bool = True) -> str:
    (tmp_path / "test_hanging.py").write_text(HANGING)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout-method={method}",
            "test_hanging.py"]
    if plugin:
        args[3:3] = ["-p", "tests.helpers.hang_dump"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr  # the test timed out
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_a_timeout_names_the_coroutine_each_task_waits_in(tmp_path, method):
    out = run_hanging(tmp_path, method)
    assert "Timeout" in out and "asyncio tasks at the timeout" in out, out
    # the test's own task, down to the await that never returns ...
    assert "in test_hangs" in out and "in swap" in out, out
    # ... and the task it started, with the line it waits on and the future it waits for
    assert "name='late-commit'" in out and "in the_commit_that_never_comes" in out, out
    assert "await event.wait()" in out and "waiting on <Future pending" in out, out


def test_without_the_dump_a_timeout_does_not_say_where_it_waits(tmp_path):
    out = run_hanging(tmp_path, "signal", plugin=False)
    assert "Timeout" in out and "in the_commit_that_never_comes" not in out, out
