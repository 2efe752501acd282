"""One typed configuration (server/config.py): defaults written once, flags generated from them,
a TOML file and the environment under the flags, `search-server config --print`, clear errors
for bad values; and the committed gRPC modules match proto/."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from server.config import ServerConfig, add_flags, default_config, load_config


def parse(command, argv, environ=None, config_file=None):
    import argparse

    p = argparse.ArgumentParser()
    add_flags(p, command)
    return load_config(command, p.parse_args(argv), environ or {}, config_file)


def test_defaults_are_the_dataclasses_and_commands_differ_only_where_declared():
    assert parse("serve", []) == ServerConfig()
    shard = parse("shard", [])
    assert shard.listen.port == 50061 and shard.engine == ServerConfig().engine


def test_flags_beat_environment_which_beats_the_file_which_beats_defaults(tmp_path):
    cfg_file = tmp_path / "search.toml"
    cfg_file.write_text('[engine]\nmax_batch = 8\ndispatch_timeout_ms = 3.5\n'
                        '[storage]\ndata_dir = "/from/file"\n[listen]\nport = 7000\n')
    env = {"SEARCH_MAX_BATCH": "16", "SEARCH_DATA_DIR": "/from/env"}
    cfg = parse("serve", ["--config", str(cfg_file), "--max-batch", "32", "--no-batching"], env)
    assert cfg.engine.max_batch == 32              # flag
    assert str(cfg.storage.data_dir) == "/from/env"  # environment over file
    assert cfg.engine.dispatch_timeout_ms == 3.5     # file over default
    assert cfg.listen.port == 7000 and cfg.engine.batching is False


@pytest.mark.parametrize("text,error", [('[engine]\nmax_batch = "many"\n', "max_batch"),
                                        ('[nosuch]\nx = 1\n', "unknown section"),
                                        ('[engine]\nbatch_size = 3\n', "unknown key"),
                                        ('[listen]\nmax_inflight = 2.9\n', "not a whole number"),
                                        ('[listen]\nport = true\n', "not a whole number"),
                                        ('max_inflight = 3\n', "outside any section")])
def test_a_bad_file_names_the_key(tmp_path, text, error):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=error):
        parse("serve", ["--config", str(f)])


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="SEARCH_MAX_BATCH"):
        parse("serve", [], {"SEARCH_MAX_BATCH": "lots"})


@pytest.mark.parametrize("env,error", [
    ({"SEARCH_MAX_INFLIGHT": ""}, "SEARCH_MAX_INFLIGHT: is empty"),
    ({"SEARCH_PORT": ""}, "SEARCH_PORT: is empty"),
    ({"SEARCH_DATA_DIR": ""}, "SEARCH_DATA_DIR: is empty"),
    ({"SEARCH_MAX_INFLIGHT": "-1"}, "out of range \\(must be >= 1\\)"),
    ({"SEARCH_RETRIEVAL_CACHE_SIZE": "-1"}, "out of range \\(must be >= 0\\)"),
    ({"SEARCH_BATCH_CHUNK": "-3"}, "SEARCH_BATCH_CHUNK"),
    ({"SEARCH_DENSE_FEEDBACK_WEIGHT": "nan"}, "not a finite number"),
    ({"SEARCH_DENSE_FEEDBACK_WEIGHT": "7"}, "between 0 and 1"),
    ({"SEARCH_DEVICE_NICE": "-30"}, "between -20 and 19")])
def test_values_a_server_cannot_run_with_are_refused_at_start(env, error):
    """Regression (outside QA): values were type-checked only. An empty SEARCH_MAX_INFLIGHT
    became "unset" and every search failed INTERNAL; --max-inflight -1 started a server that
    shed everything; a negative cache size failed every search; NaN turned feedback off."""
    with pytest.raises(ValueError, match=error):
        parse("serve", [], env)


def test_optional_values_may_be_empty_and_bounded_values_at_their_bounds_pass():
    cfg = parse("serve", ["--device-nice", "-20", "--retrieval-cache-size", "0"],
                {"SEARCH_METRICS_PORT": "", "SEARCH_DENSE_FEEDBACK_WEIGHT": "1"})
    assert cfg.listen.metrics_port is None and cfg.engine.device_nice == -20
    assert cfg.pipeline.retrieval_cache_size == 0 and cfg.pipeline.dense_feedback_weight == 1.0
    # an empty path is unset, not Path("") - the current directory, which a server then read as
    # its certificate (outside QA: `--tls-cert ""` failed reading ".")
    cfg = parse("serve", ["--tls-cert", "", "--tls-key", ""], {"SEARCH_RERANKER": ""})
    assert cfg.listen.tls_cert is None and cfg.listen.tls_key is None
    assert cfg.models.reranker is None


def test_config_print_shows_the_effective_configuration_and_it_round_trips(tmp_path):
    out = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--max-batch", "24"],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={"SEARCH_DENSE_FEEDBACK_DOCS": "3", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "max_batch = 24" in out.stdout and "dense_feedback_docs = 3" in out.stdout
    saved = tmp_path / "effective.toml"
    saved.write_text(out.stdout)
    again = load_config("config", None, {}, saved)
    assert again.engine.max_batch == 24 and again.pipeline.dense_feedback_docs == 3
    router = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--role",
                             "router", "--nats", "nats://a:4222", "--nats", "nats://b:4222"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    saved.write_text(router.stdout)
    again = load_config("router", None, {}, saved)
    assert again.replication.nats == ["nats://a:4222", "nats://b:4222"]
    # the sections a role reads, and only those (outside QA: a shard's printed [models] and
    # [pipeline], and took their flags, as if it read them)
    assert "[replication]" in router.stdout and "[engine]" not in router.stdout
    assert "[replication]" not in out.stdout and "[models]" in out.stdout
    # a role's own defaults (outside QA: it always printed serve's, port 50051, which a shard
    # then took from the file)
    shard = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--role",
                            "shard"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shard.returncode == 0 and "port = 50061" in shard.stdout, shard.stderr


def test_config_print_takes_a_roles_own_flag_names_and_the_file_starts_that_role(tmp_path):
    """Outside QA: `config --print --role shard --collection docs` wrote serve's [storage]
    collection, and a shard started from the file refused for want of --collection."""
    for role, field_, more in (("shard", "shard_collection", ["--shard", "0"]),
                               ("router", "router_collection", [])):
        out = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--role", role,
                              "--collection", "docs", *more],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        saved = tmp_path / f"{role}.toml"
        saved.write_text(out.stdout)
        cfg = load_config(role, None, {}, saved)
        assert getattr(getattr(cfg, role), field_) == "docs" and cfg.storage.collection == []


def test_flags_a_role_does_not_use_are_refused_not_ignored():
    """Outside QA: `shard --auth-tokens FILE` started a shard server that never read the file
    (shard servers accept routers by --shard-token-file alone), and `serve --shard-token-file`
    took a file that did not exist."""
    for command, flag in (("shard", "--auth-tokens"), ("shard", "--tenant"),
                          ("shard", "--publish-timeout-s"), ("serve", "--shard-token-file"),
                          ("router", "--apply-batch")):
        with pytest.raises(SystemExit):
            parse(command, [flag, "x"], {})
    assert parse("router", ["--auth-tokens", "t.json"], {}).auth.auth_tokens == Path("t.json")


def test_settings_a_role_must_not_be_given_are_refused_from_the_environment_and_files(tmp_path,
                                                                                    capsys):
    """Outside QA: SEARCH_AUTH_TOKENS given to a shard server was taken and ignored (it serves
    without authentication), as `shard --auth-tokens` was before its flag was refused; a TOML
    file's [auth] auth_tokens too (review). Those are refused; other settings a role does not use
    are ignored with a note (one environment or file may serve every role of a deployment)."""
    for command, name in (("shard", "SEARCH_AUTH_TOKENS"), ("shard", "SEARCH_TENANT"),
                          ("serve", "SEARCH_SHARD_TOKEN_FILE")):
        with pytest.raises(ValueError, match=f"environment {name}: `{command}` does not use"):
            parse(command, [], {name: "x"})
    for command, name, field in (("shard", "SEARCH_WORKERS", "workers"),
                                 ("router", "SEARCH_WORKERS", "workers")):
        cfg = parse(command, [], {name: "4"})
        assert cfg.listen.workers == 1  # not applied
        assert f"environment {name} is not used by `{command}`; ignored" in capsys.readouterr().err
    assert parse("router", [], {"SEARCH_APPLY_BATCH": "9"}).replication.apply_batch != 9
    # of a section the role does not read at all (outside QA: a shard took [models] embedder
    # from a file without a word, and `config --role shard` printed it); such variables are
    # left alone, quietly (the images set SEARCH_DATA_DIR for every role: review)
    capsys.readouterr()
    assert parse("shard", [], {"SEARCH_EMBEDDER": "x"}) == parse("shard", [], {})
    assert parse("router", [], {"SEARCH_DATA_DIR": "/data"}) == parse("router", [], {})
    assert capsys.readouterr().err == ""
    models = tmp_path / "models.toml"
    models.write_text('[models]\nembedder = "x"\n')
    assert parse("shard", [], {}, models) == parse("shard", [], {})
    assert "[models] embedder is not used by `shard`; ignored" in capsys.readouterr().err
    printed = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--role",
                              "shard", "--config", str(models)], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert printed.returncode == 0 and "embedder" not in printed.stdout
    assert "is not used by `shard`; ignored" in printed.stderr
    refused = subprocess.run([sys.executable, "-m", "server.main", "config", "--print", "--role",
                              "shard", "--embedder", "x"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "unrecognized arguments: --embedder" in refused.stderr
    assert parse("shard", [], {"SEARCH_TENANT": "default"}).auth.tenant == "default"  # the default
    assert parse("router", [], {"SEARCH_AUTH_TOKENS": "t.json"}).auth.auth_tokens == Path("t.json")
    # settings every role reads are no one's problem
    assert str(parse("shard", [], {"SEARCH_DATA_DIR": "/d"}).storage.data_dir) == "/d"
    toml = tmp_path / "shared.toml"
    toml.write_text('[auth]\nauth_tokens = "/etc/tokens.json"\n')
    with pytest.raises(ValueError, match=r"shared.toml \[auth\] auth_tokens: `shard` does not use"):
        parse("shard", [], {}, toml)
    assert parse("router", [], {}, toml).auth.auth_tokens == Path("/etc/tokens.json")
    # `config --role shard` speaks for a shard
    from server.config import load_config
    with pytest.raises(ValueError, match="`shard` does not use"):
        load_config("config", None, {"SEARCH_AUTH_TOKENS": "x"}, defaults_of="shard")


def test_replica_sets_from_the_environment_keep_their_shards_apart():
    """Outside QA: SEARCH_REPLICAS="a:1,b:1" made each replica a shard of its own (a router of the
    wrong shard count), where `--replicas a:1,b:1` is one shard of two replicas."""
    flags = parse("router", ["--replicas", "a:1,b:1", "--replicas", "c:1,d:1"], {})
    env = parse("router", [], {"SEARCH_REPLICAS": "a:1,b:1; c:1,d:1"})
    assert flags.router.replicas == env.router.replicas == ["a:1,b:1", "c:1,d:1"]
    assert parse("router", [], {"SEARCH_REPLICAS": "a:1,b:1"}).router.replicas == ["a:1,b:1"]


@pytest.mark.parametrize("flags, error", [
    (["--default-depth", "5000"], "between 1 and 2000"),        # every hybrid query was refused
    (["--dense-feedback-docs", "1000"], "between 0 and 100"),
    (["--lexical-feedback-terms", "1000"], "between 0 and 64"),
    (["--lexical-feedback-weight", "50"], "between 0 and 10"),
    (["--log-level", "LOUD"], "not one of DEBUG"),             # was a traceback at start
    (["--device", "gpu"], "not one of auto, cpu, cuda"),
    (["--embedder-backend", "tensorflow"], "not one of torch, onnx"),
    (["--event-loop", "trio"], "not one of auto, uvloop, asyncio"),
])
def test_server_defaults_past_the_request_caps_or_unknown_choices_are_refused_at_start(flags, error):
    """Outside QA: a default depth of 5,000 started a server whose every hybrid query answered
    INVALID_ARGUMENT; `--log-level debug` ended in a traceback and `config --print` printed
    choices that `serve` refuses."""
    with pytest.raises(ValueError, match=error):
        parse("serve", flags, {})
    assert parse("serve", ["--log-level", "debug"], {}).listen.log_level == "DEBUG"


@pytest.mark.parametrize("command", ["serve", "shard", "router", "config"])
def test_every_command_prints_its_generated_flags_in_help(command):
    """Regression: a literal % in a field's help crashed `search-server router --help` (argparse
    %-formats help text)."""
    import argparse

    p = argparse.ArgumentParser(prog=f"search-server {command}")
    add_flags(p, command)
    text = p.format_help()
    assert "--log-level" in text
    if command == "router":
        assert "--hedge-budget" in text and "~5%)" in text


def test_the_cli_and_the_tests_build_the_same_defaults():
    """Regression (issue 12): SearchConfig.embed_max_batch was 64 while the CLI used 16 on CPU, so
    tests never ran what production ran; now one tree holds each default once."""
    from conftest import server_config

    assert server_config(REPO).models == default_config("serve").models
    assert default_config("serve").models.max_batch(cuda=False) == 16


def test_the_committed_grpc_modules_match_the_proto_files():
    from server.rpc.codegen import check

    assert check() == []
