"""Exact (Flat) search on a GPU through torch, for hosts where faiss cannot search on the GPU.

PyPI's faiss-gpu-cu12 carries kernels for compute capability 7.0 and 8.0 only: on a Hopper GPU
(H100, H200: 9.0) its first GPU search aborts the process, and a faiss-cpu install has no GPU
path at all. torch, installed for the models, runs on any GPU its wheel supports. A Flat index is
a matrix of vectors, so its search is one matrix product and a top-k per query batch - the shape
GPUs are built for (cuVS's brute force does the same). The device copy answers unrestricted
batches exactly as the CPU Flat index would (fp32 products, no TF32); the CPU index stays for
selector searches and writing, as with a faiss GPU index (server/backends/dense.py).
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

# scores held per call: queries are searched in slices whose (slice, rows) score matrix stays
# under this many bytes, so a 1,024-query batch over 10M rows needs no 40 GB
SCORE_BYTES = 1 << 28


class TorchExactIndex:
    """The vectors of a faiss Flat index on a torch device, searched by matrix product.

    Speaks the part of faiss's index interface DenseIndex uses: `d`, `ntotal`, `metric_type`,
    `search(queries, k, params=None)` -> (distances, labels) in faiss's conventions (inner
    product: larger first; L2: squared distance, smaller first; -1 labels past ntotal) and
    `add(x)`. Adds grow a buffer by doubling, so streaming upserts do not copy the whole matrix
    each time."""

    def __init__(self, vectors: np.ndarray, metric: str, device: str,
                 score_bytes: int = SCORE_BYTES):
        import torch

        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be ip or l2, not {metric!r}")
        self._torch = torch
        self.device = torch.device(device)
        self.metric = metric
        self.metric_type = 0 if metric == "ip" else 1  # faiss.METRIC_INNER_PRODUCT / METRIC_L2
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        self.d = int(x.shape[1])
        self.ntotal = 0
        self._score_bytes = score_bytes
        self._lock = threading.Lock()  # adds replace the buffer; searches read a consistent view
        self._buf = torch.empty((max(1024, len(x)), self.d), dtype=torch.float32, device=self.device)
        self._norms = torch.empty(self._buf.shape[0], dtype=torch.float32, device=self.device)
        self.add(x)

    @classmethod
    def from_faiss(cls, index, device: str) -> "TorchExactIndex":
        """The device copy of a faiss IndexFlat (IP or L2)."""
        import faiss

        flat = faiss.downcast_index(index)
        if not isinstance(flat, faiss.IndexFlat):
            raise TypeError(f"{type(flat).__name__} is not a Flat index")
        if flat.metric_type not in (faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2):
            raise TypeError(f"faiss metric {flat.metric_type} has no exact GPU path here")
        metric = "ip" if flat.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
        vectors = (faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d)
                   .reshape(flat.ntotal, flat.d) if flat.ntotal else np.zeros((0, flat.d), np.float32))
        return cls(vectors, metric, device)

    def add(self, x: np.ndarray) -> None:
        torch = self._torch
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.d:
            raise ValueError(f"vectors must be (n, {self.d}), not {x.shape}")
        if not len(x):
            return
        with self._lock:
            need = self.ntotal + len(x)
            if need > self._buf.shape[0]:
                grown = torch.empty((max(need, 2 * self._buf.shape[0]), self.d),
                                    dtype=torch.float32, device=self.device)
                grown[:self.ntotal] = self._buf[:self.ntotal]
                norms = torch.empty(grown.shape[0], dtype=torch.float32, device=self.device)
                norms[:self.ntotal] = self._norms[:self.ntotal]
                self._buf, self._norms = grown, norms
            block = torch.from_numpy(x).to(self.device)
            self._buf[self.ntotal:need] = block
            self._norms[self.ntotal:need] = (block * block).sum(dim=1)
            self.ntotal = need

    def search(self, queries: np.ndarray, k: int, params=None) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        q = np.ascontiguousarray(queries, dtype=np.float32)
        nq = q.shape[0]
        with self._lock:
            n, base, norms = self.ntotal, self._buf, self._norms
        distances = np.full((nq, k), -np.inf if self.metric == "ip" else np.inf, np.float32)
        labels = np.full((nq, k), -1, np.int64)
        if n == 0 or nq == 0:
            return distances, labels
        kk = min(k, n)
        step = max(1, self._score_bytes // (4 * n))
        with torch.inference_mode():
            qt = torch.from_numpy(q).to(self.device, non_blocking=False)
            rows = base[:n]
            for s in range(0, nq, step):
                part = qt[s:s + step]
                scores = part @ rows.T
                if self.metric == "ip":
                    top, idx = torch.topk(scores, kk, dim=1, largest=True, sorted=True)
                else:  # |q - b|^2 = |q|^2 - 2 q.b + |b|^2, as faiss's own L2 Flat computes it
                    dist = (part * part).sum(dim=1, keepdim=True) - 2 * scores + norms[:n]
                    top, idx = torch.topk(dist, kk, dim=1, largest=False, sorted=True)
                distances[s:s + step, :kk] = top.cpu().numpy()
                labels[s:s + step, :kk] = idx.cpu().numpy()
        return distances, labels


def torch_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def place_flat_on_torch(index, shard: int) -> Optional[tuple[TorchExactIndex, str]]:
    """(device copy, where) for a Flat index when torch sees a GPU, else None."""
    import faiss

    gpus = torch_gpu_count()
    if not gpus or not isinstance(faiss.downcast_index(index), faiss.IndexFlat):
        return None
    gpu = shard % gpus
    return TorchExactIndex.from_faiss(index, f"cuda:{gpu}"), f"cuda:{gpu} (torch exact)"
