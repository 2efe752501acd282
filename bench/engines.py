"""Engine adapters and a load runner for side-by-side vector-search benchmarks.

Every engine, ours or a competitor, is driven through one small interface (:class:`Engine`):

    engine.build(xb)                    # index the base vectors; row i gets id i
    engine.set_knob(value)              # the engine's recall/speed knob (ef_search, hnsw_ef, ...)
    engine.search_in_process(q, k)      # ids of the top-k for ONE query, or None for a service
    engine.client_spec(variant="")      # services: a picklable ClientSpec a client process uses
    engine.client_variants()            # services: names of alternative clients ([""] = default)
    engine.close()                      # stop servers, drop temporary data (idempotent)

Two kinds of engine:

* **in-process** (``kind = "in-process"``): a library living in the benchmark process (hnswlib,
  qdrant-edge, faiss). :func:`measure` drives it from N threads of this process, one query per call.
* **service** (``kind = "service"``): a server reached over a socket (PostgreSQL+pgvector, Chroma,
  and later our gRPC service). The adapter starts the server itself (data under a temporary
  directory, stopped in ``close()`` and at exit). :func:`measure` never calls it from the
  benchmark process: it spawns client processes (this file run as a script with ``--client``),
  each running N threads in a closed loop with one query per request, and they report every
  request's latency back through a file. A :class:`ClientSpec` names a factory ``"module:function"``
  plus keyword arguments; the factory is called once per client thread and returns an object with
  ``search(q: np.ndarray, k: int) -> sequence of ids`` (and optionally ``close()``). Factories in
  this file are named ``"engines:..."``; others are imported with the repository root and bench/ on
  ``sys.path`` (e.g. ``"bench.my_client:connect"`` or ``"server.client:..."``).

To add an engine: subclass :class:`Engine`, set ``name``, ``kind``, ``knob_name`` and
``knob_values`` (ascending; the sweep picks the smallest value meeting the target recall), and
register it in :data:`ENGINES`.

Measurement (:func:`measure`): closed loop, every thread issues single-query requests back to
back; after a warm-up, requests that COMPLETE inside a fixed window are counted (QPS = count /
window) and their latencies kept; p50/p99 are numpy percentiles over all of them (not bucketed).
During the window the runner samples /proc: whole-machine busy CPU and the CPU of this process
tree (the benchmark process, the servers it started and their workers, the client processes), so
``other_cpu`` is the CPU that processes outside the benchmark used, in cores, on a shared machine.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
NCPU = os.cpu_count() or 1

# Ascending candidate values for the HNSW search-time knob (ef / ef_search / hnsw_ef). pgvector
# caps hnsw.ef_search at 1000.
DEFAULT_KNOBS = (10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 400, 512,
                 640, 800, 1000)


# --------------------------------------------------------------------------------------------
# interface
# --------------------------------------------------------------------------------------------

@dataclass
class ClientSpec:
    """How a client process connects to a service.

    factory: "module:function"; called as function(**kwargs) once per client thread, it returns an
    object with ``search(q, k) -> ids`` and optionally ``close()``.
    """
    factory: str
    kwargs: dict = field(default_factory=dict)


class Engine:
    name = "engine"
    kind = "in-process"          # or "service"
    knob_name = "knob"
    knob_values: tuple = DEFAULT_KNOBS

    def __init__(self):
        self.knob = None
        self.build_info: dict[str, Any] = {}   # timings and facts of the build, for the report
        self.versions: dict[str, str] = {}     # package / server versions
        self._closed = False
        atexit.register(self.close)

    def build(self, xb: np.ndarray) -> None:
        raise NotImplementedError

    def set_knob(self, value) -> None:
        self.knob = value

    def search_in_process(self, q: np.ndarray, k: int):
        """Ids of the top-k for one query (1-D float32), or None for a service."""
        return None

    def client_spec(self, variant: str = "") -> ClientSpec | None:
        """Services: how a client process connects. `variant` picks one of client_variants()."""
        return None

    def client_variants(self) -> list[str]:
        """Services may offer several clients (e.g. the vendor SDK and a bare HTTP client); each is
        measured as its own row. "" is the default client, also used for the recall sweep."""
        return [""]

    def server_pids(self) -> list[int]:
        """Pids of server processes (their descendants are included) for CPU accounting."""
        return []

    def close(self) -> None:
        self._closed = True

    def describe(self) -> str:
        return self.name


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def pkg_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return "not installed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def stop_process(proc: subprocess.Popen | None, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
    """Stop one process we started (by its pid) and wait for it; kill it if it will not stop."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(sig)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    except ProcessLookupError:
        pass


def exact_topk(xb: np.ndarray, xq: np.ndarray, k: int) -> np.ndarray:
    """Exact inner-product top-k (faiss IndexFlatIP over xb)."""
    import faiss
    index = faiss.IndexFlatIP(xb.shape[1])
    index.add(np.ascontiguousarray(xb, dtype=np.float32))
    _, ids = index.search(np.ascontiguousarray(xq, dtype=np.float32), k)
    return ids


def recall_at_k(results: list, gt: np.ndarray, k: int) -> float:
    hits = 0
    for r, g in zip(results, gt):
        hits += len(set(int(x) for x in list(r)[:k]) & set(int(x) for x in g[:k]))
    return hits / (k * len(gt))


def smallest_ef_search(index, xq: np.ndarray, gt: np.ndarray, target: float, k: int = 10):
    """The smallest efSearch of a faiss HNSW index whose recall@k on `xq` reaches `target` (None if
    none of the usual values does); the index is left at the last value tried."""
    for value in (16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256):
        index.hnsw.efSearch = value
        _, ids = index.search(xq, k)
        if recall_at_k(list(ids), gt, k) >= target:
            return value
    return None


def service_at_recall(xb: np.ndarray, xq: np.ndarray, target: float, k: int = 10):
    """For the SearchBatch benchmarks: a SearchServiceEngine built from `xb` (no server started),
    the faiss index of its one shard read from the build, the smallest efSearch whose recall@k on
    `xq` reaches `target` (None if none does; the index is left at the last value tried), and
    `xq`'s exact top-k. The engine is closed if the build or the read fails."""
    import faiss

    gt = exact_topk(xb, xq, k)
    engine = SearchServiceEngine()
    try:
        engine.build(xb)
        index = faiss.read_index(str(engine.store.build_dir("bench", engine.desc.build_id)
                                     / "shard-000" / "dense.faiss"))
    except BaseException:
        engine.close()
        raise
    return engine, index, smallest_ef_search(index, xq, gt, target, k), gt


