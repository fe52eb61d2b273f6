"""The HTTP front of the store: the Kubernetes REST protocol (JSON) over plain HTTP.

One `ApiServer` serves one `Store` on any number of listening sockets: the lab binds one on
127.0.0.1 in the root network namespace for kubectl and tests, and one inside a namespace the
node agents can reach. Sockets may be handed in already bound (binding inside another netns
has to happen before the server exists) or given as "host:port".

Watches are streamed with chunked encoding, one JSON event per line, exactly as the real
server does; a watch that starts from a version the history no longer holds gets HTTP 200
and a single ERROR event carrying a 410 Expired Status, which is what client libraries
expect (and what they relist on).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from ebpf_proxy.apiserver import discovery, events, legacyip, protobuf, schema, tables
from ebpf_proxy.apiserver import patch as patch_mod
from ebpf_proxy.apiserver.errors import (
    ApiError,
    bad_request,
    forbidden,
    invalid_object,
    method_not_allowed,
    not_acceptable,
    unsupported_media_type,
)
from ebpf_proxy.apiserver.kinds import EVENTS_V1, GROUPS, ResourceType, lookup
from ebpf_proxy.apiserver.selectors import EVENTS_V1_FIELD_ALIASES, FieldSelector
from ebpf_proxy.apiserver.store import Store
from ebpf_proxy.apiserver.watch import BOOKMARK, Watcher, WatchEvent

log = logging.getLogger("ebpf_proxy.apiserver")

# Request bodies this server decodes (JSON and YAML, and the patch types, all JSON- or YAML-encoded).
_BODY_MEDIA_TYPES = (
    "application/json", "application/yaml", "application/x-yaml", "application/apply-patch+yaml",
    patch_mod.MERGE, patch_mod.STRATEGIC, patch_mod.JSON_PATCH,
)

def _not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def parse_host_port(text: str) -> tuple[str, int]:
    """"127.0.0.1:8080", "[::1]:0", ":6443" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen address {text!r} is not HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (SO_REUSEADDR), created in the calling thread's network namespace."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, api: "ApiServer") -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.server_address = sock.getsockname()[:2]
        self.address_family = sock.family
        self.api = api

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        thread.start()
        self.api._track(thread, request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("apiserver: unhandled error serving %s", client_address)


def _parse_accept(header: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for part in (header or "*/*").split(","):
        fields = [f.strip() for f in part.split(";")]
        params = {}
        for f in fields[1:]:
            k, _, v = f.partition("=")
            params[k.strip()] = v.strip()
        out.append((fields[0].lower(), params))
    return out


def _list_meta(page: Any) -> dict[str, Any]:
    """A list's metadata: its version, and where the next page starts."""
    meta: dict[str, Any] = {"resourceVersion": page.resource_version}
    if page.continue_token:
        meta["continue"] = page.continue_token
        if page.remaining is not None:  # unknown with selectors, as kube-apiserver omits it
            meta["remainingItemCount"] = page.remaining
    return meta


def negotiate(accept: str) -> tuple[str, str]:
    """("json" | "table" | "partial", meta version): what the client accepts first that we serve."""
    for media, params in _parse_accept(accept):
        if media not in ("application/json", "application/*", "*/*"):
            continue
        shape = params.get("as")
        if shape is None:
            return "json", ""
        if params.get("g") == "meta.k8s.io" and params.get("v") in ("v1", "v1beta1"):
            if shape == "Table":
                return "table", params["v"]
            if shape == "PartialObjectMetadata":
                return "partial", params["v"]
    raise not_acceptable(f"only application/json is served by this lab API server (Accept: {accept!r})")


def _flag(query: dict[str, str], name: str) -> bool | None:
    value = query.get(name)
    if value is None:
        return None
    return value.lower() in ("true", "1", "yes")


def _int_param(query: dict[str, str], name: str) -> int | None:
    value = query.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)  # type: ignore[arg-type]
    except ValueError:
        raise bad_request(f'{name}: Invalid value: "{value}": must be an integer') from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, the second waits for the
    # client's delayed ACK: ~40 ms added to every request.
    disable_nagle_algorithm = True
    server_version = "ebpf-proxy-apiserver"
    server: _HTTPServer

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("apiserver %s: " + fmt, self.client_address[0], *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # ------------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        self.warnings: list[str] = []
        try:
            raw = self._read_body()
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/") if p]
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            result = self._route(method, parts, query, raw)
            if result is not None:
                code, payload, content_type = result
                self._send(code, payload, content_type)
        except ApiError as exc:
            self._send(exc.code, exc.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - a server must answer, and log, whatever went wrong
            log.exception("apiserver: %s %s failed", method, self.path)
            self._send(500, ApiError(500, "InternalError", f"internal error: {exc!r}").status())

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _decode(self, raw: bytes) -> Any:
        if not raw:
            raise bad_request("the request needs a body")
        media = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if media == protobuf.MEDIA_TYPE:
            try:
                return protobuf.decode(raw)
            except protobuf.DecodeError as exc:
                raise unsupported_media_type(f"the body of the request could not be decoded as {media}: {exc}") from None
        if media not in _BODY_MEDIA_TYPES:
            # 415, as kube-apiserver answers a media type it cannot decode.
            raise unsupported_media_type(
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{', '.join(_BODY_MEDIA_TYPES)}"
            )
        try:
            if media in ("application/yaml", "application/apply-patch+yaml", "application/x-yaml"):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"the body of the request could not be decoded as {media}: {exc}") from None

    def _send(self, code: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else (json.dumps(payload) + "\n").encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-cache, private")
            for warning in getattr(self, "warnings", []):
                self.send_header("Warning", '299 - "' + warning.replace('"', '\\"') + '"')
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # ------------------------------------------------------------------------------------
    # routing

    def _route(self, method: str, parts: list[str], query: dict[str, str], raw: bytes) -> tuple[int, Any, str] | None:
        if parts[:1] == ["api"] and len(parts) >= 2:
            if parts[1] != "v1":
                raise _not_found()
            if len(parts) > 2:
                return self._resource(method, "", "v1", parts[2:], query, raw)
        if parts[:1] == ["apis"] and len(parts) >= 3:
            if parts[1] not in GROUPS or parts[2] not in GROUPS[parts[1]]:
                raise _not_found()
            if len(parts) > 3:
                return self._resource(method, parts[1], parts[2], parts[3:], query, raw)
        if method != "GET":
            raise method_not_allowed(f"{method} is not allowed on {self.path}")
        doc = self._discovery(parts)
        if isinstance(doc, bytes):
            return 200, doc, "text/plain; charset=utf-8"
        return 200, doc, "application/json"

    def _discovery(self, parts: list[str]) -> Any:
        path = "/".join(parts)
        if path in ("healthz", "livez", "readyz"):
            return b"ok"
        if path == "":
            return {"paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/openapi/v3", "/readyz", "/version"]
                    + [f"/apis/{g}" for g in GROUPS] + [f"/apis/{g}/{v}" for g in GROUPS for v in GROUPS[g]]}
        if path == "version":
            return discovery.version()
        if path == "api":
            host, port = self.server.server_address[:2]
            return discovery.api_versions(f"{host}:{port}")
        if path == "api/v1":
            return discovery.api_resource_list("", "v1")
        if path == "apis":
            return discovery.api_group_list()
        if parts[:1] == ["apis"] and len(parts) == 2:
            doc = discovery.api_group(parts[1])
            if doc is not None:
                return doc
        if parts[:1] == ["apis"] and len(parts) == 3:
            doc = discovery.api_resource_list(parts[1], parts[2])
            if doc is not None:
                return doc
        if path == "openapi/v3":
            return discovery.openapi_v3_root()
        if parts[:2] == ["openapi", "v3"]:
            rest = parts[2:]
            if rest[:1] == ["api"] and len(rest) == 2:
                doc = discovery.openapi_v3_doc("", rest[1])
            elif rest[:1] == ["apis"] and len(rest) == 3:
                doc = discovery.openapi_v3_doc(rest[1], rest[2])
            else:
                doc = None
            if doc is not None:
                return doc
        raise _not_found()

    def _resource(
        self, method: str, group: str, version: str, rest: list[str], query: dict[str, str], raw: bytes
    ) -> tuple[int, Any, str] | None:
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            inner = lookup(group, version, rest[2])
            if inner is not None and inner.namespaced:
                namespace, rest = rest[1], rest[2:]
        rt = lookup(group, version, rest[0])
        if rt is None or len(rest) > 3:
            raise _not_found()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub is not None and (sub != "status" or not rt.status_subresource):
            raise _not_found()
        return _Request(self, rt, namespace, name, sub, query, raw, method).run()


class _Request:
    """One API request against one resource type: verb selection and conversion at the edges."""

    def __init__(self, handler: _Handler, rt: ResourceType, namespace: str | None, name: str | None,
                 sub: str | None, query: dict[str, str], raw: bytes, method: str) -> None:
        self.h = handler
        self.store: Store = handler.server.api.store
        self.rt = rt
        self.kind = rt.storage_kind
        self.namespace = namespace if rt.namespaced else None
        self.name = name
        self.sub = sub
        self.query = query
        self.raw = raw
        self.method = method
        self.dry_run = query.get("dryRun") == "All"

    # conversion between the wire form of this resource and its storage form
    def out(self, obj: dict[str, Any]) -> dict[str, Any]:
        return events.to_events_v1(obj) if self.rt is EVENTS_V1 else obj

    def into(self, obj: Any) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise bad_request(f"the body of a {self.rt.kind} request must be a JSON object")
        if obj.get("kind") not in (None, self.rt.kind) or obj.get("apiVersion") not in (None, self.rt.api_version):
            raise bad_request(
                f"the body is a {obj.get('apiVersion')}/{obj.get('kind')}, but {self.rt.collection_path()} takes "
                f"{self.rt.api_version}/{self.rt.kind}"
            )
        self.h.warnings.extend(schema.prune_unknown(self.rt, obj, self.query.get("fieldValidation")))
        if self.rt is EVENTS_V1:
            return events.from_events_v1(obj)
        return obj

    def field_selector(self) -> FieldSelector:
        aliases = EVENTS_V1_FIELD_ALIASES if self.rt is EVENTS_V1 else None
        return FieldSelector.parse(self.query.get("fieldSelector"), self.kind, aliases)

    def _verb(self) -> str:
        collection = {"GET": "watch" if _flag(self.query, "watch") else "list", "POST": "create",
                      "DELETE": "deletecollection"}
        item = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
        return (collection if self.name is None else item).get(self.method, "")

    def run(self) -> tuple[int, Any, str] | None:
        m = self.method
        verb = self._verb()
        if self.sub is None and verb not in self.rt.verbs:
            raise method_not_allowed(f"{self.rt.plural} do not support {verb or m} ({m} {self.h.path})")
        if self.name is None:
            if m == "GET":
                if _flag(self.query, "watch"):
                    self.watch()
                    return None
                return self.list()
            if m == "POST":
                return self.create()
            if m == "DELETE":
                return self.delete_collection()
        elif self.rt.namespaced and self.namespace is None:
            raise _not_found()
        else:
            if m == "GET":
                return self.respond(200, self.store.get(self.kind, self.namespace, self.name))
            if m == "PUT":
                return self.update()
            if m == "PATCH":
                return self.patch()
            if m == "DELETE" and self.sub is None:
                return self.delete()
        raise method_not_allowed(f"{m} is not supported on {self.h.path}")

    def respond(self, code: int, obj: dict[str, Any]) -> tuple[int, Any, str]:
        shape, version = negotiate(self.h.headers.get("Accept", ""))
        obj = self.out(obj)
        if shape == "table":
            table = tables.to_table(self.kind, [obj], obj["metadata"].get("resourceVersion", ""),
                                    include_object=self.query.get("includeObject", "Metadata"))
            table["apiVersion"] = f"meta.k8s.io/{version}"
            return code, table, f"application/json;as=Table;v={version};g=meta.k8s.io"
        if shape == "partial":
            partial = {"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}", "metadata": obj["metadata"]}
            return code, partial, f"application/json;as=PartialObjectMetadata;v={version};g=meta.k8s.io"
        return code, obj, "application/json"

    # verbs -------------------------------------------------------------------------------

    def list(self) -> tuple[int, Any, str]:
        shape, version = negotiate(self.h.headers.get("Accept", ""))
        plain = shape == "json" and self.rt is not EVENTS_V1  # the items are sent as stored
        page = self.store.list_page(
            self.kind, self.namespace, self.query.get("labelSelector"), self.field_selector(),
            resource_version=self.query.get("resourceVersion"),
            resource_version_match=self.query.get("resourceVersionMatch"),
            limit=_int_param(self.query, "limit"), continue_token=self.query.get("continue"),
            copy=not plain,
        )
        if plain:
            return 200, self._encoded_list(page), "application/json"
        items = [self.out(o) for o in page.items]
        if shape == "table":
            table = tables.to_table(self.kind, items, page.resource_version,
                                    include_object=self.query.get("includeObject", "Metadata"),
                                    continue_token=page.continue_token)
            table["apiVersion"] = f"meta.k8s.io/{version}"
            return 200, table, f"application/json;as=Table;v={version};g=meta.k8s.io"
        meta = _list_meta(page)
        if shape == "partial":
            partials = [{"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}", "metadata": o["metadata"]} for o in items]
            return 200, {"kind": "PartialObjectMetadataList", "apiVersion": f"meta.k8s.io/{version}",
                         "metadata": meta, "items": partials}, "application/json"
        return 200, {"kind": f"{self.rt.kind}List", "apiVersion": self.rt.api_version, "metadata": meta, "items": items}, "application/json"

    def _encoded_list(self, page: Any) -> bytes:
        """The list object's JSON, its items joined from the store's per-version encodings
        rather than copied and encoded again: a 500-item page of a 100k-object list costs
        little more than its bytes."""
        head = json.dumps({"kind": f"{self.rt.kind}List", "apiVersion": self.rt.api_version,
                           "metadata": _list_meta(page)})
        items = b",".join(self.store.encoded(self.kind, o) for o in page.items)
        return head[:-1].encode() + b',"items":[' + items + b"]}\n"

    def create(self) -> tuple[int, Any, str]:
        if self.rt.namespaced and self.namespace is None:
            raise method_not_allowed(f"create needs a namespace: POST {self.rt.collection_path('NAMESPACE')}")
        obj = self.into(self.h._decode(self.raw))
        if self.rt is EVENTS_V1:
            errs = events.validate_events_v1(events.to_events_v1(obj))
            if errs:
                meta = obj.get("metadata") or {}
                raise invalid_object("Event", str(meta.get("name") or meta.get("generateName") or ""), errs, "events.k8s.io")
        obj = self.store.create(self.kind, obj, namespace=self.namespace, dry_run=self.dry_run)
        self.h.warnings.extend(legacyip.warnings_for_write(self.kind, obj, None, created=True))
        return self.respond(201, obj)

    def _check_name(self, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {}) if isinstance(obj.get("metadata", {}), dict) else None
        if meta is None:
            raise bad_request("metadata must be an object")
        if meta.get("name") and meta["name"] != self.name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({self.name})")
        meta["name"] = self.name

    def update(self) -> tuple[int, Any, str]:
        obj = self.into(self.h._decode(self.raw))
        self._check_name(obj)
        result = self.store.update(self.kind, obj, namespace=self.namespace, subresource=self.sub, dry_run=self.dry_run)
        self.h.warnings.extend(legacyip.warnings_for_write(self.kind, result, self.sub, created=False))
        return self.respond(200, result)

    def patch(self) -> tuple[int, Any, str]:
        body = self.h._decode(self.raw)
        content_type = self.h.headers.get("Content-Type", "")
        assert self.name is not None

        def change(current: dict[str, Any]) -> dict[str, Any]:
            wire = self.out(current)
            patched = patch_mod.apply(content_type, wire, body, self.kind)
            self.h.warnings.extend(schema.prune_unknown(self.rt, patched, self.query.get("fieldValidation")))
            return events.from_events_v1(patched) if self.rt is EVENTS_V1 else patched

        result = self.store.mutate(self.kind, self.namespace, self.name, change, subresource=self.sub, dry_run=self.dry_run)
        self.h.warnings.extend(legacyip.warnings_for_write(self.kind, result, self.sub, created=False))
        return self.respond(200, result)

    def _delete_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.raw:
            decoded = self.h._decode(self.raw)
            if isinstance(decoded, dict):
                opts = decoded
        grace = _int_param(self.query, "gracePeriodSeconds")
        if grace is not None:
            opts["gracePeriodSeconds"] = grace
        if "All" in (opts.get("dryRun") or []):
            self.dry_run = True
        return opts

    def delete(self) -> tuple[int, Any, str]:
        opts = self._delete_options()
        pre = opts.get("preconditions") or {}
        assert self.name is not None
        obj = self.store.delete(
            self.kind, self.namespace, self.name, grace_period_seconds=opts.get("gracePeriodSeconds"),
            uid=pre.get("uid"), resource_version=pre.get("resourceVersion"), dry_run=self.dry_run,
        )
        return self.respond(200, obj)

    def delete_collection(self) -> tuple[int, Any, str]:
        self._delete_options()
        if self.dry_run:
            raise bad_request("dryRun is not supported for deletecollection by this lab API server")
        deleted = self.store.delete_collection(self.kind, self.namespace, self.query.get("labelSelector"), self.field_selector())
        return 200, {"kind": f"{self.rt.kind}List", "apiVersion": self.rt.api_version,
                     "metadata": {"resourceVersion": self.store.resource_version}, "items": [self.out(o) for o in deleted]}, "application/json"

    # watch -------------------------------------------------------------------------------

    def watch(self) -> None:
        shape, version = negotiate(self.h.headers.get("Accept", ""))
        send_initial = _flag(self.query, "sendInitialEvents")
        bookmarks = bool(_flag(self.query, "allowWatchBookmarks"))
        if send_initial is not None:
            if self.query.get("resourceVersionMatch") != "NotOlderThan":
                raise invalid_object("ListOptions", "", [forbidden("resourceVersionMatch",
                    "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan")], "meta.k8s.io")
            if send_initial and not bookmarks:
                raise invalid_object("ListOptions", "", [forbidden("allowWatchBookmarks",
                    "sendInitialEvents requires setting allowWatchBookmarks to true")], "meta.k8s.io")
        timeout = _int_param(self.query, "timeoutSeconds")
        api = self.h.server.api
        deadline = time.monotonic() + (timeout if timeout and timeout > 0 else api.default_watch_timeout)
        try:
            watcher = self.store.watch(
                self.kind, namespace=self.namespace, resource_version=self.query.get("resourceVersion"),
                label_selector=self.query.get("labelSelector"), field_selector=self.field_selector(),
                allow_bookmarks=bookmarks, send_initial_events=send_initial,
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            self._start_stream()
            self._write_event({"type": "ERROR", "object": exc.status()})
            self._end_stream()
            return
        api._watch_started(watcher)
        try:
            self._start_stream()
            self._pump(watcher, deadline, shape, version)
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.h.close_connection = True
        finally:
            # One watch per connection, as after a real server's watch the client reconnects.
            self.h.close_connection = True
            watcher.stop("the watch request ended")
            api._watch_ended(watcher)

    def _pump(self, watcher: Watcher, deadline: float, shape: str, version: str) -> None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            event = watcher.get(min(remaining, 0.5))
            if event is None:
                if watcher.stopped or self._client_gone():
                    return
                continue
            self._write_event(self._render(event, shape, version))

    def _render(self, event: WatchEvent, shape: str, version: str) -> dict[str, Any]:
        if event.type == BOOKMARK:
            obj = {"kind": self.rt.kind, "apiVersion": self.rt.api_version, "metadata": event.object["metadata"]}
            return {"type": BOOKMARK, "object": obj}
        obj = self.out(event.object)
        if shape == "table":
            obj = tables.to_table(self.kind, [obj], str(event.resource_version),
                                  include_object=self.query.get("includeObject", "Metadata"))
            obj["apiVersion"] = f"meta.k8s.io/{version}"
        return {"type": event.type, "object": obj}

    def _client_gone(self) -> bool:
        conn = self.h.connection
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _start_stream(self) -> None:
        self.h.send_response(200)
        self.h.send_header("Content-Type", "application/json")
        self.h.send_header("Transfer-Encoding", "chunked")
        self.h.send_header("Cache-Control", "no-cache, private")
        self.h.end_headers()

    def _write_event(self, event: dict[str, Any]) -> None:
        data = (json.dumps(event) + "\n").encode()
        self.h.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.h.wfile.flush()

    def _end_stream(self) -> None:
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()


class ApiServer:
    """Serves `store` on every listener; `start()` returns once all are accepting."""

    def __init__(
        self,
        store: Store,
        listen: Iterable[Any] = ("127.0.0.1:0",),
        *,
        default_watch_timeout: float = 1800.0,
    ) -> None:
        self.store = store
        self.default_watch_timeout = default_watch_timeout
        self._listen = list(listen)
        self._servers: list[_HTTPServer] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._handlers: dict[threading.Thread, socket.socket] = {}
        self._watchers: set[Watcher] = set()
        self._watch_threads: set[threading.Thread] = set()
        self._watches_done = threading.Condition(self._lock)
        self._stopping = False

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each listener, in the order given (ports resolved if 0 was asked)."""
        return [tuple(s.server_address[:2]) for s in self._servers]  # type: ignore[misc]

    @property
    def url(self) -> str:
        host, port = self.addresses[0]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> "ApiServer":
        sockets: list[socket.socket] = []
        try:
            for item in self._listen:
                if isinstance(item, socket.socket):
                    sockets.append(item)
                else:
                    host, port = parse_host_port(item) if isinstance(item, str) else item
                    sockets.append(bind_socket(host, port))
        except OSError:
            for sock in sockets:
                if sock not in self._listen:
                    sock.close()
            raise
        for sock in sockets:
            server = _HTTPServer(sock, self)
            self._servers.append(server)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name=f"apiserver-{server.server_address[1]}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("apiserver: serving on %s", ", ".join(f"{h}:{p}" for h, p in self.addresses))
        return self

    def stop(self) -> None:
        """Stop accepting, end every watch and connection, and wait for the threads."""
        with self._lock:
            self._stopping = True
            watchers = list(self._watchers)
        for server in self._servers:
            server.shutdown()
        for watcher in watchers:
            watcher.stop("the API server is stopping")
        # Let the watch streams write their final chunk before cutting idle connections.
        with self._watches_done:
            self._watches_done.wait_for(lambda: not self._watch_threads, timeout=2)
            handlers = dict(self._handlers)
        for conn in handlers.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for server in self._servers:
            server.server_close()
        for thread in self._threads + list(handlers):
            thread.join(timeout=5)
        self._servers.clear()
        self._threads.clear()

    def __enter__(self) -> "ApiServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # bookkeeping used by the handlers
    def _track(self, thread: threading.Thread, conn: socket.socket) -> None:
        with self._lock:
            self._handlers = {t: c for t, c in self._handlers.items() if t.is_alive()}
            self._handlers[thread] = conn

    def _watch_started(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.add(watcher)
            self._watch_threads.add(threading.current_thread())
            stopping = self._stopping
        if stopping:
            watcher.stop("the API server is stopping")

    def _watch_ended(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)
            self._watch_threads.discard(threading.current_thread())
            self._watches_done.notify_all()
