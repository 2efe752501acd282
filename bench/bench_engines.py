"""Side-by-side vector search: competitors (and, through the same adapters, our service) on the
same vectors, the same queries, the same k, the same machine, in one run.

What it does
------------
1. Loads an (N, d) float32 .npy of vectors (e.g. normalised sentence embeddings). The LAST
   --queries rows (default 1000) are the queries; the rest are indexed, row i with id i.
2. Ground truth: exact inner-product top-k (faiss IndexFlatIP over the indexed rows).
3. For each engine in turn (only one is alive at a time; see bench/engines.py for the adapters):
   - build it (timed; servers are started by the adapter, data under a temp dir, always stopped);
   - sweep its search knob in ascending order (one query per call, serially) and keep the smallest
     value whose recall@k vs exact search reaches --target-recall; the sweep is printed;
   - at that knob, measure QPS and exact p50/p99 latency at each --concurrency level: closed loop,
     single-query requests, --warmup s then --seconds s. Services (pgvector, Chroma) are driven
     from separate client processes (min(c, cpu count) processes sharing c threads, one
     connection per thread); in-process engines (hnswlib, qdrant-edge, faiss) from c threads of
     this process. During each window it records the CPU used by processes OUTSIDE this benchmark's
     process tree (from /proc/stat), and how the benchmark's own CPU split (server / clients /
     this process).
4. Prints the sweeps, a markdown table, the build table, package versions; --json saves all of it,
   --plots DIR draws latency_by_concurrency.png and recall_vs_qps.png (harness/plots.py).

Run
---
    .venv/bin/python bench/bench_engines.py --vectors /path/to/vectors.npy
    .venv/bin/python bench/bench_engines.py --vectors V.npy --engines hnswlib,faiss-hnsw --seconds 5
    .venv/bin/python bench/bench_engines.py --vectors V.npy --json bench/results/engines.json \
        --plots docs/img

Another engine: an Engine subclass in bench/engines.py (kind "in-process", or "service" with a
client_spec() naming a factory whose object has search(q, k) -> ids), added to engines.ENGINES.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import engines as E  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_lat(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{m['p50_ms']:.2f} / {m['p99_ms']:.2f}"


def fmt_qps(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{m['qps']:.0f}"


def rows(report: dict):
    """(row label, engine record, runs by concurrency, recall) for each engine and client variant."""
    for name, rec in report["engines"].items():
        yield name, rec, rec.get("runs", {}), rec.get("recall", float("nan"))
        for v, vrec in rec.get("variants", {}).items():
            yield f"{name} [{v} client]", rec, vrec["runs"], vrec["recall"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", required=True, help="(N, d) float32 .npy; last --queries rows are queries")
    ap.add_argument("--engines", default=",".join(E.ENGINES), help=f"comma list of {','.join(E.ENGINES)}")
    ap.add_argument("--queries", type=int, default=1000, help="held-out query rows (the last ones)")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per cell")
    ap.add_argument("--warmup", type=float, default=2.0, help="warm-up before each window")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--target-recall", type=float, default=0.95)
    ap.add_argument("--knobs", default="", help="override the knob candidates (comma list, ascending)")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="client processes for services (default min(concurrency, cpu count))")
    ap.add_argument("--quiet-wait", type=float, default=15.0,
                    help="before each cell wait up to this many s for other processes to use < "
                         "--quiet-threshold cores (0: don't wait); the other-CPU column is recorded anyway")
    ap.add_argument("--quiet-threshold", type=float, default=0.3)
    ap.add_argument("--json", default="", help="write all results here")
    ap.add_argument("--plots", default="", help="write PNG plots here (latency by concurrency, "
                                                 "recall vs QPS; needs matplotlib)")
    args = ap.parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so the adapters' finally/atexit stop the servers they started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in E.ENGINES]
    if unknown:
        ap.error(f"unknown engines {unknown}; known: {list(E.ENGINES)}")
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    knobs = tuple(int(x) for x in args.knobs.split(",")) if args.knobs else None
    k = args.k

    X = np.load(args.vectors, mmap_mode="r")
    if X.ndim != 2 or len(X) <= args.queries:
        ap.error(f"{args.vectors}: shape {X.shape} is not (N > {args.queries}, d)")
    X = np.ascontiguousarray(X, dtype=np.float32)
    xb, xq = X[:-args.queries], X[-args.queries:]
    norms = np.linalg.norm(X, axis=1)
    log(f"vectors: {args.vectors} shape={X.shape} dtype=float32; indexed {len(xb)}, queries {len(xq)} "
        f"(last rows), k={k}; norms min/mean/max {norms.min():.4f}/{norms.mean():.4f}/{norms.max():.4f}")
    log(f"machine: {platform.platform()}, {E.NCPU} CPUs, python {platform.python_version()}")

    t = time.perf_counter()
    gt = E.exact_topk(xb, xq, k)
    log(f"exact top-{k} (faiss IndexFlatIP) in {time.perf_counter() - t:.1f}s")

    report = {"vectors": os.path.abspath(args.vectors), "shape": list(X.shape), "n_indexed": len(xb),
              "n_queries": len(xq), "k": k, "seconds": args.seconds, "warmup": args.warmup,
              "concurrency": concs, "target_recall": args.target_recall, "cpus": E.NCPU,
              "platform": platform.platform(), "python": platform.python_version(),
              "versions": {"numpy": E.pkg_version("numpy"), "faiss-cpu": E.pkg_version("faiss-cpu")},
              "engines": {}}
    t_run = time.perf_counter()
    for name in names:
        log(f"\n=== {name} ===")
        rec: dict = {"name": name}
        report["engines"][name] = rec
        eng = None
        try:
            eng = E.ENGINES[name]()
            rec["describe"] = eng.describe()
            rec["kind"] = eng.kind
            log(f"  {eng.describe()} ({eng.kind})")
            eng.build(xb)
            rec["build"] = eng.build_info
            rec["versions"] = eng.versions
            log(f"  build: {eng.build_info.get('build_s', float('nan')):.1f}s  "
                + ", ".join(f"{a}={b}" for a, b in eng.build_info.items() if a not in ("build_s", "plan")))
            knob, r, sweep = E.sweep_knob(eng, xq, gt, k, args.target_recall, knobs, log=log)
            rec.update({"knob_name": eng.knob_name, "knob": knob, "recall": r, "sweep": sweep})
            if r < args.target_recall:
                log(f"  WARNING: {name} did not reach recall {args.target_recall} (best {r:.4f} at {knob})")
            variants = eng.client_variants() if eng.kind == "service" else [""]
            for variant in variants:
                runs: dict = {}
                if variant:
                    # the alternative client must return the same results
                    vr = E.recall_at_k(E.run_queries(eng, xq, k, variant), gt, k)
                    rec.setdefault("variants", {})[variant] = {"recall": vr, "runs": runs}
                    log(f"  client variant '{variant}': recall@{k}={vr:.4f} at {eng.knob_name}={knob}")
                else:
                    rec["runs"] = runs
                for c in concs:
                    m = E.measure(eng, xq, k, c, args.seconds, warmup=args.warmup,
                                  client_procs=args.client_procs or None,
                                  quiet_threshold=args.quiet_threshold, quiet_max_wait=args.quiet_wait,
                                  variant=variant)
                    runs[str(c)] = m
                    extra = ""
                    if "client_cpu_s_per_req" in m:
                        extra = f", client CPU {m['client_cpu_s_per_req'] * 1e6:.0f} us/req"
                    tag = f"[{variant}] " if variant else ""
                    log(f"  {tag}c={c:<3} QPS {m['qps']:8.1f}  p50 {m['p50_ms']:7.2f} ms  p99 {m['p99_ms']:7.2f} ms  "
                        f"n={m['n']}  cores: server {m['server_cores']:.2f} client {m['client_cores']:.2f} "
                        f"bench {m['bench_cores']:.2f} OTHER {m['other_cpu']:.2f} (steal {m['steal_cores']:.2f}){extra}")
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
            log(f"  FAILED: {rec['error']}")
            traceback.print_exc()
        finally:
            if eng is not None:
                eng.close()
        if eng is not None and "versions" not in rec:
            rec["versions"] = eng.versions
    report["total_s"] = time.perf_counter() - t_run

    # ---- tables ----
    lines = []
    lines.append(f"\nTop-{k} inner product, {len(xb)} indexed x {X.shape[1]}-d, {len(xq)} held-out queries, "
                 f"target recall@{k} >= {args.target_recall}; {args.seconds:g}s window after {args.warmup:g}s "
                 f"warm-up; latency p50 / p99 in ms; other CPU = cores used by processes outside this "
                 f"benchmark during each window (c={'/'.join(map(str, concs))}); {E.NCPU} CPUs.\n")
    head = ["engine", "knob", f"recall@{k}"]
    for c in concs:
        head += [f"QPS c={c}", f"p50/p99 c={c}"]
    head += ["other CPU (cores)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] * len(head)) + "|")
    for name, rec, runs, recall in rows(report):
        if "error" in rec and not runs:
            lines.append(f"| {name} | failed: {rec['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        row = [name, f"{rec.get('knob_name', '')}={rec.get('knob')}", f"{recall:.4f}"]
        for c in concs:
            m = runs.get(str(c))
            row += [fmt_qps(m), fmt_lat(m)]
        row.append("/".join(f"{runs[str(c)]['other_cpu']:.2f}" if str(c) in runs else "-" for c in concs))
        lines.append("| " + " | ".join(row) + " |")

    lines.append("\nBuild and CPU split (cores during the window at the highest concurrency: "
                 "server / client processes / benchmark process):\n")
    lines.append("| engine | what | build s | build detail | client CPU us/req (c=" + "/".join(map(str, concs)) +
                 f") | cores at c={concs[-1]} srv/cli/bench |")
    lines.append("|---|---|---|---|---|---|")
    for name, rec, runs, _ in rows(report):
        b = rec.get("build", {})
        detail = ", ".join(f"{a} {b[a]:.1f}s" for a in ("load_s", "index_s", "add_s", "insert_s", "optimize_s")
                           if isinstance(b.get(a), float))
        cli = "/".join(f"{runs[str(c)]['client_cpu_s_per_req'] * 1e6:.0f}" if str(c) in runs and
                       "client_cpu_s_per_req" in runs[str(c)] else "-" for c in concs)
        last = runs.get(str(concs[-1]))
        split = (f"{last['server_cores']:.2f}/{last['client_cores']:.2f}/{last['bench_cores']:.2f}"
                 if last else "-")
        bs = f"{b['build_s']:.1f}" if "build_s" in b else "-"
        lines.append(f"| {name} | {rec.get('describe', '')} | {bs} | {detail} | {cli} | {split} |")

    vers = dict(report["versions"])
    for rec in report["engines"].values():
        vers.update(rec.get("versions", {}))
    report["versions"] = vers
    lines.append("\nVersions: " + ", ".join(f"{a} {b}" for a, b in sorted(vers.items())))
    lines.append(f"Total run time {report['total_s']:.0f}s.")
    table = "\n".join(lines)
    report["table"] = table
    print(table, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.json}")
    if args.plots:
        from harness.plots import latency_by_concurrency, recall_vs_qps

        for png in latency_by_concurrency(report, args.plots) + recall_vs_qps(report, args.plots):
            log(f"wrote {png}")
    return 0 if all("error" not in r for r in report["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
