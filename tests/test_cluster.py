"""Shard servers as real processes on 127.0.0.1 behind a router: equivalence with the embedded
default, replica death, hedging around a hung replica, deadlines, admission control, metrics."""
import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from server.core.replicas import HedgePolicy
from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

from conftest import ShardProcess, publish_build, start_core_server, start_router

QUERIES = ["boundary layer transition", "supersonic flow over a cone", "heat transfer to a wall",
           "buckling of cylindrical shells", "slip flow", "wing flutter at transonic speed"]


@pytest.fixture(scope="module")
def three_shard_build(tmp_path_factory, tiny_embedder, cranfield_docs):
    data = tmp_path_factory.mktemp("cluster")
    publish_build(data, "cran3", cranfield_docs[:300], tiny_embedder, shards=3)
    publish_build(data, "cran1", cranfield_docs[:120], tiny_embedder, shards=1)
    return data


@pytest.fixture(scope="module")
def cluster(three_shard_build, tiny_embedder):
    procs = [[ShardProcess(three_shard_build, "cran3", s) for _ in range(2)] for s in range(3)]
    try:
        router = start_router(tiny_embedder, "cran3", [[p.address for p in reps] for reps in procs],
                              HedgePolicy(hedge_min_ms=20, hedge_max_ms=200))
        yield router, procs
        router.stop()
    finally:
        for reps in procs:
            for p in reps:
                p.stop()


def stub_for(address):
    return pb_grpc.SearchServiceStub(grpc.insecure_channel(address))


def hits(resp):
    return [(h.chunk_id, round(h.score, 5)) for h in resp.hits]


def test_three_shards_two_replicas_equal_the_single_process_result(cluster, three_shard_build,
                                                                   tiny_embedder):
    router, _ = cluster
    embedded = start_core_server(three_shard_build, tiny_embedder, storage={"collection": ["cran3"]})
    try:
        remote, local = stub_for(router.address), stub_for(embedded.address)
        for q in QUERIES:
            for mode in (pb.DENSE, pb.LEXICAL, pb.HYBRID):
                req = pb.SearchRequest(collection="cran3", text=q, top_k=20, mode=mode)
                a, b = remote.Search(req, timeout=20), local.Search(req, timeout=20)
                assert hits(a) == hits(b) and len(a.hits) == 20
                assert [h.text for h in a.hits] == [h.text for h in b.hits]
    finally:
        embedded.stop()


def test_metrics_are_exported_over_http_and_move(cluster):
    from prometheus_client import start_http_server
    import socket

    router, _ = cluster
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_http_server(port, addr="127.0.0.1")

    def scrape():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        vals = {}
        for line in text.splitlines():
            if line.startswith(("search_stage_seconds_count", "search_shard_seconds_count",
                                "search_requests_total")):
                name, value = line.rsplit(" ", 1)
                vals[name] = float(value)
        return vals

    before = scrape()
    stub = stub_for(router.address)
    for q in QUERIES:
        stub.Search(pb.SearchRequest(collection="cran3", text=q, top_k=5), timeout=20)
    after = scrape()
    total = 'search_stage_seconds_count{stage="total"}'
    assert after[total] - before.get(total, 0) >= len(QUERIES)
    shard_keys = [k for k in after if k.startswith("search_shard_seconds_count")]
    assert len(shard_keys) >= 3  # every shard observed, labelled by replica
    ok = 'search_requests_total{code="OK",method="Search"}'
    assert after[ok] - before.get(ok, 0) >= len(QUERIES)


def test_latency_buckets_are_fine_enough_to_separate_p99_from_p999():
    from server.core.metrics import LATENCY_BUCKETS

    ratios = [b / a for a, b in zip(LATENCY_BUCKETS, LATENCY_BUCKETS[1:])]
    assert max(ratios) <= 1.26  # neighbouring buckets differ by at most ~25%
    assert LATENCY_BUCKETS[0] <= 1e-4 and LATENCY_BUCKETS[-1] >= 30


