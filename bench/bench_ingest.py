"""Streaming ingest on the embedded default: upsert throughput under query load, write-to-visible
freshness, and compaction cost at 10/30/50% deleted.

Everything runs in this process: a real SearchCore behind a real grpc.aio server on 127.0.0.1 (as
tests/conftest.py start_core_server does), driven by grpc clients in threads.

What it measures
----------------
Setup: Cranfield (1400 documents) is built with the real builder (index_builder.build.
build_collection; default 2 shards, factory Flat), audited and published.

(a) ingest under query load. M reader threads run hybrid Search (top_k 10, Cranfield's 225 queries
    in turn) for --baseline-s seconds alone, then N writer threads run UpsertDocument for
    --ingest-s seconds while the readers go on. Each upsert is a Cranfield text with a unique token
    appended (``zq<writer>x<i>``); half are new documents, half replace a document this writer
    inserted earlier (version + 1). Reported: documents/s (and chunks/s) acknowledged, upsert
    latency, and query p50/p99 with no ingest vs during ingest, measured in the same run. The
    server's retrieval and embedding caches are OFF in (a) (--caches to keep them): with them on,
    the no-ingest phase would be served from the cache and the comparison would show cache hit
    rates, not ingest contention.
(b) freshness. With the server's default config (caches on) and N background writers going, a
    sampling writer sends --fresh-samples upserts one at a time; for each, a poller thread issues
    lexical searches for the document's unique token back to back from the moment the upsert is
    sent. Reported: send -> acknowledged, send -> first search that returned the document
    (completion time of that search), and a read-after-ack check (one search sent after the
    acknowledgement must find it: the server promises a write is searchable once acknowledged).
(c) compaction. For each deleted fraction (10%, 30%, 50%): a fresh copy of the built collection,
    a fresh server, then DeleteDocument for that fraction of the documents (random, fixed seed),
    then AdminService.Compact. Reported: compaction wall time (client) and the server's own
    `seconds`, process RSS before / peak during / after (VmRSS, sampled every 10 ms; the client,
    the server and the model share this process), on-disk size of the live build before and after
    (dense index, vectors.npy, BM25 index, SQLite store incl. WAL), and dense-search latency
    (query vectors sent over gRPC, so no embedding; retrieval cache off) before the deletes,
    after the deletes (tombstones are masked out by a row bitmap, which moves a Flat shard from
    faiss's unfiltered scan to exact search over the allowed rows), and after compaction; plus a
    check that the dense top-10 answers are identical before and after compaction.

Model: --model minilm uses the real packaged all-MiniLM-L6-v2 (server.backends.models.Embedder());
--model tiny a randomly initialised 1-layer BERT (hidden 32) with MiniLM's tokenizer, as
tests/conftest.py builds: then throughput reflects the pipeline (gRPC, chunking, batching, SQLite,
faiss, tantivy), not a real model. --model auto (default) times MiniLM on 64 Cranfield chunks and
uses it only if the projected run fits --budget-s (540 s); the choice is printed.

Run
---
    .venv/bin/python bench/bench_ingest.py                     # auto model, ~3-10 min
    .venv/bin/python bench/bench_ingest.py --model tiny --baseline-s 5 --ingest-s 10 \
        --fresh-samples 10 --fractions 0.3                    # quick
    .venv/bin/python bench/bench_ingest.py --json bench/results/ingest.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import CpuMonitor, pct  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CRANFIELD = REPO.parent / "shared" / "datasets" / "cranfield"
COLL = "cran"


# --- process memory --------------------------------------------------------------------------
def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class RssSampler:
    """Peak VmRSS over a block, sampled every `interval` seconds in a thread."""

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb())
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = rss_mb()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)
        self.peak = max(self.peak, rss_mb())
        return False


def dir_sizes(build_dir: Path) -> dict[str, int]:
    """Bytes on disk of one build, by component (summed over shards)."""
    out = {"dense": 0, "vectors": 0, "lexical": 0, "sqlite": 0, "sqlite_wal": 0, "other": 0}
    for p in build_dir.rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(build_dir).parts
        n = p.stat().st_size
        if "lexical" in rel:
            out["lexical"] += n
        elif p.name == "docstore.sqlite":
            out["sqlite"] += n
        elif p.name.startswith("docstore.sqlite"):  # -wal / -shm: transient, checkpointed later
            out["sqlite_wal"] += n
        elif p.name == "vectors.npy":
            out["vectors"] += n
        elif p.name in ("dense.faiss", "rows.npy") or "tenants" in rel:
            out["dense"] += n
        else:
            out["other"] += n
    out["total"] = sum(out.values())
    return out


def mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


# --- models ----------------------------------------------------------------------------------
def tiny_embedder(workdir: Path):
    """A randomly initialised 1-layer BERT with MiniLM's tokenizer (as tests/conftest.py)."""
    import torch
    from transformers import BertConfig, BertModel

    from server.backends.device import Device
    from server.backends.models import Embedder, packaged_minilm_dir

    d = workdir / "tiny-embedder"
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(d)
    src = packaged_minilm_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(src / name, d / name)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return Embedder(d, Device("cpu"), model_name="tiny-random-bert")


