"""`search-server serve --workers N`: N front-end processes share one port and feed one engine
process: every front end answers, answers equal the single-process server's, and a write made
through one front end is seen through all of them (one engine owns the index)."""
import os
import re
import signal
import sys
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc
from server.transport.engine_link import sweep_socket_dirs

from conftest import REPO, ServiceProcess, start_core_server
from harness.processes import free_port, free_port_run


@pytest.fixture(scope="module")
def workers(small_collection, tiny_embedder_dir):
    data, _ = small_collection
    port, metrics = free_port(), free_port_run(3)  # the engine's, then each front end's
    server = ServiceProcess(
        ["serve", "--data-dir", str(data), "--port", str(port), "--workers", "2", "--metrics-port",
         str(metrics), "--device", "cpu", "--embedder", str(tiny_embedder_dir), "--embedder-name",
         "tiny-test-embedder", "--log-level", "WARNING", "--state-dir", str(data / ".state-workers")],
        "serve --workers 2")
    assert "2 front-end processes" in server.lines[-1]
    yield server.proc, port, metrics
    server.stop(60)


def searches_answered(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(r'search_requests_total\{code="OK",method="Search"\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_every_front_end_answers_and_answers_equal_one_process(workers, small_collection,
                                                               tiny_embedder):
    _, port, metrics = workers
    single = start_core_server(small_collection[0], tiny_embedder,
                               storage={"state_dir": small_collection[0] / ".state-single"})
    try:
        local = pb_grpc.SearchServiceStub(grpc.insecure_channel(single.address))
        channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(32)]  # one connection each: the kernel spreads them
        for i, ch in enumerate(channels):
            req = pb.SearchRequest(collection="cran", text=["boundary layer", "shock wave",
                                                           "heat transfer"][i % 3], top_k=5)
            got = pb_grpc.SearchServiceStub(ch).Search(req, timeout=30)
            want = local.Search(req, timeout=30)
            assert [h.chunk_id for h in got.hits] == [h.chunk_id for h in want.hits]
        for ch in channels:
            ch.close()
    finally:
        single.stop()
    assert searches_answered(metrics + 1) > 0 and searches_answered(metrics + 2) > 0


def test_the_front_ends_split_the_cores_between_their_models(workers):
    """Each front end's embedder computes on its share of the cores: torch's default, every
    core in every front end, spun N teams on the same cores (bench/bench_cpu_threads.py)."""
    from server.backends.threads import usable_cores

    _, _, metrics = workers

    def model_threads(port: int) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return float(re.search(r"^search_model_threads ([0-9.e+]+)$", text, re.M).group(1))

    assert model_threads(metrics + 1) == model_threads(metrics + 2) == max(1, usable_cores() // 2)
    assert model_threads(metrics) == 0  # the engine loads no model


def test_a_write_through_one_front_end_is_seen_through_all(workers):
    _, port, metrics = workers
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(16)]
    stubs = [pb_grpc.SearchServiceStub(ch) for ch in channels]
    r = stubs[0].UpsertDocument(pb.UpsertDocumentRequest(collection="cran", doc_id="w-1", version=1,
                                                         text="zyxworkers one engine"), timeout=30)
    assert r.outcome == pb.WriteResponse.APPLIED
    for stub in stubs:
        hits = stub.Search(pb.SearchRequest(collection="cran", text="zyxworkers", top_k=3,
                                            mode=pb.LEXICAL), timeout=30).hits
        assert [h.doc_id for h in hits] == ["w-1"]
    # re-sent through every front end, the write is a no-op each asks the engine for, before
    # embedding anything (the engine loads no model; the front ends' embedding batches stay put)
    embeds = sum(engine_metric(metrics + i, "search_batch_size_count", model="embed")
                 for i in (1, 2))
    for stub in stubs:
        again = stub.UpsertDocument(pb.UpsertDocumentRequest(
            collection="cran", doc_id="w-1", version=1, text="zyxworkers changed"), timeout=30)
        assert again.outcome == pb.WriteResponse.NOOP_STALE_VERSION and again.stored_version == 1
        assert again.index_version == r.index_version
    assert sum(engine_metric(metrics + i, "search_batch_size_count", model="embed")
               for i in (1, 2)) == embeds
    for ch in channels:
        ch.close()


