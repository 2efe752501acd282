"""Thin servicers: read credentials and deadline, convert messages (codec.py), delegate to the core."""
from __future__ import annotations

import asyncio

import grpc

from server.core import limits
from server.core.service import SearchCore
from server.core.validation import check_batch_size
from server.core.writes import WriteAck
from server.errors import ResponseTooLarge, SearchError
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
        out = pb.SearchResponse()
        try:
            codec.write_answer(result, _dense_kind(self.core, request.collection), out)
        except codec.AnswerTooLarge as exc:
            raise ResponseTooLarge(_too_large(exc.spent)) from None
        return out

    @boundary("SearchBatch")
    async def SearchBatch(self, request, context):
        principal = self.auth.authenticate(context.invocation_metadata())
        return await answer_batch(self.core, request, principal.tenant, self._deadline(context),
                                  principal.acl_scopes)

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


def _too_large(spent: int) -> str:
    return (f"this answer takes more than {spent / 2**20:.1f} MiB, "
            f"{limits.OVER_THE_RESPONSE_LIMIT}: ask for fewer hits")


class _ResponseFull(Exception):
    """Raised out of `answer_batch`'s writer to stop the batch's remaining searches."""


async def answer_batch(core: SearchCore, request: pb.SearchBatchRequest, tenant: str,
                       deadline: float | None, acl_scopes) -> pb.SearchBatchResponse:
    """A SearchBatch's response: one slot per query, in order. Each part of the batch is written
    into its slots as soon as the pipeline answers it (`on_part`), while the later parts still
    search: encoding 1,000 answers after the last one (~25 ms on the loop, a core idle) was an
    eighth of the call.

    The answers share one budget, limits.ANSWERS_BUDGET_BYTES, counted as they are written
    (codec.write_answer). An answer that does not fit beside those written before it stops the
    batch: it and every query not yet answered get RESOURCE_EXHAUSTED in their slots, naming
    limits.RESPONSE_FULL_NOTE (SearchClient sends those again in another call), and the answers
    that fit go out. An answer larger than the budget on its own gets RESOURCE_EXHAUSTED saying
    so. Before, a batch of long texts or deep pages was built whole - gigabytes - before gRPC
    refused to send it (outside QA)."""
    check_batch_size(len(request.queries))
    out = pb.SearchBatchResponse()
    slots = [out.results.add() for _ in request.queries]
    answered = [False] * len(slots)
    queries, where = [], []  # the valid queries and their slots
    for i, r in enumerate(request.queries):
        try:
            queries.append(codec.query_from_pb(r))
            where.append(i)
        except SearchError as exc:
            slots[i].code, slots[i].message = status_for(exc).value[0], str(exc)
            answered[i] = True
    kinds: dict[str, int] = {}
    used = 0  # what the answers written so far may take
    full = (f"this answer did not fit in the response beside the ones before it "
            f"({limits.RESPONSE_FULL_NOTE}, {limits.MAX_RESPONSE_BYTES / 2**20:.0f} MiB): "
            f"send it again in another call")
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

    def encode(first: int, answers: list) -> None:
        nonlocal used
        for i, a in zip(where[first:first + len(answers)], answers):
            slot = slots[i]
            answered[i] = True
            if isinstance(a, SearchError):
                slot.code, slot.message = status_for(a).value[0], str(a)
                used += 16 + 4 * len(slot.message)  # (1,024 of them could pass the reserve)
                continue
            name = request.queries[i].collection
            kind = kinds.get(name)
            if kind is None:
                kind = kinds[name] = _dense_kind(core, name)
            response = slot.response
            response.SetInParent()  # present even if every field of the answer is a default
            try:
                used += codec.write_answer(a, kind, response, limits.ANSWERS_BUDGET_BYTES - used)
            except codec.AnswerTooLarge as exc:
                slot.Clear()
                if used == 0:  # alone: it fits no response
                    slot.code, slot.message = exhausted, _too_large(exc.spent)
                    continue
                slot.code, slot.message = exhausted, full
                raise _ResponseFull() from None

    if queries:
        try:
            await core.search_batch(queries, tenant, deadline, acl_scopes, on_part=encode)
        except _ResponseFull:
            for slot, done in zip(slots, answered):
                if not done:
                    slot.code, slot.message = exhausted, full
    return out


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
