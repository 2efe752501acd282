"""Release checks run before an alias flip - the ANN recall audit and the count reconciliation -
and the knob tuning that picks the cheapest search setting meeting a recall target.

`publish` (CollectionStore.publish) refuses a build unless both checks passed and are recorded in
its descriptor. Recall is measured with HELD-OUT queries: the builder stores vectors that are not
in the index (embedded spans of the corpus, or the user's own query vectors) as
`audit_queries.npy`; sampling queries from the index itself flatters ANN recall (each query's
nearest neighbour is itself). A build without held-out queries is audited held-in, and says so.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import faiss
import numpy as np

from server.backends.dense import DenseIndex, SearchKnobs, _unwrap, has_refine
from server.backends.docstore import DocStore
from server.backends.lexical import LexicalIndex
from server.core.collection import CollectionStore, ReleaseDescriptor, shard_dir_name
from server.errors import IndexCorruptError

AUDIT_QUERIES = "audit_queries.npy"
EF_GRID = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
NPROBE_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)
K_FACTOR_GRID = (1, 2, 4, 8, 16, 32)


def _load_shards(store: CollectionStore, desc: ReleaseDescriptor, knobs: SearchKnobs):
    bdir = store.build_dir(desc.collection, desc.build_id)
    out = []
    for s in range(desc.shards):
        sdir = bdir / shard_dir_name(s)
        dense = DenseIndex.load(sdir, desc.metric, desc.shard_files.get(shard_dir_name(s)), knobs)
        out.append((dense, np.load(sdir / "vectors.npy", mmap_mode="r")))
    return out


def _queries(store: CollectionStore, desc: ReleaseDescriptor, shards, queries, n: int,
             seed: int) -> tuple[np.ndarray, str]:
    if queries is not None:
        return np.ascontiguousarray(queries, np.float32), "held-out (given)"
    path = store.build_dir(desc.collection, desc.build_id) / AUDIT_QUERIES
    if path.is_file():  # whole: audit_build checked the build's files (the size and sha256 of it)
        return np.ascontiguousarray(np.load(path)[:max(n, 1)], np.float32), "held-out (build)"
    if desc.audit_queries:  # outside QA: a deleted file made the audit fall back, silently, to
        # the flattering held-in sample its build was made to avoid
        raise IndexCorruptError(f"build {desc.build_id} was made with held-out audit queries, "
                                f"but {path} is missing; rebuild, or audit with --audit-queries")
    rng = np.random.default_rng(seed)
    allv = np.concatenate([np.asarray(v) for _, v in shards])
    pick = rng.choice(len(allv), size=min(n, len(allv)), replace=False)
    return np.ascontiguousarray(allv[pick], np.float32), "held-in sample of chunk vectors (optimistic)"


class _RecallProbe:
    """Exact top-k of the audit queries, computed once, against which any knob setting is scored."""

    def __init__(self, shards, queries: np.ndarray, k: int, metric: str, dim: int):
        self.shards, self.queries, self.k = shards, queries, k
        ex_s, ex_i = [], []
        for dense, vecs in shards:
            if not len(vecs):  # a shard left empty (fewer documents than shards) adds no hit
                continue
            flat = faiss.IndexFlatIP(dim) if metric == "ip" else faiss.IndexFlatL2(dim)
            flat.add(np.ascontiguousarray(vecs, dtype=np.float32))
            s, r = flat.search(queries, min(k, flat.ntotal))
            ex_s.append(-s if metric == "l2" else s)
            ex_i.append(dense.chunk_ids(r))
        self.exact = self._topk(ex_s, ex_i)

    def _topk(self, scores, ids) -> np.ndarray:
        S, I = np.concatenate(scores, axis=1), np.concatenate(ids, axis=1)
        order = np.argsort(-S, axis=1, kind="stable")[:, :self.k]
        return np.take_along_axis(I, order, axis=1)

    def measure(self, knobs: SearchKnobs) -> tuple[float, float]:
        """(recall@k, ms per query of one batched search per shard) at these knobs."""
        ann_s, ann_i = [], []
        t0 = time.perf_counter()
        for dense, _ in self.shards:
            s, r = dense.search(self.queries, self.k, knobs=knobs)
            ann_s.append(s)
            ann_i.append(dense.chunk_ids(r))
        ms = (time.perf_counter() - t0) * 1e3 / len(self.queries)
        ann = self._topk(ann_s, ann_i)
        hits = [len(set(a[a >= 0]) & set(e[e >= 0])) / max(1, len(e[e >= 0]))
                for a, e in zip(ann, self.exact)]
        return float(np.mean(hits)), ms


def index_knobs(index: faiss.Index) -> tuple[str, ...]:
    """The search knobs that apply to this index: efSearch (HNSW), nprobe (IVF), k_factor (a
    refine step)."""
    top = faiss.downcast_index(index)
    inner = _unwrap(top)
    names = ("ef_search",) if isinstance(inner, faiss.IndexHNSW) else \
        ("nprobe",) if isinstance(inner, faiss.IndexIVF) else ()
    return names + (("k_factor",) if has_refine(top) and names else ())


def _candidate_knobs(index: faiss.Index, base: SearchKnobs,
                     pinned: Sequence[str] = ()) -> list[list[SearchKnobs]]:
    """Knob settings to try, as lists ordered from cheapest to dearest (recall grows along each);
    `pinned` knobs keep the base's value (given on the command line) while the others tune."""
    top = faiss.downcast_index(index)
    inner = _unwrap(top)
    refine = has_refine(top)
    if isinstance(inner, faiss.IndexHNSW):
        if "ef_search" in pinned:
            return []
        return [[SearchKnobs(base.nprobe, ef, base.k_factor) for ef in EF_GRID]]
    if isinstance(inner, faiss.IndexIVF):
        probes = ([base.nprobe] if "nprobe" in pinned
                  else [p for p in NPROBE_GRID if p <= inner.nlist] or [inner.nlist])
        factors = K_FACTOR_GRID if refine and "k_factor" not in pinned else (base.k_factor,)
        if len(probes) == 1 and len(factors) == 1:
            return []
        return [[SearchKnobs(p, base.ef_search, kf) for p in probes] for kf in factors]
    return []


