"""`search-server`: serve collections (embedded default: router and shards in one process)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="search-server", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve every published collection under --data-dir")
    s.add_argument("--data-dir", type=Path, default=Path(os.environ.get("SEARCH_DATA_DIR", "data")),
                   help="directory holding collections built by index-builder (default: ./data)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port")
    s.add_argument("--collection", action="append", default=None,
                   help="serve only these collections (repeatable; default: all published)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--embedder", type=Path, default=None,
                   help="local model directory (default: the packaged all-MiniLM-L6-v2)")
    s.add_argument("--embedder-backend", choices=["torch", "onnx"], default="torch")
    s.add_argument("--reranker", type=Path, default=None,
                   help="local directory of a Hugging Face cross-encoder (enables rerank_depth)")
    s.add_argument("--reranker-backend", choices=["torch", "onnx"], default="torch")
    s.add_argument("--rerank-cap", type=int, default=200, help="largest rerank_depth accepted")
    s.add_argument("--max-inflight", type=int, default=256,
                   help="admission control: requests beyond this get RESOURCE_EXHAUSTED")
    s.add_argument("--batch-max-size", type=int, default=64)
    s.add_argument("--batch-max-wait-ms", type=float, default=2.0)
    s.add_argument("--tenant", default="default",
                   help="the tenant every caller belongs to when authentication is off")
    s.add_argument("--log-level", default="INFO")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from server.backends.device import Device
    from server.backends.models import CrossEncoder, Embedder
    from server.core.search import SearchConfig, SearchCore
    from server.transport.app import serve_forever
    from server.transport.auth import AnonymousAuth

    device = Device(args.device)
    logging.getLogger(__name__).info("device: %s", device.describe())
    embedder = Embedder(args.embedder, device, args.embedder_backend)
    reranker = CrossEncoder(args.reranker, device, args.reranker_backend) if args.reranker else None
    config = SearchConfig(data_dir=args.data_dir, max_inflight=args.max_inflight,
                          rerank_cap=args.rerank_cap, embed_max_batch=args.batch_max_size,
                          embed_max_wait_ms=args.batch_max_wait_ms,
                          rerank_max_batch=args.batch_max_size,
                          rerank_max_wait_ms=args.batch_max_wait_ms,
                          collections=args.collection)
    core = SearchCore(config, embedder, reranker, device)
    core.load()
    asyncio.run(serve_forever(core, AnonymousAuth(args.tenant), args.host, args.port,
                              args.metrics_port))


if __name__ == "__main__":
    main()
