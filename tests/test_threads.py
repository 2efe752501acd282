"""CPU threads of the models and indexes: the cores a cgroup's CPU quota allows (not the host's),
split between the front ends of `serve --workers N`, and OpenMP threads that spin only briefly at
a barrier before they sleep (a spinning thread burns the core its team-mate needs when other
processes hold the rest: bench/bench_cpu_threads.py)."""
import os
import subprocess
import sys

import pytest

from server.backends import threads

from conftest import REPO


def _cgroup(tmp_path, v2=None, v1=None):
    if v2 is not None:
        (tmp_path / "cpu.max").write_text(v2)
    if v1 is not None:
        (tmp_path / "cpu").mkdir()
        (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    return tmp_path


@pytest.mark.parametrize("v2, v1, quota", [
    ("150000 100000\n", None, 1.5),      # cgroup v2, a container's --cpus 1.5
    ("max 100000\n", None, None),        # v2, no limit
    (None, ("200000\n", "100000\n"), 2.0),  # v1
    (None, ("-1\n", "100000\n"), None),  # v1, no limit
    ("garbage\n", None, None),           # unreadable: no cap, not a crash
    (None, None, None),                  # no cgroup files at all (not Linux, or not mounted)
])
def test_the_cgroup_cpu_quota_is_read_in_either_version(tmp_path, v2, v1, quota):
    assert threads._cgroup_quota(_cgroup(tmp_path, v2, v1), "0::/\n1:cpu:/\n") == quota


def test_the_tightest_quota_of_the_process_cgroup_and_its_ancestors_counts(tmp_path):
    """Review: only the mount's root was read, which misses a quota set on the process's own
    cgroup (no cgroup namespace: systemd CPUQuota=, --cgroupns=host) or on an ancestor."""
    pod = tmp_path / "kubepods" / "pod1"
    (pod / "ctr").mkdir(parents=True)
    (pod / "cpu.max").write_text("200000 100000\n")
    v2 = "0::/kubepods/pod1/ctr\n"
    assert threads._cgroup_quota(tmp_path, v2) == 2.0        # the ancestor's
    (pod / "ctr" / "cpu.max").write_text("50000 100000\n")
    assert threads._cgroup_quota(tmp_path, v2) == 0.5        # the tighter one, its own
    assert threads.usable_cores(tmp_path, v2) == 1
    v1_dir = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    v1_dir.mkdir(parents=True)
    (v1_dir / "cpu.cfs_quota_us").write_text("300000\n")
    (v1_dir / "cpu.cfs_period_us").write_text("100000\n")
    other = tmp_path / "v1only"
    other.mkdir()
    (other / "cpu,cpuacct").symlink_to(tmp_path / "cpu,cpuacct")
    assert threads._cgroup_quota(other, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n") == 3.0
    assert threads._cgroup_quota(other, "4:memory:/x\n") is None  # no cpu controller listed


def test_usable_cores_are_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    root = "0::/\n"
    assert threads.usable_cores(_cgroup(tmp_path, "max 100000"), root) == affinity
    capped = tmp_path / "capped"
    capped.mkdir()
    # half a core still gets a thread; 1.5 cores get 2, as a container's --cpus 1.5 can use both
    assert threads.usable_cores(_cgroup(capped, "50000 100000"), root) == 1
    (capped / "cpu.max").write_text("150000 100000")
    assert threads.usable_cores(capped, root) == min(affinity, 2)
    (capped / "cpu.max").write_text(f"{100000 * (affinity + 8)} 100000")
    assert threads.usable_cores(capped, root) == affinity  # above the affinity: the affinity


def test_front_ends_split_the_cores_between_their_models(tiny_embedder_dir, monkeypatch):
    import torch

    from server.backends.models import Embedder

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda *a: 8)  # a split shows on any host
    before = torch.get_num_threads()
    try:
        threads.share_cores_with(2)
        assert threads.model_threads_now() == 4
        Embedder(tiny_embedder_dir)
        assert torch.get_num_threads() == 4
        threads.share_cores_with(1)
        Embedder(tiny_embedder_dir)
        assert torch.get_num_threads() == 8
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's own choice stands
        Embedder(tiny_embedder_dir)
        assert torch.get_num_threads() == 3
    finally:
        threads.share_cores_with(1)
        torch.set_num_threads(before)


def _openmp_settings(args, env_extra=None) -> str:
    """What libgomp reports when it loads (OMP_DISPLAY_ENV) in a command of this project."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update({"OMP_DISPLAY_ENV": "verbose", **(env_extra or {})})
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    return out.stdout + out.stderr


def test_the_entry_points_make_openmp_threads_sleep_before_any_runtime_loads(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    # each stops with an error after loading faiss (and the server torch): libgomp reported its
    # settings as it loaded, so they were in place before the first runtime read them
    server = _openmp_settings(["server.main", "serve", "--data-dir", str(not_a_dir), "--port", "0"])
    assert "is not a directory" in server
    # both libgomp copies (faiss's and torch's) loaded after it: neither at libgomp's default
    assert server.count("GOMP_SPINCOUNT = '10000'") >= 1, server
    assert "GOMP_SPINCOUNT = '300000'" not in server, server
    builder = _openmp_settings(["index_builder.cli", "build", "--data-dir", str(tmp_path / "d"),
                                "--collection", "c", "--corpus", str(tmp_path / "missing.jsonl")])
    assert "missing.jsonl" in builder and "GOMP_SPINCOUNT = '10000'" in builder, builder
    # an operator's own choice stands
    mine = _openmp_settings(["index_builder.cli", "build", "--data-dir", str(tmp_path / "d"),
                             "--collection", "c", "--corpus", str(tmp_path / "missing.jsonl")],
                            {"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in mine and "GOMP_SPINCOUNT = '10000'" not in mine, mine
