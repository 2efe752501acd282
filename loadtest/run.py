"""Run a load scenario end to end: start the service, load it, report, stop what was started.

What is loaded (one of)
  --address HOST:PORT     a service that is already running (nothing is started or stopped)
  (default)               `search-server serve` on --data-dir (all its published collections)
  --shards N --replicas R a loopback cluster: N x R `search-server shard` + a `search-server
                          router` with hedging (--no-hedge to turn it off); either flag alone
                          implies the other's default of 1; --inject-delay-prob/--inject-delay-ms
                          (alone: a 1 x 2 cluster) slow down replica 0 of every shard
  Without --data-dir the demo collection of scripts/demo.sh (collection stdlib, the Python
  standard library's docstrings, packaged MiniLM, HNSW32,Flat, N shards) is built once into the
  system temp dir and reused (--rebuild to build it again).

How it is loaded
  (default)  loadtest/openloop.py in this process: a fixed arrival rate, latency from the
             scheduled send time, exact percentiles (HdrHistogram)
  --locust   Locust (loadtest/locustfile.py) as a subprocess, --users users each at rate/users
             requests per second; its results are read from the CSV files it writes. Closed loop
             per user, percentiles rounded to 2 significant digits.
  The first requests after a server starts are slow (model and index warm-up), so --warmup
  seconds of load at the same rate precede the measured part (default 2; 0 to see them): the
  open loop's schedule runs on into it, Locust starts after it; neither's figures, nor the
  cluster router's counters, include it.

Exit status: that of the load: 0; 2 bad arguments or the service unreachable; 3 p99 over
--p99-budget-ms (failures ranked slowest); 4 over 1% of requests failed (--max-error-rate; Locust
runs too); 5 Locust did not exit in time and was killed; 1 the service did not start. Ctrl-C or SIGTERM stop
everything this started.

    python loadtest/run.py --rate 50 --duration 20 --mode hybrid --p99-budget-ms 200
    python loadtest/run.py --shards 1 --replicas 2 --inject-delay-prob 0.05 --inject-delay-ms 50
    python loadtest/run.py --locust --users 10 --rate 50 --duration 20
    python loadtest/run.py --data-dir data --collection docs --queries queries.jsonl --rate 100
"""
from __future__ import annotations

import argparse
import csv
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness import processes  # noqa: E402
from loadtest import openloop  # noqa: E402
from loadtest.cluster import Cluster, counters_delta, router_counters  # noqa: E402

EXIT_NOT_STARTED, EXIT_KILLED = 1, 5
LOCUST_FILES = ("stats", "stats_history", "failures", "exceptions", "final_stats", "final_failures")
DEMO_CACHE = Path(tempfile.gettempdir()) / "hybrid-search-loadtest"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("service")
    g.add_argument("--address", default=None, help="load this running service; start nothing")
    g.add_argument("--data-dir", type=Path, default=None,
                   help="collections to serve (default: the demo collection, built on first use)")
    g.add_argument("--rebuild", action="store_true", help="build the demo collection again")
    g.add_argument("--shards", type=int, default=None, help="cluster: shards (default 1)")
    g.add_argument("--replicas", type=int, default=None,
                   help="cluster: replicas per shard (default 1; 2 with --inject-delay-prob)")
    g.add_argument("--inject-delay-prob", type=float, default=0.0,
                   help="cluster: share of replica 0's searches delayed (every shard)")
    g.add_argument("--inject-delay-ms", type=float, default=50.0, help="cluster: that delay")
    g.add_argument("--no-hedge", action="store_true", help="cluster: router without hedging")
    g.add_argument("--embedder", type=Path, default=None, help="server --embedder (model dir)")
    g.add_argument("--embedder-name", default=None, help="server --embedder-name")
    g.add_argument("--server-flags", default="",
                   help="more flags for serve/router, e.g. '--max-inflight 64'")
    g.add_argument("--caches", "--retrieval-cache", dest="caches", action="store_true",
                   help="keep the server's retrieval and query-embedding caches on. Off by "
                        "default in servers this starts: the load cycles through a few queries, "
                        "which the caches would answer from memory after the first pass, "
                        "measuring the caches, not embedding and search")
    g.add_argument("--start-timeout", type=float, default=240.0,
                   help="seconds a server gets to start listening (default 240)")
    g = p.add_argument_group("load")
    openloop.add_load_args(g, warmup=2.0)
    g.add_argument("--locust", action="store_true", help="load with Locust instead")
    g.add_argument("--users", type=int, default=10, help="Locust users (default 10)")
    g.add_argument("--csv-prefix", type=Path, default=None,
                   help="Locust's --csv prefix (default: a new temp dir)")
    args = p.parse_args(argv)
    openloop.check_args(p, args)
    args.cluster = bool(args.shards or args.replicas or args.inject_delay_prob)
    if args.cluster:
        args.shards = args.shards or 1
        args.replicas = args.replicas or (2 if args.inject_delay_prob else 1)
        if args.shards < 1 or args.replicas < 1:
            p.error("--shards and --replicas must be >= 1")
    if args.address and (args.cluster or args.data_dir):
        p.error("--address loads a running service: no --data-dir, --shards, --replicas")
    if args.users < 1:
        p.error("--users must be >= 1")
    return args


