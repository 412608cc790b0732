"""A private CUDA MPS daemon, so that a trainer and a replica on one GPU run at the same time.

Processes that use one GPU each have a CUDA context of their own, and the GPU runs one
context at a time: without MPS (NVIDIA's Multi-Process Service) their kernels take turns in
time slices, however few of the GPU's SMs each kernel needs. A trainer process training
beside a vLLM engine core process on the same GPU then gains no wall time from overlapping
the two (``benchmarks/gpu_share.py`` measures it). Under MPS the processes' work goes through
one server context and runs side by side.

:class:`MpsDaemon` starts ``nvidia-cuda-mps-control -d`` with its pipe and log folders in a
private directory, so that only the processes started with its environment (this one and
its children, such as vLLM's engine core) become its clients; other users of the GPU are not
affected. Enter it before anything in this process initialises CUDA: a process attaches to
MPS, or not, when its context is created.

>>> env = mps_environment("/tmp/rollq-mps-doc")
>>> sorted(env)
['CUDA_MPS_LOG_DIRECTORY', 'CUDA_MPS_PIPE_DIRECTORY']
>>> env["CUDA_MPS_PIPE_DIRECTORY"]
'/tmp/rollq-mps-doc/pipe'

Where the GPU's compute mode forbids it, the control binary is missing (no NVIDIA driver
tools, or MIG) or the daemon does not come up, entering raises :class:`MpsUnavailable`
naming the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

__all__ = ["MpsDaemon", "MpsUnavailable", "mps_environment"]

#: The control program of NVIDIA's driver tools that starts, queries and stops the daemon.
CONTROL = "nvidia-cuda-mps-control"
#: How long a control command may take before the daemon counts as not answering.
CONTROL_TIMEOUT_S = 10.0
#: How long to wait for the daemon's pipe to appear after starting it.
START_TIMEOUT_S = 10.0


class MpsUnavailable(RuntimeError):
    """CUDA MPS cannot be used here; the message says why."""


def mps_environment(root: str | os.PathLike[str]) -> dict[str, str]:
    """The environment that makes a process a client of the daemon whose folders are under ``root``."""
    base = Path(root)
    return {"CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


class MpsDaemon:
    """A CUDA MPS control daemon of this process's own, for the time the ``with`` block runs.

    On entry: starts the daemon under a fresh directory and sets its environment in
    ``os.environ``, so this process and every child started later become its clients. On exit:
    stops the daemon (``quit``, which waits for its clients to go) and restores the
    environment; where this process is a client itself (it initialised CUDA), ``quit`` is sent
    without waiting, since the daemon waits for its clients, and it goes when this process
    does. ``servers()`` lists the MPS servers running, one per GPU with clients: the
    proof that the processes did attach.

    >>> daemon = MpsDaemon()
    >>> daemon.running
    False
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self._root_arg = root
        self._root: Path | None = None
        self._made_root = False
        self._env: dict[str, str] = {}
        self._saved: dict[str, str | None] = {}
        self._quitter: subprocess.Popen[str] | None = None
        self.running = False

    def _control(self, command: str | None, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """Run the control program with this daemon's environment: ``command`` on its stdin
        (None: start it with ``-d``); its stdout, or :class:`MpsUnavailable` naming the failure."""
        env = {**os.environ, **self._env}
        args = [CONTROL, "-d"] if command is None else [CONTROL]
        try:
            done = subprocess.run(args, input=None if command is None else command + "\n", env=env,
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError as e:
            raise MpsUnavailable(f"{CONTROL} not found on PATH (NVIDIA's driver tools)") from e
        except OSError as e:
            raise MpsUnavailable(f"{CONTROL} could not run: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise MpsUnavailable(f"{CONTROL} {'-d' if command is None else command!r} did not answer "
                                 f"in {timeout} s") from e
        if done.returncode != 0:
            raise MpsUnavailable(f"{CONTROL} {'-d' if command is None else command!r} exited "
                                 f"{done.returncode}: {(done.stderr or done.stdout).strip()[:500]}")
        return done.stdout

    def servers(self) -> list[int]:
        """The pids of the MPS servers this daemon runs (none until a client created a context)."""
        out = self._control("get_server_list")
        return [int(tok) for tok in out.split() if tok.isdigit()]

    def log_tail(self, lines: int = 20) -> str:
        """The end of the daemon's control log (where it says why a client was refused)."""
        if self._root is None:
            return ""
        path = Path(self._env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> MpsDaemon:
        if _cuda_initialised():
            raise MpsUnavailable("CUDA is already initialised in this process: start the MPS daemon before "
                                 "anything touches the GPU, or this process will not be its client")
        if shutil.which(CONTROL) is None:
            raise MpsUnavailable(f"{CONTROL} not found on PATH (NVIDIA's driver tools)")
        self._made_root = self._root_arg is None
        self._root = Path(self._root_arg) if self._root_arg is not None else Path(tempfile.mkdtemp(prefix="rollq-mps-"))
        self._env = mps_environment(self._root)
        for folder in self._env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        try:
            self._control(None)
            pipe = Path(self._env["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
            deadline = time.monotonic() + START_TIMEOUT_S
            while not pipe.exists():
                if time.monotonic() > deadline:
                    raise MpsUnavailable(f"the MPS daemon's pipe {pipe} did not appear in {START_TIMEOUT_S} s: "
                                         f"{self.log_tail()}")
                time.sleep(0.05)
        except MpsUnavailable:
            self._abandon()
            raise
        self._saved = {name: os.environ.get(name) for name in self._env}
        os.environ.update(self._env)
        self.running = True
        log.info("CUDA MPS daemon started under %s", self._root)
        return self

    def _abandon(self) -> None:
        """After a failed start: stop whatever did start (without waiting long) and drop a
        folder made for it."""
        with contextlib.suppress(MpsUnavailable):
            self._control("quit", timeout=2.0)
        if self._made_root and self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the daemon and restore the environment; does nothing when it is not running."""
        if not self.running:
            return
        self.running = False
        client = _cuda_initialised()
        if client:
            # This process is a client itself: "quit" stops new clients and waits for the
            # current ones, so it is sent without waiting; the daemon goes when this process
            # does, and its folders stay until then.
            try:
                self._quitter = subprocess.Popen([CONTROL], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL, env={**os.environ, **self._env}, text=True,
                                                 start_new_session=True)
                assert self._quitter.stdin is not None
                self._quitter.stdin.write("quit\n")
                self._quitter.stdin.close()
            except OSError as e:
                log.warning("stopping the CUDA MPS daemon under %s: %s", self._root, e)
        else:
            try:
                self._control("quit")
            except MpsUnavailable as e:
                log.warning("stopping the CUDA MPS daemon under %s: %s", self._root, e)
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._made_root and self._root is not None and not client:
            shutil.rmtree(self._root, ignore_errors=True)
        log.info("CUDA MPS daemon under %s %s", self._root,
                 "told to quit once this process (a client) exits" if client else "stopped")
