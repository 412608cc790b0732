"""GRPO through rollq: a toy task, a trainer, the async loop, its plot.

>>> from rollq.rl import BucketTask, GrpoTrainer, LoopConfig, run_loop   # doctest: +SKIP

``rollq demo`` and ``benchmarks/rl_loop.py`` are built from these parts.
"""

from .behavior import SamplingTransformError, behavior_temperature, logprob_agreement, single_version, token_logprobs
from .episodes import NOT_GENERATED, Episode, EpisodeGroup, Turn, assemble_episode, play_group
from .grpo import GrpoConfig, GrpoTrainer, StepStats, group_advantages, grpo_loss
from .loop import run_loop
from .loop_config import LoopConfig
from .report import LoopReport, StepRecord, busy_fraction
from .plot import plot_run
from .replica_host import ReplicaHostError, ReplicasProcess
from .replicas import ReplicaSnapshot, Replicas
from .task import BucketTask

__all__ = [
    # task
    "BucketTask",
    # episodes (multi-turn tasks)
    "Episode",
    "EpisodeGroup",
    "NOT_GENERATED",
    "Turn",
    "assemble_episode",
    "play_group",
    # trainer
    "GrpoConfig",
    "GrpoTrainer",
    "SamplingTransformError",
    "StepStats",
    "behavior_temperature",
    "group_advantages",
    "grpo_loss",
    "logprob_agreement",
    "single_version",
    "token_logprobs",
    # loop
    "LoopConfig",
    "LoopReport",
    "StepRecord",
    "busy_fraction",
    "run_loop",
    "Replicas",
    "ReplicasProcess",
    "ReplicaHostError",
    "ReplicaSnapshot",
    # output
    "plot_run",
]
