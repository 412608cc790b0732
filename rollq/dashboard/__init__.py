"""Live views of rollq queues: a web dashboard with a JSON API and ``/metrics``, and ``rollq top``.

One :class:`Sampler` per process reads Redis on a fixed cadence (bounded commands, no scans);
every view reads its memory. The web app needs the ``dashboard`` extra (starlette, uvicorn,
prometheus_client); :class:`Sampler` and ``rollq top`` need only rollq's own dependencies.

>>> from rollq.dashboard import DashboardSettings
>>> DashboardSettings().interval
1.0
"""

from __future__ import annotations

from typing import Any

#: Port the dashboard listens on unless told otherwise (Ray's dashboard has 8265).
DEFAULT_PORT = 8650
#: Environment variable read when ``--token`` is not given.
ENV_TOKEN = "ROLLQ_DASHBOARD_TOKEN"

__all__ = ["DEFAULT_PORT", "ENV_TOKEN", "DashboardSettings", "Sampler", "create_app"]

_LAZY = {"DashboardSettings": "sampler", "Sampler": "sampler", "create_app": "app"}


def __getattr__(name: str) -> Any:  # imported on first use: `rollq --help` stays fast
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'rollq.dashboard' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{mod}"), name)
