"""The harder tasks of ``rollq demo --task``: each needs something the bucket task does not.

- ``positional`` (:class:`PositionalTask`): output token ``j`` must follow prompt digit
  ``j``: attention to a position, credit assignment across tokens, a held-out split;
- ``length`` (:class:`LengthTask`): stop after exactly ``L`` tokens: EOS, variable
  lengths, padding and masking;
- ``two_turn`` (:class:`TwoTurnTask`): two turns, one job each, the second's prompt holding the
  first's completion and the environment's answer to it: episodes that span policy versions.

Every task has the interface the RL loop uses (:func:`rollq.rl.run_loop`):
``job_specs(tokenizer, rng, count, group_size)``, ``rewards(result)``,
``prompt_of(tokenizer, result)`` and ``random_policy_reward``; a multi-turn task has
``follow_up`` and ``jobs_per_group`` instead of ``prompt_of``, and its ``rewards`` take an
:class:`~rollq.rl.episodes.EpisodeGroup`. A task with ``training_rewards(result, step)``
(:class:`~rollq.rl.task.ShapedTask`: ``length`` with a :class:`Shaping`) is trained on those
and reports ``rewards``. A task with ``observe(results, rewards)``
(:class:`~rollq.rl.task.AdaptiveTask`: ``length`` with an :class:`Exploration`) hears how each
step's groups went before it writes more jobs.

>>> make_task("positional", vocab_size=1024).random_policy_reward
0.25
"""

from __future__ import annotations

from typing import Any

from ..task import BucketTask
from .explore import Exploration
from .length import LengthTask, Shaping
from .positional import PositionalTask
from .two_turn import TwoTurnTask

__all__ = ["Exploration", "LengthTask", "PositionalTask", "Shaping", "TASKS", "TwoTurnTask", "make_task"]

#: ``rollq demo --task`` names.
TASKS = {"bucket": BucketTask, "positional": PositionalTask, "length": LengthTask, "two_turn": TwoTurnTask}


def make_task(name: str, vocab_size: int, **kwargs: Any) -> Any:
    """The task called ``name`` (:data:`TASKS`) for a vocabulary of ``vocab_size`` ids."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; one of {sorted(TASKS)}") from None
    return cls(vocab_size=vocab_size, **kwargs)
