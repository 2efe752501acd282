"""The shard engine's scheduler (server/core/engine/scheduler.py) on a real shard: concurrent
queries coalesce into fewer faiss calls and each caller gets exactly its own answer; cancelled and
expired queries are dropped before the index call; mixed restrictions never share a batch; an
idle shard dispatches at once; writes coalesce into group commits."""
import asyncio
import threading
import time

import numpy as np
import pytest

from conftest import publish_build


@pytest.fixture(scope="module")
def engine_build(tmp_path_factory, tiny_embedder, cranfield_docs):
    from index_builder.corpus import Document

    data = tmp_path_factory.mktemp("engine")
    docs = [Document(f"a-{d.doc_id}", d.text, d.title, tenant="alpha") for d in cranfield_docs[:120]]
    docs += [Document(f"b-{d.doc_id}", d.text, d.title, tenant="beta") for d in cranfield_docs[120:200]]
    desc = publish_build(data, "eng", docs, tiny_embedder)
    return data, desc


def open_shard(data, desc, **engine):
    from server.config import EngineConfig
    from server.core.collection import CollectionStore
    from server.core.engine.local import EnginePools, LocalShard

    pools = EnginePools.create(2)
    cfg = EngineConfig(**{"max_batch": 64, "dispatch_timeout_ms": 5.0, **engine})
    shard = LocalShard.open(desc, CollectionStore(data).build_dir("eng", desc.build_id),
                            data / ".state", 0, None, cfg, pools)
    return shard, pools


def query(desc, tenant, vector, depth=10, **kw):
    from server.core.types import ShardQuery

    return ShardQuery(desc.build_id, tenant, np.asarray(vector, np.float32), desc.model_id, "",
                      depth, 0, **kw)


class GatedGroups:
    """Wraps the index's group search: records every batch, and can hold the first one until
    released (so the next queries queue behind a busy index)."""

    def __init__(self, shard, hold_first=False):
        self.inner = shard.index.search_group
        self.batches = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not hold_first:
            self.gate.set()
        shard.index.search_group = self

    def __call__(self, queries, lexical_map=map):
        self.batches.append([(q.tenant, q.restriction) for q in queries])
        self.entered.set()
        self.gate.wait(30)
        return self.inner(queries, lexical_map)


def test_concurrent_queries_share_faiss_calls_and_each_gets_its_own_results(engine_build, rng):
    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    vectors = rng.standard_normal((33, desc.dim)).astype(np.float32)
    expected = [shard.index.search_group([query(desc, "alpha", v)])[0] for v in vectors]
    groups = GatedGroups(shard, hold_first=True)

    async def go():
        first = asyncio.ensure_future(shard.search([query(desc, "alpha", vectors[0])]))
        await asyncio.get_running_loop().run_in_executor(None, groups.entered.wait, 10)
        rest = [asyncio.ensure_future(shard.search([query(desc, "alpha", v)])) for v in vectors[1:]]
        await asyncio.sleep(0)
        groups.gate.set()
        return [(await f)[0] for f in [first] + rest]

    try:
        results = asyncio.run(go())
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert len(groups.batches) < len(vectors)                    # fewer index calls than queries
    assert max(len(b) for b in groups.batches) == 32             # the 32 that queued: one call
    for got, want in zip(results, expected):                     # each caller: its own answer
        assert [c.chunk_id for c in got.dense] == [c.chunk_id for c in want.dense]
    assert {r.batch_size for r in results[1:]} == {32}


def test_one_messages_queries_leave_an_idle_shard_in_full_batches(engine_build, rng):
    """A message of many queries (a SearchBatch chunk, a router's message) is queued whole before
    anything is dispatched: 8 queries at max_batch 4 are two calls of 4, each query with its
    own answer (queued one at a time, the first went alone: 1 + 4 + 3)."""
    data, desc = engine_build
    shard, pools = open_shard(data, desc, max_batch=4)
    vectors = rng.standard_normal((8, desc.dim)).astype(np.float32)
    expected = [shard.index.search_group([query(desc, "alpha", v)])[0] for v in vectors]
    groups = GatedGroups(shard)
    try:
        results = asyncio.run(shard.search([query(desc, "alpha", v) for v in vectors]))
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert [len(b) for b in groups.batches] == [4, 4]
    for got, want in zip(results, expected):
        assert [c.chunk_id for c in got.dense] == [c.chunk_id for c in want.dense]


def test_a_cancelled_or_expired_query_is_dropped_before_the_index_call(engine_build, rng):
    from server.core import metrics
    from server.errors import DeadlineExceeded

    data, desc = engine_build
    shard, pools = open_shard(data, desc, dense_workers=1)  # one device queue, held busy
    groups = GatedGroups(shard, hold_first=True)
    v = rng.standard_normal((4, desc.dim)).astype(np.float32)
    labels = ("eng", "0")
    cancelled0 = metrics.ENGINE_DROPPED.labels(*labels, "cancelled")._value.get()
    expired0 = metrics.ENGINE_DROPPED.labels(*labels, "deadline")._value.get()

    async def go():
        busy = asyncio.ensure_future(shard.search([query(desc, "alpha", v[0])]))
        await asyncio.get_running_loop().run_in_executor(None, groups.entered.wait, 10)
        gone = asyncio.ensure_future(shard.search([query(desc, "alpha", v[1])]))
        late = asyncio.ensure_future(shard.search([query(desc, "alpha", v[2])], timeout=0.05))
        kept = asyncio.ensure_future(shard.search([query(desc, "alpha", v[3])]))
        await asyncio.sleep(0.1)  # `late` is past its deadline while it waits
        gone.cancel()
        groups.gate.set()
        await busy
        with pytest.raises(asyncio.CancelledError):
            await gone
        with pytest.raises(DeadlineExceeded):
            await late
        return (await kept)[0]

    try:
        kept = asyncio.run(go())
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert len(groups.batches) == 2 and len(groups.batches[1]) == 1   # only `kept` reached faiss
    want = shard.index.search_group([query(desc, "alpha", v[3])])[0]
    assert [c.chunk_id for c in kept.dense] == [c.chunk_id for c in want.dense]
    assert metrics.ENGINE_DROPPED.labels(*labels, "cancelled")._value.get() == cancelled0 + 1
    assert metrics.ENGINE_DROPPED.labels(*labels, "deadline")._value.get() >= expired0 + 1


def test_a_statistics_round_or_fetch_past_its_budget_is_a_deadline_not_an_engine_fault(
        engine_build):
    """Outside QA (`serve --workers`): a statistics round that ran out of its budget raised a
    bare TimeoutError, which the engine process logged as a bug with a traceback and sent on as
    "engine error". The shard interface now answers DEADLINE_EXCEEDED, as for a search."""
    from server.core.types import FetchRequest, ShardQuery
    from server.errors import DeadlineExceeded

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    gate = threading.Event()
    inner_stats, inner_fetch = shard.index.term_stats, shard.index.fetch
    shard.index.term_stats = lambda qs: (gate.wait(30), inner_stats(qs))[1]
    shard.index.fetch = lambda req: (gate.wait(30), inner_fetch(req))[1]
    stats = ShardQuery(desc.build_id, "alpha", None, desc.model_id, "flow", 0, 10, stats_only=True)

    async def go():
        with pytest.raises(DeadlineExceeded, match="statistics round"):
            await shard.search([stats], timeout=0.05)
        with pytest.raises(DeadlineExceeded, match="fetch"):
            await shard.fetch(FetchRequest(desc.build_id, "alpha", (), (0, 1)), timeout=0.05)
        gate.set()
        return await shard.search([stats], timeout=10)

    try:
        answer = asyncio.run(go())[0]
    finally:
        gate.set()
        asyncio.run(shard.close())
        pools.close()
    assert answer.term_stats is not None and answer.term_stats.docs > 0


