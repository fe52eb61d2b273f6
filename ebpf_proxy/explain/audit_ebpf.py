"""The drift audit of the eBPF datapath: the maps and devices against what the last sync wrote.

Compared, per IP family (each family's datapath is audited on its own, over its own maps: the
epx_* maps for IPv4, the epx_*6 maps for IPv6): every service port's frontends (id, slot counts,
affinity, flags), its slots, its backends and its source ranges; what no service port accounts
for (the same `strays` an agent restart removes); the family's node facts (epx_config or
epx_config6, epx_node_addr(6), epx_pod_cidr(6)); and, once for both families (the lead family's
audit, shared.py), epx_iface and our TC filters and XDP program on every device the datapath
attached to. Not compared: the
connection, affinity and masquerade-port tables, which the programs themselves write.

The service maps are first only summed, streamed, against the same sums of what the last sync
wrote (digest.py); only when they differ are they read back whole (adopt.read: ~22 MiB at
100,000 Services x 10 endpoints) to name every difference. A clean audit there: 1.4 s and +1 MiB
of the agent's RSS, where reading back was 3.6 s and +25 MiB (a lab node, both families).

Repair writes only what differs: a drifted service port is taken over as the maps hold it and
moved back to what it should be (the same delta writer every sync uses, so its ids, slots and
connections stay), strays are deleted, node facts rewritten where they differ, and devices that
lost a program get it attached again.
"""

from __future__ import annotations

from collections.abc import Mapping

from ebpf_proxy.datapath.ebpf import adopt, digest
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.datapath import Believed, EbpfDatapath
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Service
from ebpf_proxy.datapath.ebpf.services import ServiceEntries
from ebpf_proxy.explain.audit import EXTRA, MISSING, STALE, AuditReport, AuditUnavailable, Drift
from ebpf_proxy.model import ServicePortName

_PROTO = {6: "tcp", 17: "udp", 132: "sctp"}
_SCOPE = {s.LB4_SCOPE_CLUSTER: "cluster", s.LB4_SCOPE_LOCAL: "local"}


def frontend_key(fe: Frontend) -> str:
    addr = f"[{fe.addr}]" if fe.addr and ":" in fe.addr else fe.addr or "<node>"  # an IPv6 address in brackets
    return f"{addr}:{fe.port}/{_PROTO.get(fe.proto, fe.proto)}"


def _service_text(svc: Service) -> str:
    return (f"id {svc.id}, {svc.count} cluster/{svc.local_count} local slots, affinity {svc.affinity_timeout}s, "
            f"flags {svc.flags:#x}")


def _backend_text(be: Backend) -> str:
    scopes = "+".join(x for x, on in (("cluster", be.in_cluster), ("local", be.in_local)) if on) or "no scope"
    return f"{be.addr}:{be.port} ({scopes})"


def service_drift(name: ServicePortName, want: ServiceEntries, snap: adopt.Snapshot) -> list[Drift]:
    """Every difference between what service port `name` should hold and what `snap` holds for its id."""
    out: list[Drift] = []
    svc_id = want.svc_id
    label = f"{name} (id {svc_id})"
    for fe, flags in sorted(want.frontends.items(), key=lambda kv: frontend_key(kv[0])):
        record = snap.records.get(fe)
        expected = want.service(flags)
        if record is None:
            out.append(Drift(MISSING, "service frontend", frontend_key(fe), f"of {label}"))
        elif record != expected:
            out.append(Drift(STALE, "service frontend", frontend_key(fe),
                             f"of {label}: holds {_service_text(record)}; should hold {_service_text(expected)}"))
    for fe in sorted(set(snap.frontends.get(svc_id, {})) - set(want.frontends), key=frontend_key):
        out.append(Drift(EXTRA, "service frontend", frontend_key(fe), f"leads to {label}, which does not have it"))
    for scope, slots in ((s.LB4_SCOPE_CLUSTER, want.cluster_slots), (s.LB4_SCOPE_LOCAL, want.local_slots)):
        if snap.slots.run(svc_id, want.bank, scope, len(slots)) == tuple(slots):
            continue  # all there (one search): the common case, a million slots at 100,000 Services
        for slot, bid in enumerate(slots):
            held = snap.slots.get((svc_id, want.bank, scope, slot))
            key = f"{label} {_SCOPE[scope]} slot {slot}"
            if held is None:
                out.append(Drift(MISSING, "slot", key, f"should hold backend {bid}"))
            elif held != bid:
                out.append(Drift(STALE, "slot", key, f"holds backend {held}, should hold {bid}"))
    held_backends = snap.backends.pick(want.backends)  # packed, no record made: equal when none drifted
    for bid, be in sorted(want.backends.items()) if held_backends != want.backends else ():
        held_be = held_backends.get(bid)
        if held_be is None:
            out.append(Drift(MISSING, "backend", f"{bid}", f"{_backend_text(be)} of {label}"))
        elif held_be != be:
            out.append(Drift(STALE, "backend", f"{bid}",
                             f"of {label}: holds {_backend_text(held_be)}, should hold {_backend_text(be)}"))
    held_ranges = snap.ranges.get(svc_id, set())
    for cidr in sorted(want.source_ranges - held_ranges):
        out.append(Drift(MISSING, "source range", f"{label} {cidr}"))
    for cidr in sorted(held_ranges - want.source_ranges):
        out.append(Drift(EXTRA, "source range", f"{label} {cidr}"))
    return out