def choose_model(kind: str, workdir: Path, chunk_texts: list[str], budget_s: float,
                 fixed_s: float, say):
    from server.backends.device import Device
    from server.backends.models import Embedder

    if kind in ("auto", "minilm"):
        t0 = time.perf_counter()
        real = Embedder(device=Device("cpu"))
        load_s = time.perf_counter() - t0
        if kind == "minilm":
            return real, "MiniLM (real packaged all-MiniLM-L6-v2)"
        sample = chunk_texts[:64]
        real.encode_many(sample[:8])
        t0 = time.perf_counter()
        real.encode_many(sample)  # the build's own call (batches of 64, length-sorted)
        per_chunk = (time.perf_counter() - t0) / len(sample)
        # the build embeds every chunk once; (a) runs for fixed times; (b) and (c) add about a
        # minute (compaction re-uses the stored vectors, no re-embedding)
        projected = per_chunk * len(chunk_texts) + fixed_s + 60.0
        say(f"model auto: MiniLM loaded in {load_s:.1f}s, {per_chunk * 1e3:.0f} ms/chunk here -> "
            f"projected {projected:.0f}s in all (budget {budget_s:.0f}s)")
        if projected <= budget_s:
            return real, "MiniLM (real packaged all-MiniLM-L6-v2)"
        del real
        gc.collect()
    emb = tiny_embedder(workdir)
    return emb, ("TINY randomly initialised 1-layer BERT (hidden 32, dim 32) with MiniLM's tokenizer: "
                 "numbers reflect the pipeline, not a real model")


# --- server ----------------------------------------------------------------------------------
def serve(data_dir: Path, embedder, **config):
    """The real gRPC server over an in-process SearchCore, on its own loop in a thread."""
    from server.backends.device import Device
    from server.core.search import SearchConfig, SearchCore
    from server.transport.embedded import ServerThread

    core = SearchCore(SearchConfig(data_dir=data_dir, **config), embedder, None, Device("cpu"))
    core.load()
    return ServerThread(core).start()


def build_base(docs, embedder, data_dir: Path, shards: int, factory: str) -> dict:
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    store = CollectionStore(data_dir)
    t0 = time.perf_counter()
    desc = build_collection(docs, store, COLL, embedder, factory, shards=shards, quiet=True)
    build_s = time.perf_counter() - t0
    audit = audit_build(store, COLL, desc.build_id, min_recall=0.0)
    store.publish(COLL, desc.build_id)
    return {"build_id": desc.build_id, "chunks": desc.chunks, "documents": desc.documents,
            "build_s": build_s, "audit_recall": audit["recall"], "model_id": desc.model_id}


