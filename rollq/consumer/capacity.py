"""The in-flight cap of one replica, adapted to its engine's state.

Pull-based load balancing needs one number per replica: how many jobs it may hold. Jobs wait
in Redis until a replica has a free slot, so a replica that is busy simply pulls less; no
router polls replicas.

The controller is AIMD on the engine's own signals (read every heartbeat):

- **back off** (cap x ``decrease``, at least ``minimum``) when the engine preempted requests
  since the last look, or its KV-cache usage is above ``kv_high``, or requests are waiting
  in the engine's own queue while the KV cache is nearly full;
- **grow** (cap + ``step``, at most ``maximum``) when KV usage is below ``kv_low``, nothing
  was preempted, and the cap is actually in use (``inflight`` >= 90% of it): no point
  growing a cap that is not the limit;
- otherwise hold.

Engines that report no KV usage (the echo engine) keep a fixed cap at ``maximum``.

>>> c = CapacityController(initial=8, maximum=64)
>>> from rollq.consumer.engine import EngineStats
>>> c.update(EngineStats(kv_usage=0.1), inflight=8)
16
>>> c.update(EngineStats(kv_usage=0.97), inflight=16)
12
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import EngineStats


@dataclass
class CapacityController:
    initial: int = 64
    maximum: int = 256
    minimum: int = 1
    adaptive: bool = True
    kv_low: float = 0.70
    kv_high: float = 0.92
    step: int = 8
    decrease: float = 0.75
    cap: int = field(init=False)
    _preemptions: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.cap = max(self.minimum, min(self.initial, self.maximum))

    def update(self, stats: EngineStats, inflight: int) -> int:
        """Adjust the cap from the latest engine stats; returns it."""
        preempted = stats.preemptions - self._preemptions
        self._preemptions = stats.preemptions
        if not self.adaptive or stats.kv_usage is None:
            self.cap = self.maximum if stats.kv_usage is None and self.adaptive else self.cap
            return self.cap
        kv = stats.kv_usage
        if preempted > 0 or kv > self.kv_high or (stats.waiting > 0 and kv > self.kv_low):
            self.cap = max(self.minimum, int(self.cap * self.decrease))
        elif kv < self.kv_low and inflight >= 0.9 * self.cap:
            self.cap = min(self.maximum, self.cap + max(self.step, self.cap // 8))
        return self.cap
