"""SUBMIT calls for built jobs: numbered, ``script_batch`` jobs and one stream each, routed
over the queue's shards (:class:`~rollq.shards.ShardMap`): a caller-chosen id to its shard, a
job targeted at a replica to the replica's home shard, any other job round robin. The calls
run in :mod:`rollq.producer._submission`.
"""

from __future__ import annotations

from typing import Any

from ..keys import QueueKeys
from ..protocol import Job, encode_job
from ..shards import ShardMap, home_shard, shard_of_id
from ._calls import CALL_RECORD_TTL_MS, Call, CallNumbers, pack_args
from ._handles import Ledger


class CallRouter:
    """The SUBMIT calls of one producer (``producer_id``), numbered by ``numbers``; the
    ledger's ``delivered`` ids are forgotten for a caller-chosen id sent again (its next
    result counts).

    >>> from rollq.producer._handles import Ledger
    >>> from rollq.settings import ProducerSettings
    >>> ledger = Ledger(ProducerSettings(), {}, lambda: None)
    >>> router = CallRouter("p1", QueueKeys("grpo"), 256, CallNumbers(), ledger)
    >>> router.set_shards(ShardMap(QueueKeys("grpo"), 2), ["c0", "c1"])
    >>> jobs = [Job(id="a", reply="p1", text="x"), Job(id="b", reply="p1", text="y")]  # generated ids
    >>> [(keys[0], keys[-1], args[6]) for keys, args, _ in router.calls(jobs)]  # round robin; K=2 carried
    [('rollq:{grpo}:jobs', 'c0', 2), ('rollq:{grpo~1}:jobs', 'c1', 2)]
    """

    def __init__(self, producer_id: str, keys: QueueKeys, script_batch: int, numbers: CallNumbers, ledger: Ledger) -> None:
        self.id = producer_id
        self.keys = keys
        self.script_batch = script_batch
        self.numbers = numbers
        self._ledger = ledger
        #: The queue grew from one shard with caller-chosen ids left in shard 0 (rollq/shards.py):
        #: such an id homed in another shard is checked in shard 0 first (submit.lua's check calls).
        self.grown = False
        self.set_shards(ShardMap(keys, 1), [keys.submit_calls(producer_id)])

    def set_shards(self, layout: ShardMap, calls_keys: list[str]) -> None:
        """Route over ``layout``, with this producer's call record in each shard (index = shard)."""
        self.layout = layout
        self.shards = layout.size
        self._calls_keys = calls_keys
        self._rr = 0  # round robin over the shards: the next generated-id job's shard

    def calls(self, jobs: list[Job]) -> list[Call]:
        """SUBMIT calls for ``jobs``, each numbered, ``script_batch`` jobs per call and one
        stream per call (the queue's, or a replica's for targeted jobs)."""
        if self.shards > 1:
            return self._sharded_calls(jobs)
        step = self.script_batch
        number, rec, inc = self.numbers.number, self._calls_keys[0], self.numbers.incarnation
        if all(job.replica is None and not job.tracked for job in jobs):  # the common case
            keys = [*self.keys.submit_keys(self.keys.jobs), rec]
            payloads = list(map(encode_job, jobs))
            calls: list[Call] = []
            for i in range(0, len(jobs), step):
                part = payloads[i : i + step]
                args: list[Any] = [""] * (2 * len(part))  # '': a generated id, nothing to record
                args[1::2] = part
                call_args = [pack_args(args), self.id, inc, 0, 0, CALL_RECORD_TTL_MS, 1, ""]
                number(call_args)
                calls.append((keys, call_args, range(i, i + len(part))))
            return calls
        by_stream: dict[str | None, list[int]] = {}
        delivered = self._ledger.delivered
        for i, job in enumerate(jobs):
            pos = by_stream.get(job.replica)
            if pos is None:
                pos = by_stream[job.replica] = []
            pos.append(i)
            if job.tracked and delivered:  # a caller-chosen id may run again: its next result counts
                delivered.discard(job.id)
        calls = []
        for replica, positions in by_stream.items():
            keys = [*self.keys.submit_keys(self.keys.job_stream(replica)), rec]
            self._add_calls(calls, keys, jobs, positions)
        return calls

    def _add_calls(self, calls: list[Call], keys: list[str], jobs: list[Job], positions: list[int], check: bool = False) -> None:
        """Append the numbered SUBMIT calls of ``jobs[positions]`` (one stream: ``keys``),
        ``script_batch`` jobs per call (check calls with ``check``: see :meth:`_sharded_calls`)."""
        step, number, inc = self.script_batch, self.numbers.number, self.numbers.incarnation
        for i in range(0, len(positions), step):
            part = positions[i : i + step]
            args: list[Any] = []
            for k in part:
                job = jobs[k]
                args.append(job.id if job.tracked else "")
                args.append(encode_job(job))
            # One msgpack argument per call, not two per job (see benchmarks/README.md).
            call_args = [pack_args(args), self.id, inc, 0, 0, CALL_RECORD_TTL_MS, self.shards, "1" if check else ""]
            number(call_args)
            calls.append((keys, call_args, part))

    def _sharded_calls(self, jobs: list[Job], check: bool = True) -> list[Call]:
        """SUBMIT calls for ``jobs`` on a queue of K > 1 shards: each call holds the jobs of
        one shard and one stream, and carries that shard's keys and this producer's call record
        in that shard (call numbers stay one sequence per producer; a resent call meets its
        own record). A caller-chosen id goes to ``shard_of_id``, a job targeted at a replica
        to the replica's home shard (its stream is there), any other job round robin.

        On a queue that grew from one shard (``_grown``, with ``check``), a caller-chosen id
        whose shard is not 0 goes first in a check call to shard 0, where ids queued before
        the growth are recorded (``lua/submit.lua``); :meth:`Submission._finish_chunk <rollq.producer._submission.Submission._finish_chunk>` sends the ones not
        recorded there to their shard."""
        k = self.shards
        check = check and self.grown
        delivered = self._ledger.delivered
        groups: dict[tuple[int, str | None, bool], list[int]] = {}
        rr = self._rr
        for i, job in enumerate(jobs):
            if job.replica is not None:
                shard = home_shard(job.replica, k)
            elif job.tracked:
                shard = shard_of_id(job.id, k)
            else:
                shard, rr = rr, rr + 1 if rr + 1 < k else 0
            checked = check and job.tracked and shard != 0
            key = (0 if checked else shard, job.replica, checked)
            pos = groups.get(key)
            if pos is None:
                pos = groups[key] = []
            pos.append(i)
            if job.tracked and delivered:  # a caller-chosen id may run again: its next result counts
                delivered.discard(job.id)
        self._rr = rr
        calls: list[Call] = []
        for (shard, replica, checked), positions in groups.items():
            sk = self.layout[shard]
            keys = [*sk.submit_keys(sk.job_stream(replica)), self._calls_keys[shard]]
            self._add_calls(calls, keys, jobs, positions, check=checked)
        return calls

    def calls_for(self, jobs: list[Job], positions: list[int], check: bool = True) -> list[Call]:
        """SUBMIT calls for ``jobs[positions]`` routed over the shards as they are now, with
        positions in ``jobs``."""
        sub = [jobs[k] for k in positions]
        calls = self._sharded_calls(sub, check) if self.shards > 1 else self.calls(sub)
        return [(keys, args, [positions[i] for i in part]) for keys, args, part in calls]
