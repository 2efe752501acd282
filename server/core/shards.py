"""The shard interface and its in-process implementation.

`LocalShard` and `RemoteShard` (server/core/remote.py) answer the same `search(query, timeout)`, so the
replica and fan-out code runs any operation on any shard. A local shard owns one shard of one
build: the faiss index, the tantivy index and the SQLite chunk store, loaded and verified together.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import Executor
from pathlib import Path
from typing import Optional, Protocol, Sequence

import numpy as np

from server.backends.dense import DenseIndex, RowFilter, SearchKnobs, exact_search
from server.backends.device import Device
from server.backends.docstore import PUBLIC_ACL, ChunkRecord, DocStore
from server.core import metrics
from server.core.chunking import chunk_id
from server.core.rwlock import RWLock
from server.backends.lexical import LexicalIndex
from server.core.collection import ReleaseDescriptor
from server.core.types import Candidate, ShardQuery, ShardResult
from server.errors import FailedPrecondition, InvalidArgument, ModelMismatch

log = logging.getLogger(__name__)

class Shard(Protocol):
    shard_no: int

    async def search(self, query: ShardQuery, timeout: Optional[float]) -> ShardResult: ...

    async def fetch_chunks(self, build_id: str, tenant: str, acl_scopes: Sequence[str],
                           rows: Sequence[int], timeout: Optional[float] = None) -> list[Candidate]: ...


def shard_dir_name(shard_no: int) -> str:
    return f"shard-{shard_no:03d}"


class ShardVectors:
    """Exact vectors by row: the build's vectors.npy (memory-mapped) plus rows added since."""

    def __init__(self, base: Optional[np.ndarray], dim: int):
        self.base = base
        self.base_n = len(base) if base is not None else 0
        self.added = np.zeros((0, dim), np.float32)

    def append(self, vectors: np.ndarray) -> None:
        self.added = np.concatenate([self.added, np.asarray(vectors, np.float32)])

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        if self.base is None:
            raise LookupError("this build has no vectors.npy")
        if len(rows) and rows.max() < self.base_n:
            return np.asarray(self.base[rows])
        out = np.empty((len(rows), self.added.shape[1]), np.float32)
        low = rows < self.base_n
        out[low] = self.base[rows[low]]
        out[~low] = self.added[rows[~low] - self.base_n]
        return out


