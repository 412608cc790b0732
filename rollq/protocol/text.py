"""Untrusted strings (job ids, prompts, reasons) cut short before they reach a log line or an
error message."""

from __future__ import annotations

from typing import Any


def cut(text: str, limit: int = 500) -> str:
    """An untrusted message cut to ``limit`` characters, for logs, errors and dead letters.

    >>> cut("x" * 12, 5)
    'xxxxx... (12 characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def short(text: Any, limit: int = 80) -> str:
    """``repr`` of an untrusted string cut to ``limit`` characters, for logs and error
    messages (a 10 MB job id must not become a 10 MB log line).

    >>> short("x" * 100, 10)
    "'xxxxxxxxxx'... (100 characters)"
    """
    if text is None:
        return "None"
    if not isinstance(text, str):
        return type(text).__name__
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
