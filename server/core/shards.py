"""The shard interface and its in-process implementation.

`LocalShard` and `RemoteShard` (server/core/remote.py) answer the same `search(query, timeout)`, so the
replica and fan-out code runs any operation on any shard. A local shard owns one shard of one
build: the faiss index, the tantivy index and the SQLite chunk store, loaded and verified together.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Executor
from pathlib import Path
from typing import Optional, Protocol

import numpy as np

from server.backends.dense import DenseIndex, RowFilter, SearchKnobs, exact_search
from server.backends.device import Device
from server.backends.docstore import PUBLIC_ACL, DocStore
from server.backends.lexical import LexicalIndex
from server.core.collection import ReleaseDescriptor
from server.core.types import Candidate, ShardQuery, ShardResult
from server.errors import FailedPrecondition, InvalidArgument, ModelMismatch


class Shard(Protocol):
    shard_no: int

    async def search(self, query: ShardQuery, timeout: Optional[float]) -> ShardResult: ...


def shard_dir_name(shard_no: int) -> str:
    return f"shard-{shard_no:03d}"


class LocalShard:
    """One shard of a build, searched in a worker thread (faiss and tantivy release the GIL).

    Restriction (tenant, ACL scopes, metadata filters, liveness) is decided by the chunk store and
    applied inside both searches, never after them:
    - dense: a bitmap selector (faiss IDSelectorBitmap) over the shard's rows; when the allowed set
      is small (<= exact_max_rows) it is searched exactly by brute force over just those rows, and an
      ANN search that returns fewer results than the allowed set could fill is redone exactly, so a
      tiny tenant or a selective filter still gets a full page;
    - a tenant with a dedicated index (built for tenants above a size threshold) is searched in it;
    - lexical: MUST clauses on tenant, ACL and metadata terms (and the row set for range filters).
    """

    MASK_CACHE = 64
    EXACT_MAX_ROWS = 20_000

    def __init__(self, desc: ReleaseDescriptor, build_dir: Path, shard_no: int,
                 device: Optional[Device] = None, executor: Optional[Executor] = None):
        self.desc = desc
        self.shard_no = shard_no
        name = shard_dir_name(shard_no)
        directory = build_dir / name
        knobs = SearchKnobs(**desc.search_defaults) if desc.search_defaults else SearchKnobs()
        files = desc.shard_files.get(name, {})
        self.dense = DenseIndex.load(directory, desc.metric, files, knobs, device, shard_no)
        if self.dense.dim != desc.dim:
            raise FailedPrecondition(f"{directory}: index dim {self.dense.dim} != descriptor {desc.dim}")
        self.tenant_dense: dict[str, DenseIndex] = {}
        for tenant in desc.dedicated_tenants.get(name, []):
            tdir = directory / "tenants" / tenant
            self.tenant_dense[tenant] = DenseIndex.load(tdir, desc.metric, files.get(f"tenants/{tenant}"),
                                                        knobs, device, shard_no)
        vectors_path = directory / "vectors.npy"
        self.vectors = np.load(vectors_path, mmap_mode="r") if vectors_path.is_file() else None
        self.lexical = LexicalIndex.open(directory / "lexical")
        self.store = DocStore(directory / "docstore.sqlite")
        self.tenant_counts = self.store.tenants()
        self.acl_restricted = self.store.restricted_acl_rows()
        self.nrows = self.dense.ntotal
        self.executor = executor
        self._masks: OrderedDict[tuple, RowFilter] = OrderedDict()
        self._masks_lock = threading.Lock()

    @property
    def corpus_version(self) -> str:
        return self.desc.corpus_version

    def _row_filter(self, tenant: str, filters, scopes: tuple) -> Optional[RowFilter]:
        """None when every row is eligible (the single-tenant, public, unfiltered fast path)."""
        if (not filters and set(self.tenant_counts) <= {tenant} and not self.acl_restricted.get(tenant)
                and sum(self.tenant_counts.values()) == self.nrows):
            return None
        key = (tenant, scopes, filters)
        with self._masks_lock:
            hit = self._masks.get(key)
            if hit is not None:
                self._masks.move_to_end(key)
                return hit
        rf = RowFilter(self.store.allowed_mask(self.nrows, tenant, filters, scopes))
        with self._masks_lock:
            self._masks[key] = rf
            while len(self._masks) > self.MASK_CACHE:
                self._masks.popitem(last=False)
        return rf

    def _dense_search(self, vector: np.ndarray, k: int, tenant: str,
                      allowed: Optional[RowFilter]) -> list[tuple[int, float]]:
        """(row, score) best first, only allowed rows."""
        if allowed is not None and allowed.count == 0:
            return []
        sub = self.tenant_dense.get(tenant)
        if sub is not None:  # a dedicated index: its rows are this tenant's only
            sub_mask = allowed.mask[sub.row_ids] if allowed is not None else None
            sub_filter = None if sub_mask is None or sub_mask.all() else RowFilter(sub_mask)
            if sub_filter is None or sub_filter.count > self.EXACT_MAX_ROWS or self.vectors is None:
                scores, rows = sub.search(vector[None, :], k, sub_filter)
                found = [(int(sub.row_ids[r]), float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
                want = min(k, sub_filter.count if sub_filter else sub.ntotal)
                if len(found) >= want or self.vectors is None:
                    return found
        if allowed is not None and self.vectors is not None and allowed.count <= self.EXACT_MAX_ROWS:
            scores, rows = exact_search(self.vectors, allowed.rows, vector, k, self.desc.metric)
            return list(zip(rows.tolist(), scores.tolist()))
        scores, rows = self.dense.search(vector[None, :], k, allowed)
        found = [(int(r), float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
        want = min(k, allowed.count if allowed is not None else self.nrows)
        if len(found) < want and allowed is not None and self.vectors is not None:
            scores, rows = exact_search(self.vectors, allowed.rows, vector, k, self.desc.metric)
            return list(zip(rows.tolist(), scores.tolist()))
        return found

    def search_sync(self, q: ShardQuery) -> ShardResult:
        if q.build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {q.build_id}")
        scopes = tuple(sorted(set(q.acl_scopes) | {PUBLIC_ACL}))
        filters = tuple(q.filters)
        allowed = self._row_filter(q.tenant, filters, scopes)
        dense_rows: list[tuple[int, float]] = []
        dense_ms = lexical_ms = 0.0
        if q.vector is not None:
            if q.model_id != self.desc.model_id:
                raise ModelMismatch(f"query vector is from model {q.model_id!r}; this build "
                                    f"serves {self.desc.model_id!r}")
            if q.vector.shape != (self.desc.dim,):
                raise InvalidArgument(f"query vector has dimension {q.vector.shape[-1]}, "
                                      f"the collection's is {self.desc.dim}")
            t0 = time.perf_counter()
            dense_rows = self._dense_search(q.vector, q.dense_depth, q.tenant, allowed)
            dense_ms = (time.perf_counter() - t0) * 1e3
        lexical_rows: list[tuple[int, float]] = []
        if q.text:
            t0 = time.perf_counter()
            ranged = any(f.is_range for f in filters)
            scores, rows = self.lexical.search(
                q.text, q.lexical_depth, q.tenant,
                [(f.key, f.any_of) for f in filters if f.any_of], scopes,
                allowed.rows.tolist() if ranged and allowed is not None else None)
            lexical_rows = list(zip(rows, scores))
            lexical_ms = (time.perf_counter() - t0) * 1e3
        records = self.store.fetch(sorted({r for r, _ in dense_rows} | {r for r, _ in lexical_rows}))

        def candidates(pairs):
            out = []
            for row, score in pairs:
                rec = records.get(row)
                # re-check against the store, the authority on visibility
                if (rec is None or rec.tenant != q.tenant or not set(rec.acl) & set(scopes)
                        or (allowed is not None and not allowed.mask[row])):
                    continue
                out.append(Candidate(rec.chunk_id, score, rec, self.shard_no))
            return out

        return ShardResult(self.shard_no, self.desc.corpus_version, candidates(dense_rows),
                           candidates(lexical_rows), dense_ms, lexical_ms)

    async def search(self, query: ShardQuery, timeout: Optional[float] = None) -> ShardResult:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self.search_sync, query)
        return await asyncio.wait_for(fut, timeout) if timeout is not None else await fut

    def close(self) -> None:
        self.store.close()
