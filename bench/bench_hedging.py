"""Hedged requests vs a slow replica: "The Tail at Scale" on a loopback cluster.

Anchor: Dean & Barroso, "The Tail at Scale" (CACM 2013) report that in a BigTable benchmark
reading 1,000 keys spread over 100 servers, sending a hedged request after a 10 ms delay cut the
99.9th-percentile latency from 1,800 ms to 74 ms while sending only 2% more requests. They
recommend deferring the hedge until the first request has been outstanding longer than the
95th-percentile latency, which bounds the extra load at about 5%.

What it measures
  Two clusters built from the same Cranfield collection (cran_s{N}: 1400 docs, real MiniLM, Flat,
  under bench/results/loadtest-data, built on first use), each --shards shards x 2 replicas of
  `python -m server.main shard` behind one `python -m server.main router`, all on 127.0.0.1:

    hedged    the router's default hedging policy (delay = the shard's recent p95 latency clamped
              to [--hedge-min-ms 2, --hedge-max-ms 200], budget --hedge-budget hedges per request,
              0.10 by default), unless the flags below change it
    unhedged  the same router started with --no-hedge

  In both, replica 0 of every shard is started with fault injection: --delay-prob of the requests
  it receives (default 10%) sleep --delay-ms first (default 100 ms); replica 1 is clean. Injection
  seeds are fixed. This is the "one slow machine" of the paper: a tail that comes from the replica,
  not from the request, which is exactly what a hedge to another replica can hide.

  Load is closed loop from this process: --concurrency asyncio workers on one grpc.aio channel,
  each sending its next Search as soon as the previous one answered, until --requests requests per
  configuration have been answered. The requests are the 225 Cranfield queries, shuffled (seeded)
  and cycled, identical for both configurations. Every latency (client-side, send -> response) is
  recorded; p50/p90/p99/p99.9 are numpy percentiles of all of them (exact, unlike Locust's buckets).

  Mode: --mode lexical by default. Lexical search never touches the query embedder, so the router's
  critical path is parse -> fan out -> merge and the tail we measure is the shard's. (Text in
  dense/hybrid modes would also be fine after warm-up, since the router caches query embeddings and
  the warm-up sends every query; --mode hybrid does that.)

  Runs are interleaved to share the machine's background load fairly: both clusters are up for the
  whole run, each gets an untimed warm-up (every query twice), then the measured requests are sent
  in --rounds rounds in ABBA order (hedged, unhedged, unhedged, hedged, ...). The extra-request
  fraction comes from the router's /metrics, scraped before and after each measured round:
  (hedges sent + retries) / shard requests, shard requests = Search RPCs x shards. "hedges won" is
  the number of hedges that answered before the primary.

  Goals: hedged p99 / unhedged p99 <= 0.3, with extra requests <= 10%.

Reading the result
  * A hedged straggler answers after about (hedge delay + one fast call), the hedge delay being the
    shard's recent p95. So hedged p99 / unhedged p99 cannot drop below roughly
    (p95 + p50) / (delay_ms + p50): on a contended 2-core machine, with the default depth of 100
    candidates per retriever (each shard call then ships ~175 KiB of candidate text, p50 ~20 ms),
    a +100 ms tail cannot reach 0.3; with --depth 10 (p50 ~9 ms) it can.
  * Hedging at the p95 means ~5% of requests want a hedge even without any slow replica (by the
    definition of p95), plus the slow ones. A budget of 0.05 hedges per request (the router's
    first default) was used up by that baseline, so stragglers arriving while the bucket was empty
    went unhedged and stayed in p99/p99.9; the default is now 0.10. p99.9 also needs a budget that
    never runs dry during bursts (try --hedge-budget 1.0: the hedges actually sent stay at ~9%,
    because the budget is a cap, not a rate).
  * p99.9 of N requests is decided by the slowest N/1000 of them; at 6000 requests that is 6
    values, so it is noisy on a shared machine (a single scheduler stall shows up there).

Run (from the repository root):
    .venv/bin/python bench/bench_hedging.py
    .venv/bin/python bench/bench_hedging.py --hedge-budget 0.1 --depth 10
    .venv/bin/python bench/bench_hedging.py --requests 3000 --concurrency 4 --shards 2
    .venv/bin/python bench/bench_hedging.py --delay-prob 0.05 --delay-ms 50 --hedge-budget 0.1
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
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--requests", type=int, default=6000, help="measured requests per configuration")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop workers")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per configuration")
    p.add_argument("--delay-prob", type=float, default=0.10, help="share of replica 0's requests delayed")
    p.add_argument("--delay-ms", type=float, default=100.0)
    p.add_argument("--mode", choices=["lexical", "dense", "hybrid"], default="lexical")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--depth", type=int, default=0,
                   help="dense_depth and lexical_depth of every request (0: the server default, 100); "
                        "each shard returns this many candidates with their text, which sets the "
                        "fast-path latency")
    p.add_argument("--hedge-budget", type=float, default=None, help="router --hedge-budget (default: router's 0.10)")
    p.add_argument("--hedge-min-ms", type=float, default=None)
    p.add_argument("--hedge-max-ms", type=float, default=None)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--timeout", type=float, default=10.0, help="per-request deadline, s")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--rebuild", action="store_true", help="rebuild the collection even if present")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    collection = ensure_collections([args.shards], args.data_dir, rebuild=args.rebuild)[args.shards]
    queries = load_queries()

    def shard_flags(shard: int, replica: int) -> list[str]:
        if replica == 0:
            return ["--inject-delay-prob", str(args.delay_prob), "--inject-delay-ms",
                    str(args.delay_ms), "--inject-seed", str(args.seed * 100 + shard)]
        return []

    hedge_flags = []
    for flag, v in (("--hedge-budget", args.hedge_budget), ("--hedge-min-ms", args.hedge_min_ms),
                    ("--hedge-max-ms", args.hedge_max_ms)):
        if v is not None:
            hedge_flags += [flag, str(v)]
    configs = {"unhedged": ["--no-hedge"], "hedged": hedge_flags}
    print(f"bench_hedging: collection {collection}, {args.shards} shard(s) x 2 replicas; replica 0 "
          f"of every shard delays {args.delay_prob:.0%} of its requests by {args.delay_ms:g} ms; "
          f"mode {args.mode}, top_k {args.top_k}, depth {args.depth or 'server default (100)'}, "
          f"closed loop x{args.concurrency}, "
          f"{args.requests} measured requests per configuration in {args.rounds} rounds; router "
          f"hedge flags: {' '.join(hedge_flags) or '(defaults)'}", flush=True)

    clusters: dict[str, Cluster] = {}
    lat = {k: [] for k in configs}
    errors = {k: {} for k in configs}
    deltas = {k: [] for k in configs}
    walls = {k: 0.0 for k in configs}
    cpu = {k: [] for k in configs}
    reqs = search_requests(collection, queries, args.requests, args.mode, args.top_k, args.seed,
                           args.depth)
    per_round = np.array_split(np.arange(args.requests), args.rounds)
    try:
        for name, flags in configs.items():
            clusters[name] = Cluster(collection, args.shards, 2, args.data_dir, shard_flags,
                                     flags, log=lambda m, n=name: print(f"[{n}] {m}", flush=True))
            clusters[name].start()
        for name, c in clusters.items():
            errs = warm_up(c.address, collection, queries, args.mode, args.top_k, args.concurrency,
                           args.depth)
            if errs:
                print(f"[{name}] warm-up errors: {errs}")
        order = []
        for r in range(args.rounds):  # ABBA: hedged, unhedged, unhedged, hedged, ...
            pair = ["hedged", "unhedged"] if r % 2 == 0 else ["unhedged", "hedged"]
            order += [(r, n) for n in pair]
        for r, name in order:
            c = clusters[name]
            chunk = [reqs[i] for i in per_round[r]]
            before = router_counters(c.metrics_url)
            with CpuMonitor() as mon:
                xs, errs, wall = closed_loop(c.address, chunk, args.concurrency, args.timeout)
            deltas[name].append(counters_delta(router_counters(c.metrics_url), before))
            lat[name].append(xs)
            walls[name] += wall
            cpu[name].append(mon)
            for k, v in errs.items():
                errors[name][k] = errors[name].get(k, 0) + v
            print(f"  round {r} {name:<8} {len(chunk)} requests, {wall:5.1f}s, "
                  f"p50 {np.percentile(xs, 50):.1f} p99 {np.percentile(xs, 99):.1f} ms; "
                  f"{mon.summary()}", flush=True)
    finally:
        for c in clusters.values():
            c.stop()

    rows = {}
    for name in configs:
        xs = np.concatenate(lat[name])
        tot = {}
        for d in deltas[name]:
            for k in ("search_requests", "hedges_sent", "hedges_won", "retries", "shard_calls_ok"):
                tot[k] = tot.get(k, 0.0) + d[k]
        per_rep = {}
        for d in deltas[name]:
            for key, v in d["per_replica"].items():
                per_rep[key] = per_rep.get(key, 0.0) + v
        shard_requests = tot["search_requests"] * args.shards
        p50, p90, p99, p999 = np.percentile(xs, [50, 90, 99, 99.9])
        other = [m.other_cores for m in cpu[name] if m.other_cores is not None]
        rows[name] = dict(n=len(xs), errors=sum(errors[name].values()), p50=p50, p90=p90, p99=p99,
                          p999=p999, max=xs.max(), slow=int((xs >= args.delay_ms).sum()),
                          rps=len(xs) / walls[name], hedges=tot["hedges_sent"],
                          won=tot["hedges_won"], retries=tot["retries"],
                          extra=(tot["hedges_sent"] + tot["retries"]) / shard_requests
                          if shard_requests else float("nan"),
                          per_rep=per_rep, other=float(np.mean(other)) if other else float("nan"))

    print(f"\nlatency in ms, client side, {args.concurrency} closed-loop workers; exact percentiles "
          f"over every request (p99.9 of {rows['hedged']['n']} samples rests on its top "
          f"~{max(1, rows['hedged']['n'] // 1000)} values)")
    hdr = (f"{'config':<9} {'ok':>6} {'err':>4} {'req/s':>6} {'p50':>6} {'p90':>6} {'p99':>7} "
           f"{'p99.9':>7} {'max':>7} {f'>={args.delay_ms:g}ms':>8} {'hedges':>7} {'won':>5} "
           f"{'extra':>7} {'othercpu':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name in ("unhedged", "hedged"):
        r = rows[name]
        print(f"{name:<9} {r['n']:>6} {r['errors']:>4} {r['rps']:>6.0f} {r['p50']:>6.1f} "
              f"{r['p90']:>6.1f} {r['p99']:>7.1f} {r['p999']:>7.1f} {r['max']:>7.1f} "
              f"{r['slow']:>8} {r['hedges']:>7.0f} {r['won']:>5.0f} {r['extra']:>7.2%} "
              f"{r['other']:>8.2f}")
    h, u = rows["hedged"], rows["unhedged"]
    ratio99, ratio999 = h["p99"] / u["p99"], h["p999"] / u["p999"]
    print(f"\nhedged p99 / unhedged p99     = {h['p99']:.1f} / {u['p99']:.1f} = {ratio99:.2f}  "
          f"(goal <= 0.30: {'met' if ratio99 <= 0.3 else 'NOT met'})")
    print(f"hedged p99.9 / unhedged p99.9 = {h['p999']:.1f} / {u['p999']:.1f} = {ratio999:.2f}  "
          f"(paper: 74 / 1800 = 0.04 with 2% extra requests)")
    print(f"extra shard requests (hedged) = {h['extra']:.2%}  (goal <= 10%: "
          f"{'met' if h['extra'] <= 0.10 else 'NOT met'}); hedges won {h['won']:.0f} of "
          f"{h['hedges']:.0f} sent")
    for name in ("unhedged", "hedged"):
        idx = {p.address: r for row in clusters[name].shard_procs for r, p in enumerate(row)}
        calls = ", ".join(f"shard {s} replica {idx.get(rep, rep)}"
                          f"{' (slow)' if idx.get(rep) == 0 else ''}: {v:.0f}"
                          for (s, rep), v in sorted(rows[name]["per_rep"].items()) if v)
        print(f"successful shard calls, {name}: {calls}")
    print(f"\n'othercpu' = cores used by processes other than this client during the measured "
          f"rounds (router and shard servers included, plus anything else running): "
          f"{os.cpu_count()} cores on this machine, so numbers are contended. Total bench time "
          f"{time.perf_counter() - t_start:.0f}s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
