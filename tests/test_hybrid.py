"""Hybrid retrieval mechanics through the real service: lexical finds exact identifiers, fusion
carries every retriever's rank, the cross-encoder reorders the fused head, context assembly keeps
a token budget, metadata filters restrict both branches before ranking."""
import grpc
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

from conftest import publish_build, start_core_server

TOPICS = ["boundary layer", "shock wave", "heat transfer", "wing flutter", "jet noise"]


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory, tiny_embedder, tiny_reranker_dir):
    from index_builder.corpus import Document
    from server.backends.device import Device
    from server.backends.models import CrossEncoder

    docs = []
    for i in range(120):
        topic = TOPICS[i % len(TOPICS)]
        docs.append(Document(f"doc{i}", f"Report {i} on {topic} measurements in a wind tunnel. "
                             f"The {topic} results are compared with theory.",
                             title=f"{topic} report {i}",
                             metadata={"product": "alpha" if i % 3 else "beta",
                                       "lang": "en" if i % 2 else "de"}))
    docs.append(Document("ident", "Specification NACA-TN-4711 describes the zeta-omega procedure.",
                         title="specification", metadata={"product": "alpha", "lang": "en"}))
    # lexical feedback: only the first names the query's word; the second shares its other words
    docs.append(Document("fb1", "The quokka census counted marsupials across the island.",
                         title="census"))
    docs.append(Document("fb2", "Marsupials across the island were counted again at night.",
                         title="recount"))
    # feedback beyond the shipped text: a dozen equal matches of one word, each with words of
    # its own, so which of them the feedback reads shows in the expansion
    words = ["amber", "basalt", "cobalt", "dolomite", "emerald", "feldspar", "garnet", "hematite",
             "iolite", "jasper", "kyanite", "lazurite"]
    for i, w in enumerate(words):
        docs.append(Document(f"zx{i}", f"zyxmineral sample {w} {w} {w}", title=f"{w} note"))
    # Unicode forms: a decomposed accent (e + U+0301) and full-width letters
    docs.append(Document("greek1", "Ο κόσμος της Αθήνας και η οδός Πανεπιστημίου."))
    docs.append(Document("latin1", "Die Straße nach Łódź und das ŒUVRE von Işık."))
    docs.append(Document("uni1", "Advice on re\u0301sume\u0301 writing for engineers.", title="careers"))
    docs.append(Document("uni2", "A \uff46\uff4c\uff55\uff58\uff47\uff41\uff54\uff45 magnetometer.",
                         title="instruments"))
    data = tmp_path_factory.mktemp("hybrid")
    publish_build(data, "h", docs, tiny_embedder, "HNSW16,Flat", shards=3)
    reranker = CrossEncoder(tiny_reranker_dir, Device("cpu"))
    srv = start_core_server(data, tiny_embedder, reranker, models={"rerank_cap": 50})
    yield srv, reranker
    srv.stop()


@pytest.fixture(scope="module")
def stub(hybrid_server):
    ch = grpc.insecure_channel(hybrid_server[0].address)
    yield pb_grpc.SearchServiceStub(ch)
    ch.close()


def search(stub, **kw):
    kw.setdefault("collection", "h")
    kw.setdefault("top_k", 10)
    return stub.Search(pb.SearchRequest(**kw), timeout=30)


def test_lexical_finds_an_exact_identifier_first(stub):
    resp = search(stub, text="NACA-TN-4711", mode=pb.LEXICAL)
    assert resp.hits[0].doc_id == "ident"
    hyb = search(stub, text="NACA-TN-4711", mode=pb.HYBRID)
    top = hyb.hits[0]
    assert top.doc_id == "ident" and top.lexical.rank == 1


def test_hybrid_hits_carry_each_retrievers_rank_and_the_fused_score(stub):
    resp = search(stub, text="shock wave measurements", mode=pb.HYBRID, rrf_k=60)
    for i, h in enumerate(resp.hits, start=1):
        assert h.fused.rank == i
        expected = sum(1 / (60 + r) for r in (h.dense.rank, h.lexical.rank) if r)
        assert h.score == pytest.approx(expected, rel=1e-5)
    assert any(h.dense.rank and h.lexical.rank for h in resp.hits)


