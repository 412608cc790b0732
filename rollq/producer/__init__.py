"""Trainer side: submit jobs, receive results."""

from .client import JobHandle, Producer
from .sync import SyncJobHandle, SyncProducer

__all__ = ["JobHandle", "Producer", "SyncJobHandle", "SyncProducer"]
