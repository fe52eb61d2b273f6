"""What to program, and what changed since it was last programmed (kube-proxy's change trackers).

kube-proxy keeps a ServiceChangeTracker and an EndpointsChangeTracker that accumulate "previous →
current" pairs between syncs. This tracker keeps the same promise with a simpler mechanism:

- it holds the *current* service ports and endpoints (per Service, endpoints merged across all of
  its EndpointSlices, like kube-proxy's EndpointSliceCache),
- the state as of the last *successful* sync,
- and the set of Services touched since then.

`take()` diffs only the touched Services against the last-synced state, so the ChangeSet is exact
(an update that reverts a previous one yields no change) and nothing is lost when a sync fails:
`abort()` puts the touched Services back, `commit()` advances the last-synced state. Because the
diff is against what was really programmed, a change that arrives while a sync is running is
simply still "touched" at the next `take()`.

Pure Python and thread-safe: the watch threads feed it, the runner thread takes from it.
"""

from __future__ import annotations

import ipaddress
import sys
import threading
from dataclasses import dataclass, replace
from itertools import chain
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from ebpf_proxy.model.compact import OneEntry, compact_mapping
from ebpf_proxy.model.endpoints import MergedEndpoints, merge
from ebpf_proxy.model.types import (
    ChangeSet,
    Endpoint,
    NodeTopology,
    Protocol,
    ProxyState,
    ServicePort,
    ServicePortName,
)

EndpointsByPort = Mapping[ServicePortName, tuple[Endpoint, ...]]
_NOTHING: Mapping = MappingProxyType({})  # what take() reads for a Service without ports or endpoints


@dataclass(frozen=True)
class NodeState:
    """This node as the API server describes it (from its Node object).

    The agent prefers the addresses it reads from the node's own interfaces (iptables' addrtype
    LOCAL means *every* local address, which the Node object does not list); these are the fallback,
    and `primary_ip` is what `--nodeport-addresses primary` means.
    """

    name: str
    addresses: tuple[str, ...] = ()  # InternalIPs, then ExternalIPs, every family, as listed
    primary_ip: str | None = None  # first InternalIP, else first ExternalIP: its family is the primary one
    eligible: bool = True  # False while the node is being deleted: /healthz then answers 503
    pod_cidrs: tuple[str, ...] = ()  # spec.podCIDRs: what --detect-local-mode NodeCIDR matches
    zone: str = ""  # label topology.kubernetes.io/zone ("" without it): which zone hints apply here

    def primary_of(self, family: int) -> str | None:
        """This family's primary address (first InternalIP of it, else first ExternalIP), as
        kubelet's --node-ip pair names one per family; None when the Node has none of it."""
        return next((ip for ip in self.addresses if ipaddress.ip_address(ip).version == family), None)

    @property
    def families(self) -> tuple[int, ...]:
        """The IP families of the Node's addresses, the primary one first."""
        ordered = ([self.primary_ip] if self.primary_ip else []) + list(self.addresses)
        return tuple(dict.fromkeys(ipaddress.ip_address(ip).version for ip in ordered))


def _service_key(namespace: str, name: str) -> str:
    """A Service's key, "namespace/name", one string object however many hold it (sys.intern).

    Without it each Service's key text existed three times at 100,000 Services x 10 endpoints:
    the key of the Services watch cache (k8s/watch.py interns it too), this tracker's key (its
    dicts, dirty set and trigger lists), and every one of its slices' `service_key`, ~64 bytes each.
    Interned, one string is kept and the intern table's entry (~45 bytes): 1.3 MiB less traced
    after the first sync at 10,000 Services (bench/cpscale.py --tracemalloc: 41.0 -> 39.7 MiB),
    ~13 MiB at 100,000; the dual-stack agent's second tracker shares the string too. Slice keys
    are not interned: each is held once, an entry would only add to it."""
    return sys.intern(f"{namespace}/{name}")


@dataclass(frozen=True, slots=True)
class _Slice:
    service_key: str
    endpoints: Mapping[ServicePortName, tuple[Endpoint, ...]]  # OneEntry or dict (compact_mapping)
    trigger_time: float | None


