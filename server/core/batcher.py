"""Dynamic micro-batching in front of a device model.

Policy: requests queue in two classes, interactive (queries) and background (document ingest).
Interactive items queue per flow (one search request: a Search or a whole SearchBatch, with every
embedding and rerank pair it asks for), and batches take the flows' items in turn, one each, so a
request of 1,024 queries or 200 rerank pairs shares the device with a single search that arrives
behind it instead of running ahead of it whole (outside QA: one client looping on 1,024-query
batches made others' single searches wait ~4 s). Background items queue in arrival order. A batch
holds one class only, interactive first whenever any is waiting, so a query never pads to a
256-token document chunk nor waits behind more than one small background batch
(`max_background_batch`). A batch closes when it holds `max_batch` items, when the next item
would push it past `max_tokens`, or `max_wait_ms` after its first item arrived, whichever comes
first. While a batch runs on the device the next one fills, so under load batches grow with no
extra wait. Items whose caller has gone (cancelled, or past its deadline) are dropped before the
device call and counted. One worker thread owns the device: batches run one at a time. A batch the
model fails is run again one item at a time, so only the items that fail alone fail (a bad input
never fails the requests batched with it).

The handle is the whole interface: `await batcher.submit(item, cost, deadline, background)`.
"""
from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, Sequence, TypeVar

from server.core import metrics
from server.errors import DeadlineExceeded, Unavailable

_STOP = object()  # queued by close(): everything before it is still served
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending:
    item: Any
    cost: int
    deadline: Optional[float]  # loop.time() seconds
    future: asyncio.Future
    enqueued: float
    background: bool = False
    flow: Any = None  # the request it belongs to (interactive items share the device by flow)


@dataclass
class _Failed:
    error: Exception


class _FairQueue:
    """Items by flow, taken round-robin: one from each flow in turn, flows in the order they
    first arrived. `appendleft` puts an item back to be taken next (a batch that it did not fit
    closes; it opens the next one)."""

    def __init__(self):
        self._flows: dict = {}
        self._front: list = []
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, p) -> None:
        self._flows.setdefault(p.flow, deque()).append(p)
        self._n += 1

    def appendleft(self, p) -> None:
        self._front.append(p)
        self._n += 1

    def popleft(self):
        self._n -= 1
        if self._front:
            return self._front.pop()
        flow = next(iter(self._flows))
        items = self._flows.pop(flow)
        p = items.popleft()
        if items:
            self._flows[flow] = items  # to the back of the round
        return p


