"""The router-to-shard protocol: the shard servicer (shard server side) and `RemoteShard` (router
side). RemoteShard implements the core's shard interface, so a ReplicaSet runs over it exactly as
over a LocalShard. gRPC status codes are turned into domain errors here, in the transport layer."""
from __future__ import annotations

from typing import Optional

import grpc
import numpy as np

from server import errors
from server.backends.docstore import ChunkRecord
from server.core import metrics
from server.core.types import Candidate, Filter, ShardQuery, ShardResult
from server.rpc import shard_pb2 as spb
from server.rpc import shard_pb2_grpc as spb_grpc
from server.transport.errors import Lifecycle, boundary

FROM_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Unavailable,  # that replica is overloaded: try another
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.IndexCorruptError,
    grpc.StatusCode.ABORTED: errors.CorpusVersionMismatch,
}


def query_to_pb(q: ShardQuery) -> spb.ShardSearchRequest:
    return spb.ShardSearchRequest(
        build_id=q.build_id, tenant=q.tenant, model_id=q.model_id, text=q.text,
        vector=q.vector.tolist() if q.vector is not None else [],
        dense_depth=q.dense_depth, lexical_depth=q.lexical_depth, acl_scopes=list(q.acl_scopes),
        text_top_n=q.text_top_n,
        filters=[spb.ShardFilter(key=f.key, any_of=list(f.any_of), gte=f.gte or "", lte=f.lte or "")
                 for f in q.filters])


def query_from_pb(r: spb.ShardSearchRequest) -> ShardQuery:
    if not r.tenant:
        raise errors.InvalidArgument("shard request without a tenant")
    vector = np.asarray(r.vector, dtype=np.float32) if len(r.vector) else None
    return ShardQuery(r.build_id, r.tenant, vector, r.model_id, r.text, r.dense_depth,
                      r.lexical_depth,
                      tuple(Filter(f.key, tuple(f.any_of), f.gte or None, f.lte or None)
                            for f in r.filters), tuple(r.acl_scopes), r.text_top_n)


def _hit_pb(c: Candidate, with_text: bool = True) -> spb.ShardHit:
    with_text = with_text and c.record.text is not None
    r = c.record
    hit = spb.ShardHit(chunk_id=r.chunk_id, score=c.score, doc_id=r.doc_id, acl=list(r.acl),
                       chunk_index=r.chunk_index, start_offset=r.start_offset,
                       end_offset=r.end_offset, tenant=r.tenant, has_text=with_text, row=max(r.row, 0))
    if with_text:
        hit.text, hit.title = r.text, r.title
        hit.metadata.update({str(k): str(v) for k, v in r.metadata.items()})
    return hit


def result_to_pb(res: ShardResult, text_top_n: int = 0) -> spb.ShardSearchResponse:
    def hits(cands):
        return [_hit_pb(c, not text_top_n or i < text_top_n) for i, c in enumerate(cands)]

    return spb.ShardSearchResponse(dense=hits(res.dense), lexical=hits(res.lexical),
                                   corpus_version=res.corpus_version, shard=res.shard,
                                   dense_ms=res.dense_ms, lexical_ms=res.lexical_ms,
                                   index_version=res.index_version)


def result_from_pb(p: spb.ShardSearchResponse) -> ShardResult:
    def cands(hits):
        return [Candidate(h.chunk_id, h.score,
                          ChunkRecord(h.row, h.chunk_id, h.doc_id, h.chunk_index, h.start_offset,
                                      h.end_offset, h.title, h.text if h.has_text else None,
                                      h.tenant, dict(h.metadata), tuple(h.acl)),
                          p.shard) for h in hits]

    return ShardResult(p.shard, p.corpus_version, cands(p.dense), cands(p.lexical), p.dense_ms,
                       p.lexical_ms, p.index_version)


class ShardServicer(spb_grpc.ShardServiceServicer):
    """Serves one LocalShard (or a fault-injecting wrapper of one) to routers."""

    def __init__(self, shard, lifecycle: Lifecycle):
        self.shard = shard
        self.lifecycle = lifecycle

    @boundary("SearchShard")
    async def SearchShard(self, request, context):
        q = query_from_pb(request)
        remaining = context.time_remaining()
        result = await self.shard.search(q, remaining)
        if result.dense_ms:  # the shard server's own per-stage histograms
            metrics.RECENT.observe("dense", result.dense_ms / 1e3)
        if result.lexical_ms:
            metrics.RECENT.observe("lexical", result.lexical_ms / 1e3)
        return result_to_pb(result, q.text_top_n)

    @boundary("FetchChunks")
    async def FetchChunks(self, request, context):
        cands = await self.shard.fetch_chunks(request.build_id, request.tenant,
                                              tuple(request.acl_scopes), list(request.rows),
                                              context.time_remaining())
        return spb.FetchChunksResponse(chunks=[_hit_pb(c) for c in cands])

    @boundary("ShardInfo")
    async def ShardInfo(self, request, context):
        d = self.shard.desc
        return spb.ShardInfoResponse(collection=d.collection, build_id=d.build_id,
                                     shard=self.shard.shard_no, corpus_version=d.corpus_version,
                                     model_id=d.model_id, chunks=self.shard.nrows,
                                     descriptor_json=d.to_json())


class RemoteShard:
    """A shard replica reached over gRPC. Each hit carries its owner's tenant, so the router's
    assembly re-checks what the shard restricted."""

    def __init__(self, address: str, shard_no: int,
                 credentials: Optional[grpc.ChannelCredentials] = None):
        self.address = address
        self.shard_no = shard_no
        options = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.keepalive_time_ms", 10_000)]
        self.channel = (grpc.aio.secure_channel(address, credentials, options) if credentials
                        else grpc.aio.insecure_channel(address, options))
        self.stub = spb_grpc.ShardServiceStub(self.channel)

    async def info(self, timeout: float = 10.0) -> spb.ShardInfoResponse:
        try:
            return await self.stub.ShardInfo(spb.ShardInfoRequest(), timeout=timeout,
                                             wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            raise errors.Unavailable(f"shard replica {self.address}: {err.code().name} "
                                     f"{err.details()}") from None

    async def search(self, query: ShardQuery, timeout: Optional[float] = None) -> ShardResult:
        try:
            resp = await self.stub.SearchShard(query_to_pb(query), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            cls = FROM_STATUS.get(err.code(), errors.Unavailable)
            raise cls(f"{self.address}: {err.code().name}: {err.details()}") from None
        return result_from_pb(resp)

    async def fetch_chunks(self, build_id, tenant, acl_scopes, rows, timeout=None):
        req = spb.FetchChunksRequest(build_id=build_id, tenant=tenant, acl_scopes=list(acl_scopes),
                                     rows=list(rows))
        try:
            resp = await self.stub.FetchChunks(req, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            cls = FROM_STATUS.get(err.code(), errors.Unavailable)
            raise cls(f"{self.address}: {err.code().name}: {err.details()}") from None
        return result_from_pb(spb.ShardSearchResponse(dense=resp.chunks, shard=self.shard_no)).dense

    async def close(self) -> None:
        await self.channel.close()