class ChangeTracker:
    """Accumulates Service/EndpointSlice changes; `take()` / `commit()` / `abort()` around each sync."""

    def __init__(self, start_time: float = 0.0, node_name: str = "") -> None:
        # Change-trigger times older than the tracker are history from before we started: kube-proxy
        # ignores them too, otherwise the first sync would report hours of "programming latency".
        self._start_time = start_time
        self._lock = threading.Lock()
        self._services: dict[str, dict[ServicePortName, ServicePort]] = {}
        self._slices: dict[tuple[str, str], _Slice] = {}
        # service key -> its slices' keys, sorted: a tuple, as most services have one slice
        # (a one-element set costs 216 bytes, the tuple 48; 10,000 Services make it count), and
        # a lone slice's key as it is (_slice_keys / _set_slice_keys)
        self._slices_by_service: dict[str, tuple] = {}
        self._endpoints: dict[str, dict[ServicePortName, tuple[Endpoint, ...]]] = {}
        self._flat_services: dict[ServicePortName, ServicePort] = {}
        # every service port's endpoints, in two parts kept in step by every change: those of the
        # service ports that exist (what take() hands out: it need not filter 10,000 entries each
        # sync), and the others (slices listed before their Service, or left by it). Not a whole
        # copy beside the visible ones: one dict of 100,000 entries less (~5 MiB, bench/cpscale.py)
        self._visible_endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        self._hidden_endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
        # take() hands these two dicts out as the ProxyState, uncopied: copying 100,000 entries
        # twice was most of the time from one endpoint change to the kernel. The copy is made
        # after the sync instead (commit() → _unshare(), off the change's path), or by a change
        # that comes first (_own_locked()): a state being programmed never changes.
        self._handed_out = False

        self._synced_services: dict[str, dict[ServicePortName, ServicePort]] = {}
        self._synced_endpoints: dict[str, dict[ServicePortName, tuple[Endpoint, ...]]] = {}
        self._synced_once = False

        self._dirty: set[str] = set()
        self._triggers: dict[str, list[float]] = {}
        self._in_flight: dict[str, tuple[dict, dict]] | None = None
        self._in_flight_triggers: dict[str, list[float]] = {}
        self._in_flight_topology = False  # the in-flight take() was full because the zone changed
        self._node: NodeState | None = None
        # this node's name and zone as the datapaths see them; a zone change re-decides every
        # service's endpoints (hints), so it asks for a full sync, as kube-proxy's
        # NodeTopologyConfig does (OnTopologyChange → forceSyncProxyRules)
        self._topology = NodeTopology(node_name=node_name)
        self._topology_changed = False

    # ---- feeding ---------------------------------------------------------------------------------

    def update_service(self, namespace: str, name: str, ports: Iterable[ServicePort]) -> bool:
        """The Service's current programmable ports ([] = not proxied). Returns whether anything changed."""
        key = _service_key(namespace, name)
        new = compact_mapping({p.name: p for p in ports})
        with self._lock:
            old = self._services.get(key, {})
            if not new and not old:  # not proxied, and was not (each Service in the other family's tracker)
                return False
            new = _named_as(self._endpoints.get(key, ()), new)
            if new == old:
                return False
            self._own_locked()
            for spn in old:
                self._flat_services.pop(spn, None)
                if spn in self._visible_endpoints:
                    self._hidden_endpoints[spn] = self._visible_endpoints.pop(spn)
            for spn, port in new.items():  # not dict.update: a OneEntry is read through the Mapping ABC
                self._flat_services[spn] = port
                if spn in self._hidden_endpoints:
                    self._visible_endpoints[spn] = self._hidden_endpoints.pop(spn)
            if new:
                self._services[key] = new
            else:
                self._services.pop(key, None)
            self._dirty.add(key)
            return True

    def delete_service(self, namespace: str, name: str) -> bool:
        return self.update_service(namespace, name, ())

    def update_slice(self, namespace: str, slice_name: str, service: str, endpoints: EndpointsByPort,
                     trigger_time: float | None = None) -> bool:
        """One EndpointSlice's endpoints by service port. Returns whether the service's endpoints changed."""
        slice_key = (namespace, slice_name)
        service_key = _service_key(namespace, service)
        # kept in merged form, so that a service with one slice (most of them) shares it as is
        merged = _merge_endpoints([endpoints])
        with self._lock:
            new = _Slice(service_key, _named_as(self._services.get(service_key, ()), merged), trigger_time)
            old = self._slices.get(slice_key)
            self._slices[slice_key] = new
            self._link(service_key, slice_key)
            changed = False
            if old is not None and old.service_key != service_key:  # label moved: leave the old service
                self._unlink(old.service_key, slice_key)
                changed |= self._remerge(old.service_key)
            changed |= self._remerge(service_key)
            if changed and trigger_time is not None and trigger_time >= self._start_time:
                self._triggers.setdefault(service_key, []).append(trigger_time)
            return changed

    def delete_slice(self, namespace: str, slice_name: str) -> bool:
        with self._lock:
            old = self._slices.pop((namespace, slice_name), None)
            if old is None:
                return False
            self._unlink(old.service_key, (namespace, slice_name))
            return self._remerge(old.service_key)

    def update_node(self, node: NodeState | None) -> bool:
        """This node's state (None: the Node object is gone). Returns whether anything changed.

        Node state does not dirty services; a change of zone makes the next take() full
        (`pending` then says so), because every service's topology choice depends on it."""
        with self._lock:
            changed = node != self._node
            self._node = node
            topology = NodeTopology(node_name=self._topology.node_name, zone=node.zone if node else "")
            if topology != self._topology:
                self._topology = topology
                self._topology_changed = True
            return changed

    @property
    def node(self) -> NodeState | None:
        with self._lock:
            return self._node

    def _slice_keys(self, service_key: str) -> tuple[tuple[str, str], ...]:
        keys = self._slices_by_service.get(service_key, ())
        return (keys,) if keys and type(keys[0]) is str else keys  # type: ignore[return-value]

    def _set_slice_keys(self, service_key: str, keys: tuple[tuple[str, str], ...]) -> None:
        # a lone slice's key as it is, not in a 1-tuple: ~48 bytes a Service (most have one slice)
        self._slices_by_service[service_key] = keys[0] if len(keys) == 1 else keys  # type: ignore[assignment]

    def _link(self, service_key: str, slice_key: tuple[str, str]) -> None:
        keys = self._slice_keys(service_key)
        if slice_key not in keys:
            self._set_slice_keys(service_key, tuple(sorted((*keys, slice_key))))

    def _unlink(self, service_key: str, slice_key: tuple[str, str]) -> None:
        keys = self._slice_keys(service_key)
        self._set_slice_keys(service_key, tuple(k for k in keys if k != slice_key))

    def _remerge(self, service_key: str) -> bool:
        """Recompute one service's endpoints from all its slices; mark it dirty if they changed."""
        merged = _merge(self._slices[k] for k in self._slice_keys(service_key))
        if not self._slices_by_service.get(service_key):
            self._slices_by_service.pop(service_key, None)
        old = self._endpoints.get(service_key, {})
        if merged == old:
            return False
        self._own_locked()
        for spn in old:
            self._hidden_endpoints.pop(spn, None)
            self._visible_endpoints.pop(spn, None)
        for spn, eps in merged.items():
            if spn in self._flat_services:
                self._visible_endpoints[spn] = eps
                self._hidden_endpoints.pop(spn, None)
            else:
                self._hidden_endpoints[spn] = eps
        if merged:
            self._endpoints[service_key] = merged
        else:
            self._endpoints.pop(service_key, None)
        self._dirty.add(service_key)
        return True

    # ---- syncing ---------------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether something changed since the last take()."""
        with self._lock:
            return bool(self._dirty) or self._topology_changed

    def take(self, full: bool = False) -> tuple[ProxyState, ChangeSet]:
        """The whole desired state and what changed since the last committed sync.

        The first take (before any commit) is always full. Must be followed by commit() or abort();
        a take() without either implicitly aborts the previous one."""
        with self._lock:
            if self._in_flight is not None:
                self._abort_locked()
            keys, self._dirty = self._dirty, set()
            changed: set[ServicePortName] = set()
            stale_endpoints: set[tuple[ServicePortName, str]] = set()
            stale_services: set[ServicePortName] = set()
            in_flight: dict[str, tuple[Mapping, Mapping]] = {}
            triggers: dict[str, list[float]] = {}
            # a first take diffs every Service (100,000 of them): the lookups bound once
            services, endpoints = self._services.get, self._endpoints.get
            synced_services, synced_endpoints = self._synced_services.get, self._synced_endpoints.get
            pending_triggers = self._triggers
            for key in keys:
                new_svc, new_eps = services(key, _NOTHING), endpoints(key, _NOTHING)
                old_svc, old_eps = synced_services(key, _NOTHING), synced_endpoints(key, _NOTHING)
                in_flight[key] = (new_svc, new_eps)
                key_changed = _changed_ports(old_svc, new_svc, old_eps, new_eps)
                changed |= key_changed
                _detect_stale_udp(old_eps, new_eps, stale_endpoints, stale_services)
                if key_changed and key in pending_triggers:
                    triggers[key] = pending_triggers.pop(key)
                elif pending_triggers:
                    pending_triggers.pop(key, None)
            self._in_flight, self._in_flight_triggers = in_flight, triggers
            self._in_flight_topology, self._topology_changed = self._topology_changed, False

            services, endpoints = self._flat_services, self._visible_endpoints
            self._handed_out = True
            changes = ChangeSet(
                full=full or not self._synced_once or self._in_flight_topology,
                services=frozenset(changed),
                stale_udp_endpoints=frozenset(stale_endpoints),
                stale_udp_services=frozenset(stale_services),
            )
            return ProxyState(services=services, endpoints=endpoints, topology=self._topology), changes

    def _own_locked(self) -> None:
        """Before a change: stop sharing the dicts the last take() handed out (copy-on-write)."""
        if self._handed_out:
            self._flat_services = dict(self._flat_services)
            self._visible_endpoints = dict(self._visible_endpoints)
            self._handed_out = False

    def commit(self) -> list[float]:
        """The last take() was programmed. Returns its change-trigger times (epoch seconds) for the
        network-programming-latency metric."""
        with self._lock:
            if self._in_flight is None:
                return []
            for key, (svc, eps) in self._in_flight.items():
                _store(self._synced_services, key, svc)
                _store(self._synced_endpoints, key, eps)
            self._synced_once = True
            triggers = sorted(t for times in self._in_flight_triggers.values() for t in times)
            self._in_flight, self._in_flight_triggers = None, {}
            self._in_flight_topology = False
        self._unshare()
        return triggers

    def _unshare(self) -> None:
        """Own copies of the dicts the last take() handed out, made outside the lock (nobody
        changes a handed-out dict: a change copies it first), so handlers are not held up."""
        with self._lock:
            if not self._handed_out:
                return
            shared = self._flat_services, self._visible_endpoints
        copies = dict(shared[0]), dict(shared[1])
        with self._lock:
            if self._handed_out and self._flat_services is shared[0] and self._visible_endpoints is shared[1]:
                self._flat_services, self._visible_endpoints = copies
                self._handed_out = False

    def abort(self) -> None:
        """The last take() failed: its changes count as pending again."""
        with self._lock:
            self._abort_locked()

    def _abort_locked(self) -> None:
        if self._in_flight is None:
            return
        self._dirty |= set(self._in_flight)
        for key, times in self._in_flight_triggers.items():
            self._triggers[key] = times + self._triggers.get(key, [])
        self._in_flight, self._in_flight_triggers = None, {}
        self._topology_changed |= self._in_flight_topology
        self._in_flight_topology = False


