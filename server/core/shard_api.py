"""The shard interface: one complete, batch-first set of operations that every kind of shard
implements, so the core never asks which kind it holds.

Kinds: `LocalShard` (server/core/engine/local.py: the engine that owns the index and device, in
this process), `RemoteShard` (server/transport/shard_rpc.py: a shard server over gRPC),
`EngineShard` (server/transport/engine_link.py: the engine in another process of this host) and
`ReplicaSet` (server/core/replicas.py: one shard served by several replicas).

Every operation is message-shaped (plain dataclasses from server/core/types.py), so the same
engine runs in process, in its own process or behind gRPC.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union

from server.core.types import (Candidate, FetchRequest, ShardInfo, ShardQuery, ShardResult,
                               ShardWrite, StoredVersions, WriteOutcome)
from server.errors import SearchError

SearchAnswer = Union[ShardResult, SearchError]

# how long a remote shard's `info` may take when the caller gives no time: a hung replica must
# not hold CollectionStats (or a router's start) for ever
SHARD_INFO_TIMEOUT_S = 10.0


class Shard(Protocol):
    shard_no: int

    @property
    def cache_version(self) -> Optional[int]:
        """The shard's index version (it moves on every write) when it can be read without a call,
        as for an engine in this process; the retrieval cache keys on it. None: unknown here, so
        answers over this shard are not cached."""
        ...

    async def search(self, queries: Sequence[ShardQuery],
                     timeout: Optional[float] = None) -> list[SearchAnswer]:
        """Answer a batch of queries; one answer per query, in order: its result, or the domain
        error that query alone got (a bad query does not fail its neighbours). An error that
        concerns the whole call (unreachable, deadline) is raised instead."""
        ...

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list[Candidate]:
        """Records of rows still live and visible to the caller."""
        ...

    async def apply(self, writes: Sequence[ShardWrite],
                    timeout: Optional[float] = None) -> list[WriteOutcome]:
        """Apply writes in order through the versioned, crash-safe path (idempotent: a version
        not above the stored one is a no-op). Acknowledged = durable and searchable."""
        ...

    async def stored_versions(self, keys: Sequence[tuple[str, str]],
                              timeout: Optional[float] = None) -> StoredVersions:
        """The stored version of each of these (tenant, doc_id) documents the shard holds, so a
        writer can answer an upsert its shard would take as a no-op without embedding it first.
        Kinds whose writes travel through the replicated log (remote shards, replica sets) know
        none here: the write then goes on as before, and the log or the shard decides."""
        ...

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = None) -> ShardInfo:
        """The build served, the write-log position applied, counts (of `tenant` only when given)
        and, when asked, a digest of the live rows (equal digests = equal live rows)."""
        ...

    async def close(self) -> None:
        ...
