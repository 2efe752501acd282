"""One typed configuration for every process: each default is written once, here.

The tree of dataclasses below is the whole configuration. Command-line flags are generated from it
(`--field-name`, help from the field's metadata), and so are environment variables (`SEARCH_` +
the field name in capitals, e.g. SEARCH_DATA_DIR) and the TOML file layout (`[section]`,
`field = value`; see `search-server config --print`). Precedence, lowest first:
defaults < --config FILE < environment < command-line flags.

Tests and benchmarks build the same `ServerConfig` the CLI does (`ServerConfig()` plus overrides),
so they run what production runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from server.core import limits

ENV_PREFIX = "SEARCH_"


def optional_path(text: str) -> Optional[Path]:
    """An argparse `type` for an optional file: an empty value (`--tls-cert ""`, a template's
    empty variable) leaves the flag unset; Path("") is the current directory, which was then
    read as the file (outside QA)."""
    return Path(text) if text else None


def opt(default: Any, help: str, **extra) -> Any:
    """A configuration field: its default and the help text its flag shows."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ListenConfig:
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = opt(50051, "gRPC port (0 = an ephemeral port, printed at start)", maximum=65535)
    metrics_port: Optional[int] = opt(None, "serve Prometheus metrics over HTTP on this port "
                                      "(serve --workers N: the front ends' request metrics on "
                                      "the next N ports)",
                                      maximum=65535)
    log_level: str = opt("INFO", "logging level", choices=("DEBUG", "INFO", "WARNING", "ERROR",
                                                           "CRITICAL"))
    shutdown_delay_s: float = opt(0.0, "on SIGTERM: seconds to go on answering new calls after "
                                       "health turns NOT_SERVING, so that load balancers and "
                                       "Kubernetes endpoints stop sending before calls are refused "
                                       "(~5 s behind a Service; 0 = refuse at once)")
    shutdown_grace_s: float = opt(5.0, "on SIGTERM, after --shutdown-delay-s: seconds in-flight "
                                       "calls get to finish (new calls and calls still running "
                                       "after it are answered UNAVAILABLE, which clients retry)")
    shutdown_limit_s: float = opt(30.0, "on SIGTERM or SIGINT, after the delay and the grace "
                                        "period: seconds the process may take to close its "
                                        "indexes, models and log before it exits anyway with "
                                        "status 1, logging why (a hung engine or device would "
                                        "otherwise keep it up; acknowledged writes are durable "
                                        "either way); 0 = wait for ever")
    max_inflight: int = opt(256, "admission control: searches and batches beyond this many in "
                                 "flight get RESOURCE_EXHAUSTED at once (writes have a budget of "
                                 "this size of their own; a shard server counts routers' queries "
                                 "against this plus --max-inflight-batched-queries; with serve "
                                 "--workers N, each front end admits this many)", minimum=1)
    max_inflight_batched_queries: int = opt(
        2048, "admission control by cost: a multi-query request (SearchBatch; a router's shard "
              "call) that would bring the queries of such requests in flight past this many gets "
              "RESOURCE_EXHAUSTED; single searches are never refused by it, so batches cannot "
              "starve them (with serve --workers N, each front end's own)", minimum=1)
    default_deadline_s: float = opt(30.0, "a search that brings no deadline gets this one (0 = "
                                          "none): a hung shard cannot hold it for ever")
    tls_cert: Optional[Path] = opt(None, "PEM certificate chain: serve TLS")
    tls_key: Optional[Path] = opt(None, "PEM private key of --tls-cert")
    tls_client_ca: Optional[Path] = opt(None, "require client certificates signed by this CA "
                                              "(mutual TLS)")
    workers: int = opt(1, "gRPC front-end processes on the port (SO_REUSEPORT) feeding one engine "
                          "process that owns the indexes (serve only; 1 = everything in one process)",
                          minimum=1)
    event_loop: str = opt("auto", "asyncio event loop: uvloop, asyncio, or auto (uvloop where it "
                                  "is installed)", choices=("auto", "uvloop", "asyncio"))
    gc_threshold: int = opt(50_000, "container objects allocated (net of those freed) before "
                                    "Python's youngest garbage collection; Python's default of "
                                    "700 collects many times per SearchBatch, each collection "
                                    "holding the GIL (0 = Python's default)", minimum=0)


