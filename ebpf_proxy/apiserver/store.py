"""The object store: etcd's role plus the registry logic of kube-apiserver, for a few kinds.

One lock serialises every write, and one global counter is the resourceVersion of every
object, as in etcd. Each committed write is appended to a bounded history, which lets a
watch resume from any version still in it, lets a paginated or `resourceVersionMatch=Exact`
list see a consistent snapshot, and makes "too old" an honest 410 once the history has moved
on (or `compact()` was called). The HTTP server and in-process users (the lab, its
EndpointSlice controller) share the same Store, so both see exactly the same semantics.

Objects are plain JSON-shaped dicts. The store copies on the way in and out, and never
mutates a committed object (a write replaces it), so history entries and watch events can
be shared between watchers without copying.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import json
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable

from ebpf_proxy.apiserver import kinds as kinds_mod
from ebpf_proxy.apiserver import patch as patch_mod
from ebpf_proxy.apiserver import services, validation
from ebpf_proxy.apiserver.errors import (
    ApiError,
    InvalidFields,
    already_exists,
    bad_request,
    conflict,
    forbidden_request,
    gone,
    invalid_object,
    not_found,
    required,
    timeout,
)
from ebpf_proxy.apiserver.jsontree import clone
from ebpf_proxy.apiserver.selectors import FieldSelector, LabelSelector
from ebpf_proxy.apiserver.watch import ADDED, DELETED, INITIAL_EVENTS_END, MODIFIED, Change, Watcher, WatchEvent

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
PROTECTED_NAMESPACES = ("default", "kube-system", "kube-public")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# Set by the server, never taken from a client's update.
_SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's: no vowels, no look-alikes

def now_rfc3339(offset: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() + offset, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _label_selector(value: Any) -> LabelSelector:
    if value is None:
        return LabelSelector()
    if isinstance(value, LabelSelector):
        return value
    if isinstance(value, dict):
        return LabelSelector.from_map(value)
    return LabelSelector.parse(value)


def _field_selector(value: Any, kind: str) -> FieldSelector:
    if value is None:
        return FieldSelector()
    if isinstance(value, FieldSelector):
        return value
    return FieldSelector.parse(value, kind)


def _parse_rv(value: Any, what: str = "resourceVersion") -> int | None:
    """None for "unset", else a non-negative int; 400 for anything else."""
    if value is None or value == "":
        return None
    try:
        rv = int(value)
    except (TypeError, ValueError):
        raise bad_request(f'{what}: Invalid value: "{value}": must be a resourceVersion returned by this server') from None
    if rv < 0:
        raise bad_request(f'{what}: Invalid value: "{value}": must not be negative')
    return rv


def _canonical(obj: dict[str, Any]) -> dict[str, Any]:
    """apiVersion, kind, metadata first, then the rest (spec, status, ...), as the real server orders them."""
    head = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
    return {**head, **{k: v for k, v in obj.items() if k not in head}}


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@dataclass
class ListPage:
    items: list[dict[str, Any]]
    resource_version: str
    continue_token: str = ""
    remaining: int | None = None


class Store:
    """Thread-safe storage of Services, EndpointSlices, Nodes, Pods, Namespaces and Events.

    Kinds are named by their Kind (`"Service"`, `"EndpointSlice"`, ...). Every method raises
    `ApiError` (the same errors the HTTP API returns) for requests the real server refuses.
    """

    def __init__(
        self,
        *,
        service_cidr: str = "10.96.0.0/12",
        node_port_range: tuple[int, int] = services.DEFAULT_NODE_PORTS,
        history_limit: int = 10000,
        bookmark_interval: float = 1.0,
        watch_queue_limit: int = 10000,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        initial_resource_version: int | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in kinds_mod.STORAGE}
        self._key_order: dict[str, list[tuple[str, str]]] = {}  # _sorted_keys_locked's cache
        self._encoded: dict[tuple[str, str, str], tuple[Any, bytes]] = {}  # encoded()'s cache
        # Start from the clock (ms) unless told otherwise: a restarted lab API server then
        # always issues newer versions than the one before it, so a client resuming with a
        # version from the old instance gets 410 Expired and relists, instead of waiting
        # for versions that this instance will not reach for a long time.
        if initial_resource_version is None:
            initial_resource_version = int(time.time() * 1000)
        self._rv = initial_resource_version
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._compacted_rv = initial_resource_version
        self._watchers: list[Watcher] = []
        self._watch_queue_limit = watch_queue_limit
        self.bookmark_interval = bookmark_interval
        self.services = services.ServiceAllocator(service_cidr, node_port_range)
        self.service_cidr = self.services.service_cidr
        self._graceful: dict[tuple[str, str, str], float] = {}  # (kind, ns, name) -> deadline
        self._wake = threading.Condition(self._lock)
        self._housekeeper: threading.Thread | None = None
        self._closed = False
        for name in namespaces:
            self.create("Namespace", {"metadata": {"name": name}})

    # ---------------------------------------------------------------------------------
    # reads

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any]:
        rt = kinds_mod.storage_type(kind)
        with self._lock:
            obj = self._objects[kind].get(self._key(rt, namespace, name))
            if obj is None:
                raise not_found(rt.plural, name, rt.group)
            return clone(obj)

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        label_selector: Any = None,
        field_selector: Any = None,
        *,
        resource_version: Any = None,
        resource_version_match: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Matching objects sorted by namespace/name, and the list's resourceVersion."""
        page = self.list_page(
            kind, namespace, label_selector, field_selector,
            resource_version=resource_version, resource_version_match=resource_version_match,
        )
        return page.items, page.resource_version

    def list_page(
        self,
        kind: str,
        namespace: str | None = None,
        label_selector: Any = None,
        field_selector: Any = None,
        *,
        resource_version: Any = None,
        resource_version_match: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        copy: bool = True,
    ) -> ListPage:
        """A list with the real server's resourceVersion semantics and `limit`/`continue` paging.

        - unset or "0": the current state;
        - N with `resourceVersionMatch` NotOlderThan: the current state (at least as new as N);
        - N with `resourceVersionMatch` Exact, or a `continue` token: the snapshot at N,
          410 Expired if the history no longer reaches back to N;
        - N without a match: the current state, but 410 Expired when N is older than the
          compacted history (stricter than the real server, so relist-on-410 is testable).

        `copy` False: the items are the stored objects themselves, for a caller that only reads
        them (the HTTP server, which sends `encoded` bytes); never modify them.
        """
        rt = kinds_mod.storage_type(kind)
        labels = _label_selector(label_selector)
        fields = _field_selector(field_selector, kind)
        start_after: tuple[str, str] | None = None
        with self._lock:
            rv = _parse_rv(resource_version)
            snapshot_rv: int | None = None
            if continue_token:
                snapshot_rv, start_after = self._decode_continue(continue_token)
            elif resource_version_match == "Exact":
                if rv is None or rv == 0:
                    raise bad_request('resourceVersionMatch: Forbidden: "Exact" requires a non-zero resourceVersion')
                snapshot_rv = rv
            elif resource_version_match not in (None, "", "NotOlderThan"):
                raise bad_request(
                    f'resourceVersionMatch: Unsupported value: "{resource_version_match}": '
                    'supported values: "Exact", "NotOlderThan"'
                )
            elif rv and resource_version_match != "NotOlderThan" and rv < self._compacted_rv:
                raise gone(f"The resourceVersion for the provided list is too old: {rv} (oldest available {self._compacted_rv}).")
            if rv is not None and rv > self._rv and snapshot_rv is None:
                raise timeout(f"Too large resource version: {rv}, current: {self._rv}")
            if snapshot_rv is not None:
                if snapshot_rv > self._rv:
                    raise timeout(f"Too large resource version: {snapshot_rv}, current: {self._rv}")
                if snapshot_rv < self._compacted_rv:
                    what = "continue parameter" if continue_token else "resourceVersion"
                    raise gone(
                        f"The provided {what} is too old to display a consistent list result "
                        f"({snapshot_rv}, oldest available {self._compacted_rv}); start a new list without it."
                    )
                state, keys_differ = self._snapshot(kind, snapshot_rv)
                keys = sorted(state) if keys_differ else self._sorted_keys_locked(kind)
                list_rv = snapshot_rv
            else:
                state = self._objects[kind]
                keys = self._sorted_keys_locked(kind)
                list_rv = self._rv
            # A page costs its own items, not the collection: the keys are sorted once (cached
            # until one is added or removed), a page starts by bisection and stops when full.
            # Real lists are paged (client-go asks for 500 at a time), so at 100k objects a
            # whole list used to sort and scan the collection 200 times.
            start, stop = 0, len(keys)
            if namespace and rt.namespaced:
                start, stop = bisect.bisect_left(keys, (namespace, "")), bisect.bisect_left(keys, (namespace + "\0", ""))
            if start_after is not None:
                start = max(start, bisect.bisect_right(keys, start_after))
            full = limit + 1 if limit and limit > 0 else None
            items, indices = [], []
            for i in range(start, stop):
                obj = state[keys[i]]
                meta = obj.get("metadata") or {}
                if labels.matches(meta.get("labels")) and fields.matches(obj):
                    items.append(obj)
                    indices.append(i)
                    if len(items) == full:  # one more than the page: there is a next page
                        break
            token, remaining = "", None
            if full is not None and len(items) == full:
                items.pop()
                indices.pop()
                last_index = indices[-1]
                last = items[-1]["metadata"]
                token = self._encode_continue(list_rv, (last.get("namespace", ""), last["name"]))
                # As kube-apiserver: a count only when it is exact, i.e. without selectors.
                if labels.empty() and fields.empty():
                    remaining = stop - last_index - 1
            return ListPage(clone(items) if copy else items, str(list_rv), token, remaining)

    def encoded(self, kind: str, obj: dict[str, Any]) -> bytes:
        """`obj` (a stored object, from list_page(copy=False)) as JSON, encoded once per
        resourceVersion: a stored object is replaced on every change, never changed in place,
        so its version names its bytes. At 100k objects a list is mostly these bytes, joined."""
        meta = obj["metadata"]
        key = (kind, meta.get("namespace", ""), meta["name"])
        rv = meta.get("resourceVersion")
        hit = self._encoded.get(key)
        if hit is not None and hit[0] == rv:
            return hit[1]
        data = json.dumps(obj, separators=(",", ":")).encode()
        self._encoded[key] = (rv, data)
        return data

    @staticmethod
    def _encode_continue(rv: int, after: tuple[str, str]) -> str:
        raw = json.dumps({"v": "epx/1", "rv": rv, "after": list(after)}).encode()
        return base64.urlsafe_b64encode(raw).decode()

    @staticmethod
    def _decode_continue(token: str) -> tuple[int, tuple[str, str]]:
        try:
            data = json.loads(base64.urlsafe_b64decode(token.encode()))
            return int(data["rv"]), (str(data["after"][0]), str(data["after"][1]))
        except (ValueError, KeyError, IndexError, TypeError, binascii.Error):
            raise bad_request(f"continue key is not valid: {token!r} was not issued by this server") from None

    def _snapshot(self, kind: str, rv: int) -> tuple[dict[tuple[str, str], dict[str, Any]], bool]:
        """The objects of `kind` as they were at `rv`, by undoing later history, and whether
        their keys differ from today's (an object was added or removed since). Read-only: with no
        change since, it is the live collection itself (each page of a list asks, uncopied)."""
        later = []
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.kind == kind:
                later.append(change)
        if not later:
            return self._objects[kind], False
        state = dict(self._objects[kind])
        keys_differ = False
        for change in later:
            meta = change.object["metadata"]
            key = (meta.get("namespace", ""), meta["name"])
            if change.type == ADDED:
                state.pop(key, None)
                keys_differ = True
            elif change.prev is not None:
                keys_differ = keys_differ or key not in state
                state[key] = change.prev
        return state, keys_differ

    def _sorted_keys_locked(self, kind: str) -> list[tuple[str, str]]:
        """The keys of `kind` in list order, sorted once per set of keys (not per page)."""
        keys = self._key_order.get(kind)
        if keys is None:
            keys = self._key_order[kind] = sorted(self._objects[kind])
        return keys

    # ---------------------------------------------------------------------------------
    # writes

    def create(
        self, kind: str, obj: dict[str, Any], *, namespace: str | None = None, dry_run: bool = False
    ) -> dict[str, Any]:
        """Create `obj` (defaulted, validated, allocated); returns the stored object."""
        rt = kinds_mod.storage_type(kind)
        obj = clone(obj)
        if not isinstance(obj, dict):
            raise bad_request(f"a {kind} must be a JSON object")
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise bad_request(f"{kind} metadata must be an object")
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        if rt.namespaced:
            body_ns = meta.get("namespace")
            if namespace and body_ns and body_ns != namespace:
                raise bad_request(
                    f"the namespace of the provided object ({body_ns}) does not match the namespace sent on the request ({namespace})"
                )
            meta["namespace"] = namespace or body_ns or "default"
        else:
            meta.pop("namespace", None)
        for field in ("resourceVersion", "uid", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"):
            meta.pop(field, None)
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = self._generate_name(kind, meta.get("namespace", ""), str(meta["generateName"]))
            errs = validation.validate_metadata(kind, meta)
            if errs:
                raise invalid_object(rt.kind, str(meta.get("name") or meta.get("generateName") or ""), errs, rt.group)
            name = meta["name"]
            ns = meta.get("namespace", "")
            if rt.namespaced and ("", ns) not in self._objects["Namespace"]:
                raise not_found("namespaces", ns)
            key = (ns, name)
            if key in self._objects[kind]:
                raise already_exists(rt.plural, name, rt.group)
            txn = self._prepare(rt, obj, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            obj = _canonical(obj)
            if dry_run:
                if txn:
                    txn.rollback()
                return obj
            self._objects[kind][key] = obj
            self._key_order.pop(kind, None)
            if txn:
                txn.commit()
            self._commit(ADDED, kind, obj, None)
            return clone(obj)

    def update(
        self,
        kind: str,
        obj: dict[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Replace an object (PUT). With `subresource="status"` only its status changes;
        otherwise its status is kept (for kinds with a status subresource), like the real server.
        A `metadata.resourceVersion` in `obj` is a precondition (409 Conflict if stale)."""
        rt = kinds_mod.storage_type(kind)
        new = clone(obj)
        meta = new.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise invalid_object(rt.kind, "", [required("metadata.name")], rt.group)
        ns = (namespace or meta.get("namespace") or "default") if rt.namespaced else None
        if rt.namespaced and namespace and meta.get("namespace") and meta["namespace"] != namespace:
            raise bad_request(
                f"the namespace of the provided object ({meta['namespace']}) does not match the namespace sent on the request ({namespace})"
            )
        with self._lock:
            old = self._objects[kind].get(self._key(rt, ns, name))
            if old is None:
                raise not_found(rt.plural, name, rt.group)
            return self._update_locked(rt, new, old, subresource, dry_run)

    def update_status(self, kind: str, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        return self.update(kind, obj, subresource="status", dry_run=dry_run)

    def patch(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        body: Any,
        patch_type: str = patch_mod.MERGE,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """PATCH with a merge, strategic-merge (treated as merge) or JSON patch body."""
        return self.mutate(kind, namespace, name, lambda cur: patch_mod.apply(patch_type, cur, body, kind),
                           subresource=subresource, dry_run=dry_run)

    def mutate(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        fn: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Atomically read-modify-write: `fn` gets a private copy and returns the new object."""
        rt = kinds_mod.storage_type(kind)
        with self._lock:
            old = self._objects[kind].get(self._key(rt, namespace, name))
            if old is None:
                raise not_found(rt.plural, name, rt.group)
            new = fn(clone(old))
            new_meta = new.get("metadata") or {}
            if new_meta.get("name", name) != name or (rt.namespaced and new_meta.get("namespace", namespace) != namespace):
                raise bad_request(f"metadata.name and metadata.namespace of {rt.plural} {name!r} cannot be changed")
            return self._update_locked(rt, new, old, subresource, dry_run)

    def delete(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        grace_period_seconds: int | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Delete an object; returns it as it was last stored.

        Pods deleted with `grace_period_seconds > 0`, and objects with finalizers, are only
        marked (`metadata.deletionTimestamp`, a MODIFIED event). A marked Pod goes away when
        its grace period ends or on a second delete with grace 0, as when a kubelet confirms
        the containers stopped. Deleting a namespace deletes everything in it.
        """
        rt = kinds_mod.storage_type(kind)
        with self._lock:
            key = self._key(rt, namespace, name)
            old = self._objects[kind].get(key)
            if old is None:
                raise not_found(rt.plural, name, rt.group)
            meta = old["metadata"]
            if uid and uid != meta["uid"]:
                raise conflict(rt.plural, name, f"Precondition failed: UID in precondition: {uid}, UID in object meta: {meta['uid']}", rt.group)
            if resource_version and resource_version != meta["resourceVersion"]:
                raise conflict(
                    rt.plural, name,
                    f"Precondition failed: ResourceVersion in precondition: {resource_version}, "
                    f"ResourceVersion in object meta: {meta['resourceVersion']}", rt.group,
                )
            if kind == "Namespace" and name in PROTECTED_NAMESPACES:
                raise forbidden_request(f'namespaces "{name}" is forbidden: this namespace may not be deleted', "namespaces", name)
            grace = grace_period_seconds if kind == "Pod" and grace_period_seconds and grace_period_seconds > 0 else 0
            return self._mark_deleting(rt, key, old, grace, dry_run)

    def delete_collection(
        self, kind: str, namespace: str | None = None, label_selector: Any = None, field_selector: Any = None
    ) -> list[dict[str, Any]]:
        rt = kinds_mod.storage_type(kind)
        with self._lock:
            items, _ = self.list(kind, namespace, label_selector, field_selector)
            return [self.delete(kind, it["metadata"].get("namespace") if rt.namespaced else None, it["metadata"]["name"]) for it in items]

    # ---------------------------------------------------------------------------------
    # watch

    def watch(
        self,
        kinds: str | Iterable[str],
        *,
        namespace: str | None = None,
        resource_version: Any = None,
        label_selector: Any = None,
        field_selector: Any = None,
        allow_bookmarks: bool = False,
        send_initial_events: bool | None = None,
    ) -> Watcher:
        """Start a watch of one kind (or several, for in-process controllers).

        With `resource_version` unset or "0" (and `send_initial_events` not False) the watch
        starts with an ADDED event per existing object; with `send_initial_events=True` those
        are followed by a BOOKMARK annotated `k8s.io/initial-events-end`. With a version N it
        replays every change after N, or raises 410 Expired if the history no longer has them
        (504 Timeout if N is newer than anything this store has issued).
        """
        names = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        if not names:
            raise ValueError("watch needs at least one kind")
        for kind in names:
            kinds_mod.storage_type(kind)
        fields = _field_selector(field_selector, names[0])
        labels = _label_selector(label_selector)
        with self._lock:
            if self._closed:
                raise ApiError(503, "ServiceUnavailable", "the API server is shutting down")
            rv = _parse_rv(resource_version)
            watcher = Watcher(
                names, namespace=namespace, label_selector=labels, field_selector=fields,
                bookmarks=allow_bookmarks, queue_limit=self._watch_queue_limit, on_stop=self._unregister,
            )
            if send_initial_events or (send_initial_events is None and not rv):
                for kind in names:
                    for obj in sorted(self._objects[kind].values(), key=lambda o: int(o["metadata"]["resourceVersion"])):
                        if watcher.matches(kind, obj):
                            watcher.offer(_initial(kind, obj))
                if send_initial_events:
                    watcher.bookmark(self._rv, {INITIAL_EVENTS_END: "true"})
            elif rv:
                if rv < self._compacted_rv:
                    raise gone(f"too old resource version: {rv} ({self._compacted_rv})")
                if rv > self._rv:
                    raise timeout(f"Too large resource version: {rv}, current: {self._rv}")
                for change in self._history:
                    if change.rv > rv:
                        event = watcher.translate(change)
                        if event is not None:
                            watcher.offer(event)
            self._watchers.append(watcher)
            if allow_bookmarks:
                self._ensure_housekeeper()
            return watcher

    def _unregister(self, watcher: Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def compact(self) -> str:
        """Forget all history up to now: watches and exact lists from older versions get 410."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv
            return str(self._rv)

    def _committed(self) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
        """The current resourceVersion and every stored object with its kind, taken at once.

        Committed objects are never mutated (a write replaces them), so the list can be
        serialised after the lock is released without a deep copy."""
        with self._lock:
            return str(self._rv), [(kind, obj) for kind in self._objects for obj in self._objects[kind].values()]

    def export_objects(self) -> tuple[str, list[dict[str, Any]]]:
        """The current resourceVersion and every stored object (see _committed)."""
        rv, pairs = self._committed()
        return rv, [obj for _kind, obj in pairs]

    def export_encoded(self) -> tuple[str, list[bytes]]:
        """export_objects(), each object as its JSON (encoded(): made once per version), for
        persist.py."""
        rv, pairs = self._committed()
        return rv, [self.encoded(kind, obj) for kind, obj in pairs]

    def restore_objects(self, objects: Iterable[dict[str, Any]]) -> None:
        """Replace the stored objects by `objects` (a persisted state), as an etcd restore does.

        Objects keep their uid, timestamps and resourceVersion; no watch event is sent (call
        before anyone watches) and the history stays empty, so a client resuming from a version
        of the old instance gets 410 Expired and relists. Service clusterIPs and nodePorts are
        claimed again; a pod whose graceful deletion was under way finishes it when its time is up.
        Raises ValueError naming the object when one cannot be restored."""
        with self._lock:
            fresh: dict[str, dict[tuple[str, str], dict[str, Any]]] = {k: {} for k in kinds_mod.STORAGE}
            allocator = services.ServiceAllocator(str(self.service_cidr), self.services.node_port_range)
            for i, obj in enumerate(objects):
                kind = obj.get("kind") if isinstance(obj, dict) else None
                meta = obj.get("metadata") if isinstance(obj, dict) else None
                if kind not in fresh or not isinstance(meta, dict) or not meta.get("name"):
                    raise ValueError(f"objects[{i}]: not a stored object (kind {kind!r} and metadata.name needed)")
                rt = kinds_mod.storage_type(kind)
                key = self._key(rt, meta.get("namespace"), meta["name"])
                where = f"objects[{i}] ({kind} {'/'.join(k for k in key if k)})"
                if key in fresh[kind]:
                    raise ValueError(f"{where}: stored twice")
                if kind == "Service":
                    try:
                        allocator.restore(obj)
                    except InvalidFields as exc:
                        raise ValueError(f"{where}: {exc}") from None
                fresh[kind][key] = obj
            self._objects = fresh
            self._key_order.clear()
            self._encoded.clear()
            self.services = allocator
            self._graceful.clear()
            for (ns, name), pod in fresh["Pod"].items():
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                if pod["metadata"].get("deletionTimestamp") and grace:
                    left = _seconds_until(pod["metadata"]["deletionTimestamp"])
                    self._graceful[("Pod", ns, name)] = time.monotonic() + max(0.0, left)
            if self._graceful:
                self._ensure_housekeeper()
                self._wake.notify_all()

    @property
    def compacted_resource_version(self) -> str:
        with self._lock:
            return str(self._compacted_rv)

    def close(self) -> None:
        """Stop every watch and the housekeeping thread; the store stays readable."""
        with self._lock:
            self._closed = True
            watchers, self._watchers = self._watchers, []
            self._wake.notify_all()
            thread = self._housekeeper
        for watcher in watchers:
            watcher.stop("the API server is shutting down")
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # ---------------------------------------------------------------------------------
    # internals (call with the lock held)

    def _key(self, rt: kinds_mod.ResourceType, namespace: str | None, name: str) -> tuple[str, str]:
        return ((namespace or "default") if rt.namespaced else "", name)

    def _generate_name(self, kind: str, namespace: str, prefix: str) -> str:
        prefix = prefix[:58]
        for _ in range(100):
            name = prefix + "".join(random.choice(_GENERATE_ALPHABET) for _ in range(5))
            if (namespace, name) not in self._objects[kind]:
                return name
        raise ApiError(500, "InternalError", f"could not generate a unique name from generateName {prefix!r}")

    def _prepare(self, rt: kinds_mod.ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> services.Transaction | None:
        """Kind-specific defaulting and validation; a Transaction when values were allocated."""
        name = obj["metadata"].get("name", "")
        try:
            if rt.kind == "Service":
                return self.services.prepare_create(obj) if old is None else self.services.prepare_update(obj, old)
            errs = []
            if rt.kind == "EndpointSlice":
                errs = validation.validate_endpoint_slice(obj)
            elif rt.kind == "Pod":
                validation.default_pod(obj)
                errs = validation.validate_pod(obj)
            elif rt.kind == "Event":
                errs = validation.validate_event(obj)
            elif rt.kind == "Namespace":
                validation.default_namespace(obj)
                obj["metadata"].setdefault("labels", {})[NAMESPACE_NAME_LABEL] = name
            if errs:
                raise InvalidFields(errs)
        except InvalidFields as exc:
            raise invalid_object(rt.kind, name, exc.errors, rt.group) from None
        return None

    def _update_locked(
        self,
        rt: kinds_mod.ResourceType,
        new: dict[str, Any],
        old: dict[str, Any],
        subresource: str | None,
        dry_run: bool,
    ) -> dict[str, Any]:
        name = old["metadata"]["name"]
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            raise bad_request(f"{rt.kind} {name!r}: metadata must be an object")
        want_rv = meta.get("resourceVersion")
        if want_rv and str(want_rv) != old["metadata"]["resourceVersion"]:
            raise conflict(rt.plural, name, "the object has been modified; please apply your changes to the latest version and try again", rt.group)
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            raise conflict(rt.plural, name, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: {old['metadata']['uid']}", rt.group)
        if subresource and (subresource != "status" or not rt.status_subresource):
            raise not_found(f"{rt.plural}/{subresource}", name, rt.group)
        if subresource == "status":
            candidate = clone(old)
            if "status" in new:
                candidate["status"] = clone(new["status"])
            else:
                candidate.pop("status", None)
        else:
            candidate = new
            if rt.status_subresource:
                if "status" in old:
                    candidate["status"] = clone(old["status"])
                else:
                    candidate.pop("status", None)
        cmeta = candidate["metadata"]
        for field in ("managedFields", "selfLink"):
            cmeta.pop(field, None)
        for field in _SERVER_META + ("name", "namespace"):
            if field in old["metadata"]:
                cmeta[field] = old["metadata"][field]
            else:
                cmeta.pop(field, None)
        candidate["apiVersion"], candidate["kind"] = rt.api_version, rt.kind
        errs = validation.validate_metadata(rt.kind, cmeta)
        if subresource == "status" and rt.kind == "Service":
            errs += services.validate_status(candidate)
        if errs:
            raise invalid_object(rt.kind, name, errs, rt.group)
        txn = None if subresource == "status" else self._prepare(rt, candidate, old)
        if _spec_part(candidate) != _spec_part(old):
            cmeta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        cmeta["resourceVersion"] = old["metadata"]["resourceVersion"]
        candidate = _canonical(candidate)
        if candidate == old or dry_run:
            if txn:
                txn.rollback()
            return clone(candidate)
        key = self._key(rt, cmeta.get("namespace"), name)
        self._objects[rt.kind][key] = candidate
        if txn:
            txn.commit()
        self._commit(MODIFIED, rt.kind, candidate, old)
        if self._deletion_complete(rt, candidate):
            self._remove_locked(rt, key)
        return clone(candidate)

    def _deletion_complete(self, rt: kinds_mod.ResourceType, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return False
        return rt.kind != "Pod" or not meta.get("deletionGracePeriodSeconds")

    def _mark_deleting(
        self, rt: kinds_mod.ResourceType, key: tuple[str, str], old: dict[str, Any], grace: int, dry_run: bool
    ) -> dict[str, Any]:
        """Start (or shorten) a graceful deletion; remove at once when nothing holds it back."""
        meta = old["metadata"]
        if meta.get("deletionTimestamp") and grace >= int(meta.get("deletionGracePeriodSeconds") or 0):
            return clone(old)  # already terminating at least this soon
        if grace == 0 and not meta.get("finalizers"):
            return clone(old) if dry_run else self._remove_locked(rt, key)
        new = clone(old)
        new["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        if dry_run:
            return new
        self._objects[rt.kind][key] = new
        self._commit(MODIFIED, rt.kind, new, old)
        gkey = (rt.kind, key[0], key[1])
        if grace:
            self._graceful[gkey] = time.monotonic() + grace
            self._ensure_housekeeper()
            self._wake.notify_all()
        else:
            self._graceful.pop(gkey, None)
        return clone(new)

    def _remove_locked(self, rt: kinds_mod.ResourceType, key: tuple[str, str]) -> dict[str, Any]:
        old = self._objects[rt.kind].pop(key)
        self._key_order.pop(rt.kind, None)
        self._encoded.pop((rt.kind, key[0], key[1]), None)
        self._graceful.pop((rt.kind, key[0], key[1]), None)
        if rt.kind == "Service":
            self.services.release(old)
        if rt.kind == "Namespace":
            ns = old["metadata"]["name"]
            for kind, objects in self._objects.items():
                if kinds_mod.storage_type(kind).namespaced:
                    for okey in [k for k in objects if k[0] == ns]:
                        self._remove_locked(kinds_mod.storage_type(kind), okey)
        gone_obj = clone(old)
        self._commit(DELETED, rt.kind, gone_obj, old)
        return clone(gone_obj)

    def _commit(self, change_type: str, kind: str, obj: dict[str, Any], prev: dict[str, Any] | None) -> int:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        change = Change(self._rv, change_type, kind, obj, prev)
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self._compacted_rv = self._history.popleft().rv
        live = []
        for watcher in self._watchers:
            if watcher.stopping:
                continue
            event = watcher.translate(change)
            if event is not None:
                watcher.offer(event)
            live.append(watcher)
        self._watchers = live
        return self._rv

    def _ensure_housekeeper(self) -> None:
        if self._housekeeper is None and not self._closed:
            self._housekeeper = threading.Thread(target=self._housekeep, name="apiserver-housekeeper", daemon=True)
            self._housekeeper.start()

    def _housekeep(self) -> None:
        """Send periodic BOOKMARKs and finish graceful pod deletions whose time is up."""
        next_bookmark = time.monotonic() + self.bookmark_interval
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                if now >= next_bookmark:
                    for watcher in self._watchers:
                        if watcher.bookmarks and not watcher.stopping:
                            watcher.bookmark(self._rv)
                    next_bookmark = now + self.bookmark_interval
                for gkey, deadline in list(self._graceful.items()):
                    if deadline <= now:
                        kind, ns, name = gkey
                        self._graceful.pop(gkey, None)
                        obj = self._objects[kind].get((ns, name))
                        if obj is not None:
                            self._mark_deleting(kinds_mod.storage_type(kind), (ns, name), obj, 0, False)
                deadlines = [next_bookmark] + list(self._graceful.values())
                self._wake.wait(max(0.01, min(deadlines) - time.monotonic()))


def _seconds_until(rfc3339: str) -> float:
    """Seconds from now until an RFC 3339 timestamp as the store writes them (0 if unreadable)."""
    try:
        when = datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        return 0.0
    return when.timestamp() - time.time()


def _initial(kind: str, obj: dict[str, Any]) -> WatchEvent:
    return WatchEvent(ADDED, kind, obj, int(obj["metadata"]["resourceVersion"]))
