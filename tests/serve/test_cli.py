"""``rollq serve`` as a process: it listens on loopback, answers /health, and checks the API
key from the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from tests.helpers import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rollq_serve_command(redis_url, queue):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLQ_SERVE_API_KEY": "sk-cli"}
    proc = subprocess.Popen([sys.executable, "-m", "rollq.cli", "serve", "--url", redis_url, "--queue", queue,
                             "--port", str(port), "--model-name", "m"], env=env, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"{base}/health", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "rollq serve did not start"
                time.sleep(0.2)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-cli"})
        assert [m["id"] for m in r.json()["data"]] == ["m"]
    finally:
        proc.terminate()
        proc.wait(15)
