"""On a test timeout, the stack of every asyncio task goes to the report.

pytest-timeout dumps the stacks of the threads, which for an asyncio test shows the event loop
waiting in ``select``: nothing says which coroutine never finished. This hook arms the same
timer pytest-timeout would (``signal`` or ``thread``, from its settings) and, when it fires,
first writes each task of every running event loop: its await chain, innermost last, and the
future it waits on. tests/conftest.py registers it (``pytest_timeout_set_timer``);
tests/test_hang_dump.py runs a hanging test to show the dump.
"""

from __future__ import annotations

import asyncio
import linecache
import signal
import sys
import threading
from typing import Any

import pytest

#: Title of the dump's section in the report.
TITLE = "asyncio tasks at the timeout"


def running_loops() -> list[asyncio.AbstractEventLoop]:
    """The event loops running now in any thread, found on the threads' stacks."""
    loops: list[asyncio.AbstractEventLoop] = []
    for frame in sys._current_frames().values():
        f: Any = frame
        while f is not None:
            obj = f.f_locals.get("self")
            if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running() and obj not in loops:
                loops.append(obj)
            f = f.f_back
    return loops


def _frame_of(aw: Any) -> Any:
    for attr in ("cr_frame", "gi_frame", "ag_frame"):
        if hasattr(aw, attr):
            return getattr(aw, attr)
    return None


def _awaited(aw: Any) -> Any:
    for attr in ("cr_await", "gi_yieldfrom", "ag_await"):
        if hasattr(aw, attr):
            return getattr(aw, attr)
    return None


def task_stack(task: asyncio.Task) -> str:
    """``task``'s await chain (outermost first, as a traceback reads) and what it waits on."""
    lines = [f"{task!r}"]
    aw: Any = task.get_coro()
    while aw is not None:
        frame = _frame_of(aw)
        if frame is None:
            break
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        src = linecache.getline(code.co_filename, frame.f_lineno).strip()
        if src:
            lines.append(f"    {src}")
        aw = _awaited(aw)
    waiter = getattr(task, "_fut_waiter", None)
    if waiter is not None:
        lines.append(f"  waiting on {waiter!r}")
    return "\n".join(lines)


def format_tasks(loops: list[asyncio.AbstractEventLoop] | None = None) -> str:
    """Every pending task of ``loops`` (default: every running loop), one stack each."""
    out = []
    for loop in running_loops() if loops is None else loops:
        tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
        out.append(f"{len(tasks)} task(s) of {loop!r}")
        out.extend(task_stack(t) for t in tasks)
    return "\n\n".join(out) if out else "no event loop is running"


def dump_tasks(item: pytest.Item) -> None:
    """Write :func:`format_tasks` to the terminal (never raises: a failed dump must not hide
    the timeout)."""
    terminal = item.config.get_terminal_writer()
    try:
        text = format_tasks()
    except Exception as e:  # noqa: BLE001 - diagnostics only
        text = f"could not list the asyncio tasks: {e!r}"
    terminal.sep("+", title=TITLE)
    terminal.write(text + "\n")
    terminal.flush()


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's own timer (its ``signal`` or ``thread`` method), with the tasks'
    stacks dumped before its thread stacks and its failure."""
    import pytest_timeout

    method = settings.method
    if method == "signal" and threading.current_thread() is not threading.main_thread():
        method = "thread"
    if method == "signal":

        def handler(signum: int, frame: Any) -> None:
            __tracebackhide__ = True
            dump_tasks(item)
            pytest_timeout.timeout_sigalrm(item, settings)

        def cancel() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    else:

        def fire() -> None:
            dump_tasks(item)
            pytest_timeout.timeout_timer(item, settings)

        timer = threading.Timer(settings.timeout, fire)
        timer.name = f"hang_dump {item.nodeid}"

        def cancel() -> None:
            timer.cancel()
            timer.join()

        timer.start()
    item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel hook calls it
    return True
