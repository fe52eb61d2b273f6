"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

Strategic merge patch is what kubectl (`apply`, `edit`, `label`) and the client libraries
send by default. It differs from a merge patch in how lists merge: `spec.ports` of a Service
merges element by element on `port`, where a merge patch would replace the whole list and
silently drop every port the patch does not mention. The merge keys come from the Go types'
`patchMergeKey` tags, transcribed below for the kinds this server stores; every other list
is replaced, as upstream does for lists without a patch strategy. The directives kubectl
emits (`$patch`, `$setElementOrder/...`, `$retainKeys`, `$deleteFromPrimitiveList/...`) are
honoured.
"""

from __future__ import annotations

import copy
from typing import Any

from ebpf_proxy.apiserver.errors import ApiError, bad_request, unsupported_media_type

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, `null` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


PRIMITIVE = ""  # merge strategy for lists of scalars: union (e.g. metadata.finalizers)

# patchMergeKey per field path (list elements do not add a path step), from the Go types.
MERGE_KEYS: dict[str, dict[tuple[str, ...], str]] = {
    "*": {("metadata", "ownerReferences"): "uid", ("metadata", "finalizers"): PRIMITIVE},
    "Service": {("spec", "ports"): "port"},
    "Pod": {
        **{("spec", c): "name" for c in ("containers", "initContainers", "ephemeralContainers")},
        **{("spec", c, "ports"): "containerPort" for c in ("containers", "initContainers", "ephemeralContainers")},
        **{("spec", c, "env"): "name" for c in ("containers", "initContainers", "ephemeralContainers")},
        **{("spec", c, "volumeMounts"): "mountPath" for c in ("containers", "initContainers", "ephemeralContainers")},
        ("spec", "volumes"): "name",
        ("spec", "imagePullSecrets"): "name",
        ("spec", "hostAliases"): "ip",
        ("status", "conditions"): "type",
        ("status", "podIPs"): "ip",
    },
    "Node": {
        ("spec", "podCIDRs"): PRIMITIVE,
        ("status", "conditions"): "type",
        ("status", "addresses"): "type",
    },
}


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value if not (isinstance(v, dict) and "$patch" in v)]
    return value


def strategic_merge_patch(target: Any, patch: Any, kind: str = "") -> Any:
    """Apply a strategic merge patch to an object of storage kind `kind`."""
    if not isinstance(patch, dict):
        raise bad_request("a strategic merge patch must be a JSON object")
    keys = {**MERGE_KEYS["*"], **MERGE_KEYS.get(kind, {})}
    result = _smp_map(target if isinstance(target, dict) else {}, patch, (), keys)
    return {} if result is None else result


def _smp_map(target: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...], keys: dict) -> dict[str, Any] | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip_directives(patch)
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = path + (key,)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            cur = result.get(key)
            merged = _smp_map(cur if isinstance(cur, dict) else {}, value, sub, keys)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and sub in keys:
            cur = result.get(key)
            result[key] = _smp_list(cur if isinstance(cur, list) else [], value, sub, keys)
        else:
            result[key] = _strip_directives(value)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
    for key, value in patch.items():
        if key.startswith("$setElementOrder/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = _ordered(result[field], value, keys.get(path + (field,), PRIMITIVE))
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(target: list[Any], patch: list[Any], path: tuple[str, ...], keys: dict) -> list[Any]:
    if any(isinstance(e, dict) and e.get("$patch") == "replace" for e in patch):
        return _strip_directives(patch)
    merge_key = keys[path]
    result = copy.deepcopy(target)
    if merge_key == PRIMITIVE:
        for value in patch:
            if value not in result:
                result.append(value)
        return result
    for elem in patch:
        if not isinstance(elem, dict) or merge_key not in elem:
            raise bad_request(f"strategic merge patch: an element of {'.'.join(path)} lacks its merge key {merge_key!r}")
        idx = next((i for i, cur in enumerate(result) if isinstance(cur, dict) and cur.get(merge_key) == elem[merge_key]), None)
        if elem.get("$patch") == "delete":
            if idx is not None:
                del result[idx]
            continue
        if idx is None:
            result.append(_strip_directives(elem))
        else:
            merged = _smp_map(result[idx], elem, path, keys)
            if merged is None:
                del result[idx]
            else:
                result[idx] = merged
    return result


def _ordered(items: list[Any], order: list[Any], merge_key: str) -> list[Any]:
    """Sort `items` as `$setElementOrder` says; items it does not mention keep their place at the end."""
    def ident(item: Any) -> Any:
        return item.get(merge_key) if merge_key and isinstance(item, dict) else item

    wanted = [ident(o) for o in order]
    known = [i for i in items if ident(i) in wanted]
    known.sort(key=lambda i: wanted.index(ident(i)))
    return known + [i for i in items if ident(i) not in wanted]


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"json patch: path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for p in parts:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise ApiError(422, "Invalid", f"json patch: path {path!r} does not exist")
    return cur


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise ApiError(422, "Invalid", f"json patch: index {last!r} out of range in {path!r}")
    else:
        raise ApiError(422, "Invalid", f"json patch: cannot add below a scalar at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    parts = _pointer(path)
    if not parts:
        raise bad_request("json patch: cannot remove the whole document")
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise ApiError(422, "Invalid", f"json patch: path {path!r} does not exist")


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 add/remove/replace/move/copy/test, applied to a copy of `target`."""
    if not isinstance(ops, list):
        raise bad_request("json patch: the body must be a JSON array of operations")
    doc = copy.deepcopy(target)
    for i, op in enumerate(ops):
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"json patch: operation {i} needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            doc, value = _remove(doc, op.get("from", ""))
            doc = _add(doc, path, value)
        elif kind == "copy":
            value = copy.deepcopy(_walk(doc, _pointer(op.get("from", "")), op.get("from", "")))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _walk(doc, _pointer(path), path) != op.get("value"):
                raise ApiError(422, "Invalid", f"json patch: test operation {i} failed at {path!r}")
        else:
            raise bad_request(f"json patch: unknown operation {kind!r} at index {i}")
    return doc


def apply(content_type: str, target: dict[str, Any], patch: Any, kind: str = "") -> dict[str, Any]:
    """Apply a PATCH body of the given media type; 415 for server-side apply and unknown types."""
    media = content_type.split(";")[0].strip().lower()
    if media == MERGE:
        result = merge_patch(target, patch)
    elif media == STRATEGIC:
        result = strategic_merge_patch(target, patch, kind)
    elif media == JSON_PATCH:
        result = json_patch(target, patch)
    elif media == APPLY:
        raise unsupported_media_type(
            "server-side apply (application/apply-patch+yaml) is not supported by this lab API server; "
            "use client-side `kubectl apply` or a merge patch"
        )
    else:
        raise unsupported_media_type(
            f"the body of the request was in an unknown format - accepted media types include: {JSON_PATCH}, {MERGE}, {STRATEGIC}"
        )
    if not isinstance(result, dict):
        raise bad_request("the patch must leave an object, not " + type(result).__name__)
    return result
