"""Versioned builds: audited, reconciled alias flips; queries see one build across a flip; writes
made during a rebuild are replayed into it; rollback; model migration refuses old vectors;
compaction drops tombstones without changing answers."""
import asyncio
import shutil
import sqlite3
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

from conftest import REPO, start_core_server


def answer_once_served(stub, req, refused, seconds=30.0):
    """The first answer to `req` once the server serves it (a watcher loads the collection on
    its next poll); until then every call must be refused with `refused`."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            return stub.Search(req, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == refused and time.monotonic() < deadline, exc
            time.sleep(0.1)


def docs(prefix, source, n):
    from index_builder.corpus import Document

    return [Document(f"{prefix}-{d.doc_id}", d.text, d.title) for d in source[:n]]


@pytest.fixture
def two_builds(tmp_path, tiny_embedder, cranfield_docs):
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    store = CollectionStore(tmp_path)
    a = build_collection(docs("a", cranfield_docs, 80), store, "c", tiny_embedder, "Flat", shards=2,
                         quiet=True)
    audit_build(store, "c", a.build_id)
    store.publish("c", a.build_id)
    b = build_collection(docs("b", cranfield_docs[80:], 80), store, "c", tiny_embedder,
                         "HNSW16,Flat", shards=3, quiet=True)
    return store, a, b


def refused_compaction(admin) -> str:
    """A Compact call that must be refused FAILED_PRECONDITION; returns the message."""
    with pytest.raises(grpc.RpcError) as err:
        admin.Compact(pb.CompactRequest(collection="c"), timeout=300)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    return err.value.details()


def run(srv, coro):
    return asyncio.run_coroutine_threadsafe(coro, srv.loop).result(120)


def test_publish_refuses_a_build_without_an_audit(two_builds):
    from server.errors import FailedPrecondition

    store, a, b = two_builds
    with pytest.raises(FailedPrecondition, match="no recall audit"):
        store.publish("c", b.build_id)
    assert store.live_build("c") == a.build_id
    # a damaged one is called damaged first (outside QA: it was sent to an audit, which said so)
    target = store.build_dir("c", b.build_id) / "shard-000" / "vectors.npy"
    whole = target.read_bytes()
    target.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    try:
        with pytest.raises(FailedPrecondition, match="fails its sha256 check"):
            store.publish("c", b.build_id)
    finally:
        target.write_bytes(whole)


def test_publish_refuses_a_build_whose_files_were_damaged_after_its_audit(two_builds,
                                                                          tmp_path_factory):
    """Regression (outside QA): a build truncated after its audit was published; every server
    then logged an error each poll and the next start failed for every collection."""
    from index_builder.build import audit_build
    from server.errors import FailedPrecondition, IndexCorruptError

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    pristine = tmp_path_factory.mktemp("pristine")
    shutil.copytree(store.data_dir, pristine, dirs_exist_ok=True)
    target = store.build_dir("c", b.build_id) / "shard-001" / "dense.faiss"
    whole = target.read_bytes()
    target.write_bytes(whole[:1000])
    with pytest.raises(FailedPrecondition, match=f"{target} is 1000 bytes, the build recorded {len(whole)}"):
        store.publish("c", b.build_id)
    target.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(FailedPrecondition, match="fails its sha256 check"):
        store.publish("c", b.build_id)
    assert store.live_build("c") == a.build_id  # nothing changed
    target.write_bytes(whole)
    # every file a server reads: exact vectors, the document store's bytes, BM25 segments
    # (outside QA: two swapped vector rows, an edited text and a deleted row were all published)
    shard = store.build_dir("c", b.build_id) / "shard-000"

    def swap_two_vector_rows(path):
        v = np.load(path)
        np.save(path, v[[1, 0, *range(2, len(v))]])

    def edit_a_text(path):
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE chunks SET text = 'edited' WHERE row = 0")
        conn.close()

    def flip_a_bit(path):
        whole = path.read_bytes()
        path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))

    segment = max((f for f in (shard / "lexical").iterdir() if not f.name.startswith(".")),
                  key=lambda f: f.stat().st_size)
    for path, damage in ((shard / "vectors.npy", swap_two_vector_rows),
                         (shard / "docstore.sqlite", edit_a_text), (segment, flip_a_bit)):
        damage(path)
        with pytest.raises(FailedPrecondition, match=f"{path} (fails its sha256|is .* bytes)"):
            store.publish("c", b.build_id)
        # and the audit says so too (outside QA re-probe: it passed the damaged build)
        with pytest.raises(IndexCorruptError, match=f"{path} (fails its sha256|is .* bytes)"):
            audit_build(store, "c", b.build_id, record=False)
        path.write_bytes((pristine / path.relative_to(store.data_dir)).read_bytes())
    store.publish("c", b.build_id)
    assert store.live_build("c") == b.build_id


def test_an_explicit_min_recall_decides_publication_lower_or_higher(two_builds):
    """Regression (outside QA): `publish --min-recall` could only make the check stricter: a
    build that failed its audit's own threshold stayed refused whatever the operator allowed."""
    from index_builder.build import audit_build
    from server.errors import FailedPrecondition

    store, a, b = two_builds
    audit = audit_build(store, "c", b.build_id, min_recall=1.01)  # no recall can pass this
    assert not audit["passed"] and audit["reconciliation"]["passed"]
    with pytest.raises(FailedPrecondition, match="below the required 1.0100"):
        store.publish("c", b.build_id)
    with pytest.raises(FailedPrecondition, match="below the required 1.0200"):
        store.publish("c", b.build_id, min_recall=1.02)
    store.publish("c", b.build_id, min_recall=audit["recall"])
    assert store.live_build("c") == b.build_id


def test_a_build_directory_holds_no_sqlite_side_files(two_builds):
    """Outside QA: every shard of a build held docstore.sqlite-wal and -shm, which no build
    records (the immutable build is the one file; a state's copy takes the WAL)."""
    store, a, b = two_builds
    for build in (a, b):
        bdir = store.build_dir("c", build.build_id)
        assert list(bdir.glob("shard-*/docstore.sqlite"))
        assert not list(bdir.glob("**/*-wal")) and not list(bdir.glob("**/*-shm"))