def test_killing_a_replica_mid_run_loses_no_request(cluster):
    router, procs = cluster
    stub = stub_for(router.address)
    done, errors = [], []
    killed = threading.Event()

    def load():
        for i in range(60):
            if i == 20:
                procs[1][0].kill()  # SIGKILL one replica of shard 1 while requests flow
                killed.set()
            try:
                r = stub.Search(pb.SearchRequest(collection="cran3", text=QUERIES[i % len(QUERIES)],
                                                 top_k=10), timeout=20)
                done.append(len(r.hits))
            except grpc.RpcError as err:
                errors.append(f"{err.code().name}: {err.details()}")

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert killed.is_set()
    assert errors == []
    assert len(done) == 180 and all(n == 10 for n in done)


@pytest.fixture
def faulty_pair(three_shard_build):
    procs = []

    def make(*flags_a, flags_b=()):
        a = ShardProcess(three_shard_build, "cran1", 0, *flags_a)
        b = ShardProcess(three_shard_build, "cran1", 0, *flags_b)
        procs.extend([a, b])
        return a, b

    yield make
    for p in procs:
        p.stop()


def test_a_hung_replica_is_hedged_around_within_the_deadline(faulty_pair, tiny_embedder):
    hung, healthy = faulty_pair("--inject-hang-prob", "1.0")
    router = start_router(tiny_embedder, "cran1", [[hung.address, healthy.address]],
                          HedgePolicy(hedge_min_ms=20, hedge_max_ms=50, hedge_budget=1.0))
    try:
        stub = stub_for(router.address)
        for q in QUERIES * 3:  # the deadline is the check: waiting for the hung replica misses it
            resp = stub.Search(pb.SearchRequest(collection="cran1", text=q, top_k=5), timeout=1.5)
            assert len(resp.hits) == 5
        replica_set = router.core.registry.get("cran1").shards[0]
        assert replica_set.stats["hedges"] >= 1
        assert replica_set.stats["hedges_won"] >= 1
    finally:
        router.stop()


def test_an_expired_deadline_is_enforced_by_the_router_itself(faulty_pair, tiny_embedder):
    """The router gives up at the caller's deadline and answers DEADLINE_EXCEEDED itself (counted
    server-side), rather than leaving the caller's own timer to cut a call still waiting on shards."""
    from server.core import metrics

    slow_a, slow_b = faulty_pair("--inject-delay-prob", "1.0", "--inject-delay-ms", "3000",
                                 flags_b=("--inject-delay-prob", "1.0", "--inject-delay-ms", "3000"))
    router = start_router(tiny_embedder, "cran1", [[slow_a.address, slow_b.address]])
    counted = metrics.REQUESTS.labels("Search", "DEADLINE_EXCEEDED")
    # and timed: the request histogram holds failed answers too (outside QA: a p99 of successes
    # alone stayed green while 790 of 800 calls failed)
    timed = metrics.REQUEST_SECONDS.labels("Search", "DEADLINE_EXCEEDED")
    try:
        stub = stub_for(router.address)
        before, before_s = counted._value.get(), timed._sum.get()
        before_n = sum(b.get() for b in timed._buckets)
        with pytest.raises(grpc.RpcError) as err:
            stub.Search(pb.SearchRequest(collection="cran1", text="slip flow", top_k=5), timeout=0.4)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10  # the server's answer may trail the client's timer
        while counted._value.get() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counted._value.get() == before + 1
        assert sum(b.get() for b in timed._buckets) == before_n + 1
        assert 0.2 <= timed._sum.get() - before_s <= 5.0
    finally:
        router.stop()


def slow_router(faulty_pair, tiny_embedder, delay_ms: int, **listen):
    """A router over two replicas that each take `delay_ms` per call, hedging off."""
    delay = ("--inject-delay-prob", "1.0", "--inject-delay-ms", str(delay_ms))
    slow_a, slow_b = faulty_pair(*delay, flags_b=delay)
    return start_router(tiny_embedder, "cran1", [[slow_a.address, slow_b.address]],
                        HedgePolicy(enabled=False), listen=listen)


def test_overload_is_shed_with_resource_exhausted(faulty_pair, tiny_embedder):
    router = slow_router(faulty_pair, tiny_embedder, 400, max_inflight=2)
    try:
        stub = stub_for(router.address)
        codes = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def one():
            start.wait()
            try:
                stub.Search(pb.SearchRequest(collection="cran1", text="slip flow", top_k=5), timeout=10)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
            with lock:
                codes.append(code)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert codes.count("RESOURCE_EXHAUSTED") >= 1
        assert codes.count("OK") >= 1
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    finally:
        router.stop()


