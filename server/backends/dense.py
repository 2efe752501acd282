"""Dense ANN over one shard with faiss, chosen by a factory string.

Rows are faiss's sequential ids (0..n-1 in add order); `row_ids` maps a row to its chunk id. Using
rows rather than an IDMap wrapper keeps search parameters intact through every index type (an
IDMap would re-wrap the selector and drop IVF/HNSW/refine parameters) and lets restriction use a
dense bitmap (faiss.IDSelectorBitmap), which costs one bit per row and O(1) per test.

Scores are returned "higher is better" for every metric: L2 distances are negated here so the
merge and fusion code never needs to know the metric.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import faiss
import numpy as np

from server.backends.device import Device
from server.errors import IndexCorruptError

log = logging.getLogger(__name__)
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}


@dataclass(frozen=True)
class SearchKnobs:
    """Search-time accuracy knobs; each applies only to the index types that have it."""

    nprobe: int = 32
    ef_search: int = 128
    k_factor: int = 4  # refine (exact re-scoring) shortlist = k * k_factor


# HNSW graphs are built with efConstruction 64 (faiss's default is 40; pgvector, hnswlib and
# Qdrant build with 64-100): a better graph needs a smaller efSearch for the same recall.
HNSW_EF_CONSTRUCTION = 64


def make_index(factory: str, dim: int, metric: str) -> faiss.Index:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, not {metric!r}")
    if re.search(r"IDMap", factory):
        raise ValueError("factory strings must not contain IDMap: rows map to chunk ids outside faiss")
    m = re.search(r"HNSW(\d+)", factory)
    if m and int(m.group(1)) < 2:  # faiss aborts (M=0) or crashes (M=1) while adding: no error
        raise ValueError(f"{factory}: HNSW needs at least 2 links per node (HNSW32 is usual)")
    m = re.search(r"NSG(\d+)", factory)
    if m and int(m.group(1)) < 8:  # faiss's graph build ran on for ever at R 0-4 (outside QA)
        raise ValueError(f"{factory}: NSG needs at least 8 links per node (NSG32 is usual)")
    try:
        index = faiss.index_factory(dim, factory, METRICS[metric])
    except RuntimeError as exc:
        raise ValueError(f"faiss cannot build factory string {factory!r}: {exc}") from exc
    inner = _unwrap(index)
    if isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    return index


def training_size(index: faiss.Index) -> int:
    """How many vectors k-means training wants for this index (0 when none is needed)."""
    inner = _unwrap(index)
    if isinstance(inner, faiss.IndexIVF):
        return min(max(inner.nlist * 40, 10_000), 200_000)
    return 0 if index.is_trained else 10_000


def _layers(index: faiss.Index) -> list:
    """The index and the ones it wraps, outermost first: a refine step (`...,RFlat`) and a
    vector transform in front (`PCA64,...`, `OPQ16,...`) wrap the index that is searched."""
    out = [faiss.downcast_index(index)]
    while True:
        if isinstance(out[-1], faiss.IndexRefine):
            out.append(faiss.downcast_index(out[-1].base_index))
        elif isinstance(out[-1], faiss.IndexPreTransform):
            out.append(faiss.downcast_index(out[-1].index))
        else:
            return out


def _unwrap(index: faiss.Index) -> faiss.Index:
    return _layers(index)[-1]


def has_refine(index: faiss.Index) -> bool:
    return any(isinstance(layer, faiss.IndexRefine) for layer in _layers(index))


def _search_params(index: faiss.Index, knobs: SearchKnobs,
                   sel: Optional[faiss.IDSelector]) -> Optional[faiss.SearchParameters]:
    """Parameters shaped like the index: a refine step takes its own, around its base's; a
    transform passes any other kind on to the index it wraps (faiss's IndexPreTransform), so it
    needs none. Outside QA: `PCA64,IVF1,Flat` got plain parameters, which its IVF refused once a
    delete or filter brought a selector, and never saw its nprobe."""
    top = faiss.downcast_index(index)
    if isinstance(top, faiss.IndexPreTransform):
        return _search_params(top.index, knobs, sel)
    if isinstance(top, faiss.IndexRefine):
        base = _search_params(top.base_index, knobs, sel)
        # (faiss's wrapper keeps `base` and the selector referenced by the outer object)
        return faiss.IndexRefineSearchParameters(k_factor=float(knobs.k_factor), base_index_params=base)
    if isinstance(top, faiss.IndexIVF):
        return faiss.SearchParametersIVF(nprobe=min(knobs.nprobe, top.nlist), sel=sel)
    if isinstance(top, faiss.IndexHNSW):
        return faiss.SearchParametersHNSW(efSearch=knobs.ef_search, sel=sel)
    return faiss.SearchParameters(sel=sel) if sel is not None else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """What a build records of one of its files, checked at publish and at load."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def recorded_problems(base: Path, files: dict, hashes: bool = True) -> list[str]:
    """Every file under `base` that differs from what a build recorded of it, as "PATH problem";
    `files` maps a name to {bytes, sha256}, or a directory's name to its own such map (the BM25
    segments, a dedicated tenant's index). `hashes=False`: presence and size only (fast)."""
    problems = []
    for name, want in files.items():
        if "bytes" not in want:
            problems += recorded_problems(base / name, want, hashes)
            continue
        problem = recorded_file_problem(base / name, want, hashes)
        if problem:
            problems.append(f"{base / name} {problem}")
    return problems


def recorded_file_problem(path: Path, want: dict, hashes: bool = True) -> Optional[str]:
    """What is wrong with a build file against what the build recorded of it ({bytes, sha256}),
    worded to follow the file's name; None when it is whole."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"is {size} bytes, the build recorded {want['bytes']} (truncated?)"
    if hashes and file_sha256(path) != want["sha256"]:
        return "fails its sha256 check (corrupted)"
    return None


class DenseIndex:
    """A trained faiss index plus the row -> chunk id map of one shard.

    On a GPU host `index` is the device copy (searched for unrestricted batches) and `cpu_index`
    the host copy, kept for searches with a selector (faiss GPU indexes take none) and for
    writing; both receive every add. Search parameters are built once per knob set and selector
    (creating SWIG parameter objects on every call cost more than a small search)."""

    def __init__(self, index: faiss.Index, row_ids: np.ndarray, metric: str,
                 knobs: SearchKnobs = SearchKnobs(), placement: str = "cpu",
                 cpu_index: Optional[faiss.Index] = None):
        if index.ntotal != len(row_ids):
            raise ValueError(f"index has {index.ntotal} vectors but {len(row_ids)} row ids")
        self.index = index
        self.cpu_index = cpu_index if cpu_index is not None else index
        self.row_ids = np.ascontiguousarray(row_ids, dtype=np.int64)
        self.metric = metric
        self.knobs = knobs
        self.placement = placement
        self.dim = index.d
        self._params: dict = {}
        inner = _unwrap(faiss.downcast_index(self.cpu_index))
        self._graph = isinstance(inner, faiss.IndexHNSW)
        self._nlist = int(inner.nlist) if isinstance(inner, faiss.IndexIVF) else 0
        self._ivf_flat = isinstance(inner, faiss.IndexIVFFlat)  # its lists hold whole vectors

    @property
    def ntotal(self) -> int:
        # the row map grows with every add, so it counts the index's vectors; reading faiss's own
        # ntotal through SWIG costs microseconds on every search
        return len(self.row_ids)

    def params(self, knobs: SearchKnobs, allowed: Optional["RowFilter"] = None):
        """faiss SearchParameters for these knobs and restriction, made once: unrestricted ones
        are cached here, restricted ones on the RowFilter (which lives until the next write)."""
        cache = self._params if allowed is None else allowed.params
        key = (id(self), knobs)
        if key not in cache:
            cache[key] = _search_params(self.cpu_index, knobs, allowed.selector if allowed else None)
        return cache[key]

    def search(self, queries: np.ndarray, k: int, allowed: Optional["RowFilter"] = None,
               knobs: Optional[SearchKnobs] = None,
               on_cpu: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-k rows for each query (one batched faiss call). Returns (scores, rows), higher
        score is better, row -1 = none.

        `allowed` restricts the search itself (faiss IDSelector), so a small allowed set still
        yields k results when k rows are allowed. `on_cpu`: the host copy with per-call
        parameters, never the device's (whose nprobe is set on the shared index and capped at
        2,048 by faiss GPU): the exhaustive redo of a short IVF page.
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        n = self.ntotal
        k = max(1, min(k, n)) if n else 1
        if n == 0:
            nq = queries.shape[0]
            return np.full((nq, k), -np.inf, np.float32), np.full((nq, k), -1, np.int64)
        knobs = knobs or self.knobs
        if self._graph and k > knobs.ef_search:
            # a graph search keeps ef candidates, and faiss does not raise ef to k: the tuned ef
            # (chosen for recall@10) would fill a deep page (hybrid's 100) badly - recall@100
            # 0.57 at ef 16 on the WordNet vectors, 0.91 at ef 100 (hnswlib's rule: ef >= k)
            knobs = replace(knobs, ef_search=k)
        if self.placement != "cpu" and allowed is None and not on_cpu:  # GPU: no selector
            scores, rows = self.index.search(queries, k, params=_gpu_params(self.index, knobs, k))
        elif allowed is not None and getattr(self.index, "takes_masks", False):
            # the device's exact Flat copy (gpu_exact.py) filters by the mask itself
            scores, rows = self.index.search(queries, k, allowed=allowed)
        else:
            if allowed is not None:
                knobs = self.filtered_knobs(knobs, allowed.count)
            scores, rows = self.cpu_index.search(queries, k, params=self.params(knobs, allowed))
        if self.metric == "l2":
            scores = -scores
        scores[rows < 0] = -np.inf
        return scores, rows

    # a filtered IVF search probes at most this many times the tuned lists: its cost grows with
    # the factor, and smaller allowed sets are searched exactly (up to 20,000 rows) or, when a
    # page comes back short, redone exactly
    MAX_FILTER_PROBE_FACTOR = 10

    def filtered_knobs(self, knobs: SearchKnobs, allowed_count: int) -> SearchKnobs:
        """An IVF search restricted to `allowed_count` of its rows probes nprobe / share lists
        (at most MAX_FILTER_PROBE_FACTOR times nprobe, at most all): it then compares about as
        many allowed vectors as the unfiltered search its nprobe was tuned on. With the tuned
        nprobe recall fell with the share (outside QA: IVF64 at nprobe 12, recall@10 0.983
        unfiltered, 0.942 under a filter allowing 45%). Other indexes keep their knobs (faiss's
        HNSW walks on past the rows a selector refuses)."""
        n = self.ntotal
        if not self._nlist or knobs.nprobe >= self._nlist or allowed_count >= n:
            return knobs
        # rounded: a few tombstones (a share of 0.99) do not cost a whole extra list per query
        scaled = round(knobs.nprobe * n / max(allowed_count, 1))
        return replace(knobs, nprobe=min(self._nlist, knobs.nprobe * self.MAX_FILTER_PROBE_FACTOR,
                                         max(knobs.nprobe, scaled)))

    def exact_is_cheaper(self, allowed_count: int) -> bool:
        """Whether brute force over the allowed rows compares no more vectors than the filtered
        IVF-Flat search would (its nlist centroids, then its probed lists' share of the rows): so
        at a small share, where filtered_knobs probes many lists for few allowed vectors. Only an
        IVF-Flat: compressed codes (PQ, SQ) cost far less to compare than the float vectors brute
        force reads (review)."""
        if not self._ivf_flat or allowed_count >= self.ntotal:
            return False
        nprobe = self.filtered_knobs(self.knobs, allowed_count).nprobe
        return allowed_count <= self._nlist + nprobe * self.ntotal / self._nlist

    def exhaustive_knobs(self) -> Optional[SearchKnobs]:
        """Knobs that probe every inverted list of an IVF index (None for other indexes): a page
        the tuned nprobe left short - its lists held fewer than k vectors - is filled by them."""
        inner = _unwrap(self.cpu_index)
        if isinstance(inner, faiss.IndexIVF) and self.knobs.nprobe < inner.nlist:
            return replace(self.knobs, nprobe=int(inner.nlist))
        return None

    def add(self, vectors: np.ndarray, chunk_ids: np.ndarray) -> int:
        """Append rows (streaming upserts); returns the first new row number."""
        first = self.ntotal
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        self.cpu_index.add(x)
        if self.index is not self.cpu_index:
            try:
                self.index.add(x)
            except RuntimeError as exc:  # a CAGRA graph takes no adds: serve from the CPU index
                log.warning("the %s index took no streaming add (%s); searching the CPU index "
                            "until the next build", self.placement, exc)
                self.index, self.placement = self.cpu_index, "cpu"
        self.row_ids = np.concatenate([self.row_ids, np.asarray(chunk_ids, dtype=np.int64)])
        return first

    def close(self) -> None:
        """Free the device copy (a retired build's); later searches use the CPU index."""
        device, self.index, self.placement = self.index, self.cpu_index, "cpu"
        if device is not self.cpu_index and hasattr(device, "close"):
            device.close()

    def chunk_ids(self, rows: np.ndarray) -> np.ndarray:
        out = np.full(rows.shape, -1, np.int64)
        ok = rows >= 0
        out[ok] = self.row_ids[rows[ok]]
        return out

    # --- persistence -------------------------------------------------------------------------
    def write(self, directory: Path) -> dict:
        """Write index + row map to temporary names, rename into place; return file checksums."""
        directory.mkdir(parents=True, exist_ok=True)
        files = {}
        index_path, rows_path = directory / "dense.faiss", directory / "rows.npy"
        tmp = index_path.with_suffix(".faiss.tmp")
        faiss.write_index(self.cpu_index, str(tmp))
        tmp.replace(index_path)
        tmp_rows = directory / "rows.tmp.npy"
        np.save(tmp_rows, self.row_ids)
        tmp_rows.replace(rows_path)
        for p in (index_path, rows_path):
            files[p.name] = file_record(p)
        return files

    @classmethod
    def load(cls, directory: Path, metric: str, expected: Optional[dict] = None,
             knobs: SearchKnobs = SearchKnobs(), device: Optional[Device] = None,
             shard: int = 0) -> "DenseIndex":
        """Load and verify. A missing, truncated or corrupted file raises IndexCorruptError naming it."""
        index_path, rows_path = directory / "dense.faiss", directory / "rows.npy"
        for p in (index_path, rows_path):
            if not p.is_file():
                raise IndexCorruptError(f"missing index file {p}")
            want = (expected or {}).get(p.name)
            problem = recorded_file_problem(p, want) if want else None
            if problem:
                raise IndexCorruptError(f"index file {p} {problem}")
        try:
            index = faiss.read_index(str(index_path))
        except Exception as exc:
            raise IndexCorruptError(f"faiss cannot read index file {index_path}: {exc}") from exc
        try:
            row_ids = np.load(rows_path, allow_pickle=False)
        except Exception as exc:
            raise IndexCorruptError(f"cannot read row map {rows_path}: {exc}") from exc
        if index.ntotal != len(row_ids):
            raise IndexCorruptError(
                f"{index_path} holds {index.ntotal} vectors but {rows_path} maps {len(row_ids)} rows")
        placement, cpu_index = "cpu", index
        if device is not None:
            index, placement = device.place_index(index, shard)
        return cls(index, row_ids, metric, knobs, placement, cpu_index)


class RowFilter:
    """An allowed set of rows as a bitmap, with the faiss selector that reads it in place."""

    def __init__(self, mask: np.ndarray):
        self.mask = mask
        self.count = int(mask.sum())
        self._bits = np.packbits(mask, bitorder="little")  # faiss reads bit i of byte i>>3
        # n is the bitmap's size in BYTES: rows past the mask (added after it was made) read as
        # "not allowed" instead of reading past the buffer
        self.selector = faiss.IDSelectorBitmap(len(self._bits), faiss.swig_ptr(self._bits))
        self._rows: Optional[np.ndarray] = None
        self.params: dict = {}  # search parameters built around this selector, per index and knobs

    @property
    def rows(self) -> np.ndarray:
        if self._rows is None:
            self._rows = np.flatnonzero(self.mask)
        return self._rows


def exact_search(vectors, rows: np.ndarray, queries: np.ndarray, k: int,
                 metric: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Brute force over the given rows only, for a batch of queries: exact, and a full page
    whenever k rows are allowed. Returns (scores, rows) per query, best first.

    Used for small allowed sets (tiny tenants, selective filters), where graph or inverted-list
    search with a selector can miss results, and where a scan of the few rows is cheaper anyway.
    """
    queries = np.atleast_2d(np.asarray(queries, dtype=np.float32))
    if len(rows) == 0:
        return [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in range(len(queries))]
    block = np.asarray(vectors[rows], dtype=np.float32)
    dim = block.shape[1]
    b_max = 1.0  # an ip collection stores unit vectors (validation.unit_vectors scales each)
    if metric == "l2":  # -|b - q|^2 = 2 b.q - |b|^2 - |q|^2, about the rows' mean: far from the
        # origin the expansion's terms are huge and cancel, in float32 (vectors 1e4 out gave
        # the wrong neighbours and positive "distances"); distances do not move with the origin
        centre = block.mean(0, dtype=np.float64).astype(np.float32)
        block, queries = block - centre, queries - centre
        sq = np.einsum("ij,ij->i", block, block)  # |b|^2 per row (float32: for a bound, enough)
        b_max = float(np.sqrt(sq.max())) * 1.001
        scores = (2 * (queries @ block.T) - sq[None, :]
                  - (queries * queries).sum(1)[:, None])
    else:
        scores = queries @ block.T                   # (queries, rows): one contiguous row each
    k = min(k, len(rows))
    # float32 products round differently with a row's position in the block and the batch's size
    # (BLAS kernels): one query's scores moved by ~1e-7 with what was searched beside it, and
    # equal vectors scored unequal (outside QA: identical documents got three scores; which one
    # a page kept changed between Search and a batch). Every row whose float32 score lies within
    # float32's error bound of the k-th is scored again in float64, rounded once: the same scores
    # alone or in any batch, equal ones in row order. The bound: a length-d float32 dot product
    # errs by at most ~d * 2^-24 * |q| |b| (the l2 expansion by that on |q|^2 + |b|^2), doubled
    eps = 2.0 * dim * 2.0 ** -24
    q_norms = np.sqrt((queries.astype(np.float64) ** 2).sum(1))
    wide = None  # the block in float64, made once when most rows need rescoring
    out = []
    for j in range(queries.shape[0]):
        col = scores[j]
        q_n = float(q_norms[j])
        tol = eps * (q_n * q_n + b_max * b_max if metric == "l2" else q_n * b_max)
        kth = col[np.argpartition(-col, k - 1)[k - 1]] if k < len(col) else col.min()
        near = np.flatnonzero(col >= kth - tol)
        if 2 * len(near) > len(col):
            if wide is None:
                wide = block.astype(np.float64)
            exact = _exact_scores(wide[near], queries[j], metric)
        else:
            exact = _exact_scores(block[near], queries[j], metric)
        top = np.lexsort((rows[near], -exact))[:k]
        out.append((exact[top], rows[near][top].astype(np.int64)))
    return out


def _exact_scores(block: np.ndarray, query: np.ndarray, metric: str) -> np.ndarray:
    """Scores of a few rows for one query in float64, rounded to float32 once."""
    b, q = block.astype(np.float64), query.astype(np.float64)
    if metric == "l2":
        d = b - q
        return (-np.einsum("ij,ij->i", d, d)).astype(np.float32)
    return (b @ q).astype(np.float32)


def _gpu_params(index, knobs: SearchKnobs, k: int):
    """GPU search knobs: CAGRA's internal top-k list (efSearch's role), IVF's nprobe."""
    if hasattr(faiss, "SearchParametersCagra") and type(index).__name__ == "GpuIndexCagra":
        params = faiss.SearchParametersCagra()
        params.itopk_size = max(k, knobs.ef_search)
        return params
    if hasattr(index, "nprobe"):
        index.nprobe = knobs.nprobe
    return None


def _skip_polysemous_training(index: faiss.Index) -> None:
    """PQ codes are searched by asymmetric distance here, never by polysemous Hamming filtering,
    so the polysemous training faiss runs by default (most of an IVF-PQ build's time) is skipped."""
    inner = _unwrap(index)
    for candidate in (inner, getattr(inner, "pq", None)):
        if candidate is not None and hasattr(candidate, "do_polysemous_training"):
            candidate.do_polysemous_training = False


def build_dense(factory: str, dim: int, metric: str, vectors: Callable[[], "np.ndarray"],
                sample: np.ndarray, row_ids: np.ndarray, block: int = 16384,
                progress: Optional[Callable[[int], None]] = None,
                training=contextlib.nullcontext) -> DenseIndex:
    """Train on `sample`, then add `vectors()` in blocks (row order = row_ids order).
    `training(what)`: a context manager around the training (one faiss call, which reports no
    progress of its own), e.g. to show that it runs."""
    index = make_index(factory, dim, metric)
    if not index.is_trained:
        if len(sample) == 0:
            raise ValueError(f"{factory} needs training vectors, and the shard has none")
        inner = _unwrap(index)
        if isinstance(inner, faiss.IndexIVF) and len(sample) < inner.nlist:
            raise ValueError(f"{factory}: {len(sample)} training vectors for {inner.nlist} lists; "
                             f"use fewer lists (e.g. IVF{max(1, len(sample) // 39)}) for this corpus")
        _skip_polysemous_training(index)
        with training(f"train {factory} on {len(sample):,} vectors"):
            try:
                index.train(np.ascontiguousarray(sample, dtype=np.float32))
            except RuntimeError as exc:  # e.g. a PQ's 256 centroids from 20 training vectors
                raise ValueError(f"{factory}: faiss cannot train it on {len(sample):,} vectors "
                                 f"({_faiss_reason(exc)}); use a smaller index or a larger corpus") from None
    x = vectors()
    for start in range(0, len(x), block):
        try:
            index.add(np.ascontiguousarray(x[start:start + block], dtype=np.float32))
        except RuntimeError as exc:  # e.g. NSG: "cannot build a graph smaller than 100"
            raise ValueError(f"{factory}: faiss cannot build it on {len(x):,} vectors "
                             f"({_faiss_reason(exc)})") from None
        if progress:
            progress(min(block, len(x) - start))
    return DenseIndex(index, row_ids, metric)


def _faiss_reason(exc: RuntimeError) -> str:
    """faiss's own sentence out of its "Error in FUNCTION at FILE:LINE: Error: 'CONDITION' failed:
    SENTENCE" (the sentence when there is one, else the condition or the message)."""
    text = " ".join(str(exc).split())
    m = (re.search(r"' failed: (.+)$", text) or re.search(r"Error: '(.*?)' failed$", text)
         or re.search(r"Error: (.+)$", text) or re.search(r"^Error in .*? at \S+:\d+: (.+)$", text))
    return (m.group(1) if m else text).strip(" '")[:300]
