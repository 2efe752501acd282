"""The build stages: chunk -> embed -> (per shard) train -> add -> write -> describe; then audit.

Every output is written under a temporary build directory that is renamed into place only when the
whole build succeeded, so a crashed build never leaves a half build under builds/.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
from tqdm import tqdm

from index_builder.corpus import Document
from server.backends.dense import DenseIndex, build_dense, make_index, training_size
from server.backends.docstore import PUBLIC_ACL, ChunkRecord, DocStore
from server.backends.lexical import ANALYZER_VERSION, LexicalIndex
from server.core.chunking import CHUNKER_VERSION, chunk_id, chunk_text, embed_text, shard_of
from server.core.collection import NAME, CollectionStore, ReleaseDescriptor, check_name
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
    final_dir = store.build_dir(collection, build_id)
    if final_dir.exists():
        raise FileExistsError(f"build {final_dir} already exists")
    tmp_dir = final_dir.parent / f".tmp-{build_id}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        return _build(docs, store, collection, embedder, factory, shards, metric,
                      search_defaults or {}, build_id, tmp_dir, final_dir, quiet, seed,
                      dedicated_tenant_min_chunks)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _check_doc(doc: Document) -> None:
    if not NAME.match(doc.tenant):
        raise ValueError(f"document {doc.doc_id!r}: tenant {doc.tenant[:80]!r} must match {NAME.pattern}")
    for scope in doc.acl:
        if not NAME.match(scope):
            raise ValueError(f"document {doc.doc_id!r}: ACL scope {scope[:80]!r} must match {NAME.pattern}")


def _train_sample(x: np.ndarray, factory: str, dim: int, metric: str, rng) -> np.ndarray:
    want = training_size(make_index(factory, dim, metric))
    return x[rng.choice(len(x), size=min(want, len(x)), replace=False)] if want else x[:0]


def _build(docs, store, collection, embedder, factory, shards, metric, search_defaults, build_id,
           tmp_dir, final_dir, quiet, seed, dedicated_min) -> ReleaseDescriptor:
    # 1. chunk (and fingerprint the corpus: corpus_version is a content hash)
    corpus_hash = hashlib.sha256(CHUNKER_VERSION.encode())
    chunks: list[PendingChunk] = []
    seen_docs: set[str] = set()
    documents: list[Document] = []
    for doc in docs:
        if doc.doc_id in seen_docs:
            raise ValueError(f"duplicate document id {doc.doc_id!r} in the corpus")
        seen_docs.add(doc.doc_id)
        _check_doc(doc)
        documents.append(doc)
        corpus_hash.update(json.dumps([doc.doc_id, doc.title, doc.text, doc.tenant, sorted(doc.acl),
                                       sorted(doc.metadata.items())]).encode())
        s = shard_of(doc.doc_id, shards)
        for c in chunk_text(doc.text):
            chunks.append(PendingChunk(doc, c.index, c.start, c.end, c.text,
                                       chunk_id(doc.doc_id, c.index), s))
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
        sdir = tmp_dir / name
        sdir.mkdir()
        members = [i for i, c in enumerate(chunks) if c.shard == s]
        x = vectors[members]
        sample = _train_sample(x, factory, dim, metric, rng)
        row_ids = np.array([chunks[i].chunk_id for i in members], dtype=np.int64)
        with _progress(len(members), f"add shard {s}", quiet) as bar:
            dense = build_dense(factory, dim, metric, lambda: x, sample, row_ids, progress=bar.update)
        files = dense.write(sdir)
        np.save(sdir / "vectors.npy", x)  # exact vectors: audits, exact restricted search, rebuilds
        store_ = DocStore(sdir / "docstore.sqlite", create=True)
        records = [ChunkRecord(row, chunks[i].chunk_id, chunks[i].doc.doc_id, chunks[i].index,
                               chunks[i].start, chunks[i].end, chunks[i].doc.title, chunks[i].text,
                               chunks[i].doc.tenant, chunks[i].doc.metadata,
                               tuple(chunks[i].doc.acl) or (PUBLIC_ACL,))
                   for row, i in enumerate(members)]
        store_.insert_chunks(records)
        shard_docs = {}
        for i in members:
            shard_docs[chunks[i].doc.doc_id] = (chunks[i].doc.version, chunks[i].doc.tenant)
        store_.insert_documents((d, v, t) for d, (v, t) in shard_docs.items())
        store_.set_meta("corpus_version", corpus_version)
        store_.set_meta("build_id", build_id)
        counts = store_.counts()
        for t, n in store_.tenants().items():
            tenants[t] = tenants.get(t, 0) + n
        store_.close()
        lexical = LexicalIndex.create(sdir / "lexical")
        with _progress(len(records), f"bm25 shard {s}", quiet) as bar:
            lexical.add((r.row, r.title, r.text, r.tenant, r.metadata, r.acl) for r in records)
            bar.update(len(records))
        # tenants above the threshold: their own dense index (rows map to this shard's rows)
        for tenant, count in sorted(counts_by_tenant(records).items()):
            if dedicated_min is None or count < dedicated_min:
                continue
            rows = np.array([r.row for r in records if r.tenant == tenant], dtype=np.int64)
            tx = x[rows]
            tfactory = factory if len(tx) >= training_size(make_index(factory, dim, metric)) else "Flat"
            tdense = build_dense(tfactory, dim, metric, lambda: tx,
                                 _train_sample(tx, tfactory, dim, metric, rng), rows)
            tfiles = tdense.write(sdir / "tenants" / tenant)
            files[f"tenants/{tenant}"] = tfiles
            dedicated.setdefault(name, []).append(tenant)
        shard_files[name] = files
        shard_counts[name] = counts

    desc = ReleaseDescriptor(
        collection=collection, build_id=build_id, model_id=embedder.model_id,
        model_revision=embedder.revision, dim=dim, metric=metric, chunker=CHUNKER_VERSION,
        lexical_analyzer=ANALYZER_VERSION, factory=factory, shards=shards,
        corpus_version=corpus_version, documents=len(documents), chunks=len(chunks),
        created_at=time.time(), shard_files=shard_files, shard_counts=shard_counts,
        tenants=tenants, search_defaults=search_defaults, dedicated_tenants=dedicated)
    (tmp_dir / "release.json").write_text(desc.to_json())
    os.rename(tmp_dir, final_dir)
    return desc


def counts_by_tenant(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.tenant] = out.get(r.tenant, 0) + 1
    return out


def audit_build(store: CollectionStore, collection: str, build_id: str, k: int = 10,
                queries: Optional[np.ndarray] = None, n_queries: int = 200,
                min_recall: float = 0.9, seed: int = 7) -> dict:
    """ANN recall@k of the build against exact search over the same vectors, merged over shards.

    Queries: the given vectors, or a sample of the build's own chunk vectors ("held-in"). The result
    is stored in the descriptor; `publish` refuses a build whose audit did not pass.
    """
    desc = store.descriptor(collection, build_id)
    bdir = store.build_dir(collection, build_id)
    from server.backends.dense import SearchKnobs

    knobs = SearchKnobs(**desc.search_defaults) if desc.search_defaults else SearchKnobs()
    shards = []
    for s in range(desc.shards):
        sdir = bdir / shard_dir_name(s)
        dense = DenseIndex.load(sdir, desc.metric, desc.shard_files.get(shard_dir_name(s)), knobs)
        shards.append((dense, np.load(sdir / "vectors.npy", mmap_mode="r")))
    source = "given"
    if queries is None:
        rng = np.random.default_rng(seed)
        allv = np.concatenate([np.asarray(v) for _, v in shards])
        queries = allv[rng.choice(len(allv), size=min(n_queries, len(allv)), replace=False)]
        source = "held-in sample of chunk vectors"
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    import faiss

    ann_s, ann_i, ex_s, ex_i = [], [], [], []
    t0 = time.perf_counter()
    for dense, vecs in shards:
        s, r = dense.search(queries, k)
        ann_s.append(s)
        ann_i.append(dense.chunk_ids(r))
    ann_ms = (time.perf_counter() - t0) * 1e3 / len(queries)
    for dense, vecs in shards:
        flat = faiss.IndexFlatIP(desc.dim) if desc.metric == "ip" else faiss.IndexFlatL2(desc.dim)
        flat.add(np.ascontiguousarray(vecs, dtype=np.float32))
        s, r = flat.search(queries, min(k, flat.ntotal))
        if desc.metric == "l2":
            s = -s
        ex_s.append(s)
        ex_i.append(dense.chunk_ids(r))

    def topk(scores, ids):
        S, I = np.concatenate(scores, axis=1), np.concatenate(ids, axis=1)
        order = np.argsort(-S, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(I, order, axis=1)

    ann, exact = topk(ann_s, ann_i), topk(ex_s, ex_i)
    hits = [len(set(a[a >= 0]) & set(e[e >= 0])) / max(1, len(e[e >= 0])) for a, e in zip(ann, exact)]
    recall = float(np.mean(hits))
    audit = {"k": k, "recall": recall, "queries": len(queries), "query_source": source,
             "min_recall": min_recall, "passed": recall >= min_recall,
             "ann_ms_per_query": ann_ms, "search_defaults": knobs.__dict__,
             "audited_at": time.time()}
    desc.audit = audit
    store.write_descriptor(desc)
    return audit
