"""Write throughput and freshness: the embedded default against replicated writes through a router
(NATS JetStream, 2 shards x 2 replicas), on the same documents, in one run.

    .venv/bin/python bench/bench_writes.py [--docs 1500] [--writers 1,16,64] [--base 400]

What it measures
- acknowledged writes/s for each count of concurrent writers in --writers (each an UpsertDocument
  carrying its chunk's own vector, so the write path is measured, not the embedding model);
- embedded default, text: --text-docs documents sent as text, which the server embeds with the
  packaged MiniLM (16 writers), then the same requests re-sent unchanged (a sync job's second
  pass: every one NOOP_STALE_VERSION, answered without embedding);
- embedded default: acknowledged = durable and searchable, so freshness is 0 by construction;
  group commits: concurrent writes share one BM25 commit and one SQLite transaction (the group
  sizes come from search_write_group_size);
- replicated: acknowledged = held by the log; "applied" = the time every replica of the write's
  shard reports (ShardInfo) an applied sequence at or above the write's; freshness = applied - ack,
  p50/p99; applied writes/s = writes / time until the last one is applied everywhere;
- query latency p50/p99 (lexical queries from 2 threads, closed loop) while writes stream, and on
  the idle server, same run.
Prints one markdown table; --json saves it.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.data import CRANFIELD, clustered  # noqa: E402
from harness.measure import OtherCpu, pct  # noqa: E402
from harness.processes import NatsServer, ServiceProcess  # noqa: E402

MODEL = "bench-writes@1"
TOKEN = "bench-writes-router-credential-0001"


def corpus(n: int):
    from index_builder.corpus import read_corpus

    docs = []
    for d in read_corpus(CRANFIELD):
        if not (d.text or d.title).strip():
            continue  # two Cranfield documents are empty: the server refuses them (INVALID_ARGUMENT)
        docs.append(d)
        if len(docs) == n:
            break
    return docs


def build(data: Path, base_docs, dim: int):
    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    store = CollectionStore(data)
    x = clustered(len(base_docs), dim, seed=1)
    docs = [Document(f"base-{d.doc_id}", d.text, d.title) for d in base_docs]
    desc = build_collection(docs, store, "w", None, "Flat", shards=2, quiet=True, vectors=x,
                            model_id=MODEL)
    store.publish("w", desc.build_id, require_audit=False)
    # "t": a small build of the packaged MiniLM's, for the writes the server embeds itself
    from server.backends.models import Embedder

    desc = build_collection(docs[:20], store, "t", Embedder(), "Flat", shards=2, quiet=True)
    store.publish("t", desc.build_id, require_audit=False)


def write_requests(docs, dim, prefix):
    from server.client import f32_bytes
    from server.rpc import search_pb2 as pb

    v = clustered(len(docs), dim, seed=2)
    return [pb.UpsertDocumentRequest(collection="w", doc_id=f"{prefix}{i}", version=1, title=d.title,
                                     vector_model_id=MODEL,
                                     chunks=[pb.ChunkInput(text=d.text or d.title,
                                                           vector_f32=f32_bytes(v[i]))])
            for i, d in enumerate(docs)]


def stream(address, requests, writers):
    """Send the requests with `writers` calls in flight (one asyncio loop, grpc.aio: a thread per
    writer in this process would make the client, not the server, the limit on 2 cores); returns
    (start time, elapsed s, acks [(request index, seq, ack time, outcome)], errors by status
    code)."""
    import asyncio

    import grpc

    from server.rpc import search_pb2_grpc as pb_grpc

    acks, errors = [], []
    nxt = iter(range(len(requests)))

    async def run(stub):
        for i in nxt:
            try:
                r = await stub.UpsertDocument(requests[i], timeout=60)
                acks.append((i, r.sequence, time.perf_counter(), r.outcome))
            except grpc.RpcError as err:
                errors.append(err.code().name)

    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            await asyncio.gather(*(run(stub) for _ in range(writers)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return t0, time.perf_counter() - t0, acks, errors


def query_latency(address, seconds, stop_event=None):
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    lat = []
    end = time.perf_counter() + seconds
    words = ["boundary layer", "supersonic flow", "heat transfer", "shock wave", "wing flutter"]

    def run(j):
        ch = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        stub = pb_grpc.SearchServiceStub(ch)
        n = j
        while time.perf_counter() < end and not (stop_event and stop_event.is_set()):
            t0 = time.perf_counter()
            stub.Search(pb.SearchRequest(collection="w", text=words[n % 5], top_k=10,
                                         mode=pb.LEXICAL), timeout=30)
            lat.append((time.perf_counter() - t0) * 1e3)
            n += 1
        ch.close()

    ts = [threading.Thread(target=run, args=(j,)) for j in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat


def group_totals(metrics_port: int) -> tuple[float, float]:
    """(writes, group commits) so far, from the server's search_write_group_size histogram."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    total = sum(float(x) for x in re.findall(r'search_write_group_size_sum\{[^}]*\} ([0-9.e+]+)', text))
    count = sum(float(x) for x in re.findall(r'search_write_group_size_count\{[^}]*\} ([0-9.e+]+)', text))
    return total, count


