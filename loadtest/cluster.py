"""Loopback clusters, shared by loadtest/run.py and bench/bench_{hedging,fanout}.py.

* `ensure_collections([1, 2, 4, 8])` builds the Cranfield corpus as `cran_s{N}` (N shards, Flat,
  packaged MiniLM) under bench/results/loadtest-data unless a published build is already there.
  Chunk embeddings are cached on disk by (model id, sha256 of the text), so building the same
  corpus with another shard count does not re-embed it.
* `Cluster` starts N shards x R replicas of `search-server shard` and one `search-server router`
  (harness.processes) on 127.0.0.1, and stops them on `stop()` / leaving the `with` block.
* `scrape_metrics` / `router_counters` read the router's Prometheus /metrics.
* `closed_loop` / `warm_up`: closed-loop gRPC clients for the benchmarks.

Every wait is bounded.
"""
from __future__ import annotations

import hashlib
import os
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from harness import processes
from harness.data import CRANFIELD, REPO, read_queries

DATA_DIR = REPO / "bench" / "results" / "loadtest-data"
FALLBACK_QUERIES = [
    "boundary layer transition", "supersonic flow over a cone", "heat transfer to a wall",
    "buckling of cylindrical shells", "slip flow", "wing flutter at transonic speed",
]


def collection_name(shards: int) -> str:
    return f"cran_s{shards}"


def load_queries(path: Optional[Path] = None) -> list[str]:
    """Cranfield's queries (a few built-in ones where the dataset is not there)."""
    try:
        return read_queries(Path(path) if path else CRANFIELD) or list(FALLBACK_QUERIES)
    except (OSError, ValueError, KeyError):
        return list(FALLBACK_QUERIES)


# --------------------------------------------------------------------------- collections

class CachingEmbedder:
    """Wraps an Embedder; `encode_many` looks every text up in a persistent cache first."""

    def __init__(self, inner, cache_path: Path):
        self.inner = inner
        self.cache_path = Path(cache_path)
        self.cache: dict[str, "np.ndarray"] = {}
        self.hits = self.misses = 0
        if self.cache_path.is_file():
            import numpy as np

            with np.load(self.cache_path) as z:
                for k, v in zip(z["keys"], z["vectors"]):
                    self.cache[str(k)] = v

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _key(self, text: str) -> str:
        return hashlib.sha256(f"{self.inner.model_id}\0{text}".encode()).hexdigest()

    def encode_many(self, texts: Sequence[str], batch_size: int = 64, progress=None):
        import numpy as np

        keys = [self._key(t) for t in texts]
        todo = sorted({k: i for i, k in enumerate(keys) if k not in self.cache}.values())
        self.hits += len(texts) - len(todo)
        self.misses += len(todo)
        if todo:
            vecs = self.inner.encode_many([texts[i] for i in todo], batch_size)
            for i, v in zip(todo, vecs):
                self.cache[keys[i]] = v
            self.save()
        if progress:
            progress(len(texts))
        return np.stack([self.cache[k] for k in keys]).astype(np.float32)

    def save(self) -> None:
        import numpy as np

        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp.npz")
        ks = list(self.cache)
        np.savez(tmp, keys=np.array(ks), vectors=np.stack([self.cache[k] for k in ks]))
        os.replace(tmp, self.cache_path)


def _published(store, name: str) -> bool:
    try:
        store.descriptor(name, store.live_build(name))
        return True
    except Exception:
        return False


