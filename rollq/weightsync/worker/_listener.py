"""Worker side of the broadcast: following the trainer's offers over Redis.

Runs in a daemon thread of each vLLM worker process, with its own blocking Redis connection:
no engine RPC sits on the update's path, where it would queue behind generation steps.
Pub/sub ``woffer <v>`` messages are only a hint; the offer record is checked every
``Listen.poll`` seconds too. Each new offer of the worker's group is received once, then
acked (:class:`~rollq.weightsync.wire.Ack`, naming the group) in the offer's ack hash and on
its signal list; a receive that ends after its group was left (the trainer rebuilt the group
and may offer the same version again there) is not acked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from ...protocol import Control, parse_control
from ..wire import Listen, Offer, State, encode_ack

if TYPE_CHECKING:
    from ..base import OfferHost

log = logging.getLogger(__name__)


def sync_client(url: str) -> Any:
    """A blocking redis-py client for ``url`` (cluster URLs through the cluster client)."""
    from ...settings import RedisSettings

    st = RedisSettings.from_url(url)
    if st.cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(st.url)
    import redis

    return redis.Redis.from_url(st.url)


def follow_channel(url: str, channel: str, closed: threading.Event, check: Callable[[Any], Any],
                   wait: Callable[[Any], None], what: str) -> None:
    """Until ``closed``: ``check(client)`` then ``wait(pubsub)``, over a blocking connection to
    ``url`` subscribed to ``channel`` (in the calling thread). Redis down or restarting: logged
    as ``what``, then reconnect and resubscribe after a back-off (0.2 s doubling to 5 s, back to
    0.2 s after each good check)."""
    delay = 0.2
    while not closed.is_set():
        client = pubsub = None
        try:
            client = sync_client(url)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(channel)
            while not closed.is_set():
                check(client)
                delay = 0.2
                wait(pubsub)
        except Exception as e:  # Redis down or restarting: back off and resubscribe
            if not closed.is_set():
                log.warning("%s: %s: %s (retrying in %.1fs)", what, type(e).__name__, e, delay)
                closed.wait(delay)
                delay = min(delay * 2, 5.0)
        finally:
            for c in (pubsub, client):
                with contextlib.suppress(Exception):
                    c is not None and c.close()


class OfferListener:
    """Follows the offers of ``receiver``'s group newer than ``listen.serving``.

    Every member of the group must take part in each of its broadcasts (the trainer's
    collective waits for all), so an offer of the group is skipped only when it is not newer
    than what the replica served when it joined, or was taken part in already.
    """

    def __init__(self, receiver: OfferHost, listen: Listen):
        self.receiver = receiver
        self.listen = listen
        self.attempted = 0  # newest offered version this worker took part in (or skipped)
        self._reported: bytes | None = None  # the FlatLayout last reported
        self._version_client: Any = None  # reads the version record for the swap (another thread)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollq-offers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        follow_channel(self.listen.url, self.listen.channel, self.receiver.closed, self.poll, self._wait_hint,
                       f"offer listener of rank {self.receiver.rank}")

    def _wait_hint(self, pubsub: Any) -> None:
        """Until an offer's hint or ``poll`` seconds; other control messages on the way are
        handed to the receiver (version commits)."""
        msg = pubsub.get_message(timeout=self.listen.poll)
        while msg is not None:
            text = str(msg.get("data", b""), "latin-1")
            if parse_control(text)[0] is Control.WOFFER:
                return
            self.receiver.on_control(text)
            msg = pubsub.get_message(timeout=0)  # other control traffic: drain it

    def poll(self, client: Any) -> bool:
        """Receive the current offer if it is new for this group; returns whether it did."""
        raw = client.hget(self.listen.offer_key, "d")
        if raw is None:
            return False
        offer = msgspec.msgpack.decode(raw, type=Offer)
        rcv = self.receiver
        if offer.group != rcv.info.id or offer.version <= max(self.attempted, self.listen.serving):
            return False
        self.attempted = offer.version  # once per offer: the trainer moves on after a failure
        rcv.receive(offer)
        if rcv.closed.is_set():  # this group was left meanwhile: the trainer no longer waits for it
            return False
        self._answer(client, offer)
        return True

    def _answer(self, client: Any, offer: Offer) -> None:
        """Ack the offer, after reporting this worker's flat layout when it changed."""
        listen, status, sink = self.listen, self.receiver.status, self.receiver.sink
        ack = encode_ack(status.ack(listen.field, offer.group))
        report = None
        # The layout only changes when a version is loaded (not written in place): in steady
        # state nothing is computed here, between the receive and the ack.
        if (sink is not None and listen.layouts_key and status.state is State.STAGED
                and (self._reported is None or not status.in_place)):
            fl = sink.flat_layout(offer.manifest)
            report = msgspec.msgpack.encode(fl) if fl is not None else None
        pipe = client.pipeline(transaction=False)
        if report is not None and report != self._reported:
            pipe.hset(listen.layouts_key, listen.field, report)  # before the ack: seen by the next offer
            self._reported = report
        if offer.acks:
            pipe.hset(offer.acks, listen.field, ack)
        if offer.ack_signal:
            pipe.rpush(offer.ack_signal, ack)
        pipe.execute()

    def recorded(self) -> int:
        """The committed version in Redis (0: unknown)."""
        if not self.listen.version_key:
            return 0
        try:
            if self._version_client is None:
                self._version_client = sync_client(self.listen.url)
            v = self._version_client.hget(self.listen.version_key, "v")
            return int(v) if v is not None else 0
        except Exception as e:  # Redis away: the swap gives up and the follower's path applies it
            log.warning("reading the version record failed: %s: %s", type(e).__name__, e)
            self._version_client = None
            return 0
