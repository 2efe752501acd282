"""The search pipeline: validate -> embed -> fan out to shards -> merge -> fuse -> rerank -> assemble.

Every stage is timed (per request, and in Prometheus), sees the request's remaining deadline, and
raises domain errors (server/errors.py) that the transport maps to gRPC status codes.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from server.backends.device import Device
from server.core import limits, metrics
from server.core.assembly import assemble
from server.core.batcher import MicroBatcher
from server.core.collection import CollectionStore, ReleaseDescriptor, check_name
from server.core.ranking import merge_topk, rrf
from server.core.shards import LocalShard, Shard, shard_dir_name
from server.core.types import (Candidate, RankedHit, SearchQuery, SearchResult, ShardQuery,
                               ShardResult, TraceEntry, WriteRequest)
from server.errors import (CorpusVersionMismatch, DeadlineExceeded, FailedPrecondition,
                           InvalidArgument, ModelMismatch, NotFound, Overloaded, SearchError,
                           Unavailable)

log = logging.getLogger(__name__)

MODES = ("dense", "lexical", "hybrid")
SCORE_KINDS = {"ip": "cosine", "l2": "l2"}


@dataclass
class SearchConfig:
    data_dir: Path
    max_inflight: int = 256
    rerank_cap: int = limits.DEFAULT_RERANK_CAP
    default_depth: int = limits.DEFAULT_DEPTH
    default_rrf_k: int = limits.DEFAULT_RRF_K
    dedupe: bool = True
    embed_max_batch: int = 64
    embed_max_tokens: int = 16384
    embed_max_wait_ms: float = 2.0
    rerank_max_batch: int = 64
    rerank_max_tokens: int = 32768
    rerank_max_wait_ms: float = 2.0
    embedding_cache_size: int = 4096
    retrieval_cache_size: int = 1024
    text_top_n: Optional[int] = None  # remote shards ship text for this many hits per list
                                      # (None: the assembly/rerank window, max(4 top_k, rerank_depth))
    shard_threads: int = 8
    faiss_threads: int = 1  # OpenMP threads per faiss search in the shard threads (see main.py)
    collections: Optional[Sequence[str]] = None  # None: every published collection


@dataclass
class LoadedCollection:
    desc: ReleaseDescriptor
    shards: list[Shard]

    @property
    def name(self) -> str:
        return self.desc.collection


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


class SearchCore:
    """Owns the loaded collections and the model batchers; answers searches and admin reads."""

    def __init__(self, config: SearchConfig, embedder=None, reranker=None,
                 device: Optional[Device] = None):
        self.config = config
        self.store = CollectionStore(config.data_dir)
        self.embedder = embedder
        self.reranker = reranker
        self.device = device
        self.collections: dict[str, LoadedCollection] = {}
        from server.backends.device import faiss_threads_initializer

        self.executor = ThreadPoolExecutor(max_workers=config.shard_threads, thread_name_prefix="shard",
                                           initializer=faiss_threads_initializer(config.faiss_threads))
        self.embed_batcher = (MicroBatcher("embed", embedder.encode, config.embed_max_batch,
                                           config.embed_max_tokens, config.embed_max_wait_ms)
                              if embedder is not None else None)
        self.rerank_batcher = (MicroBatcher("rerank", reranker.score, config.rerank_max_batch,
                                            config.rerank_max_tokens, config.rerank_max_wait_ms)
                               if reranker is not None else None)
        self._embed_cache: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        self._retrieval_cache: OrderedDict[tuple, SearchResult] = OrderedDict()
        self._writers: dict[tuple[str, int], ThreadPoolExecutor] = {}
        self._gates: dict[str, "WriteGate"] = {}
        self.inflight = 0
        self.ready = False

    # --- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        names = self.config.collections or self.store.collections()
        for name in names:
            self.store.sweep_abandoned(name)  # staging dirs of killed builds and compactions
            self.load_collection(name)
        self.ready = True

    async def start(self) -> None:
        """Inside the event loop, before serving: replay writes the live build may have missed
        (it was published while the server was down, or the server stopped mid-switch)."""
        for name, loaded in list(self.collections.items()):
            if not all(hasattr(sh, "apply_write") for sh in loaded.shards):
                continue  # a router over remote shards: nothing local to replay
            previous = self.store.alias(name).get("previous")
            if previous and self.embedder is not None and previous in self.store.builds(name):
                await self._replay(name, previous, loaded)

    def load_collection(self, name: str, build_id: Optional[str] = None) -> LoadedCollection:
        build_id = build_id or self.store.live_build(name)
        desc = self.store.descriptor(name, build_id)
        build_dir = self.store.build_dir(name, build_id)
        shards = [LocalShard(desc, build_dir, i, self.device, self.executor)
                  for i in range(desc.shards)]
        loaded = LoadedCollection(desc, shards)
        self.collections[name] = loaded
        log.info("loaded %s build %s (%d shards, %d chunks, model %s)", name, build_id,
                 desc.shards, desc.chunks, desc.model_id)
        return loaded

    def attach(self, loaded: LoadedCollection) -> None:
        """Serve a collection whose shards were built elsewhere (a router over replica sets)."""
        if [s.shard_no for s in loaded.shards] != list(range(loaded.desc.shards)):
            raise FailedPrecondition(f"{loaded.name}: build {loaded.desc.build_id} has "
                                     f"{loaded.desc.shards} shards; got {len(loaded.shards)}")
        self.collections[loaded.name] = loaded
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        for b in (self.embed_batcher, self.rerank_batcher):
            if b is not None:
                await b.close()
        self.executor.shutdown(wait=True)
        for w in self._writers.values():
            w.shutdown(wait=True)
        for c in self.collections.values():
            for s in c.shards:
                close = getattr(s, "close", None)
                if close is not None:
                    result = close()
                    if asyncio.iscoroutine(result):
                        await result

    # --- reads -------------------------------------------------------------------------------
    def collection(self, name: str) -> LoadedCollection:
        check_name(name)
        loaded = self.collections.get(name)
        if loaded is None:
            raise NotFound(f"collection {name!r} is not served here "
                           f"(serving: {sorted(self.collections) or 'none'})")
        return loaded

    def stats(self, name: str, tenant: Optional[str] = None) -> dict:
        """Live counts from the shards' stores where local (writes move them), else the build's;
        of one tenant's documents only when `tenant` is given (a tenant-scoped admin)."""
        c = self.collection(name)
        docs, chunks = c.desc.documents, c.desc.chunks
        if tenant is not None:
            docs, chunks = 0, c.desc.tenants.get(tenant, 0)
        if all(hasattr(s, "store") for s in c.shards):
            counts = [s.store.counts(tenant) for s in c.shards]
            docs, chunks = sum(x["documents"] for x in counts), sum(x["chunks"] for x in counts)
        return {"documents": docs, "chunks": chunks,
                "vectors": sum(getattr(s, "nrows", 0) for s in c.shards) if tenant is None else chunks,
                "stages": metrics.RECENT.percentiles()}

    # --- search ------------------------------------------------------------------------------
    def validate(self, q: SearchQuery, desc: ReleaseDescriptor) -> str:
        """Check every field against the limits; return the resolved mode."""
        if len(q.text) > limits.MAX_QUERY_CHARS:
            raise InvalidArgument(f"query text is {len(q.text)} characters; the cap is "
                                  f"{limits.MAX_QUERY_CHARS}")
        mode = q.mode or ("hybrid" if q.text.strip() else "dense")
        if mode not in MODES:
            raise InvalidArgument(f"unknown mode {mode!r}; use one of {MODES}")
        if not 1 <= q.top_k <= limits.MAX_TOP_K:
            raise InvalidArgument(f"top_k must be between 1 and {limits.MAX_TOP_K}, not {q.top_k}")
        for name, depth in (("dense_depth", q.dense_depth), ("lexical_depth", q.lexical_depth)):
            if depth > limits.MAX_DEPTH:
                raise InvalidArgument(f"{name} {depth} exceeds the cap {limits.MAX_DEPTH}")
        if q.rrf_k > limits.MAX_RRF_K:
            raise InvalidArgument(f"rrf_k {q.rrf_k} exceeds the cap {limits.MAX_RRF_K}")
        if q.rerank_depth > self.config.rerank_cap:
            raise InvalidArgument(f"rerank_depth {q.rerank_depth} exceeds the server cap "
                                  f"{self.config.rerank_cap}")
        if q.rerank_depth and self.rerank_batcher is None:
            raise FailedPrecondition("rerank_depth was given but this server has no cross-encoder "
                                     "(start it with --reranker DIR)")
        if q.context_token_budget > limits.MAX_CONTEXT_TOKENS:
            raise InvalidArgument(f"context_token_budget exceeds the cap {limits.MAX_CONTEXT_TOKENS}")
        if len(q.filters) > limits.MAX_FILTERS:
            raise InvalidArgument(f"{len(q.filters)} filters; the cap is {limits.MAX_FILTERS}")
        from server.backends.docstore import check_filter_key

        for f in q.filters:
            check_filter_key(f.key)
            if not (f.any_of or f.is_range) or len(f.any_of) > limits.MAX_FILTER_VALUES:
                raise InvalidArgument(f"filter {f.key!r} needs 1..{limits.MAX_FILTER_VALUES} values "
                                      "or a gte/lte range")
            if f.gte is not None and f.lte is not None and f.gte > f.lte:
                raise InvalidArgument(f"filter {f.key!r}: gte {f.gte!r} is above lte {f.lte!r}")
            if any(len(v) > limits.MAX_FILTER_VALUE_CHARS for v in f.any_of + (f.gte or "", f.lte or "")):
                raise InvalidArgument(f"a value of filter {f.key!r} exceeds "
                                      f"{limits.MAX_FILTER_VALUE_CHARS} characters")
        needs_text = mode in ("lexical", "hybrid") or (mode == "dense" and q.vector is None)
        if needs_text and not q.text.strip():
            raise InvalidArgument(f"mode {mode} needs a non-empty query text"
                                  + ("" if mode != "dense" else " or a query vector"))
        if q.vector is not None:
            if not q.vector_model_id:
                raise ModelMismatch("query vector has no model id; tag it with the model that "
                                    f"produced it (this build serves {desc.model_id!r})")
            if q.vector_model_id != desc.model_id:
                raise ModelMismatch(f"query vector is from model {q.vector_model_id!r}; collection "
                                    f"{desc.collection!r} serves {desc.model_id!r}")
            if q.vector.shape != (desc.dim,):
                raise InvalidArgument(f"query vector has dimension {q.vector.size}; collection "
                                      f"{desc.collection!r} has dimension {desc.dim}")
            if not np.isfinite(q.vector).all():
                raise InvalidArgument("query vector contains NaN or infinite values")
            if mode == "lexical":
                raise InvalidArgument("mode lexical takes text, not a vector")
        return mode

    async def _embed(self, text: str, desc: ReleaseDescriptor, deadline: Optional[float],
                     notes: list[str], background: bool = False) -> np.ndarray:
        """Embed through the cache (key: model id + sha256 of the text, shared by queries and
        ingest) and the micro-batcher."""
        if self.embedder is None:
            raise FailedPrecondition("this server has no embedder; send a query vector")
        if self.embedder.model_id != desc.model_id:
            raise FailedPrecondition(f"the server's embedder {self.embedder.model_id!r} cannot "
                                     f"embed for build {desc.build_id} ({desc.model_id!r})")
        key = (self.embedder.model_id, hashlib.sha256(text.encode()).hexdigest())
        cached = self._embed_cache.get(key)
        if cached is not None:
            self._embed_cache.move_to_end(key)
            metrics.EMBED_CACHE.labels("hit").inc()
            return cached
        metrics.EMBED_CACHE.labels("miss").inc()
        tokens = self.embedder.count_tokens([text])[0]
        if tokens > self.embedder.max_length:
            notes.append(f"query has {tokens} tokens; embedded its first {self.embedder.max_length}")
        vec = await self.embed_batcher.submit(text, min(tokens, self.embedder.max_length), deadline,
                                              background)
        self._embed_cache[key] = vec
        if len(self._embed_cache) > self.config.embedding_cache_size:
            self._embed_cache.popitem(last=False)
        return vec

    async def _fan_out(self, coll: LoadedCollection, sq: ShardQuery, deadline: Optional[float],
                       allow_partial: bool) -> tuple[list[ShardResult], list[str]]:
        loop = asyncio.get_running_loop()
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        results = await asyncio.gather(*(s.search(sq, timeout) for s in coll.shards),
                                       return_exceptions=True)
        ok, errors = [], []
        for shard, r in zip(coll.shards, results):
            if isinstance(r, BaseException):
                if isinstance(r, asyncio.TimeoutError):
                    r = DeadlineExceeded(f"shard {shard.shard_no} did not answer within the deadline")
                if isinstance(r, (InvalidArgument, FailedPrecondition)) or not isinstance(r, SearchError):
                    if not isinstance(r, SearchError):
                        log.exception("shard %d failed", shard.shard_no, exc_info=r)
                        r = Unavailable(f"shard {shard.shard_no} failed: {type(r).__name__}: {r}")
                    raise r
                errors.append(f"shard {shard.shard_no}: {r}")
            else:
                ok.append(r)
        if errors and not allow_partial:
            first = next(r for r in results if isinstance(r, BaseException))
            if isinstance(first, asyncio.TimeoutError):
                raise DeadlineExceeded(f"{len(errors)} of {len(coll.shards)} shards did not answer "
                                       f"in time: {'; '.join(errors)}")
            raise type(first)(f"{len(errors)} of {len(coll.shards)} shards failed: {'; '.join(errors)}")
        return ok, errors

    def _check_deadline(self, deadline: Optional[float], stage: str) -> None:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise DeadlineExceeded(f"deadline passed before {stage}")

    async def search(self, q: SearchQuery, tenant: str, deadline: Optional[float] = None,
                     acl_scopes: Sequence[str] = ()) -> SearchResult:
        """`tenant` and `acl_scopes` come from the caller's credentials (transport), never from
        the request."""
        if not tenant:
            raise FailedPrecondition("no tenant resolved for the caller")
        if self.inflight >= self.config.max_inflight:
            metrics.REJECTED.inc()
            raise Overloaded(f"{self.inflight} requests in flight (limit {self.config.max_inflight}); "
                             "retry with backoff")
        self.inflight += 1
        metrics.INFLIGHT.inc()
        try:
            return await self._search(q, tenant, deadline, tuple(acl_scopes))
        finally:
            self.inflight -= 1
            metrics.INFLIGHT.dec()

    def _cache_key(self, q: SearchQuery, coll: LoadedCollection, mode: str, tenant: str,
                   acl_scopes: tuple) -> Optional[tuple]:
        """Everything the answer depends on, including every shard's index version (which moves
        on every write): an entry can never be served after a write that could change it.
        None (no caching) when a shard cannot tell its version (remote replica sets)."""
        versions = tuple(getattr(s, "index_version", None) for s in coll.shards)
        if None in versions or q.include_trace:
            return None
        vec = (hashlib.sha256(q.vector.tobytes()).hexdigest(), q.vector_model_id) if q.vector is not None else None
        return (coll.desc.build_id, versions, " ".join(q.text.split()), vec, mode, tenant, acl_scopes,
                q.filters, q.top_k, q.dense_depth, q.lexical_depth, q.rrf_k, q.rerank_depth,
                q.context_token_budget, q.allow_partial)

    async def _search(self, q: SearchQuery, tenant: str, deadline: Optional[float],
                      acl_scopes: tuple) -> SearchResult:
        t_start = time.perf_counter()
        timings: dict[str, float] = {}
        notes: list[str] = []

        def lap(stage: str, t0: float) -> float:
            now = time.perf_counter()
            timings[stage] = (now - t0) * 1e3
            metrics.RECENT.observe(stage, now - t0)
            return now

        coll = self.collection(q.collection)
        desc = coll.desc
        mode = self.validate(q, desc)
        cache_key = self._cache_key(q, coll, mode, tenant, acl_scopes)
        if cache_key is not None and self.config.retrieval_cache_size:
            cached = self._retrieval_cache.get(cache_key)
            if cached is not None:
                self._retrieval_cache.move_to_end(cache_key)
                metrics.RETRIEVAL_CACHE.labels("hit").inc()
                ms = (time.perf_counter() - t_start) * 1e3
                metrics.RECENT.observe("total", ms / 1e3)
                return SearchResult(cached.hits, cached.build_id, cached.corpus_version,
                                    cached.model_id, {"cache": ms, "total": ms}, cached.partial,
                                    cached.shard_errors, None, cached.notes + ["retrieval cache hit"],
                                    cached.context_tokens)
            metrics.RETRIEVAL_CACHE.labels("miss").inc()
        t = time.perf_counter()
        vector = q.vector
        if mode in ("dense", "hybrid") and vector is None:
            self._check_deadline(deadline, "embed")
            vector = await self._embed(q.text, desc, deadline, notes)
            t = lap("embed", t)
        window = max(q.top_k * 4, q.rerank_depth)  # the hits assembly and rerank may read
        # fusion wants deep candidate lists; a single retriever needs only what assembly reads
        single = window if mode != "hybrid" else 0
        dense_depth = q.dense_depth or max(single or self.config.default_depth, q.top_k)
        lexical_depth = q.lexical_depth or max(single or self.config.default_depth, q.top_k)
        sq = ShardQuery(desc.build_id, tenant,
                        vector.astype(np.float32) if mode != "lexical" else None, desc.model_id,
                        q.text if mode != "dense" else "", dense_depth, lexical_depth, q.filters,
                        acl_scopes,
                        text_top_n=0 if q.include_trace else (self.config.text_top_n or window))
        self._check_deadline(deadline, "retrieval")
        results, shard_errors = await self._fan_out(coll, sq, deadline, q.allow_partial)
        t = lap("retrieve", t)
        for r in results:
            if r.dense_ms:
                metrics.RECENT.observe("dense", r.dense_ms / 1e3)
            if r.lexical_ms:
                metrics.RECENT.observe("lexical", r.lexical_ms / 1e3)
        timings["dense"] = max((r.dense_ms for r in results), default=0.0)
        timings["lexical"] = max((r.lexical_ms for r in results), default=0.0)
        versions = {r.corpus_version for r in results}
        if len(versions) > 1 or (versions and versions != {desc.corpus_version}):
            raise CorpusVersionMismatch(f"shards answered from corpus versions {sorted(versions)}; "
                                        f"build {desc.build_id} is {desc.corpus_version}")

        dense = merge_topk((r.dense for r in results), dense_depth) if sq.vector is not None else []
        lexical = merge_topk((r.lexical for r in results), lexical_depth) if sq.text else []
        dense_pos = {c.chunk_id: (i + 1, c.score) for i, c in enumerate(dense)}
        lex_pos = {c.chunk_id: (i + 1, c.score) for i, c in enumerate(lexical)}
        by_id = {c.chunk_id: c for c in lexical}
        by_id.update({c.chunk_id: c for c in dense})
        dense_kind = SCORE_KINDS.get(desc.metric, "inner_product")
        if mode == "hybrid":
            fused = rrf({"dense": [c.chunk_id for c in dense],
                         "lexical": [c.chunk_id for c in lexical]}, q.rrf_k or self.config.default_rrf_k)
            ranked = [RankedHit(by_id[cid], s, "rrf", dense_pos.get(cid), lex_pos.get(cid), (i + 1, s))
                      for i, (cid, s) in enumerate(fused)]
        elif mode == "dense":
            ranked = [RankedHit(c, c.score, dense_kind, dense_pos[c.chunk_id]) for c in dense]
        else:
            ranked = [RankedHit(c, c.score, "bm25", None, lex_pos[c.chunk_id]) for c in lexical]
        t = lap("fusion", t)
        if any(h.candidate.record.text is None for h in ranked):
            ranked = await self._fill_texts(coll, ranked, window, tenant, acl_scopes, deadline)
            t = lap("fetch", t)

        pre_rerank = ranked
        if q.rerank_depth and ranked:
            self._check_deadline(deadline, "rerank")
            head, tail = ranked[:q.rerank_depth], ranked[q.rerank_depth:]
            scores = await asyncio.gather(*(
                self.rerank_batcher.submit((q.text, h.candidate.record.text),
                                           (len(q.text) + len(h.candidate.record.text)) // 4 + 3,
                                           deadline) for h in head))
            order = sorted(range(len(head)), key=lambda i: (-scores[i], head[i].candidate.chunk_id))
            reranked = []
            for rank, i in enumerate(order, start=1):
                h = head[i]
                h.rerank = (rank, float(scores[i]))
                h.score, h.score_kind = float(scores[i]), "cross_encoder"
                reranked.append(h)
            ranked = reranked + tail
            t = lap("rerank", t)

        count = self.embedder.count_tokens if self.embedder is not None else None
        if q.context_token_budget and count is None:
            raise FailedPrecondition("a context token budget needs the server's tokenizer (embedder)")
        args = (ranked, q.top_k, tenant, q.context_token_budget, count, self.config.dedupe, acl_scopes)
        if q.context_token_budget:  # tokenizing the passages is CPU work: keep it off the event loop
            selected, dropped, used = await asyncio.get_running_loop().run_in_executor(
                self.executor, assemble, *args)
        else:
            selected, dropped, used = assemble(*args)
        lap("assembly", t)
        timings["total"] = (time.perf_counter() - t_start) * 1e3
        metrics.RECENT.observe("total", timings["total"] / 1e3)

        trace = None
        if q.include_trace:
            def entries(cands: Sequence[Candidate]):
                return [TraceEntry(c.chunk_id, c.record.doc_id, c.score, i + 1) for i, c in enumerate(cands)]

            def ranked_entries(hits: Sequence[RankedHit]):
                return [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id, h.score, i + 1)
                        for i, h in enumerate(hits)]

            trace = {"dense": entries(dense), "lexical": entries(lexical)}
            if mode == "hybrid":
                trace["fused"] = [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id,
                                             h.fused[1], h.fused[0]) for h in pre_rerank]
            if q.rerank_depth:
                trace["reranked"] = ranked_entries(ranked[:q.rerank_depth])
            trace["context"] = ranked_entries(selected)
            trace["dropped"] = [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id, h.score,
                                           0, reason) for h, reason in dropped]
        result = SearchResult(selected, desc.build_id, desc.corpus_version, desc.model_id, timings,
                              bool(shard_errors), shard_errors, trace, notes, used)
        if cache_key is not None and not shard_errors and self.config.retrieval_cache_size:
            self._retrieval_cache[cache_key] = result
            while len(self._retrieval_cache) > self.config.retrieval_cache_size:
                self._retrieval_cache.popitem(last=False)
        return result

    async def _fill_texts(self, coll: LoadedCollection, ranked: list[RankedHit], window: int,
                          tenant: str, acl_scopes: tuple, deadline: Optional[float]) -> list[RankedHit]:
        """Shards ship text for their top hits only; fetch the few others that fusion put in the
        window, by row (a row replaced or deleted meanwhile drops out: a ranking never mixes
        document versions). Hits past the window without text drop out too."""
        missing: dict[int, list[int]] = {}
        for h in ranked[:window]:
            if h.candidate.record.text is None:
                missing.setdefault(h.candidate.shard, []).append(h.candidate.record.row)
        if not missing:
            return [h for h in ranked if h.candidate.record.text is not None]
        loop = asyncio.get_running_loop()
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        shards = {s.shard_no: s for s in coll.shards}
        fetched = await asyncio.gather(*(
            shards[s].fetch_chunks(coll.desc.build_id, tenant, acl_scopes, ids, timeout)
            for s, ids in missing.items()))
        found = {(s, c.record.row): c.record for s, batch in zip(missing, fetched) for c in batch}
        out = []
        for h in ranked:
            if h.candidate.record.text is None:
                rec = found.get((h.candidate.shard, h.candidate.record.row))
                if rec is None:
                    continue
                h.candidate.record = rec
            out.append(h)
        return out

    # --- writes ------------------------------------------------------------------------------
    def validate_write(self, w: WriteRequest) -> None:
        if w.op not in ("upsert", "delete"):
            raise InvalidArgument(f"unknown write operation {w.op!r}")
        if not w.doc_id or len(w.doc_id) > limits.MAX_DOC_ID_CHARS or not w.doc_id.isprintable():
            raise InvalidArgument(f"doc_id must be 1..{limits.MAX_DOC_ID_CHARS} printable characters")
        if not 1 <= w.version <= limits.MAX_VERSION:
            raise InvalidArgument(f"version must be between 1 and {limits.MAX_VERSION} (2^63 - 1), "
                                  f"not {w.version}")
        if len(w.text) > limits.MAX_DOC_TEXT_CHARS:
            raise InvalidArgument(f"text is {len(w.text)} characters; the cap is {limits.MAX_DOC_TEXT_CHARS}")
        if len(w.title) > limits.MAX_TITLE_CHARS:
            raise InvalidArgument(f"title exceeds {limits.MAX_TITLE_CHARS} characters")
        if len(w.metadata) > limits.MAX_METADATA_ENTRIES:
            raise InvalidArgument(f"{len(w.metadata)} metadata entries; the cap is {limits.MAX_METADATA_ENTRIES}")
        from server.backends.docstore import check_filter_key
        from server.core.collection import NAME

        for k, v in w.metadata.items():
            check_filter_key(k)
            if len(v) > limits.MAX_METADATA_VALUE_CHARS:
                raise InvalidArgument(f"metadata {k!r} exceeds {limits.MAX_METADATA_VALUE_CHARS} characters")
        if len(w.acl) > limits.MAX_ACL_SCOPES or any(not NAME.match(a) for a in w.acl):
            raise InvalidArgument(f"acl: at most {limits.MAX_ACL_SCOPES} scopes matching {NAME.pattern}")
        if w.source_modified_at and not math.isfinite(w.source_modified_at):
            raise InvalidArgument("source_modified_at must be finite")
        if w.op == "upsert" and not w.text.strip():
            raise InvalidArgument("an upsert needs non-empty text (use DeleteDocument to remove)")

    def _gate(self, name: str) -> "WriteGate":
        gate = self._gates.get(name)
        if gate is None:
            gate = self._gates[name] = WriteGate()
        return gate

    async def write(self, w: WriteRequest, tenant: str) -> tuple[str, int, int]:
        """Apply an upsert or delete for `tenant` (from credentials). Returns (outcome, stored
        version, shard index version). Acknowledged = durable and searchable."""
        t0 = time.perf_counter()
        self.validate_write(w)
        self.collection(w.collection)
        async with self._gate(w.collection).writing():  # a build switch waits for us, and we for it
            coll = self.collection(w.collection)
            now = time.time()
            body = {"tenant": tenant, "title": w.title, "text": w.text if w.op == "upsert" else "",
                    "metadata": dict(w.metadata), "acl": list(w.acl),
                    "source_modified_at": w.source_modified_at or None, "ingested_at": now}
            outcome, stored, index_version = await self._apply(coll, w.op, tenant, w.doc_id,
                                                                w.version, body)
        metrics.WRITES.labels(w.op, outcome).inc()
        if outcome == "applied":
            metrics.FRESHNESS.observe(time.perf_counter() - t0)
            if w.source_modified_at:
                metrics.STALENESS.observe(max(0.0, now - w.source_modified_at))
        return outcome, stored, index_version

    async def _apply(self, coll: LoadedCollection, op: str, tenant: str, doc_id: str, version: int,
                     body: dict) -> tuple[str, int, int]:
        from server.core.chunking import chunk_text, embed_text, shard_of

        shard = coll.shards[shard_of(tenant, doc_id, coll.desc.shards)]
        if not hasattr(shard, "apply_write"):
            raise FailedPrecondition("this router's shards are remote: streaming writes are served "
                                     "by the embedded default (search-server serve) in this release")
        chunks, vectors = [], None
        if op == "upsert":
            chunks = chunk_text(body["text"])
            vecs = await asyncio.gather(*(self._embed(embed_text(body["title"], c.text), coll.desc,
                                                      None, [], background=True) for c in chunks))
            vectors = np.vstack(vecs).astype(np.float32) if vecs else None
        key = (coll.name, coll.desc.build_id, shard.shard_no)
        writer = self._writers.get(key)
        if writer is None:  # one thread per shard: writes apply in arrival order
            writer = self._writers[key] = ThreadPoolExecutor(1, thread_name_prefix=f"writer-{key[2]}")
        outcome, stored = await asyncio.get_running_loop().run_in_executor(
            writer, shard.apply_write, op, doc_id, version, tenant, body, chunks, vectors)
        return outcome, stored, shard.index_version

    # --- build switches: publish, rollback, compaction ---------------------------------------
    async def _replay(self, name: str, source_build: str, target: LoadedCollection) -> int:
        """Apply the source build's logged writes that the target has not seen yet (idempotent:
        each is version-checked), recording progress in the target's replay marker."""
        from server.backends.docstore import DocStore
        from server.core.compaction import read_replay_marker, write_replay_marker

        if source_build == target.desc.build_id:
            return 0
        tdir = self.store.build_dir(name, target.desc.build_id)
        marker = read_replay_marker(tdir)
        done = marker.setdefault(source_build, {})
        sdesc = self.store.descriptor(name, source_build)
        applied = 0
        loop = asyncio.get_running_loop()
        for s in range(sdesc.shards):
            sdir = self.store.build_dir(name, source_build) / shard_dir_name(s)
            log_store = DocStore(sdir / "docstore.sqlite")
            try:
                entries = await loop.run_in_executor(None, log_store.write_log, done.get(str(s), 0))
            finally:
                log_store.close()
            if entries and (self.embedder is None or self.embedder.model_id != target.desc.model_id):
                raise FailedPrecondition(
                    f"{len(entries)} writes of build {source_build} must be re-embedded for build "
                    f"{target.desc.build_id} ({target.desc.model_id}); start a server with that model")
            for seq, op, tenant, doc_id, version, body in entries:
                outcome, _, _ = await self._apply(target, op, tenant, doc_id, version, body)
                applied += outcome == "applied"
                done[str(s)] = seq
            write_replay_marker(tdir, marker)
        return applied

    async def switch_build(self, name: str, build_id: Optional[str] = None) -> dict:
        """Serve `build_id` (default: the alias's live build) in place of the current build.

        Load it, replay the current build's writes into it, then — with writes paused — replay
        the tail and swap. Each query resolves its collection once, so it sees one build.
        """
        old = self.collection(name)
        build_id = build_id or self.store.live_build(name)
        if build_id == old.desc.build_id:
            return {"build_id": build_id, "replayed": 0, "switched": False}
        loop = asyncio.get_running_loop()
        desc = self.store.descriptor(name, build_id)
        build_dir = self.store.build_dir(name, build_id)
        shards = await loop.run_in_executor(None, lambda: [
            LocalShard(desc, build_dir, i, self.device, self.executor) for i in range(desc.shards)])
        new = LoadedCollection(desc, shards)
        replayed = await self._replay(name, old.desc.build_id, new)
        async with self._gate(name).exclusive():
            replayed += await self._replay(name, old.desc.build_id, new)
            self.collections[name] = new
        self._retrieval_cache.clear()
        log.info("%s now serves build %s (was %s; %d writes replayed)", name, build_id,
                 old.desc.build_id, replayed)
        return {"build_id": build_id, "previous": old.desc.build_id, "replayed": replayed,
                "switched": True}

    async def compact(self, name: str, min_recall: float = 0.0) -> dict:
        """Compact the live build into a new one, audit and reconcile it, publish it, switch."""
        from server.core.audit import audit_build
        from server.core.compaction import compact_build

        coll = self.collection(name)
        if not all(hasattr(s, "apply_write") for s in coll.shards):
            raise FailedPrecondition("compaction runs where the shards are local (the embedded default)")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        before = {k: sum(s.store.row_states()[k] for s in coll.shards) for k in ("live", "dead", "orphan")}
        desc = await loop.run_in_executor(None, compact_build, self.store, coll)
        audit = await loop.run_in_executor(None, lambda: audit_build(
            self.store, name, desc.build_id, min_recall=min_recall))
        if not (audit["passed"] and audit["reconciliation"]["passed"]):
            raise FailedPrecondition(f"compacted build {desc.build_id} failed its checks: {audit}")
        self.store.publish(name, desc.build_id)
        switched = await self.switch_build(name, desc.build_id)
        return {"build_id": desc.build_id, "previous": coll.desc.build_id, "rows_before": before,
                "rows_after": desc.chunks, "replayed": switched["replayed"],
                "seconds": time.perf_counter() - t0}

    async def watch_aliases(self, interval: float) -> None:
        """Follow alias flips made by `index-builder publish` (poll; a flip is one file rename)."""
        while True:
            await asyncio.sleep(interval)
            for name in list(self.collections):
                try:
                    if self.store.live_build(name) != self.collections[name].desc.build_id:
                        await self.switch_build(name)
                except SearchError as exc:
                    log.error("cannot switch %s to its published build: %s", name, exc)

    async def compact_on_schedule(self, interval: float, min_tombstone_ratio: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for name, coll in list(self.collections.items()):
                if not all(hasattr(s, "store") for s in coll.shards):
                    continue
                states = [s.store.row_states() for s in coll.shards]
                total = sum(sum(x.values()) for x in states) or 1
                ratio = sum(x["dead"] + x["orphan"] for x in states) / total
                if ratio >= min_tombstone_ratio:
                    try:
                        log.info("compacting %s (tombstone ratio %.2f)", name, ratio)
                        await self.compact(name)
                    except SearchError as exc:
                        log.error("scheduled compaction of %s failed: %s", name, exc)
