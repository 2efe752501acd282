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
