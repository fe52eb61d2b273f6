"""Unknown-field handling (`fieldValidation`), using the official client's models as the schema.

The real server decodes into Go structs, so a misspelt field (`targetport`) is dropped, with
a warning by default or a 400 under `fieldValidation=Strict` (which kubectl sends). The
Python client's generated models carry the same field lists (`attribute_map`,
`openapi_types`), so they serve as the schema here instead of a hand-copied one, and a
manifest that the real server would refuse is refused in the lab too.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from ebpf_proxy.apiserver.errors import bad_request
from ebpf_proxy.apiserver.kinds import ResourceType

_MODEL = {
    ("", "Service"): "V1Service",
    ("", "Pod"): "V1Pod",
    ("", "Node"): "V1Node",
    ("", "Namespace"): "V1Namespace",
    ("", "Event"): "CoreV1Event",
    ("discovery.k8s.io", "EndpointSlice"): "V1EndpointSlice",
    ("events.k8s.io", "Event"): "EventsV1Event",
}
_LIST = re.compile(r"^[Ll]ist\[(.*)\]$")
_DICT = re.compile(r"^[Dd]ict[\[(]str, (.*)[\])]$")
_SCALARS = {"str", "int", "float", "bool", "datetime", "date", "object", "bytearray"}


@lru_cache(maxsize=None)
def _fields(model: str) -> dict[str, str] | None:
    """JSON field name -> type string of a client model; None if the client does not have it."""
    from kubernetes.client import models  # deferred: only requests that need a schema pay for it

    cls = getattr(models, model, None)
    if cls is None:
        return None
    return {cls.attribute_map[attr]: typ for attr, typ in cls.openapi_types.items()}


def _walk(value: Any, typ: str, path: str, unknown: list[str]) -> None:
    """Remove fields of `value` unknown to type `typ`, recording their paths."""
    if typ in _SCALARS or value is None:
        return
    m = _LIST.match(typ)
    if m:
        if isinstance(value, list):
            for i, item in enumerate(value):
                _walk(item, m.group(1), f"{path}[{i}]", unknown)
        return
    m = _DICT.match(typ)
    if m:
        if isinstance(value, dict):
            for key, item in value.items():
                _walk(item, m.group(1), f"{path}[{key}]", unknown)
        return
    fields = _fields(typ)
    if fields is None or not isinstance(value, dict):
        return
    for key in list(value):
        sub = f"{path}.{key}" if path else key
        if key not in fields:
            unknown.append(sub)
            del value[key]
        else:
            _walk(value[key], fields[key], sub, unknown)


def prune_unknown(rt: ResourceType, obj: dict[str, Any], directive: str | None) -> list[str]:
    """Drop unknown fields of a request body in place, as the real decoder does.

    `directive` is the `fieldValidation` parameter: Strict raises 400 BadRequest naming
    every unknown field; Warn (the default) and Ignore drop them, and for Warn the returned
    messages become `Warning` headers.
    """
    model = _MODEL.get((rt.group, rt.kind))
    if model is None or not isinstance(obj, dict):
        return []
    if directive not in (None, "", "Strict", "Warn", "Ignore"):
        raise bad_request(f'fieldValidation: Unsupported value: "{directive}": supported values: "Ignore", "Strict", "Warn"')
    unknown: list[str] = []
    _walk(obj, model, "", unknown)
    messages = [f'unknown field "{path}"' for path in unknown]
    if messages and directive == "Strict":
        raise bad_request(
            f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict decoding error: '
            + ", ".join(messages)
        )
    return [] if directive == "Ignore" else messages
