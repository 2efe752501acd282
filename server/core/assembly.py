"""Context assembly: pick the passages a caller will read, each citable to its source.

Walk the ranked hits best first; drop a hit (with its reason) when it belongs to another tenant
(defence in depth: retrieval already restricted it), repeats a passage already taken, or would push
the context past the token budget; stop at top_k. Offsets and ids travel with every passage.
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable, Optional, Sequence

from server.backends.docstore import PUBLIC_ACL
from server.core.types import RankedHit

_SPACE = re.compile(r"\s+")


def _text_key(text: str) -> str:
    return hashlib.sha1(_SPACE.sub(" ", text).strip().lower().encode()).hexdigest()


def assemble(hits: Sequence[RankedHit], top_k: int, tenant: str, token_budget: int = 0,
             count_tokens: Optional[Callable[[list[str]], list[int]]] = None,
             dedupe: bool = True, acl_scopes: Sequence[str] = ()
             ) -> tuple[list[RankedHit], list[tuple[RankedHit, str]], int]:
    """Returns (selected, dropped with reasons, tokens used)."""
    readable = set(acl_scopes) | {PUBLIC_ACL}
    selected: list[RankedHit] = []
    dropped: list[tuple[RankedHit, str]] = []
    seen: dict[str, int] = {}
    used = 0
    costs: list[int] = []
    if token_budget > 0:
        if count_tokens is None:
            raise ValueError("a token budget needs a tokenizer")
        window = [h.candidate.record.text for h in hits[: max(top_k * 4, top_k)]]
        costs = count_tokens(window) if window else []
    for i, hit in enumerate(hits):
        if len(selected) == top_k:
            break
        rec = hit.candidate.record
        if rec.tenant != tenant:
            dropped.append((hit, "tenant_mismatch"))
            continue
        if not readable.intersection(rec.acl):
            dropped.append((hit, "acl_mismatch"))
            continue
        if dedupe:
            key = _text_key(rec.text)
            if key in seen:
                dropped.append((hit, f"duplicate_of:{seen[key]}"))
                continue
            seen[key] = rec.chunk_id
        if token_budget > 0:
            cost = costs[i] if i < len(costs) else count_tokens([rec.text])[0]
            if used + cost > token_budget:
                dropped.append((hit, f"over_token_budget:{cost}>{token_budget - used}"))
                continue
            used += cost
        selected.append(hit)
    return selected, dropped, used