def _bounded(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run with a timeout; on timeout the child is killed and that is said."""
    try:
        return subprocess.run(cmd, cwd=REPO, stdin=subprocess.DEVNULL, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child already
        print(f"run: {shlex.join(cmd[:4])} ... did not exit within {timeout:.0f}s: killed it",
              flush=True)
        raise


def demo_data(shards: int, rebuild: bool) -> Path:
    """The demo collection (scripts/demo.sh) with `shards` shards, built once under the temp dir."""
    data = DEMO_CACHE / f"demo-s{shards}"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / ".lock", "w") as lock:  # one builder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild or not (data / "stdlib" / "ALIAS").is_file():
            shutil.rmtree(data / "stdlib", ignore_errors=True)
            shutil.rmtree(data / ".state", ignore_errors=True)
            print(f"building the demo collection ({shards} shard(s)) in {data} (once; a minute "
                  "or two) ...", flush=True)
            corpus = data / "stdlib-docs.jsonl"
            py = [sys.executable, "-m", "index_builder.cli"]
            for cmd in ([*py, "demo-corpus", "--out", str(corpus)],
                        [*py, "build", "--data-dir", str(data), "--collection", "stdlib",
                         "--corpus", str(corpus), "--factory", "HNSW32,Flat", "--shards",
                         str(shards), "--publish", "--quiet"]):
                if _bounded(cmd, 1800).returncode:
                    raise RuntimeError(f"{shlex.join(cmd)} failed")
    return data


def model_flags(args) -> list[str]:
    """Flags for the serve/router processes this run starts (the user's --server-flags last, so
    they win)."""
    flags = ["--embedder", str(args.embedder)] if args.embedder else []
    flags += ["--embedder-name", args.embedder_name] if args.embedder_name else []
    if not args.caches:  # a few queries cycled: both caches would answer repeats from memory
        flags += ["--retrieval-cache-size", "0", "--embedding-cache-size", "0"]
    return flags + shlex.split(args.server_flags)


def start_serve(args, stack: ExitStack, scratch: Path) -> str:
    data = args.data_dir or demo_data(1, args.rebuild)
    argv = ["serve", "--data-dir", str(data), "--state-dir", str(scratch / "state"),
            "--port", "0", "--device", "cpu", "--log-level", "WARNING", *model_flags(args)]
    server = processes.ServiceProcess(argv, "search-server serve", ready_timeout=args.start_timeout)
    stack.callback(server.stop)
    from server.client import wait_ready

    wait_ready(server.address, 60)
    print(f"search-server serve on {server.address} over {data}", flush=True)
    return server.address


def start_cluster(args, stack: ExitStack) -> Cluster:
    data = args.data_dir or demo_data(args.shards, args.rebuild)

    def shard_flags(shard: int, replica: int) -> list[str]:
        if replica == 0 and args.inject_delay_prob:
            return ["--inject-delay-prob", str(args.inject_delay_prob), "--inject-delay-ms",
                    str(args.inject_delay_ms), "--inject-seed", str(args.seed + shard)]
        return []

    router_flags = (["--no-hedge"] if args.no_hedge else []) + model_flags(args)
    cluster = Cluster(args.collection, args.shards, args.replicas, data, shard_flags,
                      router_flags, log=lambda m: print(m, flush=True))
    stack.callback(cluster.stop)
    cluster.start(args.start_timeout)
    if args.inject_delay_prob:
        print(f"fault injection: replica 0 of every shard delays {args.inject_delay_prob:.1%} of "
              f"its searches by {args.inject_delay_ms:g} ms; hedging "
              f"{'OFF' if args.no_hedge else 'ON'}", flush=True)
    return cluster


def read_locust_csv(prefix: Path) -> dict:
    """The Aggregated row of Locust's stats CSV: the final one the locustfile writes at exit, else
    Locust's own (rewritten every second while it runs, so missing the last second)."""
    final = Path(f"{prefix}_final_stats.csv")
    path = final if final.is_file() else Path(f"{prefix}_stats.csv")
    with open(path, newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["Name"] == "Aggregated")
    num = lambda k: float(row[k]) if row.get(k) not in (None, "", "N/A") else None  # noqa: E731
    out = {"source": path.name, "complete": path == final,
           "requests": int(num("Request Count")), "failures": int(num("Failure Count")),
           "rps": num("Requests/s"), "max": num("Max Response Time")}
    for key, col in (("p50", "50%"), ("p90", "90%"), ("p99", "99%"), ("p999", "99.9%")):
        out[key] = num(col)
    # the final failures with the final statistics (Locust's own file lags by up to a second:
    # outside QA saw "failures 6" beside rows adding up to 4)
    fails = Path(f"{prefix}_final_failures.csv" if path == final else f"{prefix}_failures.csv")
    out["failure_rows"] = []
    if fails.is_file():
        with open(fails, newline="") as f:
            out["failure_rows"] = list(csv.DictReader(f))
    return out


def run_locust(args, address: str) -> int:
    prefix = args.csv_prefix or Path(tempfile.mkdtemp(prefix="search-locust-")) / "search"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for kind in LOCUST_FILES:  # a reused prefix: never the last run's figures (only Locust's
        Path(f"{prefix}_{kind}.csv").unlink(missing_ok=True)  # own files: re-probe)
    seconds = math.ceil(args.duration)  # the warm-up ran before (main), outside Locust's figures
    env = dict(os.environ, LOADTEST_TARGET=address, LOADTEST_COLLECTION=args.collection,
               LOADTEST_MODE=args.mode, LOADTEST_TOP_K=str(args.top_k),
               LOADTEST_QUERIES=str(args.queries or ""),
               LOADTEST_TIMEOUT_S=str(args.deadline_ms / 1e3),
               LOADTEST_RATE_PER_USER=str(args.rate / args.users), LOADTEST_TOKEN=args.token or "")
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
           "--headless", "-u", str(args.users), "-r", str(args.users), "--run-time", f"{seconds}s",
           "--stop-timeout", "5", "--csv", str(prefix), "--only-summary", "--host", address,
           "--loglevel", "WARNING"]
    print(f"$ {shlex.join(cmd)}", flush=True)
    limit = seconds + 60  # start-up, --stop-timeout and shutdown fit well inside
    try:
        proc = _bounded(cmd, limit, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)
    except subprocess.TimeoutExpired:
        return EXIT_KILLED
    if not Path(f"{prefix}_stats.csv").is_file():
        print(proc.stdout[-4000:])
        print(f"run: locust exited with {proc.returncode} and wrote no statistics")
        return proc.returncode or EXIT_KILLED
    res = read_locust_csv(prefix)
    print(f"Locust: {args.users} users x {args.rate / args.users:g}/s (closed loop each) for "
          f"{seconds}s after {args.warmup:g}s of warm-up; exit {proc.returncode}; files "
          f"{prefix}_*.csv")
    print(f"  requests {res['requests']}, failures {res['failures']}, {res['rps']:.1f}/s; ms "
          f"(rounded buckets): p50 {res['p50']}  p90 {res['p90']}  p99 {res['p99']}  p99.9 "
          f"{res['p999']}  max {res['max']}"
          + ("" if res["complete"] else "  (from _stats.csv: the last second is missing)"))
    for row in res["failure_rows"][:5]:
        print(f"  failure x{row.get('Occurrences')}: {row.get('Error', '')[:200]}")
    # the open loop's rules, from Locust's counts (re-probe: it exited with Locust's own 1 and
    # judged a p99 that fast failures had pulled down): more than --max-error-rate failed is
    # exit 4; else, with failures ranked slowest, more than 1% of them is over any budget, and
    # within that Locust's p99 (its percentiles hold the failures' times too) is judged
    error_rate = res["failures"] / max(1, res["requests"])
    res["error_rate"] = round(error_rate, 6)
    too_many, over_budget, code = openloop.verdict(
        float("inf") if error_rate > 0.01 else res["p99"], error_rate, args)
    if code == openloop.EXIT_OK and proc.returncode not in (0, 1):  # Locust's 1: failures,
        code = proc.returncode                                          # judged above
    if too_many:
        print(f"  FAIL: {error_rate:.2%} of requests failed, over --max-error-rate "
              f"{args.max_error_rate:g} (exit {openloop.EXIT_ERRORS})")
    elif over_budget:
        what = (f"{res['p99']:g} ms" if error_rate <= 0.01 else
                "unbounded (over 1% of requests failed)")
        print(f"  FAIL: p99 (failures ranked slowest) {what} is over the budget of "
              f"{args.p99_budget_ms:g} ms (exit {openloop.EXIT_BUDGET})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tool": "locust", "users": args.users, **res,
                                         "exit_code": code}, indent=1) + "\n")
    return code


