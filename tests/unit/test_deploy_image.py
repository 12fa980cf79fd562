"""deploy/Dockerfile, its .dockerignore and the OpenTelemetry collector config, checked offline
(no docker in CI) against pyproject.toml and the rendered Kubernetes manifests."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
import urllib.parse

import pytest
import yaml

from tests.unit.test_deploy_manifests import RENDERS, ROOT, by_kind, containers, objects

DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SECRETISH = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.I)


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    """Instructions per build stage (index 0: the global ARGs before the first FROM)."""
    out: list[list[tuple[str, str]]] = [[]]
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def global_args() -> dict[str, str]:
    return dict(a[1].split("=", 1) for a in stages()[0] if a[0] == "ARG" and "=" in a[1])


def env_of(stage) -> dict[str, str]:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                env[k] = v
    return env


def packages() -> set[str]:
    return {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}


def test_cuda_runtime_base_for_both_stages():
    args = global_args()
    for st in stages()[1:]:
        base = st[0][1].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn-)?runtime-ubuntu\d+\.\d+", base), base


def test_runs_as_the_manifests_non_root_user():
    final = stages()[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the final stage must switch to a non-root user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    assert [w for w, _ in final].index("USER") > max(i for i, (w, _) in enumerate(final) if w in ("RUN", "COPY"))
    for name in RENDERS:
        for where, tpl, _c in containers(objects(name)):
            pod = tpl["spec"]["securityContext"]
            assert (pod["runAsUser"], pod["runAsGroup"]) == (int(uid), int(gid)), f"{name} {where}"


def test_entrypoint_is_the_console_script():
    (entry,) = [json.loads(rest) for word, rest in stages()[-1] if word == "ENTRYPOINT"]
    assert entry == ["ddtree"]
    assert PYPROJECT["project"]["scripts"]["ddtree"] == "gateway.cli:main"


def test_no_secrets_baked_in():
    for word, rest in instructions():
        if word in ("ARG", "ENV"):
            names = [t.partition("=")[0] for t in shlex.split(rest)]
            assert not [n for n in names if SECRETISH.search(n)], rest
        if word in ("COPY", "ADD"):
            assert not re.search(r"\.env\b|\.pem\b|\.key\b|id_rsa|\.netrc|credentials", rest), rest
            assert word != "ADD" or not rest.startswith("http"), "no remote ADD"
    assert "DDTREE_API_KEY" not in (DEPLOY / "Dockerfile").read_text()
    ignore = [x.strip() for x in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
              if x.strip() and not x.startswith("#")]
    assert ignore[0] == "*", "the build context is an allow-list: everything else stays out"


def test_every_package_is_copied_and_allowed_in_the_context():
    copied = {rest.split()[0] for word, rest in stages()[-2] if word == "COPY" and "--from" not in rest}
    assert packages() <= copied, f"not copied into the image: {packages() - copied}"
    assert copied - packages() == {"pyproject.toml"}, copied
    allowed = {x[1:].split("/")[0] for x in (DEPLOY / "Dockerfile.dockerignore").read_text().split()
               if x.startswith("!")}
    assert packages() | {"pyproject.toml", "README.md"} == allowed


def test_installs_the_package_with_the_otlp_extra():
    runs = " ".join(rest for word, rest in stages()[-2] if word == "RUN")
    m = re.search(r'pip install [^&]*"/src\[([\w,]+)\]"', runs)
    assert m and "otlp" in m.group(1).split(",")
    assert "otlp" in PYPROJECT["project"]["optional-dependencies"]
    assert "ddtree --help" in runs, "the build smoke-tests the console script"


@pytest.mark.parametrize("var", ["HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR"])
def test_cache_dirs_are_writable_volumes_in_every_pod(var):
    path = env_of(stages()[-1])[var]
    for name in RENDERS:
        for where, tpl, c in containers(objects(name)):
            vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
            mounts = [m for m in c["volumeMounts"] if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
            assert mounts, f"{name} {where} {c['name']}: {var}={path} is on the read-only root filesystem"
            m = max(mounts, key=lambda m: len(m["mountPath"]))
            assert not m.get("readOnly") and "emptyDir" in vols[m["name"]], f"{name} {where} {c['name']}"


def test_exposed_ports_cover_the_container_ports():
    exposed = {int(p) for word, rest in stages()[-1] if word == "EXPOSE" for p in rest.split()}
    used = {p["containerPort"] for n in RENDERS for _, _, c in containers(objects(n)) for p in c.get("ports", [])}
    assert used <= exposed, f"container ports missing from EXPOSE: {used - exposed}"


# --- OpenTelemetry collector ---------------------------------------------------------------------------
def test_collector_pipeline_is_complete_and_matches_the_services_endpoint():
    cfg = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    traces = cfg["service"]["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        for comp in traces[section]:
            assert comp in cfg[section], f"pipeline uses undefined {section[:-1]} {comp}"
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]
    procs = traces["processors"]
    assert procs[0] == "memory_limiter" and procs[-1] == "batch", "memory_limiter first, batch last"
    assert [e for e in traces["exporters"] if not e.startswith("debug")], "traces must leave the collector"
    settings = by_kind(objects("base"), "ConfigMap")["ddtree-config"]["data"]
    assert settings["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    endpoint = urllib.parse.urlsplit(settings["OTEL_EXPORTER_OTLP_ENDPOINT"])
    grpc_rx = cfg["receivers"][traces["receivers"][0]]["protocols"]["grpc"]["endpoint"]
    assert int(grpc_rx.rpartition(":")[2]) == endpoint.port
    assert endpoint.hostname.split(".")[0] == "otel-collector"
