from server.backends.docstore import ChunkRecord
from server.core.assembly import assemble
from server.core.types import Candidate, RankedHit


def hit(cid, text, tenant="default", score=1.0):
    rec = ChunkRecord(cid, cid, f"doc{cid}", 0, 10, 10 + len(text), "", text, tenant, {})
    return RankedHit(Candidate(cid, score, rec, 0), score, "rrf")


def words(texts):
    return [len(t.split()) for t in texts]


def test_duplicates_and_foreign_tenants_are_dropped_with_reasons():
    hits = [hit(1, "alpha beta"), hit(2, "Alpha   beta "), hit(3, "secret", tenant="other"),
            hit(4, "gamma")]
    selected, dropped, _ = assemble(hits, top_k=10, tenant="default")
    assert [h.candidate.chunk_id for h in selected] == [1, 4]
    assert [(h.candidate.chunk_id, r) for h, r in dropped] == [(2, "duplicate_of:1"),
                                                              (3, "tenant_mismatch")]


def test_token_budget_skips_passages_that_do_not_fit_and_keeps_smaller_ones():
    hits = [hit(1, "a b c"), hit(2, "d e f g h i"), hit(3, "j k")]
    selected, dropped, used = assemble(hits, top_k=10, tenant="default", token_budget=6,
                                       count_tokens=words)
    assert [h.candidate.chunk_id for h in selected] == [1, 3]
    assert used == 5
    assert dropped[0][1].startswith("over_token_budget")


def test_stops_at_top_k_and_keeps_offsets():
    hits = [hit(i, f"text {i}") for i in range(1, 6)]
    selected, _, _ = assemble(hits, top_k=2, tenant="default")
    assert [h.candidate.record.start_offset for h in selected] == [10, 10]
    assert len(selected) == 2


def test_token_budget_with_no_candidates_returns_nothing():
    """Regression: a budgeted query with no candidates crashed the tokenizer on an empty batch
    (found by tests/test_fuzz.py)."""
    def count(texts):
        assert texts, "must not be called with an empty batch"
        return [1 for _ in texts]

    assert assemble([], top_k=5, tenant="default", token_budget=10, count_tokens=count) == ([], [], 0)


def test_a_duplicate_names_a_passage_the_answer_holds_never_a_dropped_one():
    """Regression (outside QA): a passage dropped for the token budget was still remembered, so
    its later duplicate was dropped as "duplicate_of" a chunk the answer does not hold; it is
    now judged on its own (here: over the budget too)."""
    hits = [hit(1, "a b c d e f g"), hit(2, "a b c d e f g"), hit(3, "x y"), hit(4, "x  y")]
    selected, dropped, used = assemble(hits, top_k=10, tenant="default", token_budget=4,
                                       count_tokens=words)
    assert [h.candidate.chunk_id for h in selected] == [3] and used == 2
    assert [(h.candidate.chunk_id, r) for h, r in dropped] == [
        (1, "over_token_budget:7>4"), (2, "over_token_budget:7>4"), (4, "duplicate_of:3")]


def _served(tmp_path, embedder, docs, shards=1):
    from conftest import make_core, publish_build

    publish_build(tmp_path, "dup", docs, embedder, shards=shards)
    core = make_core(tmp_path, embedder, pipeline={"retrieval_cache_size": 0})
    core.load()
    return core


def _search(core, *requests):
    """The answers to SearchQuery("dup", **kw) for each kw, in one run of the core."""
    import asyncio

    from server.core.types import SearchQuery

    async def go():
        await core.start()
        try:
            return [await core.search(SearchQuery("dup", **kw), "default") for kw in requests]
        finally:
            await core.close()

    return asyncio.run(go())


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.parametrize("mode,shards,extra", [("lexical", 1, {}), ("dense", 1, {}), ("lexical", 3, {}),
                                              ("lexical", 1, {"lexical_feedback_terms": 5})])
