"""Exact (Flat) search on a GPU through torch, for hosts where faiss cannot search on the GPU.

PyPI's faiss-gpu-cu12 carries kernels for compute capability 7.0 and 8.0 only: on a Hopper GPU
(H100, H200: 9.0) its first GPU search aborts the process, and a faiss-cpu install has no GPU
path at all. torch, installed for the models, runs on any GPU its wheel supports. A Flat index is
a matrix of vectors, so its search is a matrix product and a top-k - the shape GPUs are built for
(cuVS's brute force does the same). Being exact, it also takes a restriction as a mask, so
filtered and tenant-restricted searches stay on the device too.

Answers match the CPU Flat index's, and do not depend on the batch a query rides in: candidates
are chosen by fp32 products, a few more than asked for, then re-scored in float64 and ordered by
(score, row) - the rule of `dense.exact_search`. L2 vectors are stored minus a fixed centre, so
|q - b|^2 does not lose its digits to |q|^2 + |b|^2 far from the origin.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np

# scores held at once: rows are searched in blocks whose (queries, block) score matrix stays under
# this many bytes, so a 1,024-query batch over 10M rows needs no 40 GB, and each block of the
# matrix is read once per batch slice
SCORE_BYTES = 1 << 28
QUERY_SLICE = 1024        # queries per pass over the rows
RESCORE_MARGIN = 16       # candidates beyond k re-scored in float64 (fp32 near-ties at the cut)
LOAD_ROWS = 1 << 16       # rows copied to the device at a time (no second full copy there)


class TorchExactIndex:
    """The vectors of a faiss Flat index on a torch device, searched by matrix product.

    Speaks the part of faiss's index interface DenseIndex uses: `d`, `ntotal`, `metric_type`,
    `search(queries, k, params=None, allowed=None)` -> (distances, labels) in faiss's conventions
    (inner product: larger first; L2: squared distance, smaller first; -1 labels where fewer than
    k rows qualify) and `add(x)`. `allowed` is a dense.RowFilter: rows outside its mask, and rows
    added after it was made, never answer. Adds grow the buffer by a quarter, not by doubling, so
    an index near the device's memory still takes streaming upserts."""

    takes_masks = True  # DenseIndex sends restricted searches here too

    def __init__(self, vectors: np.ndarray, metric: str, device: str,
                 score_bytes: int = SCORE_BYTES):
        import torch

        if metric not in ("ip", "l2"):
            raise ValueError(f"metric must be ip or l2, not {metric!r}")
        self._torch = torch
        self.device = torch.device(device)
        self.metric = metric
        self.metric_type = 0 if metric == "ip" else 1  # faiss.METRIC_INNER_PRODUCT / METRIC_L2
        x = np.asarray(vectors, dtype=np.float32)
        self.d = int(x.shape[1])
        self.ntotal = 0
        self._score_bytes = score_bytes
        self._lock = threading.Lock()  # adds replace the buffer; searches read a consistent view
        # L2: the mean of the first rows, fixed for the index's life (later adds use it too)
        self._centre = (torch.from_numpy(x.mean(axis=0, dtype=np.float64).astype(np.float32))
                        .to(self.device) if metric == "l2" and len(x) else None)
        self._buf = torch.empty((len(x) + max(1024, len(x) // 32), self.d), dtype=torch.float32,
                                device=self.device)
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
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.d:
            raise ValueError(f"vectors must be (n, {self.d}), not {x.shape}")
        if not len(x):
            return
        with self._lock:
            if self._buf is None:
                raise RuntimeError("this device index was closed")
            if self.metric == "l2" and self._centre is None:
                self._centre = torch.from_numpy(x.mean(axis=0, dtype=np.float64)
                                                .astype(np.float32)).to(self.device)
            need = self.ntotal + len(x)
            if need > self._buf.shape[0]:
                rows = max(need, self._buf.shape[0] + self._buf.shape[0] // 4) + 1024
                grown = torch.empty((rows, self.d), dtype=torch.float32, device=self.device)
                grown[:self.ntotal] = self._buf[:self.ntotal]
                norms = torch.empty(rows, dtype=torch.float32, device=self.device)
                norms[:self.ntotal] = self._norms[:self.ntotal]
                self._buf, self._norms = grown, norms
            for a in range(0, len(x), LOAD_ROWS):
                block = torch.from_numpy(np.ascontiguousarray(x[a:a + LOAD_ROWS])).to(self.device)
                if self._centre is not None:  # not in place: on the CPU device `block` is x itself
                    block = block - self._centre
                at = self.ntotal + a
                self._buf[at:at + len(block)] = block
                self._norms[at:at + len(block)] = torch.einsum("ij,ij->i", block, block)
            self.ntotal = need

    def close(self) -> None:
        """Give the device memory back (a build switch retires this shard's index)."""
        with self._lock:
            self._buf = self._norms = None
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()

    def _mask(self, allowed) -> "object":
        key = (id(self), "mask")
        mask = allowed.params.get(key)
        if mask is None:  # one upload per RowFilter, which lives until the next write
            mask = allowed.params[key] = self._torch.from_numpy(allowed.mask).to(self.device)
        return mask

    def search(self, queries: np.ndarray, k: int, params=None,
               allowed=None) -> tuple[np.ndarray, np.ndarray]:
        torch = self._torch
        q = np.ascontiguousarray(queries, dtype=np.float32)
        nq = q.shape[0]
        with self._lock:
            n, base, norms = self.ntotal, self._buf, self._norms
        if base is None:
            raise RuntimeError("this device index was closed")
        ip = self.metric == "ip"
        distances = np.full((nq, k), -np.inf if ip else np.inf, np.float32)
        labels = np.full((nq, k), -1, np.int64)
        mask = None
        if allowed is not None:
            mask = self._mask(allowed)
            n = min(n, int(mask.shape[0]))  # rows added after the mask was made are not allowed
        if n == 0 or nq == 0 or k <= 0:
            return distances, labels
        want = min(n, k + RESCORE_MARGIN)
        with torch.inference_mode():
            qt = torch.from_numpy(q).to(self.device)
            if self._centre is not None:
                qt = qt - self._centre
            for s in range(0, nq, QUERY_SLICE):
                part = qt[s:s + QUERY_SLICE]
                cand = self._candidates(part, base, norms, n, want, mask)
                # float64 rows gathered per candidate: slices of queries keep them under SCORE_BYTES
                step = max(1, self._score_bytes // (8 * want * self.d))
                for r in range(0, len(part), step):
                    top, rows = self._rescore(part[r:r + step], base, cand[r:r + step])
                    kk = min(k, top.shape[1])
                    at = s + r
                    distances[at:at + len(top), :kk] = top[:, :kk].cpu().numpy()
                    labels[at:at + len(top), :kk] = rows[:, :kk].cpu().numpy()
        return distances, labels

    def _candidates(self, part, base, norms, n: int, want: int, mask):
        """The `want` best rows per query by fp32 products (larger is better: q.b for inner
        product, 2 q.b - |b|^2 for L2, which orders rows as -|q - b|^2 does); -1 where the mask
        leaves fewer. Row blocks keep the score matrix under SCORE_BYTES."""
        torch = self._torch
        block = max(want, self._score_bytes // (4 * len(part)))
        vals, rows = [], []
        for a in range(0, n, block):
            b = min(n, a + block)
            if self.metric == "ip":
                scores = part @ base[a:b].T
            else:
                scores = torch.addmm(norms[a:b].neg().unsqueeze(0), part, base[a:b].T, alpha=2)
            if mask is not None:
                scores.masked_fill_(~mask[a:b], float("-inf"))
            v, i = torch.topk(scores, min(want, b - a), dim=1)
            vals.append(v)
            rows.append(i + a)
        v, i = torch.cat(vals, dim=1), torch.cat(rows, dim=1)
        if v.shape[1] > want:
            v, pick = torch.topk(v, want, dim=1)
            i = torch.gather(i, 1, pick)
        return i.masked_fill_(torch.isneginf(v), -1)

    def _rescore(self, part, base, cand):
        """Candidates' scores in float64, ordered by (score, row) - independent of which other
        queries shared the batch. Returns faiss-convention (distances, labels)."""
        torch = self._torch
        ip = self.metric == "ip"
        valid = cand >= 0
        rows = base[cand.clamp_min(0)].double()            # (queries, want, d)
        q = part.double().unsqueeze(1)
        if ip:
            score = (rows * q).sum(dim=2)
        else:
            score = -((rows - q) ** 2).sum(dim=2)
        score = score.masked_fill(~valid, float("-inf"))
        # lexicographic (score desc, row asc): sort by row, then stably by score
        by_row = torch.sort(cand.masked_fill(~valid, torch.iinfo(torch.int64).max), dim=1).indices
        score, cand = torch.gather(score, 1, by_row), torch.gather(cand, 1, by_row)
        order = torch.sort(score, dim=1, descending=True, stable=True).indices
        score, cand = torch.gather(score, 1, order), torch.gather(cand, 1, order)
        out = score.float() if ip else (-score).clamp_min(0).float()
        return out.masked_fill(cand < 0, float("-inf") if ip else float("inf")), cand


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
