"""The builder CLI end to end on a real corpus slice with the real packaged MiniLM: build (with
progress), audit, publish, list; clear errors for bad input; a corrupted build fails at load
naming the file."""
import asyncio
import fcntl
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CRANFIELD, REPO


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "index_builder.cli", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not (CRANFIELD / "corpus.jsonl").is_file():
        pytest.skip("Cranfield dataset not found")
    data = tmp_path_factory.mktemp("cli")
    out = cli("build", "--data-dir", data, "--collection", "cran", "--corpus", CRANFIELD,
              "--limit", 120, "--factory", "HNSW16,Flat", "--shards", 2, "--publish")
    assert out.returncode == 0, out.stderr
    return data, out


@pytest.mark.slow
def test_build_audit_publish_with_the_real_model(built):
    data, out = built
    assert "built cran/" in out.stdout and "120 documents" in out.stdout
    assert "sentence-transformers/all-MiniLM-L6-v2@" in out.stdout
    assert "count reconciliation passed" in out.stdout and "published: cran ->" in out.stdout
    assert "embed" in out.stderr  # the progress bar
    alias = json.loads((data / "cran" / "ALIAS").read_text())
    desc = json.loads((data / "cran" / "builds" / alias["live"] / "release.json").read_text())
    assert desc["documents"] == 120 and desc["shards"] == 2 and desc["dim"] == 384
    assert desc["factory"] == "HNSW16,Flat" and desc["audit"]["recall"] >= 0.9
    assert desc["chunker"].startswith("words-") and desc["lexical_analyzer"]
    listing = cli("list", "--data-dir", data)
    assert listing.returncode == 0 and alias["live"] in listing.stdout and "recall@10=" in listing.stdout


def test_audit_command_reports_json_and_passes(built):
    data, _ = built
    out = cli("audit", "--data-dir", data, "--collection", "cran", "--queries", 50)
    assert out.returncode == 0, out.stderr
    audit = json.loads(out.stdout)
    assert audit["queries"] == 50 and audit["reconciliation"]["passed"]


def test_list_shows_unpublished_builds_and_audit_defaults_to_the_newest(tmp_path, tiny_embedder,
                                                                        cranfield_docs):
    """Outside QA: `list` left out collections with no published build (and `list --collection`
    failed on them), and `audit` without --build took the last build id by name, not the
    newest build."""
    from index_builder.build import build_collection
    from server.core.collection import CollectionStore

    store = CollectionStore(tmp_path)
    for build_id in ("zz-older", "aa-newer"):
        build_collection(cranfield_docs[:20], store, "waiting", tiny_embedder, "Flat", quiet=True,
                         build_id=build_id)
    listing = cli("list", "--data-dir", tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert "waiting  (not published)" in listing.stdout and "zz-older" in listing.stdout
    assert cli("list", "--data-dir", tmp_path, "--collection", "waiting").stdout == listing.stdout
    out = cli("audit", "--data-dir", tmp_path, "--collection", "waiting", "--queries", 10)
    assert out.returncode == 0, out.stderr
    assert store.descriptor("waiting", "aa-newer").audit and not store.descriptor(
        "waiting", "zz-older").audit
    # outside QA: one flipped byte in a build's descriptor stopped `list` part-way, hiding the
    # other builds, with a message that named no file
    damaged = store.build_dir("waiting", "zz-older") / "release.json"
    raw = bytearray(damaged.read_bytes())
    raw[5] = 0xFF
    damaged.write_bytes(bytes(raw))
    listing = cli("list", "--data-dir", tmp_path)
    assert listing.returncode == 1 and "aa-newer" in listing.stdout
    assert f"zz-older  DAMAGED: release descriptor {damaged} is unreadable" in listing.stdout
    # outside QA: an alias naming a build that is gone was listed as if nothing were wrong
    shutil.rmtree(store.build_dir("waiting", "zz-older"))
    store.publish("waiting", "aa-newer", require_audit=False)
    assert cli("list", "--data-dir", tmp_path, "--collection", "waiting").returncode == 0
    shutil.move(store.build_dir("waiting", "aa-newer"), tmp_path / "moved-away")
    build_collection(cranfield_docs[:20], store, "waiting", tiny_embedder, "Flat", quiet=True,
                     build_id="bb-other")
    listing = cli("list", "--data-dir", tmp_path, "--collection", "waiting")
    assert listing.returncode == 1 and "aa-newer  MISSING" in listing.stdout, listing.stdout
    # prune does not go on as if nothing were wrong (re-probe: it removed the build to publish)
    out = cli("prune", "--data-dir", tmp_path, "--collection", "waiting", "--keep", 0,
              "--grace-s", 0)
    assert out.returncode == 2 and "live build aa-newer, which is gone" in out.stderr
    assert store.builds("waiting") == ["bb-other"]
    store.publish("waiting", "bb-other", require_audit=False)  # the gone build is now previous
    listing = cli("list", "--data-dir", tmp_path, "--collection", "waiting")
    assert listing.returncode == 1, listing.stdout
    assert "aa-newer  MISSING: the alias names it as the rollback target" in listing.stdout
    # outside QA: build ids of other lengths shifted the columns after them
    build_collection(cranfield_docs[:20], store, "waiting", tiny_embedder, "Flat", quiet=True,
                     build_id="c")
    listing = cli("list", "--data-dir", tmp_path, "--collection", "waiting").stdout
    rows = [line for line in listing.splitlines() if line.lstrip(" *").startswith(("bb-other", "c "))]
    assert len(rows) == 2 and len({line.index("Flat") for line in rows}) == 1, listing


def test_the_live_build_is_not_retuned_under_its_servers(built):
    """Regression (outside QA): `audit --target-recall` on the live build rewrote the published
    build's search knobs; running servers kept the old ones (they load them on a switch) while
    the build on disk said otherwise."""
    data, _ = built
    alias = json.loads((data / "cran" / "ALIAS").read_text())
    release = data / "cran" / "builds" / alias["live"] / "release.json"
    before = release.read_text()
    out = cli("audit", "--data-dir", data, "--collection", "cran", "--build", alias["live"],
              "--target-recall", "0.99")
    assert out.returncode == 2 and "is live" in out.stderr, out.stderr
    assert release.read_text() == before


def test_tuning_says_whether_the_target_was_met(capsys):
    """Regression (outside QA): "tuned: ... meets recall@10 >= 0.95" was printed when the best
    setting reached 0.639, and for Flat, which has nothing to tune."""
    from index_builder.cli import _print_tuning

    sweep = [{"knobs": {}, "recall": 0.639, "ms_per_query": 0.1}]
    base = {"k": 10, "query_source": "held-out (build)"}
    _print_tuning({**base, "recall": 0.639, "tuning": {"target_recall": 0.95, "chosen": {"nprobe": 64},
                                                       "sweep": sweep}}, "IVF64,PQ16")
    _print_tuning({**base, "recall": 0.97, "tuning": {"target_recall": 0.95, "chosen": {"nprobe": 8},
                                                      "sweep": sweep}}, "IVF64,PQ16")
    _print_tuning({**base, "recall": 1.0, "tuning": {"target_recall": 0.95, "chosen": {}, "sweep": []}},
                  "Flat")
    _print_tuning({**base, "query_source": "held-in (sampled from the build; optimistic)", "recall": 0.97,
                   "tuning": {"target_recall": 0.95, "chosen": {}, "sweep": sweep}}, "HNSW16,Flat")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tuned: no setting reached recall@10 >= 0.95") and "0.6390" in lines[0]
    assert "meets recall@10 >= 0.95" in lines[1]
    assert lines[2] == "tuned: Flat has no search knob to tune (recall@10 1.0000)"
    assert "meets" in lines[3] and "held-in" in lines[4] and "--audit-queries" in lines[4]


def test_every_command_has_help():
    for cmd in ("build", "audit", "publish", "rollback", "list", "prune", "eval", "compact",
                "canary-check", "demo-corpus"):
        out = cli(cmd, "--help")
        assert out.returncode == 0 and "usage: index-builder" in out.stdout


def test_bad_corpus_lines_and_factories_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "text": "ok"}\n{"id": "2"}\n')
    out = cli("build", "--data-dir", tmp_path, "--collection", "x", "--corpus", bad)
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "text" in out.stderr
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"id": str(i), "text": f"doc {i} text"}) + "\n" for i in range(5)))
    out = cli("build", "--data-dir", tmp_path, "--collection", "x", "--corpus", good,
              "--factory", "IVF4096,Flat", "--quiet")
    assert out.returncode == 2 and "training vectors" in out.stderr
    assert not any((tmp_path / "x" / "builds").glob("*"))  # no half build left behind


