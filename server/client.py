"""The Python client and `search-client`.

    search-client "query text"                        # one query, ranked hits with citations
    search-client --queries queries.txt --out hits.jsonl   # a file of queries, sent as SearchBatch

`SearchClient` is the library form: `search()` for one query, `search_batch()` for many (split
into SearchBatch calls of at most MAX_BATCH_QUERIES; every query gets its own status).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import grpc
import numpy as np

from server.config import optional_path
from server.core.limits import (MAX_BATCH_QUERIES, MAX_MESSAGE_BYTES, MAX_RESPONSE_BYTES,
                                RESPONSE_FULL_NOTE)
from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

MODES = {"dense": pb.DENSE, "lexical": pb.LEXICAL, "hybrid": pb.HYBRID}
# servers send answers of up to 64 MiB (a SearchBatch of 1,024 queries with deep pages); the
# queries of a batch whose answers do not all fit come back RESOURCE_EXHAUSTED in their slots, and
# are sent again in another call (SearchClient.search_batch); a batch refused whole for its size
# (by an older server, or a client's smaller limit) is split in two and retried
MAX_ANSWER_BYTES = MAX_RESPONSE_BYTES


# Searches a server answers UNAVAILABLE (it is draining for a restart, or starting) are tried
# again by gRPC itself, up to 3 attempts in all, 0.1-1 s apart, within the call's deadline: a
# rolling update of several servers behind one address (a Service, a load balancer) is not an
# error to the caller. A lone server restarting is down for its restart (seconds), longer than
# these retries wait: a caller that must ride that out retries itself. Writes are not
# (a write answered UNAVAILABLE by a router may have been logged: the caller decides, see
# WriteResponse); gRPC retries only calls the server answered without a reply's headers.
# SearchBatch is retried by SearchClient itself (BATCH_ATTEMPTS), not by gRPC: gRPC buffers at
# most 256 KiB of a call for retries, and a batch of 1,024 queries with their vectors is larger,
# so gRPC sent it once (review).
_SEARCH_SERVICE = pb.DESCRIPTOR.services_by_name["SearchService"].full_name
RETRY_SERVICE_CONFIG = json.dumps({"methodConfig": [
    {"name": [{"service": _SEARCH_SERVICE, "method": "Search"}],
     "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                     "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})
# A SearchBatch answered UNAVAILABLE (a server draining or starting) or refused for load
# (admission control's RESOURCE_EXHAUSTED: "retry with backoff") is sent again, up to 5
# attempts, 0.2-2 s apart (jittered), one attempt at a time, all within the call's deadline:
# bulk work waits for room (outside QA: a file of queries failed on the first refusal). A
# search is a read, so sending it again is safe. A single Search is not retried for load: its
# caller holds a latency budget and decides. A message over a size limit is RESOURCE_EXHAUSTED
# too, and is never retried as it was: the batch is split instead.
BATCH_ATTEMPTS = 5
BATCH_BACKOFF_S = (0.2, 2.0)  # first, most
# the longest deadline a call may carry: gRPC takes one of ~1e10 s or more (or inf) for a
# deadline already past, and fails the call at once with DEADLINE_EXCEEDED (outside QA)
MAX_TIMEOUT_S = 86400.0


def open_channel(address: str, tls_ca: Optional[Path] = None, tls_cert: Optional[Path] = None,
                 tls_key: Optional[Path] = None, max_answer_bytes: int = MAX_ANSWER_BYTES) -> grpc.Channel:
    """A channel to `address`: TLS when a CA (or a client certificate, for mutual TLS) is given;
    searches answered UNAVAILABLE are retried (RETRY_SERVICE_CONFIG)."""
    options = [("grpc.max_receive_message_length", max_answer_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG)]
    creds = channel_credentials(tls_ca, tls_cert, tls_key)
    if creds is not None:
        return grpc.secure_channel(address, creds, options)
    return grpc.insecure_channel(address, options)


def channel_credentials(tls_ca: Optional[Path] = None, tls_cert: Optional[Path] = None,
                        tls_key: Optional[Path] = None) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials from --tls-ca / --tls-cert / --tls-key (None: plaintext). ValueError,
    naming the flag, for a certificate without its key or a key without its certificate (gRPC's
    core aborts the whole process on the first; the second went unnoticed, in plaintext) and for
    a file that cannot be read (outside QA)."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (tls_ca or tls_cert):
        return None

    def read(flag: str, path: Optional[Path]) -> Optional[bytes]:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None

    return grpc.ssl_channel_credentials(read("--tls-ca", tls_ca), read("--tls-key", tls_key),
                                        read("--tls-cert", tls_cert))


def wait_ready(address: str, timeout: float = 60.0, tls_ca: Optional[Path] = None,
               tls_cert: Optional[Path] = None, tls_key: Optional[Path] = None) -> None:
    """Block until the server's health check answers SERVING (or raise)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(address, tls_ca, tls_cert, tls_key) as ch:
        grpc.channel_ready_future(ch).result(timeout=timeout)
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=timeout)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is up but not serving ({resp.status})")


