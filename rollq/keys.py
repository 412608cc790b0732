"""Every Redis key and channel name rollq uses, in one place.

All keys of one queue share the hash tag ``{rollq:<queue>}`` so that, on Redis Cluster, they
land in one slot and every Lua script of that queue can touch them atomically. One key is
global, :data:`QUEUES` (the names of the queues in use). Nothing in rollq builds a key name
anywhere else.

A queue may be *sharded* over K sub-queues (rollq/shards.py): shard 0 is the queue's own
tag ``{<queue>}`` and holds everything of the queue as a whole (policy versions, weight sync,
the replica registry, settings); shard ``i > 0`` has the tag ``{<queue>~i}`` (``~`` is not
allowed in names, so no queue's tag can be a shard's) and its own complete set of job keys
(stream, ids, results, stats, leases, ...), so every script still runs in one slot.

>>> k = QueueKeys("grpo")
>>> k.jobs
'rollq:{grpo}:jobs'
>>> k.results("trainer-1")
'rollq:{grpo}:res:trainer-1'
>>> k.shard(2).jobs
'rollq:{grpo~2}:jobs'
>>> k.shard(2).base.version
'rollq:{grpo}:version'
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property

#: Prefix of every rollq key.
PREFIX = "rollq"
#: Consumer group every replica of a queue joins.
GROUP = "rollq"
#: Most shards one queue may have.
MAX_SHARDS = 256
#: Field of a stream entry that holds the msgpack payload.
FIELD = "d"
#: Sorted set ``queue name -> last-seen UNIX time`` of the queues in use, kept by producers
#: and consumers (rollq/registry.py) so that ``rollq status`` and the dashboard list every
#: queue without a scan. The one key outside every queue's hash tag: on Redis Cluster it lives
#: on a single node, and an ACL user limited to ``~rollq:{<queue>}:*`` cannot register.
QUEUES = f"{PREFIX}:queues"

#: Separates a queue's name from a shard number in the shard's hash tag.
SHARD_SEP = "~"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
#: How every queue's key name starts: the prefix and the opening of its hash tag.
_TAG_START = f"{PREFIX}:{{"


def check_name(kind: str, name: str) -> str:
    r"""Queue, replica and producer names are short, printable and tag-safe (the whole name:
    a trailing newline is refused too).

    >>> check_name("replica", "b0")
    'b0'
    >>> check_name("replica", "b0\n")
    Traceback (most recent call last):
    ...
    ValueError: invalid replica name 'b0\n': use 1-128 characters from [A-Za-z0-9_.-]
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name[:64]) + (f"... ({len(name)} characters)" if len(name) > 64 else "") if isinstance(name, str) else type(name).__name__
        raise ValueError(f"invalid {kind} name {shown}: use 1-128 characters from [A-Za-z0-9_.-]")
    return name


def tag_of(key: str) -> str:
    """The hash tag of a queue's key name (up to its ``}``), which names the queue and the
    shard the key belongs to; the one parser of rollq's key names
    (:meth:`rollq.shards.ShardMap.of_key` maps it back to the shard's keys).

    >>> tag_of("rollq:{grpo~2}:res:p1")
    'rollq:{grpo~2}'
    >>> tag_of(QUEUES)
    Traceback (most recent call last):
    ...
    ValueError: 'rollq:queues' is no queue's key
    """
    end = key.find("}")
    if end < 0 or not key.startswith(_TAG_START):
        raise ValueError(f"{key[:200]!r} is no queue's key")
    return key[: end + 1]


