"""The processes `search-server` runs, wired from one ServerConfig: the embedded default (`serve`),
its multi-process form (`serve --workers N`: an engine process and N front ends), a shard server
(`shard`) and a router (`router`)."""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from server.backends.device import Device
from server.config import ServerConfig

log = logging.getLogger(__name__)


def load_models(cfg: ServerConfig, device: Device):
    """The embedder (packaged MiniLM unless configured; none with `--embedder none`) and the
    optional cross-encoder; both from local directories only."""
    from server.backends.models import CrossEncoder, Embedder
    from server.backends.threads import model_threads_now
    from server.core import metrics

    m = cfg.models
    embedder = None
    if (m.embedder or "").lower() != "none":
        embedder = Embedder(Path(m.embedder) if m.embedder else None, device, m.embedder_backend,
                            model_name=m.embedder_name)
    reranker = CrossEncoder(m.reranker, device, m.reranker_backend) if m.reranker else None
    if embedder is not None or reranker is not None:
        metrics.MODEL_THREADS.set(model_threads_now())
    return embedder, reranker


def make_auth(cfg: ServerConfig):
    from server.transport.auth import AnonymousAuth, TokenFileAuth

    return TokenFileAuth(cfg.auth.auth_tokens) if cfg.auth.auth_tokens else AnonymousAuth(cfg.auth.tenant)


def _device(cfg: ServerConfig) -> Device:
    device = Device(cfg.device.device)
    log.info("device: %s", device.describe())
    return device


def run_serve(cfg: ServerConfig) -> None:
    from server.core.service import SearchCore
    from server.transport import app

    device = _device(cfg)
    tls = app.TLSConfig.from_config(cfg.listen)
    if cfg.listen.workers > 1:
        from server.transport.engine_link import run_engine_with_frontends

        run_engine_with_frontends(cfg, device, tls)
        return
    embedder, reranker = load_models(cfg, device)
    core = SearchCore(cfg, embedder, reranker, device)
    core.load()
    app.run(app.serve_forever(core, make_auth(cfg), cfg.listen.host, cfg.listen.port,
                              cfg.listen.metrics_port, tls=tls, grace=cfg.listen.shutdown_grace_s,
                              delay=cfg.listen.shutdown_delay_s),
            cfg.listen)


def run_frontend(cfg: ServerConfig, engine_socket: str, engine_pid: int = 0,
                 frontends: int = 1) -> None:
    from server.backends.threads import share_cores_with
    from server.transport.engine_link import run_frontend as frontend, stop_with_the_engine

    stop_with_the_engine(engine_pid)  # first: loading models takes seconds
    share_cores_with(frontends)  # the models of N front ends split the cores, not each take all
    frontend(cfg, _device(cfg), engine_socket)


def run_shard(cfg: ServerConfig) -> None:
    from server.transport import app
    from server.transport.shard_server import serve_shard

    app.run(serve_shard(cfg, _device(cfg)), cfg.listen)


def run_router(cfg: ServerConfig) -> None:
    import grpc

    from server.core.replicas import HedgePolicy
    from server.core.service import SearchCore
    from server.transport import app
    from server.transport.router import (connect_router, follow_builds, load_topology,
                                         router_health)
    from server.transport.shard_rpc import read_token

    r = cfg.router
    if r.topology:
        collection, replicas = load_topology(r.topology)
    elif r.replicas and r.router_collection:
        collection = r.router_collection
        replicas = [[a.strip() for a in spec.split(",") if a.strip()] for spec in r.replicas]
    else:
        raise ValueError("router needs --topology FILE, or --collection NAME with --replicas")
    device = _device(cfg)
    embedder, reranker = load_models(cfg, device)
    policy = HedgePolicy(enabled=r.hedge, hedge_min_ms=r.hedge_min_ms, hedge_max_ms=r.hedge_max_ms,
                         hedge_budget=r.hedge_budget, hedge_burst=r.hedge_burst,
                         stall_ms=r.hedge_stall_ms)
    credentials = None
    if r.shard_tls_ca:
        credentials = grpc.ssl_channel_credentials(
            r.shard_tls_ca.read_bytes(), r.shard_tls_key.read_bytes() if r.shard_tls_key else None,
            r.shard_tls_cert.read_bytes() if r.shard_tls_cert else None)
    token = read_token(cfg.auth.shard_token_file)
    tls = app.TLSConfig.from_config(cfg.listen)
    holder: dict = {}

    async def main():
        write_log = None
        if cfg.replication.nats:
            from server.replication.log import ReplicatedWriteLog

            write_log = await ReplicatedWriteLog.connect(cfg.replication, collection)
            await write_log.check_layout(len(replicas))
        core = SearchCore(cfg, embedder, reranker, device, write_log)
        holder["core"] = core
        await connect_router(core, collection, replicas, policy, cfg.router.shards_wait_s,
                             credentials=credentials, token=token)

        health = router_health(lambda: holder["running"], takes_writes=write_log is not None)
        await app.serve_forever(core, make_auth(cfg), cfg.listen.host, cfg.listen.port,
                                cfg.listen.metrics_port, tls=tls, grace=cfg.listen.shutdown_grace_s,
                                delay=cfg.listen.shutdown_delay_s,
                                background=(follow_builds(core, collection, health=health),),
                                on_running=lambda running: holder.__setitem__("running", running))
        if write_log is not None:
            await write_log.close()

    app.run(main(), cfg.listen)


def default_replica_id(cfg: ServerConfig) -> str:
    """--replica-id, else the pod/host name (stable in a StatefulSet), with the port (or, for an
    ephemeral port, the pid) so replicas sharing a host and a data volume stay apart."""
    if cfg.shard.replica_id:
        return cfg.shard.replica_id
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}-{cfg.listen.port or os.getpid()}"