def _terminate(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the ExitStack: all stopped


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    with ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="search-loadtest-"))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        cluster = None
        try:
            if args.address:
                address = args.address
            elif args.cluster:
                cluster = start_cluster(args, stack)
                address = cluster.address
            else:
                address = start_serve(args, stack, scratch)
        except Exception as exc:  # noqa: BLE001 - whatever it was, say it and stop the rest
            print(f"run: the service did not start: {exc!r}", file=sys.stderr)
            return EXIT_NOT_STARTED
        if args.address:
            print("note: a running service keeps its caches; with a few distinct queries it "
                  "answers repeats from memory (start it with --retrieval-cache-size 0 "
                  "--embedding-cache-size 0 to measure embedding and search)", flush=True)
        elif not args.caches:
            print("retrieval and query-embedding caches off in the servers this run started: "
                  "every request is embedded and searched (--caches to keep them)", flush=True)
        args.address = address
        before = {}

        def measured_part_starts() -> None:  # the router's counters from the first measured send
            if cluster:
                try:
                    before.update(router_counters(cluster.metrics_url))
                except Exception as exc:  # noqa: BLE001 - the load goes on; the counters are extra
                    print(f"note: the router's metrics could not be read ({exc}); no router "
                          "counters for this run", flush=True)

        if args.locust:
            # Locust's figures are of the measured part alone
            code = openloop.warm_up(args) if args.warmup > 0 else 0
            if code == 0:
                measured_part_starts()
                code = run_locust(args, address)
        else:
            code = openloop.run(args, measured_part_starts)
        if cluster and before:
            d = counters_delta(router_counters(cluster.metrics_url), before)
            slow = {cluster.replica_address(s, 0) for s in range(args.shards)
                    } if args.inject_delay_prob else set()
            calls = ", ".join(f"shard {s} {a}{' (delayed)' if a in slow else ''}: {v:.0f}"
                              for (s, a), v in sorted(d["per_replica"].items()) if v)
            print(f"router: Search RPCs {d['search_requests']:.0f}, hedges sent "
                  f"{d['hedges_sent']:.0f} won {d['hedges_won']:.0f}, retries {d['retries']:.0f}; "
                  f"successful shard calls {calls}")
        print(f"stopping what this run started; exit {code}", flush=True)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"run: interrupted ({exc or 'Ctrl-C'}); everything it started is stopped",
              file=sys.stderr)
        sys.exit(130)
