"""deploy/k8s rendered and validated offline: every object against the real Kubernetes schemas
(kubernetes-validate, strict), the LeaderWorkerSet against a minimal structural schema plus the
real PodTemplateSpec schema for its pod templates, and the operational rules every pod must keep
(security context, requests/limits, GPUs, probes and their windows, drain, volumes, topology).
Flags, ports, addresses and env names against the code: test_deploy_cli_contract.py.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest

from tests.unit.test_deploy_kustomize import K8S, OVERLAYS, render

K8S_VERSION = "1.33"
ROOT = K8S.parents[1]
LWS_SCHEMA = json.loads((K8S / "schemas" / "leaderworkerset.x-k8s.io_v1.json").read_text())
CHECKPOINT_LOAD_S = 2 * 3600  # a 600 GB checkpoint from network storage, plus warm-up
DRAIN_DEFAULT_S = 300  # in-flight streams a pod waits for when the service has no --grace-s flag
RENDERS = ("base", *OVERLAYS)


def rendered(name: str) -> list[dict]:
    return render(K8S / "base") if name == "base" else render(K8S / "overlays" / name)


_CACHE: dict[str, list[dict]] = {}


def objects(name: str) -> list[dict]:
    if name not in _CACHE:
        _CACHE[name] = rendered(name)
    return copy.deepcopy(_CACHE[name])


def pod_templates(objs: list[dict]):
    """(where, pod template) for every workload: Deployments and both LWS templates."""
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield name, o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            if "leaderTemplate" in lwt:
                yield f"{name}/leader", lwt["leaderTemplate"]
            yield f"{name}/worker", lwt["workerTemplate"]


def containers(objs: list[dict]):
    for where, tpl in pod_templates(objs):
        for c in tpl["spec"]["containers"]:
            yield where, tpl, c


def ddtree_args(c: dict) -> list[str]:
    """The `ddtree ...` argv of a container: image ENTRYPOINT + args, or after torchrun's --module gateway.cli."""
    args = c.get("args", [])
    if "command" not in c:
        return args
    assert c["command"] == ["torchrun"], f"{c['name']}: unexpected command {c['command']}"
    i = args.index("--module")
    assert args[i + 1] == "gateway.cli", "torchrun must run the ddtree CLI module"
    return args[i + 2:]


def component(c: dict) -> str:
    return ddtree_args(c)[0]


def by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _seconds(probe: dict) -> int:
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


# --- schema validation ------------------------------------------------------------------------------
def validate(obj: dict) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        jsonschema.validate(obj, LWS_SCHEMA)
        for _where, tpl in pod_templates([obj]):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": tpl}, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_validates_strictly(name):
    objs = objects(name)
    assert objs
    for o in objs:
        try:
            validate(o)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as e:
            pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']}: {e.message} at {list(e.absolute_path)}")


@pytest.mark.parametrize("mutate,where", [
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(bogus=1), "Deployment"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"].update(port="grpc"),
     "Deployment"),
    (lambda o: o["spec"].update(replica=2), "Deployment"),
    (lambda o: o["spec"]["leaderWorkerTemplate"].update(size="two"), "LeaderWorkerSet"),
    (lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(bogus=1),
     "LeaderWorkerSet"),
    (lambda o: o["spec"].update(networkconfig={}), "LeaderWorkerSet"),
])
def test_validation_catches_mistakes(mutate, where):
    """The validators are not vacuous: typical manifest mistakes fail."""
    o = next(x for x in objects("lws" if where == "LeaderWorkerSet" else "split") if x["kind"] == where)
    validate(o)
    mutate(o)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(o)


# --- pod rules --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RENDERS)
def test_security_context(name):
    for where, tpl, c in containers(objects(name)):
        pod = tpl["spec"].get("securityContext", {})
        sc = c.get("securityContext", {})
        label = f"{name} {where} {c['name']}"
        assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, label
        assert sc.get("runAsUser", pod.get("runAsUser", 0)) != 0, label
        assert sc.get("readOnlyRootFilesystem") is True, label
        assert sc.get("allowPrivilegeEscalation") is False, label
        assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), label
        assert not sc.get("privileged"), label
        assert tpl["spec"].get("automountServiceAccountToken") is False, label


@pytest.mark.parametrize("name", RENDERS)
def test_resources_and_gpus(name):
    for where, tpl, c in containers(objects(name)):
        req, lim = c["resources"].get("requests", {}), c["resources"].get("limits", {})
        label = f"{name} {where} {c['name']}"
        for r in ("cpu", "memory", "ephemeral-storage"):
            assert r in req and r in lim, f"{label}: {r} request and limit"
        # extended resources: the API server demands request == limit
        assert req.get("nvidia.com/gpu") == lim.get("nvidia.com/gpu"), label
        if component(c) == "verifier":
            assert int(req["nvidia.com/gpu"]) >= 1, f"{label}: the verifier needs GPUs"
        if component(c) == "gateway":
            assert "nvidia.com/gpu" not in req, label
        if component(c) == "drafter" and "nvidia.com/gpu" not in req:
            # co-located: it shares the pod's GPUs, which only works when the pod holds the whole node
            others = [x for x in tpl["spec"]["containers"] if x is not c]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("NVIDIA_VISIBLE_DEVICES") == "all", label
            assert any(int(x["resources"]["limits"].get("nvidia.com/gpu", 0)) == 8 for x in others), label


