"""``rollq demo --task two_turn``: an episode of two turns, one rollq job each.

Turn 1: the prompt names a quarter ``q`` of the vocabulary (``"2222"``); the policy writes
``turn1_length`` tokens and should write them in quarter ``q``. The environment then looks
at turn 1's last token ``t`` and answers with the digit ``e = t mod quarters`` (written
``repeat`` times): it depends on turn 1's completion, not on its quarter (the quarter is
``t``'s high bits, ``e`` its low bits). Turn 2's prompt is turn 1's prompt, turn 1's
completion and the environment's digit; the policy writes two tokens: the first should be in
the quarter of ``t`` (its own turn-1 output: *recall*), the second in quarter ``e`` (the
environment's answer). The reward of the episode needs both turns::

    (in-quarter fraction of turn 1 + [turn 2 token 1 in t's quarter] + [turn 2 token 2 in quarter e]) / 3

What a policy must use: the second turn-2 token is right by chance only (1/4) unless the
policy reads the environment's digit, whose value only turn 1's exact token decides; the
first one unless it reads its own turn-1 token (copying the prompt's quarter instead is
right only as often as turn 1 was). So "ignore the environment" scores at most
``(1 + 1 + 1/4) / 3 = 0.75``; a uniform random policy scores exactly 1/4 (each of the three
parts is 1/4 when the quarters divide the vocabulary: :attr:`TwoTurnTask.random_policy_reward`
is the exact expectation for any shape); the perfect score is 1.

Each turn is its own job (:func:`rollq.rl.episodes.play_group`): the first turn's job is a
GRPO group of ``n`` samples, each sample's turn 2 a job of one sample. A weight update that
lands between the two turns gives an episode of two versions; the trainer gets every
episode whole (:class:`~rollq.rl.episodes.Episode`) and trains on both turns' tokens.

>>> task = TwoTurnTask(vocab_size=1024)
>>> task.env_digit([512, 301]), task.reward(2, [512, 301], [300, 300])   # turn 1 half right; e = 1
(1, 0.8333333333333334)
>>> task.reward(2, [512, 600], [600, 256])                                # e = 0: 256 is in quarter 1
0.6666666666666666
>>> task.reward(2, [512, 600], [600, 0]), task.random_policy_reward
(1.0, 0.25)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from ..task import vocab_range

__all__ = ["TwoTurnTask"]


@dataclass(frozen=True)
class TwoTurnTask:
    """Write in the prompt's quarter, then recall turn 1 and follow the environment (module doc)."""

    #: The model's vocabulary size (ids ``0 .. vocab_size - 1`` can be sampled).
    vocab_size: int = 1024
    #: Equal contiguous ranges of the vocabulary; the prompt and the environment name one.
    quarters: int = 4
    #: Tokens of turn 1 (turn 2 writes two).
    turn1_length: int = 2
    #: Times the prompt's digit and the environment's digit are written.
    repeat: int = 4
    #: Turns per episode (the RL loop plays episodes with :meth:`follow_up`).
    turns: int = 2

    def __post_init__(self) -> None:
        if not 2 <= self.quarters <= 10 or self.vocab_size < self.quarters:
            raise ValueError("TwoTurnTask needs 2 <= quarters <= 10 and vocab_size >= quarters")
        if self.turn1_length < 1 or self.repeat < 1 or self.turns != 2:
            raise ValueError("TwoTurnTask needs turn1_length >= 1, repeat >= 1 and turns == 2")

    def quarter_of(self, token_id: int) -> int:
        """The quarter a token id belongs to."""
        return vocab_range(token_id, self.quarters, self.vocab_size)

    def env_digit(self, turn1: Sequence[int]) -> int:
        """The environment's answer to a turn-1 completion: its last token modulo ``quarters``."""
        return turn1[-1] % self.quarters

    def reward(self, quarter: int, turn1: Sequence[int], turn2: Sequence[int]) -> float:
        """The episode's reward (module doc); missing tokens earn nothing."""
        if not turn1:
            return 0.0
        first = sum(self.quarter_of(t) == quarter for t in turn1) / len(turn1)
        recall = len(turn2) > 0 and self.quarter_of(turn2[0]) == self.quarter_of(turn1[-1])
        follow = len(turn2) > 1 and self.quarter_of(turn2[1]) == self.env_digit(turn1)
        return (first + recall + follow) / 3

    @property
    def random_policy_reward(self) -> float:
        """A uniform policy's expected reward, exact: turn 1 scores ``1 / quarters``; recall
        the chance two uniform tokens share a quarter; following the chance a uniform token's
        quarter is a uniform token's residue."""
        v, q = self.vocab_size, self.quarters
        size = [0] * q
        residue = [0] * q
        for t in range(v):
            size[self.quarter_of(t)] += 1
            residue[t % q] += 1
        recall = sum((s / v) ** 2 for s in size)
        follow = sum((residue[e] / v) * (size[e] / v) for e in range(q))
        return (1 / q + recall + follow) / 3

    def prompt_ids(self, tokenizer: Any, quarter: int) -> list[int]:
        """Turn 1's prompt: the quarter's digit, ``repeat`` times."""
        return list(tokenizer.encode(str(quarter) * self.repeat, add_special_tokens=False))

    def observation_ids(self, tokenizer: Any, env: int) -> list[int]:
        """The environment's tokens after turn 1: its digit, ``repeat`` times."""
        return list(tokenizer.encode(str(env) * self.repeat, add_special_tokens=False))

    def sampling(self, n: int, length: int) -> dict[str, Any]:
        """``n`` samples of exactly ``length`` tokens at temperature 1, with their logprobs."""
        return {"max_tokens": length, "n": n, "temperature": 1.0, "logprobs": 0, "ignore_eos": True, "detokenize": False}

    def jobs_per_group(self, group_size: int) -> int:
        """Jobs one group runs: its first turn's, then one per episode for turn 2."""
        return 1 + group_size

    def job_specs(self, tokenizer: Any, rng: random.Random, count: int, group_size: int) -> list[dict[str, Any]]:
        """``count`` first-turn jobs (one GRPO group each), quarters drawn from ``rng``."""
        out = []
        for _ in range(count):
            q = rng.randrange(self.quarters)
            out.append({"prompt_token_ids": self.prompt_ids(tokenizer, q), "sampling": self.sampling(group_size, self.turn1_length),
                        "meta": {"quarter": q}})
        return out

    def follow_up(self, tokenizer: Any, prompt: Sequence[int], turns: Sequence[Any]) -> tuple[list[int], dict[str, Any]] | None:
        """After turn 1 (:class:`~rollq.rl.episodes.Turn`): the environment's tokens and turn
        2's job, whose prompt is the episode so far; after turn 2: None (the episode is over)."""
        if len(turns) >= self.turns:
            return None
        first = turns[0].result.samples[turns[0].sample].token_ids
        env = self.env_digit(first)
        obs = self.observation_ids(tokenizer, env)
        return obs, {"prompt_token_ids": list(prompt) + first + obs, "sampling": self.sampling(1, 2), "meta": {"env": env}}

    def rewards(self, group: Any) -> list[float]:
        """Rewards of a group's episodes (:class:`~rollq.rl.episodes.EpisodeGroup`; trainer side)."""
        q = int(group.meta["quarter"])
        return [self.reward(q, ep.completion(0), ep.completion(1)) for ep in group.episodes]
