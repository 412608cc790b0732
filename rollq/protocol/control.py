"""The control channel's verbs (pub/sub hints; the durable state is in Redis keys)."""

from __future__ import annotations

import enum


class Control(str, enum.Enum):
    """Verbs of a queue's control channel (``keys.control``): messages are ``"<verb> <arg>"``.
    They are hints: a replica that misses one catches up from the durable state.

    >>> control_message(Control.CANCEL, "job-1")
    'cancel job-1'
    >>> parse_control("version 7")
    (<Control.VERSION: 'version'>, '7')
    >>> parse_control("no-such-verb x")
    (None, 'x')
    """

    #: A job was cancelled (arg: job id; ``lua/cancel.lua`` publishes it).
    CANCEL = "cancel"
    #: A replica stopped and handed its jobs back (arg: replica id): peers reclaim now.
    HANDBACK = "handback"
    #: A policy version was committed (arg: version; ``lua/publish_version.lua``).
    VERSION = "version"
    #: A version is offered over the broadcast group (arg: version).
    WOFFER = "woffer"
    #: A broadcast group is forming (arg: group id): replicas join it.
    WGROUP = "wgroup"
    #: Drop the prefix cache (no arg; loading a version drops it anyway).
    RESET_PREFIX_CACHE = "reset-prefix-cache"


_CONTROL = {c.value: c for c in Control}


def control_message(verb: Control, arg: str | int = "") -> str:
    """The text of a control message."""
    return f"{verb.value} {arg}" if arg != "" else verb.value


def parse_control(text: str) -> tuple[Control | None, str]:
    """``(verb, arg)`` of a control message; an unknown verb gives ``None`` (newer peers)."""
    verb, _, arg = text.partition(" ")
    return _CONTROL.get(verb), arg
