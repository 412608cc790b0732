"""Bad input on the trainer side: state dicts checked against the served checkpoint's
manifest before anything is written, load failures reported (not retried every second),
``wait_for_replicas``, and jobs waiting for a version that cannot come."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import pytest_asyncio
import torch

from rollq import Consumer, ConsumerSettings, EchoEngine, Producer
from rollq.errors import VersionUnavailable, WeightLoadFailed, WeightMismatch, WeightSyncTimeout
from rollq.keys import QueueKeys
from rollq.testing.fake_workers import FakeWorkerEngine
from rollq.settings import WeightSyncSettings
from rollq.weightsync import VersionRecord, WeightFollower, WeightPublisher, commit_version, read_version
from rollq.weightsync.manifest import Manifest, check_state, read_manifest
from rollq.weightsync.versions import LoadError, read_load_errors
from tests.helpers import until
from tests.weightsync.test_vllm import PROMPT, greedy, perturbed
from tests.vllm_fixtures import checkpoint_digest, checkpoint_state, digest_changes, served_digest, serving_replica

session_loop = pytest.mark.asyncio(loop_scope="session")


def slots(root: str) -> list[str]:
    return sorted(f for f in os.listdir(root) if f.startswith("slot-")) if os.path.isdir(root) else []


# -- the check itself (pure functions) ---------------------------------------------------------
def test_manifest_from_safetensors_headers_and_the_accepted_forms(tiny_model_path):  # noqa: F811
    m = read_manifest(str(tiny_model_path))
    base = checkpoint_state(tiny_model_path)
    assert {t.name for t in m.tensors} == set(base) and len(m.tensors) == len(base)
    assert all(t.dtype == "float32" for t in m.tensors)
    assert read_manifest("echo") is None
    # served names, and the inner model's names (no "model." prefix), renamed
    assert dict(check_state(list(base.items()), m)).keys() == base.keys()
    bare = [(k.removeprefix("model."), v) for k, v in base.items()]
    assert [n for n, _ in check_state(bare, m)] == list(base)
    # a tied lm_head.weight the checkpoint lacks is dropped; an untied one is not
    tied_m = Manifest(model="tied", tensors=[t for t in m.tensors if t.name != "lm_head.weight"])
    tied = dict(base, **{"lm_head.weight": base["model.embed_tokens.weight"]})
    assert "lm_head.weight" not in dict(check_state(list(tied.items()), tied_m))
    with pytest.raises(WeightMismatch, match=r"1 unexpected \(lm_head.weight\).*differs from embed_tokens"):
        check_state(list(base.items()), tied_m)
    # every kind of mismatch is named, the first few of each
    bad = dict(base)
    bad["model.norm.weight"] = torch.zeros(129)
    bad["lm_head.weight"] = bad["lm_head.weight"].half()
    bad["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    del bad["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(WeightMismatch) as ei:
        check_state(list(bad.items()), m)
    msg = str(ei.value)
    assert "1 missing (model.layers.0.mlp.down_proj.weight)" in msg
    assert "1 unexpected (model.layers.9.mlp.up_proj.weight)" in msg
    assert "model.norm.weight: sent [129], served [128]" in msg
    assert "lm_head.weight: sent float16, served float32" in msg
    many = {f"x.{i}": torch.zeros(1) for i in range(20)}
    with pytest.raises(WeightMismatch, match=r"20 unexpected \(x.0, x.1, x.2, x.3, x.4, and 15 more\)"):
        check_state(list(dict(base, **many).items()), m)


async def test_expected_manifest_refuses_a_mismatch_before_writing_anything(redis_url, queue, tmp_path, tiny_model_path):  # noqa: F811
    root = str(tmp_path / "w")
    pub = WeightPublisher(redis_url, queue, root=root, expected=str(tiny_model_path))
    base = checkpoint_state(tiny_model_path)
    with pytest.raises(WeightMismatch, match="model.norm.weight: sent"):
        await pub.publish_weights(dict(base, **{"model.norm.weight": torch.zeros(3)}))
    assert slots(root) == [] and await read_version(await pub.redis(), pub.keys) is None
    rec = await pub.publish_weights({k.removeprefix("model."): v for k, v in base.items()})  # renamed, published
    assert rec.version == 1 and rec.num_tensors == len(base)
    assert WeightPublisher(redis_url, queue, root=root, validate=False, expected=str(tiny_model_path)).validate is False
    await pub.close()


# -- load failures with fake workers --------------------------------------------------------
def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4))


async def test_transient_load_failure_is_retried_a_bounded_number_of_times_and_reported(redis_url, queue, tmp_path):
    root = str(tmp_path / "w")
    keys = QueueKeys(queue)
    pub = WeightPublisher(redis_url, queue, root=root)
    state = {k: torch.full_like(v, 1.0) for k, v in small_model().state_dict().items()}
    await pub.publish_weights(state)
    fast = dict(heartbeat_interval=0.2, lease_ttl=2.0, block=0.1)
    consumer = Consumer(FakeWorkerEngine(small_model), redis_url, queue, consumer_id="r0", settings=ConsumerSettings(**fast))
    follower = WeightFollower(consumer, WeightSyncSettings(root=root, reconcile_interval=0.1, load_retries=2, load_retry_delay=0.05))
    echo = Consumer(EchoEngine(), redis_url, queue, consumer_id="no-follower", settings=ConsumerSettings(**fast))
    await follower.start()
    tasks = [asyncio.create_task(consumer.run())]
    try:
        assert await pub.wait_for_replicas(1, timeout=10) == {"r0": 1}
        # Version 2 was broadcast without this replica and has no memmap copy: it cannot load it.
        c = await pub.redis()
        await commit_version(c, keys, VersionRecord(version=2, transport="nccl", checksum="0", num_tensors=2, nbytes=0))
        with pytest.raises(WeightLoadFailed, match=r"r0 \(version 2: WeightSyncError: .*did not receive it") as ei:
            await pub.wait_for_replicas(2, timeout=20)
        err = ei.value.failures["r0"]
        assert (err.version, err.attempts, err.final) == (2, 3, True)  # the first try and 2 retries
        await asyncio.sleep(1.0)  # ten reconcile intervals: not tried again
        assert (await read_load_errors(c, keys))["r0"].attempts == 3
        assert consumer.version == 1
        # A replica that never follows versions (no weight sync) is a laggard: the timeout names it.
        tasks.append(asyncio.create_task(echo.run()))
        await until(lambda: c.exists(keys.heartbeat("no-follower")), 5, "the second replica's lease")
        # a good version 3 loads and clears r0's error; the echo replica stays behind
        await pub.publish_weights(state)
        with pytest.raises(WeightSyncTimeout, match=r"timed out after 1.0s \(wait_for_replicas timeout=\): no-follower \(at version 0\)"):
            await pub.wait_for_replicas(3, timeout=1.0)
        assert await pub.wait_for_replicas(3, timeout=10, replicas=["r0"]) == {"r0": 3}
        assert await read_load_errors(c, keys) == {}
    finally:
        consumer.stop()
        echo.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        await follower.stop()
        await pub.close()


# -- through real vLLM ------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="session")
async def replica(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    root = str(tmp_path / "w")
    settings = ConsumerSettings(lease_ttl=5, heartbeat_interval=0.2, block=0.2, max_uncommitted_wait=0.5)
    async with serving_replica(vllm_engine, redis_url, queue, root, settings=settings, consumer_id="vllm-0") as (consumer, follower):
        c = consumer.keys
        client = follower._client
        await until(lambda: client.exists(c.heartbeat(consumer.id)), 10, "the replica's lease")
        yield consumer, follower, root


@pytest.mark.vllm
@pytest.mark.slow
@session_loop
async def test_mismatched_state_dicts_are_refused_before_any_replica_is_touched(replica, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, follower, root = replica
    keys = QueueKeys(queue)
    base = checkpoint_state(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    client = await pub.redis()
    published = msgspec.msgpack.decode(await client.hget(keys.manifests, "vllm-0"), type=Manifest)
    assert len(published.tensors) == len(base) and published.model == str(tiny_model_path)
    wrong_shape = dict(base, **{"model.norm.weight": torch.zeros(64)})
    wrong_dtype = dict(base, **{"model.layers.1.mlp.up_proj.weight": base["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)})
    unknown = dict(base, **{"model.layers.7.self_attn.q_proj.weight": torch.zeros(4, 4)})
    missing = {k: v for k, v in base.items() if k != "lm_head.weight"}
    for state, match in (
        (wrong_shape, r"shape mismatch \(model.norm.weight: sent \[64\], served \[128\]\)"),
        (wrong_dtype, r"dtype mismatch \(model.layers.1.mlp.up_proj.weight: sent bfloat16, served float32\)"),
        (unknown, r"unexpected \(model.layers.7.self_attn.q_proj.weight\)"),
        (missing, r"missing \(lm_head.weight\)"),
    ):
        with pytest.raises(WeightMismatch, match=match):
            await pub.publish_weights(state)
    assert slots(root) == [] and await read_version(client, keys) is None and consumer.version == 0
    async with Producer(redis_url, queue) as p:
        before, _ = await greedy(p)
        # the weights vLLM loaded from the checkpoint at start (every earlier test left them so)
        digest = checkpoint_digest(consumer.engine)
        assert not digest_changes(digest, await served_digest(consumer.engine))
        # the inner model's names (as TorchRL sends them), perturbed: loaded, output changes
        rec = await pub.publish_weights({k.removeprefix("model."): v for k, v in perturbed(base, 1).items()})
        assert await pub.wait_for_replicas(rec.version, timeout=60) == {"vllm-0": rec.version}
        changed, span = await greedy(p)
        assert changed != before and span == (rec.version, rec.version)
        # a full Hugging Face state dict (tied buffers and all): loaded, output restored
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).state_dict()
        rec2 = await pub.publish_weights(hf)
        await pub.wait_for_replicas(rec2.version, timeout=60)
        # The load path restored the weights bit for bit; only then is the output compared, so
        # a difference after this line is the engine's nondeterminism, not a load that missed.
        changes = digest_changes(digest, await served_digest(consumer.engine))
        assert not changes, f"republishing the checkpoint did not restore the served weights: {changes}"
        assert (await greedy(p))[0] == before, "same weights bit for bit, different greedy output: engine nondeterminism"
    await pub.close()


@pytest.mark.vllm
@pytest.mark.slow
@session_loop
async def test_a_version_that_fails_to_load_is_reported_once_and_the_replica_keeps_serving(replica, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, follower, root = replica
    keys = QueueKeys(queue)
    base = checkpoint_state(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    unchecked = WeightPublisher(redis_url, queue, root=root, validate=False)
    client = await pub.redis()
    loads = 0
    real_apply = follower.apply

    async def counting_apply(*a, **kw):
        nonlocal loads
        loads += 1
        return await real_apply(*a, **kw)

    follower.apply = counting_apply
    async with Producer(redis_url, queue) as p:
        rec1 = await pub.publish_weights(base)
        await pub.wait_for_replicas(rec1.version, timeout=60)
        good, _ = await greedy(p)
        digest = await served_digest(consumer.engine)
        loads_before = loads
        # Committed without the check: its memmap slot holds model.norm.weight of the wrong shape.
        bad = await unchecked.publish_weights(dict(base, **{"model.norm.weight": torch.ones(64)}))
        t0 = time.monotonic()
        with pytest.raises(WeightLoadFailed, match=r"vllm-0 \(version 2: WeightMismatch: .*model.norm.weight: sent \[64\], served \[128\]"):
            await pub.wait_for_replicas(bad.version, timeout=30)
        assert time.monotonic() - t0 < 10
        err = (await read_load_errors(client, keys))["vllm-0"]
        assert isinstance(err, LoadError) and (err.version, err.error, err.final) == (bad.version, "WeightMismatch", True)
        await asyncio.sleep(2.0)  # four reconcile intervals
        assert (await read_load_errors(client, keys))["vllm-0"].attempts == 1
        assert loads == loads_before and consumer.version == rec1.version  # the engine never saw version 2
        served, span = await greedy(p)
        assert served == good and span == (rec1.version, rec1.version)
        # Jobs needing the unloadable version fail at once; one beyond anything published, soon.
        h_bad = await p.submit(**PROMPT, min_version=bad.version)
        with pytest.raises(VersionUnavailable, match=r"cannot load policy version 2.*WeightMismatch"):
            await h_bad.result(timeout=10)
        h_far = await p.submit(**PROMPT, min_version=2**62)
        with pytest.raises(VersionUnavailable, match="beyond the newest committed version 2"):
            await h_far.result(timeout=10)
        # A good newer version loads, clears the report, and the replica serves it.
        rec3 = await pub.publish_weights(base)
        await pub.wait_for_replicas(rec3.version, timeout=60)
        assert await read_load_errors(client, keys) == {}
        changes = digest_changes(digest, await served_digest(consumer.engine))
        assert not changes, f"republishing the checkpoint did not restore the served weights: {changes}"
        assert (await greedy(p))[0] == good, "same weights bit for bit, different greedy output: engine nondeterminism"
    await pub.close()
    await unchecked.close()

