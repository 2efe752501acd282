"""The collection write log on NATS JetStream: idempotent appends, per-shard durable readers.

Layout
------
* One stream per collection, named ``WRITES_<token>``, capturing the subjects
  ``writes.<token>.*``; shard ``k`` appends to ``writes.<token>.<k>``. ``<token>`` is the
  collection name escaped injectively (`collection_token`): ASCII letters, digits and ``-`` stay,
  ``_`` becomes ``__`` and every other byte becomes ``_XX`` (hex), because stream names and subject
  tokens may not contain ``.``, ``*``, ``>`` or whitespace while collection names may contain ``.``.
  Two different collections never share a stream.
* FILE storage, limits retention with no limits (nothing is dropped by age or count),
  ``num_replicas`` configurable (1 in tests, 3 in production), and a duplicate window (default
  2 minutes) during which a second append carrying an already seen ``Nats-Msg-Id`` is not stored.

Sequences
---------
JetStream numbers messages per STREAM, not per subject: the sequences are global across all shards
of a collection. A shard's reader therefore sees strictly increasing but gappy sequences
(e.g. 1, 4, 5, 9), and "the last sequence a replica applied" is a stream sequence. Every number
this module returns or accepts (`PublishResult.seq`, `LogEntry.seq`, ``after_seq``,
`JetStreamWriteLog.last_sequence`) is a stream sequence.

Idempotency (measured on nats-server 2.15.1)
--------------------------------------------
A publish whose message id was already stored within the duplicate window is acknowledged with
``duplicate=True`` and the ORIGINAL message's sequence; nothing new is stored. The duplicate table
is per stream and survives a server restart (it is rebuilt from the stored messages). It is keyed by
the id alone, not by subject: the same id on another shard's subject is also dropped as a duplicate
(and acknowledged with the first message's sequence), so message ids must be unique per
collection, not merely per shard. After the window has passed, the same id is stored again.

Failure semantics
-----------------
`WriteLogUnavailable` means the outcome is UNKNOWN, not "not written": an append whose
acknowledgement was lost may still be stored (and a request sent just before a disconnect may be
delivered once the client reconnects). The caller either retries with the same message id (the
retry returns the original sequence while inside the duplicate window) or treats the write as
possibly applied. Appends are only sent while the client is connected; while it is reconnecting
they wait (within their timeout) instead of being buffered.

Durability
----------
FILE storage writes every append to the operating system before acknowledging it, so a killed
nats-server loses nothing it acknowledged (tested). It fsyncs only every ``sync_interval``
(2 minutes by default), so a single-server (R1) log can lose recent appends if the MACHINE fails;
with ``num_replicas=3`` an append is acknowledged once a quorum of servers holds it, which is what
protects against losing a machine.

Layout
------
Writes are placed on shards by a hash of (tenant, document) modulo the shard count, so a log
written for N shards means nothing to a build of M != N shards: its shard k's subject holds
documents that build places elsewhere. A router records N on ``writes.<token>.layout``
(`settle_layout`, atomically: the append expects that subject to be empty); routers and replicas
compare their own shard count with it (server/replication/log.py `layout_problem`).

Readers
-------
`ShardLogReader` is a durable pull consumer of one shard subject for one replica. The replica's own
store is the authority on what it has applied: the reader is opened with ``after_seq`` (the last
sequence durably applied) and positions the consumer at ``after_seq + 1``, recreating it when the
server's state does not match. Acknowledgements are advisory; they only stop redeliveries.

Nothing here imports grpc; the errors subclass `server.errors` so the transport maps them
(`WriteLogUnavailable` -> UNAVAILABLE, `StreamConfigMismatch`/`LogSequenceError` ->
FAILED_PRECONDITION).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.client import JetStreamContext

from server.errors import FailedPrecondition, SearchError, Unavailable

__all__ = [
    "DEFAULT_DUPLICATE_WINDOW",
    "JetStreamWriteLog",
    "LogEntry",
    "LogSequenceError",
    "PublishResult",
    "ShardLogReader",
    "StreamConfigMismatch",
    "WriteLogError",
    "WriteLogUnavailable",
    "collection_token",
    "shard_subject",
    "stream_name",
]

logger = logging.getLogger(__name__)

SUBJECT_PREFIX = "writes"
STREAM_PREFIX = "WRITES_"
MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
EXPECTED_SUBJECT_SEQ_HEADER = "Nats-Expected-Last-Subject-Sequence"
LAYOUT_TOKEN = "layout"
DEFAULT_DUPLICATE_WINDOW = 120.0
# Stream and consumer names become directory names on the server: keep well under 255 bytes.
MAX_TOKEN_LENGTH = 200

# JetStream API error codes (nats-server's errors.json) this module branches on.
_ERR_CONSUMER_NOT_FOUND = 10014
_ERR_NO_MESSAGE_FOUND = 10037
_ERR_STREAM_NAME_IN_USE = 10058
_ERR_STREAM_NOT_FOUND = 10059
_ERR_SUBJECTS_OVERLAP = 10065

# Retry pacing inside one call's timeout.
_MIN_ATTEMPT_TIMEOUT = 0.25
_BACKOFF_START = 0.02
_BACKOFF_MAX = 0.5

# The connection is gone for good (closed by us, or draining): retrying cannot help.
_CLOSED_ERRORS: Tuple[Type[BaseException], ...] = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
)
# Answered quickly and may succeed a moment later (stream leader election, JetStream still
# recovering after a restart, no stream yet, reconnect in progress).
_FAST_TRANSIENT_ERRORS: Tuple[Type[BaseException], ...] = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)
_NAME_FORBIDDEN = set(">*. /\\\t\r\n")

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Errors and results
# --------------------------------------------------------------------------------------------


class WriteLogError(SearchError):
    """The write log refused or failed an operation for a reason retrying will not fix
    (bad arguments are `ValueError`)."""


class WriteLogUnavailable(WriteLogError, Unavailable):
    """The log could not be reached (or did not answer) within the call's timeout, or the
    connection is closed. For an append the outcome is unknown: see the module docstring."""


class StreamConfigMismatch(WriteLogError, FailedPrecondition):
    """The collection's stream exists with subjects/storage/retention this module cannot use, or
    its subjects overlap another stream's."""


