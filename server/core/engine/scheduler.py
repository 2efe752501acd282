"""The shard's schedulers: concurrent queries coalesced into batched index calls, concurrent writes
into group commits. Each owns its state behind a small handle (`submit`), like the model batcher
(server/core/batcher.py).

Search policy (`SearchScheduler`):
- queries queue in groups by restriction (build, tenant, ACL scopes, filters); a batch holds one
  group's queries only, so it is one faiss call (per depth) with one selector - mixed restrictions never share
  a selector;
- a group is ready to go when it holds `max_batch` queries, when its first query has waited
  `dispatch_timeout_ms`, at once when no batch of this shard is running (an idle index pays no
  dispatch delay), and at the next loop turn when another batch runs but a device thread is free
  (the queries of that turn - e.g. every caller a finished batch answered - share one batch);
  while every thread is busy the next batches fill (continuous batching). A free thread never
  waits for a batch to fill: measured in process on 2 cores (HNSW, 117k vectors), waiting the
  dispatch timeout cost 20-25% of the queries/s at 16 callers and ~8% at 64;
- at most `workers` batches run at a time (one per device queue), and up to `burst_workers`
  while a full batch's worth of queries waits behind them (a backlog, e.g. a SearchBatch: every
  core searches, each with one more full batch queued behind it so no device thread waits for
  the event loop; under single-query traffic a core stays with the front end); the oldest ready
  group goes first;
- queries whose caller has gone (cancelled) or whose deadline has passed are dropped before the
  index call (checked as a batch leaves the queue and again as it starts on its device thread),
  and counted;
- batch sizes, queue waits and queue depth are exported per shard.
With batching off every query is its own call (the per-request path, kept for comparison).

Write policy (`WriteQueue`): writes queue in arrival order; the writer takes everything queued (up
to `max_group` writes) as one group commit, so concurrent writers share one BM25 commit and one
SQLite transaction, and a lone writer waits for nobody.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from server.core import metrics
from server.core.types import ShardQuery, ShardResult, ShardWrite, WriteOutcome
from server.errors import DeadlineExceeded, Unavailable, is_failure, is_panic, panic_as_corruption


@dataclass
class _Pending:
    query: Any
    future: asyncio.Future
    enqueued: float
    deadline: Optional[float]


class SearchScheduler:
    def __init__(self, run_group: Callable[[Sequence[ShardQuery]], list[ShardResult]],
                 device: Executor, labels: tuple[str, str], batching: bool = True,
                 max_batch: int = 64, dispatch_timeout_ms: float = 1.0, workers: int = 1,
                 burst_workers: int = 0):
        self.run_group = run_group
        self.device = device
        self.labels = labels
        self.batching = batching
        self.max_batch = max_batch if batching else 1
        self.dispatch_timeout = dispatch_timeout_ms / 1e3
        self.workers = max(1, workers)
        self.burst_workers = max(self.workers, burst_workers)
        self._depth = 0  # queries queued, not yet handed to the device
        self._groups: OrderedDict[tuple, deque[_Pending]] = OrderedDict()
        self._running = 0
        # the armed dispatch timer and the time it was armed for (uvloop's call_at answers a
        # plain Handle, without when(), for a time that rounds to now)
        self._timer: Optional[asyncio.Handle] = None
        self._timer_when = 0.0
        self._soon: Optional[asyncio.Handle] = None
        self._turn_over = False
        self._closing = False
        self._idle: Optional[asyncio.Event] = None
        self.batches = 0
        self.queries = 0
        # the metric children this scheduler writes, bound once (labels() costs ~4 us a call)
        self._m_depth = metrics.ENGINE_QUEUE_DEPTH.labels(*labels)
        self._m_wait = metrics.ENGINE_QUEUE_SECONDS.labels(*labels)
        self._m_batch = metrics.ENGINE_BATCH.labels(*labels)
        self._m_dropped = {r: metrics.ENGINE_DROPPED.labels(*labels, r) for r in ("deadline", "cancelled")}

    def submit(self, query: ShardQuery, deadline: Optional[float]) -> asyncio.Future:
        """Queue one query; the future resolves to its ShardResult (or the batch's error)."""
        return self.submit_many([query], deadline)[0]

    def submit_many(self, queries: Sequence[ShardQuery],
                    deadline: Optional[float]) -> list[asyncio.Future]:
        """Queue a message's queries, then dispatch: one future per query. Queued together, a
        message's queries of one restriction leave in full batches (queued one at a time, the
        first went alone to an idle shard: 1 + 64 + 63 for a chunk of 128)."""
        if self._closing:
            raise Unavailable("the shard is shutting down")
        loop = asyncio.get_running_loop()
        now = loop.time()
        futures = []
        for query in queries:
            p = _Pending(query, loop.create_future(), now, deadline)
            key = query.restriction if self.batching else (id(p),)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = deque()
            group.append(p)
            futures.append(p.future)
        self._depth += len(futures)
        self._pump()
        return futures

    def depth(self) -> int:
        return self._depth

    def _slots(self) -> int:
        """Batches allowed out now. While a full batch's worth waits (a backlog), every burst
        worker searches and has one more full batch queued behind its current one, so a device
        thread that finishes takes the next at once instead of idling until the event loop
        (perhaps busy assembling answers) hands it over. Only ready batches go (full, or due),
        and a query whose caller leaves while its batch waits in the pool is still left out of
        the index call (`_run`). A trickle keeps to `workers`, its batches filling meanwhile."""
        return 2 * self.burst_workers if self._depth >= self.max_batch else self.workers

    def _pump(self, at: float = 0.0) -> None:
        """Dispatch what is ready. `at`: the time a dispatch timer fired for - uvloop's clock
        counts whole milliseconds, so `loop.time()` in the timer's callback can read just under
        the time it was set for, and without this the group would re-arm a 0 ms timer until the
        millisecond ticked over."""
        loop = asyncio.get_running_loop()
        now = max(loop.time(), at)
        while self._groups and (not self.batching or self._running < self._slots()):
            key, group = next(iter(self._groups.items()))
            # the group's due time, computed as the timer is armed: `now - enqueued >= timeout`
            # can round to just under the timeout at the very time the timer fired for, and the
            # group would re-arm 0 ms timers until the clock moved on
            due = group[0].enqueued + self.dispatch_timeout
            ready = (not self.batching or self._running == 0 or len(group) >= self.max_batch
                     or now >= due or (self._turn_over and self._running < self.workers))
            if not ready:
                if self._running < self.workers:  # a thread is free: go once this turn's
                    if self._soon is None:        # arrivals have joined the group
                        self._soon = loop.call_soon(self._next_turn)
                else:
                    self._arm(due)
                break
            batch = []
            while group and len(batch) < self.max_batch:
                p = group.popleft()
                self._depth -= 1
                if self._alive(p, now):
                    batch.append(p)
            if not group:
                del self._groups[key]
            if batch:
                self._start(batch, loop, now)
        self._m_depth.set(self.depth())
        if self._idle is not None and not self._running and not self._groups:
            self._idle.set()  # close() waits for this (after the pump dropped what was dead)

    def _arm(self, when: float) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is not None and self._timer_when <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire, when)
        self._timer_when = when

    def _next_turn(self) -> None:
        """The loop turn after a query found a device thread free: what queued meanwhile goes."""
        self._soon = None
        self._turn_over = True
        try:
            self._pump()
        finally:
            self._turn_over = False

    def _fire(self, when: float) -> None:
        self._timer = None
        self._pump(when)

    def _alive(self, p: _Pending, now: float) -> bool:
        if p.deadline is not None and now >= p.deadline:
            self._m_dropped["deadline"].inc()
            if not p.future.done():
                p.future.set_exception(DeadlineExceeded("deadline passed while queued for the index"))
            return False
        if p.future.done():  # the caller went away (a cancelled request or a hedge's loser)
            self._m_dropped["cancelled"].inc()
            return False
        return True

    def _dropped_at_start(self, p: _Pending) -> None:
        if p.future.done():
            self._m_dropped["cancelled"].inc()
        else:  # left out on the device thread because its deadline had passed
            self._m_dropped["deadline"].inc()
            p.future.set_exception(DeadlineExceeded("deadline passed while queued for the index"))

    def _start(self, batch: list[_Pending], loop: asyncio.AbstractEventLoop, now: float) -> None:
        """Hand one batch to the device. No task per batch: the device thread's completion comes
        back as one loop callback (`_finish`) that answers every query of the batch."""
        self._running += 1
        for p in batch:
            self._m_wait.observe(now - p.enqueued)
        self._m_batch.observe(len(batch))
        self.batches += 1
        self.queries += len(batch)
        skew = loop.time() - time.monotonic()  # the loop's clock, read from the device thread
        try:
            done = self.device.submit(self._run, batch, skew)
        except RuntimeError:  # the device pool is shut down (the shard is closing)
            loop.call_soon(self._finish, batch, None,
                           Unavailable("the shard's device pool is shut down"))
            return
        def back_to_loop(f) -> None:  # on the device thread
            try:
                loop.call_soon_threadsafe(self._finish, batch, f, None)
            except RuntimeError:  # the loop is closed: nobody waits for these answers any more
                self._running -= 1

        done.add_done_callback(back_to_loop)

    def _run(self, batch: list[_Pending], skew: float) -> tuple[list[_Pending], list]:
        """On the device thread, as the batch starts: a batch queued behind a busy thread may
        hold queries whose caller went away or whose deadline passed meanwhile; they stay out of
        the index call too (`_finish` answers them). Returns (the queries searched, their results)."""
        now = time.monotonic() + skew
        live = [p for p in batch
                if not p.future.done() and (p.deadline is None or now < p.deadline)]
        return live, (self.run_group([p.query for p in live]) if live else [])

    def _finish(self, batch: list[_Pending], done, error: Optional[BaseException]) -> None:
        try:
            if error is None:
                error = (Unavailable("the shard's search was cancelled (shutting down)")
                         if done.cancelled() else done.exception())
            if error is None:
                searched, results = done.result()
                for p, r in zip(searched, results):
                    if not p.future.done():
                        p.future.set_result(r)
                if len(searched) < len(batch):
                    kept = {id(p) for p in searched}
                    for p in batch:
                        if id(p) not in kept:
                            self._dropped_at_start(p)
            else:  # the whole batch shares its failure
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(error)
        finally:
            self._running -= 1
            self._pump()

    async def close(self) -> None:
        """Refuse new queries; let queued and running ones finish."""
        self._closing = True
        if self._running or self._groups:
            self._idle = asyncio.Event()
            await self._idle.wait()
        if self._timer is not None:
            self._timer.cancel()
        if self._soon is not None:
            self._soon.cancel()


