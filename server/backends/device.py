"""One device abstraction for every backend.

faiss indexes go to a GPU when faiss was built with CUDA and sees a GPU (shard i on GPU i mod n,
so a multi-GPU host serves one shard per GPU); torch/onnxruntime models run on CUDA when torch
sees it. Everything falls back to the CPU, which is the path CI exercises. Index types faiss cannot
place on a GPU (HNSW, fast-scan PQ) stay on the CPU and the reason is recorded, not hidden.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

import faiss

from .gpu_exact import place_flat_on_torch, torch_gpu_count

log = logging.getLogger(__name__)


def _faiss_gpu_count() -> int:
    get = getattr(faiss, "get_num_gpus", None)
    try:
        return int(get()) if get else 0
    except Exception:  # a CPU build without the symbol, or a driver error
        return 0


# One exact search on each GPU faiss sees, in a child process: a faiss wheel without kernels for
# the GPU's architecture (PyPI's faiss-gpu-cu12 has none for Hopper, sm_90) does not raise, it
# aborts the whole process at the first GPU search ("no kernel image is available").
_GPU_PROBE = """
import faiss, numpy as np
x = np.random.default_rng(0).random((64, 32), dtype=np.float32)
for gpu in range(faiss.get_num_gpus()):
    res = faiss.StandardGpuResources()
    config = faiss.GpuIndexFlatConfig()
    config.device = gpu
    index = faiss.GpuIndexFlatL2(res, 32, config)
    index.add(x)
    _, ids = index.search(x[:4], 1)
    assert ids[:, 0].tolist() == [0, 1, 2, 3], ids
