"""A small kustomize renderer for deploy/k8s (kubectl/kustomize are not available in CI), and its tests.

It implements exactly the kustomization features deploy/k8s uses and refuses any other field, so a
manifest can never silently rely on something it does not render:
- `resources`: files (multi-document YAML) and directories holding a kustomization.yaml;
- `patches`: `path` or inline `patch`, strategic merge (one object per patch, matched by kind + name
  or by `target`; `$patch: delete` removes an object or a list item) or JSON6902 (a list of add / remove /
  replace operations, with `target`);
- `labels` (pairs, includeTemplates) and `images` (name -> newName/newTag), applied in kustomize's
  order: patches, then labels, then images, each kustomization over its own resources.
Strategic merge follows the Kubernetes merge keys of the lists it meets (containers and volumes by
name, volumeMounts by mountPath, container ports by containerPort, Service ports by port, ...).
When kubectl is on PATH, `test_renderer_matches_kubectl` compares the two renderings.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("colocated", "split", "multi-gpu", "lws")
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images", "labels"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
              "volumeMounts": "mountPath", "volumeDevices": "devicePath", "env": "name", "imagePullSecrets": "name",
              "resourceClaims": "name", "tolerations": None, "args": None, "command": None}
TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class RenderError(Exception):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _id(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _merge_key(field: str, path: tuple[str, ...]) -> str | None:
    if field == "ports":  # container ports vs Service ports
        return "containerPort" if "containers" in path or "initContainers" in path else "port"
    return MERGE_KEYS.get(field)


def strategic_merge(dst, src, path: tuple[str, ...] = ()):
    """Merge patch `src` into `dst` (returns the result; inputs untouched)."""
    if not isinstance(src, dict) or not isinstance(dst, dict):
        return copy.deepcopy(src)
    out = copy.deepcopy(dst)
    for k, v in src.items():
        if k.startswith("$"):
            raise RenderError(f"unsupported strategic-merge directive {k} at {'/'.join(path)}")
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = strategic_merge(out[k], v, path + (k,))
        elif isinstance(v, list) and isinstance(out.get(k), list) and _merge_key(k, path):
            out[k] = _merge_list(out[k], v, _merge_key(k, path), path + (k,))
        else:
            out[k] = copy.deepcopy(v)
    return out


def _merge_list(dst: list, src: list, key: str, path: tuple[str, ...]) -> list:
    """kyaml's order (kustomize 5): the patch's items first, in patch order (merged into their
    counterparts), then the untouched items in their old order. Env order matters: $(VAR) in an env
    value only sees variables defined above it."""
    out, touched = [], set()
    for item in src:
        if key not in item:
            raise RenderError(f"list item at {'/'.join(path)} lacks its merge key {key!r}: {item}")
        touched.add(item[key])
        if item.get("$patch") == "delete":
            continue
        old = next((x for x in dst if x.get(key) == item[key]), {})
        out.append(strategic_merge(old, item, path))
    return out + [copy.deepcopy(x) for x in dst if x.get(key) not in touched]


def _pointer(doc, pointer: str):
    """(parent, last token) of a JSON pointer."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.lstrip("/").split("/")]
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    return node, parts[-1]


