"""Release checks run before an alias flip: the ANN recall audit and the count reconciliation.

`publish` (CollectionStore.publish) refuses a build unless both passed and are recorded in its
descriptor.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from server.backends.dense import DenseIndex
from server.backends.docstore import DocStore
from server.backends.lexical import LexicalIndex
from server.core.collection import CollectionStore
from server.core.shards import shard_dir_name


def audit_build(store: CollectionStore, collection: str, build_id: str, k: int = 10,
                queries: Optional[np.ndarray] = None, n_queries: int = 200,
                min_recall: float = 0.9, seed: int = 7) -> dict:
    """ANN recall@k of the build against exact search over the same vectors, merged over shards,
    then the count reconciliation (reconcile_build).

    Queries: the given vectors, or a sample of the build's own chunk vectors ("held-in"). Both
    results are stored in the descriptor; `publish` refuses a build unless both passed.
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
    recon = reconcile_build(store, collection, build_id)  # publish needs both
    audit["reconciliation"] = {"passed": recon["passed"], "mismatches": recon["mismatches"]}
    return audit


def reconcile_build(store: CollectionStore, collection: str, build_id: str) -> dict:
    """Reconcile what a server would load for every shard (the build's files plus the streaming
    writes since), so it is also the check an operator runs after a crash. Stored in the
    descriptor.

    Mismatches (the build cannot be served as it is):
    - the faiss file's vectors differ from the rows the build wrote, or rows added since are not
      contiguous after them or lack their vector;
    - the BM25 index lacks a live row, or holds a row that is live nowhere and pending nowhere;
    - for a build that took no writes: live chunks, documents and tenants differ from the
      descriptor.
    Reported, not mismatches: pending rows (recovery orphans them) and dead rows still in BM25
    (recovery purges them)."""
    from server.backends.docstore import LIVE

    desc = store.descriptor(collection, build_id)
    bdir = store.build_dir(collection, build_id)
    mismatches, totals = [], {"documents": 0, "chunks": 0, "vectors": 0, "deleted_documents": 0,
                              "writes": 0, "pending_rows": 0, "bm25_rows_to_purge": 0}
    tenants: dict[str, int] = {}
    for s in range(desc.shards):
        name = shard_dir_name(s)
        sdir = bdir / name
        ds = DocStore(sdir / "docstore.sqlite")
        try:
            counts, states = ds.counts(), ds.row_states()
            deleted = sum(1 for v, live in ds.documents().values() if not live)
            writes = ds.last_write_seq()
            for t, n in ds.tenants().items():
                tenants[t] = tenants.get(t, 0) + n
            dense = DenseIndex.load(sdir, desc.metric, desc.shard_files.get(name))
            added_rows, _, added_vecs = ds.added_vectors(dense.ntotal)
            live_rows = set(ds.live_rows().tolist())
            row_state = dict(ds._conn().execute("SELECT row, live FROM chunks"))
        finally:
            ds.close()
        rows = sum(states.values())
        want = desc.shard_counts.get(name, {})
        if want and dense.ntotal != want.get("chunks"):
            mismatches.append(f"{name}: the faiss file holds {dense.ntotal} vectors, the build wrote "
                              f"{want.get('chunks')} rows")
        if dense.ntotal + len(added_rows) != rows:
            mismatches.append(f"{name}: faiss file ({dense.ntotal}) + rows added since "
                              f"({len(added_rows)}) = {dense.ntotal + len(added_rows)} vectors, "
                              f"the store {rows} rows")
        if len(added_rows) and not np.array_equal(added_rows, np.arange(dense.ntotal,
                                                                         dense.ntotal + len(added_rows))):
            mismatches.append(f"{name}: rows added since the build are not contiguous from {dense.ntotal}")
        if len(added_rows) and added_vecs.shape[1] != desc.dim:
            mismatches.append(f"{name}: rows added since the build lack {desc.dim}-d vectors")
        indexed = set(LexicalIndex.open(sdir / "lexical").indexed_rows())
        missing = live_rows - indexed
        stray = [r for r in indexed - live_rows if row_state.get(r) == LIVE or r not in row_state]
        to_purge = len(indexed - live_rows) - len(stray)
        if missing:
            mismatches.append(f"{name}: the BM25 index lacks {len(missing)} live rows")
        if stray:
            mismatches.append(f"{name}: the BM25 index holds {len(stray)} rows the store does not have")
        if not writes:
            if want and want.get("chunks") != counts["chunks"]:
                mismatches.append(f"{name}: {counts['chunks']} live chunks, the descriptor says "
                                  f"{want.get('chunks')}")
            if want and want.get("documents") != counts["documents"]:
                mismatches.append(f"{name}: {counts['documents']} documents, the descriptor says "
                                  f"{want.get('documents')}")
        totals["documents"] += counts["documents"]
        totals["chunks"] += counts["chunks"]
        totals["vectors"] += dense.ntotal + len(added_rows)
        totals["deleted_documents"] += deleted
        totals["writes"] += writes
        totals["pending_rows"] += states["pending"]
        totals["bm25_rows_to_purge"] += to_purge
    if not totals["writes"]:
        if totals["chunks"] != desc.chunks:
            mismatches.append(f"{totals['chunks']} live chunks in all, the descriptor says {desc.chunks}")
        if desc.tenants and tenants != desc.tenants:
            mismatches.append(f"tenant chunk counts {tenants} differ from the descriptor's {desc.tenants}")
    result = {"passed": not mismatches, "mismatches": mismatches, **totals, "tenants": len(tenants),
              "reconciled_at": time.time()}
    desc.reconciliation = result
    store.write_descriptor(desc)
    return result
