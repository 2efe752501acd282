"""Locust load test of the search service over gRPC.

Each simulated user holds one gRPC channel to the router (or the embedded server) and calls
SearchService.Search in a closed loop (no think time unless SEARCH_WAIT_MS is set), with query
texts drawn at random from Cranfield's queries.jsonl. Every RPC goes through `LocustInterceptor`, a
`grpc.UnaryUnaryClientInterceptor` that fires Locust's `request` event: request_type "grpc", name
the full method ("/searchserver.v1.SearchService/Search"), response time in ms, response length
(serialized bytes), and the exception when the RPC ends with a non-OK status, so any gRPC error
counts as a Locust failure.

gRPC and gevent: Locust runs users as greenlets. The sync grpc client does its I/O in C, so
`grpc.experimental.gevent.init_gevent()` is called (after Locust's monkey-patching, which importing
locust performs, and before any channel exists) to make grpc cooperate with gevent; without it one
blocked call would stall every user in the process. Checked with grpcio 1.85 / gevent 26 / locust
2.47 (this is the pattern of Locust's own examples/grpc).

Configuration (environment variables):
    SEARCH_TARGET      host:port of the service (default 127.0.0.1:50051; --host overrides it)
    SEARCH_COLLECTION  collection name (default cran_s1)
    SEARCH_MODE        hybrid | dense | lexical (default hybrid)
    SEARCH_TOP_K       hits per request (default 10)
    SEARCH_QUERIES     queries.jsonl path (default /work/shared/datasets/cranfield/queries.jsonl;
                       a few built-in queries if it cannot be read)
    SEARCH_TIMEOUT_S   per-request deadline in seconds (default 10)
    SEARCH_WAIT_MS     think time between a user's requests (default 0: closed loop)

Run (headless, against a server already listening):
    SEARCH_COLLECTION=cran_s1 .venv/bin/locust -f loadtest/locustfile.py --headless \
        -u 16 -r 16 --run-time 30s --only-summary --csv /tmp/search
or let loadtest/run_cluster.py start a loopback cluster and run this file against it.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task

# locust (imported above) has monkey-patched the standard library; grpc must be told before any
# channel is created.
grpc_gevent.init_gevent()

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from server.rpc import search_pb2 as pb  # noqa: E402
from server.rpc import search_pb2_grpc as pb_grpc  # noqa: E402

TARGET = os.environ.get("SEARCH_TARGET", "127.0.0.1:50051")
COLLECTION = os.environ.get("SEARCH_COLLECTION", "cran_s1")
MODE = os.environ.get("SEARCH_MODE", "hybrid").lower()
TOP_K = int(os.environ.get("SEARCH_TOP_K", "10"))
QUERIES_PATH = os.environ.get("SEARCH_QUERIES", "/work/shared/datasets/cranfield/queries.jsonl")
TIMEOUT_S = float(os.environ.get("SEARCH_TIMEOUT_S", "10"))
WAIT_S = float(os.environ.get("SEARCH_WAIT_MS", "0")) / 1e3
MODES = {"hybrid": pb.HYBRID, "dense": pb.DENSE, "lexical": pb.LEXICAL}
FALLBACK_QUERIES = [
    "boundary layer transition", "supersonic flow over a cone", "heat transfer to a wall",
    "buckling of cylindrical shells", "slip flow", "wing flutter at transonic speed",
]
if MODE not in MODES:
    raise SystemExit(f"SEARCH_MODE must be one of {sorted(MODES)}, not {MODE!r}")


def load_queries(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"].strip() for line in f if line.strip()]
        texts = [t for t in texts if t]
        if texts:
            return texts
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return list(FALLBACK_QUERIES)


QUERIES = load_queries(QUERIES_PATH)


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Reports every unary-unary RPC to Locust; a non-OK status is a failure."""

    def __init__(self, environment):
        self.env = environment

    def intercept_unary_unary(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        call = continuation(client_call_details, request)  # a Call that is also a Future
        exception, length = None, 0
        try:
            response = call.result()  # raises the RpcError of a failed call
            length = response.ByteSize()
        except grpc.RpcError as err:
            exception = err
        self.env.events.request.fire(
            request_type="grpc", name=client_call_details.method,
            response_time=(time.perf_counter() - t0) * 1e3, response_length=length,
            exception=exception, context={}, response=None)
        return call  # the caller still sees the result, or the RpcError


class SearchUser(User):
    wait_time = constant(WAIT_S)
    host = TARGET

    def on_start(self):
        target = self.host or TARGET
        if "://" in target:  # tolerate --host grpc://127.0.0.1:50051
            target = target.split("://", 1)[1]
        self.channel = grpc.intercept_channel(grpc.insecure_channel(target),
                                              LocustInterceptor(self.environment))
        self.stub = pb_grpc.SearchServiceStub(self.channel)

    def on_stop(self):
        self.channel.close()

    @task
    def search(self):
        req = pb.SearchRequest(collection=COLLECTION, text=random.choice(QUERIES), top_k=TOP_K,
                               mode=MODES[MODE])
        try:
            self.stub.Search(req, timeout=TIMEOUT_S)
        except grpc.RpcError:
            pass  # already reported to Locust as a failure by the interceptor


@events.test_start.add_listener
def _describe(environment, **_kw):
    print(f"locustfile: target {environment.host or TARGET}, collection {COLLECTION}, mode {MODE}, "
          f"top_k {TOP_K}, {len(QUERIES)} queries, timeout {TIMEOUT_S}s, wait {WAIT_S * 1e3:.0f} ms",
          flush=True)
