"""Open-loop load generator for SearchService.Search: requests arrive at a fixed rate, whatever
the server does.

Every send time is fixed before the run starts (evenly spaced at --rate per second, or a Poisson
process with --poisson), and a request is sent at its time even if earlier ones have not been
answered, so a stalled server meets a queue of waiting requests, as it would in production. A
closed loop (Locust's users, `harness.measure.closed_loop`) waits instead and under-reports the
stall ("coordinated omission"). Each request's latency runs from its SCHEDULED send time to its
answer, so it includes any time the generator itself fell behind, and is recorded in an
HdrHistogram (1 us .. 1 h, 3 significant digits: a percentile is within 0.1% of the true value;
none is reported above the exact maximum). Failed requests are recorded too (time until the
failure was known) and counted by gRPC status code.

One asyncio event loop with the grpc.aio client sends and receives; on 2 cores it keeps a few
hundred requests per second on schedule. The summary says whether it did: the achieved send rate
against the target, and the send lag (actual minus scheduled send time), p99 and max.

Exit status: 0; 2 bad arguments, or the server cannot be reached; 3 the p99 latency is over
--p99-budget-ms; 4 more than --max-error-rate (default 0.01) of the requests failed.

    python loadtest/openloop.py --address 127.0.0.1:50051 --rate 50 --duration 20 \\
        --mode hybrid --p99-budget-ms 200 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root

EXIT_OK, EXIT_USAGE, EXIT_BUDGET, EXIT_ERRORS = 0, 2, 3, 4
LOWEST_US, HIGHEST_US, DIGITS = 1, 3_600_000_000, 3
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}

# The demo collection (`scripts/demo.sh`: collection "stdlib") holds the Python standard library's
# docstrings; these are questions a user of it would ask.
DEMO_QUERIES = [
    "how do I parse a JSON string into a Python object",
    "read a CSV file row by row",
    "shutil.rmtree",
    "remove a directory tree recursively",
    "sort a list of dictionaries by a key",
    "regular expression to split a string on whitespace",
    "current date and time in UTC",
    "format a datetime as an ISO 8601 string",
    "run a shell command and capture its output",
    "join path components in a portable way",
    "count how often each item occurs",
    "default value for a missing dictionary key",
    "pretty print a nested data structure",
    "compute the SHA-256 hash of bytes",
    "encode bytes as base64",
    "temporary file that is deleted when closed",
    "parse command line arguments",
    "decompress a gzip file",
    "copy a file and its metadata",
    "URL-encode query parameters",
    "priority queue heap push and pop",
    "deep copy of an object",
    "generate a random integer in a range",
    "thread pool executor map",
]


def add_load_args(p, warmup: float = 0.0) -> None:
    """The load options, shared with loadtest/run.py."""
    p.add_argument("--collection", default="stdlib",
                   help="collection to search (default: stdlib, the demo collection)")
    p.add_argument("--queries", type=Path, default=None,
                   help="BEIR queries.jsonl (or its directory) or a text file with one query per "
                        "line (default: %d built-in questions about the Python standard library)"
                        % len(DEMO_QUERIES))
    p.add_argument("--mode", choices=["dense", "lexical", "hybrid"], default="hybrid",
                   help="search mode (default %(default)s)")
    p.add_argument("--top-k", type=int, default=10, help="hits per query (default %(default)s)")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second (default 50)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="seconds of measured load (default 20)")
    p.add_argument("--warmup", type=float, default=warmup,
                   help=f"seconds of load at the same rate before the measured part, not "
                        f"recorded (default {warmup:g})")
    p.add_argument("--poisson", action="store_true",
                   help="exponential gaps between requests (mean 1/rate) instead of even ones")
    p.add_argument("--deadline-ms", type=float, default=10_000.0,
                   help="gRPC deadline of each request (default 10000)")
    p.add_argument("--token", default=None, help="send `authorization: Bearer TOKEN`")
    p.add_argument("--seed", type=int, default=0, help="query order and Poisson gaps")
    p.add_argument("--p99-budget-ms", type=float, default=None,
                   help="exit with status 3 when the p99 latency (from scheduled send time) is "
                        "over this many ms")
    p.add_argument("--max-error-rate", type=float, default=0.01,
                   help="exit with status 4 when more than this share of requests failed "
                        "(default 0.01; 1 accepts any: a run whose requests fail is not within "
                        "any latency budget)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here as JSON")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1:50051",
                   help="host:port of the service (default %(default)s)")
    add_load_args(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rate <= 0 or args.duration <= 0 or args.warmup < 0 or args.deadline_ms <= 0:
        p.error("--rate, --duration and --deadline-ms must be > 0, --warmup >= 0")
    if args.top_k < 1:
        p.error("--top-k must be >= 1")


def load_queries(path) -> list[str]:
    if path is None:
        return list(DEMO_QUERIES)
    from harness.data import read_queries

    queries = read_queries(Path(path))
    if not queries:
        raise ValueError(f"no queries in {path}")
    return queries


def arrival_offsets(rate: float, seconds: float, poisson: bool, seed: int) -> list[float]:
    """Send times in seconds from the start, inside [0, seconds): evenly spaced (rate x seconds of
    them), or a Poisson process (exponential gaps of mean 1/rate; the count varies around that)."""
    if not poisson:
        return [i / rate for i in range(max(1, round(rate * seconds)))]
    rng = random.Random(seed)
    t, out = rng.expovariate(rate), []
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Recorder:
    """Latencies (us) in an HdrHistogram, send lags in another, errors by gRPC status code."""

    def __init__(self):
        from hdrh.histogram import HdrHistogram

        self.latency = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)
        self.lag = HdrHistogram(LOWEST_US, HIGHEST_US, DIGITS)
        self.max_latency_us = 0
        self.max_lag_us = 0
        self.failed = 0
        self.errors: Counter = Counter()
        self.error_examples: dict[str, str] = {}

    @staticmethod
    def _us(seconds: float) -> int:
        return min(HIGHEST_US, max(LOWEST_US, round(seconds * 1e6)))

    def record(self, latency_s: float, lag_s: float, code: str | None, message: str = "") -> None:
        us, lag = self._us(latency_s), self._us(lag_s)
        self.latency.record_value(us)
        self.lag.record_value(lag)
        self.max_latency_us = max(self.max_latency_us, us)
        self.max_lag_us = max(self.max_lag_us, lag)
        if code is not None:
            self.failed += 1
            self.errors[code] += 1
            self.error_examples.setdefault(code, message[:300])

    def percentiles_ms(self) -> dict:
        h = self.latency
        if not h.get_total_count():
            return {k: None for k in [*PERCENTILES, "max", "mean"]}
        cap = self.max_latency_us  # a percentile's bucket can end above the exact maximum
        out = {k: min(cap, h.get_value_at_percentile(q)) / 1e3 for k, q in PERCENTILES.items()}
        out["max"] = cap / 1e3
        out["mean"] = round(h.get_mean_value() / 1e3, 3)
        return out


async def _generate(args, queries: list[str]) -> dict:
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    mode = {"dense": pb.DENSE, "lexical": pb.LEXICAL, "hybrid": pb.HYBRID}[args.mode]
    order = list(queries)
    random.Random(args.seed).shuffle(order)
    requests = [pb.SearchRequest(collection=args.collection, text=q, top_k=args.top_k, mode=mode)
                for q in order]
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    timeout_s = args.deadline_ms / 1e3
    offsets = arrival_offsets(args.rate, args.warmup + args.duration, args.poisson, args.seed)
    rec = Recorder()
    sent = 0
    last_send = 0.0

    async with grpc.aio.insecure_channel(args.address) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=10.0)
        except asyncio.TimeoutError:
            raise ConnectionError(f"cannot connect to {args.address} within 10 s") from None
        stub = pb_grpc.SearchServiceStub(channel)

        async def one(i: int, scheduled: float, measured: bool) -> None:
            nonlocal sent, last_send
            now = time.perf_counter()
            if measured:
                sent += 1
                last_send = max(last_send, now)
            code = message = None
            try:
                await stub.Search(requests[i % len(requests)], timeout=timeout_s, metadata=metadata)
            except grpc.aio.AioRpcError as err:
                code, message = err.code().name, err.details() or ""
            if measured:
                rec.record(time.perf_counter() - scheduled, now - scheduled, code, message or "")

        tasks = set()
        start = time.perf_counter() + 0.01
        for i, offset in enumerate(offsets):
            scheduled = start + offset
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i, scheduled, offset >= args.warmup))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        # every request has its deadline; a little more for the answers to arrive
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=timeout_s + 5.0)
            for task in pending:
                task.cancel()
            if pending:
                rec.errors["NO_ANSWER_AFTER_DEADLINE"] += len(pending)
    window = max(args.duration, last_send - (start + args.warmup)) if sent else args.duration
    return {"recorder": rec, "sent": sent, "window": window,
            "scheduled": sum(1 for o in offsets if o >= args.warmup)}


def summarize(args, queries: list[str], run: dict) -> dict:
    rec: Recorder = run["recorder"]
    count = rec.latency.get_total_count()
    errors = dict(sorted(rec.errors.items()))
    n_err = sum(errors.values())
    achieved = run["sent"] / run["window"] if run["window"] > 0 else 0.0
    lag_p99 = rec.lag.get_value_at_percentile(99.0) / 1e3 if count else None
    planned = run["scheduled"] / args.duration  # = rate, or a Poisson draw around it
    kept_up = achieved >= 0.95 * planned and rec.max_lag_us / 1e3 <= max(100.0, 5e3 / args.rate)
    pcts = rec.percentiles_ms()
    over_budget = (args.p99_budget_ms is not None and pcts["p99"] is not None
                   and pcts["p99"] > args.p99_budget_ms)
    error_rate = n_err / max(1, run["scheduled"])
    too_many_errors = args.max_error_rate is not None and error_rate > args.max_error_rate
    return {
        "address": args.address, "collection": args.collection, "mode": args.mode,
        "top_k": args.top_k, "queries": len(queries), "arrivals": "poisson" if args.poisson else "constant",
        "target_rate": args.rate, "achieved_rate": round(achieved, 3), "duration_s": args.duration,
        "warmup_s": args.warmup, "deadline_ms": args.deadline_ms,
        "scheduled": run["scheduled"], "count": count, "ok": count - rec.failed,
        "errors": errors, "error_examples": rec.error_examples, "error_rate": round(error_rate, 6),
        "latency_ms": pcts,
        "latency_from": "scheduled send time (coordinated-omission corrected)",
        "send_lag_ms": {"p99": lag_p99, "max": rec.max_lag_us / 1e3},
        "generator_kept_up": kept_up,
        "p99_budget_ms": args.p99_budget_ms, "p99_over_budget": over_budget,
        "max_error_rate": args.max_error_rate, "too_many_errors": too_many_errors,
        "exit_code": EXIT_BUDGET if over_budget else EXIT_ERRORS if too_many_errors else EXIT_OK,
        "hdr_histogram_us": rec.latency.encode().decode() if count else None,
    }


def report(s: dict, out=None) -> None:
    out = out or sys.stdout
    lat = s["latency_ms"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"open loop: {s['address']} {s['collection']} {s['mode']} top_k {s['top_k']}, "
          f"{s['arrivals']} arrivals at {s['target_rate']:g}/s for {s['duration_s']:g}s "
          f"(+{s['warmup_s']:g}s warm-up), {s['queries']} queries", file=out)
    print(f"  requests {s['count']} of {s['scheduled']} scheduled, ok {s['ok']}, errors "
          + (", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"), file=out)
    for code, msg in s["error_examples"].items():
        print(f"    e.g. {code}: {msg}", file=out)
    print(f"  rate: target {s['target_rate']:g}/s, achieved {s['achieved_rate']:.1f}/s; send lag "
          f"p99 {fmt(s['send_lag_ms']['p99'])} ms, max {fmt(s['send_lag_ms']['max'])} ms", file=out)
    if not s["generator_kept_up"]:
        print(f"  WARNING: the generator fell behind its schedule (achieved {s['achieved_rate']:.1f}/s, "
              f"send lag up to {s['send_lag_ms']['max']:.0f} ms): this client or machine is "
              "CPU-bound at this rate. Latencies count from the scheduled times, so they include "
              "that lag (pessimistic, never flattering).", file=out)
    print(f"  latency ms from scheduled send (HdrHistogram, 3 digits): p50 {fmt(lat['p50'])}  "
          f"p90 {fmt(lat['p90'])}  p99 {fmt(lat['p99'])}  p99.9 {fmt(lat['p999'])}  "
          f"max {fmt(lat['max'])}  mean {fmt(lat['mean'])}", file=out)
    cpu = s.get("cpu")
    if cpu and cpu["other_cores"] is not None:
        print(f"  CPU: this generator {cpu['generator_cores']:.2f} and other processes (the server "
              f"included) {cpu['other_cores']:.2f} of {cpu['cores']} cores", file=out)
    if s["p99_over_budget"]:
        print(f"  FAIL: p99 {lat['p99']:.2f} ms is over the budget of {s['p99_budget_ms']:g} ms "
              f"(exit {EXIT_BUDGET})", file=out)
    elif s["p99_budget_ms"] is not None:
        print(f"  p99 within the budget of {s['p99_budget_ms']:g} ms", file=out)
    if s["too_many_errors"]:
        print(f"  FAIL: {s['error_rate']:.2%} of requests failed, over --max-error-rate "
              f"{s['max_error_rate']:g} (exit {EXIT_ERRORS})", file=out)


def run(args) -> int:
    """Generate the load, print the summary, write --json; returns the exit status."""
    try:
        queries = load_queries(args.queries)
    except (OSError, ValueError) as exc:
        print(f"openloop: cannot read queries: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from harness.measure import CpuMonitor

    print(f"open loop: {args.rate:g} requests/s to {args.address} for {args.duration:g}s "
          f"(+{args.warmup:g}s warm-up) ...", flush=True)
    try:
        with CpuMonitor() as cpu:
            result = asyncio.run(_generate(args, queries))
    except ConnectionError as exc:
        print(f"openloop: {exc}", file=sys.stderr)
        return EXIT_USAGE
    summary = summarize(args, queries, result)
    summary["cpu"] = {"cores": os.cpu_count(), "generator_cores": round(cpu.own / cpu.wall, 2),
                      "other_cores": None if cpu.other_cores is None else round(cpu.other_cores, 2)}
    report(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return summary["exit_code"]


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
