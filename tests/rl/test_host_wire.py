"""The messages between the trainer and the replicas' host process: typed, framed, bounded."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rollq.errors import ProtocolError, SchemaVersionError
from rollq.rl.host_wire import (
    MAX_FRAME, Attach, Cancel, HostConfig, Reply, Snapshot, Stop, WaitVersion, decode_call, decode_config, decode_reply,
    encode, frame, read_frame, seq_of,
)
from rollq.rl.replicas import ReplicaSnapshot
from rollq.weightsync.replica._stats import UpdateStats


@pytest.mark.parametrize("call", [Attach(queue="q", weights_root="/dev/shm/w", abort_resume=True, seq=4), WaitVersion(3, 0.5, 9),
                                  Snapshot(seq=2**62), Stop(), Cancel(target=9, seq=10)])
def test_every_call_round_trips(call):
    assert decode_call(encode(call)) == call


def test_a_reply_brings_the_updates_back_typed():
    st = UpdateStats(version=4, policy="keep", transport="ipc", update_s=0.05, pause_s=0.01,
                     load={"copy_s": 0.002, "buckets": [1, 2]}, timings={"woke_at": 10.0})
    snap = ReplicaSnapshot(versions=[4], generated_tokens=512, served_dtype="float32", updates=[st], start_s=31.5, model="m")
    back = decode_reply(encode(Reply(ok=True, snapshot=snap)))
    assert back.snapshot == snap and isinstance(back.snapshot.updates[0], UpdateStats)
    assert back.snapshot.updates[0].waits() == st.waits()


def test_the_config_carries_the_replicas_arguments():
    cfg = decode_config(encode(HostConfig(url="redis://127.0.0.1:1", queue="q", count=2, cpu_binds=["1", None], pin=[0])))
    kw = cfg.replicas_kwargs()
    assert kw["count"] == 2 and kw["cpu_binds"] == ["1", None] and "pin" not in kw and "url" not in kw
    assert "max_model_len" not in kw and "engine" not in kw  # unset: Replicas' own defaults apply


@pytest.mark.parametrize("data, error", [
    (b"\xc1", ProtocolError),                                     # not msgpack
    (msgspec.msgpack.encode({"type": "reboot"}), ProtocolError),  # an unknown call
    (msgspec.msgpack.encode({"type": "wait_version", "version": "three"}), ProtocolError),
    (msgspec.msgpack.encode([[[[[]]]]] * 3), ProtocolError),
    (b"\x91" * 100_000 + b"\xc0", ProtocolError),                 # nested 100,000 deep
    (msgspec.msgpack.encode({"type": "stop", "v": 1}), SchemaVersionError),  # an older peer
])
def test_bad_bytes_are_a_protocol_error(data, error):
    with pytest.raises(error):
        decode_call(data)


def test_the_number_of_a_call_that_does_not_decode_is_read_where_it_can_be():
    assert seq_of(msgspec.msgpack.encode({"type": "reboot", "seq": 41})) == 41
    assert seq_of(msgspec.msgpack.encode({"type": "wait_version", "version": "three", "seq": 5})) == 5
    for data in (b"\xc1", msgspec.msgpack.encode({"seq": "x"}), msgspec.msgpack.encode({"seq": -1}),
                 msgspec.msgpack.encode({"seq": 2**64 - 1}), b"\x91" * 100_000 + b"\xc0"):
        assert seq_of(data) == 0


def test_a_config_of_another_version_is_refused():
    with pytest.raises(SchemaVersionError, match="version 7"):
        decode_config(encode(HostConfig(url="u", queue="q", v=7)))


async def test_frames_are_read_whole_and_bounded():
    reader = asyncio.StreamReader()
    reader.feed_data(frame(b"abc") + frame(b""))
    reader.feed_data((MAX_FRAME + 1).to_bytes(4, "big"))
    reader.feed_eof()
    assert await read_frame(reader) == b"abc" and await read_frame(reader) == b""
    with pytest.raises(ProtocolError, match="over the limit"):
        await read_frame(reader)
    with pytest.raises(ProtocolError):
        frame(b"x" * (MAX_FRAME + 1))


async def test_a_cut_frame_is_the_end_of_the_stream():
    reader = asyncio.StreamReader()
    reader.feed_data(frame(b"abcdef")[:6])
    reader.feed_eof()
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader)
