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


def test_rollq_serve_weight_transfer_flags(redis_url, queue, tmp_path):
    """``--weight-transfer gloo`` shows in /server_info; without ``--weight-root`` it refuses to start."""
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base_cmd = [sys.executable, "-m", "rollq.cli", "serve", "--url", redis_url, "--queue", queue, "--weight-transfer", "gloo"]
    bad = subprocess.run(base_cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--weight-root" in bad.stderr
    port = _free_port()
    proc = subprocess.Popen([*base_cmd, "--weight-root", str(tmp_path / "w"), "--weight-model", str(model),
                             "--port", str(port)], env=env, cwd=ROOT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{base}/server_info", params={"config_format": "json"}, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "rollq serve did not start"
                time.sleep(0.2)
        assert r.json()["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
        assert r.json()["vllm_config"]["model_config"]["dtype"] == "torch.float32"
    finally:
        proc.terminate()
        proc.wait(15)
