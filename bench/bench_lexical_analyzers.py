"""BM25 analyzer choice on Cranfield: tokenizer, stopwords and stemming, measured with tantivy.

What it measures
  For each analyzer an in-memory tantivy index (no server, no chunking) holds one document per
  Cranfield document, with `title` and `text` as two text fields analysed by that analyzer — the
  schema of `server.backends.lexical.make_schema` minus the tenant/metadata fields. Each query is
  analysed with the same analyzer, de-duplicated, and sent as a disjunction of term queries over
  text and title, exactly as `LexicalIndex.search` builds it (tantivy BM25, k1=1.2, b=0.75, per-field
  scores summed). The top 100 documents are scored with `index_builder.evaluate.score_query` and
  averaged with `mean_scores` over the judged queries.

  Analyzers:
    (a) tantivy built-in "default": simple tokenizer + remove_long(40) + lowercase
                                    (no stopwords, no stemming)
    (b) tantivy built-in "en_stem": (a) + Snowball English stemmer
    (c) the project's analyzer, server.backends.lexical.make_analyzer():
        simple + remove_long(40) + lowercase + English stopwords + Snowball English stemmer
    (d) (c) without stopwords — the same filter chain as (b), built with TextAnalyzerBuilder
    (e) extra, completing the 2x2: (a) + English stopwords, no stemming

  The built-in tokenizers (a, b) run inside tantivy at index time; their queries are analysed with
  a TextAnalyzerBuilder chain of the same filters (tantivy has no Python handle on a built-in
  analyzer). Row (d) doubles as a check of that: it must score exactly like (b).

  Each row also shows wins/ties/losses on per-query nDCG@10 against (c) and a two-sided paired
  sign-flip randomisation p-value for the mean nDCG@10 difference (--permutations).
  The reference from ../shared/datasets/README.md (bm25s, English stopwords, k=100, ranx) is
  printed alongside: nDCG@10 0.352, recall@100 0.709, MRR@10 0.508.

Run (from the repository root; about 10 seconds):
    .venv/bin/python bench/bench_lexical_analyzers.py
    .venv/bin/python bench/bench_lexical_analyzers.py --dataset ../shared/datasets/cranfield --depth 100
"""
from __future__ import annotations

import argparse
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import tantivy  # noqa: E402

from harness.measure import pct  # noqa: E402

DEFAULT_DATASET = REPO.parent / "shared" / "datasets" / "cranfield"
REFERENCE = {"ndcg@10": 0.352, "recall@100": 0.709, "mrr@10": 0.508}
SHOWN = ("ndcg@10", "recall@10", "recall@100", "mrr@10")


def chain(stopwords: bool, stem: bool) -> "tantivy.TextAnalyzer":
    b = (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
         .filter(tantivy.Filter.remove_long(40))
         .filter(tantivy.Filter.lowercase()))
    if stopwords:
        b = b.filter(tantivy.Filter.stopword("english"))
    if stem:
        b = b.filter(tantivy.Filter.stemmer("english"))
    return b.build()


def analyzers():
    """(key, label, index tokenizer name, analyzer to register or None for a built-in, query analyzer)."""
    from server.backends.lexical import make_analyzer

    return [
        ("a", 'tantivy "default" (lower; no stop, no stem)', "default", None, chain(False, False)),
        ("b", 'tantivy "en_stem" (lower + stem)', "en_stem", None, chain(False, True)),
        ("c", "project make_analyzer (lower+stop+stem)", "bench_project", make_analyzer(),
         make_analyzer()),
        ("d", "(c) without stopwords (lower+stem)", "bench_nostop", chain(False, True),
         chain(False, True)),
        ("e", "extra: lower + stopwords, no stem", "bench_stop_nostem", chain(True, False),
         chain(True, False)),
    ]


class AnalyzerIndex:
    def __init__(self, tokenizer_name: str, analyzer, query_analyzer, docs):
        sb = tantivy.SchemaBuilder()
        sb.add_unsigned_field("row", stored=True, indexed=True, fast=True)
        sb.add_text_field("title", stored=False, tokenizer_name=tokenizer_name)
        sb.add_text_field("text", stored=False, tokenizer_name=tokenizer_name)
        self.schema = sb.build()
        self.index = tantivy.Index(self.schema)  # in memory
        if analyzer is not None:
            self.index.register_tokenizer(tokenizer_name, analyzer)
        self.query_analyzer = query_analyzer
        t0 = time.perf_counter()
        writer = self.index.writer(heap_size=128_000_000, num_threads=1)
        for row, d in enumerate(docs):
            doc = tantivy.Document()
            doc.add_unsigned("row", row)
            if d.title:
                doc.add_text("title", d.title)
            doc.add_text("text", d.text)
            writer.add_document(doc)
        writer.commit()
        writer.wait_merging_threads()
        self.index.reload()
        self.index_seconds = time.perf_counter() - t0
        self.searcher = self.index.searcher()

    def terms(self, text: str) -> list[str]:
        seen: dict[str, None] = {}
        for tok in self.query_analyzer.analyze(text):
            seen.setdefault(tok, None)
        return list(seen)

    def search(self, text: str, k: int) -> list[int]:
        """Same query shape as LexicalIndex.search: SHOULD term queries over text and title."""
        terms = self.terms(text)
        if not terms:
            return []
        Q, Occur = tantivy.Query, tantivy.Occur
        query = Q.boolean_query([(Occur.Should, Q.term_query(self.schema, field, t))
                                 for t in terms for field in ("text", "title")])
        hits = self.searcher.search(query, k, count=False).hits
        if not hits:
            return []
        return [int(r) for r in self.searcher.fast_field_values("row", [a for _, a in hits])]


