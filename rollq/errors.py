"""rollq's exceptions.

Two families matter to callers: :class:`JobError` subclasses arrive on a job's handle (the
job failed, the queue is fine), everything else is raised where the call was made.
Errors cross process boundaries as ``(type, message)`` pairs and are rebuilt here by name.
"""

from __future__ import annotations


class RollqError(Exception):
    """Base of every rollq exception."""


# -- submission side ---------------------------------------------------------------------
class QueueFull(RollqError):
    """The producer's cap on outstanding jobs (or the staleness bound) is reached."""


class StalenessBound(QueueFull):
    """Admitting more jobs would exceed the queue's off-policy staleness bound."""


class InvalidJob(RollqError, ValueError):
    """A job failed validation (bad prompt, bad sampling params, unknown fields)."""


class ProtocolError(RollqError, ValueError):
    """Bytes that are not a rollq message of a schema version this build understands."""


class SchemaVersionError(ProtocolError):
    """A message carries a schema version this build does not understand."""


# -- job outcomes (delivered to the handle) --------------------------------------------
class JobError(RollqError):
    """A job finished with an error. ``type`` names the remote exception class."""

    def __init__(self, message: str, *, job_id: str | None = None, type: str | None = None):
        super().__init__(message)
        self.job_id = job_id
        self.type = type or self.__class__.__name__


class JobRejected(JobError):
    """The consumer refused the job (invalid input, prompt too long, ...)."""


class JobCancelled(JobError):
    """The job was cancelled before it finished."""


class JobExpired(JobError):
    """The job's deadline passed before it finished."""


class DeadLettered(JobError):
    """The job was moved to the dead-letter stream (too many deliveries, poison)."""


class EngineFailed(JobError):
    """The engine raised while generating this job."""


_JOB_ERRORS: dict[str, type[JobError]] = {
    c.__name__: c for c in (JobError, JobRejected, JobCancelled, JobExpired, DeadLettered, EngineFailed)
}


def job_error(type_name: str, message: str, job_id: str | None = None) -> JobError:
    """Rebuild a :class:`JobError` from the ``(type, message)`` carried in a result."""
    cls = _JOB_ERRORS.get(type_name, JobError)
    return cls(message, job_id=job_id, type=type_name)


# -- engine side -------------------------------------------------------------------------
class EngineDead(RollqError):
    """The engine can no longer serve; the consumer stops pulling and exits non-zero."""


class PromptTooLong(InvalidJob):
    """A prompt does not fit the model's context window."""


# -- weight sync -------------------------------------------------------------------------
class WeightSyncError(RollqError):
    """A weight version could not be published or loaded."""


class CorruptWeights(WeightSyncError):
    """A stored weight version is incomplete or fails its checksum."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A phase of a weight transfer exceeded its timeout."""


class StaleVersion(WeightSyncError):
    """An announced version is older than (or equal to) what is already loaded."""


class RedisServerError(RollqError):
    """The embedded redis-server could not be started."""
