"""The RL loop: keep the queue full, take batches of groups, train, publish the next version.

Two modes share everything but the schedule:

- ``async`` (rollq's): a submitter task keeps the next steps' jobs queued ahead of the
  trainer, fire-and-forget, under the queue's staleness bound
  (:meth:`~rollq.producer.client.Producer.set_staleness_bound`: at most
  ``(max_lag + version + 1) * groups_per_step`` jobs ever admitted). Replicas keep generating
  while the trainer trains and publishes; in-flight jobs continue across a new version
  (update policy ``keep``).
- ``sync`` (the baseline of a generate / stop / update loop): submit one batch that needs the
  current version (``min_version``), wait for all of it, train, publish, repeat.

Step ``s`` trains on the groups of batch ``s`` (results of later batches that finish first
wait in a buffer). Batch ``k`` is admitted once version ``k - max_lag`` is published and
carries ``min_version = k - max_lag``, so no replica starts it on older weights (a replica
still loading a version does not count): every group trained on has a policy lag (trainer
version minus the version its generation started at) of at most ``max_lag``.

Why the async loop cannot deadlock on its bound: the submitter submits one call of
``groups_per_step`` jobs per batch; the step that makes version ``v + 1`` needs batch ``v``,
i.e. ``(v + 1) * groups_per_step`` admitted jobs, and at version ``v`` the bound admits
``(max_lag + v + 1) * groups_per_step >=`` that for any ``max_lag >= 0``; batch ``v``'s
``min_version`` is at most ``v``, which is published. Failed jobs count toward their batch
and are left out of the loss. (The bound counts jobs since the queue's first admission and
versions from 0: for a run that starts at ``trainer.version = v0`` on a fresh queue the loop
sets ``max_lag - v0``, exact while ``v0 <= max_lag``; beyond that the bound is looser and
``min_version``, which replicas honour without holding capacity, keeps the lag.)

A multi-turn task (one with ``follow_up``, e.g. :class:`~rollq.rl.tasks.TwoTurnTask`) plays
episodes instead (:func:`~rollq.rl.episodes.play_group`): one job per turn, the next turn's
job submitted when the previous turn's result is back, a step's groups
:class:`~rollq.rl.episodes.EpisodeGroup` of whole episodes, trained on with
:meth:`~rollq.rl.grpo.GrpoTrainer.step_episodes`. The bound then counts every turn's job
(``task.jobs_per_group`` per group), and the player admits batch ``k + 1``'s first turns only
after batch ``k``'s last turns, so jobs are admitted in batch order and the argument above
holds with the batch's job count in place of ``groups_per_step``. Turns of one episode may
run at different versions (a version published between them): that is what the episodes
carry per token.

``publish=False`` is the negative control: the trainer trains every step but no version is
published, so the replicas keep sampling from the initial weights and the reward must stay
at the random policy's level. Nothing then waits on a version: no staleness bound, no
``min_version``, every batch is submitted at once (async) or as the step comes (sync).

>>> (await run_loop(url, "grpo", trainer, task, tok, publisher, LoopConfig(steps=40))).summary()["reward_last"]  # doctest: +SKIP
0.99
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from functools import partial
from typing import Any, AsyncIterator, Callable, Sequence

from .._tasks import stop_task
from .episodes import EpisodeGroup, play_group
from .loop_config import LoopConfig
from .report import LoopReport, StepRecord, busy_fraction, mean
from .task import observe_groups, training_rewards

log = logging.getLogger(__name__)

__all__ = ["LoopConfig", "LoopReport", "StepRecord", "run_loop", "busy_fraction"]


# ----------------------------------------------------------------------------------------
async def run_loop(
    url: str,
    queue: str,
    trainer: Any,
    task: Any,
    tokenizer: Any,
    publisher: Any,
    config: LoopConfig,
    *,
    on_step: Callable[[StepRecord], None] | None = None,
    producer_id: str = "rl-trainer",
) -> LoopReport:
    """Run ``config.steps`` steps of GRPO through the queue (see the module doc).

    ``trainer`` is a :class:`~rollq.rl.grpo.GrpoTrainer` (None: queue only, nothing trained or
    published, e.g. on the echo engine), ``task`` a :class:`~rollq.rl.task.BucketTask` or one of
    :mod:`rollq.rl.tasks` (``job_specs``, ``rewards``, ``prompt_of``, ``random_policy_reward``; a
    :class:`~rollq.rl.task.ShapedTask` trains on its ``training_rewards`` and reports ``rewards``;
    an :class:`~rollq.rl.task.AdaptiveTask` hears how each step's groups went; a multi-turn task
    has ``follow_up`` and ``jobs_per_group`` and is played in episodes),
    ``publisher`` a :class:`~rollq.weightsync.trainer.publisher.WeightPublisher` (with a broadcast
    ``sender`` for ``transport="broadcast"``; unused, may be None, with ``publish=False``).
    ``on_step`` is called after every step. One function on purpose: it reads top to bottom as
    the algorithm (submit, wait for the step's batch, train, publish; the async submitter is
    :func:`_submit_all`).
    """
    from ..producer.client import Producer

    rng = random.Random(config.seed)
    B = config.groups_per_step
    episodic = hasattr(task, "follow_up")
    jobs_per_step = B * (task.jobs_per_group(config.group_size) if episodic else 1)
    steps: list[StepRecord] = []
    jobs: list[tuple[str, float, float]] = []
    async with Producer(url, queue, producer_id=producer_id) as p:
        await p.set_update_policy(config.update_policy)
        # Versions reach the replicas only when published: without that nothing waits on one.
        versioned = trainer is not None and config.publish
        bounded = config.mode == "async" and versioned
        # The bound counts versions from 0: a run starting at version v0 (its weights published
        # to replicas that held others) is bounded with max_lag - v0 (see the module doc).
        bound = max(0, config.max_lag - trainer.version) if bounded else None
        await p.set_staleness_bound(bound, jobs_per_step)
        t_start, w_start = time.perf_counter(), time.time()
        submitter: asyncio.Task | None = None
        batch_of: dict[str, int] = {}  # job id -> batch index
        buffered: dict[int, list[Any]] = {}
        # Episodes come from the player through this queue; results from the producer's stream.
        played: asyncio.Queue[EpisodeGroup] = asyncio.Queue()
        if config.mode == "async":
            # Batch k needs version v0 + k - max_lag (no trainer: no versions to wait for).
            base = trainer.version - config.max_lag if versioned else None
            feed = (_play_all(p, task, tokenizer, rng, config, played, base, range(config.steps)) if episodic
                    else _submit_all(p, task, tokenizer, rng, config, batch_of, base))
            submitter = asyncio.create_task(feed, name="rl-submitter")
        results = (_drain(played, config.result_timeout) if episodic else p.results(timeout=config.result_timeout)).__aiter__()
        try:
            for step in range(config.steps):
                version = trainer.version if trainer is not None else 0
                t0 = time.perf_counter()
                if config.mode == "sync" and episodic:  # this batch's episodes start on the current version
                    base = version - step if versioned else None  # batch `step` needs `version`
                    submitter = asyncio.create_task(
                        _play_all(p, task, tokenizer, rng, config, played, base, range(step, step + 1)), name="rl-player")
                elif config.mode == "sync":  # this batch runs on the current version
                    specs = task.job_specs(tokenizer, rng, B, config.group_size)
                    hs = await p.submit_many([_with(s, step, version if versioned else None) for s in specs])
                    batch_of.update((h.id, step) for h in hs)
                while len(buffered.get(step, ())) < B:
                    r = await _next(results, submitter, config.result_timeout)
                    k = batch_of.pop(r.id, None)
                    if k is None:  # arrived before submit_many returned: the job's meta says
                        k = r.meta.get("batch", step) if isinstance(r.meta, dict) else step
                    buffered.setdefault(k, []).append(r)
                batch = buffered.pop(step)
                wait_s = time.perf_counter() - t0
                ok = [r for r in batch if r.error is None]
                for r in batch:
                    if r.error is not None:
                        log.warning("job %s failed (%s: %s); left out of step %d", r.id, r.error.type, r.error.message, step)
                jobs.extend(span for r in ok for span in _job_spans(r))
                rewards = [task.rewards(r) for r in ok]  # exact: reported; `train`: the advantages' (shaping)
                train = training_rewards(task, ok, step, rewards)
                observe_groups(task, ok, rewards, step)
                counts = [_rollout_counts(r) for r in ok]
                tokens, swaps, spanning = (sum(c[i] for c in counts) for i in range(3))
                rec = StepRecord(
                    step=step, version=version, reward=mean([x for rw in rewards for x in rw]),
                    lags=[version - r.version_start for r in ok], wait_s=wait_s, train_s=0.0, publish_s=0.0,
                    elapsed_s=0.0, tokens=tokens, failed=len(batch) - len(ok), swap_tokens=swaps, spanning=spanning,
                    sample_versions=sorted({r.version_start for r in ok}),
                )
                if trainer is not None:
                    t1, c1 = time.perf_counter(), time.thread_time()
                    if ok:  # in a thread: the event loop keeps serving the replicas meanwhile
                        kw: dict[str, Any] = {"agreement": step % config.agree_every == 0}  # older versions' agreement forward
                        if config.publish and getattr(publisher, "ipc_lease", False):  # copies end before the step writes
                            kw["before_update"] = partial(_released, publisher, asyncio.get_running_loop())
                        if episodic:
                            st = await asyncio.to_thread(trainer.step_episodes, [g.episodes for g in ok], train, **kw)
                        else:
                            st = await asyncio.to_thread(trainer.step, [(task.prompt_of(tokenizer, r), r) for r in ok], train, **kw)
                        rec.loss, rec.clip_frac = st.loss, st.clip_frac
                        rec.diff_sum, rec.diff_max, rec.diff_tokens = st.diff_sum, st.diff_max, st.diff_tokens
                        rec.diff_by_lag, rec.loss_stats = st.diff_by_lag, dict(st.extra)
                        rec.diff_by_confidence, rec.agree_s = st.diff_by_confidence, st.agree_s
                    else:  # nothing to learn from; the next version is published all the same
                        trainer.advance()
                    t2, rec.loop_cpu_s = time.perf_counter(), time.thread_time() - c1
                    if config.publish:
                        await publisher.publish_weights(trainer.state_dict(), version=trainer.version, transport=config.transport)
                    rec.train_s, rec.publish_s = t2 - t1, time.perf_counter() - t2
                rec.elapsed_s = time.perf_counter() - t_start
                steps.append(rec)
                log.debug("step %d v%d reward %.3f lags %s wait %.3fs train %.3fs publish %.3fs",
                          step, version, rec.reward, Counter(rec.lags), wait_s, rec.train_s, rec.publish_s)
                if on_step is not None:
                    on_step(rec)
        finally:
            await stop_task(submitter)  # its error, if any, was raised by _next
            await p.set_staleness_bound(None)
        wall = time.perf_counter() - t_start
    return LoopReport(
        config=config, steps=steps, wall_s=wall, random_policy_reward=task.random_policy_reward,
        window=(w_start, time.time()), jobs=jobs, final_version=trainer.version if trainer is not None else 0,
    )


def _released(publisher: Any, loop: asyncio.AbstractEventLoop) -> None:
    """From the trainer's thread: the leased IPC version released once the replicas copied it."""
    asyncio.run_coroutine_threadsafe(publisher.release_weights(), loop).result()


