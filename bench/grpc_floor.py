"""The floor under the service: what Python gRPC itself costs per Search on this host.

Starts a gRPC server with this project's SearchService registration (the same safe request
parsing, `server/transport/errors.py`) whose handler does no search at all, and drives it with the
same closed-loop client processes as bench_engines.py's `search-service`. Servers, one at a time:
- `canned`: answers a prepared 10-hit SearchResponse (what the service returns) at once;
- `hop`: the same after one hand-off to a worker thread that sleeps 0.2 ms without the GIL,
  the shape of a shard search (event loop -> device thread -> event loop), no work of its own.

The service's own figures (bench_engines.py, profile_server.py) sit on top of these: the gap
between `hop` and the service is the query pipeline, the engine and the search. Prints QPS,
p50/p99 and the server's CPU per request (/proc) per concurrency.

Run
---
    .venv/bin/python bench/grpc_floor.py
    .venv/bin/python bench/grpc_floor.py --servers canned,hop --concurrency 16,64 --seconds 6
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import engines as E  # noqa: E402

HOP_SECONDS = 0.0002


def serve(port: int, kind: str) -> None:
    """Body of the server process."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc
    from server.transport.errors import add_service

    answer = pb.SearchResponse(build_id="b", corpus_version="c", model_id="m")
    for i in range(10):
        answer.hits.add(chunk_id=i, doc_id=str(i), score=0.5, text=f"passage {i} " * 20,
                        title=f"title {i}", shard=0)
    device = ThreadPoolExecutor(1)

    class Servicer(pb_grpc.SearchServiceServicer):
        async def Search(self, request, context):
            if kind == "hop":
                await asyncio.get_running_loop().run_in_executor(device, time.sleep, HOP_SECONDS)
            return answer

    async def main():
        server = grpc.aio.server()
        add_service(server, Servicer(), pb.DESCRIPTOR.services_by_name["SearchService"])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


class FloorServer(E.Engine):
    kind = "service"

    def __init__(self, server: str):
        super().__init__()
        self.name = f"grpc-{server}"
        self.port = E.free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.port), server],
                                     start_new_session=True)
        E.wait_port(self.port, 60, self.proc)

    def client_spec(self, variant=""):
        return E.ClientSpec("engines:search_service_client",
                            {"address": f"127.0.0.1:{self.port}", "model_id": "m"})

    def server_pids(self):
        return [] if self.proc is None or self.proc.poll() is not None else [self.proc.pid]

    def close(self):
        if self.proc is not None:
            E.stop_process(self.proc)
            self.proc = None
        super().close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="canned,hop")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--dim", type=int, default=384, help="query vector size the client sends")
    args = ap.parse_args(argv)
    queries = np.random.default_rng(0).standard_normal((1000, args.dim)).astype(np.float32)
    print("| server | concurrency | QPS | p50 ms | p99 ms | server CPU per request ms | "
          "client CPU per request ms |\n|---|---|---|---|---|---|---|")
    for name in args.servers.split(","):
        engine = FloorServer(name)
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                m = E.measure(engine, queries, 10, c, args.seconds)
                print(f"| {name} | {c} | {m['qps']:.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                      f"{m['server_cores'] / m['qps'] * 1e3:.3f} | "
                      f"{m['client_cores'] / m['qps'] * 1e3:.3f} |", flush=True)
        finally:
            engine.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    sys.exit(main())