def embedded(data, docs, args, rows):
    from harness.processes import free_port

    metrics = free_port()
    srv = ServiceProcess(["serve", "--data-dir", str(data), "--port", "0", "--device", "cpu",
                          "--log-level", "WARNING", "--metrics-port", str(metrics),
                          "--alias-poll-s", "0", "--state-dir", str(data / ".state-embedded")],
                         "serve")
    try:
        idle = query_latency(srv.address, 5)
        for writers in args.writers:
            prefix = f"e{writers}-"
            reqs = write_requests(docs, args.dim, prefix)
            busy = []
            stop = threading.Event()
            qt = threading.Thread(target=lambda: busy.extend(query_latency(srv.address, 3600, stop)))
            qt.start()
            g0 = group_totals(metrics)
            with OtherCpu() as cpu:
                _, elapsed, acks, errors = stream(srv.address, reqs, writers)
            g1 = group_totals(metrics)
            stop.set()
            qt.join()
            rows.append(embedded_row("embedded default", writers, elapsed, acks, errors, idle,
                                     busy, g0, g1, cpu))
        # text the server embeds, then the same requests again: each re-sent one is a no-op
        # answered before its chunks are embedded
        reqs = text_requests(docs[:args.text_docs])
        for path in ("embedded default, text", "embedded default, text re-sent unchanged"):
            g0 = group_totals(metrics)
            with OtherCpu() as cpu:
                _, elapsed, acks, errors = stream(srv.address, reqs, 16)
            rows.append(embedded_row(path, 16, elapsed, acks, errors, idle, [], g0,
                                     group_totals(metrics), cpu))
    finally:
        srv.stop()


def text_requests(docs):
    from server.rpc import search_pb2 as pb

    return [pb.UpsertDocumentRequest(collection="t", doc_id=f"t-{i}", version=1, title=d.title,
                                     text=d.text or d.title) for i, d in enumerate(docs)]


def embedded_row(path, writers, elapsed, acks, errors, idle, busy, g0, g1, cpu) -> dict:
    from server.rpc import search_pb2 as pb

    noops = sum(1 for *_, outcome in acks if outcome == pb.WriteResponse.NOOP_STALE_VERSION)
    applied = (len(acks) - noops) / elapsed  # a no-op is acknowledged, not applied
    row = {"path": path, "writers": writers, "writes": len(acks), "errors": len(errors),
           "noops": noops, "acked_per_s": len(acks) / elapsed, "applied_per_s": applied,
           "per_shard_per_s": applied / 2, "fresh_p50_ms": 0.0, "fresh_p99_ms": 0.0,
           "query_p50_idle": pct(idle, 50), "query_p99_idle": pct(idle, 99),
           "query_p50_ingest": pct(busy, 50) if busy else float("nan"),
           "query_p99_ingest": pct(busy, 99) if busy else float("nan"),
           "mean_group": (g1[0] - g0[0]) / max(1.0, g1[1] - g0[1]), "other_cpu": cpu.cores}
    print(row, flush=True)
    return row


