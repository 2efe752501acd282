"""Which build each collection serves, in the engine that owns the shards: loading, following
alias flips, replaying writes into a new build, and compaction.

A switch loads the new build, replays the current build's logged writes into it (version-checked,
so idempotent; progress kept in the new build's state), then - with writes paused - replays the
tail and swaps the registry entry. A compacted build holds its source's writes in its base files,
not in its own log, so a switch replays the logs of the whole compaction lineage (the oldest
build first): a new corpus build published after a compaction, or a rollback past one, still
gets every write. Each query resolves its collection once, so it sees one build.
Rolling back is the same switch in the other direction. Writes logged with the new build's model
are replayed with their own vectors; others are re-embedded, which needs that model here.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Optional, Sequence

from server.backends.device import Device
from server.backends.docstore import DocStore, LoggedWrite
from server.config import ServerConfig
from server.core import metrics
from server.core.chunking import Chunk, embed_text, shard_of
from server.core.collection import CollectionStore, ReleaseDescriptor, atomic_write
from server.core.encoders import Encoders
from server.core.engine.local import EnginePools, LocalShard
from server.core.engine.state import (DESCRIPTOR_COPY, check_state_is_this_builds,
                                      check_writable, keep_descriptor, remove_states,
                                      state_builds)
from server.core.registry import CollectionRegistry, LoadedCollection
from server.core.types import ShardWrite
from server.core.writes import WritePath
from server.errors import FailedPrecondition, NotFound, SearchError, is_failure, storage_error

log = logging.getLogger(__name__)


class BuildManager:
    RETIRE_AFTER_S = 60.0  # longer than any request's deadline
    RETRY_UNLOADABLE_S = 60.0  # a build that failed to load is tried again this often

    def __init__(self, config: ServerConfig, store: CollectionStore, registry: CollectionRegistry,
                 encoders: Encoders, writes: WritePath, pools: EnginePools,
                 device: Optional[Device] = None):
        self.config = config
        self.store = store
        self.state_root = config.storage.resolved_state_dir()
        self.registry = registry
        self.encoders = encoders
        self.writes = writes
        self.pools = pools
        self.device = device
        self._retired: dict[tuple[str, str], tuple[asyncio.Task, LoadedCollection]] = {}
        self._switching: dict[str, asyncio.Lock] = {}
        # collections left out because their live build failed to load: name -> that build
        self._unloadable: dict[str, Optional[str]] = {}
        self._unloadable_at: dict[str, float] = {}
        self._failed_switch: dict[str, str] = {}  # name -> the published build a switch failed to
        self._states_seen: dict[str, tuple] = {}  # name -> what the last state sweep saw
        self.on_switch = None  # async callback(collection) after a switch (an engine tells its front ends)

    # --- loading -----------------------------------------------------------------------------
    def open_build(self, name: str, build_id: Optional[str] = None) -> LoadedCollection:
        """Load every shard of a build (blocking)."""
        build_id = build_id or self.store.live_build(name)
        desc = self.store.descriptor(name, build_id)
        build_dir = self.store.build_dir(name, build_id)
        check_state_is_this_builds(self.state_root, name, desc)
        shards = []
        try:
            for i in range(desc.shards):
                shards.append(LocalShard.open(desc, build_dir, self.state_root, i, self.device,
                                              self.config.engine, self.pools,
                                              self.config.replication.apply_batch))
        except BaseException:
            for s in shards:
                s.close_sync()
            raise
        keep_descriptor(self.state_root, name, build_id, desc.to_json())
        return LoadedCollection(desc, shards)

    def load_all(self, names: Sequence[str] = ()) -> None:
        """Load every served collection's live build. A collection whose build fails to load is
        left out, its callers answered UNAVAILABLE with the reason, and retried once its alias
        moves (a fixed build published, a rollback) and every RETRY_UNLOADABLE_S (by the alias
        watcher, `_load_new_collections`): one damaged build must not take the other
        collections of the data directory down. Only when nothing loads does this raise (the
        first failure), so a server with nothing to serve does not start."""
        if not self.store.data_dir.is_dir():  # a typo served nothing, silently
            what = "is not a directory" if self.store.data_dir.exists() else "does not exist"
            raise FailedPrecondition(
                f"data directory {self.store.data_dir} {what}: fix --data-dir, or create it (an "
                "empty one serves nothing until index-builder publishes a build into it)")
        check_writable(self.state_root)
        failures = []
        for name in names or self.store.collections():
            build_id = self._live_or_none(name)
            try:
                if self.store.writable:
                    self.store.sweep_abandoned(name)  # staging dirs of killed builds and compactions
                loaded = self.open_build(name)
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                failures.append(exc)
                self._unloadable_now(name, build_id, exc)
                continue
            self.registry.put(loaded)
            log.info("loaded %s build %s (%d shards, %d chunks, model %s)", name,
                     loaded.desc.build_id, loaded.desc.shards, loaded.desc.chunks, loaded.desc.model_id)
        if failures and not self.registry.names():
            raise failures[0]

    def _live_or_none(self, name: str) -> Optional[str]:
        try:
            return self.store.live_build(name)
        except (SearchError, OSError, ValueError, KeyError):
            return None

    def _unloadable_now(self, name: str, build_id: Optional[str], exc: BaseException) -> None:
        """Record that `name` cannot be served from `build_id` (its live build, None when even
        the alias is unreadable): callers hear why; the alias watcher retries once the alias
        moves, or RETRY_UNLOADABLE_S on."""
        what = f"its live build {build_id}" if build_id else "its alias"
        if self._unloadable.get(name, ()) != build_id:  # once per build, not per poll
            # (outside QA: "the other collections are served" was said also where there were
            # none, just before the start failed)
            log.error("not serving collection %s: %s failed to load (%s: %s); while the server "
                      "runs, %s is loaded again once a build of it is published or rolled back to",
                      name, what, type(exc).__name__, exc, name)
        self._unloadable[name] = build_id
        self._unloadable_at[name] = time.monotonic()
        # callers hear what and why in general terms; the file paths are the server log's
        self.registry.mark_unloadable(name, f"{what} failed to load ({type(exc).__name__}); the "
                                            "server log names the cause - publish a working "
                                            "build or roll back")
        metrics.COLLECTION_UNLOADABLE.labels(name).set(1)

    async def _unloadable_later(self, name: str, build_id: Optional[str], exc: BaseException) -> None:
        """As _unloadable_now, after the start: an engine's front ends are told too."""
        known = self._unloadable.get(name, ())
        self._unloadable_now(name, build_id, exc)
        if known != build_id and self.on_switch is not None:
            await self.on_switch(name)

    def _loadable_again(self, name: str) -> None:
        if self._unloadable.pop(name, ()) != ():
            metrics.COLLECTION_UNLOADABLE.labels(name).set(0)

    async def start(self) -> None:
        """Before serving: replay writes the live build may have missed - it was published while
        the server was down (once or several times: the build this state last served is the
        source, not the alias's `previous`, which may never have served), or the server stopped
        mid-switch. A collection whose replay fails is left out as one whose build failed to
        load; only when none is left does this raise."""
        failures = []
        for loaded in self.registry:
            try:
                await self._catch_up(loaded)
            except BaseException as exc:  # SQLite's errors and tantivy's panics too
                if not is_failure(exc):
                    raise
                failures.append(exc)
                await asyncio.gather(*(s.close() for s in loaded.shards))
                self._unloadable_now(loaded.name, loaded.desc.build_id, exc)
        if failures and not self.registry.names():
            raise failures[0]

    async def _catch_up(self, loaded: LoadedCollection) -> None:
        name = loaded.name
        sources = [self._last_served(name), self.store.alias(name).get("previous")]
        # a build pruned while this server was down is replayed from its state (the copy of its
        # descriptor there): skipping it lost the writes it took
        for source in dict.fromkeys(b for b in sources if b and self._known(name, b)):
            await self.replay(name, source, loaded)
        self._mark_served(name, loaded.desc.build_id)

    SERVED = "SERVED"  # <state>/<collection>/SERVED: the build this state served last

    def _last_served(self, name: str) -> Optional[str]:
        path = self.state_root / name / self.SERVED
        return (path.read_text().strip() or None) if path.is_file() else None

    def _mark_served(self, name: str, build_id: str) -> None:
        """Recorded once every write the build may have missed is in it (after the replay)."""
        atomic_write(check_writable(self.state_root / name) / self.SERVED, build_id)

    def _retire(self, old: LoadedCollection) -> None:
        """Queries that resolved the old build before the swap finish on it (a feedback round or
        a text fetch may still reach it), so its shards close a while after the swap. Its BM25
        writer is released at once (another engine may write that state: a rollback reuses it)."""
        for s in old.shards:
            s.index.lexical.close()

        async def close_later():
            await asyncio.sleep(self.RETIRE_AFTER_S)
            self._retired.pop((old.name, old.desc.build_id), None)
            await asyncio.gather(*(s.close() for s in old.shards))

        task = asyncio.get_running_loop().create_task(close_later())
        self._retired[(old.name, old.desc.build_id)] = (task, old)

    def _reclaim(self, name: str, build_id: str) -> Optional[LoadedCollection]:
        """A build retired moments ago (a quick rollback) is reused instead of loaded again."""
        entry = self._retired.pop((name, build_id), None)
        if entry is None:
            return None
        entry[0].cancel()
        return entry[1]

    def shard_for(self, name: str, build_id: str, shard_no: int):
        """The shard of `build_id`: the live build's, or one retired moments ago (requests that
        resolved it before a switch still finish on it)."""
        live = self.registry.get(name)
        if live.desc.build_id == build_id:
            return live.shards[shard_no]
        retired = self._retired.get((name, build_id))
        return (retired[1] if retired is not None else live).shards[shard_no]

    async def close(self) -> None:
        """Close the builds retired by switches that have not closed yet (server shutdown)."""
        for task, old in list(self._retired.values()):
            task.cancel()
            await asyncio.gather(*(s.close() for s in old.shards))
        self._retired.clear()

    # --- replay and switching ----------------------------------------------------------------
    def _state_build_dir(self, name: str, build_id: str) -> Path:
        return self.state_root / name / build_id

    def descriptor(self, name: str, build_id: str) -> ReleaseDescriptor:
        """A build's descriptor: the build's own, or - once the build is pruned - the copy its
        state kept (`keep_descriptor`), so the writes that state logged can still be replayed."""
        try:
            return self.store.descriptor(name, build_id)
        except NotFound:
            copy = self._state_build_dir(name, build_id) / DESCRIPTOR_COPY
            if not copy.is_file():
                raise
            return ReleaseDescriptor.from_json(copy.read_text(), copy)

    def _known(self, name: str, build_id: str) -> bool:
        """Whether the build or a state of it is here (a state's writes can be replayed)."""
        if self._state_build_dir(name, build_id).is_dir():
            return True
        try:
            self.descriptor(name, build_id)
            return True
        except NotFound:
            return False

    def _compacted_from(self, name: str, build_id: str) -> Optional[str]:
        try:
            return self.descriptor(name, build_id).compacted_from
        except NotFound:  # pruned, with a state made before states kept a descriptor copy
            log.warning("%s: build %s is gone and its state here keeps no copy of its "
                        "descriptor: its own logged writes are replayed, those of any build it "
                        "was compacted from cannot be", name, build_id)
            return None

    def lineage(self, name: str, build_id: str) -> list[str]:
        """`build_id` and the builds it was compacted from, oldest first. A compacted build's
        base files hold its source's writes, so its own log does not: replaying a build's writes
        elsewhere means replaying its lineage's logs. Stops at a corpus build or one gone (its
        directory and any state of it here)."""
        chain, seen = [build_id], {build_id}
        source = self._compacted_from(name, build_id)
        while source and source not in seen and self._known(name, source):
            chain.append(source)
            seen.add(source)
            source = self._compacted_from(name, source)
        if source and source not in seen:
            log.warning("%s: build %s was compacted from %s, which is gone: writes logged only "
                        "there cannot be replayed", name, chain[-1], source)
        return chain[::-1]

    async def replay(self, name: str, source_build: str, target: LoadedCollection) -> int:
        """Apply the writes logged by the source build and its compaction lineage that the
        target has not seen yet (idempotent: each is version-checked), oldest build first,
        recording progress per build in the target's state. The target's own log is in its state
        already (a rollback to a build that served before)."""
        if source_build == target.desc.build_id:
            return 0
        chain = self.lineage(name, source_build)
        base = target.desc.compacted_from
        if base in chain:
            # the target compacts `base`: its base files hold everything `base` held, which
            # includes every earlier build's writes; only `base`'s log from the snapshot on
            # (its replay marker) and later builds' logs are new to it. Without this cut every
            # compaction re-read the whole write history.
            chain = chain[chain.index(base):]
        applied = 0
        for build in chain:
            if build != target.desc.build_id:
                applied += await self._replay_log(name, build, target)
        return applied

    async def _replay_log(self, name: str, source_build: str, target: LoadedCollection) -> int:
        from server.core.compaction import read_replay_marker, write_replay_marker

        tstate = check_writable(self._state_build_dir(name, target.desc.build_id))
        marker = read_replay_marker(tstate, self.store.build_dir(name, target.desc.build_id))
        done = marker.setdefault(source_build, {})
        applied = 0
        loop = asyncio.get_running_loop()
        # the shards whose state is here (none: that build never served here, took no writes
        # here); read from the state, not the build's descriptor: the build may be pruned
        for shard in sorted(self._state_build_dir(name, source_build).glob("shard-*")):
            number = shard.name.split("-", 1)[1]
            path = shard / "docstore.sqlite"
            if not number.isdigit() or not path.is_file():
                continue
            s = int(number)
            while True:
                log_store = DocStore(path)
                try:
                    entries = await loop.run_in_executor(self.pools.cpu, log_store.write_log,
                                                         done.get(str(s), 0), 1000)
                finally:
                    log_store.close()
                if not entries:
                    break
                writes = [await self._replayable(e, target) for e in entries]
                by_shard: dict[int, list[ShardWrite]] = {}
                for w in writes:
                    by_shard.setdefault(shard_of(w.tenant, w.doc_id, target.desc.shards), []).append(w)
                outcomes = await asyncio.gather(*(target.shards[n].apply(ws)
                                                  for n, ws in by_shard.items()))
                applied += sum(o.outcome == "applied" for batch in outcomes for o in batch)
                done[str(s)] = entries[-1].seq
                write_replay_marker(tstate, marker)
        return applied

    async def _replayable(self, e: LoggedWrite, target: LoadedCollection) -> ShardWrite:
        chunks = tuple(Chunk(i, a, b, t) for i, a, b, t in e.chunks)
        if e.op == "delete" or not chunks:
            return ShardWrite(e.op, e.tenant, e.doc_id, e.version, e.body, chunks, None)
        if e.model_id == target.desc.model_id and e.vectors is not None:
            return ShardWrite(e.op, e.tenant, e.doc_id, e.version, e.body, chunks, e.vectors)
        if not self.encoders.can_embed(target.desc):
            raise FailedPrecondition(
                f"writes of model {e.model_id!r} must be re-embedded for build "
                f"{target.desc.build_id} ({target.desc.model_id!r}); start a server with that model")
        title = e.body.get("title", "")
        vectors = await self.encoders.embed_many([embed_text(title, c.text) for c in chunks], target.desc)
        return ShardWrite(e.op, e.tenant, e.doc_id, e.version, e.body, chunks, vectors)

    async def switch_build(self, name: str, build_id: Optional[str] = None) -> dict:
        """Serve `build_id` (default: the alias's live build) in place of the current build. One
        switch of a collection at a time: a compaction's own switch and the alias watcher's, which
        saw the same flip, would otherwise both open the new build's state (and one fail). A
        switch, once begun, runs to its end even if its caller goes away: cancelled halfway (a
        Compact's deadline, outside QA) it left the new build's shards opening on a worker
        thread - their state locked against the next try - and the alias ahead of the build
        served."""
        return await asyncio.shield(self._locked_switch(name, build_id))

    async def _locked_switch(self, name: str, build_id: Optional[str]) -> dict:
        lock = self._switching.setdefault(name, asyncio.Lock())
        async with lock:
            return await self._switch_build(name, build_id)

    async def _switch_build(self, name: str, build_id: Optional[str]) -> dict:
        old = self.registry.get(name)
        build_id = build_id or self.store.live_build(name)
        if build_id == old.desc.build_id:
            return {"build_id": build_id, "replayed": 0, "switched": False}
        loop = asyncio.get_running_loop()
        new = self._reclaim(name, build_id) or await loop.run_in_executor(None, self.open_build,
                                                                           name, build_id)
        try:
            replayed = await self.replay(name, old.desc.build_id, new)
            async with self.writes.gate(name).exclusive():
                replayed += await self.replay(name, old.desc.build_id, new)
                self._mark_served(name, build_id)  # (before the swap: if it fails, nothing moved)
                self.registry.put(new)
        except BaseException:
            await asyncio.gather(*(s.close() for s in new.shards))
            raise
        log.info("%s now serves build %s (was %s; %d writes replayed)", name, build_id,
                 old.desc.build_id, replayed)
        self._failed_switch.pop(name, None)
        self._retire(old)
        if self.on_switch is not None:
            await self.on_switch(name)
        return {"build_id": build_id, "previous": old.desc.build_id, "replayed": replayed,
                "switched": True}

    async def compact(self, name: str) -> dict:
        """Compact the live build into a new one, audit and reconcile it, publish it, switch.

        The new build is held to its source's audit: the same held-out queries (copied over),
        the same recall threshold, and the knobs tuned again to the source's target when it had
        one - its index is trained anew on the live vectors, which writes may have moved far from
        the ones the source was trained on. A build that falls short is not published, and the
        source keeps serving."""
        from server.core.audit import audit_build
        from server.core.compaction import compact_build

        coll = self.registry.get(name)
        builds = self.store.collection_dir(name) / "builds"
        check_writable(builds, "build directory")
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        before = {k: sum(s.index.states[k] for s in coll.shards) for k in ("live", "dead", "orphan")}
        source = coll.desc.audit or {}
        min_recall = source.get("min_recall", 0.9)
        tuning = source.get("tuning") or {}
        target, pinned = tuning.get("target_recall"), tuple(tuning.get("pinned") or ())
        made: dict = {}

        def build_and_audit():
            made["desc"] = new = compact_build(self.store, coll)
            return new, audit_build(self.store, name, new.build_id, min_recall=min_recall,
                                    target_recall=target, pinned=pinned)

        job = loop.run_in_executor(None, build_and_audit)
        try:
            desc, audit = await asyncio.shield(job)  # a cancelled caller: the job runs out
            if not (audit["passed"] and audit["reconciliation"]["passed"]):
                raise FailedPrecondition(f"compacted build {desc.build_id} failed its checks: "
                                         f"{audit}")
            # written and audited just now; published only over its own source
            self.store.publish(name, desc.build_id, verify_files=False,
                               expect_live=coll.desc.build_id)
        except BaseException as exc:  # a build that is not published is removed, whatever stopped it
            # (outside QA: each compaction that failed its audit left a whole build behind, and
            # a scheduled one a new one every interval; review: so did a caller cancelled while
            # it was written) - once the job has stopped writing into it, never once the alias
            # names it (a publish that failed after its rename, in the directory's fsync), and
            # off the event loop (a build can be gigabytes)
            if job.done():
                await self._drop_unpublished(name, made.get("desc"))
            else:
                job.add_done_callback(lambda _: loop.create_task(
                    self._drop_unpublished(name, made.get("desc"))))
            # a full or read-only volume is the operator's to fix, not INTERNAL (outside QA)
            clear = (storage_error(exc, f"compaction of {name} into {builds}",
                                   "compact again (`index-builder list` shows the build serving)")
                     if isinstance(exc, Exception) and not isinstance(exc, SearchError) else None)
            if clear is not None:
                raise clear from exc
            raise
        switched = await self.switch_build(name)  # the alias's: an operator's later publish wins
        return {"build_id": desc.build_id, "previous": coll.desc.build_id, "rows_before": before,
                "rows_after": desc.chunks, "replayed": switched["replayed"],
                "seconds": time.perf_counter() - t0}

    async def _drop_unpublished(self, name: str, desc: Optional[ReleaseDescriptor]) -> None:
        """Remove a compaction's build that was not published (off the loop: a build can be
        gigabytes); never one the alias names."""
        if desc is None or self._live_or_none(name) == desc.build_id:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, shutil.rmtree, self.store.build_dir(name, desc.build_id), True)
        except RuntimeError:  # shutting down: the executor is gone, the build stays
            log.warning("compacted build %s of %s not removed (shutting down)", desc.build_id, name)

    async def watch_aliases(self, interval: float) -> None:
        """Follow alias flips made by `index-builder publish` (poll; a flip is one file rename),
        and serve collections published for the first time since the start."""
        while True:
            await asyncio.sleep(interval)
            await self._load_new_collections()
            for name in self.registry.names():
                live = self._live_or_none(name)
                if live is None or live == self.registry.get(name).desc.build_id:
                    continue
                try:
                    await self.switch_build(name)
                except BaseException as exc:  # a damaged build (OSError, a panic): keep watching
                    if not is_failure(exc):
                        raise
                    if self._failed_switch.get(name) != live:  # once per build, not per poll
                        log.error("cannot switch %s to its published build %s (still serving "
                                  "%s): %s", name, live, self.registry.get(name).desc.build_id, exc)
                    self._failed_switch[name] = live
            for name in self.registry.names():  # pruned builds' states: not kept for ever
                try:
                    await self.remove_unused_states(name)
                except Exception as exc:  # never the end of alias following
                    log.warning("%s: could not remove unused build states: %s: %s", name,
                                type(exc).__name__, exc)

    def _served_heads(self, name: str) -> set:
        """(On the loop) the builds this server serves or may replay from: the one served, those
        retired moments ago, and the one this state last served."""
        heads = {self._last_served(name), *(b for n, b in self._retired if n == name)}
        if name in self.registry.names():
            heads.add(self.registry.get(name).desc.build_id)
        return heads

    def unused_states(self, name: str, heads: Optional[set] = None) -> list[str]:
        """Builds of `name` whose state here nothing can use any more: the build is gone from
        the data directory (pruned), and it is neither one of `heads` (`_served_heads`) nor in
        the compaction lineage of one of them or of any build still there (whose logs a switch,
        publish or rollback replays - review: a server still on a compacted build whose switch
        failed lost its source's state, and with it the source's writes). Nothing when
        the data directory does not hold the live build (a volume not mounted must not read as
        every build pruned). Blocking: reads descriptors."""
        try:
            alias = self.store.alias(name)
            builds = set(self.store.builds(name))
        except (SearchError, OSError, ValueError):
            return []
        if alias.get("live") not in builds:
            return []
        heads = set(self._served_heads(name) if heads is None else heads)
        # every build still there may be published (again): its lineage's logs stay too
        heads |= {alias.get("live"), alias.get("previous")} | builds
        needed = set()
        for head in heads:
            if head and self._known(name, head):
                needed.add(head)
                needed.update(self.lineage(name, head))
        return [b for b in state_builds(self.state_root, name) if b not in builds | needed]

    def _keep_descriptor_copies(self, name: str) -> None:
        """Blocking: a copy of its build's descriptor beside every state here whose build is
        still there (states made before states kept one: a later prune would otherwise cut the
        lineage its writes are replayed through)."""
        builds = set(self.store.builds(name))
        for b in state_builds(self.state_root, name):
            if b in builds:  # (written only where missing)
                keep_descriptor(self.state_root, name, b, self.store.descriptor(name, b).to_json())

    async def remove_unused_states(self, name: str) -> None:
        """Remove the states `unused_states` names (off the loop: reading descriptors, and a
        state holds a copy of its shard's documents), each unless a process has it open; and
        what a removal cut short left behind. Looked at again only when the builds, the alias
        or the builds this server serves change (not at every poll), until a pass completes."""
        heads = self._served_heads(name)
        try:
            seen = (frozenset(self.store.builds(name)), tuple(self.store.alias(name).items()),
                    frozenset(heads))
        except (SearchError, OSError, ValueError):
            return
        if self._states_seen.get(name) == seen:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._keep_descriptor_copies, name)
        unused = await loop.run_in_executor(None, self.unused_states, name, heads)
        await loop.run_in_executor(None, remove_states, self.state_root, name, unused)
        self._states_seen[name] = seen

    async def _load_new_collections(self) -> None:
        """Serve collections published since the start, and those whose build failed to load
        once their alias moves to another build."""
        wanted = self.config.storage.collection
        served = set(self.registry.names())
        for name in dict.fromkeys([*self.store.collections(), *self._unloadable]):
            if name in served or (wanted and name not in wanted):
                continue
            build_id = self._live_or_none(name)
            if (name in self._unloadable and self._unloadable[name] == build_id
                    and time.monotonic() - self._unloadable_at.get(name, 0.0) < self.RETRY_UNLOADABLE_S):
                continue  # the build that failed: tried again once the alias moves, or a while on
                # (a failure may have passed: a locked SQLite file, memory)
            try:
                loaded = await asyncio.get_running_loop().run_in_executor(None, self.open_build, name)
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                await self._unloadable_later(name, build_id, exc)
                continue
            try:
                await self._catch_up(loaded)  # as at a start: this state may have served it
            except BaseException as exc:  # one collection's failure must not end the watcher
                if not is_failure(exc):
                    raise
                await asyncio.gather(*(s.close() for s in loaded.shards))
                await self._unloadable_later(name, loaded.desc.build_id, exc)
                continue
            self.registry.put(loaded)
            self._loadable_again(name)
            log.info("serving collection %s build %s (%d shards)", name,
                     loaded.desc.build_id, loaded.desc.shards)
            if self.on_switch is not None:  # an engine tells its front ends
                await self.on_switch(name)

    async def compact_on_schedule(self, interval: float, min_tombstone_ratio: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for coll in self.registry:
                states = [s.index.states for s in coll.shards]
                total = sum(sum(x.values()) for x in states) or 1
                ratio = sum(x["dead"] + x["orphan"] for x in states) / total
                if ratio >= min_tombstone_ratio:
                    try:
                        log.info("compacting %s (tombstone ratio %.2f)", coll.name, ratio)
                        await self.compact(coll.name)
                    except SearchError as exc:
                        log.error("scheduled compaction of %s failed: %s", coll.name, exc)
