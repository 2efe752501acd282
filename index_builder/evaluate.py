"""Retrieval evaluation on a BEIR-layout dataset, run through the real service over gRPC.

Metrics are computed at the document level (chunks are collapsed to their document at its best
rank), with graded relevance as in trec_eval/ranx: nDCG@10 uses gain = grade and a log2(rank+1)
discount; recall@k, precision@10, MRR@10 and hit@10 count grade > 0 as relevant. Queries without
judgments are skipped, as ranx and trec_eval do. tests/test_evaluate.py cross-checks these
functions against ranx and against rankings computed by hand.
"""
from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

METRICS = ("ndcg@10", "recall@10", "recall@100", "mrr@10", "hit@10", "precision@10")


def ndcg_at(ranking: Sequence[str], qrels: dict[str, int], k: int) -> float:
    dcg = sum(qrels.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranking[:k]))
    ideal = sorted((g for g in qrels.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def recall_at(ranking: Sequence[str], qrels: dict[str, int], k: int) -> float:
    rel = {d for d, g in qrels.items() if g > 0}
    return len(rel.intersection(ranking[:k])) / len(rel) if rel else 0.0


def precision_at(ranking: Sequence[str], qrels: dict[str, int], k: int) -> float:
    return sum(1 for d in ranking[:k] if qrels.get(d, 0) > 0) / k


def mrr_at(ranking: Sequence[str], qrels: dict[str, int], k: int) -> float:
    for i, d in enumerate(ranking[:k]):
        if qrels.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def hit_at(ranking: Sequence[str], qrels: dict[str, int], k: int) -> float:
    return 1.0 if any(qrels.get(d, 0) > 0 for d in ranking[:k]) else 0.0


def score_query(ranking: Sequence[str], qrels: dict[str, int]) -> dict[str, float]:
    return {"ndcg@10": ndcg_at(ranking, qrels, 10), "recall@10": recall_at(ranking, qrels, 10),
            "recall@100": recall_at(ranking, qrels, 100), "mrr@10": mrr_at(ranking, qrels, 10),
            "hit@10": hit_at(ranking, qrels, 10), "precision@10": precision_at(ranking, qrels, 10)}


def mean_scores(per_query: Iterable[dict[str, float]]) -> dict[str, float]:
    rows = list(per_query)
    return {m: sum(r[m] for r in rows) / len(rows) for m in METRICS} if rows else {}


def load_beir(dataset: Path, split: str = "test") -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    queries = {}
    with open(dataset / "queries.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                queries[str(obj["_id"])] = obj["text"]
    qrels: dict[str, dict[str, int]] = defaultdict(dict)
    with open(dataset / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t")
        for row in reader:
            if not row or row[0] == "query-id":
                continue
            qrels[row[0]][row[1]] = int(row[2])
    return queries, dict(qrels)


def collapse_to_documents(doc_ids: Iterable[str], depth: int) -> list[str]:
    """A document ranks where its best chunk ranks."""
    out, seen = [], set()
    for d in doc_ids:
        if d not in seen:
            seen.add(d)
            out.append(d)
            if len(out) == depth:
                break
    return out


def query_slices(text: str, qrels: dict[str, int]) -> list[str]:
    words = len(text.split())
    length = "short(<=10 words)" if words <= 10 else ("medium(11-20)" if words <= 20 else "long(>20)")
    nrel = sum(1 for g in qrels.values() if g > 0)
    judged = "few-relevant(<=5)" if nrel <= 5 else "many-relevant(>5)"
    return [length, judged]


def run_eval(args) -> int:
    import grpc

    from server.core import limits
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    queries, qrels = load_beir(args.dataset, args.split)
    qids = [q for q in queries if q in qrels]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    mode_pb = {"dense": pb.DENSE, "lexical": pb.LEXICAL, "hybrid": pb.HYBRID,
               "hybrid+rerank": pb.HYBRID}
    for m in modes:
        if m not in mode_pb:
            print(f"unknown mode {m!r}; use {sorted(mode_pb)}", file=sys.stderr)
            return 2
    top_k = min(limits.MAX_TOP_K, args.depth * 2)
    results: dict[str, dict[str, dict]] = {}
    with grpc.insecure_channel(args.address) as ch:
        stub = pb_grpc.SearchServiceStub(ch)
        for mode in modes:
            t0 = time.perf_counter()
            per_query = {}
            for qid in qids:
                req = pb.SearchRequest(collection=args.collection, text=queries[qid], top_k=top_k,
                                       mode=mode_pb[mode], dense_depth=top_k, lexical_depth=top_k,
                                       rerank_depth=args.rerank_depth if mode == "hybrid+rerank" else 0)
                resp = stub.Search(req, timeout=60)
                ranking = collapse_to_documents((h.doc_id for h in resp.hits), args.depth)
                per_query[qid] = {"ranking": ranking, "scores": score_query(ranking, qrels[qid]),
                                  "slices": query_slices(queries[qid], qrels[qid])}
            results[mode] = per_query
            print(f"{mode}: {len(qids)} queries in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    header = f"{'mode':<15}{'slice':<20}{'n':>5}" + "".join(f"{m:>14}" for m in METRICS)
    print(header)
    print("-" * len(header))
    summary = {}
    for mode, per_query in results.items():
        groups: dict[str, list] = defaultdict(list)
        for r in per_query.values():
            groups["all"].append(r["scores"])
            for s in r["slices"]:
                groups[s].append(r["scores"])
        summary[mode] = {}
        for name in ["all"] + sorted(k for k in groups if k != "all"):
            means = mean_scores(groups[name])
            summary[mode][name] = {"n": len(groups[name]), **means}
            print(f"{mode:<15}{name:<20}{len(groups[name]):>5}"
                  + "".join(f"{means[m]:>14.4f}" for m in METRICS))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "per_query.jsonl", "w") as f:
            for mode, per_query in results.items():
                for qid, r in per_query.items():
                    f.write(json.dumps({"mode": mode, "query_id": qid, **r}) + "\n")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"per-query results and summary written to {args.out}", file=sys.stderr)
    return 0
