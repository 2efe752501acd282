"""The router-to-shard protocol: the shard servicer (shard server side) and `RemoteShard` (router
side), which implements the complete shard interface (server/core/shard_api.py) over gRPC, so a
ReplicaSet runs over it exactly as over a LocalShard. gRPC status codes are turned into domain
errors here, in the transport layer.

The shard port is not an open door: every call must carry the shared router credential
(`authorization: Bearer <token>`, compared in constant time) unless mutual TLS already proved the
caller; a shard server refuses to start on a non-loopback address with neither. It enforces the
public API's limits itself (server/core/validation.py), whatever the router checked.
"""
from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path
from typing import Optional, Sequence

import grpc

from server import errors
from server.core import limits, metrics
from server.core.admission import Admission
from server.core.shard_api import SHARD_INFO_TIMEOUT_S
from server.core.types import (Candidate, FetchRequest, ShardInfo, ShardQuery, ShardWrite,
                               StoredVersions, WriteOutcome)
from server.rpc import shard_pb2 as spb
from server.rpc import shard_pb2_grpc as spb_grpc
from server.transport import codec
from server.transport.errors import Lifecycle, boundary, status_for

FROM_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ReplicaOverloaded,  # try another, no strike
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.IndexCorruptError,
    grpc.StatusCode.ABORTED: errors.CorpusVersionMismatch,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}
CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def read_token(path: Optional[Path]) -> Optional[str]:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if len(token) < 16:
        raise ValueError(f"{path}: the router credential must be at least 16 characters")
    return token


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ShardAuth:
    """Who may call a shard server: a router presenting the shared credential, or any client when
    mutual TLS authenticated it at the handshake, or anyone on loopback when neither is set."""

    def __init__(self, token: Optional[str], mutual_tls: bool):
        self.token = token
        self.mutual_tls = mutual_tls

    @classmethod
    def for_listener(cls, host: str, token: Optional[str], mutual_tls: bool) -> "ShardAuth":
        if token is None and not mutual_tls and not is_loopback(host):
            raise ValueError(f"a shard server on {host} needs --shard-token-file (the shared router "
                             "credential) or mutual TLS (--tls-client-ca): refusing to serve an open "
                             "shard port beyond loopback")
        return cls(token, mutual_tls)

    def check(self, metadata) -> None:
        if self.token is None:
            return
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if len(values) != 1:
            raise errors.Unauthenticated("shard calls need the router credential "
                                         "('authorization: Bearer <token>')")
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, presented = value.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(),
                                                                 self.token.encode()):
            raise errors.Unauthenticated("wrong router credential")


def shard_admission(max_inflight: int, max_inflight_batched_queries: int) -> Admission:
    """A router cuts a SearchBatch into messages of `batch_chunk` queries, so a shard counts
    queries, not messages: one router at its own limits (its --max-inflight singles plus its
    --max-inflight-batched-queries) always fits; several routers past that are shed."""
    return Admission(None, max_inflight + max_inflight_batched_queries, count_singles=True,
                     what="shard: ")


class ShardServicer(spb_grpc.ShardServiceServicer):
    """Serves one shard (a LocalShard, or a fault-injecting wrapper of one) to routers."""

    def __init__(self, shard, lifecycle: Lifecycle, auth: ShardAuth, status=None,
                 admission: Optional[Admission] = None):
        self.shard = shard
        # routers' search calls are shed here by their queries (the listener's defaults unless
        # the shard role passes its configured ones)
        if admission is None:
            from server.config import ListenConfig

            listen = ListenConfig()
            admission = shard_admission(listen.max_inflight, listen.max_inflight_batched_queries)
        self.admission = admission
        # after an alias flip, the build served before, for a grace period: a router that has
        # not followed the flip yet still reads it (shard_server.ShardReplica.follow_aliases)
        self.previous = None
        self.lifecycle = lifecycle
        self.auth = auth
        self.status = status  # e.g. the log consumer: "catching_up" until it has caught up

    def _serving(self, build_id: str):
        previous = self.previous
        if previous is not None and build_id and build_id == previous.desc.build_id:
            return previous
        return self.shard

    @boundary("SearchShard")
    async def SearchShard(self, request, context):
        self.auth.check(context.invocation_metadata())
        if self.status is not None and self.status() == "catching_up":
            raise errors.Unavailable(f"shard {self.shard.shard_no} is catching up on the write "
                                     "log; ask another replica")
        queries, answers = [], {}
        for i, q in enumerate(request.queries):
            try:
                queries.append((i, codec.shard_query_from_pb(q)))
            except errors.SearchError as exc:
                answers[i] = exc
        if queries:
            shard = self._serving(queries[0][1].build_id)
            with self.admission.admit(len(queries)):
                results = await shard.search([q for _, q in queries], context.time_remaining())
            for (i, q), r in zip(queries, results):
                answers[i] = r
        out = spb.ShardSearchResponse()
        texts = codec.shard_texts_budget(
            [r for r in answers.values() if not isinstance(r, errors.SearchError)],
            limits.ANSWERS_BUDGET_BYTES)
        for i in range(len(request.queries)):
            r = answers[i]
            if isinstance(r, errors.SearchError):
                out.results.add(code=status_for(r).value[0], message=str(r))
                continue
            if r.dense_ms:  # the shard server's own per-stage histograms
                metrics.RECENT.observe("shard_dense", r.dense_ms / 1e3)
            if r.lexical_ms:
                metrics.RECENT.observe("shard_lexical", r.lexical_ms / 1e3)
            out.results.append(codec.shard_result_to_pb(r, request.queries[i].text_top_n, texts))
        return out

    @boundary("FetchChunks")
    async def FetchChunks(self, request, context):
        self.auth.check(context.invocation_metadata())
        cands = await self._serving(request.build_id).fetch(codec.fetch_from_pb(request),
                                                            context.time_remaining())
        # (a fetch that could pass a response's size is refused before it is read: ShardIndex)
        return spb.FetchChunksResponse(chunks=[codec.hit_to_pb(c) for c in cands])

    @boundary("ApplyWrites")
    async def ApplyWrites(self, request, context):
        self.auth.check(context.invocation_metadata())
        if request.build_id and request.build_id != self.shard.desc.build_id:
            raise errors.FailedPrecondition(f"shard {self.shard.shard_no} serves build "
                                            f"{self.shard.desc.build_id}, not {request.build_id}")
        writes = [codec.shard_write_from_pb(w) for w in request.writes]
        outcomes = await self.shard.apply(writes, context.time_remaining())
        return spb.ApplyWritesResponse(outcomes=[codec.outcome_to_pb(o) for o in outcomes])

    @boundary("ShardInfo")
    async def ShardInfo(self, request, context):
        self.auth.check(context.invocation_metadata())
        info = await self.shard.info(request.tenant or None, request.digest)
        if self.status is not None:
            info.state = self.status()
        if self.previous is not None:
            info.also_serves = (self.previous.desc.build_id,)
        return codec.info_to_pb(info)


