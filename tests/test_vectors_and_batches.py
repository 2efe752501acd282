"""Your own vectors and the batch API, through the real service: a collection built from
precomputed embeddings answers exactly what faiss answers on those vectors; writes carry their own
chunk vectors; vectors of another model, dimension or with NaN are refused and change nothing;
SearchBatch answers every query in its slot, invalid ones alone failing."""
import asyncio
import contextlib
import json
import subprocess
import sys

import faiss
import grpc
import numpy as np
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

from conftest import REPO, shards_of, start_core_server

DIM, N = 32, 1500
MODEL = "my-own-model@3"


@pytest.fixture(scope="module")
def vector_collection(tmp_path_factory):
    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    rng = np.random.default_rng(5)
    centers = rng.standard_normal((20, DIM)).astype(np.float32)
    x = centers[rng.integers(0, 20, N)] + 0.3 * rng.standard_normal((N, DIM)).astype(np.float32)
    faiss.normalize_L2(x)
    q = centers[rng.integers(0, 20, 50)] + 0.3 * rng.standard_normal((50, DIM)).astype(np.float32)
    faiss.normalize_L2(q)
    docs = [Document(f"v{i}", f"vector document number {i} zyxvec{i}") for i in range(N)]
    data = tmp_path_factory.mktemp("vectors")
    store = CollectionStore(data)
    desc = build_collection(docs, store, "vec", None, "Flat", shards=2, quiet=True,
                            vectors=x, model_id=MODEL, audit_queries=q)
    audit = audit_build(store, "vec", desc.build_id)
    store.publish("vec", desc.build_id)
    return data, desc, x, q, audit


@pytest.fixture(scope="module")
def vec_server(vector_collection):
    srv = start_core_server(vector_collection[0], None)  # no embedding model at all
    ch = grpc.insecure_channel(srv.address)
    yield srv, pb_grpc.SearchServiceStub(ch)
    ch.close()
    srv.stop()


def vreq(v, model=MODEL, top_k=10, **kw):
    return pb.SearchRequest(collection="vec", top_k=top_k, mode=pb.DENSE,
                            vector=pb.QueryVector(values=np.asarray(v, np.float32).tolist(),
                                                  model_id=model), **kw)


def test_the_build_records_the_callers_model_and_is_audited_with_held_out_queries(vector_collection):
    _, desc, _, _, audit = vector_collection
    assert desc.model_id == MODEL and desc.model_revision == "external" and desc.chunks == N
    assert audit["query_source"].startswith("held-out") and audit["queries"] == 50
    assert audit["recall"] == 1.0  # Flat: exact


def test_a_build_from_vectors_returns_the_top_10_faiss_returns_on_them(vec_server, vector_collection):
    _, stub = vec_server
    _, desc, x, q, _ = vector_collection
    exact = faiss.IndexFlatIP(DIM)
    exact.add(x)
    _, want = exact.search(q[:20], 10)
    for qi, row in zip(q[:20], want):
        got = [h.doc_id for h in stub.Search(vreq(qi), timeout=10).hits]
        assert got == [f"v{i}" for i in row]


def raw_req(raw: bytes, values=(), model=MODEL, top_k=10):
    """A query whose vector is given as float32 bytes (QueryVector.values_f32)."""
    return pb.SearchRequest(collection="vec", top_k=top_k, mode=pb.DENSE,
                            vector=pb.QueryVector(values=values, values_f32=raw, model_id=model))


@pytest.mark.parametrize("bad", ["dimension", "nan", "model", "untagged", "bytes-dimension",
                                 "bytes-nan", "bytes-ragged", "given-twice"])
def test_query_vectors_of_another_shape_or_model_are_refused(vec_server, bad):
    _, stub = vec_server
    v = np.ones(DIM, np.float32) / np.sqrt(DIM)
    raw = v.astype("<f4").tobytes()
    req = {"dimension": vreq(np.ones(DIM + 3)), "nan": vreq(np.full(DIM, np.nan)),
           "model": vreq(v, model="someone-elses-model@1"), "untagged": vreq(v, model=""),
           "bytes-dimension": raw_req(raw + raw[:8]),
           "bytes-nan": raw_req(np.full(DIM, np.nan, "<f4").tobytes()),
           "bytes-ragged": raw_req(raw[:-1]), "given-twice": raw_req(raw, v.tolist())}[bad]
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if bad == "given-twice":
        assert "given twice" in err.value.details()


def test_a_vector_as_float32_bytes_answers_as_the_same_vector_as_floats(vec_server,
                                                                        vector_collection):
    """QueryVector.values_f32 (what server/client.py sends) and values are one vector: the
    same hits and scores, in Search and in SearchBatch."""
    from server.client import f32_bytes, request

    _, stub = vec_server
    _, _, _, q, _ = vector_collection
    for qi in q[:10]:
        floats = stub.Search(vreq(qi), timeout=10)
        raw = stub.Search(raw_req(f32_bytes(qi)), timeout=10)
        assert [(h.chunk_id, h.score) for h in raw.hits] == [(h.chunk_id, h.score) for h in floats.hits]
    sent = request(collection="vec", vector=list(map(float, q[0])), model_id=MODEL)
    assert sent.vector.values_f32 == q[0].astype("<f4").tobytes() and not sent.vector.values
    batch = stub.SearchBatch(pb.SearchBatchRequest(queries=[raw_req(f32_bytes(x)) for x in q[:5]]),
                             timeout=10)
    for x, item in zip(q[:5], batch.results):
        assert [h.chunk_id for h in item.response.hits] == [h.chunk_id for h in
                                                             stub.Search(vreq(x), timeout=10).hits]
    with pytest.raises(ValueError, match="one row of floats"):
        f32_bytes(np.ones((2, DIM)))


