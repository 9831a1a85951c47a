"""kombu's Redis transport, and its Sentinel variant, with two fixes that keep a worker alive
through what a day-long run meets. dflash_tasks/tasks/app.py registers them for `redis://` and
`sentinel://` URLs (see `register`).

1. A queue entry that is not a kombu message at all (not JSON, JSON without kombu's envelope, a
   body that is not valid base64) is logged and dropped. kombu 5.7 decodes the envelope of an
   entry it has just popped (BRPOP) outside any error handler, so one stray `LPUSH gpu0 garbage`
   ends the worker with "Unrecoverable error". Entries with a valid envelope and a bad body (a
   pickle payload, a body that does not parse, an unknown task) never get here: Celery logs them
   and acknowledges them once (`Consumer.on_decode_error`, `on_invalid_task`), never retried.

2. Losing Redis (a restart) does not kill the worker. When Celery closes the lost connection,
   kombu tries to put the channel's unacknowledged messages back in their queues through that
   closed connection and fails with an AttributeError that Celery does not expect ("Unrecoverable
   error", the worker exits). Here a closed connection raises the transport's ConnectionError,
   which Celery handles by reconnecting, and the restore is skipped with a log line: those
   messages are still in Redis's `unacked` hash and come back after the visibility timeout (while
   their tasks, still running, record their rows; the redelivered copies are skipped as done).

For a failover the Sentinel variant needs one fix more (the master's password, see
SentinelChannel): its connections are redis-py's Sentinel-managed ones, which ask the sentinels
for the master at every connect and drop a connection to a master that became a replica; the
lost connection is the same reconnect as a Redis restart, through fix 2.
"""
from __future__ import annotations

import json
import logging

import redis
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)


class UndecodableEnvelope(Exception):
    """A queue entry whose kombu envelope cannot be read."""


class Message(kombu_redis.Channel.Message):
    def __init__(self, payload, channel=None, **kwargs):
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UndecodableEnvelope(f"{type(exc).__name__}: {exc}; entry: "
                                      f"{json.dumps(payload)[:300]}") from exc


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client=None):
        try:
            return super().restore_unacked(client)
        except self.channel.connection_errors as exc:
            log.warning("broker connection lost: %d unacknowledged message(s) stay in Redis and "
                        "come back after the visibility timeout (%s)", len(self._delivered), exc)
            self._delivered.clear()
            return []


class Fixes:
    """The fixes, for kombu's Channel and its SentinelChannel alike."""

    Message = Message
    QoS = QoS

    def _connparams(self, asynchronous=False):
        # The channel outlives its connection: acks of tasks that were running when Redis went
        # away come here after Celery closed that connection.
        if getattr(self.connection, "client", None) is None:
            raise redis.ConnectionError("the broker connection is closed")
        return super()._connparams(asynchronous=asynchronous)

    def _create_client(self, asynchronous=False):
        """One synchronous client per channel and pool, not one per operation: kombu makes a
        new redis.Redis for every ack, publish and unacked record, and with redis-py 8 that
        construction was about a tenth of a GPU worker's CPU (benchmarks/RESULTS.md, case 4).
        redis.Redis is thread-safe; the pool is what reconnects, and a new pool gets a new
        client."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        cached = self.__dict__.get("_sync_client")
        if cached is None or cached.connection_pool is not pool:
            cached = self.__dict__["_sync_client"] = super()._create_client(asynchronous=False)
        return cached

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except (json.JSONDecodeError, UnicodeDecodeError, UndecodableEnvelope) as exc:
            doc = getattr(exc, "doc", None)
            log.error("dropped a queue entry that is not a kombu message: %s%s", exc,
                      f"; entry: {doc[:300]!r}" if isinstance(doc, str) else "")
            return None


class Channel(Fixes, kombu_redis.Channel):
    pass


class SentinelChannel(Fixes, kombu_redis.SentinelChannel):
    """Also: the master's password comes from the transport option `master_password`. kombu's
    `Connection.switch`, which moves on to the next sentinel of the URL when one cannot be
    reached (a failover), replaces a password given apart from the URL (Celery's
    broker_password) by that URL's none: every connection after it would be refused."""

    from_transport_options = kombu_redis.SentinelChannel.from_transport_options + ("master_password",)
    master_password = None

    def _connparams(self, asynchronous=False):
        params = super()._connparams(asynchronous=asynchronous)
        if self.master_password:
            params["password"] = self.master_password
        return params


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


def register() -> None:
    """Make `redis://` (and `rediss://`) URLs use this Transport in this process, `sentinel://`
    ones its SentinelTransport. An alias, not Celery's `broker_transport`: kombu re-reads the
    transport from the URL's scheme when it reconnects (`Connection.switch`, which also moves on
    to the next sentinel of the URL), which would bring back the unpatched one after the first
    Redis restart or failover."""
    from kombu.transport import TRANSPORT_ALIASES

    for scheme, transport in (("redis", "Transport"), ("rediss", "Transport"),
                              ("sentinel", "SentinelTransport")):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:{transport}"
