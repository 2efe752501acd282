"""A published build is servable from a read-only volume: the shard servers and the router run with
the exact arguments of deploy/k8s/search.yaml (only host-specific values - the data, state and
token paths, ports, NATS URLs - substituted), against a build on a read-only bind mount, as a
non-root user, with the state directory the only writable place. A write through the router lands
on the read-only build's replicas and the build's files are unchanged afterwards.

And a bad or unwritable path is a clear error naming the path, not DATA_LOSS.

How the build is made read-only, strongest first: a read-only bind mount in a private mount
namespace (`unshare -m`, needs root) entered as uid 65534 (`setpriv`); or, for a non-root test
run, a copy without write bits. The test says which it used and skips only when it can do neither.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from conftest import REPO, ServiceProcess, publish_build
from harness.processes import free_port
from nats_fixture import nats_server  # noqa: F401  (the module's JetStream server)
from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc

MANIFEST = REPO / "deploy" / "k8s" / "search.yaml"
NOBODY = 65534


def manifest_args() -> dict[str, list[list[str]]]:
    """role -> the container args of every workload in the manifest that runs it."""
    yaml = pytest.importorskip("yaml")
    out: dict[str, list[list[str]]] = {}
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if not doc or doc.get("kind") not in ("StatefulSet", "Deployment"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            args = [str(a) for a in c.get("args", [])]
            if args:
                out.setdefault(args[0], []).append(args)
    return out


def substitute(args: list[str], values: dict[str, str], nats_url: str) -> list[str]:
    """Replace the host-specific values of a manifest command line; every other flag stays."""
    out, it = [], iter(args)
    for a in it:
        if a == "--nats":
            next(it)  # the manifest's value is replaced
            if "--nats" not in out:  # the manifest lists a 3-node NATS cluster: here, one server
                out += ["--nats", nats_url]
            continue
        if a in ("--stream-replicas", "--port", "--metrics-port", "--host"):
            next(it)
            out += [a, {"--stream-replicas": "1", "--host": "127.0.0.1", "--port": "0",
                        "--metrics-port": str(free_port())}[a]]
            continue
        out.append(values.get(a, a))
    return out


def can_run_as_nobody() -> bool:
    return shutil.which("setpriv") is not None and subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
         "-c", "import faiss, tantivy, server"], cwd=REPO, capture_output=True).returncode == 0


def can_bind_read_only() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode == 0


def hash_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def volumes(cranfield_docs):
    """A published 2-shard build named like the manifest's collection, and the places a pod
    mounts: the build volume, a state volume, the shard-token secret, /tmp."""
    from server.backends.device import Device
    from server.backends.models import Embedder

    shard_args = manifest_args().get("shard") or pytest.fail(f"{MANIFEST}: no shard workload")
    collection = shard_args[0][shard_args[0].index("--collection") + 1]
    # not under pytest's tmp dir (mode 0700): the unprivileged server must reach what is below
    root = Path(tempfile.mkdtemp(prefix="search-readonly-"))
    root.chmod(0o755)
    data = root / "data"
    publish_build(data, collection, cranfield_docs[:40], Embedder(device=Device("cpu")),
                  shards=len(shard_args))
    state, scratch = root / "state", root / "tmp"
    for d in (state, scratch):
        d.mkdir()
    token = root / "token"
    token.write_text("shard-credential-for-the-readonly-test-0123456789")
    token.chmod(0o444)
    # the build is left with the permissions the builder gave it: a server running as another
    # user must be able to read every file of it (regression: ALIAS, release.json and tantivy's
    # meta.json were owner-only)
    mode = None
    if can_bind_read_only():
        mode = "read-only bind mount"
        if can_run_as_nobody():
            mode += f", uid {NOBODY}"
            for d in (state, scratch):
                os.chown(d, NOBODY, NOBODY)
    elif os.geteuid() != 0:
        mode = "no write bits, non-root user"
        for p in [data, *data.rglob("*")]:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    if mode is None:
        pytest.skip("root without mount namespaces: cannot make the build read-only to the server")
    print(f"read-only build: {mode}")
    yield {"root": root, "data": data, "state": state, "scratch": scratch, "token": token,
           "collection": collection, "mode": mode}
    for p in [data, *data.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def launcher(vol) -> tuple[list[str], dict]:
    """The prefix that runs a server with the build read-only (and as nobody when possible)."""
    env = {**os.environ, "HOME": str(vol["scratch"]), "TMPDIR": str(vol["scratch"]),
           "HF_HOME": str(vol["scratch"] / "hf"), "PYTHONDONTWRITEBYTECODE": "1"}
    if not vol["mode"].startswith("read-only bind mount"):
        return [], env
    data = str(vol["data"])
    user = (["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            if "uid" in vol["mode"] else [])
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && shift && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", data, *user], env


def test_the_servers_really_see_a_read_only_build(volumes):
    """The launcher's read-only build is real: writing into it fails there, the state takes writes."""
    prefix, env = launcher(volumes)
    probe = ("import os, sys\n"
             "for d in sys.argv[1:]:\n"
             "    try:\n"
             "        open(os.path.join(d, 'probe'), 'w').close(); os.remove(os.path.join(d, 'probe'))\n"
             "        print(d, 'writable')\n"
             "    except OSError as e:\n"
             "        print(d, 'refused', e.errno)\n")
    shard_dir = next(volumes["data"].rglob("shard-000"))
    out = subprocess.run([*prefix, sys.executable, "-c", probe, str(shard_dir), str(volumes["state"])],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{shard_dir} refused" in out.stdout and f"{volumes['state']} writable" in out.stdout, out.stdout


def test_the_manifest_command_lines_serve_and_take_writes_from_a_read_only_build(volumes, nats_server):  # noqa: F811
    vol = volumes
    before = hash_tree(vol["data"])
    prefix, env = launcher(vol)
    roles = manifest_args()
    paths = {"/data": str(vol["data"]), "/state": str(vol["state"]),
             "/etc/search/shard-token/token": str(vol["token"])}
    procs, by_shard = [], {}
    try:
        for args in roles["shard"]:
            shard = int(args[args.index("--shard") + 1])
            argv = substitute(args, {**paths, "$(POD_NAME)": f"shard-{shard}-0"}, nats_server.url)
            p = ServiceProcess(argv, f"shard {shard} (manifest args)", prefix=prefix, env=env)
            procs.append(p)
            by_shard[shard] = p.address
        (router_args,) = roles["router"]
        argv = substitute(router_args, paths, nats_server.url)
        # one --replicas per shard, in order: the manifest's pod DNS names -> this test's replica
        shard_no = iter(sorted(by_shard))
        argv = [by_shard[next(shard_no)] if a.count(":") and "." in a and "shard-" in a else a
                for a in argv]
        router = ServiceProcess(argv, "router (manifest args)", prefix=prefix, env=env)
        procs.append(router)
        with grpc.insecure_channel(router.address) as ch:
            stub = pb_grpc.SearchServiceStub(ch)
            ack = stub.UpsertDocument(pb.UpsertDocumentRequest(
                collection=vol["collection"], doc_id="ro-1", version=1,
                text="qqxreadonly the build volume is read-only yet this write is searchable"),
                timeout=60)
            assert ack.sequence > 0
            hits = stub.Search(pb.SearchRequest(collection=vol["collection"], text="qqxreadonly",
                                                mode=pb.LEXICAL, top_k=5,
                                                min_applied_sequence=ack.sequence), timeout=60).hits
            assert [h.doc_id for h in hits] == ["ro-1"]
            old = stub.Search(pb.SearchRequest(collection=vol["collection"], text="boundary layer",
                                               mode=pb.HYBRID, top_k=5), timeout=60).hits
            assert len(old) == 5
    finally:
        for p in procs:
            p.stop()
    for p in procs:
        out = "".join(p.lines)
        assert "Traceback" not in out and "Read-only file system" not in out, out
    assert hash_tree(vol["data"]) == before  # the build volume was never written
    written = [p for p in vol["state"].rglob("docstore.sqlite")]
    assert len(written) == len(roles["shard"])  # each shard's state sits on the state volume


def run_shard(vol, *flags, timeout=120):
    prefix, env = launcher(vol)
    return subprocess.run([*prefix, sys.executable, "-m", "server.main", "shard", "--collection",
                           vol["collection"], "--shard", "0", "--port", "0", "--device", "cpu",
                           *flags], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_an_unwritable_state_directory_is_a_clear_error_naming_it(volumes):
    vol = volumes
    inside_build = vol["data"] / "state-here"  # on the read-only volume
    out = run_shard(vol, "--data-dir", str(vol["data"]), "--state-dir", str(inside_build))
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert str(inside_build) in text and "not writable" in text and "--state-dir" in text, text
    assert "DATA_LOSS" not in text and "IndexCorrupt" not in text and "Traceback" not in text, text


def test_a_missing_data_directory_is_a_clear_error_naming_it(volumes, tmp_path):
    missing = tmp_path / "no-such-data"
    out = run_shard(volumes, "--data-dir", str(missing), "--state-dir", str(tmp_path / "s"))
    text = out.stdout + out.stderr
    assert out.returncode != 0 and str(missing) in text, text
    assert "DATA_LOSS" not in text and "Traceback" not in text, text


def test_serve_on_a_missing_data_directory_is_a_clear_error_and_creates_nothing(tmp_path):
    """Regression (outside QA): `serve --data-dir /nonexistent` served no collection without a
    word (and created the directory for its state)."""
    missing = tmp_path / "no-such-data"
    out = subprocess.run([sys.executable, "-m", "server.main", "serve", "--data-dir", str(missing),
                          "--port", "0", "--device", "cpu", "--embedder", "none"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and f"data directory {missing} does not exist" in text, text
    assert "Traceback" not in text and not missing.exists()
