"""A small kustomize for the manifest tests, for machines without `kubectl`.

It supports exactly what `deploy/` uses and refuses the rest, so a kustomization that grows a
feature this file does not know fails loudly instead of rendering something different:

- `resources`: YAML files (several documents each) and directories holding a kustomization;
- `components`: directories holding a `kind: Component` kustomization, applied after the
  resources: its own resources join the objects gathered so far and its patches, images and
  labels apply to all of them (before the including kustomization's own);
- `patches`: JSON 6902 operation lists (`add`, `replace`, `remove`), inline or from a file,
  selected by `target` (group, version, kind, name, namespace);
- `images`: `name` with `newName`, `newTag` and/or `digest`, applied to `containers` and
  `initContainers`;
- `labels`: `pairs` added to `metadata.labels` only (`includeSelectors` and `includeTemplates`
  false, kustomize's defaults).

Objects come back in the order they were read. When `kubectl` is present the tests render with
`kubectl kustomize` and check that this file agrees with it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

_KEYS = {"apiVersion", "kind", "resources", "components", "patches", "images", "labels"}
_PATCH_KEYS = {"target", "patch", "path"}
_TARGET_KEYS = {"group", "version", "kind", "name", "namespace"}
_IMAGE_KEYS = {"name", "newName", "newTag", "digest"}
_LABEL_KEYS = {"pairs", "includeSelectors", "includeTemplates"}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or is wrong."""


def build(directory: Path) -> list[Obj]:
    """Render the kustomization in `directory` into a list of objects."""
    return _build(directory, [], component=False)


def _build(directory: Path, objects: list[Obj], *, component: bool) -> list[Obj]:
    """Add `directory`'s resources to `objects` (empty unless it is a component) and transform."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8")) or {}
    unknown = set(spec) - _KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)}")
    if (spec.get("kind") == "Component") != component:
        expected = "a Component (listed in `components`)" if component else "not a Component"
        raise KustomizeError(f"{kfile}: expected {expected}, got kind {spec.get('kind')!r}")

    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(_build(path, [], component=False))
        elif path.is_file():
            docs = yaml.safe_load_all(path.read_text(encoding="utf-8"))
            objects.extend(doc for doc in docs if doc is not None)
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} does not exist")
    _check_unique(objects, kfile)
    for entry in spec.get("components", []):
        path = directory / entry
        if not path.is_dir():
            raise KustomizeError(f"{kfile}: component {entry!r} is not a directory")
        objects = _build(path, objects, component=True)

    for patch in spec.get("patches", []):
        _apply_patch(objects, patch, directory)
    for image in spec.get("images", []):
        _apply_image(objects, image)
    for label in spec.get("labels", []):
        _apply_labels(objects, label)
    return objects


def resource_id(obj: Obj) -> tuple[str, str, str, str]:
    """(group, kind, namespace, name): what kustomize keeps unique."""
    group = obj["apiVersion"].rpartition("/")[0]
    meta = obj.get("metadata", {})
    return group, obj["kind"], meta.get("namespace", ""), meta["name"]


def _check_unique(objects: list[Obj], where: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        rid = resource_id(obj)
        if rid in seen:
            raise KustomizeError(f"{where}: {rid} appears twice")
        seen.add(rid)


def _matches(obj: Obj, target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    meta = obj.get("metadata", {})
    actual = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": meta.get("name", ""),
        "namespace": meta.get("namespace", ""),
    }
    return all(actual[key] == value for key, value in target.items())


def _apply_patch(objects: list[Obj], patch: Obj, directory: Path) -> None:
    if set(patch) - _PATCH_KEYS or "target" not in patch:
        raise KustomizeError(f"unsupported patch entry {sorted(patch)}: need target + patch/path")
    target = patch["target"]
    if set(target) - _TARGET_KEYS:
        raise KustomizeError(
            f"unsupported patch target fields {sorted(set(target) - _TARGET_KEYS)}"
        )
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text("utf-8")
    ops = yaml.safe_load(text)
    if not isinstance(ops, list):
        raise KustomizeError("only JSON 6902 patches (a list of operations) are supported")
    hits = [obj for obj in objects if _matches(obj, target)]
    if not hits:
        raise KustomizeError(f"patch target {target} matches no resource")
    for obj in hits:
        for op in ops:
            _json_patch_op(obj, op)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"JSON pointer must start with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json_patch_op(obj: Obj, op: Obj) -> None:
    kind = op.get("op")
    parts = _pointer(op["path"])
    if not parts:
        raise KustomizeError("patching the whole document is not supported")
    parent: Any = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if kind in ("add", "replace"):
        value = copy.deepcopy(op["value"])
        if isinstance(parent, list):
            if kind == "add":
                parent.insert(len(parent) if last == "-" else int(last), value)
            else:
                parent[int(last)] = value
        else:
            if kind == "replace" and last not in parent:
                raise KustomizeError(f"replace: {op['path']} does not exist")
            parent[last] = value
    elif kind == "remove":
        if isinstance(parent, list):
            del parent[int(last)]
        else:
            del parent[last]
    else:
        raise KustomizeError(f"unsupported JSON patch op {kind!r}")


def _split_image(image: str) -> tuple[str, str]:
    """'repo/name:tag@sha256:x' -> ('repo/name', ':tag@sha256:x'); a port is not a tag."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon:] + at + digest
    return name, at + digest


def _apply_image(objects: list[Obj], image: Obj) -> None:
    if set(image) - _IMAGE_KEYS or "name" not in image:
        raise KustomizeError(f"unsupported images entry {sorted(image)}")

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for container in value:
                        _retag(container, image)
                else:
                    visit(value)
        elif isinstance(node, list):
            for item in node:
                visit(item)

    for obj in objects:
        visit(obj)


def _retag(container: Obj, image: Obj) -> None:
    name, suffix = _split_image(container.get("image", ""))
    if name != image["name"]:
        return
    new = image.get("newName", name)
    if "digest" in image:
        suffix = "@" + image["digest"]
    elif "newTag" in image:
        suffix = ":" + str(image["newTag"])
    container["image"] = new + suffix


def _apply_labels(objects: list[Obj], label: Obj) -> None:
    if set(label) - _LABEL_KEYS:
        raise KustomizeError(f"unsupported labels entry {sorted(label)}")
    if label.get("includeSelectors") or label.get("includeTemplates"):
        raise KustomizeError("labels with includeSelectors/includeTemplates are not supported")
    for obj in objects:
        labels = obj.setdefault("metadata", {}).setdefault("labels", {})
        labels.update({str(k): str(v) for k, v in label["pairs"].items()})