# --- (a) ingest under query load -------------------------------------------------------------
def phase_ingest(addr: str, docs, queries: list[str], writers: int, readers: int,
                 baseline_s: float, ingest_s: float, max_upserts: int, say) -> dict:
    import grpc

    from server.core.chunking import chunk_text
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    phase = {"name": "baseline"}
    qlat = {"baseline": [], "ingest": []}
    qerr = {"baseline": 0, "ingest": 0}
    stop_readers = threading.Event()
    stop_writers = threading.Event()
    lock = threading.Lock()

    def reader(r: int):
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            i = r * 37
            while not stop_readers.is_set():
                text = queries[i % len(queries)]
                i += 1
                name = phase["name"]
                t0 = time.perf_counter()
                try:
                    stub.Search(pb.SearchRequest(collection=COLL, text=text, top_k=10, mode=pb.HYBRID),
                                timeout=60)
                    dt = time.perf_counter() - t0
                    if phase["name"] == name:  # a query that straddles the switch counts nowhere
                        qlat[name].append(dt * 1e3)
                except grpc.RpcError:
                    qerr[name] += 1

    written = {"docs": 0, "chunks": 0, "inserts": 0, "updates": 0, "noop": 0, "errors": 0}
    ulat: list[float] = []

    def writer(w: int):
        rng = random.Random(1000 + w)
        mine: list[tuple[str, int, int]] = []  # (doc_id, version, source doc index)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            i = 0
            while not stop_writers.is_set() and i < max_upserts:
                if mine and rng.random() < 0.5:
                    j = rng.randrange(len(mine))
                    doc_id, version, src = mine[j]
                    version += 1
                    mine[j] = (doc_id, version, src)
                    kind = "updates"
                else:
                    src = rng.randrange(len(docs))
                    doc_id, version = f"ing-{w}-{i}", 1
                    mine.append((doc_id, version, src))
                    kind = "inserts"
                d = docs[src]
                text = f"{d.text} zq{w}x{i}"
                i += 1
                t0 = time.perf_counter()
                try:
                    r = stub.UpsertDocument(pb.UpsertDocumentRequest(
                        collection=COLL, doc_id=doc_id, version=version, text=text, title=d.title),
                        timeout=60)
                except grpc.RpcError as exc:
                    with lock:
                        written["errors"] += 1
                    say(f"  upsert error: {exc.code()} {exc.details()[:200]}")
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    ulat.append(dt * 1e3)
                    if r.outcome == pb.WriteResponse.APPLIED:
                        written["docs"] += 1
                        written[kind] += 1
                        written["chunks"] += len(chunk_text(text))
                    else:
                        written["noop"] += 1

    rthreads = [threading.Thread(target=reader, args=(r,), daemon=True) for r in range(readers)]
    for t in rthreads:
        t.start()
    time.sleep(min(2.0, baseline_s / 4))  # warm up (first batches, channel setup): not counted
    qlat["baseline"].clear()
    t_base = time.perf_counter()
    time.sleep(baseline_s)
    base_wall = time.perf_counter() - t_base
    phase["name"] = "ingest"
    wthreads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(writers)]
    with CpuMonitor() as mon:
        t0 = time.perf_counter()
        for t in wthreads:
            t.start()
        deadline = t0 + ingest_s
        while time.perf_counter() < deadline and any(t.is_alive() for t in wthreads):
            time.sleep(0.05)
        stop_writers.set()
        for t in wthreads:
            t.join(120)
        ingest_wall = time.perf_counter() - t0
        phase["name"] = "done"
    stop_readers.set()
    for t in rthreads:
        t.join(120)
    return {"writers": writers, "readers": readers, "baseline_s": base_wall, "ingest_s": ingest_wall,
            "docs_per_s": written["docs"] / ingest_wall, "chunks_per_s": written["chunks"] / ingest_wall,
            "written": written, "upsert_p50": pct(ulat, 50), "upsert_p99": pct(ulat, 99),
            "q_base_n": len(qlat["baseline"]), "q_base_p50": pct(qlat["baseline"], 50),
            "q_base_p99": pct(qlat["baseline"], 99), "q_base_qps": len(qlat["baseline"]) / base_wall,
            "q_ing_n": len(qlat["ingest"]), "q_ing_p50": pct(qlat["ingest"], 50),
            "q_ing_p99": pct(qlat["ingest"], 99), "q_ing_qps": len(qlat["ingest"]) / ingest_wall,
            "q_errors": qerr, "cpu": mon.summary()}


