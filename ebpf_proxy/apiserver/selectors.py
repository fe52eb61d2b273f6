"""Label and field selectors: parsed once per request, then matched against stored objects.

The grammar follows `k8s.io/apimachinery/pkg/labels` (equality `=`, `==`, `!=`; set-based
`in`, `notin`, `key`, `!key`; numeric `>`/`<`) and `pkg/fields` (`=`, `==`, `!=`, with
backslash escapes). Field selectors only accept the fields the real server indexes for each
kind, so a selector that works here also works against a real cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ebpf_proxy.apiserver import names
from ebpf_proxy.apiserver.errors import ApiError, bad_request


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if not present:
            return False
        try:
            have = int(value)  # type: ignore[arg-type]
        except ValueError:
            return False
        want = int(self.values[0])
        return have > want if self.op == "gt" else have < want


class LabelSelector:
    """A conjunction of requirements; the empty selector matches everything."""

    def __init__(self, requirements: tuple[Requirement, ...] = ()) -> None:
        self.requirements = requirements

    def __repr__(self) -> str:
        return f"LabelSelector({self.requirements!r})"

    def empty(self) -> bool:
        return not self.requirements

    def matches(self, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    @classmethod
    def from_map(cls, selector: dict[str, str]) -> "LabelSelector":
        """A Service's `spec.selector`: every key must equal its value."""
        return cls(tuple(Requirement(k, "=", (v,)) for k, v in sorted(selector.items())))

    @classmethod
    def parse(cls, text: str | None) -> "LabelSelector":
        """Parse the `labelSelector` query parameter; 400 BadRequest naming the bad part."""
        if text is None or not text.strip():
            return cls()
        return cls(tuple(_LabelParser(text).parse()))


class _LabelParser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, why: str) -> ApiError:
        return bad_request(f"unable to parse requirement: {why} (labelSelector {self.text!r}, at offset {self.pos})")

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def word(self) -> str:
        """A key or a value: everything up to whitespace or a delimiter."""
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in " \t\n,()=!<>":
            self.pos += 1
        return self.text[start : self.pos]

    def parse(self) -> list[Requirement]:
        reqs = []
        while True:
            reqs.append(self.requirement())
            self.skip_ws()
            if self.pos >= len(self.text):
                return reqs
            if self.peek() != ",":
                raise self.fail(f"expected ',' but found {self.peek()!r}")
            self.pos += 1

    def requirement(self) -> Requirement:
        self.skip_ws()
        negated = False
        if self.peek() == "!":
            negated = True
            self.pos += 1
            self.skip_ws()
        key = self.word()
        if not key:
            raise self.fail("expected a label key")
        why = names.label_key(key)
        if why:
            raise self.fail(f"invalid label key {key!r}: {why}")
        self.skip_ws()
        if negated:
            return Requirement(key, "!")
        if self.pos >= len(self.text) or self.peek() == ",":
            return Requirement(key, "exists")
        for token, op in (("==", "="), ("!=", "!="), ("=", "="), (">", "gt"), ("<", "lt")):
            if self.peek(len(token)) == token:
                self.pos += len(token)
                self.skip_ws()
                value = self.word()
                self.check_value(value)
                if op in ("gt", "lt"):
                    try:
                        int(value)
                    except ValueError:
                        raise self.fail(f"for '{token}' operator the value must be an integer, not {value!r}") from None
                return Requirement(key, op, (value,))
        op_word = self.word()
        if op_word not in ("in", "notin"):
            raise self.fail(f"found {op_word or self.peek()!r}, expected one of: in, notin, =, ==, !=, >, <")
        self.skip_ws()
        if self.peek() != "(":
            raise self.fail(f"expected '(' after {op_word!r}")
        self.pos += 1
        values = []
        while True:
            self.skip_ws()
            value = self.word()
            self.check_value(value)
            values.append(value)
            self.skip_ws()
            ch = self.peek()
            self.pos += 1
            if ch == ")":
                break
            if ch != ",":
                raise self.fail(f"expected ',' or ')' in the value set of {key!r}")
        return Requirement(key, op_word, tuple(values))

    def check_value(self, value: str) -> None:
        why = names.label_value(value)
        if why:
            raise self.fail(f"invalid label value {value!r}: {why}")


