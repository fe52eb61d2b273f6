"""Decoding of `application/vnd.kubernetes.protobuf` request bodies, for the kinds kubectl sends so.

kubectl (1.37, the venv's, for one) writes built-in kinds with protobuf through its typed clients, with no
discovery round-trip first and no fallback to JSON when the server answers 415: `kubectl create
namespace x` fails outright against a JSON-only server. So the server decodes protobuf, for the
kinds whose typed-client commands matter in the lab; any other kind is still a 415.

The wire format is Kubernetes' envelope: the magic `k8s\\x00`, then a `runtime.Unknown` message
(typeMeta, raw = the object's own message, contentEncoding, contentType). Objects decode into the
same dict a JSON body would give, driven by a small table of field numbers taken from
`k8s.io/api/.../generated.proto`; fields not in the table are skipped, as an older server skips
fields it does not know.
"""

from __future__ import annotations

from typing import Any

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"


class DecodeError(ValueError):
    pass


# A schema maps a field number to (JSON name, how to decode it, repeated?).
Field = tuple[str, Any, bool]
Schema = dict[int, Field]

_STRING = "string"
_INT = "int"
_MAP = "map"  # map<string, string>: repeated {1: key, 2: value}

TYPE_META: Schema = {1: ("apiVersion", _STRING, False), 2: ("kind", _STRING, False)}
UNKNOWN: Schema = {
    1: ("typeMeta", TYPE_META, False),
    2: ("raw", "bytes", False),
    3: ("contentEncoding", _STRING, False),
    4: ("contentType", _STRING, False),
}
OBJECT_META: Schema = {
    1: ("name", _STRING, False),
    2: ("generateName", _STRING, False),
    3: ("namespace", _STRING, False),
    5: ("uid", _STRING, False),
    6: ("resourceVersion", _STRING, False),
    7: ("generation", _INT, False),
    11: ("labels", _MAP, False),
    12: ("annotations", _MAP, False),
    14: ("finalizers", _STRING, True),
}
NAMESPACE: Schema = {
    1: ("metadata", OBJECT_META, False),
    2: ("spec", {1: ("finalizers", _STRING, True)}, False),
    3: ("status", {1: ("phase", _STRING, False)}, False),
}

# kind -> message schema of the object (the envelope's raw bytes)
KINDS: dict[str, Schema] = {"Namespace": NAMESPACE}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) for every field of one message."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                raise DecodeError(f"field {number}: truncated")
            value, pos = data[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise DecodeError(f"field {number}: unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def _decode_value(kind: Any, wire: int, value: Any, name: str) -> Any:
    if isinstance(kind, dict):
        return decode_message(value, kind)
    if kind == _INT:
        if wire != 0:
            raise DecodeError(f"{name}: expected a varint")
        return value
    if not isinstance(value, bytes) or wire != 2:
        raise DecodeError(f"{name}: expected a length-delimited field")
    if kind == "bytes":
        return value
    if kind == _MAP:
        entry = decode_message(value, {1: ("key", _STRING, False), 2: ("value", _STRING, False)})
        return entry.get("key", ""), entry.get("value", "")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"{name}: not UTF-8") from None


def decode_message(data: bytes, schema: Schema) -> dict[str, Any]:
    """One protobuf message as the dict its JSON form would give (unknown fields skipped)."""
    obj: dict[str, Any] = {}
    for number, wire, value in _fields(data):
        if number not in schema:
            continue
        name, kind, repeated = schema[number]
        decoded = _decode_value(kind, wire, value, name)
        if decoded in ("", 0) and not repeated:
            continue  # proto2 writes every field; the JSON form omits empty ones (omitempty)
        if kind == _MAP:
            obj.setdefault(name, {})[decoded[0]] = decoded[1]
        elif repeated:
            obj.setdefault(name, []).append(decoded)
        else:
            obj[name] = decoded
    return obj


def decode(body: bytes) -> dict[str, Any]:
    """A protobuf request body as a JSON-style object; DecodeError names what is wrong."""
    if not body.startswith(MAGIC):
        raise DecodeError("missing the k8s protobuf envelope (magic 'k8s\\x00')")
    unknown = decode_message(body[len(MAGIC):], UNKNOWN)
    type_meta = unknown.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    if kind not in KINDS:
        raise DecodeError(f"protobuf bodies of kind {kind or '(none)'!r} are not supported; send JSON")
    if unknown.get("contentEncoding"):
        raise DecodeError(f"content encoding {unknown['contentEncoding']!r} is not supported")
    obj = decode_message(unknown.get("raw", b""), KINDS[kind])
    obj["apiVersion"] = type_meta.get("apiVersion", "")
    obj["kind"] = kind
    return obj