def _named_as(known: Iterable[ServicePortName], by_port: Mapping[ServicePortName, Any]) -> Mapping[ServicePortName, Any]:
    """`by_port` keyed by the very ServicePortName objects of `known` that equal its keys (a
    ServicePort value renamed to match), so that a Service's ports and its slices' endpoints share
    one name object, and the slice's copy of the Service's name goes (~120 bytes a Service: ~12
    MiB at 100,000, bench/cpscale.py). Equal names, equal values: nothing else changes."""
    if type(known) is OneEntry and type(by_port) is OneEntry:  # one port each (most Services): no dicts
        ((same, _),), ((spn, value),) = known.items(), by_port.items()
        if same is spn or same != spn:
            return by_port
        return OneEntry(same, replace(value, name=same) if isinstance(value, ServicePort) else value)
    names = {spn: spn for spn in known}
    if not names or all(names.get(spn, spn) is spn for spn in by_port):
        return by_port
    out = {}
    for spn, value in by_port.items():
        same = names.get(spn, spn)
        if same is not spn and isinstance(value, ServicePort):
            value = replace(value, name=same)
        out[same] = value
    return compact_mapping(out)


def _store(target: dict, key: str, value: dict) -> None:
    if value:
        target[key] = value
    else:
        target.pop(key, None)


