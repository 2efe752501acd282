"""Tenant-restricted dense search on one shard: latency and recall@10 by tenant share.

What it measures
----------------
One shard of N synthetic chunks (default 100k x 384) is built with the real builder
(index_builder.build.build_collection: dense index, vectors.npy, SQLite chunk store, BM25 index) for
each faiss factory, and loaded as a real ShardIndex (server/core/engine/index.py, what the shard
engine searches). Tenants own fixed shares of the shard:

    t50 = 50%, t5 = 5%, t05 = 0.5%, t001 = 0.01% (10 chunks of 100k), rest = the remainder

assigned at random rows (a tenant's chunks are spread over every cluster, as with unrelated
customers sharing a shard). For each tenant, held-out queries go through ShardIndex.search_group
one at a time (ShardQuery with a vector, that tenant, dense_depth 10, empty text: the dense
branch only), and

* latency p50/p99 (ms) of the whole search_group call, and of its dense part (ShardResult.dense_ms);
* recall@10 against EXACT restricted search (brute force over that tenant's vectors only);
* which path served it: ShardIndex searches exactly (brute force over the allowed rows) when the
  tenant's allowed set has <= max(EXACT_MIN_ROWS, EXACT_MAX_FRACTION x rows) rows, capped at
  EXACT_MAX_ROWS (2,000 / 1% / 20,000 by default), otherwise the ANN index with a faiss
  IDSelectorBitmap, redoing it exactly when the ANN page comes back short. The path is observed,
  not inferred: the bench wraps the shard's ANN call and the engine module's exact_search;
* the same with EXACT_MAX_ROWS = 0 set on the shard instance, so every tenant goes through the ANN
  index with the selector; "raw ANN" columns then show what the selector search alone returned
  (recall and page fill BEFORE the short-page exact fallback), i.e. pure ANN-with-selector recall.

"unrestricted" is the same shard searched with no restriction (allowed=None: what a single-tenant
shard does): ShardIndex.dense_search(vector, 10, tenant, None) plus the chunk-store fetch that
search_group does; its recall is against exact search over all rows. A multi-tenant shard cannot
serve an unrestricted search through search_group (every request is scoped to the caller's tenant).

Data: clustered, low-intrinsic-dimension unit vectors (200 centres in a 24-d latent space, random
linear map to 384-d, small isotropic noise), as in bench_indexes.py; queries are drawn from the
same distribution and are not in the index. The "embedder" is a fake object with model_id,
revision, dim and encode_many(texts, batch_size=64, progress=None) that returns the precomputed
vector of each chunk (its text names its row): no model runs.

Run
---
    .venv/bin/python bench/bench_tenants.py                       # 100k chunks, 3 factories
    .venv/bin/python bench/bench_tenants.py --n 20000 --queries 50 --factories Flat   # quick
    .venv/bin/python bench/bench_tenants.py --json bench/results/tenants.json

Search runs on one thread with faiss OpenMP threads = 1 (per-request latency, as the server's
shard threads see it); building uses faiss's default threads.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faiss  # noqa: E402

from harness.data import synthetic  # noqa: E402
from harness.measure import CpuMonitor, pct  # noqa: E402

K = 10
FACTORIES = ["Flat", "HNSW32,Flat", "IVF256,PQ48x4fs,RFlat"]
SHARES = [("t50", 0.50), ("t5", 0.05), ("t05", 0.005), ("t001", 0.0001)]


# --- data ------------------------------------------------------------------------------------
def assign_tenants(n: int, seed: int) -> tuple[np.ndarray, dict[str, int]]:
    """tenant name per row (random rows), exact counts per share; the remainder is 'rest'."""
    counts = {name: max(1, int(round(n * share))) for name, share in SHARES}
    counts["rest"] = n - sum(counts.values())
    if counts["rest"] < 0:
        raise ValueError("shares exceed 100%")
    labels = np.concatenate([np.full(c, name, dtype=object) for name, c in counts.items()])
    np.random.default_rng(seed).shuffle(labels)
    return labels, counts


class SyntheticEmbedder:
    """Stands in for server.backends.models.Embedder at build time: returns each chunk's
    precomputed vector. A chunk's text starts with 'r<row>' (one chunk per document)."""

    revision = "synthetic-v1"

    def __init__(self, vectors: np.ndarray):
        self.vectors = vectors
        self.dim = vectors.shape[1]
        self.model_id = f"synthetic-clustered-{self.dim}@{self.revision}"

    def encode_many(self, texts, batch_size: int = 64, progress=None) -> np.ndarray:
        rows = np.fromiter((int(t.split(None, 1)[0][1:]) for t in texts), dtype=np.int64,
                           count=len(texts))
        if progress:
            progress(len(texts))
        return self.vectors[rows]

    def encode(self, texts):  # never called by this bench (queries are vectors)
        raise RuntimeError("SyntheticEmbedder embeds only the chunks it was built with")


