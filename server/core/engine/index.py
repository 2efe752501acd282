"""One shard of one build, as the engine owns it: the faiss index and exact vectors (read from the
immutable build), the BM25 index and the chunk store (in the shard's writable state directory).

Everything here is synchronous and thread-safe; the scheduler (scheduler.py) decides when and on
which thread it runs. Searches take groups of queries that share one restriction, so the dense
branch of the whole group is one faiss call (per search depth) with one selector.

Restriction (tenant, ACL scopes, metadata filters, liveness) is decided by the chunk store and
applied inside both searches, never after them:
- dense: a bitmap selector (faiss IDSelectorBitmap) over the shard's rows; when the allowed set is
  small (<= max(2,000 rows, 1% of the shard), capped at 20,000) it is searched exactly by brute
  force over just those rows, and an ANN search that returns fewer results than the allowed set
  could fill is redone exactly, so a tiny tenant or a selective filter still gets a full page (an
  unrestricted IVF page left short by a small nprobe is redone probing every list);
- a tenant with a dedicated index (built for tenants above a size threshold) is searched in it,
  plus exactly over its rows added since the build;
- lexical: MUST clauses on tenant, ACL and metadata terms (and the row set for range filters),
  and every hit re-checked against the same mask.

Writes are applied in groups (group commit) through the store's protocol: the new versions' chunks
are written durable but invisible (pending), added to faiss and tantivy, then ONE SQLite
transaction makes them live and the old ones dead, recording the write-log position applied. A
crash before that transaction leaves the old versions served; recovery at load deletes the cut-off
group's pending rows (so a replica that crashed numbers its next rows as its siblings do: routers
fetch by row from any replica) and purges dead ones from the lexical index. A readers-writer lock
makes each search group see one index version in both branches.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from server.backends.dense import DenseIndex, RowFilter, SearchKnobs, exact_search
from server.backends.device import Device
from server.backends.docstore import (PUBLIC_ACL, ChunkRecord, DocStore, FlipEntry,
                                      chunk_fingerprint)
from server.backends.lexical import LexicalIndex, term_filterable
from server.core import limits, metrics
from server.core.chunking import chunk_id
from server.core.collection import ReleaseDescriptor, shard_dir_name
from server.core.engine.state import (COMMITTED, lock_state, lost_writes, prepare,
                                      record_committed, state_shard_dir)
from server.core.rwlock import RWLock
from server.core.types import (Candidate, FetchRequest, ShardInfo, ShardQuery, ShardResult,
                               ShardWrite, StoredVersions, WriteOutcome, small_key)
from server.errors import (FailedPrecondition, IndexCorruptError, ModelMismatch,
                           ResponseTooLarge, is_failure, is_panic, panic_as_corruption,
                           storage_error)

log = logging.getLogger(__name__)

# a fetch of more rows than this could pass a response's size (a chunk may hold a million
# characters): their size is asked of SQLite before they are read
FETCH_UNCHECKED_ROWS = limits.ANSWERS_BUDGET_BYTES // (
    4 * (limits.MAX_DOC_TEXT_CHARS + limits.MAX_TITLE_CHARS)
    + 4 * limits.MAX_METADATA_ENTRIES * (limits.MAX_METADATA_VALUE_CHARS + 64))

# what an operator can do about a store that lost committed writes
_RESTORE = ("Restore this shard's state directory whole from a backup (its " + COMMITTED + " with "
            "it), or put in place the docstore.sqlite of a replica that has applied at least "
            "every write this one had, or remove {state} to serve the build again without the "
            "writes applied since (a replica of a replicated collection applies them again from "
            "the write log)")


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


class RecordCache:
    """Records by row, least recently used out first. A row is one chunk version and never
    changes, so a cached record cannot be stale; whether it is still live is the live bitmap's
    to say, checked by the reader under the same read lock as the search (the flip moves the
    bitmap and the store together). The idea of Solr's documentCache: the hits of popular queries
    are read from SQLite once, not on every search (a 10-row read cost ~60 us of a ~300 us
    query). capacity 0 turns it off. It holds at most `max_bytes` of text too: 50,000 rows of
    chunks written with a million characters each would be 50 GB (outside QA's long texts)."""

    MAX_BYTES = 256 * 2**20
    RECORD_BYTES = 256  # a record's own objects, besides its text and title

    def __init__(self, capacity: int, labels: tuple[str, str] = ("", ""),
                 max_bytes: int = MAX_BYTES):
        self.capacity = max(0, int(capacity))
        self.max_bytes = max_bytes
        self.bytes = 0
        self._records: OrderedDict[int, ChunkRecord] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._hit_metric = metrics.RECORD_CACHE.labels(*labels, "hit")
        self._miss_metric = metrics.RECORD_CACHE.labels(*labels, "miss")

    def read(self, rows: list[int], live: np.ndarray, store: DocStore) -> dict[int, ChunkRecord]:
        """Records of the live rows among `rows`; misses read from the store and kept."""
        if not self.capacity:
            self._miss_metric.inc(len(rows))
            return store.fetch(rows)
        out: dict[int, ChunkRecord] = {}
        missing = []
        with self._lock:
            cached = self._records
            for row in rows:
                rec = cached.get(row)
                if rec is None:
                    missing.append(row)
                elif live[row]:
                    cached.move_to_end(row)
                    out[row] = rec
            self.hits += len(rows) - len(missing)
            self.misses += len(missing)
        self._hit_metric.inc(len(rows) - len(missing))
        self._miss_metric.inc(len(missing))
        if missing:
            fresh = store.fetch(missing)
            out.update(fresh)
            size = self._size
            with self._lock:
                records = self._records
                for row, rec in fresh.items():
                    old = records.get(row)
                    if old is not None:
                        self.bytes -= size(old)
                    records[row] = rec
                    self.bytes += size(rec)
                while records and (len(records) > self.capacity or self.bytes > self.max_bytes):
                    self.bytes -= size(records.popitem(last=False)[1])
        return out

    def _size(self, rec: ChunkRecord) -> int:
        text = rec.text or ""  # Python keeps up to 4 bytes a character of a text not ASCII
        return self.RECORD_BYTES + (len(text) if text.isascii() else 4 * len(text)) + len(rec.title)


def _panics_as_corruption(method):
    """tantivy panics on some damaged files (an out-of-bounds read of a flipped byte); the panic
    arrives as pyo3's PanicException, a BaseException that the threads' `except Exception` let
    through, so the query never heard back and waited for its deadline. As an IndexCorruptError
    naming the BM25 index it fails at once (DATA_LOSS)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if not is_panic(exc):
                raise
            log.error("shard %d: the BM25 index in %s panicked: %s", self.shard_no,
                      self.lexical.directory, exc)
            raise panic_as_corruption(exc, f"reading the BM25 index in {self.lexical.directory}"
                                      ) from None
    return guarded


class ShardIndex:
    MASK_CACHE = 64
    # Brute force over the allowed rows when they are few: below ~1% of the shard a graph or
    # inverted-list search with a selector returns short or wrong pages, and a scan of <= 2,000
    # rows costs ~0.2 ms. Above that, ANN with the selector is 5-25x faster at recall ~0.99
    # (bench/bench_tenants.py), and a short page still falls back to exact. An IVF-Flat whose
    # filtered search would compare more vectors than the allowed rows also goes exact, up to
    # EXACT_MAX_ROWS (DenseIndex.exact_is_cheaper).
    EXACT_MIN_ROWS = 2_000
    EXACT_MAX_FRACTION = 0.01
    EXACT_MAX_ROWS = 20_000

    def __init__(self, desc: ReleaseDescriptor, build_dir: Path, state_root: Path, shard_no: int,
                 device: Optional[Device] = None, record_cache_rows: int = 0,
                 record_cache_bytes: int = RecordCache.MAX_BYTES):
        self.desc = desc
        self._desc_json = desc.to_json()  # a build's descriptor never changes
        self.shard_no = shard_no
        name = shard_dir_name(shard_no)
        self.build_dir = Path(build_dir) / name
        self.directory = self.build_dir
        files = desc.shard_files.get(name, {})
        self.state_dir = prepare(self.build_dir, state_shard_dir(state_root, desc.collection,
                                                                 desc.build_id, name), files)
        self._lock = lock_state(self.state_dir)
        try:
            self._open(desc, files, device, record_cache_rows, record_cache_bytes)
        except BaseException:
            # a refused shard gives back what it opened (its state's lock, the store's
            # connections, tantivy's directory): a retry in this process, or an operator's
            # repair of the files, must not find them held until the collector comes by
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the load's own error is the one to report
                log.exception("shard %d: giving back a failed load's files failed", shard_no)
            raise

    def _open(self, desc: ReleaseDescriptor, files: dict, device: Optional[Device],
              record_cache_rows: int, record_cache_bytes: int) -> None:
        shard_no = self.shard_no
        knobs = SearchKnobs(**desc.search_defaults) if desc.search_defaults else SearchKnobs()
        self.dense = DenseIndex.load(self.build_dir, desc.metric, files, knobs, device, shard_no)
        if self.dense.dim != desc.dim:
            raise FailedPrecondition(f"{self.build_dir}: index dim {self.dense.dim} != descriptor {desc.dim}")
        self.tenant_dense: dict[str, DenseIndex] = {}
        for tenant in desc.dedicated_tenants.get(shard_dir_name(shard_no), []):
            tdir = self.build_dir / "tenants" / tenant
            self.tenant_dense[tenant] = DenseIndex.load(tdir, desc.metric, files.get(f"tenants/{tenant}"),
                                                        knobs, device, shard_no)
        vectors_path = self.build_dir / "vectors.npy"
        try:
            base = np.load(vectors_path, mmap_mode="r") if vectors_path.is_file() else None
        except (ValueError, OSError) as exc:  # truncated: "mmap length is greater than file size"
            raise IndexCorruptError(f"vector file {vectors_path} is unreadable: {exc}") from exc
        if base is not None and (base.ndim != 2 or base.shape[1] != desc.dim):
            raise IndexCorruptError(f"vector file {vectors_path} holds {base.shape}, not (n, {desc.dim})")
        self.vectors = ShardVectors(base, desc.dim)
        # analysed as the build was (its analyzer version: see lexical.py)
        self.lexical = LexicalIndex.open(self.state_dir / "lexical", version=desc.lexical_analyzer)
        self.records = RecordCache(record_cache_rows, (desc.collection, str(shard_no)),
                                   record_cache_bytes)
        self._rw = RWLock()
        self._write_mutex = threading.Lock()
        # a group's BM25 commit is on disk but its flip failed: the next publish would show its
        # adds and deletes, so the next flip checks BM25 row by row before searchers see it
        self._lexical_unsettled = False
        self._full_logged = -1e9  # when a full volume was last logged (once per 10 s)
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()  # static part, by key
        self._filters: dict[tuple, tuple[int, RowFilter]] = {}       # (generation, filter)
        self._masks_lock = threading.Lock()
        self.generation = 0
        store_path = self.state_dir / "docstore.sqlite"
        try:
            self.store = DocStore(store_path)
            self.recovered = self._recover()
            self._load_counts()
        except sqlite3.DatabaseError as exc:  # a truncated or overwritten state copy
            # not damage when storage refuses (full, locked by another process, read-only):
            # removing the state, as the damage's message says, would lose its writes
            clear = storage_error(exc, f"document store {store_path}", "start again")
            if clear is not None:
                raise clear from exc
            raise IndexCorruptError(
                f"document store {store_path} is unreadable: {exc}. The build's own copy is "
                f"untouched: restore this shard's state from a backup or a replica, or remove "
                f"{self.state_dir} to serve the build again without the writes applied since"
            ) from exc

    @property
    def nrows(self) -> int:
        return len(self.live)

    def _exact_limit(self) -> int:
        return min(self.EXACT_MAX_ROWS, max(self.EXACT_MIN_ROWS, int(self.EXACT_MAX_FRACTION * self.nrows)))

    # --- load-time recovery ------------------------------------------------------------------
    def _recover(self) -> dict:
        """Rebuild in-memory state from the store (the authority) after any stop, clean or not."""
        lost = lost_writes(self.state_dir, self.store)
        if lost:
            # BM25 rows past the store's end show a lost upsert (check_lexical); a lost group of
            # deletes leaves no such trace - BM25 lacks rows the store says are live, as after a
            # crash between BM25's commit and the flip - and "repairing" it brought the deleted
            # documents back: the record of what the store had committed tells the two apart.
            # Checked before any repair touches BM25
            raise IndexCorruptError(
                f"shard state {self.state_dir}: {lost}: the store has lost committed writes (a "
                f"damaged or removed docstore.sqlite-wal?). " + _RESTORE.format(state=self.state_dir))
        dropped = self.store.pending_tail()
        if dropped:  # a crash's staged BM25 commit may hold them: out of BM25 first (idempotent:
            self.lexical.delete_rows(dropped)  # a crash before the store's delete redoes both)
            crash_point("recovery_after_lexical_drop")
            self.store.delete_rows_from(dropped[0])
        orphaned = self.store.orphan_pending()
        base_n = self.dense.ntotal
        rows, ids, vecs = self.store.added_vectors(base_n)
        if len(rows):
            if not np.array_equal(rows, np.arange(base_n, base_n + len(rows))):
                raise IndexCorruptError(f"{self.state_dir}: added rows are not contiguous from {base_n}")
            self.dense.add(vecs, ids)
            self.vectors.append(vecs)
        purge = self.store.unpurged()
        self.lexical.delete_rows(purge)
        self.store.mark_purged(purge)
        self.live = np.zeros(self.dense.ntotal, dtype=bool)
        self.live[self.store.live_rows()] = True
        self.text_hash = np.zeros(self.dense.ntotal, dtype=np.int64)
        for row, th in self.store._conn().execute("SELECT row, text_hash FROM chunks"):
            if row < len(self.text_hash):
                self.text_hash[row] = th
        # a shard that took streaming writes is checked row by row (a count can balance an extra
        # row against a missing one); an untouched build was reconciled by its audit
        touched = len(rows) > 0 or self.store.last_write_seq() > 0 or bool(dropped)
        repaired = self.check_lexical("at load", full=touched)
        return {"dropped_pending": len(dropped), "orphaned": orphaned,
                "replayed_rows": int(len(rows)), "purged": len(purge), "lexical_repaired": repaired}

    def _load_counts(self) -> None:
        """Counts kept in memory from here on (moved by every flip): descriptions are O(1)."""
        self.tenant_counts = self.store.tenants()
        self.doc_counts = self.store.documents_per_tenant()
        self.acl_restricted = self.store.restricted_acl_rows()
        # per tenant, the scope names its restricted chunks carry (grows with writes; a name no
        # chunk carries any more costs a count that finds nothing, until a reload)
        self.acl_scopes = self.store.restricted_acl_scopes()
        self.states = self.store.row_states()
        self.index_version = self.store.index_version()
        # a compacted build includes the write log up to where its snapshot was taken
        self.applied_seq = max(self.store.applied_seq(),
                               int(self.desc.log_positions.get(shard_dir_name(self.shard_no), 0)))
        self._publish_counts()

    def _publish_counts(self) -> None:
        total = max(1, sum(self.states.values()))
        labels = (self.desc.collection, str(self.shard_no))
        metrics.TOMBSTONE_RATIO.labels(*labels).set((self.states["dead"] + self.states["orphan"]) / total)
        metrics.ORPHANS.labels(*labels).set(self.states["orphan"])
        metrics.APPLIED_SEQ.labels(*labels).set(self.applied_seq)

    def check_lexical(self, when: str, full: bool = False) -> int:
        """Invariant 7: the BM25 index holds exactly the live rows. Checked by count after every
        write group, row by row at load; on a mismatch the index is repaired (extra rows deleted,
        missing live rows re-added from the store). Returns the rows repaired."""
        live = int(self.live.sum())
        if not full and self.lexical.num_docs() == live:
            return 0
        indexed = np.asarray(self.lexical.indexed_rows(), dtype=np.int64)
        in_range = indexed < self.nrows
        if when == "at load" and not in_range.all():
            # recovery has taken the rows of a write cut off by a crash out of both, so BM25 rows
            # past the store's last one were written by commits the store no longer holds: its
            # write-ahead log was lost or cut. Repairing would delete the last trace of those
            # writes and serve on without them (outside QA: a removed -wal file undid 29
            # acknowledged writes and brought deleted documents back, with one log line)
            raise IndexCorruptError(
                f"shard state {self.state_dir}: the BM25 index holds rows up to "
                f"{int(indexed.max())} that the document store does not have (it ends at row "
                f"{self.nrows - 1}): the store has lost committed writes (a damaged or removed "
                f"docstore.sqlite-wal?). " + _RESTORE.format(state=self.state_dir))
        extra = np.concatenate([indexed[~in_range], indexed[in_range][~self.live[indexed[in_range]]]])
        present = np.zeros(self.nrows, dtype=bool)
        present[indexed[in_range]] = True
        missing = np.flatnonzero(self.live & ~present)
        if not len(extra) and not len(missing):
            return 0
        metrics.LEXICAL_REPAIRS.labels(self.desc.collection, str(self.shard_no)).inc(
            len(extra) + len(missing))
        log.error("shard %d (%s): BM25 index disagreed with the store %s: %d extra, %d missing "
                  "rows; repaired", self.shard_no, self.state_dir, when, len(extra), len(missing))
        self.lexical.delete_rows(extra.tolist())
        if len(missing):
            records = self.store.fetch(missing.tolist())
            self.lexical.add_committed((r.row, r.title, r.text, r.tenant, r.metadata, r.acl)
                                       for r in records.values())
        return int(len(extra) + len(missing))

    # --- restriction -------------------------------------------------------------------------
    def row_filter(self, tenant: str, filters, scopes: tuple) -> Optional[RowFilter]:
        """None when every row is eligible (the single-tenant, public, unfiltered, no-tombstone
        fast path). Otherwise the static mask (tenant/ACL/filters: rows never change) is cached and
        ANDed with the live bitmap; the result is cached until the next write."""
        n_live = sum(self.tenant_counts.values())
        if (not filters and set(self.tenant_counts) <= {tenant} and not self.acl_restricted.get(tenant)
                and n_live == self.nrows):
            return None
        # the shard's mask caches count entries: filters of up to ~4 MB go in as their digest
        key = (tenant, scopes, small_key(filters) if filters else filters)
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
        rf = RowFilter(static[:self.nrows] & self.live)
        with self._masks_lock:
            self._masks[key] = static
            self._masks.move_to_end(key)
            while len(self._masks) > self.MASK_CACHE:
                old, _ = self._masks.popitem(last=False)
                self._filters.pop(old, None)
            self._filters[key] = (self.generation, rf)
        return rf

    # --- dense -------------------------------------------------------------------------------
    def dense_search(self, queries: np.ndarray, k: int, tenant: str,
                     allowed: Optional[RowFilter]) -> list[list[tuple[int, float]]]:
        """(row, score) best first for each query, only allowed rows; one batched faiss call."""
        nq = len(queries)
        if allowed is not None and allowed.count == 0:
            return [[] for _ in range(nq)]
        exact_ok = self.vectors.base is not None
        metric = self.desc.metric
        sub = self.tenant_dense.get(tenant)
        if sub is not None:
            out = self._dedicated_search(sub, queries, k, allowed, exact_ok)
            if out is not None:
                return out
        if allowed is not None and exact_ok and (
                allowed.count <= self._exact_limit()
                or (allowed.count <= self.EXACT_MAX_ROWS  # a bounded scan, whatever the model
                    and self.dense.exact_is_cheaper(allowed.count))):
            return [list(zip(r.tolist(), s.tolist()))
                    for s, r in exact_search(self.vectors, allowed.rows, queries, k, metric)]
        scores, rows = self.dense.search(queries, k, allowed)
        rows_l, scores_l = rows.tolist(), scores.tolist()
        if (rows < 0).any():  # faiss pads a short page with -1
            found = [[(r, s) for r, s in zip(rr, ss) if r >= 0] for rr, ss in zip(rows_l, scores_l)]
        else:
            found = [list(zip(rr, ss)) for rr, ss in zip(rows_l, scores_l)]
        want = min(k, allowed.count if allowed is not None else self.nrows)
        short = [i for i, f in enumerate(found) if len(f) < want]
        if short and allowed is not None and exact_ok:
            redo = exact_search(self.vectors, allowed.rows, queries[short], k, metric)
            for i, (s, r) in zip(short, redo):
                found[i] = list(zip(r.tolist(), s.tolist()))
        elif short and allowed is None and (wide := self.dense.exhaustive_knobs()) is not None:
            # IVF whose probed lists held fewer than k vectors (a deep page, a small nprobe):
            # those queries probe every list, so a page is short only when the shard is
            scores, rows = self.dense.search(queries[short], k, None, wide, on_cpu=True)
            for i, rr, ss in zip(short, rows.tolist(), scores.tolist()):
                found[i] = [(r, s) for r, s in zip(rr, ss) if r >= 0]
        return found

    def _dedicated_search(self, sub: DenseIndex, queries: np.ndarray, k: int,
                          allowed: Optional[RowFilter], exact_ok: bool):
        """A tenant's own index holds its rows of the build; rows it wrote since are searched
        exactly and merged. None: use the shared path instead (a small allowed set)."""
        sub_mask = allowed.mask[sub.row_ids] if allowed is not None else None
        sub_filter = None if sub_mask is None or sub_mask.all() else RowFilter(sub_mask)
        if sub_filter is not None and sub_filter.count <= self._exact_limit() and exact_ok:
            return None
        scores, rows = sub.search(queries, k, sub_filter)
        if sub_filter is None and (wide := sub.exhaustive_knobs()) is not None:
            # an IVF whose probed lists held fewer than k of the tenant's vectors: those queries
            # probe every list (as the shared index's short pages do)
            short = [i for i, rr in enumerate(rows) if int((rr >= 0).sum()) < min(k, sub.ntotal)]
            if short:
                scores, rows = scores.copy(), rows.copy()
                scores[short], rows[short] = sub.search(queries[short], k, None, wide, on_cpu=True)
        found = [[(int(sub.row_ids[r]), float(s)) for r, s in zip(rr, ss) if r >= 0]
                 for rr, ss in zip(rows, scores)]
        base_n = self.vectors.base_n
        if self.nrows > base_n and exact_ok:  # no mask (nothing restricted): all of them
            newer = (allowed.rows[allowed.rows >= base_n] if allowed is not None
                     else np.arange(base_n, self.nrows, dtype=np.int64))
            if len(newer):
                extra = exact_search(self.vectors, newer, queries, k, self.desc.metric)
                found = [sorted(f + list(zip(r.tolist(), s.tolist())), key=lambda x: -x[1])[:k]
                         for f, (s, r) in zip(found, extra)]
        want = min(k, sub_filter.count if sub_filter else sub.ntotal)
        short = [i for i, f in enumerate(found) if len(f) < want]
        if short and allowed is not None and exact_ok:
            redo = exact_search(self.vectors, allowed.rows, queries[short], k, self.desc.metric)
            for i, (s, r) in zip(short, redo):
                found[i] = list(zip(r.tolist(), s.tolist()))
        return found

    # --- search ------------------------------------------------------------------------------
    def _hidden(self, q: ShardQuery) -> Optional[tuple[tuple[str, ...], tuple[str, ...]]]:
        """(the caller's scopes, its tenant's scope names it lacks) when some of the tenant's
        chunks need a scope the caller does not hold: BM25's statistics count those out. None
        otherwise - every chunk of the tenant counts, at no cost."""
        if not self.acl_restricted.get(q.tenant):
            return None
        caller = set(q.acl_scopes) | {PUBLIC_ACL}
        lacking = self.acl_scopes.get(q.tenant, set()) - caller
        return (tuple(sorted(caller)), tuple(sorted(lacking))) if lacking else None

    def check_query(self, q: ShardQuery) -> None:
        if q.build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {q.build_id}")
        if q.vector is not None and q.model_id != self.desc.model_id:
            raise ModelMismatch(f"query vector is from model {q.model_id!r}; this build serves "
                                f"{self.desc.model_id!r}")

    @_panics_as_corruption
    def term_stats(self, queries: Sequence[ShardQuery]) -> list[ShardResult]:
        """A statistics round's answers (ShardQuery.stats_only): this shard's BM25 statistics
        for each query's terms, no search."""
        with self._rw.read():
            index_version, applied = self.index_version, self.applied_seq
            stats = [self.lexical.term_stats(q.text, q.expansion, q.tenant, self._hidden(q))
                     for q in queries]
        return [ShardResult(self.shard_no, self.desc.corpus_version, [], [], 0.0, 0.0, index_version,
                            applied, len(queries), term_stats=s) for s in stats]

    @_panics_as_corruption
    def search_group(self, queries: Sequence[ShardQuery], lexical_map=map) -> list[ShardResult]:
        """Answer queries that share one restriction: one faiss call per depth for their vectors, one
        BM25 search each (through `lexical_map`, e.g. a thread pool's map: tantivy releases the
        GIL), one store read for every record any of them may show."""
        q0 = queries[0]
        scopes = tuple(sorted(set(q0.acl_scopes) | {PUBLIC_ACL}))
        filters = tuple(q0.filters)
        n = len(queries)
        with self._rw.read():  # every branch of every query sees one index version
            index_version, applied = self.index_version, self.applied_seq
            allowed = self.row_filter(q0.tenant, filters, scopes)
            dense: list[list] = [[] for _ in range(n)]
            dense_ms = lexical_ms = 0.0
            by_depth: dict[int, list[int]] = {}
            for i, q in enumerate(queries):
                if q.vector is not None:
                    by_depth.setdefault(q.dense_depth, []).append(i)
            if by_depth:
                t0 = time.perf_counter()
                # one faiss call per depth: an approximate index searches deeper for a larger k
                # (HNSW's efSearch is at least k, an IVF-PQ shortlist is k_factor x k), so a
                # query searched with a neighbour's k could answer differently than alone
                for k, idx in by_depth.items():
                    found = self.dense_search(np.stack([queries[i].vector for i in idx]), k,
                                              q0.tenant, allowed)
                    for i, f in zip(idx, found):
                        dense[i] = f
                dense_ms = (time.perf_counter() - t0) * 1e3
            lexical: list[list] = [[] for _ in range(n)]
            term_stats = [self.lexical.term_stats(q.text, q.expansion, q.tenant, self._hidden(q))
                          if q.stats_only else None for q in queries]
            with_text = [i for i, q in enumerate(queries) if q.text and not q.stats_only]
            if with_text:
                t0 = time.perf_counter()
                # ranges, and values tantivy would not match as terms, restrict by the rows the
                # filters allow (the mask the dense side searched with); the rest as terms
                equal = [(f.key, f.any_of) for f in filters if f.any_of and term_filterable(f.any_of)]
                by_rows = any(f.is_range or (f.any_of and not term_filterable(f.any_of))
                              for f in filters)
                rows = allowed.rows.tolist() if by_rows and allowed is not None else None

                row_ids = self.dense.row_ids
                hidden = self._hidden(q0)

                def bm25(i):
                    q = queries[i]
                    s, r = self.lexical.search(q.text, q.lexical_depth, q.tenant, equal, scopes, rows,
                                               q.expansion, q.term_stats, hidden, with_ties=True)
                    # equal scores in chunk-id order, not in the order of segments (which differ
                    # between replicas that applied the same writes in other groups) - at the
                    # depth's cut too: of the hits tied there, the lowest chunk ids stay
                    return sorted(zip(r, s), key=lambda h: (-h[1], int(row_ids[h[0]])))[:q.lexical_depth]

                for i, hits in zip(with_text, lexical_map(bm25, with_text)):
                    lexical[i] = hits
                lexical_ms = (time.perf_counter() - t0) * 1e3
            # read records (text, offsets) only for the hits a router may show; the rest travel
            # as row, chunk id and text fingerprint, fetched later if the answer needs them
            wanted: set[int] = set()
            for q, d, l in zip(queries, dense, lexical):
                top = q.text_top_n or None
                wanted.update(r for r, _ in d[:top])
                wanted.update(r for r, _ in l[:top])
            live = self.live
            records = self.records.read(sorted(wanted), live, self.store)
            text_hash = self.text_hash
            row_ids = self.dense.row_ids
        out = []
        for q, d, l, stats in zip(queries, dense, lexical, term_stats):
            top = q.text_top_n or None
            out.append(ShardResult(
                self.shard_no, self.desc.corpus_version,
                self._candidates(d, top, records, q.tenant, scopes, allowed, live, text_hash, row_ids),
                self._candidates(l, top, records, q.tenant, scopes, allowed, live, text_hash, row_ids),
                dense_ms, lexical_ms, index_version, applied, n, term_stats=stats))
        return out

    def _candidates(self, pairs, top, records, tenant, scopes, allowed, live, text_hash, row_ids):
        """Candidates of one list: the first `top` with their records (re-checked against the
        store, the authority on visibility: it returns live rows only), the rest as row, chunk id
        and text fingerprint, visible by the mask (or, on the fast path, liveness) that the search
        itself used; their records are read, and re-checked, if they are fetched."""
        out = []
        append = out.append
        readable = set(scopes)
        mask = allowed.mask if allowed is not None else None
        shard_no = self.shard_no
        for row, score in (pairs if top is None else pairs[:top]):
            rec = records.get(row)
            if (rec is None or rec.tenant != tenant or readable.isdisjoint(rec.acl)
                    or (mask is not None and not mask[row])):
                continue
            append(Candidate(rec.chunk_id, score, rec, shard_no))
        if top is not None:
            for row, score in pairs[top:]:
                if (mask is not None and not mask[row]) or not live[row]:
                    continue
                cid = int(row_ids[row])
                append(Candidate(cid, score, ChunkRecord(row, cid, "", 0, 0, 0, "", None, tenant, {},
                                                         (), int(text_hash[row])), shard_no))
        return out

    def fetch(self, req: FetchRequest) -> list[Candidate]:
        """Records of rows still live and visible to the caller (rows identify chunk versions)."""
        if req.build_id != self.desc.build_id:
            raise FailedPrecondition(f"shard {self.shard_no} serves build {self.desc.build_id}, "
                                     f"not {req.build_id}")
        scopes = set(req.acl_scopes) | {PUBLIC_ACL}
        with self._rw.read():
            rows = list(dict.fromkeys(r for r in req.rows if r < self.nrows))
            if len(rows) > FETCH_UNCHECKED_ROWS:  # could pass a response's size: ask SQLite first
                size = self.store.stored_bytes(rows)
                if size > limits.ANSWERS_BUDGET_BYTES:
                    raise ResponseTooLarge(
                        f"shard {self.shard_no}: the {len(rows)} chunks asked for hold "
                        f"{size / 2**20:.1f} MiB, {limits.OVER_THE_RESPONSE_LIMIT}: ask for "
                        f"fewer (a smaller top_k)")
            records = self.records.read(rows, self.live, self.store)
            found = (records[r] for r in rows if r in records)  # in the order asked
            out = [Candidate(r.chunk_id, 0.0, r, self.shard_no) for r in found
                   if r.tenant == req.tenant and scopes.intersection(r.acl)]
            if req.with_vectors and out and self.vectors.base is not None:
                vecs = self.vectors[np.array([c.record.row for c in out], dtype=np.int64)]
                for c, v in zip(out, vecs):
                    c.vector = np.asarray(v, np.float32)
        return out

    # --- writes ------------------------------------------------------------------------------
    def apply_writes(self, writes: Sequence[ShardWrite]) -> list[WriteOutcome]:
        """Apply writes in order as one group: one pending insert, one faiss add, one BM25 commit
        and one visibility flip. Idempotent: a version not above the stored one is a no-op that
        still counts as applied for the write-log position. A document written more than once
        in the call ends as the writes in order leave it, each write answered as in order, and
        every write that applies in order takes its rows, even one a later write of the group
        replaces (dead at the flip, never in BM25): a shard numbers its rows as its replicas do
        however their writes were grouped - routers fetch by row from any replica (review: rows
        given only to the surviving write shifted one replica's rows against a sibling's, whose
        fetches then failed the chunk check and dropped hits). (Outside QA: a document written
        twice split the call into groups, and a replica replaying a log that kept rewriting a
        few documents applied ~80 entries/s.)"""
        if not writes:
            return []
        with self._write_mutex:
            try:
                return self._apply_group(writes)
            except Exception as exc:
                # storage refusing (full, locked, read-only, gone) is not INTERNAL: it names
                # the state and says whether sending the write again will do
                clear = storage_error(exc, f"shard {self.shard_no}'s state {self.state_dir}",
                                      "the write may not have been applied: send it again "
                                      "(writes are idempotent by version)")
                if clear is None:
                    raise
                if time.monotonic() - self._full_logged > 10.0:  # an operator's problem
                    self._full_logged = time.monotonic()
                    log.error("%s", clear)
                raise clear from exc

    def stored_versions(self, keys: Sequence[tuple[str, str]]) -> StoredVersions:
        """The versions the next write group would compare against (`_apply_group`'s rule) and
        the index version they were stored at, from one read of the store: no shard lock, so a
        version read never waits behind a group commit (review: under the read lock it held a
        thread of the pool every shard shares while a commit waited, stalling other shards'
        fetches)."""
        return StoredVersions(*self.store.versions_of(keys))

    def _apply_group(self, writes: Sequence[ShardWrite]) -> list[WriteOutcome]:
        stored = self.store.documents_of(list(dict.fromkeys(w.key for w in writes)))
        # the version rule in order: each write against what the ones before it left. `then`:
        # None for a write that applies, else the version it found stored (its no-op's answer)
        held = {key: version for key, (version, *_) in stored.items()}
        then: list[Optional[int]] = []
        for w in writes:
            found = held.get(w.key)
            if found is not None and found >= w.version:
                then.append(found)
            else:
                then.append(None)
                held[w.key] = w.version
        fresh = [w for w, found in zip(writes, then) if found is None]  # applied, in order
        last = {w.key: w for w in fresh}  # per document, the write that stays
        records: list[ChunkRecord] = []
        versions: list[int] = []
        new_rows: dict[int, list[int]] = {}
        first = self.store.next_row()
        if first != self.nrows:
            raise FailedPrecondition(f"shard {self.shard_no}: store expects row {first}, index has "
                                     f"{self.nrows}")
        row = first
        for w in fresh:
            if w.op != "upsert" or not len(w.chunks):
                continue
            title = w.body.get("title", "")
            acl = tuple(w.body.get("acl") or ()) or (PUBLIC_ACL,)
            meta = w.body.get("metadata") or {}
            rows = []
            for c in w.chunks:
                records.append(ChunkRecord(row, chunk_id(w.tenant, w.doc_id, c.index), w.doc_id,
                                           c.index, c.start, c.end, title, c.text, w.tenant, meta,
                                           acl, chunk_fingerprint(title, c.text)))
                versions.append(w.version)
                rows.append(row)
                row += 1
            new_rows[id(w)] = rows
        # the rows these writes retire (the writer mutex is held: the flip will find the same),
        # and those of writes a later one of this group replaces: dead as the flip ends
        retiring = self.store.live_rows_of(list(last))
        replaced = {r for w in fresh if last[w.key] is not w for r in new_rows.get(id(w), ())}
        if records:
            x = np.vstack([w.vectors for w in fresh if id(w) in new_rows]).astype(np.float32)
            self.store.insert_pending(records, versions, x)  # durable, invisible
            crash_point("after_pending")
            with self._rw.write():  # faiss adds must not run beside searches
                self.dense.add(x, [r.chunk_id for r in records])
                self.vectors.append(x)
                self.live = np.concatenate([self.live, np.zeros(len(records), bool)])
                self.text_hash = np.concatenate([self.text_hash, [r.text_hash for r in records]])
                self.states["pending"] += len(records)
            crash_point("after_dense")
        # ONE BM25 commit for the group - its new chunks in, the retired ones out - that searchers
        # see only with the flip below. A crash in between leaves the store's old version live;
        # recovery re-adds it to BM25 and removes the orphans (check_lexical at load).
        flip_done = False
        try:
            if records or retiring:
                self.lexical.stage(((r.row, r.title, r.text, r.tenant, r.metadata, r.acl)
                                    for r in records if r.row not in replaced), retiring)
            crash_point("after_lexical")
            entries = [FlipEntry(w.op, w.tenant, w.doc_id, w.version, new_rows.get(id(w), []),
                                 w.body, [(c.index, c.start, c.end, c.text) for c in w.chunks],
                                 w.vectors if id(w) in new_rows else None,
                                 w.model_id or self.desc.model_id, w.seq)
                       for w in fresh]
            seqs = [w.seq for w in writes if w.seq]
            applied_seq = max(seqs) if seqs else None
            by_row = {r.row: r for r in records}
            with self._rw.write():
                deads = self.store.flip(entries, applied_seq)  # THE flip
                flip_done = True
                dead_rows: list[int] = []
                for e, flipped in zip(entries, deads):
                    if flipped is None:
                        continue
                    dead, was_live = flipped
                    rows = [r for r, _ in dead]
                    now_live = e.op == "upsert" and bool(e.new_rows)
                    self.doc_counts[e.tenant] = (self.doc_counts.get(e.tenant, 0) + now_live
                                                 - was_live)
                    self.live[rows] = False
                    self.live[e.new_rows] = True
                    t = e.tenant
                    self.tenant_counts[t] = (self.tenant_counts.get(t, 0) + len(e.new_rows)
                                             - len(rows))
                    restricted = [by_row[r].acl for r in e.new_rows
                                  if by_row[r].acl != (PUBLIC_ACL,)]
                    self.acl_restricted[t] = (self.acl_restricted.get(t, 0) + len(restricted)
                                              - sum(1 for _, public in dead if not public))
                    for acl in restricted:
                        self.acl_scopes.setdefault(t, set()).update(a for a in acl
                                                                    if a != PUBLIC_ACL)
                    self.states["live"] += len(e.new_rows) - len(rows)
                    self.states["pending"] -= len(e.new_rows)
                    self.states["dead"] += len(rows)
                    dead_rows.extend(rows)
                for counts in (self.tenant_counts, self.doc_counts):
                    for t in [t for t, c in counts.items() if c <= 0]:
                        del counts[t]
                if any(d is not None for d in deads):
                    self.index_version += 1
                if applied_seq is not None:
                    self.applied_seq = max(self.applied_seq, applied_seq)
                self.generation += 1
                # BM25 moves with the flip: one index version in both branches (a reload that fails
                # leaves the old reader, and the next flip checks BM25 row by row)
                self._after_flip(self.lexical.publish)
                self._publish_counts()
                if self._lexical_unsettled:  # repaired before any search sees this publish
                    self._lexical_unsettled = False  # (set again if the repair fails)
                    self._after_flip(lambda: self.check_lexical("after a failed write", full=True))
        except BaseException:
            # review: a group whose BM25 commit may be on disk but whose flip did not happen (a
            # full disk) would have that commit published by the next write's flip, deleting the
            # old version the store still serves: the next flip checks BM25 row by row first
            if not flip_done and (records or retiring):
                self._lexical_unsettled = True
            raise
        crash_point("after_flip")
        unexpected = sorted(set(dead_rows) - set(retiring) - replaced)
        # the write has applied: what follows is redone later (purges at load, BM25 checked by
        # the next write), so its failure is logged, never answered as the write's (review: a
        # full disk here made an applied write answer RESOURCE_EXHAUSTED, and its retry NOOP)
        if unexpected:  # the flip retired rows the staged commit did not delete (never expected)
            self._after_flip(lambda: self.lexical.delete_rows(unexpected))
        newest = next((e for e, d in zip(reversed(entries), reversed(deads)) if d is not None),
                      None)
        if newest is not None:  # after the store's commit, never before it
            self._after_flip(lambda: record_committed(self.state_dir, newest.tenant,
                                                      newest.doc_id, newest.version))
        self._after_flip(lambda: self.store.mark_purged(dead_rows))
        self._after_flip(lambda: self.check_lexical("after a write"))
        applied = {id(w) for w, d in zip(fresh, deads) if d is not None}
        return [WriteOutcome("applied", w.version, self.index_version, w.seq)
                if found is None and id(w) in applied  # (one object sent twice: a no-op twice)
                else WriteOutcome("noop", found if found is not None
                                  else stored.get(w.key, (w.version,))[0], self.index_version, w.seq)
                for w, found in zip(writes, then)]

    def _after_flip(self, step) -> None:
        """A clean-up step after a flip: a failure is logged, and the BM25 index is checked row by
        row at the next flip."""
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - the write has applied; redone later
            if not is_failure(exc):
                raise  # KeyboardInterrupt, SystemExit
            self._lexical_unsettled = True
            log.error("shard %d (%s): a step after a write's flip failed (%s); it is redone "
                      "later", self.shard_no, self.state_dir, exc)

    # --- description -------------------------------------------------------------------------
    def info(self, tenant: Optional[str] = None, digest: bool = False) -> ShardInfo:
        """From the in-memory counts (cheap enough to poll); the digest reads every live row."""
        if tenant is None:
            docs, chunks, vectors = sum(self.doc_counts.values()), sum(self.tenant_counts.values()), self.nrows
        else:
            docs, chunks = self.doc_counts.get(tenant, 0), self.tenant_counts.get(tenant, 0)
            vectors = chunks
        total = max(1, sum(self.states.values()))
        return ShardInfo(
            self.shard_no, self.desc.collection, self.desc.build_id, self.desc.corpus_version,
            self.desc.model_id, self.index_version, self.applied_seq, docs, chunks, vectors,
            self._desc_json, self.store.live_digest() if digest else "", "serving",
            (self.states["dead"] + self.states["orphan"]) / total)

    def close(self) -> None:
        """Give back what the shard holds (also a shard whose load failed part way): each part
        on its own, the state's lock last and whatever else failed (review: a damaged BM25
        index that raised on close kept the lock)."""
        dense = getattr(self, "dense", None)
        parts = [*((dense, *getattr(self, "tenant_dense", {}).values()) if dense else ()),
                 getattr(self, "lexical", None), getattr(self, "store", None)]
        first: Optional[BaseException] = None
        try:
            for part in parts:  # device memory goes back now, not when the last reference dies
                if part is None:
                    continue
                try:
                    part.close()
                except Exception as exc:  # noqa: BLE001 - the others still close; raised after
                    first = first or exc
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None
        if first is not None:
            raise first


def crash_point(name: str) -> None:
    """Tests only: SEARCH_TEST_CRASH_POINT=<name> kills this process (SIGKILL) at that point of a
    write, to prove every window of the replace protocol is safe. Unset in every real deployment."""
    if os.environ.get("SEARCH_TEST_CRASH_POINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
