"""Model threads when cores are short: the packaged MiniLM's query latency and passage throughput,
on an idle host and beside CPU-bound neighbours, for each OpenMP threads policy.

    .venv/bin/python bench/bench_cpu_threads.py [--seconds 6] [--neighbours 0,2] [--rounds 2]
    .venv/bin/python bench/bench_cpu_threads.py --server [--seconds 8] [--neighbours 0,2]

Why: torch runs a forward's operators on an OpenMP thread team (libgomp). A thread that reaches
a barrier first spins, by default 300,000 turns, before it sleeps; when another process holds the
core its team-mate needs, the spinning thread burns the time slice that team-mate was waiting
for. Text upserts through `serve --workers 2` (two front ends, each with a model) ran at 7.3/s
against 21.4/s for `serve`, whose embedding took the same time per passage.

What it measures, each policy in its own process (libgomp reads its settings when it loads):
- `query p50/p99 ms`: one short text at a time (a query's embedding: batch 1), closed loop;
- `passages/s`: batches of 8 Cranfield passages (a write group's embedding), closed loop;
with N busy-loop neighbour processes (pure Python, one core each) running during the cell.
Policies: `default` (libgomp's own: 300,000 spin turns), `passive` (OMP_WAIT_POLICY=PASSIVE:
sleep at once), `spin 1k` and `spin 10k` (GOMP_SPINCOUNT: spin that many turns, then sleep),
`1 thread` (OMP_NUM_THREADS=1), and `server` (what `search-server` and `index-builder` set:
server/backends/threads.py, spin 10k). Rounds alternate the policies, so background
load hits each alike; the table shows the median over rounds.

`--server`: the same question through `search-server` on a collection of 200 Cranfield documents:
text upserts/s (`--writers` clients, one connection each, for half of --seconds; the server
embeds each passage) and the p50/p99 of single hybrid text queries (one client: the query's
embedding, search and fusion) for `serve` and `serve --workers 2`, each as the server now starts
(`now`: OpenMP threads spin briefly, front ends split the cores) and as before (`before`:
GOMP_SPINCOUNT=300000, libgomp's own spin, and OMP_NUM_THREADS = every core in every process).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.data import CRANFIELD  # noqa: E402
from harness.measure import OtherCpu, pct  # noqa: E402

POLICIES = {  # the environment each policy's process starts with
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 1k": {"GOMP_SPINCOUNT": "1000"},
    "spin 10k": {"GOMP_SPINCOUNT": "10000"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "server": {},  # limit_openmp_spinning() in the process, as the entry points call it
}
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def _env(extra: dict) -> dict:
    """This environment without OpenMP settings of its own, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_SETTINGS}
    env.update(extra)
    return env


@contextmanager
def _neighbours(n: int):
    """`n` busy-loop processes for the block's duration."""
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in spinners:
            p.join(5)


