"""`index-builder`: build, audit and publish versioned collections; evaluate them; make a demo corpus.

    index-builder build   --corpus corpus.jsonl --collection NAME [--factory F] [--shards N]
    index-builder audit   --collection NAME [--build ID] [--k 10] [--min-recall 0.9]
    index-builder publish --collection NAME --build ID
    index-builder list    [--collection NAME]
    index-builder eval    --dataset DIR[=NAME] [--dataset ...] (--address HOST:PORT | --serve-from DATA)
    index-builder canary-check --collection NAME --credentials creds.json --sentinel S
    index-builder compact --collection NAME --address HOST:PORT
    index-builder demo-corpus --out FILE
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Optional

from server.config import optional_path

DATA_DIR_DEFAULT = os.environ.get("SEARCH_DATA_DIR", "data")  # a string: argparse checks it


def _data_dir(text: str) -> Path:
    """--data-dir (or $SEARCH_DATA_DIR): not empty, which Path() reads as the current directory
    (review: the server refuses it, the builder wrote its collections there)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty (leave it, and $SEARCH_DATA_DIR, out for "
                                         "./data)")
    return Path(text)


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (search knobs, --k, --limit): 0 or -3 was stored in a
    build, or failed with a traceback after the build was written (outside QA)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _tenant_name(text: str) -> str:
    """argparse type: a valid tenant name (outside QA: a bad --tenant was blamed on the corpus's
    first line)."""
    from server.core.collection import check_name
    from server.errors import SearchError

    try:
        return check_name(text, "tenant")
    except SearchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    """argparse type: a recall in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a recall is between 0 and 1, not {value:g}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=_data_dir, default=DATA_DIR_DEFAULT,
                   help="root of the collections (default: ./data or $SEARCH_DATA_DIR)")
    p.add_argument("--collection", required=True, help="collection name")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="index-builder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="chunk, embed, train, add and write a new build")
    _add_common(b)
    b.add_argument("--corpus", type=Path, required=True,
                   help="BEIR corpus.jsonl (or its directory), or JSONL of {id, text, title?, "
                        "metadata?, tenant?, acl?, version?, vector?}")
    b.add_argument("--factory", default="Flat",
                   help="faiss factory string, e.g. Flat, HNSW32,Flat, IVF1024,PQ48x4fs,RFlat "
                        "(default %(default)s: exact)")
    b.add_argument("--metric", choices=["ip", "l2"], default="ip",
                   help="ip = cosine on the normalised embeddings (default)")
    b.add_argument("--shards", type=int, default=1,
                   help="number of shards (hash of doc id; default %(default)s)")
    b.add_argument("--nprobe", type=_positive_int, default=None,
                   help="IVF lists probed per query (default: tuned to --target-recall)")
    b.add_argument("--ef-search", type=_positive_int, default=None,
                   help="HNSW efSearch (default: tuned to --target-recall)")
    b.add_argument("--k-factor", type=_positive_int, default=None,
                   help="refine shortlist factor for ...,RFlat (default: tuned to --target-recall)")
    b.add_argument("--target-recall", type=_fraction, default=0.95,
                   help="with --audit/--publish: pick the cheapest knob setting (efSearch, nprobe, "
                        "k_factor) whose held-out recall@10 meets this; knobs given explicitly are "
                        "kept as they are while the others tune (default %(default)s; 0 = do not "
                        "tune)")
    b.add_argument("--vectors", type=Path, default=None,
                   help="your own embeddings: .npy with one row per corpus record (non-blank "
                        "line), in corpus order, a record skipped for having no text keeping its "
                        "row (or a 'vector' field on every JSONL line); each document is then "
                        "one chunk and nothing is embedded")
    b.add_argument("--model-id", default=None,
                   help="with your own vectors: the id of the model that made them (query "
                        "vectors must carry the same id)")
    b.add_argument("--audit-queries", type=Path, default=None,
                   help=".npy of held-out query vectors for the recall audit (default for text "
                        "builds: embedded spans of the corpus)")
    b.add_argument("--limit", type=_positive_int, default=None, help="index only the first N documents")
    b.add_argument("--tenant", type=_tenant_name, default="default",
                   help="tenant of documents that name none")
    b.add_argument("--dedicated-tenant-min-chunks", type=_positive_int, default=None,
                   help="tenants owning at least this many chunks of a shard get their own index")
    b.add_argument("--embedder", default=None,
                   help="local model directory (default: the packaged all-MiniLM-L6-v2; not "
                        "loaded for a build from your own vectors)")
    b.add_argument("--embedder-name", default=None, help="model name for the model id")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    b.add_argument("--build-id", default=None)
    b.add_argument("--audit", action="store_true", help="audit recall after building (exit 1 when the audit fails)")
    b.add_argument("--publish", action="store_true", help="audit, then publish if the audit passes")
    b.add_argument("--min-recall", type=_fraction, default=0.9,
                   help="the audit fails (and --publish refuses) below this recall@10 (default "
                        "%(default)s)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")

    a = sub.add_parser("audit", help="measure ANN recall@k against exact search; store it in the build",
                       description="Measure the build's recall@k against exact search and "
                                   "reconcile its counts across faiss, tantivy and SQLite, "
                                   "including the writes servers applied to its state since (the "
                                   "check to run after a crash). Run on a state no server is "
                                   "writing to: a write in flight between the store and BM25 can "
                                   "show as a passing mismatch.")
    _add_common(a)
    a.add_argument("--build", default=None, help="build id (default: the newest build)")
    a.add_argument("--k", type=_positive_int, default=10)
    a.add_argument("--queries", type=_positive_int, default=200, metavar="N",
                   help="how many audit queries to use (the held-out ones stored with the build "
                        "when it has them; a file of your own: --audit-queries)")
    a.add_argument("--audit-queries", type=Path, default=None,
                   help=".npy of held-out query vectors (n x dim) to audit (and tune) on, instead "
                        "of the ones stored with the build")
    a.add_argument("--min-recall", type=_fraction, default=0.9,
                   help="the audit fails below this recall@10 (default %(default)s)")
    a.add_argument("--target-recall", type=_fraction, default=None,
                   help="also tune the search knobs to the cheapest setting meeting this recall")
    _state_dir_flag(a, "the reconciliation checks what a server would load from it")
    a.add_argument("--no-record", action="store_true",
                   help="print the result without writing it into the build's descriptor (a "
                        "check of a published build, e.g. on a read-only volume)")

    pub = sub.add_parser("publish", help="flip the collection's alias to a build (audit must pass)")
    _add_common(pub)
    pub.add_argument("--build", required=True)
    pub.add_argument("--min-recall", type=_fraction, default=None,
                     help="override the threshold stored with the audit")
    _state_dir_flag(pub, "checked for streaming writes of another model than the build's")
    pub.add_argument("--allow-model-change", action="store_true",
                     help="publish although the state holds writes embedded with another model: "
                          "servers switching re-embed them, so each needs the build's embedder")

    rb = sub.add_parser("rollback", help="publish the collection's rollback target (the build "
                                         "live before the last publish) again",
                        description="Flip the alias back to its previous build: the live build "
                                    "becomes the rollback target, so a second rollback undoes the "
                                    "first. The same as `publish --build <previous>`, with the "
                                    "same checks, and refused if another publish moved the alias "
                                    "meanwhile. Running servers follow within --alias-poll-s and "
                                    "replay the streaming writes they took since.")
    _add_common(rb)
    _state_dir_flag(rb, "checked for streaming writes of another model than the build's")
    rb.add_argument("--allow-model-change", action="store_true",
                    help="roll back although the state holds writes embedded with another model")

    ls = sub.add_parser("list", help="list collections and builds",
                        description="Every collection's builds: factory, chunks, shards and audited "
                                    "recall; * marks the live build. Exit 1 if a build is damaged "
                                    "(a file missing or of another size than recorded; with "
                                    "--verify, or whose sha256 differs) or the alias names one "
                                    "that is gone.")
    ls.add_argument("--data-dir", type=_data_dir, default=DATA_DIR_DEFAULT,
                    help="root of the collections (default: ./data or $SEARCH_DATA_DIR)")
    ls.add_argument("--collection", default=None, help="only this collection (default: all)")
    ls.add_argument("--verify", action="store_true",
                    help="also check every file's sha256 (reads every build in full)")

    pr = sub.add_parser(
        "prune", help="remove old builds of a collection (never the live build, its rollback "
                      "target, or the builds they were compacted from)",
        description="Remove the builds of a collection that nothing needs: kept are the live "
                    "build, its rollback target (the alias's previous), the --keep newest, "
                    "those made or that left the alias less than --grace-s ago, and every build "
                    "any of these was compacted from (a later publish or rollback replays their "
                    "write logs). Servers remove their state of a removed build once nothing "
                    "needs it, never while they serve it (a server that was down replays its "
                    "writes from that state when it starts). Build ids are not reused.")
    _add_common(pr)
    pr.add_argument("--keep", type=int, default=2,
                    help="the newest builds kept besides those (default: 2; 0 keeps only those)")
    pr.add_argument("--grace-s", type=float, default=600.0,
                    help="also keep builds made, or that left the alias (live or rollback "
                         "target), less than this long ago: one being published now, one a "
                         "server that has not followed yet still reads (default: 600)")
    pr.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    ev = sub.add_parser("eval", help="evaluate BEIR datasets through the service")
    ev.add_argument("--dataset", action="append", required=True,
                    help="BEIR dir with corpus.jsonl, queries.jsonl, qrels/, optionally =COLLECTION "
                         "(default: the directory's name); repeatable")
    ev.add_argument("--address", default="127.0.0.1:50051",
                    help="a running server to query (default %(default)s)")
    _tls_flags(ev)
    ev.add_argument("--serve-from", type=Path, default=None,
                    help="instead of --address: build any missing collection under this data "
                         "directory (Flat, packaged MiniLM) and serve them in this process")
    ev.add_argument("--modes", default="dense,lexical,hybrid,hybrid-rrf",
                    help="(default %(default)s) comma list of dense, lexical, hybrid (with dense "
                         "feedback, the server's default), "
                         "hybrid-rrf (plain RRF), hybrid+rerank; the options that are off by "
                         "default: lexical+rm3, hybrid+rm3, hybrid-rrf+rm3 (lexical feedback, 10 "
                         "terms), hybrid-dw4, hybrid-dw6 (weighted fusion, dense share 0.4/0.6), "
                         "hybrid-minmax (min-max score fusion), hybrid-deeplong (3x the "
                         "candidate depth for queries over 20 words)")
    ev.add_argument("--compare", default=None,
                    help="comma list of A:B mode pairs compared per query (randomization test and "
                         "paired t-test on nDCG@10; default hybrid:hybrid-rrf when both run)")
    ev.add_argument("--split", default="test", help="the qrels split (default %(default)s)")
    ev.add_argument("--depth", type=int, default=100,
                    help="documents ranked per query (default %(default)s)")
    ev.add_argument("--rerank-depth", type=int, default=50,
                    help="hits reranked in the +rerank modes (default %(default)s)")
    ev.add_argument("--out", type=Path, default=None, help="directory for per-query results")
    ev.add_argument("--plots", type=Path, default=None,
                    help="write PNG plots (nDCG@10 by mode and query slice) here; needs matplotlib "
                         "(the bench extra)")

    cp = sub.add_parser("compact", help="ask a running server to compact a collection (drop tombstones)")
    cp.add_argument("--address", default="127.0.0.1:50051", help="the server (default %(default)s)")
    cp.add_argument("--collection", required=True)
    cp.add_argument("--token", default=None, help="bearer token with the operator role")
    cp.add_argument("--token-file", type=optional_path, default=None,
                    help="file holding that token (kept out of the process list)")
    _tls_flags(cp)

    cc = sub.add_parser("canary-check", help="query as every other tenant; fail if a canary sentinel appears")
    cc.add_argument("--address", default="127.0.0.1:50051", help="the server (default %(default)s)")
    cc.add_argument("--collection", required=True)
    cc.add_argument("--credentials", type=Path, required=True,
                    help='JSON list of {"tenant": ..., "token": ...} for the non-canary tenants')
    cc.add_argument("--sentinel", action="append", required=True, help="a sentinel string (repeatable)")
    _tls_flags(cc)

    dc = sub.add_parser("demo-corpus", help="write a corpus of Python standard-library docstrings")
    dc.add_argument("--out", type=Path, required=True)
    dc.add_argument("--limit", type=_positive_int, default=None)
    return p


def _state_dir_flag(parser, why: str) -> None:
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where servers keep this collection's state (default: "
                             f"DATA_DIR/.state): {why}")


def _tls_flags(parser) -> None:
    """A server that speaks TLS (--tls-cert on its listener): the client side's flags, as
    search-client and search-server health take them."""
    parser.add_argument("--tls-ca", type=optional_path, default=None,
                        help="the server speaks TLS: trust this CA")
    parser.add_argument("--tls-cert", type=optional_path, default=None,
                        help="client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=optional_path, default=None, help="key of --tls-cert")


def _knobs(args) -> tuple[dict, tuple[str, ...]]:
    """The search knobs (defaults, and those given on the command line), and the names of those
    given: they stay as they are while the others tune."""
    given = {k: v for k, v in (("nprobe", args.nprobe), ("ef_search", args.ef_search),
                               ("k_factor", args.k_factor)) if v is not None}
    from server.backends.dense import SearchKnobs

    return {**SearchKnobs().__dict__, **given}, tuple(given)


def _knobs_that_do_not_apply(given: tuple[str, ...], desc) -> list[str]:
    """The flags of search knobs given on the command line that the build's index does not have
    (--nprobe on HNSW, --ef-search on IVF, --k-factor without a refine step)."""
    if not given:
        return []
    import faiss

    from server.backends.dense import has_refine
    from server.core.audit import index_knobs

    try:
        index = faiss.index_factory(desc.dim, desc.factory)
    except RuntimeError:  # a factory faiss cannot make empty here: say nothing rather than guess
        return []
    # a refine step takes k_factor whatever it refines (`PQ8,RFlat` too: review)
    applies = set(index_knobs(index)) | ({"k_factor"} if has_refine(index) else set())
    return ["--" + k.replace("_", "-") for k in given if k not in applies]


def vectors_of_records(vectors, docs: list, tally: dict):
    """The rows of a --vectors file that belong to `docs`: row i is the corpus's record i (its
    i-th non-blank line), kept or not - a record skipped for having no text keeps its row, so a
    skip or --limit never moves a vector onto another document. With the whole corpus read
    (`tally` filled) the file must hold exactly one row per record."""
    if any(d.vector is not None for d in docs):
        raise ValueError("the corpus carries `vector` fields and --vectors was given: use one "
                         "or the other")
    if vectors.ndim != 2:
        raise ValueError(f"--vectors holds an array of shape {vectors.shape}; it needs one row "
                         "per corpus record (records x dimension)")
    records = tally.get("records")
    if records is not None and len(vectors) != records:
        skipped = tally.get("skipped", 0)
        raise ValueError(f"{len(vectors)} vectors for a corpus of {records} records"
                         f"{f' ({skipped} skipped for having no text)' if skipped else ''}: give "
                         "one row per record (non-blank line) of the corpus, in order")
    rows = [d.record for d in docs]
    if rows and max(rows) >= len(vectors):
        last = max(docs, key=lambda d: d.record)
        raise ValueError(f"{len(vectors)} vectors, but document {last.doc_id!r} is record "
                         f"{last.record + 1} of the corpus: give one row per record (non-blank "
                         "line) of the corpus, in order")
    return vectors[rows] if rows else vectors[:0]


def _check_build_id_unused(store, name: str, build_id: str, state_root: Path) -> None:
    """A build id names one build for ever: servers keep their state (and its writes) by it, so
    one reused after a prune would meet the earlier build's state (re-probe). Refused when the
    alias remembers it or the default state directory holds it."""
    from server.errors import NotFound

    try:
        alias = store.alias(name)
    except NotFound:
        alias = {}
    named = {alias.get("live"), alias.get("previous"), *alias.get("left", {})}
    if build_id in named or (state_root / name / build_id).exists():
        raise ValueError(f"build id {build_id!r} was used before in {name!r} (servers may hold a "
                         f"state of that build): choose another --build-id")


def cmd_build(args) -> int:
    from itertools import chain, islice

    import faiss

    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import read_corpus
    from server.backends.threads import model_threads_now
    from server.core.collection import CollectionStore

    # training and adding: the container's CPU quota (or the operator's OMP_NUM_THREADS)
    faiss.omp_set_num_threads(model_threads_now())
    store = CollectionStore(args.data_dir)
    if args.build_id:
        _check_build_id_unused(store, args.collection, args.build_id,
                               Path(args.data_dir) / ".state")
    tally: dict = {}
    docs = read_corpus(args.corpus, args.tenant, tally)
    if args.limit:
        docs = islice(docs, args.limit)
    vectors = None
    if args.vectors is not None:
        kept = list(docs)
        vectors = vectors_of_records(_load_npy(args.vectors, "--vectors"), kept, tally)
        docs = iter(kept)
    audit_queries = _load_npy(args.audit_queries, "--audit-queries") if args.audit_queries else None
    first = next(docs, None)  # a corpus that carries its vectors needs no model: look before loading one
    docs = chain([first], docs) if first is not None else iter(())
    embedder = None
    if vectors is None and not args.model_id and (first is None or first.vector is None):
        from server.backends.device import Device
        from server.backends.models import Embedder

        embedder = Embedder(Path(args.embedder) if args.embedder else None, Device(args.device),
                            model_name=args.embedder_name)
    knobs, pinned = _knobs(args)
    desc = build_collection(docs, store, args.collection, embedder, args.factory, args.shards,
                            args.metric, knobs, args.build_id, quiet=args.quiet,
                            dedicated_tenant_min_chunks=args.dedicated_tenant_min_chunks,
                            vectors=vectors, model_id=args.model_id, audit_queries=audit_queries)
    print(f"built {args.collection}/{desc.build_id}: {desc.documents} documents, {desc.chunks} "
          f"chunks, {desc.shards} shard(s), factory {desc.factory}, model {desc.model_id}")
    unused = _knobs_that_do_not_apply(pinned, desc)
    if unused:  # (outside QA: --nprobe on an HNSW factory was stored without a word)
        print(f"index-builder build: note: {', '.join(unused)} "
              f"{'does' if len(unused) == 1 else 'do'} not apply to {desc.factory}; no search uses "
              f"{'it' if len(unused) == 1 else 'them'}", file=sys.stderr)
    if args.audit or args.publish:
        audit = audit_build(store, args.collection, desc.build_id, min_recall=args.min_recall,
                            target_recall=args.target_recall or None, pinned=pinned,
                            progress=None if args.quiet else _to_stderr)
        recon = audit["reconciliation"]
        _print_tuning(audit, desc.factory)
        print(f"audit: recall@{audit['k']} = {audit['recall']:.4f} over {audit['queries']} "
              f"queries, {audit['query_source']} ({'passed' if audit['passed'] else 'FAILED'}, "
              f"threshold {args.min_recall}); count reconciliation "
              f"{'passed' if recon['passed'] else 'FAILED: ' + '; '.join(recon['mismatches'])}")
        if not (audit["passed"] and recon["passed"]):  # `build --audit` in CI fails the step
            print("not published: the audit failed" if args.publish else "the audit failed",
                  file=sys.stderr)
            return 1
        if args.publish:
            refusal = model_change_refusal(Path(args.data_dir) / ".state", args.collection, desc)
            if refusal:
                print(f"not published: {refusal}", file=sys.stderr)
                return 1
            store.publish(args.collection, desc.build_id)
            print(f"published: {args.collection} -> {desc.build_id}")
    return 0


def _load_npy(path: Path, flag: str):
    """A numeric .npy array, or a ValueError naming the flag and the file (outside QA: a file of
    another format, or of Python objects, said "pickled (object) data ... allow_pickle=")."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            magic = f.read(6)
            if magic != b"\x93NUMPY":  # numpy would take any other file for a pickle
                raise ValueError("not a .npy file")
            if f.seekable():
                f.seek(0)
                return np.load(f, allow_pickle=False)
            # a pipe (`--vectors <(...)`) reads once: the magic is already taken from it
            # (outside QA: reopening it by name read it empty, an EOFError traceback)
            return np.load(io.BytesIO(magic + f.read()), allow_pickle=False)
    except (ValueError, EOFError) as exc:  # EOFError: a file cut short
        why = ("it holds Python objects, not numbers" if "allow_pickle" in str(exc)
               else str(exc).split("\n")[0])
        raise ValueError(f"{flag} {path}: not a numeric .npy array ({why})") from None


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _print_tuning(audit: dict, factory: str) -> None:
    """What the knob tuning found: never "meets" when nothing met the target."""
    tuning = audit.get("tuning")
    if not tuning:
        return
    k, target = audit["k"], tuning["target_recall"]
    pinned = tuning.get("pinned") or []
    kept = f" ({', '.join(pinned)} kept as given)" if pinned else ""
    if not tuning["sweep"]:
        what = "no search knob left" if pinned else "no search knob"
        print(f"tuned: {factory} has {what} to tune{kept} (recall@{k} {audit['recall']:.4f})")
    elif audit["recall"] >= target:
        print(f"tuned: {tuning['chosen']} meets recall@{k} >= {target} at the lowest measured "
              f"cost{kept}")
    else:
        print(f"tuned: no setting reached recall@{k} >= {target}; kept the best measured, "
              f"{tuning['chosen']} ({audit['recall']:.4f}){kept}: a larger index (more lists, "
              "PQ bytes or a refine step), a lower target or other pinned knobs are needed")
    if "held-in" in audit["query_source"]:
        print("  note: tuned on held-in queries (vectors of the build itself), which flatters "
              "recall; unseen queries may get less - give --audit-queries FILE (held-out query "
              "vectors) to tune on those")