def test_publish_refuses_a_build_whose_counts_do_not_reconcile(two_builds, tmp_path):
    from index_builder.build import audit_build

    store, a, b = two_builds
    db = store.build_dir("c", b.build_id) / "shard-001" / "docstore.sqlite"
    with sqlite3.connect(db) as conn:  # lose one chunk row: the store no longer matches faiss/BM25
        conn.execute("DELETE FROM chunks WHERE row = (SELECT max(row) FROM chunks)")
    conn.close()
    # as the builder wrote it (its checksum recorded after the loss): a build made wrong, not
    # damaged since (that its sha256 catches before any count is compared)
    from server.backends.dense import file_record
    desc = store.descriptor("c", b.build_id)
    desc.shard_files["shard-001"]["docstore.sqlite"] = file_record(db)
    store.write_descriptor(desc)
    audit = audit_build(store, "c", b.build_id)
    assert audit["passed"] and not audit["reconciliation"]["passed"]
    out = subprocess.run([sys.executable, "-m", "index_builder.cli", "publish", "--data-dir",
                          str(tmp_path), "--collection", "c", "--build", b.build_id],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "reconciliation failed" in out.stderr and "shard-001" in out.stderr
    assert store.live_build("c") == a.build_id


def test_every_query_sees_one_build_across_an_alias_flip(two_builds, tiny_embedder):
    from index_builder.build import audit_build

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    srv = start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    seen, bad = [], []
    stop = threading.Event()

    def query_loop():
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            while not stop.is_set():
                r = stub.Search(pb.SearchRequest(collection="c", text="boundary layer flow", top_k=10),
                                timeout=30)
                prefix = {a.build_id: "a-", b.build_id: "b-"}.get(r.build_id)
                seen.append(r.build_id)
                if prefix is None or not all(h.doc_id.startswith(prefix) for h in r.hits):
                    bad.append((r.build_id, [h.doc_id for h in r.hits]))

    threads = [threading.Thread(target=query_loop) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        while seen.count(a.build_id) < 5:
            threading.Event().wait(0.01)
        store.publish("c", b.build_id)
        result = run(srv, srv.core.switch_build("c"))
        assert result["switched"] and result["build_id"] == b.build_id
        n = len(seen)
        while len(seen) < n + 10:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        srv.stop()
    assert bad == []
    assert a.build_id in seen and b.build_id in seen


def test_writes_during_a_rebuild_are_replayed_and_rollback_keeps_them(two_builds, tiny_embedder):
    from index_builder.build import audit_build

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)

            def find(word):
                r = stub.Search(pb.SearchRequest(collection="c", text=word, top_k=5, mode=pb.LEXICAL),
                                timeout=30)
                return r.build_id, [h.doc_id for h in r.hits]

            up = lambda d, v, t: stub.UpsertDocument(pb.UpsertDocumentRequest(  # noqa: E731
                collection="c", doc_id=d, version=v, text=t), timeout=30)
            up("w-1", 1, "zyxduring the rebuild")        # lands on A while B is being built
            up("w-2", 1, "zyxreplaced early")
            up("w-2", 2, "zyxsecond version")
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id="a-1", version=2),
                                timeout=30)
            store.publish("c", b.build_id)
            result = run(srv, srv.core.switch_build("c"))
            assert result["replayed"] == 4
            assert find("zyxduring") == (b.build_id, ["w-1"])
            assert find("zyxsecond") == (b.build_id, ["w-2"]) and find("zyxreplaced")[1] == []
            up("w-3", 1, "zyxafter the flip")            # lands on B
            assert up("w-2", 2, "zyxsecond version").outcome == pb.WriteResponse.NOOP_STALE_VERSION
            store.publish("c", a.build_id)                # roll back: A gets B's writes since
            run(srv, srv.core.switch_build("c"))
            assert find("zyxafter") == (a.build_id, ["w-3"])
            assert find("zyxduring") == (a.build_id, ["w-1"])
            assert "a-1" not in [h.doc_id for h in stub.Search(pb.SearchRequest(
                collection="c", text="a", top_k=100, mode=pb.DENSE), timeout=30).hits]
    finally:
        srv.stop()


def _writes_across_two_compactions(stub, admin, b_doc="b-none"):
    """x v1 and gone v1 and a delete of `b_doc` (a document only the corpus build B has) on the live
    build A; compact; x v2, gone deleted, mid; compact again; late. Returns the two compacted
    builds."""
    up = lambda d, v, t: stub.UpsertDocument(pb.UpsertDocumentRequest(  # noqa: E731
        collection="c", doc_id=d, version=v, text=t), timeout=30)
    up("x", 1, "zyxlineage x version one")
    up("gone", 1, "zyxlineage gone will be deleted")
    stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id=b_doc, version=5), timeout=30)
    first = admin.Compact(pb.CompactRequest(collection="c"), timeout=300).build_id
    up("x", 2, "zyxlineage x version two")
    stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id="gone", version=2), timeout=30)
    up("mid", 1, "zyxlineage mid written while the first compaction was live")
    second = admin.Compact(pb.CompactRequest(collection="c"), timeout=300).build_id
    up("late", 1, "zyxlineage late written while the second compaction was live")
    return first, second


def _lineage_answer(stub):
    r = stub.Search(pb.SearchRequest(collection="c", text="zyxlineage", top_k=10, mode=pb.LEXICAL),
                    timeout=30)
    return r.build_id, sorted((h.doc_id, h.text.split()[-1]) for h in r.hits)


LINEAGE_WANT = [("late", "live"), ("mid", "live"), ("x", "two")]