@pytest.mark.parametrize("line,problem", [
    ({"id": "x" * 600, "text": "t"}, "doc_id must be 1..512 printable"),
    ({"id": "", "text": "t"}, "doc_id must be 1..512 printable"),
    ({"id": "a\tb", "text": "t"}, "doc_id must be 1..512 printable"),
    ({"id": "1", "text": "t", "version": -3}, "version must be between 1"),
    ({"id": "1", "text": "t", "version": 2 ** 63}, "version must be between 1"),
    ({"id": "1", "text": "t", "version": 1.5}, "version must be an integer"),
    # outside QA: 0 and false were stored as version 1
    ({"id": "1", "text": "t", "version": 0}, "version must be between 1"),
    ({"id": "1", "text": "t", "version": False}, "version must be an integer"),
    ({"id": "1", "text": "t" * 1_000_001}, "the cap is 1000000"),
    ({"id": "1", "text": "t", "metadata": {"bad key!": "v"}}, "metadata key"),
    # outside QA: stored, but no filter matched it, and dense and lexical disagreed on "a"
    ({"id": "1", "text": "t", "metadata": {"p": "a\x00b"}}, "metadata 'p' holds a NUL character"),
    ({"id": "1", "text": "t", "acl": ["no spaces"]}, "acl"),
    ({"id": "1", "text": "t", "tenant": "bad tenant"}, "tenant 'bad tenant' must match"),
    # outside QA: a valid JSON line that is not an object was a traceback; a null text was
    # indexed as the word "None", an object id and nested metadata as Python's repr of them
    (["id", "text"], "a record must be a JSON object, not list"),
    ("just a string", "a record must be a JSON object, not str"),
    ({"id": {"x": 1}, "text": "t"}, "id must be a string or an integer"),
    ({"id": "1", "text": 5}, "text must be a string, not int"),
    ({"id": "1", "text": "t", "title": ["a"]}, "title must be a string, not list"),
    ({"id": "1", "text": "t", "acl": [1]}, "acl must be a list of scope names"),
    # outside QA: 1e400 parses as infinity, which was stored as the text "Infinity"
    ({"id": "1", "text": "t", "metadata": {"n": float("inf")}}, "metadata 'n' holds a number that is not finite"),
    ({"id": "1", "text": "t", "metadata": {"n": [1, float("nan")]}}, "metadata 'n' holds a number that is not finite"),
])
def test_the_builder_refuses_what_the_write_api_refuses(tmp_path, line, problem):
    """Outside QA: the builder took ids, versions and sizes that UpsertDocument and
    DeleteDocument refuse, so such a document could never be replaced or deleted; 2^63 failed
    with a traceback."""
    from index_builder.corpus import read_corpus

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{corpus}:2: ") + ".*" + re.escape(problem)):
        list(read_corpus(corpus))


def test_a_document_with_neither_text_nor_title_is_skipped_and_reported(tmp_path, capsys):
    """Outside QA: such documents were counted in the build's documents but never indexed, so
    DescribeCollection and CollectionStats disagreed; the write API refuses them."""
    from index_builder.corpus import read_corpus

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in (
        {"id": "a", "text": "some text"}, {"id": "b", "text": "  "}, {"id": "c", "text": "", "title": "T"},
        {"id": "d", "text": None, "title": "Only a title",
         "metadata": {"authors": ["Ada", "Bo"], "gone": None, "n": 3, "flag": True, "x": 1.5}})))
    docs = list(read_corpus(corpus))
    assert [d.doc_id for d in docs] == ["a", "c", "d"] and docs[2].text == ""  # null: no text, not "None"
    # JSON, not Python's repr (a true flag was stored as "True", which no "true" filter matched)
    assert docs[2].metadata == {"authors": '["Ada","Bo"]', "n": "3", "flag": "true", "x": "1.5"}
    assert f"skipped 1 document(s) with neither text nor title: {corpus}:2 ('b')" in capsys.readouterr().err