def test_a_statistics_query_searched_beside_others_reports_its_tenants_counts(engine_build):
    """Review: a statistics query that shared a message (a group) with searches was answered
    with the index-wide counts, the stand-alone round with the tenant's; both are the tenant's."""
    from server.core.types import ShardQuery

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    try:
        stats = ShardQuery(desc.build_id, "beta", None, desc.model_id, "flow", 0, 0, stats_only=True)
        search = ShardQuery(desc.build_id, "beta", None, desc.model_id, "flow", 0, 10)
        alone = shard.index.term_stats([stats])[0].term_stats
        grouped = shard.index.search_group([stats, search])[0].term_stats
        assert alone == grouped and alone.docs == shard.index.tenant_counts["beta"]
    finally:
        asyncio.run(shard.close())
        pools.close()


def test_mixed_restrictions_never_share_a_batch(engine_build, rng):
    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    groups = GatedGroups(shard, hold_first=True)
    v = rng.standard_normal((24, desc.dim)).astype(np.float32)

    async def go():
        first = asyncio.ensure_future(shard.search([query(desc, "alpha", v[0])]))
        await asyncio.get_running_loop().run_in_executor(None, groups.entered.wait, 10)
        futs = [asyncio.ensure_future(shard.search([query(desc, t, x)]))
                for t, x in zip(["alpha", "beta", "alpha", "beta"] * 6, v[1:])]
        await asyncio.sleep(0)
        groups.gate.set()
        await first
        return [(await f)[0] for f in futs]

    try:
        results = asyncio.run(go())
    finally:
        asyncio.run(shard.close())
        pools.close()
    for batch in groups.batches:
        assert len({r for _, r in batch}) == 1      # one restriction, one selector, per call
    tenants = ["alpha", "beta", "alpha", "beta"] * 6
    for t, r in zip(tenants, results):
        assert r.dense and all(c.record.tenant == t for c in r.dense[:3] if c.record.text is not None)


def test_an_idle_shard_searches_at_once_without_waiting_for_the_dispatch_timeout(engine_build, rng):
    """The dispatch timeout applies only while a batch is running: a lone query goes to the index
    the moment it is submitted (no timer armed), so an idle server is not taxed."""
    data, desc = engine_build
    shard, pools = open_shard(data, desc, dispatch_timeout_ms=60_000.0)
    v = rng.standard_normal(desc.dim).astype(np.float32)

    async def go():
        fut = shard.scheduler.submit(query(desc, "alpha", v), None)
        dispatched = shard.scheduler._running == 1 and shard.scheduler.depth() == 0
        armed = shard.scheduler._timer is not None
        await fut
        return dispatched, armed

    try:
        dispatched, armed = asyncio.run(go())
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert dispatched and not armed


def test_concurrent_writes_share_group_commits(engine_build, tiny_embedder):
    from server.core.chunking import document_chunks
    from server.core.types import ShardWrite

    data, desc = engine_build
    shard, pools = open_shard(data, desc)

    def write(i):
        chunks = document_chunks("", f"zyxgroup{i} a streamed document about wing flutter")
        return ShardWrite("upsert", "alpha", f"g-{i}", 1, {"title": "", "text": chunks[0].text},
                          tuple(chunks), tiny_embedder.encode([c.text for c in chunks]))

    async def go():
        return await asyncio.gather(*(shard.apply([write(i)]) for i in range(12)))

    try:
        outcomes = asyncio.run(go())
        assert [o[0].outcome for o in outcomes] == ["applied"] * 12
        assert shard.writes.groups < 12          # fewer commits than writes
        info, stored = shard.index.info(), shard.index.store.counts()
        assert (info.documents, info.chunks) == (stored["documents"], stored["chunks"])
        alpha = shard.index.info("alpha")
        assert (alpha.documents, alpha.chunks) == (shard.index.store.counts("alpha")["documents"],
                                                   shard.index.store.counts("alpha")["chunks"])
        hits = shard.index.search_group([query(desc, "alpha", tiny_embedder.encode(
            ["zyxgroup3 a streamed document about wing flutter"])[0])])[0]
        assert any(c.record.doc_id == "g-3" for c in hits.dense if c.record.text is not None)
    finally:
        asyncio.run(shard.close())
        pools.close()


def test_cached_records_never_outlive_their_rows(engine_build, tiny_embedder):
    """The record cache keeps chunk records by row. A row never changes, but it stops being live
    when its document is replaced or deleted: neither a search nor a fetch may return it then,
    though its record is still cached."""
    from server.core import metrics
    from server.core.chunking import document_chunks
    from server.core.types import FetchRequest, ShardWrite

    data, desc = engine_build
    shard, pools = open_shard(data, desc, record_cache_rows=10_000)
    text = "qqcache a document about boundary layer suction on swept wings"

    def write(op, version, body_text=text):
        chunks = document_chunks("", body_text) if op == "upsert" else []
        vecs = (tiny_embedder.encode([c.text for c in chunks]) if chunks
                else np.zeros((0, desc.dim), np.float32))
        return ShardWrite(op, "alpha", "cached-doc", version, {"title": "", "text": body_text},
                          tuple(chunks), vecs)

    v = tiny_embedder.encode([text])[0]

    def mine():
        res = shard.index.search_group([query(desc, "alpha", v, depth=200)])[0]
        return [c for c in res.dense if c.record.doc_id == "cached-doc"]

    async def apply(w):
        return await shard.apply([w])

    try:
        asyncio.run(apply(write("upsert", 1)))
        first = mine()
        assert first and first[0].record.text.startswith("qqcache")
        old_row = first[0].record.row
        hits = shard.index.records.hits
        exported = metrics.RECORD_CACHE.labels("eng", "0", "hit")._value.get()
        assert mine()[0].record.row == old_row and shard.index.records.hits > hits  # served cached
        assert metrics.RECORD_CACHE.labels("eng", "0", "hit")._value.get() > exported
        assert old_row in shard.index.records._records

        asyncio.run(apply(write("upsert", 2, "qqcache version two of the document about suction")))
        now = mine()
        assert [c.record.row for c in now] != [old_row]
        assert all(c.record.text.startswith("qqcache version two") for c in now)
        fetch = FetchRequest(desc.build_id, "alpha", (), (old_row,))
        assert shard.index.fetch(fetch) == []          # the old version's row, cached, not live

        new_rows = [c.record.row for c in now]
        asyncio.run(apply(write("delete", 3)))
        assert mine() == []
        assert shard.index.fetch(FetchRequest(desc.build_id, "alpha", (), tuple(new_rows))) == []
    finally:
        asyncio.run(shard.close())
        pools.close()


def test_the_record_cache_is_bounded_and_drops_the_least_recently_used(engine_build):
    from server.core.engine.index import RecordCache

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    index = shard.index
    try:
        cache = RecordCache(5)
        first = cache.read(list(range(10)), index.live, index.store)
        assert sorted(first) == list(range(10)) and cache.misses == 10
        assert list(cache._records) == [5, 6, 7, 8, 9]
        assert cache.read([5], index.live, index.store)[5] == first[5] and cache.hits == 1
        cache.read([10], index.live, index.store)     # evicts 6, the least recently used
        assert list(cache._records) == [7, 8, 9, 5, 10]
        off = RecordCache(0)
        assert off.read([1, 2], index.live, index.store).keys() == {1, 2} and not off._records
        # and by bytes: room for the three records read last, whatever the rows allow (texts of
        # a million characters would make 50,000 rows 50 GB)
        sizes = [cache._size(first[r]) for r in range(10)]
        by_bytes = RecordCache(1000, max_bytes=sum(sizes[7:]))
        by_bytes.read(list(range(10)), index.live, index.store)
        assert list(by_bytes._records) == [7, 8, 9] and by_bytes.bytes == sum(sizes[7:])
        by_bytes.read([0], index.live, index.store)   # evicts 7 and, if 0 is longer, 8 too
        assert list(by_bytes._records)[-1] == 0 and by_bytes.bytes <= by_bytes.max_bytes
        assert by_bytes.bytes == sum(cache._size(r) for r in by_bytes._records.values())
    finally:
        asyncio.run(shard.close())
        pools.close()