def ensure_collections(shard_counts: Iterable[int], data_dir: Path = DATA_DIR,
                       corpus: Path = CRANFIELD, log=print, rebuild: bool = False) -> dict[int, str]:
    """{shards: collection name}; builds (and publishes) the missing ones, embedding at most once.

    rebuild=True deletes those collections first (e.g. after a change to the on-disk format: the
    embedding cache survives, so a rebuild takes seconds)."""
    import shutil

    from server.core.collection import CollectionStore

    data_dir = Path(data_dir)
    store = CollectionStore(data_dir)
    counts = sorted(set(int(n) for n in shard_counts))
    names = {n: collection_name(n) for n in counts}
    if rebuild:
        for n in counts:
            shutil.rmtree(store.collection_dir(names[n]), ignore_errors=True)
    missing = [n for n in counts if not _published(store, names[n])]
    if not missing:
        return names
    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import read_corpus
    from server.backends.device import Device
    from server.backends.models import Embedder

    embedder = CachingEmbedder(Embedder(None, Device("cpu")), data_dir / "embedding-cache.npz")
    for n in missing:
        t0 = time.perf_counter()
        log(f"building {names[n]} ({n} shard(s), Flat) from {corpus} under {data_dir} ...")
        desc = build_collection(read_corpus(corpus), store, names[n], embedder, "Flat", n, quiet=True)
        audit = audit_build(store, names[n], desc.build_id)
        if not audit["passed"]:
            raise RuntimeError(f"audit of {names[n]}/{desc.build_id} failed: {audit}")
        store.publish(names[n], desc.build_id)
        log(f"  built {names[n]}/{desc.build_id}: {desc.documents} docs, {desc.chunks} chunks, "
            f"{time.perf_counter() - t0:.0f}s (embedding cache: {embedder.hits} hits, "
            f"{embedder.misses} misses)")
    return names


# --------------------------------------------------------------------------- processes

class Cluster:
    """shards x replicas shard servers + a router, all on 127.0.0.1.

    shard_flags(shard, replica) -> extra flags for that shard server (e.g. fault injection).
    """

    def __init__(self, collection: str, shards: int, replicas: int, data_dir: Path = DATA_DIR,
                 shard_flags: Optional[Callable[[int, int], list[str]]] = None,
                 router_flags: Sequence[str] = (), log=print):
        self.collection, self.shards, self.replicas = collection, shards, replicas
        self.data_dir = Path(data_dir)
        self.shard_flags = shard_flags or (lambda s, r: [])
        self.router_flags = list(router_flags)
        self.log = log
        self.shard_procs: list[list[processes.ShardProcess]] = []
        self.router: Optional[processes.ServiceProcess] = None
        self.metrics_port: Optional[int] = None

    def start(self, timeout: float = 240.0) -> "Cluster":
        from server.client import wait_ready

        t0 = time.perf_counter()
        try:
            for s in range(self.shards):
                self.shard_procs.append([])
                for r in range(self.replicas):
                    self.shard_procs[-1].append(processes.ShardProcess(
                        self.data_dir, self.collection, s, *self.shard_flags(s, r),
                        ready_timeout=timeout))
            self.metrics_port = processes.free_port()
            argv = ["router", "--collection", self.collection, "--port", "0",
                    "--metrics-port", str(self.metrics_port), "--device", "cpu",
                    "--log-level", "WARNING", *self.router_flags]
            for row in self.shard_procs:
                argv += ["--replicas", ",".join(p.address for p in row)]
            self.router = processes.ServiceProcess(argv, "router", ready_timeout=timeout)
            wait_ready(self.router.address, 60)
        except BaseException:
            self.stop()
            raise
        self.log(f"cluster up in {time.perf_counter() - t0:.1f}s: router {self.router.address} "
                 f"(metrics :{self.metrics_port}) over {self.shards} shard(s) x {self.replicas} "
                 f"replica(s): " + "; ".join(",".join(p.address for p in row)
                                             for row in self.shard_procs))
        return self

    @property
    def address(self) -> str:
        return self.router.address

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def replica_address(self, shard: int, replica: int) -> str:
        return self.shard_procs[shard][replica].address

    def stop(self) -> None:
        """Router first, then every shard server (SIGTERM, SIGKILL after 15 s each)."""
        for p in [self.router, *(p for row in self.shard_procs for p in row)]:
            if p is not None:
                p.stop()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- metrics

