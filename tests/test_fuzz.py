"""Thousands of malformed requests (random fields, unicode and binary garbage, absurd sizes,
NaN vectors, hostile filters) against the real server: every answer is a clear status from the
allowed set, the server stays healthy, and no data changes."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def channel(server):
    ch = grpc.insecure_channel(server.address)
    yield ch
    ch.close()


def snapshot(channel):
    admin = pb_grpc.AdminServiceStub(channel)
    stats = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran"), timeout=10)
    ref = pb_grpc.SearchServiceStub(channel).Search(
        pb.SearchRequest(collection="cran", text="boundary layer", top_k=10), timeout=10)
    return (stats.documents, stats.chunks, stats.vectors, [h.chunk_id for h in ref.hits])


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.one_of(st.text(max_size=300), st.text(alphabet=st.characters(min_codepoint=0x0, exclude_categories=("Cs",)),
                                                 max_size=50), st.just(""), st.just("   "))
filters = st.lists(st.builds(pb.MetadataFilter, key=st.text(max_size=80),
                             any_of=st.lists(st.text(max_size=40), max_size=5),
                             gte=st.text(max_size=20), lte=st.text(max_size=20)), max_size=20)
requests = st.builds(
    pb.SearchRequest,
    collection=st.one_of(st.just("cran"), st.text(max_size=40)),
    text=texts,
    top_k=st.one_of(st.integers(0, 20), st.integers(0, 2 ** 32 - 1)),
    mode=st.integers(0, 10),
    filters=filters,
    include_trace=st.booleans(),
    dense_depth=st.integers(0, 2 ** 32 - 1),
    lexical_depth=st.integers(0, 5000),
    rrf_k=st.integers(0, 2 ** 32 - 1),
    rerank_depth=st.integers(0, 1000),
    context_token_budget=st.integers(0, 2 ** 32 - 1),
    allow_partial=st.booleans(),
    vector=st.one_of(st.none(), st.builds(pb.QueryVector,
                                          values=st.lists(floats, max_size=80),
                                          model_id=st.text(max_size=30))),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=requests)
def test_random_search_requests_get_allowed_statuses(channel, req):
    stub = pb_grpc.SearchServiceStub(channel)
    try:
        stub.Search(req, timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        assert err.details(), "every refusal names its problem"
    assert code in ALLOWED, (code, req)


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=400))
def test_binary_garbage_is_invalid_argument(channel, raw):
    for method in ("/searchserver.v1.SearchService/Search",
                   "/searchserver.v1.AdminService/DescribeCollection"):
        call = channel.unary_unary(method, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        try:
            call(raw, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        assert code in ALLOWED, (code, raw)


def test_invalid_utf8_in_a_string_field_is_invalid_argument(channel):
    # field 2 (text), wire type 2, length 2, bytes 0xff 0xfe: not UTF-8
    call = channel.unary_unary("/searchserver.v1.SearchService/Search",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        call(b"\x0a\x04cran\x12\x02\xff\xfe\x20\x05", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "SearchRequest" in err.value.details()


def test_the_server_is_healthy_and_unchanged_after_the_fuzzing(channel):
    # runs after the fuzz tests in this module (pytest keeps file order)
    before = snapshot(channel)
    stub = pb_grpc.SearchServiceStub(channel)
    for top_k in (0, 10 ** 9):
        with pytest.raises(grpc.RpcError):
            stub.Search(pb.SearchRequest(collection="cran", text="x", top_k=top_k), timeout=10)
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert snapshot(channel) == before


def test_a_flood_of_concurrent_streams_is_answered_or_shed(small_collection, tiny_embedder):
    from conftest import start_core_server

    srv = start_core_server(small_collection[0], tiny_embedder, listen={"max_inflight": 16},
                            storage={"state_dir": small_collection[0] / ".state-flood"})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            futures = [stub.Search.future(pb.SearchRequest(collection="cran", text=f"flow {i}",
                                                           top_k=10), timeout=30)
                       for i in range(400)]
            codes = []
            for f in futures:
                try:
                    f.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert codes.count(grpc.StatusCode.OK) >= 16
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop()