def test_a_corpus_build_published_after_compactions_gets_every_earlier_write(two_builds, tiny_embedder,
                                                                            cranfield_docs):
    """Regression (outside QA): writes made before a compaction vanished, and a deleted document
    came back, when a new corpus build was published: only the compacted build's own log was
    replayed, and its source's writes live in its base files, not in that log."""
    from index_builder.build import audit_build, build_collection
    from server.errors import FailedPrecondition, NotFound

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    srv = start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub, admin = pb_grpc.SearchServiceStub(ch), pb_grpc.AdminServiceStub(ch)
            gone_b, kept_b = (f"b-{d.doc_id}" for d in cranfield_docs[80:82])
            first, second = _writes_across_two_compactions(stub, admin, gone_b)
            assert srv.core.builds.lineage("c", second) == [a.build_id, first, second]
            # a compaction replays only its source's log: the builds before that are in its base
            # (re-reading the whole history at every compaction grew without bound)
            from server.core.compaction import read_replay_marker

            marker = read_replay_marker(srv.core.config.storage.resolved_state_dir() / "c" / second,
                                        store.build_dir("c", second))
            assert first in marker and a.build_id not in marker, marker
            assert _lineage_answer(stub) == (second, LINEAGE_WANT)
            store.publish("c", b.build_id)
            run(srv, srv.core.switch_build("c"))
            assert _lineage_answer(stub) == (b.build_id, LINEAGE_WANT)
            b_docs = {h.doc_id for h in stub.Search(pb.SearchRequest(
                collection="c", text="flow", top_k=100, mode=pb.DENSE), timeout=30).hits}
            assert gone_b not in b_docs and kept_b in b_docs  # the delete made on A holds on B
            # pruning keeps the rollback target's compaction lineage (its logs are what a
            # rollback past it replays) ...
            kept = {x: why for x, k, why in store.retention("c", 0) if k}
            assert kept == {b.build_id: "the live build", second: "the rollback target",
                            first: f"{second} (the rollback target) was compacted from it",
                            a.build_id: f"{second} (the rollback target) was compacted from it"}
            # ... until a later publish leaves it behind: then it goes, and nothing served moves
            c = build_collection(docs("c", cranfield_docs[160:], 40), store, "c", tiny_embedder,
                                 "Flat", quiet=True)
            audit_build(store, "c", c.build_id)
            store.publish("c", c.build_id)
            run(srv, srv.core.switch_build("c"))
            assert _lineage_answer(stub) == (c.build_id, LINEAGE_WANT)
            # a build kept for any reason keeps its sources: kept as one of the newest, the
            # compacted build may be published again (re-probe: its source was pruned, and
            # publishing it then lost the source's writes)
            assert [x for x, k, _ in store.retention("c", 2) if not k] == []
            plan = store.retention("c", 0)
            assert [x for x, k, _ in plan if not k] == [second, first, a.build_id]
            for x in (second, first, a.build_id):
                store.remove_build("c", x)
            with pytest.raises(NotFound, match="has no release.json"):
                store.publish("c", first, verify_files=False, require_audit=False)
            store.publish("c", b.build_id)  # a rollback to the kept target still holds every write
            run(srv, srv.core.switch_build("c"))
            assert _lineage_answer(stub) == (b.build_id, LINEAGE_WANT)
            with pytest.raises(FailedPrecondition, match="rollback target; not removed"):
                store.remove_build("c", c.build_id)
    finally:
        srv.stop()


def test_pruned_builds_a_server_still_serves_keep_their_lineage_and_writes(two_builds, tiny_embedder,
                                                                          cranfield_docs):
    """Review: a server still on a compacted build (its switch failed, or it has not polled) while
    the alias moved on twice, and that build and its sources pruned: the state sweep kept the
    served build's own state but removed its sources', whose logs the next switch replays - the
    writes made before the compactions were lost. The served build's lineage is kept, and the
    switch replays all of it from the states."""
    from index_builder.build import audit_build, build_collection

    store, a, b = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub, admin = pb_grpc.SearchServiceStub(ch), pb_grpc.AdminServiceStub(ch)
            first, second = _writes_across_two_compactions(stub, admin)
            audit_build(store, "c", b.build_id)
            c = build_collection(docs("c", cranfield_docs[160:], 40), store, "c", tiny_embedder,
                                 "Flat", quiet=True)
            audit_build(store, "c", c.build_id)
            store.publish("c", b.build_id)
            store.publish("c", c.build_id)  # the server has not followed: it serves `second`
            for gone in (second, first, a.build_id):
                store.remove_build("c", gone)
            assert srv.core.builds.unused_states("c") == []
            run(srv, srv.core.builds.remove_unused_states("c"))
            state = srv.core.config.storage.resolved_state_dir() / "c"
            assert all((state / x).is_dir() for x in (a.build_id, first, second))
            run(srv, srv.core.switch_build("c"))
            assert _lineage_answer(stub) == (c.build_id, LINEAGE_WANT)
            # once C holds them, and nothing serves or replays from them, they go
            assert srv.core.builds.unused_states("c", {c.build_id}) == sorted(
                [a.build_id, first, second])
            # a build still there keeps the states of the builds it was compacted from, even
            # when it is neither served nor live nor previous: it may be published again
            c1 = admin.Compact(pb.CompactRequest(collection="c"), timeout=300).build_id
            e = build_collection(docs("e", cranfield_docs[200:], 20), store, "c", tiny_embedder,
                                 "Flat", quiet=True)
            audit_build(store, "c", e.build_id)
            store.publish("c", b.build_id)
            store.publish("c", e.build_id)  # live e, previous b: c1 is neither
            store.remove_build("c", c.build_id)
            assert c.build_id not in srv.core.builds.unused_states("c", {e.build_id})
            store.remove_build("c", c1)
            assert {c.build_id, c1} <= set(srv.core.builds.unused_states("c", {e.build_id}))
    finally:
        srv.stop()