def cmd_audit(args) -> int:
    from index_builder.build import audit_build, prepare_audit_queries
    from server.core.collection import CollectionStore

    store = CollectionStore(args.data_dir)
    builds = store.builds(args.collection)  # the newest by creation time, not by name
    build = args.build or (max(builds, key=lambda b: store.descriptor(args.collection, b).created_at)
                           if builds else None)
    if build is None:
        print(f"collection {args.collection!r} has no builds under {args.data_dir}", file=sys.stderr)
        return 2
    if args.target_recall is not None and _is_live(store, args.collection, build):
        print(f"build {build} is live: servers loaded its search knobs when they switched to it, "
              "and tuning would rewrite the published build under them; tune a build before "
              "publishing it (index-builder build --target-recall, or audit --target-recall on "
              "an unpublished build)", file=sys.stderr)
        return 2
    record = not args.no_record
    if record and not os.access(store.build_dir(args.collection, build), os.W_OK):
        print(f"{store.build_dir(args.collection, build)} is read-only: the result is printed, "
              "not recorded", file=sys.stderr)
        record = False
    queries = None
    if args.audit_queries is not None:
        desc = store.descriptor(args.collection, build)
        queries = prepare_audit_queries(_load_npy(args.audit_queries, "--audit-queries"),
                                        desc.dim, desc.metric)
    pinned = ((store.descriptor(args.collection, build).audit or {}).get("tuning") or {}).get(
        "pinned") or ()  # knobs given at build time stay given
    audit = audit_build(store, args.collection, build, args.k, queries=queries,
                        n_queries=args.queries, min_recall=args.min_recall,
                        target_recall=args.target_recall, pinned=tuple(pinned),
                        state_root=args.state_dir or args.data_dir / ".state", record=record,
                        progress=_to_stderr)
    print(json.dumps(audit, indent=2))
    return 0 if audit["passed"] and audit["reconciliation"]["passed"] else 1


