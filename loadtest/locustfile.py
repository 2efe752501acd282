"""Locust load test of SearchService.Search over gRPC, for those who want Locust's UI or workers.

Each user holds one gRPC channel and calls Search at a constant throughput (LOADTEST_RATE_PER_USER
requests per second, Locust's `constant_throughput` wait): still a closed loop per user, so a
stalled server slows the users down, and Locust's percentiles are rounded buckets (2 significant
digits). For exact, coordinated-omission-corrected tails use loadtest/openloop.py.

Every RPC goes through `LocustInterceptor`, which fires Locust's `request` event (request_type
"grpc", name the full method, response time in ms, serialized response size); a non-OK status is
a failure. `grpc.experimental.gevent.init_gevent()` runs after Locust's monkey-patching (importing
locust does it) and before any channel exists, so a blocked call does not stall every user.

At exit the final statistics and failures are written to <--csv prefix>_final_stats.csv and
_final_failures.csv: Locust rewrites its own CSVs once a second and not at exit, so those miss
the last second.

Configuration (environment variables; loadtest/run.py --locust sets them; LOADTEST_, not the
server's SEARCH_ prefix, so exporting them never configures a server started from that shell):
    LOADTEST_TARGET         host:port (default 127.0.0.1:50051; --host overrides it)
    LOADTEST_COLLECTION     collection (default stdlib, the demo collection)
    LOADTEST_MODE           hybrid | dense | lexical (default hybrid)
    LOADTEST_TOP_K          hits per request (default 10)
    LOADTEST_QUERIES        queries.jsonl or one query per line (default: the built-in demo queries
                          of loadtest/openloop.py)
    LOADTEST_TIMEOUT_S      per-request deadline in seconds (default 10)
    LOADTEST_RATE_PER_USER  requests per second per user (default 1)
    LOADTEST_TOKEN          bearer token (default: none)

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 10 -r 10 --run-time 30s --csv out/s
"""
from __future__ import annotations

import csv
import os
import random
import sys
import time
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant_throughput, events, task
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV

grpc_gevent.init_gevent()  # after locust's monkey-patching, before any channel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from loadtest.openloop import load_queries  # noqa: E402
from server.rpc import search_pb2 as pb  # noqa: E402
from server.rpc import search_pb2_grpc as pb_grpc  # noqa: E402

TARGET = os.environ.get("LOADTEST_TARGET", "127.0.0.1:50051")
COLLECTION = os.environ.get("LOADTEST_COLLECTION", "stdlib")
MODE = {"hybrid": pb.HYBRID, "dense": pb.DENSE, "lexical": pb.LEXICAL}[
    os.environ.get("LOADTEST_MODE", "hybrid").lower()]
TOP_K = int(os.environ.get("LOADTEST_TOP_K", "10"))
QUERIES = load_queries(os.environ.get("LOADTEST_QUERIES") or None)
TIMEOUT_S = float(os.environ.get("LOADTEST_TIMEOUT_S", "10"))
RATE_PER_USER = float(os.environ.get("LOADTEST_RATE_PER_USER", "1"))
TOKEN = os.environ.get("LOADTEST_TOKEN")
METADATA = (("authorization", f"Bearer {TOKEN}"),) if TOKEN else None


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Reports every unary-unary RPC to Locust; a non-OK status is a failure."""

    def __init__(self, environment):
        self.env = environment

    def intercept_unary_unary(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        call = continuation(client_call_details, request)  # a Call that is also a Future
        exception, length = None, 0
        try:
            length = call.result().ByteSize()  # raises the RpcError of a failed call
        except grpc.RpcError as err:
            exception = err
        self.env.events.request.fire(
            request_type="grpc", name=client_call_details.method,
            response_time=(time.perf_counter() - t0) * 1e3, response_length=length,
            exception=exception, context={}, response=None)
        return call


class SearchUser(User):
    wait_time = constant_throughput(RATE_PER_USER)
    host = TARGET

    def on_start(self):
        target = (self.host or TARGET).split("://", 1)[-1]  # tolerate --host grpc://host:port
        self.channel = grpc.intercept_channel(grpc.insecure_channel(target),
                                              LocustInterceptor(self.environment))
        self.stub = pb_grpc.SearchServiceStub(self.channel)

    def on_stop(self):
        self.channel.close()

    @task
    def search(self):
        req = pb.SearchRequest(collection=COLLECTION, text=random.choice(QUERIES), top_k=TOP_K,
                               mode=MODE)
        try:
            self.stub.Search(req, timeout=TIMEOUT_S, metadata=METADATA)
        except grpc.RpcError:
            pass  # already reported to Locust as a failure by the interceptor


_ENV = []


@events.init.add_listener
def _keep_environment(environment, **_kw):
    _ENV.append(environment)


@events.quit.add_listener
def _write_final_stats(**_kw):
    prefix = getattr(_ENV[0].parsed_options, "csv_prefix", None) if _ENV else None
    if prefix:
        stats = StatsCSV(_ENV[0], PERCENTILES_TO_REPORT)
        with open(f"{prefix}_final_failures.csv", "w", newline="") as f:
            stats.failures_csv(csv.writer(f))
        with open(f"{prefix}_final_stats.csv", "w", newline="") as f:  # last: it says both are whole
            stats.requests_csv(csv.writer(f))