@pytest.mark.parametrize("descriptor_copy", [True, False])
def test_two_publishes_while_the_server_is_down_keep_every_write(two_builds, tiny_embedder,
                                                                 cranfield_docs, descriptor_copy):
    """Regression (outside QA): A took an upsert and a delete, the server stopped, B then C were
    published, and the restarted server served C without the upsert and with the deleted
    document: only the alias's `previous` (B, which never served) was replayed. The state now
    records the build it served last, and that is the source."""
    from index_builder.build import audit_build, build_collection

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    c = build_collection(docs("a", cranfield_docs, 80), store, "c", tiny_embedder, "Flat",
                         quiet=True)
    audit_build(store, "c", c.build_id)
    gone = f"a-{cranfield_docs[3].doc_id}"

    def serve():
        return start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})

    def dense_ids(stub):
        return {h.doc_id for h in stub.Search(pb.SearchRequest(
            collection="c", text="flow", top_k=200, mode=pb.DENSE), timeout=30).hits}

    srv = serve()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            stub.UpsertDocument(pb.UpsertDocumentRequest(collection="c", doc_id="written-on-a",
                                                         version=1, text="zyxkept flow note"),
                                timeout=30)
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id=gone, version=2),
                                timeout=30)
    finally:
        srv.stop()
    store.publish("c", b.build_id)
    store.publish("c", c.build_id)
    # and A, neither live nor the rollback target now, is pruned before the server comes back:
    # its writes are replayed from its state, which kept a copy of its descriptor (skipping a
    # build gone from the data directory lost them)
    assert [(x, kept) for x, kept, _ in store.retention("c", 0)
            if x in (a.build_id, b.build_id, c.build_id)] == [
        (c.build_id, True), (b.build_id, True), (a.build_id, False)]
    store.remove_build("c", a.build_id)
    state = store.data_dir / ".state" / "c"
    assert (state / a.build_id / "release.json").is_file()
    if not descriptor_copy:  # a state made before states kept one: its own log still replays
        (state / a.build_id / "release.json").unlink()
    srv = serve()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            ids = dense_ids(stub)
            assert "written-on-a" in ids and gone not in ids
            assert f"a-{cranfield_docs[4].doc_id}" in ids  # C's own corpus is served
            # once C holds A's writes nothing needs A's state: the alias watcher's sweep removes
            # it (and keeps those of the builds there)
            assert srv.core.builds.unused_states("c") == [a.build_id]
            run(srv, srv.core.builds.remove_unused_states("c"))
            assert not (state / a.build_id).exists() and (state / c.build_id).is_dir()
            assert "written-on-a" in dense_ids(stub)
    finally:
        srv.stop()


def test_a_collection_first_served_by_the_alias_watcher_records_what_it_serves(two_builds,
                                                                                tiny_embedder,
                                                                                cranfield_docs):
    """Review: the SERVED marker (the start-up replay's source) was written at a start and a
    switch, not when a running server picked up a newly published collection, so two publishes
    while it was down lost that collection's writes as before the marker."""
    from conftest import publish_build

    store, _, _ = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        d = publish_build(store.data_dir, "d", cranfield_docs[:10], tiny_embedder)
        run(srv, srv.core.builds._load_new_collections())
        assert srv.core.registry.get("d").desc.build_id == d.build_id
        served = srv.core.config.storage.resolved_state_dir() / "d" / "SERVED"
        assert served.read_text() == d.build_id
    finally:
        srv.stop()


def test_two_switches_to_the_same_flip_take_turns(two_builds, tiny_embedder):
    """Outside QA: a compaction's own switch and the alias watcher's (which saw the same flip)
    both opened the new build's state, and one logged "state in use by pid N" - its own pid.
    Switches of a collection now take turns; the second finds the build already served."""
    from index_builder.build import audit_build

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        store.publish("c", b.build_id)

        async def both():
            return await asyncio.gather(srv.core.builds.switch_build("c"),
                                        srv.core.builds.switch_build("c"))

        first, second = run(srv, both())
        assert (first["switched"], second["switched"]) == (True, False)
        assert srv.core.registry.get("c").desc.build_id == b.build_id
    finally:
        srv.stop()


def test_a_rollback_past_two_compactions_keeps_every_write(two_builds, tiny_embedder):
    """Regression (outside QA): rolling back to the build served before two compactions brought
    back an old version and a deleted document and lost a write: only the last build's log was
    replayed into it."""
    store, a, _ = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub, admin = pb_grpc.SearchServiceStub(ch), pb_grpc.AdminServiceStub(ch)
            _writes_across_two_compactions(stub, admin)
            store.publish("c", a.build_id)
            run(srv, srv.core.switch_build("c"))
            assert _lineage_answer(stub) == (a.build_id, LINEAGE_WANT)
    finally:
        srv.stop()


def test_a_collection_published_after_the_start_is_served_without_a_restart(two_builds, tiny_embedder,
                                                                           cranfield_docs):
    """Regression (outside QA): only the collections there at the start were followed; one
    published later answered NOT_FOUND until a restart."""
    from conftest import publish_build

    store, _, _ = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder)
    watcher = asyncio.run_coroutine_threadsafe(srv.core.builds.watch_aliases(0.1), srv.loop)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            req = pb.SearchRequest(collection="later", text="zyxlater", top_k=3, mode=pb.LEXICAL)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            from index_builder.corpus import Document

            publish_build(store.data_dir, "later",
                          [Document("late-1", "zyxlater text"), *docs("later", cranfield_docs, 20)],
                          tiny_embedder)
            answer = answer_once_served(stub, req, grpc.StatusCode.NOT_FOUND)
            assert [h.doc_id for h in answer.hits] == ["late-1"]
    finally:
        watcher.cancel()
        srv.stop()