# --- (b) freshness ---------------------------------------------------------------------------
def phase_freshness(addr: str, docs, samples: int, background_writers: int, say) -> dict:
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    stop_bg = threading.Event()
    bg_done = [0]

    def background(w: int):
        rng = random.Random(5000 + w)
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            i = 0
            while not stop_bg.is_set() and i < 100_000:
                d = docs[rng.randrange(len(docs))]
                try:
                    stub.UpsertDocument(pb.UpsertDocumentRequest(
                        collection=COLL, doc_id=f"bg-{w}-{i}", version=1,
                        text=f"{d.text} zb{w}x{i}", title=d.title), timeout=60)
                    bg_done[0] += 1
                except grpc.RpcError:
                    pass
                i += 1

    ack, visible, polls, after_ack_ms = [], [], [], []
    before_ack, misses_after_ack, not_found = 0, 0, 0
    bg = [threading.Thread(target=background, args=(w,), daemon=True) for w in range(background_writers)]
    for t in bg:
        t.start()
    time.sleep(1.0)
    rng = random.Random(7)
    with grpc.insecure_channel(addr) as wch, grpc.insecure_channel(addr) as pch:
        wstub = pb_grpc.SearchServiceStub(wch)
        pstub = pb_grpc.SearchServiceStub(pch)
        for s in range(samples):
            d = docs[rng.randrange(len(docs))]
            token = f"zfresh{s}q{rng.randrange(10**9)}"
            doc_id = f"fresh-{s}"
            state = {"t_ack": None, "found_at": None, "found_sent": None, "polls": 0,
                     "miss_after_ack": 0}
            go = threading.Event()

            def poll():
                go.wait()
                t_end = time.perf_counter() + 30.0  # bounded
                while time.perf_counter() < t_end:
                    t_sent = time.perf_counter()
                    try:
                        r = pstub.Search(pb.SearchRequest(collection=COLL, text=token, top_k=10,
                                                          mode=pb.LEXICAL), timeout=30)
                    except grpc.RpcError as exc:
                        state["errors"] = state.get("errors", 0) + 1
                        say(f"  poll error: {exc.code()} {exc.details()[:200]}")
                        continue
                    t_recv = time.perf_counter()
                    state["polls"] += 1
                    hit = any(h.doc_id == doc_id for h in r.hits)
                    t_ack = state["t_ack"]
                    if not hit and t_ack is not None and t_sent > t_ack:
                        state["miss_after_ack"] += 1
                    if hit:
                        state["found_at"], state["found_sent"] = t_recv, t_sent
                        return

            poller = threading.Thread(target=poll, daemon=True)
            poller.start()
            t_send = time.perf_counter()
            go.set()
            r = wstub.UpsertDocument(pb.UpsertDocumentRequest(
                collection=COLL, doc_id=doc_id, version=1, text=f"{d.text} {token}", title=d.title),
                timeout=60)
            t_ack = time.perf_counter()
            state["t_ack"] = t_ack
            assert r.outcome == pb.WriteResponse.APPLIED, r
            # read-after-ack: a search sent now must see it
            t0 = time.perf_counter()
            rr = wstub.Search(pb.SearchRequest(collection=COLL, text=token, top_k=10,
                                               mode=pb.LEXICAL), timeout=30)
            after_ack_ms.append((time.perf_counter() - t0) * 1e3)
            if not any(h.doc_id == doc_id for h in rr.hits):
                misses_after_ack += 1
                say(f"  read-after-ack MISS for {doc_id} (token {token})")
            poller.join(40)
            ack.append((t_ack - t_send) * 1e3)
            polls.append(state["polls"])
            misses_after_ack += state["miss_after_ack"]
            if state["found_at"] is None:
                not_found += 1
                continue
            visible.append((state["found_at"] - t_send) * 1e3)
            if state["found_sent"] < t_ack:
                before_ack += 1
    stop_bg.set()
    for t in bg:
        t.join(120)
    return {"samples": samples, "background_writers": background_writers,
            "background_upserts": bg_done[0], "ack_p50": pct(ack, 50), "ack_p99": pct(ack, 99),
            "visible_p50": pct(visible, 50), "visible_p99": pct(visible, 99),
            "visible_max": max(visible) if visible else float("nan"),
            "read_after_ack_p50": pct(after_ack_ms, 50), "polls_mean": float(np.mean(polls)),
            "found_by_search_sent_before_ack": before_ack, "misses_after_ack": misses_after_ack,
            "never_found": not_found}


