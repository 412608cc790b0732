"""Replica side: the consumer loop and the engines it drives."""

from .capacity import CapacityController
from .engine import EchoEngine, Engine, EngineOutput, EngineStats
from .loop import Consumer, ReplicaInfo
from .replica import Replica

__all__ = ["CapacityController", "Consumer", "EchoEngine", "Engine", "EngineOutput", "EngineStats", "Replica", "ReplicaInfo"]