def test_a_vector_from_the_previous_model_is_refused_after_a_migration(two_builds, tiny_embedder,
                                                                       tiny_embedder_dir, cranfield_docs):
    from index_builder.build import audit_build, build_collection
    from server.backends.device import Device
    from server.backends.models import Embedder

    store, a, _ = two_builds
    v2 = Embedder(tiny_embedder_dir, Device("cpu"), model_name="tiny-test-embedder-v2")
    m = build_collection(docs("m", cranfield_docs, 40), store, "c", v2, "Flat", quiet=True)
    audit_build(store, "c", m.build_id)
    store.publish("c", m.build_id)
    srv = start_core_server(store.data_dir, v2)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            v1_vec = tiny_embedder.encode(["boundary layer"])[0]
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(pb.SearchRequest(collection="c", top_k=5, mode=pb.DENSE, vector=pb.QueryVector(
                    values=v1_vec.tolist(), model_id=a.model_id)), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert a.model_id in err.value.details() and m.model_id in err.value.details()
            ok = stub.Search(pb.SearchRequest(collection="c", top_k=5, mode=pb.DENSE, vector=pb.QueryVector(
                values=v2.encode(["boundary layer"])[0].tolist(), model_id=m.model_id)), timeout=30)
            assert len(ok.hits) == 5 and ok.model_id == m.model_id
    finally:
        srv.stop()


def test_compaction_drops_tombstones_and_keeps_every_answer(two_builds, tiny_embedder):
    from server.core import metrics

    store, a, _ = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            admin = pb_grpc.AdminServiceStub(ch)
            for i in range(1, 40):  # replace and delete: tombstones pile up
                stub.UpsertDocument(pb.UpsertDocumentRequest(collection="c", doc_id=f"a-{i}", version=2,
                                                             text=f"zyxcompact{i} replaced text"), timeout=30)
            for i in range(40, 60):
                stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id=f"a-{i}", version=2),
                                    timeout=30)
            queries = ["boundary layer", "zyxcompact7", "shock wave", "heat transfer in flow"]

            def answers(mode):
                return [[(h.doc_id, h.chunk_id, round(h.score, 4)) for h in stub.Search(
                    pb.SearchRequest(collection="c", text=q, top_k=10, mode=mode), timeout=30).hits]
                        for q in queries]

            def doc_sets(mode):
                return [{d for d, _, _ in hits} for hits in answers(mode)]

            before_dense, before_lex = answers(pb.DENSE), doc_sets(pb.LEXICAL)
            ratio = metrics.TOMBSTONE_RATIO.labels("c", "0")._value.get()
            assert ratio > 0.2
            r = admin.Compact(pb.CompactRequest(collection="c"), timeout=300)
            assert r.previous_build_id == a.build_id and r.dead_rows_before > 0
            assert r.rows_after == r.live_rows_before
            assert store.live_build("c") == r.build_id
            # dense answers are identical, scores included
            assert answers(pb.DENSE) == before_dense
            # BM25 statistics counted the deleted chunks until now (tantivy keeps them in its
            # document frequencies until segments merge), so lexical scores become exact and may
            # move; the documents found stay the same
            after_lex = doc_sets(pb.LEXICAL)
            assert after_lex[1] == before_lex[1] == {"a-7"}
            assert all(len(x & y) >= 0.7 * len(y) for x, y in zip(after_lex, before_lex)), (after_lex, before_lex)
            assert metrics.TOMBSTONE_RATIO.labels("c", "0")._value.get() == 0.0
            stale = stub.UpsertDocument(pb.UpsertDocumentRequest(collection="c", doc_id="a-45", version=1,
                                                                 text="older than its delete"), timeout=30)
            assert stale.outcome == pb.WriteResponse.NOOP_STALE_VERSION
    finally:
        srv.stop()


def test_a_compacted_build_is_held_to_its_sources_audit_or_not_published(tmp_path, tiny_embedder,
                                                                          cranfield_docs):
    """Regression (outside QA): compaction audited its new build at recall 0 with held-in
    queries, so an IVF-PQ index retrained on vectors that writes had moved was published at
    recall 0.5. The new build now gets the source's held-out queries and recall threshold (and
    its tuning target); one that falls short is not published and the source keeps serving."""
    import numpy as np

    from index_builder.build import audit_build, build_collection
    from server.core.audit import AUDIT_QUERIES
    from server.core.collection import CollectionStore

    store = CollectionStore(tmp_path)
    rng = np.random.default_rng(3)
    held_out = rng.standard_normal((30, tiny_embedder.dim)).astype(np.float32)
    a = build_collection(docs("a", cranfield_docs, 60), store, "c", tiny_embedder, "Flat",
                         quiet=True, audit_queries=held_out)
    audit_build(store, "c", a.build_id, min_recall=0.95)
    store.publish("c", a.build_id)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            admin = pb_grpc.AdminServiceStub(ch)
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id="a-1", version=2),
                                timeout=30)
            first = admin.Compact(pb.CompactRequest(collection="c"), timeout=300)
            new = store.descriptor("c", first.build_id)
            assert new.audit["query_source"] == "held-out (build)" and new.audit["queries"] == 30
            assert new.audit["min_recall"] == 0.95 and new.audit["passed"]
            assert np.array_equal(np.load(store.build_dir("c", first.build_id) / AUDIT_QUERIES),
                                  np.load(store.build_dir("c", a.build_id) / AUDIT_QUERIES))
            # a threshold the new build cannot meet: nothing is published, the source serves on
            new.audit["min_recall"] = 1.5
            store.write_descriptor(new)
            srv.core.registry.get("c").desc.audit["min_recall"] = 1.5
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id="a-2", version=2),
                                timeout=30)
            assert "failed its checks" in refused_compaction(admin)
            assert store.live_build("c") == first.build_id
            # and it left nothing behind (outside QA: a whole build per failed attempt)
            assert sorted(store.builds("c")) == sorted([a.build_id, first.build_id])
            assert stub.Search(pb.SearchRequest(collection="c", text="boundary layer", top_k=3),
                               timeout=30).build_id == first.build_id
    finally:
        srv.stop()


def test_a_build_published_while_a_compaction_runs_is_not_undone(two_builds, tiny_embedder,
                                                                 monkeypatch):
    """Regression (outside QA): an operator published a new build while a compaction of the old
    one ran; the compaction then published its copy of the old build over it, and the new corpus
    was never served. The compaction's publish now requires its source to be still live."""
    from index_builder.build import audit_build
    from server.core import compaction

    store, a, b = two_builds
    audit_build(store, "c", b.build_id)
    real = compaction.compact_build

    def compact_while_the_operator_publishes(*args, **kw):
        desc = real(*args, **kw)
        store.publish("c", b.build_id)  # `index-builder publish`, landing mid-compaction
        return desc

    monkeypatch.setattr(compaction, "compact_build", compact_while_the_operator_publishes)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            admin = pb_grpc.AdminServiceStub(ch)
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="c", doc_id="a-1", version=2),
                                timeout=30)
            assert f"build {b.build_id} was published while" in refused_compaction(admin)
            assert store.alias("c") == {"live": b.build_id, "previous": a.build_id}
            builds = sorted(p.name for p in (store.collection_dir("c") / "builds").iterdir()
                            if not p.name.startswith("."))
            assert builds == sorted([a.build_id, b.build_id])  # the stale copy is gone
            run(srv, srv.core.builds.switch_build("c"))
            assert stub.Search(pb.SearchRequest(collection="c", text="boundary layer", top_k=3),
                               timeout=30).build_id == b.build_id
    finally:
        srv.stop()