@dataclass
class BatchResult:
    """One query's answer within a batch: `code` OK with `response`, or the error for it alone
    - or, `call_failed`, the error of the whole call that carried it (search_batch with
    `per_query_errors`)."""
    code: grpc.StatusCode
    message: str
    response: Optional[pb.SearchResponse]
    call_failed: bool = False

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class SearchClient:
    """A blocking client of the public SearchService (thread-safe, like its channel)."""

    def __init__(self, address: str = "127.0.0.1:50051", token: Optional[str] = None,
                 tls_ca: Optional[Path] = None, tls_cert: Optional[Path] = None,
                 tls_key: Optional[Path] = None, timeout: float = 10.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        self.timeout = _check_timeout(timeout)
        self.channel = open_channel(address, tls_ca, tls_cert, tls_key, max_answer_bytes)
        self.stub = pb_grpc.SearchServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def search(self, text: str = "", *, collection: str, top_k: int = 10,
               mode: Optional[str] = None, vector: Optional[Sequence[float]] = None,
               model_id: str = "", timeout: Optional[float] = None, **fields) -> pb.SearchResponse:
        """One query; raises grpc.RpcError with the server's status on failure. Without a
        `mode` the server picks: hybrid for a text, dense for a vector alone."""
        return self.stub.Search(request(text, collection=collection, top_k=top_k, mode=mode,
                                        vector=vector, model_id=model_id, **fields),
                                metadata=self.metadata, timeout=self._timeout(timeout))

    def _timeout(self, timeout: Optional[float], default: Optional[float] = None) -> float:
        if timeout is None:
            return self.timeout if default is None else default
        return _check_timeout(timeout)

    def search_batch(self, requests: Iterable[pb.SearchRequest], timeout: Optional[float] = None,
                     batch_size: int = MAX_BATCH_QUERIES,
                     per_query_errors: bool = False) -> Iterator[BatchResult]:
        """Answers in the order of `requests`, sent `batch_size` per call; `timeout` is each
        call's deadline (default: the client's, or 50 ms per query of the call if longer). A call
        that fails as a whole raises grpc.RpcError - or, `per_query_errors`, answers each of its
        queries with that call's status (`call_failed`) and the next calls are still made, so the
        answers always line up with the requests. A call answered UNAVAILABLE or refused for
        load is sent again first (BATCH_ATTEMPTS). A generator: `requests` is read, and each call
        made, as the answers are iterated (a file of queries streams through), so iterate it
        while the client is open - `list(...)` for all at once."""
        if not 1 <= batch_size <= MAX_BATCH_QUERIES:
            raise ValueError(f"batch_size must be 1 to {MAX_BATCH_QUERIES}, not {batch_size!r}")
        if timeout is not None:
            _check_timeout(timeout)  # before the first call, not after a file's first batch
        chunk: list[pb.SearchRequest] = []
        for req in requests:
            chunk.append(req)
            if len(chunk) == batch_size:
                yield from self._call(chunk, timeout, per_query_errors)
                chunk = []
        if chunk:
            yield from self._call(chunk, timeout, per_query_errors)

    def _call(self, chunk: list[pb.SearchRequest], timeout: Optional[float],
              per_query_errors: bool) -> list[BatchResult]:
        results = self._answers(chunk, timeout, per_query_errors)
        # queries whose answers did not fit beside the others in the server's response: sent
        # again, in calls of as many queries as the last call fitted (a call that fits none
        # ends it: each refused slot keeps its status)
        again = [i for i, r in enumerate(results) if _no_room(r)]
        fitted = len(chunk) - len(again)
        while again and fitted:
            part, again = again[:fitted], again[fitted:]
            answers = self._answers([chunk[i] for i in part], timeout, per_query_errors)
            for i, a in zip(part, answers):
                results[i] = a
            refused = [i for i, a in zip(part, answers) if _no_room(a)]
            fitted = len(part) - len(refused)
            again = refused + again
        return results

    def _answers(self, chunk: list[pb.SearchRequest], timeout: Optional[float],
                 per_query_errors: bool) -> list[BatchResult]:
        try:
            return self._batch(chunk, timeout)
        except grpc.RpcError as err:
            if not per_query_errors:
                raise
            failed = BatchResult(err.code(), err.details() or "", None, call_failed=True)
            return [failed] * len(chunk)

    def _batch(self, chunk: list[pb.SearchRequest], timeout: Optional[float]) -> list[BatchResult]:
        try:
            resp = self._send_batch(chunk, timeout)
        except grpc.RpcError as err:
            # a message over a size limit: the same queries in two calls. Only that: a server
            # that refuses for load (RESOURCE_EXHAUSTED too) asks for a retry with backoff, and
            # twice the calls at once would be the opposite
            if not _over_message_limit(err) or len(chunk) == 1:
                raise
            half = len(chunk) // 2
            return self._batch(chunk[:half], timeout) + self._batch(chunk[half:], timeout)
        return [BatchResult(_CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.message,
                            item.response if item.code == 0 else None) for item in resp.results]

    def _send_batch(self, chunk: list[pb.SearchRequest],
                    timeout: Optional[float]) -> pb.SearchBatchResponse:
        """One SearchBatch, sent again (BATCH_ATTEMPTS) while the server is unavailable or
        refuses for load and the deadline leaves room for the wait."""
        request_ = pb.SearchBatchRequest(queries=chunk)
        deadline = time.monotonic() + self._timeout(timeout, max(self.timeout, 0.05 * len(chunk)))
        backoff = BATCH_BACKOFF_S[0]
        for attempt in range(1, BATCH_ATTEMPTS + 1):
            try:
                return self.stub.SearchBatch(request_, metadata=self.metadata,
                                             timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as err:
                wait = backoff * random.uniform(0.5, 1.0)
                if (attempt == BATCH_ATTEMPTS or not _worth_another_attempt(err)
                        or time.monotonic() + wait >= deadline):
                    raise
                time.sleep(wait)
                backoff = min(backoff * 2, BATCH_BACKOFF_S[1])
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "SearchClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_timeout(value: float) -> float:
    if not 0 < value <= MAX_TIMEOUT_S:  # also NaN
        raise ValueError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g} "
                         f"(a day), not {value!r}")
    return value


