"""`LocalShard`: the shard engine in this process - one ShardIndex, its search scheduler and its
write queue - behind the complete shard interface (server/core/shard_api.py).

The engine owns its index and device: searches reach the index only through the scheduler's
batches, writes only through the write queue's group commits. Threads: `device` runs the batched
searches (`dense_workers` of them, faiss with its configured OpenMP threads), the shared
`lexical` pool a batch's BM25 searches, the shared `cpu` pool record reads, statistics rounds,
version reads and descriptions, and one writer thread per shard applies write groups in order.
Nothing here blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from server.backends.device import Device, faiss_threads_initializer
from server.backends.threads import usable_cores
from server.config import EngineConfig
from server.core.engine.index import ShardIndex
from server.core.engine.scheduler import SearchScheduler, WriteQueue
from server.core.shard_api import SearchAnswer
from server.core.types import (Candidate, FetchRequest, ShardInfo, ShardQuery, ShardWrite,
                               StoredVersions, WriteOutcome)
from server.core.validation import validate_fetch, validate_shard_query, validate_shard_write
from server.errors import DeadlineExceeded, SearchError, Unavailable

log = logging.getLogger(__name__)

# read-your-writes asks the write log where this shard's last entry is: at most this long, and
# never past the request's deadline
PROBE_TIMEOUT_S = 5.0


@dataclass
class EnginePools:
    """Threads shared by every shard of one engine process.

    `cpu` runs work that takes a shard's read lock itself (fetches, statistics rounds), other
    reads (info, stored versions) and the pipeline's CPU work. `lexical` runs only the BM25
    searches a batch fans out while its device thread holds that shard's read lock, and nothing
    that takes the lock: on `cpu`, a batch holding the lock waited for threads that were all
    fetches queued for it behind a waiting write (the lock lets a waiting writer go first), and
    the shard hung for good (outside QA: writes beside SearchBatch and Search)."""

    cpu: ThreadPoolExecutor
    lexical: ThreadPoolExecutor
    faiss_threads: int = 1

    @classmethod
    def create(cls, search_threads: int = 8, faiss_threads: int = 1) -> "EnginePools":
        threads = max(1, search_threads)
        return cls(ThreadPoolExecutor(threads, thread_name_prefix="engine-cpu",
                                      initializer=faiss_threads_initializer(faiss_threads)),
                   ThreadPoolExecutor(threads, thread_name_prefix="engine-bm25"),
                   faiss_threads)

    def close(self) -> None:
        self.cpu.shutdown(wait=True)
        self.lexical.shutdown(wait=True)


def dense_workers(configured: int, placement: str) -> int:
    """Batches a shard may run at once. A GPU index is one device queue: one batch at a time, the
    next one filling meanwhile. On the CPU a batch runs on one faiss thread, so batches overlap
    to use more cores - but not the front end's: its event loop (gRPC, the query pipeline) needs
    a core of its own, so one worker per core beyond the first, up to 4. Measured on 2 cores
    through gRPC (docs/BENCHMARKS.md): one worker answers 20-28% more queries/s at 64 callers
    than two, whose threads took CPU from the event loop (in process, with no front end to feed,
    two were faster)."""
    return _workers(configured, placement, spare_cores=1)


def burst_workers(configured: int, placement: str) -> int:
    """Batches a shard may run at once while a backlog of full batches waits (a SearchBatch, a
    burst): then throughput is what counts, and every core searches (up to 4)."""
    return _workers(configured, placement, spare_cores=0)


def _workers(configured: int, placement: str, spare_cores: int) -> int:
    if configured > 0:
        return configured
    if placement != "cpu":
        return 1
    return max(1, min(4, usable_cores() - spare_cores))


def _abandon(futures) -> None:
    """Cancel the unfinished (the scheduler drops them) and read the finished ones' exceptions,
    which nobody else will (asyncio logs an unread one as "never retrieved")."""
    for f in futures:
        if not f.done():
            f.cancel()
        elif not f.cancelled():
            f.exception()


class LocalShard:
    def __init__(self, index: ShardIndex, config: EngineConfig, pools: EnginePools,
                 apply_batch: int = 256):
        self.index = index
        self.shard_no = index.shard_no
        self.desc = index.desc
        self.config = config
        self.pools = pools
        labels = (index.desc.collection, str(index.shard_no))
        placement = index.dense.placement
        workers = (dense_workers(config.dense_workers, placement) if config.batching
                   else max(1, config.search_threads))
        burst = burst_workers(config.dense_workers, placement) if config.batching else workers
        nice = config.device_nice if placement == "cpu" else 0
        self._device = ThreadPoolExecutor(burst, thread_name_prefix=f"engine-dev{index.shard_no}",
                                          initializer=faiss_threads_initializer(pools.faiss_threads,
                                                                                nice))
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"writer-{index.shard_no}")
        self.scheduler = SearchScheduler(self._run_group, self._device, labels, config.batching,
                                         config.max_batch, config.dispatch_timeout_ms, workers,
                                         burst)
        self.writes = WriteQueue(index.apply_writes, self._writer, labels, apply_batch)
        self._applied: Optional[asyncio.Condition] = None
        # set by a write-log consumer (server/replication/log.py): this replica applies a log, and
        # can ask the log for its subject's last sequence
        self.replicated = False
        self.watermark_probe = None
        self._probe_logged = -1e9  # when a failed probe was last logged (once per 10 s)

    @classmethod
    def open(cls, desc, build_dir: Path, state_root: Path, shard_no: int, device: Optional[Device],
             config: EngineConfig, pools: EnginePools, apply_batch: int = 256) -> "LocalShard":
        """Load (blocking: call from a worker thread when a loop is running)."""
        return cls(ShardIndex(desc, build_dir, state_root, shard_no, device,
                              config.record_cache_rows, config.record_cache_mb * 2**20),
                   config, pools, apply_batch)

    # --- the shard interface -----------------------------------------------------------------
    def _run_group(self, queries: Sequence[ShardQuery]):
        texts = sum(1 for q in queries if q.text and not q.stats_only)
        lexical_map = self.pools.lexical.map if texts > 1 else map  # never `cpu` (EnginePools)
        return self.index.search_group(queries, lexical_map)

    @property
    def cache_version(self) -> Optional[int]:
        return self.index.index_version


    async def search(self, queries: Sequence[ShardQuery],
                     timeout: Optional[float] = None) -> list[SearchAnswer]:
        loop = asyncio.get_running_loop()
        if queries and all(q.stats_only for q in queries):
            return await self._term_stats(queries, timeout)
        deadline = None if timeout is None else loop.time() + timeout
        answers: list = [None] * len(queries)
        valid = []
        for i, q in enumerate(queries):
            try:
                validate_shard_query(q, self.desc.dim)
                self.index.check_query(q)
                if q.min_applied_seq > self.index.applied_seq and self.replicated:
                    await self.wait_applied(q.min_applied_seq, deadline)
                valid.append(i)
            except SearchError as exc:
                answers[i] = exc
        if valid:
            futures = dict(zip(valid, self.scheduler.submit_many([queries[i] for i in valid],
                                                                 deadline)))
            # one waiter for all of them (no gather, no task): the hot path of every search
            pending = list(futures.values())
            try:
                _, late = await asyncio.wait(pending, timeout=timeout)
            except asyncio.CancelledError:  # the caller went away: the scheduler drops its queries
                _abandon(pending)
                raise
            if late:
                _abandon(pending)
                raise DeadlineExceeded(f"shard {self.shard_no} did not answer within the deadline")
            errors = [f.exception() for f in pending]  # every one read: none logged as lost
            for (i, f), error in zip(futures.items(), errors):
                if error is not None and not isinstance(error, SearchError):
                    raise error
                answers[i] = f.result() if error is None else error
        return answers

    async def _term_stats(self, queries: Sequence[ShardQuery],
                          timeout: Optional[float]) -> list[SearchAnswer]:
        """A statistics round (ShardQuery.stats_only): term dictionaries only, no index search,
        so on the CPU pool rather than through the device's scheduler."""
        answers: list = [None] * len(queries)
        ok = []
        for i, q in enumerate(queries):
            try:
                validate_shard_query(q, self.desc.dim)
                self.index.check_query(q)
                ok.append(i)
            except SearchError as exc:
                answers[i] = exc
        if ok:
            fut = asyncio.get_running_loop().run_in_executor(
                self.pools.cpu, self.index.term_stats, [queries[i] for i in ok])
            try:
                stats = await (asyncio.wait_for(fut, timeout) if timeout is not None else fut)
            except asyncio.TimeoutError:  # the caller's budget, not an engine fault
                raise DeadlineExceeded(f"shard {self.shard_no}: statistics round past its "
                                       f"budget") from None
            for i, r in zip(ok, stats):
                answers[i] = r
        return answers

    async def wait_applied(self, seq: int, deadline: Optional[float]) -> None:
        """Read-your-writes: wait (within the deadline) until every write-log entry of this
        shard up to `seq` is applied. Sequences count every shard's entries, so only this shard's
        last entry at or below `seq` matters: the log says where that is (the probe)."""
        if self.index.applied_seq >= seq:
            return
        if self._applied is None:
            self._applied = asyncio.Condition()
        loop = asyncio.get_running_loop()
        target = seq
        if self.watermark_probe is not None:
            left = (PROBE_TIMEOUT_S if deadline is None
                    else min(PROBE_TIMEOUT_S, deadline - loop.time()))
            if left <= 0:
                raise DeadlineExceeded(f"shard {self.shard_no}: no time left to wait for write-log "
                                       f"sequence {seq}")
            try:
                target = min(seq, await self.watermark_probe(left))
            except SearchError as exc:
                # without the log this shard cannot tell whether `seq` is one of its writes; when
                # it is not, waiting for it would only wait out the caller's deadline (outside QA:
                # with NATS down every read-your-writes search hung for its whole deadline). A
                # disconnected log is refused at once; the cause (with the log's address) is
                # logged, not sent to callers
                if loop.time() - self._probe_logged > 10.0:  # a SearchBatch would log each query
                    self._probe_logged = loop.time()
                    log.warning("shard %d: read-your-writes at %d: %s", self.shard_no, seq, exc)
                if self.index.applied_seq < seq:
                    raise Unavailable(
                        f"shard {self.shard_no} has applied the write log to "
                        f"{self.index.applied_seq}, not yet {seq}, and cannot ask the log whether "
                        f"{seq} holds a write of this shard (the log does not answer); retry when "
                        f"the write log answers") from None
        async with self._applied:
            while self.index.applied_seq < target:
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise Unavailable(f"shard {self.shard_no} has applied the write log to "
                                      f"{self.index.applied_seq}, not yet {seq}")
                try:
                    await asyncio.wait_for(self._applied.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def notify_applied(self) -> None:
        if self._applied is not None:
            async with self._applied:
                self._applied.notify_all()

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list[Candidate]:
        validate_fetch(request)
        fut = asyncio.get_running_loop().run_in_executor(self.pools.cpu, self.index.fetch, request)
        try:
            return await (asyncio.wait_for(fut, timeout) if timeout is not None else fut)
        except asyncio.TimeoutError:  # the caller's deadline, not an engine fault
            raise DeadlineExceeded(f"shard {self.shard_no}: fetch past its deadline") from None

    async def apply(self, writes: Sequence[ShardWrite],
                    timeout: Optional[float] = None) -> list[WriteOutcome]:
        for w in writes:
            validate_shard_write(w, self.desc)
        outcomes = await self.writes.submit(writes)
        await self.notify_applied()
        return outcomes

    async def stored_versions(self, keys: Sequence[tuple[str, str]],
                              timeout: Optional[float] = None) -> StoredVersions:
        # one SQLite read off the event loop, taking no shard lock (a version read before a
        # concurrent group's flip is lower, never higher: that write is embedded and the group
        # commit's own rule decides, as without this read)
        return await asyncio.get_running_loop().run_in_executor(
            self.pools.cpu, self.index.stored_versions, list(keys))

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = None) -> ShardInfo:
        return await asyncio.get_running_loop().run_in_executor(self.pools.cpu, self.index.info,
                                                                tenant, digest)

    async def close(self) -> None:
        await self.scheduler.close()
        self._device.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.index.close()

    def close_sync(self) -> None:
        """Close without a loop (a shard loaded and dropped before serving)."""
        self._device.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self.index.close()
