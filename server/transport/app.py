"""Build and run the gRPC server: services, health, reflection, metrics, graceful shutdown."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.config import ListenConfig
from server.core import limits
from server.core.service import SearchCore
from server.rpc import search_pb2, shard_pb2
from server.transport.auth import Authenticator
from server.transport.errors import Lifecycle, add_service
from server.transport.servicers import AdminServicer, SearchServicer

log = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_runner(event_loop: str = "auto"):
    """`asyncio.run` or `uvloop.run` for --event-loop; ValueError for a name it does not know or
    uvloop asked for and missing (checked at start-up, before any index loads). uvloop (libuv)
    runs the loop's own work - callbacks, timers, socket readiness - in C; the event loop is the
    one thread every request passes through, and on 2 cores it answered 4-9% more queries/s
    (docs/BENCHMARKS.md)."""
    if event_loop not in EVENT_LOOPS:
        raise ValueError(f"--event-loop {event_loop!r}: use one of {', '.join(EVENT_LOOPS)}")
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise ValueError("--event-loop uvloop: uvloop is not installed "
                                 "(pip install uvloop)") from None
        else:
            return uvloop.run
    return asyncio.run


def run(main, listen: ListenConfig):
    """Run a server's main coroutine to the end on the configured event loop. Once a stop signal
    arrives (`arm_stop_watchdog`), the whole stop - draining, closing the core, the loop's own
    clean-up - has --shutdown-delay-s + --shutdown-grace-s + --shutdown-limit-s."""
    global _stop_budget_s, _watchdog
    tune_garbage_collector(listen.gc_threshold)
    _stop_budget_s = (listen.shutdown_delay_s + listen.shutdown_grace_s + listen.shutdown_limit_s
                      if listen.shutdown_limit_s > 0 else 0.0)
    try:
        return event_loop_runner(listen.event_loop)(main)
    finally:  # this run's stop is over: nothing after it is timed by it (review)
        if _watchdog is not None:
            _watchdog.cancel()
        _watchdog, _stop_budget_s = None, 0.0


_stop_budget_s = 0.0  # set by run(); 0 = no limit
_watchdog: Optional[threading.Timer] = None


def arm_stop_watchdog(extra_s: float = 0.0) -> None:
    """Called as a stop signal arrives: a process still stopping after its budget (plus
    `extra_s`) logs why and exits with status 1. Outside QA found shard servers and engines, hung
    by a (since fixed) deadlock, still up 20 s after SIGTERM, needing SIGKILL; a stop that waits
    for a hung device thread would do the same. A thread, not a loop timer: the wait may block
    the loop itself (a thread pool's shutdown). Acknowledged writes are durable either way."""
    global _watchdog
    if _stop_budget_s <= 0 or _watchdog is not None:
        return
    budget = _stop_budget_s + extra_s
    _watchdog = threading.Timer(budget, _exit_stuck, args=(budget,))
    _watchdog.daemon = True
    _watchdog.start()


def _exit_stuck(budget: float) -> None:
    stuck = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    log.error("the process did not stop within %.0f s of the stop signal (--shutdown-limit-s): "
              "exiting now with status 1 (threads still running: %s)", budget,
              ", ".join(sorted(set(stuck)))[:500])
    logging.shutdown()
    os._exit(1)


def tune_garbage_collector(threshold: int) -> None:
    """Collect young objects after `threshold` allocations instead of Python's 700 (0 keeps it).

    Requests allocate many short-lived containers, nearly all freed by reference counting, but a
    SearchBatch holds enough of them at once that at 700 the collector ran ~80 times per batch of
    1,000 queries, each collection holding the GIL that the event loop and the searching threads
    share: 38 us of every query's ~240 us in process (docs/BENCHMARKS.md, fourteenth session).
    Nothing is frozen (gc.freeze): a build loaded before serving sits in reference cycles that
    only the collector frees, and frozen it would stay in memory after its successor replaced it
    (review)."""
    if threshold <= 0:
        return
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)


