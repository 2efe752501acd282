"""Single searches beside a SearchBatch client: does one heavy client starve the others?

Builds the Cranfield collection with the packaged MiniLM (2 shards) in a temporary directory,
serves it with `search-server serve`, and measures single hybrid searches (one client, one call
at a time, --deadline s each, a new query text every call so no cache answers):
- alone, --alone calls;
- for --seconds while another client loops on SearchBatch calls of --batch hybrid queries (each
  query a new text: every one is embedded).
Prints calls, answers, DEADLINE_EXCEEDED and p50/max latency per phase. The model queues take one
item of each waiting request in turn (server/core/batcher.py); before they did, 4 of 10 single
searches beside one such client ran past a 5 s deadline on 2 cores (docs/BENCHMARKS.md, tenth
session).

Run
---
    .venv/bin/python bench/bench_fairness.py
    .venv/bin/python bench/bench_fairness.py --seconds 25 --batch 1024 --deadline 5
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from harness.processes import ServiceProcess, free_port  # noqa: E402
from server.rpc import search_pb2 as pb  # noqa: E402
from server.rpc import search_pb2_grpc as pb_grpc  # noqa: E402


def build(data: Path, dataset: Path) -> None:
    t = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "index-builder"), "build", "--data-dir",
                    str(data), "--collection", "cran", "--corpus", str(dataset / "corpus.jsonl"),
                    "--shards", "2", "--publish"], check=True, stdout=subprocess.DEVNULL)
    print(f"built cran (2 shards, MiniLM) in {time.perf_counter() - t:.0f} s", flush=True)


def single(stub, texts: list[str], deadline: float) -> tuple[float, str]:
    req = pb.SearchRequest(collection="cran", text=f"{random.choice(texts)} {random.randrange(10**9)}",
                           top_k=10, mode=pb.HYBRID)
    t = time.perf_counter()
    try:
        stub.Search(req, timeout=deadline)
        return time.perf_counter() - t, "OK"
    except grpc.RpcError as exc:
        return time.perf_counter() - t, exc.code().name


def summary(phase: str, results: list[tuple[float, str]]) -> str:
    lat = [s for s, _ in results]
    codes = [c for _, c in results]
    return (f"| {phase} | {len(results)} | {codes.count('OK')} | {codes.count('DEADLINE_EXCEEDED')} "
            f"| {statistics.median(lat):.3f} | {max(lat):.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", type=Path, default=REPO.parent / "shared" / "datasets" / "cranfield")
    ap.add_argument("--seconds", type=float, default=25.0)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--deadline", type=float, default=5.0)
    ap.add_argument("--alone", type=int, default=10)
    args = ap.parse_args(argv)
    texts = [json.loads(line)["text"] for line in (args.dataset / "queries.jsonl").open()]
    with tempfile.TemporaryDirectory(prefix="bench_fairness_") as tmp:
        data = Path(tmp) / "data"
        build(data, args.dataset)
        port = free_port()
        server = ServiceProcess(["serve", "--data-dir", str(data), "--port", str(port),
                                 "--metrics-port", "0", "--log-level", "WARNING"], "serve")
        try:
            stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
            alone = [single(stub, texts, args.deadline) for _ in range(args.alone)]
            stop = threading.Event()
            batches, refused = [], []

            def hog():
                # 1,024 answers of 10 hits with their text: ~10 MB, over gRPC's 4 MB default
                hog_stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(
                    f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 1 << 28)]))
                while not stop.is_set():
                    reqs = [pb.SearchRequest(collection="cran", top_k=10, mode=pb.HYBRID,
                                             text=f"{random.choice(texts)} {random.randrange(10**9)}")
                            for _ in range(args.batch)]
                    t = time.perf_counter()
                    try:
                        hog_stub.SearchBatch(pb.SearchBatchRequest(queries=reqs), timeout=120)
                        batches.append(time.perf_counter() - t)
                    except grpc.RpcError as exc:
                        refused.append(f"{exc.code().name}: {exc.details()[:160]}")

            thread = threading.Thread(target=hog, daemon=True)
            thread.start()
            time.sleep(1.0)  # the first SearchBatch is queued ahead of the single searches
            beside, end = [], time.monotonic() + args.seconds
            while time.monotonic() < end:
                beside.append(single(stub, texts, args.deadline))
                time.sleep(0.2)
            stop.set()
            thread.join(180)
        finally:
            server.stop()
    print(f"\nsingle hybrid searches, deadline {args.deadline:g} s; the other client: SearchBatch "
          f"of {args.batch} hybrid queries in a loop ({len(batches)} answered, "
          f"{statistics.median(batches) if batches else float('nan'):.1f} s each; refused: "
          f"{dict((c, refused.count(c)) for c in set(refused)) or 'none'})\n")
    print("| phase | calls | answered | DEADLINE_EXCEEDED | p50 s | max s |")
    print("|---|---|---|---|---|---|")
    print(summary("alone", alone))
    print(summary("beside the SearchBatch client", beside))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