def _is_live(store, collection: str, build: str) -> bool:
    from server.errors import NotFound

    try:
        return store.live_build(collection) == build
    except NotFound:  # no alias yet: nothing is published
        return False


def writes_of_other_models(state_root: Path, collection: str, desc) -> dict[str, int]:
    """Streaming writes in this host's state of `collection` (any build but `desc`'s) embedded
    with another model than `desc`'s: a server switching to `desc` replays them, re-embedding
    each, which needs `desc`'s embedder."""
    from server.backends.docstore import DocStore

    counts: dict[str, int] = {}
    for db in sorted((Path(state_root) / collection).glob("*/shard-*/docstore.sqlite")):
        if db.parent.parent.name == desc.build_id:
            continue
        store = DocStore(db, read_only=True)
        try:
            for model, n in store.write_models().items():
                if model != desc.model_id:
                    counts[model] = counts.get(model, 0) + n
        finally:
            store.close()
    return counts


def model_change_refusal(state_root: Path, collection: str, desc) -> Optional[str]:
    """Why publishing `desc` is refused without --allow-model-change (None: it is not). Outside
    QA: such a build was published, servers without its embedder refused the switch, and after a
    restart refused to start - every collection of that data directory down."""
    others = writes_of_other_models(state_root, collection, desc)
    if not others:
        return None
    held = ", ".join(f"{n} of model {m!r}" for m, n in sorted(others.items()))
    return (f"build {desc.build_id} embeds with {desc.model_id!r}, but the servers' state holds "
            f"streaming writes embedded with another model ({held}). A server switching to it "
            f"must re-embed them: one without that model's embedder refuses the switch, and after "
            f"a restart cannot serve the collection. Publish it with `index-builder publish --build "
            f"{desc.build_id} --allow-model-change` once every server loads the embedder of "
            f"{desc.model_id!r}.")


