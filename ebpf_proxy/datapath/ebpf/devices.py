"""Which network devices carry the TC and XDP programs, attaching them, and following changes.

Every packet a service decision applies to crosses one of two kinds of device:

  pod devices       the node's end of each pod's veth. Pod traffic enters here (tc_ingress makes
                    the service decision for pods, which are not in the node's cgroup, so the
                    socket LB never sees them) and replies to pods leave here (tc_egress undoes
                    the DNAT). Hairpin traffic enters and leaves through the same one.
  external devices  every other device but loopback (in the lab: eth0): NodePort, externalIP and
                    load-balancer traffic from outside enters here, masqueraded traffic to other
                    nodes' pods leaves here. They also get the XDP program, which drops what
                    kube-proxy drops before an skb exists.

Both get tc_ingress and tc_egress. The loopback device gets neither, only tc_lo on its ingress
(bpf/lib/lo6.h): kube-proxy's INPUT rule that drops [::1]:<nodePort> of an eTP=Local NodePort
without a local endpoint, the one service decision a packet on lo needs (the socket LB decides the
node's own calls; ::1 is no NodePort address in IPv6, so it leaves that call alone). This is the
lo of the agent's netns: on a production node the host's own lo, where the filter is ours as the
other devices' are; in the lab a node namespace's lo, never the machine's. The rule for pod devices (CNIs name and route their veths
differently, so it has a configurable part): a device is a pod device when
  * its name matches one of `pod_patterns` (default: the usual CNI prefixes below), or
  * it is a veth whose peer lives in another network namespace and that carries a host route
    (a /32, or an IPv6 /128, without gateway) to an address inside a cluster CIDR of either
    family: a routed CNI's pod veth, whatever it is called.
Anything else but loopback is external. Devices are (re)classified on every change, so a veth
that shows up before its route is classified again once the route is there.

The agent also tells the programs about devices through epx_iface (ifindex -> EPX_IF_*): pod
devices (EPX_IF_POD), and, for the interface local-traffic detectors, the devices whose packets
kube-proxy's `-i` match would call local (EPX_IF_LOCAL). That match sees the device a packet
enters the IP layer through: for a pod on a bridge this is the bridge, not the pod's veth port
where tc_ingress runs; so a bridge port is local when its bridge is (iface_flags).
For host routing (bpf/lib/fib4.h) it also marks the routed pod veths bpf_redirect_peer can deliver
through (EPX_IF_PEER) and the devices that send no ICMP redirects (EPX_IF_NO_REDIRECTS, from the
send_redirects sysctls as the last reconcile or audit read them).

`LinkWatcher` follows RTM_NEWLINK/DELLINK and IPv4 and IPv6 route changes with a raw netlink socket and
re-runs the reconciliation (level-triggered: every event means "look again", nothing is parsed),
so pods added at runtime (the lab's `scale`) get the programs as their veth appears; devices that
go away are forgotten (their filters went with them).
"""

from __future__ import annotations

import contextlib
import fnmatch
import ipaddress
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.pins import AttachError
from ebpf_proxy.model import LocalDetector

log = logging.getLogger(__name__)

POD = "pod"
EXTERNAL = "external"
LOOPBACK = "loopback"  # the node's lo: tc_lo on ingress alone
DEFAULT_POD_PATTERNS = ("lxc*", "cali*", "veth*", "cni*", "azv*", "gke*", "eni*", "vnet*")

_IFF_LOOPBACK = 0x8
_IFA_F_SECONDARY = 0x01
_RTMGRP_LINK = 0x1
_RTMGRP_IPV4_ROUTE = 0x40
_RTMGRP_IPV6_ROUTE = 0x400
_IFA_F_DEPRECATED = 0x20
_IFA_F_TENTATIVE = 0x40
_MAIN_TABLE = 254


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str | None = None  # IFLA_INFO_KIND: "veth", "bridge", ... (None: a physical device)
    peer_elsewhere: bool = False  # IFLA_LINK_NETNSID present: its peer is in another netns
    loopback: bool = False
    master: int | None = None  # IFLA_MASTER: the bridge (or bond) this device is a port of


