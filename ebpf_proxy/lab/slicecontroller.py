"""The lab's EndpointSlice controller: kube-controller-manager's job, in-process on the Store.

The proxy under test consumes EndpointSlices, never Pods; in a real cluster something turns
Pods into slices. This controller does that the way the real one does
(`pkg/controller/endpointslice`), so the lab exercises the proxy with realistic slices:

- only Services with a non-empty selector and a type other than ExternalName get managed
  slices; slices of selector-less Services are the user's and are never touched;
- slices come per address type, one set for each of the Service's `ipFamilies` (IPv4 when it
  has none), as upstream's reconcileByAddressType: a dual-stack Service gets IPv4 slices and
  `addressType: IPv6` slices; slices of a family the Service dropped are deleted;
- each matching Pod with an address of the slice's family becomes one endpoint: `serving` is the Pod's Ready
  condition (a Pod without any conditions counts as ready, a lab convenience), `terminating`
  is set once the Pod has a deletionTimestamp, and `ready` is `serving and not terminating`
  (or always true with `publishNotReadyAddresses`); Pods that have finished (Succeeded/Failed)
  are left out;
- a named `targetPort` is resolved per Pod from its containers' named ports; Pods that resolve
  to different port numbers land in different slices, as upstream;
- a Service without endpoints keeps one empty placeholder slice;
- a slice is written only when its content changes, so consumers see no spurious updates;
- each endpoint carries its node's zone (label topology.kubernetes.io/zone), and topology hints
  as the real controller writes them for `trafficDistribution` and the topology-mode annotation
  (topologyhints.py); Node changes that matter to hints (zone, CPU, readiness) reconcile every
  managed Service.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from typing import Any, Mapping

from ebpf_proxy.apiserver.errors import ApiError
from ebpf_proxy.apiserver.selectors import LabelSelector
from ebpf_proxy.apiserver.store import Store
from ebpf_proxy.apiserver.watch import DELETED, Watcher, WatchEvent
from ebpf_proxy.lab.topologyhints import NodeInfo, add_hints, node_info

log = logging.getLogger("ebpf_proxy.lab.slicecontroller")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "endpointslice-controller.k8s.io"
HEADLESS_LABEL = "service.kubernetes.io/headless"
MAX_ENDPOINTS_PER_SLICE = 100

ServiceKey = tuple[str, str]  # (namespace, name)


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions")
    if not conditions:
        return True
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_ip(pod: dict[str, Any], family: str = "IPv4") -> str | None:
    """The Pod's address of `family` ("IPv4"/"IPv6") from status.podIPs (or podIP), else None."""
    status = pod.get("status") or {}
    candidates = [p.get("ip") for p in status.get("podIPs") or [] if isinstance(p, dict)] + [status.get("podIP")]
    for ip in candidates:
        if not ip:
            continue
        try:
            if f"IPv{ipaddress.ip_address(ip).version}" == family:
                return ip
        except ValueError:
            continue
    return None


def pod_ipv4(pod: dict[str, Any]) -> str | None:
    return pod_ip(pod, "IPv4")


def address_types(svc: dict[str, Any]) -> list[str]:
    """getAddressTypesForService: the Service's ipFamilies; IPv4 for one without (an old object)."""
    families = [f for f in (svc.get("spec") or {}).get("ipFamilies") or [] if f in ("IPv4", "IPv6")]
    return families or ["IPv4"]


def resolve_target_port(service_port: dict[str, Any], pod: dict[str, Any]) -> int | None:
    """The Pod-side port number of a Service port; None if a named port is not on the Pod."""
    target = service_port.get("targetPort", service_port.get("port"))
    if isinstance(target, int) and not isinstance(target, bool):
        return target
    protocol = service_port.get("protocol", "TCP")
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == protocol:
                return port.get("containerPort")
    return None


def _endpoint(svc: dict[str, Any], pod: dict[str, Any], ip: str, nodes: Mapping[str, NodeInfo]) -> dict[str, Any]:
    meta, spec = pod["metadata"], pod.get("spec") or {}
    serving = pod_ready(pod)
    terminating = bool(meta.get("deletionTimestamp"))
    ready = bool((svc.get("spec") or {}).get("publishNotReadyAddresses")) or (serving and not terminating)
    endpoint: dict[str, Any] = {
        "addresses": [ip],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "targetRef": {"kind": "Pod", "namespace": meta.get("namespace", ""), "name": meta["name"], "uid": meta.get("uid", "")},
    }
    if spec.get("nodeName"):
        endpoint["nodeName"] = spec["nodeName"]
        zone = nodes[spec["nodeName"]].zone if spec["nodeName"] in nodes else ""
        if zone:
            endpoint["zone"] = zone
    if spec.get("hostname") and spec.get("subdomain") == svc["metadata"]["name"]:
        endpoint["hostname"] = spec["hostname"]
    return endpoint


