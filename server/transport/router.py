"""Wire a router to its shard servers: one ReplicaSet of RemoteShards per shard, and keep it on
the build its replicas serve.

The router needs no copy of the index files: it reads each replica's release descriptor over
ShardInfo. At start it serves the build most replicas serve (the newest on a tie); replicas on
another build are out of rotation - but not one that flipped to a new build and still answers
for the router's (its ShardInfo `also_serves` it for a grace period). `follow_builds` re-reads
every replica's ShardInfo and moves the router to a published build once every replica that
answers serves it (at least one per shard: a replica that is down does not hold the router back),
and puts replicas that came back to the router's build into rotation again.
Both also check that the write log ends at or after every replica's applied position
(`check_write_log`): a stream that lost its entries takes no writes.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from server.core.collection import ReleaseDescriptor
from server.core.registry import LoadedCollection
from server.core.replicas import HedgePolicy, ReplicaSet
from server.core.service import SearchCore
from server.errors import FailedPrecondition, SearchError, Unavailable
from server.transport.shard_rpc import RemoteShard

log = logging.getLogger(__name__)


def load_topology(path: Path) -> tuple[str, list[list[str]]]:
    """{"collection": "cran", "shards": [["host:port", "host:port"], ...]} (index = shard number)."""
    data = json.loads(Path(path).read_text())
    shards = data.get("shards")
    if not isinstance(shards, list) or not shards or not all(isinstance(s, list) and s for s in shards):
        raise ValueError(f"{path}: 'shards' must be a non-empty list of non-empty address lists")
    return str(data["collection"]), [[str(a) for a in s] for s in shards]


async def _read_infos(sets: Sequence[ReplicaSet], timeout: float, wait: bool,
                      failures: Optional[list] = None) -> list[list]:
    """Every replica's ShardInfo (None where it failed; why, in `failures` when given)."""
    async def one(r):
        try:
            return await r.info(timeout=timeout, wait=wait)
        except SearchError as exc:
            if failures is not None:
                where = str(getattr(r, "address", r))
                failures.append(str(exc) if str(exc).startswith(where) else f"{where}: {exc}")
            return None  # a replica that is down now is used once it is back

    # every replica of every shard at once: one wait bounds them all (review: one shard after
    # another made a start wait shards x --shards-wait-s)
    flat = await asyncio.gather(*(one(r) for rs in sets for r in rs.replicas))
    out, i = [], 0
    for rs in sets:
        out.append(list(flat[i:i + len(rs.replicas)]))
        i += len(rs.replicas)
    return out


def _choose_build(infos: list[list]) -> Optional[ReleaseDescriptor]:
    votes: Counter = Counter()
    descs: dict[str, ReleaseDescriptor] = {}
    for shard in infos:
        for info in shard:
            if info is not None:
                votes[info.build_id] += 1
                descs.setdefault(info.build_id, ReleaseDescriptor.from_json(info.descriptor_json,
                                                                            Path(info.address)))
    if not votes:
        return None
    best = max(votes, key=lambda b: (votes[b], descs[b].created_at))
    return descs[best]


async def connect_router(core: SearchCore, collection: str, shard_replicas: Sequence[Sequence[str]],
                         policy: HedgePolicy = HedgePolicy(), timeout: float = 30.0,
                         credentials=None, token: Optional[str] = None) -> LoadedCollection:
    """`credentials`: grpc channel credentials for TLS to the shards (None: plaintext); `token`:
    the shared router credential the shard servers require."""
    sets = [ReplicaSet(n, [RemoteShard(a, n, credentials, token) for a in addresses], policy)
            for n, addresses in enumerate(shard_replicas)]
    failures: list[str] = []

    async def say_what_it_waits_for() -> None:  # (outside QA: 30 s of silence, then an exit)
        waited = 0
        while True:
            await asyncio.sleep(15)
            waited += 15
            log.info("waiting for the shard replicas to answer (%d s of --shards-wait-s %g)",
                     waited, timeout)

    waiting = asyncio.get_running_loop().create_task(say_what_it_waits_for())
    try:
        infos = await _read_infos(sets, timeout, wait=True, failures=failures)
    finally:
        waiting.cancel()
    for n, shard in enumerate(infos):
        for info in shard:
            if info is not None and (info.shard_no != n or info.collection != collection):
                raise FailedPrecondition(f"{info.address} serves shard {info.shard_no} of "
                                         f"{info.collection!r}; the topology puts it at shard {n} "
                                         f"of {collection!r}")
    desc = _choose_build(infos)
    if desc is None:  # say why: a wrong --shard-token-file read as "no replica answered"
        raise Unavailable(f"no shard replica answered ShardInfo within {timeout:g} s "
                          f"(--shards-wait-s): " + "; ".join(failures[:4]))
    if desc.shards != len(sets):
        raise FailedPrecondition(f"build {desc.build_id} has {desc.shards} shards; the topology "
                                 f"lists {len(sets)}")
    _adopt(sets, infos, desc)
    await check_write_log(core, infos)  # before the first write is taken
    loaded = LoadedCollection(desc, sets, direct_writes=False)
    core.attach(loaded)
    return loaded