@dataclass(frozen=True)
class Route:
    dst: str  # "a.b.c.d/len" (an IPv6 route: "x::y/len")
    oif: int | None
    gateway: str | None = None


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    role: str  # POD, EXTERNAL or LOOPBACK


def classify(links: Iterable[Link], routes: Iterable[Route], cluster_cidrs: Sequence[str],
             pod_patterns: Sequence[str] = DEFAULT_POD_PATTERNS) -> dict[int, Device]:
    """ifindex -> Device for every device that gets programs (see the module docstring)."""
    nets = [ipaddress.ip_network(c, strict=False) for c in cluster_cidrs]
    pod_routes = set()
    for r in routes:
        dst = ipaddress.ip_network(r.dst, strict=False)
        if r.oif and r.gateway is None and dst.prefixlen == dst.max_prefixlen and \
                any(dst.network_address in n for n in nets if n.version == dst.version):
            pod_routes.add(r.oif)
    out = {}
    for link in links:
        if link.loopback:
            continue
        routed_pod = link.kind == "veth" and link.peer_elsewhere and link.index in pod_routes
        named_pod = any(fnmatch.fnmatchcase(link.name, p) for p in pod_patterns)
        out[link.index] = Device(link.index, link.name, POD if routed_pod or named_pod else EXTERNAL)
    return out


def sends_no_redirects(name: str) -> bool:
    """Whether the kernel sends no ICMP redirects out of device `name` (IN_DEV_TX_REDIRECTS: its
    send_redirects and the `all` one both 0), read in the calling thread's netns. Unreadable: it
    may send them."""
    try:
        return all(Path(f"/proc/sys/net/ipv4/conf/{scope}/send_redirects").read_text().strip() == "0"
                   for scope in ("all", name))
    except OSError:
        return False


def iface_flags(links: Iterable[Link], devices: dict[int, Device], detector: LocalDetector,
                no_redirects: Callable[[str], bool] | None = None,
                mtus: Mapping[int | None, int] | None = None) -> dict[int, int]:
    """epx_iface: ifindex -> EPX_IF_* for every device that has a flag (see the module docstring).

    For host routing (bpf/lib/fib4.h): EPX_IF_PEER on a pod device that is a routed veth (its peer
    in the pod's netns, no bridge above it: the device a route to the pod names), which
    bpf_redirect_peer can deliver through; EPX_IF_NO_REDIRECTS on a device for which
    `no_redirects(name)` says the kernel sends no ICMP redirects; in bits EPX_IF_MTU_SHIFT and up,
    the smallest route MTU out of the device (`mtus`, route_mtus: None's applies to every device)."""
    links = list(links)
    names = {link.index: link.name for link in links}
    out = {}
    for link in links:
        pod = link.index in devices and devices[link.index].role == POD
        flags = s.EPX_IF_POD if pod else 0
        if pod and link.kind == "veth" and link.peer_elsewhere and not link.master:
            flags |= s.EPX_IF_PEER
        if no_redirects is not None and not link.loopback and no_redirects(link.name):
            flags |= s.EPX_IF_NO_REDIRECTS
        if mtus and not link.loopback:
            mtu = min((m for index, m in mtus.items() if index in (None, link.index)), default=0)
            flags |= min(mtu, 0xFFFF) << s.EPX_IF_MTU_SHIFT
        l3_name = names.get(link.master, link.name) if link.master else link.name
        if detector.matches_l3_device(l3_name):
            flags |= s.EPX_IF_LOCAL
        if flags:
            out[link.index] = flags
    return out