# ---------------------------------------------------------------------------------------------
# Field selectors

def _path(*keys: str) -> Callable[[dict[str, Any]], str]:
    def get(obj: dict[str, Any]) -> str:
        cur: Any = obj
        for k in keys:
            if not isinstance(cur, dict):
                return ""
            cur = cur.get(k)
        if cur is None:
            return ""
        if isinstance(cur, bool):
            return "true" if cur else "false"
        return str(cur)

    return get


_COMMON = {"metadata.name": _path("metadata", "name"), "metadata.namespace": _path("metadata", "namespace")}

# The fields the real API server supports per kind (pkg/registry/*/strategy.go ToSelectableFields).
FIELDS: dict[str, dict[str, Callable[[dict[str, Any]], str]]] = {
    "Service": {**_COMMON, "spec.clusterIP": _path("spec", "clusterIP"), "spec.type": _path("spec", "type")},
    "EndpointSlice": dict(_COMMON),
    "Node": {**_COMMON, "spec.unschedulable": _path("spec", "unschedulable")},
    "Namespace": {**_COMMON, "status.phase": _path("status", "phase")},
    "Pod": {
        **_COMMON,
        "spec.nodeName": _path("spec", "nodeName"),
        "spec.restartPolicy": _path("spec", "restartPolicy"),
        "spec.schedulerName": _path("spec", "schedulerName"),
        "spec.serviceAccountName": _path("spec", "serviceAccountName"),
        "spec.hostNetwork": _path("spec", "hostNetwork"),
        "status.phase": _path("status", "phase"),
        "status.podIP": _path("status", "podIP"),
        "status.nominatedNodeName": _path("status", "nominatedNodeName"),
    },
    "Event": {
        **_COMMON,
        **{f"involvedObject.{f}": _path("involvedObject", f) for f in (
            "kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
        "reason": _path("reason"),
        "reportingComponent": _path("reportingComponent"),
        "source": _path("source", "component"),
        "type": _path("type"),
    },
}

# events.k8s.io/v1 spells some event fields differently; selectors use its names.
EVENTS_V1_FIELD_ALIASES = {
    **{f"regarding.{f}": f"involvedObject.{f}" for f in (
        "kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
    "reportingController": "reportingComponent",
    "deprecatedSource": "source",
}


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    op: str  # "=" or "!="
    value: str
    getter: Callable[[dict[str, Any]], str]

    def matches(self, obj: dict[str, Any]) -> bool:
        have = self.getter(obj)
        return have == self.value if self.op == "=" else have != self.value


class FieldSelector:
    def __init__(self, requirements: tuple[FieldRequirement, ...] = ()) -> None:
        self.requirements = requirements

    def empty(self) -> bool:
        return not self.requirements

    def matches(self, obj: dict[str, Any]) -> bool:
        return all(r.matches(obj) for r in self.requirements)

    @classmethod
    def parse(cls, text: str | None, kind: str, aliases: dict[str, str] | None = None) -> "FieldSelector":
        """Parse `fieldSelector` for `kind`; 400 BadRequest for unknown fields or bad syntax."""
        if text is None or not text.strip():
            return cls()
        fields = FIELDS.get(kind, _COMMON)
        reqs = []
        for term in _split_unescaped(text, ","):
            term = term.strip()
            if not term:
                continue
            for token, op in (("!=", "!="), ("==", "="), ("=", "=")):
                idx = _find_unescaped(term, token)
                if idx >= 0:
                    field = term[:idx].strip()
                    value = _unescape(term[idx + len(token) :].strip())
                    break
            else:
                raise bad_request(f"invalid selector: {term!r}; can't understand it (fieldSelector {text!r})")
            canonical = (aliases or {}).get(field, field)
            if canonical not in fields:
                supported = ", ".join(sorted(k for k in fields))
                raise bad_request(f"field label not supported: {field} (fieldSelector {text!r}; supported: {supported})")
            reqs.append(FieldRequirement(field, op, value, fields[canonical]))
        return cls(tuple(reqs))


def _find_unescaped(text: str, token: str) -> int:
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text.startswith(token, i):
            return i
        i += 1
    return -1


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, cur, i = [], [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if ch == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            out.append(value[i + 1])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)
