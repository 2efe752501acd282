"""Thin servicers: read credentials and deadline, convert messages, delegate to the core."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from server.core.search import SearchCore
from server.core.types import Filter, SearchQuery, SearchResult, WriteRequest
from server.errors import InvalidArgument
from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc
from server.transport.auth import Authenticator, Principal
from server.transport.errors import Lifecycle, boundary

MODE_NAMES = {pb.SEARCH_MODE_UNSPECIFIED: "", pb.DENSE: "dense", pb.LEXICAL: "lexical",
              pb.HYBRID: "hybrid"}
SCORE_KIND = {"cosine": pb.COSINE_SIMILARITY, "inner_product": pb.INNER_PRODUCT,
              "l2": pb.L2_DISTANCE, "bm25": pb.BM25, "rrf": pb.RRF, "cross_encoder": pb.CROSS_ENCODER}


def deadline_of(context) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


def query_from_pb(req: pb.SearchRequest) -> SearchQuery:
    mode = MODE_NAMES.get(req.mode)
    if mode is None:
        raise InvalidArgument(f"unknown search mode value {req.mode}")
    vector = None
    model_id = ""
    if req.HasField("vector"):
        vector = np.frombuffer(np.asarray(req.vector.values, dtype=np.float32).tobytes(), np.float32)
        model_id = req.vector.model_id
    return SearchQuery(
        collection=req.collection, text=req.text, vector=vector, vector_model_id=model_id,
        top_k=req.top_k, mode=mode,
        filters=tuple(Filter(f.key, tuple(f.any_of), f.gte or None, f.lte or None)
                      for f in req.filters),
        include_trace=req.include_trace, dense_depth=req.dense_depth,
        lexical_depth=req.lexical_depth, rrf_k=req.rrf_k, rerank_depth=req.rerank_depth,
        context_token_budget=req.context_token_budget, allow_partial=req.allow_partial)


def _retriever(pair, kind) -> pb.RetrieverScore | None:
    if pair is None:
        return None
    return pb.RetrieverScore(rank=pair[0], score=pair[1], kind=kind)


def result_to_pb(res: SearchResult, dense_kind: int) -> pb.SearchResponse:
    out = pb.SearchResponse(build_id=res.build_id, corpus_version=res.corpus_version,
                            model_id=res.model_id, partial=res.partial,
                            shard_errors=res.shard_errors, context_tokens=res.context_tokens)
    for h in res.hits:
        rec = h.candidate.record
        kind = SCORE_KIND[h.score_kind]
        out.hits.append(pb.SearchHit(
            chunk_id=rec.chunk_id, doc_id=rec.doc_id, score=h.score, score_kind=kind,
            higher_is_better=h.score_kind != "l2", text=rec.text, title=rec.title,
            chunk_index=rec.chunk_index, start_offset=rec.start_offset, end_offset=rec.end_offset,
            metadata={str(k): str(v) for k, v in rec.metadata.items()},
            dense=_retriever(h.dense, dense_kind), lexical=_retriever(h.lexical, pb.BM25),
            fused=_retriever(h.fused, pb.RRF), rerank=_retriever(h.rerank, pb.CROSS_ENCODER),
            shard=h.candidate.shard))
    for stage, ms in res.timings.items():
        out.timings.append(pb.StageTiming(stage=stage, ms=ms))
    if res.trace is not None:
        for name, entries in res.trace.items():
            out.trace.lists.append(pb.TraceList(name=name, items=[
                pb.TraceItem(chunk_id=e.chunk_id, doc_id=e.doc_id, score=e.score, rank=e.rank,
                             reason=e.reason) for e in entries]))
        out.trace.notes.extend(res.notes)
    return out


class SearchServicer(pb_grpc.SearchServiceServicer):
    def __init__(self, core: SearchCore, auth: Authenticator, lifecycle: Lifecycle):
        self.core = core
        self.auth = auth
        self.lifecycle = lifecycle

    @boundary("Search")
    async def Search(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata())
        query = query_from_pb(request)
        result = await self.core.search(query, principal.tenant, deadline_of(context),
                                        principal.acl_scopes)
        metric = self.core.collection(request.collection).desc.metric
        return result_to_pb(result, pb.L2_DISTANCE if metric == "l2" else pb.COSINE_SIMILARITY)

    @boundary("UpsertDocument")
    async def UpsertDocument(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("write")
        w = WriteRequest("upsert", request.collection, request.doc_id, request.version, request.text,
                         request.title, dict(request.metadata), tuple(request.acl),
                         request.source_modified_at)
        return write_response(*(await self.core.write(w, principal.tenant)))

    @boundary("DeleteDocument")
    async def DeleteDocument(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("write")
        w = WriteRequest("delete", request.collection, request.doc_id, request.version)
        return write_response(*(await self.core.write(w, principal.tenant)))


def write_response(outcome: str, stored: int, index_version: int) -> pb.WriteResponse:
    return pb.WriteResponse(
        outcome=pb.WriteResponse.APPLIED if outcome == "applied" else pb.WriteResponse.NOOP_STALE_VERSION,
        stored_version=stored, index_version=str(index_version))


def describe_pb(core: SearchCore, name: str, principal: Principal) -> pb.CollectionDescription:
    """Operators see the whole descriptor; a tenant's admin sees its own tenant's view of it."""
    d = core.collection(name).desc
    if not principal.is_operator:
        counts = core.stats(name, principal.tenant)
        d = dataclasses.replace(d.for_tenant(principal.tenant), documents=counts["documents"],
                                chunks=counts["chunks"])
    return pb.CollectionDescription(
        name=d.collection, build_id=d.build_id, model_id=d.model_id, dim=d.dim, metric=d.metric,
        factory=d.factory, shards=d.shards, corpus_version=d.corpus_version, chunker=d.chunker,
        documents=d.documents, chunks=d.chunks, descriptor_json=d.to_json())


class AdminServicer(pb_grpc.AdminServiceServicer):
    """Admin reads are scoped to the caller's tenant unless it holds the operator role;
    collection-wide actions (Compact) need the operator role."""

    def __init__(self, core: SearchCore, auth: Authenticator, lifecycle: Lifecycle):
        self.core = core
        self.auth = auth
        self.lifecycle = lifecycle

    @boundary("ListCollections")
    async def ListCollections(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("admin")
        return pb.ListCollectionsResponse(
            collections=[describe_pb(self.core, n, principal) for n in sorted(self.core.collections)])

    @boundary("DescribeCollection")
    async def DescribeCollection(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("admin")
        return describe_pb(self.core, request.collection, principal)

    @boundary("Compact")
    async def Compact(self, request, context):
        self.auth.authenticate(context.invocation_metadata()).require("operator")
        r = await self.core.compact(request.collection)
        before = r["rows_before"]
        return pb.CompactResponse(build_id=r["build_id"], previous_build_id=r["previous"],
                                  live_rows_before=before["live"],
                                  dead_rows_before=before["dead"] + before["orphan"],
                                  rows_after=r["rows_after"], replayed_writes=r["replayed"],
                                  seconds=r["seconds"])

    @boundary("CollectionStats")
    async def CollectionStats(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("admin")
        s = self.core.stats(request.collection, None if principal.is_operator else principal.tenant)
        return pb.CollectionStatsResponse(
            collection=request.collection, documents=s["documents"], chunks=s["chunks"],
            vectors=s["vectors"],
            stages=[pb.StagePercentiles(stage=k, count=v["count"], p50_ms=v["p50_ms"],
                                        p95_ms=v["p95_ms"], p99_ms=v["p99_ms"])
                    for k, v in s["stages"].items()])
