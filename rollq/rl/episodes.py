"""Multi-turn episodes: one rollq job per turn, assembled into one token sequence for the trainer.

An episode is a prompt, the model's completion of it, the environment's answer, the model's
completion of all that, and so on. Every turn is its own job (its prompt is the whole episode
so far), so a weight update may land between two turns, or inside one: the turns of one
episode can come from different policy versions. :func:`assemble_episode` stitches the turns'
results back into one :class:`Episode`: the token ids of the whole sequence, the behavior
logprob and the policy version of every token, and a loss mask that marks the model's tokens
(the completions) apart from the prompt and the environment's tokens.

>>> from rollq.protocol import Result, Sample, pack_f32, pack_i32
>>> t1 = Result(id="a", version_start=3, version_end=3,
...             samples=[Sample(tokens=pack_i32([10, 11]), logprobs=pack_f32([-1.0, -2.0]))])
>>> t2 = Result(id="b", version_start=4, version_end=4,
...             samples=[Sample(tokens=pack_i32([12]), logprobs=pack_f32([-0.5]))])
>>> ep = assemble_episode([1, 2], [Turn(t1, observation=[7]), Turn(t2)])
>>> ep.token_ids, ep.loss_mask
([1, 2, 10, 11, 7, 12], [False, False, True, True, False, True])
>>> ep.versions, ep.versions_used
([-2, -2, 3, 3, -2, 4], [3, 4])
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..protocol import ErrorInfo, Result
from .behavior import SamplingTransformError, behavior_temperature

__all__ = ["NOT_GENERATED", "Episode", "EpisodeGroup", "Turn", "assemble_episode", "play_group"]

#: :attr:`Episode.versions` of a token the model did not generate (prompt, environment).
NOT_GENERATED = -2


@dataclass(frozen=True)
class Turn:
    """One turn of an episode: the job's result, which of its samples is this episode's, and
    the environment's tokens that follow the completion (empty after the last turn)."""

    result: Result
    sample: int = 0
    observation: Sequence[int] = ()


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn's completion lies in :attr:`Episode.token_ids` and where it came from."""

    start: int
    end: int
    job_id: str
    version_start: int
    version_end: int
    replica: str
    finish_reason: str | None


@dataclass(frozen=True)
class Episode:
    """A whole multi-turn episode as the trainer reads it (see the module doc).

    Every list has one entry per token of :attr:`token_ids`. ``logprobs`` holds the behavior
    logprob of each model token (NaN elsewhere); ``versions`` the policy version that
    generated each model token (``-1``: not known exactly; :data:`NOT_GENERATED` for prompt
    and environment tokens). ``prompt_len`` is the length of the first turn's prompt.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[bool]
    prompt_len: int
    turns: list[TurnSpan]
    #: The temperature every turn was sampled at (the trainer's ``log_softmax(logits / T)``).
    temperature: float = 1.0

    def completion(self, turn: int) -> list[int]:
        """The model's tokens of turn ``turn``."""
        s = self.turns[turn]
        return self.token_ids[s.start : s.end]

    def observation(self, turn: int) -> list[int]:
        """The environment's tokens after turn ``turn`` (before the next turn's completion)."""
        end = self.turns[turn + 1].start if turn + 1 < len(self.turns) else len(self.token_ids)
        return self.token_ids[self.turns[turn].end : end]

    @property
    def versions_used(self) -> list[int]:
        """The policy versions that generated the episode's model tokens, ascending (-1 when
        some token's version is not known exactly)."""
        return sorted({v for v, m in zip(self.versions, self.loss_mask) if m})

    @property
    def version_start(self) -> int:
        """The version the episode's first turn started at (its policy lag is counted from it)."""
        return self.turns[0].version_start

    @property
    def single_version(self) -> int | None:
        """The version that generated every model token, or None if several did (or one is
        not known): the episodes whose logprobs a trainer can recompute at one version."""
        used = self.versions_used
        return used[0] if len(used) == 1 and used[0] >= 0 else None

    @property
    def swap_tokens(self) -> int:
        """Model tokens whose version is not the first model token's (or is not known)."""
        vs = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return sum(v != vs[0] for v in vs) if vs else 0