def tune_knobs(probe: _RecallProbe, index: faiss.Index, base: SearchKnobs,
               target: float, pinned: Sequence[str] = (),
               progress: Optional[Callable[[str], None]] = None) -> tuple[SearchKnobs, list[dict]]:
    """The cheapest setting (by measured time) that meets `target` recall; along each list the
    first setting meeting it is taken (recall grows along it). When none does, the setting with
    the best recall, and the caller's audit then fails on its own threshold. `pinned` knobs
    stay as they are. `progress` hears each setting measured (a sweep of a large build takes
    minutes)."""
    sweep, meeting = [], []
    best = (base, -1.0, float("inf"))
    applies = index_knobs(index)
    for lst in _candidate_knobs(index, base, pinned):
        for knobs in lst:
            recall, ms = probe.measure(knobs)
            sweep.append({"knobs": knobs.__dict__, "recall": recall, "ms_per_query": ms})
            if progress is not None:
                shown = " ".join(f"{k}={v}" for k, v in knobs.__dict__.items() if k in applies)
                progress(f"tuning: {shown}: recall {recall:.4f} (target {target}), "
                         f"{ms:.3f} ms/query")
            if recall > best[1]:
                best = (knobs, recall, ms)
            if recall >= target:
                meeting.append((ms, knobs))
                break
    if meeting:
        return min(meeting, key=lambda m: m[0])[1], sweep
    return best[0], sweep