@dataclass
class DeviceConfig:
    device: str = opt("auto", "where indexes and models run: auto, cpu or cuda",
                      choices=("auto", "cpu", "cuda"))
    faiss_threads: int = opt(1, "OpenMP threads per faiss call (requests already run in parallel; "
                                "per-call OpenMP made a 20k Flat search 3.3x slower on 2 cores)", minimum=1)


@dataclass
class ModelConfig:
    embedder: Optional[str] = opt(None, "local model directory of the query/passage embedder "
                                        "(default: the packaged all-MiniLM-L6-v2; 'none': no "
                                        "embedder, callers send vectors)")
    embedder_name: Optional[str] = opt(None, "model name for the model id (default: the directory "
                                             "name); the id must equal the collection's")
    embedder_backend: str = opt("torch", "torch or onnx", choices=("torch", "onnx"))
    reranker: Optional[Path] = opt(None, "local directory of a Hugging Face cross-encoder (enables "
                                         "rerank_depth)")
    reranker_backend: str = opt("torch", "torch or onnx", choices=("torch", "onnx"))
    rerank_cap: int = opt(200, "largest rerank_depth accepted")
    batch_max_size: Optional[int] = opt(None, "items per model call (default: 16 on CPU, where "
                                              "padding makes larger batches slower per item; 64 on "
                                              "CUDA)", minimum=1)
    batch_max_wait_ms: float = opt(2.0, "a model batch closes this long after its first item")
    embed_max_tokens: int = opt(16384, "tokens per embedding batch", minimum=1)
    rerank_max_tokens: int = opt(32768, "tokens per reranking batch", minimum=1)
    embedding_cache_size: int = opt(4096, "query embeddings kept (by model id, the caller's "
                                          "tenant and scopes, and text)")

    def max_batch(self, cuda: bool) -> int:
        return self.batch_max_size or (64 if cuda else 16)


@dataclass
class PipelineConfig:
    default_depth: int = opt(100, "candidates per retriever when a request names none", minimum=1,
                             maximum=limits.MAX_DEPTH)
    default_rrf_k: int = opt(60, "reciprocal rank fusion constant when a request names none", minimum=1,
                             maximum=limits.MAX_RRF_K)
    dedupe: bool = opt(True, "drop passages whose title and text (whitespace and case folded) "
                             "repeat one already in the context")
    collection_term_stats: bool = opt(True, "score BM25 with the whole collection's term "
                                            "statistics (one more round to every shard before a "
                                            "lexical or hybrid search of a collection of several "
                                            "shards), so rankings do not depend on how documents "
                                            "fall into shards; off = each shard's own")
    batch_chunk: int = opt(128, "a batch of queries (SearchBatch) runs as concurrent chunks of "
                                "this many, so assembling one chunk's answers overlaps the "
                                "search of the next; each chunk reaches a shard as one message "
                                "(0 = the whole batch as one; --workers front ends send what one "
                                "loop turn holds as one message either way)")
    retrieval_cache_size: int = opt(1024, "retrieval results kept (keyed by every shard's index "
                                          "version, so a write invalidates them)")
    text_top_n: Optional[int] = opt(None, "shards ship text for this many hits per list (default: "
                                          "the assembly/rerank window)")
    dense_feedback_docs: int = opt(5, "hybrid queries: fused hits whose vectors move the query "
                                      "vector before a second dense search (0 = off; a request "
                                      "may set its own)", maximum=limits.MAX_FEEDBACK_DOCS)
    dense_feedback_weight: float = opt(0.6, "weight of those hits' mean against the query vector", maximum=1)
    lexical_feedback_terms: int = opt(0, "lexical and hybrid queries: terms of the first feedback "
                                         "hits added to the BM25 query (RM3) before a second "
                                         "lexical search (0 = off: it did not win on both "
                                         "development collections, docs/BENCHMARKS.md)",
                                      maximum=limits.MAX_EXPANSION_TERMS)
    lexical_feedback_weight: float = opt(0.5, "boost of the strongest expansion term (a query "
                                              "term weighs 1)", maximum=limits.MAX_TERM_WEIGHT)