def test_undecodable_corpus_lines_name_their_file_and_line(tmp_path):
    """Regression (outside QA): a byte that is not UTF-8 was reported without file or line, and a
    lone surrogate (a JSON escape no UTF-8 text can hold) failed later in the tokenizer with a
    bare TypeError."""
    from index_builder.corpus import read_corpus

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"id": "1", "text": "ok"}\n{"id": "2", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{latin1}:2: 'utf-8' codec can't decode byte 0xe9")):
        list(read_corpus(latin1))
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"id": "1", "text": "ok"}\n{"id": "2", "title": "bad \\ud800 title", "text": "x"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{lone}:2: title is not valid Unicode")):
        list(read_corpus(lone))
    bom = tmp_path / "bom.jsonl"  # a byte-order mark (Windows exports) is not an error
    bom.write_bytes(b'\xef\xbb\xbf{"id": "1", "text": "caf\xc3\xa9"}\n')
    assert [d.text for d in read_corpus(bom)] == ["caf\u00e9"]


@pytest.mark.parametrize("damaged", ["dense.faiss", "docstore.sqlite", "vectors.npy", "state"])
def test_a_corrupted_build_fails_at_load_naming_the_file(built, tiny_embedder, damaged):
    """A truncated file of the build (or of a shard's state copy) fails the load with an
    IndexCorruptError that names the file - never a bare sqlite3 or numpy traceback."""
    from conftest import make_core
    from server.core.engine.state import prepare, state_shard_dir
    from server.errors import IndexCorruptError
    import shutil

    data, _ = built
    copy = data.parent / f"corrupt-copy-{damaged}"
    shutil.copytree(data, copy)
    alias = json.loads((copy / "cran" / "ALIAS").read_text())
    shard = copy / "cran" / "builds" / alias["live"] / "shard-001"
    if damaged == "state":  # the state copy a server made at its first start
        target = prepare(shard, state_shard_dir(copy / ".state", "cran", alias["live"], "shard-001"))
        target = target / "docstore.sqlite"
        for extra in ("-wal", "-shm"):
            Path(f"{target}{extra}").unlink(missing_ok=True)
    else:
        target = shard / damaged
    with open(target, "r+b") as f:
        f.truncate(4096 if damaged != "dense.faiss" else target.stat().st_size - 100)
    core = make_core(copy)
    with pytest.raises(IndexCorruptError, match=re.escape(str(target))):
        core.load()


@pytest.mark.parametrize("damaged", ["vectors.npy", "docstore.sqlite", "lexical", "vectors.npy later"])
def test_a_build_damaged_in_place_fails_at_load_naming_the_file(built, tiny_embedder, damaged):
    """Same-size damage after publish - two vector rows swapped, a text edited in the document
    store, a bit of a BM25 segment flipped - is refused at load by the build's checksums
    (outside QA: each was served, the edited text verbatim). The vectors, which a shard reads
    from the build itself, are checked at every load: damage after a server's first start (its
    state made) was served too (outside QA, a later round)."""
    import shutil
    import sqlite3

    import numpy as np

    from conftest import make_core
    from server.errors import IndexCorruptError

    data, _ = built
    copy = data.parent / f"inplace-copy-{damaged}"
    shutil.copytree(data, copy, ignore=shutil.ignore_patterns(".state"))
    alias = json.loads((copy / "cran" / "ALIAS").read_text())
    shard = copy / "cran" / "builds" / alias["live"] / "shard-001"
    if damaged == "vectors.npy later":  # a server started on it once: its state exists
        core = make_core(copy)
        core.load()
        asyncio.run(core.close())
        assert any((copy / ".state").rglob("STATE_READY"))
        damaged = "vectors.npy"
    if damaged == "vectors.npy":
        target = shard / damaged
        v = np.load(target)
        np.save(target, v[[1, 0, *range(2, len(v))]])
    elif damaged == "docstore.sqlite":
        target = shard / damaged
        with sqlite3.connect(target) as conn:
            conn.execute("UPDATE chunks SET text = 'edited' WHERE row = 0")
        conn.close()
    else:
        target = max((f for f in (shard / "lexical").iterdir() if not f.name.startswith(".")),
                     key=lambda f: f.stat().st_size)
        whole = target.read_bytes()
        target.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    core = make_core(copy)
    with pytest.raises(IndexCorruptError, match=re.escape(str(target)) + " fails its sha256"):
        core.load()


@pytest.mark.slow
def test_eval_runs_several_datasets_from_one_command(tmp_path):
    """`index-builder eval --dataset A --dataset B --serve-from DIR`: builds both collections,
    serves them, evaluates every mode and compares hybrid with plain RRF per query."""
    from index_builder.evaluate import load_beir

    sets = []
    for name, docs in (("cranmini", 120), ("cranmini2", 80)):
        d = tmp_path / name
        (d / "qrels").mkdir(parents=True)
        lines = (CRANFIELD / "corpus.jsonl").read_text().splitlines()[:docs]
        (d / "corpus.jsonl").write_text("\n".join(lines) + "\n")
        queries, qrels = load_beir(CRANFIELD)
        kept = {json.loads(x)["_id"] for x in lines}
        qids = [q for q in qrels if set(qrels[q]) & kept][:6]
        (d / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": queries[q]}) + "\n"
                                                 for q in qids))
        (d / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
            f"{q}\t{doc}\t{g}\n" for q in qids for doc, g in qrels[q].items()))
        sets.append(d)
    out = cli("eval", "--dataset", sets[0], "--dataset", f"{sets[1]}=second", "--serve-from",
              tmp_path / "data", "--out", tmp_path / "report", timeout=900)
    assert out.returncode == 0, out.stderr
    assert "## cranmini (6 judged queries)" in out.stdout and "## second (6 judged queries)" in out.stdout
    assert "| hybrid-rrf | all | 6 |" in out.stdout and "nDCG@10 hybrid - hybrid-rrf" in out.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert set(summary) == {"cranmini", "second"} and "hybrid vs hybrid-rrf" in summary["second"]["tests"]
    # the printed tables are kept beside it (outside QA: README named a file nothing wrote)
    tables = (tmp_path / "report" / "eval_tables.md").read_text()
    assert "## cranmini (6 judged queries)" in tables and "| hybrid-rrf | all | 6 |" in tables