def test_rerank_reorders_the_fused_head_by_cross_encoder_score(stub, hybrid_server):
    _, reranker = hybrid_server
    q = "heat transfer in a wind tunnel"
    resp = search(stub, text=q, mode=pb.HYBRID, rerank_depth=20, include_trace=True)
    scores = [h.rerank.score for h in resp.hits]
    assert scores == sorted(scores, reverse=True)
    assert all(h.score_kind == pb.CROSS_ENCODER for h in resp.hits)
    assert [h.rerank.rank for h in resp.hits] == list(range(1, 11))
    direct = reranker.score([(q, resp.hits[0].text)])[0]
    assert resp.hits[0].rerank.score == pytest.approx(float(direct), abs=1e-4)
    assert "reranked" in {lst.name for lst in resp.trace.lists}
    assert "rerank" in {t.stage for t in resp.timings}


def test_rerank_depth_above_the_cap_is_refused(stub):
    with pytest.raises(grpc.RpcError) as err:
        search(stub, text="jet noise", rerank_depth=51)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cap" in err.value.details()


def test_queries_longer_than_the_model_window_are_truncated_and_say_so(stub):
    long_q = " ".join(["boundary layer separation"] * 100)
    # the second time the text comes from the embedding cache, in another mode: still said
    # (outside QA: only the first embedding said so)
    for mode in (pb.HYBRID, pb.DENSE):
        resp = search(stub, text=long_q, mode=mode, include_trace=True)
        assert resp.hits
        assert any("tokens" in n and "embedded its first" in n for n in resp.trace.notes)


def test_context_budget_is_respected_and_dropped_items_carry_reasons(stub, hybrid_server):
    resp = search(stub, text="wing flutter", mode=pb.HYBRID, top_k=10, context_token_budget=60,
                  include_trace=True)
    assert 0 < resp.context_tokens <= 60
    assert 0 < len(resp.hits) < 10
    dropped = {lst.name: lst for lst in resp.trace.lists}["dropped"]
    assert dropped.items and all(it.reason.startswith("over_token_budget") for it in dropped.items)


@pytest.mark.parametrize("mode", [pb.DENSE, pb.LEXICAL, pb.HYBRID])
def test_selective_metadata_filters_restrict_before_ranking_and_fill_the_page(stub, mode):
    # product=beta and lang=de: i % 3 == 0 and i % 2 == 0 -> i % 6 == 0 -> 20 of 121 documents
    filters = [pb.MetadataFilter(key="product", any_of=["beta"]),
               pb.MetadataFilter(key="lang", any_of=["de"])]
    resp = search(stub, text="wind tunnel report results", mode=mode, top_k=15, filters=filters)
    assert len(resp.hits) == 15
    for h in resp.hits:
        assert h.metadata["product"] == "beta" and h.metadata["lang"] == "de"
        assert int(h.doc_id[3:]) % 6 == 0


def test_weighted_fusion_scores_each_list_by_its_share(stub):
    resp = search(stub, text="shock wave measurements", mode=pb.HYBRID, rrf_k=60, dense_weight=0.7)
    assert resp.hits and any(h.dense.rank and h.lexical.rank for h in resp.hits)
    for i, h in enumerate(resp.hits, start=1):
        assert h.fused.rank == i
        expected = (1.4 / (60 + h.dense.rank) if h.dense.rank else 0) + \
                   (0.6 / (60 + h.lexical.rank) if h.lexical.rank else 0)
        assert h.score == pytest.approx(expected, rel=1e-5)


def test_lexical_matches_text_and_queries_in_any_unicode_form(stub):
    """Regression (outside QA): a document stored as "resume" + a combining accent was never
    found by the query "résumé" (the tokenizer split off the accent); text and queries are now
    NFKC-normalised before analysis, so decomposed, composed and full-width forms meet."""
    for query, doc in (("r\u00e9sum\u00e9", "uni1"), ("re\u0301sume\u0301", "uni1"),
                       ("fluxgate", "uni2"), ("\uff26\uff2c\uff35\uff38\uff27\uff21\uff34\uff25", "uni2")):
        hits = search(stub, text=query, mode=pb.LEXICAL).hits
        assert [h.doc_id for h in hits][:1] == [doc], (query, [h.doc_id for h in hits])
    # the stored text is returned as it was written, not normalised
    hit = search(stub, text="r\u00e9sum\u00e9", mode=pb.LEXICAL).hits[0]
    assert "re\u0301sume\u0301" in hit.text


