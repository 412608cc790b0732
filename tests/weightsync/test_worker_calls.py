"""The typed stub for calls into vLLM workers (rollq/weightsync/replica/worker_calls.py): the RPC each
method makes, by name and keyword, and the typed results it returns or refuses."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import pytest
import torch

from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.weightsync.wire import (
    GroupInfo,
    Listen,
    MalformedReply,
    Progress,
    StageStatus,
    State,
    Swap,
    SwapReport,
    SwapTimes,
    WorkerStatus,
)
from rollq.weightsync.replica.worker_calls import WorkerCalls, WorkerRpc
from rollq.weightsync.worker.ext import RollqWorkerExtension

INFO = GroupInfo(id="g1", host="127.0.0.1", port=29500, world_size=2, backend="gloo", timeout=10.0)
LISTEN = Listen(url="redis://x", channel="c", offer_key="o", field="r/")


class RecordingEngine:
    """A WorkerEngine of two workers that records each call and answers ``reply``."""

    def __init__(self, reply: Any):
        self.reply = reply
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any], float | None]] = []

    @property
    def num_workers(self) -> int:
        return 2

    async def call_workers(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        self.calls.append((method, args, kwargs, timeout))
        return self.reply

    async def pause(self, mode: str = "keep") -> None: ...

    async def resume(self) -> None: ...

    async def reset_prefix_cache(self) -> bool | None:
        return None

    def swap_progress(self, report: Progress | None) -> None:
        return None

    def progress_since(self) -> float:
        return 0.0


REPORT = {"swap": "shadow", "load_s": 0.5, "progress": {"tokens": {"r-0": 3}, "complete": True}}
STAGED = {"state": "staged", "version": 4, "stage_s": 0.25}
STATUS = {"state": "idle", "group": "g1", "joined": True, "rank": 1}
TIMES = {"version": 4, "enqueued_at": 10.0, "done_at": 10.5}

# (call, rpc, kwargs it sends, a worker's answer, what the stub returns for two such answers)
CASES = [
    (lambda w: w.load_memmap(root="/r", slot="slot-0", version=4, checksum="c"), WorkerRpc.LOAD_MEMMAP,
     {"root": "/r", "slot": "slot-0", "version": 4, "checksum": "c", "verify": True, "progress_since": 0.0}, REPORT,
     SwapReport(swap=Swap.SHADOW, load_s=0.5, progress=Progress(tokens={"r-0": 3}, complete=True))),
    (lambda w: w.stage_memmap(root="/r", slot="slot-1", version=4, checksum="c", chunks_in_flight=0), WorkerRpc.STAGE_MEMMAP,
     {"root": "/r", "slot": "slot-1", "version": 4, "checksum": "c", "chunks_in_flight": 0}, STAGED,
     StageStatus(state=State.STAGED, version=4, stage_s=0.25)),
    (lambda w: w.staged_status(), WorkerRpc.STAGED_STATUS, {}, STAGED, StageStatus(state=State.STAGED, version=4, stage_s=0.25)),
    (lambda w: w.stage_ipc(handles=b"h", version=4, chunk_bytes=512), WorkerRpc.STAGE_IPC, {"handles": b"h", "version": 4, "chunk_bytes": 512, "keep_maps": True,
                                                                                         "high_priority": False, "direct": False}, STAGED,
     StageStatus(state=State.STAGED, version=4, stage_s=0.25)),
    (lambda w: w.ipc_status(), WorkerRpc.IPC_STATUS, {}, STAGED, StageStatus(state=State.STAGED, version=4, stage_s=0.25)),
    (lambda w: w.receive_status(), WorkerRpc.RECEIVE_STATUS, {}, STATUS, WorkerStatus(group="g1", joined=True, rank=1)),
    (lambda w: w.apply_staged(version=4), WorkerRpc.APPLY_STAGED, {"version": 4, "progress_since": 0.0}, REPORT,
     SwapReport(swap=Swap.SHADOW, load_s=0.5, progress=Progress(tokens={"r-0": 3}, complete=True))),
    (lambda w: w.swap_overlapped(version=5, commit_timeout=0.25, receive_timeout=5.0, start_timeout=0.05, programs=8),
     WorkerRpc.SWAP_OVERLAPPED,
     {"version": 5, "commit_timeout": 0.25, "receive_timeout": 5.0, "start_timeout": 0.05, "programs": 8, "progress_since": 0.0},
     {"swap": "overlap", "parts": 3}, SwapReport(swap=Swap.OVERLAP, parts=3)),
    (lambda w: w.swap_done(), WorkerRpc.SWAP_DONE, {}, TIMES, SwapTimes(version=4, enqueued_at=10.0, done_at=10.5)),
    (lambda w: w.version(), WorkerRpc.VERSION, {}, 7, 7),
    (lambda w: w.track_progress(), WorkerRpc.TRACK_PROGRESS, {}, True, True),
    (lambda w: w.weight_sample(name_contains="lm_head", offset=8), WorkerRpc.WEIGHT_SAMPLE,
     {"name_contains": "lm_head", "offset": 8}, [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]),
]


@pytest.mark.parametrize("call, rpc, kwargs, answer, decoded", CASES, ids=[c[1].name for c in CASES])
async def test_each_call_names_its_rpc_once_passes_keywords_and_decodes_one_result_per_worker(call, rpc, kwargs, answer, decoded):
    engine = RecordingEngine([answer, answer])
    got = await call(WorkerCalls(engine))
    assert engine.calls == [(rpc.value, (), kwargs, None)]
    assert got == [decoded, decoded]
    assert all(type(g) is type(decoded) for g in got)


async def test_every_swap_passes_the_engines_progress_since():
    """The calls that swap a version in tell the workers since when the replica waits for
    outputs (the engine's ``progress_since``), so their progress report leaves out requests
    ended before it; one that leaves out nothing (above) sends 0.0."""
    engine = RecordingEngine([REPORT])
    engine.progress_since = lambda: 1234.5  # type: ignore[method-assign]
    calls = WorkerCalls(engine)
    await calls.load_memmap(root="/r", slot="slot-0", version=4, checksum="c")
    await calls.apply_staged(version=4)
    engine.reply = [{"swap": "overlap", "parts": 3}]
    await calls.swap_overlapped(version=5, commit_timeout=0.25, receive_timeout=5.0, start_timeout=0.05)
    assert [c[2]["progress_since"] for c in engine.calls] == [1234.5] * 3


@pytest.mark.parametrize("call, rpc, kwargs, answer, decoded", CASES, ids=[c[1].name for c in CASES])
async def test_a_result_of_another_shape_is_refused_naming_the_call(call, rpc, kwargs, answer, decoded):
    bad = {"state": 7, "swap": "sideways", "version": "four", "enqueued_at": "x"} if isinstance(answer, dict) else {"not": "it"}
    with pytest.raises(MalformedReply, match=rpc.value):
        await call(WorkerCalls(RecordingEngine([answer, bad])))
    with pytest.raises(MalformedReply, match=f"{rpc.value}: the engine answered dict"):
        await call(WorkerCalls(RecordingEngine({"0": answer})))


async def test_join_and_leave_send_the_group_and_listen_as_msgpack_and_the_timeout_to_the_engine():
    engine = RecordingEngine([None, None])
    calls = WorkerCalls(engine)
    assert await calls.join_group(info=INFO, rank_offset=3, listen=LISTEN) is None
    assert await calls.join_group(info=INFO, rank_offset=0) is None
    await calls.leave_group(timeout=30)
    engine.reply = [True, False]
    assert await calls.track_progress(timeout=12) == [True, False]
    (m1, _, kw1, _), (m2, _, kw2, _), leave, track = engine.calls
    assert m1 == m2 == WorkerRpc.JOIN_GROUP.value
    assert msgspec.msgpack.decode(kw1["info"], type=GroupInfo) == INFO and kw1["rank_offset"] == 3
    assert msgspec.msgpack.decode(kw1["listen"], type=Listen) == LISTEN
    assert kw2["listen"] == b""
    assert leave == (WorkerRpc.LEAVE_GROUP.value, (), {}, 30) and track[0::3] == (WorkerRpc.TRACK_PROGRESS.value, 12)


def test_every_rpc_is_a_worker_method_that_takes_the_stubs_keywords():
    """The stub and the worker extension agree: each RPC names a method of the extension, and
    the keywords the stub sends bind to that method's parameters (a rename on either side fails here)."""
    for rpc in WorkerRpc:
        assert callable(getattr(RollqWorkerExtension, rpc.value, None)), rpc
    sent = {c[1]: c[2] for c in CASES}
    sent[WorkerRpc.JOIN_GROUP] = {"info": b"", "rank_offset": 0, "listen": b""}
    sent[WorkerRpc.LEAVE_GROUP] = {}
    sent[WorkerRpc.WATCH_IPC] = {"watch": b""}
    sent[WorkerRpc.UNWATCH_IPC] = {}
    assert set(sent) == set(WorkerRpc)
    for rpc, kwargs in sent.items():
        inspect.signature(getattr(RollqWorkerExtension, rpc.value)).bind(object(), **kwargs)


async def test_watch_sends_where_to_watch_as_msgpack():
    from rollq.weightsync.wire import IpcWatch

    engine = RecordingEngine([None, None])
    watch = IpcWatch(url="redis://127.0.0.1:1", channel="q:ctl", handles_key="q:wipc", status_key="q:wipcs", field="r0/",
                     poll=0.5, chunk_bytes=64, keep_maps=False)
    assert await WorkerCalls(engine).watch_ipc(watch=watch) == 2  # workers watching
    await WorkerCalls(engine).unwatch_ipc()
    (m1, _, kw1, _), stop = engine.calls
    assert m1 == WorkerRpc.WATCH_IPC.value and msgspec.msgpack.decode(kw1["watch"], type=IpcWatch) == watch
    assert stop == (WorkerRpc.UNWATCH_IPC.value, (), {}, None)


async def test_calls_through_fake_workers_return_typed_results():
    """The real worker extension answers each read-only call in the struct the stub decodes."""
    engine = FakeWorkerEngine(lambda: torch.nn.Sequential(torch.nn.Embedding(8, 4)), num_workers=2)
    calls = WorkerCalls(engine)
    assert await calls.version() == [0, 0]
    assert await calls.staged_status() == [StageStatus(), StageStatus()]
    assert await calls.swap_done() == [SwapTimes(), SwapTimes()]
    assert [s.state for s in await calls.receive_status()] == [State.IDLE, State.IDLE]
    weight = engine.workers[1].model_runner.model.module[0].weight
    assert (await calls.weight_sample(name_contains="weight", offset=4))[1] == weight.detach().reshape(-1)[4:8].tolist()
    assert await calls.weight_sample(name_contains="nothing") == [[], []]


async def test_a_swap_hands_the_workers_progress_to_the_engine_as_the_struct_it_crossed_in(redis_url, queue, tmp_path):
    """The swap progress keeps one form from the worker's report to ``Engine.swap_progress``:
    the :class:`~rollq.weightsync.wire.Progress` the stub decoded (no map in between)."""
    from rollq import Consumer, WeightSyncSettings
    from rollq.weightsync import WeightFollower, WeightPublisher

    class Recording(FakeWorkerEngine):
        def __init__(self, *a: Any, **kw: Any):
            super().__init__(*a, **kw)
            self.reports: list[Any] = []

        def swap_progress(self, report: Progress | None) -> None:
            self.reports.append(report)
            return None

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4))

    root = str(tmp_path / "w")
    pub = WeightPublisher(redis_url, queue, root=root)
    engine = Recording(model)
    follower = WeightFollower(Consumer(engine, redis_url, queue), WeightSyncSettings(root=root, reconcile_interval=0.2))
    try:
        await pub.publish_weights({k: torch.full_like(v, 2.0) for k, v in model().state_dict().items()})
        await follower.start()
        assert follower.consumer.version == 1
        assert engine.reports and all(type(r) is Progress for r in engine.reports), engine.reports
    finally:
        await follower.stop()
        await pub.close()
