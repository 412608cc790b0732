"""``rollq demo --task length``: write ``L`` tokens from the named quarter, then stop.

The prompt names a quarter ``q`` of the vocabulary and a length ``L`` in
``min_length .. max_length`` (``"2222" + "5555"``: quarter 2, five tokens). Sampling stops
at EOS (``ignore_eos`` off, ``max_tokens = max_length + 1``), so completions have different
lengths: the task exercises EOS, padding and masking and length bias, which fixed-length
tasks never touch. The reward is the in-quarter fraction of the tokens before the stop
times whether the completion stopped after exactly ``L`` of them:

- a completion that holds an EOS id (:attr:`LengthTask.eos_ids`; vLLM ends it there), or
  whose ``finish_reason`` is ``"stop"``, stopped; its content is the tokens before the EOS;
- one cut at ``max_tokens`` (``finish_reason`` ``"length"``) did not stop and earns 0.

A uniform policy almost never stops (two EOS ids in 1024): its reward is close to 0.

>>> task = LengthTask(vocab_size=1024)
>>> task.reward(2, 3, [512, 600, 700, 3]), task.reward(2, 3, [512, 600, 3]), task.reward(2, 3, [512, 5, 700, 3])
(1.0, 0.0, 0.6666666666666666)
>>> task.reward(2, 3, [512, 600, 700, 701])       # no EOS: cut at max_tokens
0.0

That product is hard to learn from: each half of the skill (the quarter, the stop) earns
nothing unless the other half is right. :class:`Shaping` trains on a denser reward first
(:meth:`LengthTask.partial_reward`: half for the in-quarter fraction, half for stopping near
``L``) and anneals it into the exact one; :meth:`LengthTask.training_rewards` is what the
loop trains on, :meth:`LengthTask.rewards` (always the exact reward) what it reports.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..task import vocab_range
from .explore import Exploration

__all__ = ["LengthTask", "Shaping"]


@dataclass(frozen=True)
class Shaping:
    """A reward-shaping schedule: the weight of the exact reward in the reward trained on,
    ``0`` for the first ``hold`` steps, then rising linearly to ``1`` over ``anneal`` steps
    (the partial-credit reward has weight ``1 - weight``). With ``floor`` > 0 the partial
    credit keeps at least that weight for good (the exact weight tops out at ``1 - floor``), so
    near misses of the length still differ after the anneal.

    >>> sh = Shaping(hold=100, anneal=200)
    >>> [sh.weight(s) for s in (0, 100, 200, 300, 900)]
    [0.0, 0.0, 0.5, 1.0, 1.0]
    >>> [Shaping(hold=100, anneal=200, floor=0.25).weight(s) for s in (0, 200, 300, 900)]
    [0.0, 0.5, 0.75, 0.75]
    """

    #: Steps trained on the partial-credit reward alone.
    hold: int = 0
    #: Steps over which the exact reward's weight then rises from 0 to 1 (0: at once).
    anneal: int = 0
    #: The partial credit's weight never falls below this (0: the exact reward alone at the end).
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.hold < 0 or self.anneal < 0:
            raise ValueError(f"Shaping needs hold >= 0 and anneal >= 0, got {self.hold}, {self.anneal}")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"Shaping needs 0 <= floor < 1, got {self.floor}")

    def weight(self, step: int) -> float:
        """The exact reward's weight at ``step`` (0-based)."""
        if step < self.hold:
            return 0.0
        w = 1.0 if self.anneal == 0 else min(1.0, (step - self.hold) / self.anneal)
        return min(w, 1.0 - self.floor)


