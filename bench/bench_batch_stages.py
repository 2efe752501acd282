"""Where one SearchBatch's time goes, in process: the servicer's stages timed one by one.

    .venv/bin/python bench/bench_batch_stages.py --vectors wordnet.npy [--batch 1000] [--repeats 7]

Builds a collection from the vectors as `bench_batch_api.py` does (HNSW16, efSearch set for
--target-recall; the last --batch rows are the queries), loads it in this process (SearchCore on
the CPU device, retrieval cache off, the server's collector threshold) and, --repeats times, times
what one SearchBatch call does without the transport: the client building and serializing the
request, the server parsing it, converting the queries, the pipeline and engine
(`SearchCore.search_batch`), the answers to protobuf, serializing the response, the client
parsing it. Prints the median of each stage (wall clock, the event-loop thread's CPU, the
process's CPU), the whole call's queries/s, faiss's own batched search of the same queries on the
same file (all OpenMP threads) in the same run, and the floor of a Python server: that search
followed by the leanest plain-Python page assembly and encoding of the same answers.
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


async def timed_calls(core, xq: np.ndarray, repeats: int):
    """Per call and stage: (wall ms, event-loop thread CPU ms, process CPU ms); and the answers
    of the last call. The loop thread's CPU is the number to compare code by: every stage but
    the index search runs there, under the interpreter lock, and it is far steadier than the
    wall clock on a shared host."""
    from server.rpc import search_pb2 as pb
    from server.transport import codec
    from server.transport.servicers import answer_batch

    def now():
        return time.perf_counter(), time.thread_time(), time.process_time()

    def lap(a, b):
        return tuple((y - x) * 1e3 for x, y in zip(a, b))

    rows, answers = [], []
    for n in range(repeats + 1):  # the first warms the record cache
        t = [now()]
        req = pb.SearchBatchRequest(queries=[pb.SearchRequest(
            collection="bench", top_k=10, mode=pb.DENSE,
            vector=pb.QueryVector(values_f32=q.astype("<f4").tobytes(),
                                  model_id=E.SearchServiceEngine.MODEL)) for q in xq])
        data = req.SerializeToString()
        t.append(now())
        parsed = pb.SearchBatchRequest.FromString(data)
        t.append(now())

        async def stage_by_stage():
            nonlocal answers
            s = [now()]
            queries = [codec.query_from_pb(r) for r in parsed.queries]
            s.append(now())
            answers = await core.search_batch(queries, "default", None, ())
            s.append(now())
            out = pb.SearchBatchResponse()
            for a in answers:
                slot = out.results.add().response
                slot.SetInParent()
                codec.result_to_pb(a, pb.COSINE_SIMILARITY, slot)
            s.append(now())
            return out, [lap(a, b) for a, b in zip(s, s[1:])]

        async def as_served():  # the servicer's own path: each part encoded once answered
            t0 = now()
            served = await answer_batch(core, parsed, "default", None, ())
            return served, lap(t0, now())

        if n % 2:  # the two ways alternate which goes first: a shared host drifts
            served, served_lap = await as_served()
            out, middle = await stage_by_stage()
        else:
            out, middle = await stage_by_stage()
            served, served_lap = await as_served()
        t2 = [now()]
        body = out.SerializeToString()
        t2.append(now())
        pb.SearchBatchResponse.FromString(body)
        t2.append(now())
        for a, b in zip(served.results, out.results):  # the same answers, timings aside
            assert list(a.response.hits) == list(b.response.hits) and a.code == b.code, \
                "the servicer's response differs from the stages' own"
        rows.append([lap(a, b) for a, b in zip(t, t[1:])] + middle
                    + [lap(a, b) for a, b in zip(t2, t2[1:])] + [served_lap])
    return rows[1:], answers


def leanest_pages_ms(index, xq: np.ndarray, depth: int, answers, repeats: int) -> float:
    """The floor of a Python server for this call: faiss's batched search of the queries (all
    threads), then, one loop per query in plain Python, the page the service answered - skip
    repeated texts, number the hits - written straight into the response message and
    serialized. No validation, fan-out, tenancy, objects between stages or timings: what is
    left is per-hit Python and protobuf. Records (text, ids) are looked up by chunk id from the
    service's own answers; a hit the service did not show is skipped."""
    from server.rpc import search_pb2 as pb

    records = {h.candidate.record.row: h.candidate.record for a in answers for h in a.hits}
    took = []
    for _ in range(repeats):
        t = time.perf_counter()
        scores, rows = index.search(xq, depth)
        out = pb.SearchBatchResponse()
        for rr, ss in zip(rows.tolist(), scores.tolist()):
            resp = out.results.add().response
            resp.build_id, resp.corpus_version, resp.model_id = "b", "c", "m"
            hits, seen, rank = resp.hits, set(), 0
            for r, s in zip(rr, ss):
                rec = records.get(r)  # faiss numbers the shard's rows
                if rec is None or rec.text_hash in seen:
                    continue
                seen.add(rec.text_hash)
                rank += 1
                hit = hits.add(chunk_id=rec.chunk_id, doc_id=rec.doc_id, score=s,
                               score_kind=pb.COSINE_SIMILARITY, higher_is_better=True,
                               text=rec.text, title=rec.title, chunk_index=rec.chunk_index,
                               start_offset=rec.start_offset, end_offset=rec.end_offset)
                m = hit.dense
                m.rank, m.score, m.kind = rank, s, pb.COSINE_SIMILARITY
                if rank == 10:
                    break
        out.SerializeToString()
        took.append((time.perf_counter() - t) * 1e3)
    return statistics.median(took)


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
    engine, index, ef, _ = E.service_at_recall(xb, xq, args.target_recall)
    engine.store_ef_search(ef)  # read as the core below loads the build (no server started)
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
        rows, answers = asyncio.run(run())
    except BaseException:
        engine.close()
        raise
    index.hnsw.efSearch = ef
    faiss.omp_set_num_threads(E.NCPU)
    t = time.perf_counter()
    for _ in range(args.repeats):
        index.search(xq, 10)
    faiss_ms = (time.perf_counter() - t) * 1e3 / args.repeats
    floor_ms = leanest_pages_ms(index, xq, 20, answers, args.repeats)  # the service's depth: 2 x top_k
    print(f"{len(xb)} x {x.shape[1]}-d, HNSW16 efSearch={ef}, one SearchBatch of {args.batch} "
          f"queries (dense, top_k 10), in process, {args.repeats} calls; medians\n")
    print("| stage | wall ms | event-loop thread CPU ms | process CPU ms |\n|---|---|---|---|")
    for i, name in enumerate(STAGES):
        wall, loop_cpu, cpu = (statistics.median(r[i][j] for r in rows) for j in range(3))
        print(f"| {name} | {wall:.1f} | {loop_cpu:.1f} | {cpu:.1f} |")
    total, loop_total, cpu_total = (statistics.median(sum(st[j] for st in r[:len(STAGES)])
                                                      for r in rows) for j in range(3))
    print(f"| **whole call** | **{total:.1f}** ({args.batch / total * 1e3:,.0f} queries/s) | "
          f"{loop_total:.1f} | {cpu_total:.1f} |")
    served = STAGES.index("query conversion"), STAGES.index("answers to protobuf") + 1
    overlapped = [statistics.median(sum(st[j] for st in r[:served[0]] + r[served[1]:])
                                    for r in rows) for j in range(3)]
    print(f"| **whole call, as the servicer runs it** (conversion to protobuf: "
          f"`answer_batch`, {statistics.median(r[-1][0] for r in rows):.1f} ms) | "
          f"**{overlapped[0]:.1f}** ({args.batch / overlapped[0] * 1e3:,.0f} queries/s) | "
          f"{overlapped[1]:.1f} | {overlapped[2]:.1f} |")
    print(f"| faiss, one batched call on the same file | {faiss_ms:.1f} "
          f"({args.batch / faiss_ms * 1e3:,.0f} queries/s) | | |")
    print(f"| faiss + the leanest Python pages (`leanest_pages_ms`) | {floor_ms:.1f} "
          f"({args.batch / floor_ms * 1e3:,.0f} queries/s) | | |")
    print(f"\nwhole call / faiss batched: {faiss_ms / total:.2f}x stage by stage, "
          f"{faiss_ms / overlapped[0]:.2f}x as the servicer runs it; the leanest Python pages / "
          f"faiss batched: {faiss_ms / floor_ms:.2f}x")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
