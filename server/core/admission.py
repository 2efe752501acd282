"""Admission control: what a server refuses at once (RESOURCE_EXHAUSTED) instead of queueing.

Two budgets. Requests in flight (`--max-inflight`) bound every call - searches, batches, writes.
Queries of multi-query requests in flight (`--max-inflight-batched-queries`) bound batches by
what they cost: a SearchBatch of 1,024 queries is 1,024 searches' work, and counted as one
request it let a flood of batches queue ~60,000 queries behind which a single Search waited out
its deadline (outside QA). A single search is never refused by the second budget, so batches
cannot starve interactive traffic; a batch larger than the budget is still admitted when no
other batch is in flight.
"""
from __future__ import annotations

from contextlib import contextmanager

from server.core import metrics
from server.errors import Overloaded


class Admission:
    def __init__(self, max_requests: int, max_batched_queries: int):
        self.max_requests = max_requests
        self.max_batched_queries = max_batched_queries
        self.requests = 0
        self.batched_queries = 0

    @contextmanager
    def admit(self, queries: int = 1):
        """Hold one request's place (and a batch's queries) for the `with` block, or raise
        Overloaded. Runs on the event loop: no lock needed."""
        if self.requests >= self.max_requests:
            metrics.REJECTED.inc()
            raise Overloaded(f"{self.requests} requests in flight (limit {self.max_requests}); "
                             "retry with backoff")
        batched = queries if queries > 1 else 0
        if batched and self.batched_queries and self.batched_queries + batched > self.max_batched_queries:
            metrics.REJECTED.inc()
            raise Overloaded(f"{self.batched_queries} queries of batches in flight; this batch's "
                             f"{batched} would pass the limit of {self.max_batched_queries}. Retry "
                             "with backoff, or send smaller batches")
        self.requests += 1
        self.batched_queries += batched
        metrics.INFLIGHT.inc()
        metrics.INFLIGHT_BATCHED_QUERIES.inc(batched)
        try:
            yield
        finally:
            self.requests -= 1
            self.batched_queries -= batched
            metrics.INFLIGHT.dec()
            metrics.INFLIGHT_BATCHED_QUERIES.dec(batched)