def _adopt(sets: Sequence[ReplicaSet], infos: list[list], desc: ReleaseDescriptor) -> None:
    for rs, shard in zip(sets, infos):
        rs.build_id = desc.build_id
        for i, info in enumerate(shard):
            if info is not None:
                # a replica that flipped to a new build still answers for the one before it for a
                # while (`also_serves`): it stays in rotation until the router follows
                if not rs.mark_build(i, info.build_id, info.also_serves):
                    log.warning("shard %d replica %s serves build %s, not %s: out of rotation",
                                rs.shard_no, info.address, info.build_id, desc.build_id)


async def check_write_log(core: SearchCore, infos: list[list]) -> None:
    """Refuse appends while the write log ends before what some replica has applied (the stream
    was wiped and recreated): see ReplicatedWriteLog.check_against_replicas."""
    write_log = core.writes.log
    if write_log is None:
        return
    applied = {n: max((i.applied_seq for i in shard if i is not None), default=0)
               for n, shard in enumerate(infos)}
    try:
        await write_log.check_against_replicas(applied)
    except SearchError as exc:  # the log does not answer now: appends fail on their own
        log.warning("cannot compare the write log with the replicas: %s", exc)


# rounds of follow_builds in a row in which no replica of any shard answered before a router
# reports NOT_SERVING: one slow round is not an outage
DOWN_ROUNDS = 2


def router_health(running, takes_writes: bool):
    """follow_builds' `health` for a router: `running()` is its RunningServer. A router that takes
    writes (a write log) needs no shard for them: it stays ready ("" and AdminService) and only
    SearchService follows the shards - else a shard outage would take every router, and the
    writes, out of a Service."""
    from server.transport.app import SEARCH_SERVICE

    async def health(serving: bool) -> None:
        await running().set_serving(serving, (SEARCH_SERVICE,) if takes_writes else None)

    return health


async def follow_builds(core: SearchCore, collection: str, interval: float = 2.0,
                        timeout: float = 5.0, health=None) -> None:
    """Re-read every replica's build; switch to a build once every replica that answers (at
    least one per shard) serves it (a rollout finished), and keep out of rotation whatever serves
    another build. `health` (an async callable taking whether to serve): the router's health
    follows its shards - NOT_SERVING once no replica of any shard has answered as serving (not
    catching up) for DOWN_ROUNDS rounds (its searches could only answer UNAVAILABLE: a load
    balancer should send them to a router that has shards), SERVING again at the first round
    one does. A router some of whose shards answer stays SERVING: partial answers are the
    caller's choice."""
    down_rounds, serving = 0, True
    while True:
        await asyncio.sleep(interval)
        try:
            current = core.registry.get(collection)
            sets = current.shards
            infos = await _read_infos(sets, timeout, wait=False)
            if health is not None:
                # a replica catching up on its log answers ShardInfo but no search
                answering = any(i is not None and i.state == "serving" for s in infos for i in s)
                down_rounds = 0 if answering else down_rounds + 1
                want = down_rounds < DOWN_ROUNDS
                if want != serving:
                    try:
                        await health(want)
                    except Exception as exc:  # noqa: BLE001 - the follower must go on
                        log.warning("%s: could not set the router's health: %s", collection, exc)
                    else:
                        serving = want
                        if serving:
                            log.info("%s: a shard replica answers again; the router is SERVING",
                                     collection)
                        else:
                            log.warning("%s: no replica of any shard has answered searches for "
                                        "%d rounds; the router is NOT_SERVING until one does",
                                        collection, down_rounds)
            await check_write_log(core, infos)
            builds = {i.build_id for shard in infos for i in shard if i is not None}
            # every shard answers through at least one replica, and every replica that answers
            # serves the new build: follow. A replica that is down must not hold the router on the
            # old build for ever (its siblings stop answering for it after their grace period);
            # when it comes back it follows the alias too, out of rotation until it does.
            answered = all(any(i is not None for i in shard) for shard in infos)
            if answered and len(builds) == 1 and builds != {current.desc.build_id}:
                desc = _choose_build(infos)
                if desc.shards == len(sets):
                    _adopt(sets, infos, desc)
                    core.attach(LoadedCollection(desc, sets, direct_writes=False))
                    core.pipeline.clear_cache()
                    log.info("%s: every replica that answers serves build %s now; the router "
                             "follows it (was %s)", collection, desc.build_id, current.desc.build_id)
                    continue
            _adopt(sets, infos, current.desc)
        except SearchError as exc:
            log.warning("build follower for %s: %s", collection, exc)