@dataclass
class EngineConfig:
    batching: bool = opt(True, "coalesce concurrent queries of one shard into one faiss call "
                               "(per restriction and depth)")
    max_batch: int = opt(64, "queries per faiss call", minimum=1)
    dispatch_timeout_ms: float = opt(1.0, "a batch closes this long after its first query when "
                                          "the index is busy (an idle index, or a free device "
                                          "thread, searches at once)")
    dense_workers: int = opt(0, "faiss calls that may run at once per shard; 0 = one per core "
                                "beyond the first (the front end's), up to 4, for an index on "
                                "the CPU; one for an index on a GPU")
    device_nice: int = opt(10, "niceness added to the threads that search a CPU index, so the "
                               "event loop every request passes through runs first when cores "
                               "are short (0 = same priority as the rest)", minimum=-20, maximum=19)
    search_threads: int = opt(8, "threads for record reads, statistics rounds and the "
                                 "pipeline's CPU work, and as many again for the BM25 searches "
                                 "of a batch", minimum=1)
    record_cache_rows: int = opt(50_000, "chunk records (text, ids, metadata) each shard keeps in "
                                         "memory for the hits it ships, least recently used out "
                                         "first; 0 = read every one from SQLite")
    record_cache_mb: int = opt(256, "at most this much text (MiB) in each shard's record cache, "
                                    "whatever --record-cache-rows allows (chunks written with "
                                    "texts of up to a million characters)", minimum=1)


@dataclass
class StorageConfig:
    data_dir: Path = opt(Path("data"), "directory holding the collections built by index-builder "
                                       "(may be read-only)")
    state_dir: Optional[Path] = opt(None, "where running shards write (BM25 segments and locks, "
                                          "SQLite WAL, streaming writes); default: DATA_DIR/.state "
                                          "(a shard server: DATA_DIR/.state/replicas/REPLICA_ID)")
    collection: list = opt([], "serve only these collections (repeatable; default: every "
                               "published one)")
    alias_poll_s: float = opt(2.0, "follow alias flips (index-builder publish) every N seconds; 0 "
                                   "= never")
    compact_interval_s: float = opt(0.0, "check every N seconds whether to compact (0 = only on "
                                         "request)")
    compact_min_tombstone_ratio: float = opt(0.2, "scheduled compaction runs when dead+orphan "
                                                  "rows reach this share", maximum=1)

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir) if self.state_dir else Path(self.data_dir) / ".state"


@dataclass
class AuthConfig:
    tenant: str = opt("default", "the tenant every caller belongs to when authentication is off")
    auth_tokens: Optional[Path] = opt(None, "JSON token file (server/transport/auth.py): callers "
                                            "present 'authorization: Bearer <token>'; their tenant, "
                                            "ACL scopes and roles come from it")
    shard_token_file: Optional[Path] = opt(None, "file holding the shared router credential: shard "
                                                 "servers require it from routers, routers send it")


@dataclass
class ShardConfig:
    shard_collection: Optional[str] = opt(None, "collection this shard server serves",
                                          flag="--collection")
    shard: Optional[int] = opt(None, "shard number within the build")
    build: Optional[str] = opt(None, "build id (default: the collection's live build, followed "
                                     "when it changes)")
    replica_id: Optional[str] = opt(None, "this replica's name (its durable log consumer); "
                                          "default: HOSTNAME-PORT")
    inject_delay_prob: float = opt(0.0, "fault injection (tests only): delay this share of searches",
                                   maximum=1)
    inject_delay_ms: float = opt(0.0, "fault injection: the delay")
    inject_fail_prob: float = opt(0.0, "fault injection: fail this share with UNAVAILABLE", maximum=1)
    inject_hang_prob: float = opt(0.0, "fault injection: hang this share until the deadline", maximum=1)
    inject_seed: Optional[int] = opt(None, "fault injection: random seed")