def test_a_fetch_that_would_pass_a_responses_size_is_refused_before_it_is_read(engine_build,
                                                                              monkeypatch):
    """A fetch of more rows than surely fit asks SQLite their size first and is refused, naming
    the limit, without reading them (review: records of a million characters each were read
    whole, then refused); one that fits is read as ever."""
    from server.core import limits
    from server.core.engine import index as index_module
    from server.core.types import FetchRequest
    from server.errors import ResponseTooLarge

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    index = shard.index
    try:
        rows = list(range(20))
        size = index.store.stored_bytes(rows)
        assert size > 0
        monkeypatch.setattr(index_module, "FETCH_UNCHECKED_ROWS", 4)
        monkeypatch.setattr(limits, "ANSWERS_BUDGET_BYTES", size - 1)
        reads = []
        monkeypatch.setattr(index.records, "read", lambda *a: reads.append(a) or {})
        req = FetchRequest(desc.build_id, "default", (), tuple(rows))
        with pytest.raises(ResponseTooLarge, match=limits.RESPONSE_TOO_LARGE_NOTE):
            index.fetch(req)
        assert reads == []  # refused before a record was read
        monkeypatch.setattr(limits, "ANSWERS_BUDGET_BYTES", size)
        index.fetch(req)
        assert len(reads) == 1
    finally:
        asyncio.run(shard.close())
        pools.close()


def test_the_packed_record_read_equals_the_row_by_row_read(tmp_path, monkeypatch):
    """DocStore.fetch reads a block of rows as one JSON value (one SQLite step: one GIL hand-back
    instead of one per row); it must return exactly what the row-by-row read does, odd text and
    extreme integers included, and only live rows."""
    from server.backends import docstore
    from server.backends.docstore import ChunkRecord, DocStore

    store = DocStore(tmp_path / "s.sqlite", create=True)
    records = [
        ChunkRecord(0, 2**63 - 1, "d\"0", 0, 0, 5, "T\u00eftle", "caf\u00e9 \U0001f600 \"quoted\"\n\\", "t",
                    {"lang": "fr", "year": "1999"}, ("@all", "team-a"), 2**62 + 7),
        ChunkRecord(1, 1, "d1", 3, 10, 20, "", "\u0000 nul and tab\t", "t", {}, ("@all",), 1),
        ChunkRecord(2, 12345, "d2", 0, 0, 1, "", "x", "other", {"k": "v"}, ("team-b",), 0),
        ChunkRecord(3, 99, "dead", 0, 0, 1, "", "gone", "t", {}, ("@all",), 5),
    ]
    store.insert_chunks(records)
    store._conn().execute("UPDATE chunks SET live=2 WHERE row=3")
    rows = [3, 2, 1, 0, 7]
    packed = store.fetch(rows)
    assert docstore._JSON_FETCH  # the packed read ran (no fallback)
    monkeypatch.setattr(docstore, "_JSON_FETCH", False)
    row_by_row = store.fetch(rows)
    assert packed == row_by_row
    assert sorted(packed) == [0, 1, 2]
    assert packed[0].text == records[0].text and packed[0].chunk_id == 2**63 - 1
    assert packed[1].text == records[1].text                 # NUL survives the JSON packing
    assert packed[0].acl == ("@all", "team-a") and isinstance(packed[0].acl, tuple)
    store.close()


def test_recovery_deletes_a_cut_off_groups_pending_rows_and_orphans_earlier_ones(tmp_path):
    """Pending rows after the last settled row (a crash between a group's pending insert and its
    flip) are deleted, so the next write takes the same rows on every replica; pending rows that
    settled rows follow (a group that failed without a crash) cannot be renumbered and become
    orphans."""
    from server.backends.docstore import ChunkRecord, DocStore, STATE_NAMES

    store = DocStore(tmp_path / "s.sqlite", create=True)
    store.insert_chunks([ChunkRecord(r, 100 + r, f"d{r}", 0, 0, 1, "", "x", "t", {}, ("@all",), r)
                         for r in range(6)])
    store._conn().execute("UPDATE chunks SET live=0 WHERE row IN (2, 4, 5)")  # 2: mid, 4-5: tail
    assert store.pending_tail() == [4, 5]
    store.delete_rows_from(4)
    assert store.next_row() == 4
    assert store.orphan_pending() == 1
    states = dict(store._conn().execute("SELECT row, live FROM chunks").fetchall())
    assert {r: STATE_NAMES[v] for r, v in states.items()} == {
        0: "live", 1: "live", 2: "orphan", 3: "live"}
    assert store.pending_tail() == []  # nothing pending left
    store.close()


def test_batches_run_one_at_a_time_on_a_gpu_and_one_per_spare_core_on_the_cpu(monkeypatch):
    import os

    from server.backends import threads
    from server.core.engine.local import dense_workers

    monkeypatch.setattr(threads, "_cgroup_quota", lambda *a, **k: None)  # a host with no quota
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert dense_workers(0, "cpu") == 4 and dense_workers(0, "cuda:0") == 1
    assert dense_workers(3, "cuda:0") == 3         # a configured number wins
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert dense_workers(0, "cpu") == 2             # one core left to the front end
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert dense_workers(0, "cpu") == 1


def test_the_read_write_lock_shares_reads_and_lets_a_waiting_writer_go_first():
    """Searches share the read side; a write's flip waits for them and, once waiting, goes before
    searches that arrive after it (writes never starve)."""
    from server.core.rwlock import RWLock

    lock = RWLock()
    order = []
    writer_in, late_reader_in = threading.Event(), threading.Event()

    def writer():
        with lock.write():
            order.append("writer")
            writer_in.set()

    def late_reader():
        with lock.read():
            order.append("late reader")
            late_reader_in.set()

    with lock.read():
        with lock.read():                       # a second reader does not wait for the first
            order.append("two readers")
        w = threading.Thread(target=writer)
        w.start()
        deadline = time.monotonic() + 10        # until the writer is queued behind the reader
        while lock._waiting_writers != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lock._waiting_writers == 1
        r = threading.Thread(target=late_reader)
        r.start()
        assert not writer_in.wait(0.2) and not late_reader_in.is_set()
    w.join(10)
    r.join(10)
    assert order == ["two readers", "writer", "late reader"]


def test_a_batch_holding_the_read_lock_never_waits_for_threads_queued_behind_a_writer(
        engine_build, rng):
    """Outside QA (writes beside SearchBatch and Search; `serve` and `--workers` hung for good): a
    batch of texts holds the shard's read lock while its BM25 searches fan out to a pool. A write
    came to wait for the lock, so every fetch that arrived after it queued for the lock on that
    pool's threads - all of them - and the batch's BM25 searches never got a thread. Here: the
    batch paused after taking the lock, a writer waiting, every `cpu` thread a fetch queued for
    the lock; the batch must finish, then the writer, then the fetches."""
    from server.core.types import FetchRequest, ShardQuery

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    index = shard.index
    in_dense, go = threading.Event(), threading.Event()
    inner_dense = index.dense_search

    def paused_dense(*args):  # the batch holds the read lock here
        in_dense.set()
        go.wait(60)
        return inner_dense(*args)

    index.dense_search = paused_dense
    fetching = threading.Semaphore(0)
    inner_fetch = index.fetch

    def counted_fetch(req):
        fetching.release()  # on a `cpu` thread, about to wait for the read lock
        return inner_fetch(req)

    index.fetch = counted_fetch
    texts = ["flow over a flat plate", "heat transfer at the wall", "shock wave boundary layer"]
    queries = [ShardQuery(desc.build_id, "alpha", rng.standard_normal(desc.dim).astype(np.float32),
                          desc.model_id, t, 10, 10) for t in texts]
    answers, order = [], []
    batch = threading.Thread(target=lambda: (answers.extend(shard._run_group(queries)),
                                             order.append("batch")), daemon=True)

    def write_side():
        with index._rw.write():
            order.append("writer")

    writer = threading.Thread(target=write_side, daemon=True)
    threads = pools.cpu._max_workers
    try:
        batch.start()
        assert in_dense.wait(30)
        writer.start()
        deadline = time.monotonic() + 10  # until the writer waits behind the batch
        while index._rw._waiting_writers != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert index._rw._waiting_writers == 1
        fetches = [pools.cpu.submit(index.fetch, FetchRequest(desc.build_id, "alpha", (), (0, 1)))
                   for _ in range(threads)]
        for _ in range(threads):  # every `cpu` thread is in a fetch, queued for the read lock
            assert fetching.acquire(timeout=30)
        go.set()
        batch.join(60)
        writer.join(60)
        assert not batch.is_alive() and not writer.is_alive(), "the shard deadlocked"
        assert order == ["batch", "writer"]
        assert all(f.result(60) for f in fetches)
        assert len(answers) == 3 and all(a.lexical for a in answers)
    finally:
        go.set()
        index.dense_search, index.fetch = inner_dense, inner_fetch
        if batch.is_alive():  # deadlocked: let the queued fetches in, so the cycle ends and
            lock = index._rw  # pytest can exit (its pool threads are not daemons)
            with lock._cond:
                lock._waiting_writers = 0
                lock._cond.notify_all()
            batch.join(60)
        asyncio.run(shard.close())
        pools.close()