class StreamMissing(WriteLogError, FailedPrecondition):
    """The collection's stream does not exist (never created, deleted, or a wiped NATS store):
    nothing is stored until it is restored."""


class LogSequenceError(WriteLogError, FailedPrecondition):
    """A replica's applied sequence is inconsistent with the stream: the stream no longer holds
    the entries right after it (purged), or it is beyond the stream's last sequence (the stream was
    deleted and recreated, or the replica points at another cluster). The replica must be rebuilt
    from a snapshot; it cannot catch up from this log."""


@dataclass(frozen=True)
class PublishResult:
    """The acknowledgement of one append.

    ``seq`` is the stream sequence that holds the message. ``duplicate`` is True when JetStream
    recognised the message id inside the duplicate window and stored nothing; ``seq`` is then the
    sequence of the message originally stored with that id (nats-server reports it in the ack).
    """

    seq: int
    duplicate: bool


@dataclass(frozen=True)
class LogEntry:
    """One entry of a shard's log: its stream sequence, payload and message id ("" if the message
    was appended without one, i.e. not through `JetStreamWriteLog.publish`)."""

    seq: int
    payload: bytes
    msg_id: str
    appended_at: float = 0.0  # when the stream stored it (epoch seconds; 0 if unknown)


# --------------------------------------------------------------------------------------------
# Naming
# --------------------------------------------------------------------------------------------


def collection_token(collection: str) -> str:
    """Escape a collection name into one subject token / stream-name fragment, injectively.

    ASCII letters, digits and ``-`` are kept; ``_`` becomes ``__``; every other character becomes
    ``_XX`` per UTF-8 byte (upper-case hex). The escapes are prefix-free, so distinct names give
    distinct tokens. Raises ValueError for an empty name or one whose token exceeds
    `MAX_TOKEN_LENGTH` characters.
    """
    if not isinstance(collection, str) or not collection:
        raise ValueError(f"collection name must be a non-empty string, got {collection!r}")
    out: List[str] = []
    for ch in collection:
        if ch == "_":
            out.append("__")
        elif ch.isascii() and (ch.isalnum() or ch == "-"):
            out.append(ch)
        else:
            out.extend(f"_{b:02X}" for b in ch.encode("utf-8"))
    token = "".join(out)
    if len(token) > MAX_TOKEN_LENGTH:
        raise ValueError(f"collection name {collection[:80]!r} is too long for a stream name "
                         f"({len(token)} > {MAX_TOKEN_LENGTH} characters once escaped)")
    return token


def stream_name(collection: str) -> str:
    """The stream that holds `collection`'s write log: ``WRITES_<collection_token>``."""
    return STREAM_PREFIX + collection_token(collection)


def shard_subject(collection: str, shard: int) -> str:
    """The subject shard `shard` of `collection` appends to: ``writes.<token>.<shard>``."""
    return f"{SUBJECT_PREFIX}.{collection_token(collection)}.{_check_shard(shard)}"


def _check_shard(shard: int) -> int:
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
        raise ValueError(f"shard must be a non-negative int, got {shard!r}")
    return shard


def _check_seq(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _check_timeout(value: float, what: str = "timeout") -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{what} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def _check_consumer_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"durable consumer name must be a non-empty string, got {name!r}")
    if any(c in _NAME_FORBIDDEN for c in name) or len(name) > MAX_TOKEN_LENGTH:
        raise ValueError(f"durable consumer name {name[:80]!r} must not contain . * > / \\ or "
                         f"whitespace and must be at most {MAX_TOKEN_LENGTH} characters")
    return name


def _redact(url: str) -> str:
    """A server URL without credentials, for error messages."""
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        if parts.username or parts.password:
            host = parts.hostname or ""
            port = f":{parts.port}" if parts.port else ""
            return f"{parts.scheme}://***@{host}{port}"
    except ValueError:
        return "<unparseable server url>"
    return url


def _describe(exc: Optional[BaseException]) -> str:
    if exc is None:
        return "none"
    if isinstance(exc, nats.js.errors.APIError):
        return (f"{type(exc).__name__}(code={exc.code}, err_code={exc.err_code}, "
                f"{exc.description!r})")
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# The log
# --------------------------------------------------------------------------------------------