def test_a_corpus_with_fewer_documents_than_shards_is_audited_published_and_served(tmp_path,
                                                                                   tiny_embedder):
    """Regression (outside QA): 3 documents in 5 shards built, then the audit crashed on the
    empty shards (faiss asserts k > 0), so the collection could never be published. Empty
    shards now add no hit to the audit, and the served collection answers from the others."""
    from index_builder.corpus import Document

    from conftest import publish_build

    docs = [Document(f"d{i}", f"note {i} on {w} turbulence", title=w)
            for i, w in enumerate(("wing", "nozzle", "flutter"))]
    desc = publish_build(tmp_path, "tiny", docs, tiny_embedder, shards=5)
    assert desc.shards == 5
    srv = start_core_server(tmp_path, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            for mode in (pb.DENSE, pb.LEXICAL, pb.HYBRID):
                r = stub.Search(pb.SearchRequest(collection="tiny", text="nozzle turbulence",
                                                 top_k=10, mode=mode), timeout=30)
                assert not r.partial and r.hits, mode
                if mode != pb.LEXICAL:
                    assert sorted(h.doc_id for h in r.hits) == ["d0", "d1", "d2"], mode
                assert r.hits[0].doc_id == "d1" or mode == pb.DENSE
    finally:
        srv.stop()


def test_a_build_under_a_strict_umask_is_still_readable_by_other_users(tmp_path):
    """Outside QA: under umask 077 the data root, the collection's directory and builds/ were
    made 0700, so a server running as another user could not reach the world-readable files
    inside (ALIAS: permission denied)."""
    import os
    import stat

    import numpy as np

    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    data = tmp_path / "fresh-data"
    old = os.umask(0o077)
    try:
        store = CollectionStore(data)
        desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(20)], store, "u",
                                None, "Flat", quiet=True,
                                vectors=np.random.default_rng(1).standard_normal((20, 4)),
                                model_id="m")
        store.publish("u", desc.build_id, require_audit=False)
    finally:
        os.umask(old)
    others = stat.S_IROTH | stat.S_IXOTH
    for d in (data, data / "u", data / "u" / "builds", store.build_dir("u", desc.build_id)):
        assert d.stat().st_mode & others == others, d
    assert (data / "u" / "ALIAS").stat().st_mode & stat.S_IROTH


def test_publishing_the_live_build_again_keeps_its_rollback_target(tmp_path, tiny_embedder,
                                                                   cranfield_docs):
    """Outside QA: publishing the build that was already live set `previous` to null, so the
    collection lost its rollback target."""
    from conftest import publish_build
    from server.core.collection import CollectionStore

    a = publish_build(tmp_path, "c", cranfield_docs[:10], tiny_embedder)
    b = publish_build(tmp_path, "c", cranfield_docs[:12], tiny_embedder)
    store = CollectionStore(tmp_path)
    assert store.publish("c", b.build_id) == {"live": b.build_id, "previous": a.build_id}
    assert store.alias("c") == {"live": b.build_id, "previous": a.build_id}


def test_a_collection_whose_build_fails_to_load_leaves_the_others_served(two_builds, tiny_embedder,
                                                                         cranfield_docs):
    """Regression (outside QA): one collection whose live build could not load (a damaged file)
    stopped the server from starting, taking every other collection of the data directory down.
    Now the others are served, the damaged one answers UNAVAILABLE naming the file, and it is
    served again once a working build of it is published."""
    from prometheus_client import REGISTRY

    from conftest import publish_build

    store, a, b = two_builds
    publish_build(store.data_dir, "ok", docs("ok", cranfield_docs, 20), tiny_embedder)
    damaged = store.build_dir("c", a.build_id) / "shard-000" / "vectors.npy"
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size - 64)
    srv = start_core_server(store.data_dir, tiny_embedder)
    watcher = asyncio.run_coroutine_threadsafe(srv.core.builds.watch_aliases(0.1), srv.loop)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)

            def search(collection):
                return stub.Search(pb.SearchRequest(collection=collection, text="boundary layer",
                                                    top_k=3), timeout=30)

            assert len(search("ok").hits) == 3
            with pytest.raises(grpc.RpcError) as err:
                search("c")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert a.build_id in err.value.details() and "IndexCorruptError" in err.value.details()
            assert str(store.data_dir) not in err.value.details()  # no server paths to callers
            assert REGISTRY.get_sample_value("search_collection_unloadable", {"collection": "c"}) == 1
            admin = pb_grpc.AdminServiceStub(ch)
            listed = {c.name: c for c in admin.ListCollections(pb.ListCollectionsRequest(),
                                                               timeout=30).collections}
            assert sorted(listed) == ["c", "ok"]  # listed, saying why, not gone
            assert a.build_id in listed["c"].unavailable and not listed["c"].build_id
            assert listed["ok"].unavailable == "" and listed["ok"].build_id
            from index_builder.build import audit_build

            audit_build(store, "c", b.build_id)
            store.publish("c", b.build_id)  # a working build: served without a restart
            answer = answer_once_served(stub, pb.SearchRequest(collection="c", text="boundary layer",
                                                               top_k=3), grpc.StatusCode.UNAVAILABLE)
            assert answer.build_id == b.build_id and len(answer.hits) == 3
            assert REGISTRY.get_sample_value("search_collection_unloadable", {"collection": "c"}) == 0
            served = [c for c in admin.ListCollections(pb.ListCollectionsRequest(),
                                                       timeout=30).collections if c.name == "c"]
            assert served[0].build_id == b.build_id and served[0].unavailable == ""
    finally:
        watcher.cancel()
        srv.stop()


