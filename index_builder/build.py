"""The build stages: chunk -> embed -> (per shard) train -> add -> write -> describe; then audit.

Every output is written under a temporary build directory that is renamed into place only when the
whole build succeeded, so a crashed build never leaves a half build under builds/.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
from tqdm import tqdm

from index_builder.corpus import Document
from server.backends.docstore import PUBLIC_ACL, ChunkRecord
from server.backends.lexical import ANALYZER_VERSION
from server.core.chunking import CHUNKER_VERSION, chunk_id, chunk_text, embed_text, shard_of
from server.core.collection import NAME, CollectionStore, ReleaseDescriptor, check_name
from server.core.build_writer import write_shard
from server.core.shards import shard_dir_name

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


def _progress(total: int, desc: str, quiet: bool):
    return tqdm(total=total, desc=desc, unit="chunk", disable=quiet, leave=False, mininterval=0.5)


def build_collection(docs: Iterable[Document], store: CollectionStore, collection: str, embedder,
                     factory: str = DEFAULT_FACTORY, shards: int = 1, metric: str = "ip",
                     search_defaults: Optional[dict] = None, build_id: Optional[str] = None,
                     quiet: bool = False, seed: int = 1234,
                     dedicated_tenant_min_chunks: Optional[int] = None) -> ReleaseDescriptor:
    """Build a new immutable build of `collection`. Tenants owning at least
    `dedicated_tenant_min_chunks` chunks of a shard also get their own dense index there."""
    check_name(collection)
    if shards < 1:
        raise ValueError("shards must be >= 1")
    build_id = check_name(build_id or time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3),
                          "build")
    with store.staging(collection, build_id) as tmp_dir:
        return _build(docs, collection, embedder, factory, shards, metric, search_defaults or {},
                      build_id, tmp_dir, quiet, seed, dedicated_tenant_min_chunks)


def _check_doc(doc: Document) -> None:
    if not NAME.match(doc.tenant):
        raise ValueError(f"document {doc.doc_id!r}: tenant {doc.tenant[:80]!r} must match {NAME.pattern}")
    for scope in doc.acl:
        if not NAME.match(scope):
            raise ValueError(f"document {doc.doc_id!r}: ACL scope {scope[:80]!r} must match {NAME.pattern}")


def _build(docs, collection, embedder, factory, shards, metric, search_defaults, build_id,
           tmp_dir, quiet, seed, dedicated_min) -> ReleaseDescriptor:
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
        corpus_hash.update(json.dumps([doc.doc_id, doc.title, doc.text, doc.tenant, sorted(doc.acl),
                                       sorted(doc.metadata.items())]).encode())
        s = shard_of(doc.tenant, doc.doc_id, shards)
        for c in chunk_text(doc.text):
            chunks.append(PendingChunk(doc, c.index, c.start, c.end, c.text,
                                       chunk_id(doc.tenant, doc.doc_id, c.index), s))
    if not chunks:
        raise ValueError("the corpus has no text to index")
    corpus_version = corpus_hash.hexdigest()[:16]

    # 2. embed every chunk once (batches of similar length)
    with _progress(len(chunks), "embed", quiet) as bar:
        vectors = embedder.encode_many([embed_text(c.doc.title, c.text) for c in chunks],
                                       progress=bar.update)
    dim = vectors.shape[1]

    # 3. per shard: train, add in blocks, write dense + lexical + chunk store
    rng = np.random.default_rng(seed)
    shard_files, shard_counts, tenants, dedicated = {}, {}, {}, {}
    for s in range(shards):
        name = shard_dir_name(s)
        members = [i for i, c in enumerate(chunks) if c.shard == s]
        records = [ChunkRecord(row, chunks[i].chunk_id, chunks[i].doc.doc_id, chunks[i].index,
                               chunks[i].start, chunks[i].end, chunks[i].doc.title, chunks[i].text,
                               chunks[i].doc.tenant, chunks[i].doc.metadata,
                               tuple(chunks[i].doc.acl) or (PUBLIC_ACL,))
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
        collection=collection, build_id=build_id, model_id=embedder.model_id,
        model_revision=embedder.revision, dim=dim, metric=metric, chunker=CHUNKER_VERSION,
        lexical_analyzer=ANALYZER_VERSION, factory=factory, shards=shards,
        corpus_version=corpus_version, documents=len(documents), chunks=len(chunks),
        created_at=time.time(), shard_files=shard_files, shard_counts=shard_counts,
        tenants=tenants, search_defaults=search_defaults, dedicated_tenants=dedicated)
    (tmp_dir / "release.json").write_text(desc.to_json())
    return desc


# the audit runs in-server too (compaction), so it lives with the core
from server.core.audit import audit_build, reconcile_build  # noqa: E402,F401
