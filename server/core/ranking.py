"""Pure ranking functions: merge per-shard top-k lists, and reciprocal rank fusion.

No devices, sockets or I/O: unit-tested directly (tests/test_ranking.py).
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from server.core.types import Candidate


def merge_topk(per_shard: Iterable[Sequence[Candidate]], k: int) -> list[Candidate]:
    """Global top-k of per-shard lists that are each sorted best first (higher score is better).

    Ties break on chunk id so the order is deterministic whatever the shard count. A chunk seen
    twice (it cannot be, with document sharding, but a replica mix-up must not duplicate) is kept
    once, at its best score.
    """
    best = heapq.nsmallest(k * 2 if k else 0, (c for lst in per_shard for c in lst),
                           key=lambda c: (-c.score, c.chunk_id))
    out, seen = [], set()
    for c in best:
        if c.chunk_id in seen:
            continue
        seen.add(c.chunk_id)
        out.append(c)
        if len(out) == k:
            break
    return out


def rrf(ranked_lists: dict[str, Sequence[int]], k: int = 60) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: score(d) = sum over lists of 1 / (k + rank(d)), rank 1-based.

    Returns (chunk_id, fused score) best first; ties break on chunk id.
    """
    if k <= 0:
        raise ValueError("rrf k must be positive")
    scores: dict[int, float] = {}
    for ids in ranked_lists.values():
        for rank, cid in enumerate(ids, start=1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
