"""`search-server shard`: one shard of one build behind the shard port.

- The shard engine (LocalShard) owns the index; the servicer (shard_rpc.py) authenticates routers.
- With --nats, the replica applies its shard's replicated write log (server/replication/log.py):
  it catches up before it reports SERVING, and answers searches UNAVAILABLE until then, so a
  router uses its siblings.
- Without --build it serves the collection's live build and follows alias flips: the new build is
  loaded and caught up from its own log position, then swapped in. The old one keeps answering
  requests that name it, and keeps applying its write log, for a grace period (RETIRE_AFTER_S):
  a router that has not followed the flip yet still reads every replica (ShardInfo lists it in
  `also_serves`) instead of finding none on its build once all replicas have flipped.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from server.backends.device import Device
from server.config import ServerConfig
from server.core.collection import CollectionStore
from server.core.engine.local import EnginePools, LocalShard
from server.core.engine.state import (check_state_is_this_builds, keep_descriptor,
                                      remove_states, state_builds)
from server.core.faults import FaultSpec, FaultyShard
from server.errors import CatchUpAbandoned, SearchError
from server.transport.shard_rpc import shard_admission

log = logging.getLogger(__name__)
RETIRE_AFTER_S = 60.0


class ShardReplica:
    """The shard this server serves now, its log consumer, and how it moves to a new build."""

    def __init__(self, cfg: ServerConfig, device: Device, pools: EnginePools):
        self.cfg = cfg
        self.device = device
        self.pools = pools
        self.store = CollectionStore(cfg.storage.data_dir)
        self.collection = cfg.shard.shard_collection
        self.shard_no = cfg.shard.shard
        self.local: Optional[LocalShard] = None
        self.replicator = None
        self.js = None
        s = cfg.shard
        self.faults = FaultSpec(s.inject_delay_prob, s.inject_delay_ms, s.inject_fail_prob,
                                s.inject_hang_prob, s.inject_seed)
        self.served = None  # what the servicer calls: the shard, or its fault-injecting wrapper
        self.previous = None  # (served, shard, replicator) of the build before the last flip
        self._states_seen = None  # what the last sweep of unused states saw
        from server.roles import default_replica_id

        self.replica_id = default_replica_id(cfg)
        # each replica its own state (replicas may share one data volume): named by replica id
        self.state_root = (cfg.storage.state_dir
                           or cfg.storage.data_dir / ".state" / "replicas" / self.replica_id)

    def _open(self, build_id: str) -> LocalShard:
        desc = self.store.descriptor(self.collection, build_id)
        if not 0 <= self.shard_no < desc.shards:
            raise ValueError(f"--shard must be within 0..{desc.shards - 1} for build {build_id}")
        check_state_is_this_builds(self.state_root, self.collection, desc)
        shard = LocalShard.open(desc, self.store.build_dir(self.collection, build_id),
                                self.state_root, self.shard_no, self.device, self.cfg.engine,
                                self.pools, self.cfg.replication.apply_batch)
        keep_descriptor(self.state_root, self.collection, build_id, desc.to_json())
        return shard

    async def start(self) -> None:
        if self.collection is None or self.shard_no is None:
            raise ValueError("shard needs --collection NAME and --shard N")
        build = self.cfg.shard.build or self.store.live_build(self.collection)
        loop = asyncio.get_running_loop()
        self.local = await loop.run_in_executor(None, self._open, build)
        self.served = FaultyShard(self.local, self.faults) if self.faults.active else self.local
        if self.cfg.replication.nats:
            from server.replication.log import connect_log

            self.js = await connect_log(self.cfg.replication, self.collection)
            await self._check_layout(self.local.desc)
            self.replicator = self._replicator(self.local)

    async def _check_layout(self, desc) -> None:
        """A build of another shard count than the log's writes are placed by is refused before
        it applies any of them (server/replication/log.py layout_problem)."""
        from server.replication.log import LayoutMismatch, layout_problem

        problem = await layout_problem(self.js, desc.shards, f"build {desc.build_id}")
        if problem:
            raise LayoutMismatch(problem)

    def _replicator(self, local: LocalShard):
        from server.replication.log import ShardReplicator

        return ShardReplicator(self.js, local, self.replica_id, self.cfg.replication)

    def status(self) -> str:
        return self.replicator.state() if self.replicator is not None else "serving"

    async def follow_aliases(self, interval: float, swap) -> None:
        """Serve the live build as it changes (only when no --build was given)."""
        loop = asyncio.get_running_loop()
        refused, live, unfollowable = None, None, None
        while True:
            await asyncio.sleep(interval)
            try:
                await self._remove_unused_states()
            except Exception as exc:  # never the end of alias following (review)
                log.warning("could not remove unused build states: %s: %s", type(exc).__name__, exc)
            try:
                live = self.store.live_build(self.collection)
                if live != unfollowable:
                    unfollowable = None  # the alias moved: a build refused before is tried again
                if live in (self.local.desc.build_id, unfollowable):
                    continue
                back = self.previous
                if back is not None and back[1].desc.build_id == live:
                    # a quick rollback: the previous build is still open (it holds its state's
                    # lock, so it cannot be opened twice) and its log consumer still applies
                    self.previous = None
                    _, new, replicator = back
                    started = True
                else:
                    if self.js is not None:  # before opening it
                        await self._check_layout(self.store.descriptor(self.collection, live))
                    new = await loop.run_in_executor(None, self._open, live)
                    replicator, started = None, False
                    try:
                        if self.js is not None:
                            replicator = self._replicator(new)
                            # given up once the alias leaves this build (outside QA re-probe: a
                            # rollback during a long catch-up was followed by a switch to the
                            # build it had rolled back, after a minute of applying its log)
                            await replicator.catch_up(wanted=lambda: self._still_live(live))
                        # a flip within the grace period: the build before the previous one goes
                        await self._retire(None, swap)
                    except BaseException:  # not swapped in: release it (it holds its state's
                        if replicator is not None:  # lock; the next poll opens it again)
                            await replicator.stop()
                        await new.close()
                        raise
                old = self.previous = (self.served, self.local, self.replicator)
                self.local, self.replicator = new, replicator
                self.served = FaultyShard(new, self.faults) if self.faults.active else new
                swap(self.served, old[0])
                if replicator is not None and not started:
                    loop.create_task(replicator.run())
                log.info("shard %d of %s now serves build %s (was %s; it answers requests that "
                         "name it for %gs)", self.shard_no, self.collection, live,
                         old[1].desc.build_id, RETIRE_AFTER_S)
                loop.call_later(RETIRE_AFTER_S, lambda o=old: loop.create_task(self._retire(o, swap)))
            except CatchUpAbandoned as exc:
                log.info("%s; not switching to it", exc)
            except (SearchError, OSError, ValueError) as exc:
                why = (live, str(exc))
                if why != refused:  # once per build and reason, not at every poll
                    log.error("cannot follow %s to its live build: %s", self.collection, exc)
                refused = why
                from server.replication.log import LayoutMismatch, MisplacedWrite

                if isinstance(exc, (MisplacedWrite, LayoutMismatch)):  # the log will not change:
                    unfollowable = live  # not tried at every poll, until the alias moves
            else:
                refused = None

    def _still_live(self, build_id: str) -> bool:
        """Whether the alias still names `build_id` (an unreadable alias: assume so)."""
        try:
            return self.store.live_build(self.collection) == build_id
        except (SearchError, OSError, ValueError):
            return True

    async def _remove_unused_states(self) -> None:
        """Remove this replica's states of builds gone from the data directory (pruned) that it
        does not have open: a shard server replays no other build's log (its writes come from
        the write log), so nothing else reads them. Looked at when the builds or the builds
        open change; nothing when the data directory does not hold the live build."""
        try:
            builds = frozenset(self.store.builds(self.collection))
            live = self.store.live_build(self.collection)
        except (SearchError, OSError, ValueError):
            return
        open_now = {self.local.desc.build_id} | (
            {self.previous[1].desc.build_id} if self.previous is not None else set())
        seen = (builds, frozenset(open_now))
        if live not in builds or seen == self._states_seen:
            return
        self._states_seen = seen
        gone = [b for b in state_builds(self.state_root, self.collection)
                if b not in builds | open_now]
        await asyncio.get_running_loop().run_in_executor(None, remove_states, self.state_root,
                                                         self.collection, gone)

    async def _retire(self, which=None, swap=None) -> None:
        """Close the previous build (`which`, if it is still the previous one) and its log
        consumer; the servicer stops answering for it first."""
        previous = self.previous
        if previous is None or (which is not None and previous is not which):
            return
        self.previous = None
        if swap is not None:
            swap(self.served, None)
        _, shard, replicator = previous
        if replicator is not None:
            await replicator.stop()
        await shard.close()

    async def close(self) -> None:
        await self._retire()
        if self.replicator is not None:
            await self.replicator.stop()
        if self.local is not None:
            await self.local.close()
        if self.js is not None:
            await self.js.close()


async def serve_shard(cfg: ServerConfig, device: Device) -> None:
    from server.transport import app
    from server.transport.shard_rpc import read_token

    token = read_token(cfg.auth.shard_token_file)
    tls = app.TLSConfig.from_config(cfg.listen)
    pools = EnginePools.create(cfg.engine.search_threads, cfg.device.faiss_threads)
    replica = ShardReplica(cfg, device, pools)
    await replica.start()
    note = app.start_metrics(cfg.listen.host, cfg.listen.metrics_port)
    running = await app.start_shard_server(replica.served, cfg.listen.host, cfg.listen.port, tls,
                                           token, replica.status,
                                           serving=replica.replicator is None,
                                           admission=shard_admission(
                                               cfg.listen.max_inflight,
                                               cfg.listen.max_inflight_batched_queries))
    tasks = []
    loop = asyncio.get_running_loop()
    if replica.replicator is not None:
        await replica.replicator.catch_up()
        await running.set_serving(True)
        tasks.append(loop.create_task(replica.replicator.run()))

        async def health_follows_the_log() -> None:
            """NOT_SERVING while the replica cannot apply its log (it stopped on an entry of
            another layout: review), so readiness probes take it out of rotation too."""
            serving = True
            while True:
                await asyncio.sleep(1.0)
                now = replica.status() == "serving"
                if now != serving:
                    await running.set_serving(now)
                    serving = now

        tasks.append(loop.create_task(health_follows_the_log()))
    if not cfg.shard.build and cfg.storage.alias_poll_s > 0:
        def swap(shard, previous):
            running.servicer.shard, running.servicer.previous = shard, previous

        tasks.append(loop.create_task(replica.follow_aliases(cfg.storage.alias_poll_s, swap)))
    desc = replica.local.desc
    print(f"shard server (shard {replica.shard_no} of {desc.collection}/{desc.build_id}) "
          f"listening on {cfg.listen.host}:{running.port}{note}{app.loop_note()}", flush=True)
    try:
        await app.wait_for_signal_then_stop(running, cfg.listen.shutdown_grace_s,
                                            cfg.listen.shutdown_delay_s)
    finally:
        for t in tasks:
            t.cancel()
        await replica.close()
        pools.close()
