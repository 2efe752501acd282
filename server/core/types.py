"""Plain data passed between transport, core and shards (no grpc types here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from server.backends.docstore import ChunkRecord


@dataclass(frozen=True)
class Filter:
    key: str
    any_of: tuple[str, ...] = ()
    gte: Optional[str] = None
    lte: Optional[str] = None

    @property
    def is_range(self) -> bool:
        return self.gte is not None or self.lte is not None


@dataclass
class SearchQuery:
    collection: str
    text: str = ""
    vector: Optional[np.ndarray] = None
    vector_model_id: str = ""
    top_k: int = 10
    mode: str = "hybrid"          # dense | lexical | hybrid
    filters: tuple[Filter, ...] = ()
    include_trace: bool = False
    dense_depth: int = 0
    lexical_depth: int = 0
    rrf_k: int = 0
    rerank_depth: int = 0
    context_token_budget: int = 0
    allow_partial: bool = False


@dataclass
class WriteRequest:
    op: str                        # upsert | delete
    collection: str
    doc_id: str
    version: int
    text: str = ""
    title: str = ""
    metadata: dict = field(default_factory=dict)
    acl: tuple[str, ...] = ()
    source_modified_at: float = 0.0


@dataclass
class ShardQuery:
    """What one shard is asked: already embedded, already scoped to the caller's tenant."""

    build_id: str
    tenant: str
    vector: Optional[np.ndarray]   # (dim,) float32, or None for no dense branch
    model_id: str
    text: str                      # "" for no lexical branch
    dense_depth: int
    lexical_depth: int
    filters: tuple[Filter, ...] = ()
    acl_scopes: tuple[str, ...] = ()   # the caller's ACL scopes (PUBLIC_ACL is always added)
    text_top_n: int = 0                # remote shards: ship text for the first N hits of each list


@dataclass
class Candidate:
    """One chunk as a retriever saw it."""

    chunk_id: int
    score: float
    record: ChunkRecord
    shard: int


@dataclass
class ShardResult:
    shard: int
    corpus_version: str
    dense: list[Candidate]
    lexical: list[Candidate]
    dense_ms: float = 0.0
    lexical_ms: float = 0.0
    index_version: int = 0      # moves on every write to the shard


@dataclass
class RankedHit:
    candidate: Candidate
    score: float
    score_kind: str                          # cosine | inner_product | l2 | bm25 | rrf | cross_encoder
    dense: Optional[tuple[int, float]] = None    # (rank, score) in the merged dense list
    lexical: Optional[tuple[int, float]] = None
    fused: Optional[tuple[int, float]] = None
    rerank: Optional[tuple[int, float]] = None


@dataclass
class TraceEntry:
    chunk_id: int
    doc_id: str
    score: float
    rank: int
    reason: str = ""


@dataclass
class SearchResult:
    hits: list[RankedHit]
    build_id: str
    corpus_version: str
    model_id: str
    timings: dict[str, float]
    partial: bool = False
    shard_errors: list[str] = field(default_factory=list)
    trace: Optional[dict[str, list[TraceEntry]]] = None
    notes: list[str] = field(default_factory=list)
    context_tokens: int = 0
