"""`search-server`: serve collections.

  serve   the embedded default: front end and shard engine in one process (or, with --workers N,
          N front-end processes on one port feeding one engine process), over every published
          collection
  shard   one shard of one build, over proto/shard.proto (a shard server of a distributed
          deployment); with --nats it applies the replicated write log
  router  query embedding, fan-out (hedged, over replica sets), fusion, rerank and assembly, in
          front of shard servers listed in a topology file or with --replicas; with --nats it
          accepts writes and appends them to the replicated write log
  config  print the effective configuration (defaults < --config FILE < environment < flags)
  health  exit 0 when a server answers SERVING (container health checks)

Every option is a field of the typed configuration in server/config.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional


ROLES = ("serve", "shard", "router")  # whose configuration `config --role` prints


def build_parser(internal: bool = False, config_role: str = "serve") -> argparse.ArgumentParser:
    """The command line; `internal` adds `frontend`, which `serve --workers N` starts itself (so a
    user's typo is never offered it). `config_role`: the role `config --role` names (its short
    flag names, e.g. a shard's --collection, are then `config`'s too)."""
    from server.config import add_flags, optional_path

    p = argparse.ArgumentParser(prog="search-server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # the metavar lists the commands users run (not the internal `frontend`)
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{serve,shard,router,config,health}")
    add_flags(sub.add_parser("serve", help="embedded default: front end and shards in one process"),
              "serve")
    add_flags(sub.add_parser("shard", help="serve one shard of a build to routers"), "shard")
    add_flags(sub.add_parser("router", help="front shard servers: embed, fan out with hedging, "
                                            "fuse, rerank"), "router")
    c = sub.add_parser("config", help="print the effective configuration as TOML")
    c.add_argument("--print", action="store_true", help="print it (the default)")
    c.add_argument("--role", choices=ROLES, default="serve",
                   help="whose configuration: its defaults differ (a shard listens on 50061) "
                        "(default %(default)s)")
    add_flags(c, "config", config_role)
    h = sub.add_parser("health", help="exit 0 when a server answers SERVING (container probes)")
    h.add_argument("--address", default="127.0.0.1:50051", help="the server (default %(default)s)")
    h.add_argument("--service", default="",
                   help='a service name; empty: the server is ready (a shard: caught up on its '
                        'log; the default); "liveness": its event loop answers (liveness probes)')
    h.add_argument("--timeout", type=float, default=3.0, help="seconds (default %(default)s)")
    h.add_argument("--tls-ca", type=optional_path, default=None,
                   help="the server speaks TLS: trust this CA")
    h.add_argument("--tls-cert", type=optional_path, default=None,
                   help="client certificate (mutual TLS)")
    h.add_argument("--tls-key", type=optional_path, default=None, help="key of --tls-cert")
    if internal:  # the front-end worker of `serve --workers N` (started by serve itself)
        f = sub.add_parser("frontend")
        f.add_argument("--engine-socket", required=True)
        f.add_argument("--engine-pid", type=int, default=0,
                       help="stop at once if this process (the engine) is not the parent")
        f.add_argument("--frontends", type=int, default=1,
                       help="front ends of the server: each runs its models on that share of "
                            "the cores")
        add_flags(f, "serve")
    return p


class _QuietFaissLoader(logging.Filter):
    """faiss logs which SIMD build it loaded at INFO on every start: noise for operators."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("faiss") and record.levelno <= logging.INFO)


def health(address: str, service: str, timeout: float, tls_ca: Optional[Path] = None,
           tls_cert: Optional[Path] = None, tls_key: Optional[Path] = None) -> int:
    """The gRPC health check, for HEALTHCHECK lines and probes: 0 if SERVING, 1 otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from server.client import open_channel

    channel = open_channel(address, tls_ca, tls_cert, tls_key)
    try:
        with channel as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=timeout)
    except grpc.RpcError as err:
        print(f"{address}: {err.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv=None) -> None:
    from server.backends.threads import limit_openmp_spinning

    limit_openmp_spinning()  # before anything loads torch's or faiss's OpenMP runtime
    from server.config import load_config

    argv = sys.argv[1:] if argv is None else list(argv)
    role = "serve"
    if argv[:1] == ["config"]:  # the role decides what config's short flags mean
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--role", choices=ROLES, default="serve")
        role = pre.parse_known_args(argv[1:])[0].role
    args = build_parser(internal=argv[:1] == ["frontend"], config_role=role).parse_args(argv)
    if args.command == "health":
        try:
            raise SystemExit(health(args.address, args.service, args.timeout, args.tls_ca,
                                    args.tls_cert, args.tls_key))
        except ValueError as exc:  # a TLS flag without its pair, an unreadable file
            print(f"search-server health: error: {exc}", file=sys.stderr)
            raise SystemExit(2)
    command = args.command if args.command != "frontend" else "serve"
    try:
        cfg = load_config(command, args, defaults_of=args.role if command == "config" else None)
        if args.command != "config":
            from server.transport.app import event_loop_runner

            event_loop_runner(cfg.listen.event_loop)  # a bad choice fails now, not after loading
    except ValueError as exc:
        raise SystemExit(f"search-server: {exc}")
    if args.command == "config":
        try:
            print(cfg.to_toml(args.role), flush=True)
        except BrokenPipeError:  # `config --print | head`
            from server.client import stdout_reader_gone

            stdout_reader_gone()
        return
    logging.basicConfig(level=cfg.listen.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_QuietFaissLoader())
    from server import roles
    from server.errors import SearchError

    try:
        if args.command == "serve":
            roles.run_serve(cfg)
        elif args.command == "frontend":
            roles.run_frontend(cfg, args.engine_socket, args.engine_pid, args.frontends)
        elif args.command == "shard":
            roles.run_shard(cfg)
        else:
            roles.run_router(cfg)
    except (SearchError, ValueError, OSError) as exc:  # bad paths, permissions: say which, exit 2
        print(f"search-server {args.command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
