"""SearchBatch through the service against faiss's own batched search on the same index file.

    .venv/bin/python bench/bench_batch_api.py --vectors V.npy [--batch 1000] [--repeats 5]
        [--flags "" --flags "--batch-chunk 0" --rounds 2]

1. Builds a collection from the vectors (the last --batch rows are the queries), HNSW16, with
   efSearch set to the smallest value whose recall@10 reaches --target-recall (measured with
   faiss on the built file), and serves it (`search-server serve`, no embedding model).
2. Sends the --batch queries as ONE SearchBatch call (dense, top_k 10), --repeats times, from this
   process (it builds the request each time, as a client would); QPS = queries / wall time.
   Each vector form (--forms) in turn on the same server: `bytes` (QueryVector.values_f32, what
   server/client.py sends) and `floats` (QueryVector.values, one Python float per value).
3. Searches the same queries with faiss on the same dense.faiss file, one batched call with all
   OpenMP threads, --repeats times.
Prints both, their ratio, and both recalls against exact search, measured in the same run.
With several --flags (extra `serve` flags), the service is measured with each, alternating round
by round on the same build (as bench/ab_server_flags.py does for single queries).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines as E  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--flags", action="append", default=None,
                    help="extra serve flags of one server variant (repeatable; default: none)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--forms", default="bytes,floats",
                    help="vector forms to send, each measured on the same server: bytes, floats")
    args = ap.parse_args(argv)

    import faiss

    sys.path.insert(0, str(E.REPO_ROOT))
    import grpc
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    X = np.ascontiguousarray(np.load(args.vectors), dtype=np.float32)
    xb, xq = X[:-args.batch], X[-args.batch:]
    engine, index, ef, gt = E.service_at_recall(xb, xq, args.target_recall)
    try:
        engine.set_knob(ef)
        faiss.omp_set_num_threads(E.NCPU)
        _, ids = index.search(xq, 10)
        faiss_recall = E.recall_at_k(list(ids), gt, 10)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            index.search(xq, 10)
        faiss_qps = args.batch * args.repeats / (time.perf_counter() - t0)

        def vector(q, form):
            if form == "bytes":
                return pb.QueryVector(values_f32=q.astype("<f4").tobytes(), model_id=engine.MODEL)
            return pb.QueryVector(values=q.tolist(), model_id=engine.MODEL)

        def call(stub, form):
            req = pb.SearchBatchRequest(queries=[pb.SearchRequest(
                collection="bench", top_k=10, mode=pb.DENSE, vector=vector(q, form)) for q in xq])
            return stub.SearchBatch(req, timeout=120)

        forms = args.forms.split(",")
        variants = [(f, form) for f in (args.flags or [""]) for form in forms]
        runs = {v: [] for v in variants}
        recalls = {}
        for _ in range(args.rounds):
            for flags in dict.fromkeys(f for f, _ in variants):
                engine.server_flags = tuple(shlex.split(flags))
                engine._restart()
                channel = grpc.insecure_channel(f"127.0.0.1:{engine.port}",
                                                options=[("grpc.max_receive_message_length", 64 << 20)])
                stub = pb_grpc.SearchServiceStub(channel)
                for form in forms:
                    resp = call(stub, form)  # warm-up, and the answers for recall
                    assert all(r.code == 0 for r in resp.results), \
                        [r.message for r in resp.results if r.code][:3]
                    recalls[flags, form] = E.recall_at_k([[int(h.doc_id) for h in r.response.hits]
                                                          for r in resp.results], gt, 10)
                    t0 = time.perf_counter()
                    for _ in range(args.repeats):
                        call(stub, form)
                    runs[flags, form].append(args.batch * args.repeats / (time.perf_counter() - t0))
                channel.close()
    finally:
        engine.close()
    print(f"{len(xb)} x {X.shape[1]}-d, HNSW16 efSearch={ef}, batches of {args.batch} queries, "
          f"{args.repeats} repeats, {args.rounds} round(s), {E.NCPU} CPUs\n")
    print("| path | recall@10 | queries/s |")
    print("|---|---|---|")
    print(f"| faiss, one batched call on the index file (all OpenMP threads) | {faiss_recall:.4f} | "
          f"{faiss_qps:,.0f} |")
    def label(v):
        flags, form = v
        return f"{form}{', ' + flags if flags else ''}"

    for v in variants:
        qps = sum(runs[v]) / len(runs[v])
        rounds = " / ".join(f"{x:,.0f}" for x in runs[v]) if args.rounds > 1 else ""
        name = f"service, one SearchBatch call over gRPC ({label(v)})"
        print(f"| {name} | {recalls[v]:.4f} | {qps:,.0f}{' (' + rounds + ')' if rounds else ''} |")
    for v in variants:
        qps = sum(runs[v]) / len(runs[v])
        print(f"\nSearchBatch ({label(v)}) / faiss batched: {qps / faiss_qps:.2f}x", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
