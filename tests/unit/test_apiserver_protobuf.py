"""Protobuf request bodies (`application/vnd.kubernetes.protobuf`), as kubectl's typed clients send."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ebpf_proxy.apiserver import ApiServer, Store
from ebpf_proxy.apiserver import protobuf


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (all lengths here fit one varint byte)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def envelope(kind: str, raw: bytes, api_version: str = "v1") -> bytes:
    type_meta = _field(1, api_version.encode()) + _field(2, kind.encode())
    return protobuf.MAGIC + _field(1, type_meta) + _field(2, raw) + _field(3, b"") + _field(4, b"")


def namespace_message(name: str, labels: dict[str, str]) -> bytes:
    meta = _field(1, name.encode()) + _field(2, b"") + _field(3, b"") + bytes([7 << 3, 0])  # generation 0
    for key, value in labels.items():
        meta += _field(11, _field(1, key.encode()) + _field(2, value.encode()))
    return _field(1, meta) + _field(2, _field(1, b"kubernetes")) + _field(3, _field(1, b""))


def test_decodes_a_namespace_like_its_json_form():
    body = envelope("Namespace", namespace_message("team-a", {"team": "a", "tier": "x"}))
    assert protobuf.decode(body) == {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "team-a", "labels": {"team": "a", "tier": "x"}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {},
    }


@pytest.mark.parametrize("body, why", [
    (b"\x0a\x00", "magic"),
    (envelope("Service", b""), "kind 'Service' are not supported"),
    (protobuf.MAGIC + b"\x0a\x05\x0a", "truncated"),
])
def test_undecodable_bodies_say_why(body, why):
    with pytest.raises(protobuf.DecodeError, match=why):
        protobuf.decode(body)


@pytest.fixture
def server():
    store = Store()
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    yield srv, store
    srv.stop()
    store.close()


def post(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_protobuf_namespace_is_created(server):
    srv, store = server
    status, obj = post(srv.url + "/api/v1/namespaces", envelope("Namespace", namespace_message("team-a", {})),
                       protobuf.MEDIA_TYPE)
    assert status == 201 and obj["metadata"]["name"] == "team-a"
    assert store.get("Namespace", None, "team-a")["status"]["phase"] == "Active"


def test_unsupported_protobuf_kind_and_unknown_media_type_are_415(server):
    srv, _ = server
    status, obj = post(srv.url + "/api/v1/namespaces/default/services", envelope("Service", b""), protobuf.MEDIA_TYPE)
    assert status == 415 and obj["reason"] == "UnsupportedMediaType" and "send JSON" in obj["message"]
    status, obj = post(srv.url + "/api/v1/namespaces", b"name: x", "text/plain")
    assert status == 415 and "application/json" in obj["message"]
