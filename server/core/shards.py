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

from server.backends.dense import DenseIndex, RowFilter, SearchKnobs
from server.backends.device import Device
from server.backends.docstore import DocStore
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
    """One shard of a build, searched in a worker thread (faiss and tantivy release the GIL)."""

    MASK_CACHE = 64

    def __init__(self, desc: ReleaseDescriptor, build_dir: Path, shard_no: int,
                 device: Optional[Device] = None, executor: Optional[Executor] = None):
        self.desc = desc
        self.shard_no = shard_no
        name = shard_dir_name(shard_no)
        directory = build_dir / name
        knobs = SearchKnobs(**desc.search_defaults) if desc.search_defaults else SearchKnobs()
        self.dense = DenseIndex.load(directory, desc.metric, desc.shard_files.get(name), knobs,
                                     device, shard_no)
        if self.dense.dim != desc.dim:
            raise FailedPrecondition(f"{directory}: index dim {self.dense.dim} != descriptor {desc.dim}")
        self.lexical = LexicalIndex.open(directory / "lexical")
        self.store = DocStore(directory / "docstore.sqlite")
        self.tenant_counts = self.store.tenants()
        self.nrows = self.dense.ntotal
        self.executor = executor
        self._masks: OrderedDict[tuple, RowFilter] = OrderedDict()
        self._masks_lock = threading.Lock()

    @property
    def corpus_version(self) -> str:
        return self.desc.corpus_version

    def _row_filter(self, tenant: str, filters) -> Optional[RowFilter]:
        """None when every row is eligible (the single-tenant, unfiltered fast path)."""
        if not filters and set(self.tenant_counts) <= {tenant} \
                and sum(self.tenant_counts.values()) == self.nrows:
            return None
        key = (tenant, tuple((f.key, f.any_of) for f in filters))
        with self._masks_lock:
            hit = self._masks.get(key)
            if hit is not None:
                self._masks.move_to_end(key)
                return hit
        mask = self.store.allowed_mask(self.nrows, tenant, [(f.key, f.any_of) for f in filters])
        rf = RowFilter(mask)
        with self._masks_lock:
            self._masks[key] = rf
            while len(self._masks) > self.MASK_CACHE:
                self._masks.popitem(last=False)
        return rf

    def search_sync(self, q: ShardQuery) -> ShardResult:
        if q.build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {q.build_id}")
        allowed = self._row_filter(q.tenant, q.filters)
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
            if allowed is None or allowed.count > 0:
                scores, rows = self.dense.search(q.vector[None, :], q.dense_depth, allowed)
                dense_rows = [(int(r), float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
            dense_ms = (time.perf_counter() - t0) * 1e3
        lexical_rows: list[tuple[int, float]] = []
        if q.text:
            t0 = time.perf_counter()
            scores, rows = self.lexical.search(q.text, q.lexical_depth, q.tenant,
                                               [(f.key, f.any_of) for f in q.filters])
            lexical_rows = list(zip(rows, scores))
            lexical_ms = (time.perf_counter() - t0) * 1e3
        records = self.store.fetch(sorted({r for r, _ in dense_rows} | {r for r, _ in lexical_rows}))

        def candidates(pairs):
            out = []
            for row, score in pairs:
                rec = records.get(row)
                # re-check against the store, the authority on visibility
                if rec is None or rec.tenant != q.tenant or (allowed is not None and not allowed.mask[row]):
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