def test_duplicates_never_leave_a_single_retriever_page_short(tmp_path, tiny_embedder, mode,
                                                              shards, extra):
    """Outside QA: a lexical or dense query read 2 x top_k candidates; when duplicates filled
    them, de-duplication dropped them and nothing deeper was read: top_k 5 gave 1 hit (lexical)
    or 2 (dense) where 7 distinct passages match. The retriever now reads deeper (4x each
    round) while its page is short and its list full - an RM3-expanded query too, its expansion
    searched again at the deeper depth (outside QA, a later round: it stayed short)."""
    from index_builder.corpus import Document

    same = "shock wave interaction with a boundary layer at supersonic speed"
    docs = [Document(f"dup{i}", same) for i in range(30)]
    docs += [Document(f"other{i}", f"shock tube experiment number {i} with a new nozzle {i * 7}")
             for i in range(6)]
    [r] = _search(_served(tmp_path, tiny_embedder, docs, shards),
                  dict(text="shock", top_k=5, mode=mode, **extra))
    ids = [h.candidate.record.doc_id for h in r.hits]
    assert len(ids) == 5 and len({h.candidate.record.text for h in r.hits}) == 5
    assert sum(i.startswith("dup") for i in ids) == 1
    assert any("deep" in n for n in r.notes)


def test_deeper_rounds_go_on_while_the_page_is_short_and_the_list_full(tmp_path, tiny_embedder):
    """Outside QA, a later round: two deeper rounds (10 -> 40 -> 160) were the most, so 200
    copies of one boilerplate text left a lexical page of 1 hit where 6 distinct passages sat
    behind them. Rounds now go on (-> 640) until the page fills or the depth cap."""
    from index_builder.corpus import Document

    docs = [Document(f"dup{i}", "shock page not found") for i in range(200)]
    docs += [Document(f"other{i}", f"shock tube experiment number {i} with a new nozzle {i * 7}")
             for i in range(6)]
    [r] = _search(_served(tmp_path, tiny_embedder, docs), dict(text="shock", top_k=5, mode="lexical"))
    ids = [h.candidate.record.doc_id for h in r.hits]
    assert len(ids) == 5 and sum(i.startswith("dup") for i in ids) == 1, ids
    assert any("640 per list" in n for n in r.notes), r.notes


def test_duplicates_never_leave_a_hybrid_page_short(tmp_path):
    """Outside QA: with duplicates filling both of a hybrid query's lists, the page came back
    with 1 hit for top_k 20 where thousands of passages match (the single retrievers read
    deeper; hybrid did not). Both lists are now read deeper, fused again with the dense
    feedback, and the page fills; its first hit stays the first."""
    import asyncio

    from conftest import make_core, publish_build
    from index_builder.corpus import Document
    from server.core.types import SearchQuery

    same = "shock wave interaction with a boundary layer"
    docs = [Document(f"dup{i}", same) for i in range(40)]
    docs += [Document(f"other{i}", f"shock tube experiment number {i} with a new nozzle of "
                                   f"{i * 7} degrees and a long supply line of pressure")
             for i in range(6)]
    rng = np.random.default_rng(9)
    near = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    x = np.vstack([np.tile(near, (40, 1)) + 0.01 * rng.standard_normal((40, 4)),
                   np.array([0.0, 1.0, 0.0, 0.0]) + 0.01 * rng.standard_normal((6, 4))])
    publish_build(tmp_path, "dup", docs, None, vectors=x.astype(np.float32), model_id="m")
    core = make_core(tmp_path, pipeline={"retrieval_cache_size": 0, "default_depth": 10})
    core.load()

    async def go():
        await core.start()
        try:
            return await core.search(SearchQuery("dup", text="shock", vector=near,
                                                 vector_model_id="m", top_k=5, mode="hybrid"),
                                     "default")
        finally:
            await core.close()

    r = asyncio.run(go())
    ids = [h.candidate.record.doc_id for h in r.hits]
    assert len(ids) == 5 and ids[0].startswith("dup") and sum(i.startswith("dup") for i in ids) == 1
    assert any("160 per list" in n for n in r.notes), r.notes  # 10 -> 40 -> 160
    fused = [h.fused[1] for h in r.hits]
    assert fused == sorted(fused, reverse=True)


def test_passages_over_the_token_budget_do_not_end_the_page_early(tmp_path, tiny_embedder):
    """Outside QA: with a token budget the two long passages ranked first were dropped and the
    page ended empty, though a short passage that fits ranked third (the proto promises later,
    shorter hits may still fill the budget)."""
    from index_builder.corpus import Document

    docs = [Document(f"long{i}", "flutter " * 40 + f"of panel {i} under load") for i in range(2)]
    docs += [Document("short", "flutter panel"), Document("filler", "heat transfer in a nozzle")]
    unbudgeted, r = _search(_served(tmp_path, tiny_embedder, docs),
                            dict(text="flutter", top_k=3, mode="lexical"),
                            dict(text="flutter", top_k=1, mode="lexical", context_token_budget=10))
    assert [h.candidate.record.doc_id for h in unbudgeted.hits] == ["long0", "long1", "short"]
    assert [h.candidate.record.doc_id for h in r.hits] == ["short"]


