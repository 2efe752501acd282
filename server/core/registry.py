"""The collections a process serves: name -> the build it serves and that build's shards.

A query resolves its collection once, so it sees one build even while a build switch swaps the
entry (server/core/builds.py). The shards are any kind (server/core/shard_api.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from server.core import metrics
from server.core.collection import ReleaseDescriptor, check_name
from server.core.shard_api import Shard
from server.errors import FailedPrecondition, NotFound, Unavailable


@dataclass
class LoadedCollection:
    desc: ReleaseDescriptor
    shards: list[Shard]
    # whether writes may go to the shards directly: yes where one engine owns each shard (this
    # process, or an engine process of this host); no for replica sets, whose replicas take
    # writes only through the replicated write log, in one order
    direct_writes: bool = True

    @property
    def name(self) -> str:
        return self.desc.collection


class CollectionRegistry:
    def __init__(self):
        self._by_name: dict[str, LoadedCollection] = {}
        # collections this process should serve but whose live build failed to load: their
        # callers hear why (UNAVAILABLE), not that the collection does not exist
        self._unloadable: dict[str, str] = {}

    def get(self, name: str) -> LoadedCollection:
        check_name(name)
        loaded = self._by_name.get(name)
        if loaded is None:
            why = self._unloadable.get(name)
            if why is not None:
                raise Unavailable(f"collection {name!r} is not serving: {why}")
            # not the names of those served: any caller, of any tenant, gets this answer, and
            # collections are how tenants that must share nothing are kept apart (outside QA)
            raise NotFound(f"collection {name!r} is not served here (AdminService."
                           f"ListCollections, with the admin role, names those that are)")
        return loaded

    def put(self, loaded: LoadedCollection) -> None:
        if [s.shard_no for s in loaded.shards] != list(range(loaded.desc.shards)):
            raise FailedPrecondition(f"{loaded.name}: build {loaded.desc.build_id} has "
                                     f"{loaded.desc.shards} shards; got {len(loaded.shards)}")
        self._by_name[loaded.name] = loaded
        self._unloadable.pop(loaded.name, None)
        for shard in loaded.shards:  # each shard's fault counters exported from the start, at
            # 0: an alert on their increase sees 0, not "no data" (outside QA)
            for counter in (metrics.FETCH_MISMATCHES, metrics.LEXICAL_REPAIRS):
                counter.labels(loaded.name, str(shard.shard_no))

    def mark_unloadable(self, name: str, why: str) -> None:
        """`name` is not served (its entry, if any, is dropped); `get` answers UNAVAILABLE with
        `why` until a build of it is put."""
        self._by_name.pop(name, None)
        self._unloadable[name] = why

    def unloadable(self) -> dict[str, str]:
        return dict(self._unloadable)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[LoadedCollection]:
        return iter(list(self._by_name.values()))