def test_a_server_whose_every_collection_fails_to_load_does_not_start(two_builds, tiny_embedder):
    """With nothing it could serve, the load raises the failure (naming the file) instead of
    starting a server that answers nothing."""
    from conftest import make_core
    from server.errors import IndexCorruptError

    store, a, _ = two_builds
    damaged = store.build_dir("c", a.build_id) / "shard-001" / "vectors.npy"
    with open(damaged, "r+b") as f:
        f.truncate(damaged.stat().st_size - 64)
    with pytest.raises(IndexCorruptError, match=str(damaged)):
        make_core(store.data_dir, tiny_embedder).load()


def test_describe_counts_what_is_live_as_collection_stats_does(two_builds, tiny_embedder):
    """Regression (outside QA): DescribeCollection gave operators the build's counts (unchanged
    by any write) and tenant admins live ones. Both now count what is live, as CollectionStats
    does; the descriptor JSON keeps what the build wrote."""
    import json

    store, a, _ = two_builds
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub, admin = pb_grpc.SearchServiceStub(ch), pb_grpc.AdminServiceStub(ch)
            stub.UpsertDocument(pb.UpsertDocumentRequest(collection="c", doc_id="new-1", version=1,
                                                         text="a document written after the build"),
                                timeout=30)
            d = admin.DescribeCollection(pb.DescribeCollectionRequest(collection="c"), timeout=30)
            s = admin.CollectionStats(pb.CollectionStatsRequest(collection="c"), timeout=30)
            assert (d.documents, d.chunks) == (s.documents, s.chunks) == (a.documents + 1, a.chunks + 1)
            assert json.loads(d.descriptor_json)["documents"] == a.documents
    finally:
        srv.stop()


def test_a_compacted_build_is_labelled_with_the_analyzer_that_wrote_its_bm25_index(tmp_path,
                                                                                  tiny_embedder,
                                                                                  cranfield_docs):
    """Review: compaction writes the BM25 index anew from the text with this version's analyzer
    but kept the source's label, so a build of analyzer v2 compacted held "cafe" while its
    queries were analysed without folding, and "café" found nothing."""
    from conftest import publish_build
    from index_builder.corpus import Document
    from server.backends.lexical import ANALYZER_VERSION
    from server.core.collection import CollectionStore

    desc = publish_build(tmp_path, "acc", [Document("cafe-1", "café au lait in the morning"),
                                           *docs("acc", cranfield_docs, 30)], tiny_embedder)
    store = CollectionStore(tmp_path)
    old = store.descriptor("acc", desc.build_id)
    old.lexical_analyzer = "nfkc+simple+remove_long40+lower+stop_en+snowball_en/v2"
    store.write_descriptor(old)
    srv = start_core_server(tmp_path, tiny_embedder, pipeline={"retrieval_cache_size": 0})
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub, admin = pb_grpc.SearchServiceStub(ch), pb_grpc.AdminServiceStub(ch)
            stub.DeleteDocument(pb.DeleteDocumentRequest(collection="acc", doc_id="acc-1", version=2),
                                timeout=30)
            new = admin.Compact(pb.CompactRequest(collection="acc"), timeout=300).build_id
            assert store.descriptor("acc", new).lexical_analyzer == ANALYZER_VERSION
            for query in ("café", "cafe"):
                hits = stub.Search(pb.SearchRequest(collection="acc", text=query, top_k=3,
                                                    mode=pb.LEXICAL), timeout=30).hits
                assert [h.doc_id for h in hits][:1] == ["cafe-1"], query
    finally:
        srv.stop()


def test_a_compaction_whose_caller_goes_away_leaves_no_build_behind(two_builds, tiny_embedder,
                                                                   monkeypatch):
    """Review: a Compact whose caller was cancelled while the new build was written (its
    deadline, the longest phase) left that build in place, never audited nor removed. The
    build is now removed once the writing thread is done with it; the source keeps serving."""
    import concurrent.futures
    import time

    from server.core import compaction

    store, a, b = two_builds
    real = compaction.compact_build
    written, release = threading.Event(), threading.Event()

    def slow(store_, coll):
        desc = real(store_, coll)  # the new build is in place
        written.set()
        release.wait(60)
        return desc

    monkeypatch.setattr(compaction, "compact_build", slow)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        job = asyncio.run_coroutine_threadsafe(srv.core.builds.compact("c"), srv.loop)
        assert written.wait(120)
        assert len(store.builds("c")) == 3  # a, b and the compacted build
        job.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            job.result(30)
        release.set()
        deadline = time.monotonic() + 60
        while sorted(store.builds("c")) != sorted([a.build_id, b.build_id]):
            assert time.monotonic() < deadline, store.builds("c")
            time.sleep(0.05)
        assert store.live_build("c") == a.build_id
    finally:
        release.set()
        srv.stop()


def test_a_collection_whose_load_failure_passes_is_served_without_a_publish(two_builds, tiny_embedder,
                                                                           cranfield_docs):
    """Review: a failure that passes (a locked file, memory) left the collection out until its
    alias moved; before, the server failed to start and a supervisor's restart retried. The
    watcher now tries the same build again every RETRY_UNLOADABLE_S."""
    from conftest import publish_build

    store, a, _ = two_builds
    publish_build(store.data_dir, "ok", docs("ok", cranfield_docs, 20), tiny_embedder)
    damaged = store.build_dir("c", a.build_id) / "shard-000" / "vectors.npy"
    whole = damaged.read_bytes()
    damaged.write_bytes(whole[:-64])
    srv = start_core_server(store.data_dir, tiny_embedder)
    srv.core.builds.RETRY_UNLOADABLE_S = 0.2
    watcher = asyncio.run_coroutine_threadsafe(srv.core.builds.watch_aliases(0.1), srv.loop)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            req = pb.SearchRequest(collection="c", text="boundary layer", top_k=3)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            damaged.write_bytes(whole)  # the failure passes; the alias never moves
            assert answer_once_served(stub, req, grpc.StatusCode.UNAVAILABLE).build_id == a.build_id
    finally:
        watcher.cancel()
        srv.stop()