def worker(policy: str, seconds: float) -> None:
    """Runs in a fresh interpreter (the policy's environment set before torch loads)."""
    if policy == "server":  # what search-server and index-builder do
        from server.backends.threads import limit_openmp_spinning

        limit_openmp_spinning()
    import torch

    from server.backends.models import Embedder

    emb = Embedder()  # sets torch's threads: OMP_NUM_THREADS if given, else the usable cores
    passages = []
    with open(CRANFIELD / "corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            if d.get("text"):
                passages.append(f"{d.get('title', '')} {d['text']}")
            if len(passages) == 400:
                break
    queries = ["boundary layer transition", "supersonic flow over a wedge", "heat transfer",
               "shock wave interaction", "wing flutter at high speed"]
    emb.encode(queries[:1])
    emb.encode(passages[:8])  # warm: the first calls allocate
    lat, end, i = [], time.perf_counter() + seconds / 2, 0
    while time.perf_counter() < end:
        t = time.perf_counter()
        emb.encode([queries[i % len(queries)]])
        lat.append((time.perf_counter() - t) * 1e3)
        i += 1
    n, t0, j = 0, time.perf_counter(), 0
    end = t0 + seconds / 2
    while time.perf_counter() < end:
        emb.encode(passages[j:j + 8])
        j = (j + 8) % (len(passages) - 8)
        n += 8
    print(json.dumps({"threads": torch.get_num_threads(), "p50": pct(lat, 50), "p99": pct(lat, 99),
                      "passages_s": n / (time.perf_counter() - t0)}), flush=True)


def _spin(stop) -> None:
    while not stop.is_set():
        for _ in range(10000):
            pass


def cell(policy: str, neighbours: int, seconds: float) -> dict:
    with _neighbours(neighbours):
        t0, c0 = time.perf_counter(), os.times()
        with OtherCpu() as other:
            out = subprocess.run([sys.executable, __file__, "--worker", policy, "--seconds",
                                  str(seconds)], env=_env(POLICIES[policy]), cwd=REPO,
                                 capture_output=True, text=True, check=True)
        c1, wall = os.times(), time.perf_counter() - t0
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # the worker had ended by the time OtherCpu looked at this process's tree: its CPU (a
    # waited-for child's) is taken out here
    worker = (c1.children_user + c1.children_system - c0.children_user - c0.children_system) / wall
    r["other_cpu"] = None if other.cores is None else max(0.0, other.cores - worker)
    return r


def _server_cell(data_src: Path, flags: list, env_extra: dict, seconds: float, writers: int,
                 docs: list, neighbours: int) -> dict:
    import asyncio
    import shutil
    import tempfile

    import grpc

    from harness.processes import ServiceProcess
    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    tmp = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    shutil.copytree(data_src, tmp / "data")
    server = ServiceProcess(["serve", "--data-dir", str(tmp / "data"), "--port", "0",
                             "--metrics-port", "0", "--retrieval-cache-size", "0", *flags],
                            "serve", env=_env(env_extra))
    queries = ["boundary layer transition", "supersonic flow over a wedge", "heat transfer to a "
               "cylinder", "shock wave interaction", "wing flutter at high speed"]
    try:
        with _neighbours(neighbours), OtherCpu() as other:
            lat, acks, nxt = [], [], iter(range(len(docs)))

            async def write(stub, end):
                for i in nxt:
                    if time.perf_counter() > end:
                        return
                    d = docs[i]
                    await stub.UpsertDocument(pb.UpsertDocumentRequest(
                        collection="t", doc_id=f"w{i}", version=1, title=d["title"],
                        text=d["text"]), timeout=120)
                    acks.append(i)

            async def run():
                chans = [grpc.aio.insecure_channel(server.address, options=[
                    ("grpc.use_local_subchannel_pool", 1)]) for _ in range(writers)]
                stubs = [pb_grpc.SearchServiceStub(c) for c in chans]
                for q in queries:  # warm every front end's model and the index
                    await stubs[0].Search(pb.SearchRequest(collection="t", text=q, top_k=10), timeout=120)
                end = time.perf_counter() + seconds / 2
                i = 0
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    await stubs[i % writers].Search(pb.SearchRequest(
                        collection="t", text=queries[i % len(queries)], top_k=10), timeout=60)
                    lat.append((time.perf_counter() - t) * 1e3)
                    i += 1
                t0 = time.perf_counter()
                await asyncio.gather(*(write(s, t0 + seconds / 2) for s in stubs))
                rate = len(acks) / (time.perf_counter() - t0)
                for c in chans:
                    await c.close()
                return rate

            rate = asyncio.run(run())
    finally:
        server.stop(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"p50": pct(lat, 50), "p99": pct(lat, 99), "upserts_s": rate, "other_cpu": other.cores}


def server_main(args) -> None:
    import tempfile

    from index_builder.build import build_collection
    from index_builder.corpus import read_corpus
    from server.backends.models import Embedder
    from server.core.collection import CollectionStore

    docs = [d for d in read_corpus(CRANFIELD) if d.text.strip()]
    base, writes = docs[:200], [{"title": d.title, "text": d.text} for d in docs[200:1200]]
    data = Path(tempfile.mkdtemp(prefix="bench-threads-src-")) / "data"
    store = CollectionStore(data)
    desc = build_collection(base, store, "t", Embedder(), "Flat", quiet=True)
    store.publish("t", desc.build_id, require_audit=False)
    configs = {"now": {}, "before": {"GOMP_SPINCOUNT": "300000",
                                     "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}}
    servers = {"serve": [], "serve --workers 2": ["--workers", "2"]}
    neighbours = [int(x) for x in args.neighbours.split(",")]
    results: dict = {}
    for r in range(args.rounds):
        for n in neighbours:
            for sname, flags in servers.items():
                for cname, env in configs.items():
                    res = _server_cell(data, flags, env, args.seconds, args.writers, writes, n)
                    results.setdefault((sname, cname, n), []).append(res)
                    print(f"round {r + 1}: {sname} {cname} neighbours={n}: {res}", file=sys.stderr,
                          flush=True)
    print(f"\ncores: {len(os.sched_getaffinity(0))}; median of {args.rounds} rounds; "
          f"{args.writers} writers\n")
    _table(["server", "threads"], "hybrid query", "text upserts/s", "upserts_s",
           {(sname, cname, n): results[(sname, cname, n)]
            for n in neighbours for sname in servers for cname in configs})


def _table(labels: list, latency: str, rate: str, rate_key: str, cells: dict) -> None:
    """One markdown row per cell (its labels, then the neighbour count): medians over rounds."""
    print(f"| {' | '.join(labels)} | neighbours | {latency} p50 / p99 ms | {rate} | other cpu |")
    print("|---" * (len(labels) + 4) + "|")
    for (*names, n), rs in cells.items():
        med = {k: statistics.median(x[k] or 0.0 for x in rs) for k in ("p50", "p99", rate_key, "other_cpu")}
        print(f"| {' | '.join(map(str, names))} | {n} | {med['p50']:.2f} / {med['p99']:.2f} | "
              f"{med[rate_key]:.1f} | {med['other_cpu']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="per cell: half latency, half throughput")
    ap.add_argument("--neighbours", default="0,2", help="busy processes beside the model, per cell")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--server", action="store_true", help="through search-server (see above)")
    ap.add_argument("--writers", type=int, default=6, help="--server: concurrent writers")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.seconds)
        return
    if args.server:
        server_main(args)
        return
    policies = args.policies.split(",")
    neighbours = [int(x) for x in args.neighbours.split(",")]
    results: dict = {}
    for r in range(args.rounds):
        for n in neighbours:
            for p in policies:
                res = cell(p, n, args.seconds)
                results.setdefault((p, n), []).append(res)
                print(f"round {r + 1}: {p:9s} neighbours={n}: {res}", file=sys.stderr, flush=True)
    print(f"\ncores: {len(os.sched_getaffinity(0))}; median of {args.rounds} rounds; 'other cpu' is "
          f"processes outside this benchmark's (its neighbours are its own)\n")
    _table(["policy", "torch threads"], "query", "passages/s", "passages_s",
           {(p, results[(p, n)][0]["threads"], n): results[(p, n)]
            for n in neighbours for p in policies})


if __name__ == "__main__":
    main()
