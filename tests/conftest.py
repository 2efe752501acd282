"""Shared fixtures: tiny random transformer models (mechanics, fast), small real collections,
and a real gRPC server on a loopback socket."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from server.transport.embedded import ServerThread  # noqa: F401  (re-exported to the tests)
from server.transport.embedded import serve_config as server_config  # noqa: F401
from server.transport.embedded import start_core_server  # noqa: F401

from harness.data import CRANFIELD  # noqa: F401  (../shared/datasets/cranfield)
from harness.processes import REPO, ServiceProcess, ShardProcess  # noqa: F401


@pytest.fixture(scope="session")
def tiny_embedder_dir(tmp_path_factory) -> Path:
    """A randomly initialised 1-layer BERT with MiniLM's tokenizer: real code path, no real weights."""
    from harness.models import tiny_embedder_dir as make

    return make(tmp_path_factory.mktemp("tiny-embedder"))


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory) -> Path:
    from harness.models import tiny_reranker_dir as make

    return make(tmp_path_factory.mktemp("tiny-reranker"))


@pytest.fixture(scope="session")
def tiny_embedder(tiny_embedder_dir):
    from server.backends.device import Device
    from server.backends.models import Embedder

    return Embedder(tiny_embedder_dir, Device("cpu"), model_name="tiny-test-embedder")


@pytest.fixture(scope="session")
def cranfield_docs():
    from index_builder.corpus import read_corpus

    if not (CRANFIELD / "corpus.jsonl").is_file():
        pytest.skip(f"Cranfield dataset not found at {CRANFIELD}")
    return list(read_corpus(CRANFIELD))


def publish_build(data, name, docs, embedder, factory="Flat", shards=1, **kw):
    """Build, audit and publish a collection under `data`; returns its descriptor."""
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    store = CollectionStore(data)
    desc = build_collection(docs, store, name, embedder, factory, shards=shards, quiet=True, **kw)
    audit_build(store, name, desc.build_id)
    store.publish(name, desc.build_id)
    return desc


def write_through_a_server(data, embedder, doc_id: str, text: str, collection: str = "c") -> None:
    """One upsert through an embedded server over `data`, which then stops: its state holds the
    write, logged for the build it served."""
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    srv = start_core_server(data, embedder)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            pb_grpc.SearchServiceStub(ch).UpsertDocument(pb.UpsertDocumentRequest(
                collection=collection, doc_id=doc_id, version=1, text=text), timeout=30)
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def small_collection(tmp_path_factory, tiny_embedder, cranfield_docs):
    """300 Cranfield documents, 2 shards, Flat, built with the tiny embedder and published."""
    data = tmp_path_factory.mktemp("data")
    return data, publish_build(data, "cran", cranfield_docs[:300], tiny_embedder, shards=2)


def make_core(data_dir, embedder=None, reranker=None, **sections):
    from server.backends.device import Device
    from server.core.service import SearchCore

    return SearchCore(server_config(data_dir, **sections), embedder, reranker, Device("cpu"))


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes():
    """Every server process a test started is gone when the session ends, even when a fixture
    failed half-way through its setup."""
    from harness.processes import stop_all

    yield
    stop_all()


class DelegatingShard:
    """A shard that answers as `inner` does, but for the methods a test overrides (a fault)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def live_row(shard, chunk_id):
    """The shard row holding the live version of a chunk."""
    return shard.index.store._conn().execute(
        "SELECT row FROM chunks WHERE chunk_id=? AND live=1", (chunk_id,)).fetchone()[0]


def shards_of(srv, name):
    """The local shards a running embedded server serves for a collection."""
    return srv.core.registry.get(name).shards


def start_router(embedder, collection, replicas, policy=None, token=None, write_log=None,
                 follow_builds_s=None, follow_timeout_s=5.0, **sections):
    """An in-process router (real gRPC server) over shard server processes; with
    `follow_builds_s` it re-reads the replicas' builds that often (each read bounded by
    `follow_timeout_s`), its health following its shards, as `search-server router` does."""
    import asyncio

    from server.backends.device import Device
    from server.core.replicas import HedgePolicy
    from server.core.service import SearchCore
    from server.transport.auth import AnonymousAuth
    from server.transport.router import connect_router, follow_builds, router_health

    core = SearchCore(server_config(REPO, **sections), embedder, None, Device("cpu"), write_log)
    started: dict = {}
    health = router_health(lambda: started["server"].running, takes_writes=write_log is not None)

    async def setup():
        await connect_router(core, collection, replicas, policy or HedgePolicy(), token=token)
        if follow_builds_s:
            asyncio.get_running_loop().create_task(follow_builds(
                core, collection, follow_builds_s, follow_timeout_s, health=health))

    started["server"] = ServerThread(core, AnonymousAuth("default"), setup)
    return started["server"].start()


@pytest.fixture(scope="module")
def server(small_collection, tiny_embedder):
    data, _ = small_collection
    srv = start_core_server(data, tiny_embedder)
    yield srv
    srv.stop()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
