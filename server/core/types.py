"""Plain data passed between transport, core and shards (no grpc types here)."""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from server.backends.docstore import ChunkRecord


KEY_PART_MAX_CHARS = 256


def small_key(part):
    """A cache-key part as itself, or as its digest when large: caches count entries, not
    bytes, and keys holding a query's text and filters whole let one client's unique queries
    with 1 MB of filters each hold ~1.4 GB (outside QA)."""
    text = part if isinstance(part, str) else repr(part)
    if len(text) <= KEY_PART_MAX_CHARS:
        return part
    return ("sha256", hashlib.sha256(text.encode()).hexdigest())


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
    min_applied_sequence: int = 0   # read-your-writes: the WriteResponse.sequence to see
    feedback_docs: Optional[int] = None     # hybrid dense feedback: fused hits fed back (None: default)
    feedback_weight: Optional[float] = None  # their weight against the query's (None: default)
    lexical_feedback_terms: Optional[int] = None  # RM3 expansion terms (None: default, 0: off)
    dense_weight: Optional[float] = None     # weighted fusion: the dense list's share (None: 0.5)
    fusion: str = "rrf"                      # rrf | minmax (hybrid only)


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
    chunks: tuple = ()              # (text, vector) pairs the caller chunked and embedded itself
    vector_model_id: str = ""       # the model of those vectors (must be the collection's)


@dataclass(frozen=True)
class TermStats:
    """BM25 statistics of a query's analysed terms over one shard's lexical index, or summed
    (`+`) over every shard of a collection: the documents counted and, per term, how many hold
    it in the text and in the title."""

    docs: int
    df: tuple[tuple[str, int, int], ...] = ()   # (term, text documents, title documents)

    def __add__(self, other: "TermStats") -> "TermStats":
        summed: dict[str, list[int]] = {}
        for t, text_df, title_df in self.df + other.df:
            cur = summed.setdefault(t, [0, 0])
            cur[0] += text_df
            cur[1] += title_df
        return TermStats(self.docs + other.docs, tuple((t, a, b) for t, (a, b) in summed.items()))


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
    text_top_n: int = 0                # ship text for the first N hits of each list (0 = all)
    min_applied_seq: int = 0           # read-your-writes: answer only once this log position is applied
    expansion: tuple[tuple[str, float], ...] = ()  # lexical feedback: (analysed term, boost)
    # a router's follow-up round (feedback) asks the replica that answered the first round, so
    # one answer never mixes two replicas' versions of a document; never sent to a shard
    replica: str = ""
    # the statistics round before a lexical search of a collection of several shards: answer
    # with this shard's TermStats for the text's terms, search nothing
    stats_only: bool = False
    term_stats: Optional[TermStats] = None   # the collection's, to score BM25 with

    @property
    def restriction(self) -> tuple:
        """Queries with equal restrictions share one batched search with one selector."""
        return (self.build_id, self.tenant, tuple(sorted(self.acl_scopes)), self.filters)


@dataclass(frozen=True)
class FetchRequest:
    """Records of rows sent without text (see ShardQuery.text_top_n), re-checked for liveness and
    visibility to the caller; with their stored vectors when asked (dense feedback)."""

    build_id: str
    tenant: str
    acl_scopes: tuple[str, ...]
    rows: tuple[int, ...]
    with_vectors: bool = False
    # a router asks the replica whose answer ranked these rows first (rows number one replica's
    # chunk versions); never sent to a shard
    replica: str = ""


@dataclass
class ShardWrite:
    """One document write for one shard, already chunked and embedded. `seq` is its position in
    the write log (0 in the embedded default, where the shard's own log numbers it)."""

    op: str                                   # upsert | delete
    tenant: str
    doc_id: str
    version: int
    body: dict                                # title, text, metadata, acl, source_modified_at, ingested_at
    chunks: tuple = ()                        # server.core.chunking.Chunk
    vectors: Optional[np.ndarray] = None      # (len(chunks), dim) float32
    seq: int = 0
    model_id: str = ""                        # the model of `vectors`

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.doc_id)


@dataclass(frozen=True)
class WriteOutcome:
    outcome: str          # applied | noop
    stored_version: int
    index_version: int
    seq: int = 0          # the log position it was recorded at


@dataclass(frozen=True)
class StoredVersions:
    """The stored version of documents a shard holds, a deleted one's (its tombstone's) too, read
    at one index version: a write of one of them at a version not above its own would be a
    no-op, answered with these."""
    versions: dict        # (tenant, doc_id) -> version; documents the shard never held are absent
    index_version: int


@dataclass
class ShardInfo:
    """What a shard says about itself: the build it serves, how far it has applied the write log,
    its counts (of one tenant when asked for one), and optionally a digest of its live rows."""

    shard_no: int
    collection: str
    build_id: str
    corpus_version: str
    model_id: str
    index_version: int
    applied_seq: int
    documents: int
    chunks: int
    vectors: int
    descriptor_json: str = ""
    live_digest: str = ""
    state: str = "serving"      # serving | catching_up
    tombstone_ratio: float = 0.0
    address: str = ""           # for replicas: which one answered
    replicas: list = field(default_factory=list)  # a replica set: every replica's own ShardInfo
    also_serves: tuple = ()     # builds still answered after an alias flip (a grace period)


@dataclass(slots=True)
class Candidate:
    """One chunk as a retriever saw it."""

    chunk_id: int
    score: float
    record: ChunkRecord
    shard: int
    vector: Optional[np.ndarray] = None   # only from a fetch that asked for vectors

    def __reduce__(self):  # as ChunkRecord's: one tuple of the fields (the engine link)
        return (Candidate, _candidate_fields(self))


_candidate_fields = operator.attrgetter(*(f.name for f in fields(Candidate)))


@dataclass
class ShardResult:
    shard: int
    corpus_version: str
    dense: list[Candidate]
    lexical: list[Candidate]
    dense_ms: float = 0.0
    lexical_ms: float = 0.0
    index_version: int = 0      # moves on every write to the shard
    applied_seq: int = 0        # the write-log position the answer reflects
    batch_size: int = 1         # queries in the batched search that answered this one
    replica: str = ""           # which replica of a replica set answered (set by the router)
    term_stats: Optional[TermStats] = None   # the answer to a statistics round (stats_only)


@dataclass(slots=True)
class RankedHit:
    candidate: Candidate
    score: float
    score_kind: str                          # cosine | inner_product | l2 | bm25 | rrf | minmax | cross_encoder
    dense: Optional[tuple[int, float]] = None    # (rank, score) in the merged dense list
    lexical: Optional[tuple[int, float]] = None
    fused: Optional[tuple[int, float]] = None
    rerank: Optional[tuple[int, float]] = None
    fused_kind: str = "rrf"                  # how `fused` was computed: rrf | minmax


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
