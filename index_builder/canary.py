"""Canary check: query as every other tenant and prove no canary sentinel ever comes back.

The canary tenant's documents carry unique sentinel strings. For each credential (one per tenant
that is not the canary), every sentinel is sent as a query in every mode, plus generic queries; any
hit whose text, title or document id contains a sentinel is a leak. Exit status 1 on a leak.

    index-builder canary-check --address HOST:PORT --collection NAME \\
        --credentials creds.json --sentinel CANARY-7f3a --sentinel ...
    creds.json: [{"tenant": "acme", "token": "..."}, ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional, Sequence

GENERIC = ("report", "results of the experiment", "the", "secret", "confidential")


def find_leaks(address: str, collection: str, credentials: Sequence[dict],
               sentinels: Sequence[str], top_k: int = 50,
               skipped: Optional[dict] = None, tls: Sequence = (None, None, None)
               ) -> tuple[int, list[str]]:
    """(queries sent, leaks). A mode the server cannot answer for a text (FAILED_PRECONDITION:
    a collection of your own vectors served without an embedding model) is left out, with the
    server's reason in `skipped`; any other error raises ValueError (the check did not run)."""
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    leaks, queries = [], 0
    skipped = {} if skipped is None else skipped
    lowered = [s.lower() for s in sentinels]
    from server.client import open_channel

    with open_channel(address, *tls) as ch:  # TLS with --tls-ca (and a client certificate)
        stub = pb_grpc.SearchServiceStub(ch)
        for cred in credentials:
            md = (("authorization", f"Bearer {cred['token']}"),)
            for text in list(sentinels) + list(GENERIC):
                for mode in (pb.DENSE, pb.LEXICAL, pb.HYBRID):
                    name = pb.SearchMode.Name(mode)
                    if name in skipped:
                        continue
                    try:
                        resp = stub.Search(pb.SearchRequest(collection=collection, text=text,
                                                            top_k=top_k, mode=mode),
                                           metadata=md, timeout=30)
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and mode != pb.LEXICAL:
                            skipped[name] = exc.details()
                            continue
                        raise ValueError(f"{name} query as tenant {cred['tenant']!r} failed: "
                                         f"{exc.code().name}: {exc.details()}") from None
                    queries += 1
                    for h in resp.hits:
                        blob = f"{h.doc_id} {h.title} {h.text}".lower()
                        for s in lowered:
                            if s in blob:
                                leaks.append(f"tenant {cred['tenant']!r} query {text!r} mode "
                                             f"{pb.SearchMode.Name(mode)}: {h.doc_id} contains {s!r}")
    return queries, leaks


def main(args) -> int:
    """0: no sentinel came back; 1: a leak; 2 (through the CLI): the check could not run."""
    creds = json.loads(Path(args.credentials).read_text())
    if not isinstance(creds, list) or not creds:  # (outside QA: [] checked nothing, passed)
        raise ValueError(f"--credentials {args.credentials}: a non-empty JSON list of "
                         '{"tenant": ..., "token": ...} is needed: no tenant, nothing checked')
    skipped: dict = {}
    queries, leaks = find_leaks(args.address, args.collection, creds, args.sentinel,
                                skipped=skipped, tls=(args.tls_ca, args.tls_cert, args.tls_key))
    for mode, reason in skipped.items():
        print(f"canary check: {mode} not checked: {reason}", file=sys.stderr)
    for leak in leaks:
        print(f"LEAK: {leak}", file=sys.stderr)
    print(f"canary check: {queries} queries as {len(creds)} tenant(s), {len(args.sentinel)} "
          f"sentinel(s): {'LEAKS FOUND' if leaks else 'no sentinel returned'}")
    return 1 if leaks else 0
