"""Pure ranking functions: merge per-shard top-k lists, and reciprocal rank fusion.

No devices, sockets or I/O: unit-tested directly (tests/test_ranking.py).
"""
from __future__ import annotations

import heapq
import math
from typing import Iterable, Optional, Sequence

from server.core.types import Candidate


def _best_first(c: Candidate) -> tuple:
    return -c.score, c.chunk_id


def _strictly_best_first(lst: Sequence[Candidate]) -> bool:
    """Whether one list is in merge order already: scores strictly falling (no ties to break on
    chunk id; a NaN fails the test), every chunk once. Cheaper than re-sorting it."""
    prev = None
    for c in lst:
        if prev is not None and not c.score < prev:
            return False
        prev = c.score
    return len({c.chunk_id for c in lst}) == len(lst)


def merge_topk(per_shard: Iterable[Sequence[Candidate]], k: int) -> list[Candidate]:
    """Global top-k of per-shard lists that are each sorted best first (higher score is better).

    Ties break on chunk id among the candidates the shards returned. Which of many tied
    candidates a shard returns at its depth is tantivy's (document order), so a page cut
    through a run of ties can differ with top_k and the shard layout (outside QA). A chunk seen
    twice (it cannot be, with document sharding, but a replica mix-up must not duplicate) is kept
    once, at its best score.
    """
    lists = [lst for lst in per_shard if lst]
    if k <= 0 or not lists:
        return []
    if len(lists) == 1 and _strictly_best_first(lists[0]):
        return list(lists[0][:k])  # one shard's list (most collections): already the order
    items = [c for lst in lists for c in lst]
    # a full sort is cheaper than a heap for the short lists one or two shards return (and the
    # lists arrive sorted, which Timsort merges in one pass)
    best = (sorted(items, key=_best_first) if len(items) <= 8 * k
            else heapq.nsmallest(k * 2, items, key=_best_first))
    out, seen = [], set()
    for c in best:
        if c.chunk_id in seen:
            continue
        seen.add(c.chunk_id)
        out.append(c)
        if len(out) == k:
            break
    return out


def rrf(ranked_lists: dict[str, Sequence[int]], k: int = 60,
        weights: Optional[dict[str, float]] = None) -> list[tuple[int, float]]:
    """Reciprocal rank fusion: score(d) = sum over lists of w_list / (k + rank(d)), rank 1-based,
    w = 1 unless `weights` names the list (weighted RRF).

    Returns (chunk_id, fused score) best first; ties break on chunk id.
    """
    if k <= 0:
        raise ValueError("rrf k must be positive")
    scores: dict[int, float] = {}
    for name, ids in ranked_lists.items():
        w = 1.0 if weights is None else weights.get(name, 1.0)
        for rank, cid in enumerate(ids, start=1):
            scores[cid] = scores.get(cid, 0.0) + w / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


def minmax_fusion(scored: dict[str, Sequence[tuple[int, float]]],
                  weights: dict[str, float]) -> list[tuple[int, float]]:
    """Convex combination of min-max normalised scores: each list's scores (higher is better,
    as every retriever reports them: an L2 index negates its distances) are mapped to [0, 1]
    (best = 1; a list whose scores are all equal maps to 1), weighted, and summed per chunk id
    (absent from a list = 0). Returns (chunk_id, fused score) best first; ties break on chunk id."""
    fused: dict[int, float] = {}
    for name, pairs in scored.items():
        if not pairs:
            continue
        vals = [s for _, s in pairs]
        lo, hi = min(vals), max(vals)
        w = weights.get(name, 1.0)
        for (cid, _), v in zip(pairs, vals):
            norm = 1.0 if hi == lo else (v - lo) / (hi - lo)
            fused[cid] = fused.get(cid, 0.0) + w * norm
    return sorted(fused.items(), key=lambda kv: (-kv[1], kv[0]))


def rm3_expansion(query: str, texts: Sequence[str], weights: Sequence[float], n_terms: int,
                  top_weight: float, analyzer: Optional[str] = None) -> tuple[tuple[str, float], ...]:
    """RM3's relevance model over feedback texts: P(t|R) = sum_d w_d * tf(t, d) / |d| with w_d
    the hits' scores normalised to sum 1 (uniform when none is positive); the `n_terms` most
    likely analysed terms that are not already in the query (nor single characters), boosted
    proportionally, the first at `top_weight`, none below MIN_TERM_WEIGHT (a boost that rounds
    to 0 would be refused). Runs the index's analyzer: call it off the event loop."""
    from server.backends.lexical import ANALYZER_VERSION, analyze

    if n_terms <= 0 or not texts:
        return ()
    w = [x if x > 0 and math.isfinite(x) else 0.0 for x in weights]
    total = sum(w)
    if total <= 0:
        w, total = [1.0] * len(texts), float(len(texts))
    version = analyzer or ANALYZER_VERSION  # the build's (descriptor's) analyzer version
    in_query = set(analyze(query, version))
    rel: dict[str, float] = {}
    for text, wd in zip(texts, w):
        terms = analyze(text, version)
        if not terms or wd <= 0:
            continue
        share = wd / total / len(terms)
        for t in terms:
            if len(t) > 1 and t not in in_query:
                rel[t] = rel.get(t, 0.0) + share
    top = sorted(((t, p) for t, p in rel.items() if p > 0), key=lambda kv: (-kv[1], kv[0]))[:n_terms]
    if not top:
        return ()
    best = top[0][1]
    return tuple((t, max(MIN_TERM_WEIGHT, top_weight * p / best)) for t, p in top)


MIN_TERM_WEIGHT = 1e-3
