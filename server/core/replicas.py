"""Fan-out policy: how the router reads one shard through its replica set.

Policy, in order:
1. **Rotation**: a replica serving another build than the router's (it answered "serves build X")
   is out of rotation until a re-read of its ShardInfo shows the router's build again; a replica
   whose calls time out, stall or fail UNAVAILABLE (it is down, refusing connections, or
   catching up; a call it shed as overloaded is retried elsewhere without counting against it)
   is ejected for a while (`eject_ms`, doubling on each ejection
   in a row up to `eject_max_ms`), then taken back on probation. When no replica is in rotation,
   all of them are tried rather than none.
2. **Pick**: among replicas in rotation, the lowest (outstanding calls + 1) x recent latency
   (an EWMA that also counts hedges a replica lost: a hung replica does not look idle just because
   its cancelled calls left), ties round-robin; replicas already tried for this request skipped.
   A replica's excess over the best replica's latency fades with `ewma_half_life_s` since its
   last answer, so one that was slow once is tried again and earns back its share, instead of
   going without traffic for as long as its sibling keeps up (which would halve capacity).
3. **Hedge**: if it has not answered after the hedge delay - this shard's recently observed p95
   latency, clamped to [hedge_min_ms, hedge_max_ms] - send the same request to a second replica.
   The first success wins; the other call is cancelled. Hedges are capped by a budget: every
   request earns `hedge_budget` tokens (default 0.10 = at most ~10% extra requests), a hedge spends
   one, and the bucket holds at most `hedge_burst` tokens. A request that finds the bucket empty
   looks again after each further delay (other requests refill it); a call with no answer after
   `stall_ms` (1 s) is stalled, and the second replica is tried without a token.
4. **Retry**: a replica that fails with UNAVAILABLE (down, refused, reset, overloaded) or serves
   another build is retried at once on the next untried replica, within the request's deadline;
   so is a call whose every query the replica answered UNAVAILABLE (a read-your-writes sequence
   it cannot confirm, a shutdown), without a strike against it.
5. **Fail fast**: INVALID_ARGUMENT, NOT_FOUND and other FAILED_PRECONDITIONs are the request's
   fault or the build's, the same on every replica: returned at once, never retried.
6. **Summarise**: when every replica failed, the error says how many and why, e.g.
   "shard 1: 2 of 2 replicas failed: 127.0.0.1:7001 UNAVAILABLE ...; 127.0.0.1:7002 ...".
Searches and FetchChunks follow the same policy; the deadline bounds everything: no call
outlives the caller's remaining budget.
"""
from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import numpy as np

from server.core import metrics
from server.core.shard_api import SHARD_INFO_TIMEOUT_S
from server.core.types import (Candidate, FetchRequest, ShardInfo, ShardQuery, ShardResult,
                               ShardWrite, StoredVersions, WriteOutcome)
from server.errors import (DeadlineExceeded, FailedPrecondition, ReplicaOverloaded, SearchError,
                           ShardUnreachable, Unavailable)

RETRYABLE = (Unavailable, DeadlineExceeded)
WRONG_BUILD = re.compile(r"serves build (\S+), not (\S+)")


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
    # a call without an answer this long is stalled, not slow: a second replica is tried even with
    # the budget spent (a retry of a call that looks dead, not a speculative hedge); without this a
    # lone request on a stalled replica, with no traffic to refill the bucket, waited out its deadline
    stall_ms: float = 1000.0
    quantile: float = 95.0
    window: int = 512
    eject_after: int = 3          # timeouts or lost hedges in a row that eject a replica
    eject_ms: float = 1000.0
    eject_max_ms: float = 30_000.0
    ewma_half_life_s: float = 1.0  # slow evidence fades when a replica has not answered since


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


@dataclass
class ReplicaHealth:
    ewma_ms: float = 1.0
    sampled_at: float = 0.0       # when ewma_ms last moved (monotonic s)
    strikes: int = 0              # timeouts / lost hedges in a row
    ejections: int = 0            # ejections in a row (reset by a success)
    ejected_until: float = 0.0
    ejected_down: bool = False    # ejected for failing at once (down), not for being slow
    other_build: Optional[str] = None

    def in_rotation(self, now: float) -> bool:
        return self.other_build is None and now >= self.ejected_until