def desired_slices(svc: dict[str, Any], pods: list[dict[str, Any]], max_per_slice: int = MAX_ENDPOINTS_PER_SLICE,
                   nodes: Mapping[str, NodeInfo] | None = None,
                   family: str = "IPv4") -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """(ports, endpoints) of every slice of address type `family` that `svc` should have, given
    the Pods its selector matches and the Nodes (by name) they run on."""
    nodes = nodes or {}
    groups: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        ip = pod_ip(pod, family)
        if ip is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        ports = []
        for sp in (svc.get("spec") or {}).get("ports") or []:
            number = resolve_target_port(sp, pod)
            if number is None:
                continue
            port = {"name": sp.get("name", ""), "port": number, "protocol": sp.get("protocol", "TCP")}
            if sp.get("appProtocol"):
                port["appProtocol"] = sp["appProtocol"]
            ports.append(port)
        key = json.dumps(ports, sort_keys=True)
        groups.setdefault(key, (ports, []))[1].append(_endpoint(svc, pod, ip, nodes))
    if not groups:
        return [([], [])]
    add_hints(svc, [ep for _, eps in groups.values() for ep in eps], nodes)
    slices = []
    for ports, endpoints in groups.values():
        for i in range(0, len(endpoints), max_per_slice):
            slices.append((ports, endpoints[i : i + max_per_slice]))
    return slices


def _slice_labels(svc: dict[str, Any]) -> dict[str, str]:
    labels = dict(svc["metadata"].get("labels") or {})
    labels[SERVICE_NAME_LABEL] = svc["metadata"]["name"]
    labels[MANAGED_BY_LABEL] = MANAGED_BY
    if (svc.get("spec") or {}).get("clusterIP") == "None":
        labels[HEADLESS_LABEL] = ""
    return labels


def _owner(svc: dict[str, Any]) -> list[dict[str, Any]]:
    meta = svc["metadata"]
    return [{"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta["uid"],
             "controller": True, "blockOwnerDeletion": True}]


def _content(slice_: dict[str, Any]) -> tuple[Any, ...]:
    meta = slice_["metadata"]
    return (meta.get("labels") or {}, meta.get("ownerReferences") or [], slice_.get("addressType"),
            slice_.get("endpoints") or [], slice_.get("ports") or [])


