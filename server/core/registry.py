"""The collections a process serves: name -> the build it serves and that build's shards.

A query resolves its collection once, so it sees one build even while a build switch swaps the
entry (server/core/builds.py). The shards are any kind (server/core/shard_api.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from server.core.collection import ReleaseDescriptor, check_name
from server.core.shard_api import Shard
from server.errors import FailedPrecondition, NotFound


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

    def get(self, name: str) -> LoadedCollection:
        check_name(name)
        loaded = self._by_name.get(name)
        if loaded is None:
            raise NotFound(f"collection {name!r} is not served here "
                           f"(serving: {sorted(self._by_name) or 'none'})")
        return loaded

    def put(self, loaded: LoadedCollection) -> None:
        if [s.shard_no for s in loaded.shards] != list(range(loaded.desc.shards)):
            raise FailedPrecondition(f"{loaded.name}: build {loaded.desc.build_id} has "
                                     f"{loaded.desc.shards} shards; got {len(loaded.shards)}")
        self._by_name[loaded.name] = loaded

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[LoadedCollection]:
        return iter(list(self._by_name.values()))
