"""Key names: one Redis Cluster slot per queue, names checked."""

from __future__ import annotations

import pytest

from rollq.consumer.engine import EchoEngine
from rollq.consumer.loop import Consumer
from rollq.errors import InvalidJob
from rollq.keys import PREFIX, QUEUES, QueueKeys, check_name
from rollq.producer.client import Producer

SLOTS = 16384


def crc16_xmodem(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str:
    """The part of a key Redis Cluster hashes: the first non-empty ``{...}``, else the key."""
    start = key.find("{")
    if start != -1:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot(key: str) -> int:
    return crc16_xmodem(hash_tag(key).encode()) % SLOTS


def test_crc16_matches_the_cluster_spec():
    # Reference value from the Redis Cluster specification.
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert slot("{user1000}.following") == slot("{user1000}.followers")
    assert slot("foo{}{bar}") == crc16_xmodem(b"foo{}{bar}") % SLOTS
    assert slot("foo{{bar}}zap") == crc16_xmodem(b"{bar") % SLOTS
    from redis.crc import key_slot

    for key in ("123456789", "rollq:{q}:jobs", "plain", "a{b}c{d}"):
        assert slot(key) == key_slot(key.encode())


def every_key(k: QueueKeys) -> list[str]:
    return [
        *k.all_static(),
        k.replica_jobs("replica-0"),
        k.job_stream("replica-1"),
        k.results("p-abc"),
        k.heartbeat("replica-0"),
        k.control,  # a channel, but sharded pub/sub would route it by slot too
        k.pattern(),
    ]


@pytest.mark.parametrize("queue", ["grpo", "default", "a", "Q.v2-run_7", "x" * 128])
def test_all_keys_of_a_queue_share_one_slot(queue):
    k = QueueKeys(queue)
    keys = every_key(k)
    assert k.job_stream(None) == k.jobs and k.job_stream("r") == k.replica_jobs("r")
    assert len(set(keys)) == len(keys), "two roles share a key name"
    assert all(key.startswith(f"{PREFIX}:") for key in keys)
    slots = {key: slot(key) for key in keys}
    assert set(slots.values()) == {crc16_xmodem(queue.encode()) % SLOTS}, slots
    # every key carries the tag itself, not a prefix that happens to hash alike
    assert all(hash_tag(key) == queue for key in keys)


def test_queues_are_separate():
    a, b = QueueKeys("alpha"), QueueKeys("beta")
    assert not set(every_key(a)) & set(every_key(b))
    assert a.pattern() != b.pattern()
    # the pattern of one queue does not match keys of a queue whose name extends it
    import fnmatch

    ab = QueueKeys("alpha-b")
    assert not any(fnmatch.fnmatchcase(key, a.pattern()) for key in every_key(ab) if key != ab.pattern())
    assert all(fnmatch.fnmatchcase(key, a.pattern()) for key in every_key(a) if key != a.pattern())


def test_the_registry_of_queues_is_the_one_global_key():
    import fnmatch

    assert QUEUES.startswith(f"{PREFIX}:") and hash_tag(QUEUES) == QUEUES  # no tag: one slot of its own
    for queue in ("queues", "default", "rollq"):
        k = QueueKeys(queue)
        assert QUEUES not in every_key(k) and not fnmatch.fnmatchcase(QUEUES, k.pattern())


BAD_NAMES = ["", "a b", "a{b", "a}b", "{x}", "a:b", "a*", "new\nline", "x" * 129, "ünï", None, 7, b"bytes"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_invalid_queue_names_are_refused(name):
    with pytest.raises(ValueError, match="invalid queue name"):
        QueueKeys(name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid queue name"):
        Producer("redis://127.0.0.1:1/0", queue=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid queue name"):
        Consumer(EchoEngine(), "redis://127.0.0.1:1/0", queue=name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n], ids=repr)
def test_invalid_producer_and_consumer_names_are_refused(name):
    with pytest.raises(ValueError, match="invalid producer name"):
        Producer("redis://127.0.0.1:1/0", queue="q", producer_id=name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid consumer name"):
        Consumer(EchoEngine(), "redis://127.0.0.1:1/0", queue="q", consumer_id=name)  # type: ignore[arg-type]


def test_valid_names_pass():
    for name in ("a", "A-z_0.9", "x" * 128):
        assert check_name("queue", name) == name


@pytest.mark.parametrize("name", ["a b", "x}{y", "r:1", "x" * 129], ids=repr)
def test_job_targeted_at_an_impossible_replica_is_refused(name):
    """No consumer can be named like this, so such a job would wait forever in a stream
    nobody reads: refuse it when it is built."""
    p = Producer("redis://127.0.0.1:1/0", queue="q")
    with pytest.raises(InvalidJob, match="replica"):
        p.build_job(prompt="hi", replica=name)


def test_tag_of_is_the_one_parser_of_key_names():
    from rollq.keys import QUEUES, tag_of

    for k in (QueueKeys("grpo"), QueueKeys("grpo", 7)):
        for key in (k.jobs, k.results("p}1"), k.cancel("a}b"), k.replica_jobs("r")):
            assert tag_of(key) == k.tag
    for bad in (QUEUES, "other:{grpo}:jobs", "rollq:{grpo"):
        with pytest.raises(ValueError, match="no queue's key"):
            tag_of(bad)