def test_a_failed_batch_fails_its_queries_and_the_shard_keeps_serving(engine_build, rng):
    """The device thread's failure comes back through the loop callback to every query of its
    batch (and only those); the next batch runs; a shard whose device pool is gone answers
    UNAVAILABLE instead of hanging."""
    from server.errors import Unavailable

    data, desc = engine_build
    shard, pools = open_shard(data, desc, dense_workers=1)
    v = rng.standard_normal((3, desc.dim)).astype(np.float32)
    inner = shard.index.search_group
    calls = []

    def flaky(queries, lexical_map=map):
        calls.append(len(queries))
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return inner(queries, lexical_map)

    shard.index.search_group = flaky

    async def go():
        first = await asyncio.gather(shard.search([query(desc, "alpha", v[0])]),
                                     return_exceptions=True)
        second = await shard.search([query(desc, "alpha", v[1])])
        shard._device.shutdown(wait=True)
        (refused,) = await shard.search([query(desc, "alpha", v[2])])  # its slot's error
        assert isinstance(refused, Unavailable)
        return first[0], second[0]

    try:
        failed, ok = asyncio.run(go())
    finally:
        shard.index.close()
        pools.close()
    assert isinstance(failed, RuntimeError) and "device fault" in str(failed)
    want = inner([query(desc, "alpha", v[1])])[0]
    assert [c.chunk_id for c in ok.dense] == [c.chunk_id for c in want.dense]
    assert shard.scheduler._running == 0                      # no batch left counted as running


def test_a_lone_coroutine_is_awaited_in_place_with_gathers_semantics():
    from server.core.pipeline import gather

    async def ok(x):
        return x

    async def bad():
        raise ValueError("boom")

    async def go():
        assert await gather([ok(1)]) == [1]
        assert await gather([ok(1), ok(2)]) == [1, 2]
        assert await gather([]) == []
        (err,) = await gather([bad()], return_exceptions=True)
        assert isinstance(err, ValueError)
        with pytest.raises(ValueError):
            await gather([bad()])
        got = await gather([ok(1), bad()], return_exceptions=True)
        assert got[0] == 1 and isinstance(got[1], ValueError)

    asyncio.run(go())


def test_memoised_metric_children_are_the_registered_ones():
    from server.core import metrics

    child = metrics.labelled(metrics.REQUESTS, "TestMethod", "OK")
    assert child is metrics.labelled(metrics.REQUESTS, "TestMethod", "OK")
    before = metrics.REQUESTS.labels("TestMethod", "OK")._value.get()
    child.inc()
    assert metrics.REQUESTS.labels("TestMethod", "OK")._value.get() == before + 1


def test_a_backlog_of_full_batches_uses_the_burst_workers_and_a_trickle_does_not():
    """Single-query traffic keeps to `workers` batches at a time (a core stays with the front
    end); once a full batch's worth of queries waits (a SearchBatch), up to `burst_workers` run,
    and full batches are handed to the device pool ahead of a free thread."""
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.local import burst_workers, dense_workers
    from server.core.engine.scheduler import SearchScheduler

    running, peak, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def run_group(queries):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1
        return [q * 10 for q in queries]

    class Q(int):
        restriction = ("same",)

    pool = ThreadPoolExecutor(2)

    async def go():
        s = SearchScheduler(run_group, pool, ("unit", "0"), max_batch=4, dispatch_timeout_ms=1.0,
                            workers=1, burst_workers=2)
        first = s.submit(Q(1), None)                       # idle: runs at once
        trickle = [s.submit(Q(i), None) for i in (2, 3, 4)]
        await asyncio.sleep(0.05)                          # past the dispatch timeout
        peak_trickle = peak[0]
        backlog = [s.submit(Q(i), None) for i in (5, 6, 7, 8, 9)]  # now >= 4 wait
        for _ in range(200):
            if peak[0] == 2:
                break
            await asyncio.sleep(0.01)
        peak_backlog = peak[0]
        handed_over = s._running  # full batches queue behind the busy device threads
        release.set()
        got = await asyncio.gather(first, *trickle, *backlog)
        await s.close()
        return peak_trickle, peak_backlog, handed_over, got

    try:
        peak_trickle, peak_backlog, handed_over, got = asyncio.run(go())
    finally:
        pool.shutdown()
    assert peak_trickle == 1 and peak_backlog == 2
    # the first batch, then [2..5] and [6..9] handed over at once: one of them waits in the
    # device pool's queue rather than in the scheduler for a loop turn
    assert handed_over == 3
    assert got == [i * 10 for i in range(1, 10)]             # every caller its own answer
    # the CPU rule: one core left to the front end, every core for a backlog, 1 on a GPU
    assert burst_workers(0, "cuda:0") == 1 and burst_workers(3, "cpu") == 3
    from server.backends.threads import usable_cores
    assert burst_workers(0, "cpu") == max(1, min(4, usable_cores())) >= dense_workers(0, "cpu")


@pytest.mark.skipif(not hasattr(__import__("os"), "setpriority"), reason="no per-thread priority")
def test_the_threads_that_search_a_cpu_index_run_below_the_event_loops_priority(engine_build, rng):
    import os

    data, desc = engine_build
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}
    for nice in (7, 0):
        shard, pools = open_shard(data, desc, device_nice=nice)
        inner = shard.index.search_group

        def spy(queries, lexical_map=map, nice=nice):
            seen[nice] = os.getpriority(os.PRIO_PROCESS, 0)  # this (device) thread's own
            return inner(queries, lexical_map)

        shard.index.search_group = spy
        try:
            asyncio.run(shard.search([query(desc, "alpha", rng.standard_normal(desc.dim))]))
        finally:
            asyncio.run(shard.close())
            pools.close()
    assert seen[7] == min(19, base + 7)                   # lowered, relative to the process's
    assert seen[0] == base                                # 0 leaves it alone
    assert os.getpriority(os.PRIO_PROCESS, 0) == base     # the caller's thread is untouched


def test_a_batch_queued_behind_a_busy_thread_leaves_out_queries_that_died_meanwhile():
    """A full batch handed to the device pool ahead of a free thread still leaves out, when it
    starts, a query whose caller went away and one whose deadline passed while it waited; the
    expired one is told so, the rest are answered."""
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import SearchScheduler
    from server.errors import DeadlineExceeded

    release = threading.Event()
    searched, handed = [], []

    def run_group(queries):
        searched.append(list(queries))
        if queries[0] == 1:
            release.wait(10)
        return [q * 10 for q in queries]

    class Q(int):
        restriction = ("same",)

    class RecordingPool(ThreadPoolExecutor):  # remembers each batch it is handed
        def submit(self, fn, batch, *args):
            handed.append(batch)
            return super().submit(fn, batch, *args)

    pool = RecordingPool(1)

    async def go():
        loop = asyncio.get_running_loop()
        s = SearchScheduler(run_group, pool, ("unit", "0"), max_batch=3, dispatch_timeout_ms=1.0,
                            workers=1, burst_workers=1)
        first = s.submit(Q(1), None)                     # runs at once, held on the only thread
        late = [s.submit(Q(i), loop.time() + 60) for i in (2, 3, 4)]  # a full batch: queued ahead
        try:
            assert s._running == 2 and s.depth() == 0    # handed over, waiting in the pool
            late[0].cancel()                             # its caller went away
            (expiring,) = [p for p in handed[1] if p.future is late[1]]
            expiring.deadline = loop.time() - 1          # its deadline passed while it waited
        finally:
            release.set()
        assert await first == 10
        with pytest.raises(DeadlineExceeded):
            await late[1]
        assert await late[2] == 40
        await s.close()

    try:
        asyncio.run(go())
    finally:
        pool.shutdown()
    assert searched == [[1], [4]]


