"""The query pipeline: validate -> [retrieval cache] -> embed -> fan out -> merge -> fuse
(-> dense feedback) -> rerank -> assemble, for a batch of queries at once.

A single Search is a batch of one; SearchBatch runs the same code, so every stage serves all of a
batch's queries together: their embeddings share model batches, each shard receives one message
holding every query for it (and batches them into one faiss call per restriction and depth), and a query
that fails validation fails alone in its slot. A large batch runs as concurrent chunks of
`batch_chunk` queries (one message per shard each): the event loop assembles the answers of the
chunks whose searches are done while the device threads search the rest, instead of every stage
waiting for the whole batch.

Every stage is timed (per request, and in Prometheus), sees the request's remaining deadline, and
raises domain errors (server/errors.py) that the transport maps to gRPC status codes. Tenant and
ACL scopes come from the caller's credentials, never from a request.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from server.config import PipelineConfig
from server.core import limits, metrics
from server.core.assembly import ContextAssembler
from server.core.encoders import Encoders
from server.core.ranking import merge_topk, minmax_fusion, rm3_expansion, rrf
from server.core.registry import CollectionRegistry, LoadedCollection
from server.core.types import (Candidate, FetchRequest, RankedHit, SearchQuery, SearchResult,
                               ShardQuery, ShardResult, TermStats, TraceEntry, small_key)
from server.core.validation import unit_vectors, validate_query
from server.errors import (CorpusVersionMismatch, DeadlineExceeded, FailedPrecondition,
                           Internal, InvalidArgument, SearchError, Unavailable)

log = logging.getLogger(__name__)

SCORE_KINDS = {"ip": "cosine", "l2": "l2"}
FAIL_FAST = (InvalidArgument, FailedPrecondition)  # the request's or the build's fault: not partial


async def gather(coros: Sequence, return_exceptions: bool = False) -> list:
    """asyncio.gather, awaiting a lone coroutine in place: a single Search would otherwise pay a
    task (and a loop turn) at every stage for nothing to run beside."""
    if len(coros) != 1:
        return await asyncio.gather(*coros, return_exceptions=return_exceptions)
    if not return_exceptions:
        return [await coros[0]]
    try:
        return [await coros[0]]
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or getattr(task, "cancelling", lambda: 1)():
            raise  # this task is being cancelled: propagate, as gather's own caller would see
        return [exc]  # the awaited call was cancelled under us (e.g. a closed channel): a result
    except Exception as exc:  # noqa: BLE001 - returned, as gather would
        return [exc]


def _naming_its_shard(shard_no: int, error: SearchError) -> str:
    """A shard's error as the answer reports it: "shard N: ...", once (most messages name their
    shard already; outside QA saw "shard 1: shard 1: deadline passed")."""
    text = str(error)
    named = text.startswith((f"shard {shard_no}:", f"shard {shard_no} "))
    return text if named else f"shard {shard_no}: {text}"


def _same_chunk(ranked: Optional[Candidate], fetched: Candidate) -> bool:
    """A fetched row holds the chunk a retriever ranked: same chunk id, and the same text
    fingerprint where both sides have one."""
    if ranked is None or ranked.chunk_id != fetched.chunk_id:
        return False
    a, b = ranked.record.text_hash, fetched.record.text_hash
    return not (a and b and a != b)


@dataclass
class _Query:
    """One query's state through the pipeline."""

    q: SearchQuery
    error: Optional[SearchError] = None
    coll: Optional[LoadedCollection] = None
    mode: str = ""
    vector: Optional[np.ndarray] = None
    sq: Optional[ShardQuery] = None
    cache_key: Optional[tuple] = None
    result: Optional[SearchResult] = None
    shard_results: list = field(default_factory=list)
    shard_errors: list = field(default_factory=list)
    dense: list = field(default_factory=list)
    lexical: list = field(default_factory=list)
    fused: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    flow: object = None  # the request it came in: the model queues share the device by request

    @property
    def live(self) -> bool:
        return self.error is None and self.result is None


# The statistics round's budget (a shard slower than that is left on its own statistics): 250
# ms for one query, within a tenth of the time left; 50 ms more for each further query of the
# round, within a quarter of the time left and 10 s in all. Where tenants share a shard a
# query's counts walk postings, uncached after a start or a write: ~20 ms for a long Cranfield
# query on a loaded 2-core host. One 250 ms budget for a whole batch left every query of a cold
# batch of 16 on per-shard statistics, ranked unlike the same query sent alone (outside QA);
# the caps bound what a hung shard costs a batch
DEEPER_NOTE = "read deeper"  # how the note of a deeper round starts (one note: the last round's)
STATS_ROUND_MAX_S = 0.25
STATS_ROUND_SHARE = 0.1
STATS_ROUND_PER_QUERY_S = 0.05
STATS_ROUND_BATCH_SHARE = 0.25
STATS_ROUND_CAP_S = 10.0