@dataclass(frozen=True)
class LengthTask:
    """Write exactly ``L`` tokens from quarter ``q`` and stop (see the module doc)."""

    #: The model's vocabulary size (ids ``0 .. vocab_size - 1`` can be sampled).
    vocab_size: int = 1024
    #: Equal contiguous ranges of the vocabulary; a prompt names one.
    quarters: int = 4
    min_length: int = 2
    max_length: int = 8
    #: Token ids that end a completion (the tiny model's ``<|im_end|>`` and ``<|endoftext|>``,
    #: its ``generation_config`` ``eos_token_id``).
    eos_ids: tuple[int, ...] = (3, 0)
    #: Times the quarter and the length are each written in the prompt.
    repeat: int = 4
    #: Train on a partial-credit reward first (:meth:`training_rewards`); None: on the exact one.
    shaping: Shaping | None = None
    #: Sample a prompt whose groups collapse onto a wrong answer hotter (:meth:`observe`);
    #: None: every training job at temperature 1.
    exploration: Exploration | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 2 <= self.quarters <= 10 or self.vocab_size < self.quarters:
            raise ValueError("LengthTask needs 2 <= quarters <= 10 and vocab_size >= quarters")
        if not 1 <= self.min_length <= self.max_length <= 9 or self.repeat < 1:
            raise ValueError("LengthTask needs 1 <= min_length <= max_length <= 9 and repeat >= 1")

    def quarter_of(self, token_id: int) -> int:
        """The quarter a token id belongs to."""
        return vocab_range(token_id, self.quarters, self.vocab_size)

    def content(self, token_ids: Sequence[int], finish_reason: str | None = None) -> list[int] | None:
        """The tokens before the first EOS id, or None if the completion did not stop (no
        EOS id and a ``finish_reason`` other than ``"stop"``)."""
        ids = list(token_ids)
        for i, t in enumerate(ids):
            if t in self.eos_ids:
                return ids[:i]
        return ids if finish_reason == "stop" else None

    def reward(self, quarter: int, length: int, token_ids: Sequence[int], finish_reason: str | None = None) -> float:
        """In-quarter fraction of the content times whether it is exactly ``length`` tokens long."""
        body = self.content(token_ids, finish_reason)
        if body is None or len(body) != length:
            return 0.0
        return sum(self.quarter_of(t) == quarter for t in body) / length

    def partial_reward(self, quarter: int, length: int, token_ids: Sequence[int], finish_reason: str | None = None) -> float:
        """Partial credit, each half of the skill on its own: half the in-quarter fraction of
        the content (of every token, for a completion that did not stop) plus half
        ``1 / (1 + |n - length|)`` for a completion that stopped after ``n`` tokens (0 if it did
        not stop). 1 exactly where :meth:`reward` is 1.

        >>> task = LengthTask(vocab_size=1024)
        >>> task.partial_reward(2, 3, [512, 600, 700, 3]), task.partial_reward(2, 3, [512, 600, 3])
        (1.0, 0.75)
        >>> task.partial_reward(2, 3, [512, 5, 700, 1000])   # no stop: the fraction's half only
        0.25
        """
        body = self.content(token_ids, finish_reason)
        tokens = list(token_ids) if body is None else body
        frac = sum(self.quarter_of(t) == quarter for t in tokens) / len(tokens) if tokens else 0.0
        stop = 0.0 if body is None else 1.0 / (1 + abs(len(body) - length))
        return (frac + stop) / 2

    def training_reward(
        self, quarter: int, length: int, token_ids: Sequence[int], finish_reason: str | None, step: int
    ) -> float:
        """The reward trained on at ``step``: :meth:`reward` without :attr:`shaping`, else the
        schedule's mix of it and :meth:`partial_reward`.

        >>> task = LengthTask(vocab_size=1024, shaping=Shaping(hold=0, anneal=10))
        >>> [task.training_reward(2, 3, [512, 600, 3], None, s) for s in (0, 5, 10)]
        [0.75, 0.375, 0.0]
        """
        exact = self.reward(quarter, length, token_ids, finish_reason)
        if self.shaping is None:
            return exact
        w = self.shaping.weight(step)
        if w >= 1.0:
            return exact
        return w * exact + (1 - w) * self.partial_reward(quarter, length, token_ids, finish_reason)

    @property
    def random_policy_reward(self) -> float:
        """The uniform policy's expected reward (exact, over the prompts drawn uniformly): it
        must stop after exactly ``L`` tokens, each in the quarter, then draw an EOS."""
        v, e = self.vocab_size, len(self.eos_ids)
        lengths = range(self.min_length, self.max_length + 1)
        # Content tokens are non-EOS; the EOS ids are in quarter 0 only (low ids), so the
        # in-quarter fraction's expectation is the share of non-EOS ids in the quarter.
        cont = 1 - e / v
        share = sum(
            sum(1 for t in range(v) if t not in self.eos_ids and self.quarter_of(t) == q) / (v - e)
            for q in range(self.quarters)
        ) / self.quarters
        return sum(cont**n * (e / v) * share for n in lengths) / len(lengths)

    def prompt_text(self, quarter: int, length: int) -> str:
        return str(quarter) * self.repeat + str(length) * self.repeat

    def prompt_ids(self, tokenizer: Any, quarter: int, length: int) -> list[int]:
        return list(tokenizer.encode(self.prompt_text(quarter, length), add_special_tokens=False))

    def prompt_of(self, tokenizer: Any, result: Any) -> list[int]:
        """The prompt a result was generated from (quarter and length ride in ``meta``)."""
        return self.prompt_ids(tokenizer, int(result.meta["quarter"]), int(result.meta["length"]))

    def sampling(self, group_size: int, temperature: float = 1.0) -> dict[str, Any]:
        """A GRPO group that stops at EOS, at most ``max_length + 1`` tokens."""
        return {
            "max_tokens": self.max_length + 1, "n": group_size, "temperature": temperature, "logprobs": 0,
            "ignore_eos": False, "detokenize": False,
        }

    def job_specs(self, tokenizer: Any, rng: random.Random, count: int, group_size: int) -> list[dict[str, Any]]:
        """``count`` training jobs with quarter and length drawn from ``rng``, each prompt at
        its :attr:`exploration` temperature (1 without it)."""
        out = []
        for _ in range(count):
            q, n = rng.randrange(self.quarters), rng.randint(self.min_length, self.max_length)
            t = self.exploration.temperature((q, n)) if self.exploration is not None else 1.0
            out.append(self.job_spec(tokenizer, q, n, group_size, t))
        return out

    def job_spec(self, tokenizer: Any, quarter: int, length: int, group_size: int,
                 temperature: float = 1.0) -> dict[str, Any]:
        """The job of one prompt: a group of ``group_size`` samples, quarter and length in ``meta``."""
        return {"prompt_token_ids": self.prompt_ids(tokenizer, quarter, length),
                "sampling": self.sampling(group_size, temperature), "meta": {"quarter": quarter, "length": length}}

    def observe(self, results: Sequence[Any], rewards: Sequence[Sequence[float]], step: int) -> None:
        """Tell :attr:`exploration` how each result's group went on the exact reward
        (``rewards``, one list per result), from the end of :attr:`shaping`'s hold on; nothing
        without an exploration. The exact reward, not the one trained on: a group whose samples
        all stop at the same wrong length earns partial credits that still differ by their
        content, so its advantages are all content while its length never moves.

        >>> from types import SimpleNamespace as NS
        >>> tok = NS(encode=lambda text, add_special_tokens: [ord(c) for c in text])
        >>> task = LengthTask(exploration=Exploration(boost=1.5), shaping=Shaping(hold=10))
        >>> task.observe([NS(meta={"quarter": 1, "length": 2})], [[0.0, 0.0]], step=9)   # in the hold
        >>> task.observe([NS(meta={"quarter": 1, "length": 2})], [[0.0, 0.0]], step=10)  # collapsed, wrong
        >>> task.exploration.hot(), task.job_spec(tok, 1, 2, 4, task.exploration.temperature((1, 2)))["sampling"]["temperature"]
        ({(1, 2): 1.5}, 1.5)
        """
        if self.exploration is None or (self.shaping is not None and step < self.shaping.hold):
            return
        for r, rw in zip(results, rewards):
            self.exploration.observe((int(r.meta["quarter"]), int(r.meta["length"])), rw)

    def final_specs(self, tokenizer: Any, group_size: int) -> list[dict[str, Any]]:
        """One job per (quarter, length) pair, every prompt the task has, for an evaluation of
        the final policy (:meth:`by_length`)."""
        return [self.job_spec(tokenizer, q, n, group_size)
                for n in range(self.min_length, self.max_length + 1) for q in range(self.quarters)]

    def by_length(self, results: Sequence[Any]) -> dict[str, dict[str, Any]]:
        """Per target length ``L`` (the key, as a string): the samples' mean exact reward and
        where they stopped, the share of samples by content length (``"none"``: cut at
        ``max_tokens``), most common first. Which lengths a policy confuses is what this task
        is hard for.

        >>> from types import SimpleNamespace as NS
        >>> s = lambda ids: NS(token_ids=ids, finish_reason="stop")
        >>> r = NS(meta={"quarter": 2, "length": 3}, samples=[s([512, 600, 700, 3]), s([512, 600, 3]), s([512, 600, 700, 3])])
        >>> LengthTask(vocab_size=1024).by_length([r])
        {'3': {'reward': 0.6667, 'stopped': {'3': 0.6667, '2': 0.3333}}}
        """
        rewards: dict[int, list[float]] = {}
        stops: dict[int, Counter[str]] = {}
        for r in results:
            n = int(r.meta["length"])
            rewards.setdefault(n, []).extend(self.rewards(r))
            bodies = (self.content(smp.token_ids, smp.finish_reason) for smp in r.samples)
            stops.setdefault(n, Counter()).update("none" if b is None else str(len(b)) for b in bodies)
        return {
            str(n): {"reward": round(sum(rewards[n]) / len(rewards[n]), 4),
                     "stopped": {k: round(c / len(rewards[n]), 4) for k, c in stops[n].most_common()}}
            for n in sorted(rewards)
        }

    def final_report(self, results: Sequence[Any]) -> dict[str, Any]:
        """What ``rollq demo`` adds to its summary from :meth:`final_specs`' results: the final
        policy's mean exact reward over every prompt (``reward_final``) and :meth:`by_length`
        (``final_by_length``)."""
        flat = [x for r in results for x in self.rewards(r)]
        return {"reward_final": round(sum(flat) / max(1, len(flat)), 4), "final_by_length": self.by_length(results)}

    def rewards(self, result: Any) -> list[float]:
        """The exact rewards of a result's samples: what the loop reports."""
        q, n = int(result.meta["quarter"]), int(result.meta["length"])
        return [self.reward(q, n, s.token_ids, s.finish_reason) for s in result.samples]

    def training_rewards(self, result: Any, step: int) -> list[float]:
        """The rewards the loop trains on at ``step`` (:meth:`training_reward`; :meth:`rewards`
        without :attr:`shaping`)."""
        q, n = int(result.meta["quarter"]), int(result.meta["length"])
        return [self.training_reward(q, n, s.token_ids, s.finish_reason, step) for s in result.samples]
