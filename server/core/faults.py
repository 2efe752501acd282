"""Fault injection for tests and load tests only.

Reachable solely through the shard server's command-line flags (never a request field), off by
default, and loud in the log when on. Wraps a shard: some requests are delayed, fail with
UNAVAILABLE, or hang until the caller's deadline.
"""
from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Optional

from server.core.types import ShardQuery, ShardResult
from server.errors import Unavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    delay_prob: float = 0.0
    delay_ms: float = 0.0
    fail_prob: float = 0.0
    hang_prob: float = 0.0
    seed: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.delay_prob > 0 or self.fail_prob > 0 or self.hang_prob > 0

    def __post_init__(self):
        for name in ("delay_prob", "fail_prob", "hang_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")


class FaultyShard:
    """Same interface as the shard it wraps."""

    def __init__(self, inner, spec: FaultSpec):
        self.inner = inner
        self.spec = spec
        self.rng = random.Random(spec.seed)
        log.warning("FAULT INJECTION ON for shard %d: %s", inner.shard_no, spec)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def search(self, query: ShardQuery, timeout: Optional[float] = None) -> ShardResult:
        s, r = self.spec, self.rng.random()
        if r < s.fail_prob:
            raise Unavailable(f"injected failure on shard {self.inner.shard_no}")
        r -= s.fail_prob
        if r < s.hang_prob:
            await asyncio.Event().wait()  # never set: hangs until the caller cancels
        r -= s.hang_prob
        if r < s.delay_prob:
            await asyncio.sleep(s.delay_ms / 1e3)
        return await self.inner.search(query, timeout)