def scrape_metrics(url: str, timeout: float = 10.0) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def router_counters(url: str) -> dict:
    """The router counters the load tests report, summed over labels (plus per-replica calls)."""
    samples = scrape_metrics(url)

    def total(name, **match):
        return sum(v for n, labels, v in samples
                   if n == name and all(labels.get(k) == want for k, want in match.items()))

    per_replica = {}
    for n, labels, v in samples:
        if n == "search_shard_seconds_count":
            per_replica[(labels.get("shard"), labels.get("replica"))] = v
    errors = {}
    for n, labels, v in samples:
        if n == "search_shard_errors_total":
            key = (labels.get("shard"), labels.get("replica"), labels.get("code"))
            errors[key] = v
    codes = {labels.get("code"): v for n, labels, v in samples
             if n == "search_requests_total" and labels.get("method") == "Search"}
    return {
        "search_requests": total("search_requests_total", method="Search"),
        "search_codes": codes,
        "hedges_sent": total("search_hedges_sent_total"),
        "hedges_won": total("search_hedges_won_total"),
        "retries": total("search_retries_total"),
        "shard_calls_ok": total("search_shard_seconds_count"),
        "shard_seconds_sum": total("search_shard_seconds_sum"),
        "shard_errors": errors,
        "per_replica": per_replica,
        "embed_cache_hit": total("search_embedding_cache_total", result="hit"),
        "embed_cache_miss": total("search_embedding_cache_total", result="miss"),
    }


def counters_delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = {kk: vv - (b or {}).get(kk, 0.0) for kk, vv in v.items()}
        else:
            out[k] = v - (b or 0.0)
    return out


# --------------------------------------------------------------------------- closed-loop client

MODES = {"dense": 1, "lexical": 2, "hybrid": 3}  # pb.SearchMode values


def search_requests(collection: str, queries: Sequence[str], n: int, mode: str = "hybrid",
                    top_k: int = 10, seed: int = 0, depth: int = 0) -> list:
    """n SearchRequests cycling through a seeded shuffle of the queries (depth 0: server default)."""
    import random

    from server.rpc import search_pb2 as pb

    qs = list(queries)
    random.Random(seed).shuffle(qs)
    return [pb.SearchRequest(collection=collection, text=qs[i % len(qs)], top_k=top_k,
                             mode=MODES[mode], dense_depth=depth, lexical_depth=depth)
            for i in range(n)]


async def _closed_loop(address: str, reqs: Sequence, concurrency: int, timeout: float):
    import grpc

    from server.rpc import search_pb2_grpc as pb_grpc

    lat = [float("nan")] * len(reqs)
    errors: dict[str, int] = {}
    nxt = iter(range(len(reqs)))
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SearchServiceStub(ch)

        async def worker():
            for i in nxt:  # the shared iterator hands each index to exactly one worker
                t0 = time.perf_counter()
                try:
                    await stub.Search(reqs[i], timeout=timeout)
                    lat[i] = (time.perf_counter() - t0) * 1e3
                except grpc.aio.AioRpcError as err:
                    errors[err.code().name] = errors.get(err.code().name, 0) + 1

        import asyncio

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return lat, errors, wall


def closed_loop(address: str, reqs: Sequence, concurrency: int = 8, timeout: float = 10.0):
    """Closed loop: `concurrency` workers, each sending its next request when the last answered.
    Returns (latencies in ms of the successful requests as a numpy array, {code: count}, wall s)."""
    import asyncio

    import numpy as np

    lat, errors, wall = asyncio.run(_closed_loop(address, reqs, concurrency, timeout))
    xs = np.asarray(lat, dtype=float)
    return xs[~np.isnan(xs)], errors, wall


def warm_up(address: str, collection: str, queries: Sequence[str], mode: str, top_k: int = 10,
            concurrency: int = 4, depth: int = 0) -> dict:
    """Every distinct query once (fills the router's query-embedding cache), then a second pass."""
    reqs = search_requests(collection, queries, 2 * len(queries), mode, top_k, 12345, depth)
    _, errors, _ = closed_loop(address, reqs, concurrency, timeout=60.0)
    return errors