def test_an_idle_device_thread_takes_what_queued_at_the_next_loop_turn():
    """With two device threads and one busy, queries that arrive meanwhile do not wait for the
    dispatch timeout while the other thread idles: they go at the next loop turn, together (the
    ones submitted in the same turn share one batch)."""
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import SearchScheduler

    release = threading.Event()
    run_group, Q = held_first(release)
    batches = []

    def recording(queries):
        batches.append(list(queries))
        return run_group(queries)

    pool = ThreadPoolExecutor(2)

    async def go():
        s = SearchScheduler(recording, pool, ("unit", "0"), max_batch=64,
                            dispatch_timeout_ms=60_000.0, workers=2, burst_workers=2)
        first = s.submit(Q(1), None)                    # idle: runs at once, held
        rest = [s.submit(Q(i), None) for i in (2, 3, 4)]
        queued = s.depth()
        try:                                           # 60 s of dispatch timeout: only the
            got = await asyncio.wait_for(asyncio.gather(*rest), 5)  # idle thread answers in time
        finally:
            release.set()
        assert await first == 1
        await s.close()
        return queued, got

    try:
        queued, got = asyncio.run(go())
    finally:
        pool.shutdown()
    assert queued == 3                                 # not dispatched one by one as they came
    assert got == [2, 3, 4] and batches == [[1], [2, 3, 4]]


def held_first(release: threading.Event, other: bool = False):
    """A device function whose batch starting with query 1 waits for `release` (a busy device),
    and a query type whose values all share one restriction (so one batch); with `other`, also
    a query type of another restriction."""
    def run_group(queries):
        if queries[0] == 1:
            release.wait(10)
        return list(queries)

    class Q(int):
        restriction = ("same",)

    class QB(int):
        restriction = ("other",)

    return (run_group, Q, QB) if other else (run_group, Q)


def timed_scheduler(cls, run_group, pool):
    """One device thread (two in a backlog), batches of 2, a 1 ms dispatch timeout - set once
    the state below is built (a loaded host may pass a millisecond between two submits)."""
    return cls(run_group, pool, ("unit", "0"), max_batch=2, dispatch_timeout_ms=60_000.0,
               workers=1, burst_workers=2)


def backlog_behind_a_partial_group(s, Q, QB):
    """The state a dispatch timer is for: the only regular device thread busy (query 1 held), a
    backlog (a full batch of [3, 4]) that allows burst batches, and ahead of it a group of one
    query of another restriction that waits for its timer. Returns the three futures, the
    backlog's gathered."""
    first = s.submit(Q(1), None)                      # idle: runs at once, held
    other = s.submit(QB(2), None)                     # a batch runs: waits (no backlog yet)
    full = [s.submit(Q(i), None) for i in (3, 4)]     # a backlog now, queued behind it
    assert s._running == 1 and s._timer is not None and list(s._groups) == [("other",), ("same",)]
    s.dispatch_timeout = 0.001                        # the timer the group's 1 ms asks for
    s._arm(s._groups[("other",)][0].enqueued + s.dispatch_timeout)
    return first, other, asyncio.gather(*full)


def test_a_dispatch_timer_fires_once_on_uvloops_millisecond_clock():
    """uvloop's loop.time() counts whole milliseconds: read in the timer's own callback it can
    sit just under the time the timer was set for. The scheduler takes the timer's time as now,
    so a waiting group goes on the first firing instead of re-arming 0 ms timers."""
    uvloop = pytest.importorskip("uvloop")
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import SearchScheduler

    release = threading.Event()
    run_group, Q, QB = held_first(release, other=True)
    pool = ThreadPoolExecutor(3)
    fired = []

    async def go():
        s = timed_scheduler(SearchScheduler, run_group, pool)
        inner = s._fire
        s._fire = lambda when: (fired.append(when), inner(when))
        first, other, full = backlog_behind_a_partial_group(s, Q, QB)
        got = await other, await full               # the timer lets the partial group go
        release.set()
        return await first, got

    try:
        assert uvloop.run(go()) == (1, (2, [3, 4]))
    finally:
        pool.shutdown()
    assert 1 <= len(fired) <= 2


def test_a_timer_armed_for_now_on_uvloop_can_be_armed_again():
    """Regression (outside QA): uvloop's call_at answers a plain Handle, without when(), for a
    time that rounds to now; arming again read when() and failed the shard's whole message
    (UNAVAILABLE: "'uvloop.loop.Handle' object has no attribute 'when'")."""
    uvloop = pytest.importorskip("uvloop")
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import SearchScheduler

    run_group, _ = held_first(threading.Event())
    pool = ThreadPoolExecutor(1)
    fired = []

    async def go():
        s = timed_scheduler(SearchScheduler, run_group, pool)
        s._fire = fired.append
        loop = asyncio.get_running_loop()
        now = loop.time()
        s._arm(now - 0.001)   # due already: a Handle, not a TimerHandle, under uvloop
        assert not hasattr(s._timer, "when")
        s._arm(now + 60.0)    # later: the armed timer stands
        s._arm(now - 0.002)   # earlier: replaces it
        for _ in range(10):
            await asyncio.sleep(0)
        return now

    try:
        now = uvloop.run(go())
    finally:
        pool.shutdown()
    assert fired == [now - 0.002]  # the first was cancelled, the second never armed


def test_a_waiting_group_goes_when_its_timer_fires_whatever_the_float_rounding():
    """In about 4 binades of 10, (enqueued + 0.001) - enqueued is just under 0.001: a
    group due at enqueued + timeout must go when its timer fires for that time, not re-arm (this
    is what made the uvloop test above fail now and then)."""
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import SearchScheduler

    release = threading.Event()
    run_group, Q, QB = held_first(release, other=True)
    pool = ThreadPoolExecutor(3)

    async def go():
        s = timed_scheduler(SearchScheduler, run_group, pool)
        first, other, full = backlog_behind_a_partial_group(s, Q, QB)
        group = s._groups[("other",)]
        # a time the loop's clock has not reached where the rounding bites. Within a binade
        # [2^k, 2^(k+1)) every float is a multiple of one ulp, so (e + 0.001) - e is the same for
        # all of them: search binades, not neighbouring floats (a search of neighbours never
        # ended once the host's monotonic clock passed 65,536 s, a binade where it never bites)
        e = asyncio.get_running_loop().time() + 60
        for _ in range(64):
            if (e + 0.001) - e < 0.001:
                break
            e *= 2
        assert (e + 0.001) - e < 0.001
        group[0].enqueued = e
        armed = []
        s._arm = armed.append
        try:
            s._fire(e + 0.001)                    # the timer armed for e + timeout fires
            assert armed == [] and not s._groups  # it went, nothing re-armed
        finally:
            release.set()
        return await first, await other, await full

    try:
        assert asyncio.run(go()) == (1, 2, [3, 4])
    finally:
        pool.shutdown()


def test_close_returns_when_a_running_batch_ends_and_every_queued_query_was_dropped(engine_build, rng):
    data, desc = engine_build
    shard, pools = open_shard(data, desc, dense_workers=1)
    groups = GatedGroups(shard, hold_first=True)
    v = rng.standard_normal((2, desc.dim)).astype(np.float32)

    async def go():
        busy = asyncio.ensure_future(shard.search([query(desc, "alpha", v[0])]))
        await asyncio.get_running_loop().run_in_executor(None, groups.entered.wait, 10)
        gone = asyncio.ensure_future(shard.search([query(desc, "alpha", v[1])]))
        await asyncio.sleep(0)
        gone.cancel()                          # queued behind the held batch, then dropped
        closing = asyncio.ensure_future(shard.scheduler.close())
        await asyncio.sleep(0)
        groups.gate.set()
        await busy
        await asyncio.wait_for(closing, 10)    # hung forever before: idle was checked too early

    try:
        asyncio.run(go())
    finally:
        shard._device.shutdown(wait=True)
        shard.index.close()
        pools.close()
    assert len(groups.batches) == 1