# --- (c) compaction --------------------------------------------------------------------------
def dense_latency(stub, pb, qvecs: np.ndarray, model_id: str, reps: int) -> tuple[list, list]:
    lat, answers = [], []
    for rep in range(reps):
        for v in qvecs:
            req = pb.SearchRequest(collection=COLL, top_k=10, mode=pb.DENSE,
                                   vector=pb.QueryVector(values=v.tolist(), model_id=model_id))
            t0 = time.perf_counter()
            r = stub.Search(req, timeout=60)
            lat.append((time.perf_counter() - t0) * 1e3)
            if rep == 0:
                answers.append([(h.doc_id, h.chunk_index) for h in r.hits])
    return lat, answers


def phase_compaction(pristine: Path, workdir: Path, embedder, docs, qvecs: np.ndarray,
                     fraction: float, reps: int, delete_threads: int, say) -> dict:
    import grpc

    from server.core.collection import CollectionStore
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    data = workdir / f"compact-{int(fraction * 100)}"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(pristine, data)
    store = CollectionStore(data)
    srv = serve(data, embedder, retrieval_cache_size=0)
    try:
        model_id = srv.core.collections[COLL].desc.model_id
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            admin = pb_grpc.AdminServiceStub(ch)
            dense_latency(stub, pb, qvecs[:10], model_id, 1)  # warm-up
            lat0, _ = dense_latency(stub, pb, qvecs, model_id, reps)
            victims = random.Random(int(fraction * 1000)).sample([d.doc_id for d in docs],
                                                                 int(round(fraction * len(docs))))
            t0 = time.perf_counter()
            errs = [0]

            def deleter(part):
                with grpc.insecure_channel(srv.address) as dch:
                    dstub = pb_grpc.SearchServiceStub(dch)
                    for doc_id in part:
                        r = dstub.DeleteDocument(pb.DeleteDocumentRequest(
                            collection=COLL, doc_id=doc_id, version=2), timeout=60)
                        if r.outcome != pb.WriteResponse.APPLIED:
                            errs[0] += 1

            ts = [threading.Thread(target=deleter, args=(victims[i::delete_threads],))
                  for i in range(delete_threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(600)
            delete_s = time.perf_counter() - t0
            lat1, ans1 = dense_latency(stub, pb, qvecs, model_id, reps)
            old_build = srv.core.collections[COLL].desc.build_id
            size_before = dir_sizes(store.build_dir(COLL, old_build))
            gc.collect()
            rss_before = rss_mb()
            with RssSampler() as samp:
                t0 = time.perf_counter()
                cr = admin.Compact(pb.CompactRequest(collection=COLL), timeout=600)
                compact_s = time.perf_counter() - t0
            gc.collect()
            rss_after = rss_mb()
            new_build = cr.build_id
            size_after = dir_sizes(store.build_dir(COLL, new_build))
            size_old_after = dir_sizes(store.build_dir(COLL, old_build))
            data_total = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
            lat2, ans2 = dense_latency(stub, pb, qvecs, model_id, reps)
    finally:
        srv.stop()
        shutil.rmtree(data, ignore_errors=True)
    return {"fraction": fraction, "deleted_docs": len(victims), "delete_errors": errs[0],
            "delete_s": delete_s, "deletes_per_s": len(victims) / delete_s,
            "live_rows_before": cr.live_rows_before, "dead_rows_before": cr.dead_rows_before,
            "rows_after": cr.rows_after, "compact_s": compact_s, "server_seconds": cr.seconds,
            "rss_before": rss_before, "rss_peak": samp.peak, "rss_after": rss_after,
            "size_before": size_before, "size_after": size_after, "size_old_after": size_old_after, "data_dir_after": data_total,
            "dense_p50_pristine": pct(lat0, 50), "dense_p50_before": pct(lat1, 50),
            "dense_p50_after": pct(lat2, 50), "dense_p99_before": pct(lat1, 99),
            "dense_p99_after": pct(lat2, 99), "answers_identical": ans1 == ans2}


# --- main ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("auto", "minilm", "tiny"), default="auto")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="auto picks MiniLM only if its projected total run time fits this")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--factory", default="Flat")
    p.add_argument("--writers", type=int, default=4, help="N upsert threads (a)")
    p.add_argument("--readers", type=int, default=4, help="M hybrid-search threads (a)")
    p.add_argument("--baseline-s", type=float, default=20.0, help="queries alone (a)")
    p.add_argument("--ingest-s", type=float, default=40.0, help="queries + upserts (a)")
    p.add_argument("--max-upserts", type=int, default=5000, help="per writer, a hard bound (a)")
    p.add_argument("--caches", action="store_true",
                   help="(a) with the server's retrieval/embedding caches on (default: off)")
    p.add_argument("--fresh-samples", type=int, default=40, help="(b)")
    p.add_argument("--fresh-writers", type=int, default=2, help="background upsert threads (b)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 0.5], help="(c)")
    p.add_argument("--dense-queries", type=int, default=50, help="(c) query vectors")
    p.add_argument("--dense-reps", type=int, default=3, help="(c) passes over them per measurement")
    p.add_argument("--delete-threads", type=int, default=4, help="(c)")
    p.add_argument("--skip", nargs="*", default=[], choices=("a", "b", "c"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    from index_builder.corpus import read_corpus
    from server.core.chunking import chunk_text, embed_text

    def say(line: str) -> None:
        print(line, flush=True)

    t_all = time.perf_counter()
    mon = CpuMonitor().__enter__()
    docs = list(read_corpus(CRANFIELD))
    queries = [json.loads(l)["text"] for l in open(CRANFIELD / "queries.jsonl") if l.strip()]
    chunk_texts = [embed_text(d.title, c.text) for d in docs for c in chunk_text(d.text)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        embedder, model_desc = choose_model(args.model, workdir, chunk_texts, args.budget_s,
                                           args.baseline_s + args.ingest_s, say)
        say(f"model: {model_desc}; model_id {embedder.model_id}, dim {embedder.dim}")
        say(f"machine: {os.cpu_count()} CPUs, loadavg(1m) {os.getloadavg()[0]:.2f} at start")
        pristine = workdir / "pristine"
        info = build_base(docs, embedder, pristine, args.shards, args.factory)
        say(f"corpus: Cranfield {info['documents']} documents, {info['chunks']} chunks; build "
            f"{info['build_s']:.1f}s ({args.shards} shards, {args.factory}); audit recall "
            f"{info['audit_recall']:.3f}")
        out.update(model=model_desc, build=info)
        live = workdir / "live"
        shutil.copytree(pristine, live)

        if "a" not in args.skip:
            cache_cfg = {} if args.caches else {"retrieval_cache_size": 0, "embedding_cache_size": 0}
            srv = serve(live, embedder, **cache_cfg)
            try:
                a = phase_ingest(srv.address, docs, queries, args.writers, args.readers,
                                 args.baseline_s, args.ingest_s, args.max_upserts, say)
            finally:
                srv.stop()
            out["ingest"] = a
            w = a["written"]
            say(f"\n(a) ingest under query load  [server caches "
                f"{'ON' if args.caches else 'OFF (retrieval_cache_size=0, embedding_cache_size=0)'}]")
            say(f"  {a['writers']} writer threads (UpsertDocument), {a['readers']} reader threads "
                f"(hybrid Search, top_k 10)")
            say(f"  upserts acknowledged: {w['docs']} in {a['ingest_s']:.1f}s = {a['docs_per_s']:.1f} "
                f"docs/s ({a['chunks_per_s']:.1f} chunks/s); {w['inserts']} new, {w['updates']} "
                f"replacements, {w['noop']} no-op, {w['errors']} errors")
            say(f"  upsert latency p50 {a['upsert_p50']:.1f} ms, p99 {a['upsert_p99']:.1f} ms")
            say(f"  {'query phase':<22}{'queries':>8}{'QPS':>8}{'p50 ms':>9}{'p99 ms':>9}")
            say(f"  {'no ingest':<22}{a['q_base_n']:>8}{a['q_base_qps']:>8.1f}{a['q_base_p50']:>9.1f}"
                f"{a['q_base_p99']:>9.1f}")
            say(f"  {'during ingest':<22}{a['q_ing_n']:>8}{a['q_ing_qps']:>8.1f}{a['q_ing_p50']:>9.1f}"
                f"{a['q_ing_p99']:>9.1f}")
            say(f"  query errors: {a['q_errors']}; during ingest: {a['cpu']}")

        if "b" not in args.skip:
            srv = serve(live, embedder)  # the server's default config (caches on)
            try:
                b = phase_freshness(srv.address, docs, args.fresh_samples, args.fresh_writers, say)
            finally:
                srv.stop()
            out["freshness"] = b
            say(f"\n(b) freshness  [server default config, caches on; {b['background_writers']} "
                f"background writers did {b['background_upserts']} upserts meanwhile]")
            say(f"  {b['samples']} sampled upserts; lexical search for each one's unique token, "
                f"polled back to back from the send ({b['polls_mean']:.1f} polls/sample)")
            say(f"  {'':<36}{'p50 ms':>9}{'p99 ms':>9}")
            say(f"  {'send -> acknowledged':<36}{b['ack_p50']:>9.1f}{b['ack_p99']:>9.1f}")
            say(f"  {'send -> first search returning it':<36}{b['visible_p50']:>9.1f}"
                f"{b['visible_p99']:>9.1f}   (max {b['visible_max']:.1f})")
            say(f"  {'read-after-ack search latency':<36}{b['read_after_ack_p50']:>9.1f}")
            say(f"  found by a search SENT before the ack: {b['found_by_search_sent_before_ack']}/"
                f"{b['samples']}; searches sent after the ack that missed it: "
                f"{b['misses_after_ack']}; never found: {b['never_found']}")

        if "c" not in args.skip:
            rng = np.random.default_rng(3)
            qtexts = [queries[i] for i in rng.choice(len(queries), args.dense_queries, replace=False)]
            qvecs = embedder.encode(qtexts)
            say(f"\n(c) compaction  [fresh copy of the build per fraction; retrieval cache off; "
                f"dense search = {args.dense_queries} query vectors x {args.dense_reps} over gRPC]")
            rows = []
            for f in args.fractions:
                gc.collect()
                rows.append(phase_compaction(pristine, workdir, embedder, docs, qvecs, f,
                                             args.dense_reps, args.delete_threads, say))
            out["compaction"] = rows
            say(f"  {'deleted':>8}{'docs':>6}{'del/s':>7}{'dead':>6}{'live':>6}{'compact s':>10}"
                f"{'server s':>9}{'RSS MB before/peak/after':>26}{'disk MB before->after':>24}"
                f"{'dense p50 ms pristine/deleted/compacted':>42}{'same top10':>11}")
            for c in rows:
                rss = f"{c['rss_before']:.0f}/{c['rss_peak']:.0f}/{c['rss_after']:.0f}"
                disk = f"{mb(c['size_before']['total'])}->{mb(c['size_after']['total'])}"
                dl = (f"{c['dense_p50_pristine']:.2f}/{c['dense_p50_before']:.2f}/"
                      f"{c['dense_p50_after']:.2f}")
                say(f"  {100 * c['fraction']:>7.0f}%{c['deleted_docs']:>6}{c['deletes_per_s']:>7.0f}"
                    f"{c['dead_rows_before']:>6}{c['live_rows_before']:>6}{c['compact_s']:>10.2f}"
                    f"{c['server_seconds']:>9.2f}{rss:>26}{disk:>24}{dl:>42}"
                    f"{'yes' if c['answers_identical'] else 'NO':>11}")
            say("  disk by component, MB (before -> after): "
                + "; ".join(f"{100 * c['fraction']:.0f}%: " + ", ".join(
                    f"{k} {mb(c['size_before'][k])}->{mb(c['size_after'][k])}"
                    for k in ("dense", "vectors", "lexical", "sqlite", "sqlite_wal")) for c in rows))
            say("  after compaction the old build stays on disk (MB, its size then / whole data dir): "
                + ", ".join(f"{100 * c['fraction']:.0f}%: {mb(c['size_old_after']['total'])} / "
                            f"{mb(c['data_dir_after'])}" for c in rows))
            say("  dense p99 ms deleted -> compacted: "
                + ", ".join(f"{100 * c['fraction']:.0f}%: {c['dense_p99_before']:.2f}->"
                            f"{c['dense_p99_after']:.2f}" for c in rows))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    mon.__exit__(None, None, None)
    say(f"\ntotal {time.perf_counter() - t_all:.0f}s; {mon.summary()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
