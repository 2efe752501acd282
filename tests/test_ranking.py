"""Merging and fusion are pure functions: pinned here against rankings computed by hand."""
import pytest

from server.backends.docstore import ChunkRecord
from server.core.ranking import merge_topk, rrf
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