def test_a_pinned_knob_stays_while_the_others_tune(tmp_path, capsys):
    """Outside QA: --nprobe 8 on an IVF-PQ build with a refine step turned all tuning off, so
    k_factor stayed at its default and the audit failed (recall 0.64, where tuning k_factor
    reached 0.95) without a word. The given knob now stays and the others tune; the tuning line
    names only the knobs of the index, and says which were kept."""
    import numpy as np

    from index_builder.build import audit_build, build_collection
    from index_builder.cli import _print_tuning
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore

    rng = np.random.default_rng(11)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    store = CollectionStore(tmp_path)
    desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(3000)], store, "pq",
                            None, "IVF16,PQ4x4fs,RFlat", quiet=True, vectors=x, model_id="m",
                            search_defaults={"nprobe": 8, "ef_search": 128, "k_factor": 4},
                            audit_queries=rng.standard_normal((100, 16)).astype(np.float32))
    audit = audit_build(store, "pq", desc.build_id, target_recall=0.95, pinned=("nprobe",))
    tuning = audit["tuning"]
    assert {s["knobs"]["nprobe"] for s in tuning["sweep"]} == {8}
    assert len({s["knobs"]["k_factor"] for s in tuning["sweep"]}) > 1  # k_factor was tuned
    assert tuning["chosen"]["nprobe"] == 8 and set(tuning["chosen"]) == {"nprobe", "k_factor"}
    assert tuning["pinned"] == ["nprobe"]
    assert store.descriptor("pq", desc.build_id).search_defaults["nprobe"] == 8
    _print_tuning(audit, "IVF16,PQ4x4fs,RFlat")
    out = capsys.readouterr().out
    assert "(nprobe kept as given)" in out and "ef_search" not in out
    # knobs the index does not have are named (outside QA: stored without a word)
    from index_builder.cli import _knobs_that_do_not_apply

    assert _knobs_that_do_not_apply(("nprobe", "ef_search", "k_factor"), desc) == ["--ef-search"]
    hnsw = build_collection([Document(f"d{i}", f"doc {i}") for i in range(50)], store, "hnsw",
                            None, "HNSW8,Flat", shards=60, vectors=x[:50], model_id="m")
    assert "60 shards for 50 documents: at least 10 shard(s) start empty" in capsys.readouterr().err
    assert _knobs_that_do_not_apply(("nprobe", "k_factor"), hnsw) == ["--nprobe", "--k-factor"]
    assert _knobs_that_do_not_apply(("ef_search",), hnsw) == []
    refined = build_collection([Document(f"d{i}", f"doc {i}") for i in range(300)], store, "pqr",
                               None, "PQ4x4fs,RFlat", quiet=True, vectors=x[:300], model_id="m")
    assert _knobs_that_do_not_apply(("k_factor", "nprobe"), refined) == ["--nprobe"]


def test_command_line_mistakes_get_one_line_errors_not_tracebacks(tmp_path, capsys):
    """Outside QA (a new user's walk-through): `list` of a mistyped data directory printed
    nothing and exited 0; search-client answered --top-k -1, a missing --token-file and a server
    that never came up (--wait) with tracebacks; a port in use was a 39-line traceback and the
    metrics port's error did not say which port."""
    import socket

    from index_builder.cli import main as builder
    from server.client import main as client
    from server.transport.app import start_metrics

    with pytest.raises(SystemExit) as exit_:
        builder(["list", "--data-dir", str(tmp_path / "typo")])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err
    for argv, said in ((["--top-k", "-1", "q"], "--top-k"),
                       (["--token-file", str(tmp_path / "none"), "q"], "--token-file")):
        with pytest.raises(SystemExit) as exit_:
            client(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port} \\(--metrics-port\\)"):
            start_metrics("127.0.0.1", port)
        import grpc

        from server.transport.app import _listen

        async def listen():
            server = grpc.aio.server()
            try:
                _listen(server, "127.0.0.1", port, None)
            finally:
                await server.stop(None)

        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(--host/--port\\)"):
            asyncio.run(listen())
    assert client(["--wait", "0.5", "--address", f"127.0.0.1:{_free_port()}", "q"]) == 2
    assert "did not answer SERVING within 0.5 s" in capsys.readouterr().err
    # a typo is not offered the internal command serve --workers starts (outside QA re-probe)
    from server.main import main as server

    with pytest.raises(SystemExit):
        server(["serv"])
    said = capsys.readouterr().err
    assert "invalid choice: 'serv'" in said and "frontend" not in said


