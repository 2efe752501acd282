"""The evaluation metrics, against rankings computed by hand and against ranx on the same runs."""
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from index_builder.evaluate import (collapse_to_documents, hit_at, mrr_at, ndcg_at, precision_at,
                                    recall_at, score_query)

QRELS = {"a": 3, "b": 1, "c": 2}


def test_metrics_by_hand():
    ranking = ["x", "a", "y", "c"]
    dcg = 3 / math.log2(3) + 2 / math.log2(5)
    idcg = 3 / math.log2(2) + 2 / math.log2(3) + 1 / math.log2(4)
    assert ndcg_at(ranking, QRELS, 10) == pytest.approx(dcg / idcg)
    assert recall_at(ranking, QRELS, 10) == pytest.approx(2 / 3)
    assert recall_at(ranking, QRELS, 1) == 0.0
    assert precision_at(ranking, QRELS, 10) == pytest.approx(0.2)
    assert mrr_at(ranking, QRELS, 10) == pytest.approx(0.5)
    assert hit_at(ranking, QRELS, 10) == 1.0 and hit_at(["x"], QRELS, 10) == 0.0
    assert ndcg_at(["a", "c", "b"], QRELS, 10) == pytest.approx(1.0)


def test_chunks_collapse_to_their_documents_best_rank():
    assert collapse_to_documents(["d1", "d2", "d1", "d3", "d2"], 10) == ["d1", "d2", "d3"]
    assert collapse_to_documents(["d1", "d2", "d3"], 2) == ["d1", "d2"]


def test_metrics_agree_with_ranx_on_random_runs():
    ranx = pytest.importorskip("ranx")
    rng = np.random.default_rng(3)
    docs = [f"d{i}" for i in range(60)]
    qrels, run = {}, {}
    for q in range(40):
        rel = rng.choice(docs, size=int(rng.integers(1, 8)), replace=False)
        qrels[f"q{q}"] = {d: int(rng.integers(1, 5)) for d in rel}
        ranked = list(rng.choice(docs, size=120 if q % 2 else 30, replace=True))
        run[f"q{q}"] = collapse_to_documents(ranked, 100)
    ours = {m: np.mean([score_query(run[q], qrels[q])[m] for q in qrels])
            for m in ("ndcg@10", "recall@10", "recall@100", "mrr@10", "hit@10", "precision@10")}
    r_run = ranx.Run({q: {d: float(len(r) - i) for i, d in enumerate(r)} for q, r in run.items()})
    r_qrels = ranx.Qrels(qrels)
    theirs = ranx.evaluate(r_qrels, r_run, ["ndcg@10", "recall@10", "recall@100", "mrr@10",
                                            "hit_rate@10", "precision@10"])
    assert ours["ndcg@10"] == pytest.approx(theirs["ndcg@10"], abs=1e-6)
    assert ours["recall@10"] == pytest.approx(theirs["recall@10"], abs=1e-6)
    assert ours["recall@100"] == pytest.approx(theirs["recall@100"], abs=1e-6)
    assert ours["mrr@10"] == pytest.approx(theirs["mrr@10"], abs=1e-6)
    assert ours["hit@10"] == pytest.approx(theirs["hit_rate@10"], abs=1e-6)
    assert ours["precision@10"] == pytest.approx(theirs["precision@10"], abs=1e-6)


def test_the_paired_tests_tell_a_real_difference_from_noise():
    from index_builder.evaluate import paired_tests

    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, 200)
    better = paired_tests(base + 0.05 + rng.normal(0, 0.05, 200), base)
    same = paired_tests(base + rng.normal(0, 0.05, 200), base)
    assert better["mean_diff"] > 0.04 and better["p_randomization"] < 0.001 and better["p_ttest"] < 0.001
    assert same["p_randomization"] > 0.05 and same["p_ttest"] > 0.05


def test_eval_rebuilds_a_collection_built_from_another_corpus_chunker_or_embedder(tmp_path, tiny_embedder,
                                                                          cranfield_docs):
    """`eval --serve-from DIR` reuses a collection it built before only when that build measures
    this dataset with this version's code; a build from another corpus, an older chunker or
    another embedder is rebuilt, not silently evaluated."""
    import dataclasses

    import json

    from index_builder.evaluate import EVAL_SOURCE, _corpus_fingerprint, _stale_build
    from server.core.chunking import CHUNKER_VERSION
    from server.core.collection import CollectionStore

    from conftest import publish_build

    store = CollectionStore(tmp_path)
    assert _stale_build(store, "cran", tiny_embedder.model_id) == ""  # none yet: just build
    desc = publish_build(tmp_path, "cran", cranfield_docs[:20], tiny_embedder)
    assert _stale_build(store, "cran", tiny_embedder.model_id) == ""
    assert "embedder" in _stale_build(store, "cran", "another-model@1")
    # another corpus under the same collection name (outside QA: a changed dataset, or another
    # directory of the same name, was evaluated against the old build: nDCG 0.0, no warning)
    dataset = tmp_path / "ds"
    dataset.mkdir()
    (dataset / "corpus.jsonl").write_text('{"_id": "1", "text": "one"}\n')
    assert "another corpus" in _stale_build(store, "cran", tiny_embedder.model_id, dataset)
    (store.collection_dir("cran") / EVAL_SOURCE).write_text(json.dumps(
        {"corpus_sha256": _corpus_fingerprint(dataset)}))
    assert _stale_build(store, "cran", tiny_embedder.model_id, dataset) == ""
    (dataset / "corpus.jsonl").write_text('{"_id": "1", "text": "one, edited"}\n')
    assert "another corpus" in _stale_build(store, "cran", tiny_embedder.model_id, dataset)
    store.write_descriptor(dataclasses.replace(desc, chunker="words-160-32/v3"))
    why = _stale_build(store, "cran", tiny_embedder.model_id)
    assert "words-160-32/v3" in why and CHUNKER_VERSION in why