def stray_drift(strays: adopt.Strays) -> list[Drift]:
    out = []
    for entries in strays.services:
        for fe in sorted(entries.frontends, key=frontend_key):
            out.append(Drift(EXTRA, "service frontend", frontend_key(fe),
                             f"leads to service id {entries.svc_id}, which no service port has"))
    for svc_id, bank, scope, slot in strays.slots:
        out.append(Drift(EXTRA, "slot", f"id {svc_id} bank {bank} {_SCOPE.get(scope, scope)} slot {slot}",
                         "beyond its service's slots, in the bank it does not use, or of no service"))
    for bid in strays.backends:
        out.append(Drift(EXTRA, "backend", f"{bid}", "no service port uses it"))
    for svc_id, cidr in strays.ranges:
        out.append(Drift(EXTRA, "source range", f"id {svc_id} {cidr}", "of no service"))
    return out


def _value(field: object) -> object:
    if isinstance(field, s.In6):  # an IPv6 address compares by its bytes (a struct compares by identity)
        return bytes(field)
    return getattr(field, "value", field)  # be32/be16 fields are structs with a value


def node_drift(believed: Believed, iface_flags: Mapping[int, int] | None) -> list[Drift]:
    """epx_config (epx_config6), epx_node_addr(6), epx_pod_cidr(6) and epx_iface against what
    they should hold."""
    maps = believed.maps
    out: list[Drift] = []
    held = maps.config()
    if bytes(held) != bytes(believed.config):
        fields = [name for name, *_ in type(believed.config)._fields_
                  if _value(getattr(held, name)) != _value(getattr(believed.config, name))]
        table = "epx_config6" if isinstance(believed.config, s.LB6Config) else "epx_config"
        out.append(Drift(STALE, "node setting", table, "differs in " + ", ".join(fields)))
    addrs = maps.node_addrs()
    out += [Drift(MISSING, "node address", a) for a in sorted(believed.node_addrs - addrs)]
    out += [Drift(EXTRA, "node address", a) for a in sorted(addrs - believed.node_addrs)]
    cidrs = maps.pod_cidrs()
    out += [Drift(MISSING, "local-traffic CIDR", c) for c in sorted(believed.pod_cidrs - cidrs)]
    out += [Drift(EXTRA, "local-traffic CIDR", c) for c in sorted(cidrs - believed.pod_cidrs)]
    if iface_flags is None:  # another family's audit checks epx_iface
        return out
    ifaces = maps.ifaces()
    want = {i: f for i, f in iface_flags.items() if f}
    for index in sorted(want.keys() | ifaces.keys()):
        have, should = ifaces.get(index), want.get(index)
        if have is None:
            out.append(Drift(MISSING, "device flags", f"ifindex {index}", f"should be {should:#x}"))
        elif should is None:
            out.append(Drift(EXTRA, "device flags", f"ifindex {index}", f"holds {have:#x}"))
        elif have != should:
            out.append(Drift(STALE, "device flags", f"ifindex {index}", f"holds {have:#x}, should be {should:#x}"))
    return out


def device_drift(lost: Mapping[int, list[str]], believed: Believed) -> list[Drift]:
    names = {i: d.name for i, d in believed.devices.attached.items()} if believed.devices is not None else {}
    return [Drift(MISSING, "device program", f"{names.get(i, i)} {prog}", f"ifindex {i}")
            for i, progs in sorted(lost.items()) for prog in progs]


def _service_drifts(datapath: EbpfDatapath, believed: Believed,
                    report: AuditReport) -> tuple[dict[ServicePortName, ServiceEntries], adopt.Strays]:
    """Add to `report` what the service maps hold other than what `believed` says; return what
    the drifted service ports hold and the strays (for a repair). The maps are first only summed
    (digest.py: nothing held, the clean case); read back whole only when the sums differ, while
    the connection GC, which holds a whole table too, waits its turn (whole_map_pass)."""
    if digest.of_entries(believed.services.values(), believed.maps) == digest.of_maps(believed.maps):
        return {}, adopt.Strays()
    with datapath.whole_map_pass():
        snap = adopt.read(believed.maps)
        # the service ports in the order the syncs keep them, not a sorted copy (100,000 pairs:
        # 6 MiB of objects, traced); only what drifted is sorted
        found_by_name = [(name, want, found) for name, want in believed.services.items()
                         if (found := service_drift(name, want, snap))]
        found_by_name.sort(key=lambda row: row[0])
        drifted: dict[ServicePortName, ServiceEntries] = {}
        for name, want, found in found_by_name:
            report.drifts += found
            drifted[name] = adopt.entries_of(snap, want.svc_id)
        strays = adopt.strays(snap, adopt.ById(snap.max_svc_id, believed.services.values()))
    report.drifts += stray_drift(strays)
    return drifted, strays


def audit(datapath: EbpfDatapath, repair: bool = False) -> AuditReport:
    believed = datapath.believed()
    if believed is None:
        raise AuditUnavailable("ebpf datapath: no sync has completed yet, nothing to compare")
    report = AuditReport(mode="ebpf")
    drifted, strays = _service_drifts(datapath, believed, report)
    devs = believed.devices  # None: the lead family's audit checks the devices (both families' programs)
    node = node_drift(believed, devs.iface_flags() if devs is not None else None)
    report.drifts += node
    lost = devs.lost() if devs is not None else {}
    report.drifts += device_drift(lost, believed)
    report.checked = {
        "service ports": len(believed.services),
        "frontends": sum(len(e.frontends) for e in believed.services.values()),
        "backends": sum(len(e.backends) for e in believed.services.values()),
        "devices": len(devs.attached) if devs is not None else 0,
    }
    if repair and report.drifts:
        report.writes = datapath.repair_services(drifted, strays)
        if node:
            report.writes += datapath.repair_node()
        if lost:
            report.writes += datapath.repair_devices(lost)
        report.repaired = True
    return report

