"""Retrieval evaluation on a BEIR-layout dataset, run through the real service over gRPC.

Metrics are computed at the document level (chunks are collapsed to their document at its best
rank), with graded relevance as in trec_eval/ranx: nDCG@10 uses gain = grade and a log2(rank+1)
discount; recall@k, precision@10, MRR@10 and hit@10 count grade > 0 as relevant. Queries without
judgments are skipped, as ranx and trec_eval do. tests/test_evaluate.py cross-checks these
functions against ranx and against rankings computed by hand.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

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


def paired_tests(a: Sequence[float], b: Sequence[float], iterations: int = 10_000,
                 seed: int = 0) -> dict:
    """Paired comparison of per-query scores of two systems on the same queries: mean difference,
    a two-sided randomization (sign-flip) test and the paired t-test."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    observed = abs(d.mean()) if len(d) else 0.0
    rng = np.random.default_rng(seed)
    signs = rng.choice((-1.0, 1.0), size=(iterations, len(d)))
    p_random = float((np.abs((signs * d).mean(axis=1)) >= observed - 1e-12).mean()) if len(d) else 1.0
    out = {"n": len(d), "mean_diff": float(d.mean()) if len(d) else 0.0,
           "p_randomization": p_random}
    try:
        from scipy import stats

        out["p_ttest"] = float(stats.ttest_rel(a, b).pvalue) if len(d) > 1 and d.std() > 0 else 1.0
    except ImportError:  # scipy is a test dependency; the randomization test needs none
        pass
    return out


# Evaluation modes: the request each sends (hybrid-rrf is plain RRF, without dense feedback).
# The +rm3, -dwN, -minmax and -deeplong modes measure choices that are off by default: lexical
# feedback with 10 terms; weighted fusion with the dense list's share N/10; min-max score fusion;
# 3x the candidate depth for long queries (> 20 words).
MODES = {"dense": {"mode": "DENSE"}, "lexical": {"mode": "LEXICAL"}, "hybrid": {"mode": "HYBRID"},
         "hybrid-rrf": {"mode": "HYBRID", "feedback_docs": 0},
         "hybrid+rerank": {"mode": "HYBRID", "rerank": True},
         "lexical+rm3": {"mode": "LEXICAL", "lexical_feedback_terms": 10},
         "hybrid+rm3": {"mode": "HYBRID", "lexical_feedback_terms": 10},
         "hybrid-rrf+rm3": {"mode": "HYBRID", "feedback_docs": 0, "lexical_feedback_terms": 10},
         "hybrid-dw4": {"mode": "HYBRID", "dense_weight": 0.4},
         "hybrid-dw6": {"mode": "HYBRID", "dense_weight": 0.6},
         "hybrid-minmax": {"mode": "HYBRID", "fusion": "FUSION_MIN_MAX"},
         "hybrid-deeplong": {"mode": "HYBRID", "long_query_depth": 3}}


def _datasets(specs: Sequence[str]) -> list[tuple[Path, str]]:
    """DIR or DIR=COLLECTION; the collection is named after the directory when not given."""
    out = []
    for spec in specs:
        path, _, name = spec.partition("=")
        out.append((Path(path), name or Path(path).name))
    return out


EVAL_SOURCE = "eval-source.json"  # in the collection's directory: what eval built it from


def _corpus_fingerprint(dataset: Path) -> str:
    corpus = dataset / "corpus.jsonl" if dataset.is_dir() else dataset
    return hashlib.sha256(corpus.read_bytes()).hexdigest()


def _stale_build(store, name: str, model_id: str, dataset: Optional[Path] = None) -> str:
    """Why the collection's live build would not measure this dataset with this version's code
    (another corpus, chunker or embedder), or "" when it would (or there is none)."""
    from server.core.chunking import CHUNKER_VERSION

    if name not in store.collections():
        return ""
    desc = store.descriptor(name, store.live_build(name))
    if desc.chunker != CHUNKER_VERSION:
        return f": its live build used chunker {desc.chunker}, this version {CHUNKER_VERSION}"
    if desc.model_id != model_id:
        return f": its live build used embedder {desc.model_id}, this version {model_id}"
    if dataset is not None:
        source = store.collection_dir(name) / EVAL_SOURCE
        built_from = json.loads(source.read_text()).get("corpus_sha256") if source.is_file() else None
        if built_from != _corpus_fingerprint(dataset):
            return f": its live build was made from another corpus than {dataset}"
    return ""