def test_words_match_with_or_without_their_accents_and_in_greek_capitals(stub):
    """Regression (outside QA): a query or title in Greek capitals ("ΚΟΣΜΟΣ": no accents, and
    lowercasing maps Σ to σ wherever it stands) never matched the text's "κόσμος", and "cafe"
    never matched "café". Analyzer v3 drops the accents of Latin and Greek letters and folds
    final ς to σ, in text and queries alike."""
    for query, doc in (("ΚΟΣΜΟΣ", "greek1"), ("κόσμος", "greek1"), ("Κόσμος", "greek1"),
                       ("ΟΔΟΣ", "greek1"), ("οδος", "greek1"), ("resume", "uni1"),
                       ("RÉSUMÉ", "uni1"), ("strasse", "latin1"), ("lodz", "latin1"),
                       ("oeuvre", "latin1"), ("isik", "latin1"), ("ışık", "latin1")):
        hits = search(stub, text=query, mode=pb.LEXICAL).hits
        assert [h.doc_id for h in hits][:1] == [doc], (query, [h.doc_id for h in hits])


V2 = "nfkc+simple+remove_long40+lower+stop_en+snowball_en/v2"
LONG_RUSSIAN = "достопримечательность"  # 21 letters, 42 bytes


def test_long_words_of_two_byte_letters_are_indexed(tmp_path):
    """Outside QA: tokens of 40 bytes or more were dropped, so a 21-letter Russian or Greek word
    (two bytes a letter) could never be found. Analyzer v3 drops them from 100 bytes."""
    from server.backends.lexical import LexicalIndex

    index = LexicalIndex.create(tmp_path / "v3")
    index.add([(0, "", f"музей {LONG_RUSSIAN}", "default", {}, ("public",))])
    assert list(index.search(LONG_RUSSIAN, 5, "default")[1]) == [0]


def test_a_build_of_an_older_analyzer_is_queried_as_it_was_built(tmp_path):
    """A v2 build indexed accents and final ς as they are, and dropped tokens from 40 bytes:
    its queries and writes are analysed so too (folding only the queries would stop "κόσμος"
    matching the text it always matched)."""
    from server.backends.lexical import ANALYZER_VERSION, LexicalIndex, analyze, analyzer_folds

    assert analyzer_folds(ANALYZER_VERSION) and not analyzer_folds(V2)
    LexicalIndex.create(tmp_path / "v2")
    index = LexicalIndex.open(tmp_path / "v2", version=V2)  # as ShardIndex opens a v2 build
    index.add([(0, "", f"ο κόσμος {LONG_RUSSIAN}", "default", {}, ("public",))])
    assert list(index.search("κόσμος", 5, "default")[1]) == [0]
    assert list(index.search(LONG_RUSSIAN, 5, "default")[1]) == []  # dropped, as v2 did
    assert analyze("κόσμος", V2) == ["κόσμος"] and analyze("κόσμος") == ["κοσμοσ"]


def test_lexical_feedback_expands_the_bm25_query_with_terms_of_the_first_hits(stub):
    plain = search(stub, text="quokka", mode=pb.LEXICAL)
    assert [h.doc_id for h in plain.hits] == ["fb1"]
    fed = search(stub, text="quokka", mode=pb.LEXICAL, lexical_feedback_terms=5, feedback_docs=1,
                 include_trace=True)
    assert [h.doc_id for h in fed.hits][:2] == ["fb1", "fb2"]
    note = [n for n in fed.trace.notes if n.startswith("lexical feedback from the first 1 hits")]
    assert note and "marsupi" in note[0] and "quokka" not in note[0].split(":", 1)[1]
    hyb = search(stub, text="quokka", mode=pb.HYBRID, lexical_feedback_terms=5, feedback_docs=1)
    assert "fb2" in [h.doc_id for h in hyb.hits if h.lexical.rank]
    # the feedback reads the hits' text even where the shards did not ship it (untraced calls ship
    # text for the first top_k + a few hits only), so tracing a call does not change its answer
    for mode in (pb.HYBRID, pb.LEXICAL):
        opts = dict(text="zyxmineral", mode=mode, top_k=1, lexical_feedback_terms=12,
                    feedback_docs=20)
        plain, traced = search(stub, **opts), search(stub, include_trace=True, **opts)
        def seen(resp):
            return [(h.doc_id, round(h.score, 5), h.lexical.rank, round(h.lexical.score, 4))
                    for h in resp.hits]

        assert seen(plain) == seen(traced)
        read = 20 if mode == pb.HYBRID else 12  # lexical: the twelve documents that match
        assert any(n.startswith(f"lexical feedback from the first {read} hits")
                   for n in traced.trace.notes), list(traced.trace.notes)
    off = search(stub, text="quokka", mode=pb.LEXICAL, lexical_feedback_terms=0, include_trace=True)
    assert [h.doc_id for h in off.hits] == ["fb1"]
    assert not any(n.startswith("lexical feedback") for n in off.trace.notes)


