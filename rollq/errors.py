"""rollq's exceptions.

Two families matter to callers: :class:`JobError` subclasses arrive on a job's handle (the
job failed, the queue is fine), everything else is raised where the call was made.
Errors cross process boundaries as ``(type, message)`` pairs and are rebuilt here by name.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable


class RollqError(Exception):
    """Base of every rollq exception."""


# -- submission side ---------------------------------------------------------------------
class QueueFull(RollqError):
    """The producer's cap on outstanding jobs (or the staleness bound) is reached."""


class StalenessBound(QueueFull):
    """Admitting more jobs would exceed the queue's off-policy staleness bound.

    Raised by a submission that does not block (``block_when_full=False``). A submission of
    several calls (several shards, or more than ``script_batch`` jobs) may have had some
    calls admitted before one was refused, so the error says which jobs went in:

    Attributes:
        enqueued: the handles of the jobs that were enqueued (their results will come).
        refused: the jobs that were not enqueued (submit them again after a newer version
            is published). No job is in both lists, and every job submitted is in one.
    """

    def __init__(self, message: str, *, enqueued: list[Any] | None = None, refused: list[Any] | None = None):
        super().__init__(message)
        self.enqueued: list[Any] = list(enqueued or [])
        self.refused: list[Any] = list(refused or [])


class ShardCountMismatch(RollqError):
    """A producer or consumer named a number of shards other than the queue's recorded one."""


class BadQueueData(RollqError):
    """A key of a queue holds a value rollq never writes there (a stray ``SET``, a counter
    that is not an integer, a registry entry that is not msgpack): the views report the queue
    as unreadable, naming ``key`` (and ``field``, for a hash), and show the other queues."""

    def __init__(self, message: str, *, key: str, field: str | None = None):
        super().__init__(message)
        self.key = key
        self.field = field


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


class VersionUnavailable(JobError):
    """No policy version the job may run on (``min_version`` or newer) can be reached on the
    replica that held it: it is beyond the newest committed version for too long, the wait
    exceeded ``ConsumerSettings.max_version_wait``, or the replica cannot load that version."""


class ResultTooLarge(JobError):
    """The job's result, encoded, is larger than ``ConsumerSettings.max_result_bytes`` (or
    Redis refused to store it): the job fails instead of holding up every result after it."""


_JOB_ERRORS: dict[str, type[JobError]] = {
    c.__name__: c
    for c in (JobError, JobRejected, JobCancelled, JobExpired, DeadLettered, EngineFailed, VersionUnavailable, ResultTooLarge)
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


class WeightMismatch(WeightSyncError, ValueError):
    """Weights whose names, shapes or dtypes do not match the served model's checkpoint.

    ``mismatch`` (a :class:`rollq.weightsync.manifest.Mismatch`, when known) lists them all;
    the message names the first few of each kind.
    """

    def __init__(self, message: str, *, mismatch: object = None):
        super().__init__(message)
        self.mismatch = mismatch


class WeightLoadFailed(WeightSyncError):
    """Replicas reported that they cannot load a committed version.

    ``failures`` maps each replica id to its :class:`rollq.weightsync.versions.LoadError`.
    """

    def __init__(self, message: str, *, failures: dict | None = None):
        super().__init__(message)
        self.failures = failures or {}


class RedisServerError(RollqError):
    """The embedded redis-server could not be started."""


class RedisAuthError(RollqError):
    """Redis refused our credentials (wrong password or user) or the ACL user lacks a
    permission. Not retried: backing off would not make the password right."""


class RedisTLSError(RedisAuthError):
    """Redis' TLS certificate failed the check (an unknown authority, another host name, an
    expired certificate). Not retried: backing off would not make the certificate right."""


class SubmitInterrupted(RollqError):
    """Redis stayed unreachable while a submission was under way (longer than
    ``RedisSettings.command_timeout`` without progress).

    The batch splits, in order, into ``enqueued`` (handles of jobs Redis acknowledged),
    ``in_doubt`` (jobs of calls that were sent but whose replies were lost: Redis may or may
    not have enqueued them) and ``not_sent`` (jobs built but never sent); ``remaining`` is the
    iterator of specs not read yet (None if all were). ``await err.resume()`` sends the
    in-doubt calls again under their original call numbers (a call that ran replays its reply,
    so nothing is enqueued twice), then the rest, and returns their handles. Resending the
    in-doubt jobs any other way may enqueue them twice.
    """

    #: Set by the submission that raised it, for :meth:`resume`: the in-doubt jobs with their
    #: calls, and the finalizer that frees those calls' numbers once the error is dropped.
    _doubt: list[Any]
    _unpin: Any

    def __init__(self, message: str, *, enqueued: list, in_doubt: list, not_sent: list,
                 remaining: object = None, resume: Callable[[], Awaitable[list]] | None = None):
        super().__init__(message)
        self.enqueued = enqueued
        self.in_doubt = in_doubt
        self.not_sent = not_sent
        self.remaining = remaining
        self._resume = resume

    async def resume(self) -> list:
        """Handles of the in-doubt, not-sent and remaining jobs, submitted without doubling."""
        if self._resume is None:
            raise RuntimeError("this SubmitInterrupted cannot be resumed (its producer is gone)")
        resume, self._resume = self._resume, None
        return await resume()