def test_client_tls_flags_without_their_pair_or_file_are_one_line_errors(tmp_path):
    """Outside QA: --tls-cert without --tls-key aborted every client tool inside gRPC's core
    (exit 134), --tls-key alone connected in plaintext as if it were not there, and a missing
    --tls-ca file was a traceback. Each is refused with a line naming the flag, before any call
    (run as subprocesses: the abort would take pytest with it)."""
    pem = tmp_path / "any.pem"
    pem.write_text("not used: refused before it is read\n")
    address = f"127.0.0.1:{_free_port()}"
    tools = {"search-client": ["server.client", "--address", address, "q"],
             "health": ["server.main", "health", "--address", address],
             "compact": ["index_builder.cli", "compact", "--address", address, "--collection", "c"]}
    cases = ((["--tls-cert", str(pem)], "--tls-cert and --tls-key go together"),
             (["--tls-key", str(pem)], "--tls-cert and --tls-key go together"),
             (["--tls-ca", str(tmp_path / "none.pem")], "--tls-ca"))
    for tool, argv in tools.items():
        for flags, said in cases:
            proc = subprocess.run([sys.executable, "-m", *argv, *flags], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, (tool, flags, proc.returncode, proc.stderr[-300:])
            assert said in proc.stderr and "Traceback" not in proc.stderr, (tool, flags, proc.stderr)
        # empty flags are unset, not Path("") - the current directory, refused as "--tls-ca .:
        # Is a directory" (outside QA): plaintext, so the call reaches the (absent) server
        proc = subprocess.run([sys.executable, "-m", *argv, "--tls-ca", "", "--tls-cert", "",
                               "--tls-key", ""], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr, (tool, proc.stderr[-300:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flags,problem", [
    (("--nprobe", "-3"), "--nprobe: must be at least 1, not -3"),
    (("--ef-search", "0"), "--ef-search: must be at least 1, not 0"),
    (("--limit", "0"), "--limit: must be at least 1, not 0"),
    (("--target-recall", "1.5"), "--target-recall: a recall is between 0 and 1, not 1.5"),
])
def test_knobs_out_of_range_are_refused_before_anything_is_built(tmp_path, flags, problem):
    """Outside QA: --nprobe -3 failed with a traceback after the build was written, --ef-search 0
    was stored in the build, --limit 0 indexed everything, --target-recall 1.5 was taken."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "text": "one"}) + "\n")
    out = cli("build", "--data-dir", tmp_path, "--collection", "x", "--corpus", corpus, *flags)
    assert out.returncode == 2 and problem in out.stderr, out.stderr
    assert not (tmp_path / "x").exists()


def test_publish_refuses_a_build_of_another_model_than_the_writes_servers_hold(tmp_path, tiny_embedder,
                                                                               cranfield_docs):
    """Outside QA: a build of another model was published over a collection whose servers held
    streaming writes; a server without that model's embedder refused the switch, and after a
    restart refused to start, taking every collection of its data directory down."""
    import numpy as np

    from conftest import publish_build, write_through_a_server
    from index_builder.build import audit_build, build_collection
    from server.core.collection import CollectionStore

    first = publish_build(tmp_path, "c", cranfield_docs[:20], tiny_embedder)
    write_through_a_server(tmp_path, tiny_embedder, "streamed", "a streamed write")
    store = CollectionStore(tmp_path)
    vectors = np.random.default_rng(0).standard_normal((20, first.dim)).astype(np.float32)
    other = build_collection(cranfield_docs[:20], store, "c", None, "Flat", quiet=True,
                             vectors=vectors, model_id="someone-elses-model@1")
    audit_build(store, "c", other.build_id)
    out = cli("publish", "--data-dir", tmp_path, "--collection", "c", "--build", other.build_id)
    assert out.returncode == 2, out.stdout
    assert f"holds streaming writes embedded with another model (1 of model {first.model_id!r})" in out.stderr
    assert store.live_build("c") == first.build_id  # nothing changed
    out = cli("publish", "--data-dir", tmp_path, "--collection", "c", "--build", other.build_id,
              "--allow-model-change")
    assert out.returncode == 0, out.stderr
    assert store.live_build("c") == other.build_id


def test_rollback_publishes_the_previous_build_and_a_second_one_undoes_it(tmp_path, tiny_embedder,
                                                                          cranfield_docs):
    """Outside QA: the docs and error messages spoke of rolling back, but no command did it (it
    took `publish --build <previous id>`, which no doc said)."""
    from conftest import publish_build
    from server.core.collection import CollectionStore

    out = cli("rollback", "--data-dir", tmp_path, "--collection", "r")
    assert out.returncode == 2 and "is not published" in out.stderr
    first = publish_build(tmp_path, "r", cranfield_docs[:20], tiny_embedder)
    out = cli("rollback", "--data-dir", tmp_path, "--collection", "r")
    assert out.returncode == 2 and "has no rollback target" in out.stderr
    second = publish_build(tmp_path, "r", cranfield_docs[20:40], tiny_embedder)
    store = CollectionStore(tmp_path)
    out = cli("rollback", "--data-dir", tmp_path, "--collection", "r")
    assert out.returncode == 0, out.stderr
    assert store.alias("r") == {**store.alias("r"), "live": first.build_id, "previous": second.build_id}
    assert f"rolled back: r -> {first.build_id}" in out.stdout
    out = cli("rollback", "--data-dir", tmp_path, "--collection", "r")
    assert out.returncode == 0 and store.live_build("r") == second.build_id
    # outside QA: a build published with `--min-recall` below its audit's threshold could not be
    # rolled back to ("... below the required 0.9000; not published")
    from index_builder.build import audit_build

    assert not audit_build(store, "r", first.build_id, min_recall=1.01)["passed"]
    listed = cli("list", "--data-dir", tmp_path).stdout.splitlines()
    assert "(audit FAILED)" in next(line for line in listed if first.build_id in line)
    assert "FAILED" not in next(line for line in listed if second.build_id in line)
    out = cli("publish", "--data-dir", tmp_path, "--collection", "r", "--build", first.build_id)
    assert out.returncode == 2 and "below the required 1.0100" in out.stderr
    out = cli("publish", "--data-dir", tmp_path, "--collection", "r", "--build", first.build_id,
              "--min-recall", "0")
    assert out.returncode == 0 and store.live_build("r") == first.build_id
    assert cli("rollback", "--data-dir", tmp_path, "--collection", "r").returncode == 0
    out = cli("rollback", "--data-dir", tmp_path, "--collection", "r")
    assert out.returncode == 0 and store.live_build("r") == first.build_id, out.stderr


def test_an_audit_never_falls_back_to_held_in_queries_when_the_builds_own_are_gone(tmp_path):
    """Outside QA: deleting a build's audit_queries.npy made the audit use a held-in sample of
    the index's own vectors (which flatters ANN recall), silently."""
    import numpy as np

    from index_builder.build import AUDIT_QUERIES, audit_build, build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore
    from server.errors import IndexCorruptError

    rng = np.random.default_rng(3)
    store = CollectionStore(tmp_path)
    desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(300)], store, "q", None,
                            "Flat", quiet=True, vectors=rng.standard_normal((300, 8)).astype(np.float32),
                            model_id="m", audit_queries=rng.standard_normal((20, 8)).astype(np.float32))
    assert audit_build(store, "q", desc.build_id)["query_source"] == "held-out (build)"
    (store.build_dir("q", desc.build_id) / AUDIT_QUERIES).unlink()
    with pytest.raises(IndexCorruptError, match=f"{AUDIT_QUERIES} is missing"):
        audit_build(store, "q", desc.build_id)


def test_an_altered_audit_query_file_or_bm25_file_list_is_refused(tmp_path):
    """Outside QA: two build files no checksum covered. An altered audit_queries.npy was audited
    as it was (a recall measured on other queries than the build's), and a truncated
    lexical/.managed.json passed publish, after which no server could open the BM25 index."""
    import numpy as np

    from index_builder.build import AUDIT_QUERIES, audit_build, build_collection
    from index_builder.corpus import Document
    from server.core.collection import CollectionStore
    from server.errors import FailedPrecondition, IndexCorruptError

    rng = np.random.default_rng(4)
    store = CollectionStore(tmp_path)
    desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(200)], store, "q", None,
                            "Flat", quiet=True, vectors=rng.standard_normal((200, 8)).astype(np.float32),
                            model_id="m", audit_queries=rng.standard_normal((20, 8)).astype(np.float32))
    build = store.build_dir("q", desc.build_id)
    audit_build(store, "q", desc.build_id)
    queries = build / AUDIT_QUERIES
    np.save(queries, np.load(queries)[::-1])  # the same size, other queries first
    with pytest.raises(IndexCorruptError, match=f"{queries} fails its sha256"):
        audit_build(store, "q", desc.build_id)
    with pytest.raises(FailedPrecondition, match=f"{queries} fails its sha256"):
        store.publish("q", desc.build_id)
    own = np.random.default_rng(8).standard_normal((10, 8)).astype(np.float32)
    assert audit_build(store, "q", desc.build_id, queries=own)["query_source"] == "held-out (given)"
    np.save(queries, np.load(queries)[::-1])  # restored: publishable again
    managed = build / "shard-000" / "lexical" / ".managed.json"
    whole = managed.read_bytes()
    managed.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(FailedPrecondition, match=f"{managed} is .* bytes, the build recorded"):
        store.publish("q", desc.build_id)
    managed.write_bytes(whole)
    store.publish("q", desc.build_id)
    assert store.live_build("q") == desc.build_id


