"""Every request field checked against the documented limits (server/core/limits.py), in one place.

The public API (searches, writes) and the shard port (shard queries, fetches, writes) enforce the
same limits: a shard server never trusts its caller to have checked them.
"""
from __future__ import annotations

import math
import numpy as np

from server.backends.docstore import check_filter_key
from server.core import limits
from server.core.collection import NAME, ReleaseDescriptor
from server.core.types import FetchRequest, Filter, SearchQuery, ShardQuery, ShardWrite, WriteRequest
from server.errors import InvalidArgument, ModelMismatch

MODES = ("dense", "lexical", "hybrid")


def check_filters(filters: tuple[Filter, ...]) -> None:
    if len(filters) > limits.MAX_FILTERS:
        raise InvalidArgument(f"{len(filters)} filters; the cap is {limits.MAX_FILTERS}")
    for f in filters:
        check_filter_key(f.key)
        if not (f.any_of or f.is_range) or len(f.any_of) > limits.MAX_FILTER_VALUES:
            raise InvalidArgument(f"filter {f.key!r} needs 1..{limits.MAX_FILTER_VALUES} values "
                                  "or a gte/lte range")
        if f.gte is not None and f.lte is not None and f.gte > f.lte:
            raise InvalidArgument(f"filter {f.key!r}: gte {f.gte!r} is above lte {f.lte!r}")
        if any(len(v) > limits.MAX_FILTER_VALUE_CHARS for v in f.any_of + (f.gte or "", f.lte or "")):
            raise InvalidArgument(f"a value of filter {f.key!r} exceeds "
                                  f"{limits.MAX_FILTER_VALUE_CHARS} characters")


def check_batch_size(n: int) -> None:
    """A SearchBatch holds 1 to MAX_BATCH_QUERIES queries, counted as sent (before any is
    decoded: an undecodable query still costs a slot)."""
    if not n:
        raise InvalidArgument("a batch needs at least one query")
    if n > limits.MAX_BATCH_QUERIES:
        raise InvalidArgument(f"{n} queries; a batch takes at most {limits.MAX_BATCH_QUERIES}")


def check_vector(vector: np.ndarray, model_id: str, desc: ReleaseDescriptor) -> None:
    """A query or chunk vector must carry the build's model id, its dimension, finite values."""
    if not model_id:
        raise ModelMismatch("vector has no model id; tag it with the model that produced it "
                            f"(this build serves {desc.model_id!r})")
    if model_id != desc.model_id:
        raise ModelMismatch(f"vector is from model {model_id!r}; collection {desc.collection!r} "
                            f"serves {desc.model_id!r}")
    if vector.ndim != 1 or vector.shape[0] != desc.dim:
        raise InvalidArgument(f"vector has dimension {vector.shape[-1] if vector.ndim else 0}; "
                              f"collection {desc.collection!r} has dimension {desc.dim}")
    if not np.isfinite(vector).all():
        raise InvalidArgument("vector contains NaN or infinite values")


def unit_vectors(vectors: np.ndarray, metric: str, what: str = "vector") -> np.ndarray:
    """Vectors (one, or one per row) as the index compares them. An `ip` collection ranks by
    cosine similarity, so every vector it is given - built, written or queried - is scaled to unit
    length first (in float64: no finite input overflows), as Qdrant's cosine distance does; without
    it one long vector outranks everything, and the length of a query vector would decide how much
    dense feedback moves it. A zero vector has no direction and is refused. An `l2` collection keeps
    lengths (they are the distance) and refuses vectors too long for float32 distances."""
    if metric == "ip" and getattr(vectors, "ndim", 0) == 1 and vectors.dtype == np.float32:
        wide = vectors.astype(np.float64)  # the hot path, one query vector: ~3 us
        squared = float(np.dot(wide, wide))
        if 1e-30 < squared < 1e30:  # a float32 scale factor is exact enough; else the slow path
            return vectors * np.float32(1.0 / math.sqrt(squared))
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    flat = norms.reshape(-1)
    bad = np.flatnonzero(flat == 0 if metric == "ip" else flat > limits.MAX_VECTOR_NORM)
    if len(bad):
        row = int(bad[0])
        where = "" if v.ndim == 1 else f" (row {row})"
        err = InvalidArgument(
            f"{what}{where} is all zeros: under cosine similarity it has no direction to rank by"
            if metric == "ip" else
            f"{what}{where} has length {float(flat[row]):.3g}; the cap is "
            f"{limits.MAX_VECTOR_NORM:g} (float32 distances overflow beyond it)")
        err.row = row if v.ndim > 1 else None
        raise err
    if metric == "ip":
        return (v / norms).astype(np.float32)
    return np.asarray(vectors, dtype=np.float32)


