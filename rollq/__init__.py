"""rollq: a Redis-Streams job queue that feeds RL rollouts to vLLM replicas.

Trainers submit prompts fire-and-forget; replicas pull what their free capacity allows;
every result carries the policy version(s) that produced it.

>>> import rollq
>>> 'Producer' in rollq.__all__
True
"""

from .consumer import CapacityController, Consumer, EchoEngine, Engine, EngineOutput, EngineStats, Replica
from .errors import (
    DeadLettered,
    EngineDead,
    EngineFailed,
    InvalidJob,
    JobCancelled,
    JobError,
    JobExpired,
    JobRejected,
    PromptTooLong,
    ProtocolError,
    QueueFull,
    RollqError,
    SchemaVersionError,
    StalenessBound,
    VersionUnavailable,
)
from .keys import QueueKeys
from .producer import JobHandle, Producer, SyncJobHandle, SyncProducer
from .protocol import Job, Message, Result, Sample, SamplingParams
from .server import RedisServer
from .settings import ConsumerSettings, ProducerSettings, RedisSettings, WeightSyncSettings

__version__ = "0.1.0"

__all__ = [
    # producing
    "Producer", "SyncProducer", "JobHandle", "SyncJobHandle", "ProducerSettings",
    # consuming
    "Consumer", "ConsumerSettings", "Replica", "WeightSyncSettings", "Engine", "EchoEngine", "EngineOutput", "EngineStats", "CapacityController",
    # wire types
    "Job", "Result", "Sample", "SamplingParams", "Message",
    # infrastructure
    "RedisSettings", "RedisServer", "QueueKeys",
    # errors
    "RollqError", "QueueFull", "StalenessBound", "InvalidJob", "ProtocolError", "SchemaVersionError", "JobError",
    "JobRejected", "JobCancelled", "JobExpired", "DeadLettered", "EngineFailed", "EngineDead", "PromptTooLong",
    "VersionUnavailable",
]