async def _submit_all(
    p: Any, task: Any, tokenizer: Any, rng: random.Random, config: LoopConfig, batch_of: dict[str, int],
    base: int | None,
) -> None:
    """Submit every step's groups, one call per batch; the staleness bound holds calls back.
    Batch ``k`` needs version ``base + k`` (see the module doc; None: no version needed)."""
    for k in range(config.steps):
        specs = task.job_specs(tokenizer, rng, config.groups_per_step, config.group_size)
        floor = None if base is None else max(0, base + k)
        hs = await p.submit_many([_with(s, k, floor) for s in specs])
        batch_of.update((h.id, k) for h in hs)


async def _play_all(
    p: Any, task: Any, tokenizer: Any, rng: random.Random, config: LoopConfig, out: asyncio.Queue[EpisodeGroup],
    base: int | None, batches: range,
) -> None:
    """Play the episodes of ``batches`` (a multi-turn task), batch after batch: batch ``k``'s
    groups concurrently, every group's turns in order (:func:`~rollq.rl.episodes.play_group`),
    each finished group into ``out``. Batch ``k`` needs version ``base + k`` (None: none)."""
    for k in batches:
        floor = None if base is None else max(0, base + k)
        specs = [_with(s, k, floor) for s in task.job_specs(tokenizer, rng, config.groups_per_step, config.group_size)]

        async def one(spec: dict[str, Any]) -> None:
            out.put_nowait(await play_group(p, task, tokenizer, spec))

        await asyncio.gather(*(one(s) for s in specs))


