"""How many CPU threads the models and indexes may use, and how their OpenMP threads wait.

No heavy imports here: `limit_openmp_spinning` must run before torch or faiss loads its OpenMP
runtime (libgomp reads its settings once, when it loads), so the entry points call it first.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

_CGROUP = Path("/sys/fs/cgroup")
SPIN_COUNT = 10_000  # libgomp's spin turns at a barrier before a thread sleeps (its default: 300,000)


def _quota_in(directory: Path) -> Optional[float]:
    """The CPU quota one cgroup directory sets, in cores: v2 `cpu.max` ("QUOTA PERIOD" or "max
    PERIOD") or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none); None without one."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _cgroup_quota(root: Path = _CGROUP, membership: Optional[str] = None) -> Optional[float]:
    """The tightest CPU quota over this process's cgroup and its ancestors, in cores (a
    container's --cpus, a Kubernetes CPU limit, a systemd CPUQuota=), or None when there is none
    or nothing can be read. `membership`: /proc/self/cgroup's text (cgroup v2 "0::/PATH", v1
    "N:cpu,cpuacct:/PATH"); inside a container's cgroup namespace PATH is "/" and the mount's
    root is the container's own cgroup."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            membership = ""
    dirs = [root, root / "cpu", root / "cpu,cpuacct"]  # v2, and v1's usual mount points
    for line in membership.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers and "cpu" not in controllers.split(","):
            continue
        rel = Path(path.strip() or "/").relative_to("/")
        for base in ([root] if not controllers else [root / "cpu", root / "cpu,cpuacct", root / controllers]):
            for depth in range(len(rel.parts), 0, -1):
                dirs.append(base.joinpath(*rel.parts[:depth]))
    quotas = [q for q in (_quota_in(d) for d in dict.fromkeys(dirs)) if q is not None]
    return min(quotas) if quotas else None


def usable_cores(root: Path = _CGROUP, membership: Optional[str] = None) -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota,
    which affinity does not show (in a container limited to 2 CPUs on a 64-core host, torch and
    OpenMP would otherwise start 64 threads each and spend the quota switching between them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(root, membership)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def limit_openmp_spinning() -> None:
    """OpenMP threads that reach a barrier first spin only briefly (GOMP_SPINCOUNT=10000, about
    ten microseconds), then sleep, unless the environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT
    itself. libgomp's default spins 300,000 turns: a spinning thread burns the core its
    team-mate needs whenever another process (or another front end of `serve --workers`) holds
    the other cores. The packaged MiniLM, beside two busy processes on 2 cores, embedded a query
    in 505 ms at the median with the default and in 12.7 ms with this, at the same speed as the
    default on an idle host (4.6 vs 4.5 ms); sleeping at once (OMP_WAIT_POLICY=PASSIVE) cost
    2.5x on the idle host (bench/bench_cpu_threads.py). Call before torch or faiss is imported."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


def model_threads(processes: int = 1) -> int:
    """torch's intra-op threads for one of `processes` model-running processes on this host: an
    equal share of the usable cores, at least one."""
    return max(1, usable_cores() // max(1, processes))


_share = 1  # model-running processes on this host that share its cores (`serve --workers N`)


def share_cores_with(processes: int) -> None:
    """This process is one of `processes` that run models on this host: models loaded after
    this take that share of the cores."""
    global _share
    _share = max(1, processes)


def model_threads_now() -> int:
    """The intra-op threads a model loaded now gets (torch's, onnxruntime's): OMP_NUM_THREADS when
    the operator set it, else this process's share of the usable cores."""
    given = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return model_threads(_share)
