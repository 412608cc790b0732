"""rollq.rl.mps: the run's own CUDA MPS daemon.

On CPU machines a stand-in ``nvidia-cuda-mps-control`` (a shell script on PATH that keeps
the commands it got and makes the daemon's pipe as the real one does) shows the protocol:
start with ``-d`` under the private folders, the environment set for this process and its
children, ``quit`` and the environment restored on exit, clear errors where MPS cannot run.
On a GPU the real daemon: a child process that creates a CUDA context becomes its client.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollq.rl import mps
from rollq.rl.mps import MpsDaemon, MpsUnavailable, mps_environment


def _fake_control(folder: Path, *, start_rc: int = 0, make_pipe: bool = True) -> Path:
    """A stand-in control program: logs its argv and stdin, and on ``-d`` makes the pipe."""
    script = folder / "nvidia-cuda-mps-control"
    pipe = 'touch "$CUDA_MPS_PIPE_DIRECTORY/control"' if make_pipe else ":"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        log="{folder}/calls"
        if [ "$1" = "-d" ]; then
            echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$log"
            {pipe}
            exit {start_rc}
        fi
        read cmd
        echo "cmd $cmd" >> "$log"
        if [ "$cmd" = "get_server_list" ]; then echo 4242; fi
        exit 0
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def fake_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in mps_environment("x"):
        monkeypatch.delenv(name, raising=False)
    return bin_dir


def test_the_daemon_starts_under_its_own_folders_sets_the_environment_and_quits(fake_path, tmp_path):
    _fake_control(fake_path)
    root = tmp_path / "mps"
    with MpsDaemon(root) as daemon:
        assert daemon.running
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "pipe")
        # a child started now is a client of this daemon, not of a system-wide one
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(root / "pipe")
        assert daemon.servers() == [4242]
    assert not daemon.running
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    calls = (fake_path / "calls").read_text().splitlines()
    assert calls == [f"start {root / 'pipe'} {root / 'log'}", "cmd get_server_list", "cmd quit"]


def test_a_daemon_of_a_temporary_folder_removes_it_and_restores_an_earlier_setting(fake_path, monkeypatch):
    _fake_control(fake_path)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/somewhere/else")
    with MpsDaemon() as daemon:
        pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.name == "pipe" and pipe.parent.name.startswith("rollq-mps-")
    assert not pipe.parent.exists()
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/somewhere/else"
    daemon.close()  # a second close does nothing


def test_no_control_program_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpsUnavailable, match="nvidia-cuda-mps-control not found"):
        MpsDaemon(tmp_path / "mps").__enter__()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ or os.environ["CUDA_MPS_PIPE_DIRECTORY"] != str(tmp_path / "mps" / "pipe")


def test_a_daemon_that_fails_to_start_or_never_makes_its_pipe_is_a_clear_error(fake_path, tmp_path, monkeypatch):
    _fake_control(fake_path, start_rc=3)
    with pytest.raises(MpsUnavailable, match="exited 3"):
        MpsDaemon(tmp_path / "a").__enter__()
    _fake_control(fake_path, make_pipe=False)
    monkeypatch.setattr(mps, "START_TIMEOUT_S", 0.3)
    with pytest.raises(MpsUnavailable, match="did not appear"):
        MpsDaemon(tmp_path / "b").__enter__()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    # whatever started is told to quit, and a folder made for it goes
    assert (fake_path / "calls").read_text().splitlines()[-2:] == [f"start {tmp_path / 'b' / 'pipe'} {tmp_path / 'b' / 'log'}",
                                                                   "cmd quit"]
    monkeypatch.setattr(mps.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "made"))
    with pytest.raises(MpsUnavailable, match="did not appear"):
        MpsDaemon().__enter__()
    assert not (tmp_path / "made").exists()


def test_the_daemon_refuses_to_start_once_cuda_is_initialised(fake_path, tmp_path, monkeypatch):
    """A process whose CUDA context exists would not be the daemon's client: refused, not ignored."""
    import torch

    _fake_control(fake_path)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MpsUnavailable, match="already initialised"):
        MpsDaemon(tmp_path / "mps").__enter__()
    assert not (fake_path / "calls").exists()


@pytest.mark.gpu
def test_a_child_that_uses_the_gpu_becomes_a_client_of_the_real_daemon(tmp_path):
    code = ("import torch, sys; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); "
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.readline()")
    with MpsDaemon(tmp_path / "mps") as daemon:
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            assert daemon.servers(), daemon.log_tail()
        finally:
            child.communicate("\n", timeout=60)


def test_closing_from_a_process_that_is_a_client_does_not_wait_for_the_daemon(fake_path, tmp_path, monkeypatch):
    """The daemon's ``quit`` waits for its clients; a process that used CUDA is one, so closing
    must not wait for it (an rl_loop run on an H100 waited out the 10 s control timeout)."""
    import time

    import torch

    script = _fake_control(fake_path)
    # "quit" blocks as the real one does while a client remains
    script.write_text(script.read_text().replace('exit 0\n', 'if [ "$cmd" = "quit" ]; then sleep 5; fi\nexit 0\n'))
    with MpsDaemon(tmp_path / "mps") as daemon:
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0
    assert not daemon.running and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    deadline = time.monotonic() + 5
    while "cmd quit" not in (fake_path / "calls").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (fake_path / "calls").read_text().splitlines()[-1] == "cmd quit"