def audit_build(store: CollectionStore, collection: str, build_id: str, k: int = 10,
                queries: Optional[np.ndarray] = None, n_queries: int = 200,
                min_recall: float = 0.9, seed: int = 7, target_recall: Optional[float] = None,
                state_root: Optional[Path] = None, record: bool = True,
                pinned: Sequence[str] = (), progress: Optional[Callable[[str], None]] = None) -> dict:
    """ANN recall@k of the build against exact search over the same vectors, merged over shards,
    then the count reconciliation (reconcile_build). With `target_recall`, first tune the search
    knobs (but the `pinned` ones) to the cheapest setting meeting it and store them in the
    descriptor. A build whose
    files differ from what it recorded of them (damaged since) is not audited: IndexCorruptError
    names the files."""
    desc = store.descriptor(collection, build_id)
    # queries given (audit --audit-queries): the build's own file is not read, so its damage
    # does not stop the audit that replaces it
    problems = store.file_problems(collection, build_id, audit_queries=queries is None)
    if problems:
        raise IndexCorruptError(f"build {build_id} is damaged: {'; '.join(problems)}")
    knobs = SearchKnobs(**desc.search_defaults) if desc.search_defaults else SearchKnobs()
    shards = _load_shards(store, desc, knobs)
    queries, source = _queries(store, desc, shards, queries, n_queries, seed)
    probe = _RecallProbe(shards, queries, k, desc.metric, desc.dim)
    tuning = None
    if target_recall is not None:
        index = shards[0][0].cpu_index
        chosen, sweep = tune_knobs(probe, index, knobs, target_recall, pinned, progress)
        applies = index_knobs(index)
        tuning = {"target_recall": target_recall, "sweep": sweep,
                  "chosen": {k: v for k, v in chosen.__dict__.items() if k in applies},
                  "pinned": [k for k in pinned if k in applies]}
        knobs = chosen
        desc.search_defaults = dict(chosen.__dict__)
    recall, ann_ms = probe.measure(knobs)
    audit = {"k": k, "recall": recall, "queries": len(queries), "query_source": source,
             "min_recall": min_recall, "passed": recall >= min_recall, "ann_ms_per_query": ann_ms,
             "search_defaults": knobs.__dict__, "tuning": tuning, "audited_at": time.time()}
    desc.audit = audit
    if record:
        store.write_descriptor(desc)
    recon = reconcile_build(store, collection, build_id, state_root, record)
    audit["reconciliation"] = {"passed": recon["passed"], "mismatches": recon["mismatches"]}
    return audit


