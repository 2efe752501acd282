"""Benchmark the dense index types the server can serve: recall, build time, memory, single-query QPS.

What it measures
----------------
For each faiss factory string (Flat, "HNSW32,Flat", "IVF1024,PQ48x4fs,RFlat", "IVF1024,PQ48") it
builds an index over N synthetic vectors with the server's own code (server.backends.dense:
make_index / training_size / build_dense), then reports

* recall@10   -- overlap of the index's top 10 with the exact (brute-force) top 10, averaged over the
                 held-out queries, searched through DenseIndex.search with the server's SearchKnobs
                 (nprobe 32, efSearch 128, k_factor 4 -- the same defaults the server uses);
* build s     -- wall time of build_dense (k-means/PQ training on a training_size() sample + add);
* bytes/vec   -- len(faiss.serialize_index(index)) / N: what the index costs in RAM (the server's
                 row -> chunk id map adds another 8 B/vector, not counted here);
* QPS c=1     -- one thread issuing one-query DenseIndex.search calls back to back;
* QPS c=16    -- 16 threads (a ThreadPoolExecutor), each issuing one-query searches back to back
                 (faiss releases the GIL inside search, so the threads overlap in C++);

plus the same numbers as ratios against Flat.

Data
----
Isotropic Gaussian vectors are useless for this: in 384-d every point is almost equidistant from
every other, so "nearest neighbours" are noise and ANN recall numbers mean nothing. Real sentence
embeddings have low intrinsic dimension and cluster by topic, so the data here is: 200 cluster
centres in a 24-d latent space, points = centre + Gaussian spread (latent), projected to 384-d by a
fixed random linear map, plus small isotropic 384-d noise, L2-normalised (metric "ip" = cosine, as
the server's default). Queries are drawn from the same distribution but are not in the index.
The script prints a contrast check (mean cosine of the 1st / 10th neighbour vs a random point) so
you can see the neighbours are meaningful.

Run
---
    .venv/bin/python bench/bench_indexes.py                      # 100k x 384, 1000 queries
    .venv/bin/python bench/bench_indexes.py --n 20000 --queries 500   # quick
    .venv/bin/python bench/bench_indexes.py --json bench/results/indexes.json

On an idle 2-core machine the default run takes about 2 minutes (the "IVF1024,PQ48" build dominates:
factory "PQ48" turns on faiss's polysemous training; "PQ48np" would skip it). The last line reports
how much CPU OTHER processes used meanwhile: timings are only meaningful when that is ~0%.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.data import synthetic  # noqa: E402
from harness.measure import ForeignLoad  # noqa: E402

import faiss  # noqa: E402

from server.backends.dense import (DenseIndex, SearchKnobs, build_dense, make_index,  # noqa: E402
                                   training_size)


INDEXES = ["Flat", "HNSW32,Flat", "IVF1024,PQ48x4fs,RFlat", "IVF1024,PQ48"]
K = 10


def exact_topk(base: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    flat = faiss.IndexFlatIP(base.shape[1])
    flat.add(base)
    return flat.search(queries, k)


def recall_at_k(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    hits = [len(set(f[:k][f[:k] >= 0].tolist()) & set(t[:k].tolist())) for f, t in zip(found, truth)]
    return float(np.mean(hits)) / k


def qps(dense: DenseIndex, queries: np.ndarray, concurrency: int, min_seconds: float,
        knobs: SearchKnobs, omp_threads: int = 1) -> float:
    """Single-query searches through DenseIndex.search; whole passes over the queries until
    `min_seconds` have passed. With concurrency c, c threads each own 1/c of the queries.

    omp_set_num_threads is per calling thread in libgomp (a new thread starts from the process
    default, not from what another thread set), so every worker sets it itself (initializer).
    """
    faiss.omp_set_num_threads(omp_threads)
    warm = queries[: min(50, len(queries))]
    for q in warm:
        dense.search(q[None, :], K, knobs=knobs)

    def worker(part: np.ndarray) -> int:
        for q in part:
            dense.search(q[None, :], K, knobs=knobs)
        return len(part)

    parts = [queries[i::concurrency] for i in range(concurrency)]
    done = 0
    with ThreadPoolExecutor(max_workers=concurrency, initializer=faiss.omp_set_num_threads,
                            initargs=(omp_threads,)) as pool:
        t0 = time.perf_counter()
        while True:
            if concurrency == 1:
                done += worker(queries)
            else:
                done += sum(pool.map(worker, parts))
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                return done / elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="indexed vectors (default 100000)")
    p.add_argument("--dim", type=int, default=384, help="dimension (default 384)")
    p.add_argument("--queries", type=int, default=1000, help="held-out queries (default 1000)")
    p.add_argument("--indexes", nargs="+", default=INDEXES, help="factory strings to compare")
    p.add_argument("--clusters", type=int, default=200)
    p.add_argument("--latent", type=int, default=24, help="intrinsic (latent) dimension")
    p.add_argument("--spread", type=float, default=0.6, help="within-cluster std in latent space")
    p.add_argument("--noise", type=float, default=0.05, help="isotropic noise std per output dim")
    p.add_argument("--nprobe", type=int, default=32)
    p.add_argument("--ef-search", type=int, default=128)
    p.add_argument("--k-factor", type=int, default=4)
    p.add_argument("--min-seconds", type=float, default=2.0,
                   help="each QPS measurement repeats the query set until this much time passed")
    p.add_argument("--build-threads", type=int, default=0,
                   help="OpenMP threads for training/adding/exact search (0 = faiss default)")
    p.add_argument("--compare-omp-default", action="store_true",
                   help="also measure c=16 with faiss's default OpenMP threads per call (shows the "
                        "oversubscription that omp_set_num_threads(1) avoids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write results here (bench/results/)")
    args = p.parse_args(argv)

    load = ForeignLoad()
    default_threads = faiss.omp_get_max_threads()
    build_threads = args.build_threads or default_threads
    knobs = SearchKnobs(nprobe=args.nprobe, ef_search=args.ef_search, k_factor=args.k_factor)
    print(f"faiss {faiss.__version__}, {os.cpu_count()} CPUs, OpenMP threads for build: "
          f"{build_threads}, for single-query QPS: 1")
    print(f"data: n={args.n} dim={args.dim} queries={args.queries} clusters={args.clusters} "
          f"latent={args.latent} spread={args.spread} noise={args.noise}; knobs {knobs}")

    t0 = time.perf_counter()
    base, queries = synthetic(args.n, args.queries, args.dim, args.clusters, args.latent,
                              args.spread, args.noise, args.seed)
    faiss.omp_set_num_threads(build_threads)
    gt_s, gt_i = exact_topk(base, queries, K)
    rnd = np.mean(np.sum(queries * base[np.random.default_rng(1).integers(0, args.n, args.queries)],
                         axis=1))
    print(f"contrast: mean cos to 1st NN {gt_s[:, 0].mean():.3f}, 10th NN {gt_s[:, K - 1].mean():.3f}, "
          f"random point {rnd:.3f}  (data + ground truth in {time.perf_counter() - t0:.1f} s)")
    print()

    rows_ids = np.arange(args.n, dtype=np.int64)
    results = []
    for factory in args.indexes:
        faiss.omp_set_num_threads(build_threads)
        want = training_size(make_index(factory, args.dim, "ip"))
        rng = np.random.default_rng(args.seed + 1)
        sample = base[rng.choice(args.n, size=min(want, args.n), replace=False)] if want else base[:0]
        t0 = time.perf_counter()
        dense = build_dense(factory, args.dim, "ip", lambda: base, sample, rows_ids)
        build_s = time.perf_counter() - t0
        dense.knobs = knobs
        bpv = faiss.serialize_index(dense.index).nbytes / args.n
        _, found = dense.search(queries, K, knobs=knobs)  # batched: recall only
        recall = recall_at_k(found, gt_i, K)

        # Single-query QPS with ONE OpenMP thread per call. faiss parallelises inside a search
        # with OpenMP; when 16 Python threads each run one-query searches concurrently, every
        # call would start its own OpenMP team of omp_get_max_threads() workers, i.e. up to 32
        # busy-spinning threads fighting over 2 cores (oversubscription: lower QPS, worse tail).
        # With many concurrent single queries the parallelism comes from the callers, so each
        # call should stay single-threaded -- the recommended setting for a server doing this.
        # (qps() sets it in every worker thread: the setting is per thread.)
        q1 = qps(dense, queries, 1, args.min_seconds, knobs, omp_threads=1)
        q16 = qps(dense, queries, 16, args.min_seconds, knobs, omp_threads=1)
        r = {"index": factory, "recall@10": recall, "build_s": build_s, "bytes_per_vector": bpv,
             "train_vectors": int(len(sample)), "qps_c1": q1, "qps_c16": q16}
        extra = ""
        if args.compare_omp_default:
            r["qps_c16_omp_default"] = qps(dense, queries, 16, args.min_seconds, knobs,
                                           omp_threads=default_threads)
            extra = f" (c=16 with {default_threads} OpenMP threads/call: {r['qps_c16_omp_default']:.0f})"
        results.append(r)
        print(f"  done {factory}: recall@10 {recall:.4f}, build {build_s:.1f} s, {bpv:.0f} B/vec, "
              f"QPS c=1 {q1:.0f}, c=16 {q16:.0f}{extra}", flush=True)
        del dense

    flat = next((r for r in results if r["index"] == "Flat"), results[0])
    print()
    hdr = (f"{'index':<24} {'recall@10':>9} {'build s':>8} {'bytes/vector':>12} {'QPS c=1':>9} "
           f"{'QPS c=16':>9} | {'build xFlat':>11} {'mem xFlat':>9} {'QPS1 xFlat':>10} "
           f"{'QPS16 xFlat':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['index']:<24} {r['recall@10']:>9.4f} {r['build_s']:>8.2f} "
              f"{r['bytes_per_vector']:>12.1f} {r['qps_c1']:>9.0f} {r['qps_c16']:>9.0f} | "
              f"{r['build_s'] / max(flat['build_s'], 1e-9):>11.1f} "
              f"{r['bytes_per_vector'] / flat['bytes_per_vector']:>9.3f} "
              f"{r['qps_c1'] / flat['qps_c1']:>10.2f} {r['qps_c16'] / flat['qps_c16']:>11.2f}")
    print(f"\n(n={args.n}, dim={args.dim}, {args.queries} held-out queries, k={K}; recall vs exact "
          f"inner-product search; QPS = one-query DenseIndex.search calls, OpenMP threads = 1)")
    print(load.report())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()},
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
