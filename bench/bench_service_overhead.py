"""How much does the gRPC service add on top of the faiss search it wraps? (dense, precomputed vector)

What it measures
----------------
1. Builds a Flat collection of N synthetic documents with the project's own builder
   (index_builder.build.build_collection: chunk -> embed -> faiss + SQLite docstore + tantivy ->
   release.json), recall-audits and publishes it. No text model is loaded: a fake embedder turns
   each text into a deterministic random unit vector seeded by a hash of the text. The vectors are
   meaningless as semantics, but this benchmark measures overhead, not quality.
2. In-process baseline: DenseIndex.search (the LocalShard.dense the server loaded) with one query
   vector per call, k = the dense depth the service will use, at concurrency 1 and C (threads,
   each issuing one-query searches back to back). Per-call latency and QPS.
3. Service: the real server (SearchCore + server.transport.app.start_server, grpc.aio on a
   loopback TCP port, the same wiring as `search-server serve`) runs in this process; a SEPARATE
   client process (this script re-invoked with --client, so the client's Python has its own GIL)
   sends SearchRequest{vector=<precomputed, tagged with the build's model_id>, mode=DENSE,
   top_k=10, dense_depth=D} with a sync gRPC stub from 1 and C threads. Per-request latency
   (client side, so it includes both Python gRPC stacks) and QPS. The request protos are built
   before timing starts.
   By default it runs twice: dense_depth=10 (faiss does exactly the baseline's work, so the
   difference is pure service overhead) and dense_depth=0 (the server's default depth,
   limits.DEFAULT_DEPTH=100 candidates fetched from the docstore, then cut to top_k 10).
4. Prints QPS, p50/p99 latency for each, the service/in-process QPS ratio at concurrency C
   (goal >= 0.7x) and the added p50 latency (goal < 1 ms), plus: CPU time per request of the server
   process and the client process (shows whether the cores are saturated and by whom), the server's
   own stage timings (SearchResponse.timings: faiss+shard "dense", SearchCore "total"), and the
   server process's CPU per request split by thread (event loop / shard executor / gRPC C-core /
   other, which includes OpenMP workers), from /proc.
   The server's whole-result cache (SearchConfig.retrieval_cache_size) is turned off, since the
   client cycles a fixed query set (--retrieval-cache N turns it back on).
   The last line reports how much CPU OTHER processes used during the run: the numbers are only
   meaningful when that is ~0% (this box is shared; rerun when it is not).

Run
---
    .venv/bin/python bench/bench_service_overhead.py                   # 20000 docs, c=1 and 16
    .venv/bin/python bench/bench_service_overhead.py --docs 5000 --seconds 3
    .venv/bin/python bench/bench_service_overhead.py --omp-threads 1    # 1 OpenMP thread per search
    .venv/bin/python bench/bench_service_overhead.py --json bench/results/service_overhead.json

The collection is built in a temporary directory (removed at exit) unless --data-dir is given.
--omp-threads 0 (default) leaves faiss's OpenMP default, which is what `search-server serve` does
today; N > 0 sets it in the baseline threads and in the server's shard executor threads alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from _util import ForeignLoad  # noqa: E402


COLLECTION = "bench"
MODEL_ID = "bench-hash-embedder-384"


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------
def summarize(latencies_s: list[float], wall_s: float, stages: list[dict]) -> dict:
    lat = np.asarray(latencies_s) * 1e3
    out = {"requests": int(lat.size), "qps": lat.size / wall_s, "p50_ms": float(np.percentile(lat, 50)),
           "p99_ms": float(np.percentile(lat, 99)), "mean_ms": float(lat.mean())}
    if stages:  # server-reported stage timings (SearchResponse.timings), p50 per stage
        out["server_stage_p50_ms"] = {k: float(np.median([st.get(k, 0.0) for st in stages]))
                                      for k in stages[0]}
    return out


def run_closed_loop(call, items: list, concurrency: int, seconds: float, warmup: int = 100,
                    initializer=None) -> dict:
    """`concurrency` threads, each calling call(item) back to back over its share of `items`
    (cycled) until `seconds` pass. Returns QPS and latency percentiles. `call` may return a dict
    of server stage timings (ms), summarised as medians."""
    if initializer:
        initializer()
    for it in items[:warmup]:  # callers that time CPU around this call warm up first, warmup=0
        call(it)
    stop_at = [0.0]
    start = threading.Barrier(concurrency + 1)

    def worker(i: int) -> tuple[list[float], list[dict]]:
        if initializer:
            initializer()
        mine = items[i::concurrency] or items
        lat, stages = [], []
        start.wait()
        j = 0
        while True:
            t0 = time.perf_counter()
            st = call(mine[j % len(mine)])
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            if isinstance(st, dict):
                stages.append(st)
            j += 1
            if t1 >= stop_at[0]:
                return lat, stages

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futs = [pool.submit(worker, i) for i in range(concurrency)]
        t_start = time.perf_counter()
        stop_at[0] = t_start + seconds
        start.wait()
        got = [f.result() for f in futs]
        wall = time.perf_counter() - t_start
    return summarize([x for lat, _ in got for x in lat], wall, [x for _, st in got for x in st])


# ----------------------------------------------------------------------------------------------
# client process
# ----------------------------------------------------------------------------------------------
def client_main(args) -> int:
    """Runs in its own process: sync gRPC stub(s), 1 and C threads. Talks to the parent on stdout:
    'MARK <name> start|end' lines (the parent samples its own CPU time there), then 'RESULT <json>'."""
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    cfg = json.loads(args.client)
    queries = np.load(cfg["queries"])
    channels = [grpc.insecure_channel(cfg["address"]) for _ in range(cfg["channels"])]
    for ch in channels:
        grpc.channel_ready_future(ch).result(timeout=30)
    stubs = [pb_grpc.SearchServiceStub(ch) for ch in channels]
    out = {"levels": [], "check": {}}

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def search(item) -> dict:
        resp = item[0].Search(item[1], timeout=30)
        return {t.stage: t.ms for t in resp.timings}

    for depth in cfg["depths"]:
        reqs = [pb.SearchRequest(collection=COLLECTION, top_k=cfg["top_k"], mode=pb.DENSE,
                                 dense_depth=depth,
                                 vector=pb.QueryVector(values=q.tolist(), model_id=cfg["model_id"]))
                for q in queries]
        first = stubs[0].Search(reqs[0], timeout=30)
        out["check"][str(depth)] = [int(h.chunk_id) for h in first.hits]
        for c in cfg["concurrency"]:
            # thread i uses stub i % channels; items carry their stub so the call stays trivial
            items = [(stubs[i % len(stubs)], r) for i, r in enumerate(reqs)]
            name = f"service depth={depth} c={c}"
            for it in items[:cfg["warmup"]]:  # untimed, outside the CPU-time window
                search(it)
            say(f"MARK {name} start")
            t_cpu = os.times()
            res = run_closed_loop(search, items, c, cfg["seconds"], warmup=0)
            t_cpu2 = os.times()
            say(f"MARK {name} end")
            res["client_cpu_s"] = (t_cpu2.user + t_cpu2.system) - (t_cpu.user + t_cpu.system)
            res.update(name=name, depth=depth, concurrency=c)
            out["levels"].append(res)
    for ch in channels:
        ch.close()
    say("RESULT " + json.dumps(out))
    return 0


# ----------------------------------------------------------------------------------------------
# server process (this one): build, baseline, serve
# ----------------------------------------------------------------------------------------------
class HashEmbedder:
    """Stands in for the text model: text -> unit vector seeded by blake2b(text). Deterministic."""

    def __init__(self, dim: int):
        self.model_id = MODEL_ID
        self.revision = "bench"
        self.dim = dim
        self.max_length = 256

    def _one(self, text: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
        return v / np.linalg.norm(v)

    def encode_many(self, texts, batch_size: int = 64, progress=None) -> np.ndarray:
        out = np.empty((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            out[i] = self._one(t)
            if progress and (i + 1) % 1000 == 0:
                progress(1000)
        return out

    def encode(self, texts) -> np.ndarray:
        return self.encode_many(list(texts))

    def count_tokens(self, texts) -> list[int]:
        return [len(t.split()) for t in texts]


def synthetic_docs(n: int, seed: int):
    from index_builder.corpus import Document

    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(5000)]
    for i in range(n):
        words = rng.choice(len(vocab), size=int(rng.integers(20, 60)))
        yield Document(f"doc-{i:07d}", " ".join(vocab[w] for w in words), f"title {i}")


def build(data_dir: Path, n_docs: int, dim: int, seed: int) -> dict:
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    store = CollectionStore(data_dir)
    t0 = time.perf_counter()
    desc = build_collection(synthetic_docs(n_docs, seed), store, COLLECTION, HashEmbedder(dim),
                            "Flat", shards=1, quiet=True)
    audit = audit_build(store, COLLECTION, desc.build_id)
    store.publish(COLLECTION, desc.build_id)
    return {"build_id": desc.build_id, "chunks": desc.chunks, "seconds": time.perf_counter() - t0,
            "audit_recall": audit["recall"]}


LOOP_THREAD_ID = None  # the server's event loop thread (per-thread CPU accounting)


def cpu_now() -> float:
    t = os.times()
    return t.user + t.system


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread group of this process (Linux /proc; {} elsewhere). Groups: the
    asyncio/grpc.aio event loop thread, the shard executor threads, gRPC C-core's own threads,
    everything else (main thread, OpenMP workers, ...)."""
    out: dict[str, float] = {}
    hz = os.sysconf("SC_CLK_TCK")
    loop_tid = LOOP_THREAD_ID
    py = {t.native_id: t.name for t in threading.enumerate()}  # Python names its threads only here
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / hz
        name = py.get(int(tid))
        if int(tid) == loop_tid:
            group = "event loop"
        elif name is not None and name.startswith("shard"):
            group = "shard threads"
        elif name is None and comm not in ("python", "python3") and not comm.startswith("python"):
            group = "grpc core"  # native threads gRPC C-core names (grpc_global_tim, ...)
        else:
            group = "other"  # main thread, OpenMP workers (native but unnamed), ...
        out[group] = out.get(group, 0.0) + cpu
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=20_000, help="synthetic documents (1 chunk each)")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=1000, help="distinct query vectors (cycled)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per level")
    p.add_argument("--warmup", type=int, default=100, help="untimed requests before each level")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--depths", type=int, nargs="+", default=[10, 0],
                   help="dense_depth values sent (0 = server default, 100); the in-process "
                        "baseline searches k = the first one (or top_k when it is 0)")
    p.add_argument("--channels", type=int, default=1, help="gRPC channels in the client process")
    p.add_argument("--omp-threads", type=int, default=0,
                   help="OpenMP threads per faiss call (0 = faiss default, as search-server does)")
    p.add_argument("--shard-threads", type=int, default=8, help="SearchConfig.shard_threads")
    p.add_argument("--retrieval-cache", type=int, default=0,
                   help="SearchConfig.retrieval_cache_size (default 0: off, every request searches)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="build here and keep it (default: a temporary directory, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write results here (bench/results/)")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: client process
    args = p.parse_args(argv)
    if args.client:
        return client_main(args)

    import faiss

    from server.backends.device import Device
    from server.core.search import SearchConfig, SearchCore

    load = ForeignLoad()
    tmp = None
    data_dir = args.data_dir
    if data_dir is None:
        tmp = tempfile.mkdtemp(prefix="bench-service-")
        data_dir = Path(tmp)
    try:
        print(f"{os.cpu_count()} CPUs, faiss {faiss.__version__}, OpenMP threads per search: "
              f"{args.omp_threads or f'default ({faiss.omp_get_max_threads()})'}")
        info = build(data_dir, args.docs, args.dim, args.seed)
        print(f"built Flat collection: {info['chunks']} chunks x {args.dim}-d in "
              f"{info['seconds']:.1f} s (audit recall {info['audit_recall']:.3f}) at {data_dir}")

        extra = {}
        if "retrieval_cache_size" in {f.name for f in dataclasses.fields(SearchConfig)}:
            # the server caches whole results by (query vector, knobs, index version); cycling a
            # fixed query set would measure cache hits, so the cache is off unless asked for
            extra["retrieval_cache_size"] = args.retrieval_cache
        config = SearchConfig(data_dir=data_dir, collections=[COLLECTION],
                              shard_threads=args.shard_threads, **extra)
        core = SearchCore(config, None, None, Device("cpu"))
        if args.omp_threads:
            # OpenMP's thread count is per calling thread, so set it in the shard worker threads
            # the server searches from (before load(): the shards keep the executor they get).
            core.executor.shutdown()
            core.executor = ThreadPoolExecutor(
                max_workers=args.shard_threads, thread_name_prefix="shard",
                initializer=faiss.omp_set_num_threads, initargs=(args.omp_threads,))
        core.load()
        shard = core.collections[COLLECTION].shards[0]
        dense = shard.dense

        rng = np.random.default_rng(args.seed + 1)
        queries = rng.standard_normal((args.queries, args.dim)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        base_k = args.depths[0] or args.top_k

        # --- in-process baseline --------------------------------------------------------------
        init = (lambda: faiss.omp_set_num_threads(args.omp_threads)) if args.omp_threads else None
        results = []
        for c in args.concurrency:
            items = [q[None, :] for q in queries]
            if init:
                init()
            for q in items[:args.warmup]:  # untimed, outside the CPU-time window
                dense.search(q, base_k)
            t_cpu = cpu_now()
            res = run_closed_loop(lambda q: dense.search(q, base_k), items, c, args.seconds,
                                  warmup=0, initializer=init)
            res["server_cpu_s"] = cpu_now() - t_cpu
            res.update(name=f"in-process k={base_k} c={c}", depth=None, concurrency=c)
            results.append(res)
            print(f"  {res['name']}: {res['qps']:.0f} QPS, p50 {res['p50_ms']:.3f} ms", flush=True)
        _, rows = dense.search(queries[:1], args.top_k)
        expected = dense.chunk_ids(rows)[0].tolist()

        # --- the service, driven from a separate client process ---------------------------------
        from server.transport.embedded import ServerThread

        srv = ServerThread(core).start()
        global LOOP_THREAD_ID
        LOOP_THREAD_ID = srv.native_id
        qfile = data_dir / "bench-queries.npy"
        np.save(qfile, queries)
        cfg = {"address": srv.address, "queries": str(qfile), "channels": args.channels,
               "concurrency": args.concurrency, "seconds": args.seconds, "warmup": args.warmup,
               "top_k": args.top_k, "depths": args.depths, "model_id": MODEL_ID}
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client",
                                 json.dumps(cfg)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        marks, tmarks, client_out = {}, {}, None
        for line in proc.stdout:
            if line.startswith("MARK "):
                name, edge = line[5:].strip().rsplit(" ", 1)
                marks[(name, edge)] = cpu_now()
                tmarks[(name, edge)] = thread_cpu()
            elif line.startswith("RESULT "):
                client_out = json.loads(line[7:])
            else:
                print("client: " + line.rstrip())
        rc = proc.wait()
        srv.stop()
        if rc != 0 or client_out is None:
            raise SystemExit(f"client process failed (exit {rc})")
        for res in client_out["levels"]:
            res["server_cpu_s"] = marks[(res["name"], "end")] - marks[(res["name"], "start")]
            t0, t1 = tmarks[(res["name"], "start")], tmarks[(res["name"], "end")]
            res["server_thread_cpu_s"] = {g: t1.get(g, 0.0) - t0.get(g, 0.0) for g in t1}
            results.append(res)
            print(f"  {res['name']}: {res['qps']:.0f} QPS, p50 {res['p50_ms']:.3f} ms", flush=True)
        for depth, got in client_out["check"].items():
            if got != expected:
                print(f"WARNING: service hits (dense_depth={depth}) differ from in-process top "
                      f"{args.top_k}: {got[:3]}... vs {expected[:3]}...")

        report(results, args, base_k, info)
        print(load.report())
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()},
                                             "build": info, "results": results}, indent=2))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(results: list[dict], args, base_k: int, info: dict) -> None:
    print()
    hdr = (f"{'path':<34} {'conc':>4} {'QPS':>7} {'p50 ms':>8} {'p99 ms':>8} {'QPS/in-proc':>11} "
           f"{'+p50 ms':>8} {'srv CPU us/req':>14} {'cli CPU us/req':>14} "
           f"{'srv dense p50':>13} {'srv total p50':>13}")
    print(hdr)
    print("-" * len(hdr))
    base = {r["concurrency"]: r for r in results if r["depth"] is None}
    for r in results:
        b = base[r["concurrency"]]
        label = (f"in-process DenseIndex.search k={base_k}" if r["depth"] is None else
                 f"gRPC Search dense_depth={r['depth'] or '100 (dflt)'}")
        cli = r.get("client_cpu_s")
        st = r.get("server_stage_p50_ms", {})
        print(f"{label:<34} {r['concurrency']:>4} {r['qps']:>7.0f} {r['p50_ms']:>8.3f} "
              f"{r['p99_ms']:>8.3f} {r['qps'] / b['qps']:>10.2f}x {r['p50_ms'] - b['p50_ms']:>8.3f} "
              f"{r['server_cpu_s'] / r['requests'] * 1e6:>14.0f} "
              f"{(cli / r['requests'] * 1e6) if cli is not None else float('nan'):>14.0f} "
              f"{st.get('dense', float('nan')):>13.3f} {st.get('total', float('nan')):>13.3f}")
    groups = ["event loop", "shard threads", "grpc core", "other"]
    if any(r.get("server_thread_cpu_s") for r in results):
        print("\nserver process CPU per request by thread (us/req):")
        print(f"{'path':<34} {'conc':>4} " + " ".join(f"{g:>13}" for g in groups))
        for r in results:
            tc = r.get("server_thread_cpu_s")
            if not tc:
                continue
            print(f"{'gRPC Search dense_depth=' + str(r['depth'] or '100 (dflt)'):<34} "
                  f"{r['concurrency']:>4} "
                  + " ".join(f"{tc.get(g, 0.0) / r['requests'] * 1e6:>13.0f}" for g in groups))
    cmax = max(args.concurrency)
    print()
    for r in results:
        if r["depth"] is None or r["concurrency"] != cmax:
            continue
        b = base[cmax]
        b1 = base.get(1)
        s1 = next((x for x in results if x["depth"] == r["depth"] and x["concurrency"] == 1), None)
        added = (s1["p50_ms"] - b1["p50_ms"]) if (s1 and b1) else float("nan")
        ratio = r["qps"] / b["qps"]
        print(f"dense_depth={r['depth'] or '100 (server default)'}: service/in-process QPS at "
              f"c={cmax} = {ratio:.2f}x (goal >= 0.7x: {'met' if ratio >= 0.7 else 'NOT met'}); "
              f"added p50 at c=1 = {added:.3f} ms (goal < 1 ms: {'met' if added < 1 else 'NOT met'})")
    print(f"\n({info['chunks']} docs x {args.dim}-d, Flat, inner product, top_k {args.top_k}; "
          f"{args.seconds:.0f} s per level after {args.warmup} warm-up requests; client: separate "
          f"process, sync gRPC stub, {args.channels} channel(s), one thread per concurrent request; "
          f"server: grpc.aio in-process with SearchCore, {args.shard_threads} shard threads, "
          f"retrieval cache {args.retrieval_cache or 'off'}; "
          f"CPU us/req = process CPU time (user+sys) during the level / requests; srv dense / srv "
          f"total p50 = medians of the stage timings the server reports in SearchResponse.timings: "
          f"faiss+shard time, and SearchCore time from validation to assembly; p50 minus srv "
          f"total = gRPC transport, both Python stacks and event-loop queueing)")
    limits_note(results, args)


