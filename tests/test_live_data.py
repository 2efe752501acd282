"""Streaming upserts and deletes: idempotent, ordered, atomic per document, durable, crash-safe;
caches never outlive a write that changes their answer."""
import asyncio
import os
import random
import re
import subprocess
import sys
import threading

import grpc
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

from conftest import _CHILDREN, REPO, live_row, publish_build, start_core_server

APPLIED, NOOP = pb.WriteResponse.APPLIED, pb.WriteResponse.NOOP_STALE_VERSION


def long_text(markers, words_per_chunk=150):
    """One marker word per ~chunk of filler, so each chunk is findable by its marker."""
    filler = "the flow over the plate was measured at several stations along the span"
    parts = []
    for m in markers:
        body = (filler + " ") * (words_per_chunk // len(filler.split()))
        parts.append(f"{m} {body}")
    return " ".join(parts)


@pytest.fixture(scope="module")
def live_build(tmp_path_factory, tiny_embedder, cranfield_docs):
    data = tmp_path_factory.mktemp("live")
    return data, publish_build(data, "live", cranfield_docs[:60], tiny_embedder, shards=2)


@pytest.fixture(scope="module")
def live(live_build, tiny_embedder):
    srv = start_core_server(live_build[0], tiny_embedder)
    ch = grpc.insecure_channel(srv.address)
    yield srv, pb_grpc.SearchServiceStub(ch)
    ch.close()
    srv.stop()


def upsert(stub, doc_id, version, text, **kw):
    return stub.UpsertDocument(pb.UpsertDocumentRequest(collection="live", doc_id=doc_id,
                                                        version=version, text=text, **kw), timeout=30)


def delete(stub, doc_id, version):
    return stub.DeleteDocument(pb.DeleteDocumentRequest(collection="live", doc_id=doc_id,
                                                        version=version), timeout=30)


def docs_for(stub, text, mode=pb.LEXICAL, top_k=20):
    resp = stub.Search(pb.SearchRequest(collection="live", text=text, top_k=top_k, mode=mode), timeout=30)
    return list(dict.fromkeys(h.doc_id for h in resp.hits)), resp  # documents, best chunk first


def test_upsert_is_searchable_when_acknowledged_and_replays_are_noops(live):
    _, stub = live
    r = upsert(stub, "new-1", 3, "zyxalpha turbine blade cooling", title="cooling")
    assert r.outcome == APPLIED and r.stored_version == 3
    assert docs_for(stub, "zyxalpha")[0] == ["new-1"]
    dense, _ = docs_for(stub, "cooling. zyxalpha turbine blade cooling", mode=pb.DENSE, top_k=1)
    assert dense == ["new-1"]
    again = upsert(stub, "new-1", 3, "zyxalpha turbine blade cooling", title="cooling")
    assert again.outcome == NOOP and again.stored_version == 3
    older = upsert(stub, "new-1", 2, "zyxbeta an older version")
    assert older.outcome == NOOP and older.stored_version == 3
    assert docs_for(stub, "zyxbeta")[0] == []


def test_replacing_with_a_shorter_document_leaves_no_orphan_chunk(live):
    srv, stub = live
    assert upsert(stub, "long-1", 1, long_text(["mkalpha", "mkbravo", "mkcharlie"])).outcome == APPLIED
    for m in ("mkalpha", "mkbravo", "mkcharlie"):
        assert docs_for(stub, m)[0] == ["long-1"]
    assert upsert(stub, "long-1", 2, "mkdelta only now").outcome == APPLIED
    for m in ("mkalpha", "mkbravo", "mkcharlie"):
        assert docs_for(stub, m)[0] == []
    assert docs_for(stub, "mkdelta")[0] == ["long-1"]
    from server.core.chunking import shard_of

    shard = srv.core.collections["live"].shards[shard_of("long-1", 2)]
    live_rows = shard.store._conn().execute(
        "SELECT count(*) FROM chunks WHERE doc_id='long-1' AND live=1").fetchone()[0]
    assert live_rows == 1
    hits = [h for h in docs_for(stub, "flow over the plate measured stations", pb.DENSE, 100)[1].hits
            if h.doc_id == "long-1"]
    assert all(h.text == "mkdelta only now" for h in hits)


def test_delete_removes_from_both_branches_and_is_idempotent(live):
    _, stub = live
    upsert(stub, "del-1", 1, "zyxgamma wind shear")
    assert delete(stub, "del-1", 2).outcome == APPLIED
    assert docs_for(stub, "zyxgamma")[0] == []
    assert "del-1" not in docs_for(stub, "zyxgamma wind shear", pb.DENSE, 100)[0]
    assert delete(stub, "del-1", 2).outcome == NOOP
    assert upsert(stub, "del-1", 1, "zyxgamma resurrected?").outcome == NOOP
    assert docs_for(stub, "zyxgamma")[0] == []
    assert upsert(stub, "del-1", 3, "zyxgamma back at version three").outcome == APPLIED
    assert docs_for(stub, "zyxgamma")[0] == ["del-1"]


def test_cache_entries_never_survive_a_write_that_changes_their_answer(live):
    from server.core import metrics

    _, stub = live
    assert docs_for(stub, "zyxepsilon")[0] == []
    hits_before = metrics.RETRIEVAL_CACHE.labels("hit")._value.get()
    assert docs_for(stub, "zyxepsilon")[0] == []  # same question, no write: served from cache
    assert metrics.RETRIEVAL_CACHE.labels("hit")._value.get() == hits_before + 1
    upsert(stub, "cache-1", 1, "zyxepsilon appears now")
    assert docs_for(stub, "zyxepsilon")[0] == ["cache-1"]
    upsert(stub, "cache-1", 2, "gone again")
    assert docs_for(stub, "zyxepsilon")[0] == []


def test_a_document_of_another_tenant_cannot_be_overwritten(live):
    from server.core.types import WriteRequest
    from server.errors import PermissionDenied

    srv, stub = live
    upsert(stub, "owned-1", 1, "zyxzeta belongs to default")
    fut = asyncio.run_coroutine_threadsafe(
        srv.core.write(WriteRequest("upsert", "live", "owned-1", 5, "hijack"), "mallory"), srv.loop)
    with pytest.raises(PermissionDenied):
        fut.result(30)
    assert docs_for(stub, "zyxzeta")[0] == ["owned-1"]


def test_writes_survive_a_restart(live_build, tiny_embedder, live):
    srv, stub = live
    upsert(stub, "durable-1", 7, "zyxeta durable write")
    other = start_core_server(live_build[0], tiny_embedder)  # a second process view of the same store
    try:
        with grpc.insecure_channel(other.address) as ch:
            assert docs_for(pb_grpc.SearchServiceStub(ch), "zyxeta")[0] == ["durable-1"]
    finally:
        other.stop()


# --- kill -9 during replaces ------------------------------------------------------------------

class ServerProcess:
    def __init__(self, data, embedder_dir, crash_point=None):
        env = dict(os.environ)
        env.pop("SEARCH_TEST_CRASH_POINT", None)
        if crash_point:
            env["SEARCH_TEST_CRASH_POINT"] = crash_point
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.main", "serve", "--data-dir", str(data), "--port", "0",
             "--device", "cpu", "--embedder", str(embedder_dir), "--embedder-name",
             "tiny-test-embedder", "--log-level", "WARNING"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _CHILDREN.append(self.proc)
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError("server exited before serving:\n" + "".join(lines))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.SearchServiceStub(self.channel)

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def versions_visible(stub, doc_id, max_version):
    """Which versions of doc_id are served: every version's text carries the marker v<doc>x<n>."""
    seen = set()
    for v in range(1, max_version + 1):
        marker = version_marker(doc_id, v)
        for mode in (pb.LEXICAL,):
            ids, _ = docs_for(stub, marker, mode)
            if doc_id in ids:
                seen.add(v)
    return seen


def version_marker(doc_id, v):
    """One alphanumeric token (the analyzer splits on anything else), unique per version."""
    return "v" + re.sub(r"[^a-z0-9]", "", doc_id.lower()) + f"x{v}"


def version_text(doc_id, v):
    # odd versions are long (3 chunks), even ones short: replaces grow and shrink
    marker = version_marker(doc_id, v)
    return long_text([marker] * (3 if v % 2 else 1))


@pytest.fixture(scope="module")
def crash_build(tmp_path_factory, tiny_embedder, tiny_embedder_dir, cranfield_docs):
    data = tmp_path_factory.mktemp("crash")
    publish_build(data, "live", cranfield_docs[:30], tiny_embedder)
    return data


@pytest.mark.parametrize("point,expect_new", [("after_pending", False), ("after_dense", False),
                                              ("after_lexical", False), ("after_flip", True)])
def test_a_kill_at_each_step_of_a_replace_leaves_one_version_served(crash_build, tiny_embedder_dir,
                                                                    point, expect_new):
    doc = f"crash-{point}"
    srv = ServerProcess(crash_build, tiny_embedder_dir)
    try:
        assert upsert(srv.stub, doc, 1, version_text(doc, 1)).outcome == APPLIED
    finally:
        srv.close()
    srv = ServerProcess(crash_build, tiny_embedder_dir, crash_point=point)
    try:
        with pytest.raises(grpc.RpcError):
            upsert(srv.stub, doc, 2, version_text(doc, 2))
        assert srv.proc.wait(30) == -9  # it really died mid-write
    finally:
        srv.close()
    srv = ServerProcess(crash_build, tiny_embedder_dir)
    try:
        assert versions_visible(srv.stub, doc, 2) == ({2} if expect_new else {1})
        retry = upsert(srv.stub, doc, 2, version_text(doc, 2))
        assert retry.outcome == (NOOP if expect_new else APPLIED)
        assert versions_visible(srv.stub, doc, 2) == {2}
    finally:
        srv.close()


def test_random_kills_during_a_stream_of_replaces_never_lose_a_document(crash_build,
                                                                       tiny_embedder_dir):
    """SIGKILL at random moments while replaces stream in (several trials): after each restart
    every document is served at exactly one version, at least its last acknowledged one."""
    rng = random.Random(11)
    docs = [f"rk-{i}" for i in range(4)]
    acked = {d: 0 for d in docs}
    attempted = {d: 0 for d in docs}
    for trial in range(5):
        srv = ServerProcess(crash_build, tiny_embedder_dir)
        try:
            for d in docs:  # the previous trial's state: one version each, >= the last acked
                seen = versions_visible(srv.stub, d, attempted[d])
                if acked[d]:
                    assert len(seen) == 1 and acked[d] <= seen.pop() <= attempted[d], (trial, d)
            killer = threading.Timer(rng.uniform(0.05, 0.6), srv.proc.kill)
            killer.start()
            try:
                while srv.proc.poll() is None:
                    d = rng.choice(docs)
                    v = attempted[d] + 1
                    attempted[d] = v
                    try:
                        if upsert(srv.stub, d, v, version_text(d, v)).outcome == APPLIED:
                            acked[d] = v
                    except grpc.RpcError:
                        break
            finally:
                killer.cancel()
        finally:
            srv.close()
    srv = ServerProcess(crash_build, tiny_embedder_dir)
    try:
        for d in docs:
            if acked[d]:
                seen = versions_visible(srv.stub, d, attempted[d])
                assert len(seen) == 1 and seen.pop() >= acked[d]
                again = upsert(srv.stub, d, acked[d], version_text(d, acked[d]))
                assert again.outcome == NOOP  # replaying an acknowledged version is a no-op
    finally:
        srv.close()


def test_a_row_fetched_after_its_document_was_replaced_is_dropped_not_mixed(live):
    """Hits beyond the text window travel as rows and are fetched later; a row replaced in between
    must not come back with the new version's text (one ranking, one document version)."""
    from server.core.chunking import chunk_id, shard_of

    srv, stub = live
    upsert(stub, "mix-1", 1, "zyxtheta first version")
    coll = srv.core.collections["live"]
    shard = coll.shards[shard_of("mix-1", coll.desc.shards)]
    row = live_row(shard, chunk_id("mix-1", 0))
    assert len(shard.fetch_chunks_sync(coll.desc.build_id, "default", (), [row])) == 1
    upsert(stub, "mix-1", 2, "zyxtheta second version")
    assert shard.fetch_chunks_sync(coll.desc.build_id, "default", (), [row]) == []
