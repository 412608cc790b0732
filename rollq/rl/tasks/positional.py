"""``rollq demo --task positional``: output token ``j`` must come from prompt digit ``j``'s quarter.

The prompt holds ``digits`` digits in ``0 .. quarters - 1`` (``"2031"``); the vocabulary is
cut into ``quarters`` equal contiguous ranges as in :class:`~rollq.rl.task.BucketTask`. The
policy writes ``digits`` tokens (``ignore_eos``) and output token ``j`` earns
``1 / digits`` when it falls in the quarter digit ``j`` names. A uniform policy scores
``1 / quarters`` (0.25); "follow the last digit" scores 0.4375 (output 3 always right, the
others right when their digit equals the last one); the full score needs output ``j`` to
attend to prompt position ``j``: context-dependent credit assignment that the bucket task
never asks for.

The 256 digit strings are split once, deterministically, into training strings and
held-out strings (:meth:`PositionalTask.is_heldout`); :meth:`PositionalTask.job_specs`
draws only training strings, and ``rollq demo --task positional`` reports the reward on the
held-out ones as ``reward_heldout``.

>>> task = PositionalTask(vocab_size=1024)
>>> task.reward("2031", [512, 0, 768, 300])
1.0
>>> task.reward("2031", [512, 512, 512, 300]), task.random_policy_reward
(0.5, 0.25)
>>> len(task.train_strings), len(task.heldout_strings)
(224, 32)
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..task import vocab_range

__all__ = ["PositionalTask"]


@dataclass(frozen=True)
class PositionalTask:
    """Copy the prompt's digits as vocabulary quarters, position by position (see the module doc)."""

    #: The model's vocabulary size (ids ``0 .. vocab_size - 1`` can be sampled).
    vocab_size: int = 1024
    #: Digits in a prompt, and tokens generated per sample.
    digits: int = 4
    #: Equal contiguous ranges of the vocabulary; a digit names one (so digits are ``0 .. quarters - 1``).
    quarters: int = 4
    #: Times each digit is written in the prompt (``2`` makes ``"2031"`` the prompt ``"22003311"``).
    repeat: int = 1
    #: One digit string in ``heldout_every`` (by :meth:`is_heldout`'s hash) is held out.
    heldout_every: int = 8
    train_strings: tuple[str, ...] = field(init=False, repr=False)
    heldout_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 2 <= self.quarters <= 10 or self.digits < 1 or self.vocab_size < self.quarters or self.repeat < 1:
            raise ValueError("PositionalTask needs 2 <= quarters <= 10, digits >= 1, repeat >= 1, vocab_size >= quarters")
        if self.heldout_every < 2:
            raise ValueError("heldout_every must be >= 2 (some strings must stay for training)")
        every = ["".join(d) for d in itertools.product("0123456789"[: self.quarters], repeat=self.digits)]
        object.__setattr__(self, "heldout_strings", tuple(s for s in every if self.is_heldout(s)))
        object.__setattr__(self, "train_strings", tuple(s for s in every if not self.is_heldout(s)))

    def is_heldout(self, digits: str) -> bool:
        """Whether a digit string is held out of training: its weighted digit sum, weights
        ``1, 4, 3, 5, 3, 5, ...``, is 0 modulo :attr:`heldout_every` (for 4 quarters and
        ``heldout_every = 8`` the first two digits alone make the sum uniform modulo 8, so
        exactly one string in 8 is held out; every digit value appears at every position
        among the training strings).

        >>> PositionalTask().is_heldout("0000"), PositionalTask().is_heldout("0001")
        (True, False)
        """
        weights = (1, 4) + (3, 5) * len(digits)
        return sum(int(c) * w for c, w in zip(digits, weights)) % self.heldout_every == 0

    def quarter_of(self, token_id: int) -> int:
        """The quarter a token id belongs to."""
        return vocab_range(token_id, self.quarters, self.vocab_size)

    def reward(self, digits: str, token_ids: Sequence[int]) -> float:
        """``1 / len(digits)`` for every output token ``j`` in digit ``j``'s quarter (tokens
        beyond the digits earn nothing)."""
        return sum(self.quarter_of(t) == int(d) for d, t in zip(digits, token_ids)) / len(digits)

    @property
    def random_policy_reward(self) -> float:
        """Expected reward of a uniform policy: ``1 / quarters``."""
        return 1.0 / self.quarters

    def prompt_text(self, digits: str) -> str:
        return "".join(c * self.repeat for c in digits)

    def prompt_ids(self, tokenizer: Any, digits: str) -> list[int]:
        """Token ids of the prompt for a digit string."""
        return list(tokenizer.encode(self.prompt_text(digits), add_special_tokens=False))

    def prompt_of(self, tokenizer: Any, result: Any) -> list[int]:
        """The prompt a result was generated from (its digits ride in ``meta``)."""
        return self.prompt_ids(tokenizer, str(result.meta["digits"]))

    def sampling(self, group_size: int) -> dict[str, Any]:
        """A GRPO group of ``group_size`` samples of exactly ``digits`` tokens at temperature 1."""
        return {
            "max_tokens": self.digits, "n": group_size, "temperature": 1.0, "logprobs": 0,
            "ignore_eos": True, "detokenize": False,
        }

    def job_specs(self, tokenizer: Any, rng: random.Random, count: int, group_size: int) -> list[dict[str, Any]]:
        """``count`` jobs (one GRPO group each) on training strings drawn from ``rng``."""
        return [self.job_spec(tokenizer, rng.choice(self.train_strings), group_size) for _ in range(count)]

    def heldout_specs(self, tokenizer: Any, group_size: int) -> list[dict[str, Any]]:
        """One job per held-out string (the evaluation of ``reward_heldout``)."""
        return [self.job_spec(tokenizer, s, group_size) for s in self.heldout_strings]

    def job_spec(self, tokenizer: Any, digits: str, group_size: int) -> dict[str, Any]:
        return {"prompt_token_ids": self.prompt_ids(tokenizer, digits), "sampling": self.sampling(group_size),
                "meta": {"digits": digits}}

    def rewards(self, result: Any) -> list[float]:
        """Rewards of a result's samples (trainer side)."""
        digits = str(result.meta["digits"])
        return [self.reward(digits, s.token_ids) for s in result.samples]