def replicated(data, docs, args, rows, tmp: Path):
    import grpc

    from server.core.chunking import shard_of
    from server.rpc import shard_pb2 as spb
    from server.rpc import shard_pb2_grpc as spb_grpc

    (tmp / "token").write_text(TOKEN)
    nats = NatsServer(tmp / "nats").start()
    procs = []
    try:
        reps = [[ServiceProcess(["shard", "--data-dir", str(data), "--collection", "w", "--shard", str(s),
                                 "--port", "0", "--device", "cpu", "--log-level", "WARNING",
                                 "--nats", nats.url, "--replica-id", f"bw-{s}-{r}",
                                 "--shard-token-file", str(tmp / "token"), "--alias-poll-s", "0"],
                                f"replica {s}/{r}") for r in range(2)] for s in range(2)]
        procs.extend(p for rs in reps for p in rs)
        router = ServiceProcess(["router", "--collection", "w", "--port", "0", "--device", "cpu",
                                 "--log-level", "WARNING", "--nats", nats.url, "--embedder", "none",
                                 "--shard-token-file", str(tmp / "token"),
                                 *[x for rs in reps for x in ("--replicas", ",".join(p.address for p in rs))]],
                                "router")
        procs.append(router)
        md = (("authorization", f"Bearer {TOKEN}"),)
        stubs = [[spb_grpc.ShardServiceStub(grpc.insecure_channel(p.address)) for p in rs] for rs in reps]
        idle = query_latency(router.address, 5)
        for writers in args.writers:
            prefix = f"r{writers}-"
            reqs = write_requests(docs, args.dim, prefix)
            applied_at = {}
            done = threading.Event()

            def monitor():
                while not done.is_set():
                    now = time.perf_counter()
                    for s, shard_stubs in enumerate(stubs):
                        seq = min(st.ShardInfo(spb.ShardInfoRequest(), metadata=md, timeout=10).applied_seq
                                  for st in shard_stubs)
                        applied_at.setdefault(s, []).append((now, seq))
                    time.sleep(0.005)

            mt = threading.Thread(target=monitor)
            mt.start()
            busy = []
            stop = threading.Event()
            qt = threading.Thread(target=lambda: busy.extend(query_latency(router.address, 3600, stop)))
            qt.start()
            with OtherCpu() as cpu:
                t0, elapsed, acks, errors = stream(router.address, reqs, writers)
                last = {s: last_of(acks, reqs, s) for s in (0, 1)}
                t_end = time.perf_counter() + 120
                while time.perf_counter() < t_end and not all(
                        applied_at.get(s) and applied_at[s][-1][1] >= last[s] for s in (0, 1)):
                    time.sleep(0.01)
            stop.set()
            qt.join()
            done.set()
            mt.join()
            fresh = []
            for i, seq, t_ack, _ in acks:
                s = shard_of("default", reqs[i].doc_id, 2)
                t_vis = next((t for t, a in applied_at[s] if a >= seq), None)
                if t_vis is not None:
                    fresh.append(max(0.0, (t_vis - t_ack) * 1e3))
            t_all = max(next(t for t, a in applied_at[s] if a >= last[s]) for s in (0, 1))
            applied_s = max(t_all - t0, elapsed)
            rows.append({"path": "router + NATS, 2 shards x 2 replicas", "writers": writers,
                         "writes": len(acks), "errors": len(errors), "acked_per_s": len(acks) / elapsed,
                         "applied_per_s": len(acks) / applied_s,
                         "per_shard_per_s": len(acks) / applied_s / 2,
                         "fresh_p50_ms": pct(fresh, 50), "fresh_p99_ms": pct(fresh, 99),
                         "query_p50_idle": pct(idle, 50), "query_p99_idle": pct(idle, 99),
                         "query_p50_ingest": pct(busy, 50), "query_p99_ingest": pct(busy, 99),
                         "mean_group": float("nan"), "other_cpu": cpu.cores})
            print(rows[-1], flush=True)
    finally:
        for p in procs:
            p.stop()
        nats.stop()


def last_of(acks, reqs, shard):
    from server.core.chunking import shard_of

    seqs = [seq for i, seq, *_ in acks if shard_of("default", reqs[i].doc_id, 2) == shard]
    return max(seqs) if seqs else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=1500, help="documents written per run")
    ap.add_argument("--base", type=int, default=400, help="documents in the base build")
    ap.add_argument("--writers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16, 64],
                    help="comma list of writer counts (calls in flight), one run each")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--text-docs", type=int, default=200,
                    help="documents the embedded server embeds itself, then receives again unchanged")
    ap.add_argument("--no-replicated", action="store_true",
                    help="the embedded default only (no NATS, no router)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    docs = corpus(args.base + args.docs)
    base, writes = docs[:args.base], docs[args.base:]
    tmp = Path(tempfile.mkdtemp(prefix="bench-writes-"))
    build(tmp / "data", base, args.dim)
    rows: list[dict] = []
    embedded(tmp / "data", writes, args, rows)
    if not args.no_replicated:
        replicated(tmp / "data", writes, args, rows, tmp)
    print(f"\n{len(writes)} single-chunk documents per run, each with its own {args.dim}-d vector; "
          f"base build {len(base)} documents, 2 shards; the text rows: {args.text_docs} "
          f"documents the server embeds (packaged MiniLM), then the same requests again; 2 CPUs\n")
    print("| path | writers | acked/s (no-ops) | applied on every replica /s | per shard /s | "
          "freshness p50 / p99 ms | mean group commit | query p50 / p99 ms idle | during ingest "
          "| other CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        noops = f" ({r['noops']})" if r.get("noops") else ""
        print(f"| {r['path']} | {r['writers']} | {r['acked_per_s']:.0f}{noops} | {r['applied_per_s']:.0f} | "
              f"{r['per_shard_per_s']:.0f} | {r['fresh_p50_ms']:.1f} / {r['fresh_p99_ms']:.1f} | "
              f"{r['mean_group']:.1f} | {r['query_p50_idle']:.1f} / {r['query_p99_idle']:.1f} | "
              f"{r['query_p50_ingest']:.1f} / {r['query_p99_ingest']:.1f} | "
              f"{(r['other_cpu'] or 0):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