def test_a_switch_whose_caller_goes_away_still_completes(two_builds, tiny_embedder, monkeypatch):
    """Outside QA: a Compact whose deadline ran out during its switch (after the publish) left
    the alias naming the new build while the old one served, and the new build's shards opening
    on a worker thread with their state locked, so the next switch failed with "in use by" this
    very process. A switch, once begun, now completes whatever its caller does."""
    import concurrent.futures
    import time

    from server.core.builds import BuildManager

    store, a, b = two_builds
    real = BuildManager.open_build
    opening, release = threading.Event(), threading.Event()

    def slow_open(self, name, build_id=None):
        if build_id == b.build_id:
            opening.set()
            release.wait(60)
        return real(self, name, build_id)

    monkeypatch.setattr(BuildManager, "open_build", slow_open)
    srv = start_core_server(store.data_dir, tiny_embedder)
    try:
        store.publish("c", b.build_id, require_audit=False)
        job = asyncio.run_coroutine_threadsafe(srv.core.builds.switch_build("c"), srv.loop)
        assert opening.wait(60)
        job.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            job.result(30)
        release.set()
        deadline = time.monotonic() + 60
        while srv.core.registry.get("c").desc.build_id != b.build_id:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with grpc.insecure_channel(srv.address) as ch:
            answer = pb_grpc.SearchServiceStub(ch).Search(
                pb.SearchRequest(collection="c", text="boundary layer", top_k=3), timeout=30)
            assert answer.build_id == b.build_id
    finally:
        release.set()
        srv.stop()


def test_a_build_id_reused_after_a_prune_is_refused_not_served_over_the_earlier_state(
        tmp_path, tiny_embedder, cranfield_docs, capsys):
    """Re-probe: a build pruned and built again under the same id met the earlier build's state
    (its rows and writes) and failed to load with "rows added after the build lack their
    vectors". The builder refuses an id used before, and a server refuses, by name, a state made
    for an earlier build of that id."""
    import shutil

    from conftest import publish_build, write_through_a_server
    from index_builder.cli import main as builder_main
    from server.errors import IndexCorruptError

    publish_build(tmp_path, "c", cranfield_docs[:20], tiny_embedder, build_id="same")
    write_through_a_server(tmp_path, tiny_embedder, "w", "zyxwritten")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "one"}\n')
    with pytest.raises(SystemExit) as exit_:
        builder_main(["build", "--data-dir", str(tmp_path), "--collection", "c", "--corpus",
                      str(corpus), "--build-id", "same", "--model-id", "m"])
    assert exit_.value.code == 2 and "build id 'same' was used before" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "c" / "builds" / "same")  # by hand, then built again (the API
    publish_build(tmp_path, "c", cranfield_docs[20:40], tiny_embedder, build_id="same")  # allows it)
    with pytest.raises(IndexCorruptError, match="belongs to an earlier build also named same"):
        start_core_server(tmp_path, tiny_embedder)


def test_a_compaction_or_build_on_a_full_volume_says_so_and_changes_nothing(
        tmp_path, tiny_embedder, cranfield_docs, monkeypatch, capsys):
    """A volume that fills while a compaction writes its build: RESOURCE_EXHAUSTED naming the
    compaction, the live build still serving, nothing half-made listed (outside QA: INTERNAL
    OperationalError). The builder on a full volume: one line naming the condition, exit 2
    (outside QA: a traceback). SQLite's own error is raised where the build would write."""
    import sqlite3

    from conftest import publish_build
    from index_builder import build as builder
    from index_builder.cli import main as builder_main
    from server.core import compaction
    from server.core.collection import CollectionStore

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    live = publish_build(tmp_path, "c", cranfield_docs[:20], tiny_embedder)
    srv = start_core_server(tmp_path, tiny_embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            admin = pb_grpc.AdminServiceStub(ch)
            monkeypatch.setattr(compaction, "compact_build", full)
            with pytest.raises(grpc.RpcError) as err:
                admin.Compact(pb.CompactRequest(collection="c"), timeout=300)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            assert "compaction of c" in err.value.details() and "full" in err.value.details()
            assert "compact again" in err.value.details()
            hits = pb_grpc.SearchServiceStub(ch).Search(pb.SearchRequest(
                collection="c", text="flow", top_k=3, mode=pb.LEXICAL), timeout=30)
            assert hits.build_id == live.build_id and len(hits.hits) == 3
    finally:
        srv.stop()

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "1", "text": "one"}\n')
    monkeypatch.setattr(builder, "build_collection", full)
    with pytest.raises(SystemExit) as exit_:
        builder_main(["build", "--data-dir", str(tmp_path), "--collection", "d", "--corpus",
                      str(corpus), "--model-id", "m"])
    err_text = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err_text, err_text
    assert "index-builder build: error: storage it writes or reads is full" in err_text
    assert CollectionStore(tmp_path).builds("c") == [live.build_id]  # no half build listed


def test_a_build_whose_directories_a_failing_first_build_removes_goes_on(tmp_path):
    """Review: two first builds of one collection - A fails and removes the empty directories
    made for it while B is between making them and opening its lock file there: B failed with
    FileNotFoundError. B makes them again and builds. (The interleaving is forced: A's clean-up
    runs inside B's sweep of abandoned staging, the step between the two.)"""
    from server.core.collection import CollectionStore

    class RacedByA(CollectionStore):
        raced = False

        def sweep_abandoned(self, name, remove=True):
            if not self.raced:  # A's failure clean-up, at the worst moment for B
                self.raced = True
                (self.collection_dir(name) / "builds").rmdir()
                self.collection_dir(name).rmdir()
            return super().sweep_abandoned(name, remove)

    store = RacedByA(tmp_path)
    with store.staging("c", "b1") as tmp:
        (tmp / "release.json").write_text("{}")
    assert store.raced and (tmp_path / "c" / "builds" / "b1" / "release.json").is_file()
    assert sorted(p.name for p in (tmp_path / "c" / "builds").iterdir()) == ["b1"]