class JetStreamWriteLog:
    """A collection's write log: a connection to NATS plus the collection's stream.

    Create with `connect`; call `ensure_stream` once before appending; `close` when done. One
    instance may be shared by any number of coroutines of one event loop (appends are independent
    requests) and by several `ShardLogReader` objects.
    """

    def __init__(self, nc: NATS, collection: str, *, servers: Sequence[str], replicas: int,
                 duplicate_window: float, api_timeout: float, connected: asyncio.Event) -> None:
        """Internal: use `JetStreamWriteLog.connect`."""
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(timeout=api_timeout)
        self._collection = collection
        self._token = collection_token(collection)
        self._stream = STREAM_PREFIX + self._token
        self._servers = [_redact(s) for s in servers]
        self._replicas = replicas
        self._duplicate_window = duplicate_window
        self._api_timeout = api_timeout
        self._connected = connected

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        servers: Sequence[str],
        collection: str,
        replicas: int = 1,
        *,
        connect_timeout: float = 5.0,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        api_timeout: float = 5.0,
        reconnect_time_wait: float = 1.0,
        ping_interval: float = 10.0,
        name: Optional[str] = None,
        tls: Optional[ssl.SSLContext] = None,
        tls_hostname: Optional[str] = None,
        user_credentials: Optional[str] = None,
        nkeys_seed: Optional[str] = None,
        user: Optional[str] = None,
        password: Optional[str] = None,
        token: Optional[str] = None,
    ) -> "JetStreamWriteLog":
        """Connect to NATS for `collection`'s log. Does not create or check the stream.

        ``servers`` are NATS URLs (``nats://host:4222``, ``tls://...``). ``replicas`` is the
        stream's ``num_replicas`` used by `ensure_stream` (1 for a single server, 3 in production).
        The whole connect, across all servers, is bounded by ``connect_timeout``; afterwards the
        client reconnects forever, waiting ``reconnect_time_wait`` between attempts, and detects
        a dead peer after about three ``ping_interval`` s. ``api_timeout`` bounds the reader's
        management calls that take no explicit timeout. TLS and credentials (``tls`` context, a
        ``.creds`` file via ``user_credentials``, an NKey seed file, user/password or token) are
        passed to nats-py unchanged.

        Raises `WriteLogUnavailable` when no server accepted the connection in time, and
        `WriteLogError` for an authorization failure; ValueError for bad arguments.
        """
        servers = [servers] if isinstance(servers, str) else list(servers)
        if not servers:
            raise ValueError("servers must name at least one NATS URL")
        collection_token(collection)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 5:
            raise ValueError(f"replicas must be an int in 1..5, got {replicas!r}")
        connect_timeout = _check_timeout(connect_timeout, "connect_timeout")
        duplicate_window = _check_timeout(duplicate_window, "duplicate_window")
        api_timeout = _check_timeout(api_timeout, "api_timeout")

        nc = NATS()
        connected = asyncio.Event()
        errors_seen: List[BaseException] = []
        shown = ", ".join(_redact(s) for s in servers)

        async def on_error(exc: Exception) -> None:
            errors_seen.append(exc)
            del errors_seen[:-1]
            logger.debug("NATS client error (%s): %s", shown, _describe(exc))

        async def on_disconnected() -> None:
            connected.clear()
            if not nc.is_closed:  # close() reports a disconnection too
                logger.warning("disconnected from NATS (%s); reconnecting", shown)

        async def on_reconnected() -> None:
            connected.set()
            logger.info("reconnected to NATS (%s)", shown)

        async def on_closed() -> None:
            connected.clear()

        options: Dict[str, Any] = dict(
            servers=servers,
            name=name or f"write-log:{collection}",
            connect_timeout=connect_timeout,
            reconnect_time_wait=reconnect_time_wait,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            ping_interval=ping_interval,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
        )
        for key, value in (("tls", tls), ("tls_hostname", tls_hostname),
                           ("user_credentials", user_credentials), ("nkeys_seed", nkeys_seed),
                           ("user", user), ("password", password), ("token", token)):
            if value is not None:
                options[key] = value

        try:
            # nats-py retries the initial connect forever with reconnects enabled: bound it here.
            await asyncio.wait_for(nc.connect(**options), timeout=connect_timeout)
        except (asyncio.TimeoutError, OSError, nats.errors.NoServersError) as exc:
            await _close_quietly(nc)
            last = errors_seen[-1] if errors_seen else exc
            if isinstance(last, nats.errors.AuthorizationError):
                raise WriteLogError(f"NATS at {shown} refused the credentials: "
                                    f"{_describe(last)}") from exc
            raise WriteLogUnavailable(
                f"could not connect to NATS at {shown} within {connect_timeout:g}s "
                f"(last error: {_describe(last)})") from exc
        except nats.errors.Error as exc:
            await _close_quietly(nc)
            raise WriteLogError(f"could not connect to NATS at {shown}: {_describe(exc)}") from exc
        connected.set()
        return cls(nc, collection, servers=servers, replicas=replicas,
                   duplicate_window=duplicate_window, api_timeout=api_timeout,
                   connected=connected)

    async def __aenter__(self) -> "JetStreamWriteLog":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- properties --------------------------------------------------------------------------

    @property
    def collection(self) -> str:
        return self._collection

    @property
    def stream(self) -> str:
        """The stream name, ``WRITES_<token>``."""
        return self._stream

    @property
    def subjects(self) -> str:
        """The stream's one subject filter, ``writes.<token>.*``."""
        return f"{SUBJECT_PREFIX}.{self._token}.*"

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def duplicate_window(self) -> float:
        return self._duplicate_window

    @property
    def max_payload(self) -> int:
        """The largest message the NATS server takes (its `max_payload`, 1 MB by default)."""
        return int(self._nc.max_payload)

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    def subject(self, shard: int) -> str:
        """The subject shard `shard` appends to. ValueError for a negative or non-int shard."""
        return f"{SUBJECT_PREFIX}.{self._token}.{_check_shard(shard)}"

    @property
    def layout_subject(self) -> str:
        """Where the shard count the log's writes are placed by is recorded."""
        return f"{SUBJECT_PREFIX}.{self._token}.{LAYOUT_TOKEN}"

    # ---- operations --------------------------------------------------------------------------

    async def wait_connected(self, timeout: float) -> None:
        """Return once the client is connected; `WriteLogUnavailable` if it is not within
        `timeout` s or the connection is closed."""
        await self._wait_connected(asyncio.get_running_loop().time() + _check_timeout(timeout),
                                   "wait for the NATS connection")

    async def ensure_stream(self, timeout: float = 10.0) -> bool:
        """Create the collection's stream if it does not exist; return True if this call created it.

        An existing stream must capture exactly ``writes.<token>.*`` with FILE storage and limits
        retention, otherwise `StreamConfigMismatch` is raised and nothing is changed (a stream
        whose subjects overlap another stream's raises it too). A different ``num_replicas``, a
        shorter duplicate window, or age/count/size limits (which would drop entries replicas may
        still need) are logged as warnings and left alone: they are operator decisions. Safe to
        call concurrently from several processes. `WriteLogUnavailable` if JetStream does not
        answer within `timeout` s.
        """
        timeout = _check_timeout(timeout)
        desired = api.StreamConfig(
            name=self._stream,
            description=f"write log of collection {self._collection!r}",
            subjects=[self.subjects],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            discard=api.DiscardPolicy.OLD,
            num_replicas=self._replicas,
            duplicate_window=self._duplicate_window,
        )

        async def attempt(t: float) -> Tuple[api.StreamInfo, bool]:
            jsm = self._nc.jsm(timeout=t)
            try:
                return await jsm.stream_info(self._stream), False
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code not in (None, _ERR_STREAM_NOT_FOUND):
                    raise
            try:
                return await jsm.add_stream(desired), True
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code == _ERR_STREAM_NAME_IN_USE:  # created concurrently, another config
                    return await jsm.stream_info(self._stream), False
                raise

        try:
            info, created = await self._call(f"ensure stream {self._stream}", attempt, timeout)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _ERR_SUBJECTS_OVERLAP:
                raise StreamConfigMismatch(
                    f"cannot create stream {self._stream}: its subjects {self.subjects} overlap "
                    f"another stream's ({exc.description})") from exc
            raise WriteLogError(f"JetStream refused to create stream {self._stream}: "
                                f"{_describe(exc)}") from exc
        self._check_stream_config(info.config)
        if created:
            logger.info("created stream %s (subjects %s, replicas %d, duplicate window %gs)",
                        self._stream, self.subjects, self._replicas, self._duplicate_window)
        return created

    async def publish(self, shard: int, payload: bytes, msg_id: str,
                      timeout: float = 5.0) -> PublishResult:
        """Append `payload` to shard `shard`'s subject with message id `msg_id`; return its ack.

        Idempotent inside the duplicate window: publishing an id that the stream already holds
        stores nothing and returns ``PublishResult(original_seq, duplicate=True)``. Ids are
        deduplicated per collection (across shards), so they must be unique per collection.
        Timeouts, "no responders" (no stream yet, JetStream restarting) and 503s are retried with
        the same id until `timeout` s have passed; then `WriteLogUnavailable` is raised, whose
        outcome is unknown (retry with the same id) - or `StreamMissing`, when no stream took the
        subject and JetStream says the stream does not exist (nothing was stored). Because of those retries ``duplicate=True``
        can also answer a first call whose own earlier attempt was stored but not acknowledged in
        time; either way the payload is stored exactly once, at ``seq``. While the client is reconnecting the append
        waits instead of being buffered. A definite refusal (payload over the server's
        max_payload, wrong stream) raises `WriteLogError`.
        """
        subject = self.subject(shard)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
        if not isinstance(msg_id, str) or not msg_id or any(c in msg_id for c in "\r\n\0"):
            raise ValueError(f"msg_id must be a non-empty string without CR/LF/NUL, got {msg_id!r}")
        timeout = _check_timeout(timeout)
        data = bytes(payload)

        async def attempt(t: float) -> api.PubAck:
            headers = {MSG_ID_HEADER: msg_id, EXPECTED_STREAM_HEADER: self._stream}
            return await self._js.publish(subject, data, timeout=t, headers=headers)

        try:
            ack = await self._call(
                f"append msg id {msg_id!r} to {subject}", attempt, timeout,
                no_responders_hint=(f"; no stream answered on {subject}: was ensure_stream() run, "
                                    f"and does the server run with JetStream enabled (-js)?"))
        except WriteLogUnavailable as exc:
            if isinstance(exc.__cause__, (nats.errors.NoRespondersError,
                                          nats.js.errors.NoStreamResponseError)):
                # no stream took the subject: when the stream is gone, nothing was stored and
                # re-sending cannot help (outside QA: a wiped NATS store gave "may still have
                # been stored: re-send", every 5 s, for ever)
                await self._raise_if_missing(f"append msg id {msg_id!r} to {subject}")
            # the caller's answer must say what a timeout means here (outside QA: a write
            # answered UNAVAILABLE was stored, and a "corrected" body under the same version
            # then lost to it as a stale replay)
            raise WriteLogUnavailable(f"{exc}. The write may still have been stored: re-send "
                                      "the same request (writes are idempotent by document "
                                      "version); a changed body needs a higher version") from exc
        except nats.js.errors.APIError as exc:
            raise WriteLogError(f"JetStream refused the append of msg id {msg_id!r} to "
                                f"{subject}: {_describe(exc)}") from exc
        except nats.errors.MaxPayloadError as exc:
            raise WriteLogError(f"payload of {len(data)} bytes for {subject} exceeds the "
                                f"server's max_payload") from exc
        return PublishResult(seq=int(ack.seq), duplicate=bool(ack.duplicate))

    async def _raise_if_missing(self, what: str) -> None:
        """StreamMissing if JetStream answers that the stream does not exist (else nothing: it
        may just be restarting)."""
        try:
            await self._nc.jsm(timeout=1.0).stream_info(self._stream)
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _ERR_STREAM_NOT_FOUND:
                raise StreamMissing(
                    f"cannot {what}: stream {self._stream} does not exist (the NATS store was "
                    f"wiped or the stream deleted); nothing was stored. Writes are refused "
                    f"until the log is restored, or the collection rebuilt") from exc
        except Exception:  # noqa: BLE001 - no answer: the caller's UNAVAILABLE stands
            return

    async def last_sequence(self, shard: int, timeout: float = 5.0) -> int:
        """The stream sequence of the last message on shard `shard`'s subject; 0 if it has none.

        `WriteLogError` if the stream does not exist, `WriteLogUnavailable` if JetStream does not
        answer within `timeout` s.
        """
        subject = self.subject(shard)
        msg = await self._msg_or_none(f"read the last sequence of {subject}", timeout,
                                      lambda jsm: jsm.get_last_msg(self._stream, subject))
        return 0 if msg is None else int(msg.seq or 0)

    async def layout(self, timeout: float = 5.0) -> int:
        """The shard count recorded for this log (see Layout above); 0 when none is recorded."""
        subject = self.layout_subject
        msg = await self._msg_or_none(f"read the layout on {subject}", timeout,
                                      lambda jsm: jsm.get_last_msg(self._stream, subject))
        if msg is None:
            return 0
        try:
            return int(json.loads(bytes(msg.data or b"{}")).get("shards", 0))
        except (ValueError, AttributeError) as exc:
            raise WriteLogError(f"{self.layout_subject} holds no layout record ({exc})") from exc

    async def entry_from(self, shard: int, seq: int, timeout: float = 5.0) -> Optional[LogEntry]:
        """The first entry on shard `shard`'s subject at or after stream sequence `seq`; None
        when there is none."""
        subject, seq = self.subject(shard), _check_seq(seq, "seq")
        msg = await self._msg_or_none(f"read an entry of {subject}", timeout,
                                      lambda jsm: jsm.get_msg(self._stream, seq=seq,
                                                              subject=subject, next=True))
        if msg is None:
            return None
        return LogEntry(seq=int(msg.seq), payload=bytes(msg.data or b""),
                        msg_id=(msg.headers or {}).get(MSG_ID_HEADER, ""))

    async def _msg_or_none(self, what: str, timeout: float, get):
        """The message `get(jsm)` reads (retried as `_call` retries), or None when the stream
        holds no such message."""
        timeout = _check_timeout(timeout)

        async def attempt(t: float):
            try:
                return await get(self._nc.jsm(timeout=t))
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code == _ERR_NO_MESSAGE_FOUND:
                    return None
                raise

        try:
            return await self._call(what, attempt, timeout)
        except nats.js.errors.APIError as exc:
            raise self._api_error(what, exc) from exc

    async def settle_layout(self, shards: int, timeout: float = 5.0) -> int:
        """The log's recorded shard count, recording `shards` first if none is: the append
        expects the layout subject to be empty (it is refused when a count is recorded
        already), so of two processes recording different counts at once one wins and both
        read the winner's."""
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ValueError(f"shards must be a positive int, got {shards!r}")
        subject = self.layout_subject
        data = json.dumps({"shards": shards, "recorded_at": time.time()}).encode()

        async def attempt(t: float) -> api.PubAck:
            headers = {EXPECTED_STREAM_HEADER: self._stream, EXPECTED_SUBJECT_SEQ_HEADER: "0"}
            return await self._js.publish(subject, data, timeout=t, headers=headers)

        try:
            await self._call(f"record the layout on {subject}", attempt, timeout)
        except nats.js.errors.APIError as exc:
            # "wrong last sequence": a count is recorded already; read it below
            logger.info("layout of %s recorded already: %s", self._stream, _describe(exc))
        recorded = await self.layout(timeout)
        if not recorded:
            raise WriteLogError(f"could not record the layout on {subject}")
        return recorded

    async def payload_at(self, seq: int, timeout: float = 5.0) -> bytes:
        """The payload the stream holds at sequence `seq` (`WriteLogError` if it holds none)."""
        timeout = _check_timeout(timeout)

        async def attempt(t: float) -> bytes:
            msg = await self._nc.jsm(timeout=t).get_msg(self._stream, seq)
            return bytes(msg.data or b"")

        try:
            return await self._call(f"read entry {seq} of {self._stream}", attempt, timeout)
        except nats.js.errors.APIError as exc:
            raise self._api_error(f"read entry {seq} of {self._stream}", exc) from exc

    async def close(self) -> None:
        """Close the connection (idempotent). Durable consumers stay on the server."""
        await _close_quietly(self._nc)

    # ---- internals shared with ShardLogReader ------------------------------------------------

    def _check_stream_config(self, cfg: api.StreamConfig) -> None:
        problems = []
        if sorted(cfg.subjects or []) != [self.subjects]:
            problems.append(f"subjects {cfg.subjects} (expected [{self.subjects!r}])")
        if cfg.storage is not None and cfg.storage != api.StorageType.FILE:
            problems.append(f"storage {_enum_value(cfg.storage)!r} (expected 'file')")
        if cfg.retention is not None and cfg.retention != api.RetentionPolicy.LIMITS:
            problems.append(f"retention {_enum_value(cfg.retention)!r} (expected 'limits': "
                            f"other policies delete entries once one consumer acknowledged them)")
        if problems:
            raise StreamConfigMismatch(
                f"stream {self._stream} exists with a configuration the write log of collection "
                f"{self._collection!r} cannot use: {'; '.join(problems)}. Fix or remove that "
                f"stream; nothing was changed.")
        if cfg.num_replicas not in (None, self._replicas):
            logger.warning("stream %s has %s replicas, this process asked for %d; left as is",
                           self._stream, cfg.num_replicas, self._replicas)
        if cfg.duplicate_window and cfg.duplicate_window + 1e-9 < self._duplicate_window:
            logger.warning("stream %s deduplicates message ids for %gs only (asked for %gs): "
                           "retries later than that are stored twice", self._stream,
                           cfg.duplicate_window, self._duplicate_window)
        limits = {k: v for k, v in (("max_age", cfg.max_age), ("max_msgs", cfg.max_msgs),
                                    ("max_bytes", cfg.max_bytes),
                                    ("max_msgs_per_subject", cfg.max_msgs_per_subject))
                  if v is not None and v > 0}
        if limits:
            logger.warning("stream %s has limits %s: entries past them are dropped, and a "
                           "replica that falls behind them must be rebuilt", self._stream, limits)

    def _api_error(self, what: str, exc: nats.js.errors.APIError) -> WriteLogError:
        if exc.err_code == _ERR_STREAM_NOT_FOUND:
            return StreamMissing(f"cannot {what}: stream {self._stream} does not exist "
                                 f"(call ensure_stream() first)")
        return WriteLogError(f"cannot {what}: {_describe(exc)}")

    async def _wait_connected(self, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._nc.is_closed:
                raise WriteLogUnavailable(f"{what}: the NATS connection is closed")
            if self._connected.is_set() and self._nc.is_connected:
                return
            if not self._nc.is_connected:
                self._connected.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WriteLogUnavailable(
                    f"{what}: not connected to NATS at {', '.join(self._servers)} "
                    f"(the client keeps reconnecting)")
            try:
                await asyncio.wait_for(self._connected.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    async def _call(self, what: str, op: Callable[[float], Awaitable[T]], timeout: float, *,
                    no_responders_hint: str = "") -> T:
        """Run ``op(attempt_timeout)`` until it returns, retrying transient failures, all within
        `timeout` s. Only attempts while connected. Raises `WriteLogUnavailable` when time runs
        out or the connection is closed; other exceptions (API errors) propagate."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt_cap = max(_MIN_ATTEMPT_TIMEOUT, timeout / 3)
        backoff = _BACKOFF_START
        last: Optional[BaseException] = None
        while True:
            try:
                await self._wait_connected(deadline, what)
            except WriteLogUnavailable as exc:
                if last is None or self._nc.is_closed:
                    raise
                raise WriteLogUnavailable(f"{exc} (last error: {_describe(last)})") from last
            remaining = deadline - loop.time()
            try:
                return await op(min(remaining, attempt_cap))
            except _CLOSED_ERRORS as exc:
                raise WriteLogUnavailable(f"{what}: the NATS connection is closed") from exc
            except _FAST_TRANSIENT_ERRORS as exc:
                last = exc
                pause = min(backoff, deadline - loop.time())
                if pause > 0:
                    await asyncio.sleep(pause)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            except asyncio.TimeoutError as exc:  # includes nats.errors.TimeoutError
                last = exc
            if deadline - loop.time() <= 0:
                hint = no_responders_hint if isinstance(
                    last, (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)) \
                    else ""
                raise WriteLogUnavailable(
                    f"{what}: JetStream at {', '.join(self._servers)} did not answer within "
                    f"{timeout:g}s (last error: {_describe(last)}){hint}") from last


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


async def _close_quietly(nc: NATS) -> None:
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.close(), timeout=5.0)
    except Exception as exc:  # closing must never mask the caller's own error
        logger.debug("closing the NATS connection failed: %s", _describe(exc))


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------


class ShardLogReader:
    """One replica's ordered reader of one shard's log: a durable pull consumer filtered to the
    shard subject, with explicit acks.

    Contract:

    * Construct with ``after_seq`` = the last stream sequence this replica has DURABLY applied
      (0 if none); the replica's own store is the authority, not the consumer's ack floor.
    * `open` (called implicitly by `fetch` and `lag`) makes the durable ``durable`` deliver from
      ``after_seq + 1``: it reuses an existing consumer only if its ack floor equals
      ``after_seq``, it has no unacknowledged deliveries, and its settings match; otherwise (the
      replica's state was wiped, restored from an older snapshot, ahead of its acks, or the
      settings changed) it deletes and recreates it (`recreated` tells). The durable name must be
      used by one reader at a time and for one shard only: a durable that filters another subject
      raises `WriteLogError` instead of being taken over.
    * `fetch` returns entries of this shard only, in log order, each at most once per reader
      (redeliveries of entries already returned, and anything <= ``after_seq``, are dropped),
      without gaps: deliveries are numbered by the consumer, and when one is missing (lost on a
      disconnect, taken by a stray reader of the same durable) or the numbering moved back (the
      server crashed and restored older consumer state) the reader returns what precedes it and
      repositions the consumer just after the last entry it returned, before the next fetch
      (`resets` counts these).
    * `ack` the entries after committing them. Acks only stop redeliveries; losing one is
      harmless.
    * If the caller cannot apply returned entries, it must `close` the reader and open a new one
      with its real applied sequence: this reader never returns an entry twice.
    """

    def __init__(self, log: JetStreamWriteLog, shard: int, durable: str, after_seq: int, *,
                 max_ack_pending: int = 1024, ack_wait: float = 30.0) -> None:
        """No I/O; see the class docstring. ``max_ack_pending`` bounds fetched-but-unacked
        entries (and so the useful `fetch` batch size); ``ack_wait`` is how long the server
        waits for an ack before redelivering."""
        self._log = log
        self._shard = _check_shard(shard)
        self._subject = log.subject(shard)
        self._durable = _check_consumer_name(durable)
        self._after_seq = _check_seq(after_seq, "after_seq")
        if isinstance(max_ack_pending, bool) or not isinstance(max_ack_pending, int) \
                or max_ack_pending < 1:
            raise ValueError(f"max_ack_pending must be a positive int, got {max_ack_pending!r}")
        self._max_ack_pending = max_ack_pending
        self._ack_wait = _check_timeout(ack_wait, "ack_wait")
        self._delivered = after_seq  # highest sequence returned by fetch (or the start floor)
        self._applied = after_seq  # highest sequence passed to ack
        self._next_dseq = 1  # the consumer sequence the next delivery must carry
        self._outstanding: Dict[int, Msg] = {}  # returned, not yet acked: seq -> latest delivery
        self._sub: Optional[JetStreamContext.PullSubscription] = None
        self._needs_reset = False
        self._recreated = False
        self._resets = 0
        self._closed = False
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> "ShardLogReader":
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- properties --------------------------------------------------------------------------

    @property
    def shard(self) -> int:
        return self._shard

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def durable(self) -> str:
        return self._durable

    @property
    def delivered_seq(self) -> int:
        """The highest sequence `fetch` has returned (``after_seq`` before the first entry)."""
        return self._delivered

    @property
    def applied_seq(self) -> int:
        """The highest sequence passed to `ack` (``after_seq`` before the first ack)."""
        return self._applied

    @property
    def recreated(self) -> bool:
        """True if opening had to delete an existing durable whose state did not match."""
        return self._recreated

    @property
    def resets(self) -> int:
        """How many times a missing delivery made the reader reposition its consumer."""
        return self._resets

    # ---- operations --------------------------------------------------------------------------

    async def open(self, timeout: float = 10.0) -> "ShardLogReader":
        """Position the durable consumer at ``after_seq + 1`` (see the class docstring) and bind
        to it. Idempotent. `LogSequenceError` if ``after_seq`` is past the stream's end or the
        stream no longer holds the entries after it; `WriteLogUnavailable` if JetStream does not
        answer within `timeout` s; `WriteLogError` if the stream does not exist."""
        timeout = _check_timeout(timeout)
        if self._closed:
            raise WriteLogError(f"reader {self._durable} of {self._subject} is closed")
        if self._sub is not None and not self._needs_reset:
            return self  # without waiting for a fetch in progress
        async with self._lock:
            await self._position(timeout)
        return self

    async def fetch(self, max_messages: int, timeout: float) -> List[LogEntry]:
        """Up to `max_messages` new entries of this shard in log order; [] if none arrived
        within `timeout` s. Waits up to `timeout` s for the connection and raises
        `WriteLogUnavailable` if it is still down (or closed); when the consumer must first be
        (re)positioned that step may take up to the log's ``api_timeout``. Batches are capped at
        ``max_ack_pending``."""
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) \
                or max_messages < 1:
            raise ValueError(f"max_messages must be a positive int, got {max_messages!r}")
        timeout = _check_timeout(timeout)
        if self._closed:
            raise WriteLogError(f"reader {self._durable} of {self._subject} is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._lock:
            if self._sub is None or self._needs_reset:
                await self._position(max(timeout, self._log._api_timeout))
            await self._log._wait_connected(deadline, f"fetch from {self._subject}")
            remaining = deadline - loop.time()
            if remaining <= 0.001:
                return []
            assert self._sub is not None
            try:
                msgs = await self._sub.fetch(min(max_messages, self._max_ack_pending),
                                             timeout=remaining)
            except asyncio.TimeoutError:  # nothing new (includes FetchTimeoutError)
                return []
            except _CLOSED_ERRORS as exc:
                raise WriteLogUnavailable(f"fetch from {self._subject}: the NATS connection is "
                                          f"closed") from exc
            except _FAST_TRANSIENT_ERRORS as exc:
                logger.debug("fetch from %s: %s", self._subject, _describe(exc))
                return []
            except nats.js.errors.APIError as exc:
                raise WriteLogError(f"fetch from {self._subject} (durable {self._durable}) "
                                    f"failed: {_describe(exc)}") from exc
            return await self._accept(msgs)

    async def ack(self, entries: Sequence[LogEntry], timeout: float = 5.0) -> bool:
        """Acknowledge entries the caller has durably applied; return True if the server
        confirmed them within `timeout` s.

        Entries this reader did not return, or already acked, are ignored. Acks are advisory
        (they stop redeliveries and move the consumer's ack floor, which `open` compares with
        ``after_seq``); a False result needs no action. Never raises for transport problems.
        """
        timeout = _check_timeout(timeout)
        msgs: List[Msg] = []
        for entry in entries:
            m = self._outstanding.pop(entry.seq, None)
            if m is not None:
                msgs.append(m)
                self._applied = max(self._applied, entry.seq)
        if not msgs:
            return True
        try:
            for m in msgs[:-1]:
                await m.ack()
            # The server processes one consumer's acks in order: confirming the last one
            # confirms them all.
            await msgs[-1].ack_sync(timeout=timeout)
            return True
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            logger.info("acks on %s (durable %s) not confirmed: %s; they only affect "
                        "redelivery", self._subject, self._durable, _describe(exc))
            return False

    async def lag(self, timeout: float = 5.0) -> int:
        """How many messages on this shard's subject this reader has not acknowledged yet.

        Computed from the consumer's info as ``num_pending`` (matching messages not yet delivered)
        plus ``num_ack_pending`` (delivered, not acknowledged, including fetched entries the
        caller has not acked). Not from last-sequence differences: sequences are global across
        shards, so a difference would also count other shards' messages. `WriteLogUnavailable`
        if JetStream does not answer within `timeout` s; `WriteLogError` if the consumer has been
        deleted behind the reader's back (the next `fetch` recreates it).
        """
        timeout = _check_timeout(timeout)
        await self.open(timeout)
        log = self._log

        async def attempt(t: float) -> api.ConsumerInfo:
            return await log._nc.jsm(timeout=t).consumer_info(log.stream, self._durable)

        try:
            info = await log._call(f"read consumer {self._durable}", attempt, timeout)
        except nats.js.errors.APIError as exc:
            if exc.err_code == _ERR_CONSUMER_NOT_FOUND:
                self._needs_reset = True
                raise WriteLogError(f"durable {self._durable} on {log.stream} was deleted; the "
                                    f"next fetch recreates it") from exc
            raise log._api_error(f"read consumer {self._durable}", exc) from exc
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def close(self) -> None:
        """Stop receiving (idempotent). The durable consumer stays on the server for the next
        reader; use `delete` when the replica is decommissioned."""
        self._closed = True
        sub, self._sub = self._sub, None
        self._outstanding.clear()
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                logger.debug("unsubscribe from %s failed: %s", self._subject, _describe(exc))

    async def delete(self, timeout: float = 5.0) -> None:
        """Close the reader and delete its durable consumer from the server (no error if it is
        already gone)."""
        timeout = _check_timeout(timeout)
        await self.close()
        log = self._log

        async def attempt(t: float) -> None:
            try:
                await log._nc.jsm(timeout=t).delete_consumer(log.stream, self._durable)
            except nats.js.errors.NotFoundError:
                pass

        try:
            await log._call(f"delete consumer {self._durable}", attempt, timeout)
        except nats.js.errors.APIError as exc:
            raise log._api_error(f"delete consumer {self._durable}", exc) from exc

    # ---- internals ---------------------------------------------------------------------------

    def _consumer_config(self, start: int) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            name=self._durable,
            durable_name=self._durable,
            description=f"replica reader of {self._subject}",
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self._ack_wait,
            filter_subject=self._subject,
            max_ack_pending=self._max_ack_pending,
            replay_policy=api.ReplayPolicy.INSTANT,
        )

    def _mismatch(self, info: api.ConsumerInfo) -> Optional[str]:
        """Why an existing durable cannot be reused as is (None if it can)."""
        cfg = info.config
        filters = [cfg.filter_subject] if cfg.filter_subject else list(cfg.filter_subjects or [])
        if filters != [self._subject]:
            raise WriteLogError(
                f"durable {self._durable} on stream {self._log.stream} reads {filters or 'all'}, "
                f"not {self._subject}: durable names must be unique per shard; not taking it "
                f"over")
        if cfg.deliver_subject:
            return "it is a push consumer"
        if cfg.ack_policy is not None and cfg.ack_policy != api.AckPolicy.EXPLICIT:
            return f"its ack policy is {_enum_value(cfg.ack_policy)!r}"
        if cfg.max_ack_pending != self._max_ack_pending or cfg.ack_wait is None \
                or abs(cfg.ack_wait - self._ack_wait) > 1e-3:
            return "its max_ack_pending/ack_wait differ from this reader's"
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        if floor != self._delivered:
            return f"its ack floor is {floor} but the replica has applied up to {self._delivered}"
        if info.num_ack_pending:
            return f"it has {info.num_ack_pending} unacknowledged deliveries"
        return None

    async def _position(self, timeout: float) -> None:
        """Make the durable deliver from ``delivered_seq + 1`` and bind a fresh subscription.
        Caller holds the lock."""
        if self._sub is not None and not self._needs_reset:
            return
        log = self._log
        start = self._delivered + 1
        force = self._needs_reset
        old, self._sub = self._sub, None
        if old is not None:
            try:
                await old.unsubscribe()
            except Exception as exc:
                logger.debug("unsubscribe from %s failed: %s", self._subject, _describe(exc))
        recreated = False
        repositioning = force

        async def attempt(t: float) -> api.ConsumerInfo:
            nonlocal recreated, force
            jsm = log._nc.jsm(timeout=t)
            state = (await jsm.stream_info(log.stream)).state
            if self._delivered > state.last_seq:
                raise LogSequenceError(
                    f"replica of {self._subject} has applied up to sequence {self._delivered} but "
                    f"stream {log.stream} ends at {state.last_seq}: the stream was recreated or "
                    f"this is another cluster; rebuild the replica from a snapshot")
            if state.first_seq > start:
                raise LogSequenceError(
                    f"stream {log.stream} now starts at sequence {state.first_seq}: the entries "
                    f"after {self._delivered} that {self._subject}'s replica needs may have been "
                    f"removed; rebuild the replica from a snapshot")
            info: Optional[api.ConsumerInfo]
            try:
                info = await jsm.consumer_info(log.stream, self._durable)
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code not in (None, _ERR_CONSUMER_NOT_FOUND):
                    raise
                info = None
            if info is not None:
                reason = "a delivery was missing" if force else self._mismatch(info)
                if reason is None:
                    return info
                logger.info("recreating durable %s of %s at sequence %d: %s", self._durable,
                            self._subject, start, reason)
                try:
                    await jsm.delete_consumer(log.stream, self._durable)
                except nats.js.errors.NotFoundError:
                    pass
                recreated = True
                force = False  # a retry after a timeout may reuse what this attempt creates
            return await jsm.add_consumer(log.stream, config=self._consumer_config(start))

        try:
            info = await log._call(f"open durable {self._durable} on {self._subject}", attempt,
                                   timeout)
        except nats.js.errors.APIError as exc:
            raise log._api_error(f"open durable {self._durable} on {self._subject}",
                                 exc) from exc
        self._sub = await log._js.pull_subscribe_bind(durable=self._durable, stream=log.stream)
        self._next_dseq = (info.delivered.consumer_seq if info.delivered else 0) + 1
        self._outstanding.clear()
        self._needs_reset = False
        if recreated and not repositioning:  # repositionings are counted in `resets`
            self._recreated = True

    async def _accept(self, msgs: Sequence[Msg]) -> List[LogEntry]:
        """Turn a fetched batch into entries. An entry is returned only if its delivery carries
        the next consumer sequence and its stream sequence is new; a redelivery of something
        already returned is dropped; any other numbering (a delivery missing, or the consumer's
        numbering moved back after a server crash or a recreation elsewhere) stops the batch
        there and makes the next fetch reposition the consumer after the last returned entry."""
        out: List[LogEntry] = []
        stale_acks: List[Msg] = []
        for m in msgs:
            md = m.metadata
            dseq, sseq = md.sequence.consumer, md.sequence.stream
            if dseq < self._next_dseq and sseq <= self._delivered:
                self._note_redelivery(sseq, m, stale_acks)  # an older delivery, still queued
                continue
            if dseq != self._next_dseq:
                logger.warning("durable %s of %s: delivery %d of sequence %d arrived where "
                               "delivery %d was expected; repositioning at sequence %d",
                               self._durable, self._subject, dseq, sseq, self._next_dseq,
                               self._delivered + 1)
                self._needs_reset = True
                self._resets += 1
                break
            self._next_dseq = dseq + 1
            if sseq <= self._delivered:  # a redelivery of something already returned or applied
                self._note_redelivery(sseq, m, stale_acks)
                continue
            headers = m.headers or {}
            stamp = getattr(md, "timestamp", None)
            out.append(LogEntry(seq=sseq, payload=bytes(m.data),
                                msg_id=headers.get(MSG_ID_HEADER, ""),
                                appended_at=stamp.timestamp() if stamp is not None else 0.0))
            self._outstanding[sseq] = m
            self._delivered = sseq
        for m in stale_acks:
            try:
                await m.ack()
            except Exception as exc:
                logger.debug("ack of a redelivery failed: %s", _describe(exc))
        return out

    def _note_redelivery(self, seq: int, m: Msg, stale_acks: List[Msg]) -> None:
        if seq in self._outstanding:
            self._outstanding[seq] = m  # ack the newest delivery when the caller acks
        elif seq <= self._applied:
            # Already applied and acked once (that ack was lost): ack it again.
            stale_acks.append(m)
