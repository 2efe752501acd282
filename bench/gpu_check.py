"""Every GPU path of the product, in a few minutes, on a host with a GPU - run it first whenever a
GPU machine is at hand, and record what it prints in docs/BENCHMARKS.md.

    .venv/bin/python bench/gpu_check.py [--vectors V.npy] [--n 200000] [--json OUT.json]

Sections (each through the product's own code, server/backends/device.py and friends):
1. environment: what torch, faiss and onnxruntime see;
2. faiss on the GPU per index type (Flat, IVF-Flat, IVF-PQ, HNSW -> CAGRA where faiss has cuVS;
   where faiss cannot search on the GPU - PyPI's wheel on Hopper - Flat through torch and the
   others on the CPU): placement, recall@10 against exact search, and batched QPS at batch
   1/16/128/1024 against the same index on the CPU;
3. the shard engine on the GPU: a LocalShard whose index the Device placed, 256 concurrent
   single queries through its scheduler - mean batch size and QPS (batching on and off);
4. the packaged MiniLM embedder on CUDA vs CPU (texts/s by batch size), and a cross-encoder of
   MiniLM-L6's shape (random weights: timings only) on CUDA;
5. onnxruntime's CUDA provider, when the installed onnxruntime has it.
Without a GPU it says so and exits 0 after section 1 (CI runs it that way).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEVICE = "cuda"  # --cpu-dry-run: every section through the same code on the CPU (tests the script)


def clustered(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    proj = rng.standard_normal((32, d)).astype(np.float32)
    centers = rng.standard_normal((512, 32)).astype(np.float32) * 2
    z = centers[rng.integers(0, 512, n)] + rng.standard_normal((n, 32)).astype(np.float32)
    x = z @ proj + 0.3 * rng.standard_normal((n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


REPEATS = 3                  # --repeats: timed runs per figure (after one warm-up)
BATCHES = (1, 16, 128, 1024)  # --batches: query batch sizes timed per index
FACTORIES = ("Flat", "IVF1024,Flat", "IVF1024,PQ64", "HNSW32,Flat")  # --factories
ENGINE_FACTORY = "IVF1024,Flat"  # --engine-factory


def timed(fn, repeats=None) -> float:
    repeats = repeats or REPEATS
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def environment() -> dict:
    import faiss

    from server.backends.device import Device

    device = Device("auto")
    env = {"faiss": faiss.__version__, "faiss_gpus": device.faiss_gpus,
           "faiss_gpu_unusable": device.faiss_gpu_unusable,
           "faiss_has_cagra": hasattr(faiss, "GpuIndexCagra")}
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.cuda.is_available()
        if env["torch_cuda"]:
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        env["torch"] = f"unavailable: {exc}"
    try:
        import onnxruntime as ort

        env["onnxruntime_providers"] = ort.get_available_providers()
    except Exception as exc:
        env["onnxruntime_providers"] = f"unavailable: {exc}"
    return env


def faiss_paths(x: np.ndarray, q: np.ndarray, k: int = 10) -> list[dict]:
    import faiss

    from server.backends.dense import DenseIndex, SearchKnobs, build_dense, make_index, training_size
    from server.backends.device import Device

    exact = faiss.IndexFlatIP(x.shape[1])
    exact.add(x)
    _, gt = exact.search(q, k)
    device = Device(DEVICE)
    rows = []
    rng = np.random.default_rng(1)
    knobs = SearchKnobs(nprobe=32, ef_search=64, k_factor=4)
    for factory in FACTORIES:
        t0 = time.perf_counter()
        want = training_size(make_index(factory, x.shape[1], "ip"))
        sample = x[rng.choice(len(x), min(want, len(x)), replace=False)] if want else x[:0]
        cpu = build_dense(factory, x.shape[1], "ip", lambda: x, sample, np.arange(len(x)))
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        gpu_index, where = device.place_index(cpu.cpu_index, 0)
        place_s = time.perf_counter() - t0
        gpu = DenseIndex(gpu_index, cpu.row_ids, "ip", knobs, where, cpu.cpu_index)
        row = {"factory": factory, "placement": where, "cpu_build_s": build_s, "place_s": place_s}
        for name, idx in (("cpu", DenseIndex(cpu.cpu_index, cpu.row_ids, "ip", knobs)), ("gpu", gpu)):
            _, ids = idx.search(q, k)
            row[f"{name}_recall"] = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, gt)]))
            for b in BATCHES:
                batch = q[:b]
                row[f"{name}_qps_b{b}"] = b / timed(lambda: idx.search(batch, k))
        rows.append(row)
        print(f"  {factory:14} {where:18} recall cpu {row['cpu_recall']:.3f} gpu {row['gpu_recall']:.3f}  "
              + "  ".join(f"b{b}: cpu {row[f'cpu_qps_b{b}']:,.0f} gpu {row[f'gpu_qps_b{b}']:,.0f}"
                          for b in BATCHES), flush=True)
    return rows


def engine_on_gpu(x: np.ndarray, q: np.ndarray) -> list[dict]:
    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.backends.device import Device
    from server.config import EngineConfig
    from server.core.collection import CollectionStore
    from server.core.engine.local import EnginePools, LocalShard
    from server.core.types import ShardQuery

    data = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    store = CollectionStore(data)
    desc = build_collection([Document(str(i), f"row {i}") for i in range(len(x))], store, "g", None,
                            ENGINE_FACTORY, quiet=True, vectors=x, model_id="gpu-check@1")
    out = []
    for batching in (True, False):
        pools = EnginePools.create()
        shard = LocalShard.open(desc, store.build_dir("g", desc.build_id), data / ".state", 0,
                                Device(DEVICE), EngineConfig(batching=batching), pools)

        async def go():
            qs = [ShardQuery(desc.build_id, "default", v, desc.model_id, "", 10, 0, text_top_n=10)
                  for v in q[:256]]
            await shard.search(qs[:8])
            t0 = time.perf_counter()
            await asyncio.gather(*(shard.search([sq]) for sq in qs))
            return time.perf_counter() - t0

        elapsed = asyncio.run(go())
        sched = shard.scheduler
        row = {"factory": ENGINE_FACTORY, "batching": batching, "placement": shard.index.dense.placement, "queries": 256,
               "qps": 256 / elapsed, "mean_batch": sched.queries / max(1, sched.batches)}
        out.append(row)
        print(f"  engine batching {'on ' if batching else 'off'}: {row['placement']}, "
              f"{row['qps']:,.0f} queries/s, mean batch {row['mean_batch']:.1f}", flush=True)
        asyncio.run(shard.close())
        pools.close()
    return out


def models_on_gpu() -> list[dict]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from server.backends.device import Device
    from server.backends.models import CrossEncoder, Embedder

    texts = [f"query number {i} about boundary layer transition on a swept wing" for i in range(512)]
    out = []
    for where in sorted({"cpu", DEVICE}):
        emb = Embedder(device=Device(where))
        for b in (1, 16, 64, 256):
            s = timed(lambda: emb.encode(texts[:b]), repeats=2)
            out.append({"model": "MiniLM-L6 embedder", "device": where, "batch": b, "items_per_s": b / s})
    d = Path(tempfile.mkdtemp(prefix="gpu-ce-"))
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                             intermediate_size=1536, num_labels=1)).save_pretrained(d)
    from server.backends.models import packaged_minilm_dir

    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (d / name).write_bytes((packaged_minilm_dir() / name).read_bytes())
    pairs = [(t, "a passage of about fifty words " * 8) for t in texts[:64]]
    for where in sorted({"cpu", DEVICE}):
        ce = CrossEncoder(d, Device(where))
        s = timed(lambda: ce.score(pairs), repeats=2)
        out.append({"model": "cross-encoder (MiniLM-L6 shape, random)", "device": where, "batch": 64,
                    "items_per_s": 64 / s})
    for r in out:
        print(f"  {r['model']:42} {r['device']:5} batch {r['batch']:4}: {r['items_per_s']:,.0f}/s", flush=True)
    return out


def main(argv=None) -> int:
    global DEVICE, REPEATS, BATCHES, FACTORIES, ENGINE_FACTORY
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vectors", default=None, help="(N, d) .npy; default: synthetic clustered")
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", ""), "gpu_check.json")
                    if os.environ.get("OUT") else None)
    ap.add_argument("--sections", default="faiss,engine,models")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run every section on the CPU anyway (checks the script itself)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    ap.add_argument("--batches", default="1,16,128,1024",
                    help="query batch sizes timed per index (comma list, each <= 1024)")
    ap.add_argument("--factories", default=";".join(FACTORIES),
                    help="faiss section: index types (';'-separated factory strings)")
    ap.add_argument("--engine-factory", default=ENGINE_FACTORY, help="engine section's index type")
    args = ap.parse_args(argv)
    FACTORIES = tuple(args.factories.split(";"))
    ENGINE_FACTORY = args.engine_factory
    REPEATS = args.repeats
    BATCHES = tuple(int(b) for b in args.batches.split(","))
    report = {"environment": environment()}
    print("environment:", json.dumps(report["environment"]), flush=True)
    if not report["environment"]["faiss_gpus"] and not report["environment"].get("torch_cuda"):
        if not args.cpu_dry_run:
            print("no GPU visible to faiss or torch: nothing else to check here")
            return 0
        DEVICE = "cpu"
        print("no GPU: dry run of every section on the CPU")
    if args.vectors:
        x = np.ascontiguousarray(np.load(args.vectors), dtype=np.float32)
    else:
        x = clustered(args.n + 1024, 384)
    xb, q = x[:-1024], x[-1024:]
    sections = (("faiss", lambda: faiss_paths(xb, q)), ("engine", lambda: engine_on_gpu(xb, q)),
                ("models", models_on_gpu))
    wanted = set(args.sections.split(","))
    for name, fn in sections:
        if name not in wanted:
            continue
        print(f"{name}:", flush=True)
        try:
            report[name] = fn()
        except Exception as exc:  # report and go on: one broken path must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  FAILED: {type(exc).__name__}: {exc}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = [n for n, r in report.items() if isinstance(r, dict) and "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
