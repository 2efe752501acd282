"""BM25 across shards: how often a lexical top-10 is the same in 1 and in N shards, with the
collection's term statistics (the statistics round, the default) and with each shard's own
(`--no-collection-term-stats`), and what the round costs a lexical query.

What it measures
  A BEIR dataset's corpus built twice, in 1 shard and in --shards shards (Flat; random vectors
  of a made-up model, since only BM25 is measured here, so nothing is embedded), served by the
  embedded server (real gRPC on loopback) with the statistics round on and off. Every query of
  the dataset, LEXICAL top-10 through the service: the share of queries whose document list is
  the same in both layouts. Then latency of lexical queries one at a time against the N-shard
  collection, the two settings alternating round by round (--rounds), retrieval cache off.
  Hybrid queries are not measured here: they need the packaged model's embeddings (the round
  runs while a query is embedded, so it adds nothing to a hybrid query's wait).

Run (from the repository root; under a minute for Cranfield on 2 cores):
    .venv/bin/python bench/bench_term_stats.py --dataset ../shared/datasets/cranfield --shards 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def build(data: Path, dataset: Path, shards: int) -> str:
    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import read_corpus
    from server.core.collection import CollectionStore

    docs = list(read_corpus(dataset))
    vectors = np.random.default_rng(0).standard_normal((len(docs), 8)).astype(np.float32)
    store = CollectionStore(data)
    name = f"s{shards}"
    desc = build_collection(docs, store, name, None, "Flat", shards=shards, quiet=True,
                            vectors=vectors, model_id="lexical-only@1")
    audit_build(store, name, desc.build_id)
    store.publish(name, desc.build_id)
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, type=Path, help="BEIR dataset directory")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc
    from server.transport.embedded import start_core_server

    with open(args.dataset / "queries.jsonl", encoding="utf-8") as f:
        queries = [t for t in (json.loads(line)["text"] for line in f if line.strip()) if t.strip()]
    data = Path(tempfile.mkdtemp(prefix="bench-term-stats-"))
    one, many = build(data, args.dataset, 1), build(data, args.dataset, args.shards)

    def serve(stats: bool):
        return start_core_server(data, pipeline={"collection_term_stats": stats,
                                                 "retrieval_cache_size": 0})

    def top10(stub, coll: str, q: str) -> list[str]:
        return [h.doc_id for h in stub.Search(pb.SearchRequest(collection=coll, text=q, top_k=10,
                                                               mode=pb.LEXICAL), timeout=30).hits]

    same, latency = {}, {True: [], False: []}
    for r in range(args.rounds):
        for stats in (True, False):
            srv = serve(stats)
            try:
                stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(srv.address))
                if r == 0:
                    same[stats] = sum(top10(stub, one, q) == top10(stub, many, q) for q in queries)
                for q in queries[:20]:  # warm up
                    top10(stub, many, q)
                for q in queries:
                    t = time.perf_counter()
                    top10(stub, many, q)
                    latency[stats].append((time.perf_counter() - t) * 1e3)
            finally:
                srv.stop()
    print(f"\n{args.dataset.name}: {len(queries)} queries, 1 vs {args.shards} shards, LEXICAL top-10\n")
    print("| BM25 statistics | identical top-10 lists | lexical p50 / p99 ms, "
          f"{args.shards} shards ({args.rounds} rounds) |")
    print("|---|---|---|")
    for stats, label in ((True, "the collection's (default)"), (False, "each shard's own")):
        lat = sorted(latency[stats])
        print(f"| {label} | {same[stats]} / {len(queries)} | {statistics.median(lat):.2f} / "
              f"{lat[int(0.99 * (len(lat) - 1))]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