def test_admission_counts_a_batch_by_its_queries_and_never_starves_single_searches():
    """Outside QA: a SearchBatch counted as one request, so 60 batches of 1,024 queries were all
    admitted (~61,000 queued) and a single Search waited out its deadline behind them."""
    from server.core.admission import Admission
    from server.errors import Overloaded

    gate = Admission(max_requests=4, max_batched_queries=10)
    with gate.admit(8):                       # a batch of 8 holds 8 of the 10
        with pytest.raises(Overloaded, match="would pass the limit of 10"):
            with gate.admit(3):
                pass
        with gate.admit(2), gate.admit(1), gate.admit(1):  # singles never count against it
            assert gate.requests == 4 and gate.batched_queries == 10
            with pytest.raises(Overloaded, match="4 requests in flight"):
                with gate.admit(1):
                    pass
            with gate.admit(write=True):  # writes have their own budget (review: writes waiting
                pass                      # on a slow log took every search's place)
    assert gate.requests == 0 and gate.batched_queries == 0
    writes = [gate.admit(write=True) for _ in range(4)]
    for w in writes:
        w.__enter__()
    with pytest.raises(Overloaded, match="4 writes in flight"):
        with gate.admit(write=True):
            pass
    with gate.admit(1):  # a search is admitted beside writes stuck on their log
        pass
    for w in writes:
        w.__exit__(None, None, None)
    with gate.admit(50):                      # larger than the budget, alone: admitted
        with pytest.raises(Overloaded):
            with gate.admit(2):
                pass


def test_a_batch_flood_is_shed_while_single_searches_answer(faulty_pair, tiny_embedder):
    from server.core import metrics

    router = slow_router(faulty_pair, tiny_embedder, 600, max_inflight_batched_queries=4)
    try:
        stub = stub_for(router.address)
        batch = pb.SearchBatchRequest(queries=[pb.SearchRequest(collection="cran1", text=q, top_k=5)
                                               for q in QUERIES[:3]])
        first = stub.SearchBatch.future(batch, timeout=20)
        held = time.monotonic() + 10
        while metrics.INFLIGHT_BATCHED_QUERIES._value.get() < 3 and time.monotonic() < held:
            time.sleep(0.01)  # until the router holds the first batch's 3 queries
        assert metrics.INFLIGHT_BATCHED_QUERIES._value.get() == 3
        with pytest.raises(grpc.RpcError) as err:
            stub.SearchBatch(batch, timeout=20)  # 3 more would make 6 > 4: refused at once
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queries of batches in flight" in err.value.details()
        single = stub.Search(pb.SearchRequest(collection="cran1", text="slip flow", top_k=5), timeout=20)
        assert len(single.hits) == 5  # a single search is admitted beside the batch
        assert [(r.code, len(r.response.hits)) for r in first.result().results] == [(0, 5)] * 3
        again = stub.SearchBatch(batch, timeout=20).results  # the budget is free again
        assert [(r.code, len(r.response.hits)) for r in again] == [(0, 5)] * 3
    finally:
        router.stop()


def test_a_shard_server_sheds_router_calls_beyond_its_max_inflight(faulty_pair, three_shard_build):
    """Outside QA: the shard role took --max-inflight and never checked it; 200 concurrent
    calls to a shard started with --max-inflight 2 all queued. A shard counts queries (a router
    cuts batches into messages): --max-inflight 1 plus --max-inflight-batched-queries 1 is a
    budget of 2 queries, and each call below carries 2."""
    from server.core.collection import CollectionStore
    from server.rpc import shard_pb2 as spb
    from server.rpc import shard_pb2_grpc as spb_grpc

    slow, _ = faulty_pair("--inject-delay-prob", "1.0", "--inject-delay-ms", "600", "--max-inflight", "1",
                          "--max-inflight-batched-queries", "1")
    build = CollectionStore(three_shard_build).live_build("cran1")
    query = spb.ShardQuery(build_id=build, tenant="default", text="slip flow", lexical_depth=5)
    request = spb.ShardSearchRequest(queries=[query, query])
    with grpc.insecure_channel(slow.address) as ch:
        stub = spb_grpc.ShardServiceStub(ch)
        calls = [stub.SearchShard.future(request, timeout=20) for _ in range(4)]
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
    assert codes.count("OK") >= 1 and codes.count("RESOURCE_EXHAUSTED") >= 1, codes
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}


