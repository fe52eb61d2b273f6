"""The bench's Services: the few it measures, and as many fillers as the size asks for.

Fillers are selector-less ClusterIP Services with hand-written EndpointSlices, so no controller
stands between the bench and the agents: 10,000 Services × 2 endpoints install at the speed of
the API server, and a "change" is exactly one slice write. Their endpoints are distinct addresses
from a phantom range (no pod has them; no traffic goes to them): every endpoint is a real entry
in the datapath (a KUBE-SEP chain, a backend map entry), never deduplicated with another. A
change moves one endpoint to an address never used before, so "the kernel has it" can only mean
"the kernel has this change".

The measured Services point at the backend pods on the port of the mode being measured
(`point_at_mode`), see ports.py for why each mode has its own.
"""

from __future__ import annotations

import copy
import ipaddress
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.rest import Rest, RestError
from ebpf_proxy.lab.topology import Topology

NAMESPACE = "default"
ROLE_LABEL = "bench.ebpf-proxy.io/role"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "bench.ebpf-proxy.io"
FILLER_PREFIX = "bench-f"

# Endpoint addresses nobody owns (shared address space, RFC 6598), 2 million in each range.
FILLER_RANGE = ipaddress.IPv4Network("100.64.0.0/11")
CHURN_RANGE = ipaddress.IPv4Network("100.96.0.0/11")


def filler_name(index: int) -> str:
    return f"{FILLER_PREFIX}{index:05d}"


def slice_name(service: str) -> str:
    return f"{service}-bench"


def range_address(network: ipaddress.IPv4Network, seq: int) -> str:
    """The seq-th host address of `network`; ValueError past its end (never reuse an address)."""
    hosts = network.num_addresses - 2
    if not 0 <= seq < hosts:
        raise ValueError(f"address #{seq} is beyond the {hosts} addresses of {network}")
    return str(network.network_address + 1 + seq)


def service_object(name: str, role: str, *, svc_type: str = "ClusterIP", protocol: str = "TCP",
                   port: int = ports.SERVICE_PORT, etp: str | None = None, family: str | None = None) -> dict:
    spec: dict = {"type": svc_type, "ports": [{"port": port, "protocol": protocol, "targetPort": port}]}
    if etp:
        spec["externalTrafficPolicy"] = etp
    if family:  # one family only, e.g. the IPv6 ClusterIP of a dual-stack bench
        spec["ipFamilies"], spec["ipFamilyPolicy"] = [family], "SingleStack"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {ROLE_LABEL: role}},
            "spec": spec}


def slice_object(service: str, role: str, endpoints: Sequence[tuple[str, str]], port: int,
                 protocol: str = "TCP", address_type: str = "IPv4") -> dict:
    """An EndpointSlice for `service`; endpoints are (ip, nodeName), all ready."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": slice_name(service), "namespace": NAMESPACE,
                     "labels": {SERVICE_NAME_LABEL: service, MANAGED_BY_LABEL: MANAGED_BY, ROLE_LABEL: role}},
        "addressType": address_type,
        "endpoints": [{"addresses": [ip], "nodeName": node,
                       "conditions": {"ready": True, "serving": True, "terminating": False}}
                      for ip, node in endpoints],
        "ports": [{"name": "", "port": port, "protocol": protocol}],
    }


def filler_slice(index: int, per_service: int, nodes: Sequence[str]) -> dict:
    """Filler `index`'s slice: `per_service` phantom endpoints, spread over the nodes."""
    endpoints = [(range_address(FILLER_RANGE, index * per_service + j), nodes[(index + j) % len(nodes)])
                 for j in range(per_service)]
    return slice_object(filler_name(index), "filler", endpoints, ports.FILLER_PORT)


@dataclass
class MeasuredService:
    name: str
    cluster_ip: str
    node_port: int | None
    protocol: str


@dataclass
class InstallStats:
    services: int  # Services the cluster now has from the bench (measured + fillers)
    created: int
    deleted: int
    seconds: float


