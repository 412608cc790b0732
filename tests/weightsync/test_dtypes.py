"""The served dtype is the one the trainer trains: a replica serves its checkpoint's dtype
unless its user names another, every version records its dtypes, a replica that converts
them says so (log, registry, ``rollq status``), and one it would round without being asked
is refused with ``WeightMismatch``."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import torch

from rollq import Producer
from rollq.consumer._vllm_api import checkpoint_dtype, resolve_dtype
from rollq.errors import WeightLoadFailed, WeightMismatch
from rollq.keys import QueueKeys
from rollq.status import queue_status
from rollq.weightsync import WeightPublisher
from rollq.weightsync.manifest import Manifest, check_state, conversion
from rollq.weightsync.versions import TensorMeta, read_load_errors, read_version
from tests.helpers import until
from tests.vllm_fixtures import checkpoint_state, serving_replica

session_loop = pytest.mark.asyncio(loop_scope="session")


# -- choosing the served dtype (no engine) ------------------------------------------------------
def test_auto_serves_the_checkpoints_dtype_off_the_cpu(tmp_path, tiny_model_path):
    # vLLM's own "auto" would serve this float32 checkpoint in bfloat16 on a GPU.
    assert checkpoint_dtype(str(tiny_model_path)) == "float32"
    assert resolve_dtype("auto", str(tiny_model_path), cpu=False) == "float32"
    assert resolve_dtype("auto", str(tiny_model_path), cpu=True) == "float32"
    assert resolve_dtype("bfloat16", str(tiny_model_path), cpu=False) == "bfloat16"
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert resolve_dtype("auto", str(bf16), cpu=False) == "bfloat16"
    assert resolve_dtype("auto", str(bf16), cpu=True) == "float32"  # bf16 crashes vLLM's CPU attention
    assert resolve_dtype("auto", str(tmp_path / "nowhere"), cpu=False) == "auto"  # vLLM decides, with a warning


def test_a_lossy_conversion_is_accepted_only_when_the_served_dtype_was_named():
    served = [TensorMeta("w", "float32", [2])]
    auto = Manifest(model="m", tensors=served, served_dtype="bfloat16")
    named = Manifest(model="m", tensors=served, served_dtype="bfloat16", dtype_named=True)
    state = [("w", torch.zeros(2))]
    with pytest.raises(WeightMismatch, match=r"dtype mismatch \(w: sent float32, served bfloat16\).*name"):
        check_state(state, auto)
    assert [n for n, _ in check_state(state, named)] == ["w"]
    assert conversion("float32", "bfloat16", True) == "rounded"
    assert conversion("bfloat16", "float32", True) == "exact"
    with pytest.raises(ValueError):
        conversion("bfloat16", "float32", False, checkpoint="float32")


# -- through real vLLM --------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="session")
async def named_float32(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    """The session engine's replica, its user having named float32 (what it serves anyway)."""
    asked = vllm_engine.config.dtype
    vllm_engine.config.dtype = "float32"
    try:
        async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
            yield consumer, follower, str(tmp_path / "w")
    finally:
        vllm_engine.config.dtype = asked


@pytest_asyncio.fixture(loop_scope="session")
async def auto_replica(vllm_engine, redis_url, queue, tmp_path):  # noqa: F811
    async with serving_replica(vllm_engine, redis_url, queue, str(tmp_path / "w")) as (consumer, follower):
        yield consumer, follower, str(tmp_path / "w")


@pytest.mark.vllm
@pytest.mark.slow
@session_loop
async def test_versions_record_their_dtypes_and_an_unasked_conversion_is_refused(auto_replica, vllm_engine, redis_url, queue, tiny_model_path):  # noqa: F811
    consumer, _, root = auto_replica
    assert vllm_engine.dtype == "float32"
    keys = QueueKeys(queue)
    base = checkpoint_state(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    unchecked = WeightPublisher(redis_url, queue, root=root, validate=False)
    try:
        rec = await pub.publish_weights(base)
        assert rec.dtypes == ["float32"]
        client = await pub.redis()
        assert (await read_version(client, keys)).dtypes == ["float32"]
        await pub.wait_for_replicas(rec.version, timeout=60)
        st = await queue_status(client, keys)
        (view,) = st.replicas
        assert view.info["served_dtype"] == "float32" and view.info["converted_from"] == []
        # bf16 weights into a replica whose user named no dtype: refused before the engine
        # sees them (the publisher checks; the replica checks too, for unchecked publishers).
        half = {k: v.to(torch.bfloat16) for k, v in base.items()}
        with pytest.raises(WeightMismatch, match="sent bfloat16, served float32"):
            await pub.publish_weights(half)
        bad = await unchecked.publish_weights(half)
        assert bad.dtypes == ["bfloat16"]
        with pytest.raises(WeightLoadFailed, match="WeightMismatch: .*sent bfloat16, served float32"):
            await pub.wait_for_replicas(bad.version, timeout=30)
        assert (await read_load_errors(client, keys))[consumer.id].error == "WeightMismatch"
        assert consumer.version == rec.version
    finally:
        await pub.close()
        await unchecked.close()


@pytest.mark.vllm
@pytest.mark.slow
@session_loop
async def test_a_named_dtype_converts_and_says_so(named_float32, vllm_engine, redis_url, queue, tiny_model_path, caplog):  # noqa: F811
    consumer, _, root = named_float32
    keys = QueueKeys(queue)
    base = checkpoint_state(tiny_model_path)
    pub = WeightPublisher(redis_url, queue, root=root)
    try:
        half = {k: v.to(torch.bfloat16) for k, v in base.items()}
        with caplog.at_level("WARNING", logger="rollq.weightsync.replica.follower"):
            rec = await pub.publish_weights(half)  # the replica named float32: bf16 is taken, converted
            await pub.wait_for_replicas(rec.version, timeout=60)
            assert consumer.converted_from == ["bfloat16"]
            rec2 = await pub.publish_weights(half)
            await pub.wait_for_replicas(rec2.version, timeout=60)
        said = [r for r in caplog.records if "converted to float32" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]  # once, not per version
        await consumer.announce()
        st = await queue_status(await pub.redis(), keys)
        assert st.replicas[0].info["converted_from"] == ["bfloat16"]
        async with Producer(redis_url, queue) as p:
            r = await (await p.submit(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 3})).result(timeout=60)
        assert r.policy_version == (rec2.version, rec2.version)
        rec3 = await pub.publish_weights(base)  # float32 again: nothing converted
        await until(lambda: consumer.version == rec3.version, 60, "the float32 version served")
        assert consumer.converted_from == []
    finally:
        await pub.close()