def test_min_max_fusion_combines_normalised_list_scores(stub):
    resp = search(stub, text="shock wave measurements", mode=pb.HYBRID, fusion=pb.FUSION_MIN_MAX,
                  dense_weight=0.7, feedback_docs=0, include_trace=True)
    lists = {lst.name: [(it.chunk_id, it.score) for it in lst.items] for lst in resp.trace.lists}

    def norm(name):
        scores = [s for _, s in lists[name]]
        lo, hi = min(scores), max(scores)
        return {cid: (s - lo) / (hi - lo) if hi > lo else 1.0 for cid, s in lists[name]}

    dense, lexical = norm("dense"), norm("lexical")
    assert resp.hits and all(h.score_kind == pb.MIN_MAX_FUSED and h.fused.kind == pb.MIN_MAX_FUSED
                             for h in resp.hits)
    for i, h in enumerate(resp.hits, start=1):
        assert h.fused.rank == i
        expected = 0.7 * dense.get(h.chunk_id, 0.0) + 0.3 * lexical.get(h.chunk_id, 0.0)
        assert h.score == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert [h.score for h in resp.hits] == sorted((h.score for h in resp.hits), reverse=True)
    rrf_default = search(stub, text="shock wave measurements", mode=pb.HYBRID)
    assert all(h.score_kind == pb.RRF for h in rrf_default.hits)


@pytest.mark.parametrize("field,value", [("dense_weight", 1.0), ("dense_weight", 0.0),
                                         ("feedback_weight", 1.5), ("feedback_docs", 101),
                                         ("lexical_feedback_terms", 65), ("fusion", 7)])