def reconcile_build(store: CollectionStore, collection: str, build_id: str,
                    state_root: Optional[Path] = None, record: bool = True) -> dict:
    """Reconcile what a server would load for every shard - the build's files plus, when the
    shard has a state directory under `state_root`, the streaming writes there - so it is also
    the check an operator runs after a crash. Stored in the descriptor when `record`.

    Mismatches (the build cannot be served as it is; audit_build checks the recorded sizes and
    sha256s first):
    - the faiss file's vectors differ from the rows the build wrote, or rows added since are not
      contiguous after them or lack their vector;
    - the BM25 index lacks a live row, or holds a row that is live nowhere and pending nowhere;
    - for a shard that took no writes: live chunks and documents differ from the descriptor.
    Reported, not mismatches: pending rows (recovery deletes a crash-cut tail and orphans the
    rest), dead rows still in BM25 (recovery purges them) and, in a state, live rows missing
    from BM25 of documents a write was replacing when it was cut off - its BM25 commit made,
    the store's flip not (recovery re-adds them)."""
    from server.backends.docstore import LIVE, PENDING
    from server.core.engine.state import READY, lost_writes, state_shard_dir

    desc = store.descriptor(collection, build_id)
    bdir = store.build_dir(collection, build_id)
    mismatches, totals = [], {"documents": 0, "chunks": 0, "vectors": 0, "deleted_documents": 0,
                              "writes": 0, "pending_rows": 0, "bm25_rows_to_purge": 0,
                              "bm25_rows_to_repair": 0}
    tenants: dict[str, int] = {}
    for s in range(desc.shards):
        name = shard_dir_name(s)
        sdir = bdir / name
        state = state_shard_dir(state_root, collection, build_id, name) if state_root else None
        live_dir = state if state is not None and (state / READY).is_file() else None
        ds = DocStore((live_dir or sdir) / "docstore.sqlite", read_only=live_dir is None)
        try:
            lost = lost_writes(live_dir, ds) if live_dir is not None else None
            counts, states = ds.counts(), ds.row_states()
            deleted = sum(1 for v, live in ds.documents().values() if not live)
            writes = ds.last_write_seq()
            for t, n in ds.tenants().items():
                tenants[t] = tenants.get(t, 0) + n
            dense = DenseIndex.load(sdir, desc.metric, desc.shard_files.get(name))
            added_rows, _, added_vecs = ds.added_vectors(dense.ntotal)
            live_rows = set(ds.live_rows().tolist())
            row_doc, row_state, cut = {}, {}, set()
            for row, live, tenant, doc_id in ds._conn().execute(
                    "SELECT row, live, tenant, doc_id FROM chunks"):
                row_state[row], row_doc[row] = live, (tenant, doc_id)
                if live == PENDING:
                    cut.add((tenant, doc_id))
        finally:
            ds.close()
        rows = sum(states.values())
        want = desc.shard_counts.get(name, {})
        where = f"{name}" + (" (state)" if live_dir is not None else "")
        if lost:  # a server refuses this state (ShardIndex._recover): it would re-add deletes
            mismatches.append(f"{where}: {lost}: the store has lost committed writes")
        if want and dense.ntotal != want.get("chunks"):
            mismatches.append(f"{where}: the faiss file holds {dense.ntotal} vectors, the build "
                              f"wrote {want.get('chunks')} rows")
        if dense.ntotal + len(added_rows) != rows:
            mismatches.append(f"{where}: faiss file ({dense.ntotal}) + rows added since "
                              f"({len(added_rows)}) = {dense.ntotal + len(added_rows)} vectors, "
                              f"the store {rows} rows")
        if len(added_rows) and not np.array_equal(added_rows, np.arange(dense.ntotal,
                                                                         dense.ntotal + len(added_rows))):
            mismatches.append(f"{where}: rows added since the build are not contiguous from {dense.ntotal}")
        if len(added_rows) and added_vecs.shape[1] != desc.dim:
            mismatches.append(f"{where}: rows added since the build lack {desc.dim}-d vectors")
        lexical = LexicalIndex.open((live_dir or sdir) / "lexical", read_only=live_dir is None,
                                    version=desc.lexical_analyzer)
        try:
            indexed = set(lexical.indexed_rows())
        finally:
            lexical.close()
        missing = live_rows - indexed
        # a write cut off between its BM25 commit and the store's flip: the old version's rows
        # left BM25 while still live in the store (recovery re-adds them); only in a state
        to_repair = {r for r in missing if row_doc.get(r) in cut} if live_dir is not None else set()
        missing -= to_repair
        stray = [r for r in indexed - live_rows if row_state.get(r) == LIVE or r not in row_state]
        to_purge = len(indexed - live_rows) - len(stray)
        if missing:  # a server re-adds them when it loads the state (a delete cut off after its
            # BM25 commit leaves no trace in the store to tell it from damage)
            mismatches.append(f"{where}: the BM25 index lacks {len(missing)} live rows"
                              + (" (a server loading this state re-adds them)" if live_dir else ""))
        if stray:
            mismatches.append(f"{where}: the BM25 index holds {len(stray)} rows the store does not have")
        if not writes:
            if want and want.get("chunks") != counts["chunks"]:
                mismatches.append(f"{where}: {counts['chunks']} live chunks, the descriptor says "
                                  f"{want.get('chunks')}")
            if want and want.get("documents") != counts["documents"]:
                mismatches.append(f"{where}: {counts['documents']} documents, the descriptor says "
                                  f"{want.get('documents')}")
        totals["documents"] += counts["documents"]
        totals["chunks"] += counts["chunks"]
        totals["vectors"] += dense.ntotal + len(added_rows)
        totals["deleted_documents"] += deleted
        totals["writes"] += writes
        totals["pending_rows"] += states["pending"]
        totals["bm25_rows_to_purge"] += to_purge
        totals["bm25_rows_to_repair"] += len(to_repair)
    if not totals["writes"]:
        if totals["chunks"] != desc.chunks:
            mismatches.append(f"{totals['chunks']} live chunks in all, the descriptor says {desc.chunks}")
        if desc.tenants and tenants != desc.tenants:
            mismatches.append(f"tenant chunk counts {tenants} differ from the descriptor's {desc.tenants}")
    result = {"passed": not mismatches, "mismatches": mismatches, **totals, "tenants": len(tenants),
              "reconciled_at": time.time()}
    if record:
        desc.reconciliation = result
        store.write_descriptor(desc)
    return result
