"""Where one SearchBatch's time goes, in process: the servicer's stages timed one by one.

    .venv/bin/python bench/bench_batch_stages.py --vectors wordnet.npy [--batch 1000] [--repeats 7]

Builds a collection from the vectors as `bench_batch_api.py` does (HNSW16, efSearch set for
--target-recall; the last --batch rows are the queries), loads it in this process (SearchCore on
the CPU device, retrieval cache off, the server's collector threshold) and, --repeats times, times
what one SearchBatch call does without the transport: the client building and serializing the
request, the server parsing it, converting the queries, the pipeline and engine
(`SearchCore.search_batch`), the answers to protobuf, serializing the response, the client
parsing it. Prints the median of each stage, the whole call's queries/s, and faiss's own batched
search of the same queries on the same file (all OpenMP threads) in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines as E  # noqa: E402

STAGES = ("client request", "server parse", "query conversion", "pipeline and engine",
          "answers to protobuf", "response serialize", "client parse")


async def timed_calls(core, xq: np.ndarray, repeats: int) -> list[list[float]]:
    from server.rpc import search_pb2 as pb
    from server.transport import codec

    rows = []
    for _ in range(repeats + 1):  # the first warms the record cache
        t = [time.perf_counter()]
        req = pb.SearchBatchRequest(queries=[pb.SearchRequest(
            collection="bench", top_k=10, mode=pb.DENSE,
            vector=pb.QueryVector(values_f32=q.astype("<f4").tobytes(),
                                  model_id=E.SearchServiceEngine.MODEL)) for q in xq])
        data = req.SerializeToString()
        t.append(time.perf_counter())
        parsed = pb.SearchBatchRequest.FromString(data)
        t.append(time.perf_counter())
        queries = [codec.query_from_pb(r) for r in parsed.queries]
        t.append(time.perf_counter())
        answers = await core.search_batch(queries, "default", None, ())
        t.append(time.perf_counter())
        out = pb.SearchBatchResponse()
        for a in answers:
            slot = out.results.add().response
            slot.SetInParent()
            codec.result_to_pb(a, pb.COSINE_SIMILARITY, slot)
        t.append(time.perf_counter())
        body = out.SerializeToString()
        t.append(time.perf_counter())
        pb.SearchBatchResponse.FromString(body)
        t.append(time.perf_counter())
        rows.append([(b - a) * 1e3 for a, b in zip(t, t[1:])])
    return rows[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--target-recall", type=float, default=0.95)
    args = ap.parse_args(argv)

    import faiss

    sys.path.insert(0, str(E.REPO_ROOT))
    from server.backends.device import Device
    from server.core.service import SearchCore
    from server.transport.app import tune_garbage_collector
    from server.transport.embedded import serve_config

    x = np.ascontiguousarray(np.load(args.vectors), dtype=np.float32)
    xb, xq = x[:-args.batch], x[-args.batch:]
    gt = E.exact_topk(xb, xq, 10)
    engine = E.SearchServiceEngine()
    engine.build(xb)
    index = faiss.read_index(str(engine.store.build_dir("bench", engine.desc.build_id)
                                 / "shard-000" / "dense.faiss"))
    ef = E.smallest_ef_search(index, xq, gt, args.target_recall)
    desc = engine.store.descriptor("bench", engine.desc.build_id)
    desc.search_defaults = {**(desc.search_defaults or {}), "ef_search": ef}
    engine.store.write_descriptor(desc)
    tune_garbage_collector(serve_config(engine.dir / "data").listen.gc_threshold)

    async def run():
        core = SearchCore(serve_config(engine.dir / "data", pipeline={"retrieval_cache_size": 0}),
                          None, None, Device("cpu"))
        core.load()
        await core.start()
        try:
            return await timed_calls(core, xq, args.repeats)
        finally:
            await core.close()

    try:
        rows = asyncio.run(run())
    except BaseException:
        engine.close()
        raise
    index.hnsw.efSearch = ef
    faiss.omp_set_num_threads(E.NCPU)
    t = time.perf_counter()
    for _ in range(args.repeats):
        index.search(xq, 10)
    faiss_ms = (time.perf_counter() - t) * 1e3 / args.repeats
    print(f"{len(xb)} x {x.shape[1]}-d, HNSW16 efSearch={ef}, one SearchBatch of {args.batch} "
          f"queries (dense, top_k 10), in process, {args.repeats} calls; median ms per stage\n")
    print("| stage | ms |\n|---|---|")
    for i, name in enumerate(STAGES):
        print(f"| {name} | {statistics.median(r[i] for r in rows):.1f} |")
    total = statistics.median(sum(r) for r in rows)
    print(f"| **whole call** | **{total:.1f}** ({args.batch / total * 1e3:,.0f} queries/s) |")
    print(f"| faiss, one batched call on the same file | {faiss_ms:.1f} "
          f"({args.batch / faiss_ms * 1e3:,.0f} queries/s) |")
    print(f"\nwhole call / faiss batched: {faiss_ms / total:.2f}x")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
