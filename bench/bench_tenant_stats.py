"""BM25 with each tenant's own statistics: what the count queries cost a lexical search.

    .venv/bin/python bench/bench_tenant_stats.py [--dataset ../shared/datasets/cranfield]
        [--tenants 2] [--rounds 2] [--k 100]

Indexes the dataset's corpus in one LexicalIndex (server/backends/lexical.py), documents dealt
round-robin to --tenants tenants, and searches every query as the first tenant, alternating in
one run: with index-wide statistics (tantivy's own: every tenant's documents, the behaviour
before tenant scoping), and with the tenant's own live statistics, cold (just after a reload:
every count query runs) and warm (counts cached for this index version). Prints p50/p99 per
search. An index of one tenant takes the first path at no cost.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.backends.lexical import LexicalIndex  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=str(Path(__file__).resolve().parents[2] / "shared" /
                                             "datasets" / "cranfield"))
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=100)
    args = ap.parse_args(argv)
    root = Path(args.dataset)
    docs = [json.loads(line) for line in open(root / "corpus.jsonl")]
    queries = [json.loads(line)["text"] for line in open(root / "queries.jsonl")]
    lex = LexicalIndex.create(Path(tempfile.mkdtemp()) / "lexical")
    lex.add((i, d.get("title", ""), d["text"], f"t{i % args.tenants}", {}, ("@all",))
            for i, d in enumerate(docs))
    scoped = LexicalIndex._scoped_stats

    def run(label: str, repeat: int) -> None:
        took = []
        for _ in range(repeat):
            for q in queries:
                t = time.perf_counter()
                lex.search(q, args.k, "t0")
                took.append(time.perf_counter() - t)
        took.sort()
        print(f"| {label} | {took[len(took) // 2] * 1e6:.0f} | {took[int(len(took) * 0.99)] * 1e6:.0f} |")

    print(f"{len(docs)} documents, {args.tenants} tenants, {len(queries)} queries, top {args.k}\n")
    print("| statistics | p50 us | p99 us |\n|---|---|---|")
    for _ in range(args.rounds):
        LexicalIndex._scoped_stats = lambda *a, **k: None
        run("index-wide (tantivy's own)", 3)
        LexicalIndex._scoped_stats = scoped
        lex._reload()
        run("the tenant's own, cold", 1)
        run("the tenant's own, warm", 3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
