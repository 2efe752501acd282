"""Open-loop load generator for SearchService.Search: requests arrive at a fixed rate, whatever
the server does.

Every send time is fixed before the run starts (evenly spaced at --rate per second, or a Poisson
process with --poisson), and a request is sent at its time even if earlier ones have not been
answered, so a stalled server meets a queue of waiting requests, as it would in production. A
closed loop (Locust's users, `harness.measure.closed_loop`) waits instead and under-reports the
stall ("coordinated omission"). Each request's latency runs from its SCHEDULED send time to its
answer, so it includes any time the generator itself fell behind, and is recorded in an
HdrHistogram (1 us .. 1 h, 3 significant digits: a percentile is within 0.1% of the true value;
none is reported above the exact maximum). The latency percentiles are those of the requests
that answered; failed ones (any gRPC status but OK, a client error, no answer within the
deadline) are counted by status, and the p99 the budget is held to ranks them as the slowest
requests of all: a fast failure (a shed request) never pulls the judged p99 down, and more than
1% failures is over any budget.

One asyncio event loop with the grpc.aio client sends and receives; on 2 cores it keeps a few
hundred requests per second on schedule. The summary says whether it did: the achieved send rate
against the target, and the send lag (actual minus scheduled send time), p99 and max.

Exit status: 0; 2 bad arguments, or the server cannot be reached; 4 more than --max-error-rate
(default 0.01) of the requests failed; else 3 the p99 latency, failures ranked slowest, is over
--p99-budget-ms.

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
from typing import Optional

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
                   help="exit with status 3 when the p99 latency (from scheduled send time; "
                        "failed requests ranked slowest) is over this many ms")
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
    if args.rate * args.duration < 1:  # (re-probe: nothing measured was "within the budget")
        p.error(f"--duration {args.duration:g} s at --rate {args.rate:g}/s measures no request: "
                "give a longer duration or a higher rate")


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
        """One request: its latency goes to the histogram if it answered, its status to the
        error counts if it did not; every sent request's send lag is recorded."""
        lag = self._us(lag_s)
        self.lag.record_value(lag)
        self.max_lag_us = max(self.max_lag_us, lag)
        if code is None:
            us = self._us(latency_s)
            self.latency.record_value(us)
            self.max_latency_us = max(self.max_latency_us, us)
        else:
            self.fail(code, message)

    def fail(self, code: str, message: str = "", n: int = 1) -> None:
        self.failed += n
        self.errors[code] += n
        self.error_examples.setdefault(code, message[:300])

    def percentiles_ms(self) -> dict:
        """Of the requests that answered."""
        h = self.latency
        if not h.get_total_count():
            return {k: None for k in [*PERCENTILES, "max", "mean"]}
        cap = self.max_latency_us  # a percentile's bucket can end above the exact maximum
        out = {k: min(cap, h.get_value_at_percentile(q)) / 1e3 for k, q in PERCENTILES.items()}
        out["max"] = cap / 1e3
        out["mean"] = round(h.get_mean_value() / 1e3, 3)
        return out

    def p99_failures_slowest_ms(self) -> float:
        """The p99 of every request, the failed ones ranked slowest of all: infinite when more
        than 1% failed (or none answered), else the answered requests' percentile at the same
        rank."""
        ok = self.latency.get_total_count()
        total = ok + self.failed
        if not ok or self.failed > 0.01 * total:
            return float("inf")
        rank = 0.99 * total / ok * 100.0  # <= 100: the failures sit above this rank
        return min(self.max_latency_us, self.latency.get_value_at_percentile(min(100.0, rank))) / 1e3

    def send_lag_ms(self) -> dict:
        if not self.lag.get_total_count():
            return {"p99": None, "max": None}
        return {"p99": min(self.max_lag_us, self.lag.get_value_at_percentile(99.0)) / 1e3,
                "max": self.max_lag_us / 1e3}


async def _generate(args, queries: list[str], on_measured=None) -> dict:
    """Send the schedule; `on_measured` (a blocking call, run on a thread) runs as the measured
    part begins, after the warm-up's sends."""
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
            except Exception as exc:  # noqa: BLE001 - a request lost in the client is a failure too
                code, message = f"CLIENT_{type(exc).__name__}", str(exc)
            if measured:
                rec.record(time.perf_counter() - scheduled, now - scheduled, code, message or "")

        tasks: dict[asyncio.Task, bool] = {}  # running request -> measured (past the warm-up)
        hook = None
        start = time.perf_counter() + 0.01
        for i, offset in enumerate(offsets):
            scheduled = start + offset
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # at the first measured send (warm-up requests still in flight then are counted in:
            # rate x their latency, a few; the open loop does not pause to drain them)
            if hook is None and on_measured is not None and offset >= args.warmup:
                hook = asyncio.get_running_loop().run_in_executor(None, on_measured)
            task = asyncio.create_task(one(i, scheduled, offset >= args.warmup))
            tasks[task] = offset >= args.warmup
            task.add_done_callback(lambda t: tasks.pop(t, None))
        # every request has its deadline; a little more for the answers to arrive
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=timeout_s + 5.0)
            measured = sum(1 for task in pending if tasks.get(task))
            for task in pending:
                task.cancel()
            if measured:  # a warm-up request is never counted, answered or not
                rec.fail("NO_ANSWER_AFTER_DEADLINE", f"no answer {timeout_s + 5.0:g} s after the "
                         "last send", measured)
        if hook is not None:
            await hook
    window = max(args.duration, last_send - (start + args.warmup)) if sent else args.duration
    return {"recorder": rec, "sent": sent, "window": window,
            "scheduled": sum(1 for o in offsets if o >= args.warmup)}