# a replica that was down is tried again at least once a second: gRPC's default backoff grows to
# 120 s, so a shard whose replicas had been down ~45 s stayed unreachable for another ~18 s after
# both were back and SERVING (outside QA re-probe); one connection attempt a second per dead
# replica is nothing to a router
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 250),
                     ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 1000))


class RemoteShard:
    """A shard replica reached over gRPC. Each hit carries its owner's tenant, so the router's
    assembly re-checks what the shard restricted."""

    def __init__(self, address: str, shard_no: int,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None):
        self.address = address
        self.shard_no = shard_no
        options = [("grpc.max_receive_message_length", limits.MAX_RESPONSE_BYTES),
                   ("grpc.max_send_message_length", limits.MAX_RESPONSE_BYTES),
                   ("grpc.keepalive_time_ms", 10_000), *RECONNECT_OPTIONS]
        self.channel = (grpc.aio.secure_channel(address, credentials, options) if credentials
                        else grpc.aio.insecure_channel(address, options))
        self.stub = spb_grpc.ShardServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    @property
    def cache_version(self) -> Optional[int]:
        return None  # a remote index version cannot be read without a call: no caching over it

    def _error(self, err: grpc.aio.AioRpcError) -> errors.SearchError:
        cls = FROM_STATUS.get(err.code(), errors.Unavailable)
        details = err.details() or ""
        if cls is errors.ReplicaOverloaded and (limits.RESPONSE_TOO_LARGE_NOTE in details
                                                or "larger than max" in details):
            cls = errors.ResponseTooLarge  # the same on every replica: the caller's to hear
        return cls(f"{self.address}: {err.code().name}: {err.details()}")

    async def search(self, queries: Sequence[ShardQuery], timeout: Optional[float] = None) -> list:
        req = spb.ShardSearchRequest(queries=[codec.shard_query_to_pb(q) for q in queries])
        try:
            resp = await self.stub.SearchShard(req, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        out = []
        for r in resp.results:
            if r.code:
                code = CODE_BY_VALUE.get(r.code, grpc.StatusCode.UNKNOWN)
                out.append(FROM_STATUS.get(code, errors.Unavailable)(f"{self.address}: {r.message}"))
            else:
                out.append(codec.shard_result_from_pb(r))
        if len(out) != len(queries):
            raise errors.Unavailable(f"{self.address} answered {len(out)} of {len(queries)} queries")
        return out

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list[Candidate]:
        try:
            resp = await self.stub.FetchChunks(codec.fetch_to_pb(request), timeout=timeout,
                                               metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        return [codec.hit_from_pb(h, self.shard_no) for h in resp.chunks]

    async def apply(self, writes: Sequence[ShardWrite], timeout: Optional[float] = None,
                    build_id: str = "") -> list[WriteOutcome]:
        req = spb.ApplyWritesRequest(build_id=build_id, writes=[codec.shard_write_to_pb(w) for w in writes])
        try:
            resp = await self.stub.ApplyWrites(req, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        return [codec.outcome_from_pb(o) for o in resp.outcomes]

    async def stored_versions(self, keys: Sequence[tuple[str, str]],
                              timeout: Optional[float] = None) -> StoredVersions:
        """None known: a shard server takes its writes from the write log (a router has no
        direct writes to it), so nothing here asks it before embedding."""
        return StoredVersions({}, 0)

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = SHARD_INFO_TIMEOUT_S,
                   wait: bool = False) -> ShardInfo:
        try:
            resp = await self.stub.ShardInfo(spb.ShardInfoRequest(tenant=tenant or "", digest=digest),
                                             timeout=timeout, wait_for_ready=wait,
                                             metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        return codec.info_from_pb(resp, self.address)

    async def close(self) -> None:
        await self.channel.close()