def limits_note(results: list[dict], args) -> None:
    """A short, data-driven note on what bounds the service numbers on this machine."""
    svc = [r for r in results if r["depth"] == args.depths[0]]
    by_c = {r["concurrency"]: r for r in svc}
    base = {r["concurrency"]: r for r in results if r["depth"] is None}
    if not svc or not base:
        return
    ncpu = os.cpu_count() or 1
    cmax = max(by_c)
    lines = []
    r1, b1 = by_c.get(min(by_c)), base.get(min(by_c))
    st = r1.get("server_stage_p50_ms", {})
    if "total" in st and "dense" in st:
        lines.append(
            f"latency at c={r1['concurrency']} (dense_depth={args.depths[0] or 'default'}): p50 "
            f"{r1['p50_ms']:.2f} ms = DenseIndex.search in the shard thread {st['dense']:.2f} ms (in-process alone: "
            f"{b1['p50_ms']:.2f} ms) + SearchCore around it {st['total'] - st['dense']:.2f} ms "
            f"(validation, executor hop, docstore fetch, assembly, metrics) + transport "
            f"{r1['p50_ms'] - st['total']:.2f} ms (protobuf + gRPC in both Python processes, "
            f"loopback TCP, event-loop scheduling).")
    rc = by_c[cmax]
    srv_us = rc["server_cpu_s"] / rc["requests"] * 1e6
    cli_us = rc.get("client_cpu_s", 0.0) / rc["requests"] * 1e6
    base_us = base[cmax]["server_cpu_s"] / base[cmax]["requests"] * 1e6
    cap = ncpu * 1e6 / (srv_us + cli_us)
    lines.append(
        f"CPU at c={cmax}: server {srv_us:.0f} us + client {cli_us:.0f} us per request vs "
        f"{base_us:.0f} us for the bare search; {ncpu} CPUs shared by both processes cap the "
        f"service near {cap:.0f} QPS (measured {rc['qps']:.0f}; busy "
        f"{rc['qps'] * (srv_us + cli_us) / 1e6:.2f} of {ncpu} cores). The remaining gap to full "
        f"use is most likely GIL serialisation inside the server process.")
    tc = rc.get("server_thread_cpu_s") or {}
    if tc.get("event loop"):
        loop_us = tc["event loop"] / rc["requests"] * 1e6
        lines.append(
            f"the grpc.aio event loop thread alone spends {loop_us:.0f} us CPU per request, all "
            f"under the GIL: one thread, so ~{1e6 / loop_us:.0f} QPS is its ceiling on any "
            f"number of cores, and the shard threads' Python (docstore fetch, candidates) "
            f"competes with it for the same GIL.")
    if tc.get("other", 0.0) / rc["requests"] * 1e6 > 0.3 * srv_us:
        lines.append(
            f"'other' threads (OpenMP workers spinning inside faiss calls) use "
            f"{tc['other'] / rc['requests'] * 1e6:.0f} us per request: faiss's default OpenMP "
            f"threading oversubscribes the cores under concurrent single-query load; compare "
            f"--omp-threads 1.")
    print("\nwhat limits this result:")
    for line in lines:
        print("  - " + line)


if __name__ == "__main__":
    sys.exit(main())