@dataclass
class RouterConfig:
    topology: Optional[Path] = opt(None, 'JSON {"collection": NAME, "shards": [["host:port", ...], '
                                         '...]}')
    router_collection: Optional[str] = opt(None, "collection (with --replicas)", flag="--collection")
    replicas: list = opt([], "comma-separated replica addresses of one shard; repeat in shard "
                              "order (SEARCH_REPLICAS: the shards separated by ';')", env_items=";")
    hedge: bool = opt(True, "hedge slow shard calls to a second replica")
    hedge_min_ms: float = opt(2.0, "earliest hedge delay")
    hedge_max_ms: float = opt(200.0, "latest hedge delay")
    hedge_budget: float = opt(0.10, "hedges per request on average (keep above 0.05: hedging at "
                                    "p95 wants ~5%)")
    hedge_burst: float = opt(10.0, "hedge tokens that can accumulate for a burst of slow calls")
    hedge_stall_ms: float = opt(1000.0, "a shard call with no answer this long is stalled: a second "
                                        "replica is tried even when the hedge budget is spent")
    shards_wait_s: float = opt(30.0, "at start: how long to wait for a replica of the shards to "
                                     "answer (shard servers loading a large build take minutes: "
                                     "give that long, and a startup probe longer still)")
    shard_tls_ca: Optional[Path] = opt(None, "reach shards over TLS, trusting this CA")
    shard_tls_cert: Optional[Path] = opt(None, "client certificate for mutual TLS to shards")
    shard_tls_key: Optional[Path] = opt(None, "key of --shard-tls-cert")


@dataclass
class ReplicationConfig:
    nats: list = opt([], "NATS server URLs of the JetStream write log (repeatable); none = the "
                         "embedded default, which needs no broker")
    stream_replicas: int = opt(1, "JetStream replicas of the write log (3 in production)", minimum=1)
    apply_batch: int = opt(256, "log entries a replica applies per group commit", minimum=1)
    publish_timeout_s: float = opt(5.0, "how long a write waits for the log to hold it")
    nats_creds: Optional[Path] = opt(None, "NATS user credentials file (.creds: JWT and nkey seed)")
    nats_token_file: Optional[Path] = opt(None, "file holding a NATS authorization token")
    nats_tls_ca: Optional[Path] = opt(None, "reach NATS over TLS, trusting this CA")
    nats_tls_cert: Optional[Path] = opt(None, "client certificate for mutual TLS to NATS")
    nats_tls_key: Optional[Path] = opt(None, "key of --nats-tls-cert")


@dataclass
class ServerConfig:
    listen: ListenConfig = field(default_factory=ListenConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    models: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)

    def replace(self, **sections: dict) -> "ServerConfig":
        """A copy with some fields changed: cfg.replace(storage={"data_dir": p})."""
        out = dataclasses.replace(self)
        for name, changes in sections.items():
            setattr(out, name, dataclasses.replace(getattr(self, name), **changes))
        return out

    def to_toml(self, role: Optional[str] = None) -> str:
        """The configuration as a TOML file; with `role`, only the sections that role reads."""
        lines = []
        types = _section_types()
        for sec in fields(self):
            if role is not None and sec.name not in COMMAND_SECTIONS[role]:
                continue
            lines.append(f"[{sec.name}]")
            for f in fields(types[sec.name]):
                value = getattr(getattr(self, sec.name), f.name)
                text = _toml_value(value)
                lines.append(f"{f.name} = {text}" if text is not None else f"# {f.name} = (unset)")
            lines.append("")
        return "\n".join(lines)


# Which sections each command reads (its flags are generated from these).
COMMAND_SECTIONS = {
    "serve": ("listen", "device", "models", "pipeline", "engine", "storage", "auth"),
    "shard": ("listen", "device", "engine", "storage", "auth", "shard", "replication"),
    "router": ("listen", "device", "models", "pipeline", "auth", "router", "replication"),
    "config": ("listen", "device", "models", "pipeline", "engine", "storage", "auth", "shard",
               "router", "replication"),
}
COMMAND_DEFAULTS = {"shard": {"listen": {"port": 50061}}}
SERVE_ONLY = {("listen", "workers"), ("storage", "collection"), ("storage", "compact_interval_s"),
              ("storage", "compact_min_tombstone_ratio")}
# Fields of a command's sections that the command does not use: it takes no flag for them (a
# flag accepted and ignored misled: `shard --auth-tokens` served without authentication; shard
# servers accept routers by --shard-token-file alone - outside QA)
UNUSED = {
    "serve": {("auth", "shard_token_file")},
    "shard": SERVE_ONLY | {("auth", "auth_tokens"), ("auth", "tenant"),
                           ("replication", "publish_timeout_s")},
    "router": SERVE_ONLY | {("replication", "apply_batch")},
}


