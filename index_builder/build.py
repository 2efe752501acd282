"""The build stages: chunk -> embed -> (per shard) train -> add -> write -> describe; then audit.

Every output is written under a temporary build directory that is renamed into place only when the
whole build succeeded, so a crashed build never leaves a half build under builds/.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
from tqdm import tqdm

from index_builder.corpus import Document
from server.backends.dense import file_record
from server.backends.docstore import PUBLIC_ACL, ChunkRecord, chunk_fingerprint
from server.backends.lexical import ANALYZER_VERSION
from server.core.chunking import CHUNKER_VERSION, capped_chunks, chunk_id, embed_text, shard_of
from server.core.collection import NAME, CollectionStore, ReleaseDescriptor, check_name
from server.core.build_writer import write_shard
from server.core.collection import shard_dir_name
from server.core.validation import unit_vectors
from server.errors import InvalidArgument

DEFAULT_FACTORY = "Flat"


@dataclass
class PendingChunk:
    doc: Document
    index: int
    start: int
    end: int
    text: str
    chunk_id: int
    shard: int
    doc_row: int = -1  # the document's position in the corpus (own-vector builds)


def _progress(total: int, desc: str, quiet: bool):
    return tqdm(total=total, desc=desc, unit="chunk", disable=quiet, leave=False, mininterval=0.5)


def build_collection(docs: Iterable[Document], store: CollectionStore, collection: str, embedder,
                     factory: str = DEFAULT_FACTORY, shards: int = 1, metric: str = "ip",
                     search_defaults: Optional[dict] = None, build_id: Optional[str] = None,
                     quiet: bool = False, seed: int = 1234,
                     dedicated_tenant_min_chunks: Optional[int] = None,
                     vectors: Optional[np.ndarray] = None, model_id: Optional[str] = None,
                     audit_queries: Optional[np.ndarray] = None,
                     log_positions: Optional[dict] = None) -> ReleaseDescriptor:
    """Build a new immutable build of `collection`. Tenants owning at least
    `dedicated_tenant_min_chunks` chunks of a shard also get their own dense index there.

    Your own vectors: with `vectors` (one row per document, in corpus order) or a `vector` on
    every document, and `model_id` naming the model that made them, nothing is embedded and each
    document is one chunk (you chunked it yourself). `audit_queries` are held-out query vectors
    for the recall audit; a text build embeds spans of its own corpus for that when none are given.
    """
    check_name(collection)
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if vectors is not None and not model_id:
        raise ValueError(OWN_NEEDS_MODEL_ID)
    build_id = check_name(build_id or time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3),
                          "build")
    with store.staging(collection, build_id) as tmp_dir:
        return _build(docs, collection, embedder, factory, shards, metric, search_defaults or {},
                      build_id, tmp_dir, quiet, seed, dedicated_tenant_min_chunks, vectors,
                      model_id, audit_queries, log_positions or {})


OWN_NEEDS_MODEL_ID = ("a build from your own vectors (--vectors, or a `vector` field in the corpus) "
                      "needs --model-id: the model that made them (query vectors must carry it)")


def prepare_audit_queries(queries, dim: int, metric: str) -> np.ndarray:
    """Held-out audit query vectors, checked and scaled as the server scales query vectors."""
    queries = np.asarray(queries, dtype=np.float32)
    if queries.ndim != 2 or queries.shape[1] != dim or not len(queries):
        raise ValueError(f"audit queries must be an (n, {dim}) array, not {queries.shape}")
    if not np.isfinite(queries).all():
        raise ValueError("audit queries hold NaN or infinite values")
    try:
        return unit_vectors(queries, metric, "audit query")
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _check_doc(doc: Document) -> None:
    if not NAME.match(doc.tenant):
        raise ValueError(f"document {doc.doc_id!r}: tenant {doc.tenant[:80]!r} must match {NAME.pattern}")
    for scope in doc.acl:
        if not NAME.match(scope):
            raise ValueError(f"document {doc.doc_id!r}: ACL scope {scope[:80]!r} must match {NAME.pattern}")


def _own_vectors(documents: list[Document], vectors: Optional[np.ndarray],
                 metric: str) -> Optional[np.ndarray]:
    """Per-document vectors from --vectors (aligned with the corpus) or the JSONL `vector` field,
    scaled as the index compares them (unit length under `ip`, cosine: `unit_vectors`)."""
    given = [d.vector for d in documents]
    if vectors is None and all(v is None for v in given):
        return None
    if vectors is None:
        if any(v is None for v in given):
            missing = next(d.doc_id for d in documents if d.vector is None)
            raise ValueError(f"document {missing!r} has no vector while others do")
        dim = len(given[0])
        odd = next((d for d in documents if len(d.vector) != dim), None)
        if odd is not None:
            raise ValueError(f"document {odd.doc_id!r} has a vector of dimension {len(odd.vector)} "
                             f"and document {documents[0].doc_id!r} one of {dim}: give every "
                             "document a vector of one dimension")
        flag = next((d for d in documents if {bool, np.bool_} & set(map(type, d.vector))), None)
        if flag is not None:  # numpy would read True as 1.0 among floats (the reader refuses it)
            raise ValueError(f"document {flag.doc_id!r} has a vector holding booleans: give numbers")
        vectors = np.asarray(given)  # numbers as given (an all-boolean list stays bool)
    vectors = np.asarray(vectors)
    if not np.issubdtype(vectors.dtype, np.number) or np.issubdtype(vectors.dtype, np.complexfloating):
        raise ValueError(f"the vectors hold {vectors.dtype} values: give real numbers")
    if vectors.ndim != 2 or len(vectors) != len(documents):
        raise ValueError(f"{len(vectors) if vectors.ndim else 0} vectors for {len(documents)} "
                         "documents: give one per document, in corpus order")
    if vectors.shape[1] == 0:
        raise ValueError("the vectors have dimension 0: give each document a non-empty vector")
    # checked as given, before float32: a finite float64 past float32's range became inf in the
    # cast and was reported as "NaN or infinite" (outside QA)
    if not np.isfinite(vectors).all():
        bad = int(np.flatnonzero(~np.isfinite(vectors).all(axis=1))[0])
        raise ValueError(f"the vector of document {documents[bad].doc_id!r} (row {bad}) has NaN or "
                         "infinite values")
    # only wider floats can hold what float32 cannot (no copy of a float32 array for nothing)
    big = (np.abs(vectors).max(axis=1) > np.finfo(np.float32).max
           if vectors.dtype.kind == "f" and vectors.dtype.itemsize > 4 else np.zeros(0, bool))
    if big.any():
        bad = int(np.flatnonzero(big)[0])
        raise ValueError(f"the vector of document {documents[bad].doc_id!r} (row {bad}) has values "
                         f"beyond float32's range (|x| <= {np.finfo(np.float32).max:.3g}): vectors "
                         "are stored as float32")
    vectors = vectors.astype(np.float32, copy=False)
    try:
        return unit_vectors(vectors, metric, "the vector")
    except InvalidArgument as exc:
        raise ValueError(f"document {documents[exc.row].doc_id!r}: {exc}") from None


def _span_queries(chunks: list[PendingChunk], embedder, n: int, seed: int) -> np.ndarray:
    """Held-out audit queries for a text build: short spans (6-16 words) of random chunks,
    embedded like queries. They are not indexed vectors, so recall is not flattered by exact
    self-matches."""
    rng = np.random.default_rng(seed)
    texts = []
    for i in rng.choice(len(chunks), size=min(n, len(chunks)), replace=False):
        words = (chunks[i].text or chunks[i].doc.title).split()
        if not words:
            continue
        span = int(rng.integers(6, 17))
        start = int(rng.integers(0, max(1, len(words) - span + 1)))
        texts.append(" ".join(words[start:start + span]))
    return embedder.encode_many(texts) if texts else np.zeros((0, embedder.dim), np.float32)


def _build(docs, collection, embedder, factory, shards, metric, search_defaults, build_id,
           tmp_dir, quiet, seed, dedicated_min, given_vectors, model_id, audit_queries,
           log_positions) -> ReleaseDescriptor:
    # 1. chunk (and fingerprint the corpus: corpus_version is a content hash)
    corpus_hash = hashlib.sha256(CHUNKER_VERSION.encode())
    chunks: list[PendingChunk] = []
    seen_docs: set[tuple[str, str]] = set()
    documents: list[Document] = []
    for doc in docs:
        if (doc.tenant, doc.doc_id) in seen_docs:
            raise ValueError(f"duplicate document id {doc.doc_id!r} of tenant {doc.tenant!r} in the corpus")
        seen_docs.add((doc.tenant, doc.doc_id))
        _check_doc(doc)
        documents.append(doc)
    if shards > len(documents) and not quiet:  # (outside QA: 5,000 shards for 1,398 documents
        # were built for minutes without a word; streamed writes may fill them later)
        print(f"index-builder: note: {shards} shards for {len(documents)} documents: at least "
              f"{shards - len(documents)} shard(s) start empty", file=sys.stderr, flush=True)
    own = _own_vectors(documents, given_vectors, metric)
    # known only now: the vectors may come with the corpus (a `vector` field on every line)
    if own is not None and not model_id:
        raise ValueError(OWN_NEEDS_MODEL_ID)
    if own is None and embedder is None:
        raise ValueError("a text build needs an embedder (or your own vectors - --vectors FILE or "
                         "a `vector` field in the corpus - with --model-id)")
    if own is not None:
        corpus_hash.update(b"own-vectors")
    for i, doc in enumerate(documents):
        corpus_hash.update(json.dumps([doc.doc_id, doc.title, doc.text, doc.tenant, sorted(doc.acl),
                                       sorted(doc.metadata.items())]).encode())
        s = shard_of(doc.tenant, doc.doc_id, shards)
        if own is not None:  # the caller chunked (and embedded) it: one chunk
            chunks.append(PendingChunk(doc, 0, 0, len(doc.text), doc.text,
                                       chunk_id(doc.tenant, doc.doc_id, 0), s, i))
            continue
        try:
            pieces = capped_chunks(doc.title, doc.text, f"document {doc.doc_id!r}")
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        for c in pieces:
            chunks.append(PendingChunk(doc, c.index, c.start, c.end, c.text,
                                       chunk_id(doc.tenant, doc.doc_id, c.index), s))
    if not chunks:
        raise ValueError("the corpus has no text to index")
    if own is not None:
        corpus_hash.update(hashlib.sha256(own.tobytes()).digest())
    corpus_version = corpus_hash.hexdigest()[:16]

    # 2. embed every chunk once (batches of similar length), or take the caller's vectors
    if own is not None:
        vectors = own[[c.doc_row for c in chunks]]
        model, revision = model_id, "external"
    else:
        with _progress(len(chunks), "embed", quiet) as bar:
            vectors = embedder.encode_many([embed_text(c.doc.title, c.text) for c in chunks],
                                           progress=bar.update)
        model, revision = embedder.model_id, embedder.revision
        if audit_queries is None:
            audit_queries = _span_queries(chunks, embedder, 200, seed)
    dim = vectors.shape[1]
    if audit_queries is not None:
        np.save(tmp_dir / AUDIT_QUERIES, prepare_audit_queries(audit_queries, dim, metric))

    # 3. per shard: train, add in blocks, write dense + lexical + chunk store
    rng = np.random.default_rng(seed)
    shard_files, shard_counts, tenants, dedicated = {}, {}, {}, {}
    for s in range(shards):
        name = shard_dir_name(s)
        members = [i for i, c in enumerate(chunks) if c.shard == s]
        records = [ChunkRecord(row, chunks[i].chunk_id, chunks[i].doc.doc_id, chunks[i].index,
                               chunks[i].start, chunks[i].end, chunks[i].doc.title, chunks[i].text,
                               chunks[i].doc.tenant, chunks[i].doc.metadata,
                               tuple(chunks[i].doc.acl) or (PUBLIC_ACL,),
                               chunk_fingerprint(chunks[i].doc.title, chunks[i].text))
                   for row, i in enumerate(members)]
        shard_docs = {}
        for i in members:
            shard_docs[(chunks[i].doc.tenant, chunks[i].doc.doc_id)] = (chunks[i].doc.version, 1)
        out = write_shard(tmp_dir / name, records, vectors[members], shard_docs, factory, metric,
                          rng, dedicated_min, corpus_version, build_id, quiet, label=str(s))
        shard_files[name], shard_counts[name] = out.files, out.counts
        for t, n in out.tenants.items():
            tenants[t] = tenants.get(t, 0) + n
        if out.dedicated:
            dedicated[name] = out.dedicated

    desc = ReleaseDescriptor(
        collection=collection, build_id=build_id, model_id=model, model_revision=revision,
        dim=dim, metric=metric, chunker=CHUNKER_VERSION if own is None else "caller-chunked/v1",
        lexical_analyzer=ANALYZER_VERSION, factory=factory, shards=shards,
        corpus_version=corpus_version, documents=len(documents), chunks=len(chunks),
        created_at=time.time(), shard_files=shard_files, shard_counts=shard_counts,
        tenants=tenants, search_defaults=search_defaults, dedicated_tenants=dedicated,
        log_positions=log_positions,
        audit_queries=AUDIT_QUERIES if audit_queries is not None else None,
        audit_queries_file=(file_record(tmp_dir / AUDIT_QUERIES) if audit_queries is not None
                            else None))
    (tmp_dir / "release.json").write_text(desc.to_json())
    return desc


# the audit runs in-server too (compaction), so it lives with the core
from server.core.audit import AUDIT_QUERIES, audit_build, reconcile_build  # noqa: E402,F401
