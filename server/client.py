"""A small gRPC client: `python -m server.client "query text"` prints ranked hits with citations."""
from __future__ import annotations

import argparse
import sys
import textwrap

import grpc

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

MODES = {"dense": pb.DENSE, "lexical": pb.LEXICAL, "hybrid": pb.HYBRID}


def wait_ready(address: str, timeout: float = 60.0) -> None:
    """Block until the server's health check answers SERVING (or raise)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is up but not serving ({resp.status})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="search-client", description=__doc__)
    p.add_argument("query")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--collection", default="stdlib")
    p.add_argument("--mode", choices=sorted(MODES), default="hybrid")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--wait", type=float, default=0, help="wait this long for the server first")
    p.add_argument("--timeout", type=float, default=10.0, help="request deadline in seconds")
    args = p.parse_args(argv)
    if args.wait:
        wait_ready(args.address, args.wait)
    with grpc.insecure_channel(args.address) as ch:
        stub = pb_grpc.SearchServiceStub(ch)
        try:
            resp = stub.Search(pb.SearchRequest(collection=args.collection, text=args.query,
                                                top_k=args.top_k, mode=MODES[args.mode],
                                                include_trace=args.trace), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"{len(resp.hits)} hits from {args.collection} build {resp.build_id} "
          f"(model {resp.model_id}, corpus {resp.corpus_version})")
    for i, h in enumerate(resp.hits, 1):
        kind = pb.ScoreKind.Name(h.score_kind).lower()
        ranks = f"dense #{h.dense.rank or '-'} lexical #{h.lexical.rank or '-'}"
        print(f"{i:>2}. {h.doc_id}  [{kind} {h.score:.4f}, {ranks}]  chars {h.start_offset}-{h.end_offset}")
        print(textwrap.indent(textwrap.shorten(h.text, 200), "      "))
    print("timings: " + ", ".join(f"{t.stage} {t.ms:.1f} ms" for t in resp.timings))
    if args.trace:
        for lst in resp.trace.lists:
            print(f"trace {lst.name}: " + ", ".join(f"{it.doc_id}#{it.rank}" for it in lst.items[:10]))
        for note in resp.trace.notes:
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
