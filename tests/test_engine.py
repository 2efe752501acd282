"""The shard engine's scheduler (server/core/engine/scheduler.py) on a real shard: concurrent
queries coalesce into fewer faiss calls and each caller gets exactly its own answer; cancelled and
expired queries are dropped before the index call; mixed restrictions never share a batch; an
idle shard dispatches at once; writes coalesce into group commits."""
import asyncio
import threading

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


def test_a_cancelled_or_expired_query_is_dropped_before_the_index_call(engine_build, rng):
    from server.core import metrics
    from server.errors import DeadlineExceeded

    data, desc = engine_build
    shard, pools = open_shard(data, desc)
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