class LocalShard:
    """One shard of a build, searched in worker threads (faiss and tantivy release the GIL).

    Restriction (tenant, ACL scopes, metadata filters, liveness) is decided by the chunk store and
    applied inside both searches, never after them:
    - dense: a bitmap selector (faiss IDSelectorBitmap) over the shard's rows; when the allowed set
      is small (<= max(2,000 rows, 1% of the shard), capped at 20,000) it is searched exactly by
      brute force over just those rows, and an ANN search that returns fewer results than the
      allowed set could fill is redone exactly, so a tiny tenant or a selective filter still gets
      a full page;
    - a tenant with a dedicated index (built for tenants above a size threshold) is searched in it;
    - lexical: MUST clauses on tenant, ACL and metadata terms (and the row set for range filters),
      and every hit re-checked against the same mask.

    Streaming writes (apply_write) follow the store's protocol: the new version's chunks are
    written durable but invisible (pending), added to faiss and tantivy, then ONE SQLite transaction
    makes them live and the old ones dead. A crash before that transaction leaves the old version
    served; recovery at load orphans pending rows and purges dead ones from the lexical index.
    A readers-writer lock makes each search see one index version in both branches.
    """

    MASK_CACHE = 64
    # Brute force over the allowed rows when they are few: below ~1% of the shard a graph or
    # inverted-list search with a selector returns short or wrong pages, and a scan of <= 2,000
    # rows costs ~0.2 ms. Above that, ANN with the selector is 5-25x faster at recall ~0.99
    # (bench/bench_tenants.py), and a short page still falls back to exact.
    EXACT_MIN_ROWS = 2_000
    EXACT_MAX_FRACTION = 0.01
    EXACT_MAX_ROWS = 20_000

    def _exact_limit(self) -> int:
        return min(self.EXACT_MAX_ROWS, max(self.EXACT_MIN_ROWS, int(self.EXACT_MAX_FRACTION * self.nrows)))

    def __init__(self, desc: ReleaseDescriptor, build_dir: Path, shard_no: int,
                 device: Optional[Device] = None, executor: Optional[Executor] = None):
        self.desc = desc
        self.shard_no = shard_no
        name = shard_dir_name(shard_no)
        directory = build_dir / name
        self.directory = directory
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
        self.vectors = ShardVectors(np.load(vectors_path, mmap_mode="r") if vectors_path.is_file()
                                    else None, desc.dim)
        self.lexical = LexicalIndex.open(directory / "lexical")
        self.store = DocStore(directory / "docstore.sqlite")
        self.executor = executor
        self._rw = RWLock()
        self._write_mutex = threading.Lock()
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()  # static part, by key
        self._filters: dict[tuple, tuple[int, RowFilter]] = {}       # (generation, filter)
        self._masks_lock = threading.Lock()
        self.recovered = self._recover()
        self._refresh_counts()

    # --- load-time recovery ------------------------------------------------------------------
    def _recover(self) -> dict:
        """Rebuild in-memory state from the store (the authority) after any stop, clean or not."""
        orphaned = self.store.orphan_pending()
        base_n = self.dense.ntotal
        rows, ids, vecs = self.store.added_vectors(base_n)
        if len(rows):
            if not np.array_equal(rows, np.arange(base_n, base_n + len(rows))):
                raise FailedPrecondition(f"{self.directory}: added rows are not contiguous from {base_n}")
            self.dense.add(vecs, ids)
            self.vectors.append(vecs)
        purge = self.store.unpurged()
        self.lexical.delete_rows(purge)
        self.store.mark_purged(purge)
        self.nrows = self.dense.ntotal
        self.live = np.zeros(self.nrows, dtype=bool)
        self.live[self.store.live_rows()] = True
        # a shard that took streaming writes is checked row by row (a count can balance an extra
        # row against a missing one); an untouched build was reconciled by its audit
        touched = len(rows) > 0 or self.store.last_write_seq() > 0
        repaired = self._check_lexical("at load", full=touched)
        return {"orphaned": orphaned, "replayed_rows": int(len(rows)), "purged": len(purge),
                "lexical_repaired": repaired}

    def _check_lexical(self, when: str, full: bool = False) -> int:
        """Invariant 7: the BM25 index holds exactly the live rows. Checked by count after every
        write, row by row at load; on a mismatch the index is repaired (extra rows deleted,
        missing live rows re-added from the store). Returns the rows repaired."""
        live = int(self.live.sum())
        if not full and self.lexical.num_docs() == live:
            return 0
        indexed = np.asarray(self.lexical.indexed_rows(), dtype=np.int64)
        in_range = indexed < self.nrows
        extra = np.concatenate([indexed[~in_range], indexed[in_range][~self.live[indexed[in_range]]]])
        present = np.zeros(self.nrows, dtype=bool)
        present[indexed[in_range]] = True
        missing = np.flatnonzero(self.live & ~present)
        if not len(extra) and not len(missing):
            return 0
        metrics.LEXICAL_REPAIRS.labels(self.desc.collection, str(self.shard_no)).inc(
            len(extra) + len(missing))
        log.error("shard %d (%s): BM25 index disagreed with the store %s: %d extra, %d missing "
                  "rows; repaired", self.shard_no, self.directory, when, len(extra), len(missing))
        with self._rw.write():
            self.lexical.delete_rows(extra.tolist())
            if len(missing):
                records = self.store.fetch(missing.tolist())
                self.lexical.add_committed((r.row, r.title, r.text, r.tenant, r.metadata, r.acl)
                                           for r in records.values())
        return int(len(extra) + len(missing))

    def _refresh_counts(self) -> None:
        self.tenant_counts = self.store.tenants()
        self.acl_restricted = self.store.restricted_acl_rows()
        self.index_version = self.store.index_version()
        self.generation = getattr(self, "generation", 0) + 1
        states = self.store.row_states()
        total = max(1, sum(states.values()))
        metrics.TOMBSTONE_RATIO.labels(self.desc.collection, str(self.shard_no)).set(
            (states["dead"] + states["orphan"]) / total)
        metrics.ORPHANS.labels(self.desc.collection, str(self.shard_no)).set(states["orphan"])

    @property
    def corpus_version(self) -> str:
        return self.desc.corpus_version

    # --- restriction -------------------------------------------------------------------------
    def _row_filter(self, tenant: str, filters, scopes: tuple) -> Optional[RowFilter]:
        """None when every row is eligible (the single-tenant, public, unfiltered, no-tombstone
        fast path). Otherwise the static mask (tenant/ACL/filters: rows never change) is cached and
        ANDed with the live bitmap; the result is cached until the next write."""
        n_live = sum(self.tenant_counts.values())
        if (not filters and set(self.tenant_counts) <= {tenant} and not self.acl_restricted.get(tenant)
                and n_live == self.nrows):
            return None
        key = (tenant, scopes, filters)
        with self._masks_lock:
            cached = self._filters.get(key)
            if cached is not None and cached[0] == self.generation:
                return cached[1]
            static = self._masks.get(key)
        if static is None or len(static) < self.nrows:
            first = 0 if static is None else len(static)
            more = self.store.allowed_mask(self.nrows, tenant, filters, scopes, live_only=False,
                                           first_row=first)
            static = more if static is None else np.concatenate([static, more])
        rf = RowFilter(static & self.live)
        with self._masks_lock:
            self._masks[key] = static
            self._masks.move_to_end(key)
            while len(self._masks) > self.MASK_CACHE:
                old, _ = self._masks.popitem(last=False)
                self._filters.pop(old, None)
            self._filters[key] = (self.generation, rf)
        return rf

    def _dense_search(self, vector: np.ndarray, k: int, tenant: str,
                      allowed: Optional[RowFilter]) -> list[tuple[int, float]]:
        """(row, score) best first, only allowed rows."""
        if allowed is not None and allowed.count == 0:
            return []
        exact_ok = self.vectors.base is not None
        sub = self.tenant_dense.get(tenant)
        if sub is not None:  # a dedicated index: its rows are this tenant's only
            sub_mask = allowed.mask[sub.row_ids] if allowed is not None else None
            sub_filter = None if sub_mask is None or sub_mask.all() else RowFilter(sub_mask)
            if sub_filter is None or sub_filter.count > self._exact_limit() or not exact_ok:
                scores, rows = sub.search(vector[None, :], k, sub_filter)
                found = [(int(sub.row_ids[r]), float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
                want = min(k, sub_filter.count if sub_filter else sub.ntotal)
                if len(found) >= want or not exact_ok:
                    return found
        if allowed is not None and exact_ok and allowed.count <= self._exact_limit():
            scores, rows = exact_search(self.vectors, allowed.rows, vector, k, self.desc.metric)
            return list(zip(rows.tolist(), scores.tolist()))
        scores, rows = self.dense.search(vector[None, :], k, allowed)
        found = [(int(r), float(s)) for r, s in zip(rows[0], scores[0]) if r >= 0]
        want = min(k, allowed.count if allowed is not None else self.nrows)
        if len(found) < want and allowed is not None and exact_ok:
            scores, rows = exact_search(self.vectors, allowed.rows, vector, k, self.desc.metric)
            return list(zip(rows.tolist(), scores.tolist()))
        return found

    # --- search ------------------------------------------------------------------------------
    def search_sync(self, q: ShardQuery) -> ShardResult:
        if q.build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {q.build_id}")
        if q.vector is not None:
            if q.model_id != self.desc.model_id:
                raise ModelMismatch(f"query vector is from model {q.model_id!r}; this build "
                                    f"serves {self.desc.model_id!r}")
            if q.vector.shape != (self.desc.dim,):
                raise InvalidArgument(f"query vector has dimension {q.vector.shape[-1]}, "
                                      f"the collection's is {self.desc.dim}")
        scopes = tuple(sorted(set(q.acl_scopes) | {PUBLIC_ACL}))
        filters = tuple(q.filters)
        with self._rw.read():  # both branches see one index version
            index_version = self.index_version
            allowed = self._row_filter(q.tenant, filters, scopes)
            dense_rows: list[tuple[int, float]] = []
            dense_ms = lexical_ms = 0.0
            if q.vector is not None:
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
            # read records (text, offsets) only for the hits the router may show; the rest travel
            # as ids and scores and are fetched later if fusion promotes them (fetch_chunks)
            n = q.text_top_n or None
            records = self.store.fetch(sorted({r for r, _ in dense_rows[:n]} |
                                              {r for r, _ in lexical_rows[:n]}))
            live = self.live

        def candidates(pairs):
            out = []
            for i, (row, score) in enumerate(pairs):
                if n is not None and i >= n:
                    # visibility of an unread row: the mask (or, on the fast path, liveness) that
                    # the search itself used; its record is read, and re-checked, if it is fetched
                    if (allowed is not None and not allowed.mask[row]) or not live[row]:
                        continue
                    cid = int(self.dense.row_ids[row])
                    out.append(Candidate(cid, score, ChunkRecord(row, cid, "", 0, 0, 0, "", None,
                                                                 q.tenant, {}, ()), self.shard_no))
                    continue
                rec = records.get(row)
                # re-check against the store, the authority on visibility (fetch returns live rows)
                if (rec is None or rec.tenant != q.tenant or not set(rec.acl) & set(scopes)
                        or (allowed is not None and not allowed.mask[row])):
                    continue
                out.append(Candidate(rec.chunk_id, score, rec, self.shard_no))
            return out

        return ShardResult(self.shard_no, self.desc.corpus_version, candidates(dense_rows),
                           candidates(lexical_rows), dense_ms, lexical_ms, index_version)

    async def search(self, query: ShardQuery, timeout: Optional[float] = None) -> ShardResult:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self.search_sync, query)
        return await asyncio.wait_for(fut, timeout) if timeout is not None else await fut

    def fetch_chunks_sync(self, build_id: str, tenant: str, acl_scopes: Sequence[str],
                          rows: Sequence[int]) -> list[Candidate]:
        """Records of rows still live and visible to the caller (rows identify chunk versions)."""
        if build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {build_id}")
        scopes = set(acl_scopes) | {PUBLIC_ACL}
        with self._rw.read():
            records = self.store.fetch([int(r) for r in rows])
        return [Candidate(r.chunk_id, 0.0, r, self.shard_no) for r in records.values()
                if r.tenant == tenant and scopes.intersection(r.acl)]

    async def fetch_chunks(self, build_id: str, tenant: str, acl_scopes: Sequence[str],
                           rows: Sequence[int], timeout: Optional[float] = None) -> list[Candidate]:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, self.fetch_chunks_sync, build_id, tenant,
                                   acl_scopes, rows)
        return await asyncio.wait_for(fut, timeout) if timeout is not None else await fut

    # --- streaming writes --------------------------------------------------------------------
    def apply_write(self, op: str, doc_id: str, version: int, tenant: str, body: dict,
                    chunks: Sequence = (), vectors: Optional[np.ndarray] = None) -> tuple[str, int]:
        """Apply one upsert or delete; returns ("applied" | "noop", stored version).

        Idempotent and ordered: a version not newer than the stored one (a replay) is a no-op.
        """
        with self._write_mutex:
            current = self.store.document(tenant, doc_id)
            if current is not None and current[0] >= version:
                return "noop", current[0]
            new_rows: list[int] = []
            if op == "upsert" and len(chunks):
                first = self.store.next_row()
                if first != self.nrows:
                    raise FailedPrecondition(f"shard {self.shard_no}: store expects row {first}, "
                                             f"index has {self.nrows}")
                acl = tuple(body.get("acl") or ()) or (PUBLIC_ACL,)
                records = [ChunkRecord(first + i, chunk_id(tenant, doc_id, c.index), doc_id, c.index,
                                       c.start, c.end, body.get("title", ""), c.text, tenant,
                                       body.get("metadata", {}), acl) for i, c in enumerate(chunks)]
                new_rows = [r.row for r in records]
                self.store.insert_pending(records, version, vectors)  # durable, invisible
                crash_point("after_pending")
                with self._rw.write():
                    self.dense.add(vectors, [r.chunk_id for r in records])
                    self.vectors.append(vectors)
                    self.nrows = self.dense.ntotal
                    self.live = np.concatenate([self.live, np.zeros(len(records), bool)])
                crash_point("after_dense")
                with self._rw.write():
                    self.lexical.add_committed((r.row, r.title, r.text, r.tenant, r.metadata, r.acl)
                                               for r in records)
                crash_point("after_lexical")
            with self._rw.write():
                dead = self.store.flip(op, tenant, doc_id, version, new_rows, body)  # THE flip
                if dead is None:
                    return "noop", self.store.document(tenant, doc_id)[0]
                self.live[dead] = False
                self.live[new_rows] = True
                self._refresh_counts()
            crash_point("after_flip")
            with self._rw.write():
                self.lexical.delete_rows(dead)
            self.store.mark_purged(dead)
            self._check_lexical("after a write")
            return "applied", version

    def close(self) -> None:
        writer = getattr(self.lexical, "_writer", None)
        if writer is not None:
            writer.wait_merging_threads()
        self.store.close()


def crash_point(name: str) -> None:
    """Tests only: SEARCH_TEST_CRASH_POINT=<name> kills this process (SIGKILL) at that point of a
    write, to prove every window of the replace protocol is safe. Unset in every real deployment."""
    if os.environ.get("SEARCH_TEST_CRASH_POINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
