"""Per-prompt exploration: a prompt whose GRPO group collapsed is sampled hotter next time.

A group whose samples all earn the same reward has no advantage: GRPO learns nothing from
it. When that reward is wrong (below the best), the prompt is stuck: at temperature 1 the
policy repeats the same wrong answer on every sample, and nothing moves it (``rollq demo
--task length`` runs stall this way, whole prompts stopping at one wrong length).
:class:`Exploration` keeps a sampling temperature per prompt: a collapsed, wrong group
multiplies it by ``boost`` (up to ``max_temperature``), a group with spread divides it by
``boost`` (down to 1), and a group that is right on every sample resets it to 1.

The trainer computes its logprobs at each sample's temperature (``log_softmax(logits /
T)``), so the replicas must return the logprobs of the distribution they sampled from
(``VllmEngineConfig(logprobs_mode="processed_logprobs")``); the importance ratio is then
exact at every temperature.

>>> ex = Exploration(boost=1.5, max_temperature=2.0)
>>> ex.observe("p", [0.0, 0.0, 0.0]); ex.temperature("p")
1.5
>>> ex.observe("p", [0.0, 0.0, 0.0]); ex.temperature("p")       # capped
2.0
>>> ex.observe("p", [0.0, 1.0, 0.0]); round(ex.temperature("p"), 4)   # spread: cooler
1.3333
>>> ex.observe("p", [1.0, 1.0, 1.0]); ex.temperature("p")       # solved: back to 1
1.0
>>> ex.temperature("never seen")
1.0
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

__all__ = ["Exploration", "MAX_TEMPERATURE"]

#: The highest sampling temperature vLLM accepts (its ``SamplingParams`` refuses more).
MAX_TEMPERATURE = 2.0


@dataclass
class Exploration:
    """The sampling temperature of each prompt, from how its last groups went (module doc)."""

    #: Factor applied to a prompt's temperature per collapsed wrong group (its inverse per
    #: group with spread).
    boost: float = 1.25
    #: The hottest a prompt is ever sampled (at most vLLM's limit, :data:`MAX_TEMPERATURE`).
    max_temperature: float = MAX_TEMPERATURE
    #: The reward of a right sample; a collapsed group at this reward or above is solved.
    best: float = 1.0
    _temps: dict[Hashable, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.boost > 1.0:
            raise ValueError(f"Exploration.boost must be > 1, got {self.boost}")
        if not 1.0 <= self.max_temperature <= MAX_TEMPERATURE:
            raise ValueError(f"Exploration.max_temperature must be in [1, {MAX_TEMPERATURE}] (vLLM refuses a "
                             f"sampling temperature above {MAX_TEMPERATURE}), got {self.max_temperature}")

    def temperature(self, key: Hashable) -> float:
        """The temperature to sample prompt ``key`` at (1 for a prompt not seen yet)."""
        return self._temps.get(key, 1.0)

    def observe(self, key: Hashable, rewards: Sequence[float]) -> None:
        """Record one group of prompt ``key``: its samples' rewards."""
        if not rewards:
            return
        t = self.temperature(key)
        if max(rewards) - min(rewards) > 1e-9:
            t = max(1.0, t / self.boost)
        elif rewards[0] >= self.best - 1e-9:
            t = 1.0
        else:
            t = min(self.max_temperature, t * self.boost)
        if t == 1.0:
            self._temps.pop(key, None)
        else:
            self._temps[key] = t

    def hot(self) -> dict[Hashable, float]:
        """The prompts sampled above temperature 1 now, and their temperatures.

        >>> ex = Exploration(); ex.observe(("q", 2), [0.5, 0.5]); ex.hot()
        {('q', 2): 1.25}
        """
        return dict(self._temps)
