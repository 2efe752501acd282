"""Run the real gRPC server inside another program, on its own event loop in a background thread.

Used by the tests and the benchmarks to drive a SearchCore over a real loopback socket.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable, Optional

from server.transport.app import TLSConfig, start_server
from server.transport.auth import AnonymousAuth, Authenticator


class ServerThread:
    """`ServerThread(core).start()` serves `core` on 127.0.0.1 (an ephemeral port) until stop().

    `setup` (a coroutine function) runs inside the loop before serving, e.g. connecting a router to
    its shards. `native_id` is the event loop thread's OS id (per-thread CPU accounting)."""

    def __init__(self, core, auth: Optional[Authenticator] = None,
                 setup: Optional[Callable[[], Awaitable[None]]] = None,
                 tls: Optional[TLSConfig] = None):
        self.core, self.auth, self.setup, self.tls = core, auth or AnonymousAuth(), setup, tls
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="grpc-server")
        self.port: Optional[int] = None
        self.native_id: Optional[int] = None
        self.error: Optional[BaseException] = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.native_id = threading.get_native_id()

        async def boot():
            if self.setup is not None:
                await self.setup()
            await self.core.start()
            self.running = await start_server(self.core, self.auth, "127.0.0.1", 0, self.tls)
            self.port = self.running.port

        try:
            self.loop.run_until_complete(boot())
        except BaseException as exc:  # surfaced to the caller by start()
            self.error = exc
            self.started.set()
            return
        self.started.set()
        self.loop.run_forever()

    def start(self, timeout: float = 120.0) -> "ServerThread":
        self.thread.start()
        self.started.wait(timeout)
        if self.error:
            raise self.error
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 60.0) -> None:
        """Stop serving and close the core (RunningServer.stop), then end the loop's default
        executor (build switches and compaction run there) and the loop itself."""
        asyncio.run_coroutine_threadsafe(self.running.stop(1.0), self.loop).result(timeout)
        asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(),
                                         self.loop).result(timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        self.loop.close()


def serve_config(data_dir, **sections):
    """The configuration `search-server serve` builds (server/config.py), with some sections
    changed, e.g. serve_config(data, engine={"max_batch": 8})."""
    from server.config import default_config

    return default_config("serve").replace(
        storage={"data_dir": data_dir, **sections.pop("storage", {})}, **sections)


def start_core_server(data_dir, embedder=None, reranker=None, auth=None, tls=None,
                      **sections) -> ServerThread:
    """A loaded SearchCore on the CPU device, served over loopback gRPC from a background thread."""
    from server.backends.device import Device
    from server.core.service import SearchCore

    core = SearchCore(serve_config(data_dir, **sections), embedder, reranker, Device("cpu"))
    core.load()
    return ServerThread(core, auth, tls=tls).start()
