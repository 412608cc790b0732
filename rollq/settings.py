"""Settings: small dataclasses with named, documented defaults.

The connection URL falls back to ``$ROLLQ_REDIS_URL`` (and only the URL does). A URL with
the scheme ``redis+cluster://`` (or ``rediss+cluster://``), or the query ``?cluster=true``,
connects through redis-py's cluster client.

>>> RedisSettings.from_url("redis://127.0.0.1:6380/0").cluster
False
>>> RedisSettings.from_url("redis+cluster://10.0.0.1:7000").url
'redis://10.0.0.1:7000'
>>> RedisSettings.from_url("redis://10.0.0.1:7000?cluster=true").full_url
'redis+cluster://10.0.0.1:7000'

``url`` is what redis-py's ``from_url`` takes; ``full_url`` says the same and whether to use the
cluster client: hand ``full_url`` (never ``url``) to another process or thread that connects
on its own, so a cluster stays a cluster there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .protocol.limits import MAX_RESULT_BYTES

#: Environment variable consulted when no URL is given.
ENV_URL = "ROLLQ_REDIS_URL"
#: A file holding the URL (its first line), for a URL with a password: a URL on the command
#: line shows in ``ps``, and an environment variable in ``/proc/<pid>/environ`` to the same user.
ENV_URL_FILE = "ROLLQ_REDIS_URL_FILE"
#: URL used when neither an argument nor the environment gives one.
DEFAULT_URL = "redis://127.0.0.1:6379/0"
#: Queue used when none is named.
DEFAULT_QUEUE = "default"


def _seconds(name: str, v: object, zero_ok: bool = False) -> None:
    """Refuse a ``RedisSettings`` timeout that is not finite seconds > 0 (>= 0 with ``zero_ok``)."""
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 or (zero_ok and v == 0))):
        raise ValueError(f"RedisSettings.{name} must be finite seconds {'>= 0 or None' if zero_ok else '> 0'}, got {v!r}")


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis."""

    url: str = DEFAULT_URL
    #: Use redis-py's cluster client (Redis Cluster / Valkey cluster mode).
    cluster: bool = False
    #: Seconds to wait for a TCP connection.
    connect_timeout: float = 5.0
    #: Seconds a non-blocking command may take before it is treated as a failure.
    command_timeout: float = 30.0
    #: Connections per client pool; on a cluster, commands and pipelines under way at once
    #: for the whole client (each uses at most one connection of a node).
    max_connections: int = 64
    #: Seconds a command waits for a free connection when all ``max_connections`` are in use
    #: (a burst: hundreds of HTTP clients of ``rollq serve`` at once); then it fails with
    #: redis-py's ``MaxConnectionsError``. None: it waits as long as it takes.
    pool_timeout: float | None = 30.0

    def __post_init__(self) -> None:
        n = self.max_connections
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"RedisSettings.max_connections must be an int >= 1, got {n!r}")
        _seconds("connect_timeout", self.connect_timeout)
        _seconds("command_timeout", self.command_timeout)
        if self.pool_timeout is not None:
            _seconds("pool_timeout", self.pool_timeout, zero_ok=True)

    @property
    def full_url(self) -> str:
        """``url`` with the cluster flag in its scheme: ``from_url(full_url)`` gives these settings back."""
        if not self.cluster:
            return self.url
        parts = urlsplit(self.url)
        return urlunsplit((f"{parts.scheme}+cluster", *parts[1:]))

    @classmethod
    def from_url(cls, url: str | None = None, **kw: object) -> RedisSettings:
        url = url or os.environ.get(ENV_URL) or read_url_file(os.environ.get(ENV_URL_FILE)) or DEFAULT_URL
        parts = urlsplit(url)
        cluster = False
        scheme = parts.scheme
        if scheme.endswith("+cluster"):
            cluster, scheme = True, scheme[: -len("+cluster")]
        query = dict(parse_qsl(parts.query))
        if query.pop("cluster", "").lower() in ("1", "true", "yes"):
            cluster = True
        clean = urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))
        return cls(url=clean, cluster=cluster, **kw)  # type: ignore[arg-type]


def read_url_file(path: str | None) -> str | None:
    """The Redis URL in the first line of the file at ``path`` (None: no path given).

    >>> read_url_file(None) is None
    True
    """
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().strip()
    except OSError as e:
        raise ValueError(f"cannot read the Redis URL file {path!r}: {e.strerror}") from e
    if not line:
        raise ValueError(f"the Redis URL file {path!r} is empty")
    return line