def loop_note() -> str:
    """For the "listening on" line: which event loop serves (uvloop or asyncio)."""
    return f" [event loop: {type(asyncio.get_running_loop()).__module__.split('.')[0]}]"

SERVICES = (search_pb2.DESCRIPTOR.services_by_name["SearchService"].full_name,
            search_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name)
SEARCH_SERVICE = SERVICES[0]

@dataclass(frozen=True)
class TLSConfig:
    """Server TLS: certificate chain and key (PEM files); with client_ca, clients must present a
    certificate signed by it (mutual TLS, e.g. router -> shard)."""

    cert: Path
    key: Path
    client_ca: Optional[Path] = None

    @classmethod
    def from_config(cls, listen) -> Optional["TLSConfig"]:
        if bool(listen.tls_cert) != bool(listen.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(listen.tls_cert, listen.tls_key, listen.tls_client_ca) if listen.tls_cert else None

    def credentials(self) -> grpc.ServerCredentials:
        ca = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


def _listen(server: grpc.aio.Server, host: str, port: int, tls: Optional[TLSConfig]) -> int:
    address = f"{host}:{port}"
    why = "the address is in use or not available here" + (
        ", or --tls-cert/--tls-key are not a valid certificate and key" if tls is not None else "")
    try:
        bound = (server.add_secure_port(address, tls.credentials()) if tls is not None
                 else server.add_insecure_port(address))
    except RuntimeError:  # grpcio's "Failed to bind to address": a traceback, not a message
        bound = 0
    if bound == 0:  # an OSError: the command line says it in one line and exits 2
        raise OSError(f"cannot listen on {address} (--host/--port): {why}")
    return bound


CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", limits.MAX_RESPONSE_BYTES),
    ("grpc.max_concurrent_streams", 1024),
]


SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"].full_name


# A health service name that answers SERVING for as long as the server's event loop runs - also
# while a shard catches up on its log (NOT_SERVING on "") or drains - so a liveness probe restarts
# a process whose loop is stuck, never one that is merely not ready.
LIVENESS = "liveness"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    core: object  # SearchCore (closed on stop), or None when the caller owns what it serves
    lifecycle: Lifecycle
    services: tuple = SERVICES
    servicer: object = None  # a shard server's servicer (its shard is swapped on a build switch)
    stopping: bool = False

    async def set_serving(self, serving: bool, names: Optional[tuple] = None) -> None:
        """Health of `names` (default: the server's, "" and each of its services)."""
        if serving and self.stopping:  # a server on its way out never turns SERVING again
            return
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in (("",) + self.services) if names is None else names:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0, delay: float = 0.0) -> None:
        """Flip health to NOT_SERVING; go on answering for `delay` seconds (load balancers and
        Kubernetes endpoints notice the flip only after a while, and until they do, calls keep
        arriving: refused at once, every rolling update failed some - outside QA); then answer
        new calls UNAVAILABLE, give in-flight calls `grace` seconds (calls still running then are
        answered UNAVAILABLE), stop the listener, drain the batch queues and close the core."""
        self.stopping = True
        for name in ("",) + self.services:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if delay > 0:
            log.info("health is NOT_SERVING; answering new calls for %.1f s more "
                     "(--shutdown-delay-s)", delay)
            await asyncio.sleep(delay)
        late = await self.lifecycle.drain(grace)
        if late:
            log.warning("%d calls were still running after the %.1f s grace period: answered "
                        "UNAVAILABLE", late, grace)
        await self.lifecycle.quiesce()
        await self.server.stop(1.0)
        if self.core is not None:
            await self.core.close()