def test_a_budget_that_holds_fewer_than_top_k_passages_reads_no_deeper(tmp_path, tiny_embedder):
    """Review: a token budget that holds fewer than top_k passages is how budgets work, not a
    short page - reading deeper for it re-fetched and re-tokenized 16x the candidates for the
    same answer. Only repeats, or a budget that took nothing at all, read deeper."""
    from index_builder.corpus import Document

    docs = [Document(f"p{i}", f"flutter of panel {i} with a long span and a stiff frame")
            for i in range(30)]
    [r] = _search(_served(tmp_path, tiny_embedder, docs),
                  dict(text="flutter", top_k=5, mode="lexical", context_token_budget=40))
    assert 1 <= len(r.hits) < 5
    assert not any("deep" in n for n in r.notes)


def test_a_deeper_round_that_fails_leaves_the_first_page(tmp_path, tiny_embedder):
    """Review: the optional deeper retrieval re-settled the query, so a shard failing only in
    that round failed an answer the first round had complete (or marked it partial). It now
    keeps the first round's page, with a note (and no cache entry)."""
    from conftest import DelegatingShard
    from index_builder.corpus import Document
    from server.errors import Unavailable

    same = "shock wave interaction with a boundary layer at supersonic speed"
    docs = [Document(f"dup{i}", same) for i in range(30)]
    docs += [Document(f"other{i}", f"shock tube experiment number {i} with a new nozzle {i * 7}")
             for i in range(6)]
    core = _served(tmp_path, tiny_embedder, docs, shards=2)
    coll = core.registry.get("dup")
    first_depth = {}

    class FailsDeeper(DelegatingShard):
        async def search(self, queries, timeout=None):
            for q in queries:
                if q.stats_only:
                    continue
                if first_depth.setdefault(q.text, q.lexical_depth) < q.lexical_depth:
                    raise Unavailable("injected: down for the deeper round")
            return await self.inner.search(queries, timeout)

    coll.shards[1] = FailsDeeper(coll.shards[1])
    [r] = _search(core, dict(text="shock", top_k=5, mode="lexical"))
    assert not r.partial and r.hits
    assert any("deeper retrieval skipped" in n for n in r.notes)


def test_allow_partial_answers_from_some_shards_but_not_from_none(tmp_path, tiny_embedder):
    """Outside QA: with every shard failed, allow_partial answered OK with no hits (partial, the
    errors listed), which a client reads as "nothing matches". Partial means some shards."""
    from conftest import DelegatingShard
    from index_builder.corpus import Document
    from server.errors import Unavailable

    class Down(DelegatingShard):
        async def search(self, queries, timeout=None):
            raise Unavailable("injected: down")

    docs = [Document(f"d{i}", f"shock tube experiment number {i} with nozzle {i * 7}")
            for i in range(20)]
    core = _served(tmp_path, tiny_embedder, docs, shards=2)
    shards = core.registry.get("dup").shards
    shards[1] = Down(shards[1])
    [r] = _search(core, dict(text="shock tube", top_k=5, mode="lexical", allow_partial=True))
    assert r.partial and r.hits and {h.candidate.shard for h in r.hits} == {0}
    core = _served(tmp_path / "again", tiny_embedder, docs, shards=2)
    shards = core.registry.get("dup").shards
    shards[0], shards[1] = Down(shards[0]), Down(shards[1])
    with pytest.raises(Unavailable, match="2 of 2 shards failed"):
        _search(core, dict(text="shock tube", top_k=5, mode="lexical", allow_partial=True))


def test_repeats_and_a_budget_read_deeper_only_until_the_budget_ends_the_page(tmp_path,
                                                                              tiny_embedder):
    """Outside QA (re-probe): with duplicates and a budget that holds one passage, a dense
    query read 40 deep (right: the first 10 were repeats) and then 160 deep for the same single
    hit, because repeats had been dropped at some point. Once the budget has ended the page (a
    passage taken, the next over it), no deeper list fills it."""
    from index_builder.corpus import Document

    same = "shock wave interaction with a boundary layer at supersonic speed"
    docs = [Document(f"dup{i}", same) for i in range(30)]
    docs += [Document(f"other{i}", f"shock wave interaction number {i} with a boundary layer "
                                   f"at supersonic speed and a nozzle {i * 7}") for i in range(30)]
    [r] = _search(_served(tmp_path, tiny_embedder, docs),
                  dict(text=same, top_k=5, mode="dense", context_token_budget=20))
    assert len(r.hits) == 1
    # one deeper round (10 -> 40), not a second (160); one note, naming the last round
    assert [n for n in r.notes if "deeper" in n] == [n for n in r.notes if "40 per list" in n], r.notes
    assert sum("deeper" in n for n in r.notes) == 1, r.notes