@pytest.mark.parametrize("name", RENDERS)
def test_writable_volumes(name):
    for where, tpl, c in containers(objects(name)):
        vols = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        label = f"{name} {where} {c['name']}"
        for m in mounts.values():
            assert m["name"] in vols, f"{label}: mount of undeclared volume {m['name']}"
        for path in ("/tmp", "/var/cache/ddtree"):
            assert path in mounts and not mounts[path].get("readOnly"), f"{label}: {path} must be writable"
            assert "emptyDir" in vols[mounts[path]["name"]], label
        for v in vols.values():
            if "emptyDir" in v:
                assert "sizeLimit" in v["emptyDir"], f"{label}: unbounded emptyDir {v['name']}"
        if component(c) != "gateway":
            shm = vols[mounts["/dev/shm"]["name"]]
            assert shm["emptyDir"].get("medium") == "Memory", label
        assert mounts["/models"].get("readOnly") is True, label
        assert vols[mounts["/models"]["name"]]["persistentVolumeClaim"].get("readOnly") is True, label


@pytest.mark.parametrize("name", RENDERS)
def test_probes(name):
    for where, tpl, c in containers(objects(name)):
        label = f"{name} {where} {c['name']}"
        if where.endswith("/worker"):  # torch.distributed ranks > 0 serve no gRPC
            assert not any(k in c for k in ("startupProbe", "readinessProbe", "livenessProbe")), label
            continue
        co_drafter = component(c) == "drafter" and len(tpl["spec"]["containers"]) > 1
        kinds = ("startupProbe", "livenessProbe") if co_drafter else ("startupProbe", "readinessProbe",
                                                                       "livenessProbe")
        if co_drafter:  # the verifier stays ready (autoregressive) while its drafter restarts
            assert "readinessProbe" not in c, label
        for k in kinds:
            assert "grpc" in c.get(k, {}), f"{label}: {k} must be a gRPC health probe"
        ports = {c[k]["grpc"]["port"] for k in kinds}
        services = {c[k]["grpc"].get("service", "") for k in kinds}
        assert len(ports) == 1 and len(services) == 1, f"{label}: probes disagree: {ports} {services}"
        if component(c) in ("verifier", "drafter"):
            assert _seconds(c["startupProbe"]) >= CHECKPOINT_LOAD_S, f"{label}: startup window too short"
        assert _seconds(c["livenessProbe"]) >= 60, f"{label}: liveness gives up too fast"


@pytest.mark.parametrize("name", RENDERS)
def test_termination_covers_prestop_and_drain(name):
    from tests.unit.test_deploy_cli_contract import parsed_or_none

    for where, tpl, c in containers(objects(name)):
        label = f"{name} {where} {c['name']}"
        pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre >= 5, f"{label}: endpoints need a few seconds to drop the pod before SIGTERM"
        ns = parsed_or_none(objects(name), where, c)
        drain = getattr(ns, "grace_s", None) if ns is not None else None
        drain = DRAIN_DEFAULT_S if drain is None else drain
        assert tpl["spec"]["terminationGracePeriodSeconds"] >= pre + drain + 10, label


# --- topology ---------------------------------------------------------------------------------------
def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(where: str, tpl: dict) -> dict:
    """Labels the running pods carry: the template's, plus what the LWS controller adds."""
    labels = dict(tpl["metadata"].get("labels", {}))
    if where.startswith("LeaderWorkerSet/"):
        _, name, role = where.split("/")
        labels["leaderworkerset.sigs.k8s.io/name"] = name
        labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0" if role == "leader" else "1"
    return labels


@pytest.mark.parametrize("name", RENDERS)
def test_services_select_pods_and_resolve_target_ports(name):
    objs = objects(name)
    for svc in by_kind(objs, "Service").values():
        pods = [(w, t) for w, t in pod_templates(objs) if _selects(svc["spec"]["selector"], pod_labels(w, t))]
        assert pods, f"{name}: Service {svc['metadata']['name']} selects no pods"
        for p in svc["spec"]["ports"]:
            for w, t in pods:
                named = {cp["name"]: cp["containerPort"] for c in t["spec"]["containers"] for cp in c.get("ports", [])}
                assert p["targetPort"] in named, f"{name}: {svc['metadata']['name']} port {p['name']} in {w}"


