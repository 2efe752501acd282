"""`serve --workers N`: one engine process that owns every index (and the device), fed by N gRPC
front-end processes on the same port (SO_REUSEPORT) that embed, fuse and assemble.

One Python process tops out at a few thousand requests/s of gRPC and pipeline work (one GIL);
front ends scale that across cores, while batching stays in one place: every front end's queries
for a shard reach that shard's one scheduler, which batches across all of them (the split of
vLLM's engine core and its multi-process clients).

The link is a Unix socket (no network, same user): length-prefixed pickled messages carrying
the shard interface's own dataclasses (server/core/types.py), numpy arrays out of band.
`EngineShard` implements the complete shard interface over it, so the front end's pipeline and
write path are exactly the embedded default's. Queries a front end submits in the same event-loop
turn travel in one message. The engine pushes a collection's new descriptor to every front end
when it switches builds; requests for the previous build are still answered by it while it
drains.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from server.config import ServerConfig
from server.core.chunking import shard_of
from server.core.registry import LoadedCollection
from server.core.types import FetchRequest, ShardQuery, ShardWrite, StoredVersions
from server.errors import SearchError, ShardUnreachable, Unavailable

log = logging.getLogger(__name__)
_LEN = struct.Struct("!I")
RESTARTS_PER_MINUTE = 5  # front-end exits the engine restarts before it stops the server
CANCEL = "cancel"        # (request id,): a front end's caller went away before the answer
CANCELLABLE = ("search", "fetch")  # reads only: a write, once sent, runs to its outcome


async def _send(writer: asyncio.StreamWriter, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> Any:
    head = await reader.readexactly(_LEN.size)
    return pickle.loads(await reader.readexactly(_LEN.unpack(head)[0]))


# --- the engine side ---------------------------------------------------------------------------
class EngineServer:
    """Answers front ends over the socket from the SearchCore that owns the shards."""

    def __init__(self, core, path: str, expected: int):
        self.core = core
        self.path = path
        self.expected = expected
        self._clients: set[asyncio.StreamWriter] = set()
        self.ready_frontends = 0
        self._ready = asyncio.Event()
        self._server = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)  # this user only

    def _shard(self, collection: str, build_id: str, shard_no: int):
        return self.core.builds.shard_for(collection, build_id, shard_no)

    async def _handle(self, op: str, args: tuple):
        core = self.core
        if op == "search":
            collection, build_id, shard_no, queries, timeout = args
            return await self._shard(collection, build_id, shard_no).search(queries, timeout)
        if op == "fetch":
            collection, shard_no, request, timeout = args
            return await self._shard(collection, request.build_id, shard_no).fetch(request, timeout)
        if op == "apply":
            collection, build_id, shard_no, writes, timeout = args
            async with core.writes.gate(collection).writing():  # a switch waits for it, or it
                live = core.registry.get(collection)              # for the switch
                if live.desc.build_id == build_id:
                    return await live.shards[shard_no].apply(writes, timeout)
                return await _apply_to_live(live, build_id, writes, timeout)
        if op == "versions":
            collection, build_id, shard_no, keys, timeout = args
            live = core.registry.get(collection)
            if live.desc.build_id != build_id:  # switched meanwhile: none known, the write goes
                return StoredVersions({}, 0)     # on and `apply` places it on the live build
            return await live.shards[shard_no].stored_versions(keys, timeout)
        if op == "info":
            collection, shard_no, tenant, digest, timeout = args
            shards = core.registry.get(collection).shards
            if shard_no >= len(shards):  # a front end a switch to fewer shards has not reached
                raise Unavailable(f"collection {collection!r} has switched to a build of "
                                  f"{len(shards)} shards: ask again")
            # the front end's limit, less a margin for the answer's way back (a replica set
            # here reports each replica's state before the front end gives the engine up)
            limit = {} if timeout is None else {"timeout": timeout * 0.9}
            return await shards[shard_no].info(tenant, digest, **limit)
        if op == "collections":
            return [c.desc.to_json() for c in core.registry]
        if op == "unloadable":  # collections whose build failed to load, and why
            return core.registry.unloadable()
        if op == "compact":
            return await core.compact(args[0])
        if op == "ready":
            self.ready_frontends += 1
            if self.ready_frontends >= self.expected:
                self._ready.set()
            return None
        raise ValueError(f"unknown engine operation {op!r}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        lock = asyncio.Lock()
        running: dict[int, asyncio.Task] = {}  # reads by request id: a front end may cancel them

        async def answer(req_id, op, args):
            try:
                result, ok = await self._handle(op, args), True
            except SearchError as exc:
                result, ok = exc, False
            except Exception as exc:  # a bug: report it, keep serving
                log.exception("engine operation %s failed", op)
                result, ok = Unavailable(f"engine error in {op}: {type(exc).__name__}: {exc}"), False
            async with lock:
                await _send(writer, (req_id, ok, result))

        try:
            while True:
                req_id, op, args = await _recv(reader)
                if op == CANCEL:  # its caller went away: the shards drop its queued queries
                    task = running.get(args[0])
                    if task is not None:
                        task.cancel()
                    continue
                task = asyncio.get_running_loop().create_task(answer(req_id, op, args))
                if op in CANCELLABLE:  # (a write, once sent, runs to its outcome)
                    running[req_id] = task
                    task.add_done_callback(lambda _, r=req_id: running.pop(r, None))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._clients.discard(writer)
            writer.close()
            for task in list(running.values()):  # the front end is gone: so are its callers
                task.cancel()

    async def announce(self, collection: str) -> None:
        """Tell every front end which build a collection serves now - or, when its build failed
        to load, why it serves none."""
        unloadable = self.core.registry.unloadable()
        message = (("unloadable", collection, unloadable[collection]) if collection in unloadable
                   else ("collection", self.core.registry.get(collection).desc.to_json()))
        for w in list(self._clients):
            try:
                await _send(w, (0, True, message))
            except ConnectionError:
                self._clients.discard(w)

    async def wait_ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


# --- the front-end side ------------------------------------------------------------------------
class EngineClient:
    """One front end's connection to the engine: requests matched to answers by id."""

    def __init__(self, path: str, on_push=None, on_lost=None):
        self.path = path
        self.on_push = on_push
        self.on_lost = on_lost  # called once when the engine goes away (the front end stops)
        self.lost: Optional[str] = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader_task: Optional[asyncio.Task] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._lock = asyncio.Lock()
        self._closing = False
        self._cancels: set[asyncio.Task] = set()

    async def connect(self, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() > deadline:
                    raise Unavailable(f"the engine at {self.path} did not come up within {timeout}s")
                await asyncio.sleep(0.05)
        self._reader_task = loop.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                req_id, ok, result = await _recv(reader)
                if req_id == 0:
                    if self.on_push is not None:
                        self.on_push(result)
                    continue
                fut = self._waiting.pop(req_id, None)
                if fut is not None and not fut.done():
                    (fut.set_result if ok else fut.set_exception)(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # EOF, a reset, a bad message: the link is gone either way
            if not self._closing:  # (our own close() ends the link too: that is no loss)
                self._lose(f"the engine process went away ({type(exc).__name__})")

    def _lose(self, why: str) -> None:
        """Every waiting call fails UNAVAILABLE (a client retries elsewhere) and so does every
        later one; `on_lost` runs once. Without this a call sent on a dead link waited out its
        deadline, and the front end kept reporting SERVING."""
        if self.lost is not None:
            return
        self.lost = why
        log.error("%s: failing %d waiting calls", why, len(self._waiting))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(Unavailable(why))
        self._waiting.clear()
        if self.on_lost is not None:
            self.on_lost(why)

    async def call(self, op: str, *args, timeout: Optional[float] = None):
        if self._writer is None:
            raise Unavailable("not connected to the engine")
        if self.lost is not None:
            raise Unavailable(self.lost)
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = fut
        try:
            async with self._lock:
                try:
                    await _send(self._writer, (req_id, op, args))
                except (RuntimeError, OSError) as exc:  # "transport closed", a broken pipe
                    self._lose(f"the engine process went away ({exc})")
                    raise Unavailable(self.lost) from None
            return await (asyncio.wait_for(fut, timeout) if timeout is not None else fut)
        except asyncio.CancelledError:
            # (wait_for cancels `fut` itself as it goes: an answer is a result, not a cancel)
            answered = fut.done() and not fut.cancelled()
            if op in CANCELLABLE and not answered and self.lost is None:
                task = asyncio.get_running_loop().create_task(self._cancel(req_id))
                self._cancels.add(task)  # referenced until done (the loop keeps weak ones)
                task.add_done_callback(self._cancels.discard)
            raise
        finally:
            self._waiting.pop(req_id, None)

    async def _cancel(self, req_id: int) -> None:
        try:
            async with self._lock:
                await _send(self._writer, (0, CANCEL, (req_id,)))
        except (RuntimeError, OSError):
            pass  # the link is gone: so is the engine's work for it

    async def close(self) -> None:
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()


async def _apply_to_live(live, build_id: str, writes: Sequence[ShardWrite],
                         timeout: Optional[float]) -> list:
    """Writes a front end routed for `build_id` while the engine switched the collection to
    `live` (the front end hears of the switch a moment later): each goes to the shard the live
    build places it on - a shard count that changed places documents elsewhere (outside QA:
    writes in flight during a 2 -> 3 shard publish were stored on the old layout's shard, so
    their deletes missed them and deleted documents came back; 3 -> 2 failed with an
    IndexError). Vectors embedded for another model than the live build's are refused."""
    desc = live.desc
    for w in writes:
        if w.op == "upsert" and w.model_id and w.model_id != desc.model_id:
            raise Unavailable(f"collection {desc.collection!r} switched from build {build_id} to "
                              f"{desc.build_id} (model {desc.model_id!r}) while this write, "
                              f"embedded with {w.model_id!r}, was on its way: send it again")
    by_shard: dict[int, list[int]] = {}
    for i, w in enumerate(writes):
        by_shard.setdefault(shard_of(w.tenant, w.doc_id, desc.shards), []).append(i)
    out: list = [None] * len(writes)
    for shard_no, idx in by_shard.items():
        for i, outcome in zip(idx, await live.shards[shard_no].apply([writes[i] for i in idx],
                                                                      timeout)):
            out[i] = outcome
    return out


class EngineShard:
    """The shard interface, answered by the engine process. Queries submitted in one event-loop
    turn (concurrent requests of this front end) go to the engine as one message."""

    def __init__(self, client: EngineClient, collection: str, shard_no: int, build_id: str = ""):
        self.client = client
        self.collection = collection
        self.shard_no = shard_no
        self.build_id = build_id  # the build this front end routes writes for
        self._pending: list[tuple[ShardQuery, asyncio.Future]] = []
        self._timeout: Optional[float] = None

    @property
    def cache_version(self) -> Optional[int]:
        return None  # the engine's index version is another process's: no caching over it

    async def search(self, queries: Sequence[ShardQuery], timeout: Optional[float] = None) -> list:
        loop = asyncio.get_running_loop()
        futs = []
        for q in queries:
            fut = loop.create_future()
            self._pending.append((q, fut))
            futs.append(fut)
        self._timeout = timeout if self._timeout is None or timeout is None else max(self._timeout, timeout)
        if len(self._pending) == len(queries):  # the first this turn: flush at the turn's end
            loop.call_soon(self._flush)
        results = await asyncio.gather(*futs, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, SearchError):
                raise r
        whole = [r for r in results if isinstance(r, Unavailable) and getattr(r, "whole_call", False)]
        if whole:
            raise whole[0]
        return results

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        timeout, self._timeout = self._timeout, None
        pending = [(q, fut) for q, fut in pending if not fut.done()]  # callers gone this turn
        if not pending:
            return
        by_build: dict[str, list] = {}
        for q, fut in pending:
            by_build.setdefault(q.build_id, []).append((q, fut))
        for build_id, items in by_build.items():
            call = asyncio.get_running_loop().create_task(self._send(build_id, items, timeout))
            left = [len(items)]

            def gone(fut, call=call, left=left):  # every caller of the message went away
                if fut.cancelled():
                    left[0] -= 1
                    if left[0] == 0:
                        call.cancel()  # (the client tells the engine)

            for _, fut in items:
                fut.add_done_callback(gone)

    async def _send(self, build_id: str, items: list, timeout: Optional[float]) -> None:
        try:
            answers = await self.client.call("search", self.collection, build_id, self.shard_no,
                                             [q for q, _ in items], timeout)
        except SearchError as exc:
            exc.whole_call = True
            answers = [exc] * len(items)
        except BaseException as exc:  # nothing may leave a caller's future unresolved
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(exc)
            raise
        for (_, fut), a in zip(items, answers):
            if not fut.done():
                fut.set_result(a)

    async def fetch(self, request: FetchRequest, timeout: Optional[float] = None) -> list:
        return await self.client.call("fetch", self.collection, self.shard_no, request, timeout)

    async def apply(self, writes: Sequence[ShardWrite], timeout: Optional[float] = None) -> list:
        # the build it was routed for: the engine may have switched since (engine_link._apply_to_live)
        return await self.client.call("apply", self.collection, self.build_id, self.shard_no,
                                      list(writes), timeout)

    async def stored_versions(self, keys: Sequence[tuple[str, str]],
                              timeout: Optional[float] = None) -> StoredVersions:
        return await self.client.call("versions", self.collection, self.build_id, self.shard_no,
                                      list(keys), timeout)

    async def info(self, tenant: Optional[str] = None, digest: bool = False,
                   timeout: Optional[float] = None):
        """The engine's ShardInfo of this shard; an engine that does not answer within `timeout`
        is this shard unreachable, as a hung remote shard is (review: the link's own TimeoutError
        reached the caller as INTERNAL, where CollectionStats lists the shard and goes on)."""
        try:
            return await self.client.call("info", self.collection, self.shard_no, tenant, digest,
                                          timeout, timeout=timeout)
        except asyncio.TimeoutError:
            raise ShardUnreachable(f"shard {self.shard_no}: the engine process did not answer "
                                   f"ShardInfo within {timeout:.1f} s") from None

    async def close(self) -> None:
        pass  # the client is closed by the front end


def _attach(core, client: EngineClient, desc_json: str) -> None:
    from server.core.collection import ReleaseDescriptor

    desc = ReleaseDescriptor.from_json(desc_json, Path(client.path))
    core.attach(LoadedCollection(desc, [EngineShard(client, desc.collection, i, desc.build_id)
                                        for i in range(desc.shards)], direct_writes=True))


# --- processes ---------------------------------------------------------------------------------
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_engine_with_frontends(cfg: ServerConfig, device, tls) -> None:
    """The engine here; N front ends as child processes on one port."""
    from server.core.service import SearchCore
    from server.transport import app

    port = cfg.listen.port or _free_port(cfg.listen.host)
    core = SearchCore(cfg, None, None, device)
    core.load()
    sweep_socket_dirs()
    sock_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    path = os.path.join(sock_dir, "engine.sock")

    async def main():
        engine = EngineServer(core, path, cfg.listen.workers)
        core.builds.on_switch = engine.announce
        await engine.start()
        await core.start()
        note = app.start_metrics(cfg.listen.host, cfg.listen.metrics_port)
        if note:  # each front end serves its own request metrics on the next ports
            note += (f" (the engine's; front ends' on {cfg.listen.metrics_port + 1}-"
                     f"{cfg.listen.metrics_port + cfg.listen.workers})")
        argv = [a for a in sys.argv[1:] if a != "serve"]
        metrics = cfg.listen.metrics_port

        def spawn(i: int) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "server.main", "frontend",
                                     "--engine-socket", path, "--engine-pid", str(os.getpid()),
                                     "--frontends", str(cfg.listen.workers),
                                     *_frontend_args(argv, port),
                                     *(["--metrics-port", str(metrics + 1 + i)] if metrics else [])])

        children = [spawn(i) for i in range(cfg.listen.workers)]
        stop = asyncio.Event()
        failed: list[str] = []
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [loop.create_task(c) for c in core.background()]

        async def watch_frontends(ready: asyncio.Task) -> None:
            """A front end that exits is reaped and started again once the server has served;
            one that exits before the server ever served fails the start (the same cause would
            repeat: a port taken, a bad flag) instead of leaving the engine waiting for it, and
            so does one that keeps exiting (RESTARTS_PER_MINUTE): the orchestrator restarts the
            whole server rather than this loop restarting a front end for ever."""
            restarts: list[float] = []
            while not stop.is_set():
                await asyncio.sleep(0.5)
                for i, c in enumerate(children):
                    code = c.poll()
                    if code is None or stop.is_set():
                        continue
                    now = loop.time()
                    restarts[:] = [t for t in restarts if now - t < 60.0]
                    if not ready.done() or ready.exception() is not None:
                        failed.append(f"front end {i} (pid {c.pid}) exited with status {code} "
                                      "before serving")
                    elif len(restarts) >= RESTARTS_PER_MINUTE:
                        failed.append(f"front end {i} (pid {c.pid}) exited with status {code}, "
                                      f"the {len(restarts) + 1}th front-end exit within a minute")
                    if failed:
                        stop.set()
                        return
                    restarts.append(now)
                    log.error("front end %d (pid %d) exited with status %s: starting it again",
                              i, c.pid, code)
                    children[i] = spawn(i)

        try:
            waiter = loop.create_task(engine.wait_ready(600))
            tasks.append(loop.create_task(watch_frontends(waiter)))
            done, _ = await asyncio.wait({waiter, loop.create_task(stop.wait())},
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiter in done and waiter.exception() is None:
                print(f"search-server listening on {cfg.listen.host}:{port} ({cfg.listen.workers} "
                      f"front-end processes, one engine){note}{app.loop_note()}", flush=True)
            await stop.wait()
        finally:
            # the front ends' own stops, then ours (their 10 s margin below included)
            app.arm_stop_watchdog(extra_s=10.0)
            stop.set()  # the watcher restarts no front end from here on
            for c in children:  # front ends drain their calls; the engine answers until they exit
                if c.poll() is None:
                    c.send_signal(signal.SIGTERM)
            async def reap(c: subprocess.Popen) -> None:
                try:
                    await asyncio.wait_for(loop.run_in_executor(None, c.wait),
                                           cfg.listen.shutdown_delay_s + cfg.listen.shutdown_grace_s + 10)
                except asyncio.TimeoutError:
                    c.kill()

            await asyncio.gather(*(reap(c) for c in children))  # at once: one wait in all
            for t in tasks:
                t.cancel()
            await engine.close()
            await core.close()
        if failed:
            raise SystemExit(f"search-server: error: {failed[0]}")

    try:
        app.run(main(), cfg.listen)
    finally:
        try:
            os.unlink(path)
            os.rmdir(sock_dir)
        except OSError:
            pass


SOCKET_DIR_PREFIX = "search-engine-"


def sweep_socket_dirs(tmp: Optional[str] = None) -> list[str]:
    """Remove the socket directories (`search-engine-<pid>-*` in the temporary directory) of
    engines that died without removing theirs (SIGKILL, a lost host's restart of the
    container): this user's, whose process is gone. A pid in use again is left alone - a
    directory too many, never a live engine's socket taken away. Returns what was removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for entry in Path(tmp).glob(f"{SOCKET_DIR_PREFIX}*-*"):
        pid = entry.name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or entry.is_symlink() or entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its engine is gone - unless the pid is another PID
            if _listening(entry / "engine.sock"):  # namespace's (a /tmp shared by containers)
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        except OSError:  # gone meanwhile, or a pid of another user's (alive): not ours to remove
            continue
    return removed


def _listening(path: Path) -> bool:
    """Whether an engine answers on this Unix socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _frontend_args(argv: list[str], port: int) -> list[str]:
    """The parent's own flags for its children, with the chosen port and one worker each."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--port", "--workers", "--metrics-port"):
            skip = True
            continue
        if a.startswith(("--port=", "--workers=", "--metrics-port=")):
            continue
        out.append(a)
    return out + ["--port", str(port), "--workers", "1"]


def stop_with_the_engine(engine_pid: int) -> None:
    """Linux: have the kernel send this front end SIGTERM when the engine, its parent, dies,
    however it dies (outside QA: a front end started again just before the engine was killed
    with SIGKILL kept retrying its socket for a minute, holding the port); and if the engine
    (`engine_pid`) died before that was set, stop now. Elsewhere the lost connection
    (`on_lost`) or the connect timeout stops it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if engine_pid and os.getppid() != engine_pid:
        raise SystemExit(f"search-server frontend: the engine (pid {engine_pid}) has gone")


def run_frontend(cfg: ServerConfig, device, engine_socket: str) -> None:
    from server.core.service import SearchCore
    from server.roles import load_models, make_auth
    from server.transport import app

    embedder, reranker = load_models(cfg, device)
    core = SearchCore(cfg, embedder, reranker, device)
    tls = app.TLSConfig.from_config(cfg.listen)

    def engine_lost(why: str) -> None:
        # nothing here can answer a search without the engine: stop (SIGTERM drains what is
        # left) so the port, the health check and the metrics port are free for a restart
        log.error("front end %d stops: %s", os.getpid(), why)
        os.kill(os.getpid(), signal.SIGTERM)

    async def setup():
        def pushed(msg) -> None:
            if msg[0] == "unloadable":  # a collection the engine could not load
                core.registry.mark_unloadable(msg[1], msg[2])
            else:
                _attach(core, client, msg[1])

        client = EngineClient(engine_socket, on_push=pushed, on_lost=engine_lost)
        await client.connect()
        core.engine = client
        for desc_json in await client.call("collections"):
            _attach(core, client, desc_json)
        for name, why in (await client.call("unloadable")).items():
            core.registry.mark_unloadable(name, why)  # callers hear why, as from the engine

    async def main():
        await setup()

        async def announce_ready():  # runs once the port is served
            await core.engine.call("ready")

        # the function, not a coroutine: a front end refused its port made none to leave
        # never awaited
        await app.serve_forever(core, make_auth(cfg), cfg.listen.host, cfg.listen.port,
                                cfg.listen.metrics_port, ready_message=False, tls=tls,
                                grace=cfg.listen.shutdown_grace_s, reuse_port=True,
                                delay=cfg.listen.shutdown_delay_s, background=(announce_ready,))
        await core.engine.close()
        if core.engine.lost:
            raise SystemExit(3)  # the engine went away: not a clean stop

    app.run(main(), cfg.listen)
