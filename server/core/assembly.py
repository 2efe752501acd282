"""Context assembly: pick the passages a caller will read, each citable to its source.

Walk the ranked hits best first; drop a hit (with its reason) when it belongs to another tenant
or lies outside the caller's ACL scopes (defence in depth: retrieval already restricted it),
repeats a passage already taken (same title and text, by the fingerprint the shard stored), or
would push the context past the token budget; stop at top_k. Offsets and ids travel with every
passage.

`ContextAssembler` takes hits one at a time, so the pipeline can fetch the texts of the next few
hits only when assembly actually reaches them.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from server.backends.docstore import PUBLIC_ACL, chunk_fingerprint
from server.core.types import RankedHit


class ContextAssembler:
    def __init__(self, top_k: int, tenant: str, token_budget: int = 0, dedupe: bool = True,
                 acl_scopes: Sequence[str] = ()):
        self.top_k = top_k
        self.tenant = tenant
        self.token_budget = token_budget
        self.dedupe = dedupe
        self.readable = set(acl_scopes) | {PUBLIC_ACL}
        self.selected: list[RankedHit] = []
        self.dropped: list[tuple[RankedHit, str]] = []
        self.used = 0
        self.smallest_cost: Optional[int] = None  # the fewest tokens of any passage offered
        self._seen: dict[int, int] = {}

    @property
    def full(self) -> bool:
        return len(self.selected) >= self.top_k

    def offer(self, hit: RankedHit, cost: int = 0) -> bool:
        """Consider one hit (its record read); `cost` is its tokens when there is a budget."""
        rec = hit.candidate.record
        if rec.tenant != self.tenant:
            self.dropped.append((hit, "tenant_mismatch"))
            return False
        if self.readable.isdisjoint(rec.acl):
            self.dropped.append((hit, "acl_mismatch"))
            return False
        key = None
        if self.dedupe:
            key = rec.text_hash or chunk_fingerprint(rec.title, rec.text)
            if key in self._seen:
                self.dropped.append((hit, f"duplicate_of:{self._seen[key]}"))
                return False
        if self.token_budget > 0:
            if self.smallest_cost is None or cost < self.smallest_cost:
                self.smallest_cost = cost
            if self.used + cost > self.token_budget:
                self.dropped.append((hit, f"over_token_budget:{cost}>{self.token_budget - self.used}"))
                return False
            self.used += cost
        if key is not None:  # a duplicate names a passage the answer holds, never a dropped one
            self._seen[key] = rec.chunk_id
        self.selected.append(hit)
        return True


def assemble(hits: Sequence[RankedHit], top_k: int, tenant: str, token_budget: int = 0,
             count_tokens: Optional[Callable[[list[str]], list[int]]] = None,
             dedupe: bool = True, acl_scopes: Sequence[str] = ()
             ) -> tuple[list[RankedHit], list[tuple[RankedHit, str]], int]:
    """All at once over hits whose records are read. Returns (selected, dropped with reasons,
    tokens used)."""
    if token_budget > 0 and count_tokens is None:
        raise ValueError("a token budget needs a tokenizer")
    a = ContextAssembler(top_k, tenant, token_budget, dedupe, acl_scopes)
    window = list(hits[: max(top_k * 4, top_k)])
    costs = count_tokens([h.candidate.record.text for h in window]) if token_budget > 0 and window else []
    for i, hit in enumerate(hits):
        if a.full:
            break
        cost = 0
        if token_budget > 0:
            cost = costs[i] if i < len(costs) else count_tokens([hit.candidate.record.text])[0]
        a.offer(hit, cost)
    return a.selected, a.dropped, a.used