# --- path observation ------------------------------------------------------------------------
class PathProbe:
    """Counts, per search, ANN calls (and their page fill) and exact brute-force calls."""

    def __init__(self, shard):
        import server.core.engine.index as index_mod

        self.mod = index_mod
        self.orig_exact = index_mod.exact_search
        self.dense = shard.dense
        self.orig_ann = shard.dense.search
        self.reset()

        def exact(*a, **kw):
            self.exact_calls += 1
            return self.orig_exact(*a, **kw)

        def ann(*a, **kw):
            self.ann_calls += 1
            return self.orig_ann(*a, **kw)

        index_mod.exact_search = exact
        shard.dense.search = ann  # instance attribute: shadows the method on this index only

    def reset(self):
        self.exact_calls = 0
        self.ann_calls = 0

    def path(self) -> str:
        if self.ann_calls and self.exact_calls:
            return "ann>exact"
        if self.ann_calls:
            return "ann"
        if self.exact_calls:
            return "exact"
        return "none"

    def restore(self):
        self.mod.exact_search = self.orig_exact
        try:
            del self.dense.search
        except AttributeError:
            pass


# --- measurement -----------------------------------------------------------------------------
def exact_restricted(base: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> list[set]:
    flat = faiss.IndexFlatIP(base.shape[1])
    flat.add(np.ascontiguousarray(base[rows]))
    _, idx = flat.search(queries, min(k, len(rows)))
    return [set(rows[i[i >= 0]].tolist()) for i in idx]


def recall(found: list[int], truth: set) -> float:
    return len(set(found) & truth) / max(1, len(truth))


def measure_tenant(shard, probe, tenant: str, queries: np.ndarray, truth: list[set],
                   model_id: str, build_id: str) -> dict:
    from server.core.types import ShardQuery

    def q(v):
        return ShardQuery(build_id, tenant, v, model_id, "", K, 0)

    # first query builds and caches the tenant's row mask (one SQLite scan of the shard)
    t0 = time.perf_counter()
    shard.search_group([q(queries[0])])
    first_ms = (time.perf_counter() - t0) * 1e3
    total, dense_ms, recs, paths, fill = [], [], [], {}, []
    raw_rec, raw_fill = [], []
    from server.backends.docstore import PUBLIC_ACL

    allowed = shard.row_filter(tenant, (), (PUBLIC_ACL,))  # the mask search_group used (cached)
    for v, t in zip(queries, truth):
        probe.reset()
        t0 = time.perf_counter()
        r, = shard.search_group([q(v)])
        total.append((time.perf_counter() - t0) * 1e3)
        dense_ms.append(r.dense_ms)
        rows = [c.record.row for c in r.dense]
        recs.append(recall(rows, t))
        fill.append(len(rows))
        p = probe.path()
        paths[p] = paths.get(p, 0) + 1
        if probe.ann_calls:  # what the selector search returned before any exact fallback
            s, rr = probe.orig_ann(v[None, :], K, allowed)
            got = [int(x) for x in rr[0] if x >= 0]
            raw_rec.append(recall(got, t))
            raw_fill.append(len(got))
    return {"tenant": tenant, "allowed": int(allowed.count) if allowed is not None else shard.nrows,
            "first_ms": first_ms, "p50": pct(total, 50), "p99": pct(total, 99),
            "dense_p50": pct(dense_ms, 50), "dense_p99": pct(dense_ms, 99),
            "recall": float(np.mean(recs)), "fill": float(np.mean(fill)), "paths": paths,
            "raw_recall": float(np.mean(raw_rec)) if raw_rec else None,
            "raw_fill": float(np.mean(raw_fill)) if raw_fill else None}


def measure_unrestricted(shard, queries: np.ndarray, truth: list[set]) -> dict:
    total, dense_ms, recs = [], [], []
    for v, t in zip(queries, truth):
        t0 = time.perf_counter()
        pairs, = shard.dense_search(v[None, :], K, "unrestricted", None)
        t1 = time.perf_counter()
        shard.store.fetch(sorted(r for r, _ in pairs))
        t2 = time.perf_counter()
        total.append((t2 - t0) * 1e3)
        dense_ms.append((t1 - t0) * 1e3)
        recs.append(recall([r for r, _ in pairs], t))
    return {"tenant": "unrestricted", "allowed": shard.nrows, "first_ms": float("nan"),
            "p50": pct(total, 50), "p99": pct(total, 99), "dense_p50": pct(dense_ms, 50),
            "dense_p99": pct(dense_ms, 99), "recall": float(np.mean(recs)), "fill": float(K),
            "paths": {"ann(no selector)": len(queries)}, "raw_recall": None, "raw_fill": None}


def fmt_row(r: dict, n: int) -> str:
    share = 100.0 * r["allowed"] / n
    paths = ",".join(f"{k}:{v}" for k, v in sorted(r["paths"].items()))
    raw = (f"{r['raw_recall']:.3f}/{r['raw_fill']:.1f}" if r["raw_recall"] is not None else "-")
    first = "-" if r["first_ms"] != r["first_ms"] else f"{r['first_ms']:.1f}"
    return (f"  {r['tenant']:<13}{r['allowed']:>8} {share:>7.2f}% {r['p50']:>8.2f} {r['p99']:>8.2f} "
            f"{r['dense_p50']:>8.2f} {r['dense_p99']:>8.2f} {r['recall']:>7.3f} {r['fill']:>5.1f} "
            f"{raw:>12}  {first:>8}  {paths}")


HEADER = (f"  {'tenant':<13}{'rows':>8} {'share':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'dense50':>8} {'dense99':>8} {'rec@10':>7} {'fill':>5} {'rawANN r/fill':>12}  "
          f"{'1st ms':>8}  path(s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="chunks in the shard (default 100000)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=200, help="queries per tenant (default 200)")
    p.add_argument("--factories", nargs="+", default=FACTORIES)
    p.add_argument("--clusters", type=int, default=200)
    p.add_argument("--latent", type=int, default=24)
    p.add_argument("--spread", type=float, default=0.6)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, default=None, help="build here and keep it (default: temp)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.backends.device import Device
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex

    t_all = time.perf_counter()
    mon = CpuMonitor().__enter__()
    print(f"faiss {faiss.__version__}, {os.cpu_count()} CPUs; search: 1 thread, faiss OpenMP "
          f"threads 1; build: faiss default ({faiss.omp_get_max_threads()})")
    base, queries = synthetic(args.n, args.queries, args.dim, args.clusters, args.latent,
                              args.spread, args.noise, args.seed)
    labels, counts = assign_tenants(args.n, args.seed + 1)
    print(f"data: n={args.n} dim={args.dim} clusters={args.clusters} latent={args.latent} "
          f"spread={args.spread} noise={args.noise}; {args.queries} held-out queries per tenant")
    print("tenants (chunks): " + ", ".join(f"{t}={c} ({100 * c / args.n:.2f}%)"
                                          for t, c in counts.items()))
    tenant_rows = {t: np.flatnonzero(labels == t) for t in counts}
    truth = {t: exact_restricted(base, tenant_rows[t], queries, K) for t, _ in SHARES}
    truth_all = exact_restricted(base, np.arange(args.n), queries, K)
    docs = [Document(f"d{i}", f"r{i} chunk of tenant {labels[i]}", tenant=str(labels[i]))
            for i in range(args.n)]
    emb = SyntheticEmbedder(base)

    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    results = {}
    try:
        for factory in args.factories:
            store = CollectionStore(root / factory.replace(",", "_"))
            t0 = time.perf_counter()
            desc = build_collection(docs, store, "tenants", emb, factory, shards=1, quiet=True)
            build_s = time.perf_counter() - t0
            faiss.omp_set_num_threads(1)
            shard = ShardIndex(desc, store.build_dir("tenants", desc.build_id), root / "state", 0,
                               Device("cpu"))
            probe = PathProbe(shard)
            try:
                unres = measure_unrestricted(shard, queries, truth_all)
                default_rows = [measure_tenant(shard, probe, t, queries, truth[t], emb.model_id,
                                               desc.build_id) for t, _ in SHARES]
                shard.EXACT_MAX_ROWS = 0  # instance attribute: every tenant through the ANN index
                ann_rows = [measure_tenant(shard, probe, t, queries, truth[t], emb.model_id,
                                           desc.build_id) for t, _ in SHARES]
            finally:
                probe.restore()
                shard.close()
                faiss.omp_set_num_threads(os.cpu_count() or 1)
            print(f"\n=== {factory}  (build {build_s:.1f}s incl. SQLite + BM25 index; "
                  f"knobs {desc.search_defaults or 'server defaults: nprobe 32, efSearch 128, k_factor 4'})")
            print(f"-- exact below max({ShardIndex.EXACT_MIN_ROWS} rows, "
                  f"{ShardIndex.EXACT_MAX_FRACTION:.0%} of the shard), cap {ShardIndex.EXACT_MAX_ROWS} "
                  "(server default)")
            print(HEADER)
            print(fmt_row(unres, args.n))
            for r in default_rows:
                print(fmt_row(r, args.n))
            print("-- EXACT_MAX_ROWS = 0 on the instance (ANN + IDSelectorBitmap for every tenant; "
                  "short page -> exact)")
            print(HEADER)
            for r in ann_rows:
                print(fmt_row(r, args.n))
            results[factory] = {"build_s": build_s, "unrestricted": unres,
                                "default": default_rows, "exact_max_rows_0": ann_rows}
            if args.keep is None:
                shutil.rmtree(store.data_dir, ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    mon.__exit__(None, None, None)
    print("\ncolumns: rows = the tenant's allowed chunks; p50/p99 = whole search_group call; "
          "dense50/99 = its dense part\n(ShardResult.dense_ms); rec@10 vs exact restricted brute "
          "force; fill = results returned (of 10);\nrawANN r/fill = recall and fill of the ANN "
          "selector search alone, before the exact fallback (only where ANN ran);\n1st ms = the "
          "tenant's first query (builds and caches its row mask from SQLite); path(s) = queries "
          "per served path.")
    print(f"total {time.perf_counter() - t_all:.0f}s; {mon.summary()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "tenants": counts, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
