"""Thin servicers: read credentials and deadline, convert messages (codec.py), delegate to the core."""
from __future__ import annotations

import asyncio

from server.core.service import SearchCore
from server.core.validation import check_batch_size
from server.core.writes import WriteAck
from server.errors import SearchError
from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc
from server.transport import codec
from server.transport.auth import Authenticator, Principal
from server.transport.errors import Lifecycle, boundary, status_for

OUTCOMES = {"applied": pb.WriteResponse.APPLIED, "noop": pb.WriteResponse.NOOP_STALE_VERSION,
            "accepted": pb.WriteResponse.ACCEPTED}


def deadline_of(context, default_s: float = 0.0) -> float | None:
    """The caller's deadline on the loop's clock; `default_s` (when > 0) for a caller without one."""
    remaining = context.time_remaining()
    if remaining is None:
        remaining = default_s if default_s > 0 else None
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


def _dense_kind(core: SearchCore, collection: str) -> int:
    try:
        metric = core.collection(collection).desc.metric
    except SearchError:
        return pb.COSINE_SIMILARITY
    return pb.L2_DISTANCE if metric == "l2" else pb.COSINE_SIMILARITY


class SearchServicer(pb_grpc.SearchServiceServicer):
    def __init__(self, core: SearchCore, auth: Authenticator, lifecycle: Lifecycle):
        self.core = core
        self.auth = auth
        self.lifecycle = lifecycle

    def _deadline(self, context) -> float | None:
        return deadline_of(context, self.core.config.listen.default_deadline_s)

    @boundary("Search")
    async def Search(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata())
        result = await self.core.search(codec.query_from_pb(request), principal.tenant,
                                        self._deadline(context), principal.acl_scopes)
        return codec.result_to_pb(result, _dense_kind(self.core, request.collection))

    @boundary("SearchBatch")
    async def SearchBatch(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata())
        check_batch_size(len(request.queries))
        queries, items = [], {}
        for i, r in enumerate(request.queries):
            try:
                queries.append((i, codec.query_from_pb(r)))
            except SearchError as exc:
                items[i] = exc
        if queries:
            answers = await self.core.search_batch([q for _, q in queries], principal.tenant,
                                                   self._deadline(context), principal.acl_scopes)
            for (i, _), a in zip(queries, answers):
                items[i] = a
        out = pb.SearchBatchResponse()
        for i, r in enumerate(request.queries):
            a = items[i]
            if isinstance(a, SearchError):
                out.results.add(code=status_for(a).value[0], message=str(a))
            else:
                slot = out.results.add().response
                slot.SetInParent()  # present even if every field of the answer is a default
                codec.result_to_pb(a, _dense_kind(self.core, r.collection), slot)
        return out

    @boundary("UpsertDocument")
    async def UpsertDocument(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("write")
        return write_response(await self.core.write(codec.write_from_pb(request, "upsert"),
                                                    principal.tenant))

    @boundary("DeleteDocument")
    async def DeleteDocument(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("write")
        return write_response(await self.core.write(codec.write_from_pb(request, "delete"),
                                                    principal.tenant))


def write_response(ack: WriteAck) -> pb.WriteResponse:
    return pb.WriteResponse(outcome=OUTCOMES[ack.outcome], stored_version=ack.stored_version,
                            index_version=ack.index_version, sequence=ack.sequence)


async def describe_pb(core: SearchCore, name: str, principal: Principal) -> pb.CollectionDescription:
    """Operators see the whole descriptor (as the build wrote it); a tenant's admin sees its own
    tenant's view of it. The counts are live (core.describe)."""
    operator = principal.is_operator
    d, build = await core.describe(name, None if operator else principal.tenant)
    return pb.CollectionDescription(
        name=d.collection, build_id=d.build_id, model_id=d.model_id, dim=d.dim, metric=d.metric,
        factory=d.factory, shards=d.shards, corpus_version=d.corpus_version, chunker=d.chunker,
        documents=d.documents, chunks=d.chunks,
        descriptor_json=build.to_json() if operator else d.to_json())


class AdminServicer(pb_grpc.AdminServiceServicer):
    """Admin reads are scoped to the caller's tenant unless it holds the operator role;
    collection-wide actions and views (Compact, replica states) need the operator role."""

    def __init__(self, core: SearchCore, auth: Authenticator, lifecycle: Lifecycle):
        self.core = core
        self.auth = auth
        self.lifecycle = lifecycle

    @boundary("ListCollections")
    async def ListCollections(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("admin")
        registry = self.core.registry
        listed = {n: await describe_pb(self.core, n, principal) for n in registry.names()}
        # a collection whose build failed to load is listed too, saying why: an operator looking
        # for it would otherwise find it gone, with its callers hearing UNAVAILABLE
        listed.update({n: pb.CollectionDescription(name=n, unavailable=why)
                       for n, why in registry.unloadable().items() if n not in listed})
        return pb.ListCollectionsResponse(collections=[listed[n] for n in sorted(listed)])

    @boundary("DescribeCollection")
    async def DescribeCollection(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata()).require("admin")
        return await describe_pb(self.core, request.collection, principal)

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
        operator = principal.is_operator
        s = await self.core.stats(request.collection, None if operator else principal.tenant,
                                  operator and request.digest,
                                  deadline_of(context, self.core.config.listen.default_deadline_s))
        out = pb.CollectionStatsResponse(
            collection=request.collection, documents=s["documents"], chunks=s["chunks"],
            vectors=s["vectors"], shard_errors=s["shard_errors"])
        if operator:  # the stage window counts every tenant's queries: operators only
            out.stages.extend(pb.StagePercentiles(stage=k, count=v["count"], p50_ms=v["p50_ms"],
                                                  p95_ms=v["p95_ms"], p99_ms=v["p99_ms"])
                              for k, v in s["stages"].items())
            for info in s["shards"]:
                for r in info.replicas or [info]:
                    out.replicas.add(shard=info.shard_no, replica=r.address or "local",
                                     build_id=r.build_id, applied_sequence=r.applied_seq,
                                     live_digest=r.live_digest, state=r.state, chunks=r.chunks,
                                     tombstone_ratio=r.tombstone_ratio)
        return out