def test_a_lone_call_cancelled_under_us_is_a_result_and_our_own_cancellation_propagates():
    from server.core.pipeline import gather

    async def cancelled_inside():
        raise asyncio.CancelledError()        # e.g. a gRPC call whose channel closed

    async def go():
        (got,) = await gather([cancelled_inside()], return_exceptions=True)
        assert isinstance(got, asyncio.CancelledError)
        started = asyncio.Event()

        async def slow():
            started.set()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(gather([slow()], return_exceptions=True))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_a_chunk_that_fails_the_whole_batch_stops_the_other_chunks():
    """A batch-wide error in one chunk (its deadline) is the batch's answer, and the chunks still
    running are cancelled rather than left to search for nobody."""
    from server.config import PipelineConfig
    from server.core.pipeline import QueryPipeline
    from server.errors import DeadlineExceeded

    pipeline = QueryPipeline(None, None, PipelineConfig(batch_chunk=2), 0, None)
    started, cancelled = [], []

    async def chunk(states, tenant, acl_scopes, deadline, t_start, stats=None):  # one chunk's run
        queries = [st.q for st in states]
        started.append(queries)
        if queries[0] == 2:
            raise DeadlineExceeded("deadline passed before retrieval")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(list(queries))
            raise

    pipeline._search = chunk
    pipeline._prepare = lambda st, tenant, acl_scopes: None  # the stand-in queries are valid

    class Q(int):  # a stand-in query of vectors alone: no statistics round
        text = ""

    async def go():
        with pytest.raises(DeadlineExceeded):  # (unchunked, the lone call would wait forever)
            await asyncio.wait_for(pipeline.search([Q(i) for i in range(5)], "default", (), None), 10)
        # inside the loop's life (asyncio.run's own clean-up would cancel them anyway)
        for _ in range(100):
            if len(cancelled) == 2:
                break
            await asyncio.sleep(0)  # a loop turn: cancellation is delivered on the next one
        assert sorted(cancelled) == [[0, 1], [4]]

    asyncio.run(go())
    assert started == [[0, 1], [2, 3], [4]]


def test_a_statistics_round_answers_per_query_beside_searches_and_off_the_scheduler(engine_build, rng):
    """ShardQuery.stats_only: the shard's BM25 statistics for the query's terms and no hits; a
    call of statistics queries alone skips the search scheduler (no faiss batch), an invalid one
    fails in its slot only; mixed into a searched batch, each query gets its own kind of answer."""
    from dataclasses import replace

    from server.core.types import ShardResult
    from server.errors import InvalidArgument

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
    gated = GatedGroups(shard)
    base = query(desc, "alpha", rng.standard_normal(desc.dim))
    stats_q = replace(base, vector=None, text="boundary layer flow", dense_depth=0, stats_only=True)
    bad = replace(stats_q, dense_depth=-1)
    try:
        alone = asyncio.run(shard.search([stats_q, bad]))
        batches_alone = len(gated.batches)
        mixed = asyncio.run(shard.search([stats_q, replace(base, text="boundary layer flow",
                                                           lexical_depth=5)]))
        alpha_chunks = shard.index.tenant_counts["alpha"]
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert batches_alone == 0
    assert isinstance(alone[1], InvalidArgument)
    st = alone[0].term_stats
    assert isinstance(alone[0], ShardResult) and not alone[0].dense and not alone[0].lexical
    # the caller's tenant's live chunks (beta's 80 documents share the index)
    assert st.docs == alpha_chunks and [t for t, _, _ in st.df] == ["boundari", "layer", "flow"]
    assert all(text_df > 0 for _, text_df, _ in st.df)
    assert mixed[0].term_stats == st and not mixed[0].lexical
    assert mixed[1].term_stats is None and len(mixed[1].lexical) == 5 and len(mixed[1].dense) == 10


def test_a_querys_answer_does_not_depend_on_the_depth_of_its_batch_neighbours(tmp_path, rng):
    """Regression (outside QA): a group was searched with the largest depth of its queries, and an
    approximate index searches deeper for a larger k (HNSW's efSearch is at least k), so a query
    coalesced with a deep one answered otherwise than alone: Search and SearchBatch, or one
    caller's repeats under other callers' traffic, disagreed."""
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex

    n, dim = 3000, 32
    x = rng.standard_normal((n, dim)).astype(np.float32)
    docs = [Document(f"d{i}", f"document {i}") for i in range(n)]
    desc = publish_build(tmp_path, "hn", docs, None, "HNSW8,Flat", vectors=x, model_id="m",
                         search_defaults={"ef_search": 8})
    index = ShardIndex(desc, CollectionStore(tmp_path).build_dir("hn", desc.build_id),
                       tmp_path / ".state", 0, None, 0)
    try:
        shallow = [query(desc, "default", v, depth=10) for v in rng.standard_normal((40, dim))]
        alone = [index.search_group([q])[0] for q in shallow]
        deep = query(desc, "default", rng.standard_normal(dim), depth=300)
        mixed = index.search_group(shallow + [deep])
    finally:
        index.close()
    assert {r.batch_size for r in mixed} == {41}  # one group: the depths shared a call before
    for a, m in zip(alone, mixed):
        assert [(c.chunk_id, c.score) for c in m.dense] == [(c.chunk_id, c.score) for c in a.dense]
    assert len(mixed[-1].dense) == 300


@pytest.mark.parametrize("key, red, blue", [
    ("team.name", "red", "blue"),                                  # a dot in the key
    ("published", "2024-05-01T12:00:00Z", "2024-05-02 08:00:00+02:00"),  # RFC 3339 date-times
    ("plain", "red", "blue"),
])
def test_an_equality_filter_restricts_bm25_as_it_restricts_dense(tmp_path, rng, key, red, blue):
    """Regression (outside QA): lexical filters ran as terms on tantivy's JSON field, which reads
    a dot in a key as a step into an object and indexes a string that parses as an RFC 3339
    date-time as a date: both filters matched nothing in lexical mode (and hybrid lost its
    lexical side) while dense found the documents."""
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex
    from server.core.types import Filter, ShardQuery

    docs = [Document(f"d{i}", f"quarterly report number {i}", metadata={key: red if i % 2 else blue})
            for i in range(30)]
    x = rng.standard_normal((30, 8)).astype(np.float32)
    desc = publish_build(tmp_path, "mf", docs, None, "Flat", vectors=x, model_id="m")
    index = ShardIndex(desc, CollectionStore(tmp_path).build_dir("mf", desc.build_id),
                       tmp_path / ".state", 0, None, 0)
    try:
        found = {}
        for value in (red, blue):
            q = ShardQuery(desc.build_id, "default", x[0], "m", "quarterly report", 50, 50,
                           (Filter(key, (value,)),))
            r = index.search_group([q])[0]
            found[value] = ({c.record.doc_id for c in r.dense}, {c.record.doc_id for c in r.lexical})
    finally:
        index.close()
    for value, parity in ((red, 1), (blue, 0)):
        want = {f"d{i}" for i in range(30) if i % 2 == parity}
        assert found[value] == (want, want), value


def test_a_panic_of_the_bm25_library_fails_the_query_at_once_naming_the_index(engine_build):
    """Outside QA: a flipped byte in a BM25 file made tantivy panic; pyo3 raises that as
    PanicException, a BaseException that `except Exception` lets through, so every lexical
    query waited for its deadline without an answer. It is now an IndexCorruptError naming the
    BM25 index, in the query's slot, and the shard keeps serving."""
    from server.core.types import ShardQuery
    from server.errors import IndexCorruptError

    class PanicException(BaseException):  # pyo3's, by name (it cannot be imported)
        pass

    data, desc = engine_build
    shard, pools = open_shard(data, desc)

    def panics(*args, **kwargs):
        raise PanicException("index out of bounds: the len is 3 but the index is 7")

    lexical = ShardQuery(desc.build_id, "alpha", None, desc.model_id, "boundary layer", 0, 10)

    async def go():
        shard.index.lexical.search = panics
        [got] = await asyncio.wait_for(shard.search([lexical]), 10)
        del shard.index.lexical.search
        [after] = await asyncio.wait_for(shard.search([lexical]), 10)
        return got, after

    try:
        got, after = asyncio.run(go())
    finally:
        asyncio.run(shard.close())
        pools.close()
    assert isinstance(got, IndexCorruptError)
    assert "BM25 index in" in str(got) and "index out of bounds" in str(got)
    assert after.lexical  # the shard still answers