def scan(ipr) -> tuple[list[Link], list[Route]]:
    """The links and main-table IPv4 and IPv6 routes of `ipr`'s network namespace."""
    links = []
    for msg in ipr.get_links():
        info = msg.get("IFLA_LINKINFO")
        links.append(Link(
            index=msg["index"],
            name=msg.get("IFLA_IFNAME") or "",
            kind=info.get("IFLA_INFO_KIND") if info is not None else None,
            peer_elsewhere=msg.get("IFLA_LINK_NETNSID") is not None,
            loopback=bool(msg["flags"] & _IFF_LOOPBACK),
            master=msg.get("IFLA_MASTER"),
        ))
    routes = []
    for family, unspecified in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        for msg in ipr.get_routes(family=family):
            if (msg.get("RTA_TABLE") or msg["table"]) != _MAIN_TABLE:
                continue
            dst = msg.get("RTA_DST") or unspecified
            routes.append(Route(f"{dst}/{msg['dst_len']}", msg.get("RTA_OIF"), msg.get("RTA_GATEWAY")))
    return links, routes


_RTAX_MTU = "RTAX_MTU"


def route_mtus(ipr) -> dict[int | None, int]:
    """oif -> the smallest MTU metric of the IPv4 routes out of it, in every table (policy routing
    may pick any); a multipath route's under None (any device). For host routing's MTU check
    (EPX_IF_MTU_SHIFT): forwarding honours these, bpf_fib_lookup does not unless locked."""
    out: dict[int | None, int] = {}
    for msg in ipr.get_routes(family=socket.AF_INET):  # a dump: every table
        metrics = msg.get("RTA_METRICS")
        mtu = metrics.get(_RTAX_MTU) if metrics is not None else None
        if mtu:
            oif = msg.get("RTA_OIF")
            out[oif] = min(mtu, out.get(oif, mtu))
    return out


def primary_address(ipr, devices: dict[int, Device], routes: Sequence[Route], family: int = 4,
                    toward: str | None = None) -> str | None:
    """The address kube-proxy's MASQUERADE would pick for traffic leaving the node: the first
    primary IPv4 address of the external device holding the default route (else of the first
    external device that has one). IPv6 (`family` 6) has no primary address: of that device's
    global addresses (not link-local, deprecated or tentative, which the kernel's source address
    selection avoids), the one sharing the longest prefix with `toward` (RFC 6724 rule 8, as the
    kernel picks a source for a destination: the caller gives a backend's, a cluster CIDR's
    address), else the first."""
    externals = [d.index for d in sorted(devices.values(), key=lambda d: d.index) if d.role == EXTERNAL]
    default_dst = "0.0.0.0/0" if family == 4 else "::/0"
    default = [r.oif for r in routes if r.dst == default_dst and r.oif in externals]
    skip = _IFA_F_SECONDARY if family == 4 else _IFA_F_DEPRECATED | _IFA_F_TENTATIVE
    for index in default + externals:
        found = []
        for msg in ipr.get_addr(family=socket.AF_INET if family == 4 else socket.AF_INET6, index=index):
            if msg["flags"] & skip:
                continue
            addr = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
            ip = ipaddress.ip_address(addr) if addr else None
            if ip is not None and not ip.is_loopback and not (family == 6 and ip.is_link_local):
                found.append(addr)
        if found:
            return max(found, key=lambda a: _common_prefix(a, toward)) if toward else found[0]
    return None


def _common_prefix(a: str, b: str) -> int:
    """The length of the prefix addresses `a` and `b` (one family) share, in bits."""
    x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    return x.max_prefixlen - (int(x) ^ int(y)).bit_length()


@dataclass(frozen=True)
class Programs:
    """Program fds the devices get."""

    tc_ingress: int
    tc_egress: int
    xdp: int | None  # None: no XDP
    tc_lo: int | None = None  # the loopback device's ingress (bpf/lib/lo6.h); None: lo untouched


