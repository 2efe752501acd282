"""Start a loopback cluster (shard servers x replicas + router), load it with Locust, report.

Scenarios
    steady        1 shard x 1 replica: the baseline
    fanout        --shards N x --replicas R (default 2 x 1)
    slow-replica  --shards N (default 1) x 2 replicas; replica 0 of every shard is started with
                  fault injection: --delay-prob of its requests (default 0.05) sleep --delay-ms more
                  (default 50 ms). The other replica is clean. Hedging (on unless --no-hedge) should
                  hide most of that tail.

What it does
 1. Builds the Cranfield corpus (1400 docs, real packaged MiniLM, Flat) as collection cran_s{N}
    under bench/results/loadtest-data unless a published build with that shard count is there
    already (chunk embeddings are cached on disk, so other shard counts do not re-embed).
 2. Starts the shard servers (`python -m server.main shard ... --port 0`) and the router
    (`python -m server.main router --replicas ... --metrics-port P`) on 127.0.0.1.
 3. Warms up: every Cranfield query once, then once more, straight through gRPC (this fills the
    router's query-embedding cache, so in text modes the embedder is mostly off the critical path
    during the measured run).
 4. Runs Locust headless on loadtest/locustfile.py for --run-time with --users closed-loop users
    (no think time), writing CSVs and a JSON summary under bench/results/loadtest/.
 5. Prints Locust's aggregate percentiles, request and failure counts, and the router's counters
    over the Locust run (difference of two /metrics scrapes): Search RPCs, hedges sent and won,
    retries, successful shard calls per replica, and the extra-request fraction
    (hedges + retries) / shard requests, where shard requests = Search RPCs x shards.
 6. Stops every process it started.

Caveats
  * Locust's percentiles are bucketed, not exact: it rounds each response time to 2 significant
    digits (exact below 100 ms, to 10 ms up to 1 s, to 100 ms above), so e.g. p99.9 = 110 means
    "somewhere around 105-115 ms". Use bench/bench_hedging.py for exact percentiles.
  * Locust (one gevent process), the router and every shard server share this machine's cores;
    on a 2-core box the numbers are CPU-contended and say more about that than about the code.

Usage (from the repository root)
    .venv/bin/python loadtest/run_cluster.py --scenario steady --users 8 --run-time 30s
    .venv/bin/python loadtest/run_cluster.py --scenario fanout --shards 4 --replicas 1 --mode lexical
    .venv/bin/python loadtest/run_cluster.py --scenario slow-replica --delay-prob 0.05 --delay-ms 50
    .venv/bin/python loadtest/run_cluster.py --scenario slow-replica --no-hedge
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadtest.cluster import (DATA_DIR, Cluster, counters_delta, ensure_collections,  # noqa: E402
                              load_queries, router_counters, warm_up)

RESULTS = REPO / "bench" / "results" / "loadtest"


def seconds(spec: str) -> float:
    """Locust-style durations: 30, 30s, 2m, 1h30m."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms]?)", spec.strip())
    if not parts or "".join(a + b for a, b in parts) != spec.strip():
        raise argparse.ArgumentTypeError(f"bad duration {spec!r} (use e.g. 30s, 2m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["steady", "fanout", "slow-replica"], default="steady")
    p.add_argument("--shards", type=int, default=None, help="fanout: 2; slow-replica: 1")
    p.add_argument("--replicas", type=int, default=None, help="fanout: 1; slow-replica: 2 (min 2)")
    p.add_argument("--users", type=int, default=8, help="concurrent Locust users (closed loop)")
    p.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all at once)")
    p.add_argument("--run-time", default="30s", help="Locust --run-time (default 30s)")
    p.add_argument("--mode", choices=["hybrid", "dense", "lexical"], default="hybrid")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--no-hedge", action="store_true", help="start the router with --no-hedge")
    p.add_argument("--hedge-budget", type=float, default=None, help="router --hedge-budget (default: the router's)")
    p.add_argument("--delay-prob", type=float, default=0.05, help="slow-replica: share of replica 0's requests delayed")
    p.add_argument("--delay-ms", type=float, default=50.0, help="slow-replica: added delay")
    p.add_argument("--seed", type=int, default=1, help="fault-injection seed")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--rebuild", action="store_true", help="rebuild the collection even if present")
    p.add_argument("--csv-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.run_seconds = seconds(args.run_time)
    if args.scenario == "steady":
        if (args.shards or 1) != 1 or (args.replicas or 1) != 1:
            p.error("steady is 1 shard x 1 replica; use --scenario fanout for other shapes")
        args.shards = args.replicas = 1
    elif args.scenario == "fanout":
        args.shards = args.shards or 2
        args.replicas = args.replicas or 1
    else:
        args.shards = args.shards or 1
        args.replicas = max(2, args.replicas or 2)
    if args.shards < 1 or args.replicas < 1 or args.users < 1:
        p.error("--shards, --replicas and --users must be >= 1")
    return args


def read_locust_results(prefix: Path) -> dict:
    """Final totals from --json-file (written at shutdown); failure messages from the CSV.

    The _stats.csv file is rewritten once a second while Locust runs and not at shutdown, so its
    last second of requests can be missing; the JSON file is complete.
    """
    import json

    from locust.stats import calculate_response_time_percentile

    entries = json.loads(Path(f"{prefix}.json").read_text())
    n = sum(e["num_requests"] for e in entries)
    fails = sum(e["num_failures"] for e in entries)
    times: dict[int, int] = {}
    for e in entries:
        for k, v in e["response_times"].items():
            times[int(float(k))] = times.get(int(float(k)), 0) + v
    start = min((e["start_time"] for e in entries), default=0.0)
    last = max((e["last_request_timestamp"] or 0.0 for e in entries), default=0.0)
    out = {"requests": n, "failures": fails, "rps": n / (last - start) if last > start else 0.0,
           "max": max((e["max_response_time"] for e in entries), default=0)}
    for label, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p99.9", 0.999)):
        out[label] = calculate_response_time_percentile(times, n, q) if n else float("nan")
    failures = []
    fpath = Path(f"{prefix}_failures.csv")
    if fpath.is_file():
        with open(fpath, newline="") as f:
            failures = list(csv.DictReader(f))
    out["failure_rows"] = failures
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    names = ensure_collections([args.shards], args.data_dir, rebuild=args.rebuild)
    collection = names[args.shards]
    queries = load_queries()

    def shard_flags(shard: int, replica: int) -> list[str]:
        if args.scenario == "slow-replica" and replica == 0:
            return ["--inject-delay-prob", str(args.delay_prob), "--inject-delay-ms",
                    str(args.delay_ms), "--inject-seed", str(args.seed + shard)]
        return []

    router_flags = ["--no-hedge"] if args.no_hedge else []
    if args.hedge_budget is not None:
        router_flags += ["--hedge-budget", str(args.hedge_budget)]
    args.csv_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{args.scenario}-{args.shards}x{args.replicas}-{'nohedge' if args.no_hedge else 'hedge'}"
    prefix = args.csv_dir / f"{tag}-{time.strftime('%Y%m%dT%H%M%S')}"
    print(f"scenario {args.scenario}: {args.shards} shard(s) x {args.replicas} replica(s), "
          f"collection {collection}, mode {args.mode}, top_k {args.top_k}, hedging "
          f"{'OFF' if args.no_hedge else 'ON'}"
          + (f", replica 0 of every shard: {args.delay_prob:.1%} of requests +{args.delay_ms:g} ms"
             if args.scenario == "slow-replica" else ""), flush=True)

    with Cluster(collection, args.shards, args.replicas, args.data_dir, shard_flags,
                 router_flags) as cluster:
        errs = warm_up(cluster.address, collection, queries, args.mode, args.top_k)
        if errs:
            print(f"warm-up errors: {errs}", flush=True)
        before = router_counters(cluster.metrics_url)
        env = dict(os.environ, SEARCH_TARGET=cluster.address, SEARCH_COLLECTION=collection,
                   SEARCH_MODE=args.mode, SEARCH_TOP_K=str(args.top_k))
        cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
               "--headless", "-u", str(args.users), "-r", str(args.spawn_rate or args.users),
               "--run-time", args.run_time, "--stop-timeout", "5", "--csv", str(prefix),
               "--json-file", str(prefix), "--only-summary", "--host", cluster.address,
               "--loglevel", "WARNING"]
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=args.run_seconds + 120)
        wall = time.perf_counter() - t0
        after = router_counters(cluster.metrics_url)
    if proc.returncode not in (0, 1):  # locust exits 1 when some requests failed
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
        raise SystemExit(f"locust exited with {proc.returncode}")
    for line in proc.stdout.splitlines():
        if line.startswith("locustfile:"):
            print(line)
    res = read_locust_results(prefix)
    d = counters_delta(after, before)
    shard_requests = d["search_requests"] * args.shards

    print(f"\nLocust ({args.users} users, closed loop, {args.run_time}; locust wall {wall:.0f}s) "
          f"files: {prefix}.json, {prefix}_*.csv")
    print("  percentiles are Locust's rounded buckets (2 significant digits), not exact values")
    print(f"  {'requests':>9} {'failures':>8} {'req/s':>7} {'p50':>6} {'p95':>6} {'p99':>6} "
          f"{'p99.9':>6} {'max':>6}   (ms)")
    print(f"  {res['requests']:>9} {res['failures']:>8} {res['rps']:>7.1f} {res['p50']:>6} "
          f"{res['p95']:>6} {res['p99']:>6} {res['p99.9']:>6} {res['max']:>6.0f}")
    for row in res["failure_rows"][:5]:
        print(f"  failure x{row.get('Occurrences')}: {row.get('Error', '')[:200]}")

    print("\nrouter /metrics over the Locust run")
    codes = ", ".join(f"{k} {v:.0f}" for k, v in sorted(d["search_codes"].items()) if v)
    print(f"  Search RPCs {d['search_requests']:.0f} ({codes}); shard requests "
          f"{shard_requests:.0f} (= RPCs x {args.shards} shard(s))")
    print(f"  hedges sent {d['hedges_sent']:.0f}, won {d['hedges_won']:.0f}; retries "
          f"{d['retries']:.0f}; successful shard calls {d['shard_calls_ok']:.0f}")
    if shard_requests:
        extra = (d["hedges_sent"] + d["retries"]) / shard_requests
        print(f"  extra shard requests: (hedges + retries) / shard requests = {extra:.2%}; "
              f"hedges won / sent = "
              f"{(d['hedges_won'] / d['hedges_sent']) if d['hedges_sent'] else float('nan'):.0%}")
    for (shard, replica), v in sorted(d["per_replica"].items()):
        if v:
            idx = next((r for r in range(args.replicas)
                        if cluster.replica_address(int(shard), r) == replica), "?")
            slow = " (fault-injected)" if args.scenario == "slow-replica" and idx == 0 else ""
            print(f"  shard {shard} replica {idx} {replica}{slow}: {v:.0f} successful calls")
    errs = {k: v for k, v in d["shard_errors"].items() if v}
    if errs:
        print(f"  shard call errors: {errs}")
    print(f"  embedding cache over the run: {d['embed_cache_hit']:.0f} hits, "
          f"{d['embed_cache_miss']:.0f} misses")
    print(f"\nnote: Locust, the router and {args.shards * args.replicas} shard server(s) share "
          f"{os.cpu_count()} CPU cores (loadavg now {os.getloadavg()[0]:.1f}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
