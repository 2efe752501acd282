"""Writing one shard of a build: dense index (trained, added in blocks), exact vectors, chunk store,
BM25 index, and dedicated indexes for large tenants. Shared by the offline builder
(index_builder/build.py) and in-server compaction (server/core/compaction.py)."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from tqdm import tqdm

from server.backends.dense import build_dense, file_record, make_index, training_size
from server.backends.docstore import ChunkRecord, DocStore
from server.backends.lexical import LexicalIndex


@dataclass
class ShardOutput:
    files: dict
    counts: dict
    tenants: dict
    dedicated: list = field(default_factory=list)


@contextlib.contextmanager
def _ticking(bar: tqdm, what: str, every_s: float = 1.0):
    """While a call that reports no progress runs (faiss training: minutes for OPQ or a large
    IVF), the bar names it and counts its seconds, instead of sitting at 0%."""
    if bar.disable:
        yield
        return
    desc, t0, stop = bar.desc, time.monotonic(), threading.Event()
    bar.set_description_str(what, refresh=True)

    def tick():
        while not stop.wait(every_s):
            bar.set_postfix_str(f"{time.monotonic() - t0:.0f} s", refresh=True)

    ticker = threading.Thread(target=tick, name="build-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        bar.set_description_str(desc, refresh=False)
        bar.set_postfix_str("", refresh=True)


def train_sample(x: np.ndarray, factory: str, dim: int, metric: str, rng) -> np.ndarray:
    want = training_size(make_index(factory, dim, metric))
    return x[rng.choice(len(x), size=min(want, len(x)), replace=False)] if want else x[:0]


def write_shard(sdir: Path, records: Sequence[ChunkRecord], x: np.ndarray, documents: dict,
                factory: str, metric: str, rng, dedicated_min: Optional[int], corpus_version: str,
                build_id: str, quiet: bool = True, label: str = "") -> ShardOutput:
    """`records[i].row == i` and `x[i]` is its vector; `documents`: (tenant, doc_id) -> (version,
    live) — tombstones included, so a compacted shard still refuses older replays."""
    sdir.mkdir(parents=True)
    dim = x.shape[1]
    row_ids = np.array([r.chunk_id for r in records], dtype=np.int64)
    bar = tqdm(total=len(records), desc=f"add shard {label}", unit="chunk", disable=quiet, leave=False)
    with bar:
        dense = build_dense(factory, dim, metric, lambda: x, train_sample(x, factory, dim, metric, rng),
                            row_ids, progress=bar.update,
                            training=lambda what: _ticking(bar, f"{what} (shard {label})"))
    files = dense.write(sdir)
    np.save(sdir / "vectors.npy", x)  # exact vectors: audits, exact restricted search, compaction
    store = DocStore(sdir / "docstore.sqlite", create=True)
    store.insert_chunks(records)
    store.insert_documents((t, d, v, live) for (t, d), (v, live) in documents.items())
    store.set_meta("corpus_version", corpus_version)
    store.set_meta("build_id", build_id)
    counts = store.counts()
    tenants = store.tenants()
    store.seal()
    store.close()
    lexical = LexicalIndex.create(sdir / "lexical")
    lexical.add((r.row, r.title, r.text, r.tenant, r.metadata, r.acl) for r in records)
    # every file a server reads from the build, checked at publish and when a server first reads
    # it (tantivy's lock files, which it recreates, excepted; its list of managed files
    # included: a truncated one made the BM25 index unopenable): damage after the audit is refused
    files["vectors.npy"] = file_record(sdir / "vectors.npy")
    files["docstore.sqlite"] = file_record(sdir / "docstore.sqlite")
    files["lexical"] = {f.name: file_record(f) for f in sorted((sdir / "lexical").iterdir())
                        if f.is_file() and not f.name.endswith(".lock")}
    dedicated = []
    for tenant, count in sorted(tenants.items()):
        if dedicated_min is None or count < dedicated_min:
            continue
        rows = np.array([r.row for r in records if r.tenant == tenant], dtype=np.int64)
        tx = x[rows]
        tfactory = factory if len(tx) >= training_size(make_index(factory, dim, metric)) else "Flat"
        tdense = build_dense(tfactory, dim, metric, lambda: tx, train_sample(tx, tfactory, dim, metric, rng),
                             rows)
        files[f"tenants/{tenant}"] = tdense.write(sdir / "tenants" / tenant)
        dedicated.append(tenant)
    return ShardOutput(files, counts, tenants, dedicated)