class EndpointSliceController:
    """Keeps managed EndpointSlices in step with Services and Pods; runs one worker thread."""

    def __init__(self, store: Store, *, max_endpoints_per_slice: int = MAX_ENDPOINTS_PER_SLICE) -> None:
        self.store = store
        self.max_endpoints_per_slice = max_endpoints_per_slice
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: Watcher | None = None
        self._cond = threading.Condition()
        self._handled_rv = 0
        self._synced = False
        self._pod_labels: dict[tuple[str, str], dict[str, str]] = {}
        self._nodes: dict[str, NodeInfo] = {}  # what endpoint zones and hints need, by node name
        self._retry: set[ServiceKey] = set()
        # Services that may have managed slices: a selector-less Service not in here needs no
        # work, and asking the store would scan every slice (10,000 Services created at once
        # then cost O(N^2) and kept the API server busy for minutes after the bench's installs)
        self._with_slices: set[ServiceKey] = set()
        self.writes = 0  # slices created, updated or deleted (tests check "no spurious writes")

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "EndpointSliceController":
        self._thread = threading.Thread(target=self._run, name="endpointslice-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.stop("the controller is stopping")
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_synced(self, timeout: float = 10.0) -> bool:
        """True once every Service/Pod change made before this call has been handled."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                watcher = self._watcher
                target = watcher.last_offered_rv if watcher is not None else None
                if self._synced and watcher is not None and self._handled_rv >= (target or 0) and not self._retry:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))

    # -- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self._watch_and_handle()
                backoff = 0.1
            except Exception:  # noqa: BLE001 - keep the lab's controller alive, like a real one
                log.exception("endpointslice controller: resyncing after an error")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _watch_and_handle(self) -> None:
        # Watch from "now" first, then read everything: no change can fall between the two.
        watcher = self.store.watch(("Service", "Pod", "Node"), send_initial_events=False)
        with self._cond:
            self._watcher = watcher
            self._synced = False
        try:
            self._sync_all()
            with self._cond:
                self._synced = True
                self._cond.notify_all()
            while not self._stop.is_set():
                event = watcher.get(timeout=0.5 if self._retry else 1.0)
                if event is None:
                    if watcher.stopped:
                        return  # dropped (fell behind): resync from scratch
                    self._retry_failed()
                    continue
                for key in self._affected(event):
                    self._reconcile_safely(key)
                with self._cond:
                    self._handled_rv = event.resource_version
                    self._cond.notify_all()
        finally:
            watcher.stop("the controller restarts its watch")

    def _sync_all(self) -> None:
        nodes, _ = self.store.list("Node")
        self._nodes = {n["metadata"]["name"]: node_info(n) for n in nodes}
        pods, _ = self.store.list("Pod")
        self._pod_labels = {(p["metadata"]["namespace"], p["metadata"]["name"]): p["metadata"].get("labels") or {} for p in pods}
        services, _ = self.store.list("Service")
        keys = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in services}
        slices, _ = self.store.list("EndpointSlice", label_selector={MANAGED_BY_LABEL: MANAGED_BY})
        self._with_slices = {(s["metadata"]["namespace"], s["metadata"]["labels"].get(SERVICE_NAME_LABEL, ""))
                             for s in slices}
        keys |= self._with_slices
        for key in sorted(keys):
            self._reconcile_safely(key)

    def _affected(self, event: WatchEvent) -> set[ServiceKey]:
        meta = event.object["metadata"]
        ns, name = meta.get("namespace", ""), meta["name"]
        if event.kind == "Service":
            return {(ns, name)}
        if event.kind == "Node":
            return self._node_changed(name, None if event.type == DELETED else node_info(event.object))
        old_labels = self._pod_labels.get((ns, name), {})
        new_labels = meta.get("labels") or {}
        if event.type == DELETED:
            self._pod_labels.pop((ns, name), None)
        else:
            self._pod_labels[(ns, name)] = new_labels
        services, _ = self.store.list("Service", ns)
        affected = set()
        for svc in services:
            selector = (svc.get("spec") or {}).get("selector")
            if selector:
                sel = LabelSelector.from_map(selector)
                if sel.matches(old_labels) or sel.matches(new_labels):
                    affected.add((ns, svc["metadata"]["name"]))
        return affected

    def _node_changed(self, name: str, info: NodeInfo | None) -> set[ServiceKey]:
        """Every managed Service, if what hints read from this Node changed (rare: a node's zone,
        CPU or readiness); nothing for the other Node updates."""
        if self._nodes.get(name) == info:
            return set()
        if info is None:
            self._nodes.pop(name, None)
        else:
            self._nodes[name] = info
        return set(self._with_slices)

    def _retry_failed(self) -> None:
        keys, self._retry = self._retry, set()
        for key in keys:
            self._reconcile_safely(key)
        with self._cond:
            self._cond.notify_all()

    def _reconcile_safely(self, key: ServiceKey) -> None:
        try:
            self.reconcile(*key)
            self._retry.discard(key)
        except ApiError as exc:
            log.warning("endpointslice controller: %s/%s: %s (will retry)", key[0], key[1], exc.message)
            self._retry.add(key)

    # -- reconciling one Service -----------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        """Make the managed slices of Service namespace/name what its Pods say they should be."""
        try:
            svc: dict[str, Any] | None = self.store.get("Service", namespace, name)
        except ApiError as exc:
            if exc.code != 404:
                raise
            svc = None
        spec = (svc or {}).get("spec") or {}
        unmanaged = svc is None or not spec.get("selector") or spec.get("type") == "ExternalName"
        if unmanaged and (namespace, name) not in self._with_slices:
            return
        self._with_slices.add((namespace, name))
        existing, _ = self.store.list(
            "EndpointSlice", namespace, label_selector={SERVICE_NAME_LABEL: name, MANAGED_BY_LABEL: MANAGED_BY}
        )
        if unmanaged:
            for slice_ in existing:
                self._delete(slice_)
            self._with_slices.discard((namespace, name))
            return
        pods, _ = self.store.list("Pod", namespace, label_selector=spec["selector"])
        families = address_types(svc)
        for family in families:
            mine = [s for s in existing if s.get("addressType") == family]
            self._reconcile_family(svc, family, pods, mine)
        for slice_ in existing:  # address types the Service no longer has
            if slice_.get("addressType") not in families:
                self._delete(slice_)

    def _reconcile_family(self, svc: dict[str, Any], family: str, pods: list[dict[str, Any]],
                          existing: list[dict[str, Any]]) -> None:
        namespace, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        wanted = desired_slices(svc, pods, self.max_endpoints_per_slice, self._nodes, family)
        unused = list(existing)
        for ports, endpoints in wanted:
            match = next((s for s in unused if (s.get("ports") or []) == ports), None) or (unused[0] if unused else None)
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"namespace": namespace, "labels": _slice_labels(svc), "ownerReferences": _owner(svc)},
                "addressType": family,
                "endpoints": endpoints,
                "ports": ports,
            }
            if match is None:
                body["metadata"]["generateName"] = f"{name[:57]}-"
                self.store.create("EndpointSlice", body)
                self.writes += 1
                continue
            unused.remove(match)
            body["metadata"]["name"] = match["metadata"]["name"]
            body["metadata"]["resourceVersion"] = match["metadata"]["resourceVersion"]
            if _content(body) != _content(match):
                self.store.update("EndpointSlice", body)
                self.writes += 1
        for slice_ in unused:
            self._delete(slice_)

    def _delete(self, slice_: dict[str, Any]) -> None:
        meta = slice_["metadata"]
        try:
            self.store.delete("EndpointSlice", meta["namespace"], meta["name"], uid=meta["uid"])
            self.writes += 1
        except ApiError as exc:
            if exc.code != 404:
                raise