def test_a_passage_skipped_for_the_budget_does_not_stop_repeats_from_reading_deeper(
        tmp_path, tiny_embedder):
    """Outside QA: repeats filled the first candidates and one long passage among them was
    skipped for the budget; that skip ended the page at 1 passage of 20 tokens with 130 left,
    where the same query pinned deeper filled 5. The budget ends a page only once what it has
    left is less than the smallest passage read."""
    from index_builder.corpus import Document

    docs = [Document(f"dup{i}", "harbor notice fog") for i in range(8)]
    docs.append(Document("long", "harbor notice " + " ".join(f"word{j}" for j in range(200))))
    docs += [Document(f"other{i}", f"harbor crane number {i}") for i in range(6)]
    core = _served(tmp_path, tiny_embedder, docs)
    core.pipeline.encoders.count_tokens = lambda texts: [len(t.split()) for t in texts]
    [r] = _search(core, dict(text="harbor notice", top_k=5, mode="lexical",
                             context_token_budget=150))
    ids = [h.candidate.record.doc_id for h in r.hits]
    assert len(ids) == 5 and "long" not in ids and sum(i.startswith("dup") for i in ids) == 1, ids
    assert r.context_tokens <= 150 and any("deeper" in n for n in r.notes), r.notes


def test_a_budget_that_fits_no_passage_does_not_deepen_a_hybrid_query(tmp_path, tiny_embedder):
    """Review: the hybrid deepening also fired when the token budget took no passage, reading
    and tokenizing 800 and then 3,200 more candidates (with feedback rounds) for one cheap
    request; a hybrid query reads deeper for repeats only."""
    import asyncio

    from conftest import make_core, publish_build
    from index_builder.corpus import Document
    from server.core.types import SearchQuery

    docs = [Document(f"d{i}", f"shock tube experiment number {i} " + "with a long nozzle " * 8)
            for i in range(40)]
    publish_build(tmp_path, "dup", docs, tiny_embedder)
    counted = []
    core = make_core(tmp_path, tiny_embedder,
                     pipeline={"retrieval_cache_size": 0, "default_depth": 10})
    core.load()
    core.pipeline.encoders.count_tokens = lambda texts: counted.extend(texts) or [100] * len(texts)

    async def go():
        await core.start()
        try:
            return await core.search(SearchQuery("dup", text="shock tube", top_k=5, mode="hybrid",
                                                 context_token_budget=10), "default")
        finally:
            await core.close()

    r = asyncio.run(go())
    assert r.hits == [] and not any("deep" in n for n in r.notes)
    assert len(counted) <= 20  # the first round's candidates only (10 per list)
    # outside QA: the empty page said nothing of why
    assert any(n.startswith("the token budget of 10 fit none of the") for n in r.notes), r.notes


def test_equal_bm25_scores_are_cut_at_the_depth_by_chunk_id(tmp_path, tiny_embedder):
    """Outside QA: of many passages with the same text, which ones a page showed followed the
    order of tantivy's segments at the shard's depth cut, which differs between replicas that
    applied the same writes in other groups. A shard now reads every hit tied at its cut and
    keeps the lowest chunk ids. (Across shards the same text scores a few ulps apart - each
    shard's own field lengths, the statistics round's boost - so there the order is by score.)"""
    import asyncio

    from conftest import make_core, publish_build
    from index_builder.corpus import Document
    from server.core.chunking import chunk_id
    from server.core.types import SearchQuery

    docs = [Document(f"same{i:02d}", "shock page not found") for i in range(60)]
    publish_build(tmp_path, "dup", docs, tiny_embedder)
    core = make_core(tmp_path, tiny_embedder, pipeline={"retrieval_cache_size": 0, "dedupe": False})
    core.load()

    async def go():
        await core.start()
        try:
            return await core.search(SearchQuery("dup", text="shock", top_k=3, mode="lexical"),
                                     "default")
        finally:
            await core.close()

    got = [h.candidate.record.doc_id for h in asyncio.run(go()).hits]
    lowest = sorted(docs, key=lambda d: chunk_id("default", d.doc_id, 0))[:3]
    assert got == [d.doc_id for d in lowest]