def front_ends(engine_pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(engine_pid)], capture_output=True, text=True).stdout.split()


def test_collection_stats_through_a_front_end_survive_an_engine_that_hangs(workers):
    """CollectionStats reaches the shards through the engine; an engine that does not answer
    (stopped: its socket takes the call, nothing answers) is given up just before the caller's
    deadline and each shard listed unreachable, as a hung remote shard is (review: the link's
    own TimeoutError reached the caller as INTERNAL)."""
    proc, port, _ = workers
    admin = pb_grpc.AdminServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    whole = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran"), timeout=30)
    shards = {r.shard for r in whole.replicas}
    assert not whole.shard_errors and whole.chunks > 0 and shards
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        hung = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran"), timeout=3)
        assert time.monotonic() - t0 < 3
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert len(hung.shard_errors) == len(shards), hung
    assert all("the engine process did not answer ShardInfo" in e for e in hung.shard_errors)
    assert hung.chunks == 0 and {r.state for r in hung.replicas} <= {"unreachable"}
    again = admin.CollectionStats(pb.CollectionStatsRequest(collection="cran"), timeout=30)
    assert not again.shard_errors and again.chunks == whole.chunks


def test_a_front_end_that_dies_is_started_again(workers):
    """Regression (outside QA): a front end killed or crashed was never noticed: the engine ran
    on with fewer (a zombie left), or with none and the port closed."""
    proc, port, _ = workers
    before = front_ends(proc.pid)
    assert len(before) == 2
    subprocess.run(["kill", "-9", before[0]], check=True)
    deadline = time.monotonic() + 60
    while True:
        now = front_ends(proc.pid)
        if len(now) == 2 and before[0] not in now:
            break
        assert time.monotonic() < deadline, f"no new front end: {now}"
        time.sleep(0.2)
    stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + 60
    while True:  # the new front end answers once it has loaded its models
        try:
            resp = stub.Search(pb.SearchRequest(collection="cran", text="boundary layer", top_k=3),
                               timeout=10)
            assert resp.hits
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline


def test_a_killed_engine_stops_every_front_end_and_no_search_hangs(small_collection,
                                                                  tiny_embedder_dir):
    """Regression (outside QA): after a kill -9 of the engine the front ends kept their port and
    reported SERVING, every search waited out its deadline, writes failed INTERNAL, and a
    restarted server shared its port with them. Now a front end that loses its engine fails
    what waits UNAVAILABLE and exits."""
    data, _ = small_collection
    port = free_port()
    server = ServiceProcess(
        ["serve", "--data-dir", str(data), "--port", str(port), "--workers", "2", "--device", "cpu",
         "--embedder", str(tiny_embedder_dir), "--embedder-name", "tiny-test-embedder",
         "--log-level", "WARNING", "--state-dir", str(data / ".state-workers-kill")],
        "serve --workers 2")
    children = front_ends(server.pid)
    assert len(children) == 2
    stub = pb_grpc.SearchServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    assert stub.Search(pb.SearchRequest(collection="cran", text="shock wave", top_k=3), timeout=30).hits
    server.kill()
    for _ in range(3):  # UNAVAILABLE (a client retries elsewhere), never a deadline waited out
        with pytest.raises(grpc.RpcError) as err:
            stub.Search(pb.SearchRequest(collection="cran", text="shock wave", top_k=3), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    deadline = time.monotonic() + 30
    while any(subprocess.run(["kill", "-0", pid], capture_output=True).returncode == 0
              for pid in children):
        assert time.monotonic() < deadline, "front ends outlived their engine"
        time.sleep(0.2)
    # the killed engine left its socket directory; the next engine's start sweeps it (outside QA)
    left = list(Path(tempfile.gettempdir()).glob(f"search-engine-{server.pid}-*"))
    assert left and (left[0] / "engine.sock").exists()
    assert sweep_socket_dirs() and not any(p.exists() for p in left)


def test_the_socket_directories_of_dead_engines_are_swept_and_no_others():
    import shutil

    tmp_path = Path(tempfile.mkdtemp(prefix="sw", dir="/tmp"))  # a Unix socket path is short
    try:
        _sweep_socket_dirs_in(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _sweep_socket_dirs_in(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"search-engine-{int(done.stdout)}-abc"
    alive = tmp_path / f"search-engine-{os.getpid()}-def"
    other = tmp_path / "search-engine-notapid"
    for d in (dead, alive, other):
        d.mkdir()
        (d / "engine.sock").write_text("")
    # a pid this namespace does not know, whose socket answers: another container's engine
    listening = tmp_path / f"search-engine-{int(done.stdout)}-ghi"
    listening.mkdir()
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(listening / "engine.sock"))
        server.listen(1)
        assert sweep_socket_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists() and listening.exists()


def engine_metric(metrics_port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_cancelled_call_stops_its_queued_work_in_the_engine(workers, cranfield_docs):
    """Outside QA: under --workers a cancelled SearchBatch kept the engine busy for seconds (its
    queries were all searched: none dropped), where one process drops them at once. A front end
    now tells the engine when every caller of a message went away, and the engine's shards drop
    the queued queries as cancelled."""
    _, port, metrics = workers  # the engine's metrics port; the front ends' follow it
    vocab = sorted({w for d in cranfield_docs for w in d.text.split() if w.isalpha() and len(w) > 3})
    queries = [pb.SearchRequest(collection="cran", mode=pb.LEXICAL, top_k=10, text=" ".join(
        vocab[(i * 37 + j) % len(vocab)] for j in range(900))[:8000]) for i in range(1024)]
    before = engine_metric(metrics, "search_engine_dropped_total", reason="cancelled")
    searched = engine_metric(metrics, "search_engine_batch_size_count")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = pb_grpc.SearchServiceStub(ch).SearchBatch.future(
            pb.SearchBatchRequest(queries=queries), timeout=300)
        deadline = time.monotonic() + 60
        while engine_metric(metrics, "search_engine_batch_size_count") == searched:  # busy yet?
            assert time.monotonic() < deadline and not call.done(), "the engine never started"
            time.sleep(0.005)  # (a poll interval: the loop waits for the condition)
        call.cancel()
    deadline = time.monotonic() + 60
    while engine_metric(metrics, "search_engine_dropped_total", reason="cancelled") == before:
        assert time.monotonic() < deadline, "the engine searched every cancelled query"
        time.sleep(0.02)


def test_sigterm_stops_the_engine_and_every_front_end(workers):
    proc, port, _ = workers
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0



PARENT = r'''
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-m", "server.main", "frontend", "--engine-socket",
                          sys.argv[1], "--engine-pid", str(os.getpid()), "--data-dir", sys.argv[2],
                          "--port", "0", "--device", "cpu", "--log-level", "WARNING"])
print(child.pid, flush=True)
time.sleep(600)
'''


def test_a_front_end_still_connecting_stops_when_its_engine_dies(tmp_path, small_collection):
    """Outside QA: a front end started again just before its engine was killed with SIGKILL kept
    retrying the engine's socket for a minute. The kernel now sends a front end SIGTERM when its
    parent (the engine) dies, however it dies. Here the parent is a stand-in that only spawns the
    front end, whose socket nobody will ever answer."""
    data, _ = small_collection
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "nobody.sock"), str(data)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 40  # its connect would give up only after 60 s
    while subprocess.run(["kill", "-0", str(child)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the front end outlived its engine"
        time.sleep(0.2)


@pytest.mark.parametrize("before, after", [(2, 3), (3, 2)])
def test_a_write_routed_for_the_build_before_a_switch_lands_where_the_live_build_places_it(
        tmp_path, tiny_embedder, cranfield_docs, before, after):
    """Outside QA: with --workers, a front end routes a write by its own descriptor and the
    engine applied it to that shard number of whatever build was live. Writes in flight while a
    publish changed 2 shards to 3 were stored on the old layout's shard, so their deletes (routed
    by the new layout) missed them and deleted documents came back; 3 -> 2 failed with an
    IndexError. The engine now places a write routed for another build by the live build."""
    import asyncio

    from conftest import publish_build
    from server.core.chunking import shard_of
    from server.core.types import WriteRequest
    from server.transport.engine_link import EngineServer

    old = publish_build(tmp_path, "sw", cranfield_docs[:30], tiny_embedder, shards=before)
    live = publish_build(tmp_path, "sw", cranfield_docs[:30], tiny_embedder, shards=after)
    srv = start_core_server(tmp_path, tiny_embedder)
    try:
        engine = EngineServer(srv.core, str(tmp_path / "unused.sock"), 1)

        def run(coro):
            return asyncio.run_coroutine_threadsafe(coro, srv.loop).result(60)

        coll = srv.core.registry.get("sw")
        assert coll.desc.build_id == live.build_id
        doc_ids = [f"moved-{i}" for i in range(12)]
        for i, doc_id in enumerate(doc_ids):
            # each as a front end still on the old build would send it: that layout's shard
            stale_shard = shard_of("default", doc_id, before)
            w = WriteRequest("upsert", "sw", doc_id, 1, f"zyxmoved{i} panel")
            sw = run(srv.core.writes.shard_write(w, "default", coll.desc))
            (outcome,) = run(engine._handle("apply", ("sw", old.build_id, stale_shard, [sw], None)))
            assert outcome.outcome == "applied"
        moved = 0
        for doc_id in doc_ids:
            home = shard_of("default", doc_id, after)
            moved += home != shard_of("default", doc_id, before)
            for shard in coll.shards:
                held = shard.index.store.documents_of([("default", doc_id)])
                assert bool(held) == (shard.shard_no == home), (doc_id, shard.shard_no, home)
        assert moved  # some of them do change shards between the layouts
        # one embedded for another model than the live build's is refused, not stored
        from dataclasses import replace as _replace

        from server.errors import Unavailable
        w = WriteRequest("upsert", "sw", "other-model", 1, "zyxother panel")
        sw = _replace(run(srv.core.writes.shard_write(w, "default", coll.desc)), model_id="m-old@1")
        with pytest.raises(Unavailable, match="embedded with 'm-old@1'"):
            run(engine._handle("apply", ("sw", old.build_id, 0, [sw], None)))
        assert not any(s.index.store.documents_of([("default", "other-model")]) for s in coll.shards)
        if after < before:  # a stale front end's description of a shard that is gone
            with pytest.raises(Unavailable, match="switched to a build of 2 shards"):
                run(engine._handle("info", ("sw", before - 1, None, False, None)))
    finally:
        srv.stop()


def test_hits_cross_the_engine_link_whole():
    """Candidates and their records pickle as one tuple of their fields (~3x faster than a
    slots dataclass's own state): every field, the vector too, comes back as it was."""
    import pickle

    import numpy as np

    from server.backends.docstore import ChunkRecord
    from server.core.types import Candidate

    rec = ChunkRecord(7, 70, "doc-7", 2, 10, 42, "A title", "some text", "acme", {"year": "1999"},
                      ("public", "hr"), 123456789)
    vec = np.arange(4, dtype=np.float32)
    for c in (Candidate(70, 0.25, rec, 3), Candidate(70, -1.5, rec, 1, vec)):
        back = pickle.loads(pickle.dumps(c, protocol=5))
        assert type(back) is Candidate and type(back.record) is ChunkRecord
        assert back.record == rec and (back.chunk_id, back.score, back.shard) == (
            c.chunk_id, c.score, c.shard)
        assert (back.vector is None) == (c.vector is None)
        if c.vector is not None:
            assert back.vector.dtype == np.float32 and np.array_equal(back.vector, c.vector)
