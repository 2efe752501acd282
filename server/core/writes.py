"""The write path: validate -> chunk -> embed (or take the caller's own vectors) -> one ShardWrite
for the document's shard -> applied by that shard's engine (the embedded default), or appended to
the replicated write log that every replica of the shard applies in order (distributed mode).

Documents are keyed by (tenant, doc_id) and routed by a hash of both, so all of a document's
chunks live on one shard and a replace is local to it. The tenant comes from credentials.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import numpy as np

from server.core import metrics
from server.core.chunking import capped_chunks, embed_text, given_chunks, shard_of
from server.core.collection import ReleaseDescriptor
from server.core.encoders import Encoders
from server.core.registry import CollectionRegistry
from server.core.shard_api import Shard
from server.core.types import ShardWrite, WriteRequest
from server.core.validation import check_vector, unit_vectors, validate_write
from server.errors import InvalidArgument


@dataclass(frozen=True)
class WriteAck:
    outcome: str            # applied | noop (embedded: applied before the answer) | accepted (logged)
    stored_version: int
    index_version: str
    sequence: int = 0       # the write-log position (distributed mode; 0 in the embedded default)


class WriteLog(Protocol):
    """The replicated write log (server/replication/): appends are idempotent by message id."""

    async def append(self, collection: str, shard: int, write: ShardWrite,
                     msg_id: str) -> tuple[int, bool]:
        """(sequence, superseded): a message id the log holds already stores nothing and answers
        the sequence of the entry it holds; `superseded` when that entry is another write (another
        write - another body, or the other operation - under the same document and version), not
        this one or a retry of it."""
        ...

    async def check_against_replicas(self, applied: dict[int, int]) -> Optional[str]:
        """Refuse appends while the log ends before a position a replica has applied (shard ->
        highest applied sequence); returns why, or None."""
        ...


def message_id(collection: str, w: ShardWrite) -> str:
    """Deterministic per document version, so a retried publish of the same write is dropped by
    the log, and so is another write under a version the log holds (a delete of the version an
    upsert wrote, or the reverse: outside QA found both ACCEPTED while replicas applied only the
    first, where the embedded server answers NOOP_STALE_VERSION)."""
    key = f"{collection}\x00{w.tenant}\x00{w.doc_id}\x00{w.version}".encode()
    return hashlib.sha256(key).hexdigest()[:32]


class WriteGate:
    """Writes run concurrently with each other; a build switch waits for running writes to finish
    and holds new ones until the swap is done (so no write lands on a build being retired)."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._writes = 0
        self._switching = False

    @asynccontextmanager
    async def writing(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._switching)
            self._writes += 1
        try:
            yield
        finally:
            async with self._cond:
                self._writes -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._switching)
            self._switching = True
            await self._cond.wait_for(lambda: self._writes == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._switching = False
                self._cond.notify_all()


class WritePath:
    def __init__(self, registry: CollectionRegistry, encoders: Encoders,
                 log: Optional[WriteLog] = None):
        self.registry = registry
        self.encoders = encoders
        self.log = log
        self._gates: dict[str, WriteGate] = {}

    def gate(self, name: str) -> WriteGate:
        gate = self._gates.get(name)
        if gate is None:
            gate = self._gates[name] = WriteGate()
        return gate

    async def write(self, w: WriteRequest, tenant: str) -> WriteAck:
        """Apply (embedded) or log (distributed) an upsert or delete for `tenant` (from
        credentials). Embedded: acknowledged = durable and searchable. Distributed: acknowledged
        = held by the log; WriteAck.sequence is what a read passes as min_applied_sequence."""
        t0 = time.perf_counter()
        validate_write(w)
        self.registry.get(w.collection)
        now = time.time()
        async with self.gate(w.collection).writing():  # a build switch waits for us, and we for it
            coll = self.registry.get(w.collection)
            shard_no = shard_of(tenant, w.doc_id, coll.desc.shards)
            # the embedded server asks its shard first: an upsert it would take as a no-op (a
            # re-sent document, a sync job's unchanged pages) is answered without embedding it
            sw = await self.shard_write(w, tenant, coll.desc, now,
                                        coll.shards[shard_no] if self.log is None else None)
            if isinstance(sw, WriteAck):
                ack = sw
            elif self.log is not None:
                seq, superseded = await self.log.append(coll.name, shard_no, sw,
                                                        message_id(coll.name, sw))
                # another body under a version the log holds already: nothing was stored and the
                # first body stands, as the embedded server answers; a retry is ACCEPTED (held)
                ack = WriteAck("noop" if superseded else "accepted", w.version, "", seq)
            else:
                out = (await coll.shards[shard_no].apply([sw]))[0]
                ack = WriteAck(out.outcome, out.stored_version, str(out.index_version), out.seq)
        metrics.WRITES.labels(w.op, ack.outcome).inc()
        if ack.outcome == "applied":
            metrics.FRESHNESS.observe(time.perf_counter() - t0)
        if w.source_modified_at and ack.outcome != "noop":
            metrics.STALENESS.observe(max(0.0, now - w.source_modified_at))
        return ack

    async def shard_write(self, w: WriteRequest, tenant: str, desc: ReleaseDescriptor,
                          now: Optional[float] = None,
                          shard: Optional[Shard] = None) -> Union[ShardWrite, WriteAck]:
        """Chunk and embed (or check the caller's chunks and vectors) into the shard's message.
        With `shard` (the document's, which applies the write itself), an upsert to embed whose
        version is not above the one stored there is answered NOOP instead, as the shard would
        answer it, with no model call: checked and chunked as ever, so a request that fails
        those fails the same way."""
        body = {"title": w.title, "text": "", "metadata": dict(w.metadata), "acl": list(w.acl),
                "source_modified_at": w.source_modified_at or None,
                "ingested_at": now if now is not None else time.time()}
        if w.op == "delete":
            return ShardWrite("delete", tenant, w.doc_id, w.version, body)
        if w.chunks:
            text, chunks = given_chunks([t for t, _ in w.chunks])
            vectors = self._given_vectors(w, desc)
        else:
            text, chunks = w.text, capped_chunks(w.title, w.text)
            vectors = None
        body["text"] = text
        if vectors is None and chunks and shard is not None:
            self.encoders.check_model(desc, writing=True)  # a server that cannot embed says so
            stored = await shard.stored_versions([(tenant, w.doc_id)])
            found = stored.versions.get((tenant, w.doc_id))
            if found is not None and found >= w.version:
                return WriteAck("noop", found, str(stored.index_version))
        if vectors is None:
            vectors = await self.encoders.embed_many([embed_text(w.title, c.text) for c in chunks], desc)
        return ShardWrite("upsert", tenant, w.doc_id, w.version, body, tuple(chunks), vectors,
                          model_id=desc.model_id)

    @staticmethod
    def _given_vectors(w: WriteRequest, desc: ReleaseDescriptor) -> Optional[np.ndarray]:
        given = [v for _, v in w.chunks]
        if all(v is None or len(v) == 0 for v in given):
            return None  # chunks without vectors: the server embeds them
        if any(v is None or len(v) == 0 for v in given):
            raise InvalidArgument("give a vector for every chunk, or for none")
        vectors = np.asarray([np.asarray(v, np.float32) for v in given]) if len({len(v) for v in given}) == 1 \
            else None
        if vectors is None:
            raise InvalidArgument(f"chunk vectors differ in dimension; collection {desc.collection!r} "
                                  f"has dimension {desc.dim}")
        for v in vectors:
            check_vector(v, w.vector_model_id, desc)
        return unit_vectors(vectors, desc.metric, "chunk vector")