def test_eval_plots_without_their_packages_fail_before_the_evaluation(monkeypatch, tmp_path):
    """Outside QA: in the images (no harness/, no matplotlib) `eval --plots` failed with an
    ImportError after the whole evaluation had run. It is refused first, naming what is missing."""
    import importlib.util

    from index_builder.cli import build_parser
    from index_builder.evaluate import run_eval

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "harness" else real(name, *a))
    args = build_parser().parse_args(["eval", "--dataset", str(tmp_path), "--plots",
                                      str(tmp_path / "plots"), "--address", "127.0.0.1:1"])
    with pytest.raises(ValueError, match=r"--plots needs matplotlib .* \(missing: harness\)"):
        run_eval(args)


@pytest.mark.parametrize("argv, error", [
    (["--compare", "hybrid"], "give pairs of two modes as A:B"),
    (["--modes", "lexical", "--compare", "lexical:lexical"], "give pairs of two modes as A:B"),
    (["--modes", ","], "names no mode"),  # re-probe: evaluated nothing and exited 0
    (["--compare", "lexical:bogus"], "bogus not among --modes"),
    (["--modes", "dense,lexical", "--compare", "hybrid:lexical"], "hybrid not among --modes"),
    (["--depth", "0"], "--depth 0: between 1 and 1000"),
    (["--depth", "-5"], "--depth -5: between 1 and 1000"),
    (["--dataset", "{tmp}/missing"], "queries.jsonl is missing"),
])
def test_eval_arguments_are_refused_before_anything_runs(tmp_path, argv, error):
    """Outside QA: a malformed --compare failed after the whole evaluation had run (its results
    lost), an unknown mode in it was ignored, --depth 0 raised a traceback and a bad second
    --dataset failed only once the first had been evaluated. Refused first, with nothing served
    (no server at --address is needed to find out)."""
    from index_builder.cli import build_parser
    from index_builder.evaluate import run_eval

    good = tmp_path / "good"
    (good / "qrels").mkdir(parents=True)
    (good / "queries.jsonl").write_text('{"_id": "1", "text": "q"}\n')
    (good / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t1\t1\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    args = build_parser().parse_args(["eval", "--dataset", str(good), "--address", "127.0.0.1:1",
                                      *argv])
    with pytest.raises(ValueError, match=re.escape(error)):
        run_eval(args)


def test_eval_of_modes_without_the_default_pair_compares_nothing_and_runs(tmp_path):
    """Review: `eval --modes lexical` was refused because the default --compare named modes it
    did not run; it reaches the server (none here: UNAVAILABLE, not an argument error)."""
    from index_builder.cli import build_parser
    from index_builder.evaluate import run_eval
    from harness.processes import free_port

    good = tmp_path / "good"
    (good / "qrels").mkdir(parents=True)
    (good / "queries.jsonl").write_text('{"_id": "1", "text": "q"}\n')
    (good / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t1\t1\n")
    args = build_parser().parse_args(["eval", "--dataset", str(good), "--modes", "lexical",
                                      "--address", f"127.0.0.1:{free_port()}"])
    with pytest.raises(ValueError, match="UNAVAILABLE"):
        run_eval(args)


def test_eval_against_no_server_is_one_line(tmp_path):
    """Outside QA: a 28-line gRPC traceback when no server answered (and a 17-line one for an
    unknown collection: the same path, NOT_FOUND)."""
    from conftest import REPO
    from harness.processes import free_port

    good = tmp_path / "good"
    (good / "qrels").mkdir(parents=True)
    (good / "queries.jsonl").write_text('{"_id": "1", "text": "q"}\n')
    (good / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\t1\t1\n")
    out = subprocess.run([sys.executable, "-m", "index_builder.cli", "eval", "--dataset", str(good),
                          "--address", f"127.0.0.1:{free_port()}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "UNAVAILABLE" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