def test_feedback_and_fusion_options_out_of_range_are_refused(stub, field, value):
    with pytest.raises(grpc.RpcError) as err:
        search(stub, text="shock wave", mode=pb.HYBRID, **{field: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_a_query_that_fails_unexpectedly_fails_alone_in_its_batch(hybrid_server, stub):
    """Regression (outside QA): one query whose reranking failed inside the model (a pair longer
    than its positions) made the whole SearchBatch INTERNAL and lost the other answers. The
    failure is re-created here by raising the reranker's input limit past its 256 positions."""
    _, reranker = hybrid_server
    limit, reranker.max_length = reranker.max_length, 512
    try:
        short = [pb.SearchRequest(collection="h", text=t, top_k=5, rerank_depth=5)
                 for t in ("shock wave", "heat transfer", "jet noise")]
        long = pb.SearchRequest(collection="h", text="wing flutter " * 200, top_k=5, rerank_depth=5)
        out = stub.SearchBatch(pb.SearchBatchRequest(queries=[short[0], long, *short[1:]]),
                               timeout=60).results
        assert [r.code for r in out] == [0, grpc.StatusCode.INTERNAL.value[0], 0, 0]
        assert "internal error in finish" in out[1].message
        assert all(r.response.hits for i, r in enumerate(out) if i != 1)
    finally:
        reranker.max_length = limit
    assert stub.SearchBatch(pb.SearchBatchRequest(queries=[long]), timeout=60).results[0].code == 0


def test_bm25_scores_are_the_same_whatever_restricts_the_search(tmp_path):
    """Regression (outside QA): the tenant, ACL and metadata clauses scored too - every hit got
    the tenant term's own BM25 (+1.22 for one tenant, +2.61 for another, differing with each
    shard's tenant mix) and +1.0 per ACL or filter clause - so a score moved with the tenant and
    the filters, and merges across shards compared unlike sums. Restrictions now only filter."""
    from server.backends.lexical import LexicalIndex

    lex = LexicalIndex.create(tmp_path / "lexical")
    rows = []
    for i in range(40):
        tenant = "alpha" if i % 5 else "beta"
        rows.append((i, f"title {i}", f"wing flutter test {i} " + "flutter " * (i % 3),
                     tenant, {"lang": "en" if i % 2 else "de"}, ("eng",) if i % 4 else ("public",)))
    lex.add(rows)
    checked = 0
    for tenant in ("alpha", "beta"):  # (a tenant's own statistics: see the test below)
        scores, found = lex.search("wing flutter", 40, tenant)
        plain = dict(zip(found, scores))
        assert len(plain) == (32 if tenant == "alpha" else 8)
        for scopes in (None, ("public",), ("public", "eng")):
            for equal in ((), (("lang", ("en",)),)):
                s, r = lex.search("wing flutter", 40, tenant, equal, scopes)
                for row, score in zip(r, s):
                    assert score == pytest.approx(plain[row], rel=1e-6), (tenant, scopes, equal, row)
                    checked += 1
        if tenant == "alpha":
            s, r = lex.search("wing flutter", 40, "alpha", rows=[3, 6, 7])
            assert sorted(r) == [3, 6, 7] and all(x == pytest.approx(plain[y], rel=1e-6)
                                                  for x, y in zip(s, r))
    assert checked > 50


def test_a_tenants_bm25_scores_count_its_own_live_documents_only(tmp_path):
    """Outside QA: BM25 counted every tenant's documents (and deleted ones until a merge), so
    another tenant's writes reordered a tenant's results (and told it how common a term is
    elsewhere), and replicas that merged at other times scored apart. A tenant's query now
    scores with its own live documents' statistics: with every field of one length (BM25's
    length part stays the index's), its scores do not move when another tenant writes, and
    after deletes they equal those of an index that never held the deleted documents."""
    from server.backends.lexical import LexicalIndex

    def row(i, tenant, word):
        return (i, "t", f"wing {word} panel w{i % 7}", tenant, {}, ("@all",))

    alpha = [row(i, "alpha", "flutter" if i % 3 else "buckling") for i in range(30)]
    lex = LexicalIndex.create(tmp_path / "shared")
    lex.add(alpha)
    def scores(index):
        s, r = index.search("wing flutter", 40, "alpha")
        return dict(zip(r, s))

    before = scores(lex)
    lex.add([row(100 + i, "beta", "flutter") for i in range(60)])  # another tenant writes
    assert scores(lex) == pytest.approx(before, rel=1e-5)
    gone = [i for i in range(30) if i % 4 == 0]
    lex.delete_rows(gone)  # deleted, not merged away: tantivy still counts them
    lex._reload()
    fresh = LexicalIndex.create(tmp_path / "fresh")
    fresh.add([r for r in alpha if r[0] not in gone] + [row(100 + i, "beta", "flutter")
                                                       for i in range(60)])
    assert scores(lex) == pytest.approx(scores(fresh), rel=1e-5)
    # and the statistics round reports the tenant's live counts
    stats = lex.term_stats("wing flutter", (), "alpha")
    assert stats.docs == 30 - len(gone)
    assert dict((t, d) for t, d, _ in stats.df)["flutter"] == sum(
        1 for i in range(30) if i % 3 and i not in gone)
    # an index holding only another tenant's documents counts none of the caller's (review: it
    # answered with the other tenant's counts, which the round then summed into alpha's idf)
    beta_only = LexicalIndex.create(tmp_path / "beta")
    beta_only.add([row(200 + i, "beta", "flutter") for i in range(50)])
    stats = beta_only.term_stats("wing flutter", (), "alpha")
    assert stats.docs == 0 and all(d == 0 and t == 0 for _, d, t in stats.df)


def test_expansion_terms_beside_collection_statistics_count_the_tenants_own_documents(tmp_path):
    """Outside QA: on a collection of several shards the statistics round counts a query's own
    terms; a feedback round's expansion terms then scored with tantivy's statistics, which
    count every tenant's documents (and scopes the caller cannot read), so another tenant's
    writes of an expansion term moved a caller's scores by 5-7%. They score with the tenant's
    own live counts now, as the round's terms do."""
    from server.backends.lexical import LexicalIndex

    def row(i, tenant, word):
        return (i, "t", f"wing {word} panel w{i % 7}", tenant, {}, ("@all",))

    lex = LexicalIndex.create(tmp_path / "shard")
    lex.add([row(i, "alpha", "thermal" if i % 3 else "flutter") for i in range(30)])
    stats = lex.term_stats("wing", (), "alpha")  # the round's statistics: the query's own term

    def scores():
        s, r = lex.search("wing", 40, "alpha", expansion=[("thermal", 0.5)], stats=stats)
        return dict(zip(r, s))

    before = scores()
    assert len(before) == 30
    lex.add([row(100 + i, "beta", "thermal") for i in range(60)])  # another tenant writes
    assert scores() == pytest.approx(before, rel=1e-5)


def test_bm25_ranks_alike_whatever_the_shard_count(tmp_path, tiny_embedder):
    """Regression (outside QA): each shard scored BM25 with its own document frequencies, so a
    lexical ranking changed with the shard count (9 of 225 Cranfield top-10 lists agreed
    between 1 and 3 shards). A statistics round now gives every shard the collection's: with
    every field of one length (the field-length part of BM25 stays a shard's own), 1 and 3
    shards score every hit alike. Turned off, they differ - which shows the test can fail. The
    statistics also cross the shard port's protobuf codec unchanged."""
    import random

    from index_builder.corpus import Document
    from server.core.types import ShardQuery, ShardResult, TermStats
    from server.transport import codec

    rnd = random.Random(7)
    vocab = [f"zq{i:02d}" for i in range(30)]
    weights = [1.0 / (i + 1) for i in range(30)]  # a skewed vocabulary: idf matters
    docs = [Document(f"d{i}", " ".join(rnd.choices(vocab, weights, k=8)), title=f"tt{i % 7} tu{i % 5}")
            for i in range(90)]
    publish_build(tmp_path, "one", docs, tiny_embedder, shards=1)
    publish_build(tmp_path, "three", docs, tiny_embedder, shards=3)
    queries = ["zq03 zq11 zq20", "zq00 zq25", "zq07 tt3", "zq14 zq14 zq29 tu2", "zq01 zq02 zq05"]

    def answers(**pipeline):
        srv = start_core_server(tmp_path, tiny_embedder, pipeline=pipeline)
        try:
            with grpc.insecure_channel(srv.address) as ch:
                stub = pb_grpc.SearchServiceStub(ch)
                out = {}
                for coll in ("one", "three"):
                    for q in queries:
                        r = stub.Search(pb.SearchRequest(collection=coll, text=q, top_k=100,
                                                         mode=pb.LEXICAL), timeout=30)
                        # equal scores may differ in the last float bit between layouts (the
                        # idf is scaled, not set): compare rounded, ties in id order
                        out[coll, q] = sorted(((round(h.score, 4), h.doc_id) for h in r.hits),
                                              key=lambda x: (-x[0], x[1]))
                return out
        finally:
            srv.stop()

    shared = answers()
    for q in queries:
        assert len(shared["one", q]) >= 20
        assert shared["three", q] == shared["one", q], q
    own = answers(collection_term_stats=False)
    assert any(own["three", q] != own["one", q] for q in queries)
    assert all(own["one", q] == shared["one", q] for q in queries)  # one shard: nothing to do

    stats = TermStats(90, (("zq03", 40, 0), ("tt3", 0, 13))) + TermStats(10, (("zq03", 2, 1),))
    assert stats == TermStats(100, (("zq03", 42, 1), ("tt3", 0, 13)))
    q = ShardQuery("b", "default", None, "m", "zq03", 0, 0, stats_only=True, term_stats=stats)
    back = codec.shard_query_from_pb(codec.shard_query_to_pb(q))
    assert back.stats_only and back.term_stats == stats
    res = codec.shard_result_from_pb(codec.shard_result_to_pb(ShardResult(0, "v", [], [], term_stats=stats)))
    assert res.term_stats == stats
    assert codec.shard_result_from_pb(codec.shard_result_to_pb(ShardResult(0, "v", [], []))).term_stats is None


def test_identical_passages_get_one_cross_encoder_score_whatever_the_batching(tiny_reranker_dir):
    """Outside QA: a pair scored in two model batches differed in its last bits (padding), so of
    identical passages an answer cited one or another by how the request was batched (Search
    against SearchBatch, traced or not). Each distinct text is now scored once per query: copies
    tie exactly and break by chunk id."""
    import asyncio

    from server.backends.device import Device
    from server.backends.models import CrossEncoder
    from server.core.encoders import Encoders

    reranker = CrossEncoder(tiny_reranker_dir, Device("cpu"))
    scored = []
    real = reranker.score
    reranker.score = lambda pairs: scored.extend(pairs) or real(pairs)
    enc = Encoders(None, reranker)
    same = "a harbor notice about fog and the tide tables for the week"
    passages = [same, "another text entirely", same, "a third one", same]

    async def go():
        try:
            return await enc.rerank("harbor fog", passages, None)
        finally:
            await enc.close()

    scores = asyncio.run(go())
    assert scores[0] == scores[2] == scores[4]  # exactly: one score for the text
    assert sorted(p for _, p in scored) == sorted(set(passages))  # each text scored once