@dataclass
class Devices:
    """Keeps the TC/XDP programs attached to exactly the devices `classify` picks.

    Acts in the network namespace of the thread that calls `reconcile` (the agent's own; the
    link watcher's thread inherits it from the thread that started it).
    """

    programs: Programs
    cluster_cidrs: Sequence[str]
    pod_patterns: Sequence[str] = DEFAULT_POD_PATTERNS
    xdp_mode: str = "generic"
    detector: LocalDetector = field(default_factory=LocalDetector)
    write_ifaces: Callable[[dict[int, int]], int] | None = None  # epx_iface writer (Maps.set_ifaces)
    attached: dict[int, Device] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # device name -> last attach error
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def desired(self, ipr) -> tuple[dict[int, Device], list[Route], dict[int, int]]:
        """The devices to attach to, the routes, and epx_iface's contents."""
        links, routes = scan(ipr)
        devices = classify(links, routes, self.cluster_cidrs, self.pod_patterns)
        flags = iface_flags(links, devices, self.detector, sends_no_redirects, route_mtus(ipr))
        if self.programs.tc_lo is not None:  # after iface_flags: lo gets no flag as a device of ours
            devices.update({link.index: Device(link.index, link.name, LOOPBACK) for link in links if link.loopback})
        return devices, routes, flags

    def reconcile(self, required: bool = False) -> int:
        """Attach to new or reclassified devices, forget vanished ones. Returns attachments made.

        A device that cannot be attached is logged and retried on the next reconcile; with
        `required`, the first failure raises AttachError instead (the first sync must not report
        success with the datapath half attached)."""
        from pyroute2.iproute import IPRoute  # noqa: PLC0415 (netlink only where devices are touched)

        with self._lock, IPRoute() as ipr:
            want, _routes, flags = self.desired(ipr)
            if self.write_ifaces is not None:
                self.write_ifaces(flags)  # before attaching: a new pod device's first packet finds it
            done = 0
            for index, dev in sorted(want.items()):
                if self.attached.get(index) == dev:
                    continue
                self.errors.pop(dev.name, None)
                try:
                    self._attach(ipr, dev)
                except Exception as exc:  # pyroute2 raises NetlinkError; vanished devices too
                    message = f"device {dev.name} (ifindex {index}, {dev.role}): attaching failed: {exc}"
                    self.errors[dev.name] = message
                    if required and ipr.link_lookup(ifname=dev.name):
                        raise AttachError(message) from exc
                    log.warning("%s; retried on the next device change", message)
                    continue
                self.attached[index] = dev
                done += 1
            for index in set(self.attached) - set(want):
                log.info("device %s is gone: forgotten", self.attached.pop(index).name)
            return done

    def _attach(self, ipr, dev: Device) -> None:
        """TC is required (it makes every service decision); XDP only drops earlier what TC drops
        anyway, so a device that refuses it (another XDP program, a driver) is logged and kept.
        The loopback device gets tc_lo on its ingress and nothing else."""
        if dev.role == LOOPBACK:
            loader.attach_tc(ipr, dev.index, self.programs.tc_lo, None)
            log.info("program tc_lo attached to the loopback device %s", dev.name,
                     extra={"device": dev.name, "role": dev.role, "ifindex": dev.index})
            return
        loader.attach_tc(ipr, dev.index, self.programs.tc_ingress, self.programs.tc_egress)
        try:
            if dev.role == EXTERNAL and self.programs.xdp is not None:
                loader.attach_xdp(ipr, dev.index, self.programs.xdp, self.xdp_mode)
            else:
                loader.detach_xdp(ipr, dev.index, self.xdp_mode)
        except Exception as exc:  # pyroute2 NetlinkError
            self.errors[dev.name] = f"device {dev.name}: XDP ({self.xdp_mode}) not attached: {exc}"
            log.warning("%s; TC alone applies the same drops", self.errors[dev.name])
        log.info("programs attached to %s device %s", dev.role, dev.name,
                 extra={"device": dev.name, "role": dev.role, "ifindex": dev.index})

    def lost(self) -> dict[int, list[str]]:
        """ifindex -> what of ours is no longer on an attached device (TC filter names, the XDP
        program), for the drift audit. An XDP program that never attached (see `errors`) is not lost."""
        from pyroute2.iproute import IPRoute  # noqa: PLC0415

        out: dict[int, list[str]] = {}
        with self._lock, IPRoute() as ipr:
            for index, dev in sorted(self.attached.items()):
                try:
                    missing = loader.missing_tc(ipr, index, ingress_only=dev.role == LOOPBACK)
                    wants_xdp = dev.role == EXTERNAL and self.programs.xdp is not None and dev.name not in self.errors
                    if wants_xdp and not loader.xdp_program_id(ipr, index):
                        missing.append(loader.XDP_PROGRAM_NAME)
                except Exception:  # the device vanished meanwhile: the link watcher forgets it
                    continue
                if missing:
                    out[index] = missing
        return out

    def reattach(self, indexes: Iterable[int]) -> int:
        """Attach again to devices whose programs were removed behind our back. Returns attachments."""
        with self._lock:
            for index in indexes:
                self.attached.pop(index, None)
        return self.reconcile()

    def iface_flags(self) -> dict[int, int]:
        """What epx_iface should hold now."""
        from pyroute2.iproute import IPRoute  # noqa: PLC0415

        with self._lock, IPRoute() as ipr:
            return self.desired(ipr)[2]

    def primary_address(self, family: int = 4) -> str | None:
        """primary_address() of this node (IPv6: toward its first IPv6 cluster CIDR, where backends are)."""
        from pyroute2.iproute import IPRoute  # noqa: PLC0415

        nets = [ipaddress.ip_network(c, strict=False) for c in self.cluster_cidrs]
        toward = next((str(n.network_address) for n in nets if n.version == family), None) if family == 6 else None
        with IPRoute() as ipr:
            want, routes, _flags = self.desired(ipr)
            return primary_address(ipr, want, routes, family, toward)