def sign_flip_p(diffs: np.ndarray, n: int, seed: int) -> float:
    """Two-sided paired randomisation test of mean(diffs) == 0."""
    if not np.any(diffs):
        return 1.0
    rng = np.random.default_rng(seed)
    observed = abs(diffs.mean())
    signs = rng.choice((-1.0, 1.0), size=(n, len(diffs)))
    return float((np.abs((signs * diffs).mean(axis=1)) >= observed - 1e-12).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="BEIR-layout dataset directory")
    p.add_argument("--split", default="test", help="qrels split (qrels/SPLIT.tsv)")
    p.add_argument("--depth", type=int, default=100, help="documents retrieved per query")
    p.add_argument("--permutations", type=int, default=10000, help="sign-flip test resamples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from index_builder.corpus import read_corpus
    from index_builder.evaluate import load_beir, mean_scores, score_query

    docs = list(read_corpus(args.dataset))
    queries, qrels = load_beir(args.dataset, args.split)
    qids = [q for q in queries if q in qrels]
    print(f"dataset: {args.dataset} — {len(docs)} documents, {len(qids)} judged queries "
          f"(of {len(queries)}); top {args.depth} per query; tantivy-py {version('tantivy')} BM25 "
          f"(k1=1.2, b=0.75), title and text fields, disjunction of analysed query terms\n")

    rows = []
    for key, label, tok_name, analyzer, qa in analyzers():
        idx = AnalyzerIndex(tok_name, analyzer, qa, docs)
        per_query, lat, n_terms, empty = {}, [], [], 0
        for qid in qids:
            t0 = time.perf_counter()
            hits = idx.search(queries[qid], args.depth)
            lat.append(time.perf_counter() - t0)
            n_terms.append(len(idx.terms(queries[qid])))
            empty += not hits
            ranking = [docs[r].doc_id for r in hits]
            per_query[qid] = score_query(ranking, qrels[qid])
        vocab = len({t for d in docs for t in qa.analyze(f"{d.title} {d.text}")})
        rows.append({"key": key, "label": label, "per_query": per_query,
                     "mean": mean_scores(per_query.values()), "index_s": idx.index_seconds,
                     "q_p50_ms": pct(lat, 50) * 1e3, "terms": float(np.mean(n_terms)),
                     "vocab": vocab, "empty": empty})

    header = (f"{'':4}{'analyzer':<46}" + "".join(f"{m:>12}" for m in SHOWN)
              + f"{'terms/q':>9}{'vocab':>8}{'index s':>9}{'query p50 ms':>14}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"({r['key']}) {r['label']:<46}" + "".join(f"{r['mean'][m]:>12.4f}" for m in SHOWN)
              + f"{r['terms']:>9.1f}{r['vocab']:>8}{r['index_s']:>9.2f}{r['q_p50_ms']:>14.2f}")
    print(f"{'ref':<4}{'bm25s, English stopwords (datasets/README.md)':<46}"
          + "".join(f"{REFERENCE[m]:>12.3f}" if m in REFERENCE else f"{'-':>12}" for m in SHOWN))

    base = next(r for r in rows if r["key"] == "c")
    print("\nPer-query nDCG@10 against (c), the project analyzer:")
    header = f"{'':4}{'mean diff':>10}{'wins':>6}{'ties':>6}{'losses':>8}{'p (sign-flip)':>15}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if r is base:
            continue
        d = np.array([r["per_query"][q]["ndcg@10"] - base["per_query"][q]["ndcg@10"] for q in qids])
        print(f"({r['key']}){d.mean():>+10.4f}{int((d > 1e-12).sum()):>6}{int((abs(d) <= 1e-12).sum()):>6}"
              f"{int((d < -1e-12).sum()):>8}{sign_flip_p(d, args.permutations, args.seed):>15.4f}")

    b = next(r for r in rows if r["key"] == "b")
    d = next(r for r in rows if r["key"] == "d")
    same = all(b["per_query"][q] == d["per_query"][q] for q in qids)
    print(f"\ncheck: built-in en_stem (b) and its TextAnalyzerBuilder equivalent (d) score "
          f"{'identically on every query' if same else 'DIFFERENTLY (query analysis mismatch!)'}")
    if any(r["empty"] for r in rows):
        print("queries with no hits: " + ", ".join(f"({r['key']}) {r['empty']}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
