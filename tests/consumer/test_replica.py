"""rollq.consumer.replica.Replica: engine, follower's first load, consumer; stopped in reverse;
what started is stopped again when a later part fails. A real vLLM engine goes through the same
class in the ``rollq consume`` tests (tests/helpers/vllm_replica.py)."""

from __future__ import annotations

import asyncio

import pytest

from rollq import EchoEngine, Replica, WeightSyncSettings
from rollq.errors import WeightSyncError
from rollq.weightsync.replica.follower import WeightFollower


class LoggedEngine(EchoEngine):
    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log

    async def start(self) -> None:
        self.log.append("engine start")
        await super().start()

    async def stop(self) -> None:
        self.log.append("engine stop")
        await super().stop()


class FakeFollower:
    """Stands in for the WeightFollower: logs, and raises from ``start`` when told to."""

    def __init__(self, log: list[str], replica: Replica, fail: bool = False):
        self.log, self.replica, self.fail = log, replica, fail

    async def start(self) -> None:
        # The consumer must not serve yet: the committed version loads first.
        self.log.append(f"follower start (consumer {self.replica.consumer.state})")
        if self.fail:
            raise WeightSyncError("the first load failed")

    async def stop(self) -> None:
        self.log.append("follower stop")


def logged_replica(redis_url: str, queue: str, log: list[str], *, fail_follower: bool = False, **kw) -> Replica:
    engine = kw.pop("engine", None) or LoggedEngine(log)
    r = Replica(engine, redis_url, queue, consumer_id="r0", **kw)
    r.follower = FakeFollower(log, r, fail=fail_follower)  # type: ignore[assignment]
    run = r.consumer.run

    async def logged_run(**kw):
        log.append("consumer run")
        try:
            return await run(**kw)
        finally:
            log.append("consumer stopped")

    r.consumer.run = logged_run  # type: ignore[method-assign]
    return r


async def wait_serving(r: Replica) -> None:
    async with asyncio.timeout(10):
        while r.consumer.state != "serving":
            await asyncio.sleep(0.01)


async def test_starts_engine_follower_consumer_and_stops_in_reverse(redis_url, queue):
    log: list[str] = []
    r = logged_replica(redis_url, queue, log)
    await r.start()
    await wait_serving(r)
    assert await r.stop(timeout=10)
    assert log == ["engine start", "follower start (consumer starting)", "consumer run", "consumer stopped",
                   "follower stop", "engine stop"]


async def test_run_in_the_foreground_stops_everything_when_the_consumer_returns(redis_url, queue):
    log: list[str] = []
    r = logged_replica(redis_url, queue, log)
    assert await r.run(burst=True) == 0  # an empty queue: burst returns at once
    assert log == ["engine start", "follower start (consumer starting)", "consumer run", "consumer stopped",
                   "follower stop", "engine stop"]


@pytest.mark.parametrize("how", ["start", "run"])
async def test_a_failed_follower_start_stops_the_engine(redis_url, queue, how):
    log: list[str] = []
    r = logged_replica(redis_url, queue, log, fail_follower=True)
    with pytest.raises(WeightSyncError, match="first load failed"):
        await (r.start() if how == "start" else r.run())
    # the follower's own start cleans up after itself; the replica stops the engine
    assert log == ["engine start", "follower start (consumer starting)", "engine stop"]
    assert r.consumer.state == "starting"  # it never pulled


async def test_a_failed_consumer_start_stops_the_follower_and_the_engine(redis_url, queue):
    log: list[str] = []
    r = logged_replica(redis_url, queue, log)

    async def setup_fails() -> None:
        raise ConnectionError("the consumer group could not be created")

    r.consumer._setup_redis = setup_fails  # type: ignore[method-assign]
    with pytest.raises(ConnectionError, match="consumer group"):
        await r.run()
    assert log == ["engine start", "follower start (consumer starting)", "consumer run", "consumer stopped",
                   "follower stop", "engine stop"]


async def test_an_engine_it_did_not_build_is_neither_started_nor_stopped(redis_url, queue):
    log: list[str] = []
    engine = LoggedEngine(log)
    await engine.start()
    r = logged_replica(redis_url, queue, log, engine=engine, own_engine=False)
    await r.start()
    await wait_serving(r)
    await r.stop(timeout=10)
    assert log == ["engine start", "follower start (consumer starting)", "consumer run", "consumer stopped",
                   "follower stop"]
    await engine.stop()


async def test_weights_give_the_replica_a_weight_follower(redis_url, queue, tmp_path):
    r = Replica(EchoEngine(), redis_url, queue, weights=WeightSyncSettings(root=str(tmp_path), reconcile_interval=0.2))
    assert isinstance(r.follower, WeightFollower) and r.follower.settings.root == str(tmp_path)
    assert Replica(EchoEngine(), redis_url, queue).follower is None
    async with r:
        await wait_serving(r)
        assert r.follower._task is not None and not r.follower._task.done()  # following
    assert r.follower._task.done()
