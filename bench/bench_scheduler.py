"""The shard engine's search scheduler in process: closed-loop queries/s, mean batch and device
CPU per query, for several index types and caller counts.

What it measures
  One `LocalShard` (the engine: scheduler + index, server/core/engine/local.py) over a collection
  built from `--vectors` (.npy, rows = vectors; the last 1,000 rows are held out as queries) with
  each `--factory`, configured as the in-process benchmark adapter is (a batch on every core).
  C coroutines on one event loop (C in --concurrency) each await one dense query at a time, as
  the gRPC servicer does, for --seconds; rounds (--rounds) interleave the cells so background
  load hits every cell alike. Reported per cell: queries/s (median round, and every round), the
  mean batch the scheduler formed, and the device threads' CPU per query (thread CPU time inside
  the index call, per query).

  To compare two revisions of the scheduler, run this script in a `git worktree` of each on the
  same --data-dir (the builds are reused) and compare the tables; the host's speed drifts, so
  prefer rounds run back to back.

Run (from the repository root; about 1 minute per factory with the defaults):
    .venv/bin/python bench/bench_scheduler.py --vectors wordnet.npy
    .venv/bin/python bench/bench_scheduler.py --vectors wordnet.npy --factory HNSW16,Flat \\
        --factory IVF1024,Flat --concurrency 16,64 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def open_engine(data: Path, factory: str, xb: np.ndarray):
    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.config import EngineConfig
    from server.core.collection import CollectionStore
    from server.core.engine.local import EnginePools, LocalShard, burst_workers

    store = CollectionStore(data)
    name = "sched-" + "".join(c if c.isalnum() else "-" for c in factory).strip("-").lower()
    found = [store.descriptor(name, b) for b in store.builds(name)]
    found = [d for d in found if d.chunks == len(xb)]
    desc = found[-1] if found else build_collection(
        [Document(str(i), f"row {i}") for i in range(len(xb))], store, name, None, factory,
        quiet=True, vectors=xb, model_id="bench-vectors@1")
    pools = EnginePools.create()
    shard = LocalShard.open(desc, store.build_dir(name, desc.build_id), data / ".state" / name, 0,
                            None, EngineConfig(dense_workers=burst_workers(0, "cpu")), pools)
    return desc, shard, pools


def instrument(shard) -> dict:
    """Count batches, queries and device-thread CPU inside the index call."""
    acc = {"batches": 0, "queries": 0, "cpu": 0.0}
    lock = threading.Lock()
    inner = shard.scheduler.run_group

    def run_group(queries):
        c = time.thread_time()
        out = inner(queries)
        with lock:
            acc["batches"] += 1
            acc["queries"] += len(queries)
            acc["cpu"] += time.thread_time() - c
        return out

    shard.scheduler.run_group = run_group
    return acc


async def closed_loop(shard, desc, xq: np.ndarray, conc: int, seconds: float) -> float:
    from server.core.types import ShardQuery

    done = 0
    end = time.monotonic() + seconds

    async def caller(j: int) -> None:
        nonlocal done
        i = j
        while time.monotonic() < end:
            q = ShardQuery(desc.build_id, "default", xq[i % len(xq)], desc.model_id, "", 10, 0,
                           text_top_n=10)
            await shard.search([q])
            done += 1
            i += conc

    t0 = time.monotonic()
    await asyncio.gather(*(caller(j) for j in range(conc)))
    return done / (time.monotonic() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vectors", required=True, help="(N, d) float32 .npy")
    ap.add_argument("--factory", action="append", help="faiss factory (repeatable); default "
                    "HNSW16,Flat and IVF1024,Flat")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ef-search", type=int, default=48)
    ap.add_argument("--nprobe", type=int, default=16)
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "bench" / "results" / "scheduler-data"))
    args = ap.parse_args(argv)

    x = np.ascontiguousarray(np.load(args.vectors), dtype=np.float32)
    xb, xq = x[:-1000], x[-1000:]
    concs = [int(c) for c in args.concurrency.split(",")]
    factories = args.factory or ["HNSW16,Flat", "IVF1024,Flat"]
    loop = asyncio.new_event_loop()
    engines = {}
    for f in factories:
        desc, shard, pools = open_engine(Path(args.data_dir), f, xb)
        dense = shard.index.dense
        dense.knobs = dataclasses.replace(dense.knobs, ef_search=args.ef_search, nprobe=args.nprobe)
        engines[f] = (desc, shard, pools, instrument(shard))
        loop.run_until_complete(closed_loop(shard, desc, xq, 8, 1.0))  # warm the record cache
    cells = {}
    for r in range(args.rounds):
        for f, (desc, shard, _, acc) in engines.items():
            for c in concs:
                for k in acc:
                    acc[k] = 0
                qps = loop.run_until_complete(closed_loop(shard, desc, xq, c, args.seconds))
                n = max(1, acc["queries"])
                cells.setdefault((f, c), []).append(
                    (qps, acc["queries"] / max(1, acc["batches"]), acc["cpu"] / n * 1e6))
                print(f"  round {r + 1}: {f} c={c}: {qps:,.0f} queries/s", flush=True)
    print("\n| factory | callers | queries/s (median; rounds) | mean batch | device CPU per query (us) |")
    print("|---|---|---|---|---|")
    for (f, c), rows in cells.items():
        med = statistics.median(q for q, _, _ in rows)
        print(f"| {f} | {c} | {med:,.0f} ({' / '.join(f'{q:,.0f}' for q, _, _ in rows)}) | "
              f"{statistics.median(b for _, b, _ in rows):.1f} | "
              f"{statistics.median(u for _, _, u in rows):.0f} |")
    for desc, shard, pools, _ in engines.values():
        loop.run_until_complete(shard.close())
        pools.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