def detach_all(xdp_mode: str = "generic") -> dict[str, int]:
    """Remove our TC programs (tcx, or cls_bpf filters) and XDP program from every device of the
    calling thread's netns.

    Needs no memory of what was attached (a fresh `ebpf-proxy cleanup` process): our TC programs
    are known by their names (tcx) or their filters' (cls_bpf), our XDP program by its program
    name. Returns counts: "tc", the TC hooks' programs removed, and "xdp"."""
    from pyroute2.iproute import IPRoute  # noqa: PLC0415

    counts = {"tc": 0, "xdp": 0}
    with IPRoute() as ipr:
        for msg in ipr.get_links():
            index = msg["index"]
            counts["tc"] += loader.detach_tc(ipr, index)
            counts["xdp"] += int(loader.detach_xdp(ipr, index, xdp_mode))
    return counts


class LinkWatcher:
    """Calls `on_change()` from its own thread whenever a link or an IPv4/IPv6 route appears, changes or
    goes, and every `resync` seconds regardless (a missed event heals by itself).

    The netlink socket is opened in `start()`, so events come from the caller's netns; the thread
    inherits that netns too, so `on_change` acts there.
    """

    def __init__(self, on_change: Callable[[], object], resync: float = 60.0) -> None:
        self._on_change = on_change
        self._resync = resync
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._stopping = threading.Event()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self._sock.bind((0, _RTMGRP_LINK | _RTMGRP_IPV4_ROUTE | _RTMGRP_IPV6_ROUTE))
        self._sock.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="ebpf-link-watcher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            ready, _, _ = select.select([self._sock, self._wake_r], [], [], self._resync)
            if self._stopping.is_set():
                return
            if self._sock in ready:
                self._drain()
            try:
                self._on_change()
            except Exception:  # a failed reconcile is retried on the next event or resync
                log.exception("reconciling devices after a link change failed")

    def _drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                if not self._sock.recv(65536):
                    return
            except BlockingIOError:
                return
            except OSError:  # ENOBUFS: events were lost; the reconcile that follows sees everything
                return

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        self._thread = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