async def _drain(q: asyncio.Queue[EpisodeGroup], timeout: float) -> AsyncIterator[EpisodeGroup]:
    """The groups put in ``q``; stops after ``timeout`` seconds without one."""
    while True:
        try:
            yield await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            return


def _job_spans(r: Any) -> list[tuple[str, float, float]]:
    """(replica, started, finished) of every job of a result or an episode group."""
    return [(x.replica, x.started, x.finished) for x in (r.results if isinstance(r, EpisodeGroup) else [r])]


def _rollout_counts(r: Any) -> tuple[int, int, int]:
    """Generated tokens, tokens of another version than their sample's first (:func:`_swap_tokens`)
    and samples generated by more than one version, of a result or an episode group."""
    if isinstance(r, EpisodeGroup):
        return (sum(sum(e.loss_mask) for e in r.episodes), sum(e.swap_tokens for e in r.episodes),
                sum(len(e.versions_used) > 1 for e in r.episodes))
    swaps = [_swap_tokens(s.token_versions(r.version_start)) for s in r.samples]
    return sum(len(s.tokens) // 4 for s in r.samples), sum(swaps), sum(x > 0 for x in swaps)


def _swap_tokens(versions: Sequence[int]) -> int:
    """Tokens of one sample whose version is not its first token's (-1, unknown, counts).

    >>> _swap_tokens([3, 3, 4, 4]), _swap_tokens([3, -1]), _swap_tokens([])
    (2, 1, 0)
    """
    return sum(v != versions[0] for v in versions) if versions else 0


def _with(spec: dict[str, Any], batch: int, min_version: int | None) -> dict[str, Any]:
    """``spec`` tagged with its batch (in ``meta``) and, if given, the version it needs."""
    out = dict(spec, meta={**spec.get("meta", {}), "batch": batch})
    if min_version:
        out["min_version"] = min_version
    return out


async def _next(results: Any, submitter: asyncio.Task | None, timeout: float) -> Any:
    """The next result; raises the submitter's error if it failed first, TimeoutError after ``timeout``."""
    nxt = asyncio.ensure_future(results.__anext__())
    waiting = {nxt} if submitter is None or submitter.done() else {nxt, submitter}
    if submitter is not None and submitter.done() and submitter.exception() is not None:
        nxt.cancel()
        raise submitter.exception()  # type: ignore[misc]
    while True:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            try:
                return nxt.result()
            except StopAsyncIteration:
                raise TimeoutError(
                    f"no result for {timeout:.0f}s (LoopConfig.result_timeout): are the replicas running?"
                ) from None
        if submitter is not None and submitter in done:
            if submitter.exception() is not None:
                nxt.cancel()
                raise submitter.exception()  # type: ignore[misc]
            waiting = {nxt}