def assemble_episode(prompt: Sequence[int], turns: Sequence[Turn]) -> Episode:
    """One :class:`Episode` from the first prompt and the turns in order: each turn's
    completion, then its observation. Raises ValueError for a sample without per-token
    logprobs and :class:`~rollq.rl.behavior.SamplingTransformError` for turns sampled at
    different temperatures (or with a transform the trainer cannot reproduce)."""
    if not turns:
        raise ValueError("an episode needs at least one turn")
    ids, lps, vers, mask = list(prompt), [math.nan] * len(prompt), [NOT_GENERATED] * len(prompt), [False] * len(prompt)
    spans, temps = [], set()
    for t in turns:
        r = t.result
        s = r.samples[t.sample]
        lp = s.token_logprobs
        toks = s.token_ids
        if lp is None or len(lp) != len(toks):
            raise ValueError(f"job {r.id!r}: turns need per-token logprobs (submit with sampling logprobs=0)")
        temps.add(behavior_temperature(r))
        spans.append(TurnSpan(start=len(ids), end=len(ids) + len(toks), job_id=r.id, version_start=r.version_start,
                              version_end=r.version_end, replica=r.replica, finish_reason=s.finish_reason))
        ids += toks
        lps += lp
        vers += s.token_versions(r.version_start)
        mask += [True] * len(toks)
        obs = list(t.observation)
        ids += obs
        lps += [math.nan] * len(obs)
        vers += [NOT_GENERATED] * len(obs)
        mask += [False] * len(obs)
    if len(temps) > 1:
        raise SamplingTransformError(f"temperature: the turns of one episode were sampled at {sorted(temps)}")
    return Episode(token_ids=ids, logprobs=lps, versions=vers, loss_mask=mask, prompt_len=len(prompt), turns=spans,
                   temperature=temps.pop())


@dataclass(frozen=True)
class EpisodeGroup:
    """One GRPO group of episodes: those whose first turns are the samples of one job.

    ``id`` and ``meta`` are the first turn's job's; ``results`` every job the group ran, the
    first turn's first. ``error`` is the first failed job's error (then ``episodes`` is
    empty: a group with a failed turn is left out of the loss, as a failed job is).
    """

    id: str
    meta: Any
    episodes: list[Episode] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    error: ErrorInfo | None = None

    @property
    def version_start(self) -> int:
        """The version the group's first turn started at."""
        return self.results[0].version_start if self.results else 0


async def play_group(producer: Any, task: Any, tokenizer: Any, spec: dict[str, Any]) -> EpisodeGroup:
    """Play one group of episodes through the queue: submit the first turn's job (``spec``,
    ``n`` samples: one episode each), then, turn after turn, one job per live episode, whose
    prompt ``task.follow_up`` makes from the episode so far; assemble the episodes.

    ``task.follow_up(tokenizer, prompt, turns)`` returns None when the episode is over, else
    ``(observation, spec)``: the environment's tokens after the last turn and the next turn's
    job (its prompt must be the episode so far, observation included). Follow-up jobs need at
    least the first job's ``min_version`` and carry its ``meta``. Waits with handles, so the producer's
    :meth:`~rollq.producer.client.Producer.results` iterator must not run meanwhile.
    """
    (h,) = await producer.submit_many([spec])
    first = await h.result(raise_error=False)
    done: list[Result] = [first]
    if first.error is not None:
        return EpisodeGroup(id=first.id, meta=first.meta, results=done, error=first.error)
    prompt = list(spec["prompt_token_ids"])
    playing = [[Turn(first, i)] for i in range(len(first.samples))]
    finished: list[list[Turn]] = []
    while playing:
        nxt = [task.follow_up(tokenizer, prompt, turns) for turns in playing]
        finished += [turns for turns, n in zip(playing, nxt) if n is None]
        live = [(turns, n) for turns, n in zip(playing, nxt) if n is not None]
        if not live:
            break
        hs = await producer.submit_many([_follow_spec(spec, n[1]) for _, n in live])
        rs = await asyncio.gather(*(x.result(raise_error=False) for x in hs))
        done += rs
        failed = next((r for r in rs if r.error is not None), None)
        if failed is not None:
            return EpisodeGroup(id=first.id, meta=first.meta, results=done, error=failed.error)
        playing = [turns[:-1] + [Turn(turns[-1].result, turns[-1].sample, obs), Turn(r, 0)]
                   for (turns, (obs, _)), r in zip(live, rs)]
    finished.sort(key=lambda turns: turns[0].sample)  # the first job's sample order
    episodes = [assemble_episode(prompt, turns) for turns in finished]
    return EpisodeGroup(id=first.id, meta=first.meta, episodes=episodes, results=done)


def _follow_spec(first: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A follow-up turn's job: ``spec`` needing at least the first job's ``min_version``, with
    the first job's ``meta`` under the follow-up's own.

    >>> _follow_spec({"min_version": 3, "meta": {"batch": 1}}, {"min_version": 5, "meta": {"env": 2}})
    {'min_version': 5, 'meta': {'batch': 1, 'env': 2}}
    """
    out = dict(spec)
    if first.get("min_version") is not None:
        out["min_version"] = max(first["min_version"], spec.get("min_version") or 0)
    if isinstance(first.get("meta"), dict):
        out["meta"] = {**first["meta"], **(spec.get("meta") or {})}
    return out
