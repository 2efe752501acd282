"""A/B of `search-server serve` flags on one build: the same collection, the same client processes,
the settings alternated round by round (these machines drift; alternation keeps the comparison
fair). For tuning knobs such as --dense-workers, --device-nice or --max-batch on your own host.

    .venv/bin/python bench/ab_server_flags.py --vectors wordnet.npy \\
        --flags "" --flags "--device-nice 0" --rounds 2 --concurrency 16,64

Builds the vectors into a collection (HNSW16,Flat, efSearch --ef-search, no embedding model, the
retrieval cache off: every query reaches the index), then for each round and each flag set
restarts the server with those flags and measures closed-loop QPS and latency at each
concurrency. Prints one row per (round, flags, concurrency) and the mean QPS per flag set.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines as E  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", required=True, help="(N, d) float32 .npy; last --queries rows are queries")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--flags", action="append", default=None,
                    help='one flag set per use, e.g. --flags "" --flags "--dense-workers 2"')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--ef-search", type=int, default=64)
    ap.add_argument("-k", type=int, default=10)
    args = ap.parse_args(argv)
    flag_sets = args.flags or [""]
    conc = [int(c) for c in args.concurrency.split(",")]

    x = np.load(args.vectors, mmap_mode="r")
    xb = np.ascontiguousarray(x[:-args.queries], np.float32)
    xq = np.ascontiguousarray(x[-args.queries:], np.float32)
    engine = E.SearchServiceEngine()
    try:
        print(f"building {len(xb)} x {xb.shape[1]} ...", flush=True)
        engine.build(xb)
        totals: dict[tuple[str, int], list[float]] = {}
        print("| round | flags | concurrency | QPS | p50 ms | p99 ms | server CPU per request ms |")
        print("|---|---|---|---|---|---|---|")
        for r in range(1, args.rounds + 1):
            for flags in flag_sets:
                engine.server_flags = tuple(shlex.split(flags))
                engine.knob = None  # set_knob restarts the server with the flags
                engine.set_knob(args.ef_search)
                for c in conc:
                    m = E.measure(engine, xq, args.k, c, args.seconds)
                    totals.setdefault((flags, c), []).append(m["qps"])
                    print(f"| {r} | `{flags or '(defaults)'}` | {c} | {m['qps']:.0f} | "
                          f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                          f"{m['server_cores'] / m['qps'] * 1e3:.3f} |", flush=True)
        print("\nmean QPS over the rounds:")
        for (flags, c), qps in totals.items():
            print(f"  {flags or '(defaults)':40s} c={c:<4d} {np.mean(qps):7.0f}  "
                  f"({', '.join(f'{q:.0f}' for q in qps)})")
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