print("ok")
"""
_probe_verdict: dict[str, Optional[str]] = {}
_warned_unusable: list[bool] = []


def faiss_gpu_failure(probe: str = _GPU_PROBE, timeout_s: float = 120.0) -> Optional[str]:
    """None when faiss can search on every GPU it sees, else why not. Checked once per process
    (a child process, so an abort inside faiss costs the probe, not the server)."""
    if probe in _probe_verdict:
        return _probe_verdict[probe]
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode == 0 and done.stdout.strip().endswith("ok"):
            verdict = None
        else:
            code = done.returncode
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
            lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
            verdict = f"{how}: {lines[-1][-400:] if lines else 'no output'}"
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        verdict = f"{type(exc).__name__}: {exc}"
    _probe_verdict[probe] = verdict
    return verdict


@dataclass
class Device:
    """Where indexes and models run. `prefer` is "auto", "cpu" or "cuda"."""

    prefer: str = "auto"
    faiss_seen: int = field(init=False)  # GPUs faiss reports; `faiss_gpus` those it can search on
    torch_cuda: bool = field(init=False)
    _faiss_usable: Optional[int] = field(init=False, default=None, repr=False)
    _faiss_unusable: Optional[str] = field(init=False, default=None, repr=False)
    _resources: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.prefer not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.prefer!r}")
        use_gpu = self.prefer != "cpu"
        self.faiss_seen = _faiss_gpu_count() if use_gpu else 0
        self.torch_cuda = torch_gpu_count() > 0 if use_gpu else False
        if self.prefer == "cuda" and not (self.torch_cuda or self.faiss_gpus):
            why = f" (faiss sees {self.faiss_seen} but {self._faiss_unusable})" if self.faiss_seen else ""
            raise RuntimeError(f"device=cuda was asked for, but neither faiss nor torch can use a GPU{why}")

    @property
    def faiss_gpus(self) -> int:
        """GPUs faiss can search on. Probed at first use, not at start: only the process that
        places indexes pays for the probe (front ends and the builder's embedding never do)."""
        if self._faiss_usable is None:
            self._faiss_unusable = faiss_gpu_failure() if self.faiss_seen else None
            self._faiss_usable = 0 if self._faiss_unusable else self.faiss_seen
            if self._faiss_unusable and not _warned_unusable:
                _warned_unusable.append(True)  # once per process, not once per Device
                log.warning("faiss sees %d GPU(s) but cannot search on them (%s). Flat indexes "
                            "search on the GPU through torch; IVF and HNSW stay on the CPU. A "
                            "faiss built for this GPU's architecture places them too (PyPI's "
                            "faiss-gpu-cu12 has no Hopper kernels; conda's faiss-gpu, or a build "
                            "from source, has them)", self.faiss_seen, self._faiss_unusable)
        return self._faiss_usable

    @property
    def faiss_gpu_unusable(self) -> Optional[str]:
        """Why faiss cannot search on the GPUs it sees (None: it can, or it sees none)."""
        return self._faiss_unusable if self.faiss_gpus == 0 else None

    @property
    def torch_device(self) -> str:
        return "cuda" if self.torch_cuda else "cpu"

    @property
    def onnx_providers(self) -> list[str]:
        if self.torch_cuda:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def describe(self) -> str:
        """For the start-up log line; does not run the faiss probe (placement does)."""
        faiss_part = (f"faiss_gpus={self._faiss_usable}" if self._faiss_usable is not None
                      else f"faiss_sees={self.faiss_seen}")
        if self._faiss_unusable:
            faiss_part += f" (faiss GPU unusable: {self._faiss_unusable})"
        import importlib.util

        # the shard image has no torch: say so rather than "torch=cpu" (outside QA)
        torch = self.torch_device if importlib.util.find_spec("torch") is not None else "absent"
        return f"{faiss_part} torch={torch}"

    def gpu_resources(self, gpu: int):
        """One faiss StandardGpuResources per GPU, shared by the shards placed on it (each one
        reserves scratch memory: one per index would waste it)."""
        res = self._resources.get(gpu)
        if res is None:
            res = self._resources[gpu] = faiss.StandardGpuResources()
        return res

    def place_index(self, index: "faiss.Index", shard: int) -> tuple["faiss.Index", str]:
        """Return (index to search, where) - a GPU index when possible, else the CPU index.

        Shard i goes to GPU i mod n (one shard per GPU on a multi-GPU host). Flat and IVF
        (IVF-Flat, IVF-PQ) indexes are cloned to the GPU; an HNSW index becomes a CAGRA graph
        built on the GPU from the same vectors when faiss has cuVS (GpuIndexCagra). Fast-scan PQ
        and refine wrappers have no GPU version and stay on the CPU, logged. The caller keeps the
        CPU index for searches with a selector (GPU indexes take none). Without a faiss that can
        search on the GPU, a Flat index goes to the GPU through torch instead."""
        if self.faiss_gpus == 0:
            # no faiss GPU (a CPU build, or one without kernels for this GPU): a Flat index can
            # still search on the GPU through torch, exactly (server/backends/gpu_exact.py)
            if self.torch_cuda:
                try:
                    placed = place_flat_on_torch(index, shard)
                except Exception as exc:  # out of device memory, say: the CPU index serves
                    log.warning("shard %d stays on CPU: torch could not hold its Flat index (%s)",
                                shard, exc)
                    placed = None
                if placed:
                    return placed
            return index, "cpu"
        gpu = shard % self.faiss_gpus
        inner = faiss.downcast_index(index)
        try:
            res = self.gpu_resources(gpu)
            if isinstance(inner, faiss.IndexHNSW) and hasattr(faiss, "GpuIndexCagra"):
                cfg = faiss.GpuIndexCagraConfig()
                cfg.device = gpu
                cfg.graph_degree = 32
                cfg.intermediate_graph_degree = 64
                cagra = faiss.GpuIndexCagra(res, index.d, index.metric_type, cfg)
                cagra.train(index.reconstruct_n(0, index.ntotal))  # builds the graph on the GPU
                cagra.referenced_resources = res
                return cagra, f"cuda:{gpu} (CAGRA)"
            opts = faiss.GpuClonerOptions()
            opts.useFloat16 = os.environ.get("SEARCH_GPU_FP16", "0") == "1"
            gpu_index = faiss.index_cpu_to_gpu(res, gpu, index, opts)
            gpu_index.referenced_resources = res  # keep the resources alive with the index
            return gpu_index, f"cuda:{gpu}"
        except Exception as exc:  # HNSW without cuVS, fast-scan PQ and refine: no GPU version
            log.warning("shard %d stays on CPU: faiss cannot place %s on GPU (%s)",
                        shard, type(inner).__name__, exc)
            return index, "cpu"


def faiss_threads_initializer(n: int, nice: int = 0):
    """For a ThreadPoolExecutor's `initializer`: libgomp's thread count is per calling thread, so
    faiss.omp_set_num_threads in the main thread does not reach the worker threads that search.
    `nice` > 0 lowers the worker threads' CPU priority by that much (Linux: per thread) so that,
    when cores are short, the event loop - the one thread every request passes through - runs
    first."""
    def init() -> None:
        faiss.omp_set_num_threads(max(1, n))
        # Linux only: there setpriority(PRIO_PROCESS, 0) is the calling thread; elsewhere
        # (macOS) it is the whole process
        if nice > 0 and sys.platform.startswith("linux"):
            try:
                # relative to the process's own; 0 = this thread (Linux: per thread)
                os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
            except OSError:
                pass  # a priority the platform refuses is a lost optimisation, not an error

    return init


_default: Device | None = None


def default_device() -> Device:
    global _default
    if _default is None:
        _default = Device(os.environ.get("SEARCH_DEVICE", "auto"))
    return _default
