"""Several hosts on one machine: NATS JetStream, a router and 2 shards x 2 replicas, each in its
own network namespace on a bridge (with `tc netem` delay where the kernel has it). Versioned
writes stream in while queries run, and meanwhile a replica is SIGKILLed (and restarted), another
SIGSTOPped for 10 s, and the router SIGKILLed and restarted. Afterwards: no acknowledged write is
lost, no read carrying its write's sequence saw a stale version, every replica converged, and
every query met its deadline except those sent while the router itself was down.

Needs root (network namespaces, veth, a bridge); skipped with the reason where they cannot be
created."""
import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest

from server.rpc import search_pb2 as pb
from server.rpc import search_pb2_grpc as pb_grpc
from server.rpc import shard_pb2 as spb
from server.rpc import shard_pb2_grpc as spb_grpc

from conftest import ServiceProcess, publish_build
from nats_fixture import NatsServer, find_nats_server

TOKEN = "multihost-router-credential-0123456789"
SUFFIX = f"{os.getpid() % 10000}"
SUBNET = f"10.{100 + os.getpid() % 100}.0"
DEADLINE_S = 3.0


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


class Hosts:
    """A bridge and one network namespace per host, each with one address on it."""

    def __init__(self, names):
        self.bridge = f"brs{SUFFIX}"
        self.ns = {}
        self.ip = {}
        self.netem = False
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(names, start=2):
            ns, vh, vn = f"s{SUFFIX}{name}", f"vh{SUFFIX}{i}", f"vn{SUFFIX}{i}"
            sh("ip", "netns", "add", ns)
            self.ns[name] = ns
            sh("ip", "link", "add", vh, "type", "veth", "peer", "name", vn)
            sh("ip", "link", "set", vn, "netns", ns)
            sh("ip", "link", "set", vh, "master", self.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", vn)
            sh("ip", "-n", ns, "link", "set", vn, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.ip[name] = f"{SUBNET}.{i}"
            delay = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", vn, "root", "netem",
                       "delay", "2ms", check=False)
            self.netem = delay.returncode == 0

    def prefix(self, name):
        return ("ip", "netns", "exec", self.ns[name])

    def close(self):
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2's `ip`")
    probe = sh("ip", "netns", "add", f"probe{SUFFIX}", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {probe.stderr.strip()}")
    sh("ip", "netns", "del", f"probe{SUFFIX}", check=False)
    h = Hosts(["nats", "router", "s0r0", "s0r1", "s1r0", "s1r1"])
    try:
        yield h
    finally:
        h.close()


def marker(doc, v):
    return f"mh{doc}x{v}"


def test_writes_and_reads_survive_killed_stopped_and_restarted_hosts(hosts, tmp_path, tiny_embedder,
                                                                      tiny_embedder_dir,
                                                                      cranfield_docs, record_property):
    record_property("latency", "tc netem 2 ms" if hosts.netem else "2 ms injected by each replica "
                    "(this kernel has no netem qdisc)")
    binary = find_nats_server()
    if not binary:
        pytest.fail("nats-server not found: `bash scripts/nats.sh install` (CI installs it)")
    data = tmp_path / "data"
    publish_build(data, "mh", cranfield_docs[:40], tiny_embedder, shards=2)
    (tmp_path / "token").write_text(TOKEN)
    wrapper = tmp_path / "nats-in-ns"
    wrapper.write_text(f"#!/bin/sh\nexec {' '.join(hosts.prefix('nats'))} {binary} \"$@\"\n")
    wrapper.chmod(0o755)
    nats = NatsServer(tmp_path / "nats-store", port=4222, host=hosts.ip["nats"], binary=str(wrapper))
    nats.start()
    nats_url = nats.url
    procs = {}

    def replica(shard, r):
        name = f"s{shard}r{r}"
        # without netem in this kernel the replica itself adds the few milliseconds of latency
        delay = [] if hosts.netem else ["--inject-delay-prob", "1.0", "--inject-delay-ms", "2"]
        procs[name] = ServiceProcess(
            ["shard", "--data-dir", str(data), "--collection", "mh", "--shard", str(shard),
             "--host", hosts.ip[name], "--port", "7000", "--device", "cpu", "--log-level", "WARNING",
             "--nats", nats_url, "--replica-id", name, "--shard-token-file", str(tmp_path / "token"),
             *delay], f"replica {name}", hosts.prefix(name))
        return procs[name]

    def router():
        procs["router"] = ServiceProcess(
            ["router", "--collection", "mh", "--host", hosts.ip["router"], "--port", "7100",
             "--device", "cpu", "--log-level", "WARNING", "--nats", nats_url,
             "--shard-token-file", str(tmp_path / "token"), "--embedder", str(tiny_embedder_dir),
             "--embedder-name", "tiny-test-embedder",
             "--replicas", f"{hosts.ip['s0r0']}:7000,{hosts.ip['s0r1']}:7000",
             "--replicas", f"{hosts.ip['s1r0']}:7000,{hosts.ip['s1r1']}:7000"],
            "router", hosts.prefix("router"))
        return procs["router"]

    try:
        for s in (0, 1):
            for r in (0, 1):
                replica(s, r)
        router()
        # a client that reconnects promptly once the router is back (default backoff reaches 2 min)
        channel = grpc.insecure_channel(f"{hosts.ip['router']}:7100", options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500)])
        stub = pb_grpc.SearchServiceStub(channel)
        router_down = []       # (from, to) monotonic windows in which the router was not running
        acked = {}             # doc -> (version, sequence) of its last acknowledged write
        attempted = {}         # doc -> highest version sent
        stale, slow, failures = [], [], []
        stop = threading.Event()
        lock = threading.Lock()

        def during_router_restart(t0, t1):
            """The requests the test names: those in flight while the router was down, or within
            the client's reconnect backoff (0.5 s) of it coming back."""
            return any(a <= t1 and t0 <= b + 1.5 for a, b in router_down)

        def writer():
            n = 0
            while not stop.is_set():
                doc = f"d{n % 12}"
                v = attempted.get(doc, 0) + 1
                attempted[doc] = v
                t0 = time.monotonic()
                try:
                    r = stub.UpsertDocument(pb.UpsertDocumentRequest(
                        collection="mh", doc_id=doc, version=v, text=f"{marker(doc, v)} multihost write"),
                        timeout=DEADLINE_S)
                except grpc.RpcError as err:
                    if not during_router_restart(t0, time.monotonic()):
                        failures.append(("write", err.code().name, err.details()))
                    n += 1
                    time.sleep(0.05)
                    continue
                with lock:
                    acked[doc] = (v, r.sequence)
                # read your write: the new version and never the one it replaced
                t0 = time.monotonic()
                try:
                    new = [h.doc_id for h in stub.Search(pb.SearchRequest(
                        collection="mh", text=marker(doc, v), top_k=3, mode=pb.LEXICAL,
                        min_applied_sequence=r.sequence), timeout=DEADLINE_S).hits]
                    old = [h.doc_id for h in stub.Search(pb.SearchRequest(
                        collection="mh", text=marker(doc, v - 1), top_k=3, mode=pb.LEXICAL,
                        min_applied_sequence=r.sequence), timeout=DEADLINE_S).hits] if v > 1 else []
                    if new != [doc] or doc in old:
                        stale.append((doc, v, new, old))
                except grpc.RpcError as err:
                    if not during_router_restart(t0, time.monotonic()):
                        failures.append(("read-your-write", err.code().name, err.details()))
                n += 1

        def reader(i):
            queries = ["boundary layer flow", "supersonic wing", "heat transfer", "shock wave"]
            n = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    stub.Search(pb.SearchRequest(collection="mh", text=queries[(i + n) % 4], top_k=5,
                                                 mode=(pb.HYBRID, pb.LEXICAL)[n % 2]),
                                timeout=DEADLINE_S)
                except grpc.RpcError as err:
                    if not during_router_restart(t0, time.monotonic()):
                        failures.append(("read", err.code().name, err.details()))
                    time.sleep(0.05)
                if time.monotonic() - t0 > DEADLINE_S + 0.5:
                    slow.append(time.monotonic() - t0)
                n += 1

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,))
                                                       for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(3)
        procs["s0r1"].kill()                                  # a replica dies
        time.sleep(2)
        os.kill(procs["s1r0"].proc.pid, signal.SIGSTOP)       # another hangs for 10 s
        time.sleep(4)
        replica(0, 1)                                         # the dead one comes back
        time.sleep(6)
        os.kill(procs["s1r0"].proc.pid, signal.SIGCONT)
        time.sleep(2)
        router_down.append([time.monotonic(), float("inf")])
        procs["router"].kill()                                # the router dies
        router()                                              # and is restarted
        router_down[-1][1] = time.monotonic()
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(60)

        # every replica has applied everything acknowledged (each answers a read at the last
        # acknowledged sequence: it waits until its shard's subject is applied that far), and
        # then they converge on the same log position and live rows
        admin = pb_grpc.AdminServiceStub(channel)
        last_seq = max(seq for _, seq in acked.values())
        build = admin.CollectionStats(pb.CollectionStatsRequest(collection="mh"), timeout=30).replicas[0].build_id
        for name in ("s0r0", "s0r1", "s1r0", "s1r1"):
            with grpc.insecure_channel(f"{hosts.ip[name]}:7000") as ch:
                resp = spb_grpc.ShardServiceStub(ch).SearchShard(spb.ShardSearchRequest(queries=[
                    spb.ShardQuery(build_id=build, tenant="default", text="caught up", lexical_depth=1,
                                   min_applied_seq=last_seq)]),
                    metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=90)
            assert resp.results[0].code == 0, (name, resp.results[0].message)
        deadline = time.monotonic() + 90
        while True:
            stats = admin.CollectionStats(pb.CollectionStatsRequest(collection="mh", digest=True),
                                          timeout=30)
            by_shard = {}
            for r in stats.replicas:
                by_shard.setdefault(r.shard, []).append(r)
            if len(stats.replicas) == 4 and all(
                    len({(r.applied_sequence, r.live_digest) for r in rs}) == 1
                    and all(r.state == "serving" for r in rs) for rs in by_shard.values()):
                break
            assert time.monotonic() < deadline, f"replicas did not converge: {stats.replicas}"
            time.sleep(0.5)
        # no acknowledged write is lost: each document shows exactly one version, >= its last ack
        for doc, (v, _) in acked.items():
            visible = [w for w in range(1, attempted[doc] + 1) if doc in [h.doc_id for h in stub.Search(
                pb.SearchRequest(collection="mh", text=marker(doc, w), top_k=3, mode=pb.LEXICAL,
                                 min_applied_sequence=last_seq), timeout=10).hits]]
            assert len(visible) == 1 and visible[0] >= v, (doc, v, visible)
        channel.close()
        assert len(acked) == 12 and sum(v for v, _ in acked.values()) > 24
        assert stale == [], stale[:5]
        assert failures == [], failures[:5]
        assert slow == []
    finally:
        for p in procs.values():
            p.stop()
        nats.stop()