async def start_server(core: SearchCore, auth: Authenticator, host: str = "127.0.0.1",
                       port: int = 0, tls: Optional[TLSConfig] = None,
                       reuse_port: bool = False) -> RunningServer:
    """The public services on host:port. `reuse_port`: several front-end processes share the
    port (SO_REUSEPORT, the kernel spreads connections over them)."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 1 if reuse_port else 0)])
    lifecycle = Lifecycle()
    add_service(server, SearchServicer(core, auth, lifecycle),
                search_pb2.DESCRIPTOR.services_by_name["SearchService"])
    add_service(server, AdminServicer(core, auth, lifecycle),
                search_pb2.DESCRIPTOR.services_by_name["AdminService"])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(SERVICES + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = _listen(server, host, port, tls)
    await server.start()
    status = (health_pb2.HealthCheckResponse.SERVING if core.ready
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("",) + SERVICES:
        await health_servicer.set(name, status)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, health_servicer, core, lifecycle)


async def start_shard_server(shard, host: str = "127.0.0.1", port: int = 0,
                             tls: Optional[TLSConfig] = None, token: Optional[str] = None,
                             status=None, serving: bool = True,
                             admission=None) -> RunningServer:
    """Serve one shard over proto/shard.proto, with health and reflection. Callers must present
    `token` (the shared router credential) unless mutual TLS authenticates them; neither is
    allowed only on loopback. `serving=False` keeps health NOT_SERVING (catching up on the log)."""
    from server.transport.shard_rpc import ShardAuth, ShardServicer

    auth = ShardAuth.for_listener(host, token, tls is not None and tls.client_ca is not None)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    lifecycle = Lifecycle()
    servicer = ShardServicer(shard, lifecycle, auth, status, admission)
    add_service(server, servicer, shard_pb2.DESCRIPTOR.services_by_name["ShardService"])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SHARD_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                        server)
    bound = _listen(server, host, port, tls)
    await server.start()
    running = RunningServer(server, bound, health_servicer, None, lifecycle, (SHARD_SERVICE,),
                            servicer)
    await running.set_serving(serving)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return running


async def wait_for_signal_then_stop(running: RunningServer, grace: float = 5.0,
                                    delay: float = 0.0) -> None:
    """SIGTERM (an orchestrator's) stops after `delay`; SIGINT (Ctrl-C) without it."""
    stop = asyncio.Event()
    received: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (received.append(s), stop.set()))
    await stop.wait()
    arm_stop_watchdog()
    log.info("shutting down: draining in-flight requests (grace %.1f s)", grace)
    await running.stop(grace, delay if received[0] == signal.SIGTERM else 0.0)


def start_metrics(host: str, metrics_port: Optional[int]) -> str:
    if metrics_port is None:
        return ""
    from prometheus_client import start_http_server

    try:
        start_http_server(metrics_port, addr=host)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{metrics_port} (--metrics-port): "
                      f"{exc.strerror or exc}") from None
    return f", metrics on http://{host}:{metrics_port}/metrics"





async def serve_forever(core: SearchCore, auth: Authenticator, host: str, port: int,
                        metrics_port: Optional[int], ready_message: bool = True,
                        setup=None, tls: Optional[TLSConfig] = None,
                        background: tuple = (), grace: float = 5.0, reuse_port: bool = False,
                        delay: float = 0.0, on_running=None) -> None:
    """`background`: coroutines, or coroutine functions, run for the server's life (alias
    watching, scheduled compaction, a router's build following). `on_running` is called with the
    RunningServer once it listens (e.g. to let a background task set its health)."""
    note = start_metrics(host, metrics_port)
    if setup is not None:  # e.g. connecting a router to its shard replicas, inside the loop
        await setup()
    await core.start()
    running = await start_server(core, auth, host, port, tls, reuse_port)
    if on_running is not None:
        on_running(running)
    if ready_message:
        print(f"search-server listening on {host}:{running.port}{note}{loop_note()}", flush=True)
    # a coroutine function is called here: a server that fails before this point leaves no
    # coroutine never awaited
    tasks = [asyncio.get_running_loop().create_task(c() if callable(c) else c)
             for c in tuple(background) + tuple(core.background())]
    try:
        await wait_for_signal_then_stop(running, grace, delay)
    finally:
        for t in tasks:
            t.cancel()