def validate_query(q: SearchQuery, desc: ReleaseDescriptor, rerank_cap: int) -> str:
    """Check every field of a public search; return the resolved mode."""
    if len(q.text) > limits.MAX_QUERY_CHARS:
        raise InvalidArgument(f"query text is {len(q.text)} characters; the cap is "
                              f"{limits.MAX_QUERY_CHARS}")
    mode = q.mode or ("hybrid" if q.text.strip() else "dense")
    if mode not in MODES:
        raise InvalidArgument(f"unknown mode {mode!r}; use one of {MODES}")
    if not 1 <= q.top_k <= limits.MAX_TOP_K:
        raise InvalidArgument(f"top_k must be between 1 and {limits.MAX_TOP_K}, not {q.top_k}")
    for name, depth in (("dense_depth", q.dense_depth), ("lexical_depth", q.lexical_depth)):
        if depth > limits.MAX_DEPTH:
            raise InvalidArgument(f"{name} {depth} exceeds the cap {limits.MAX_DEPTH}")
    if q.rrf_k > limits.MAX_RRF_K:
        raise InvalidArgument(f"rrf_k {q.rrf_k} exceeds the cap {limits.MAX_RRF_K}")
    if q.rerank_depth > rerank_cap:
        raise InvalidArgument(f"rerank_depth {q.rerank_depth} exceeds the server cap {rerank_cap}")
    if q.context_token_budget > limits.MAX_CONTEXT_TOKENS:
        raise InvalidArgument(f"context_token_budget exceeds the cap {limits.MAX_CONTEXT_TOKENS}")
    if q.min_applied_sequence > limits.MAX_SEQUENCE:
        raise InvalidArgument(f"min_applied_sequence exceeds {limits.MAX_SEQUENCE}")
    if q.feedback_docs is not None and q.feedback_docs > limits.MAX_FEEDBACK_DOCS:
        raise InvalidArgument(f"feedback_docs exceeds the cap {limits.MAX_FEEDBACK_DOCS}")
    if q.feedback_weight is not None and not 0.0 <= q.feedback_weight <= 1.0:
        raise InvalidArgument("feedback_weight must be between 0 and 1")
    if q.lexical_feedback_terms is not None and q.lexical_feedback_terms > limits.MAX_EXPANSION_TERMS:
        raise InvalidArgument(f"lexical_feedback_terms exceeds the cap {limits.MAX_EXPANSION_TERMS}")
    if q.dense_weight is not None and not 0.0 < q.dense_weight < 1.0:
        raise InvalidArgument("dense_weight must be strictly between 0 and 1")
    check_filters(q.filters)
    needs_text = mode in ("lexical", "hybrid") or (mode == "dense" and q.vector is None)
    if needs_text and not q.text.strip():
        if not q.mode:  # the caller named no mode: say what a query needs, not what we guessed
            raise InvalidArgument("a query needs a non-empty text or a query vector")
        raise InvalidArgument(f"mode {mode} needs a non-empty query text"
                              + ("" if mode != "dense" else " or a query vector"))
    if q.vector is not None:
        check_vector(q.vector, q.vector_model_id, desc)
        if mode == "lexical":
            raise InvalidArgument("mode lexical takes text, not a vector")
    return mode