def test_text_needs_a_model_the_server_does_not_have_but_lexical_works(vec_server):
    _, stub = vec_server
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(pb.SearchRequest(collection="vec", text="vector document", top_k=5,
                                     mode=pb.DENSE), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and MODEL in err.value.details()
    assert "query vector" in err.value.details()
    hits = stub.Search(pb.SearchRequest(collection="vec", text="zyxvec7", top_k=5, mode=pb.LEXICAL),
                       timeout=10).hits
    assert [h.doc_id for h in hits] == ["v7"]
    # a writer is told what a writer sends (outside QA: it was told to send a query vector)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpsertDocument(pb.UpsertDocumentRequest(collection="vec", doc_id="t1", version=1,
                                                     text="text only"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "chunks with their vectors and vector_model_id" in err.value.details()
    assert "query vector" not in err.value.details()
    # so is one whose version is stale (v7 holds version 1): the check before embedding answers
    # no NOOP where the server could not have embedded the text at all
    with pytest.raises(grpc.RpcError) as err:
        stub.UpsertDocument(pb.UpsertDocumentRequest(collection="vec", doc_id="v7", version=1,
                                                     text="text only"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_upserts_carry_their_own_chunk_vectors(vec_server, vector_collection):
    _, stub = vec_server
    rng = np.random.default_rng(9)
    v = rng.standard_normal(DIM).astype(np.float32)
    v /= np.linalg.norm(v)
    # one chunk's vector as floats, the other's as float32 bytes
    ok = pb.UpsertDocumentRequest(collection="vec", doc_id="mine-1", version=1, vector_model_id=MODEL,
                                  chunks=[pb.ChunkInput(text="zyxmine first part", vector=v.tolist()),
                                          pb.ChunkInput(text="second part",
                                                        vector_f32=(-v).astype("<f4").tobytes())])
    assert stub.UpsertDocument(ok, timeout=10).outcome == pb.WriteResponse.APPLIED
    top = stub.Search(vreq(v, top_k=1), timeout=10).hits[0]
    assert top.doc_id == "mine-1" and top.text == "zyxmine first part" and top.start_offset == 0
    second = [h for h in stub.Search(vreq(-v, top_k=1), timeout=10).hits][0]
    assert second.doc_id == "mine-1" and second.start_offset == len("zyxmine first part") + 2


@pytest.mark.parametrize("bad", ["model", "dimension", "nan", "some-missing", "bytes-ragged",
                                 "bytes-dimension", "given-twice"])
def test_bad_chunk_vectors_are_refused_and_change_nothing(vec_server, bad):
    _, stub = vec_server
    v = [0.1] * DIM
    raw = np.asarray(v, "<f4").tobytes()
    chunks = {"model": [pb.ChunkInput(text="zyxbadvec", vector=v)],
              "dimension": [pb.ChunkInput(text="zyxbadvec", vector=v + [0.2])],
              "nan": [pb.ChunkInput(text="zyxbadvec", vector=[float("nan")] * DIM)],
              "some-missing": [pb.ChunkInput(text="zyxbadvec", vector=v),
                               pb.ChunkInput(text="no vector")],
              "bytes-ragged": [pb.ChunkInput(text="zyxbadvec", vector_f32=raw[:-2])],
              "bytes-dimension": [pb.ChunkInput(text="zyxbadvec", vector_f32=raw[:-4])],
              "given-twice": [pb.ChunkInput(text="zyxbadvec", vector=v, vector_f32=raw)]}[bad]
    req = pb.UpsertDocumentRequest(collection="vec", doc_id=f"bad-{bad}", version=1, chunks=chunks,
                                   vector_model_id="other@1" if bad == "model" else MODEL)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpsertDocument(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    hits = stub.Search(pb.SearchRequest(collection="vec", text="zyxbadvec", top_k=5,
                                        mode=pb.LEXICAL), timeout=10).hits
    assert hits == []


def test_search_batch_answers_each_query_in_its_slot(vec_server, vector_collection):
    _, stub = vec_server
    _, _, _, q, _ = vector_collection
    good = [vreq(v) for v in q[:12]]
    bad = {3: vreq(np.ones(DIM + 1)), 7: vreq(q[0], model="other@1"),
           10: pb.SearchRequest(collection="no-such", top_k=5, text="x")}
    queries = [bad.get(i, g) for i, g in enumerate(good)]
    resp = stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30)
    assert len(resp.results) == len(queries)
    for i, item in enumerate(resp.results):
        if i in (3, 7):
            assert item.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and item.message
        elif i == 10:
            assert item.code == grpc.StatusCode.NOT_FOUND.value[0]
        else:
            single = stub.Search(queries[i], timeout=10)
            assert item.code == 0
            assert [h.chunk_id for h in item.response.hits] == [h.chunk_id for h in single.hits]


def test_a_batch_finishes_its_queries_in_place_with_the_pages_the_full_path_assembles(
        vector_collection, tmp_path):
    """A query whose page needs no fetch, rerank, budget or trace is finished where its batch
    settles, not in a task of its own (a SearchBatch of 1,000 made 1,000 tasks on the event loop).
    Its page is the one the full path assembles: the same batch on a server whose shards ship one
    text per list (text_top_n 1), where every query takes the full path and fetches the rest of
    its page by row - dense, lexical and hybrid (whose fused hits take the copy that carries its
    text, so it too finishes in place)."""
    x, q = vector_collection[2], vector_collection[3]
    # a document 40th by its vector, first by its unique word: fused first, with its text shipped
    # only in the lexical list (no dense feedback, which would lift it into the dense list's head)
    deep = int(np.argsort(-(x @ q[21]))[39])
    queries = [vreq(v, top_k=7) for v in q[:12]]
    queries += [pb.SearchRequest(collection="vec", top_k=5, mode=pb.LEXICAL,
                                 text=f"vector document zyxvec{i}") for i in (5, 77, 900)]
    queries += [pb.SearchRequest(collection="vec", top_k=5, mode=pb.HYBRID, text=text,
                                 vector=vreq(q[k]).vector, feedback_docs=feedback)
                for k, text, feedback in ((20, "zyxvec12 number", 5), (21, f"zyxvec{deep}", 0))]

    def page(item):
        assert item.code == 0, item.message
        return [(h.chunk_id, h.doc_id, h.text, round(h.score, 6), h.dense.rank, h.lexical.rank,
                 h.fused.rank) for h in item.response.hits]

    pages, full_path, tasks = {}, {}, {}
    for name, text_top_n in (("in place", None), ("full", 1)):
        srv = start_core_server(vector_collection[0], None,
                                pipeline={"retrieval_cache_size": 0, "text_top_n": text_top_n},
                                storage={"state_dir": tmp_path / name.replace(" ", "-")})
        calls, created = [], []
        try:
            pipeline = srv.core.pipeline

            async def counted(st, *args, inner=pipeline._finish_one, calls=calls):
                calls.append(st.q)
                return await inner(st, *args)

            def counting(loop, coro, created=created, **kw):
                created.append(getattr(coro, "__qualname__", ""))
                return asyncio.Task(coro, loop=loop, **kw)

            pipeline._finish_one = counted
            srv.loop.call_soon_threadsafe(srv.loop.set_task_factory, counting)
            with grpc.insecure_channel(srv.address) as ch:
                got = pb_grpc.SearchServiceStub(ch).SearchBatch(
                    pb.SearchBatchRequest(queries=queries), timeout=30).results
        finally:
            srv.stop()
        pages[name] = [page(item) for item in got]
        full_path[name], tasks[name] = len(calls), created
    assert all(pages["in place"]) and pages["in place"] == pages["full"]
    assert pages["full"][-1][0][1:2] == (f"v{deep}",) and pages["full"][-1][0][4] > 10
    assert full_path == {"in place": 0, "full": len(queries)}
    finishing = {name: [c for c in made if c.endswith("._finish")] for name, made in tasks.items()}
    assert len(finishing["full"]) == len(queries) and not finishing["in place"]


def test_stage_histograms_take_one_sample_per_call_for_what_its_queries_share(
        vector_collection, tmp_path):
    """A SearchBatch's queries share their call's total, their shards' batched searches and the
    pages assembled in place: one sample each per call (and per shard for the index time), not one
    per query (1,000 observations of ~16 values for a SearchBatch of 1,000). A Search, one query,
    takes the same samples as before."""
    from prometheus_client import REGISTRY

    def counts():
        return {stage: REGISTRY.get_sample_value("search_stage_seconds_count", {"stage": stage}) or 0
                for stage in ("total", "dense", "assembly", "retrieve")}

    q = vector_collection[3]
    srv = start_core_server(vector_collection[0], None,
                            pipeline={"retrieval_cache_size": 0, "batch_chunk": 0},
                            storage={"state_dir": tmp_path / "state"})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            before = counts()
            got = stub.SearchBatch(pb.SearchBatchRequest(queries=[vreq(v) for v in q[:24]]),
                                   timeout=30).results
            after_batch = counts()
            one = stub.Search(vreq(q[30]), timeout=30)
            after_one = counts()
    finally:
        srv.stop()
    assert all(item.code == 0 and len(item.response.hits) == 10 for item in got) and one.hits
    batch = {k: after_batch[k] - before[k] for k in before}
    single = {k: after_one[k] - after_batch[k] for k in before}
    # two shards: one index-time sample each; the rest one per call
    assert batch == {"total": 1, "dense": 2, "assembly": 1, "retrieve": 1}
    assert single == {"total": 1, "dense": 2, "assembly": 1, "retrieve": 1}


def test_index_time_samples_are_per_collection_and_shard():
    """A SearchBatch may name several collections: shard 0 of one and shard 0 of another are two
    samples (review: keyed by shard number alone, they collapsed into the larger)."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from server.core.pipeline import QueryPipeline
    from server.core.types import ShardResult

    def count(stage):
        return REGISTRY.get_sample_value("search_stage_seconds_count", {"stage": stage}) or 0

    def state(coll, *dense_ms, error=None):
        return SimpleNamespace(coll=SimpleNamespace(name=coll), error=error, shard_results=[
            ShardResult(shard, "v", [], [], ms, 0.0) for shard, ms in enumerate(dense_ms)])

    before = count("dense"), count("lexical")
    QueryPipeline._observe_retrievers([
        state("a", 5.0, 1.0), state("a", 7.0, 2.0),  # one call's two queries on a's two shards
        state("b", 9.0),                             # and one on b's only shard
        state("c", 4.0, error=RuntimeError("failed")),  # failed: its results are not this round's
    ])
    assert (count("dense") - before[0], count("lexical") - before[1]) == (3, 0)


def test_answers_past_the_response_limit_come_back_in_their_slots_and_are_sent_again(
        vector_collection, tmp_path, monkeypatch):
    """Answers share one response budget, counted as they are written. With room for two
    answers of 8 long passages each, a SearchBatch of 6 answers two and gives the other four
    RESOURCE_EXHAUSTED naming the response size limit (before: the whole response was built -
    gigabytes with long enough texts - and then refused by gRPC); SearchClient sends those four
    again until all six are answered, each as a single Search answers it. An answer too large on
    its own is refused as that, in its slot and as a Search, and is not sent again."""
    from server.client import SearchClient
    from server.core import limits

    srv = start_core_server(vector_collection[0], None, pipeline={"retrieval_cache_size": 0},
                            storage={"state_dir": tmp_path / "state"})
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    try:
        with grpc.insecure_channel(srv.address, options=[
                ("grpc.max_receive_message_length", 64 * 2**20)]) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            rng = np.random.default_rng(11)
            for i in range(8):
                v = rng.standard_normal(DIM).astype(np.float32)
                text = f"zqbig passage {i} " + "filler " * 8_000  # ~56 KB
                assert stub.UpsertDocument(pb.UpsertDocumentRequest(
                    collection="vec", doc_id=f"big-{i}", version=1, vector_model_id=MODEL,
                    chunks=[pb.ChunkInput(text=text, vector=v.tolist())]),
                    timeout=30).outcome == pb.WriteResponse.APPLIED
            queries = [pb.SearchRequest(collection="vec", top_k=k, mode=pb.LEXICAL, text="zqbig")
                       for k in (8, 9, 10, 11, 12, 13)]  # six queries, the same eight hits
            singles = [[h.chunk_id for h in stub.Search(q, timeout=30).hits] for q in queries]
            assert all(len(s) == 8 for s in singles)
            one_answer = stub.Search(queries[0], timeout=30).ByteSize()

            monkeypatch.setattr(limits, "ANSWERS_BUDGET_BYTES", int(2.5 * one_answer))
            got = stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30).results
            ok = [i for i, item in enumerate(got) if item.code == 0]
            assert len(ok) == 2, [(item.code, item.message[:80]) for item in got]
            for i, item in enumerate(got):
                if item.code == 0:
                    assert [h.chunk_id for h in item.response.hits] == singles[i]
                else:
                    assert item.code == exhausted.value[0] and not item.HasField("response")
                    assert limits.RESPONSE_FULL_NOTE in item.message
            with SearchClient(srv.address, timeout=30) as client:
                answers = list(client.search_batch(queries))
            assert [a.code for a in answers] == [grpc.StatusCode.OK] * 6
            assert [[h.chunk_id for h in a.response.hits] for a in answers] == singles

            monkeypatch.setattr(limits, "ANSWERS_BUDGET_BYTES", one_answer // 2)
            alone = stub.SearchBatch(pb.SearchBatchRequest(queries=queries[:2]), timeout=30).results
            assert [item.code for item in alone] == [exhausted.value[0]] * 2
            assert all("ask for fewer hits" in item.message
                       and limits.RESPONSE_FULL_NOTE not in item.message for item in alone)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(queries[0], timeout=30)
            assert err.value.code() == exhausted and "ask for fewer hits" in err.value.details()
            with SearchClient(srv.address, timeout=30) as client:  # refused, and not again
                assert [a.code for a in client.search_batch(queries[:2])] == [exhausted] * 2
    finally:
        srv.stop()


def test_a_shard_message_carries_texts_up_to_its_budget_and_the_rest_as_rows():
    """A shard server's answer to a router shares one room for hit texts across the message's
    results: past it, hits travel as row, chunk id and text fingerprint (the router fetches the
    texts its pages show), and nothing is lost. Before, every text was built into the message
    and gRPC refused it whole (a shard server holding gigabytes for a batch of long texts)."""
    from server.backends.docstore import ChunkRecord
    from server.core.types import Candidate, ShardResult
    from server.transport import codec

    def cand(i):
        rec = ChunkRecord(i, 100 + i, f"d{i}", 0, 0, 10_000, "t", "x" * 10_000, "default", {},
                          ("@all",), 7000 + i)
        return Candidate(rec.chunk_id, 1.0 / (i + 1), rec, 0)

    from server.errors import ResponseTooLarge

    results = [ShardResult(0, "v", [cand(0), cand(1)], []), ShardResult(0, "v", [cand(2)], [cand(3)])]
    one = codec.record_bytes(cand(0).record)
    assert codec.shard_texts_budget(results, 4 * one) is None  # all fits: nothing withheld
    with pytest.raises(ResponseTooLarge, match="without their texts"):
        codec.shard_texts_budget(results, 4 * codec.HIT_BYTES)  # not even the hits' ids fit
    room = codec.shard_texts_budget(results, int(2.6 * one))
    first = codec.shard_result_to_pb(results[0], 0, room)
    second = codec.shard_result_to_pb(results[1], 0, room)
    shipped = list(first.dense) + list(second.dense) + list(second.lexical)
    assert [h.has_text for h in shipped] == [True, True, False, False]
    assert [len(h.text) for h in shipped] == [10_000, 10_000, 0, 0]
    back = codec.shard_result_from_pb(second)
    assert back.dense[0].record.text is None  # the router fetches it
    assert [(c.record.row, c.chunk_id, c.record.text_hash) for c in back.dense + back.lexical] == \
        [(2, 102, 7002), (3, 103, 7003)]


@pytest.mark.parametrize("chunk, messages", [(4, 4), (0, 1)])
def test_a_large_batch_runs_in_chunks_of_one_message_per_shard_with_the_same_answers(
        vector_collection, tmp_path, chunk, messages):
    """With batch_chunk 4, the 14 queries of 16 that parse reach each shard as 4 messages (the
    chunks run at once, so one chunk's assembly overlaps another's search, and each chunk's
    answers are written into their slots as it finishes); with 0 as one. Either way every query
    is answered in its own slot, exactly as a single Search answers it, bad ones failing alone:
    two that do not parse (which shift every later query's place among the chunks) and two the
    pipeline refuses (one of them in the last chunk)."""
    q = vector_collection[3]
    queries = [vreq(v) for v in q[:16]]
    queries[0].mode = 99                                 # refused as it is read
    queries[6].vector.values_f32 = b"12345"              # likewise
    del queries[6].vector.values[:]
    queries[3] = vreq(np.ones(DIM + 1))                  # refused by the pipeline
    queries[13] = vreq(q[0], model="other@1")            # likewise
    bad = (0, 3, 6, 13)
    srv = start_core_server(vector_collection[0], None,  # no cache: every query is searched
                            pipeline={"batch_chunk": chunk, "retrieval_cache_size": 0},
                            storage={"state_dir": tmp_path / "state"})
    calls = []
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            singles = {i: stub.Search(r, timeout=10) for i, r in enumerate(queries) if i not in bad}
            for shard in shards_of(srv, "vec"):
                def counted(batch, timeout=None, inner=shard.search, no=shard.shard_no):
                    calls.append((no, len(batch)))
                    return inner(batch, timeout)
                shard.search = counted
            parts = []  # (first query, answers) as the pipeline hands each part to the servicer
            pipeline_search = srv.core.pipeline.search

            async def noted(queries_, tenant, scopes, deadline, on_part=None):
                def note(first, answers):
                    parts.append((first, len(answers)))
                    on_part(first, answers)
                return await pipeline_search(queries_, tenant, scopes, deadline, note)
            srv.core.pipeline.search = noted
            got = stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30).results
    finally:
        srv.stop()
    # each part is handed over on its own, as it is answered (the servicer encodes it then)
    assert sorted(parts) == ([(0, 4), (4, 4), (8, 4), (12, 2)] if chunk else [(0, 14)])
    assert len(got) == 16
    for i in bad:
        assert got[i].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and got[i].message
        assert not got[i].HasField("response")
    for i, single in singles.items():
        assert got[i].code == 0 and len(single.hits) == 10
        assert [h.chunk_id for h in got[i].response.hits] == [h.chunk_id for h in single.hits]
    for no in (0, 1):
        assert len([n for s, n in calls if s == no]) == messages
        assert sum(n for s, n in calls if s == no) == 12  # every valid query once, none twice


def test_a_chunked_batch_asks_the_shards_for_its_statistics_once(vector_collection, tmp_path):
    """Regression (outside QA): each chunk of a large lexical batch ran its own statistics round
    on a 2-shard collection, concurrently with the other chunks' searches; queued behind them a
    round could pass its budget and leave a whole chunk scored on per-shard statistics (scores
    differing from Search's). One round now serves the whole batch; the chunks still search
    apart, and every answer equals its own Search's."""
    queries = [pb.SearchRequest(collection="vec", text=f"vector document zyxvec{i}", top_k=5,
                                mode=pb.LEXICAL) for i in range(14)]
    srv = start_core_server(vector_collection[0], None,
                            pipeline={"batch_chunk": 4, "retrieval_cache_size": 0},
                            storage={"state_dir": tmp_path / "state"})
    calls = []
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            singles = [stub.Search(r, timeout=10) for r in queries]
            for shard in shards_of(srv, "vec"):
                def counted(batch, timeout=None, inner=shard.search, no=shard.shard_no):
                    calls.append((no, batch[0].stats_only, len(batch)))
                    return inner(batch, timeout)
                shard.search = counted
            got = stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30).results
    finally:
        srv.stop()
    for no in (0, 1):
        assert [n for s, stats, n in calls if s == no and stats] == [14]  # one round for all
        assert sorted(n for s, stats, n in calls if s == no and not stats) == [2, 4, 4, 4]
    for single, answer in zip(singles, got):
        assert answer.code == 0 and len(single.hits) == 5
        assert [(h.chunk_id, h.score) for h in answer.response.hits] == \
            [(h.chunk_id, h.score) for h in single.hits]


def test_a_batch_whose_statistics_take_time_keeps_the_collections_statistics(vector_collection,
                                                                             tmp_path):
    """Outside QA: the statistics round had one 250 ms budget for a whole batch, while counting a
    query's terms walks postings where tenants share a shard (~20 ms a query, cold, on a loaded
    host): a cold batch of 16 left every query on per-shard statistics, 31 of 32 top-10 lists
    unlike Search's. The budget grows with the round's queries; here each query's counts take
    10 ms on each shard, 0.4 s for the batch."""
    import time as _time

    queries = [pb.SearchRequest(collection="vec", text=f"vector document zyxvec{i}", top_k=5,
                                mode=pb.LEXICAL, include_trace=True) for i in range(40)]
    srv = start_core_server(vector_collection[0], None, pipeline={"retrieval_cache_size": 0},
                            storage={"state_dir": tmp_path / "state"})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            singles = [stub.Search(r, timeout=10) for r in queries]
            for shard in shards_of(srv, "vec"):
                lexical = shard.index.lexical

                def slow(*args, inner=lexical.term_stats, **kwargs):
                    _time.sleep(0.01)  # the cost of counting a query's terms, cold
                    return inner(*args, **kwargs)
                lexical.term_stats = slow
            got = stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30).results
    finally:
        srv.stop()
    for single, answer in zip(singles, got):
        assert answer.code == 0
        assert not [n for n in answer.response.trace.notes if "statistics skipped" in n]
        assert [(h.chunk_id, h.score) for h in answer.response.hits] == \
            [(h.chunk_id, h.score) for h in single.hits]


def test_a_batch_above_the_cap_is_refused(vec_server, vector_collection):
    _, stub = vec_server
    q = vector_collection[3]
    with pytest.raises(grpc.RpcError) as err:
        stub.SearchBatch(pb.SearchBatchRequest(queries=[vreq(q[0])] * 1025), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1024" in err.value.details()
    # outside QA: queries that failed to decode were left out before the count, so 1,024 valid
    # ones and any number of undecodable ones got past the cap, and an empty batch answered OK
    undecodable = pb.SearchRequest(collection="vec", mode=9)
    for queries in ([vreq(q[0])] * 1024 + [undecodable], [undecodable] * 1025, []):
        with pytest.raises(grpc.RpcError) as err:
            stub.SearchBatch(pb.SearchBatchRequest(queries=queries), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("1025 queries" in err.value.details() if queries
                else "at least one query" in err.value.details())


def test_the_builder_takes_vectors_from_the_command_line(tmp_path):
    rng = np.random.default_rng(1)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"doc {i}"}) + "\n" for i in range(300)))
    np.save(tmp_path / "v.npy", rng.standard_normal((300, 16)).astype(np.float32))
    np.save(tmp_path / "wrong.npy", rng.standard_normal((299, 16)).astype(np.float32))

    def build(vectors, *extra):
        return subprocess.run([sys.executable, "-m", "index_builder.cli", "build", "--data-dir",
                               str(tmp_path / "data"), "--collection", "cli", "--corpus", str(corpus),
                               "--vectors", str(vectors), "--quiet", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    out = build(tmp_path / "wrong.npy", "--model-id", "m@1")
    assert out.returncode == 2 and "299 vectors for a corpus of 300 records" in out.stderr
    out = build(tmp_path / "v.npy")
    assert out.returncode == 2 and "--model-id" in out.stderr
    out = build(tmp_path / "v.npy", "--model-id", "m@1", "--publish")
    assert out.returncode == 0, out.stderr
    assert "model m@1" in out.stdout and "published" in out.stdout
    assert "held-in" in out.stdout  # no held-out queries were given: the audit says so
    # ... and a later audit can use held-out query vectors from a file (outside QA: it took a
    # count only, so a build made without them could never be audited on unseen queries)
    np.save(tmp_path / "q.npy", rng.standard_normal((40, 16)).astype(np.float32))
    audit = [sys.executable, "-m", "index_builder.cli", "audit", "--data-dir", str(tmp_path / "data"),
             "--collection", "cli", "--no-record", "--min-recall", "0"]
    out = subprocess.run([*audit, "--audit-queries", str(tmp_path / "q.npy")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["query_source"] == "held-out (given)" and report["queries"] == 40
    np.save(tmp_path / "q8.npy", rng.standard_normal((40, 8)).astype(np.float32))
    out = subprocess.run([*audit, "--audit-queries", str(tmp_path / "q8.npy")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "audit queries must be an (n, 16) array" in out.stderr, out.stderr
    (tmp_path / "cut.npy").write_bytes((tmp_path / "q.npy").read_bytes()[:-7])  # (was a traceback)
    out = subprocess.run([*audit, "--audit-queries", str(tmp_path / "cut.npy")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"--audit-queries {tmp_path / 'cut.npy'}: not a numeric .npy array" in out.stderr


def test_a_skipped_record_keeps_its_vector_row_with_or_without_a_limit(tmp_path):
    """Regression (outside QA): the reader skips a record with no text, and the builder paired
    the documents after it with the vectors of the records before them (`--limit` sliced the
    file by documents kept, not by records): a search with a document's own vector found its
    neighbour at score 1. Row i of --vectors now always belongs to record i."""
    import sqlite3

    rng = np.random.default_rng(3)
    empty = {5, 30}
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": "" if i in empty else f"doc {i}"})
                              + "\n" for i in range(60)))
    vectors = rng.standard_normal((60, 8)).astype(np.float32)
    np.save(tmp_path / "v.npy", vectors)
    np.save(tmp_path / "short.npy", vectors[:58])  # one row per document kept: not records

    def build(name, vectors_file, *extra):
        return subprocess.run([sys.executable, "-m", "index_builder.cli", "build", "--data-dir",
                               str(tmp_path / "data"), "--collection", name, "--corpus", str(corpus),
                               "--vectors", str(vectors_file), "--model-id", "m", "--quiet",
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=300)

    def stored(name):
        shard = next((tmp_path / "data" / name / "builds").glob("*/shard-000"))
        con = sqlite3.connect(f"file:{shard / 'docstore.sqlite'}?immutable=1", uri=True)
        rows = dict(con.execute("select row, doc_id from chunks"))
        con.close()
        return rows, np.load(shard / "vectors.npy")

    for name, extra, kept in (("limited", ("--limit", "40"), 40), ("whole", (), 58)):
        out = build(name, tmp_path / "v.npy", *extra)
        assert out.returncode == 0, out.stderr
        rows, got = stored(name)
        assert len(rows) == kept
        for row, doc_id in rows.items():
            want = vectors[int(doc_id[1:])]
            assert np.allclose(got[row], want / np.linalg.norm(want), atol=1e-6), doc_id
    out = build("short", tmp_path / "short.npy")
    assert out.returncode == 2
    assert "58 vectors for a corpus of 60 records (2 skipped for having no text)" in out.stderr


def test_own_vectors_of_no_dimension_ragged_or_given_twice_are_refused_by_name(tmp_path):
    """Outside QA: (n, 0) vectors built a 0-dimensional collection under l2, ragged `vector`
    fields failed with numpy's "inhomogeneous shape" naming nothing, and `vector` fields beside
    --vectors were silently ignored."""
    from index_builder.build import build_collection
    from index_builder.cli import vectors_of_records
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    store = CollectionStore(tmp_path / "data")
    docs = [Document("a", "first", record=0), Document("b", "second", record=1)]
    with pytest.raises(ValueError, match="dimension 0"):
        build_collection(docs, store, "z", None, "Flat", metric="l2", quiet=True,
                         vectors=np.zeros((2, 0), np.float32), model_id="m")
    ragged = [Document("a", "first", vector=[1.0, 0.0, 0.0]), Document("b", "second", vector=[0.0, 1.0])]
    with pytest.raises(ValueError, match="document 'b' has a vector of dimension 2 and document "
                                         "'a' one of 3"):
        build_collection(ragged, store, "r", None, "Flat", quiet=True, model_id="m")
    with pytest.raises(ValueError, match="`vector` fields and --vectors"):
        vectors_of_records(np.ones((2, 3), np.float32), ragged, {"records": 2})
    # outside QA: finite float64 values past float32's range were reported as "NaN or infinite"
    # (the cast made them inf), and booleans passed for numbers (stored as 1.0 and 0.0)
    huge = [Document("a", "first", vector=[2.4e200, 1.0]), Document("b", "second", vector=[1.0, 0.0])]
    with pytest.raises(ValueError, match=r"document 'a' \(row 0\) has values beyond float32's range"):
        build_collection(huge, store, "h", None, "Flat", quiet=True, model_id="m")
    with pytest.raises(ValueError, match="beyond float32's range"):
        build_collection(docs, store, "h", None, "Flat", quiet=True, model_id="m",
                         vectors=np.array([[1.0, 0.0], [0.0, -1e39]]))
    with pytest.raises(ValueError, match="NaN or infinite"):
        build_collection(docs, store, "h", None, "Flat", quiet=True, model_id="m",
                         vectors=np.array([[1.0, 0.0], [np.inf, 0.0]]))
    flags = [Document("a", "first", vector=[True, False]), Document("b", "second", vector=[False, True])]
    with pytest.raises(ValueError, match="document 'a' has a vector holding booleans"):
        build_collection(flags, store, "h", None, "Flat", quiet=True, model_id="m")
    mixed = [Document("a", "first", vector=[1.0, 0.5]), Document("b", "second", vector=[True, 0.5])]
    with pytest.raises(ValueError, match="document 'b' has a vector holding booleans"):
        build_collection(mixed, store, "h", None, "Flat", quiet=True, model_id="m")
    assert not list((tmp_path / "data").glob("*/builds/*"))
    corpus = tmp_path / "bools.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "first", "vector": [True, False]}) + "\n")
    from index_builder.corpus import read_corpus
    with pytest.raises(ValueError, match="vector must be a non-empty list of numbers"):
        list(read_corpus(corpus))


def test_the_builder_takes_vectors_from_the_corpus_lines(tmp_path):
    """Regression (outside QA): a corpus whose lines carry a `vector` field (the documented form)
    failed with --model-id ("a text build needs an embedder") and, without it, built a
    collection of model None that no query vector could search."""
    rng = np.random.default_rng(2)
    corpus = tmp_path / "v.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"doc {i}",
                                          "vector": rng.standard_normal(16).round(4).tolist()}) + "\n"
                              for i in range(300)))

    def build(*extra):
        return subprocess.run([sys.executable, "-m", "index_builder.cli", "build", "--data-dir",
                               str(tmp_path / "data"), "--collection", "vf", "--corpus", str(corpus),
                               "--quiet", *extra], cwd=REPO, capture_output=True, text=True, timeout=300)

    out = build("--embedder", "none-needed")  # no --model-id: refused before any model loads
    assert out.returncode == 2 and "needs --model-id" in out.stderr, out.stderr
    assert not list((tmp_path / "data").glob("vf/builds/*"))
    out = build("--model-id", "m@2", "--publish")
    assert out.returncode == 0, out.stderr
    assert "model m@2" in out.stdout and "300 documents, 300 chunks" in out.stdout


def test_the_client_sends_more_queries_than_one_batch_holds_and_keeps_their_order(vec_server,
                                                                                 vector_collection):
    """SearchClient.search_batch splits at the server's cap (1024) and answers in request order,
    each answer equal to that query's own Search; an invalid query fails in its slot only."""
    from server.client import SearchClient, request

    srv, stub = vec_server
    q = vector_collection[3]
    vectors = [q[i % len(q)] for i in range(1100)]
    reqs = [request(collection="vec", mode="dense", top_k=5, vector=v, model_id=MODEL) for v in vectors]
    reqs[1050] = request(collection="vec", mode="dense", top_k=5, vector=vectors[0], model_id="other@1")
    with SearchClient(srv.address) as client:
        results = list(client.search_batch(reqs, timeout=60))
        single = {i: [h.chunk_id for h in client.search(collection="vec", mode="dense", top_k=5,
                                                        vector=q[i], model_id=MODEL).hits]
                  for i in range(len(q))}
    assert len(results) == 1100
    assert results[1050].code == grpc.StatusCode.INVALID_ARGUMENT and "other@1" in results[1050].message
    for i, res in enumerate(results):
        if i != 1050:
            assert res.ok and [h.chunk_id for h in res.response.hits] == single[i % len(q)], i


def test_a_batch_whose_answer_is_over_the_message_limit_is_split_not_failed(vec_server,
                                                                           vector_collection):
    """An answer larger than the client's receive limit (RESOURCE_EXHAUSTED for the whole call)
    is asked for again in halves until each fits: every query still gets its own answer."""
    from server.client import SearchClient, request

    srv, _ = vec_server
    q = vector_collection[3]
    reqs = [request(collection="vec", mode="dense", top_k=50, vector=q[i % len(q)], model_id=MODEL)
            for i in range(64)]
    with SearchClient(srv.address) as roomy:
        whole = list(roomy.search_batch(reqs, timeout=60))
    one_answer = whole[0].response.ByteSize()
    with SearchClient(srv.address, max_answer_bytes=one_answer * 10) as tight:
        with pytest.raises(grpc.RpcError) as err:  # the unsplit call really is over the limit
            tight.stub.SearchBatch(pb.SearchBatchRequest(queries=reqs), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        split = list(tight.search_batch(reqs, timeout=60))
    assert [r.ok for r in split] == [True] * 64
    assert [[h.chunk_id for h in r.response.hits] for r in split] == \
        [[h.chunk_id for h in r.response.hits] for r in whole]


@contextlib.contextmanager
def peer_search_server(servicer, threads):
    """A real gRPC server running `servicer` (a stand-in for a search server) on a free port;
    yields its address."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(threads))
    pb_grpc.add_SearchServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_the_client_sends_again_what_did_not_fit_in_calls_it_can_answer_in_order():
    """A server whose responses fit one answer each (answers near the size limit): the client
    sends the refused queries again, as many per call as the last call fitted, until each is
    answered - 1,024 queries, 1,024 calls, in order, with no recursion (review: one level of
    recursion per call raised RecursionError near 1,000). With per_query_errors, a call that
    fails midway marks only the queries it carried; answers already in hand stay."""
    from server.client import SearchClient, request
    from server.core.limits import RESPONSE_FULL_NOTE

    calls = []

    class OneAtATime(pb_grpc.SearchServiceServicer):
        fail_at = None

        def SearchBatch(self, req, context):
            calls.append([q.collection for q in req.queries])
            if len(calls) == self.fail_at:
                context.abort(grpc.StatusCode.INTERNAL, "a bug, this once")  # not retried
            first, *rest = req.queries
            return pb.SearchBatchResponse(results=[
                pb.SearchBatchItem(response=pb.SearchResponse(build_id=first.collection))] + [
                pb.SearchBatchItem(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                   message=f"did not fit ({RESPONSE_FULL_NOTE}, 64 MiB)")
                for _ in rest])

    servicer = OneAtATime()
    with peer_search_server(servicer, 2) as address:
        reqs = [request(collection=f"c{i}", vector=[1.0], model_id=MODEL) for i in range(1024)]
        with SearchClient(address) as client:
            answers = list(client.search_batch(reqs))
            assert [a.response.build_id for a in answers] == [f"c{i}" for i in range(1024)]
            assert len(calls) == 1024 and all(len(c) == 1 for c in calls[1:])
            calls.clear()
            servicer.fail_at = 3  # the third call fails: its query alone is marked
            answers = list(client.search_batch(reqs[:5], batch_size=5, per_query_errors=True))
            assert [a.ok for a in answers] == [True, True, False, True, True]
            assert answers[2].call_failed and answers[2].code == grpc.StatusCode.INTERNAL
            assert [a.response.build_id for a in answers if a.ok] == ["c0", "c1", "c3", "c4"]


def test_a_batch_refused_for_load_is_retried_whole_with_backoff_not_split():
    """Regression (outside QA): the client split a batch in halves on any RESOURCE_EXHAUSTED, so
    a server refusing for load ("retry with backoff") got 73 calls at once for 10 batches of
    64. Only gRPC's own message-size refusal splits. A refusal for load (or UNAVAILABLE, a server
    draining) is retried as asked - the same queries, one attempt at a time, 5 attempts at most
    - so a server that has room again answers them (outside QA: a file of queries failed on the
    first refusal). The batch is a full one with its vectors, 1.6 MB: gRPC's own retries buffer
    256 KiB of a call and sent a larger one once (review). The peer is a real gRPC server that
    refuses SearchBatch as an overloaded search server does, `refusals` times, then answers."""
    import threading

    from server.client import SearchClient, request

    calls, at_once, lock = [], [0, 0], threading.Lock()  # at_once: now, most

    class Overloaded(pb_grpc.SearchServiceServicer):
        refusals = 0
        code = grpc.StatusCode.RESOURCE_EXHAUSTED

        def SearchBatch(self, req, context):
            with lock:
                calls.append(len(req.queries))
                at_once[0] += 1
                at_once[1] = max(at_once)
            try:
                if len(calls) <= self.refusals:
                    context.abort(self.code, "1 requests in flight (limit 1); retry with backoff")
                return pb.SearchBatchResponse(results=[
                    pb.SearchBatchItem(response=pb.SearchResponse(build_id=q.collection))
                    for q in req.queries])
            finally:
                with lock:
                    at_once[0] -= 1

    servicer = Overloaded()
    with peer_search_server(servicer, 4) as address:
        reqs = [request(collection=f"c{i}", vector=[1.0] * 384, model_id=MODEL)
                for i in range(1024)]
        assert pb.SearchBatchRequest(queries=reqs).ByteSize() > 1_500_000
        with SearchClient(address) as client:
            servicer.refusals = 10**6  # refused for good: the caller hears it after 5 attempts
            with pytest.raises(grpc.RpcError) as err:
                list(client.search_batch(reqs, timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "backoff" in err.value.details()
            assert calls == [1024] * 5 and at_once[1] == 1
            for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                calls.clear()
                servicer.refusals, servicer.code = 2, code  # room again after two refusals
                answers = list(client.search_batch(reqs, timeout=30))
                assert calls == [1024] * 3 and at_once[1] == 1, code
                assert [a.response.build_id for a in answers] == [f"c{i}" for i in range(1024)]
            calls.clear()
            servicer.refusals = 10**6  # a deadline too short for the next wait: no more attempts
            with pytest.raises(grpc.RpcError):
                list(client.search_batch(reqs, timeout=0.25))
            assert 1 <= len(calls) <= 2
            with pytest.raises(ValueError, match="positive"):
                client.search("x", collection="vec", timeout=0)


def test_a_file_of_queries_keeps_one_line_per_query_when_a_call_fails(tmp_path):
    """Outside QA: a `--queries` run whose second call failed as a whole left 1,024 lines of
    2,600 and said nothing of the rest; there was no way to send smaller calls after "send
    smaller batches"; `--timeout inf` (or 1e10) went out as a deadline gRPC took for past, an
    immediate DEADLINE_EXCEEDED. Now a failed call writes its queries' lines with its status and
    the next calls are made; three failed calls in a row stop the run, saying how many were not
    sent; --batch-size cuts the calls; a timeout over a day is refused before any call. The peer
    is a real gRPC server that fails the calls listed in `failing` (1-based) as a whole."""
    from concurrent import futures

    from server.client import SearchClient

    calls = []

    class Flaky(pb_grpc.SearchServiceServicer):
        failing: set = set()

        def SearchBatch(self, req, context):
            calls.append([q.text for q in req.queries])
            if len(calls) in self.failing:
                context.abort(grpc.StatusCode.INTERNAL, f"call {len(calls)} broke")
            return pb.SearchBatchResponse(results=[
                pb.SearchBatchItem(response=pb.SearchResponse(
                    hits=[pb.SearchHit(doc_id=q.text, chunk_id=1, score=1.0)]))
                for q in req.queries])

    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_SearchServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    queries = tmp_path / "q.txt"
    queries.write_text("".join(f"q{i}\n" for i in range(1, 8)))  # ids 1-7
    out = tmp_path / "out.jsonl"

    def run(*extra):
        calls.clear()
        out.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-m", "server.client", "--address",
                               f"127.0.0.1:{port}", "--queries", str(queries), "--out", str(out),
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        return proc, [(r["id"], r["code"], r.get("message") or r["hits"][0]["doc_id"])
                      for r in rows]

    try:
        servicer.failing = {2}
        proc, rows = run("--batch-size", "2")
        assert proc.returncode == 1, proc.stderr
        assert calls == [["q1", "q2"], ["q3", "q4"], ["q5", "q6"], ["q7"]]
        assert rows == [("1", "OK", "q1"), ("2", "OK", "q2"), ("3", "INTERNAL", "call 2 broke"),
                        ("4", "INTERNAL", "call 2 broke"), ("5", "OK", "q5"), ("6", "OK", "q6"),
                        ("7", "OK", "q7")]
        assert "queries 3-4 failed: INTERNAL: call 2 broke" in proc.stderr
        assert "7 queries in" in proc.stderr and "5 OK, 2 INTERNAL" in proc.stderr

        servicer.failing = {1, 2, 3, 4}  # gone: three calls fail, the fourth is never made
        proc, rows = run("--batch-size", "2")
        assert proc.returncode == 1 and len(calls) == 3
        assert [r[:2] for r in rows] == [(str(i), "INTERNAL") for i in range(1, 7)]
        assert "3 calls in a row failed; the other 1 queries were not sent" in proc.stderr
        assert "6 INTERNAL, 1 not sent" in proc.stderr

        servicer.failing = set()
        proc, rows = run()  # by default one call holds them all
        assert proc.returncode == 0 and len(calls) == 1 and [r[1] for r in rows] == ["OK"] * 7

        for flags, said in ((["--timeout", "inf"], "up to 86400"),
                            (["--timeout", "1e10"], "up to 86400"),
                            (["--batch-size", "0"], "from 1 to 1024"),
                            (["--batch-size", "1025"], "from 1 to 1024")):
            proc, rows = run(*flags)
            assert proc.returncode == 2 and said in proc.stderr, (flags, proc.stderr)
            assert "Traceback" not in proc.stderr and calls == [] and rows == []
        proc = subprocess.run([sys.executable, "-m", "server.client", "--address",
                               f"127.0.0.1:{port}", "--batch-size", "2", "q"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "--batch-size cuts the calls of --queries" in proc.stderr
        with pytest.raises(ValueError, match="up to 86400"):
            SearchClient(f"127.0.0.1:{port}", timeout=float("inf"))
        with SearchClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(ValueError, match="up to 86400"):
                list(client.search_batch([pb.SearchRequest(text="x")], timeout=1e10))
            with pytest.raises(ValueError, match="batch_size must be 1 to 1024"):
                list(client.search_batch([pb.SearchRequest(text="x")], batch_size=0))
        assert calls == []
    finally:
        server.stop(None)


def test_the_client_leaves_the_mode_to_the_server_unless_told(vec_server, vector_collection):
    """Regression (outside QA): the client sent HYBRID unless told otherwise, so the documented
    vector-only query (`search(vector=..., model_id=...)`) failed with "mode hybrid needs a
    non-empty query text"; unset, the server picks (dense for a vector alone)."""
    from server.client import SearchClient, request

    srv, _ = vec_server
    q = vector_collection[3][0]
    assert request(collection="vec").mode == pb.SEARCH_MODE_UNSPECIFIED
    with SearchClient(srv.address) as client:
        plain = client.search(collection="vec", vector=q, model_id=MODEL, top_k=5)
        dense = client.search(collection="vec", vector=q, model_id=MODEL, top_k=5, mode="dense")
    assert [h.chunk_id for h in plain.hits] == [h.chunk_id for h in dense.hits] and len(plain.hits) == 5
    assert plain.hits[0].score_kind == pb.COSINE_SIMILARITY


def test_search_client_answers_a_file_of_queries(server, tmp_path):
    """`search-client --queries FILE` (plain lines and BEIR-style JSONL) writes one JSON line per
    query in order; a query the server refuses is reported in its line and the exit code is 1."""
    plain = tmp_path / "q.txt"
    plain.write_text("slip flow\n\nboundary layer heat transfer\n")
    beir = tmp_path / "q.jsonl"
    beir.write_text(json.dumps({"_id": "a", "text": "supersonic wing"}) + "\n"
                    + json.dumps({"_id": "b", "text": ""}) + "\n")  # empty text: refused in its slot

    def run(path, *extra):
        out = tmp_path / f"{path.stem}.out.jsonl"
        proc = subprocess.run([sys.executable, "-m", "server.client", "--address", server.address,
                               "--collection", "cran", "--queries", str(path), "--out", str(out),
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        return proc, rows

    proc, rows = run(plain, "--mode", "lexical")
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in rows] == ["1", "3"] and all(r["code"] == "OK" and r["hits"] for r in rows)
    stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(server.address))
    direct = stub.Search(pb.SearchRequest(collection="cran", text="slip flow", top_k=5,
                                          mode=pb.LEXICAL), timeout=10)
    assert [h["chunk_id"] for h in rows[0]["hits"]] == [h.chunk_id for h in direct.hits]
    assert "2 queries" in proc.stderr and "2 OK" in proc.stderr

    # outside QA: --trace was ignored with --queries; each line now carries its query's trace
    proc, traced = run(plain, "--mode", "lexical", "--trace")
    assert proc.returncode == 0, proc.stderr
    assert [r["hits"] for r in traced] == [r["hits"] for r in rows]
    t = traced[0]["trace"]
    assert "dense" not in t  # the retriever a lexical query did not use
    assert [i["chunk_id"] for i in t["context"]] == [h["chunk_id"] for h in rows[0]["hits"]]
    assert [i["rank"] for i in t["lexical"][:3]] == [1, 2, 3] and "notes" in t

    proc, rows = run(beir)
    assert proc.returncode == 1
    assert [(r["id"], r["code"]) for r in rows] == [("a", "OK"), ("b", "INVALID_ARGUMENT")]
    assert rows[1]["message"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 3}\n')
    proc, _ = run(bad)
    assert proc.returncode == 2 and "bad.jsonl:1" in proc.stderr
    # regression (outside QA): an unwritable --out ended in a traceback
    proc = subprocess.run([sys.executable, "-m", "server.client", "--address", server.address,
                           "--collection", "cran", "--queries", str(plain), "--out",
                           str(tmp_path / "no-such-dir" / "x.jsonl")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "cannot write" in proc.stderr and "Traceback" not in proc.stderr
    # regression (outside QA): --timeout 0 ended in a traceback and -1 was sent as a deadline
    for t in ("0", "-1"):
        proc, _ = run(plain, "--timeout", t)
        assert proc.returncode == 2 and "positive number of seconds" in proc.stderr
        assert "Traceback" not in proc.stderr
    # outside QA: a file without queries exited 0 as if every query had answered
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    proc, rows = run(blank)
    assert proc.returncode == 2 and "holds no queries" in proc.stderr and rows == []
    # outside QA: --out beside one query was ignored
    proc = subprocess.run([sys.executable, "-m", "server.client", "--address", server.address,
                           "--collection", "cran", "slip flow", "--out", str(tmp_path / "one.jsonl")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--out writes the answers of --queries" in proc.stderr
    # outside QA: `search-client ... | head` ended in a BrokenPipeError traceback
    reader_gone = subprocess.Popen([sys.executable, "-m", "server.client", "--address",
                                    server.address, "--collection", "cran", "slip flow", "--trace"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()
    err = reader_gone.stderr.read().decode()
    assert reader_gone.wait(120) == 0 and "Traceback" not in err and "BrokenPipe" not in err


def test_the_printed_trace_says_why_a_passage_was_dropped(capsys):
    """Outside QA: `search-client --trace` printed dropped passages as `doc#0`, without the
    reason the response carries, and an empty `trace dense:` line for a lexical query."""
    from server.client import _print_response

    resp = pb.SearchResponse(build_id="b1", timings=[pb.StageTiming(stage="lexical", ms=1.0)],
                             hits=[pb.SearchHit(doc_id="d1", score=2.0, score_kind=pb.BM25,
                                                lexical=pb.RetrieverScore(rank=1, score=2.0))],
                             trace=pb.SearchTrace(lists=[
        pb.TraceList(name="dense"),
        pb.TraceList(name="lexical", items=[pb.TraceItem(doc_id="d1", rank=1, score=2.0),
                                            pb.TraceItem(doc_id="d2", rank=2, score=2.0)]),
        pb.TraceList(name="dropped", items=[pb.TraceItem(doc_id="d2", chunk_id=7,
                                                         reason="duplicate_of:5")])],
        notes=["a note"]))
    _print_response(resp, "c", trace=True)
    out = capsys.readouterr().out
    assert "trace dense" not in out and "dense #" not in out and "[bm25 2.0000, lexical #1]" in out
    assert "trace lexical: d1#1, d2#2" in out
    assert "trace dropped: d2 (duplicate_of:5)" in out and "note: a note" in out


def test_a_plain_query_file_may_have_lines_that_start_with_a_brace(tmp_path):
    """Regression (outside QA): one plain-text query starting with "{" made the whole file fail
    as invalid JSON. The first non-blank line decides the format."""
    from server.client import read_queries

    plain = tmp_path / "q.txt"
    plain.write_text("boundary layer\n{curly} braces in a query\n")
    assert read_queries(plain) == [("1", "boundary layer"), ("2", "{curly} braces in a query")]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"_id": "a", "text": "one"}\nnot json\n')
    with pytest.raises(ValueError, match="q.jsonl:2: not valid JSON"):
        read_queries(jsonl)


def test_the_length_of_a_query_vector_changes_nothing(vec_server, vector_collection):
    """The collection ranks by cosine: a query vector scaled by 1e-4, 1e4 or to the edge of float32
    gets the same hits and scores as the unit vector, in dense and in hybrid mode (whose dense
    feedback mixes the query vector with stored ones: a long vector used to drown the feedback, a
    short one to be replaced by it); a zero vector has no direction and is refused."""
    _, stub = vec_server
    u = vector_collection[3][7].astype(np.float64)
    u /= np.linalg.norm(u)

    def answer(v, mode):
        req = vreq(v)
        req.mode = mode
        if mode == pb.HYBRID:
            req.text = "vector document number"
        r = stub.Search(req, timeout=10)
        return [(h.chunk_id, round(h.score, 4), round(h.dense.score, 4)) for h in r.hits]

    for mode in (pb.DENSE, pb.HYBRID):
        unit = answer(u, mode)
        assert len(unit) == 10 and all(d <= 1.0 + 1e-5 for _, _, d in unit)
        for scale in (1e-4, 1e4):
            assert answer(u * scale, mode) == unit, (mode, scale)
    huge = np.full(DIM, 3e38)  # finite, but its squared length overflows float32
    assert answer(huge, pb.DENSE) == answer(np.ones(DIM), pb.DENSE)
    assert all(np.isfinite(s) for _, s, _ in answer(huge, pb.DENSE))
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(vreq(np.zeros(DIM)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "zeros" in err.value.details()


def test_a_long_chunk_vector_cannot_outrank_everything(vec_server, vector_collection):
    """Written chunk vectors are scaled to unit length like built ones: a document written with a
    vector 100 times too long scores its cosine (1.0 for its own direction), not 100, and does not
    take the first place for queries it is not near; a zero chunk vector is refused and changes
    nothing."""
    _, stub = vec_server
    q = vector_collection[3]
    w = q[3].astype(np.float64) / np.linalg.norm(q[3])
    before = {i: [h.doc_id for h in stub.Search(vreq(q[i]), timeout=10).hits] for i in range(20)}
    req = pb.UpsertDocumentRequest(collection="vec", doc_id="long-1", version=1, vector_model_id=MODEL,
                                   chunks=[pb.ChunkInput(text="zyxlong", vector=(100 * w).tolist())])
    assert stub.UpsertDocument(req, timeout=10).outcome == pb.WriteResponse.APPLIED
    own = stub.Search(vreq(w, top_k=1), timeout=10).hits[0]
    assert own.doc_id == "long-1" and abs(own.score - 1.0) < 1e-4
    for i in range(20):
        hits = stub.Search(vreq(q[i]), timeout=10).hits
        assert max(h.score for h in hits) <= 1.0 + 1e-5
        if "long-1" not in [h.doc_id for h in hits]:
            assert [h.doc_id for h in hits] == before[i]  # nowhere near: nothing moved
    zero = pb.UpsertDocumentRequest(collection="vec", doc_id="zero-1", version=1, vector_model_id=MODEL,
                                    chunks=[pb.ChunkInput(text="zyxzero", vector=[0.0] * DIM)])
    with pytest.raises(grpc.RpcError) as err:
        stub.UpsertDocument(zero, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "zeros" in err.value.details()
    assert stub.Search(pb.SearchRequest(collection="vec", text="zyxzero", top_k=5, mode=pb.LEXICAL),
                       timeout=10).hits == []


def test_a_build_scales_its_own_vectors_to_unit_length_and_names_a_zero_one(tmp_path):
    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    rng = np.random.default_rng(2)
    x = rng.standard_normal((200, 8)).astype(np.float32) * rng.uniform(0.01, 100, (200, 1)).astype(np.float32)
    docs = [Document(f"s{i}", f"scaled {i}") for i in range(200)]
    store = CollectionStore(tmp_path / "data")
    desc = build_collection(docs, store, "scaled", None, "Flat", quiet=True, vectors=x, model_id="m@1")
    index = faiss.read_index(str(store.build_dir("scaled", desc.build_id) / "shard-000" / "dense.faiss"))
    stored = index.reconstruct_n(0, index.ntotal)
    assert np.allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-5)
    x[17] = 0
    with pytest.raises(ValueError, match="document 's17'.*all zeros"):
        build_collection(docs, store, "scaled", None, "Flat", quiet=True, vectors=x, model_id="m@1")


def test_an_l2_collection_keeps_lengths_and_refuses_vectors_whose_distances_overflow():
    from server.core import limits
    from server.core.validation import unit_vectors
    from server.errors import InvalidArgument

    v = np.array([[3.0, 4.0], [1e17, 0.0]], np.float32)
    assert np.array_equal(unit_vectors(v, "l2"), v)          # lengths are the distance: kept
    with pytest.raises(InvalidArgument, match=r"chunk vector \(row 1\) has length"):
        unit_vectors(np.array([[3.0, 4.0], [limits.MAX_VECTOR_NORM * 2, 0.0]]), "l2", "chunk vector")
    assert np.allclose(unit_vectors(v, "ip"), [[0.6, 0.8], [1.0, 0.0]])


def test_an_l2_collection_refuses_too_long_vectors_over_grpc_and_changes_nothing(tmp_path):
    """Through the service: an l2 collection answers INVALID_ARGUMENT for a query or a chunk
    vector longer than the cap (its float32 distances would overflow), and stays as it was."""
    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core import limits
    from server.core.collection import CollectionStore

    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, DIM)).astype(np.float32)
    store = CollectionStore(tmp_path / "data")
    desc = build_collection([Document(f"l{i}", f"l2 doc {i}") for i in range(200)], store, "lvec",
                            None, "Flat", metric="l2", quiet=True, vectors=x, model_id=MODEL)
    store.publish("lvec", desc.build_id, require_audit=False)
    long = np.zeros(DIM)
    long[0] = limits.MAX_VECTOR_NORM * 10
    srv = start_core_server(tmp_path / "data", None)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            ok = stub.Search(pb.SearchRequest(collection="lvec", top_k=3, mode=pb.DENSE,
                                              vector=pb.QueryVector(values=x[5].tolist(), model_id=MODEL)),
                             timeout=10)
            assert ok.hits[0].doc_id == "l5"
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(pb.SearchRequest(collection="lvec", top_k=3, mode=pb.DENSE,
                                             vector=pb.QueryVector(values=long.tolist(), model_id=MODEL)),
                            timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cap" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.UpsertDocument(pb.UpsertDocumentRequest(
                    collection="lvec", doc_id="too-long", version=1, vector_model_id=MODEL,
                    chunks=[pb.ChunkInput(text="zyxtoolong", vector=long.tolist())]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cap" in err.value.details()
            assert stub.Search(pb.SearchRequest(collection="lvec", text="zyxtoolong", top_k=3,
                                                mode=pb.LEXICAL), timeout=10).hits == []
    finally:
        srv.stop()


def test_an_l2_collection_fuses_and_reports_scores_higher_is_better(tmp_path):
    """Regression (outside QA): an l2 shard negates its distances (higher is better), but min-max
    fusion flipped the dense list of an l2 collection once more, so its farthest candidate
    counted as the nearest; and the API said "lower is better" beside negated distances. Now
    a document's own vector fuses to itself first, and every hit says higher is better."""
    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import Document
    from server.core import metrics
    from server.core.collection import CollectionStore

    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 8)).astype(np.float32)
    docs = [Document(f"e{i}", f"euclid note zyxdoc{i}") for i in range(300)]
    store = CollectionStore(tmp_path / "data")
    desc = build_collection(docs, store, "euc", None, "Flat", metric="l2", quiet=True, vectors=x,
                            model_id="m@1")
    audit_build(store, "euc", desc.build_id)
    store.publish("euc", desc.build_id)
    srv = start_core_server(tmp_path / "data", pipeline={"retrieval_cache_size": 0})
    assembly = metrics.STAGE_SECONDS.labels("assembly")
    try:
        stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(srv.address))
        for i in (3, 77, 150):
            v = pb.QueryVector(values=x[i].tolist(), model_id="m@1")
            dense = stub.Search(pb.SearchRequest(collection="euc", vector=v, top_k=5, mode=pb.DENSE),
                                timeout=10)
            assert dense.hits[0].doc_id == f"e{i}" and abs(dense.hits[0].score) < 1e-4
            assert all(h.higher_is_better and h.score_kind == pb.L2_DISTANCE for h in dense.hits)
            scores = [h.score for h in dense.hits]
            assert scores == sorted(scores, reverse=True) and max(scores) <= 1e-4
            before = assembly._sum.get()
            fused = stub.Search(pb.SearchRequest(collection="euc", vector=v, text=f"zyxdoc{i}",
                                                 top_k=5, mode=pb.HYBRID, dense_weight=0.9,
                                                 fusion=pb.FUSION_MIN_MAX, feedback_docs=0),
                                timeout=10)
            assert fused.hits[0].doc_id == f"e{i}"
            # the assembly stage is observed in seconds (it was divided by 1,000 once more)
            took_s = {t.stage: t.ms for t in fused.timings}["assembly"] / 1e3
            assert assembly._sum.get() - before == pytest.approx(took_s, rel=0.05, abs=1e-6)
            # hybrid with dense feedback (the default): the moved query keeps its length under
            # l2 (it was scaled to unit length, off the data: 53 of 300 stayed first)
            rrf = stub.Search(pb.SearchRequest(collection="euc", vector=v, text=f"zyxdoc{i}",
                                               top_k=5, mode=pb.HYBRID, include_trace=True),
                              timeout=10)
            assert any(n.startswith("dense feedback") for n in rrf.trace.notes)
            assert rrf.hits[0].doc_id == f"e{i}" and rrf.hits[0].dense.rank == 1
    finally:
        srv.stop()


def test_canary_check_of_your_own_vectors_checks_lexical_and_names_what_it_skipped(vec_server):
    """Outside QA: on a server without an embedding model (your own vectors) the canary check
    died on its first dense text query with a traceback and exit 1, the status of a leak. It now
    checks what the server can answer (lexical), says which modes it could not and why, and a
    failure to check at all is an error (exit 2), never a verdict."""
    from index_builder.canary import find_leaks

    srv, _ = vec_server
    skipped: dict = {}
    queries, leaks = find_leaks(srv.address, "vec", [{"tenant": "default", "token": "-"}],
                                ["zyxvec7"], skipped=skipped)
    assert set(skipped) == {"DENSE", "HYBRID"} and all(skipped.values())
    assert queries > 0 and leaks and all("LEXICAL" in leak for leak in leaks)  # v7 holds it
    with pytest.raises(ValueError, match="NOT_FOUND"):
        find_leaks(srv.address, "no-such-collection", [{"tenant": "default", "token": "-"}],
                   ["zyxvec7"])


def test_a_query_file_with_a_byte_order_mark_or_bytes_not_utf8_is_read_or_named(tmp_path):
    """Regression (outside QA): a JSONL file saved with a UTF-8 byte-order mark was read as plain
    text - every raw JSON line sent as a query, ids replaced by line numbers, exit 0; a byte
    that is not UTF-8 failed the run naming neither the file nor the line."""
    from server.client import read_queries

    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"_id": "q-heat", "text": "heat transfer"}\n'
                    b'{"_id": "q-wing", "text": "wing"}\n')
    assert read_queries(bom) == [("q-heat", "heat transfer"), ("q-wing", "wing")]
    plain = tmp_path / "bom.txt"
    plain.write_bytes(b"\xef\xbb\xbfslip flow\n")
    assert read_queries(plain) == [("1", "slip flow")]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nnot \xff utf-8\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: not UTF-8 text \(invalid start byte at byte 4"):
        read_queries(bad)