@dataclass(frozen=True)
class ProducerSettings:
    """Trainer-side knobs."""

    #: Jobs a producer may have outstanding (submitted, result not yet received).
    max_outstanding: int = 100_000
    #: When the cap is reached: wait for room (True) or raise QueueFull (False).
    block_when_full: bool = True
    #: submit_many: on one server, the most jobs whose script replies may be outstanding
    #: (calls are written as they are built); on a cluster, jobs per pipelined round trip.
    chunk_size: int = 4000
    #: Jobs per script call: bounds how long one call holds Redis (shared servers).
    script_batch: int = 500
    #: Results fetched per read of the result stream.
    result_batch: int = 2000
    #: Largest prompt accepted, in bytes (text, token bytes or message contents).
    max_prompt_bytes: int = 4 << 20
    #: Seconds between retries while the staleness bound refuses a submission.
    admission_poll: float = 0.05
    #: Shards of the queue (rollq/shards.py): None follows the queue's record (1 if it has
    #: none); a number is recorded if the queue has none, and refused if it records another.
    shards: int | None = None


@dataclass(frozen=True)
class ConsumerSettings:
    """Replica-side knobs. Times in seconds."""

    #: Jobs a replica runs at once at most (the capacity controller stays below it).
    #: None: 1.25x the engine's own concurrency limit (vLLM's max_num_seqs) + 8, else 256.
    max_inflight: int | None = None
    #: Starting in-flight cap before the controller adapts it.
    #: None: the engine's concurrency limit + 8 (keeps its scheduler fed), else 64.
    initial_inflight: int | None = None
    #: Adapt the in-flight cap to the engine's KV usage / preemptions.
    adaptive: bool = True
    #: Most jobs taken in one read. Small reads interleave replicas fairly when a burst of jobs
    #: arrives (each takes a slice, then reads again); raise it for tiny, very fast jobs.
    batch: int = 64
    #: How long one blocking read waits for new jobs.
    block: float = 1.0
    #: Heartbeat period; the lease key is renewed this often.
    heartbeat_interval: float = 1.0
    #: A consumer whose lease is this old is dead; its jobs are reclaimed. Also the TTL of the
    #: reclaimer role (at least 2 x ``reclaim_interval``): a dead holder is replaced this late.
    lease_ttl: float = 5.0
    #: How often each replica takes a reclaim turn: it renews or tries to take the queue's
    #: reclaimer role (and every ``lease_ttl`` checks its own pending entries); only the role's
    #: holder scans the group for dead consumers, so a fleet scans once per interval, not once
    #: per replica. Replicas of one queue should share this and ``lease_ttl``.
    reclaim_interval: float = 1.0
    #: Deliveries after which a job goes to the dead-letter stream instead of running again.
    max_deliveries: int = 3
    #: Shards of the queue (rollq/shards.py): None follows the queue's record (1 if it has
    #: none, and the replica takes up shards added later); a number is recorded if the queue
    #: has none, and refused if it records another.
    shards: int | None = None
    #: Results are kept this long for a producer that does not read them.
    result_ttl: float = 24 * 3600.0
    #: Dead-letter stream is trimmed (approximately) to this many entries.
    dlq_maxlen: int = 100_000
    #: On SIGTERM, wait this long for running jobs before handing the rest back
    #: (keep below Kubernetes' terminationGracePeriodSeconds).
    drain_timeout: float = 25.0
    #: Largest prompt accepted, in bytes.
    max_prompt_bytes: int = 4 << 20
    #: Reconnect backoff: first delay and cap.
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    #: A job whose ``min_version`` is above the loaded policy version waits (outside the
    #: in-flight cap) at most this long in all, then fails with VersionUnavailable.
    max_version_wait: float = 300.0
    #: ... and at most this long while its ``min_version`` is beyond the newest committed
    #: version (raise it if trainers submit jobs for a version long before publishing it).
    max_uncommitted_wait: float = 60.0
    #: Jobs that may wait for a policy version at once; at this bound the replica stops
    #: pulling until some start or fail (the rest wait in Redis for any replica).
    max_parked: int = 1024
    #: Largest encoded result a replica records; a larger one fails its job with
    #: ResultTooLarge (Redis refuses values over 512 MiB, and a huge one delays every result
    #: recorded after it).
    max_result_bytes: int = MAX_RESULT_BYTES
    #: Bytes of a dead-lettered entry kept in its dead letter (the rest is cut; a cut entry
    #: cannot be requeued). ``dlq_maxlen`` bounds how many dead letters are kept.
    dlq_payload_bytes: int = 64 << 10
    #: Streamed jobs (``Job.stream``): their new tokens are written to Redis at most this
    #: often (seconds; one pipeline per flush for every streamed job)...
    progress_interval: float = 0.025
    #: ... to a per-job stream trimmed (approximately) to this many entries ...
    progress_maxlen: int = 4096
    #: ... that expires this long after its last write (seconds).
    progress_ttl: float = 600.0
    #: Most tokens of progress buffered between flushes (more are dropped: progress is a
    #: preview; the result is authoritative).
    progress_buffer_tokens: int = 1 << 20
    #: Extra fields shown in the replica registry.
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightSyncSettings:
    """How a replica follows policy versions (:class:`~rollq.weightsync.replica.follower.WeightFollower`).

    >>> WeightSyncSettings(root="/dev/shm/rollq-weights", broadcast=True).enabled
    True
    >>> WeightSyncSettings().enabled
    False
    """

    #: The memmap store (the publisher's ``root``); None: versions arrive only by broadcast.
    root: str | None = None
    #: Join the trainer's broadcast group (``BroadcastSender``) and receive versions while serving.
    broadcast: bool = False
    #: Seconds between reads of the durable version record when no pub/sub hint arrives.
    reconcile_interval: float = 5.0
    #: Seconds a version may take to load (and, on start, to arrive when the committed one was missed).
    load_timeout: float = 300.0
    #: Seconds the ``drain`` policy waits for running requests before loading anyway.
    drain_timeout: float = 120.0
    #: Update policy when the queue's config names none (``keep``, ``abort``, ``drain``).
    default_policy: str = "keep"
    #: ``abort`` policy: requests ended for an update continue from the tokens they had, on
    #: the new weights (:mod:`rollq.consumer._resume`; seeded jobs still run again from
    #: scratch, as do all on an engine without ``reports_aborted``). False: every one runs
    #: again from scratch.
    abort_resume: bool = False
    #: Seconds the resume waits for the engine to report the requests it ended.
    abort_resume_timeout: float = 30.0
    #: Memmap reads to the GPU: 256 MiB chunks queued at most this many at a time (0: all at
    #: once, faster but it stalls generation; see :class:`~rollq.weightsync.memmap.MemmapStore`).
    memmap_chunks_in_flight: int = 3
    #: IPC copies on a GPU wait for the device after every this many bytes copied or
    #: checksummed, so the engine on the same GPU steps between the parts instead of behind
    #: one burst over the whole version (0: one burst, the fastest copy).
    ipc_chunk_bytes: int = 0
    #: IPC copies on a GPU run on a high-priority CUDA stream: their blocks are scheduled
    #: ahead of the engine's queued kernels as SMs free up, so the copy ends sooner while
    #: the engine's steps during it slow down (the same bytes move either way). False: the
    #: default priority, the engine's.
    ipc_high_priority: bool = False
    #: IPC copies keep the trainer's storages mapped from one version to the next, so a
    #: trainer that updates its tensors in place costs no handle opening after its first
    #: version (:mod:`rollq.weightsync.worker._ipc_maps`). False: every version opens every
    #: handle and unmaps it after the copy.
    ipc_keep_mappings: bool = True
    #: The replica's workers watch for IPC versions themselves (a thread with its own Redis
    #: connection in each worker) and start copying one when it is announced, while the
    #: follower reads and checks its record; no engine RPC then stands between the
    #: announcement and the copy (:mod:`rollq.weightsync.worker._ipc_watch`). False: the
    #: follower starts every copy with an RPC after it has read the record.
    ipc_prestage: bool = False
    #: A leased IPC version (``WeightPublisher(ipc_lease=True)``) is not copied while the
    #: engine serves: the swap copies the trainer's tensors straight into the live weights
    #: (by the shadow's load plan on a GPU; through ``load_weights`` where there is no shadow),
    #: under a claim the publisher's ``release_weights`` waits for. One copy of the weights
    #: fewer per version, and none beside them in memory; generation stops for the same copy
    #: as a shadow swap. The trainer process dying before the swap makes the replica refuse
    #: the version (the old weights serve on); dying during the swap's copy itself (a few
    #: milliseconds on a GPU) is not covered on CUDA, where the memory of a dead exporter is
    #: undefined: the worker then fails the swap with
    #: :class:`~rollq.weightsync.ipc_wire.TornDirectSwap`, its weights possibly mixed, and the
    #: follower loads the version's memmap copy instead where the publisher keeps one, else
    #: records it; so it does when the trainer released the version during the copy (the
    #: claim lives in Redis: a Redis that lost it within those milliseconds). False (the
    #: default): leased versions are copied into the shadow first, and a trainer dying at any
    #: point leaves the old weights serving.
    ipc_direct: bool = False
    #: Swap broadcast versions in part by part while they arrive (``keep``, one worker;
    #: :class:`~rollq.weightsync.replica._overlap.OverlappedSwap`).
    swap_overlap: bool = False
    #: The overlapped swap starts this many seconds before the broadcast's estimated end (one
    #: engine step plus the exchange of the weights).
    overlap_lead_s: float = 0.035
    #: Seconds the overlapped swap waits for the commit before undoing what it swapped in.
    overlap_commit_timeout: float = 0.25
    #: Swap programs the overlapped swap prepares (0: its default).
    overlap_programs: int = 0
    #: Attempts after the first at a version whose load failed for a reason other than
    #: corrupt or mismatched data.
    load_retries: int = 3
    #: Seconds between those attempts at first, doubling (at most 60 s).
    load_retry_delay: float = 2.0

    @property
    def enabled(self) -> bool:
        """Whether there is anything to follow (a memmap root or a broadcast group)."""
        return self.root is not None or self.broadcast