class BenchServices:
    """Creates and changes the bench's objects at the lab's API server."""

    def __init__(self, rest: Rest, topology: Topology, per_service: int = 2, threads: int = 4) -> None:
        if per_service < 1:
            raise ValueError(f"endpoints per service: must be >= 1, got {per_service}")
        self.rest = rest
        self.topology = topology
        self.per_service = per_service
        self.threads = threads
        self.nodes = [n.name for n in topology.nodes]
        self.backends = sorted((p for p in topology.pods if p.labels.get("app") == "bench-backend"),
                               key=lambda p: p.name)
        if len(self.backends) < 1:
            raise ValueError("bench topology: no pod labelled app=bench-backend")
        self.measured: dict[str, MeasuredService] = {}
        self.fillers = 0
        self._churn_seq = 0
        self._target_offset = 0
        self._slices: dict[str, dict] = {}  # last written slice of each service the bench changed
        self._lock = threading.Lock()

    # ---- measured Services ------------------------------------------------------------------------
    @property
    def ipv6(self) -> bool:
        """Whether the backends have IPv6 addresses (a dual-stack bench topology): then the IPv6
        ClusterIP path is measured too."""
        return all(_ipv6_of(p.ips) for p in self.backends)

    def _paths(self) -> dict[str, str]:
        return {path: svc for path, svc in ports.PATH_SERVICE.items() if self.ipv6 or path not in ports.IPV6_PATHS}

    def _measured_objects(self) -> list[dict]:
        objs = [
            service_object(ports.SVC_CLUSTERIP, "measured"),
            service_object(ports.SVC_NODEPORT_CLUSTER, "measured", svc_type="NodePort", etp="Cluster"),
            service_object(ports.SVC_NODEPORT_LOCAL, "measured", svc_type="NodePort", etp="Local"),
            service_object(ports.SVC_UDP, "measured", protocol="UDP", port=ports.UDP_SERVICE_PORT),
            service_object(ports.SVC_CHURN, "measured"),
        ]
        if self.ipv6:
            objs.append(service_object(ports.SVC_CLUSTERIP6, "measured", family="IPv6"))
        return objs

    def install_measured(self) -> None:
        for obj in self._measured_objects():
            name = obj["metadata"]["name"]
            got = self.rest.get("Service", name, NAMESPACE) or self.rest.create(obj)
            spec = got["spec"]
            node_port = (spec.get("ports") or [{}])[0].get("nodePort")
            self.measured[name] = MeasuredService(name, spec["clusterIP"], node_port,
                                                  obj["spec"]["ports"][0]["protocol"])
        churn = slice_object(ports.SVC_CHURN, "measured",
                             [(ip, self.nodes[0]) for ip in self._next_churn(self.per_service)],
                             ports.FILLER_PORT)
        self._write_slice(churn)
        self.point_at_mode(None)

    def point_at_mode(self, mode: str | None) -> None:
        """Point the measured Services at the backends' ports for `mode` (None: no endpoints)."""
        backends = [(p.ip, p.node) for p in self.backends]
        for path, svc in self._paths().items():
            port = ports.tcp_port(mode, path) if mode else ports.FILLER_PORT
            if path in ports.IPV6_PATHS:
                v6 = [(_ipv6_of(p.ips), p.node) for p in self.backends]
                self._write_slice(slice_object(svc, "measured", v6 if mode else [], port, address_type="IPv6"))
            else:
                self._write_slice(slice_object(svc, "measured", backends if mode else [], port))
        udp_port = ports.udp_port(mode) if mode else ports.FILLER_PORT
        self._write_slice(slice_object(ports.SVC_UDP, "measured", backends if mode else [], udp_port, "UDP"))

    def _write_slice(self, obj: dict) -> dict:
        try:
            out = self.rest.replace(obj)
        except RestError as exc:
            if exc.status != 404:
                raise
            out = self.rest.create(obj)
        with self._lock:
            self._slices[obj["metadata"]["labels"][SERVICE_NAME_LABEL]] = obj
        return out

    # ---- fillers ------------------------------------------------------------------------------------
    def ensure_size(self, total: int) -> InstallStats:
        """Make the bench's Services number max(total, measured ones): add or remove fillers."""
        if not self.measured:
            self.install_measured()
        measured = len(self._measured_objects())  # the IPv6 ClusterIP only on a dual-stack topology
        want = max(0, total - measured)
        start = time.monotonic()
        created = deleted = 0
        if want > self.fillers:
            self.rest.map(self._create_filler, range(self.fillers, want), threads=self.threads)
            created = want - self.fillers
        elif want < self.fillers:
            self.rest.map(self._delete_filler, range(want, self.fillers), threads=self.threads)
            deleted = self.fillers - want
        self.fillers = want
        return InstallStats(measured + want, created, deleted, time.monotonic() - start)

    def _create_filler(self, index: int) -> None:
        name = filler_name(index)
        self.rest.create(service_object(name, "filler"))
        self.rest.create(filler_slice(index, self.per_service, self.nodes))  # rebuilt on demand: not kept

    def _delete_filler(self, index: int) -> None:
        name = filler_name(index)
        self.rest.delete("EndpointSlice", slice_name(name), NAMESPACE)
        self.rest.delete("Service", name, NAMESPACE)
        with self._lock:
            self._slices.pop(name, None)

    def remove_all(self) -> None:
        """Delete every object any bench run created: a reused lab starts from none and is left
        as it was found."""
        for kind in ("EndpointSlice", "Service"):
            self.rest.delete_by_label(kind, ROLE_LABEL, NAMESPACE)
        self.measured.clear()
        self.fillers = 0
        self._slices.clear()

    # ---- churn --------------------------------------------------------------------------------------
    def churn_targets(self) -> list[str]:
        """Services whose endpoints the control-plane measurements change: the fillers, else churn."""
        return [filler_name(i) for i in range(self.fillers)] or [ports.SVC_CHURN]

    def _next_churn(self, count: int) -> list[str]:
        with self._lock:
            out = [range_address(CHURN_RANGE, self._churn_seq + k) for k in range(count)]
            self._churn_seq += count
        return out

    def _current_slice(self, service: str) -> dict:
        with self._lock:
            current = self._slices.get(service)
        if current is None:
            if not service.startswith(FILLER_PREFIX):
                raise KeyError(f"service {service!r}: the bench has not written its slice")
            current = filler_slice(int(service[len(FILLER_PREFIX):]), self.per_service, self.nodes)
        return current

    def changed_slice(self, service: str) -> tuple[dict, tuple[str, int]]:
        """`service`'s slice with its first endpoint moved to a fresh address: the new slice, and
        the (ip, port) that is in it and was never anywhere before. Nothing is written yet."""
        obj = copy.deepcopy(self._current_slice(service))
        ip, = self._next_churn(1)
        obj["endpoints"][0]["addresses"] = [ip]
        return obj, (ip, obj["ports"][0]["port"])

    def write(self, obj: dict) -> int:
        """Write a changed slice; returns the resourceVersion the server gave the change."""
        return int(self._write_slice(obj)["metadata"]["resourceVersion"])

    def remember(self, obj: dict) -> None:
        """Make `obj` the slice the next change of its Service builds on, before it is written."""
        with self._lock:
            self._slices[obj["metadata"]["labels"][SERVICE_NAME_LABEL]] = obj

    def next_target_index(self) -> int:
        """Where in churn_targets() the next measurement starts, so successive ones spread out."""
        return self._target_offset

    def advance_targets(self, count: int) -> None:
        self._target_offset += count

    def expected_endpoints(self, obj: dict) -> set[tuple[str, int]]:
        port = obj["ports"][0]["port"]
        return {(e["addresses"][0], port) for e in obj["endpoints"]}


def _ipv6_of(ips: Sequence[str]) -> str | None:
    return next((ip for ip in ips if ":" in ip), None)


def measured_targets(measured: dict[str, MeasuredService], topology: Topology, entry_node: str) -> dict[str, str]:
    """path -> 'IP:PORT' (or '[IPV6]:PORT') the load generator hits, for the proxy modes' TCP paths
    and UDP; the IPv6 ClusterIP when it was installed (a dual-stack topology)."""
    node_ip = topology.node(entry_node).ip
    out = {
        "clusterip": f"{measured[ports.SVC_CLUSTERIP].cluster_ip}:{ports.SERVICE_PORT}",
        "nodeport-cluster": f"{node_ip}:{measured[ports.SVC_NODEPORT_CLUSTER].node_port}",
        "nodeport-local": f"{node_ip}:{measured[ports.SVC_NODEPORT_LOCAL].node_port}",
        "udp": f"{measured[ports.SVC_UDP].cluster_ip}:{ports.UDP_SERVICE_PORT}",
    }
    if ports.SVC_CLUSTERIP6 in measured:
        out["clusterip6"] = f"[{measured[ports.SVC_CLUSTERIP6].cluster_ip}]:{ports.SERVICE_PORT}"
    return out