def _flip(args, store, build_id: str, command: str, done: str, **publish) -> int:
    """Publish `build_id` (publish, rollback): refused while the servers' state holds streaming
    writes of another model, unless --allow-model-change."""
    refusal = None if args.allow_model_change else model_change_refusal(
        args.state_dir or Path(args.data_dir) / ".state", args.collection,
        store.descriptor(args.collection, build_id))
    if refusal:
        print(f"index-builder {command}: error: {refusal}", file=sys.stderr)
        return 2
    alias = store.publish(args.collection, build_id, **publish)
    print(f"{done}: {args.collection} -> {alias['live']} (previous: {alias['previous']})")
    return 0


def cmd_publish(args) -> int:
    from server.core.collection import CollectionStore

    return _flip(args, CollectionStore(args.data_dir), args.build, "publish", "published",
                 min_recall=args.min_recall)


def cmd_rollback(args) -> int:
    from server.core.collection import CollectionStore

    store = CollectionStore(args.data_dir)
    alias = store.alias(args.collection) if args.collection in store.collections() else {}
    live, previous = alias.get("live"), alias.get("previous")
    if not previous:
        why = ("is not published" if not live else
               f"has no rollback target: {live} is the only build it has published")
        print(f"index-builder rollback: error: collection {args.collection!r} {why}",
              file=sys.stderr)
        return 2
    # the target was live before, published by an operator who accepted its recall then (perhaps
    # with --min-recall): a rollback is not refused for it (outside QA: it was, and said "not
    # published"). Its reconciliation and files are still checked.
    return _flip(args, store, previous, "rollback", "rolled back", expect_live=live, min_recall=0.0)