def test_a_panic_while_writing_fails_the_group_at_once_and_the_queue_goes_on():
    """Review: the write queue caught Exception only, so a tantivy panic (a BaseException) in
    a group's commit left its writers waiting for their deadlines; they now get an
    IndexCorruptError at once, and the next group is applied."""
    from concurrent.futures import ThreadPoolExecutor

    from server.core.engine.scheduler import WriteQueue
    from server.errors import IndexCorruptError

    class PanicException(BaseException):  # pyo3's, by name
        pass

    calls = []

    def apply(writes):
        calls.append(list(writes))
        if len(calls) == 1:
            raise PanicException("index out of bounds")
        return [f"ok-{w}" for w in writes]

    pool = ThreadPoolExecutor(1)

    async def go():
        q = WriteQueue(apply, pool, ("unit", "0"))
        first = await asyncio.wait_for(asyncio.gather(q.submit(["a"]), return_exceptions=True), 10)
        second = await asyncio.wait_for(q.submit(["b"]), 10)
        return first[0], second

    try:
        first, second = asyncio.run(go())
    finally:
        pool.shutdown()
    assert isinstance(first, IndexCorruptError) and "index out of bounds" in str(first)
    assert second == ["ok-b"]


def test_bm25_statistics_count_only_the_documents_the_callers_scopes_read(tmp_path, rng):
    """Outside QA: documents that need an ACL scope still counted in the BM25 statistics of
    callers without it - 12 hidden documents holding a term halved a scope-less caller's score
    for its own visible document, telling it how many restricted documents hold any word. The
    statistics now count the documents the caller's scopes read (where the tenant has restricted
    ones: others pay nothing)."""
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex
    from server.core.types import ShardQuery

    docs = [Document("vis", "secretterm common words of a visible report", tenant="acme")]
    docs += [Document(f"hid{i}", "secretterm other words of a hidden report", tenant="acme",
                      acl=("hr",)) for i in range(12)]
    docs += [Document(f"pub{i}", f"plain common words number {i}", tenant="acme") for i in range(6)]
    x = rng.standard_normal((len(docs), 8)).astype(np.float32)
    desc = publish_build(tmp_path, "acl", docs, None, vectors=x, model_id="m")
    index = ShardIndex(desc, CollectionStore(tmp_path).build_dir("acl", desc.build_id),
                       tmp_path / ".state", 0, None, 0)

    def stats(scopes):
        q = ShardQuery(desc.build_id, "acme", None, "m", "secretterm", 0, 10, acl_scopes=scopes,
                       stats_only=True)
        return index.term_stats([q])[0].term_stats

    def bm25(scopes):
        q = ShardQuery(desc.build_id, "acme", None, "m", "secretterm", 0, 10, acl_scopes=scopes)
        return [(c.record.doc_id, c.score) for c in index.search_group([q])[0].lexical]

    try:
        blind, seeing = stats(()), stats(("hr",))
        assert (blind.docs, blind.df[0][1]) == (7, 1)      # the visible document, and the public ones
        assert (seeing.docs, seeing.df[0][1]) == (19, 13)  # the hr scope reads the hidden ones too
        # a chunk of a scope written since (a name the build did not have) is counted out too
        from server.core.chunking import document_chunks
        from server.core.types import ShardWrite

        chunks = tuple(document_chunks("", "secretterm legal words of another report"))
        index.apply_writes([ShardWrite("upsert", "acme", "legal1", 1,
                                       {"title": "", "text": chunks[0].text, "acl": ["legal"]},
                                       chunks, rng.standard_normal((1, 8)).astype(np.float32))])
        assert (stats(()).docs, stats(()).df[0][1]) == (7, 1)
        assert (stats(("hr",)).docs, stats(("hr",)).df[0][1]) == (19, 13)
        assert (stats(("hr", "legal")).docs, stats(("hr", "legal")).df[0][1]) == (20, 14)
        shown = bm25(())
        assert [d for d, _ in shown] == ["vis"]
        # scored on what the caller reads: the same score as with no hidden document at all
        hidden_free = publish_build(tmp_path / "free", "acl", [d for d in docs if not d.acl], None,
                                    vectors=x[[0, *range(13, len(docs))]], model_id="m")
        free = ShardIndex(hidden_free, CollectionStore(tmp_path / "free").build_dir(
            "acl", hidden_free.build_id), tmp_path / "free" / ".state", 0, None, 0)
        try:
            q = ShardQuery(hidden_free.build_id, "acme", None, "m", "secretterm", 0, 10)
            alone = free.search_group([q])[0].lexical[0].score
        finally:
            free.close()
        assert shown[0][1] == pytest.approx(alone, rel=0.05)  # field lengths stay the index's
    finally:
        index.close()


def test_a_full_volume_is_a_clear_retryable_refusal_and_changes_nothing(tmp_path, rng):
    """Outside QA (a full disk): writes failed INTERNAL "OperationalError" - the SQLite error
    itself hidden by a ROLLBACK of a transaction SQLite had already rolled back - which clients do
    not retry and which did not say the disk was full. Now RESOURCE_EXHAUSTED naming the state
    volume, nothing applied, and the write goes through once there is room. The full volume is
    SQLite's own: the store may not grow past its size (max_page_count), SQLITE_FULL."""
    import grpc

    from index_builder.corpus import Document
    from server.core.chunking import document_chunks
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex
    from server.core.types import ShardQuery, ShardWrite
    from server.errors import StorageFull
    from server.transport.errors import status_for

    docs = [Document(f"d{i}", f"plain words number {i}") for i in range(8)]
    desc = publish_build(tmp_path, "full", docs, None,
                         vectors=rng.standard_normal((8, 8)).astype(np.float32), model_id="m")
    index = ShardIndex(desc, CollectionStore(tmp_path).build_dir("full", desc.build_id),
                       tmp_path / ".state", 0, None, 0)
    text = "zyxfull " + "filler words " * 2000
    chunks = tuple(document_chunks("", text))
    write = ShardWrite("upsert", "default", "big", 1, {"title": "", "text": text}, chunks,
                       rng.standard_normal((len(chunks), 8)).astype(np.float32))

    def found():
        q = ShardQuery(desc.build_id, "default", None, "m", "zyxfull", 0, 5)
        return [c.record.doc_id for c in index.search_group([q])[0].lexical]

    try:
        conn = index.store._conn()  # this thread's connection: apply_writes runs on it
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(StorageFull) as err:
            index.apply_writes([write])
        assert "is full" in str(err.value) and "database or disk is full" in str(err.value)
        assert status_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert found() == [] and index.states["live"] == 8
        conn.execute("PRAGMA max_page_count=1073741823")  # room again
        assert index.apply_writes([write])[0].outcome == "applied"
        assert found() == ["big"]
    finally:
        index.close()