def json6902(obj: dict, ops: list[dict]) -> dict:
    obj = copy.deepcopy(obj)
    for op in ops:
        parent, last = _pointer(obj, op["path"])
        kind = op["op"]
        if isinstance(parent, list):
            i = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(i, copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[i] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[i]
            else:
                raise RenderError(f"unsupported JSON6902 op {kind}")
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise RenderError(f"replace of missing {op['path']}")
                parent[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[last]
            else:
                raise RenderError(f"unsupported JSON6902 op {kind}")
    return obj


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    unknown = set(target) - set(want)
    if unknown:
        raise RenderError(f"unsupported patch target fields {sorted(unknown)}")
    return all(want[k] == v for k, v in target.items())


def _apply_patch(objs: list[dict], entry: dict, base: Path) -> list[dict]:
    text = (base / entry["path"]).read_text() if "path" in entry else entry["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    target = entry.get("target")
    if len(docs) == 1 and isinstance(docs[0], list):  # JSON6902
        if target is None:
            raise RenderError("a JSON6902 patch needs a target")
        hits = [i for i, o in enumerate(objs) if _matches(o, target)]
        if not hits:
            raise RenderError(f"patch target {target} matches nothing")
        for i in hits:
            objs[i] = json6902(objs[i], docs[0])
        return objs
    if len(docs) != 1:  # kustomize 5.5 panics on these (nil apiVersion): one object per patch file
        raise RenderError(f"{entry}: a strategic-merge patch must hold exactly one object, got {len(docs)}")
    for doc in docs:
        sel = target or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
        hits = [i for i, o in enumerate(objs) if _matches(o, sel)]
        if len(hits) != 1:
            raise RenderError(f"strategic-merge patch for {sel} matches {len(hits)} objects")
        if doc.get("$patch") == "delete":
            objs.pop(hits[0])
        else:
            objs[hits[0]] = strategic_merge(objs[hits[0]], doc)
    return objs


def _split_image(image: str) -> tuple[str, str]:
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    return (image[:colon], image[colon:]) if colon > slash else (image, "")


def _set_images(node, images: list[dict]) -> None:
    """kustomize's image transformer edits every `containers` / `initContainers` list, any kind."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for c in v:
                    name, tag = _split_image(c["image"])
                    for im in images:
                        if im["name"] == name:
                            tag = ":" + im["newTag"] if "newTag" in im else tag
                            c["image"] = im.get("newName", name) + tag
            else:
                _set_images(v, images)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, images)


def _set_labels(objs: list[dict], spec: dict) -> None:
    if spec.get("includeSelectors"):
        raise RenderError("labels.includeSelectors is not supported by this renderer")
    pairs = spec["pairs"]
    for o in objs:
        o["metadata"].setdefault("labels", {}).update(pairs)
        if spec.get("includeTemplates") and o["kind"] in TEMPLATE_KINDS:
            o["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def render(directory: Path) -> list[dict]:
    """Objects of the kustomization in `directory`, as `kustomize build` would emit them."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(k) - SUPPORTED
    if unsupported:
        raise RenderError(f"{directory}: kustomization fields {sorted(unsupported)} are not supported")
    objs: list[dict] = []
    for r in k.get("resources", []):
        p = (directory / r).resolve()
        objs += render(p) if p.is_dir() else _load_docs(p)
    ids = [_id(o) for o in objs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise RenderError(f"{directory}: duplicate objects {sorted(dup)}")
    for entry in k.get("patches", []):
        objs = _apply_patch(objs, entry, directory)
    for spec in k.get("labels", []):
        _set_labels(objs, spec)
    if k.get("images"):
        _set_images(objs, k["images"])
    return objs


# --- tests of the renderer itself ---------------------------------------------------------------------
def test_strategic_merge_by_keys_and_deletes():
    base = {"spec": {"containers": [{"name": "a", "image": "x", "ports": [{"containerPort": 1, "name": "p"}],
                                     "env": [{"name": "E", "value": "1"}, {"name": "F", "value": "2"}]}],
                     "volumes": [{"name": "v", "emptyDir": {}}]}}
    patch = {"spec": {"containers": [{"name": "a", "ports": [{"containerPort": 2}],
                                      "env": [{"name": "E", "value": "9"}, {"name": "F", "$patch": "delete"}]},
                                     {"name": "b", "image": "y"}],
                      "volumes": [{"name": "v", "emptyDir": {"medium": "Memory"}}]}}
    out = strategic_merge(base, patch)
    a, b = out["spec"]["containers"]
    assert a["image"] == "x" and [p["containerPort"] for p in a["ports"]] == [2, 1]  # patch items first
    assert a["env"] == [{"name": "E", "value": "9"}]
    assert b == {"name": "b", "image": "y"}
    assert out["spec"]["volumes"] == [{"name": "v", "emptyDir": {"medium": "Memory"}}]
    assert base["spec"]["containers"][0]["env"][1]["name"] == "F"  # input untouched
    # args have no merge key: a patch replaces the whole list
    assert strategic_merge({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}
    # Service ports merge by port
    svc = strategic_merge({"ports": [{"port": 80, "name": "h"}]}, {"ports": [{"port": 80, "name": "g"}]})
    assert svc == {"ports": [{"port": 80, "name": "g"}]}


def test_json6902_ops():
    obj = {"spec": {"args": ["a"], "x/y": 1}}
    out = json6902(obj, [{"op": "add", "path": "/spec/args/-", "value": "b"},
                         {"op": "add", "path": "/spec/args/0", "value": "z"},
                         {"op": "replace", "path": "/spec/x~1y", "value": 2},
                         {"op": "remove", "path": "/spec/args/1"}])
    assert out == {"spec": {"args": ["z", "b"], "x/y": 2}}
    with pytest.raises(RenderError):
        json6902(obj, [{"op": "move", "path": "/spec/args/0"}])


def test_images_and_unsupported_fields(tmp_path):
    objs = [{"kind": "LeaderWorkerSet", "metadata": {"name": "x"}, "spec": {"t": {"spec": {"containers": [
        {"name": "c", "image": "ddtree"}, {"name": "d", "image": "reg:5000/other:1"}]}}}}]
    _set_images(objs, [{"name": "ddtree", "newName": "ghcr.io/a/ddtree", "newTag": "0.1.0"},
                       {"name": "reg:5000/other", "newTag": "2"}])
    cs = objs[0]["spec"]["t"]["spec"]["containers"]
    assert [c["image"] for c in cs] == ["ghcr.io/a/ddtree:0.1.0", "reg:5000/other:2"]
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(RenderError, match="namePrefix"):
        render(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests are rendered by this module's renderer only")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=lambda o: json.dumps(_id(o)))
    ours = sorted(render(K8S / "overlays" / overlay), key=lambda o: json.dumps(_id(o)))
    assert json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)