class ReplicaSet:
    """One shard served by several replicas; implements the whole shard interface."""

    def __init__(self, shard_no: int, replicas: Sequence, policy: HedgePolicy = HedgePolicy(),
                 build_id: Optional[str] = None):
        if not replicas:
            raise ValueError(f"shard {shard_no} has no replicas")
        self.shard_no = shard_no
        self.replicas = list(replicas)
        self.policy = policy
        self.build_id = build_id
        self.outstanding = [0] * len(replicas)
        self.health = [ReplicaHealth() for _ in replicas]
        self.latency = LatencyWindow(policy)
        self._rr = itertools.count()
        self._clock = time.monotonic
        self._tokens = policy.hedge_burst
        self.stats = {"requests": 0, "hedges": 0, "hedges_won": 0, "retries": 0, "ejections": 0,
                      "stall_retries": 0}

    @property
    def cache_version(self) -> Optional[int]:
        return None

    def _name(self, i: int) -> str:
        return getattr(self.replicas[i], "address", str(i))

    # --- rotation ----------------------------------------------------------------------------
    def _pick(self, exclude: set[int]) -> Optional[int]:
        now = self._clock()
        untried = [i for i in range(len(self.replicas)) if i not in exclude]
        if not untried:
            return None
        rotation = [i for i in untried if self.health[i].in_rotation(now)]
        candidates = rotation or untried
        start = next(self._rr)
        n = len(self.replicas)
        best = min(self.health[i].ewma_ms for i in candidates)
        return min(candidates, key=lambda i: ((self.outstanding[i] + 1) * self._latency(i, now, best),
                                              (i - start) % n))

    def _latency(self, i: int, now: float, best: Optional[float] = None) -> float:
        """Replica i's recent latency, its excess over the best replica's faded by the time since
        it last answered (half-life `ewma_half_life_s`)."""
        h = self.health[i]
        if best is None:
            best = min(x.ewma_ms for x in self.health)
        age = max(0.0, now - h.sampled_at)
        return best + (h.ewma_ms - best) * 0.5 ** (age / self.policy.ewma_half_life_s)

    def _strike(self, i: int, elapsed_ms: Optional[float]) -> None:
        """A timeout, a first attempt a later hedge beat (slow evidence: `elapsed_ms`), or an
        UNAVAILABLE (None: a refused connection fails in microseconds, which must not read as a
        fast replica); ejection when repeated - unless that would leave no other replica in
        rotation. A replica that is down fails at once and so never has calls outstanding:
        without this it looked the least loaded and took a failing call before every retry."""
        h = self.health[i]
        now = self._clock()
        if elapsed_ms is not None:
            h.ewma_ms = 0.7 * self._latency(i, now) + 0.3 * elapsed_ms
            h.sampled_at = now
        h.strikes += 1
        others = [j for j in range(len(self.replicas)) if j != i and self.health[j].in_rotation(now)]
        if h.strikes >= self.policy.eject_after and others:
            ms = min(self.policy.eject_ms * 2 ** h.ejections, self.policy.eject_max_ms)
            h.ejected_until = now + ms / 1e3
            h.ejected_down = elapsed_ms is None
            h.ejections += 1
            h.strikes = 0
            self.stats["ejections"] += 1
            metrics.EJECTIONS.labels(str(self.shard_no), self._name(i)).inc()

    def _success(self, i: int, ms: Optional[float]) -> None:
        h = self.health[i]
        if ms is not None:
            now = self._clock()
            h.ewma_ms = 0.7 * self._latency(i, now) + 0.3 * ms
            h.sampled_at = now
        h.strikes = 0
        h.ejections = 0
        if h.ejected_down:
            # a replica that was down and answers again is back at once; one ejected for being
            # slow (stopped, overloaded) serves out its period: the answers that arrive first
            # are its backlog, and it is still slow while it works through it
            h.ejected_until, h.ejected_down = 0.0, False

    def mark_build(self, i: int, build_id: Optional[str], also_serves: Sequence[str] = ()) -> bool:
        """What replica i serves (from its answer or its ShardInfo): another build than the
        router's takes it out of rotation; the router's build puts it back, and so does a
        replica that flipped to a new build but still answers for the router's (`also_serves`,
        a grace period after an alias flip). Returns whether it is in rotation now."""
        serves = build_id is None or self.build_id in (build_id, *also_serves)
        self.health[i].other_build = None if serves else build_id
        return serves

    def out_of_rotation(self) -> list[int]:
        return [i for i, h in enumerate(self.health) if h.other_build is not None]

    # --- the hedged call ---------------------------------------------------------------------
    async def _call(self, i: int, op: Callable[[object, Optional[float]], Awaitable],
                    timeout: Optional[float], timed: bool = True):
        name = self._name(i)
        self.outstanding[i] += 1
        t0 = time.perf_counter()
        try:
            result = await op(self.replicas[i], timeout)
        except asyncio.CancelledError:
            # given up (a hedge answered first, or the request ended: its deadline, its caller
            # gone): the slow call's time must not vanish from the replica's view
            if timed:
                metrics.labelled(metrics.SHARD_ABANDONED_SECONDS, str(self.shard_no),
                                 name).observe(time.perf_counter() - t0)
            raise
        except asyncio.TimeoutError:
            self._strike(i, (time.perf_counter() - t0) * 1e3)
            metrics.SHARD_ERRORS.labels(str(self.shard_no), name, "DEADLINE_EXCEEDED").inc()
            raise DeadlineExceeded(f"{name} did not answer within the deadline")
        except SearchError as exc:
            if isinstance(exc, DeadlineExceeded):
                self._strike(i, (time.perf_counter() - t0) * 1e3)
            elif isinstance(exc, Unavailable) and not isinstance(exc, ReplicaOverloaded):
                self._strike(i, None)
            self._check_build(i, exc)
            metrics.SHARD_ERRORS.labels(str(self.shard_no), name, type(exc).__name__).inc()
            raise
        finally:
            self.outstanding[i] -= 1
        ms = (time.perf_counter() - t0) * 1e3
        self._success(i, ms if timed else None)
        if timed:
            self.latency.observe(ms)
            metrics.labelled(metrics.SHARD_SECONDS, str(self.shard_no), name).observe(ms / 1e3)
        return result

    def _check_build(self, i: int, exc: SearchError) -> bool:
        m = WRONG_BUILD.search(str(exc)) if isinstance(exc, FailedPrecondition) else None
        if m is None:
            return False
        self.mark_build(i, m.group(1))
        return True

    async def _hedged(self, op, timeout: Optional[float], check=None, first: Optional[int] = None,
                      timed: bool = True):
        """Run `op(replica, timeout)` under the policy above, starting with replica `first` when
        given. `check(i, result)` may raise a SearchError to reject a result (e.g. answers from
        another build). `timed=False` (a statistics round: no search) adds nothing to the hedge
        budget and no sample to the latencies searches are hedged and routed by."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if timed:
            self.stats["requests"] += 1
            self._tokens = min(self.policy.hedge_burst, self._tokens + self.policy.hedge_budget)
        tried: set[int] = set()
        running: dict[asyncio.Task, tuple[int, float]] = {}
        failures: list[str] = []
        timed_out = True  # so far, every failure was a replica's DeadlineExceeded
        hedged_index: Optional[int] = None

        def remaining() -> Optional[float]:
            return None if deadline is None else deadline - loop.time()

        def launch(i: Optional[int] = None) -> Optional[int]:
            i = self._pick(tried) if i is None else i
            if i is None:
                return None
            tried.add(i)
            running[asyncio.ensure_future(self._call(i, op, remaining(), timed))] = (i, time.perf_counter())
            return i

        launch(first)
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
                    # with the budget spent, look again after another delay: other requests
                    # refill it, and past `stall_ms` the call is taken as stalled and a second
                    # replica is tried anyway: it must not wait out its deadline
                    if not can_hedge:
                        continue
                    (_, started), = running.values()
                    if self._tokens >= 1.0:
                        self._tokens -= 1.0
                    elif (time.perf_counter() - started) * 1e3 >= self.policy.stall_ms:
                        self.stats["stall_retries"] += 1
                    else:
                        continue
                    hedged_index = launch()
                    self.stats["hedges"] += 1
                    metrics.labelled(metrics.HEDGES_SENT, str(self.shard_no)).inc()
                    continue
                for task in done:
                    i, _ = running.pop(task)
                    exc = task.exception()
                    if exc is None:
                        result = task.result()
                        try:
                            if check is not None:
                                check(i, result)
                        except SearchError as rejected:
                            exc = rejected
                        else:
                            if i == hedged_index:
                                self.stats["hedges_won"] += 1
                                metrics.labelled(metrics.HEDGES_WON, str(self.shard_no)).inc()
                                for j, t0 in running.values():  # the first attempt a later hedge
                                    if j != hedged_index:       # beat: slow evidence against it
                                        self._strike(j, (time.perf_counter() - t0) * 1e3)
                            return result
                    retry = isinstance(exc, RETRYABLE) or (isinstance(exc, FailedPrecondition)
                                                           and self._check_build(i, exc))
                    if not retry:
                        raise exc  # the request's fault, the same on every replica
                    failures.append(f"{self._name(i)} {type(exc).__name__}: {exc}")
                    timed_out = timed_out and isinstance(exc, DeadlineExceeded)
                    if not running and launch() is not None:
                        self.stats["retries"] += 1
                        metrics.RETRIES.labels(str(self.shard_no)).inc()
            left = remaining()
            # every replica ran out of time (a replica's own deadline can beat this loop's
            # timer): the caller hears DEADLINE_EXCEEDED, not UNAVAILABLE's "retry" (review)
            error = (DeadlineExceeded if failures and (timed_out or (left is not None and left <= 0))
                     else Unavailable)
            raise error(f"shard {self.shard_no}: {len(failures)} of {len(self.replicas)} "
                        f"replicas failed: {'; '.join(failures)}")
        finally:
            for task in running:
                task.cancel()  # the loser of a hedge, or calls outliving a failure

    # --- the shard interface -----------------------------------------------------------------
    async def search(self, queries: Sequence[ShardQuery], timeout: Optional[float] = None) -> list:
        """Answers stamped with the replica that gave them. Queries pinned to one replica (a
        follow-up round: ShardQuery.replica) go to it first, under the usual policy otherwise
        (hedged after the delay, retried elsewhere on failure); the caller compares the answers'
        data with the first round's before it mixes them."""
        def check(i, answers):
            for a in answers:  # a replica of another build refuses every query of the batch
                if isinstance(a, FailedPrecondition) and self._check_build(i, a):
                    raise a
            # a replica that cannot answer any of them now (it has not applied a write the
            # caller asked to read and cannot ask the write log where its own entries are; it is
            # shutting down) says so per query: another replica may answer them, so the batch is
            # tried there - without a strike, since the replica answered. Where some queries did
            # answer, they are kept with the others' errors
            if answers and all(isinstance(a, Unavailable) and not isinstance(a, ReplicaOverloaded)
                               for a in answers):
                raise answers[0]
            for a in answers:
                if isinstance(a, ShardResult):
                    a.replica = self._name(i)

        pinned = {q.replica for q in queries}
        first = self._index_of(pinned.pop() if len(pinned) == 1 else "")
        return await self._hedged(lambda r, t: r.search(queries, t), timeout, check, first=first,
                                  timed=not all(q.stats_only for q in queries))

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list[Candidate]:
        """From the replica that ranked the rows (FetchRequest.replica) first, under the usual
        policy otherwise; the caller checks that each row still holds the chunk it ranked."""
        return await self._hedged(lambda r, t: r.fetch(request, t), timeout,
                                  first=self._index_of(request.replica))

    def _index_of(self, name: str) -> Optional[int]:
        """The replica of that name (a pinned round's), or None: the policy picks."""
        return next((j for j in range(len(self.replicas)) if name and self._name(j) == name), None)

    async def apply(self, writes: Sequence[ShardWrite],
                    timeout: Optional[float] = None) -> list[WriteOutcome]:
        """Direct writes go to every replica (replicated writes normally travel through the write
        log instead); an error if any replica failed - writes are idempotent, so retry."""
        results = await asyncio.gather(*(r.apply(writes, timeout) for r in self.replicas),
                                       return_exceptions=True)
        failed = [f"{self._name(i)}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            raise Unavailable(f"shard {self.shard_no}: {len(failed)} of {len(self.replicas)} replicas "
                              f"did not apply the writes: {'; '.join(failed)}")
        return results[0]

    async def stored_versions(self, keys: Sequence[tuple[str, str]],
                              timeout: Optional[float] = None) -> StoredVersions:
        """None known: a replica set's writes travel through the write log, whose retries must
        be answered as the log answers them, not from a replica's state."""
        return StoredVersions({}, 0)

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = SHARD_INFO_TIMEOUT_S) -> ShardInfo:
        """Every replica's own ShardInfo (in `replicas`), headed by the first that answered."""
        answers = await asyncio.gather(*(r.info(tenant, digest, timeout) for r in self.replicas),
                                       return_exceptions=True)
        infos = []
        for i, a in enumerate(answers):
            if isinstance(a, BaseException):
                infos.append(ShardInfo(self.shard_no, "", "", "", "", 0, 0, 0, 0, 0,
                                       state="unreachable", address=self._name(i)))
            else:
                if not self.mark_build(i, a.build_id, a.also_serves) and self.build_id is not None:
                    a.state = "other_build"
                infos.append(a)
        ok = [x for x in infos if x.state not in ("unreachable", "other_build")]
        if not ok:
            raise ShardUnreachable(f"shard {self.shard_no}: no replica of build {self.build_id} "
                                   f"answered ShardInfo", infos)
        head = ok[0]
        return ShardInfo(head.shard_no, head.collection, head.build_id, head.corpus_version,
                         head.model_id, head.index_version, head.applied_seq, head.documents,
                         head.chunks, head.vectors, head.descriptor_json, head.live_digest,
                         head.state, head.tombstone_ratio, head.address, infos)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas))
