"""Dynamic micro-batching in front of a device model.

Policy: requests queue in arrival order; a batch closes when it holds `max_batch` items, when the
next item would push it past `max_tokens`, or `max_wait_ms` after its first item arrived, whichever
comes first. While a batch runs on the device the next one fills, so under load batches grow with
no extra wait. Items whose caller has gone (cancelled, or past its deadline) are dropped before the
device call and counted. One worker thread owns the device: batches run one at a time.

The handle is the whole interface: `await batcher.submit(item, cost, deadline)`.
"""
from __future__ import annotations

import asyncio
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


class MicroBatcher(Generic[T, R]):
    def __init__(self, name: str, fn: Callable[[Sequence[T]], Sequence[R]], max_batch: int = 32,
                 max_tokens: int = 8192, max_wait_ms: float = 2.0):
        if max_batch < 1 or max_tokens < 1 or max_wait_ms < 0:
            raise ValueError("max_batch and max_tokens must be >= 1 and max_wait_ms >= 0")
        self.name = name
        self.fn = fn
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_wait = max_wait_ms / 1e3
        self._queue: Optional[asyncio.Queue[_Pending]] = None
        self._worker: Optional[asyncio.Task] = None
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-device")
        self._carry: Optional[_Pending] = None
        self._closing = False
        self.batches = 0
        self.dropped = 0

    def start(self) -> None:
        if self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-batcher")

    async def submit(self, item: T, cost: int = 1, deadline: Optional[float] = None) -> R:
        """Queue one item; resolves to its result. `deadline` is in loop.time() seconds."""
        if self._closing:
            raise Unavailable(f"{self.name} batcher is shutting down")
        self.start()
        loop = asyncio.get_running_loop()
        pending = _Pending(item, max(1, min(cost, self.max_tokens)), deadline, loop.create_future(),
                           loop.time())
        self._queue.put_nowait(pending)
        metrics.QUEUE_DEPTH.labels(self.name).set(self._queue.qsize())
        return await pending.future

    def _alive(self, p: _Pending, now: float) -> bool:
        if p.future.done():  # the caller cancelled
            self.dropped += 1
            metrics.BATCH_DROPPED.labels(self.name, "cancelled").inc()
            return False
        if p.deadline is not None and now >= p.deadline:
            self.dropped += 1
            metrics.BATCH_DROPPED.labels(self.name, "deadline").inc()
            p.future.set_exception(DeadlineExceeded(f"deadline passed while queued for {self.name}"))
            return False
        return True

    async def _next_batch(self) -> Optional[list[_Pending]]:
        loop = asyncio.get_running_loop()
        first = self._carry or await self._queue.get()
        self._carry = None
        if first is _STOP:
            return None
        batch, tokens = [first], first.cost
        close_at = first.enqueued + self.max_wait
        while len(batch) < self.max_batch:
            try:
                p = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = close_at - loop.time()
                if remaining <= 0:
                    break
                try:
                    p = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    break
            if p is _STOP or tokens + p.cost > self.max_tokens:
                self._carry = p  # opens the next batch (or ends the worker after this one)
                break
            batch.append(p)
            tokens += p.cost
        now = loop.time()
        return [p for p in batch if self._alive(p, now)]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            metrics.QUEUE_DEPTH.labels(self.name).set(self._queue.qsize())
            if not batch:
                continue
            now = loop.time()
            for p in batch:
                metrics.STAGE_SECONDS.labels(f"{self.name}_queue").observe(now - p.enqueued)
            metrics.BATCH_SIZE.labels(self.name).observe(len(batch))
            self.batches += 1
            try:
                results = await loop.run_in_executor(self._device, self.fn, [p.item for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{self.name}: model returned {len(results)} results "
                                       f"for {len(batch)} inputs")
            except Exception as exc:  # the whole batch fails with the model's error
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            for p, r in zip(batch, results):
                if not p.future.done():
                    p.future.set_result(r)

    async def close(self) -> None:
        """Stop accepting, let queued work finish, then stop the worker."""
        self._closing = True
        if self._worker is not None:
            self._queue.put_nowait(_STOP)
            await self._worker
        self._device.shutdown(wait=True)