class QueryPipeline:
    def __init__(self, registry: CollectionRegistry, encoders: Encoders, config: PipelineConfig,
                 rerank_cap: int, cpu: Executor):
        self.registry = registry
        self.encoders = encoders
        self.config = config
        self.rerank_cap = rerank_cap
        self.cpu = cpu
        self._cache: OrderedDict[tuple, SearchResult] = OrderedDict()

    def clear_cache(self) -> None:
        self._cache.clear()

    async def search(self, queries: Sequence[SearchQuery], tenant: str, acl_scopes: tuple,
                     deadline: Optional[float],
                     on_part: Optional[Callable[[int, list], None]] = None) -> list:
        """One answer per query, in order: a SearchResult, or the SearchError of that query.
        `on_part(first, answers)`, called on the loop as each chunk of a batch is answered
        (`first`: the index of its first query), lets the caller encode those answers while the
        later chunks still search, instead of after all of them with a core idle."""
        t_start = time.perf_counter()
        flow = object()  # this request, in the model queues (batcher.py)
        chunk = self.config.batch_chunk
        if chunk <= 0 or len(queries) <= chunk:
            answers = await self._search(self._prepared(queries, tenant, acl_scopes, flow),
                                         tenant, acl_scopes, deadline, t_start)
            if on_part is not None:
                on_part(0, answers)
            return answers
        if any(q.text for q in queries):
            # one statistics round for the whole batch: each chunk's own round would queue
            # behind the other chunks' searches and could run past its budget, leaving that
            # chunk's queries on per-shard statistics (scores unlike Search's). One round, one
            # budget; it runs while the chunks embed, and each chunk takes its statistics after
            states = self._prepared(queries, tenant, acl_scopes, flow)
            stats_round = self._collection_term_stats(states, tenant, acl_scopes, deadline)
            shared = asyncio.ensure_future(stats_round) if stats_round is not None else None
            parts = [self._search(states[i:i + chunk], tenant, acl_scopes, deadline, t_start,
                                  shared if shared is not None else {})
                     for i in range(0, len(states), chunk)]
        else:  # vectors alone: no round; each chunk is prepared while the ones before it search
            parts = [self._prepared_search(queries[i:i + chunk], tenant, acl_scopes, deadline,
                                           t_start, flow) for i in range(0, len(queries), chunk)]
            shared = None
        if on_part is not None:
            parts = [self._then(part, on_part, first)
                     for part, first in zip(parts, range(0, len(queries), chunk))]
        tasks = [asyncio.ensure_future(part) for part in parts]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:  # an error of the whole batch (its deadline), or a chunk or the
            for t in tasks:    # caller cancelled: the other chunks stop too
                t.cancel()
            if shared is not None:
                shared.cancel()
                if shared.done() and not shared.cancelled():
                    shared.exception()  # read: the chunks raised it already
            raise
        return [answer for part in parts for answer in part]

    @staticmethod
    async def _then(part, on_part: Callable[[int, list], None], first: int) -> list:
        answers = await part
        on_part(first, answers)
        return answers

    def _prepared(self, queries: Sequence[SearchQuery], tenant: str,
                  acl_scopes: tuple, flow: object) -> list[_Query]:
        states = [_Query(q, flow=flow) for q in queries]
        for st in states:
            self._prepare(st, tenant, acl_scopes)
        return states

    async def _prepared_search(self, queries: Sequence[SearchQuery], tenant: str,
                               acl_scopes: tuple, deadline: Optional[float],
                               t_start: float, flow: object) -> list:
        return await self._search(self._prepared(queries, tenant, acl_scopes, flow), tenant,
                                  acl_scopes, deadline, t_start)

    async def _search(self, states: list[_Query], tenant: str, acl_scopes: tuple,
                      deadline: Optional[float], t_start: float, stats=None) -> list:
        """The prepared queries' answers. `stats`: the batch's statistics round (a chunked
        batch: its result, or the future of it, which runs while this chunk embeds), else the
        round runs here."""
        t = time.perf_counter()
        # the statistics round needs only the text: it runs while the queries are embedded
        stats_round = (self._collection_term_stats(states, tenant, acl_scopes, deadline)
                       if stats is None else None)
        to_embed = [st for st in states if st.live and st.mode != "lexical" and st.q.vector is None]
        if to_embed:
            if stats_round is not None:
                stats_round = asyncio.ensure_future(stats_round)
            try:
                self._check_deadline(deadline, "embed")
                # the embedding cache is the caller's tenant's and scopes' own (encoders.py)
                await gather([self._embed(st, deadline, (tenant, acl_scopes)) for st in to_embed])
            except BaseException:
                if stats_round is not None:
                    stats_round.cancel()
                    if stats_round.done() and not stats_round.cancelled():
                        stats_round.exception()  # read: it failed first, and nobody else will
                raise
            t = self._lap(states, "embed", t)
        if stats is None:
            stats = {} if stats_round is None else await stats_round
        elif isinstance(stats, asyncio.Future):  # shared with the batch's other chunks: a chunk
            stats = await asyncio.shield(stats)  # cancelled alone leaves it to them
        for st in states:
            if st.live:
                st.sq = self._shard_query(st, tenant, acl_scopes)
                if id(st) in stats:
                    st.sq = replace(st.sq, term_stats=stats[id(st)])
        if stats_round is not None and not to_embed:  # the round ran here
            t = self._lap(states, "term_stats", t)
        await self._retrieve(states, deadline)
        t = self._lap(states, "retrieve", t)
        hybrid = False
        for st in states:
            if st.live:
                self._fuse(st)
                hybrid = hybrid or st.mode == "hybrid"
        if hybrid:  # a single retriever's "fusion" is a truncation: not a stage worth a sample
            t = self._lap(states, "fusion", t)
        for st in states:  # a partial first round: no feedback rounds on top (an improvement, and
            if st.live and st.shard_errors and (  # the failed shards' time is spent): answer now
                    self._wants_dense_feedback(st) or self._wants_expansion(st)):
                st.notes.append("feedback skipped: the first round was partial")
        await self._feedback_rounds(states, tenant, acl_scopes, deadline, t)
        later, in_place_ms = [], None
        for st in states:
            if not st.live:
                continue
            if not self._finish_now(st, tenant, acl_scopes):
                later.append(st)
            elif st.result is not None:
                in_place_ms = (in_place_ms or 0.0) + st.timings["assembly"]
        if in_place_ms is not None:  # the pages assembled in place: one sample for the call
            metrics.RECENT.observe("assembly", in_place_ms / 1e3)
        if later:
            await gather([self._finish(st, tenant, acl_scopes, deadline) for st in later])
        total = (time.perf_counter() - t_start) * 1e3
        out, answered = [], False
        for st in states:
            if st.error is not None:
                out.append(st.error)
                continue
            if st.result is None:
                continue
            st.result.timings.setdefault("total", total)
            out.append(st.result)
            answered = True
        if answered:  # one sample per call (a SearchBatch's chunk): its queries share the total
            metrics.RECENT.observe("total", total / 1e3)
        return out

    async def _feedback_rounds(self, states: list[_Query], tenant: str, acl_scopes: tuple,
                               deadline: Optional[float], t: Optional[float] = None) -> None:
        """The feedback rounds of the queries that want them and whose first round was whole:
        dense feedback, then RM3 expansion; each round timed as a stage when `t` is given."""
        feedback = [st for st in states
                    if st.live and not st.shard_errors and self._wants_dense_feedback(st)]
        if feedback:
            await self._dense_feedback(feedback, tenant, acl_scopes, deadline)
            if t is not None:
                t = self._lap(feedback, "feedback", t)
        expand = [st for st in states
                  if st.live and not st.shard_errors and self._wants_expansion(st)]
        if expand:
            await self._lexical_feedback(expand, tenant, acl_scopes, deadline)
            if t is not None:
                self._lap(expand, "lexical_feedback", t)

    # --- stages ------------------------------------------------------------------------------
    def _prepare(self, st: _Query, tenant: str, acl_scopes: tuple) -> None:
        try:
            st.coll = self.registry.get(st.q.collection)
            st.mode = validate_query(st.q, st.coll.desc, self.rerank_cap)
            if st.q.rerank_depth and not self.encoders.can_rerank():
                raise FailedPrecondition("rerank_depth was given but this server has no "
                                         "cross-encoder (start it with --reranker DIR)")
            if st.q.context_token_budget and self.encoders.embedder is None:
                raise FailedPrecondition("a context token budget needs the server's tokenizer")
            if st.mode != "lexical" and st.q.vector is None:
                self.encoders.check_model(st.coll.desc)
            elif st.q.vector is not None:  # the caller's own: scaled as the index compares them
                st.vector = unit_vectors(st.q.vector, st.coll.desc.metric, "query vector")
        except SearchError as exc:
            st.error = exc
            return
        if not self.config.retrieval_cache_size:
            return  # no key to build (a hash of the vector) for a cache that is off
        st.cache_key = self._cache_key(st, tenant, acl_scopes)
        if st.cache_key is not None:
            cached = self._cache.get(st.cache_key)
            if cached is not None:
                self._cache.move_to_end(st.cache_key)
                metrics.labelled(metrics.RETRIEVAL_CACHE, "hit").inc()
                st.result = SearchResult(cached.hits, cached.build_id, cached.corpus_version,
                                         cached.model_id, {"cache": 0.0}, cached.partial,
                                         cached.shard_errors, None,
                                         cached.notes + ["retrieval cache hit"], cached.context_tokens)
                return
            metrics.labelled(metrics.RETRIEVAL_CACHE, "miss").inc()

    def _cache_key(self, st: _Query, tenant: str, acl_scopes: tuple) -> Optional[tuple]:
        """Everything the answer depends on, including every shard's index version (which moves
        on every write): an entry can never be served after a write that could change it.
        None (no caching) when a shard cannot tell its version (remote shards) or for traces."""
        versions = tuple(s.cache_version for s in st.coll.shards)
        q = st.q
        if None in versions or q.include_trace:
            return None
        vec = (hashlib.sha256(q.vector.tobytes()).hexdigest(), q.vector_model_id) if q.vector is not None else None
        # the text as sent: a normalisation of our own could fold two texts the tokenizer tells
        # apart (str.split() counts U+001F as a space; the tokenizer deletes it)
        # the collection's name too: two collections can hold builds of the same id (a copied
        # directory, `--build-id` given twice), at the same shard versions
        return (st.coll.desc.collection, st.coll.desc.build_id, versions, small_key(q.text), vec,
                st.mode, tenant, acl_scopes, small_key(q.filters), q.top_k, q.dense_depth,
                q.lexical_depth, q.rrf_k, q.rerank_depth, q.context_token_budget, q.allow_partial,
                q.feedback_docs, q.feedback_weight, q.lexical_feedback_terms, q.dense_weight,
                q.fusion)

    async def _embed(self, st: _Query, deadline: Optional[float], partition: tuple) -> None:
        try:
            st.vector = await self.encoders.embed(st.q.text, st.coll.desc, deadline, st.notes,
                                                  flow=st.flow, partition=partition)
        except SearchError as exc:
            st.error = exc
        except Exception as exc:  # this query fails alone; the batch's others answer
            st.error = self._internal(st, "embed", exc)

    def _window(self, q: SearchQuery) -> int:
        """The hits assembly and rerank read: shards ship text for these, the rest as ids."""
        return max(q.top_k + min(q.top_k, 8), q.rerank_depth)

    def _shard_query(self, st: _Query, tenant: str, acl_scopes: tuple) -> ShardQuery:
        q, desc = st.q, st.coll.desc
        vector = st.vector if st.vector is not None else q.vector
        # fusion wants deep candidate lists; a single retriever needs only what assembly reads,
        # with room for duplicates it drops
        single = max(2 * q.top_k, q.rerank_depth) if st.mode != "hybrid" else 0
        if single and st.mode == "lexical" and self._expansion_n(st):
            single = max(single, self._lexical_feedback_k(st))  # lexical feedback reads that deep
        dense_depth = q.dense_depth or max(single or self.config.default_depth, q.top_k)
        lexical_depth = q.lexical_depth or max(single or self.config.default_depth, q.top_k)
        text_top_n = 0 if q.include_trace else (self.config.text_top_n or self._window(q))
        return ShardQuery(desc.build_id, tenant,
                          np.asarray(vector, np.float32) if st.mode != "lexical" else None,
                          desc.model_id, q.text if st.mode != "dense" else "", dense_depth,
                          lexical_depth, q.filters, acl_scopes, text_top_n, q.min_applied_sequence)

    async def _retrieve(self, states: list[_Query], deadline: Optional[float]) -> None:
        """One message per shard holding every live query for its collection."""
        by_coll: dict[str, list[_Query]] = {}
        for st in states:
            if st.live:
                by_coll.setdefault(st.coll.name, []).append(st)
        if not by_coll:
            return
        self._check_deadline(deadline, "retrieval")
        await gather([self._fan_out(group[0].coll, group, deadline) for group in by_coll.values()])
        self._observe_retrievers([st for group in by_coll.values() for st in group])

    @staticmethod
    def _observe_retrievers(sent: list[_Query]) -> None:
        """Each shard's dense and lexical search time in this round, one sample per collection's
        shard (the slowest of the call's batches there): the queries of one call share their
        shard's batched search (observed per query, a SearchBatch of 1,000 put 1,000 copies of ~16
        values into the histogram, at ~2 us each)."""
        dense: dict[tuple[str, int], float] = {}  # by collection and shard: a SearchBatch's
        lexical: dict[tuple[str, int], float] = {}  # queries may name several collections
        for st in sent:
            if st.error is None:  # settled by this round (a failed one keeps older results)
                name = st.coll.name
                for r in st.shard_results:
                    key = (name, r.shard)
                    if r.dense_ms > dense.get(key, 0.0):
                        dense[key] = r.dense_ms
                    if r.lexical_ms > lexical.get(key, 0.0):
                        lexical[key] = r.lexical_ms
        for ms in dense.values():
            metrics.RECENT.observe("dense", ms / 1e3)
        for ms in lexical.values():
            metrics.RECENT.observe("lexical", ms / 1e3)

    def _collection_term_stats(self, states: list[_Query], tenant: str, acl_scopes: tuple,
                               deadline: Optional[float]):
        """BM25 on the collection's statistics, not each shard's: a shard's idf counts its own
        documents only, so a lexical ranking would change with how documents fall into shards
        (with 3 shards, 7 of 225 Cranfield top-10 lists equalled one shard's). A first round
        asks every shard for its statistics of the query's terms (the shape of Elasticsearch's
        dfs_query_then_fetch), and the search scores with their sums. Queries of one-shard
        collections skip it. A shard that fails this round leaves its query on per-shard
        statistics (noted); the search round decides whether that shard's failure fails it.
        Returns None when no query needs a round, else the round (a coroutine) whose result
        maps id(query state) to the collection's TermStats."""
        if not self.config.collection_term_stats:
            return None
        todo = [st for st in states if st.live and st.mode != "dense" and st.q.text
                and len(st.coll.shards) > 1]
        if not todo:
            return None

        async def round_() -> dict[int, TermStats]:
            self._check_deadline(deadline, "term statistics")
            # a round of its own budget: a shard that hangs must leave the search round its
            # time (the search decides what that shard's failure means), not eat it here
            loop = asyncio.get_running_loop()
            n = len(todo)
            budget = min(STATS_ROUND_CAP_S, STATS_ROUND_MAX_S + STATS_ROUND_PER_QUERY_S * (n - 1))
            if deadline is not None:
                share = STATS_ROUND_SHARE if n == 1 else STATS_ROUND_BATCH_SHARE
                budget = min(budget, share * (deadline - loop.time()))
            round_deadline = loop.time() + budget
            out: dict[int, TermStats] = {}

            def settle(st: _Query, ok: list[ShardResult]) -> None:
                stats = [r.term_stats for r in ok]
                if None in stats:  # a shard server that does not know the round searched instead
                    st.notes.append("collection BM25 statistics skipped: a shard answered without "
                                    "them; scored with each shard's own")
                    return
                total = stats[0]
                for more in stats[1:]:
                    total = total + more
                out[id(st)] = total

            # a query whose round a shard failed gets a " skipped" note: an answer not to cache
            await self._second_round(
                todo, [ShardQuery(st.coll.desc.build_id, tenant, None, st.coll.desc.model_id,
                                  st.q.text, 0, 0, st.q.filters, acl_scopes, 0,
                                  st.q.min_applied_sequence, stats_only=True) for st in todo],
                round_deadline, "collection BM25 statistics", settle, "statistics round")
            return out

        return round_()

    async def _fan_out(self, coll: LoadedCollection, group: list[_Query], deadline: Optional[float],
                       feedback: Optional[list[ShardQuery]] = None) -> list[list]:
        """Ask every shard for every query of `group`; returns [query][shard] answers (a result
        or an error) and, unless `feedback` (another round's own shard queries: a feedback or a
        statistics round) is given, settles each query's shard results and errors."""
        loop = asyncio.get_running_loop()
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        if timeout is not None and any(st.q.allow_partial for st in group):
            # a shard that hangs must fail before the request does, or there is no time left to
            # answer with the other shards' results (fetching texts, assembling): keep a fifth of
            # what is left, up to 200 ms
            timeout -= min(0.2 * timeout, 0.2)
        elif timeout is not None:
            # no partial answer, but the caller hears which shard was late: the server answers
            # DEADLINE_EXCEEDED naming it a twentieth of the time (up to 50 ms) before the
            # deadline, instead of the caller's transport ending the call with a bare "Deadline
            # Exceeded" (outside QA)
            timeout -= min(0.05 * timeout, 0.05)
        sqs = [st.sq for st in group] if feedback is None else feedback
        per_shard = {s.shard_no: sqs for s in coll.shards}
        if feedback is not None:  # a follow-up round: ask each shard's replica of the first round
            for shard_no, replica in self._first_round_replicas(group).items():
                per_shard[shard_no] = [replace(q, replica=replica) for q in sqs]
        calls = await gather([s.search(per_shard[s.shard_no], timeout) for s in coll.shards],
                             return_exceptions=True)
        per_query: list[list] = [[] for _ in group]
        for shard, answer in zip(coll.shards, calls):
            if isinstance(answer, BaseException):
                err = self._shard_error(shard.shard_no, answer)
                for lst in per_query:
                    lst.append(err)
            else:
                for lst, a in zip(per_query, answer):
                    lst.append(a)
        if feedback is None:
            for st, answers in zip(group, per_query):
                self._settle(st, answers)
        return per_query

    @staticmethod
    def _same_data(st: _Query, second: list[ShardResult]) -> bool:
        """Whether a follow-up round saw the data the first round saw, shard by shard: the same
        replica at the same index version, or another replica at the same write-log position;
        else mixing the rounds could mix two versions of a document in one answer."""
        first = {r.shard: r for r in st.shard_results}
        for r in second:
            f = first.get(r.shard)
            if f is None:
                continue
            if (r.index_version != f.index_version if r.replica == f.replica
                    else r.applied_seq != f.applied_seq):
                return False
        return True

    @staticmethod
    def _first_round_replicas(group: list[_Query]) -> dict[int, str]:
        """Per shard, the replica that answered every query of `group` in the first round (one
        message per shard per group, so normally one): a feedback round pinned to it never mixes
        a lagging replica's version of a document with another's."""
        seen: dict[int, set] = {}
        for st in group:
            for r in st.shard_results:
                seen.setdefault(r.shard, set()).add(r.replica)
        return {shard: names.pop() for shard, names in seen.items() if len(names) == 1 and "" not in names}

    @staticmethod
    def _shard_error(shard_no: int, exc: BaseException) -> SearchError:
        if isinstance(exc, asyncio.TimeoutError):
            return DeadlineExceeded(f"shard {shard_no} did not answer within the deadline")
        if isinstance(exc, SearchError):
            return exc
        log.error("shard %d failed", shard_no, exc_info=exc)
        return Unavailable(f"shard {shard_no} failed: {type(exc).__name__}: {exc}")

    def _settle(self, st: _Query, answers: list) -> None:
        ok, errors = [], []
        for shard, a in zip(st.coll.shards, answers):
            if isinstance(a, SearchError):
                if isinstance(a, FAIL_FAST):
                    st.error = a
                    return
                errors.append((shard.shard_no, a))
            else:
                ok.append(a)
        if errors and (not st.q.allow_partial or not ok):  # partial: some shards, not none
            first = errors[0][1]
            detail = "; ".join(_naming_its_shard(n, e) for n, e in errors)
            what = "did not answer in time" if isinstance(first, DeadlineExceeded) else "failed"
            st.error = type(first)(f"{len(errors)} of {len(st.coll.shards)} shards {what}: {detail}")
            return
        st.shard_results = ok
        st.shard_errors = [_naming_its_shard(n, e) for n, e in errors]
        versions = {r.corpus_version for r in ok}
        desc = st.coll.desc
        if len(versions) > 1 or (versions and versions != {desc.corpus_version}):
            st.error = CorpusVersionMismatch(f"shards answered from corpus versions {sorted(versions)}; "
                                             f"build {desc.build_id} is {desc.corpus_version}")
            return
        if st.mode != "lexical":  # the retrievers the query used (a lexical query's "dense 0.0
            st.timings["dense"] = max((r.dense_ms for r in ok), default=0.0)  # ms" said nothing)
        if st.mode != "dense":
            st.timings["lexical"] = max((r.lexical_ms for r in ok), default=0.0)

    def _fuse(self, st: _Query) -> None:
        sq, results = st.sq, st.shard_results
        st.dense = merge_topk((r.dense for r in results), sq.dense_depth) if sq.vector is not None else []
        st.lexical = merge_topk((r.lexical for r in results), sq.lexical_depth) if sq.text else []
        if st.mode == "hybrid":
            st.fused = self._fused_ranking(st)

    def _fused_ranking(self, st: _Query) -> list[tuple[int, float]]:
        """The current lists fused: RRF, weighted when the request names a dense_weight (0.5 =
        plain RRF), or with fusion=minmax a weighted sum of min-max normalised scores."""
        w = st.q.dense_weight
        if st.q.fusion == "minmax":
            share = 0.5 if w is None else w
            # every retriever's scores arrive higher-is-better (an l2 shard negates its
            # distances), so neither list is flipped
            return minmax_fusion({"dense": [(c.chunk_id, c.score) for c in st.dense],
                                  "lexical": [(c.chunk_id, c.score) for c in st.lexical]},
                                 {"dense": share, "lexical": 1.0 - share})
        weights = None if w is None else {"dense": 2.0 * w, "lexical": 2.0 * (1.0 - w)}
        return rrf({"dense": [c.chunk_id for c in st.dense],
                    "lexical": [c.chunk_id for c in st.lexical]}, self._rrf_k(st), weights)

    def _rrf_k(self, st: _Query) -> int:
        return st.q.rrf_k or self.config.default_rrf_k

    def _wants_dense_feedback(self, st: _Query) -> bool:
        return st.mode == "hybrid" and bool(self._feedback_k(st))

    def _wants_expansion(self, st: _Query) -> bool:
        return st.mode in ("hybrid", "lexical") and bool(self._expansion_n(st))

    def _feedback_k(self, st: _Query) -> int:
        k = st.q.feedback_docs
        return self.config.dense_feedback_docs if k is None else k

    async def _dense_feedback(self, states: list[_Query], tenant: str, acl_scopes: tuple,
                              deadline: Optional[float]) -> None:
        """Hybrid pseudo-relevance feedback on the dense side: the query vector moves toward the
        stored vectors of the first fused hits (q' = a q + b mean, scaled to unit length in a
        cosine (`ip`) collection; under `l2` lengths are part of the distance and stay), the
        dense list is searched again with q', and fused again with the unchanged lexical list.
        Measured on both development collections (docs/BENCHMARKS.md); on by default for hybrid
        queries."""
        async def vectors_of(st: _Query) -> Optional[np.ndarray]:
            ids = {c.chunk_id: c for c in st.dense + st.lexical}
            got = await self._fetch_rows(st, [ids[cid] for cid, _ in st.fused[:self._feedback_k(st)]],
                                         tenant, acl_scopes, deadline, with_vectors=True, tolerant=True)
            vecs = [c.vector for c in got.values() if c.vector is not None]
            return np.mean(vecs, axis=0) if vecs else None

        means = await gather([vectors_of(st) for st in states])
        todo, sqs = [], []
        for st, mean in zip(states, means):
            if mean is None:
                continue
            b = st.q.feedback_weight if st.q.feedback_weight is not None else self.config.dense_feedback_weight
            v = (1.0 - b) * st.sq.vector + b * mean.astype(np.float32)
            if st.coll.desc.metric == "ip":  # under l2 a unit length would move q off the data
                v /= max(float(np.linalg.norm(v)), 1e-12)
            todo.append(st)
            sqs.append(replace(st.sq, vector=v.astype(np.float32), text="", lexical_depth=0))

        def settle(st: _Query, ok: list[ShardResult]) -> None:
            st.dense = merge_topk((r.dense for r in ok), st.sq.dense_depth)
            st.fused = self._fused_ranking(st)
            st.notes.append(f"dense feedback from the first {self._feedback_k(st)} fused hits")

        await self._second_round(todo, sqs, deadline, "dense feedback", settle)

    async def _second_round(self, todo: list[_Query], sqs: list[ShardQuery],
                            deadline: Optional[float], what: str, settle,
                            round_name: str = "second search") -> None:
        """A round besides the search (feedback, statistics): ask the shards `sqs` (one per query
        of `todo`, grouped by collection); `settle(query, results)` takes a query's answers when
        every shard gave one, else the query gets a note that `what` was skipped."""
        by_coll: dict[str, list[int]] = {}
        for i, st in enumerate(todo):
            by_coll.setdefault(st.coll.name, []).append(i)
        for idx in by_coll.values():
            group = [todo[i] for i in idx]
            answers = await self._fan_out(group[0].coll, group, deadline, [sqs[i] for i in idx])
            for st, ans in zip(group, answers):
                ok = [a for a in ans if isinstance(a, ShardResult)]
                if len(ok) < len(ans):
                    st.notes.append(f"{what} skipped: a shard failed its {round_name}")
                    continue
                if not self._same_data(st, ok):
                    st.notes.append(f"{what} skipped: a shard answered the second search from "
                                    "other data than the first (a write, or a replica at another "
                                    "log position)")
                    continue
                settle(st, ok)

    def _expansion_n(self, st: _Query) -> int:
        n = st.q.lexical_feedback_terms
        n = self.config.lexical_feedback_terms if n is None else n
        return max(0, min(n, limits.MAX_EXPANSION_TERMS))  # a server default beyond the shards' cap

    def _lexical_feedback_k(self, st: _Query) -> int:
        """Hits fed back to the lexical side: the request's feedback_docs, else the server's
        dense_feedback_docs, else 5 (feedback_docs 0 turns off only the dense side's feedback)."""
        return st.q.feedback_docs or self.config.dense_feedback_docs or 5

    async def _lexical_feedback(self, states: list[_Query], tenant: str, acl_scopes: tuple,
                                deadline: Optional[float]) -> None:
        """Pseudo-relevance feedback on the lexical side (RM3): terms weighted by their share of
        the first feedback hits' text (each hit weighted by its fused, or BM25, score) are added
        to the BM25 query with boosts up to `lexical_feedback_weight` (a query term weighs 1);
        the lexical list is searched again and fused again with the dense one. The hits' text
        is read for those the shards did not ship it for, so a traced request (all text shipped)
        and an untraced one expand alike. Off by default: measured on both development
        collections in docs/BENCHMARKS.md."""
        loop = asyncio.get_running_loop()
        picks = []
        for st in states:
            ranked = st.fused if st.mode == "hybrid" else [(c.chunk_id, c.score) for c in st.lexical]
            by_id: dict[int, Candidate] = {}
            for c in st.dense + st.lexical:  # prefer the copy that came with its text
                if c.chunk_id not in by_id or by_id[c.chunk_id].record.text is None:
                    by_id[c.chunk_id] = c
            picks.append([(by_id[cid], score) for cid, score in ranked[:self._lexical_feedback_k(st)]
                          if cid in by_id])
        texts = await gather([self._feedback_texts(st, p, tenant, acl_scopes, deadline)
                              for st, p in zip(states, picks)])
        top_weight = min(max(self.config.lexical_feedback_weight, 1e-3), limits.MAX_TERM_WEIGHT)

        async def expand(st: _Query, docs: list[tuple[str, float]]):
            if not docs:
                return ()
            try:
                return await loop.run_in_executor(
                    self.cpu, rm3_expansion, st.q.text, [t for t, _ in docs], [s for _, s in docs],
                    self._expansion_n(st), top_weight,
                    st.coll.desc.lexical_analyzer)  # as the index analyses
            except Exception as exc:  # feedback is an improvement, never a reason to fail
                log.exception("lexical feedback failed")
                st.notes.append(f"lexical feedback skipped: {type(exc).__name__}")
                return ()

        expansions = await gather([expand(st, d) for st, d in zip(states, texts)])
        todo, sqs, notes = [], [], {}
        for st, docs, expansion in zip(states, texts, expansions):
            if not expansion:
                continue
            todo.append(st)
            notes[id(st)] = (len(docs), expansion)
            sqs.append(replace(st.sq, vector=None, dense_depth=0, expansion=expansion))

        def settle(st: _Query, ok: list[ShardResult]) -> None:
            st.lexical = merge_topk((r.lexical for r in ok), st.sq.lexical_depth)
            if st.mode == "hybrid":
                st.fused = self._fused_ranking(st)
            n, expansion = notes[id(st)]
            st.notes.append(f"lexical feedback from the first {n} hits: "
                            + ", ".join(f"{t} {w:.2f}" for t, w in expansion))

        await self._second_round(todo, sqs, deadline, "lexical feedback", settle)

    async def _feedback_texts(self, st: _Query, picks: list[tuple[Candidate, float]], tenant: str,
                              acl_scopes: tuple, deadline: Optional[float]) -> list[tuple[str, float]]:
        """(title + text, score) of the feedback hits; records the shards did not ship are read
        by row (a row replaced since is dead and drops out; a shard that fails drops its hits)."""
        found = await self._fetch_rows(st, [c for c, _ in picks if c.record.text is None], tenant,
                                       acl_scopes, deadline, tolerant=True)
        out = []
        for c, score in picks:
            if c.record.text is None:
                c = found.get((c.shard, c.record.row))
            rec = None if c is None else c.record
            if rec is not None and rec.text is not None:
                out.append((f"{rec.title or ''} {rec.text}", score))
        return out

    async def _finish(self, st: _Query, tenant: str, acl_scopes: tuple,
                      deadline: Optional[float]) -> None:
        try:
            st.result = await self._finish_one(st, tenant, acl_scopes, deadline)
        except SearchError as exc:
            st.error = exc
        except Exception as exc:  # this query fails alone; the batch's others answer
            st.error = self._internal(st, "finish", exc)

    def _finish_now(self, st: _Query, tenant: str, acl_scopes: tuple) -> bool:
        """Finish the common query in place, awaiting nothing: no rerank, token budget or trace,
        every hit its page reads already carrying its text (shards ship texts for the window), and
        nothing deeper to read. The page is the one `_finish_one` assembles for it, without a
        task and four coroutines per query (for a SearchBatch of 1,000, 1,000 tasks on the event
        loop). False when the query needs the full path, which starts over: nothing of
        this attempt is kept."""
        q = st.q
        if q.rerank_depth or q.context_token_budget or q.include_trace:
            return False
        try:
            t = time.perf_counter()
            a = ContextAssembler(q.top_k, tenant, 0, self.config.dedupe, acl_scopes)
            offer = a.offer
            for h in self._ranked(st):
                if a.full:
                    break
                if h.candidate.record.text is None:
                    return False  # its text is read by row: the full path fetches it
                offer(h)
            if self._can_deepen(st, a):
                return False
            # observed once for the call's pages assembled in place (`_search`)
            st.timings["assembly"] = (time.perf_counter() - t) * 1e3
            st.result = self._result(st, a)
        except SearchError as exc:
            st.error = exc
        except Exception as exc:  # this query fails alone; the batch's others answer
            st.error = self._internal(st, "finish", exc)
        return True

    @staticmethod
    def _internal(st: _Query, stage: str, exc: Exception) -> Internal:
        log.error("query on %s failed in %s", st.q.collection, stage, exc_info=exc)
        # the type only, as the transport boundary answers: the message may hold internals
        return Internal(f"internal error in {stage} ({type(exc).__name__}); the server log has it")

    async def _finish_one(self, st: _Query, tenant: str, acl_scopes: tuple,
                          deadline: Optional[float]) -> SearchResult:
        q = st.q
        t = time.perf_counter()
        ranked = self._ranking(st)
        pre_rerank = ranked
        if q.rerank_depth and ranked:
            self._check_deadline(deadline, "rerank")
            head = await self._with_text(st, ranked[:q.rerank_depth], tenant, acl_scopes, deadline)
            t = time.perf_counter()
            scores = await self.encoders.rerank(q.text, [h.candidate.record.text for h in head],
                                                deadline, st.flow)
            order = sorted(range(len(head)), key=lambda i: (-scores[i], head[i].candidate.chunk_id))
            reranked = []
            for rank, i in enumerate(order, start=1):
                h = head[i]
                h.rerank = (rank, scores[i])
                h.score, h.score_kind = scores[i], "cross_encoder"
                reranked.append(h)
            ranked = reranked + ranked[q.rerank_depth:]
            t = self._stamp(st, "rerank", t)
        a = await self._assemble(st, ranked, tenant, acl_scopes, deadline)
        # deeper until the page fills, a list comes back short (nothing more to find) or the
        # depth cap, 4x a round: 20 -> 80 -> 320 -> 1,280 -> 2,000 for top_k 10 (five rounds from
        # top_k 1's depth of 2), each on half the time left. Two rounds left a page of 1 hit
        # where 31 distinct passages sat behind 700 copies of one boilerplate text (outside QA)
        while self._can_deepen(st, a):
            if not await self._retrieve_deeper(st, tenant, acl_scopes, deadline):
                break
            ranked = pre_rerank = self._ranking(st)
            a = await self._assemble(st, ranked, tenant, acl_scopes, deadline)
        self._stamp(st, "assembly", t)
        return self._result(st, a, pre_rerank, ranked)

    def _result(self, st: _Query, a: ContextAssembler, pre_rerank=(), ranked=()) -> SearchResult:
        """The answer of an assembled page, kept in the retrieval cache unless degraded."""
        q, desc = st.q, st.coll.desc
        if q.context_token_budget and not a.selected and a.dropped:  # (outside QA: an empty
            read = len(a.selected) + len(a.dropped)                   # page, and no word why)
            st.notes.append(f"the token budget of {q.context_token_budget} fit none of the "
                            f"{read} passages read")
        trace = self._trace(st, pre_rerank, ranked, a) if q.include_trace else None
        result = SearchResult(a.selected, desc.build_id, desc.corpus_version, desc.model_id,
                              st.timings, bool(st.shard_errors), st.shard_errors, trace, st.notes,
                              a.used)
        # an answer degraded by a failed feedback round is served, never cached
        degraded = st.shard_errors or any(" skipped" in n for n in st.notes)
        if st.cache_key is not None and not degraded:  # a key only while the cache is on
            self._cache[st.cache_key] = result
            while len(self._cache) > self.config.retrieval_cache_size:
                self._cache.popitem(last=False)
        return result

    @classmethod
    def _ranking(cls, st: _Query) -> list[RankedHit]:
        """The query's ranking: the fused list of a hybrid query (each hit with its ranks in
        both retrievers' lists), else the single retriever's list, its rank the position."""
        return list(cls._ranked(st))

    @staticmethod
    def _ranked(st: _Query) -> Iterator[RankedHit]:
        """`_ranking`, one hit at a time: a page that fills early makes no more of them."""
        if st.mode == "hybrid":
            dense_pos = {c.chunk_id: (i + 1, c.score) for i, c in enumerate(st.dense)}
            lex_pos = {c.chunk_id: (i + 1, c.score) for i, c in enumerate(st.lexical)}
            # a chunk both lists hold: the dense copy, unless only the lexical one carries its
            # text (each list ships texts for its own first hits; both copies were read under
            # one lock, so they are the same row), which saves a fetch
            by_id = {c.chunk_id: c for c in st.lexical}
            for c in st.dense:
                kept = by_id.get(c.chunk_id)
                if kept is None or c.record.text is not None or kept.record.text is None:
                    by_id[c.chunk_id] = c
            kind = "minmax" if st.q.fusion == "minmax" else "rrf"
            for i, (cid, s) in enumerate(st.fused, 1):
                yield RankedHit(by_id[cid], s, kind, dense_pos.get(cid), lex_pos.get(cid), (i, s),
                                fused_kind=kind)
        elif st.mode == "dense":
            dense_kind = SCORE_KINDS.get(st.coll.desc.metric, "inner_product")
            for i, c in enumerate(st.dense, 1):
                yield RankedHit(c, c.score, dense_kind, (i, c.score))
        else:
            for i, c in enumerate(st.lexical, 1):
                yield RankedHit(c, c.score, "bm25", None, (i, c.score))

    def _can_deepen(self, st: _Query, a: ContextAssembler) -> bool:
        """Whether a short page may fill from deeper in the same retrievers: passages were
        dropped as repeats (or as another tenant's or scope's, defence in depth) and the budget
        (if any) did not end the page, or the budget took none at all - a budget that holds
        fewer than top_k passages is how budgets work, not a short page (and for a hybrid
        query, repeats only: its lists are deep already); retrievers whose
        depths the request did not pin, a list of which came back full (more may exist), not
        reranked (the rerank window is the request's)."""
        q = st.q
        if a.full or q.rerank_depth or st.shard_errors:
            return False
        over_budget = any(reason.startswith("over_token_budget") for _, reason in a.dropped)
        if over_budget and a.selected and (a.smallest_cost is None
                                           or q.context_token_budget - a.used < a.smallest_cost):
            # the budget ends this page: what it has left is less than any passage read took.
            # With room for the smallest (a long passage skipped, repeats dropped), deeper hits
            # may still fill it, as the API promises (outside QA: 1 passage of 20 tokens, 130
            # left, where the same query pinned deeper filled 5)
            return False
        repeats = any(not reason.startswith("over_token_budget") for _, reason in a.dropped)
        # a budget that took none of a hybrid query's ~200 candidates is not helped by 800 or
        # 3,200 more (each fetched and tokenized, with feedback rounds): repeats only, there
        budget_took_none = bool(q.context_token_budget) and not a.selected and st.mode != "hybrid"
        if not repeats and not budget_took_none:
            return False
        lists = []  # (depth asked, got, pinned by the request) of each retriever the query uses
        if st.mode in ("dense", "hybrid"):
            lists.append((st.sq.dense_depth, len(st.dense), q.dense_depth))
        if st.mode in ("lexical", "hybrid"):
            lists.append((st.sq.lexical_depth, len(st.lexical), q.lexical_depth))
        return (not any(pinned for _, _, pinned in lists)
                and any(got >= depth and depth < limits.MAX_DEPTH for depth, got, _ in lists))

    async def _retrieve_deeper(self, st: _Query, tenant: str, acl_scopes: tuple,
                               deadline: Optional[float]) -> bool:
        """The query's retrievers again, 4x deeper, on half the time left (the rest stays for
        reading and assembling the deeper page), fused again, its feedback rounds (dense, RM3)
        included, so the deeper ranking is the query's own at a larger depth. Best effort: a
        round that fails, or finds no time, leaves the query as it was (with a note when it
        failed) and returns False."""
        loop = asyncio.get_running_loop()
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return False
        kept = (st.sq, st.shard_results, st.shard_errors, st.dense, st.lexical, st.fused,
                dict(st.timings))
        d, lx = st.sq.dense_depth, st.sq.lexical_depth
        st.sq = replace(st.sq, dense_depth=min(limits.MAX_DEPTH, 4 * d) if d else 0,
                        lexical_depth=min(limits.MAX_DEPTH, 4 * lx) if lx else 0)
        await self._retrieve([st], None if left is None else loop.time() + left / 2)
        if st.error is not None or st.shard_errors:
            why = st.error or st.shard_errors[0]
            st.error = None
            st.sq, st.shard_results, st.shard_errors, st.dense, st.lexical, st.fused, st.timings = kept
            st.notes.append(f"deeper retrieval skipped ({why}): the page may be short")
            return False
        self._fuse(st)
        # the same first hits: the same feedback, searched deeper
        await self._feedback_rounds([st], tenant, acl_scopes, deadline)
        # the feedback rounds' notes once, not per round; one note of the deepest round, saying
        # what the lists held (outside QA: a note per round, the last naming a depth of 384
        # where the lists held 131)
        st.notes[:] = [n for n in dict.fromkeys(st.notes) if not n.startswith(DEEPER_NOTE)]
        held = max(len(st.dense), len(st.lexical))
        asked = max(st.sq.dense_depth, st.sq.lexical_depth)
        st.notes.append(f"{DEEPER_NOTE}, {asked} per list ({held} found): duplicates or the "
                        f"token budget left the page short")
        return True

    async def _assemble(self, st: _Query, ranked: list[RankedHit], tenant: str,
                        acl_scopes: tuple, deadline: Optional[float]) -> ContextAssembler:
        """Offer the ranked hits best first, reading texts a window at a time, until top_k."""
        q = st.q
        a = ContextAssembler(q.top_k, tenant, q.context_token_budget, self.config.dedupe, acl_scopes)
        pos = 0
        loop = asyncio.get_running_loop()
        while not a.full and pos < len(ranked):
            need = q.top_k - len(a.selected)
            window = ranked[pos:pos + need + min(need, 8)]
            pos += len(window)
            readable = await self._with_text(st, window, tenant, acl_scopes, deadline)
            costs = [0] * len(readable)
            if q.context_token_budget and readable:  # tokenizing is CPU work: off the loop
                costs = await loop.run_in_executor(self.cpu, self.encoders.count_tokens,
                                                   [h.candidate.record.text for h in readable])
            for h, cost in zip(readable, costs):
                if a.full:
                    break
                a.offer(h, cost)
            if q.context_token_budget and a.used >= q.context_token_budget:
                break  # nothing more can fit: reading on would only tokenize
        return a

    async def _with_text(self, st: _Query, hits: list[RankedHit], tenant: str, acl_scopes: tuple,
                         deadline: Optional[float]) -> list[RankedHit]:
        """The hits with their records read: shards ship records for their first hits only; the
        others are fetched by row now. A row replaced or deleted meanwhile is dead and drops out,
        so one ranking never mixes document versions."""
        missing = [h.candidate for h in hits if h.candidate.record.text is None]
        if not missing:
            return hits
        t0 = time.perf_counter()
        found = await self._fetch_rows(st, missing, tenant, acl_scopes, deadline)
        self._stamp(st, "fetch", t0)
        out = []
        for h in hits:
            if h.candidate.record.text is None:
                c = found.get((h.candidate.shard, h.candidate.record.row))
                if c is None:
                    continue
                h.candidate.record = c.record
            out.append(h)
        return out

    async def _fetch_rows(self, st: _Query, cands: Sequence[Candidate], tenant: str, acl_scopes: tuple,
                          deadline: Optional[float], with_vectors: bool = False,
                          tolerant: bool = False) -> dict[tuple[int, int], Candidate]:
        """The records of these candidates' rows that are still live and visible to the caller
        (with their stored vectors if asked), one FetchChunks per shard, keyed by (shard, row).
        A shard that fails raises, or with `tolerant` (feedback rounds: an improvement, never a
        reason to fail) leaves its rows out. A row that holds another chunk than the one ranked
        (a replica whose rows disagree with the one that searched) is left out too: a hit is
        dropped, never swapped for another document."""
        per_shard: dict[int, list[int]] = {}
        ranked: dict[tuple[int, int], Candidate] = {}
        for c in cands:
            per_shard.setdefault(c.shard, []).append(c.record.row)
            ranked[(c.shard, c.record.row)] = c
        if not per_shard:
            return {}
        loop = asyncio.get_running_loop()
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        shards = {s.shard_no: s for s in st.coll.shards}
        answered = {r.shard: r.replica for r in st.shard_results}
        got = await gather([
            shards[n].fetch(FetchRequest(st.sq.build_id, tenant, acl_scopes, tuple(rows), with_vectors,
                                         answered.get(n, "")),
                            timeout) for n, rows in per_shard.items()], return_exceptions=tolerant)
        out = {}
        for n, batch in zip(per_shard, got):
            if isinstance(batch, BaseException):
                continue
            for c in batch:
                key = (n, c.record.row)
                if _same_chunk(ranked.get(key), c):
                    out[key] = c
                else:
                    metrics.FETCH_MISMATCHES.labels(st.coll.desc.collection, str(n)).inc()
                    log.error("shard %d: row %d holds chunk %d, not the ranked chunk %s: left "
                              "out (replicas whose rows disagree)", n, c.record.row, c.chunk_id,
                              getattr(ranked.get(key), "chunk_id", None))
        return out

    def _trace(self, st: _Query, pre_rerank, ranked, a: ContextAssembler) -> dict:
        def entries(cands: Sequence[Candidate]):
            return [TraceEntry(c.chunk_id, c.record.doc_id, c.score, i + 1) for i, c in enumerate(cands)]

        def ranked_entries(hits: Sequence[RankedHit]):
            return [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id, h.score, i + 1)
                    for i, h in enumerate(hits)]

        trace = {"dense": entries(st.dense), "lexical": entries(st.lexical)}
        if st.mode == "hybrid":
            trace["fused"] = [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id,
                                         h.fused[1], h.fused[0]) for h in pre_rerank]
        if st.q.rerank_depth:
            trace["reranked"] = ranked_entries(ranked[:st.q.rerank_depth])
        trace["context"] = ranked_entries(a.selected)
        trace["dropped"] = [TraceEntry(h.candidate.chunk_id, h.candidate.record.doc_id, h.score, 0,
                                       reason) for h, reason in a.dropped]
        return trace

    # --- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _check_deadline(deadline: Optional[float], stage: str) -> None:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise DeadlineExceeded(f"deadline passed before {stage}")

    @staticmethod
    def _lap(states: list[_Query], stage: str, t0: float) -> float:
        """A stage the request's queries ran together: one sample per call (a SearchBatch's
        embedding is one stage of one call), none when no query of it is still live."""
        now = time.perf_counter()
        ms = (now - t0) * 1e3
        live = False
        for st in states:
            if st.live:
                st.timings[stage] = ms
                live = True
        if live:
            metrics.RECENT.observe(stage, ms / 1e3)
        return now

    @staticmethod
    def _stamp(st: _Query, stage: str, t0: float) -> float:
        now = time.perf_counter()
        st.timings[stage] = st.timings.get(stage, 0.0) + (now - t0) * 1e3
        metrics.RECENT.observe(stage, now - t0)
        return now