def cmd_list(args) -> int:
    from server.core.collection import DESCRIPTOR, NAME, CollectionStore
    from server.errors import IndexCorruptError

    if not Path(args.data_dir).exists():  # a typo listed nothing and exited 0 (a file: main)
        print(f"data directory {args.data_dir} does not exist", file=sys.stderr)
        return 2
    store = CollectionStore(args.data_dir)

    def build_dirs(name: str) -> list[str]:
        """Every build directory, with its descriptor or not (staging ones aside): one that lost
        its descriptor is damaged, not absent (re-probe: such a build was left out of the list,
        or called gone while its files were there)."""
        d = store.collection_dir(name) / "builds"
        return sorted(p.name for p in d.iterdir()
                      if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else []

    names = [args.collection] if args.collection else sorted(
        set(store.collections(unpublished=True))
        | {p.name for p in Path(args.data_dir).iterdir()
           if p.is_dir() and NAME.match(p.name) and build_dirs(p.name)})
    if args.collection and not build_dirs(args.collection):
        print(f"collection {args.collection!r} has no builds under {args.data_dir}", file=sys.stderr)
        return 2
    published = set(store.collections())
    damaged = 0
    for name in names:
        alias = store.alias(name) if name in published else {}
        live = alias.get("live")
        print(name if live else f"{name}  (not published)")
        builds_dir = store.collection_dir(name) / "builds"
        dirs, builds = build_dirs(name), store.builds(name)
        headless = [b for b in dirs if b not in builds]
        width = max(map(len, dirs), default=0)  # one column of build ids, whatever their lengths
        for role, b in (("live", live), ("the rollback target", alias.get("previous"))):
            if b and b not in dirs:  # (outside QA: a gone live build was unsaid)
                print(f"  ! {b}  MISSING: the alias names it as {role}, but it is gone"
                      + ("; publish a build listed here" if role == "live" else ""))
                damaged += 1
        for b in headless:
            print(f"  {'*' if b == live else ' '} {b:<{width}}  DAMAGED: its release descriptor "
                  f"{builds_dir / b / DESCRIPTOR} is missing")
            damaged += 1
        for b in builds:
            try:
                d = store.descriptor(name, b)
                audit = (f"recall@{d.audit['k']}={d.audit['recall']:.3f}"
                         + ("" if d.audit.get("passed") else " (audit FAILED)")
                         if d.audit else "not audited")
                line = (f"{d.factory:<24} {d.chunks:>8} chunks  {d.shards} shard(s)  {audit}")
                problems = store.file_problems(name, b, hashes=args.verify)
                if problems:  # (outside QA: a build whose vectors were gone listed as whole)
                    raise IndexCorruptError(problems[0] + (f" (and {len(problems) - 1} more)"
                                                           if len(problems) > 1 else ""))
            except (IndexCorruptError, KeyError, TypeError, ValueError, OSError) as exc:
                # one damaged (or unreadable) build must not hide the others
                why = str(exc) or type(exc).__name__
                print(f"  {'*' if b == live else ' '} {b:<{width}}  DAMAGED: {why}")
                damaged += 1
                continue
            print(f"  {'*' if b == live else ' '} {b:<{width}}  {line}")
    return 1 if damaged else 0


def cmd_prune(args) -> int:
    from server.core.collection import CollectionStore

    if args.keep < 0 or args.grace_s < 0:
        raise ValueError(f"--keep and --grace-s must be 0 or more, not {args.keep} and "
                         f"{args.grace_s:g}")
    store = CollectionStore(args.data_dir)
    # staging directories of builds and compactions that were killed (`builds/.tmp-<id>`; the
    # next build sweeps them too): prune removes them, as it says (outside QA: it neither
    # removed nor mentioned them)
    swept = _sweep_abandoned(store, args.collection, args.dry_run)
    if not store.builds(args.collection):
        print(f"collection {args.collection!r} has no builds under {args.data_dir}", file=sys.stderr)
        return 2
    if args.collection not in store.collections():
        raise ValueError(f"collection {args.collection!r} has never been published: nothing "
                         f"decides what to keep yet (remove an unwanted build by hand)")
    alias, builds = store.alias(args.collection), store.builds(args.collection)
    if alias.get("live") not in builds:  # (re-probe: it pruned the build to publish next)
        raise ValueError(f"the alias names live build {alias.get('live')}, which is gone: "
                         f"publish a build first (index-builder list)")
    if alias.get("previous") and alias["previous"] not in builds:
        print(f"warning: the rollback target {alias['previous']} is gone", file=sys.stderr)
    plan = store.retention(args.collection, args.keep, args.grace_s)
    freed, removed = swept, 0
    for build_id, kept, why in plan:
        if kept:
            print(f"  keep    {build_id}  ({why})")
            continue
        if args.dry_run:
            size = store.build_size(args.collection, build_id)
            print(f"  would remove {build_id}  ({size / 1e6:.1f} MB)")
        else:
            size = store.remove_build(args.collection, build_id)
            print(f"  removed {build_id}  ({size / 1e6:.1f} MB)")
        freed += size
        removed += 1
    verb = "would free" if args.dry_run else "freed"
    print(f"{args.collection}: {removed} of {len(plan)} builds {'to remove' if args.dry_run else 'removed'}, "
          f"{verb} {freed / 1e6:.1f} MB")
    return 0


def _sweep_abandoned(store, collection: str, dry_run: bool) -> int:
    """Remove (or, `dry_run`, list) the staging directories whose builder is gone; their bytes."""
    builds = store.collection_dir(collection) / "builds"
    found = store.sweep_abandoned(collection, remove=False)
    sizes = {}
    for name in found:
        try:
            sizes[name] = sum(p.lstat().st_size for p in (builds / name).rglob("*") if p.is_file())
        except FileNotFoundError:  # a concurrent build's sweep removed it meanwhile
            sizes[name] = 0
    gone = found if dry_run else store.sweep_abandoned(collection)
    for name in gone:
        print(f"  {'would remove' if dry_run else 'removed'} {name}  (a build or compaction that "
              f"did not finish, {sizes.get(name, 0) / 1e6:.1f} MB)")
    return sum(sizes.get(name, 0) for name in gone)


def cmd_demo_corpus(args) -> int:
    from index_builder.corpus import stdlib_docs

    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(args.out, "w") as f:
        for doc in stdlib_docs(args.limit):
            f.write(json.dumps({"id": doc.doc_id, "title": doc.title, "text": doc.text,
                                "metadata": doc.metadata}) + "\n")
            n += 1
    print(f"wrote {n} documents to {args.out}")
    return 0


def cmd_compact(args) -> int:
    import grpc

    from server.rpc import search_pb2 as pb
    from server.rpc import search_pb2_grpc as pb_grpc

    from server.client import open_channel

    try:
        token = args.token_file.read_text().strip() if args.token_file else args.token
    except OSError as exc:
        print(f"index-builder compact: --token-file {args.token_file}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with open_channel(args.address, args.tls_ca, args.tls_cert, args.tls_key) as ch:
        try:
            r = pb_grpc.AdminServiceStub(ch).Compact(pb.CompactRequest(collection=args.collection),
                                                     metadata=md, timeout=3600)
        except grpc.RpcError as err:
            print(f"index-builder compact: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(f"compacted {args.collection}: {r.previous_build_id} -> {r.build_id}; rows "
          f"{r.live_rows_before} live + {r.dead_rows_before} dead -> {r.rows_after}; "
          f"{r.replayed_writes} writes replayed; {r.seconds:.1f}s")
    return 0


def cmd_canary(args) -> int:
    from index_builder.canary import main as canary_main

    return canary_main(args)


def cmd_eval(args) -> int:
    from index_builder.evaluate import run_eval

    return run_eval(args)


COMMANDS = {"build": cmd_build, "audit": cmd_audit, "publish": cmd_publish,
            "rollback": cmd_rollback, "list": cmd_list,
            "prune": cmd_prune,
            "demo-corpus": cmd_demo_corpus, "eval": cmd_eval, "canary-check": cmd_canary,
            "compact": cmd_compact}


def main(argv=None) -> None:
    from server.backends.threads import limit_openmp_spinning

    limit_openmp_spinning()  # before anything loads torch's or faiss's OpenMP runtime
    args = build_parser().parse_args(argv)
    from server.errors import STORAGE_CONDITION_WORDS, SearchError, storage_condition

    try:
        data_dir = getattr(args, "data_dir", None)
        if data_dir is not None and Path(data_dir).exists() and not Path(data_dir).is_dir():
            raise ValueError(f"--data-dir {data_dir} is not a directory")
        rc = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe (`list | head`) is caught
    except (SearchError, ValueError, FileNotFoundError, FileExistsError, IsADirectoryError,
            NotADirectoryError) as exc:  # one line, not a traceback (outside QA)
        print(f"index-builder {args.command}: error: {exc}", file=sys.stderr)
        rc = 2
    except BrokenPipeError:  # `index-builder list | head`
        from server.client import stdout_reader_gone

        stdout_reader_gone()
        rc = 0
    except KeyboardInterrupt:  # Ctrl-C: a build's staging directory is already removed
        print(f"index-builder {args.command}: interrupted"
              + ("; an unfinished build was removed" if args.command == "build" else ""),
              file=sys.stderr)
        rc = 130
    except Exception as exc:
        # storage refusing (a full volume: SQLite's "database or disk is full", an OSError, a
        # tantivy error) is the operator's to fix, and said in one line (outside QA: a
        # traceback); an unfinished build is already removed. Anything else is a bug: traced
        condition = storage_condition(exc)
        if condition is None:
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"index-builder {args.command}: error: storage it writes or reads is "
              f"{STORAGE_CONDITION_WORDS[condition]} ({type(exc).__name__}: {first})"
              + ("; the unfinished build was removed" if args.command == "build" else ""),
              file=sys.stderr)
        rc = 2
    sys.exit(rc)


if __name__ == "__main__":
    main()