@dataclass(frozen=True)
class QueueKeys:
    """Key names of one queue, or of one shard of it (``shard > 0``)."""

    queue: str
    shard_index: int = 0

    def __post_init__(self) -> None:
        check_name("queue", self.queue)
        if type(self.shard_index) is not int or not 0 <= self.shard_index < MAX_SHARDS:
            raise ValueError(f"invalid shard {self.shard_index!r}: use 0-{MAX_SHARDS - 1}")

    @cached_property
    def tag(self) -> str:
        if self.shard_index:
            return f"{PREFIX}:{{{self.queue}{SHARD_SEP}{self.shard_index}}}"
        return f"{PREFIX}:{{{self.queue}}}"

    def shard(self, i: int) -> QueueKeys:
        """The keys of shard ``i`` of this queue (``shard(0)`` is the queue's own)."""
        return self if i == self.shard_index else QueueKeys(self.queue, i)

    def shards(self, k: int) -> list[QueueKeys]:
        """The keys of shards ``0 .. k-1``."""
        return [self.shard(i) for i in range(k)]

    @cached_property
    def base(self) -> QueueKeys:
        """Shard 0: where the queue-wide keys live (versions, weight sync, registry, config)."""
        return self.shard(0)

    # -- job streams ---------------------------------------------------------------------
    @cached_property
    def jobs(self) -> str:
        """Shared stream of untargeted jobs; every replica of the queue pulls from it."""
        return f"{self.tag}:jobs"

    def replica_jobs(self, replica: str) -> str:
        """Stream of jobs targeted at one replica (multi-turn follow-ups, ``replica=``)."""
        return f"{self.tag}:r:{replica}"

    def job_stream(self, replica: str | None) -> str:
        return self.jobs if not replica else self.replica_jobs(replica)

    @cached_property
    def ids(self) -> str:
        """Hash of caller-chosen job ids while queued or running (idempotent submission)."""
        return f"{self.tag}:ids"

    def cancel(self, job_id: str) -> str:
        """Cancellation mark of a job (expires; consumers check it for running jobs)."""
        return f"{self.tag}:cx:{job_id}"

    @cached_property
    def dlq(self) -> str:
        """Dead-letter stream: entries that could not be served, with the reason."""
        return f"{self.tag}:dlq"

    def results(self, producer: str) -> str:
        """Per-producer result stream; the producer deletes what it has consumed."""
        return f"{self.tag}:res:{producer}"

    def progress(self, producer: str, job_id: str) -> str:
        """Progress stream of a streamed job (``Job.stream``): its samples' tokens while they
        are generated, in the shard of the job's stream; trimmed and expiring (the replica
        sets both), so nothing is left behind.

        >>> QueueKeys("grpo").progress("p1", "j7")
        'rollq:{grpo}:pg:p1:j7'
        """
        return f"{self.tag}:pg:{producer}:{job_id}"

    # -- replicas --------------------------------------------------------------------------
    @cached_property
    def consumers(self) -> str:
        """Hash ``consumer -> msgpack info`` (registry shown by ``rollq status``)."""
        return f"{self.tag}:consumers"

    def heartbeat(self, consumer: str) -> str:
        """Lease of a live consumer: a key with a TTL, renewed every heartbeat."""
        return f"{self.tag}:hb:{consumer}"

    @cached_property
    def free(self) -> str:
        """Hash ``replica -> msgpack FreeSlots``: each replica's free capacity as of its
        last heartbeat, which it writes and reads every beat (rollq/consumer/_share.py) to take
        its share of a burst, not the whole of it."""
        return f"{self.tag}:free"

    def session(self, key: str) -> str:
        """String: the replica that served a session last (``rollq serve``'s sticky sessions,
        rollq/serve/sessions.py), with a TTL. ``key`` is the client's session key, hashed
        here, so any string a client sends makes a short key of fixed form."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self.tag}:sess:{digest}"

    @cached_property
    def reclaimer(self) -> str:
        """String: the id of the one replica that scans for dead peers now (the reclaimer
        role, rollq/consumer/_reclaimer.py); a TTL, renewed by its holder every reclaim turn."""
        return f"{self.tag}:reclaimer"

    # -- accounting and control --------------------------------------------------------
    @cached_property
    def stats(self) -> str:
        """Hash of monotonically increasing counters (submitted, completed, failed, ...)."""
        return f"{self.tag}:stats"

    @cached_property
    def latency(self) -> str:
        """Hash of latency histogram buckets (submit-to-result, milliseconds)."""
        return f"{self.tag}:lat"

    @cached_property
    def lag(self) -> str:
        """Hash ``lag -> count``: policy lag of finished jobs (loaded version - version at start)."""
        return f"{self.tag}:lagh"

    @cached_property
    def control(self) -> str:
        """Pub/sub channel of hints (cancellations, hand-backs, new versions)."""
        return f"{self.tag}:ctl"

    @cached_property
    def config(self) -> str:
        """Hash of per-queue settings (update policy, staleness bound)."""
        return f"{self.tag}:config"

    # -- policy versions (weight sync) -----------------------------------------------------
    @cached_property
    def version(self) -> str:
        """Hash ``v`` (latest committed policy version) and ``d`` (its msgpack record)."""
        return f"{self.tag}:version"

    @cached_property
    def versions_log(self) -> str:
        """Stream of every committed version, for dashboards and audits."""
        return f"{self.tag}:versions"

    @cached_property
    def weights_group(self) -> str:
        """Hash: the trainer's broadcast group: ``call`` (the id of a group being formed, whose
        call replicas answer in :meth:`weights_answers`) and ``d`` (msgpack GroupInfo of the
        formed group, with each member replica's first rank)."""
        return f"{self.tag}:wgroup"

    @cached_property
    def weights_members(self) -> str:
        """Hash ``replica -> "workers run-token"`` of the replicas that follow broadcasts
        (written by each one at start, removed at stop or by the trainer when it stops
        answering; see rollq.weightsync.wire.member_entry)."""
        return f"{self.tag}:wmembers"

    def weights_answers(self, group: str) -> str:
        """Hash ``replica -> "workers run-token"``: the replicas that answered the call of
        broadcast group ``group`` (its members). Expires."""
        return f"{self.tag}:wanswers:{group}"

    @cached_property
    def weights_offer(self) -> str:
        """Hash: the version being broadcast now (manifest, checksum), before it is committed."""
        return f"{self.tag}:woffer"

    @cached_property
    def weights_layouts(self) -> str:
        """Hash ``replica/worker -> msgpack FlatLayout``: where each broadcast receiver's shadow
        weights want each tensor of a manifest (the trainer packs buckets that way)."""
        return f"{self.tag}:wlayouts"

    @cached_property
    def weights_ipc(self) -> str:
        """String: msgpack IpcHandles of the version the trainer exposes to replicas on its
        host (rollq.weightsync.ipc_wire), written before the version is committed and
        overwritten by the next one."""
        return f"{self.tag}:wipc"

    @cached_property
    def weights_ipc_staged(self) -> str:
        """Hash ``replica/worker -> msgpack StageStatus``: each watching worker's copy of the
        version exposed over IPC (rollq.weightsync.worker._ipc_watch), read by its follower
        without an engine RPC."""
        return f"{self.tag}:wipcs"

    @cached_property
    def weights_ipc_swaps(self) -> str:
        """Hash ``replica/worker -> msgpack SwapTimes``: when each watching worker's last direct
        swap's copies ended on its device (or why they were torn), written by the worker's
        thread that waits for them (rollq.weightsync.worker._ipc_watch) and read by its
        follower without an engine RPC."""
        return f"{self.tag}:wipcw"

    @cached_property
    def weights_ipc_copied(self) -> str:
        """Hash ``replica -> version``: each running follower (registered at its start with the
        version it serves, removed at its stop) and the last version exposed over IPC that it
        finished copying (or gave up on), read by a publisher releasing a leased version
        (rollq.weightsync.transports.ipc_lease)."""
        return f"{self.tag}:wipcc"

    @cached_property
    def weights_ipc_claims(self) -> str:
        """Hash of a leased IPC version's direct swaps (``WeightSyncSettings.ipc_direct``):
        ``released`` (the newest version its publisher started releasing) and, per replica
        about to copy the trainer's tensors straight into its live weights,
        ``c:<replica> -> "<version> <deadline ms>"`` (rollq/lua/ipc_claim.lua,
        rollq/lua/ipc_release.lua; rollq.weightsync.transports.ipc_lease)."""
        return f"{self.tag}:wipcl"

    def weights_acks(self, version: int) -> str:
        """Hash ``replica -> ok|error`` of receivers that staged a broadcast version."""
        return f"{self.tag}:wacks:{version}"

    def weights_ack_signal(self, version: int) -> str:
        """List each receiver also pushes its ack onto (``field\tvalue``), so the trainer
        blocks on it (BLPOP) instead of polling the ack hash."""
        return f"{self.tag}:wacksig:{version}"

    @cached_property
    def manifests(self) -> str:
        """Hash ``replica -> msgpack Manifest``: tensor names, dtypes and shapes of the
        checkpoint each replica serves (the publisher checks state dicts against it)."""
        return f"{self.tag}:manifests"

    @cached_property
    def load_errors(self) -> str:
        """Hash ``replica -> msgpack LoadError``: why a replica cannot load a committed
        version (removed once it loads one)."""
        return f"{self.tag}:loaderr"

    @cached_property
    def admission(self) -> str:
        """Hash of admission-control counters (staleness bound)."""
        return f"{self.tag}:adm"

    def submit_calls(self, producer: str) -> str:
        """Hash ``call number -> msgpack reply`` of a producer's recent SUBMIT calls (plus
        ``inc``, its incarnation, and ``lo``, the lowest number kept): a resent call replays its
        reply instead of enqueuing again. Holds the calls in flight; expires; deleted on close."""
        return f"{self.tag}:calls:{producer}"

    def submit_keys(self, stream: str) -> list[str]:
        """KEYS of the submit script for ``stream`` (see rollq/lua/submit.lua)."""
        return [stream, self.ids, self.stats, self.config, self.version, self.admission]

    def all_static(self) -> list[str]:
        """Every key of the queue whose name does not depend on a producer or replica."""
        return [
            self.jobs, self.ids, self.dlq, self.consumers, self.free, self.reclaimer, self.stats, self.latency, self.lag,
            self.config, self.version, self.versions_log, self.admission, self.weights_group, self.weights_offer,
            self.weights_layouts, self.weights_members, self.weights_ipc, self.weights_ipc_staged, self.weights_ipc_copied,
            self.weights_ipc_claims, self.weights_ipc_swaps, self.manifests,
            self.load_errors,
        ]

    def pattern(self) -> str:
        """Glob of every key of this queue or shard (tests and ``rollq`` admin tools only)."""
        return f"{self.tag}:*"
