"""The schedule of one RL run (:class:`LoopConfig`), which :func:`rollq.rl.loop.run_loop`
follows and :class:`rollq.rl.report.LoopReport` keeps beside what the run measured.

>>> LoopConfig(steps=10, mode="sync").max_lag
1
>>> LoopConfig(mode="eager")
Traceback (most recent call last):
ValueError: mode must be 'async' or 'sync', got 'eager'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoopConfig"]


@dataclass
class LoopConfig:
    """One RL run's schedule."""

    #: Trainer steps (= policy versions published).
    steps: int = 40
    #: GRPO groups (jobs) per step.
    groups_per_step: int = 16
    #: Samples per group (``sampling.n``).
    group_size: int = 8
    #: ``async`` or ``sync`` (see the module doc).
    mode: str = "async"
    #: Staleness bound of the async mode, in versions.
    max_lag: int = 1
    #: ``memmap``, ``broadcast`` (gloo on CPU, NCCL on GPU: the publisher's sender) or ``ipc``
    #: (rollq.weightsync.transports.ipc). Over ``ipc`` the async trainer steps in place while
    #: replicas may still copy: give it ``WeightPublisher(ipc_lease=True)`` (each step first
    #: waits for their copies) or ``ipc_snapshot=True``, else a replica copying refuses the version.
    transport: str = "memmap"
    #: Seeds the prompts' buckets.
    seed: int = 0
    #: Seconds without any result before the loop gives up (TimeoutError).
    result_timeout: float = 300.0
    #: Publish each new version to the replicas. False: the negative control (module doc);
    #: the trainer still trains, the replicas keep the initial weights.
    publish: bool = True
    #: The queue's update policy for the run (``keep``, ``abort`` or ``drain``: how replicas
    #: apply a version while requests run; set on the queue when the loop starts).
    update_policy: str = "keep"
    #: The trainer's agreement forward at older versions' weights on every k-th step only (the update is the same).
    agree_every: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {self.mode!r}")
        if self.update_policy not in ("keep", "abort", "drain"):
            raise ValueError(f"update_policy must be 'keep', 'abort' or 'drain', got {self.update_policy!r}")
        if self.transport not in ("memmap", "broadcast", "ipc"):
            raise ValueError(f"transport must be 'memmap', 'broadcast' or 'ipc', got {self.transport!r}")
        if self.max_lag < 0 or min(self.steps, self.groups_per_step, self.group_size, self.agree_every) < 1:
            raise ValueError("LoopConfig needs steps, groups_per_step, group_size, agree_every >= 1 and max_lag >= 0")
