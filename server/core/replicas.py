"""Fan-out policy: how the router reads one shard through its replica set.

Policy, in order:
1. **Pick** the replica with the fewest outstanding requests (ties go round-robin), skipping replicas
   already tried for this request.
2. **Hedge**: if it has not answered after the hedge delay — this shard's recently observed p95
   latency, clamped to [hedge_min_ms, hedge_max_ms] — send the same request to a second replica. The
   first success wins; the other call is cancelled. Hedges are capped by a budget: every request
   earns `hedge_budget` tokens (default 0.10 = at most ~10% extra requests), a hedge spends one,
   and the bucket holds at most `hedge_burst` tokens.
3. **Retry**: a replica that fails with UNAVAILABLE (down, refused, reset) is retried at once on the
   next untried replica, within the request's deadline.
4. **Fail fast**: INVALID_ARGUMENT, NOT_FOUND and FAILED_PRECONDITION are the request's fault or the
   build's, the same on every replica: returned at once, never retried.
5. **Summarise**: when every replica failed, the error says how many and why, e.g.
   "shard 1: 2 of 2 replicas failed: 127.0.0.1:7001 UNAVAILABLE ...; 127.0.0.1:7002 ...".
The deadline bounds everything: no call outlives the caller's remaining budget.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from server.core import metrics
from server.core.types import ShardQuery, ShardResult
from server.errors import DeadlineExceeded, SearchError, Unavailable

RETRYABLE = (Unavailable,)


@dataclass(frozen=True)
class HedgePolicy:
    enabled: bool = True
    hedge_min_ms: float = 2.0
    hedge_max_ms: float = 200.0
    # Hedging at the shard's p95 means ~5% of requests reach the hedge delay by definition, so the
    # budget must sit above 5% or stragglers arriving with an empty bucket go unhedged
    # (measured: bench/bench_hedging.py, docs/BENCHMARKS.md).
    hedge_budget: float = 0.10
    hedge_burst: float = 10.0
    quantile: float = 95.0
    window: int = 512


class LatencyWindow:
    """Recent successful call latencies of one shard; the hedge delay is their quantile."""

    def __init__(self, policy: HedgePolicy):
        self.policy = policy
        self._xs: deque[float] = deque(maxlen=policy.window)
        self._cached: Optional[float] = None
        self._since = 0

    def observe(self, ms: float) -> None:
        self._xs.append(ms)
        self._since += 1
        if self._since >= 16:
            self._cached = None

    def hedge_delay_ms(self) -> float:
        p = self.policy
        if len(self._xs) < 20:  # too few samples: hedge late rather than double the load
            return p.hedge_max_ms
        if self._cached is None:
            self._cached = float(np.percentile(np.fromiter(self._xs, float), p.quantile))
            self._since = 0
        return min(max(self._cached, p.hedge_min_ms), p.hedge_max_ms)


class ReplicaSet:
    """One shard served by several replicas; answers the same `search` as a single shard."""

    def __init__(self, shard_no: int, replicas: Sequence, policy: HedgePolicy = HedgePolicy()):
        if not replicas:
            raise ValueError(f"shard {shard_no} has no replicas")
        self.shard_no = shard_no
        self.replicas = list(replicas)
        self.policy = policy
        self.outstanding = [0] * len(replicas)
        self.latency = LatencyWindow(policy)
        self._rr = itertools.count()
        self._tokens = policy.hedge_burst
        self.stats = {"requests": 0, "hedges": 0, "hedges_won": 0, "retries": 0}

    def _pick(self, exclude: set[int]) -> Optional[int]:
        candidates = [i for i in range(len(self.replicas)) if i not in exclude]
        if not candidates:
            return None
        start = next(self._rr)
        candidates.sort(key=lambda i: (self.outstanding[i], (i - start) % len(self.replicas)))
        return candidates[0]

    def _take_hedge_token(self) -> bool:
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    async def _call(self, i: int, query: ShardQuery, timeout: Optional[float]) -> ShardResult:
        replica = self.replicas[i]
        name = getattr(replica, "address", str(i))
        self.outstanding[i] += 1
        t0 = time.perf_counter()
        try:
            result = await replica.search(query, timeout)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            metrics.SHARD_ERRORS.labels(str(self.shard_no), name, "DEADLINE_EXCEEDED").inc()
            raise DeadlineExceeded(f"{name} did not answer within the deadline")
        except SearchError as exc:
            metrics.SHARD_ERRORS.labels(str(self.shard_no), name, type(exc).__name__).inc()
            raise
        finally:
            self.outstanding[i] -= 1
        ms = (time.perf_counter() - t0) * 1e3
        self.latency.observe(ms)
        metrics.SHARD_SECONDS.labels(str(self.shard_no), name).observe(ms / 1e3)
        return result

    async def search(self, query: ShardQuery, timeout: Optional[float] = None) -> ShardResult:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self.stats["requests"] += 1
        self._tokens = min(self.policy.hedge_burst, self._tokens + self.policy.hedge_budget)
        tried: set[int] = set()
        running: dict[asyncio.Task, int] = {}
        failures: list[str] = []
        hedged_index: Optional[int] = None

        def remaining() -> Optional[float]:
            return None if deadline is None else deadline - loop.time()

        def launch(exclude: set[int]) -> Optional[int]:
            i = self._pick(exclude)
            if i is None:
                return None
            tried.add(i)
            running[asyncio.ensure_future(self._call(i, query, remaining()))] = i
            return i

        launch(tried)
        try:
            while running:
                left = remaining()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(f"shard {self.shard_no}: deadline passed "
                                           f"({len(tried)} replica(s) tried)")
                wait_for = left
                can_hedge = (self.policy.enabled and hedged_index is None and len(running) == 1
                             and len(tried) < len(self.replicas))
                if can_hedge:
                    delay = self.latency.hedge_delay_ms() / 1e3
                    wait_for = delay if left is None else min(delay, left)
                done, _ = await asyncio.wait(running, timeout=wait_for,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    if can_hedge and self._take_hedge_token():
                        hedged_index = launch(tried)
                        self.stats["hedges"] += 1
                        metrics.HEDGES_SENT.labels(str(self.shard_no)).inc()
                    elif can_hedge:
                        hedged_index = -1  # budget spent: no hedge for this request
                    continue
                for task in done:
                    i = running.pop(task)
                    exc = task.exception()
                    if exc is None:
                        if i == hedged_index:
                            self.stats["hedges_won"] += 1
                            metrics.HEDGES_WON.labels(str(self.shard_no)).inc()
                        return task.result()
                    name = getattr(self.replicas[i], "address", str(i))
                    if not isinstance(exc, RETRYABLE):
                        raise exc  # the request's fault, or the deadline: same on every replica
                    failures.append(f"{name} {type(exc).__name__}: {exc}")
                    if not running and launch(tried) is not None:
                        self.stats["retries"] += 1
                        metrics.RETRIES.labels(str(self.shard_no)).inc()
            raise Unavailable(f"shard {self.shard_no}: {len(failures)} of {len(self.replicas)} "
                              f"replicas failed: {'; '.join(failures)}")
        finally:
            for task in running:
                task.cancel()  # the loser of a hedge, or calls outliving a failure

    async def fetch_chunks(self, build_id, tenant, acl_scopes, rows, timeout=None):
        """A small follow-up read: least-outstanding replica first, the next one on UNAVAILABLE."""
        tried: set[int] = set()
        failures = []
        while True:
            i = self._pick(tried)
            if i is None:
                raise Unavailable(f"shard {self.shard_no}: fetch failed on every replica: "
                                  f"{'; '.join(failures)}")
            tried.add(i)
            try:
                return await self.replicas[i].fetch_chunks(build_id, tenant, acl_scopes, rows, timeout)
            except RETRYABLE as exc:
                failures.append(str(exc))

    async def close(self) -> None:
        for r in self.replicas:
            close = getattr(r, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