# Of those, the ones a role must not be given at all (security: a shard handed SEARCH_AUTH_TOKENS
# served without authentication, as `shard --auth-tokens` did - outside QA): refused from a flag,
# the environment or a file. The others are ignored with a note when they come from the
# environment or a file, which one deployment may share between its roles.
REFUSED_UNUSED = {("auth", "auth_tokens"), ("auth", "tenant"), ("auth", "shard_token_file")}


def _unused(role: str, sec: str, name: str, where: str, set_: bool) -> bool:
    """Whether (sec, name) is a setting `role` does not use (of a section it does not read, or
    in UNUSED): refused (ValueError) when it is one of REFUSED_UNUSED and `set_` (given a value of
    its own), else True (to be ignored, with a note when set)."""
    if sec in COMMAND_SECTIONS[role] and (sec, name) not in UNUSED.get(role, ()):
        return False
    if (sec, name) in REFUSED_UNUSED and set_:
        raise ValueError(f"{where}: `{role}` does not use this setting (it would be ignored, "
                         f"which misleads); remove it for this process")
    if set_:
        print(f"search-server {role}: note: {where} is not used by `{role}`; ignored",
              file=sys.stderr)
    return True


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(ServerConfig)
    return {name: hints[name] for name in hints}


def _field_types(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _base_type(annotation) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _toml_value(value) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) or '""' for v in value) + "]"
    return json.dumps(str(value))


def _coerce(annotation, value, where: str):
    """A value from a file, the environment or a flag, as the field's type."""
    if value is None:
        return None
    base = _base_type(annotation)
    try:
        if base is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(f"not a boolean: {value!r}")
            return bool(value)
        if base is list:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return list(value)
        if base in (int, float, str, Path) and isinstance(value, str) and value == "" \
                and annotation is not str:
            # `--tls-cert ""` (or an empty env var in a manifest) was Path(""), the current
            # directory: a server that failed reading "." as a certificate
            if type(None) in typing.get_args(annotation):
                return None  # an optional field: empty = unset
            raise ValueError("is empty (leave it out to use the default)")
        if base is Path:
            return Path(value)
        if base in (int, float, str):
            if base is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError(f"not a whole number: {value!r}")
                return int(value)
            if base is float:
                if isinstance(value, bool):
                    raise ValueError(f"not a number: {value!r}")
                number = float(value)
                if not math.isfinite(number):
                    raise ValueError(f"not a finite number: {value!r}")
                return number
            return base(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return value


def _check_range(f: dataclasses.Field, value, where: str):
    """The value, checked. Numbers are >= 0 unless the field says otherwise (`minimum`, `maximum`
    metadata): a negative limit or cache size started a server that answered nothing; defaults
    past the request caps (a default depth of 5,000) started one whose every hybrid query was
    refused. A field with `choices` takes one of them, in any case (`--log-level debug`), as
    the choice's own spelling."""
    choices = f.metadata.get("choices")
    if choices and value is not None:
        match = next((c for c in choices if c.lower() == str(value).lower()), None)
        if match is None:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(choices)}")
        return match
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    low, high = f.metadata.get("minimum", 0), f.metadata.get("maximum")
    if (low is not None and value < low) or (high is not None and value > high):
        span = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{where}: {value!r} is out of range (must be {span})")
    return value