def _serve(data_dir: Path, datasets: list[tuple[Path, str]]):
    """Build (once) and serve the datasets' collections in this process: exact search (Flat),
    the packaged MiniLM, one shard."""
    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import read_corpus
    from server.backends.device import Device
    from server.backends.models import Embedder
    from server.config import default_config
    from server.core.collection import CollectionStore
    from server.core.service import SearchCore
    from server.transport.embedded import ServerThread

    store = CollectionStore(data_dir)
    embedder = Embedder(None, Device("auto"))
    for path, name in datasets:
        stale = _stale_build(store, name, embedder.model_id, path)
        if name in store.collections() and not stale:
            continue
        print(f"building {name} from {path} (Flat, packaged MiniLM){stale}", file=sys.stderr)
        desc = build_collection(read_corpus(path), store, name, embedder, "Flat", quiet=True)
        audit_build(store, name, desc.build_id)
        store.publish(name, desc.build_id)
        (store.collection_dir(name) / EVAL_SOURCE).write_text(json.dumps(
            {"dataset": str(path), "corpus_sha256": _corpus_fingerprint(path)}))
    cfg = default_config("serve").replace(storage={"data_dir": data_dir})
    core = SearchCore(cfg, embedder, None, Device("auto"))
    core.load()
    return ServerThread(core).start()