class MicroBatcher(Generic[T, R]):
    def __init__(self, name: str, fn: Callable[[Sequence[T]], Sequence[R]], max_batch: int = 32,
                 max_tokens: int = 8192, max_wait_ms: float = 2.0, max_background_batch: int = 8):
        if max_batch < 1 or max_tokens < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_tokens must be >= 1 and max_wait_ms >= 0")
        self.name = name
        self.fn = fn
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_wait = max_wait_ms / 1e3
        self.max_background_batch = max(1, min(max_background_batch, max_batch))
        self._queues: Optional[tuple[_FairQueue, deque]] = None  # (interactive, background)
        self._arrived: Optional[asyncio.Event] = None
        self._worker: Optional[asyncio.Task] = None
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-device")
        self._closing = False
        self.batches = 0
        self.dropped = 0

    def start(self) -> None:
        if self._worker is None:
            self._queues = (_FairQueue(), deque())
            self._arrived = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-batcher")

    def _depth(self) -> int:
        return len(self._queues[0]) + len(self._queues[1])

    def _put(self, p) -> None:
        self._queues[1 if p is _STOP or p.background else 0].append(p)
        self._arrived.set()

    async def submit(self, item: T, cost: int = 1, deadline: Optional[float] = None,
                     background: bool = False, flow: Any = None) -> R:
        """Queue one item; resolves to its result. `deadline` is in loop.time() seconds;
        `background` marks work (ingest) that must not delay interactive queries; `flow` names
        the request an interactive item belongs to (None: a flow of its own)."""
        if self._closing:
            raise Unavailable(f"{self.name} batcher is shutting down")
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = _Pending(item, max(1, min(cost, self.max_tokens)), deadline, future,
                           loop.time(), background, future if flow is None else flow)
        self._put(pending)
        metrics.labelled(metrics.QUEUE_DEPTH, self.name).set(self._depth())
        return await pending.future

    def _alive(self, p: _Pending, now: float) -> bool:
        if p.future.done():  # the caller cancelled
            self.dropped += 1
            metrics.labelled(metrics.BATCH_DROPPED, self.name, "cancelled").inc()
            return False
        if p.deadline is not None and now >= p.deadline:
            self.dropped += 1
            metrics.labelled(metrics.BATCH_DROPPED, self.name, "deadline").inc()
            p.future.set_exception(DeadlineExceeded(f"deadline passed while queued for {self.name}"))
            return False
        return True

    async def _take(self, klass: Optional[int], until: Optional[float]):
        """Next item of `klass` (None: interactive first, else background), waiting until `until`
        (loop time; None = forever). Returns None on timeout."""
        loop = asyncio.get_running_loop()
        while True:
            for k in ((0, 1) if klass is None else (klass,)):
                if self._queues[k]:
                    return self._queues[k].popleft()
            if klass == 0 and self._queues[1] and self._queues[1][0] is _STOP:
                return None  # shutting down: close this batch
            self._arrived.clear()
            if until is None:
                await self._arrived.wait()
                continue
            remaining = until - loop.time()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return None

    async def _next_batch(self) -> Optional[list[_Pending]]:
        loop = asyncio.get_running_loop()
        first = await self._take(None, None)
        if first is _STOP:
            return None
        klass = 1 if first.background else 0
        limit = self.max_background_batch if first.background else self.max_batch
        batch, tokens = [first], first.cost
        close_at = first.enqueued + self.max_wait
        while len(batch) < limit:
            if klass == 1 and self._queues[0]:
                break  # a query arrived: let it go next
            p = self._take_nowait(klass)
            if p is None:
                p = await self._take(klass, close_at)
            if p is None:
                break
            if p is _STOP or tokens + p.cost > self.max_tokens:
                self._queues[klass].appendleft(p)  # opens the next batch (or ends the worker)
                break
            batch.append(p)
            tokens += p.cost
        now = loop.time()
        return [p for p in batch if self._alive(p, now)]

    def _take_nowait(self, klass: int):
        q = self._queues[klass]
        return q.popleft() if q else None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            metrics.labelled(metrics.QUEUE_DEPTH, self.name).set(self._depth())
            if not batch:
                continue
            now = loop.time()
            for p in batch:
                metrics.labelled(metrics.STAGE_SECONDS, f"{self.name}_queue").observe(now - p.enqueued)
            metrics.labelled(metrics.BATCH_SIZE, self.name).observe(len(batch))
            self.batches += 1
            try:
                results = await loop.run_in_executor(self._device, self._call, batch)
            except Exception as exc:
                if len(batch) == 1:
                    if not batch[0].future.done():
                        batch[0].future.set_exception(exc)
                    continue
                # one bad input must not fail the requests batched with it (other callers'):
                # each item runs alone, and only the ones that fail alone fail
                results = await loop.run_in_executor(self._device, self._each_alone, batch)
            for p, r in zip(batch, results):
                if p.future.done():
                    continue
                if isinstance(r, _Failed):
                    p.future.set_exception(r.error)
                else:
                    p.future.set_result(r)

    def _call(self, batch: list[_Pending]) -> Sequence:
        results = self.fn([p.item for p in batch])
        if len(results) != len(batch):
            raise RuntimeError(f"{self.name}: model returned {len(results)} results "
                               f"for {len(batch)} inputs")
        return results

    def _each_alone(self, batch: list[_Pending]) -> list:
        out = []
        for p in batch:
            if p.future.done():  # its caller has gone meanwhile: no device time for it
                out.append(None)
                continue
            try:
                out.append(self._call([p])[0])
            except Exception as exc:
                out.append(_Failed(exc))
        return out

    async def close(self) -> None:
        """Stop accepting, let queued work finish, then stop the worker."""
        self._closing = True
        if self._worker is not None:
            self._put(_STOP)
            await self._worker
        self._device.shutdown(wait=True)
