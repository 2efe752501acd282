"""Soak: writes landing while SearchBatch and Search run, against a server this script starts; a
probe every 2 s tells whether the server still answers.

    .venv/bin/python loadtest/soak.py [--seconds 180] [--workers 0] [--writers 1] [--batchers 3]
                                      [--searchers 4]

Builds (once, as loadtest/cluster.py does) the Cranfield collection with 2 shards and the packaged
MiniLM, and serves it with `search-server serve` (`--workers N`: N front ends and one engine
process) on a fresh state directory. Then, for --seconds:
- writers upsert 8 documents over and over, each write a new version of text the server embeds;
- batchers send SearchBatch calls of 2-24 lexical and hybrid queries, top_k 5-40;
- searchers send hybrid Searches, top_k 20-60;
- every 2 s a probe sends one lexical Search with a 5 s deadline. 30 s of failed probes in a row
  is a hang.
Prints the calls answered and the errors by status code, then NO HANG or HUNG; exits 1 on a hang
(the server is stopped either way). The twenty-first session's outside QA hung `serve` this way
within 40-130 s, and `serve --workers 2` within 70 s, before a batch's BM25 searches got their own
thread pool (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "loadtest"))

import grpc  # noqa: E402

from cluster import DATA_DIR, FALLBACK_QUERIES, ensure_collections  # noqa: E402
from harness.data import CRANFIELD, read_queries  # noqa: E402
from harness.processes import ServiceProcess  # noqa: E402
from server.rpc import search_pb2 as pb  # noqa: E402
from server.rpc import search_pb2_grpc as pb_grpc  # noqa: E402

HANG_S = 30.0


class Load:
    """The writers', batchers' and searchers' threads, counting what they get back."""

    def __init__(self, address: str, collection: str, texts: list[str]):
        self.address, self.collection, self.texts = address, collection, texts
        self.stop = threading.Event()
        self.answered: Counter = Counter()
        self.errors: Counter = Counter()
        self._lock = threading.Lock()

    def _call(self, kind: str, fn) -> None:
        try:
            fn()
            outcome, counter = kind, self.answered
        except grpc.RpcError as err:
            outcome, counter = f"{kind} {err.code().name}", self.errors
        with self._lock:
            counter[outcome] += 1

    def writer(self, k: int) -> None:
        stub, rng, version = self._stub(), random.Random(k), 1
        while not self.stop.is_set():
            version += 1
            for d in range(8):
                req = pb.UpsertDocumentRequest(collection=self.collection, doc_id=f"soak-{k}-{d}",
                                               version=version,
                                               text=f"soak {d} {version} {rng.choice(self.texts)}")
                self._call("write", lambda: stub.UpsertDocument(req, timeout=10))

    def batcher(self, k: int) -> None:
        stub, rng = self._stub(), random.Random(100 + k)
        while not self.stop.is_set():
            req = pb.SearchBatchRequest(queries=[
                pb.SearchRequest(collection=self.collection, text=rng.choice(self.texts),
                                 top_k=rng.randint(5, 40), mode=rng.choice([pb.LEXICAL, pb.HYBRID]))
                for _ in range(rng.randint(2, 24))])
            self._call("batch", lambda: stub.SearchBatch(req, timeout=10))

    def searcher(self, k: int) -> None:
        stub, rng = self._stub(), random.Random(200 + k)
        while not self.stop.is_set():
            req = pb.SearchRequest(collection=self.collection, text=rng.choice(self.texts),
                                   top_k=rng.randint(20, 60), mode=pb.HYBRID)
            self._call("search", lambda: stub.Search(req, timeout=10))

    def _stub(self):
        return pb_grpc.SearchServiceStub(grpc.insecure_channel(self.address))


def probe_until(address: str, collection: str, seconds: float) -> bool:
    """True once HANG_S of probes in a row failed (a hang), False if the time ran out first."""
    stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(address))
    end, failing_since = time.monotonic() + seconds, None
    while time.monotonic() < end:
        time.sleep(2.0)  # the probe's period, not a synchronisation
        try:
            stub.Search(pb.SearchRequest(collection=collection, text="wing", top_k=3,
                                         mode=pb.LEXICAL), timeout=5)
            failing_since = None
        except grpc.RpcError as err:
            failing_since = failing_since or time.monotonic()
            print(f"probe failed: {err.code().name} {(err.details() or '')[:100]}", flush=True)
            if time.monotonic() - failing_since >= HANG_S:
                return True
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--workers", type=int, default=0, help="serve --workers N (0: one process)")
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--batchers", type=int, default=3)
    ap.add_argument("--searchers", type=int, default=4)
    args = ap.parse_args(argv)
    collection = ensure_collections([2])[2]
    texts = read_queries(CRANFIELD) or FALLBACK_QUERIES
    state = tempfile.mkdtemp(prefix="soak-state-")
    srv = ServiceProcess(["serve", "--data-dir", str(DATA_DIR), "--state-dir", state, "--port", "0",
                          "--device", "cpu", "--log-level", "WARNING", "--alias-poll-s", "3600",
                          *(["--workers", str(args.workers)] if args.workers else [])], "serve")
    load = Load(srv.address, collection, texts)
    threads = ([threading.Thread(target=load.writer, args=(k,)) for k in range(args.writers)]
               + [threading.Thread(target=load.batcher, args=(k,)) for k in range(args.batchers)]
               + [threading.Thread(target=load.searcher, args=(k,)) for k in range(args.searchers)])
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        hung = probe_until(srv.address, collection, args.seconds)
    finally:
        load.stop.set()
        for t in threads:
            t.join(15)
        srv.stop()
    print(f"{'HUNG' if hung else 'NO HANG'} after {time.monotonic() - t0:.0f} s "
          f"(serve{f' --workers {args.workers}' if args.workers else ''}); answered: "
          f"{dict(sorted(load.answered.items()))}; errors: {dict(sorted(load.errors.items()))}")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