class _Tee(io.TextIOBase):
    """Writes to several text streams."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)


def run_eval(args) -> int:
    from server.core import limits
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    datasets = _datasets(args.dataset)
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"unknown modes {unknown}; use {sorted(MODES)}", file=sys.stderr)
        return 2
    if not modes:  # (re-probe: an empty list evaluated nothing and exited 0)
        raise ValueError(f"--modes {args.modes!r} names no mode; use some of {sorted(MODES)}")
    # every argument is checked before the evaluation runs, not after (outside QA: a malformed
    # --compare failed once every mode had run, and lost the results)
    compare = []
    given = args.compare
    if given is None:  # the default pair, when both of its modes run
        given = "hybrid:hybrid-rrf" if {"hybrid", "hybrid-rrf"} <= set(modes) else ""
    for pair in (c.strip() for c in given.split(",")):
        if not pair:
            continue
        a, sep, b = pair.partition(":")
        if not sep or not a or not b or ":" in b or a == b:
            raise ValueError(f"--compare {pair!r}: give pairs of two modes as A:B, e.g. "
                             "hybrid:hybrid-rrf")
        missing = [m for m in (a, b) if m not in modes]
        if missing:
            raise ValueError(f"--compare {pair}: {', '.join(missing)} not among --modes "
                             f"({', '.join(modes)})")
        compare.append((a, b))
    if not 1 <= args.depth <= limits.MAX_TOP_K:  # hits asked: 2x the depth, up to the cap
        raise ValueError(f"--depth {args.depth}: between 1 and {limits.MAX_TOP_K} documents per "
                         "query")
    if args.depth < 100:
        print(f"note: --depth {args.depth} ranks fewer than 100 documents per query: recall@100 "
              f"is recall@{args.depth} here", file=sys.stderr)
    if getattr(args, "plots", None):  # before the evaluation, not after it (outside QA)
        import importlib.util

        missing = [m for m in ("matplotlib", "harness") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"--plots needs matplotlib (the bench extra) and the source "
                             f"checkout's harness/ package, which the images leave out "
                             f"(missing: {', '.join(missing)})")
    for path, _ in datasets:  # a bad second dataset fails now, not after the first's evaluation
        for need in (path / "queries.jsonl", path / "qrels" / f"{args.split}.tsv"):
            if not need.is_file():
                raise ValueError(f"--dataset {path}: {need} is missing (a BEIR directory has "
                                 f"corpus.jsonl, queries.jsonl and qrels/{args.split}.tsv)")
    server = _serve(args.serve_from, datasets) if args.serve_from else None
    address = server.address if server else args.address
    top_k = min(limits.MAX_TOP_K, args.depth * 2)
    report = {}
    try:
        import grpc

        from server.client import open_channel

        tls = (None, None, None) if server else (args.tls_ca, args.tls_cert, args.tls_key)
        with open_channel(address, *tls, max_answer_bytes=256 << 20) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            tables = io.StringIO()  # the printed tables, also kept as OUT/eval_tables.md
            with contextlib.redirect_stdout(_Tee(sys.stdout, tables)):
                for path, collection in datasets:
                    try:
                        report[collection] = _evaluate(stub, pb, path, collection, modes, compare,
                                                       top_k, args)
                    except grpc.RpcError as err:  # one line, not a gRPC traceback (outside QA)
                        raise ValueError(f"{address}: {err.code().name}: {err.details()}") from None
    finally:
        if server is not None:
            server.stop()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(
            {c: {k: v for k, v in r.items() if k != "per_query"} for c, r in report.items()}, indent=2))
        with open(args.out / "per_query.jsonl", "w") as f:
            for collection, r in report.items():
                for mode, per_query in r["per_query"].items():
                    for qid, q in per_query.items():
                        f.write(json.dumps({"collection": collection, "mode": mode, "query_id": qid,
                                            **q}) + "\n")
        (args.out / "eval_tables.md").write_text(tables.getvalue().lstrip("\n"))
        print(f"summary.json, per_query.jsonl and eval_tables.md written to {args.out}",
              file=sys.stderr)
    if getattr(args, "plots", None):
        from harness.plots import ndcg_by_slice

        summary = {c: {k: v for k, v in r.items() if k != "per_query"} for c, r in report.items()}
        for png in ndcg_by_slice(summary, args.plots):
            print(f"plot written to {png}", file=sys.stderr)
    return 0


def _evaluate(stub, pb, path: Path, collection: str, modes, compare, top_k: int, args) -> dict:
    queries, qrels = load_beir(path, args.split)
    qids = [q for q in queries if q in qrels]
    results: dict[str, dict[str, dict]] = {}
    for mode in modes:
        spec = MODES[mode]
        t0 = time.perf_counter()
        per_query = {}
        for start in range(0, len(qids), 32):  # one SearchBatch call per 32 queries
            batch = qids[start:start + 32]
            reqs = []
            for qid in batch:
                req = pb.SearchRequest(collection=collection, text=queries[qid], top_k=top_k,
                                       mode=getattr(pb, spec["mode"]), dense_depth=top_k,
                                       lexical_depth=top_k,
                                       rerank_depth=args.rerank_depth if spec.get("rerank") else 0)
                for option in ("feedback_docs", "lexical_feedback_terms", "dense_weight"):
                    if option in spec:
                        setattr(req, option, spec[option])
                if "fusion" in spec:
                    req.fusion = getattr(pb, spec["fusion"])
                if "long_query_depth" in spec and len(queries[qid].split()) > 20:
                    req.dense_depth = req.lexical_depth = spec["long_query_depth"] * top_k
                reqs.append(req)
            resp = stub.SearchBatch(pb.SearchBatchRequest(queries=reqs), timeout=600)
            for qid, item in zip(batch, resp.results):
                if item.code:
                    raise ValueError(f"{collection} query {qid} ({mode}): {item.message}")
                ranking = collapse_to_documents((h.doc_id for h in item.response.hits), args.depth)
                per_query[qid] = {"ranking": ranking, "scores": score_query(ranking, qrels[qid]),
                                  "slices": query_slices(queries[qid], qrels[qid])}
        results[mode] = per_query
        print(f"{collection} {mode}: {len(qids)} queries in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
    print(f"\n## {collection} ({len(qids)} judged queries)\n")
    print("| mode | slice | n | " + " | ".join(METRICS) + " |")
    print("|---|---|---|" + "---|" * len(METRICS))
    summary = {}
    for mode, per_query in results.items():
        groups: dict[str, list] = defaultdict(list)
        for r in per_query.values():
            groups["all"].append(r["scores"])
            for sl in r["slices"]:
                groups[sl].append(r["scores"])
        summary[mode] = {}
        for name in ["all"] + sorted(k for k in groups if k != "all"):
            means = mean_scores(groups[name])
            summary[mode][name] = {"n": len(groups[name]), **means}
            print(f"| {mode} | {name} | {len(groups[name])} | "
                  + " | ".join(f"{means[m]:.4f}" for m in METRICS) + " |")
    tests = {}
    for a, b in compare:
        if a in results and b in results:
            t = paired_tests([results[a][q]["scores"]["ndcg@10"] for q in qids],
                             [results[b][q]["scores"]["ndcg@10"] for q in qids])
            tests[f"{a} vs {b}"] = t
            print(f"\n{collection}: nDCG@10 {a} - {b} = {t['mean_diff']:+.4f} over {t['n']} queries; "
                  f"randomization p = {t['p_randomization']:.4f}"
                  + (f", paired t-test p = {t['p_ttest']:.4f}" if "p_ttest" in t else ""))
    return {"summary": summary, "tests": tests, "per_query": results}
