"""Wire a router to its shard servers: one ReplicaSet of RemoteShards per shard.

The router needs no copy of the index files: it reads each shard's release descriptor over
ShardInfo and refuses to start unless every replica serves the same build of the same collection.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from server.core.collection import ReleaseDescriptor
from server.core.replicas import HedgePolicy, ReplicaSet
from server.core.search import LoadedCollection, SearchCore
from server.errors import FailedPrecondition, Unavailable
from server.transport.shard_rpc import RemoteShard


def load_topology(path: Path) -> tuple[str, list[list[str]]]:
    """{"collection": "cran", "shards": [["host:port", "host:port"], ...]} (index = shard number)."""
    data = json.loads(Path(path).read_text())
    shards = data.get("shards")
    if not isinstance(shards, list) or not shards or not all(isinstance(s, list) and s for s in shards):
        raise ValueError(f"{path}: 'shards' must be a non-empty list of non-empty address lists")
    return str(data["collection"]), [[str(a) for a in s] for s in shards]


async def connect_router(core: SearchCore, collection: str, shard_replicas: Sequence[Sequence[str]],
                         policy: HedgePolicy = HedgePolicy(), timeout: float = 30.0,
                         credentials=None) -> LoadedCollection:
    """`credentials`: grpc channel credentials for TLS to the shards (None: plaintext)."""
    sets, desc = [], None
    for shard_no, addresses in enumerate(shard_replicas):
        replicas = [RemoteShard(a, shard_no, credentials) for a in addresses]
        for r in replicas:
            try:
                info = await r.info(timeout)
            except Unavailable:
                continue  # a replica that is down now is still used once it is back
            d = ReleaseDescriptor.from_json(info.descriptor_json, Path(r.address))
            if info.shard != shard_no or d.collection != collection:
                raise FailedPrecondition(f"{r.address} serves shard {info.shard} of {d.collection!r}; "
                                         f"the topology puts it at shard {shard_no} of {collection!r}")
            if desc is None:
                desc = d
            elif (d.build_id, d.corpus_version) != (desc.build_id, desc.corpus_version):
                raise FailedPrecondition(f"{r.address} serves build {d.build_id}; other shards serve "
                                         f"{desc.build_id}: every shard must serve the same build")
        sets.append(ReplicaSet(shard_no, replicas, policy))
    if desc is None:
        raise Unavailable("no shard replica answered ShardInfo")
    if desc.shards != len(sets):
        raise FailedPrecondition(f"build {desc.build_id} has {desc.shards} shards; the topology "
                                 f"lists {len(sets)}")
    loaded = LoadedCollection(desc, sets)
    core.attach(loaded)
    return loaded
