"""Shared fixtures: tiny random transformer models (mechanics, fast), small real collections,
and a real gRPC server on a loopback socket."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from server.transport.embedded import ServerThread  # noqa: F401  (re-exported to the tests)

REPO = Path(__file__).resolve().parent.parent
CRANFIELD = REPO.parent / "shared" / "datasets" / "cranfield"


def _tokenizer_files(dst: Path) -> None:
    from server.backends.models import packaged_minilm_dir

    src = packaged_minilm_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy2(src / name, dst / name)


@pytest.fixture(scope="session")
def tiny_embedder_dir(tmp_path_factory) -> Path:
    """A randomly initialised 1-layer BERT with MiniLM's tokenizer: real code path, no real weights."""
    import torch
    from transformers import BertConfig, BertModel

    d = tmp_path_factory.mktemp("tiny-embedder")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    BertModel(cfg).save_pretrained(d)
    _tokenizer_files(d)
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return d


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    d = tmp_path_factory.mktemp("tiny-reranker")
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, num_labels=1)
    BertForSequenceClassification(cfg).save_pretrained(d)
    _tokenizer_files(d)
    return d


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


@pytest.fixture(scope="session")
def small_collection(tmp_path_factory, tiny_embedder, cranfield_docs):
    """300 Cranfield documents, 2 shards, Flat, built with the tiny embedder and published."""
    data = tmp_path_factory.mktemp("data")
    return data, publish_build(data, "cran", cranfield_docs[:300], tiny_embedder, shards=2)


def server_config(data_dir, **sections):
    """The configuration the CLI builds (server/config.py), with some sections changed, e.g.
    server_config(data, engine={"max_batch": 8})."""
    from server.config import default_config

    return default_config("serve").replace(storage={"data_dir": data_dir, **sections.pop("storage", {})},
                                           **sections)


def make_core(data_dir, embedder=None, reranker=None, **sections):
    from server.backends.device import Device
    from server.core.service import SearchCore

    return SearchCore(server_config(data_dir, **sections), embedder, reranker, Device("cpu"))


def start_core_server(data_dir, embedder=None, reranker=None, auth=None, tls=None, **sections):
    from server.transport.auth import AnonymousAuth

    core = make_core(data_dir, embedder, reranker, **sections)
    core.load()
    return ServerThread(core, auth or AnonymousAuth("default"), tls=tls).start()


_CHILDREN: list = []


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes():
    """Every server process a test started is gone when the session ends, even when a fixture
    failed half-way through its setup."""
    yield
    for proc in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def live_row(shard, chunk_id):
    """The shard row holding the live version of a chunk."""
    return shard.index.store._conn().execute(
        "SELECT row FROM chunks WHERE chunk_id=? AND live=1", (chunk_id,)).fetchone()[0]


def shards_of(srv, name):
    """The local shards a running embedded server serves for a collection."""
    return srv.core.registry.get(name).shards


class ServiceProcess:
    """A real `search-server` process on an ephemeral loopback port: started with `args`, ready
    once it prints its "listening on" line (every wait bounded by the child's own exit)."""

    def __init__(self, args, what="server", prefix=()):
        import re
        import subprocess
        import sys

        self.args = list(args)
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "server.main", *self.args],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        _CHILDREN.append(self.proc)
        self.lines = []
        for line in self.proc.stdout:  # the server prints its port once it is serving
            self.lines.append(line)
            m = re.search(r"listening on [0-9.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        else:
            raise RuntimeError(f"{what} exited before serving:\n" + "".join(self.lines))
        # keep draining its output so a chatty child never blocks on a full pipe
        self.drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.drain.start()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except Exception:
                self.kill()


class ShardProcess(ServiceProcess):
    """A real shard server process (`search-server shard`) on an ephemeral loopback port."""

    def __init__(self, data_dir, collection, shard, *flags):
        super().__init__(["shard", "--data-dir", str(data_dir), "--collection", collection,
                          "--shard", str(shard), "--port", "0", "--device", "cpu",
                          "--log-level", "WARNING", *flags], "shard server")


def start_router(embedder, collection, replicas, policy=None, token=None, write_log=None,
                 follow_builds_s=None, **sections):
    """An in-process router (real gRPC server) over shard server processes; with
    `follow_builds_s` it re-reads the replicas' builds that often, as `search-server router` does."""
    import asyncio

    from server.backends.device import Device
    from server.core.replicas import HedgePolicy
    from server.core.service import SearchCore
    from server.transport.auth import AnonymousAuth
    from server.transport.router import connect_router, follow_builds

    core = SearchCore(server_config(REPO, **sections), embedder, None, Device("cpu"), write_log)

    async def setup():
        await connect_router(core, collection, replicas, policy or HedgePolicy(), token=token)
        if follow_builds_s:
            asyncio.get_running_loop().create_task(follow_builds(core, collection, follow_builds_s))

    return ServerThread(core, AnonymousAuth("default"), setup).start()


@pytest.fixture(scope="module")
def server(small_collection, tiny_embedder):
    data, _ = small_collection
    srv = start_core_server(data, tiny_embedder)
    yield srv
    srv.stop()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
