"""Fan-out cost: latency with 1, 2, 4, 8 shards at a fixed total corpus, on loopback.

What it measures
  The same Cranfield corpus (1400 docs, real packaged MiniLM, Flat) built with N shards, N in
  --shards (default 1,2,4,8), as collections cran_s{N} under bench/results/loadtest-data (built on
  first use; chunk embeddings are computed once and reused for every shard count through a
  persistent cache wrapped around the embedder, so the builds hold identical vectors). For each N,
  N shard servers (1 replica each, `python -m server.main shard`) behind one router
  (`python -m server.main router`), all on 127.0.0.1. Hedging is irrelevant here (one replica per
  shard: the router has no second replica to hedge to).

  Load: closed loop from this process, --concurrency asyncio workers on one grpc.aio channel, the
  225 Cranfield queries shuffled (seeded) and cycled, --requests measured requests per shard count.
  Every client-side latency is recorded; p50/p90/p99 are exact numpy percentiles.

  Mode: --mode hybrid by default, so every shard runs both retrievers (faiss Flat + tantivy BM25).
  The query embedding is computed by the router, but the untimed warm-up sends every query twice
  and the router caches query embeddings, so during the measured requests the embedder is off the
  critical path (the table shows cache misses, which should be 0).

  All clusters are started up front and measured in --rounds interleaved rounds (the order rotates
  every round) so slow drifts in the machine's background load hit every shard count alike.

  What to expect: each request waits for the slowest of N shard calls, and each shard searches
  1/N of the data. At 1400 documents a shard's own search is sub-millisecond, so the fan-out
  overhead (N RPCs, N responses to decode and merge) dominates and latency grows with N. The
  responses are not small: every shard returns dense_depth + lexical_depth candidates (100 + 100 by
  default, whatever top_k is) with their full chunk text, ~175 KiB per shard call on Cranfield, so
  the router decodes N x 200 candidates per request. --depth 10 shows how much of the cost that is.
  On a small
  machine the N shard processes, the router and this client also contend for the same few cores:
  with 8 shards there are 10 busy processes on this machine, so the growth measured here is mostly
  CPU contention and per-RPC overhead, not a property of a real multi-host deployment.

Run (from the repository root):
    .venv/bin/python bench/bench_fanout.py
    .venv/bin/python bench/bench_fanout.py --requests 1000 --concurrency 4 --shards 1,2,4,8
    .venv/bin/python bench/bench_fanout.py --mode lexical
    .venv/bin/python bench/bench_fanout.py --depth 10 --requests 1000
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from harness.measure import CpuMonitor  # noqa: E402
from loadtest.cluster import (DATA_DIR, Cluster, closed_loop, counters_delta,  # noqa: E402
                              ensure_collections, load_queries, router_counters, search_requests,
                              warm_up)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="1,2,4,8", help="comma list of shard counts")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per shard count")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mode", choices=["hybrid", "dense", "lexical"], default="hybrid")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--depth", type=int, default=0,
                   help="dense_depth and lexical_depth of every request (0: the server default, 100)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--rebuild", action="store_true", help="rebuild the collections even if present")
    args = p.parse_args(argv)
    args.shard_counts = [int(x) for x in args.shards.split(",") if x.strip()]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    names = ensure_collections(args.shard_counts, args.data_dir, rebuild=args.rebuild)
    queries = load_queries()
    print(f"bench_fanout: shard counts {args.shard_counts} (1 replica each), mode {args.mode}, "
          f"top_k {args.top_k}, depth {args.depth or 'server default (100)'}, closed loop "
          f"x{args.concurrency}, {args.requests} measured requests "
          f"per shard count in {args.rounds} interleaved rounds", flush=True)
    reqs = search_requests("", queries, args.requests, args.mode, args.top_k, args.seed, args.depth)
    per_round = np.array_split(np.arange(args.requests), args.rounds)
    clusters: dict[int, Cluster] = {}
    lat = {n: [] for n in args.shard_counts}
    errors = {n: {} for n in args.shard_counts}
    deltas = {n: [] for n in args.shard_counts}
    walls = {n: 0.0 for n in args.shard_counts}
    cpu = {n: [] for n in args.shard_counts}
    try:
        for n in args.shard_counts:
            clusters[n] = Cluster(names[n], n, 1, args.data_dir,
                                  log=lambda m, n=n: print(f"[{n} shard(s)] {m}", flush=True))
            clusters[n].start()
        for n, c in clusters.items():
            # 16 at once lets the router's micro-batcher embed the queries in batches
            errs = warm_up(c.address, names[n], queries, args.mode, args.top_k, 16, args.depth)
            if errs:
                print(f"[{n} shard(s)] warm-up errors: {errs}")
        for r in range(args.rounds):
            k = r % len(args.shard_counts)
            order = args.shard_counts[k:] + args.shard_counts[:k]
            if r % 2:
                order = order[::-1]
            for n in order:
                c = clusters[n]
                chunk = []
                for i in per_round[r]:
                    q = type(reqs[i])()
                    q.CopyFrom(reqs[i])
                    q.collection = names[n]
                    chunk.append(q)
                before = router_counters(c.metrics_url)
                with CpuMonitor() as mon:
                    xs, errs, wall = closed_loop(c.address, chunk, args.concurrency, args.timeout)
                deltas[n].append(counters_delta(router_counters(c.metrics_url), before))
                lat[n].append(xs)
                walls[n] += wall
                cpu[n].append(mon)
                for key, v in errs.items():
                    errors[n][key] = errors[n].get(key, 0) + v
                print(f"  round {r} {n} shard(s): {len(chunk)} requests {wall:5.1f}s, p50 "
                      f"{np.percentile(xs, 50):.1f} p99 {np.percentile(xs, 99):.1f} ms; "
                      f"{mon.summary()}", flush=True)
    finally:
        for c in clusters.values():
            c.stop()

    rows = {}
    for n in args.shard_counts:
        xs = np.concatenate(lat[n])
        tot = {}
        for d in deltas[n]:
            for k in ("search_requests", "shard_calls_ok", "shard_seconds_sum", "embed_cache_miss"):
                tot[k] = tot.get(k, 0.0) + d[k]
        other = [m.other_cores for m in cpu[n] if m.other_cores is not None]
        p50, p90, p99 = np.percentile(xs, [50, 90, 99])
        rows[n] = dict(n=len(xs), err=sum(errors[n].values()), rps=len(xs) / walls[n], p50=p50,
                       p90=p90, p99=p99, max=xs.max(),
                       shard_ms=1e3 * tot["shard_seconds_sum"] / max(1.0, tot["shard_calls_ok"]),
                       calls=tot["shard_calls_ok"] / max(1.0, tot["search_requests"]),
                       miss=tot["embed_cache_miss"], other=float(np.mean(other)) if other else float("nan"))
    base = rows[args.shard_counts[0]]
    print(f"\nlatency in ms, client side, {args.concurrency} closed-loop workers, mode {args.mode}; "
          f"exact percentiles; ratios vs {args.shard_counts[0]} shard(s)")
    hdr = (f"{'shards':>6} {'ok':>6} {'err':>4} {'req/s':>6} {'p50':>6} {'p90':>6} {'p99':>6} "
           f"{'max':>7} {'p50 x':>6} {'p99 x':>6} {'shard call':>10} {'calls/req':>9} "
           f"{'emb miss':>8} {'othercpu':>8}")
    print(hdr)
    print("-" * len(hdr))
    for n in args.shard_counts:
        r = rows[n]
        print(f"{n:>6} {r['n']:>6} {r['err']:>4} {r['rps']:>6.0f} {r['p50']:>6.1f} {r['p90']:>6.1f} "
              f"{r['p99']:>6.1f} {r['max']:>7.1f} {r['p50'] / base['p50']:>6.2f} "
              f"{r['p99'] / base['p99']:>6.2f} {r['shard_ms']:>8.2f}ms {r['calls']:>9.2f} "
              f"{r['miss']:>8.0f} {r['other']:>8.2f}")
    print("\n'shard call' = mean router-side latency of one shard call (router /metrics); "
          "'othercpu' = cores used by everything but this client during the measured rounds "
          "(the router and shard servers included).")
    print(f"CPU contention: this machine has {os.cpu_count()} cores; with N shards there are N+1 "
          f"server processes plus this client (plus anything else running: loadavg "
          f"{os.getloadavg()[0]:.1f} now), so the growth with N mixes fan-out overhead with "
          f"processes competing for cores. Total bench time {time.perf_counter() - t_start:.0f}s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
