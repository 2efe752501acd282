"""Measurement: exact percentiles, recall against exact search, closed-loop load, and the CPU used
by other processes while a measurement ran (on a small shared machine a noisy neighbour makes a
number meaningless, so every benchmark reports it)."""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

import numpy as np


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def _busy_jiffies() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    vals = [int(x) for x in fields]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals[:8]) - idle


class CpuMonitor:
    """with CpuMonitor() as m: ...; m.summary() -> 'other processes used X of N cores'."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.busy0 = _busy_jiffies()
        self.own0 = sum(os.times()[:2])
        self.load0 = os.getloadavg()[0]
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        busy1 = _busy_jiffies()
        self.own = sum(os.times()[:2]) - self.own0
        hz = os.sysconf("SC_CLK_TCK")
        self.busy = None if busy1 is None or self.busy0 is None else (busy1 - self.busy0) / hz
        self.load1 = os.getloadavg()[0]
        return False

    @property
    def other_cores(self) -> float | None:
        """Average cores used by other processes during the block (never below 0)."""
        if self.busy is None or self.wall <= 0:
            return None
        return max(0.0, (self.busy - self.own) / self.wall)

    def summary(self) -> str:
        other = self.other_cores
        s = (f"wall {self.wall:.1f}s, this process {self.own / self.wall:.2f} cores, "
             f"loadavg(1m) {self.load0:.2f}->{self.load1:.2f}")
        if other is not None:
            s += f", other processes {other:.2f} of {os.cpu_count()} cores"
        return s


def wait_quiet(threshold: float = 0.3, max_wait: float = 60.0, window: float = 0.5) -> float | None:
    """Block until other processes use under `threshold` cores over a `window`-second sample, or
    `max_wait` seconds pass; returns the last sample (None where /proc/stat is unreadable).

    On a shared machine this keeps benchmark cells out of other jobs' bursts; on an idle one it
    returns after one window."""
    deadline = time.perf_counter() + max(0.0, max_wait)
    while True:
        with CpuMonitor() as m:
            time.sleep(window)
        other = m.other_cores
        if other is None or other < threshold or time.perf_counter() >= deadline:
            return other


def _proc_stat() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (Linux /proc/stat; zeros elsewhere)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(v) - v[3] - v[4]) / hz, sum(v) / hz


class ForeignLoad:
    """CPU time other processes used while we ran: a noisy neighbour makes QPS meaningless."""

    def __init__(self):
        self.busy0, self.total0 = _proc_stat()
        t = os.times()
        self.own0 = t.user + t.system + t.children_user + t.children_system

    def report(self) -> str:
        busy, total = _proc_stat()
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system - self.own0
        if total <= self.total0:
            return "foreign CPU load: unknown (no /proc/stat)"
        foreign = max(0.0, (busy - self.busy0) - own)
        cap = total - self.total0
        return (f"CPU used by OTHER processes during this run: {foreign:.1f} of {cap:.1f} "
                f"core-seconds ({100 * foreign / cap:.0f}%); results are only clean when this is ~0%")



def recall_at_k(found: Sequence[Sequence[int]], exact: np.ndarray, k: int) -> float:
    """Mean |found_k & exact_k| / k over queries."""
    return float(np.mean([len(set(list(f)[:k]) & set(e[:k].tolist())) / k for f, e in zip(found, exact)]))


def closed_loop(call: Callable[[int], object], threads: int, seconds: float,
                warmup: float = 1.0) -> dict:
    """`threads` callers, each calling `call(i)` back to back; requests that complete inside the
    window after `warmup` are counted. Returns qps and exact latency percentiles (ms)."""
    lat: list[list[float]] = [[] for _ in range(threads)]
    errors = [0] * threads
    start = time.perf_counter()
    t0, t1 = start + warmup, start + warmup + seconds

    def run(j: int) -> None:
        i = j
        while True:
            a = time.perf_counter()
            if a >= t1:
                return
            try:
                call(i)
            except Exception:
                errors[j] += 1
            b = time.perf_counter()
            if a >= t0 and b <= t1:
                lat[j].append((b - a) * 1e3)
            i += threads

    ts = [threading.Thread(target=run, args=(j,)) for j in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    xs = [x for lst in lat for x in lst]
    return {"qps": len(xs) / seconds, "n": len(xs), "errors": sum(errors), "p50_ms": pct(xs, 50),
            "p99_ms": pct(xs, 99), "p999_ms": pct(xs, 99.9), "max_ms": max(xs) if xs else float("nan")}


def _tree(root: int) -> set[int]:
    """`root` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def _cpu_of(pids: set[int]) -> float:
    hz = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / hz
        except (OSError, IndexError, ValueError):
            pass
    return total


class OtherCpu:
    """with OtherCpu() as m: ...; m.cores -> cores used by processes OUTSIDE this process and its
    descendants (the servers a benchmark started) during the block."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.busy0 = _busy_jiffies()
        self.tree0 = _cpu_of(_tree(os.getpid()))
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        busy1 = _busy_jiffies()
        tree = _cpu_of(_tree(os.getpid())) - self.tree0
        hz = os.sysconf("SC_CLK_TCK")
        self.cores = (None if busy1 is None or self.busy0 is None or wall <= 0
                      else max(0.0, ((busy1 - self.busy0) / hz - tree) / wall))
        return False