@pytest.mark.parametrize("name", RENDERS)
def test_hpa_and_pdbs(name):
    from telemetry.metrics import Metrics

    objs = objects(name)
    deployments = by_kind(objs, "Deployment")
    hpas = by_kind(objs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"ddtree-gateway"}
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        assert hpa["spec"]["minReplicas"] >= 2, "a single gateway would make its PDB block every drain"
        (m,) = hpa["spec"]["metrics"]
        assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == "ddtree_queue_depth"
        # the metric is a gauge the services really export
        families = {f.name: f.type for f in Metrics().registry.collect()}
        assert families.get("ddtree_queue_depth") == "gauge"
    pdbs = by_kind(objs, "PodDisruptionBudget")
    assert "ddtree-gateway" in pdbs and "ddtree-verifier" in pdbs
    for pdb in pdbs.values():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(_selects(sel, pod_labels(w, t)) for w, t in pod_templates(objs)), pdb["metadata"]["name"]


def test_colocated_pod_shares_shm_and_gpus():
    for name in ("colocated", "multi-gpu"):
        objs = objects(name)
        assert "ddtree-drafter" not in by_kind(objs, "Deployment") and "ddtree-drafter" not in by_kind(objs, "Service")
        tpl = by_kind(objs, "Deployment")["ddtree-verifier"]["spec"]["template"]
        cs = {component(c): c for c in tpl["spec"]["containers"]}
        assert set(cs) == {"verifier", "drafter"}
        shm = {c: next(m["name"] for m in cs[c]["volumeMounts"] if m["mountPath"] == "/dev/shm") for c in cs}
        assert shm["verifier"] == shm["drafter"], f"{name}: /dev/shm must be one volume"


def test_multi_gpu_world_matches_gpus():
    from torch.distributed.run import get_args_parser

    from tests.unit.test_deploy_cli_contract import env_of, expand

    objs = objects("multi-gpu")
    where, _, c = next(x for x in containers(objs) if component(x[2]) == "verifier")
    env = env_of(objs, where, c)
    ns = get_args_parser().parse_args([expand(a, env) for a in c["args"]])
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert int(env["NPROC_PER_NODE"]) == gpus == int(ns.nproc_per_node) == 8
    assert ns.nnodes == "1" and ns.module and ns.training_script == "gateway.cli"
    _torchrun_waits_for_the_drain(objs, where, c, ns)
    # torchrun sets WORLD_SIZE, RANK, LOCAL_RANK per rank: the container must not (the CLI reads them)
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK"} & {e["name"] for e in c.get("env", [])}


def _torchrun_waits_for_the_drain(objs, where, c, ns) -> None:
    """On SIGTERM torchrun signals the ranks and SIGKILLs them after --shutdown-timeout: rank 0 must get its
    whole drain (--grace-s; the other ranks wait for its STOP), within the pod's termination grace period."""
    from tests.unit.test_deploy_cli_contract import parsed_or_none

    grace = parsed_or_none(objs, where, c).grace_s
    assert ns.shutdown_timeout is not None and int(ns.shutdown_timeout) >= grace, where
    tpl = dict(pod_templates(objs))[where]
    assert tpl["spec"]["terminationGracePeriodSeconds"] >= c["lifecycle"]["preStop"]["sleep"]["seconds"] + int(
        ns.shutdown_timeout), where


def test_lws_group_and_leader_service():
    from torch.distributed.run import get_args_parser

    objs = objects("lws")
    assert "ddtree-verifier" not in by_kind(objs, "Deployment")
    lws = by_kind(objs, "LeaderWorkerSet")["ddtree-verifier"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] >= 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    from tests.unit.test_deploy_cli_contract import LWS_INJECTED, env_of, expand

    assert LWS_INJECTED["LWS_GROUP_SIZE"] == str(lwt["size"])
    for where, _tpl, c in containers([lws]):
        if component(c) != "verifier":
            continue
        env = env_of(objs, where, c)
        ns = get_args_parser().parse_args([expand(a, env) for a in c["args"]])
        assert int(ns.nproc_per_node) == int(c["resources"]["limits"]["nvidia.com/gpu"]), where
        assert ns.nnodes == str(lwt["size"]) and ns.training_script == "gateway.cli"
        assert ns.master_addr == LWS_INJECTED["LWS_LEADER_ADDRESS"] and ns.node_rank == 0
        _torchrun_waits_for_the_drain(objs, where, c, ns)
    svc = by_kind(objs, "Service")["ddtree-verifier"]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == lws["metadata"]["name"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_one_pinned_image_everywhere(name):
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {c["image"] for _, _, c in containers(objects(name))}
    assert images == {f"ghcr.io/ddtree-serve/ddtree:{version}"}, images


@pytest.mark.parametrize("name", RENDERS)
def test_labels(name):
    for o in objects(name):
        assert o["metadata"]["labels"].get("app.kubernetes.io/part-of") == "ddtree", o["metadata"]["name"]
    for where, tpl in pod_templates(objects(name)):
        assert tpl["metadata"]["labels"].get("app.kubernetes.io/part-of") == "ddtree", where