def validate_shard_query(q: ShardQuery, dim: int) -> None:
    """The shard port's own check of what a router sends (the same caps as the public API)."""
    if not q.tenant or not NAME.match(q.tenant):
        raise InvalidArgument("a shard query needs a valid tenant")
    if len(q.text) > limits.MAX_QUERY_CHARS:
        raise InvalidArgument(f"query text exceeds {limits.MAX_QUERY_CHARS} characters")
    for name, depth in (("dense_depth", q.dense_depth), ("lexical_depth", q.lexical_depth),
                        ("text_top_n", q.text_top_n)):
        if not 0 <= depth <= limits.MAX_DEPTH:
            raise InvalidArgument(f"{name} {depth} is outside 0..{limits.MAX_DEPTH}")
    if len(q.acl_scopes) > limits.MAX_ACL_SCOPES or any(not NAME.match(a) for a in q.acl_scopes):
        raise InvalidArgument(f"acl_scopes: at most {limits.MAX_ACL_SCOPES} names matching "
                              f"{NAME.pattern}")
    check_filters(q.filters)
    if q.vector is not None:
        if q.vector.shape != (dim,):
            raise InvalidArgument(f"query vector has dimension {q.vector.shape[-1]}, the "
                                  f"collection's is {dim}")
        if not np.isfinite(q.vector).all():
            raise InvalidArgument("query vector contains NaN or infinite values")
    if not 0 <= q.min_applied_seq <= limits.MAX_SEQUENCE:
        raise InvalidArgument(f"min_applied_seq is outside 0..{limits.MAX_SEQUENCE}")
    if len(q.expansion) > limits.MAX_EXPANSION_TERMS:
        raise InvalidArgument(f"{len(q.expansion)} expansion terms; the cap is "
                              f"{limits.MAX_EXPANSION_TERMS}")
    for term, weight in q.expansion:
        if not term or len(term) > limits.MAX_TERM_CHARS:
            raise InvalidArgument(f"expansion terms have 1..{limits.MAX_TERM_CHARS} characters")
        if not 0.0 < weight <= limits.MAX_TERM_WEIGHT:  # also refuses NaN
            raise InvalidArgument(f"expansion term weights are in (0, {limits.MAX_TERM_WEIGHT}]")


def validate_fetch(req: FetchRequest) -> None:
    if not req.tenant or not NAME.match(req.tenant):
        raise InvalidArgument("a fetch needs a valid tenant")
    if len(req.rows) > limits.MAX_FETCH_ROWS:
        raise InvalidArgument(f"{len(req.rows)} rows; a fetch takes at most {limits.MAX_FETCH_ROWS}")
    if any(not 0 <= r <= limits.MAX_ROW for r in req.rows):
        raise InvalidArgument(f"rows must be between 0 and {limits.MAX_ROW} (2^63 - 1)")
    if len(req.acl_scopes) > limits.MAX_ACL_SCOPES or any(not NAME.match(a) for a in req.acl_scopes):
        raise InvalidArgument(f"acl_scopes: at most {limits.MAX_ACL_SCOPES} names matching "
                              f"{NAME.pattern}")


