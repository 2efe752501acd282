"""All Prometheus metrics, defined once.

Latency buckets are geometric (x1.25 from 50 us to ~60 s), so neighbouring buckets differ by 25% and
p99 and p99.9 land in different buckets. Stages are a label, not a metric each. A small in-memory
window of recent latencies per stage backs the `CollectionStats` admin call (p50/p95/p99 now).
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = tuple(round(5e-5 * 1.25 ** i, 7) for i in range(64))
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)

STAGE_SECONDS = Histogram("search_stage_seconds", "Latency of one stage of answered queries: "
                          "per call for stages a request's queries run together (embed, "
                          "term_stats, retrieve, fusion, feedback, lexical_feedback, total, and "
                          "assembly of the pages finished in place), per collection's shard and "
                          "retrieval round for dense and lexical (the index time), per query "
                          "for the others (fetch, rerank, assembly on the full path; "
                          "shard_dense and shard_lexical on shard servers); "
                          "search_request_seconds counts every answer", ["stage"],
                          buckets=LATENCY_BUCKETS)
SHARD_SECONDS = Histogram("search_shard_seconds", "Latency of one answered shard call, per "
                          "replica (calls given up on: search_shard_abandoned_seconds)",
                          ["shard", "replica"], buckets=LATENCY_BUCKETS)
SHARD_ABANDONED_SECONDS = Histogram("search_shard_abandoned_seconds", "Time until a shard call was "
                                    "given up (a hedge answered first, or its caller went): a "
                                    "lower bound of that replica's latency, which the answered "
                                    "calls' histogram leaves out", ["shard", "replica"],
                                    buckets=LATENCY_BUCKETS)
REQUESTS = Counter("search_requests_total", "RPCs answered, by method and status code",
                   ["method", "code"])
REQUEST_SECONDS = Histogram("search_request_seconds", "Time to answer an RPC, by method and status "
                            "code (failures too)", ["method", "code"], buckets=LATENCY_BUCKETS)
INFLIGHT = Gauge("search_inflight_requests", "Requests being served now")
INFLIGHT_BATCHED_QUERIES = Gauge("search_inflight_batched_queries", "Queries of multi-query "
                                 "requests (SearchBatch, a router's shard message) being served now")
MODEL_THREADS = Gauge("search_model_threads", "CPU threads each model of this process computes with "
                      "(its share of the cores the cgroup allows; 0: no model loaded)")
REJECTED = Counter("search_rejected_total", "Requests shed by admission control")
HEDGES_SENT = Counter("search_hedges_sent_total", "Hedged shard requests sent", ["shard"])
HEDGES_WON = Counter("search_hedges_won_total", "Hedged shard requests that answered first", ["shard"])
EJECTIONS = Counter("search_replica_ejections_total", "Replicas taken out of rotation after "
                    "timeouts, stalls or UNAVAILABLE answers", ["shard", "replica"])
RETRIES = Counter("search_retries_total", "Shard requests retried on another replica", ["shard"])
SHARD_ERRORS = Counter("search_shard_errors_total", "Failed shard calls", ["shard", "replica", "code"])
BATCH_SIZE = Histogram("search_batch_size", "Items per device call", ["model"], buckets=BATCH_BUCKETS)
QUEUE_DEPTH = Gauge("search_batch_queue_depth", "Items waiting for a device call", ["model"])
BATCH_DROPPED = Counter("search_batch_dropped_total", "Queued items dropped before the device call",
                        ["model", "reason"])
TOMBSTONE_RATIO = Gauge("search_tombstone_ratio", "Dead or orphaned rows / all rows (compaction "
                        "removes them)", ["collection", "shard"])
LEXICAL_REPAIRS = Counter("search_lexical_repaired_rows_total", "Rows the BM25 index held or lacked "
                          "against the store (invariant 7), found and repaired", ["collection", "shard"])
FETCH_MISMATCHES = Counter("search_fetch_mismatches_total", "Fetched rows that held another chunk "
                           "than the one ranked (replicas whose rows disagree); left out",
                           ["collection", "shard"])
APPLIED_SEQ = Gauge("search_applied_sequence", "Write-log position a shard has applied",
                    ["collection", "shard"])
WRITE_LAG = Gauge("search_replica_write_lag", "Log entries for this shard the replica has not "
                  "applied yet (each replica process reports its own)", ["collection", "shard"])
ENGINE_BATCH = Histogram("search_engine_batch_size", "Queries per batched shard search",
                         ["collection", "shard"], buckets=BATCH_BUCKETS)
ENGINE_QUEUE_SECONDS = Histogram("search_engine_queue_seconds", "Time a query waited for its "
                                 "batched shard search", ["collection", "shard"],
                                 buckets=LATENCY_BUCKETS)
ENGINE_DROPPED = Counter("search_engine_dropped_total", "Queries dropped before the index call "
                         "(caller gone or past its deadline)", ["collection", "shard", "reason"])
RECORD_CACHE = Counter("search_engine_record_cache_total", "Chunk records a shard read for the "
                       "hits it ships: from its record cache (hit) or from SQLite (miss)",
                       ["collection", "shard", "result"])
ENGINE_QUEUE_DEPTH = Gauge("search_engine_queue_depth", "Queries waiting for a batched shard search",
                           ["collection", "shard"])
WRITE_GROUP = Histogram("search_write_group_size", "Writes applied per group commit",
                        ["collection", "shard"], buckets=BATCH_BUCKETS)
ORPHANS = Gauge("search_orphan_rows", "Rows of writes that never became live", ["collection", "shard"])
STALENESS = Histogram("search_staleness_seconds", "ingested_at - source_modified_at of written "
                      "documents", buckets=tuple(0.01 * 2 ** i for i in range(24)))
FRESHNESS = Histogram("search_write_visible_seconds", "Write received -> searchable (acknowledged)",
                      buckets=LATENCY_BUCKETS)
WRITES = Counter("search_writes_total", "Document writes by operation and outcome", ["op", "outcome"])
REPLICA_APPLIED = Counter("search_replica_applied_writes_total", "Log entries this replica applied, "
                          "by operation and outcome (a router counts appends in "
                          "search_writes_total)", ["op", "outcome"])
REPLICA_VISIBLE = Histogram("search_replica_write_visible_seconds", "Appended to the log -> "
                            "applied on this replica, while it follows the log (not its catch-up "
                            "after a restart); across hosts this includes their clock difference",
                            buckets=LATENCY_BUCKETS)
COLLECTION_UNLOADABLE = Gauge("search_collection_unloadable", "1 while a collection is not served "
                              "because its live build failed to load", ["collection"])
RETRIEVAL_CACHE = Counter("search_retrieval_cache_total", "Retrieval cache lookups", ["result"])
EMBED_CACHE = Counter("search_embedding_cache_total", "Query-embedding cache lookups", ["result"])


_CHILDREN: dict = {}


def labelled(metric, *values: str):
    """`metric.labels(*values)`, memoised: prometheus_client checks and locks on every labels()
    call (~4 us), which the query path would pay several times per request. Label values on the
    query path come from small fixed sets (stages, methods and codes, shard numbers)."""
    key = (metric, values)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*values)
    return child


class RecentLatencies:
    """The last `window` observations per stage, for on-demand percentiles."""

    def __init__(self, window: int = 4096):
        self._data: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))
        self._lock = threading.Lock()

    def observe(self, stage: str, seconds: float) -> None:
        labelled(STAGE_SECONDS, stage).observe(seconds)
        with self._lock:
            self._data[stage].append(seconds)

    def percentiles(self) -> dict[str, dict[str, float]]:
        with self._lock:
            snapshot = {k: np.fromiter(v, float) for k, v in self._data.items() if v}
        out = {}
        for stage, xs in sorted(snapshot.items()):
            p50, p95, p99 = np.percentile(xs, [50, 95, 99]) * 1e3
            out[stage] = {"count": len(xs), "p50_ms": p50, "p95_ms": p95, "p99_ms": p99}
        return out


RECENT = RecentLatencies()