@dataclass
class _PendingWrites:
    writes: Sequence[ShardWrite]
    future: asyncio.Future


class WriteQueue:
    def __init__(self, apply: Callable[[Sequence[ShardWrite]], list[WriteOutcome]],
                 writer: Executor, labels: tuple[str, str], max_group: int = 256):
        self.apply = apply
        self.writer = writer
        self.labels = labels
        self.max_group = max_group
        self._queue: deque[_PendingWrites] = deque()
        self._busy = False
        self.groups = 0

    async def submit(self, writes: Sequence[ShardWrite]) -> list[WriteOutcome]:
        loop = asyncio.get_running_loop()
        p = _PendingWrites(list(writes), loop.create_future())
        self._queue.append(p)
        if not self._busy:
            self._busy = True
            loop.create_task(self._drain())
        # a write, once queued, is applied even if its caller goes away (it may already be in
        # the group being committed); shield it from the caller's cancellation
        return await asyncio.shield(p.future)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                group: list[_PendingWrites] = []
                n = 0
                while self._queue and (not group or n + len(self._queue[0].writes) <= self.max_group):
                    p = self._queue.popleft()
                    group.append(p)
                    n += len(p.writes)
                writes = [w for p in group for w in p.writes]
                metrics.WRITE_GROUP.labels(*self.labels).observe(len(writes))
                self.groups += 1
                try:
                    outcomes = await loop.run_in_executor(self.writer, self.apply, writes)
                except BaseException as exc:
                    if not is_failure(exc):
                        raise  # cancellation, exit: not the writes' answer
                    if is_panic(exc):  # tantivy's, on a damaged file: the writers hear at once
                        exc = panic_as_corruption(exc, "a write group in the BM25 index")
                    for p in group:
                        p.future.set_exception(exc)
                    continue
                i = 0
                for p in group:
                    p.future.set_result(outcomes[i:i + len(p.writes)])
                    i += len(p.writes)
        finally:
            self._busy = False

