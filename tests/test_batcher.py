"""The micro-batcher: concurrent requests share device calls; batches close on size, tokens and
wait; callers that are gone are dropped before the device call."""
import asyncio
import threading

import pytest

from server.core.batcher import MicroBatcher
from server.errors import DeadlineExceeded


class Device:
    """Records every call; can be held closed so requests pile up behind a running batch."""

    def __init__(self):
        self.calls: list[list] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, items):
        self.entered.set()
        self.gate.wait(10)
        self.calls.append(list(items))
        return [x * 2 for x in items]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_device_calls():
    dev = Device()

    async def main():
        b = MicroBatcher("t", dev, max_batch=64, max_tokens=10_000, max_wait_ms=50)
        out = await asyncio.gather(*(b.submit(i) for i in range(32)))
        await b.close()
        return out

    assert run(main()) == [i * 2 for i in range(32)]
    assert len(dev.calls) < 32 and sum(map(len, dev.calls)) == 32


def test_batch_closes_at_max_size():
    dev = Device()

    async def main():
        b = MicroBatcher("t", dev, max_batch=4, max_tokens=10_000, max_wait_ms=1000)
        await asyncio.gather(*(b.submit(i) for i in range(10)))
        await b.close()

    run(main())
    assert [len(c) for c in dev.calls] == [4, 4, 2]


def test_batch_closes_on_token_budget():
    dev = Device()

    async def main():
        b = MicroBatcher("t", dev, max_batch=100, max_tokens=10, max_wait_ms=1000)
        await asyncio.gather(*(b.submit(i, cost=4) for i in range(5)))
        await b.close()

    run(main())
    assert [len(c) for c in dev.calls] == [2, 2, 1]  # 4+4 fits in 10, a third would not


def test_batch_closes_after_max_wait_with_a_single_request():
    dev = Device()

    async def main():
        b = MicroBatcher("t", dev, max_batch=100, max_tokens=1000, max_wait_ms=5)
        r = await asyncio.wait_for(b.submit(21), timeout=5)
        await b.close()
        return r

    assert run(main()) == 42
    assert dev.calls == [[21]]


def test_cancelled_and_expired_requests_never_reach_the_device():
    dev = Device()

    async def main():
        loop = asyncio.get_running_loop()
        b = MicroBatcher("t", dev, max_batch=100, max_tokens=1000, max_wait_ms=0)
        dev.gate.clear()
        first = asyncio.ensure_future(b.submit(1))
        await loop.run_in_executor(None, dev.entered.wait, 10)  # batch [1] is on the device
        cancelled = asyncio.ensure_future(b.submit(2))
        expired = asyncio.ensure_future(b.submit(3, deadline=loop.time()))  # already due
        alive = asyncio.ensure_future(b.submit(4))
        await asyncio.sleep(0)  # let the submits enqueue
        cancelled.cancel()
        dev.gate.set()
        assert await first == 2
        assert await alive == 8
        with pytest.raises(DeadlineExceeded):
            await expired
        await b.close()
        return b.dropped

    dropped = run(main())
    assert dev.calls == [[1], [4]]
    assert dropped == 2


def test_model_errors_fail_the_batch_not_the_batcher():
    calls = []

    def flaky(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("device fell over")
        return items

    async def main():
        b = MicroBatcher("t", flaky, max_batch=1, max_tokens=1000, max_wait_ms=0)
        with pytest.raises(RuntimeError, match="fell over"):
            await b.submit("a")
        assert await b.submit("b") == "b"
        await b.close()

    run(main())


def test_an_input_the_model_fails_on_fails_alone_not_the_requests_batched_with_it():
    """Regression (outside QA): one bad input (a pair too long for the model) failed every
    request in its device batch, other callers' included. A failed batch now runs again one item
    at a time; only what fails alone fails."""
    calls = []

    def model(items):
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("input too long for the model")
        return [x.upper() for x in items]

    async def main():
        b = MicroBatcher("t", model, max_batch=8, max_tokens=1000, max_wait_ms=50)
        out = await asyncio.gather(*(b.submit(x) for x in ("a", "bad", "c")), return_exceptions=True)
        await b.close()
        return out

    a, bad, c = run(main())
    assert (a, c) == ("A", "C") and isinstance(bad, ValueError)
    assert calls[0] == ["a", "bad", "c"] and calls[1:] == [["a"], ["bad"], ["c"]]


def test_queries_go_before_queued_ingest_and_batches_never_mix_classes():
    dev = Device()

    async def main():
        loop = asyncio.get_running_loop()
        b = MicroBatcher("t", dev, max_batch=64, max_tokens=10_000, max_wait_ms=0,
                         max_background_batch=4)
        dev.gate.clear()
        first = asyncio.ensure_future(b.submit(0, background=True))
        await loop.run_in_executor(None, dev.entered.wait, 10)  # [0] holds the device
        ingest = [asyncio.ensure_future(b.submit(100 + i, background=True)) for i in range(10)]
        await asyncio.sleep(0)
        queries = [asyncio.ensure_future(b.submit(i)) for i in range(1, 4)]
        await asyncio.sleep(0)
        dev.gate.set()
        await asyncio.gather(first, *ingest, *queries)
        await b.close()

    run(main())
    assert dev.calls[0] == [0]
    assert dev.calls[1] == [1, 2, 3]  # the queries, although they arrived after the ingest
    assert all(len(c) <= 4 and all(x >= 100 for x in c) for c in dev.calls[2:])
    assert sum(len(c) for c in dev.calls) == 14


def test_requests_share_the_device_in_turn_not_in_arrival_order():
    """Regression (outside QA): one client's 1,024-query SearchBatch (or a 200-pair rerank)
    queued whole ahead of a single search that arrived after it, which waited ~4 s. Items of
    one request share a flow; batches take the flows' items in turn."""
    dev = Device()

    async def main():
        loop = asyncio.get_running_loop()
        b = MicroBatcher("t", dev, max_batch=4, max_tokens=10_000, max_wait_ms=0)
        dev.gate.clear()
        first = asyncio.ensure_future(b.submit(0))
        await loop.run_in_executor(None, dev.entered.wait, 10)  # [0] holds the device
        big, small = object(), object()
        bulk = [asyncio.ensure_future(b.submit(100 + i, flow=big)) for i in range(40)]
        await asyncio.sleep(0)
        single = asyncio.ensure_future(b.submit(7, flow=small))
        await asyncio.sleep(0)
        dev.gate.set()
        out = await asyncio.gather(first, *bulk, single)
        await b.close()
        return out

    out = run(main())
    assert out == [0, *[(100 + i) * 2 for i in range(40)], 14]
    assert dev.calls[0] == [0]
    assert dev.calls[1] == [100, 7, 101, 102]  # the single search's turn comes at once
    assert [x for c in dev.calls[2:] for x in c] == list(range(103, 140))  # the rest in order
