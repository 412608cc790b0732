"""live_replicas: registry records whose heartbeat key exists, decoded; dead or unreadable ones left out."""

import msgspec

from rollq.keys import QueueKeys
from rollq.protocol import ReplicaInfo
from rollq.replicas import live_replicas


def _info(rid: str, tp: int = 1) -> bytes:
    return msgspec.msgpack.encode(ReplicaInfo(
        id=rid, host="h", pid=1, engine="fake", model="m", device="cpu", version=3, inflight=0, cap=1,
        kv_usage=None, tokens_per_s=0.0, completed=0, failed=0, started_at=0.0, heartbeat_at=0.0,
        state="serving", tp_size=tp,
    ))


async def test_live_replicas(redis_client, queue):
    keys = QueueKeys(queue)
    assert await live_replicas(redis_client, keys) == {}
    await redis_client.hset(keys.consumers, mapping={"a": _info("a", tp=2), "b": _info("b"), "c": b"\xc1junk"})
    await redis_client.set(keys.heartbeat("a"), 1, ex=30)
    await redis_client.set(keys.heartbeat("c"), 1, ex=30)
    live = await live_replicas(redis_client, keys)
    assert list(live) == ["a"]
    assert live["a"].tp_size == 2 and live["a"].version == 3
    await redis_client.set(keys.heartbeat("b"), 1, ex=30)
    assert sorted(await live_replicas(redis_client, keys)) == ["a", "b"]
