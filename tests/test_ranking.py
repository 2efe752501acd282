"""Merging and fusion are pure functions: pinned here against rankings computed by hand."""
import pytest

from server.backends.docstore import ChunkRecord
from server.core.ranking import merge_topk, minmax_fusion, rm3_expansion, rrf
from server.core.types import Candidate


def cand(cid, score, shard=0):
    rec = ChunkRecord(cid, cid, f"d{cid}", 0, 0, 1, "", "x", "default", {})
    return Candidate(cid, score, rec, shard)


def test_merge_topk_takes_global_best_across_shards():
    a = [cand(1, 0.9), cand(2, 0.5), cand(3, 0.1)]
    b = [cand(4, 0.8), cand(5, 0.7)]
    assert [c.chunk_id for c in merge_topk([a, b], 3)] == [1, 4, 5]


def test_merge_topk_breaks_ties_on_chunk_id_and_drops_duplicates():
    a = [cand(7, 0.5), cand(3, 0.5)]
    b = [cand(3, 0.5), cand(1, 0.4)]
    assert [c.chunk_id for c in merge_topk([a, b], 10)] == [3, 7, 1]


def test_one_shards_list_merges_as_the_sorted_merge_does():
    """One list is returned as it came when its scores strictly fall and its chunks are
    distinct; else (ties, a NaN, a repeat) it goes through the sort, which gives the same order."""
    import random

    def sorted_merge(lst, k):  # the order merge_topk promises, written out
        out, seen = [], set()
        for c in sorted(lst, key=lambda c: (-c.score, c.chunk_id)):
            if c.chunk_id not in seen:
                seen.add(c.chunk_id)
                out.append(c)
        return out[:k]

    rng = random.Random(3)
    for trial in range(300):
        n = rng.randint(1, 25)
        scores = sorted((rng.choice([0.1, 0.2, 0.3]) if trial % 3 == 0 else rng.random())
                        for _ in range(n))[::-1]
        ids = [rng.randint(1, 40 if trial % 5 == 0 else 10_000) for _ in range(n)]
        lst = [cand(i, s) for i, s in zip(ids, scores)]
        k = rng.randint(1, 30)
        got = merge_topk([lst], k)
        assert [(c.chunk_id, c.score) for c in got] == [(c.chunk_id, c.score)
                                                       for c in sorted_merge(lst, k)]
    tied = [cand(9, 0.5), cand(2, 0.5)]  # equal scores: chunk id decides, not the list's order
    assert [c.chunk_id for c in merge_topk([tied], 2)] == [2, 9]
    twice = [cand(4, 0.9), cand(4, 0.3), cand(5, 0.2)]  # a repeat: once, at its best score
    assert [(c.chunk_id, c.score) for c in merge_topk([twice], 3)] == [(4, 0.9), (5, 0.2)]
    signed = [cand(8, 0.0), cand(3, -0.0)]  # equal as numbers: chunk id decides
    assert [c.chunk_id for c in merge_topk([signed], 2)] == [3, 8]
    nan = [cand(6, 0.9), cand(7, float("nan")), cand(2, 0.1)]
    assert [c.chunk_id for c in merge_topk([nan], 3)] == [c.chunk_id for c in sorted_merge(nan, 3)]
    assert merge_topk([[cand(1, 0.5)]], 0) == [] and merge_topk([[cand(1, 0.5)]], -1) == []


def test_rrf_matches_hand_computation():
    # doc 10: rank 1 in A, rank 2 in B -> 1/61 + 1/62; doc 20: rank 2 in A -> 1/62;
    # doc 30: rank 1 in B -> 1/61
    fused = dict(rrf({"A": [10, 20], "B": [30, 10]}, k=60))
    assert fused[10] == pytest.approx(1 / 61 + 1 / 62)
    assert fused[20] == pytest.approx(1 / 62)
    assert fused[30] == pytest.approx(1 / 61)
    order = [cid for cid, _ in rrf({"A": [10, 20], "B": [30, 10]}, k=60)]
    assert order == [10, 30, 20]


def test_rrf_k_changes_the_weight_of_top_ranks():
    # with tiny k, rank 1 in one list beats rank 2 in both (1/1 > 1/2 + 1/2 is false; equal) -> use 3
    lists = {"A": [1, 2, 3], "B": [4, 2, 5]}
    assert rrf(lists, k=1)[0][0] == 2  # 1/3 + 1/3 = 0.667 > 1/2
    assert rrf(lists, k=60)[0][0] == 2
    with pytest.raises(ValueError):
        rrf(lists, k=0)


def test_weighted_rrf_scales_each_list():
    fused = dict(rrf({"dense": [1, 2], "lexical": [2, 3]}, k=10, weights={"dense": 1.5, "lexical": 0.5}))
    assert fused[1] == pytest.approx(1.5 / 11)
    assert fused[2] == pytest.approx(1.5 / 12 + 0.5 / 11)
    assert fused[3] == pytest.approx(0.5 / 12)
    assert rrf({"a": [1], "b": [2]}, weights={"a": 1.0, "b": 1.0}) == rrf({"a": [1], "b": [2]})


def test_rm3_expansion_takes_the_feedback_texts_most_likely_new_terms():
    texts = ["Marsupials on the island: a quokka survey of marsupials", "island marsupials at night"]
    got = rm3_expansion("quokka survey", texts, [2.0, 1.0], 3, 0.5)
    terms = [t for t, _ in got]
    assert terms[:2] == ["marsupi", "island"]            # analysed (stemmed) as the index holds them
    assert "quokka" not in terms and "survey" not in terms  # the query's own terms are not added
    assert got[0][1] == pytest.approx(0.5) and all(a[1] >= b[1] for a, b in zip(got, got[1:]))
    assert len(got) == 3
    # a text weighted more pulls its terms up: "night" only appears in the second text
    heavy_second = dict(rm3_expansion("quokka survey", texts, [0.1, 5.0], 5, 0.5))
    light_second = dict(rm3_expansion("quokka survey", texts, [5.0, 0.1], 5, 0.5))
    assert heavy_second.get("night", 0) > light_second.get("night", 0)
    assert rm3_expansion("quokka", texts, [1.0, 1.0], 0, 0.5) == ()


def test_minmax_fusion_normalises_each_list_and_weights_them():
    fused = dict(minmax_fusion({"dense": [(1, 0.9), (2, 0.5), (3, 0.1)], "lexical": [(2, 12.0), (4, 4.0)]},
                               {"dense": 0.6, "lexical": 0.4}))
    assert fused[1] == pytest.approx(0.6)                 # best dense, absent from lexical
    assert fused[2] == pytest.approx(0.6 * 0.5 + 0.4)     # middle dense, best lexical
    assert fused[3] == pytest.approx(0.0) and fused[4] == pytest.approx(0.0)
    # L2 arrives negated (higher is better): the nearest maps to 1
    l2 = minmax_fusion({"dense": [(7, -0.2), (8, -1.4)]}, {"dense": 1.0})
    assert l2 == [(7, 1.0), (8, 0.0)]
    assert minmax_fusion({"dense": [(5, 3.0)], "lexical": []}, {"dense": 0.5, "lexical": 0.5}) == [(5, 0.5)]