def test_the_builder_shows_training_and_tuning_as_they_run(tmp_path):
    """Outside QA: an OPQ training sat at "add shard 0: 0%" for 3 minutes, and a knob sweep
    printed nothing until it ended. Training now names itself on the bar and counts its seconds;
    every setting the tuner measures is reported as it is measured."""
    import io
    import time

    import numpy as np
    from tqdm import tqdm

    from index_builder.build import audit_build, build_collection
    from index_builder.corpus import Document
    from server.core.build_writer import _ticking
    from server.core.collection import CollectionStore

    out = io.StringIO()
    bar = tqdm(total=10, desc="add shard 0", file=out)
    with _ticking(bar, "train IVF4,Flat on 100 vectors (shard 0)", every_s=0.01):
        deadline = time.monotonic() + 30
        while "0 s]" not in out.getvalue():  # the ticker refreshed the bar at least once
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.01)
    assert "train IVF4,Flat on 100 vectors (shard 0)" in out.getvalue()
    assert bar.desc == "add shard 0"
    bar.close()

    rng = np.random.default_rng(5)
    store = CollectionStore(tmp_path)
    desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(400)], store, "t", None,
                            "IVF16,Flat", quiet=True, vectors=rng.standard_normal((400, 8)).astype(np.float32),
                            model_id="m")
    heard = []
    audit = audit_build(store, "t", desc.build_id, target_recall=0.99, progress=heard.append)
    sweep = audit["tuning"]["sweep"]
    assert len(heard) == len(sweep) > 0
    assert heard[0].startswith(f"tuning: nprobe={sweep[0]['knobs']['nprobe']}: recall ")


def test_a_descriptor_from_a_newer_builder_loads_or_says_why_not(tmp_path, caplog):
    """Outside QA: a build whose release.json carried a field the server did not know (written
    by a newer index-builder) was refused as "invalid" - a corrupt file - so upgrading the
    builder before the servers took every new build down. Unknown fields are now skipped with
    a warning; a descriptor whose format says they must not be is refused, saying so."""
    import numpy as np

    from index_builder.build import build_collection
    from index_builder.corpus import Document
    from server.core.collection import DESCRIPTOR, CollectionStore
    from server.errors import FailedPrecondition

    store = CollectionStore(tmp_path)
    desc = build_collection([Document(f"d{i}", f"doc {i}") for i in range(20)], store, "f", None,
                            "Flat", quiet=True, model_id="m",
                            vectors=np.random.default_rng(6).standard_normal((20, 4)).astype(np.float32))
    path = store.build_dir("f", desc.build_id) / DESCRIPTOR
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "a_later_field": {"x": 1}}))
    assert "format" not in data  # format 1 is not written: servers older than it refuse new keys
    with caplog.at_level("WARNING"):
        assert store.descriptor("f", desc.build_id) == desc
    assert "a_later_field" in caplog.text and "newer index-builder" in caplog.text
    store.write_descriptor(store.descriptor("f", desc.build_id))  # e.g. an audit's record
    assert json.loads(path.read_text())["a_later_field"] == {"x": 1}  # kept
    path.write_text(json.dumps({**data, "format": 2, "a_later_field": 1}))
    with pytest.raises(FailedPrecondition, match="format 2, written by a newer index-builder"):
        store.descriptor("f", desc.build_id)


def test_prune_removes_old_builds_and_a_following_server_removes_their_state(tmp_path, tiny_embedder,
                                                                             tiny_embedder_dir,
                                                                             cranfield_docs):
    """Retention: every build and its state stayed until an operator removed them by hand.
    `index-builder prune` removes the builds nothing needs (never the live build or its rollback
    target), says what it removes first with --dry-run, and a server following the alias removes
    its state of a removed build on its next poll, keeping the others'."""
    import time

    from conftest import publish_build
    from harness.processes import ServiceProcess
    from server.client import SearchClient

    state = tmp_path / "state"
    first = publish_build(tmp_path, "c", cranfield_docs[:20], tiny_embedder)

    def serve():
        return ServiceProcess(["serve", "--data-dir", str(tmp_path), "--state-dir", str(state),
                               "--port", "0", "--device", "cpu", "--log-level", "WARNING",
                               "--alias-poll-s", "0.2", "--embedder", str(tiny_embedder_dir),
                               "--embedder-name", "tiny-test-embedder"])

    srv = serve()
    try:
        client = SearchClient(srv.address)

        def serves(build_id):
            deadline = time.monotonic() + 60
            while client.search("flow", collection="c").build_id != build_id:
                assert time.monotonic() < deadline, f"the server never served {build_id}"
                time.sleep(0.1)

        serves(first.build_id)
        builds = [first]
        for i in (1, 2):  # two more publishes: the first build is neither live nor the rollback target
            builds.append(publish_build(tmp_path, "c", cranfield_docs[20 * i:20 * i + 20],
                                        tiny_embedder))
            serves(builds[-1].build_id)
        assert (state / "c" / first.build_id).is_dir()
        # a build that left the alias moments ago stays (a lagging server may still read it),
        # however old the build (made a day ago here)
        from server.core.collection import CollectionStore

        store = CollectionStore(tmp_path)
        old = store.descriptor("c", first.build_id)
        old.created_at -= 86400
        store.write_descriptor(old)
        out = cli("prune", "--data-dir", tmp_path, "--collection", "c", "--keep", 0)
        assert out.returncode == 0, out.stderr
        assert f"keep    {first.build_id}  (left the alias 0 min ago (--grace-s 600))" in out.stdout
        assert "0 of 3 builds removed" in out.stdout
        out = cli("prune", "--data-dir", tmp_path, "--collection", "c", "--keep", 0, "--grace-s", 0,
                  "--dry-run")
        assert out.returncode == 0, out.stderr
        assert f"would remove {first.build_id}" in out.stdout
        assert f"keep    {builds[2].build_id}  (the live build)" in out.stdout
        assert f"keep    {builds[1].build_id}  (the rollback target)" in out.stdout
        assert (tmp_path / "c" / "builds" / first.build_id).is_dir()  # a dry run removes nothing
        (tmp_path / "c" / "builds" / ".tmp-being-built").mkdir()  # a build being written (its
        (tmp_path / "c" / "builds" / ".tmp-being-built" / "release.json").write_text("{}")
        # builder holds the flock of its staging directory; one without is a killed build's)
        being_built = open(tmp_path / "c" / "builds" / ".tmp-being-built.lock", "a")
        fcntl.flock(being_built, fcntl.LOCK_EX)
        out = cli("prune", "--data-dir", tmp_path, "--collection", "c", "--keep", 0, "--grace-s", 0)
        being_built.close()
        assert out.returncode == 0 and f"removed {first.build_id}" in out.stdout, out.stderr
        assert (tmp_path / "c" / "builds" / ".tmp-being-built").is_dir()  # not its to touch
        assert "1 of 3 builds removed" in out.stdout
        assert not (tmp_path / "c" / "builds" / first.build_id).exists()
        # the server retired the first build a moment ago (its shards stay open for requests
        # already on it, RETIRE_AFTER_S): a server started again sweeps it at its first poll
        client.channel.close()
        srv.stop()
        srv = serve()
        client = SearchClient(srv.address)
        deadline = time.monotonic() + 60
        while (state / "c" / first.build_id).exists():
            assert time.monotonic() < deadline, "the server kept the state of a pruned build"
            time.sleep(0.1)
        assert all((state / "c" / b.build_id).is_dir() for b in builds[1:])
        assert client.search("flow", collection="c").hits  # serving on, untouched
        out = cli("prune", "--data-dir", tmp_path, "--collection", "c", "--keep", -1)
        assert out.returncode == 2 and "--keep and --grace-s must be 0 or more" in out.stderr
        client.channel.close()
    finally:
        srv.stop()


