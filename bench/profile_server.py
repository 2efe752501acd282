"""Where the server's CPU goes per request: a py-spy profile of `search-server serve` under load.

Builds a collection from precomputed vectors (the same adapter as bench_engines.py's
`search-service`), drives it with --concurrency closed-loop clients in their own processes, and
while they run samples the server with py-spy (`py-spy record --format raw`, every thread,
native frames off unless --native; without --native py-spy reads the server without stopping
it, `--nonblocking`, since stopping it ~250 times a second cost ~40% of its throughput). Prints:
- QPS, and the server's CPU per request from /proc (all threads, all time, faiss included);
- the share of the server's busy samples inside faiss's search (IndexHNSW.search, IndexIVF...,
  IndexFlat..., knn on a GPU) against everything else, and from the two the CPU per request
  OUTSIDE the index;
- the top functions by their own samples, so the rest has names;
- per thread of the server, the cores it ran on and the cores' worth of time it was ready to run
  but waiting for a CPU (/proc/PID/task/TID/schedstat): a server below its cores' share whose
  event loop waits on the run queue is short of CPU, not of work.

Run
---
    .venv/bin/python bench/profile_server.py --vectors wordnet.npy
    .venv/bin/python bench/profile_server.py --vectors wordnet.npy --concurrency 64 --seconds 10

Needs py-spy (the `bench` extra) and permission to trace the server (same user; on some kernels
`sysctl kernel.yama.ptrace_scope=0`).
"""
from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import engines as E  # noqa: E402

FAISS_SEARCH = ("IndexHNSW.search", "IndexIVF", "IndexFlat", "IndexRefine", "knn_", "GpuIndex")


def profile(pid: int, seconds: float, rate: int, out: Path, native: bool = False) -> subprocess.Popen:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [spy, "record", "-p", str(pid), "-r", str(rate), "-d", str(int(seconds)), "-f", "raw",
           "-o", str(out), "--subprocesses"] + (["--native"] if native else ["--nonblocking"])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarise(raw: Path) -> dict:
    own: collections.Counter = collections.Counter()
    total = in_faiss = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        count = int(n)
        total += count
        if any(f.startswith(FAISS_SEARCH) for f in frames):
            in_faiss += count
        own[frames[-1]] += count
    return {"samples": total, "faiss": in_faiss, "top": own.most_common(15)}


def thread_times(pid: int) -> dict[int, tuple[str, float, float]]:
    """{tid: (name, seconds on a CPU, seconds runnable but waiting for one)} of a process now."""
    out = {}
    task = Path(f"/proc/{pid}/task")
    for tid_dir in task.iterdir():
        try:
            stat = (tid_dir / "stat").read_text()
            on_cpu, waiting, _ = (tid_dir / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        out[int(tid_dir.name)] = (name, int(on_cpu) / 1e9, int(waiting) / 1e9)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", required=True, help="(N, d) float32 .npy; last --queries rows are queries")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--ef-search", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0, help="profiled window (inside the load)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    ap.add_argument("--native", action="store_true",
                    help="native frames too (gRPC's Cython core, faiss); idle waits then count as "
                         "samples, so read the thread totals, not the faiss share")
    args = ap.parse_args(argv)

    x = np.load(args.vectors, mmap_mode="r")
    xb = np.ascontiguousarray(x[:-args.queries], np.float32)
    xq = np.ascontiguousarray(x[-args.queries:], np.float32)
    engine = E.SearchServiceEngine()
    work = Path(tempfile.mkdtemp(prefix="profile_server_"))
    try:
        print(f"building {len(xb)} x {xb.shape[1]} ...", flush=True)
        engine.build(xb)
        engine.set_knob(args.ef_search)
        pid = engine.server_pids()[0]
        raw = args.raw or work / "server.raw"
        holder: dict = {}

        def start_profile():  # inside the measured window: after the harness's 2 s warm-up
            time.sleep(3.0)
            holder["threads0"] = (time.monotonic(), thread_times(pid))
            holder["spy"] = profile(pid, args.seconds, args.rate, raw, args.native)
            time.sleep(args.seconds)
            holder["threads1"] = (time.monotonic(), thread_times(pid))

        threading.Thread(target=start_profile, daemon=True).start()
        m = E.measure(engine, xq, args.k, args.concurrency, args.seconds + 6.0, warmup=2.0)
        spy = holder["spy"]
        _, err = spy.communicate(timeout=60)
        if spy.returncode != 0 or not raw.is_file():
            print(f"py-spy failed (rc={spy.returncode}): {err.decode(errors='replace')[-400:]}")
            return 1
        s = summarise(raw)
        qps, cores = m["qps"], m["server_cores"]
        per_req_ms = cores / qps * 1e3
        share = s["faiss"] / max(1, s["samples"])
        print(f"\nc={args.concurrency}: {qps:.0f} QPS, p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms; "
              f"server {cores:.2f} cores = {per_req_ms:.3f} ms CPU per request (/proc)")
        print(f"py-spy: {s['samples']} busy samples of the server's threads, {share:.1%} inside "
              f"faiss's search -> {per_req_ms * share:.3f} ms per request in the index, "
              f"{per_req_ms * (1 - share):.3f} ms outside it")
        print("top functions by own samples:")
        for frame, n in s["top"]:
            print(f"  {n / max(1, s['samples']):6.1%}  {frame}")
        if "threads1" in holder:
            (t0, a), (t1, b) = holder["threads0"], holder["threads1"]
            print("server threads (cores over the profiled window; tid = pid is the event loop):")
            rows = []
            for tid, (name, cpu, wait) in b.items():
                if tid in a:
                    rows.append((tid, name, (cpu - a[tid][1]) / (t1 - t0), (wait - a[tid][2]) / (t1 - t0)))
            for tid, name, cpu, wait in sorted(rows, key=lambda r: -r[2]):
                if cpu >= 0.01 or wait >= 0.01:
                    role = "event loop" if tid == pid else name
                    print(f"  {role:16s} tid {tid:<8d} on a CPU {cpu:5.2f}   runnable, waiting for a CPU {wait:5.2f}")
        return 0
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