def _whole_number(of: str, most: Optional[int] = None):
    """An argparse type: a whole number of `of` from 1 (to `most`, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1 or (most is not None and value > most):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number of {of} "
                + (f"from 1 to {most}" if most is not None else ">= 1"))
        return value
    return parse


# --top-k: the server states its own upper limit; --batch-size: up to the server's cap
_top_k = _whole_number("hits")
_batch_size = _whole_number("queries", MAX_BATCH_QUERIES)


def _positive_seconds(text: str) -> float:
    """--timeout, checked as the client checks a timeout."""
    try:
        return _check_timeout(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _no_room(r: BatchResult) -> bool:
    """A query the server answered RESOURCE_EXHAUSTED because its answer did not fit in the
    response beside the others (not one too large on its own)."""
    return r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and RESPONSE_FULL_NOTE in r.message


def _worth_another_attempt(err: grpc.RpcError) -> bool:
    """A server draining or starting, or one that refused for load: not a message too large."""
    return (err.code() == grpc.StatusCode.UNAVAILABLE
            or err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not _over_message_limit(err))


def _over_message_limit(err: grpc.RpcError) -> bool:
    """gRPC's own refusal of a message over the size limit ("Received/Sent message larger than
    max"), not a server's admission control."""
    return (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "larger than max" in (err.details() or ""))


