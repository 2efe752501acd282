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
from typing import Optional, Sequence

from server.core.types import FetchRequest, ShardQuery
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
    """The whole shard interface of the shard it wraps; searches and fetches may be delayed, fail
    or hang."""

    def __init__(self, inner, spec: FaultSpec):
        self.inner = inner
        self.spec = spec
        self.rng = random.Random(spec.seed)
        log.warning("FAULT INJECTION ON for shard %d: %s", inner.shard_no, spec)

    @property
    def shard_no(self) -> int:
        return self.inner.shard_no

    @property
    def desc(self):
        return self.inner.desc

    async def apply(self, writes, timeout: Optional[float] = None) -> list:
        return await self.inner.apply(writes, timeout)

    async def stored_versions(self, keys, timeout: Optional[float] = None):
        return await self.inner.stored_versions(keys, timeout)

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = None):
        return await self.inner.info(tenant, digest, timeout)

    async def close(self) -> None:
        await self.inner.close()

    @property
    def cache_version(self) -> Optional[int]:
        return self.inner.cache_version

    async def search(self, queries: Sequence[ShardQuery], timeout: Optional[float] = None) -> list:
        await self._maybe_fault()
        return await self.inner.search(queries, timeout)

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list:
        await self._maybe_fault()
        return await self.inner.fetch(request, timeout)

    async def _maybe_fault(self) -> None:
        s, r = self.spec, self.rng.random()
        if r < s.fail_prob:
            raise Unavailable(f"injected failure on shard {self.inner.shard_no}")
        r -= s.fail_prob
        if r < s.hang_prob:
            await asyncio.Event().wait()  # never set: hangs until the caller cancels
        r -= s.hang_prob
        if r < s.delay_prob:
            await asyncio.sleep(s.delay_ms / 1e3)