def test_failing_replica_is_retried_on_the_next_one(faulty_pair, tiny_embedder):
    failing, healthy = faulty_pair("--inject-fail-prob", "1.0")
    router = start_router(tiny_embedder, "cran1", [[failing.address, healthy.address]],
                          HedgePolicy(enabled=False))
    try:
        stub = stub_for(router.address)
        for q in QUERIES:
            assert len(stub.Search(pb.SearchRequest(collection="cran1", text=q, top_k=5),
                                   timeout=10).hits) == 5
        assert router.core.registry.get("cran1").shards[0].stats["retries"] >= 1
    finally:
        router.stop()


def test_partial_results_only_when_the_request_allows_them(three_shard_build, tiny_embedder):
    procs = [ShardProcess(three_shard_build, "cran3", 0), ShardProcess(three_shard_build, "cran3", 1),
             ShardProcess(three_shard_build, "cran3", 2, "--inject-fail-prob", "1.0")]
    router = start_router(tiny_embedder, "cran3", [[p.address] for p in procs])
    try:
        stub = stub_for(router.address)
        with pytest.raises(grpc.RpcError) as err:
            stub.Search(pb.SearchRequest(collection="cran3", text="slip flow", top_k=5), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "1 of 3 shards failed" in err.value.details()
        resp = stub.Search(pb.SearchRequest(collection="cran3", text="slip flow", top_k=5,
                                            allow_partial=True), timeout=10)
        assert resp.partial and len(resp.shard_errors) == 1 and "shard 2" in resp.shard_errors[0]
        assert not resp.shard_errors[0].startswith("shard 2: shard 2"), resp.shard_errors
        assert len(resp.hits) == 5 and all(h.shard in (0, 1) for h in resp.hits)
    finally:
        router.stop()
        for p in procs:
            p.stop()


def test_an_operator_still_sees_collection_stats_while_a_shard_is_down(three_shard_build,
                                                                       tiny_embedder):
    """Outside QA: with every replica of one shard down, CollectionStats failed UNAVAILABLE as a
    whole - no view of which replicas were serving, in the outage that needs it most. Now the
    down shard's replicas are listed unreachable, the counts are the other shards' and
    shard_errors names the shard."""
    procs = [ShardProcess(three_shard_build, "cran3", 0), ShardProcess(three_shard_build, "cran3", 1),
             ShardProcess(three_shard_build, "cran3", 2)]
    router = start_router(tiny_embedder, "cran3", [[p.address] for p in procs])
    try:
        admin = pb_grpc.AdminServiceStub(grpc.insecure_channel(router.address))
        whole = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran3"), timeout=30)
        assert not whole.shard_errors and {r.state for r in whole.replicas} == {"serving"}
        per_shard = {r.shard: r.chunks for r in whole.replicas}
        # hung (stopped: its port still takes the call, nothing answers), then down (refused)
        os.kill(procs[2].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            # outside QA: the shards' own 10 s ShardInfo timeout held the answer past the
            # caller's deadline, which then ended the call with DEADLINE_EXCEEDED
            hung = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran3"), timeout=3)
            assert time.monotonic() - t0 < 3
        finally:
            os.kill(procs[2].pid, signal.SIGCONT)
        procs[2].stop()
        down = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran3"), timeout=30)
        for answer in (hung, down):
            assert len(answer.shard_errors) == 1, answer
            assert answer.shard_errors[0].startswith("shard 2:"), answer
            states = {(r.shard, r.replica, r.state) for r in answer.replicas}
            assert (2, procs[2].address, "unreachable") in states, states
            assert {(s, st) for s, _, st in states} == {(0, "serving"), (1, "serving"),
                                                        (2, "unreachable")}
            assert answer.chunks == per_shard[0] + per_shard[1] < whole.chunks
    finally:
        router.stop()
        for p in procs:
            p.stop()


def test_a_hung_shard_still_leaves_time_for_a_partial_answer_and_no_search_waits_for_ever(
        three_shard_build, tiny_embedder):
    """A shard that hangs (never answers): with allow_partial the router answers from the other
    shards before the caller's deadline (it keeps a fifth of the time, up to 200 ms, for that),
    marked partial, with no feedback round on top; without it, the server's DEADLINE_EXCEEDED naming the shard; and a caller that sets no
    deadline gets the server's default one (--default-deadline-s) instead of waiting for ever.
    The statistics round of BM25 gives up on the hung shard within a budget of its own."""
    procs = [ShardProcess(three_shard_build, "cran3", 0), ShardProcess(three_shard_build, "cran3", 1),
             ShardProcess(three_shard_build, "cran3", 2, "--inject-hang-prob", "1.0")]
    router = start_router(tiny_embedder, "cran3", [[p.address] for p in procs],
                          listen={"default_deadline_s": 2.5})
    try:
        stub = stub_for(router.address)
        for timeout in (2.5, None):  # the caller's deadline, then the server's default
            resp = stub.Search(pb.SearchRequest(collection="cran3", text="slip flow", top_k=5,
                                                allow_partial=True, include_trace=True),
                               timeout=timeout)
            assert resp.partial and "shard 2" in resp.shard_errors[0]
            assert len(resp.hits) == 5 and all(h.shard in (0, 1) for h in resp.hits)
            assert "feedback skipped: the first round was partial" in resp.trace.notes
            # the statistics round before the search gave up on the hung shard within its own
            # budget (a tenth of the time, up to 250 ms): BM25 on each shard's own statistics
            assert any(n.startswith("collection BM25 statistics skipped") for n in resp.trace.notes)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(pb.SearchRequest(collection="cran3", text="slip flow", top_k=5),
                            timeout=timeout)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # the server's answer, naming the late shard once (outside QA: the caller's own
            # transport ended the call first, with a bare "Deadline Exceeded"; and partial
            # answers said "shard 2: shard 2: ...")
            assert "1 of 3 shards did not answer in time: shard 2" in err.value.details(), \
                err.value.details()
            assert "shard 2: shard 2" not in err.value.details()
            assert not resp.shard_errors[0].startswith("shard 2: shard 2"), resp.shard_errors
    finally:
        router.stop()
        for p in procs:
            p.stop()


def test_hits_shipped_without_text_are_fetched_and_answers_do_not_change(three_shard_build,
                                                                         tiny_embedder):
    """Remote shards send text for their top hits only (text_top_n); the router fetches the texts
    of other hits that fusion puts in its window. With text for 1 hit per list, every answer must
    still equal the embedded default's."""
    procs = [ShardProcess(three_shard_build, "cran3", s) for s in range(3)]
    router = start_router(tiny_embedder, "cran3", [[p.address] for p in procs],
                          pipeline={"text_top_n": 1, "retrieval_cache_size": 0})
    embedded = start_core_server(three_shard_build, tiny_embedder, storage={"collection": ["cran3"]})
    try:
        remote, local = stub_for(router.address), stub_for(embedded.address)
        for q in QUERIES[:3]:
            for mode in (pb.DENSE, pb.LEXICAL, pb.HYBRID):
                req = pb.SearchRequest(collection="cran3", text=q, top_k=10, mode=mode)
                a, b = remote.Search(req, timeout=20), local.Search(req, timeout=20)
                assert [(h.chunk_id, h.text, h.start_offset) for h in a.hits] == \
                    [(h.chunk_id, h.text, h.start_offset) for h in b.hits]
                assert "fetch" in {t.stage for t in a.timings}
    finally:
        embedded.stop()
        router.stop()
        for p in procs:
            p.stop()


def test_a_router_refuses_writes_and_compaction_with_a_clear_status(cluster):
    router, _ = cluster
    ch = grpc.insecure_channel(router.address)
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.SearchServiceStub(ch).UpsertDocument(pb.UpsertDocumentRequest(
            collection="cran3", doc_id="d", version=9, text="x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "write log" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.AdminServiceStub(ch).Compact(pb.CompactRequest(collection="cran3"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "local" in err.value.details()
    ch.close()


def test_a_replica_on_another_build_is_routed_around_and_the_router_follows_a_finished_rollout(
        tmp_path, tiny_embedder, cranfield_docs):
    """Regression (issue 10.1): two `shard --build B1` replicas and a router; B2 published and one
    replica restarted without --build (so it serves B2): 340 of 400 router queries failed with
    FAILED_PRECONDITION. Now the B2 replica is out of rotation until every replica serves B2, and
    then the router follows."""
    from server.core.collection import CollectionStore

    b1 = publish_build(tmp_path, "bf", cranfield_docs[:40], tiny_embedder)
    store = CollectionStore(tmp_path)
    from index_builder.build import audit_build, build_collection

    b2 = build_collection(cranfield_docs[40:80], store, "bf", tiny_embedder, quiet=True)
    audit_build(store, "bf", b2.build_id)
    r1 = ShardProcess(tmp_path, "bf", 0, "--build", b1.build_id)
    r2 = ShardProcess(tmp_path, "bf", 0, "--build", b1.build_id)
    router = start_router(tiny_embedder, "bf", [[r1.address, r2.address]], follow_builds_s=0.3)
    try:
        stub = stub_for(router.address)
        store.publish("bf", b2.build_id)
        r2.stop()
        r2 = ShardProcess(tmp_path, "bf", 0, "--port", str(r2.port))  # the live build: B2
        builds = set()
        for i in range(200):
            resp = stub.Search(pb.SearchRequest(collection="bf", text=QUERIES[i % len(QUERIES)],
                                                top_k=3), timeout=10)
            builds.add(resp.build_id)
        assert builds == {b1.build_id}  # every query answered, from the build the router serves
        r1.stop()  # the last B1 replica: until it is back on B2 no replica serves the router's
        r1 = ShardProcess(tmp_path, "bf", 0, "--port", str(r1.port))  # build, and none may mix
        deadline = time.monotonic() + 30
        while True:
            try:
                if stub.Search(pb.SearchRequest(collection="bf", text="flow", top_k=3),
                               timeout=10).build_id == b2.build_id:
                    break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "the router did not follow the finished rollout"
            time.sleep(0.2)
    finally:
        router.stop()
        r1.stop()
        r2.stop()


def test_replicas_that_all_flipped_keep_answering_the_router_until_it_follows_and_roll_back_at_once(
        tmp_path, tiny_embedder, cranfield_docs):
    """Regression (outside QA): once every replica had followed a publish and the router had not
    yet, no replica answered the router's build: 230 of 730 searches failed over 2.5-6 s. A
    replica now answers requests naming the build it served before for a grace period, and says
    so in ShardInfo (`also_serves`), so the router keeps it in rotation until it follows."""
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore
    from server.rpc import shard_pb2 as spb
    from server.rpc import shard_pb2_grpc as spb_grpc

    b1 = publish_build(tmp_path, "rf", cranfield_docs[:40], tiny_embedder)
    store = CollectionStore(tmp_path)
    b2 = build_collection(cranfield_docs[40:80], store, "rf", tiny_embedder, quiet=True)
    audit_build(store, "rf", b2.build_id)
    replicas = [ShardProcess(tmp_path, "rf", 0, "--alias-poll-s", "0.2") for _ in range(2)]
    router = start_router(tiny_embedder, "rf", [[r.address for r in replicas]])  # never follows
    try:
        stub = stub_for(router.address)
        assert stub.Search(pb.SearchRequest(collection="rf", text="flow", top_k=3),
                           timeout=10).build_id == b1.build_id
        infos = [spb_grpc.ShardServiceStub(grpc.insecure_channel(r.address)) for r in replicas]

        def flip(to, before, within_s):
            """Publish `to`; wait until every replica serves it and still answers for `before`."""
            store.publish("rf", to)
            deadline = time.monotonic() + within_s
            while not all(i.ShardInfo(spb.ShardInfoRequest(), timeout=10).build_id == to
                          for i in infos):
                assert time.monotonic() < deadline, f"the replicas did not follow {to}"
                time.sleep(0.1)
            assert all(list(i.ShardInfo(spb.ShardInfoRequest(), timeout=10).also_serves) == [before]
                       for i in infos)

        flip(b2.build_id, b1.build_id, 60)
        for i in range(60):  # every replica has flipped; the router is still on B1
            resp = stub.Search(pb.SearchRequest(collection="rf", text=QUERIES[i % len(QUERIES)],
                                                top_k=3, mode=(pb.HYBRID, pb.LEXICAL, pb.DENSE)[i % 3]),
                               timeout=10)
            assert resp.build_id == b1.build_id and resp.hits and not resp.partial
        # a quick rollback reuses the build still open (it held its state's lock: opening it
        # again failed with "in use by pid <own pid>" until the grace period ended)
        flip(b1.build_id, b2.build_id, 20)
        assert stub.Search(pb.SearchRequest(collection="rf", text="flow", top_k=3),
                           timeout=10).build_id == b1.build_id
    finally:
        router.stop()
        for r in replicas:
            r.stop()


def test_a_replica_that_is_down_does_not_hold_the_router_on_the_old_build(
        tmp_path, tiny_embedder, cranfield_docs):
    """Review: the router followed a new build only when every replica answered ShardInfo, so one
    replica down during a rollout kept it on the old build for good, and its siblings stopped
    answering for that build after their grace period."""
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    b1 = publish_build(tmp_path, "dn", cranfield_docs[:40], tiny_embedder)
    store = CollectionStore(tmp_path)
    b2 = build_collection(cranfield_docs[40:80], store, "dn", tiny_embedder, quiet=True)
    audit_build(store, "dn", b2.build_id)
    up = ShardProcess(tmp_path, "dn", 0, "--alias-poll-s", "0.2")
    down = ShardProcess(tmp_path, "dn", 0, "--alias-poll-s", "0.2")
    router = start_router(tiny_embedder, "dn", [[up.address, down.address]], follow_builds_s=0.3)
    try:
        stub = stub_for(router.address)
        assert stub.Search(pb.SearchRequest(collection="dn", text="flow", top_k=3),
                           timeout=10).build_id == b1.build_id
        down.stop()
        store.publish("dn", b2.build_id)
        deadline = time.monotonic() + 30
        while stub.Search(pb.SearchRequest(collection="dn", text="flow", top_k=3),
                          timeout=10).build_id != b2.build_id:
            assert time.monotonic() < deadline, "the router did not follow with a replica down"
            time.sleep(0.2)
    finally:
        router.stop()
        up.stop()
        down.stop()


def test_a_router_whose_shards_all_stopped_answering_reports_not_serving(tmp_path, tiny_embedder,
                                                                         cranfield_docs):
    """Outside QA: a router stayed SERVING with every shard down, so load balancers kept sending
    it searches that could only fail. Its health follows its shards: NOT_SERVING once no replica
    answers, SERVING again when one does; the liveness service stays SERVING throughout."""
    import os
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    publish_build(tmp_path, "hl", cranfield_docs[:30], tiny_embedder)
    shard = ShardProcess(tmp_path, "hl", 0)
    router = start_router(tiny_embedder, "hl", [[shard.address]], follow_builds_s=0.2,
                          follow_timeout_s=0.5)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(router.address))

    def status(service=""):
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_for(want, what):
        deadline = time.monotonic() + 30
        while status() != want:
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert status() == SERVING
        os.kill(shard.proc.pid, signal.SIGSTOP)  # it answers nothing, as a hung host would
        wait_for(NOT_SERVING, "the router stayed SERVING with no shard answering")
        assert status("searchserver.v1.SearchService") == NOT_SERVING
        assert status("liveness") == SERVING  # not ready, but alive: no restart
        os.kill(shard.proc.pid, signal.SIGCONT)
        wait_for(SERVING, "the router did not turn SERVING when its shard answered again")
        resp = stub_for(router.address).Search(pb.SearchRequest(collection="hl", text="flow",
                                                                top_k=3), timeout=10)
        assert len(resp.hits) == 3
    finally:
        os.kill(shard.proc.pid, signal.SIGCONT)
        router.stop()
        shard.stop()


def test_a_router_that_takes_writes_stays_ready_for_them_without_shards():
    """Review: a router with a write log takes writes without any shard; turning "" NOT_SERVING
    with the shards down would take every router, and the writes, out of a Service. Only
    SearchService follows the shards there; a stopping server never turns SERVING again."""
    import asyncio

    from grpc_health.v1 import health, health_pb2

    from server.transport.app import SEARCH_SERVICE, SERVICES, RunningServer
    from server.transport.errors import Lifecycle
    from server.transport.router import router_health

    async def statuses(takes_writes):
        servicer = health.aio.HealthServicer()
        running = RunningServer(None, 0, servicer, None, Lifecycle())
        for name in ("",) + SERVICES:
            await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        set_health = router_health(lambda: running, takes_writes)
        await set_health(False)
        out = {}
        for name in ("",) + SERVICES:
            resp = await servicer.Check(health_pb2.HealthCheckRequest(service=name), None)
            out[name] = resp.status
        running.stopping = True
        await set_health(True)  # on its way out: stays NOT_SERVING
        resp = await servicer.Check(health_pb2.HealthCheckRequest(service=SEARCH_SERVICE), None)
        return out, resp.status

    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    writes, after_stop = asyncio.run(statuses(True))
    assert writes == {"": SERVING, SERVICES[0]: NOT_SERVING, SERVICES[1]: SERVING}
    assert after_stop == NOT_SERVING
    reads, _ = asyncio.run(statuses(False))
    assert set(reads.values()) == {NOT_SERVING}


def test_a_stopped_replica_costs_no_query_its_deadline(three_shard_build, tiny_embedder):
    """Regression (issue 10.4): one replica of two SIGSTOPped under 8 client threads with a 3 s
    deadline failed 11 queries (8 in hybrid mode even with unlimited hedging): FetchChunks was not
    hedged, and a cancelled hedge loser made the hung replica look idle. Now fetches are hedged,
    lost hedges count against a replica, and a stalled replica is ejected from first attempts."""
    import os
    import signal

    a, b = ShardProcess(three_shard_build, "cran1", 0), ShardProcess(three_shard_build, "cran1", 0)
    router = start_router(tiny_embedder, "cran1", [[a.address, b.address]],
                          pipeline={"retrieval_cache_size": 0, "text_top_n": 2})
    errors, wrong, done = [], [], []
    stop = threading.Event()

    def ask(stub, q, mode):
        resp = stub.Search(pb.SearchRequest(collection="cran1", text=q, top_k=10, mode=mode), timeout=3)
        return [h.chunk_id for h in resp.hits]

    baseline_stub = stub_for(router.address)
    expected = {(q, m): ask(baseline_stub, q, m) for q in QUERIES for m in (pb.HYBRID, pb.LEXICAL)}

    def client(i):
        stub = stub_for(router.address)
        n = 0
        while not stop.is_set():
            mode = (pb.HYBRID, pb.LEXICAL)[n % 2]
            q = QUERIES[(i + n) % len(QUERIES)]
            try:
                if ask(stub, q, mode) != expected[(q, mode)]:
                    wrong.append((q, mode))
            except grpc.RpcError as err:
                errors.append(f"{err.code().name}: {err.details()}")
            n += 1
        done.append(n)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(a.proc.pid, signal.SIGSTOP)
        time.sleep(5.0)
        os.kill(a.proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        replica_set = router.core.registry.get("cran1").shards[0]
    finally:
        router.stop()
        a.stop()
        b.stop()
    assert errors == [] and wrong == []
    assert sum(done) > 100 and replica_set.stats["ejections"] >= 1


def test_a_router_waits_shards_wait_s_for_its_shards_and_says_so():
    """Outside QA: a router started before its shards said nothing for 30 s and exited, while
    shard servers may take many minutes to load a build (their startup probe allows 20). The
    wait is --shards-wait-s now, and the refusal names it."""
    import subprocess
    import sys

    from conftest import REPO
    from harness.processes import free_port

    nobody = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "server.main", "router", "--collection", "c",
                          "--replicas", nobody, "--port", "0", "--shards-wait-s", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and time.monotonic() - t0 < 60
    assert "no shard replica answered ShardInfo within 2 s (--shards-wait-s)" in out.stderr, out.stderr