def _flag(section: str, f: dataclasses.Field, command: str = "") -> str:
    """A field's flag: its name, or the short alias a command knows it by (`--collection`), except
    for `config`, which takes every section at once and so needs names that cannot clash."""
    if command != "config" and f.metadata.get("flag"):
        return f.metadata["flag"]
    return "--" + f.name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, command: str, role: str = "serve") -> None:
    """Add the flags of every field of `command`'s sections (default: not given, so the merge
    below can tell a flag from a default). `config` takes its `role`'s flags (outside QA: it took
    every section's, so `config --role shard --embedder x` printed a setting no shard reads), by
    their full names and the role's own short names too (`config --role shard --collection docs`
    sets the shard's collection, as `shard --collection docs` does)."""
    parser.add_argument("--config", type=Path, default=None,
                        help="TOML configuration file (see `search-server config --print`)")
    types = _section_types()
    runs = command if command != "config" else role  # the role whose defaults and flags these are
    defaults = default_config(runs)
    for sec in COMMAND_SECTIONS[runs]:
        group = parser.add_argument_group(sec)
        for f in fields(types[sec]):
            if (sec, f.name) in UNUSED[runs]:
                continue
            annotation = _field_types(types[sec])[f.name]
            base = _base_type(annotation)
            default = getattr(getattr(defaults, sec), f.name)
            # argparse %-formats help strings: a literal % in the text must be doubled
            help_text = f"{f.metadata.get('help', '').replace('%', '%%')} [default: {default if default not in ([], None) else 'unset'}; env {ENV_PREFIX}{f.name.upper()}]"
            dest = f"{sec}.{f.name}"
            names = [_flag(sec, f, command)]
            if command == "config" and f.metadata.get("flag"):
                names.append(f.metadata["flag"])  # the role's own name for it
            if base is bool:
                group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_text)
            elif base is list:
                group.add_argument(*names, dest=dest, action="append",
                                   default=argparse.SUPPRESS, help=help_text,
                                   metavar=f.name.upper())
            else:
                group.add_argument(*names, dest=dest, type=str, default=argparse.SUPPRESS,
                                   help=help_text, metavar=f.name.upper())


def default_config(command: str = "serve") -> ServerConfig:
    cfg = ServerConfig()
    for sec, changes in COMMAND_DEFAULTS.get(command, {}).items():
        setattr(cfg, sec, dataclasses.replace(getattr(cfg, sec), **changes))
    return cfg


def load_config(command: str, args: Optional[argparse.Namespace] = None,
                environ: Optional[dict] = None, config_file: Optional[Path] = None,
                defaults_of: Optional[str] = None) -> ServerConfig:
    """Defaults < TOML file < environment < flags, each value checked against its field's type.
    `defaults_of`: start from that role's defaults (`config --print --role shard`) while reading
    every section the command takes."""
    environ = os.environ if environ is None else environ
    role = defaults_of or command  # whose settings these are (`config --role shard`: a shard's)
    cfg = default_config(role)
    types = _section_types()
    values: dict[tuple[str, str], Any] = {}
    path = config_file or (getattr(args, "config", None) if args is not None else None)
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"configuration file {path}: {exc}") from None
        for sec, table in data.items():
            if not isinstance(table, dict):
                raise ValueError(f"configuration file {path}: {sec!r} is outside any section: put "
                                 "it under its [section] (see `search-server config --print`)")
            if sec not in types:
                raise ValueError(f"configuration file {path}: unknown section [{sec}]")
            known = {f.name for f in fields(types[sec])}
            for key, value in table.items():
                if key not in known:
                    raise ValueError(f"configuration file {path}: unknown key {key!r} in [{sec}]")
                where = f"{path} [{sec}] {key}"
                # `cfg` holds the role's defaults until the values are applied below
                if _unused(role, sec, key, where, value != getattr(getattr(cfg, sec), key)):
                    continue
                values[(sec, key)] = (value, where)
    # the variables of the sections the role reads: those of others are no concern of its (the
    # images set SEARCH_DATA_DIR for every role; a note on each router start misled - review)
    for sec in COMMAND_SECTIONS[role]:
        for f in fields(types[sec]):
            name = ENV_PREFIX + f.name.upper()
            env = environ.get(name)
            if env is None:
                continue
            # set = a value of its own (SEARCH_TENANT=default names the default: no conflict)
            default = str(getattr(getattr(cfg, sec), f.name))
            if _unused(role, sec, f.name, f"environment {name}", env not in ("", default)):
                continue
            if f.metadata.get("env_items"):  # a list whose items are lists of their own
                env = [v.strip() for v in env.split(f.metadata["env_items"]) if v.strip()]
            values[(sec, f.name)] = (env, f"environment {name}")
    if args is not None:
        for dest, value in vars(args).items():
            if "." in dest:
                sec, name = dest.split(".", 1)
                field_ = next(x for x in fields(types[sec]) if x.name == name)
                values[(sec, name)] = (value, f"flag {_flag(sec, field_, command)}")
    for (sec, name), (value, where) in values.items():
        annotation = _field_types(types[sec])[name]
        value = _coerce(annotation, value, where)
        value = _check_range(next(x for x in fields(types[sec]) if x.name == name), value, where)
        setattr(getattr(cfg, sec), name, value)
    return cfg