def validate_write(w: WriteRequest) -> None:
    """A public write (UpsertDocument / DeleteDocument) before it is chunked and embedded."""
    if w.op not in ("upsert", "delete"):
        raise InvalidArgument(f"unknown write operation {w.op!r}")
    check_doc(w.doc_id, w.version)
    if w.op == "upsert" and not w.doc_id.strip():
        # (outside QA: " " was stored as a document id). New documents only: a delete of one
        # stored before stays possible, and shards never refuse what their log already holds
        raise InvalidArgument("doc_id must hold a character other than spaces")
    if len(w.text) > limits.MAX_DOC_TEXT_CHARS:
        raise InvalidArgument(f"text is {len(w.text)} characters; the cap is {limits.MAX_DOC_TEXT_CHARS}")
    if len(w.title) > limits.MAX_TITLE_CHARS:
        raise InvalidArgument(f"title exceeds {limits.MAX_TITLE_CHARS} characters")
    check_metadata(w.metadata, w.acl)
    for k, v in w.metadata.items():
        # stored, but no filter could match it (SQLite's JSON reads stop there). Refused for new
        # writes only (here: the API and the builder), not in check_metadata, which shards also
        # run on writes the log or a replay delivers: one logged before this check must apply
        if "\x00" in v:
            raise InvalidArgument(f"metadata {k!r} holds a NUL character")
    if w.source_modified_at and not math.isfinite(w.source_modified_at):
        raise InvalidArgument("source_modified_at must be finite")
    if w.chunks:
        if w.op != "upsert":
            raise InvalidArgument("a delete carries no chunks")
        if w.text:
            raise InvalidArgument("give either text (the server chunks it) or chunks, not both")
        if len(w.chunks) > limits.MAX_CHUNKS_PER_DOC:
            raise InvalidArgument(f"{len(w.chunks)} chunks; the cap is {limits.MAX_CHUNKS_PER_DOC}")
        total = sum(len(t) for t, _ in w.chunks)
        if total > limits.MAX_DOC_TEXT_CHARS:
            raise InvalidArgument(f"chunk text is {total} characters; the cap is {limits.MAX_DOC_TEXT_CHARS}")
        if any(not t.strip() for t, _ in w.chunks):
            raise InvalidArgument("every chunk needs non-empty text")
    elif w.op == "upsert" and not (w.text.strip() or w.title.strip()):
        raise InvalidArgument("an upsert needs non-empty text or title (use DeleteDocument to remove)")


def check_doc(doc_id: str, version: int) -> None:
    if not doc_id or len(doc_id) > limits.MAX_DOC_ID_CHARS or not doc_id.isprintable():
        raise InvalidArgument(f"doc_id must be 1..{limits.MAX_DOC_ID_CHARS} printable characters")
    if not 1 <= version <= limits.MAX_VERSION:
        raise InvalidArgument(f"version must be between 1 and {limits.MAX_VERSION} (2^63 - 1), "
                              f"not {version}")


def check_metadata(metadata: dict, acl) -> None:
    if len(metadata) > limits.MAX_METADATA_ENTRIES:
        raise InvalidArgument(f"{len(metadata)} metadata entries; the cap is {limits.MAX_METADATA_ENTRIES}")
    for k, v in metadata.items():
        check_filter_key(k, "metadata key")  # metadata keys are what filters name
        if len(v) > limits.MAX_METADATA_VALUE_CHARS:
            raise InvalidArgument(f"metadata {k!r} exceeds {limits.MAX_METADATA_VALUE_CHARS} characters")
    if len(acl) > limits.MAX_ACL_SCOPES or any(not NAME.match(a) for a in acl):
        raise InvalidArgument(f"acl: at most {limits.MAX_ACL_SCOPES} scopes matching {NAME.pattern}")


def validate_shard_write(w: ShardWrite, desc: ReleaseDescriptor) -> None:
    """The shard's own check of a write a router or the log delivers."""
    if w.op not in ("upsert", "delete"):
        raise InvalidArgument(f"unknown write operation {w.op!r}")
    if not w.tenant or not NAME.match(w.tenant):
        raise InvalidArgument("a shard write needs a valid tenant")
    check_doc(w.doc_id, w.version)
    check_metadata(w.body.get("metadata") or {}, w.body.get("acl") or ())
    if len(w.chunks) > limits.MAX_CHUNKS_PER_DOC:
        raise InvalidArgument(f"{len(w.chunks)} chunks; the cap is {limits.MAX_CHUNKS_PER_DOC}")
    if w.op == "upsert" and w.chunks:
        if w.vectors is None or w.vectors.shape != (len(w.chunks), desc.dim):
            raise InvalidArgument(f"an upsert of {len(w.chunks)} chunks needs that many "
                                  f"{desc.dim}-d vectors")
        if not np.isfinite(w.vectors).all():
            raise InvalidArgument("chunk vectors contain NaN or infinite values")

