"""The builder CLI end to end on a real corpus slice with the real packaged MiniLM: build (with
progress), audit, publish, list; clear errors for bad input; a corrupted build fails at load
naming the file."""
import json
import subprocess
import sys

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


def test_every_command_has_help():
    for cmd in ("build", "audit", "publish", "list", "eval", "compact", "canary-check", "demo-corpus"):
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


def test_a_corrupted_build_fails_at_load_naming_the_file(built, tiny_embedder):
    from conftest import make_core
    from server.errors import IndexCorruptError
    import shutil

    data, _ = built
    copy = data.parent / "corrupt-copy"
    shutil.copytree(data, copy)
    alias = json.loads((copy / "cran" / "ALIAS").read_text())
    target = copy / "cran" / "builds" / alias["live"] / "shard-001" / "dense.faiss"
    target.write_bytes(target.read_bytes()[:-100])
    core = make_core(copy)
    with pytest.raises(IndexCorruptError, match=str(target)):
        core.load()