def _vector_corpus(tmp_path, n=400, dim=16):
    """A corpus with its own vectors (no model to load): corpus.jsonl and v.npy."""
    import numpy as np

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i}"}) + "\n"
                              for i in range(n)))
    np.save(tmp_path / "v.npy", np.random.default_rng(7).standard_normal((n, dim)).astype(np.float32))
    return corpus, tmp_path / "v.npy"


def test_factories_faiss_cannot_build_here_are_one_line_errors_not_crashes(tmp_path):
    """Outside QA: HNSW0 aborted the builder (exit 134) and HNSW1 crashed it (exit 139, no
    message); a PQ with more centroids than training vectors, or NSG on a small corpus, gave a
    faiss traceback (exit 1)."""
    corpus, vectors = _vector_corpus(tmp_path, n=40)
    for factory, says in (("HNSW0,Flat", "at least 2 links"), ("HNSW1,Flat", "at least 2 links"),
                          ("NSG4", "at least 8 links"),  # re-probe: faiss's build ran on for ever
                          ("PQ4x12", "cannot train it on 40 vectors (Number of training points"),
                          ("NSG32,Flat", "cannot build it on 40 vectors")):
        out = cli("build", "--data-dir", tmp_path / "data", "--collection", "c", "--corpus",
                  corpus, "--vectors", vectors, "--model-id", "m", "--factory", factory, "--quiet")
        assert out.returncode == 2, (factory, out.returncode, out.stderr[-500:])
        assert factory in out.stderr and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not list((tmp_path / "data" / "c" / "builds").glob("*"))  # nothing half-built


def test_build_audit_exits_1_when_the_audit_fails(tmp_path):
    """Outside QA: `build --audit` printed FAILED and exited 0, so a CI step never noticed."""
    corpus, vectors = _vector_corpus(tmp_path, n=2000, dim=32)
    args = ["build", "--data-dir", tmp_path / "data", "--collection", "c", "--corpus", corpus,
            "--vectors", vectors, "--model-id", "m", "--factory", "HNSW4,Flat", "--ef-search", "4",
            "--target-recall", "0", "--quiet", "--audit"]
    out = cli(*args, "--min-recall", "0.9999")
    assert "FAILED" in out.stdout and out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "the audit failed" in out.stderr
    passing = cli(*args, "--min-recall", "0.01")
    assert "passed" in passing.stdout and passing.returncode == 0, passing.stderr


def test_list_finds_missing_and_truncated_build_files_and_with_verify_altered_ones(tmp_path):
    """Outside QA: `list` said a build whose vectors had gone was whole (recall 1.000, exit 0),
    though its help promised exit 1 for a damaged build."""
    from server.core.collection import CollectionStore

    corpus, vectors = _vector_corpus(tmp_path, n=50)
    out = cli("build", "--data-dir", tmp_path / "data", "--collection", "c", "--corpus", corpus,
              "--vectors", vectors, "--model-id", "m", "--quiet")
    assert out.returncode == 0, out.stderr
    store = CollectionStore(tmp_path / "data")
    (build,) = store.builds("c")
    shard = store.build_dir("c", build) / "shard-000"
    assert cli("list", "--data-dir", tmp_path / "data", "--verify").returncode == 0
    raw = bytearray((shard / "vectors.npy").read_bytes())
    raw[-1] ^= 0xFF  # same size, other bytes: only a hash tells
    (shard / "vectors.npy").write_bytes(bytes(raw))
    assert cli("list", "--data-dir", tmp_path / "data").returncode == 0
    listing = cli("list", "--data-dir", tmp_path / "data", "--verify")
    assert listing.returncode == 1 and "vectors.npy fails its sha256 check" in listing.stdout
    (shard / "vectors.npy").write_bytes(bytes(raw[:-100]))  # truncated: found without --verify
    listing = cli("list", "--data-dir", tmp_path / "data")
    assert listing.returncode == 1 and f"{build}  DAMAGED" in listing.stdout, listing.stdout
    assert "(truncated?)" in listing.stdout
    (shard / "vectors.npy").unlink()
    listing = cli("list", "--data-dir", tmp_path / "data")
    assert listing.returncode == 1 and "vectors.npy is missing" in listing.stdout, listing.stdout
    # re-probe: a build whose descriptor was gone was left out of the list
    (tmp_path / "data" / "lost+found").mkdir()  # what a volume's root may hold: not a collection
    (store.build_dir("c", build) / "release.json").unlink()
    for only in ((), ("--collection", "c")):
        listing = cli("list", "--data-dir", tmp_path / "data", *only)
        assert listing.returncode == 1, listing.stdout + listing.stderr
        assert f"{build}  DAMAGED: its release descriptor" in listing.stdout, listing.stdout