def verdict(judged_p99_ms: Optional[float], error_rate: float, args) -> tuple[bool, bool, int]:
    """(too many errors, over the p99 budget, exit status) of a run, by one rule for the open
    loop and Locust: more than --max-error-rate failed is exit 4, before the budget's 3, since
    failures ranked slowest make the judged p99 unbounded past 1% of them. `judged_p99_ms`:
    None when nothing was measured (nothing to judge)."""
    too_many = args.max_error_rate is not None and error_rate > args.max_error_rate
    over = (args.p99_budget_ms is not None and judged_p99_ms is not None
            and judged_p99_ms > args.p99_budget_ms)
    return too_many, over, EXIT_ERRORS if too_many else EXIT_BUDGET if over else EXIT_OK


def summarize(args, queries: list[str], run: dict) -> dict:
    rec: Recorder = run["recorder"]
    ok = rec.latency.get_total_count()
    # scheduled requests that never reported (none should: every one answers, fails or is
    # counted as unanswered) are failures too, not a smaller denominator
    missing = run["scheduled"] - ok - rec.failed
    if missing > 0:
        rec.fail("NOT_REPORTED", "scheduled, never reported", missing)
    errors = dict(sorted(rec.errors.items()))
    n_err = rec.failed
    achieved = run["sent"] / run["window"] if run["window"] > 0 else 0.0
    planned = run["scheduled"] / args.duration  # = rate, or a Poisson draw around it
    kept_up = achieved >= 0.95 * planned and rec.max_lag_us / 1e3 <= max(100.0, 5e3 / args.rate)
    pcts = rec.percentiles_ms()
    # no measured request at all (a run shorter than one gap): nothing to judge
    judged = rec.p99_failures_slowest_ms() if ok + n_err else None
    error_rate = n_err / max(1, run["scheduled"])
    too_many_errors, over_budget, code = verdict(judged, error_rate, args)
    return {
        "address": args.address, "collection": args.collection, "mode": args.mode,
        "top_k": args.top_k, "queries": len(queries), "arrivals": "poisson" if args.poisson else "constant",
        "target_rate": args.rate, "achieved_rate": round(achieved, 3), "duration_s": args.duration,
        "warmup_s": args.warmup, "deadline_ms": args.deadline_ms,
        "scheduled": run["scheduled"], "count": ok + n_err, "ok": ok,
        "errors": errors, "error_examples": rec.error_examples, "error_rate": round(error_rate, 6),
        "latency_ms": pcts,
        "latency_of": "answered requests (failures are counted in errors)",
        "latency_from": "scheduled send time (coordinated-omission corrected)",
        "p99_failures_slowest_ms": None if judged in (None, float("inf")) else judged,
        "send_lag_ms": rec.send_lag_ms(),
        "generator_kept_up": kept_up,
        "p99_budget_ms": args.p99_budget_ms, "p99_over_budget": over_budget,
        "max_error_rate": args.max_error_rate, "too_many_errors": too_many_errors,
        "exit_code": code,
        "hdr_histogram_us": rec.latency.encode().decode() if ok else None,
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
    print(f"  latency ms of the {s['ok']} answered, from scheduled send (HdrHistogram, 3 digits): "
          f"p50 {fmt(lat['p50'])}  p90 {fmt(lat['p90'])}  p99 {fmt(lat['p99'])}  "
          f"p99.9 {fmt(lat['p999'])}  max {fmt(lat['max'])}  mean {fmt(lat['mean'])}", file=out)
    judged = s["p99_failures_slowest_ms"]
    print(f"  p99 of all {s['count']}, failures ranked slowest: "
          + (f"{judged:.2f} ms" if judged is not None else
             "unbounded (over 1% failed)" if s["count"] else "none (no measured request)"),
          file=out)
    cpu = s.get("cpu")
    if cpu and cpu["other_cores"] is not None:
        print(f"  CPU: this generator {cpu['generator_cores']:.2f} and other processes (the server "
              f"included) {cpu['other_cores']:.2f} of {cpu['cores']} cores", file=out)
    if s["p99_over_budget"]:
        what = f"{judged:.2f} ms" if judged is not None else "unbounded (over 1% of requests failed)"
        print(f"  FAIL: p99 (failures ranked slowest) {what} is over the budget of "
              f"{s['p99_budget_ms']:g} ms (exit {EXIT_BUDGET})", file=out)
    elif s["p99_budget_ms"] is not None:
        print(f"  p99 within the budget of {s['p99_budget_ms']:g} ms", file=out)
    if s["too_many_errors"]:
        print(f"  FAIL: {s['error_rate']:.2%} of requests failed, over --max-error-rate "
              f"{s['max_error_rate']:g} (exit {EXIT_ERRORS})", file=out)


def warm_up(args) -> int:
    """--warmup seconds of this load at --rate, nothing recorded (before a Locust run); returns
    0, or EXIT_USAGE when the server cannot be reached or the queries read."""
    from types import SimpleNamespace

    print(f"warm-up: {args.warmup:g}s at {args.rate:g}/s (not measured) ...", flush=True)
    try:
        asyncio.run(_generate(SimpleNamespace(**{**vars(args), "duration": 0.0}),
                              load_queries(args.queries)))
    except (ConnectionError, OSError, ValueError) as exc:
        print(f"openloop: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def run(args, on_measured=None) -> int:
    """Generate the load, print the summary, write --json; returns the exit status.
    `on_measured` runs (on a thread) as the measured part begins."""
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
            result = asyncio.run(_generate(args, queries, on_measured))
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
