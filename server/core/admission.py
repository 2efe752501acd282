"""Admission control: what a server refuses at once (RESOURCE_EXHAUSTED) instead of queueing.

Two budgets. Requests in flight (`--max-inflight`) bound searches and batches; writes have a
budget of that size of their own (a write waiting on a slow log must not take a search's place).
Queries of multi-query requests in flight (`--max-inflight-batched-queries`) bound batches by
what they cost: a SearchBatch of 1,024 queries is 1,024 searches' work, and counted as one
request it let a flood of batches queue ~60,000 queries behind which a single Search waited out
its deadline (outside QA). A single search is never refused by the second budget, so batches
cannot starve interactive traffic; a batch larger than the budget is still admitted when no
other batch is in flight.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

from server.core import metrics
from server.errors import Overloaded


class Admission:
    """`max_requests` bounds searches and batches (None: no bound); writes have a budget of the
    same size of their own, so writes waiting on a slow log never take a search's place.
    `count_singles`: every request's queries count against `max_batched_queries` (a shard
    server, whose callers are routers: there one budget of queries fits a router at its own
    limits however it cuts its batches into messages)."""

    def __init__(self, max_requests: Optional[int], max_batched_queries: int,
                 count_singles: bool = False, what: str = ""):
        self.max_requests = max_requests
        self.max_batched_queries = max_batched_queries
        self.count_singles = count_singles
        self.what = what
        self.requests = 0
        self.writes = 0
        self.batched_queries = 0

    def _refuse(self, why: str) -> None:
        metrics.REJECTED.inc()
        raise Overloaded(f"{self.what}{why}; retry with backoff")

    @contextmanager
    def admit(self, queries: int = 1, write: bool = False):
        """Hold one request's place (and a batch's queries) for the `with` block, or raise
        Overloaded. Runs on the event loop: no lock needed."""
        held = self.writes if write else self.requests
        if self.max_requests is not None and held >= self.max_requests:
            self._refuse(f"{held} {'writes' if write else 'requests'} in flight (limit "
                         f"{self.max_requests})")
        batched = queries if queries > 1 or self.count_singles else 0
        if batched and self.batched_queries and self.batched_queries + batched > self.max_batched_queries:
            self._refuse(f"{self.batched_queries} queries of batches in flight; these {batched} "
                         f"would pass the limit of {self.max_batched_queries} (send smaller "
                         "batches)")
        if write:
            self.writes += 1
        else:
            self.requests += 1
        self.batched_queries += batched
        metrics.INFLIGHT.inc()
        metrics.INFLIGHT_BATCHED_QUERIES.inc(batched)
        try:
            yield
        finally:
            if write:
                self.writes -= 1
            else:
                self.requests -= 1
            self.batched_queries -= batched
            metrics.INFLIGHT.dec()
            metrics.INFLIGHT_BATCHED_QUERIES.dec(batched)