def _merge(slices: Iterable[_Slice]) -> Mapping[ServicePortName, tuple[Endpoint, ...]]:
    """Endpoints of one service across its slices (iterated in name order), deduplicated by ip:port.
    A lone slice's endpoints are already in that form (_merge_endpoints is idempotent): shared,
    not copied, which at 10,000 Services saves a dict and a tuple per service port."""
    slices = list(slices)
    if len(slices) == 1:
        return slices[0].endpoints
    return _merge_endpoints(sl.endpoints for sl in slices)


def _merge_endpoints(parts: Iterable[EndpointsByPort]) -> Mapping[ServicePortName, tuple[Endpoint, ...]]:
    """Endpoints by port from several sources, deduplicated by ip:port and sorted, packed
    (model.endpoints.merge: a MergedEndpoints, a Sequence of Endpoint equal to the sorted tuple;
    the first source wins a duplicate, except that a local copy is preferred). Ports left
    without an endpoint are left out."""
    if type(parts) is list and len(parts) == 1 and all(type(eps) is MergedEndpoints for eps in parts[0].values()):
        # a slice's own endpoints, already merged (k8s/convert.py packs them so): merge() would
        # give each list back as it is
        return compact_mapping({spn: eps for spn, eps in parts[0].items() if eps})
    by_port: dict[ServicePortName, list[Sequence[Endpoint]]] = {}
    for part in parts:
        for spn, eps in part.items():
            by_port.setdefault(spn, []).append(eps)
    # packed (model/endpoints.py): at 100,000 Services x 10 endpoints the Endpoint objects and
    # their IP strings were 165 MiB; the packed lists ~20 MiB
    merged = {spn: merge(lists) for spn, lists in by_port.items()}
    return compact_mapping({spn: eps for spn, eps in merged.items() if eps})