def test_bad_tenant_flag_and_vector_files_name_the_flag(tmp_path):
    """Outside QA: a bad --tenant was blamed on the corpus's first line, and a --vectors file
    that was not a numeric .npy said "pickled (object) data ... allow_pickle=" naming no file."""
    import numpy as np

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n')
    base = ["build", "--data-dir", tmp_path / "data", "--collection", "c", "--corpus", corpus, "--quiet"]
    out = cli(*base, "--tenant", "bad tenant!")
    assert out.returncode == 2 and "argument --tenant: tenant name 'bad tenant!'" in out.stderr
    (tmp_path / "text.npy").write_text("hello")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for name, why in (("text.npy", "not a .npy file"), ("objects.npy", "it holds Python objects")):
        out = cli(*base, "--vectors", tmp_path / name, "--model-id", "m")
        assert out.returncode == 2, out.stderr
        assert f"--vectors {tmp_path / name}: not a numeric .npy array ({why}" in out.stderr
    out = cli(*base, "--dedicated-tenant-min-chunks", "-5")
    assert out.returncode == 2 and "must be at least 1" in out.stderr


def test_vectors_read_from_a_pipe_build_and_a_cut_file_is_refused_by_name(tmp_path):
    """Outside QA: `--vectors <(...)` (a pipe) failed with an EOFError traceback - the file was
    opened twice, and its first bytes, read to check the format, were gone from the second read.
    A pipe is read once now; a file cut short is refused naming the flag, with nothing built."""
    import io
    import os
    import threading

    import numpy as np

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "d{i}", "text": "doc {i}"}}\n' for i in range(3)))
    vectors = np.eye(3, 8, dtype=np.float32)
    raw = io.BytesIO()
    np.save(raw, vectors)
    fifo = tmp_path / "vectors.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:  # blocks until the builder opens the pipe
            f.write(raw.getvalue())

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    base = ["build", "--data-dir", tmp_path / "data", "--collection", "c", "--corpus", corpus,
            "--factory", "Flat", "--quiet", "--model-id", "m"]
    out = cli(*base, "--vectors", fifo, "--publish", timeout=120)  # (before: blocked for ever
    writer.join(30)  # on the second open of the pipe, which no one writes again)
    assert out.returncode == 0, out.stderr
    listing = cli("list", "--data-dir", tmp_path / "data")
    assert listing.returncode == 0, listing.stderr
    assert re.match(r"c\n  \* \S+  Flat +3 chunks", listing.stdout), listing.stdout
    cut = tmp_path / "cut.npy"
    cut.write_bytes(raw.getvalue()[:-5])
    out = cli(*[tmp_path / "data2" if a == tmp_path / "data" else a for a in base], "--vectors", cut)
    assert out.returncode == 2, out.stderr
    assert f"--vectors {cut}: not a numeric .npy array" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "data2" / "c").exists()


def test_a_failed_build_leaves_no_directories_and_prune_removes_killed_builds_staging(tmp_path):
    """Outside QA: a refused build (a NaN vector) left an empty DATA/<name>/builds/, and a
    killed build's staging directory (`builds/.tmp-<id>` with its lock, which the kernel freed
    when the builder died) was neither removed nor mentioned by prune. Now the failed build's
    directories go, and prune removes (--dry-run: lists) staging whose builder is gone, never one
    a live builder holds."""
    import numpy as np

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "d{i}", "text": "doc {i}"}}\n' for i in range(3)))
    vectors = np.eye(3, 8, dtype=np.float32)
    np.save(tmp_path / "ok.npy", vectors)
    vectors[1, 2] = np.nan
    np.save(tmp_path / "nan.npy", vectors)
    data = tmp_path / "data"

    def build(collection, npy, *extra):
        return cli("build", "--data-dir", data, "--collection", collection, "--corpus", corpus,
                   "--factory", "Flat", "--quiet", "--model-id", "m", "--vectors", npy, *extra)

    out = build("c", tmp_path / "nan.npy")
    assert out.returncode == 2 and "NaN" in out.stderr
    assert not data.exists()  # the data directory was made for it: gone too
    out = build("c", tmp_path / "ok.npy", "--publish")
    assert out.returncode == 0, out.stderr
    out = build("other", tmp_path / "nan.npy")
    assert out.returncode == 2 and sorted(p.name for p in data.iterdir()) == ["c"]

    builds = data / "c" / "builds"
    for name in ("dead", "live"):  # what a killed builder and a running one leave
        (builds / f".tmp-{name}").mkdir()
        (builds / f".tmp-{name}" / "index.faiss").write_bytes(b"\0" * 2_000_000)
        (builds / f".tmp-{name}.lock").touch()
    with open(builds / ".tmp-live.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = cli("prune", "--data-dir", data, "--collection", "c", "--dry-run")
        assert out.returncode == 0, out.stderr
        assert "would remove .tmp-dead  (a build or compaction that did not finish, 2.0 MB)" \
            in out.stdout and ".tmp-live" not in out.stdout
        assert (builds / ".tmp-dead" / "index.faiss").is_file()
        out = cli("prune", "--data-dir", data, "--collection", "c")
        assert out.returncode == 0, out.stderr
        assert "removed .tmp-dead" in out.stdout and ".tmp-live" not in out.stdout
        assert "freed 2.0 MB" in out.stdout
        assert not (builds / ".tmp-dead").exists() and not (builds / ".tmp-dead.lock").exists()
        assert (builds / ".tmp-live" / "index.faiss").is_file()
    listing = cli("list", "--data-dir", data)
    assert listing.returncode == 0 and re.match(r"c\n  \* \S+  Flat +3 chunks", listing.stdout)


def test_an_empty_data_dir_is_refused_not_read_as_the_current_directory(tmp_path):
    """Review: `--data-dir ""` (or an empty $SEARCH_DATA_DIR, a template's unset variable) was
    Path(""), the current directory, where the builder wrote its collections; the server
    refuses it. Each is refused naming the flag, and nothing is written."""
    import os

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n')
    for argv, env in ((["build", "--data-dir", ""], {}), (["build"], {"SEARCH_DATA_DIR": ""}),
                      (["list", "--data-dir", ""], {})):
        if argv[0] == "build":
            argv = [*argv, "--collection", "c", "--corpus", str(corpus), "--factory", "Flat",
                    "--model-id", "m", "--quiet"]
        proc = subprocess.run([sys.executable, "-m", "index_builder.cli", *argv], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(REPO), **env},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (argv, env, proc.stderr)
        assert "argument --data-dir: is empty" in proc.stderr, (argv, env, proc.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
