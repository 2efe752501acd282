"""`search-server`: serve collections.

  serve   the embedded default: router and shards in one process, over every published collection
  shard   one shard of one build, over proto/shard.proto (a shard server of a distributed deployment)
  router  query embedding, fan-out (hedged, over replica sets), fusion, rerank and assembly, in front
          of shard servers listed in a topology file or with --replicas
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path


def _common(s: argparse.ArgumentParser, port: int) -> None:
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=port)
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--faiss-threads", type=int, default=1,
                   help="OpenMP threads per faiss search (default 1: requests already run in "
                        "parallel, and per-call OpenMP made a 20k Flat search 3.3x slower here)")
    s.add_argument("--log-level", default="INFO")
    s.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGTERM: seconds in-flight calls get to finish (new calls and calls "
                        "still running after it are answered UNAVAILABLE, which clients retry)")
    t = s.add_argument_group("TLS")
    t.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS")
    t.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    t.add_argument("--tls-client-ca", type=Path, default=None,
                   help="require client certificates signed by this CA (mutual TLS)")


def _data_dir(s: argparse.ArgumentParser) -> None:
    s.add_argument("--data-dir", type=Path, default=Path(os.environ.get("SEARCH_DATA_DIR", "data")),
                   help="directory holding collections built by index-builder (default: ./data)")


def _models(s: argparse.ArgumentParser) -> None:
    s.add_argument("--embedder", type=Path, default=None,
                   help="local model directory (default: the packaged all-MiniLM-L6-v2)")
    s.add_argument("--embedder-name", default=None,
                   help="model name for the model id (default: the directory name); the id must "
                        "equal the one the collection was built with")
    s.add_argument("--embedder-backend", choices=["torch", "onnx"], default="torch")
    s.add_argument("--reranker", type=Path, default=None,
                   help="local directory of a Hugging Face cross-encoder (enables rerank_depth)")
    s.add_argument("--reranker-backend", choices=["torch", "onnx"], default="torch")
    s.add_argument("--rerank-cap", type=int, default=200, help="largest rerank_depth accepted")
    s.add_argument("--max-inflight", type=int, default=256,
                   help="admission control: requests beyond this get RESOURCE_EXHAUSTED")
    s.add_argument("--batch-max-size", type=int, default=None,
                   help="items per device call (default: 16 on CPU, where padding makes larger "
                        "batches slower per item (bench/bench_batching.py); 64 on CUDA)")
    s.add_argument("--batch-max-wait-ms", type=float, default=2.0)
    s.add_argument("--tenant", default="default",
                   help="the tenant every caller belongs to when authentication is off")
    s.add_argument("--auth-tokens", type=Path, default=None,
                   help="JSON token file (see server/transport/auth.py): callers must present "
                        "'authorization: Bearer <token>'; their tenant and ACL scopes come from it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="search-server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="embedded default: router and shards in one process")
    _common(s, 50051)
    _data_dir(s)
    _models(s)
    s.add_argument("--collection", action="append", default=None,
                   help="serve only these collections (repeatable; default: all published)")
    s.add_argument("--alias-poll-s", type=float, default=2.0,
                   help="follow alias flips (index-builder publish) every N seconds; 0 = never")
    s.add_argument("--compact-interval-s", type=float, default=0.0,
                   help="check every N seconds whether to compact (0 = only on request)")
    s.add_argument("--compact-min-tombstone-ratio", type=float, default=0.2,
                   help="scheduled compaction runs when dead+orphan rows reach this share")

    sh = sub.add_parser("shard", help="serve one shard of a build to routers")
    _common(sh, 50061)
    _data_dir(sh)
    sh.add_argument("--collection", required=True)
    sh.add_argument("--shard", type=int, required=True, help="shard number within the build")
    sh.add_argument("--build", default=None, help="build id (default: the collection's live build)")
    f = sh.add_argument_group("fault injection (tests and load tests only; off by default)")
    f.add_argument("--inject-delay-prob", type=float, default=0.0)
    f.add_argument("--inject-delay-ms", type=float, default=0.0)
    f.add_argument("--inject-fail-prob", type=float, default=0.0)
    f.add_argument("--inject-hang-prob", type=float, default=0.0)
    f.add_argument("--inject-seed", type=int, default=None)

    r = sub.add_parser("router", help="front shard servers: embed, fan out with hedging, fuse, rerank")
    _common(r, 50051)
    _models(r)
    r.add_argument("--topology", type=Path, default=None,
                   help='JSON {"collection": NAME, "shards": [["host:port", ...], ...]}')
    r.add_argument("--collection", default=None, help="with --replicas")
    r.add_argument("--replicas", action="append", default=None,
                   help="comma-separated replica addresses of one shard; repeat in shard order")
    r.add_argument("--no-hedge", action="store_true", help="disable hedged requests")
    r.add_argument("--hedge-min-ms", type=float, default=2.0)
    r.add_argument("--hedge-max-ms", type=float, default=200.0)
    r.add_argument("--hedge-budget", type=float, default=0.10,
                   help="hedges allowed per request, on average (0.10 = 10%% extra requests at most); "
                        "keep it above 0.05, since hedging at p95 wants ~5%%")
    r.add_argument("--hedge-burst", type=float, default=10.0,
                   help="hedge tokens that can accumulate for a burst of slow calls")
    r.add_argument("--shard-tls-ca", type=Path, default=None,
                   help="reach shards over TLS, trusting this CA")
    r.add_argument("--shard-tls-cert", type=Path, default=None, help="client certificate for mTLS")
    r.add_argument("--shard-tls-key", type=Path, default=None)
    return p


def _make_core(args, data_dir, device):
    from server.backends.models import CrossEncoder, Embedder
    from server.core.search import SearchConfig, SearchCore

    embedder = Embedder(args.embedder, device, args.embedder_backend, model_name=args.embedder_name)
    reranker = CrossEncoder(args.reranker, device, args.reranker_backend) if args.reranker else None
    max_batch = args.batch_max_size or (64 if device.torch_cuda else 16)
    config = SearchConfig(data_dir=data_dir, max_inflight=args.max_inflight,
                          rerank_cap=args.rerank_cap, embed_max_batch=max_batch,
                          embed_max_wait_ms=args.batch_max_wait_ms,
                          rerank_max_batch=max_batch,
                          rerank_max_wait_ms=args.batch_max_wait_ms, faiss_threads=args.faiss_threads,
                          collections=getattr(args, "collection", None)
                          if args.command == "serve" else None)
    return SearchCore(config, embedder, reranker, device)


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.backends.device import Device
    from server.transport import app
    from server.transport.auth import AnonymousAuth

    device = Device(args.device)
    logging.getLogger(__name__).info("device: %s", device.describe())
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    tls = app.TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    auth = None
    if args.command != "shard":
        from server.transport.auth import TokenFileAuth

        auth = TokenFileAuth(args.auth_tokens) if args.auth_tokens else AnonymousAuth(args.tenant)
    if args.command == "shard":
        from server.core.collection import CollectionStore
        from server.core.faults import FaultSpec, FaultyShard
        from server.core.shards import LocalShard

        store = CollectionStore(args.data_dir)
        build = args.build or store.live_build(args.collection)
        desc = store.descriptor(args.collection, build)
        if not 0 <= args.shard < desc.shards:
            raise SystemExit(f"--shard must be within 0..{desc.shards - 1} for build {build}")
        from concurrent.futures import ThreadPoolExecutor

        from server.backends.device import faiss_threads_initializer

        executor = ThreadPoolExecutor(8, thread_name_prefix="shard",
                                      initializer=faiss_threads_initializer(args.faiss_threads))
        shard = LocalShard(desc, store.build_dir(args.collection, build), args.shard, device, executor)
        spec = FaultSpec(args.inject_delay_prob, args.inject_delay_ms, args.inject_fail_prob,
                         args.inject_hang_prob, args.inject_seed)
        asyncio.run(app.serve_shard_forever(FaultyShard(shard, spec) if spec.active else shard,
                                            args.host, args.port, args.metrics_port, tls,
                                            args.shutdown_grace_s))
        return
    if args.command == "router":
        from server.core.replicas import HedgePolicy
        from server.transport.router import connect_router, load_topology

        if args.topology:
            collection, replicas = load_topology(args.topology)
        elif args.replicas and args.collection:
            collection = args.collection
            replicas = [[a.strip() for a in spec.split(",") if a.strip()] for spec in args.replicas]
        else:
            raise SystemExit("router needs --topology FILE, or --collection NAME with --replicas")
        core = _make_core(args, Path("."), device)
        policy = HedgePolicy(enabled=not args.no_hedge, hedge_min_ms=args.hedge_min_ms,
                             hedge_max_ms=args.hedge_max_ms, hedge_budget=args.hedge_budget,
                             hedge_burst=args.hedge_burst)

        credentials = None
        if args.shard_tls_ca:
            import grpc

            credentials = grpc.ssl_channel_credentials(
                args.shard_tls_ca.read_bytes(),
                args.shard_tls_key.read_bytes() if args.shard_tls_key else None,
                args.shard_tls_cert.read_bytes() if args.shard_tls_cert else None)

        async def setup():
            await connect_router(core, collection, replicas, policy, credentials=credentials)

        asyncio.run(app.serve_forever(core, auth, args.host, args.port, args.metrics_port,
                                      setup=setup, tls=tls, grace=args.shutdown_grace_s))
        return
    core = _make_core(args, args.data_dir, device)
    core.load()
    background = []
    if args.alias_poll_s > 0:
        background.append(core.watch_aliases(args.alias_poll_s))
    if args.compact_interval_s > 0:
        background.append(core.compact_on_schedule(args.compact_interval_s,
                                                   args.compact_min_tombstone_ratio))
    asyncio.run(app.serve_forever(core, auth, args.host, args.port, args.metrics_port, tls=tls,
                                  background=tuple(background), grace=args.shutdown_grace_s))


if __name__ == "__main__":
    main()