def _changed_ports(old_svc: Mapping, new_svc: Mapping, old_eps: Mapping, new_eps: Mapping) -> set[ServicePortName]:
    """Service ports (existing before or after) whose service or endpoints differ."""
    if not old_svc:  # nothing synced before (every Service at the first take): each port is new
        return {spn for spn, svc in new_svc.items() if svc is not None or old_eps.get(spn, ()) != new_eps.get(spn, ())}
    ports = set(old_svc)
    ports.update(new_svc)
    return {
        spn for spn in ports
        if old_svc.get(spn) != new_svc.get(spn) or old_eps.get(spn, ()) != new_eps.get(spn, ())
    }


_UDP = Protocol.UDP  # a module global: looking the member up on the enum class is several times slower


def _detect_stale_udp(old_eps: Mapping, new_eps: Mapping, stale_endpoints: set, stale_services: set) -> None:
    """kube-proxy's detectStaleConntrackEntries, on one service's endpoints.

    - a serving UDP endpoint that is gone (or stopped serving) may have conntrack entries that would
      keep sending traffic to it;
    - a UDP service port that goes from no serving endpoint to some may have entries created while
      it had none (black-holed), which must go so that new packets reach the new endpoints.

    Called for every changed Service (all 100,000 at a first take): a Service without a UDP port
    (most) returns after one plain loop, before any set is built."""
    for spn in chain(old_eps, new_eps):
        if spn.protocol is _UDP:
            break
    else:
        return
    for spn in old_eps.keys() | new_eps.keys():
        if spn.protocol is not _UDP:
            continue
        old, new = old_eps.get(spn, ()), new_eps.get(spn, ())
        still_serving = {ep.addr for ep in new if ep.serving}
        for ep in old:
            if ep.serving and ep.addr not in still_serving:
                stale_endpoints.add((spn, ep.ip))
        if any(ep.serving for ep in new) and not any(ep.serving for ep in old):
            stale_services.add(spn)
