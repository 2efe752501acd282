"""How fast a shard applies a run of logged writes: what a replica catching up on the write log
does, one group commit per fetched batch (`--apply-batch`, the replica's `apply_batch`, 256).

    .venv/bin/python bench/bench_replay.py [--writes 2048] [--docs 40] [--apply-batch 256]

Two logs of the same length, in one run, on shards of the same build (Flat, `--dim` random
vectors carried by each write, so the embedding model is not measured):
- rewrites: `--writes` upserts cycling over `--docs` documents (a log that edits a few documents
  again and again: each group holds several writes of one document, which it stores once, as
  the writes in order leave it);
- distinct: `--writes` upserts of as many different documents (every write takes its rows).
Prints writes/s of each and their ratio, and the rows each shard ended with. Each group's
commit (tantivy's, SQLite's) waits on the disk, so the figures move with the host's I/O.
Before a group stored a document once, a repeat split the group, so the rewrites log made one
commit per few writes: 2,048 writes of 40 documents (8-d vectors, `--dim 8`) applied at
2,208-2,482 writes/s, 14,126-14,289 after (the sixteenth session). Rows for every write that
applies (so that replicas number rows alike, eighteenth session) took that to 7,824-7,851,
against 9,251-9,301 for distinct documents in the same run (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index_builder.build import build_collection  # noqa: E402
from index_builder.corpus import Document  # noqa: E402
from server.core.chunking import document_chunks  # noqa: E402
from server.core.collection import CollectionStore  # noqa: E402
from server.core.engine.index import ShardIndex  # noqa: E402
from server.core.types import ShardWrite  # noqa: E402

MODEL = "bench-replay@1"


def log_of(doc_ids: list[str], dim: int, rng) -> list[ShardWrite]:
    """Upserts of `doc_ids` in order, each a newer version of its document, numbered as a log."""
    versions: dict[str, int] = {}
    writes = []
    for seq, doc_id in enumerate(doc_ids, 1):
        versions[doc_id] = versions.get(doc_id, 0) + 1
        text = f"document {doc_id} as of edit {versions[doc_id]}"
        chunks = tuple(document_chunks("", text))
        w = ShardWrite("upsert", "default", doc_id, versions[doc_id], {"title": "", "text": text},
                       chunks, rng.standard_normal((len(chunks), dim)).astype(np.float32),
                       model_id=MODEL)
        w.seq = seq
        writes.append(w)
    return writes


def replay(desc, build_dir: Path, root: Path, writes: list[ShardWrite], group: int):
    index = ShardIndex(desc, build_dir, root, 0, None, 0)
    try:
        t0 = time.perf_counter()
        for i in range(0, len(writes), group):
            index.apply_writes(writes[i:i + group])
        secs = time.perf_counter() - t0
        assert index.applied_seq == len(writes)
        return len(writes) / secs, index.nrows
    finally:
        index.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--writes", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=40, help="documents the rewrites log cycles over")
    ap.add_argument("--apply-batch", type=int, default=256, help="writes per group commit")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two logs")
    args = ap.parse_args()
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store = CollectionStore(tmp / "data")
        base = [Document(f"base{i}", f"base document {i}") for i in range(200)]
        base_vectors = rng.standard_normal((len(base), args.dim)).astype(np.float32)
        desc = build_collection(base, store, "replay", None, "Flat", quiet=True, model_id=MODEL,
                                vectors=base_vectors)
        build_dir = store.build_dir("replay", desc.build_id)
        logs = {"rewrites": log_of([f"d{i % args.docs}" for i in range(args.writes)], args.dim,
                                   rng),
                "distinct": log_of([f"d{i}" for i in range(args.writes)], args.dim, rng)}
        rates: dict[str, list[float]] = {name: [] for name in logs}
        rows = {}
        for r in range(args.rounds):  # alternating: this host's speed drifts
            for name, writes in logs.items():
                rate, rows[name] = replay(desc, build_dir, tmp / f"state-{name}-{r}", writes,
                                          args.apply_batch)
                rates[name].append(rate)
    print(f"| log ({args.writes} upserts, groups of {args.apply_batch}) | writes/s (each round) "
          "| rows at the end |")
    print("|---|---|---|")
    for name, label in (("rewrites", f"rewrites of {args.docs} documents"),
                        ("distinct", f"{args.writes} distinct documents")):
        print(f"| {label} | {' / '.join(f'{x:,.0f}' for x in rates[name])} | {rows[name]:,} |")
    ratio = np.median(rates["rewrites"]) / np.median(rates["distinct"])
    print(f"\nrewrites / distinct (medians): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