# ---- CPU accounting from /proc --------------------------------------------------------------

def _machine_busy() -> tuple[float, float] | None:
    """(busy, steal) CPU-seconds of the whole machine since boot, all cores. Busy = user + nice +
    system + irq + softirq (idle, iowait and steal excluded); steal = time the hypervisor gave
    our virtual CPUs to someone else."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]] + [0] * 8
    except OSError:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / _HZ, v[7] / _HZ


def _all_ppids() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            out[int(d)] = int(s[s.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _proc_cpu(pid: int) -> float | None:
    """utime+stime+cutime+cstime of a process (all its threads, and its reaped children), s."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    f = s[s.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / _HZ


def _descendants(roots: list[int], ppids: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for p, pp in ppids.items():
        children.setdefault(pp, []).append(p)
    seen, stack = set(), [r for r in roots if r in ppids]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(children.get(p, ()))
    return seen


class CpuSample:
    """Snapshot of machine busy time and of the CPU time of groups of our processes.

    groups: {"bench": [own pid], "server": [...], "client": [...]} -> each group's pids and all
    their descendants. A process is counted in the first group that claims it.
    """

    def __init__(self, groups: dict[str, list[int]]):
        self.t = time.monotonic()
        ppids = _all_ppids()
        self.machine = _machine_busy()
        self.per_pid: dict[str, dict[int, float]] = {}
        claimed: set[int] = set()
        # servers and clients are usually children of the bench process: claim them first
        for name in sorted(groups, key=lambda g: g == "bench"):
            pids = _descendants(groups[name], ppids) - claimed
            claimed |= pids
            cpu = {}
            for p in pids:
                c = _proc_cpu(p)
                if c is not None:
                    cpu[p] = c
            self.per_pid[name] = cpu


def cpu_delta(a: CpuSample, b: CpuSample) -> dict[str, float]:
    """Average cores used between two samples: per group, ours in total, and other processes."""
    wall = max(1e-9, b.t - a.t)
    out: dict[str, float] = {}
    ours = 0.0
    for name, after in b.per_pid.items():
        before = a.per_pid.get(name, {})
        used = 0.0
        for pid, c in after.items():
            # a process born inside the window counts from zero
            used += max(0.0, c - before.get(pid, 0.0)) if pid in before else c
        out[f"{name}_cores"] = used / wall
        ours += used
    if a.machine is not None and b.machine is not None:
        busy = b.machine[0] - a.machine[0]
        out["machine_cores"] = busy / wall
        out["steal_cores"] = (b.machine[1] - a.machine[1]) / wall
        # /proc/stat and per-process times are sampled separately: clamp tiny negatives to 0
        out["other_cpu"] = max(0.0, (busy - ours) / wall)
    else:
        out["machine_cores"] = out["other_cpu"] = out["steal_cores"] = float("nan")
    return out


def wait_quiet(groups: dict[str, list[int]], threshold: float, max_wait: float,
               window: float = 1.0) -> float:
    """Wait (at most max_wait s) until other processes use < threshold cores over `window` s."""
    deadline = time.monotonic() + max_wait
    while True:
        a = CpuSample(groups)
        time.sleep(window)
        other = cpu_delta(a, CpuSample(groups))["other_cpu"]
        if not (other >= threshold) or time.monotonic() >= deadline:
            return other


# --------------------------------------------------------------------------------------------
# closed-loop load
# --------------------------------------------------------------------------------------------

def _closed_loop(searchers: list[Callable[[np.ndarray, int], Any]], queries: np.ndarray, k: int,
                 first_index: int, stride: int, t_end: float, window: tuple[float, float]
                 ) -> list[list[float]]:
    """Run one thread per searcher until t_end (monotonic); each thread cycles through the queries
    from its own offset. Returns, per thread, the latencies (s) of requests completing in window."""
    nq = len(queries)
    lats: list[list[float]] = [[] for _ in searchers]
    errors: list[BaseException] = []
    w0, w1 = window

    def run(i: int, search):
        j = (first_index + i) * stride % nq
        mine = lats[i]
        clock = time.monotonic
        try:
            while True:
                s = clock()
                if s >= t_end:
                    return
                search(queries[j], k)
                e = clock()
                if w0 <= e < w1:
                    mine.append(e - s)
                j += 1
                if j == nq:
                    j = 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(searchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} client threads failed: {errors[0]!r}") from errors[0]
    return lats


def _resolve_factory(path: str) -> Callable:
    mod, _, fn = path.partition(":")
    if mod in ("engines", "bench.engines", "__main__") and fn in globals():
        return globals()[fn]
    for p in (str(REPO_ROOT), str(BENCH_DIR)):
        if p not in sys.path:
            sys.path.insert(0, p)
    return getattr(importlib.import_module(mod), fn)


def open_client(spec: ClientSpec):
    return _resolve_factory(spec.factory)(**spec.kwargs)


def _client_main(job_path: str) -> int:
    """Body of a client process: connect, say READY, wait for GO t_warm t0 t1, run, write results."""
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    queries = np.load(job["queries"])
    factory = _resolve_factory(job["factory"])
    clients = [factory(**job["kwargs"]) for _ in range(job["threads"])]
    for c in clients:                      # one request each: connected and the path is hot
        c.search(queries[0], job["k"])
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    if not line or line[0] != "GO":
        return 2
    t0, t1 = float(line[1]), float(line[2])
    cpu_marks: dict[str, float] = {}

    def mark():                             # this process's own CPU at the window edges
        for name, t in (("t0", t0), ("t1", t1)):
            time.sleep(max(0.0, t - time.monotonic()))
            tm = os.times()
            cpu_marks[name] = tm.user + tm.system
    marker = threading.Thread(target=mark, daemon=True)
    marker.start()
    lats = _closed_loop([c.search for c in clients], queries, job["k"], job["first_index"],
                        job["stride"], t1, (t0, t1))
    marker.join()
    for c in clients:
        close = getattr(c, "close", None)
        if close:
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
    np.savez(job["out"], lat=np.concatenate([np.asarray(x, dtype=np.float64) for x in lats]),
             per_thread=np.array([len(x) for x in lats]),
             cpu=np.array([cpu_marks.get("t1", np.nan) - cpu_marks.get("t0", np.nan)]))
    print("DONE", flush=True)
    return 0


def measure(engine: Engine, queries: np.ndarray, k: int, concurrency: int, seconds: float,
            warmup: float = 2.0, client_procs: int | None = None, quiet_threshold: float = 0.3,
            quiet_max_wait: float = 0.0, variant: str = "") -> dict:
    """QPS and exact latency percentiles at `concurrency` outstanding single-query requests.

    In-process engines: `concurrency` threads of this process call engine.search_in_process.
    Services: `client_procs` client processes (default min(concurrency, cpu count)) share the
    `concurrency` threads; each thread has its own connection (its own factory call)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    me = os.getpid()
    server = engine.server_pids()
    result: dict[str, Any] = {"concurrency": concurrency, "seconds": seconds, "warmup": warmup,
                              "variant": variant}
    if quiet_max_wait > 0:
        result["other_cpu_before"] = wait_quiet({"bench": [me], "server": server},
                                                quiet_threshold, quiet_max_wait)
    stride = max(1, len(queries) // concurrency)

    if engine.kind == "in-process":
        search = engine.search_in_process
        if search(queries[0], k) is None:
            raise RuntimeError(f"{engine.name}: search_in_process returned None")
        groups = {"bench": [me], "server": server}
        start = time.monotonic()
        t0, t1 = start + warmup, start + warmup + seconds
        samples: dict[str, CpuSample] = {}

        def sampler():
            for name, t in (("t0", t0), ("t1", t1)):
                time.sleep(max(0.0, t - time.monotonic()))
                samples[name] = CpuSample(groups)
        st = threading.Thread(target=sampler, daemon=True)
        st.start()
        if hasattr(engine, "closed_loop_on_loop"):  # driven the way its front end drives it
            lats = engine.closed_loop_on_loop(queries, k, concurrency, t0, t1)
        else:
            lats = _closed_loop([search] * concurrency, queries, k, 0, stride, t1, (t0, t1))
        st.join()
        allv = np.concatenate([np.asarray(x, dtype=np.float64) for x in lats])
        result["client_procs"] = 0
        result["threads"] = concurrency
    else:
        spec = engine.client_spec(variant)
        if spec is None:
            raise RuntimeError(f"{engine.name}: service without client_spec()")
        procs_n = max(1, min(concurrency, client_procs or NCPU))
        per = [concurrency // procs_n + (1 if i < concurrency % procs_n else 0) for i in range(procs_n)]
        work = Path(tempfile.mkdtemp(prefix="bench_clients_"))
        procs: list[subprocess.Popen] = []
        try:
            qpath = work / "queries.npy"
            np.save(qpath, queries)
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(REPO_ROOT), str(BENCH_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            first = 0
            for i, n in enumerate(per):
                job = {"factory": spec.factory, "kwargs": spec.kwargs, "queries": str(qpath), "k": k, "threads": n,
                       "first_index": first, "stride": stride, "out": str(work / f"out{i}.npz")}
                first += n
                jp = work / f"job{i}.pkl"
                with open(jp, "wb") as f:
                    pickle.dump(job, f)
                err = open(work / f"err{i}.txt", "wb")
                procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--client", str(jp)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                              env=env, text=True))
                err.close()

            def fail(msg):
                tails = []
                for i, _ in enumerate(procs):
                    try:
                        tails.append((work / f"err{i}.txt").read_text()[-3000:])
                    except OSError:
                        pass
                raise RuntimeError(msg + "\n" + "\n".join(tails))

            for p in procs:
                line = p.stdout.readline().strip()
                if line != "READY":
                    fail(f"{engine.name}: client process did not start (got {line!r})")
            groups = {"bench": [me], "server": server, "client": [p.pid for p in procs]}
            start = time.monotonic()
            t0, t1 = start + warmup, start + warmup + seconds
            for p in procs:
                p.stdin.write(f"GO {t0!r} {t1!r}\n")
                p.stdin.flush()
            samples = {}
            for name, t in (("t0", t0), ("t1", t1)):
                time.sleep(max(0.0, t - time.monotonic()))
                samples[name] = CpuSample(groups)
            parts, client_cpu = [], 0.0
            for i, p in enumerate(procs):
                try:
                    line = p.stdout.readline().strip()
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    fail(f"{engine.name}: client process {i} did not finish")
                if line != "DONE" or p.returncode != 0:
                    fail(f"{engine.name}: client process {i} failed (rc={p.returncode})")
                with np.load(work / f"out{i}.npz") as d:
                    parts.append(d["lat"])
                    client_cpu += float(d["cpu"][0])
            allv = np.concatenate(parts)
            result["client_procs"] = procs_n
            result["threads"] = concurrency
            result["client_cpu_s_per_req"] = client_cpu / max(1, len(allv))
        finally:
            for p in procs:
                stop_process(p, signal.SIGKILL, 5)
            shutil.rmtree(work, ignore_errors=True)

    window = t1 - t0
    cpu = cpu_delta(samples["t0"], samples["t1"])
    n = len(allv)
    result.update({
        "n": n,
        "qps": n / window,
        "p50_ms": float(np.percentile(allv, 50) * 1e3) if n else float("nan"),
        "p99_ms": float(np.percentile(allv, 99) * 1e3) if n else float("nan"),
        "mean_ms": float(allv.mean() * 1e3) if n else float("nan"),
        "max_ms": float(allv.max() * 1e3) if n else float("nan"),
        "other_cpu": cpu["other_cpu"],
        "machine_cores": cpu["machine_cores"],
        "steal_cores": cpu["steal_cores"],
        "bench_cores": cpu.get("bench_cores", 0.0),
        "server_cores": cpu.get("server_cores", 0.0),
        "client_cores": cpu.get("client_cores", 0.0),
    })
    return result


# --------------------------------------------------------------------------------------------
# recall sweep
# --------------------------------------------------------------------------------------------

def run_queries(engine: Engine, queries: np.ndarray, k: int, variant: str = "") -> list:
    """Top-k ids for every query, one query per call (in process, or through one client)."""
    if engine.kind == "in-process":
        return [engine.search_in_process(q, k) for q in queries]
    client = open_client(engine.client_spec(variant))
    try:
        return [client.search(q, k) for q in queries]
    finally:
        close = getattr(client, "close", None)
        if close:
            close()


def sweep_knob(engine: Engine, queries: np.ndarray, gt: np.ndarray, k: int, target: float,
               values=None, log=print) -> tuple[Any, float, list[dict]]:
    """Try knob values in ascending order; stop at the first whose recall@k >= target.
    Returns (chosen value, its recall, the sweep). If none reaches it, the last value is kept."""
    sweep = []
    chosen, chosen_recall = None, float("nan")
    for v in (values or engine.knob_values):
        engine.set_knob(v)
        t = time.perf_counter()
        res = run_queries(engine, queries, k)
        dt = time.perf_counter() - t
        r = recall_at_k(res, gt, k)
        sweep.append({"knob": v, "recall": r, "sweep_s": dt})
        log(f"    {engine.name}: {engine.knob_name}={v:<5} recall@{k}={r:.4f}  ({dt:.1f}s for {len(queries)} queries, serial)")
        chosen, chosen_recall = v, r
        if r >= target:
            break
    engine.set_knob(chosen)
    return chosen, chosen_recall, sweep


# --------------------------------------------------------------------------------------------
# in-process engines
# --------------------------------------------------------------------------------------------

class FaissHNSWEngine(Engine):
    """faiss IndexHNSWFlat (inner product), raw, in process; one OpenMP thread per search."""
    name = "faiss-hnsw"
    knob_name = "efSearch"

    def __init__(self, m: int = 16, ef_construction: int = 64):
        super().__init__()
        import faiss
        self.faiss = faiss
        self.m, self.efc = m, ef_construction
        self.index = None
        self.versions = {"faiss-cpu": pkg_version("faiss-cpu")}

    def build(self, xb):
        faiss = self.faiss
        faiss.omp_set_num_threads(NCPU)
        t = time.perf_counter()
        self.index = faiss.IndexHNSWFlat(xb.shape[1], self.m, faiss.METRIC_INNER_PRODUCT)
        self.index.hnsw.efConstruction = self.efc
        self.index.add(np.ascontiguousarray(xb, dtype=np.float32))
        self.build_info = {"build_s": time.perf_counter() - t, "m": self.m, "ef_construction": self.efc}
        faiss.omp_set_num_threads(1)   # single-query searches: no OpenMP fan-out across threads

    def set_knob(self, value):
        super().set_knob(value)
        self.index.hnsw.efSearch = int(value)

    def search_in_process(self, q, k):
        _, ids = self.index.search(q.reshape(1, -1), k)
        return ids[0]

    def close(self):
        self.index = None
        super().close()

    def describe(self):
        return f"faiss IndexHNSWFlat M={self.m} efConstruction={self.efc} IP"


class HnswlibEngine(Engine):
    name = "hnswlib"
    knob_name = "ef"

    def __init__(self, m: int = 16, ef_construction: int = 64):
        super().__init__()
        import hnswlib
        self.hnswlib = hnswlib
        self.m, self.efc = m, ef_construction
        self.index = None
        self.versions = {"hnswlib": pkg_version("hnswlib")}

    def build(self, xb):
        t = time.perf_counter()
        self.index = self.hnswlib.Index(space="ip", dim=xb.shape[1])
        self.index.init_index(max_elements=len(xb), ef_construction=self.efc, M=self.m)
        self.index.add_items(np.ascontiguousarray(xb, dtype=np.float32), np.arange(len(xb)), num_threads=NCPU)
        self.build_info = {"build_s": time.perf_counter() - t, "m": self.m, "ef_construction": self.efc}

    def set_knob(self, value):
        super().set_knob(value)
        self.index.set_ef(int(value))

    def search_in_process(self, q, k):
        labels, _ = self.index.knn_query(q.reshape(1, -1), k=k, num_threads=1)
        return labels[0]

    def close(self):
        self.index = None
        super().close()

    def describe(self):
        return f"hnswlib M={self.m} ef_construction={self.efc} space=ip"


class QdrantEdgeEngine(Engine):
    """Embedded Qdrant (qdrant-edge-py): one shard on a temp dir, HNSW m/ef_construct, Dot.

    Measured with qdrant-edge-py 0.9.0: EdgeShard.query keeps the GIL while it searches (a pure
    Python thread runs at ~half speed beside a searching thread; hnswlib's leaves it at ~1.0), so N
    threads of one process do not add throughput; the shard's own search pool still runs
    per-segment work in parallel (more than one core busy at concurrency 1)."""
    name = "qdrant-edge"
    knob_name = "hnsw_ef"

    def __init__(self, m: int = 16, ef_construction: int = 64, segments: int = 1):
        super().__init__()
        import qdrant_edge as qe
        self.qe = qe
        self.m, self.efc, self.segments = m, ef_construction, segments
        self.dir = None
        self.shard = None
        self.params = None
        self.versions = {"qdrant-edge-py": pkg_version("qdrant-edge-py")}

    def build(self, xb):
        qe = self.qe
        self.dir = tempfile.mkdtemp(prefix="bench_qdrant_")
        cfg = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=xb.shape[1], distance=qe.Distance.Dot),
            hnsw_config=qe.HnswIndexConfig(m=self.m, ef_construct=self.efc, full_scan_threshold=10_000),
            # one segment -> one HNSW graph over all points, like the other engines; the size
            # cap is raised so the optimizer does not split it.
            optimizers=qe.EdgeOptimizersConfig(default_segment_number=self.segments,
                                               max_segment_size=4_000_000),
            wal_enabled=False,
        )
        t = time.perf_counter()
        self.shard = qe.EdgeShard.create(os.path.join(self.dir, "shard"), cfg)
        xb = np.ascontiguousarray(xb, dtype=np.float32)
        for s in range(0, len(xb), 2000):
            pts = [qe.Point(int(i), xb[i].tolist()) for i in range(s, min(len(xb), s + 2000))]
            self.shard.update(qe.UpdateOperation.upsert_points(pts))
        t_ins = time.perf_counter() - t
        self.shard.optimize()
        self.shard.flush()
        info = self.shard.info()
        self.build_info = {"build_s": time.perf_counter() - t, "insert_s": t_ins,
                           "optimize_s": time.perf_counter() - t - t_ins,
                           "m": self.m, "ef_construction": self.efc, "shard_info": _safe_repr(info)}

    def set_knob(self, value):
        super().set_knob(value)
        self.params = self.qe.SearchParams(hnsw_ef=int(value))

    def search_in_process(self, q, k):
        qe = self.qe
        res = self.shard.query(qe.QueryRequest(limit=k, query=qe.Query.Nearest(q.tolist()),
                                               params=self.params, with_payload=False, with_vector=False))
        return [p.id for p in res]

    def close(self):
        if self.shard is not None:
            try:
                self.shard.close()
            except Exception:  # noqa: BLE001
                pass
            self.shard = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        super().close()

    def describe(self):
        return f"qdrant-edge m={self.m} ef_construct={self.efc} Dot, {self.segments} segment(s)"


def _safe_repr(x, limit=600) -> str:
    try:
        s = repr(x)
    except Exception:  # noqa: BLE001
        s = "?"
    return s[:limit]


# --------------------------------------------------------------------------------------------
# services
# --------------------------------------------------------------------------------------------

class PgVectorEngine(Engine):
    """PostgreSQL + pgvector from the `pgserver` wheel's bundled binaries, own postmaster on a
    loopback TCP port, HNSW (vector_ip_ops, m, ef_construction); knob = hnsw.ef_search, set per
    connection by each client. Clients: psycopg 3, autocommit, one connection per thread, a
    prepared `SELECT id ... ORDER BY embedding <#> $1::vector LIMIT k` with the vector as text."""
    name = "pgvector"
    kind = "service"
    knob_name = "hnsw.ef_search"

    def __init__(self, m: int = 16, ef_construction: int = 64, shared_buffers: str = "1GB",
                 build_workers: int | None = None):
        super().__init__()
        self.m, self.efc = m, ef_construction
        self.shared_buffers = shared_buffers
        self.build_workers = NCPU - 1 if build_workers is None else build_workers
        self.dir = None
        self.proc = None
        self.port = None
        self.versions = {"pgserver": pkg_version("pgserver"), "psycopg": pkg_version("psycopg"),
                         "psycopg-binary": pkg_version("psycopg-binary")}

    # -- server --
    def _start(self):
        from pgserver import _commands as pgc
        bindir = pgc.POSTGRES_BIN_PATH
        self.dir = Path(tempfile.mkdtemp(prefix="bench_pg_"))
        pgdata = self.dir / "pgdata"
        user = None
        if os.geteuid() == 0:               # postgres refuses to run as root: as pgserver does
            from pgserver.utils import (ensure_folder_permissions, ensure_prefix_permissions,
                                        ensure_user_exists)
            import pwd
            import stat
            user = "pgserver"
            ensure_user_exists(user)
            ensure_prefix_permissions(bindir)
            ensure_folder_permissions(bindir, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
            ensure_folder_permissions(bindir.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
            ensure_prefix_permissions(self.dir)
            pw = pwd.getpwnam(user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        subprocess.run([str(bindir / "initdb"), "-D", str(pgdata), "--auth=trust", "-U", "postgres",
                        "--encoding=utf8", "--no-sync"], check=True, capture_output=True, user=user)
        self.port = free_port()
        settings = {
            "listen_addresses": "127.0.0.1", "port": self.port, "unix_socket_directories": "",
            "max_connections": 300, "shared_buffers": self.shared_buffers,
            "maintenance_work_mem": "2GB", "max_parallel_maintenance_workers": self.build_workers,
            "max_parallel_workers_per_gather": 0, "jit": "off", "autovacuum": "off",
            "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
            "wal_level": "minimal", "max_wal_senders": 0, "max_wal_size": "8GB",
            "checkpoint_timeout": "1h", "logging_collector": "off",
        }
        args = [str(bindir / "postgres"), "-D", str(pgdata)]
        for key, val in settings.items():
            args += ["-c", f"{key}={val}"]
        self.log = open(self.dir / "postgres.log", "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, user=user,
                                     start_new_session=True)
        import psycopg
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self._conninfo("postgres"), autocommit=True) as c:
                    c.execute("CREATE DATABASE bench")
                break
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("postgres did not start:\n" + (self.dir / "postgres.log").read_text()[-3000:])
                time.sleep(0.3)
        self.versions["postgres"] = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True,
                                                   text=True).stdout.strip()

    def _conninfo(self, db="bench"):
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={db}"

    def build(self, xb):
        import psycopg
        xb = np.ascontiguousarray(xb, dtype=np.float32)
        n, d = xb.shape
        self._start()
        with psycopg.connect(self._conninfo(), autocommit=True) as c:
            c.execute("CREATE EXTENSION vector")
            self.versions["pgvector"] = c.execute(
                "SELECT extversion FROM pg_extension WHERE extname='vector'").fetchone()[0]
            c.execute(f"CREATE TABLE items (id int4 PRIMARY KEY, embedding vector({d}) NOT NULL)")
            t = time.perf_counter()
            # COPY ... BINARY: per row int16 nfields, (int32 len, int4 id), (int32 len, pgvector
            # binary = int16 dim, int16 unused, float4[dim]), all big-endian
            row = np.dtype([("nf", ">i2"), ("l1", ">i4"), ("id", ">i4"), ("l2", ">i4"), ("dim", ">i2"),
                            ("unused", ">i2"), ("v", ">f4", (d,))])
            with c.cursor() as cur, cur.copy("COPY items (id, embedding) FROM STDIN WITH (FORMAT BINARY)") as cp:
                cp.write(b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8)
                for s in range(0, n, 10_000):
                    e = min(n, s + 10_000)
                    rows = np.zeros(e - s, dtype=row)
                    rows["nf"], rows["l1"], rows["id"] = 2, 4, np.arange(s, e)
                    rows["l2"], rows["dim"], rows["v"] = 4 + 4 * d, d, xb[s:e]
                    cp.write(rows.tobytes())
                cp.write(b"\xff\xff")
            t_load = time.perf_counter() - t
            c.execute("VACUUM ANALYZE items")
            t1 = time.perf_counter()
            c.execute(f"CREATE INDEX items_hnsw ON items USING hnsw (embedding vector_ip_ops) "
                      f"WITH (m = {self.m}, ef_construction = {self.efc})")
            t_index = time.perf_counter() - t1
            c.execute("CHECKPOINT")
            size = c.execute("SELECT pg_size_pretty(pg_relation_size('items_hnsw')), "
                             "pg_size_pretty(pg_total_relation_size('items'))").fetchone()
            plan = "\n".join(r[0] for r in c.execute(
                "EXPLAIN SELECT id FROM items ORDER BY embedding <#> %s::vector LIMIT 10",
                (_vec_text(xb[0]),)).fetchall())
        self.build_info = {"build_s": t_load + t_index, "load_s": t_load, "index_s": t_index,
                           "index_size": size[0], "total_size": size[1], "m": self.m,
                           "ef_construction": self.efc, "build_workers": self.build_workers,
                           "shared_buffers": self.shared_buffers, "plan": plan}
        if "Index Scan using items_hnsw" not in plan:
            raise RuntimeError(f"pgvector: the query does not use the HNSW index:\n{plan}")

    def set_knob(self, value):
        super().set_knob(int(value))

    def client_spec(self, variant=""):
        return ClientSpec("engines:pg_client", {"conninfo": self._conninfo(), "ef_search": self.knob})

    def server_pids(self):
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []

    def close(self):
        if self.proc is not None:
            stop_process(self.proc, signal.SIGINT, 30)   # SIGINT = fast shutdown
            self.proc = None
            self.log.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        super().close()

    def describe(self):
        return f"pgvector HNSW m={self.m} ef_construction={self.efc} vector_ip_ops (<#>)"


def _vec_text(q: np.ndarray) -> str:
    return "[" + ",".join(map(repr, q.tolist())) + "]"


class _PgClient:
    def __init__(self, conninfo: str, ef_search: int | None):
        import psycopg
        self.conn = psycopg.connect(conninfo, autocommit=True)
        if ef_search is not None:
            self.conn.execute(f"SET hnsw.ef_search = {int(ef_search)}")
        self.sql = None
        self.k = None

    def search(self, q, k):
        if k != self.k:
            self.k = k
            self.sql = f"SELECT id FROM items ORDER BY embedding <#> %s::vector LIMIT {int(k)}"
        rows = self.conn.execute(self.sql, (_vec_text(q),), prepare=True).fetchall()
        return [r[0] for r in rows]

    def close(self):
        self.conn.close()


def pg_client(conninfo: str, ef_search: int | None = None):
    return _PgClient(conninfo, ef_search)


class ChromaEngine(Engine):
    """Chroma server (`chroma run`, the Rust server shipped in the chromadb wheel) on a loopback
    port, persistent data under a temp dir; one collection with HNSW space=ip, max_neighbors=m,
    ef_construction; knob = hnsw ef_search (collection.modify). Clients: chromadb.HttpClient."""
    name = "chroma"
    kind = "service"
    knob_name = "hnsw.ef_search"

    def __init__(self, m: int = 16, ef_construction: int = 64, space: str = "ip"):
        super().__init__()
        self.m, self.efc, self.space = m, ef_construction, space
        self.dir = None
        self.proc = None
        self.port = None
        self.collection = None
        self.versions = {"chromadb": pkg_version("chromadb")}

    def _start(self):
        self.dir = Path(tempfile.mkdtemp(prefix="bench_chroma_"))
        self.port = free_port()
        self.log = open(self.dir / "chroma.log", "wb")
        self._launch()

    def _launch(self):
        exe = Path(sys.executable).parent / "chroma"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "chromadb.cli.cli"]
        env = dict(os.environ, ANONYMIZED_TELEMETRY="False")
        self.proc = subprocess.Popen(cmd + ["run", "--path", str(self.dir / "data"), "--host", "127.0.0.1",
                                            "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_port(self.port, 60, self.proc)
        except Exception as exc:
            raise RuntimeError(f"chroma did not start: {exc}\n" + (self.dir / "chroma.log").read_text()[-3000:])

    def _admin(self):
        return _chroma_http(self.port)

    def build(self, xb):
        xb = np.ascontiguousarray(xb, dtype=np.float32)
        self._start()
        client = self._admin()
        t = time.perf_counter()
        self.collection = client.create_collection(
            "bench", embedding_function=None,
            configuration={"hnsw": {"space": self.space, "max_neighbors": self.m,
                                    "ef_construction": self.efc, "ef_search": 10}})
        self.knob = 10
        bs = min(5000, client.get_max_batch_size())
        for s in range(0, len(xb), bs):
            e = min(len(xb), s + bs)
            self.collection.add(ids=[str(i) for i in range(s, e)], embeddings=xb[s:e])
        t_add = time.perf_counter() - t
        # wait until every record is indexed and queryable
        count = self.collection.count()
        self.collection.query(query_embeddings=xb[:1], n_results=1, include=[])
        self.build_info = {"build_s": time.perf_counter() - t, "add_s": t_add, "count": count,
                           "m": self.m, "ef_construction": self.efc, "space": self.space,
                           "batch": bs}
        if count != len(xb):
            raise RuntimeError(f"chroma: count {count} != {len(xb)}")

    def set_knob(self, value):
        value = int(value)
        if value == self.knob:
            return
        super().set_knob(value)
        self.collection.modify(configuration={"hnsw": {"ef_search": value}})
        # Chroma 1.5 stores the new ef_search but a running server keeps using the HNSW index it
        # already loaded (with the old ef) -- measured: recall does not move. A restart reloads the
        # index from disk with the new configuration.
        stop_process(self.proc, signal.SIGTERM, 30)
        self._launch()
        self.collection = self._admin().get_collection("bench", embedding_function=None)
        got = self.collection.configuration.get("hnsw", {}).get("ef_search")
        if got != value:
            raise RuntimeError(f"chroma: ef_search is {got} after modify({value})")
        self.restarts = getattr(self, "restarts", 0) + 1

    def client_variants(self):
        return ["", "http"]

    def client_spec(self, variant=""):
        if variant == "http":
            return ClientSpec("engines:chroma_http_client",
                              {"port": self.port, "collection_id": str(self.collection.id)})
        return ClientSpec("engines:chroma_client", {"port": self.port, "collection": "bench"})

    def server_pids(self):
        return [self.proc.pid] if self.proc and self.proc.poll() is None else []

    def close(self):
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, 20)
            self.proc = None
            self.log.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        super().close()

    def describe(self):
        return f"Chroma HNSW max_neighbors={self.m} ef_construction={self.efc} space={self.space}"


def _chroma_http(port: int):
    import chromadb
    from chromadb.config import Settings
    return chromadb.HttpClient(host="127.0.0.1", port=port,
                               settings=Settings(anonymized_telemetry=False))


class _ChromaClient:
    def __init__(self, port: int, collection: str):
        self.client = _chroma_http(port)
        self.col = self.client.get_collection(collection, embedding_function=None)

    def search(self, q, k):
        res = self.col.query(query_embeddings=q.reshape(1, -1), n_results=k, include=[])
        return [int(x) for x in res["ids"][0]]


def chroma_client(port: int, collection: str):
    return _ChromaClient(port, collection)


class _ChromaHttpClient:
    """The same REST call the chromadb client makes (POST .../collections/{id}/query, JSON), with
    only http.client + json: no pydantic validation, no httpx. Shows what the SDK costs."""

    def __init__(self, port: int, collection_id: str):
        import http.client
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.path = (f"/api/v2/tenants/default_tenant/databases/default_database/collections/"
                     f"{collection_id}/query")
        self.headers = {"Content-Type": "application/json"}

    def search(self, q, k):
        body = ('{"query_embeddings":[[' + ",".join(map(repr, q.tolist())) + ']],"n_results":'
                + str(int(k)) + ',"include":[]}')
        self.conn.request("POST", self.path, body=body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"chroma HTTP {resp.status}: {data[:300]!r}")
        return [int(x) for x in json.loads(data)["ids"][0]]

    def close(self):
        self.conn.close()


def chroma_http_client(port: int, collection_id: str):
    return _ChromaHttpClient(port, collection_id)


class SearchServiceEngine(Engine):
    """This project's gRPC service (`search-server serve`), over a collection built from the
    vectors themselves (`index-builder build --vectors`, HNSW M=16, efConstruction 64), with no
    embedding model loaded. Knob = efSearch (written into the build's search defaults; the server
    is restarted to load it). Variants of the server: batching off (the per-request path: every
    query its own faiss call) and --workers N front ends. The client is the generated gRPC stub,
    one channel (connection) per client thread, a SearchRequest built per call as a user would."""

    kind = "service"
    knob_name = "efSearch"
    MODEL = "bench-vectors@1"

    def __init__(self, batching: bool = True, workers: int = 1, factory: str = "HNSW16,Flat",
                 texts: str | None = None, name: str | None = None,
                 server_flags: tuple[str, ...] = ()):
        super().__init__()
        self.batching, self.workers, self.factory, self.texts = batching, workers, factory, texts
        self.server_flags = tuple(server_flags)  # more `serve` flags (bench/ab_server_flags.py)
        self.name = name or ("search-service" + ("" if batching else " (batching off)")
                             + (f" --workers {workers}" if workers > 1 else ""))
        self.dir = None
        self.proc = None
        self.port = None
        self.versions = {"hybrid-search-server": "this checkout", "faiss-cpu": pkg_version("faiss-cpu"),
                         "grpcio": pkg_version("grpcio")}

    def build(self, xb):
        sys.path.insert(0, str(REPO_ROOT))
        from index_builder.build import build_collection
        from index_builder.corpus import Document
        from server.core.collection import CollectionStore

        xb = np.ascontiguousarray(xb, dtype=np.float32)
        self.dir = Path(tempfile.mkdtemp(prefix="bench_service_"))
        texts = (Path(self.texts).read_text().split("\n") if self.texts else None)
        docs = [Document(str(i), texts[i] if texts and i < len(texts) else f"row {i}")
                for i in range(len(xb))]
        store = CollectionStore(self.dir / "data")
        t = time.perf_counter()
        self.desc = build_collection(docs, store, "bench", None, self.factory, quiet=True,
                                     vectors=xb, model_id=self.MODEL)
        store.publish("bench", self.desc.build_id, require_audit=False)
        self.store = store
        self.build_info = {"build_s": time.perf_counter() - t, "factory": self.factory,
                           "texts": bool(texts)}
        self.knob = None

    def set_knob(self, value):
        value = int(value)
        if value == self.knob and self.proc is not None:
            return
        super().set_knob(value)
        self.store_ef_search(value)
        self._restart()

    def store_ef_search(self, value: int) -> None:
        """The build's efSearch in its descriptor, which a server reads as it loads the build."""
        desc = self.store.descriptor("bench", self.desc.build_id)
        desc.search_defaults = {**(desc.search_defaults or {}), "ef_search": int(value)}
        self.store.write_descriptor(desc)

    def _restart(self):
        stop_process(self.proc, signal.SIGTERM, 30)
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "server.main", "serve", "--data-dir", str(self.dir / "data"),
               "--port", str(self.port), "--embedder", "none", "--log-level", "WARNING",
               "--workers", str(self.workers), "--alias-poll-s", "0",
               # every query must reach the index, as it does in the other engines: the harness
               # cycles through 1,000 queries, which the retrieval cache (1,024 entries by
               # default) would otherwise answer from memory after the first pass
               "--retrieval-cache-size", "0"]
        if not self.batching:
            cmd.append("--no-batching")
        cmd += list(self.server_flags)
        self.log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_port(self.port, 120, self.proc)
        client = search_service_client(f"127.0.0.1:{self.port}", self.MODEL)
        deadline = time.time() + 120
        while True:  # the port opens before every front end is up: wait for answers
            try:
                client.search(np.ones(self.desc.dim, np.float32), 1)  # any direction (not zero)
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        client.close()

    def client_spec(self, variant=""):
        return ClientSpec("engines:search_service_client",
                          {"address": f"127.0.0.1:{self.port}", "model_id": self.MODEL})

    def server_pids(self):
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [self.proc.pid]

    def close(self):
        if self.proc is not None:
            stop_process(self.proc, signal.SIGTERM, 30)
            self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        super().close()

    def describe(self):
        return (f"search-server serve, {self.factory} (efConstruction 64), batching "
                f"{'on' if self.batching else 'off'}, {self.workers} front end(s)")


class SearchEngineInProcess(Engine):
    """This project's shard engine in the benchmark process, no gRPC: a LocalShard (scheduler +
    index) over the same kind of build as SearchServiceEngine, called from the harness threads
    through its event loop (one loop thread; the engine's own threads search). Paired with
    FaissSameIndex, which searches the very same dense.faiss file with faiss directly."""

    kind = "in-process"
    knob_name = "efSearch"
    name = "search-engine (in process)"

    def __init__(self, factory: str = "HNSW16,Flat"):
        super().__init__()
        self.factory = factory
        self.dir = None
        self.loop = None
        self.versions = {"hybrid-search-server": "this checkout"}

    @staticmethod
    def config():
        """The engine with no front end in its process: a batch on every core (the server's
        default keeps one core for its event loop; `--dense-workers` sets this there too)."""
        from server.config import EngineConfig
        from server.core.engine.local import burst_workers

        return EngineConfig(dense_workers=burst_workers(0, "cpu"))

    def build(self, xb):
        import asyncio

        sys.path.insert(0, str(REPO_ROOT))
        from index_builder.build import build_collection
        from index_builder.corpus import Document
        from server.core.collection import CollectionStore
        from server.core.engine.local import EnginePools, LocalShard

        self.dir = Path(tempfile.mkdtemp(prefix="bench_engine_"))
        store = CollectionStore(self.dir / "data")
        t = time.perf_counter()
        self.desc = build_collection([Document(str(i), f"row {i}") for i in range(len(xb))], store,
                                     "bench", None, self.factory, quiet=True,
                                     vectors=np.ascontiguousarray(xb, np.float32),
                                     model_id=SearchServiceEngine.MODEL)
        self.build_info = {"build_s": time.perf_counter() - t, "factory": self.factory}
        self.pools = EnginePools.create()
        self.shard = LocalShard.open(self.desc, store.build_dir("bench", self.desc.build_id),
                                     self.dir / ".state", 0, None, self.config(), self.pools)
        self.index_path = store.build_dir("bench", self.desc.build_id) / "shard-000" / "dense.faiss"
        SearchEngineInProcess.last_index_path = self.index_path  # faiss-same-index reads it
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def set_knob(self, value):
        import dataclasses

        super().set_knob(int(value))
        dense = self.shard.index.dense
        dense.knobs = dataclasses.replace(dense.knobs, ef_search=int(value))

    def _query(self, q, k):
        from server.core.types import ShardQuery

        return ShardQuery(self.desc.build_id, "default", np.asarray(q, np.float32),
                          SearchServiceEngine.MODEL, "", int(k), 0, text_top_n=int(k))

    def search_in_process(self, q, k):
        """One query from another thread (the recall sweep): two thread hops more than the
        front end pays, which calls from the engine's own loop."""
        import asyncio

        fut = asyncio.run_coroutine_threadsafe(self.shard.search([self._query(q, k)]), self.loop)
        return [int(c.record.doc_id) for c in fut.result()[0].dense]

    def closed_loop_on_loop(self, queries, k, concurrency, t0, t1) -> list[list[float]]:
        """`concurrency` coroutines on the engine's loop, each awaiting one query at a time (as
        the gRPC servicer, already on that loop, does); latencies (s) of queries inside [t0, t1]."""
        import asyncio

        async def caller(j):
            lat, i = [], j
            while True:
                a = time.monotonic()
                if a >= t1:
                    return lat
                res = await self.shard.search([self._query(queries[i % len(queries)], k)])
                [int(c.record.doc_id) for c in res[0].dense]
                b = time.monotonic()
                if a >= t0 and b <= t1:
                    lat.append(b - a)
                i += concurrency

        async def run_all():
            return await asyncio.gather(*(caller(j) for j in range(concurrency)))

        return asyncio.run_coroutine_threadsafe(run_all(), self.loop).result()

    def close(self):
        import asyncio

        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self.shard.close(), self.loop).result(60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.pools.close()
            self.loop = None
        if self.dir is not None:  # kept until exit: faiss-same-index may still read the file
            atexit.register(shutil.rmtree, self.dir, True)
            self.dir = None
        super().close()

    def describe(self):
        return f"LocalShard in process (scheduler + index), {self.factory}"


class FaissSameIndex(Engine):
    """faiss searching the dense.faiss file SearchEngineInProcess built (the same graph), one
    query per call, 1 OpenMP thread: the baseline for the engine's own overhead. Built last in a
    run that also builds the in-process engine (it reads that engine's file)."""

    kind = "in-process"
    knob_name = "efSearch"
    name = "faiss (same index file)"

    def __init__(self):
        super().__init__()
        self.source = None
        self.versions = {"faiss-cpu": pkg_version("faiss-cpu")}

    def build(self, xb):
        import faiss

        path = getattr(SearchEngineInProcess, "last_index_path", None)
        if path is None or not Path(path).is_file():
            self.source = SearchEngineInProcess()
            self.source.build(xb)
            path = self.source.index_path
        t = time.perf_counter()
        self.index = faiss.read_index(str(path))
        faiss.omp_set_num_threads(1)
        self.build_info = {"build_s": time.perf_counter() - t, "read_from": "the engine's build"}

    def set_knob(self, value):
        super().set_knob(int(value))
        self.index.hnsw.efSearch = int(value)

    def search_in_process(self, q, k):
        _, ids = self.index.search(np.asarray(q, np.float32).reshape(1, -1), int(k))
        return ids[0]

    def close(self):
        if self.source is not None:
            self.source.close()
        super().close()

    def describe(self):
        return "faiss IndexHNSWFlat read from the engine's build, one query per call"


class _SearchServiceClient:
    def __init__(self, address: str, model_id: str):
        sys.path.insert(0, str(REPO_ROOT))
        import grpc
        from server.rpc import search_pb2, search_pb2_grpc

        self.pb = search_pb2
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = search_pb2_grpc.SearchServiceStub(self.channel)
        self.model_id = model_id

    def search(self, q, k):
        pb = self.pb
        resp = self.stub.Search(pb.SearchRequest(
            collection="bench", top_k=int(k), mode=pb.DENSE,
            vector=pb.QueryVector(values_f32=np.asarray(q, "<f4").tobytes(), model_id=self.model_id)),
            timeout=30)
        return [int(h.doc_id) for h in resp.hits]

    def close(self):
        self.channel.close()


def search_service_client(address: str, model_id: str):
    return _SearchServiceClient(address, model_id)


ENGINES: dict[str, Callable[[], Engine]] = {
    "search-service": SearchServiceEngine,
    "search-service-nobatch": lambda: SearchServiceEngine(batching=False),
    "search-service-workers2": lambda: SearchServiceEngine(workers=2),
    "search-engine-inproc": SearchEngineInProcess,
    "faiss-same-index": FaissSameIndex,
    "pgvector": PgVectorEngine,
    "chroma": ChromaEngine,
    "hnswlib": HnswlibEngine,
    "qdrant-edge": QdrantEdgeEngine,
    "faiss-hnsw": FaissHNSWEngine,
}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        sys.exit(_client_main(sys.argv[2]))
    print(__doc__)
    sys.exit(1)
