"""`SearchCore`: what the transport calls. It admits requests and hands them to the part that owns
them - the query pipeline (pipeline.py), the write path (writes.py), the build manager (builds.py,
only where this process owns the shards) - over the collections in the registry (registry.py).

One process can be: the embedded default (it owns local shards: engine and front end together);
a front end over an engine process of the same host (`serve --workers N`); or a router over
shard servers. The pipeline and write path are the same in all three; only the shards differ.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable, Optional, Sequence

from server.backends.device import Device
from server.config import ServerConfig
from server.core.admission import Admission
from server.core import metrics
from server.core.builds import BuildManager
from server.core.collection import CollectionStore, ReleaseDescriptor
from server.core.encoders import Encoders
from server.core.engine.local import EnginePools
from server.core.pipeline import QueryPipeline
from server.core.registry import CollectionRegistry, LoadedCollection
from server.core.shard_api import SHARD_INFO_TIMEOUT_S
from server.core.types import SearchQuery, SearchResult, ShardInfo, WriteRequest
from server.core.writes import WriteAck, WriteLog, WritePath
from server.core.validation import check_batch_size
from server.errors import FailedPrecondition, SearchError, ShardUnreachable

log = logging.getLogger(__name__)


class SearchCore:
    def __init__(self, config: ServerConfig, embedder=None, reranker=None,
                 device: Optional[Device] = None, write_log: Optional[WriteLog] = None):
        self.config = config
        self.device = device
        self.store = CollectionStore(config.storage.data_dir)
        self.registry = CollectionRegistry()
        self.encoders = Encoders(embedder, reranker, config.models,
                                 cuda=bool(device and device.torch_cuda))
        self.pools = EnginePools.create(config.engine.search_threads, config.device.faiss_threads)
        self.pipeline = QueryPipeline(self.registry, self.encoders, config.pipeline,
                                      config.models.rerank_cap, self.pools.cpu)
        self.writes = WritePath(self.registry, self.encoders, write_log)
        self.builds: Optional[BuildManager] = None
        self.engine = None  # a front end's link to the engine process that owns its shards
        self.admission = Admission(config.listen.max_inflight,
                                   config.listen.max_inflight_batched_queries)
        self.ready = False

    # --- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        """Own the shards of every served collection (the embedded default; blocking)."""
        self.builds = BuildManager(self.config, self.store, self.registry, self.encoders,
                                   self.writes, self.pools, self.device)
        self.builds.load_all(self.config.storage.collection)
        self.ready = True

    def attach(self, loaded: LoadedCollection) -> None:
        """Serve a collection whose shards live elsewhere (shard servers, an engine process)."""
        self.registry.put(loaded)
        self.ready = True

    async def start(self) -> None:
        if self.builds is not None:
            await self.builds.start()

    def background(self) -> list:
        """Coroutines to run for the server's life (alias following, scheduled compaction)."""
        s = self.config.storage
        out = []
        if self.builds is not None and s.alias_poll_s > 0:
            out.append(self.builds.watch_aliases(s.alias_poll_s))
        if self.builds is not None and s.compact_interval_s > 0:
            out.append(self.builds.compact_on_schedule(s.compact_interval_s,
                                                       s.compact_min_tombstone_ratio))
        return out

    async def close(self) -> None:
        self.ready = False
        await self.encoders.close()
        if self.builds is not None:
            await self.builds.close()
        for coll in self.registry:
            await asyncio.gather(*(s.close() for s in coll.shards))
        self.pools.close()

    # --- reads -------------------------------------------------------------------------------
    def collection(self, name: str) -> LoadedCollection:
        return self.registry.get(name)

    async def search(self, q: SearchQuery, tenant: str, deadline: Optional[float] = None,
                     acl_scopes: Sequence[str] = ()) -> SearchResult:
        """`tenant` and `acl_scopes` come from the caller's credentials, never from the request."""
        out = await self.search_batch([q], tenant, deadline, acl_scopes)
        if isinstance(out[0], SearchError):
            raise out[0]
        return out[0]

    async def search_batch(self, queries: Sequence[SearchQuery], tenant: str,
                           deadline: Optional[float] = None,
                           acl_scopes: Sequence[str] = (),
                           on_part: Optional[Callable[[int, list], None]] = None) -> list:
        """One answer per query: a SearchResult, or that query's SearchError. `on_part(first,
        answers)` is called on the loop as each part of the batch is answered (QueryPipeline.search)."""
        if not tenant:
            raise FailedPrecondition("no tenant resolved for the caller")
        check_batch_size(len(queries))
        with self.admission.admit(len(queries)):
            return await self.pipeline.search(queries, tenant, tuple(acl_scopes), deadline,
                                              on_part)

    async def stats(self, name: str, tenant: Optional[str] = None, digest: bool = False,
                    deadline: Optional[float] = None) -> dict:
        """Live counts from every shard (of one tenant's documents only when `tenant` is given:
        a tenant-scoped admin) and, for operators, each shard's applied log position and digest.
        An operator's view survives a shard none of whose replicas answers: that shard's
        replicas are listed unreachable, the counts are the other shards' and `shard_errors`
        says so (outside QA: the whole call failed UNAVAILABLE, the view an outage needs most).
        A tenant admin's counts are never partial: that call fails. `deadline` (the caller's,
        on the loop's clock): a replica that hangs is given up a twentieth of the time left (up
        to 50 ms) before it, so the answer - the other shards' view - reaches the caller in
        time (outside QA: the shards' own 10 s ShardInfo timeout held it past the caller's)."""
        coll = self.registry.get(name)
        limit = {}
        if deadline is not None:
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            limit["timeout"] = min(SHARD_INFO_TIMEOUT_S, left - min(0.05 * left, 0.05))
        answers = await asyncio.gather(*(s.info(tenant, digest, **limit) for s in coll.shards),
                                       return_exceptions=True)
        infos, errors = [], []
        for shard, a in zip(coll.shards, answers):
            if isinstance(a, ShardUnreachable) and tenant is None:
                infos.append(ShardInfo(shard.shard_no, name, "", "", "", 0, 0, 0, 0, 0,
                                       state="unreachable", replicas=a.replicas))
                errors.append(str(a))
            elif isinstance(a, BaseException):
                raise a
            else:
                infos.append(a)
        return {"documents": sum(i.documents for i in infos), "chunks": sum(i.chunks for i in infos),
                "vectors": sum(i.vectors for i in infos), "shards": infos,
                "stages": metrics.RECENT.percentiles(), "shard_errors": errors}

    @staticmethod
    async def _infos(coll: LoadedCollection, tenant: Optional[str], digest: bool = False) -> list:
        return await asyncio.gather(*(s.info(tenant, digest) for s in coll.shards))

    async def describe(self, name: str, tenant: Optional[str] = None
                       ) -> tuple[ReleaseDescriptor, ReleaseDescriptor]:
        """(the view, the build's own descriptor) of the live build, resolved once. The view
        counts documents and chunks live (the build's and the streaming writes since, as
        CollectionStats counts them: outside QA found operators shown the build's counts, and
        tenant admins live ones) and is tenant-scoped (no other tenant's name or size) when
        `tenant` is given. An operator whose shards cannot all be counted (a replica set down)
        gets the build's counts rather than no description."""
        loaded = self.registry.get(name)
        desc = loaded.desc
        try:
            infos = await self._infos(loaded, tenant)
        except SearchError:
            if tenant is not None:
                raise  # a tenant's view never shows the collection's own counts
            return desc, desc
        view = desc if tenant is None else desc.for_tenant(tenant)
        return (dataclasses.replace(view, documents=sum(i.documents for i in infos),
                                    chunks=sum(i.chunks for i in infos)), desc)

    # --- writes and builds -------------------------------------------------------------------
    async def write(self, w: WriteRequest, tenant: str) -> WriteAck:
        if self.writes.log is None and not self.registry.get(w.collection).direct_writes:
            raise FailedPrecondition("this router's shards are replica sets and it has no write "
                                     "log: start it with --nats (replicated writes)")
        with self.admission.admit(write=True):  # its own budget: a slow log never blocks searches
            return await self.writes.write(w, tenant)

    async def compact(self, name: str) -> dict:
        if self.builds is not None:
            return await self.builds.compact(name)
        if self.engine is not None:
            return await self.engine.call("compact", name)
        raise FailedPrecondition("compaction runs where the shards are local (search-server "
                                 "serve, or index-builder compact against it)")

    async def switch_build(self, name: str, build_id: Optional[str] = None) -> dict:
        if self.builds is None:
            raise FailedPrecondition("this server does not own its shards")
        result = await self.builds.switch_build(name, build_id)
        if result["switched"]:
            self.pipeline.clear_cache()
        return result
