"""The toy task of ``rollq demo``: write tokens from the vocabulary bucket the prompt names.

The vocabulary is cut into ``buckets`` equal contiguous ranges (vocab 1024, 4 buckets: ids
``[0, 256)``, ``[256, 512)``, ...). A prompt names one bucket in plain text ("Write 4
tokens from bucket 2 of 4:"); the policy generates ``length`` tokens (``ignore_eos``, so
every sample has exactly that many) and earns the fraction of them that fall in the named
bucket. The reward is dense: a uniform random policy scores ``1 / buckets`` (0.25) on every
sample, so every GRPO group has spread from the first step, and the perfect score is 1.

Where the reward runs: on the trainer, on each :class:`~rollq.protocol.Result` it takes
from the queue (:meth:`BucketTask.rewards`). Replicas only generate; the bucket travels
with the job in ``meta`` and comes back on the result, so the reward needs nothing but the
result, costs microseconds, and changing the task never touches a replica.

>>> task = BucketTask()
>>> task.bucket_of(300), task.reward(1, [256, 511, 0, 1023])
(1, 0.5)
>>> task.random_policy_reward
0.25
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["AdaptiveTask", "BucketTask", "ShapedTask", "observe_groups", "training_rewards", "vocab_range"]


@runtime_checkable
class ShapedTask(Protocol):
    """A task that trains on other rewards than it reports (e.g. a reward-shaping schedule,
    :class:`~rollq.rl.tasks.Shaping`): ``rewards(result)`` stays the task's exact reward, the
    one every figure reports; ``training_rewards(result, step)`` is what advantages come from."""

    def rewards(self, result: Any) -> list[float]: ...

    def training_rewards(self, result: Any, step: int) -> list[float]: ...


def training_rewards(task: Any, results: Sequence[Any], step: int, exact: list[list[float]]) -> list[list[float]]:
    """The rewards the loop trains on at ``step``: ``exact`` (each result's ``task.rewards``,
    which the loop reports) unless ``task`` is a :class:`ShapedTask`.

    >>> training_rewards(BucketTask(), ["a result"], 0, [[0.5]])   # no shaping: the same list
    [[0.5]]
    """
    if not isinstance(task, ShapedTask):
        return exact
    return [task.training_rewards(r, step) for r in results]


@runtime_checkable
class AdaptiveTask(Protocol):
    """A task whose next jobs depend on how its last groups went (e.g. a hotter temperature
    for prompts whose groups collapsed, :class:`~rollq.rl.tasks.Exploration`): the loop calls
    ``observe(results, rewards, step)`` with each step's results, their exact rewards (what the
    loop reports) and the step's index."""

    def observe(self, results: Sequence[Any], rewards: Sequence[Sequence[float]], step: int) -> None: ...


def observe_groups(task: Any, results: Sequence[Any], rewards: Sequence[Sequence[float]], step: int) -> None:
    """Hand step ``step``'s ``results`` and their exact ``rewards`` to ``task`` if it is an
    :class:`AdaptiveTask` (nothing otherwise).

    >>> observe_groups(BucketTask(), ["a result"], [[0.5]], 0)   # not adaptive: nothing happens
    """
    if isinstance(task, AdaptiveTask):
        task.observe(results, rewards, step)


def vocab_range(token_id: int, parts: int, vocab_size: int) -> int:
    """Which of ``parts`` equal contiguous ranges of a ``vocab_size`` vocabulary holds
    ``token_id`` (the buckets and quarters of every task in :mod:`rollq.rl`).

    >>> [vocab_range(t, 4, 1024) for t in (0, 255, 256, 767, 1023)]
    [0, 0, 1, 2, 3]
    >>> [vocab_range(t, 3, 10) for t in range(10)]   # sizes 4, 3, 3 when parts does not divide it
    [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    """
    return token_id * parts // vocab_size


@dataclass(frozen=True)
class BucketTask:
    """Generate ``length`` tokens from the bucket named in the prompt (see the module doc)."""

    #: The model's vocabulary size (ids ``0 .. vocab_size - 1`` can be sampled).
    vocab_size: int = 1024
    #: Equal contiguous ranges the vocabulary is cut into.
    buckets: int = 4
    #: Tokens generated per sample.
    length: int = 4

    def __post_init__(self) -> None:
        if self.buckets < 2 or self.vocab_size < self.buckets or self.length < 1:
            raise ValueError("BucketTask needs buckets >= 2, vocab_size >= buckets and length >= 1")

    def bucket_of(self, token_id: int) -> int:
        """The bucket a token id belongs to."""
        return vocab_range(token_id, self.buckets, self.vocab_size)

    def reward(self, bucket: int, token_ids: Sequence[int]) -> float:
        """Fraction of ``token_ids`` in ``bucket`` (0 for an empty sample)."""
        if not token_ids:
            return 0.0
        return sum(self.bucket_of(t) == bucket for t in token_ids) / len(token_ids)

    @property
    def random_policy_reward(self) -> float:
        """Expected reward of a uniform policy over the vocabulary, buckets drawn uniformly:
        exactly ``1 / buckets`` (the buckets' sizes sum to the vocabulary)."""
        return 1.0 / self.buckets

    #: Times the bucket's digit is repeated in the prompt. A sentence that names the bucket
    #: once ("from bucket 2 of 4:") is one token in sixteen that differs between prompts: a
    #: random-init 2-layer model then took 40+ steps to get past 0.5; with the digit alone,
    #: repeated, it reached 0.9 in 12-25 steps (lr 5e-3..1e-2, measured in pure torch).
    repeat: int = 8

    def prompt_text(self, bucket: int) -> str:
        """The prompt naming ``bucket`` (``"2222..."``; buckets >= 10 use their decimal form)."""
        return str(bucket) * self.repeat

    def prompt_ids(self, tokenizer: Any, bucket: int) -> list[int]:
        """Token ids of the prompt for ``bucket`` (the tokenizer's encoding of :meth:`prompt_text`)."""
        return list(tokenizer.encode(self.prompt_text(bucket), add_special_tokens=False))

    def prompt_of(self, tokenizer: Any, result: Any) -> list[int]:
        """The prompt a result was generated from (its bucket rides in ``meta``)."""
        return self.prompt_ids(tokenizer, int(result.meta["bucket"]))

    def sampling(self, group_size: int) -> dict[str, Any]:
        """Sampling params of one job: a GRPO group of ``group_size`` samples at temperature 1
        (vLLM's logprobs are those of the unscaled logits), the sampled tokens' logprobs."""
        return {
            "max_tokens": self.length, "n": group_size, "temperature": 1.0, "logprobs": 0,
            "ignore_eos": True, "detokenize": False,
        }

    def job_specs(self, tokenizer: Any, rng: random.Random, count: int, group_size: int) -> list[dict[str, Any]]:
        """``count`` jobs (one GRPO group each) for buckets drawn from ``rng``; the bucket rides in ``meta``."""
        prompts = [self.prompt_ids(tokenizer, b) for b in range(self.buckets)]
        sp = self.sampling(group_size)
        out = []
        for _ in range(count):
            b = rng.randrange(self.buckets)
            out.append({"prompt_token_ids": prompts[b], "sampling": sp, "meta": {"bucket": b}})
        return out

    def rewards(self, result: Any) -> list[float]:
        """Rewards of a result's samples (trainer side; see the module doc)."""
        bucket = int(result.meta["bucket"])
        return [self.reward(bucket, s.token_ids) for s in result.samples]