def request(text: str = "", *, collection: str, top_k: int = 10, mode: Optional[str] = None,
            vector: Optional[Sequence[float]] = None, model_id: str = "", **fields) -> pb.SearchRequest:
    """A SearchRequest from plain values (`mode` by name, or None for the server's choice: hybrid
    for a text, dense for a vector alone; `vector` with the model id it came from)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, not {mode!r}")
    qv = None if vector is None else pb.QueryVector(values_f32=f32_bytes(vector), model_id=model_id)
    return pb.SearchRequest(collection=collection, text=text, top_k=top_k,
                            mode=pb.SEARCH_MODE_UNSPECIFIED if mode is None else MODES[mode],
                            vector=qv, **fields)


def f32_bytes(vector: Sequence[float]) -> bytes:
    """A vector as QueryVector.values_f32 / ChunkInput.vector_f32 take it: raw little-endian
    float32, one conversion of the whole array instead of one Python float per value."""
    x = np.asarray(vector, dtype="<f4")
    if x.ndim != 1:
        raise ValueError(f"a vector is one row of floats, not an array of shape {x.shape}")
    return x.tobytes()


def _is_jsonl(lines: list[str]) -> bool:
    """The file's format, from its first non-blank line: a JSON object makes it JSONL (every line
    must then be one); anything else, plain text, where a line that starts with "{" is a query."""
    first = next((x.strip() for x in lines if x.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def read_queries(path: Path) -> list[tuple[str, str]]:
    """(id, text) pairs from a file: JSONL with `text` (or `query`) and optional `_id`/`id` (a BEIR
    queries.jsonl works as is), or plain text with one query per line (the first non-blank line
    decides which). Blank lines are skipped. A UTF-8 byte-order mark is not part of the first
    line (outside QA: it made a JSONL file read as plain text, each line sent as a query)."""
    with open(path, "rb") as f:
        raw = f.read().splitlines(keepends=True)
    lines = []
    for n, b in enumerate(raw, 1):
        try:
            lines.append(b.decode("utf-8-sig" if n == 1 else "utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{n}: not UTF-8 text ({exc.reason} at byte {exc.start} of "
                             "the line)") from None
    jsonl = _is_jsonl(lines)
    out = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        if not jsonl:
            out.append((str(n), line))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        text = obj.get("text", obj.get("query")) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{n}: a JSON query needs a string `text` field")
        out.append((str(obj.get("_id", obj.get("id", n))), text))
    return out


def _print_response(resp: pb.SearchResponse, collection: str, trace: bool) -> None:
    print(f"{len(resp.hits)} hits from {collection} build {resp.build_id} "
          f"(model {resp.model_id}, corpus {resp.corpus_version})")
    # the retrievers the query used (their stages are timed): a hit's rank in each, "-" where
    # one did not find it; a lexical query's hits say nothing of a dense list
    used = ([name for name in ("dense", "lexical") if any(t.stage == name for t in resp.timings)]
            # a retrieval-cache hit times only "cache": then the retrievers its hits name
            or [name for name in ("dense", "lexical") if any(h.HasField(name) for h in resp.hits)])
    for i, h in enumerate(resp.hits, 1):
        kind = pb.ScoreKind.Name(h.score_kind).lower()
        ranks = " ".join(f"{name} #{getattr(h, name).rank or '-'}" for name in used)
        print(f"{i:>2}. {h.doc_id}  [{kind} {h.score:.4f}{', ' + ranks if ranks else ''}]  "
              f"chars {h.start_offset}-{h.end_offset}")
        print(textwrap.indent(textwrap.shorten(h.text, 200), "      "))
    print("timings: " + ", ".join(f"{t.stage} {t.ms:.1f} ms" for t in resp.timings))
    if trace:
        for lst in resp.trace.lists:
            if not lst.items:  # a retriever the query did not use (a lexical query's dense list)
                continue
            # ranked lists as doc#rank, the dropped list with each drop's reason
            print(f"trace {lst.name}: " + ", ".join(
                f"{it.doc_id} ({it.reason})" if it.reason else f"{it.doc_id}#{it.rank}"
                for it in lst.items[:10]) + (f", ... {len(lst.items) - 10} more"
                                             if len(lst.items) > 10 else ""))
        for note in resp.trace.notes:
            print(f"note: {note}")


def trace_json(resp: pb.SearchResponse) -> dict:
    """A response's trace as JSON: each list's items (doc, chunk, rank, score, and for a dropped
    one why), and the notes."""
    out: dict = {lst.name: [{"doc_id": it.doc_id, "chunk_id": it.chunk_id, "rank": it.rank,
                             "score": round(it.score, 6), **({"reason": it.reason} if it.reason else {})}
                            for it in lst.items]
                 for lst in resp.trace.lists if lst.items}
    out["notes"] = list(resp.trace.notes)
    return out


def _run_file(client: SearchClient, args) -> int:
    try:
        queries = read_queries(args.queries)
    except (OSError, ValueError) as exc:
        print(f"search-client: {exc}", file=sys.stderr)
        return 2
    if not queries:  # (outside QA: exit 0 with "0 queries ...", as if all had answered)
        print(f"search-client: {args.queries} holds no queries", file=sys.stderr)
        return 2
    try:
        out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    except OSError as exc:
        print(f"search-client: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 2
    codes: Counter = Counter()
    t0 = time.perf_counter()
    answered, failed_in_a_row = 0, 0
    try:
        # one call at a time: a call that fails as a whole (its deadline, a server going away)
        # writes a line with its status for each of its queries and the next call is still made,
        # so the file keeps one line per query (outside QA: it ended at the failed call, 1,024
        # lines of 2,600, unsaid). Calls failing in a row mean the server is gone: stop there.
        for start in range(0, len(queries), args.batch_size):
            part = queries[start:start + args.batch_size]
            reqs = [request(text, collection=args.collection, top_k=args.top_k, mode=args.mode,
                            include_trace=args.trace) for _, text in part]
            results = list(client.search_batch(reqs, args.timeout, args.batch_size,
                                               per_query_errors=True))
            for (qid, _), res in zip(part, results):
                codes[res.code.name] += 1
                out.write(json.dumps(_row(qid, res, args.trace)) + "\n")
            answered += len(part)
            failed_in_a_row = failed_in_a_row + 1 if all(r.call_failed for r in results) else 0
            if failed_in_a_row:
                print(f"search-client: the call of queries {start + 1}-{start + len(part)} failed: "
                      f"{results[0].code.name}: {results[0].message}", file=sys.stderr)
            if failed_in_a_row == GIVE_UP_AFTER_FAILED_CALLS and answered < len(queries):
                print(f"search-client: {GIVE_UP_AFTER_FAILED_CALLS} calls in a row failed; the "
                      f"other {len(queries) - answered} queries were not sent", file=sys.stderr)
                break
    finally:
        if out is not sys.stdout:
            out.close()
    secs = time.perf_counter() - t0
    summary = ", ".join(f"{n} {c}" for c, n in codes.most_common())
    unsent = f", {len(queries) - answered} not sent" if answered < len(queries) else ""
    print(f"{len(queries)} queries in {secs:.2f} s ({answered / max(secs, 1e-9):.0f}/s): "
          f"{summary}{unsent}", file=sys.stderr)
    return 0 if codes["OK"] == len(queries) else 1


GIVE_UP_AFTER_FAILED_CALLS = 3


def _row(qid: str, res: BatchResult, trace: bool) -> dict:
    """One query's JSON line: id, code, and its hits (and trace) or the error's message."""
    row = {"id": qid, "code": res.code.name}
    if res.ok:
        row["hits"] = [{"doc_id": h.doc_id, "chunk_id": h.chunk_id, "score": round(h.score, 6)}
                       for h in res.response.hits]
        if trace:
            row["trace"] = trace_json(res.response)
    else:
        row["message"] = res.message
    return row


def stdout_reader_gone() -> None:
    """`... | head` closed stdout: point it at /dev/null, so that the interpreter's own flush at
    exit does not raise again with a traceback (the recipe of Python's signal documentation)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv=None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return rc
    except BrokenPipeError:  # `search-client ... | head` (outside QA: a traceback)
        stdout_reader_gone()
        return 0


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="search-client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("query", nargs="?", help="one query (or use --queries)")
    p.add_argument("--queries", type=Path, metavar="FILE",
                   help="a file of queries (one per line, or JSONL with `text`), sent as SearchBatch "
                        "calls; writes one JSON line per query: id, code, hits or message")
    p.add_argument("--out", type=Path, help="with --queries: write the JSON lines here, not stdout")
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port (default %(default)s)")
    p.add_argument("--collection", default="stdlib", help="default %(default)s (the demo's)")
    p.add_argument("--mode", choices=sorted(MODES), default="hybrid", help="default %(default)s")
    p.add_argument("--top-k", type=_top_k, default=5, help="hits per query (default %(default)s)")
    p.add_argument("--trace", action="store_true",
                   help="print why each hit ranked where it did (with --queries: a `trace` field "
                        "in each JSON line)")
    p.add_argument("--token-file", type=optional_path,
                   help="file holding a bearer token (--auth-tokens servers)")
    p.add_argument("--tls-ca", type=optional_path, help="CA certificate: connect with TLS")
    p.add_argument("--tls-cert", type=optional_path, help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", type=optional_path, help="client key (mutual TLS)")
    p.add_argument("--wait", type=float, default=0, help="wait this long for the server first")
    p.add_argument("--timeout", type=_positive_seconds, default=None,
                   help="deadline per call in seconds (default 10; with --queries, 10 or 50 ms per "
                        "query of the call, whichever is longer)")
    p.add_argument("--batch-size", type=_batch_size, default=MAX_BATCH_QUERIES,
                   help="with --queries: queries per SearchBatch call (default %(default)s, the "
                        "server's cap; smaller when a server answers RESOURCE_EXHAUSTED \"send "
                        "smaller batches\" after its retries, or for shorter calls)")
    args = p.parse_args(argv)
    if (args.query is None) == (args.queries is None):
        p.error("give one query or --queries FILE")
    if args.out and args.queries is None:  # (outside QA: it was ignored)
        p.error("--out writes the answers of --queries FILE; one query's answer is printed")
    if args.batch_size != MAX_BATCH_QUERIES and args.queries is None:
        p.error("--batch-size cuts the calls of --queries FILE; one query is one call")
    try:
        token = args.token_file.read_text().strip() if args.token_file else None
    except OSError as exc:
        p.error(f"--token-file {args.token_file}: {exc.strerror or exc}")
    try:
        channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        p.error(str(exc))
    if args.wait:
        try:
            wait_ready(args.address, args.wait, args.tls_ca, args.tls_cert, args.tls_key)
        except (grpc.FutureTimeoutError, grpc.RpcError, RuntimeError) as exc:
            print(f"search-client: {args.address} did not answer SERVING within {args.wait:g} s"
                  f"{'' if isinstance(exc, grpc.FutureTimeoutError) else f' ({exc})'}",
                  file=sys.stderr)
            return 2
    with SearchClient(args.address, token, args.tls_ca, args.tls_cert, args.tls_key,
                      args.timeout or 10.0) as client:
        if args.queries is not None:
            return _run_file(client, args)
        try:
            resp = client.search(args.query, collection=args.collection, top_k=args.top_k,
                                 mode=args.mode, include_trace=args.trace)
        except grpc.RpcError as err:
            print(f"{err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    _print_response(resp, args.collection, args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
