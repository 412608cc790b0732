"""Replica side: the consumer loop and the engines it drives."""

from .capacity import CapacityController
from .engine import EchoEngine, Engine, EngineOutput, EngineStats
from .loop import Consumer, ReplicaInfo

__all__ = ["CapacityController", "Consumer", "EchoEngine", "Engine", "EngineOutput", "EngineStats", "ReplicaInfo"]