def test_a_failed_flip_leaves_bm25_as_the_store_says_after_the_next_write(tmp_path, rng):
    """Review: a replace whose BM25 commit succeeded but whose flip (the store's transaction)
    failed - a full disk, here SQLite refusing the write-log row through a trigger of the test's
    connection - left that commit for the next write's flip to publish: the old version, still
    live in the store, dropped out of lexical search. The next flip now checks BM25 row by row
    before any search sees it."""
    from index_builder.corpus import Document
    from server.core.chunking import document_chunks
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex
    from server.core.types import ShardQuery, ShardWrite

    docs = [Document("victim", "zyxvictim the version that stays")]
    docs += [Document(f"d{i}", f"plain words number {i}") for i in range(6)]
    desc = publish_build(tmp_path, "flip", docs, None,
                         vectors=rng.standard_normal((len(docs), 8)).astype(np.float32), model_id="m")
    index = ShardIndex(desc, CollectionStore(tmp_path).build_dir("flip", desc.build_id),
                       tmp_path / ".state", 0, None, 0)

    def write(doc_id, version, text):
        chunks = tuple(document_chunks("", text))
        return ShardWrite("upsert", "default", doc_id, version, {"title": "", "text": text}, chunks,
                          rng.standard_normal((len(chunks), 8)).astype(np.float32))

    def found(word):
        q = ShardQuery(desc.build_id, "default", None, "m", word, 0, 5)
        return [c.record.doc_id for c in index.search_group([q])[0].lexical]

    try:
        conn = index.store._conn()  # this thread's connection: apply_writes runs on it
        conn.execute("CREATE TEMP TRIGGER no_room BEFORE INSERT ON writes WHEN NEW.doc_id='victim' "
                     "BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END")
        with pytest.raises(Exception, match="disk is full"):
            index.apply_writes([write("victim", 2, "zyxreplacement the version that failed")])
        assert found("zyxvictim") == ["victim"] and found("zyxreplacement") == []
        conn.execute("DROP TRIGGER no_room")
        assert index.apply_writes([write("other", 1, "an unrelated write")])[0].outcome == "applied"
        assert found("zyxvictim") == ["victim"] and found("zyxreplacement") == []
        assert index.apply_writes([write("victim", 2, "zyxreplacement now it fits")])[0].outcome == "applied"
        assert found("zyxvictim") == [] and found("zyxreplacement") == ["victim"]
        # a step after the flip that fails (the purge mark) leaves the write applied, answered so
        # (it answered RESOURCE_EXHAUSTED, and its retry NOOP), and redone later
        conn.execute("CREATE TEMP TRIGGER no_room BEFORE UPDATE OF purged ON chunks "
                     "BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END")
        assert index.apply_writes([write("d0", 2, "zyxthird after the flip")])[0].outcome == "applied"
        conn.execute("DROP TRIGGER no_room")
        assert found("zyxthird") == ["d0"] and index.store.unpurged()
    finally:
        index.close()


def test_a_document_written_several_times_in_one_group_ends_as_the_writes_in_order_leave_it(
        tmp_path, rng):
    """One call with repeats (a replica replaying a log that rewrites a few documents): one
    group, one flip, each write answered as it would be in order, and the shard ends as it does
    when every write is applied alone - the same rows, row for row (routers fetch by row from
    any replica), the same live rows, versions, tombstones and logged writes, the log position
    of the last write (a no-op) included. Outside QA: each repeat split the call into another
    group and commit, and a replica caught up at ~80 log entries a second. Review: rows given
    only to a document's last write numbered the next document's rows lower than a replica
    that applied the same log in other groups, so fetches from that replica dropped hits."""
    from index_builder.corpus import Document
    from server.core.chunking import document_chunks
    from server.core.collection import CollectionStore
    from server.core.engine.index import ShardIndex
    from server.core.types import ShardQuery, ShardWrite

    docs = [Document(f"d{i}", f"plain words number {i}") for i in range(4)]
    desc = publish_build(tmp_path, "reps", docs, None,
                         vectors=rng.standard_normal((len(docs), 8)).astype(np.float32), model_id="m")
    vectors = {}

    def write(op, doc_id, version, seq, text=""):
        chunks = tuple(document_chunks("", text)) if op == "upsert" else ()
        key = (doc_id, version)
        if op == "upsert" and key not in vectors:
            vectors[key] = rng.standard_normal((len(chunks), 8)).astype(np.float32)
        w = ShardWrite(op, "default", doc_id, version, {"title": "", "text": text}, chunks,
                       vectors.get(key) if op == "upsert" else None)
        w.seq = seq
        return w

    writes = [write("upsert", "a", 1, 1, "zyxalpha first"),
              write("upsert", "b", 1, 2, "zyxbravo first"),
              write("upsert", "a", 3, 3, "zyxalpha third"),
              write("delete", "b", 2, 4),
              write("upsert", "a", 2, 5, "zyxalpha stale"),      # below a's 3: a no-op
              write("upsert", "d1", 2, 6, "zyxdelta replaced"),   # a corpus document
              write("upsert", "a", 3, 7, "zyxalpha same version, another body"),  # no-op
              write("delete", "d1", 1, 8)]                         # below 2: the last, a no-op
    expected = [("applied", 1), ("applied", 1), ("applied", 3), ("applied", 2), ("noop", 3),
                ("applied", 2), ("noop", 3), ("noop", 2)]

    def shard(name):
        root = tmp_path / name
        return ShardIndex(desc, CollectionStore(tmp_path).build_dir("reps", desc.build_id),
                          root, 0, None, 0)

    together, alone = shard("together"), shard("alone")
    try:
        v0 = together.index_version
        out = together.apply_writes(writes)
        assert [(o.outcome, o.stored_version) for o in out] == expected
        assert together.index_version == v0 + 1                      # one flip
        one_by_one = [alone.apply_writes([w])[0] for w in writes]
        twice = write("upsert", "twice", 1, 0, "zyxtwice")  # one object sent twice in a call
        assert [o.outcome for o in together.apply_writes([twice, twice])] == ["applied", "noop"]
        assert [o.outcome for o in alone.apply_writes([twice])] == ["applied"]
        assert [(o.outcome, o.stored_version) for o in one_by_one] == expected
        for index in (together, alone):
            assert index.applied_seq == 8
        keys = [("default", d) for d in ("a", "b", "d1", "d0")]
        assert together.store.documents_of(keys) == alone.store.documents_of(keys)
        assert together.store.live_digest() == alone.store.live_digest()
        for word, docs_found in (("zyxalpha", ["a"]), ("zyxbravo", []), ("zyxdelta", ["d1"]),
                                 ("third", ["a"]), ("stale", [])):
            q = ShardQuery(desc.build_id, "default", None, "m", word, 0, 5)
            for index in (together, alone):
                assert [c.record.doc_id for c in index.search_group([q])[0].lexical] == docs_found
        # rows as the writes in order number them, however grouped; the next write's too
        after = write("upsert", "c", 1, 9, "zyxcharlie first")
        for index in (together, alone):
            assert index.apply_writes([after])[0].outcome == "applied"

        def rows(index, sql):
            return index.store._conn().execute(sql).fetchall()

        for sql in ("SELECT row, chunk_id, doc_id, version, live FROM chunks ORDER BY row",
                    "SELECT log_seq, op, doc_id, version FROM writes ORDER BY log_seq"):
            assert rows(together, sql) == rows(alone, sql)
        assert together.nrows == alone.nrows and together.live.tolist() == alone.live.tolist()
        q = ShardQuery(desc.build_id, "default", None, "m", "zyxcharlie", 0, 5)
        assert ([c.record.row for c in together.search_group([q])[0].lexical]
                == [c.record.row for c in alone.search_group([q])[0].lexical] != [])
    finally:
        together.close()
        alone.close()


def test_every_kind_of_shard_implements_the_whole_shard_interface():
    """The core never asks which kind it holds (no hasattr): each kind answers every operation
    of `shard_api.Shard`, the asynchronous ones as coroutines."""
    import inspect

    from server.core.engine.local import LocalShard
    from server.core.faults import FaultyShard
    from server.core.replicas import ReplicaSet
    from server.core.shard_api import Shard
    from server.transport.engine_link import EngineShard
    from server.transport.shard_rpc import RemoteShard

    operations = {name: value for name, value in vars(Shard).items() if not name.startswith("_")}
    assert {"search", "fetch", "apply", "stored_versions", "info", "close",
            "cache_version"} <= set(operations)
    for kind in (LocalShard, RemoteShard, EngineShard, ReplicaSet, FaultyShard):
        for name, value in operations.items():
            assert hasattr(kind, name), f"{kind.__name__} lacks {name}"
            if inspect.iscoroutinefunction(value):
                assert inspect.iscoroutinefunction(getattr(kind, name)), (kind.__name__, name)
