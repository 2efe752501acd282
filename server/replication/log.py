"""Replicated writes on the JetStream log (jetstream.py): the router's side that appends, and the
replica's side that applies.

Router: `ReplicatedWriteLog.append` encodes a ShardWrite (chunks, vectors, body) as the shard
port's protobuf message and publishes it on the shard's subject with a message id derived from
(collection, tenant, document, version), so a retried write is stored once. The write is
acknowledged once the log holds it; the acknowledgement carries the log sequence.

Replica: `ShardReplicator` is one replica's durable consumer of one shard's subject. It applies
entries in log order through the shard's versioned, crash-safe write path in groups (one group
commit per fetch), and the applied sequence is committed in the same SQLite transaction as the
visibility flip, so the replica's store - not the consumer's acknowledgements - says how far it
got. On start (new replica, restart, or a build switch) it opens its consumer just after that
position and catches up before the replica reports ready.

Read-your-writes: a search carrying min_applied_sequence S waits (within its deadline) until the
replica has applied every entry of its subject up to S. Sequences are per stream, so a shard whose
subject got no entry since its last applied one is caught up for any S: the replica asks the log
for its subject's last sequence L and waits only for min(S, L).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import time
from pathlib import Path
from typing import Callable, Optional

from server.config import ReplicationConfig
from server.core import metrics
from server.core.chunking import shard_of
from server.core.collection import shard_dir_name
from server.core.types import ShardWrite
from server.errors import CatchUpAbandoned, FailedPrecondition, InvalidArgument, SearchError
from server.replication.jetstream import (JetStreamWriteLog, ShardLogReader, StreamMissing,
                                          WriteLogError, WriteLogUnavailable)

log = logging.getLogger(__name__)
HEADER_ALLOWANCE = 1024  # bytes kept for an append's headers within the server's max_payload


def nats_options(config: ReplicationConfig) -> dict:
    """Credentials and TLS for the NATS connection, from the configuration's files."""
    opts: dict = {}
    if config.nats_creds:
        if not Path(config.nats_creds).is_file():
            raise FileNotFoundError(f"--nats-creds {config.nats_creds}: no such file")
        opts["user_credentials"] = str(config.nats_creds)
    if config.nats_token_file:
        token = Path(config.nats_token_file).read_text().strip()
        if not token:
            raise ValueError(f"--nats-token-file {config.nats_token_file} is empty")
        opts["token"] = token
    if config.nats_tls_ca or config.nats_tls_cert or config.nats_tls_key:
        if bool(config.nats_tls_cert) != bool(config.nats_tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        ctx = ssl.create_default_context(cafile=str(config.nats_tls_ca) if config.nats_tls_ca else None)
        if config.nats_tls_cert:
            ctx.load_cert_chain(str(config.nats_tls_cert), str(config.nats_tls_key))
        opts["tls"] = ctx
    return opts


async def connect_log(config: ReplicationConfig, collection: str) -> JetStreamWriteLog:
    """The collection's write log on the configured NATS servers, its stream ensured."""
    js = await JetStreamWriteLog.connect(config.nats, collection, config.stream_replicas,
                                         **nats_options(config))
    await js.ensure_stream()
    return js


async def layout_problem(js: JetStreamWriteLog, shards: int, whose: str,
                         record: bool = False) -> Optional[str]:
    """Why `whose` (a router's replica sets, a replica's build), with `shards` shards, cannot
    follow this log, or None. The log records the shard count its writes are placed by; shard k
    of another count would take documents it does not hold (outside QA: after a re-shard along
    the deploy notes, a new build's shards replayed the old layout's subjects, and deleted
    documents and old versions came back). Only a router - what places the writes - records
    it (`record`), and only if the entries already there fit its count: a replica of the wrong
    count that opened a log from before the record first wrote its own count, and the right
    builds were refused from then on (re-probe). Where no count is recorded, a replica checks
    the entries, and stops on the first misplaced one it replays (ShardReplicator.step)."""
    advice = (": a collection's shard count is fixed by its log. To change it, build a new "
              "collection (another name, so another log) from a corpus holding every document, "
              "streamed ones included, and move clients to it")
    recorded = await js.layout()
    if not recorded:
        misfit = await _entries_misfit(js, shards)
        if misfit:
            return (f"the write log of collection {js.collection!r} holds writes placed for "
                    f"another shard count than the {shards} of {whose} ({misfit}){advice}")
        if not record:
            return None
        recorded = await js.settle_layout(shards)
    if recorded == shards:
        return None
    return (f"the write log of collection {js.collection!r} places documents on {recorded} shards "
            f"and {whose} has {shards}{advice}")


MISFIT_SAMPLES = 16  # entries read per shard subject: a count that is a multiple of the log's
                    # places each by chance with odds 1 in (its count / the log's) (review)


async def _entries_misfit(js: JetStreamWriteLog, shards: int) -> Optional[str]:
    """How a log's entries do not fit `shards` shards, judged by up to MISFIT_SAMPLES entries of
    each shard's subject, spread over it, and by any entry on the subject of shard `shards`
    (a smaller count); None when they fit (or there are none)."""
    from google.protobuf.message import DecodeError

    from server.rpc import shard_pb2

    beyond = await js.last_sequence(shards)
    if beyond:
        return f"entry {beyond} is on shard {shards}'s subject"
    for s in range(shards):
        last = await js.last_sequence(s)
        if not last:
            continue
        seen = set()
        starts = {1 + (last - 1) * i // (MISFIT_SAMPLES - 1) for i in range(MISFIT_SAMPLES)}
        for start in sorted(starts):
            entry = await js.entry_from(s, start)
            if entry is None or entry.seq in seen:
                continue
            seen.add(entry.seq)
            msg = shard_pb2.ShardWrite()
            try:
                msg.ParseFromString(entry.payload)
            except DecodeError:
                return f"entry {entry.seq} on shard {s}'s subject is not a write this server reads"
            owner = shard_of(msg.tenant, msg.doc_id, shards)
            if owner != s:
                return (f"entry {entry.seq}, of document {msg.doc_id!r}, is on shard {s}'s "
                        f"subject; {shards} shards place it on shard {owner}")
    return None


class ReplicatedWriteLog:
    """The router's write log (server/core/writes.py WriteLog) on JetStream."""

    def __init__(self, js: JetStreamWriteLog, config: ReplicationConfig):
        self.js = js
        self.config = config
        self.broken: Optional[str] = None  # why appends are refused (check_against_replicas)
        self.misplaced: Optional[str] = None  # why appends are refused (check_layout)
        self._missing_before = False  # the last check found the stream missing

    async def check_layout(self, shards: int) -> Optional[str]:
        """Refuse appends when this router's `shards` replica sets do not match the shard count
        the log's writes are placed by (see layout_problem); returns why, or None."""
        self.misplaced = await layout_problem(self.js, shards, "this router's --replicas",
                                              record=True)
        if self.misplaced:
            log.error("write log: %s; writes are refused", self.misplaced)
        return self.misplaced

    async def check_against_replicas(self, applied: dict[int, int]) -> Optional[str]:
        """The log can never end before a position a replica has applied: if it does, the stream
        lost its entries (NATS storage wiped, or another cluster), a new append would get a
        sequence that replicas already count as applied (read-your-writes would pass without
        the write, and no replica would ever apply it), so appends are refused until the stream
        ends at or after every replica again. `applied`: shard -> highest applied sequence among
        its replicas (read before this call: the log only grows meanwhile)."""
        shards = sorted(s for s, seq in applied.items() if seq > 0)
        # all shards at once, briefly: this runs in the router's build follower
        problem = None
        try:
            lasts = await asyncio.gather(*(self.js.last_sequence(s, timeout=2.0) for s in shards))
            self._missing_before = False
        except StreamMissing as exc:  # (outside QA: only each append, after 5 s, found out)
            lasts = []
            # twice in a row: a NATS cluster's meta layer may say so for a moment while it
            # recovers (review)
            if self._missing_before:
                problem = (f"the write log's stream does not exist ({exc}); writes are refused "
                           "until it is restored or the replicas are rebuilt from a snapshot")
            else:
                problem = self.broken
            self._missing_before = True
        for shard, last in zip(shards, lasts):
            if last < applied[shard]:
                problem = (f"the write log of shard {shard} ends at sequence {last} but a "
                           f"replica has applied up to {applied[shard]}: the stream lost entries "
                           "(NATS storage wiped or replaced?); writes are refused until it is "
                           "restored or the replicas are rebuilt from a snapshot")
                break
        if problem != self.broken:
            (log.error if problem else log.warning)("write log: %s", problem or "consistent again")
        self.broken = problem
        return problem

    @classmethod
    async def connect(cls, config: ReplicationConfig, collection: str) -> "ReplicatedWriteLog":
        return cls(await connect_log(config, collection), config)

    async def append(self, collection: str, shard: int, write: ShardWrite,
                     msg_id: str) -> tuple[int, bool]:
        from server.transport.codec import shard_write_to_pb

        if self.broken or self.misplaced:
            raise FailedPrecondition(self.broken or self.misplaced)
        message = shard_write_to_pb(write, collection, write.model_id)
        payload = message.SerializeToString()
        # the server counts the headers too (message id, expected stream): a margin for them
        if len(payload) + HEADER_ALLOWANCE > self.js.max_payload:  # refused here, not as INTERNAL
            raise InvalidArgument(
                f"this write's log entry (text, chunk texts and vectors) is {len(payload):,} "
                f"bytes; the write log takes at most {self.js.max_payload - HEADER_ALLOWANCE:,} "
                f"(the NATS server's max_payload of {self.js.max_payload:,} less "
                f"{HEADER_ALLOWANCE:,} for headers): raise max_payload (deploy/ and "
                f"scripts/nats.sh set 8 MB) or split the document")
        result = await self.js.publish(shard, payload, msg_id, self.config.publish_timeout_s)
        if not result.duplicate:
            return result.seq, False
        # The log held this message id already: a client's retry, the log client's own retry of
        # this very call (an earlier attempt stored it, its ack was lost), or another body under
        # a version already written. Only the last stored nothing new.
        try:
            held = await self.js.payload_at(result.seq, self.config.publish_timeout_s)
        except SearchError:
            return result.seq, False  # cannot tell: the log holds an entry for it, as ACCEPTED says
        return result.seq, not _same_write(held, message)

    async def close(self) -> None:
        await self.js.close()


def _same_write(held: bytes, message) -> bool:
    """The same write but for the time it was taken in (a retry's `ingested_at` is later) and
    the last bits of its vectors: a router embeds a retried text again, in another model batch,
    and batched matrix products round differently with their neighbours."""
    import numpy as np

    from server.rpc import shard_pb2

    other = shard_pb2.ShardWrite()
    other.ParseFromString(held)

    def content(m) -> tuple:
        body = json.loads(m.body_json or "{}")
        body.pop("ingested_at", None)
        return (m.op, m.tenant, m.doc_id, m.version, body, [(c.index, c.start, c.end, c.text)
                                                            for c in m.chunks],
                len(m.vectors), m.dim, m.model_id)

    if content(other) != content(message):
        return False
    if other.vectors == message.vectors:
        return True
    a, b = (np.frombuffer(m.vectors, dtype="<f4") for m in (other, message))
    return bool(np.allclose(a, b, rtol=1e-3, atol=1e-5))


class MisplacedWrite(FailedPrecondition):
    """A log entry on this shard's subject for a document its build places on another shard."""


class LayoutMismatch(FailedPrecondition):
    """A build whose shard count the log's writes are not placed by (layout_problem)."""


def durable_name(replica_id: str, build_id: str, shard: int) -> str:
    """One durable consumer per replica and build: a new build replays from its own position."""
    raw = f"{replica_id}-{build_id}-{shard_dir_name(shard)}"
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:200]


class ShardReplicator:
    """Applies one shard's write log to one replica (a LocalShard)."""

    def __init__(self, js: JetStreamWriteLog, shard, replica_id: str, config: ReplicationConfig):
        self.js = js
        self.shard = shard
        self.config = config
        self.durable = durable_name(replica_id, shard.desc.build_id, shard.shard_no)
        self.caught_up = False
        self.reader: Optional[ShardLogReader] = None
        self._stop = asyncio.Event()
        self._lag_gauge = metrics.WRITE_LAG.labels(shard.desc.collection, str(shard.shard_no))
        self._lag_checked = 0.0
        shard.replicated = True
        shard.watermark_probe = self.subject_last_sequence

    def state(self) -> str:
        return "serving" if self.caught_up else "catching_up"

    async def subject_last_sequence(self, timeout: float = 5.0) -> int:
        if not self.js.is_connected:  # a request would wait for a reconnect (review)
            raise WriteLogUnavailable("the write log is not connected")
        return await self.js.last_sequence(self.shard.shard_no, timeout=timeout)

    async def _open(self) -> None:
        if self.reader is not None:
            await self.reader.close()
        self.reader = ShardLogReader(self.js, self.shard.shard_no, self.durable,
                                     self.shard.index.applied_seq,
                                     max_ack_pending=max(1024, self.config.apply_batch * 2))
        await self.reader.open()

    async def step(self, timeout: float) -> int:
        """Fetch and apply one group; returns how many entries it applied."""
        from server.transport.codec import shard_write_from_pb
        from server.rpc import shard_pb2

        if self.reader is None:
            await self._open()
        # what the log holds now, as one group; else wait for the next entry and take whatever
        # came with it (a pull for a full batch would wait out its timeout to fill it)
        entries = await self.reader.fetch(self.config.apply_batch, 0.005)
        if not entries:
            entries = await self.reader.fetch(1, timeout)
            if not entries:
                return 0
            if self.config.apply_batch > 1:
                entries += await self.reader.fetch(self.config.apply_batch - 1, 0.005)
        writes = []
        shards, shard_no = self.shard.desc.shards, self.shard.shard_no
        for e in entries:
            msg = shard_pb2.ShardWrite()
            msg.ParseFromString(e.payload)
            w = shard_write_from_pb(msg, seq=e.seq)
            w.model_id = msg.model_id
            owner = shard_of(w.tenant, w.doc_id, shards)
            if owner != shard_no:  # nothing of this group is applied
                raise MisplacedWrite(
                    f"write-log entry {e.seq} ({w.op} of document {w.doc_id!r}) is on shard "
                    f"{shard_no}'s subject, but build {self.shard.desc.build_id} places that "
                    f"document on shard {owner} of {shards}: the log was written for another "
                    f"shard count; this replica stops applying it")
            writes.append(w)
        outcomes = await self.shard.apply(writes)  # the applied sequence commits with the flip
        await self.reader.ack(entries)
        # where a write becomes searchable in the cluster: the router only appends (and counts
        # "accepted"), so each replica counts what it applied and how long after the append
        now = time.time()
        for w, e, out in zip(writes, entries, outcomes):
            metrics.REPLICA_APPLIED.labels(w.op, out.outcome).inc()
            if self.caught_up and e.appended_at and out.outcome == "applied":
                metrics.REPLICA_VISIBLE.observe(max(0.0, now - e.appended_at))
        return len(entries)

    async def _report_lag(self) -> None:
        if time.monotonic() - self._lag_checked >= 1.0:
            self._lag_gauge.set(await self.reader.lag())
            self._lag_checked = time.monotonic()

    async def catch_up(self, timeout: float = 0.2,
                       wanted: Optional[Callable[[], bool]] = None) -> int:
        """Apply what the log holds for this shard until less than one group is left; then
        report ready (what is left, and what comes later, is applied by `run`, as it is for any
        following replica). Outside QA: waiting for a fetch that found nothing never ended while
        writes kept arriving (one every 0.2 s sufficed), so a restarted replica stayed out of
        rotation as long as its shard took writes - both of a shard's replicas restarted meant
        the shard was down."""
        total = 0
        while True:
            if wanted is not None and not wanted():  # e.g. the alias moved off this build
                raise CatchUpAbandoned(f"shard {self.shard.shard_no}: build "
                                       f"{self.shard.desc.build_id} is no longer wanted")
            n = await self.step(timeout)
            total += n
            # after a group: less than another group behind; after a fetch that found nothing:
            # nothing behind
            lag = await self.reader.lag()
            if lag < (self.config.apply_batch if n else 1):
                break
            await self._report_lag()
        if lag:  # the rest that was there, without waiting for more: a build this replica
            # switches to then starts no further behind than what came meanwhile (review)
            total += await self.step(0.005)
        self._lag_gauge.set(lag)
        self.caught_up = True
        log.info("shard %d replica caught up: applied %d log entries, at sequence %d",
                 self.shard.shard_no, total, self.shard.index.applied_seq)
        return total

    async def run(self) -> None:
        """Follow the log until stopped; on errors (NATS down) retry with backoff. The replica's
        lag is exported at most once a second while it applies (one consumer-info request), and
        as 0 whenever the log has nothing more for it."""
        backoff = 0.2
        while not self._stop.is_set():
            try:
                if await self.step(0.5):
                    backoff = 0.2
                    await self._report_lag()
                else:
                    self._lag_gauge.set(0)
            except MisplacedWrite as exc:  # no retry applies it: out of rotation, loudly
                self.caught_up = False
                log.error("shard %d replicator: %s", self.shard.shard_no, exc)
                return
            except (SearchError, WriteLogError) as exc:
                log.warning("shard %d replicator: %s; retrying in %.1fs", self.shard.shard_no, exc,
                            backoff)
                self.reader = None
                try:
                    await asyncio.wait_for(self._stop.wait(), backoff)
                except asyncio.TimeoutError:
                    pass
                backoff = min(backoff * 2, 5.0)

    async def stop(self) -> None:
        self._stop.set()
        if self.reader is not None:
            await self.reader.close()
