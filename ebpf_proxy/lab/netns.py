"""Build and tear down a lab's network: one netns per node, pod and client, on a shared L2.

Shape of the network (names from :mod:`ebpf_proxy.lab.naming`)::

    netns epx-L-underlay:  br0 (holds apiServerIP/32), ports n<i> (nodes) and c<i> (clients)
    netns epx-L-n-<node>:  eth0 (node ip + extraIPs, all /32)  <-veth->  n<i> on br0
                           lxc<hash> per local pod             <-veth->  eth0 in the pod
    netns epx-L-p-<pod>:   eth0 (pod ip/32), default via 169.254.1.1
    netns epx-L-c-<cli>:   eth0 (client ip/32)                  <-veth->  c<i> on br0

Routing, chosen so that any mix of subnets works (the topology may put nodes, clients and
the API server in unrelated subnets, and pods may have fixed IPs outside their podCIDR):

* Every address on the underlay (node IPs and extraIPs, client IPs, apiServerIP) is a /32,
  and every host holds a /32 ``scope link`` route to each of the others on its uplink: they
  are all neighbours on one bridge and ARP for each other directly. No subnet routes exist.
* Pod destinations go through the pod's node: every other node and every client has
  ``<podCIDR> via <node ip> onlink`` (plus ``<pod ip>/32 via <node ip> onlink`` for a pod
  whose fixed IP lies outside its node's podCIDR). The node itself has ``<pod ip>/32 dev
  lxc<hash>``.
* A pod's only route is ``default via 169.254.1.1`` (a /32 link route makes it reachable),
  with a permanent neighbour entry mapping that address to the node-side veth's MAC, and
  proxy_arp on that veth as a fallback: Calico's scheme. The pod never ARPs for real
  addresses, so pod IPs need no shared subnet with anything.
* A node with ``podBridge: NAME`` puts its pods' veths on a Linux bridge of that name instead
  (kubenet's shape): the node's route to a pod is ``<pod ip>/32 dev NAME``, the pod's neighbour
  entry for 169.254.1.1 is the bridge's MAC, and pod traffic enters the node's IP layer through
  the bridge (what kube-proxy's BridgeInterface local-traffic detector matches). Traffic still
  goes through the node at L3, pod to pod included (every pod is a /32 behind 169.254.1.1).
* Nodes' default route is ``via apiServerIP onlink``: the underlay does not forward, so
  traffic to unknown destinations dies there, as it would leaving for an internet with no
  route back. It must exist, though: a node's own connect() to a ClusterIP needs *some*
  route before iptables' OUTPUT DNAT (or anything else) can rewrite it, exactly as on a real
  node. Clients' default route is their gateway node, so externalIPs/LoadBalancer IPs
  reach the cluster.
* Every route a node or client adds carries its own primary IP as preferred source, so
  extraIPs are never picked as source by accident.

IPv6 (a topology with IPv6 in its clusterCIDR: dual-stack or IPv6-only) follows the same
scheme family by family: /128 addresses and link routes, ``<podCIDR6> via <node ip6> onlink``,
and in every pod ``default via fe80::1`` with a permanent neighbour entry for fe80::1 (the node
side's MAC, as for 169.254.1.1; Calico uses a link-local gateway the same way). Each route's
preferred source is the host's own address of the route's family; a host without an address of
a family (an IPv4-only client in a dual-stack lab) gets no routes of it.

Sysctls, all inside the lab's namespaces (never the root netns): rp_filter=0 everywhere
(service NAT creates asymmetric paths), redirects off; on nodes ip_forward=1 and
route_localnet=1 (kube-proxy relies on it for 127.0.0.1 NodePorts). In an IPv4-only lab IPv6
is off (this keeps packet captures free of DAD and router solicitations); with IPv6 it is on,
with DAD off (accept_dad=0: addresses are usable at once, no "tentative" wait), router
advertisements and solicitations off (every route is static), and on nodes
net.ipv6.conf.all.forwarding=1. TX checksum offload is
off on *every* veth end, so every packet leaves its sender with a software checksum, and a
wrong incremental checksum update in a BPF program breaks delivery here as it would on a
real NIC (see PLATFORM.md, pitfall 1).

Each node gets a cgroup v2 directory and each pod one below its node's (naming.py).

Speed: namespaces are created in-process (unshare + bind mount on the calling thread, then
setns back), netlink handles are opened in-process in each netns and reused, and checksum
offload is switched with the ethtool ioctl, so building spawns no subprocess at all.

Teardown (:func:`destroy`) needs nothing but the lab name: it finds the lab's namespaces in
/run/netns, kills every process whose netns is one of them or who sits in the lab's cgroups,
removes the cgroups deepest first and then the namespaces.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from pyroute2 import IPRoute

from ebpf_proxy import procs
from ebpf_proxy.lab import naming, nsexec
from ebpf_proxy.lab._setns import CLONE_NEWNET
from ebpf_proxy.lab.topology import PodSpec, Topology

POD_GATEWAY = "169.254.1.1"
POD_GATEWAY6 = "fe80::1"  # the pods' IPv6 default gateway, link-local like Calico's

_MNT_DETACH = 2
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_SIOCETHTOOL = 0x8946
_ETHTOOL_STXCSUM = 0x17


class LabNetError(RuntimeError):
    """Building or tearing down a lab's network failed; the message names the object."""


class LabExistsError(LabNetError):
    """A lab of that name still has namespaces or cgroups: tear it down first."""


# --- what a lab consists of ----------------------------------------------------------------


@dataclass(frozen=True)
class NodeNet:
    name: str
    ip: str
    netns: str
    cgroup: str
    uplink: str  # in the node netns, towards the underlay
    bridge_port: str  # in the underlay netns


@dataclass(frozen=True)
class PodNet:
    name: str
    node: str
    ip: str
    netns: str
    cgroup: str
    ifname: str  # inside the pod
    host_ifname: str  # the veth's node side, in the node netns


@dataclass(frozen=True)
class ClientNet:
    name: str
    ip: str
    netns: str
    gateway_ip: str
    uplink: str
    bridge_port: str


@dataclass(frozen=True)
class LabNetwork:
    """Where each part of a lab lives. Pure naming: :meth:`describe` works for a lab built
    earlier by another process, given its name and topology."""

    name: str
    topology: Topology
    underlay_netns: str
    bridge: str
    nodes: Mapping[str, NodeNet]
    pods: Mapping[str, PodNet]
    clients: Mapping[str, ClientNet]

    @classmethod
    def describe(cls, lab: str, topology: Topology) -> "LabNetwork":
        naming.validate_lab_name(lab)
        nodes = {
            n.name: NodeNet(n.name, n.ip, naming.node_netns(lab, n.name),
                            naming.node_cgroup(lab, n.name), naming.UPLINK,
                            naming.node_port_ifname(i))
            for i, n in enumerate(topology.nodes)
        }
        pods = {p.name: _pod_net(lab, topology, p.name) for p in topology.pods}
        clients = {
            c.name: ClientNet(c.name, c.ip, naming.client_netns(lab, c.name),
                              topology.node(c.gateway).ip, naming.UPLINK,
                              naming.client_port_ifname(i))
            for i, c in enumerate(topology.clients)
        }
        return cls(lab, topology, naming.underlay_netns(lab), naming.BRIDGE,
                   MappingProxyType(nodes), MappingProxyType(pods), MappingProxyType(clients))

    def all_netns(self) -> list[str]:
        return [self.underlay_netns, *(n.netns for n in self.nodes.values()),
                *(p.netns for p in self.pods.values()), *(c.netns for c in self.clients.values())]


def _pod_net(lab: str, topology: Topology, pod_name: str) -> PodNet:
    pod = topology.pod(pod_name)
    return PodNet(pod.name, pod.node, pod.ip, naming.pod_netns(lab, pod.name),
                  naming.pod_cgroup(lab, pod.node, pod.name), naming.POD_IFNAME,
                  naming.pod_host_ifname(pod.name))


# --- kernel primitives -----------------------------------------------------------------------

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _share_netns_dir() -> None:
    """Make /run/netns a shared mount, as ``ip netns add`` does, so netns bind mounts (and
    their removal) propagate into mount namespaces copied from ours."""
    path = naming.NETNS_DIR.encode()
    os.makedirs(naming.NETNS_DIR, exist_ok=True)
    if _libc.mount(b"", path, b"none", _MS_SHARED | _MS_REC, None) == 0:
        return
    if _libc.mount(path, path, b"none", _MS_BIND | _MS_REC, None) != 0:
        raise _errno_error(f"bind-mounting {naming.NETNS_DIR} onto itself")
    if _libc.mount(b"", path, b"none", _MS_SHARED | _MS_REC, None) != 0:
        raise _errno_error(f"making {naming.NETNS_DIR} a shared mount")


def create_netns(name: str) -> None:
    """Create the named netns without forking: the calling thread unshares its netns, bind
    mounts it to /run/netns/NAME and returns to the netns it came from."""
    path = nsexec.netns_path(name)
    if not os.path.isdir(naming.NETNS_DIR):  # a fresh machine: nothing has made a netns yet
        _share_netns_dir()
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    except FileExistsError:
        raise LabExistsError(f"network namespace {name!r} already exists ({path})") from None
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.unshare(CLONE_NEWNET) != 0:
            raise _errno_error(f"unshare(CLONE_NEWNET) for netns {name!r}")
        try:
            if _libc.mount(b"/proc/thread-self/ns/net", path.encode(), b"none", _MS_BIND,
                           None) != 0:
                raise _errno_error(f"bind-mounting the new netns on {path}")
        finally:
            nsexec.setns_fd(saved)
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(saved)


def delete_netns(name: str) -> None:
    """Unmount and unlink /run/netns/NAME; the kernel frees the netns (and every interface
    in it, which takes the veth peers elsewhere along) once no process holds it."""
    path = nsexec.netns_path(name)
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # EINVAL: a stale file, never mounted
            raise OSError(err, f"unmounting netns {name!r} ({path}): {os.strerror(err)}")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_sysctls(netns: str, values: Mapping[str, str | int]) -> None:
    """Write /proc/sys/<key> (``net/ipv4/ip_forward`` style keys) inside ``netns``: /proc/sys/net
    resolves to the netns of the thread opening the file."""
    with nsexec.in_netns(netns):
        for key, value in values.items():
            path = f"/proc/sys/{key}"
            try:
                with open(path, "w") as f:
                    f.write(f"{value}\n")
            except FileNotFoundError:
                if key.startswith("net/ipv6/"):
                    continue  # kernel without IPv6: nothing to switch off
                raise LabNetError(f"netns {netns!r}: sysctl {path} does not exist") from None
            except OSError as e:
                raise LabNetError(f"netns {netns!r}: writing {value} to {path}: {e}") from e


def _tx_csum_off(sock: socket.socket, ifname: str) -> None:
    """``ethtool -K IFNAME tx off`` through the ethtool ioctl, on ``sock``'s netns."""
    value = ctypes.create_string_buffer(struct.pack("II", _ETHTOOL_STXCSUM, 0))
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value))
    try:
        fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
    except OSError as e:
        raise LabNetError(f"turning TX checksum offload off on {ifname}: {e.strerror}") from e


class _Netns:
    """Open handles into one lab netns: a netlink socket and an ioctl socket, both created in
    the netns in-process, so they act there whichever thread's netns we are in later."""

    def __init__(self, name: str):
        self.name = name
        with nsexec.in_netns(name):
            nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)
            self.ioctl_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # use_socket: pyroute2 otherwise opens a fresh socket per calling thread, in that
            # thread's netns; with it, use from another thread fails loudly instead.
            self.ipr = IPRoute(use_socket=nl, groups=0)
        except BaseException:
            nl.close()
            self.ioctl_sock.close()
            raise

    def close(self) -> None:
        self.ipr.close()
        self.ioctl_sock.close()

    def index(self, ifname: str) -> int:
        found = self.ipr.link_lookup(ifname=ifname)
        if not found:
            raise LabNetError(f"netns {self.name!r}: no interface {ifname!r}")
        return found[0]

    def up(self, ifname: str, **extra) -> int:
        idx = self.index(ifname)
        self.ipr.link("set", index=idx, state="up", **extra)
        return idx

    def mac(self, ifname: str) -> str:
        return self.ipr.link("get", index=self.index(ifname))[0].get("address")

    def add_addr(self, idx: int, ip) -> None:
        prefixlen = 128 if ":" in str(ip) else 32
        self.ipr.addr("add", index=idx, address=str(ip), prefixlen=prefixlen)

    def link_route(self, idx: int, dst, src) -> None:
        """``dst dev IDX scope link src SRC``: dst is a neighbour on that link. (IPv6 has no
        route scopes: a route without gateway is on-link.)"""
        kw = {"prefsrc": str(src)} if src is not None else {}
        if ":" in str(dst):
            kw["family"] = socket.AF_INET6
        else:
            kw["scope"] = "link"
        self.ipr.route("add", dst=str(dst), oif=idx, **kw)

    def via_route(self, idx: int, dst, gateway, src) -> None:
        """``dst via GATEWAY dev IDX onlink src SRC``."""
        kw = {"family": socket.AF_INET6} if ":" in str(gateway) else {}
        self.ipr.route("add", dst=str(dst), gateway=str(gateway), oif=idx, flags=["onlink"],
                       prefsrc=str(src), **kw)

    def del_route(self, dst) -> None:
        try:
            self.ipr.route("del", dst=str(dst), **({"family": socket.AF_INET6} if ":" in str(dst) else {}))
        except Exception as e:  # pyroute2 NetlinkError: ESRCH when already gone
            if getattr(e, "code", None) != errno.ESRCH:
                raise

    def tx_off(self, *ifnames: str) -> None:
        for ifname in ifnames:
            _tx_csum_off(self.ioctl_sock, ifname)


def _netns_sysctls(forwarding: bool, ipv6: bool = False) -> dict[str, int]:
    values: dict[str, int] = {}
    for scope in ("all", "default"):
        values[f"net/ipv6/conf/{scope}/disable_ipv6"] = 0 if ipv6 else 1
        if ipv6:
            values[f"net/ipv6/conf/{scope}/accept_dad"] = 0
            values[f"net/ipv6/conf/{scope}/accept_ra"] = 0
            values[f"net/ipv6/conf/{scope}/router_solicitations"] = 0
        values[f"net/ipv4/conf/{scope}/rp_filter"] = 0
        values[f"net/ipv4/conf/{scope}/accept_redirects"] = 0
        values[f"net/ipv4/conf/{scope}/send_redirects"] = 0
        values[f"net/ipv4/conf/{scope}/arp_ignore"] = 0
        if forwarding:
            values[f"net/ipv4/conf/{scope}/route_localnet"] = 1
    if forwarding:
        values["net/ipv4/ip_forward"] = 1
        # REJECT answers with ICMP port-unreachable; the default rate limit (1/s per peer after
        # a small burst) would turn most of a burst of probes into "timeout".
        values["net/ipv4/icmp_ratelimit"] = 0
        if ipv6:
            values["net/ipv6/conf/all/forwarding"] = 1
            values["net/ipv6/icmp/ratelimit"] = 0
    return values


def _new_netns(name: str, forwarding: bool, ipv6: bool = False) -> _Netns:
    create_netns(name)
    _write_sysctls(name, _netns_sysctls(forwarding, ipv6))  # before any interface: "default" applies
    ns = _Netns(name)
    ns.up("lo")
    return ns


def _make_cgroup(path: str) -> None:
    if not path.startswith(naming.CGROUP_PARENT + os.sep):
        raise LabNetError(f"cgroup {path!r} lies outside {naming.CGROUP_PARENT}")
    if not os.path.isdir(naming.CGROUP_MOUNT):
        raise LabNetError(f"cgroup v2 is not mounted at {naming.CGROUP_MOUNT}")
    for attempt in range(3):  # another lab's teardown may remove the shared parent meanwhile
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


# --- build ----------------------------------------------------------------------------------


def lab_exists(lab: str) -> bool:
    naming.validate_lab_name(lab)
    return bool(naming.lab_netns_names(lab)) or os.path.isdir(naming.lab_cgroup(lab))


def build(lab: str, topology: Topology) -> LabNetwork:
    """Create lab ``lab``'s whole network for ``topology``; return where everything lives.

    Raises LabExistsError if anything of that lab already exists. On any failure, removes
    what it made (via :func:`destroy`) before raising.
    """
    net = LabNetwork.describe(lab, topology)
    if lab_exists(lab):
        raise LabExistsError(
            f"lab {lab!r} already exists (netns {naming.lab_netns_names(lab) or 'none'}, "
            f"cgroup {naming.lab_cgroup(lab)}): tear it down first (ebpf-proxy lab down {lab})"
        )
    _share_netns_dir()
    handles: dict[str, _Netns] = {}
    try:
        _build(net, handles)
    except BaseException:
        for h in handles.values():
            h.close()
        handles.clear()
        destroy(lab)
        raise
    finally:
        for h in handles.values():
            h.close()
    return net


def _build(net: LabNetwork, handles: dict[str, _Netns]) -> None:
    topo = net.topology
    v6 = topo.has_ipv6
    under = handles[net.underlay_netns] = _new_netns(net.underlay_netns, forwarding=False, ipv6=v6)
    # STP off: ports forward at once; with IPv6, multicast snooping off too, so neighbour
    # solicitations reach every port without waiting for MLD reports
    under.ipr.link("add", ifname=net.bridge, kind="bridge", **({"br_mcast_snooping": 0} if v6 else {}))
    br = under.up(net.bridge)
    for api_ip in topo.api_server_ips:
        under.add_addr(br, api_ip)

    hosts = [(n.netns, n.bridge_port, n.ip, topo.node(n.name).all_ips, True)
             for n in net.nodes.values()]
    hosts += [(c.netns, c.bridge_port, c.ip, topo.client(c.name).ips, False) for c in net.clients.values()]
    for netns, port, _ip, ips, is_node in hosts:
        ns = handles[netns] = _new_netns(netns, forwarding=is_node, ipv6=v6)
        ns.ipr.link("add", ifname=naming.UPLINK, kind="veth",
                    peer={"ifname": port, "net_ns_fd": net.underlay_netns})
        under.up(port, master=br)
        under.tx_off(port)
        idx = ns.up(naming.UPLINK)
        ns.tx_off(naming.UPLINK)
        for ip in ips:
            ns.add_addr(idx, ip)

    # Underlay: a /32 link route to every host on the bridge (replies from the API server).
    api_src = _by_version(topo.api_server_ips)
    for _netns, _port, _ip, ips, _node in hosts:
        for ip in ips:
            under.link_route(br, ip, api_src.get(_version(ip)))

    for node in net.nodes.values():
        _route_host(handles[node.netns], topo, topo.node(node.name).ips, gateways=topo.api_server_ips,
                    skip_node=node.name)
        _make_cgroup(node.cgroup)
    _make_cgroup(naming.apiserver_cgroup(net.name))
    for client in net.clients.values():
        _route_host(handles[client.netns], topo, topo.client(client.name).ips,
                    gateways=topo.node(topo.client(client.name).gateway).ips, skip_node=None)

    for pod in net.pods.values():
        _attach_pod(net, handles[net.nodes[pod.node].netns], pod)


def _version(ip: str) -> int:
    return 6 if ":" in ip else 4


def _by_version(ips) -> dict[int, str]:
    """The first address of each family (a host's primary address of that family)."""
    out: dict[int, str] = {}
    for ip in ips:
        out.setdefault(_version(ip), ip)
    return out


def _route_host(ns: _Netns, topo: Topology, own_ips, gateways, skip_node: str | None) -> None:
    """Routes of a node or client, per family it has an address of: host link routes to every
    other underlay address, pod prefixes via their node, default via the family's gateway."""
    idx = ns.index(naming.UPLINK)
    own = _by_version(own_ips)
    neighbours = list(topo.api_server_ips)
    for node in topo.nodes:
        if node.name != skip_node:
            neighbours.extend(node.all_ips)
    neighbours.extend(ip for c in topo.clients for ip in c.ips)
    for ip in neighbours:
        src = own.get(_version(ip))
        if src is not None and ip not in own_ips:
            ns.link_route(idx, ip, src)
    for node in topo.nodes:
        if node.name == skip_node:
            continue
        via = _by_version(node.ips)
        for prefix in topo.pod_prefixes(node.name):
            version = _version(prefix)
            if version in own and version in via:
                ns.via_route(idx, prefix, via[version], own[version])
    for version, gateway in _by_version(gateways).items():
        if version in own:
            ns.via_route(idx, "0.0.0.0/0" if version == 4 else "::/0", gateway, own[version])


def _attach_pod(net: LabNetwork, node_ns: _Netns, pod: PodNet) -> None:
    """Create the pod's netns, its veth to the node, addresses, routes and cgroup."""
    node_src = _by_version(net.topology.node(pod.node).ips)
    pod_ips = net.topology.pod(pod.name).ips
    bridge = net.topology.node(pod.node).pod_bridge
    pod_ns = _new_netns(pod.netns, forwarding=False, ipv6=net.topology.has_ipv6)
    try:
        node_ns.ipr.link("add", ifname=pod.host_ifname, kind="veth",
                         peer={"ifname": pod.ifname, "net_ns_fd": pod.netns})
        if bridge:
            gateway_dev = bridge
            route_idx = _pod_bridge(node_ns, bridge)
            node_ns.up(pod.host_ifname, master=route_idx)
        else:
            gateway_dev = pod.host_ifname
            _write_sysctls(node_ns.name, {f"net/ipv4/conf/{pod.host_ifname}/proxy_arp": 1})
            route_idx = node_ns.up(pod.host_ifname)
        node_ns.tx_off(pod.host_ifname)
        for ip in pod_ips:
            version = _version(ip)
            node_ns.link_route(route_idx, f"{ip}/{32 if version == 4 else 128}", node_src.get(version))

        idx = pod_ns.up(pod.ifname)
        pod_ns.tx_off(pod.ifname)
        gateway_mac = node_ns.mac(gateway_dev)
        for ip in pod_ips:
            pod_ns.add_addr(idx, ip)
            if _version(ip) == 4:
                pod_ns.ipr.neigh("add", dst=str(POD_GATEWAY), lladdr=gateway_mac, ifindex=idx)
                pod_ns.link_route(idx, f"{POD_GATEWAY}/32", ip)
                pod_ns.ipr.route("add", dst="0.0.0.0/0", gateway=str(POD_GATEWAY), oif=idx)
            else:
                pod_ns.ipr.neigh("add", dst=POD_GATEWAY6, lladdr=gateway_mac, ifindex=idx,
                                 family=socket.AF_INET6)
                pod_ns.ipr.route("add", dst="::/0", gateway=POD_GATEWAY6, oif=idx, family=socket.AF_INET6)
    finally:
        pod_ns.close()
    _make_cgroup(pod.cgroup)


def _pod_bridge(node_ns: _Netns, name: str) -> int:
    """The node's pod bridge, created with its first pod: up, proxy_arp as the veths have it."""
    found = node_ns.ipr.link_lookup(ifname=name)
    if found:
        return found[0]
    node_ns.ipr.link("add", ifname=name, kind="bridge")
    # a bridge takes its lowest port's MAC unless one is set: set its own, so that the pods'
    # permanent neighbour entries for the gateway stay right as pods come and go
    node_ns.ipr.link("set", index=node_ns.index(name), address=node_ns.mac(name))
    _write_sysctls(node_ns.name, {f"net/ipv4/conf/{name}/proxy_arp": 1, f"net/ipv4/conf/{name}/rp_filter": 0})
    idx = node_ns.up(name)
    node_ns.tx_off(name)
    return idx


def _outside_prefixes(topo: Topology, pod_name: str) -> list[str]:
    """The host routes (/32, /128) other hosts need to reach the pod: one per address of it
    that lies outside its node's podCIDR of that family."""
    pod = topo.pod(pod_name)
    return [p for p in topo.pod_prefixes(pod.node)
            if p.split("/")[0] in pod.ips and p.endswith(("/32", "/128"))]


def add_pod(lab: str, topology: Topology, pod: PodSpec | str) -> PodNet:
    """Add a pod (spec or name) to running lab ``lab``; ``topology`` must already contain it
    (e.g. ``topology.with_pod(...)``). If its IP lies outside its node's podCIDR, every other
    node and client gets a /32 route to it via the pod's node."""
    pod_name = pod if isinstance(pod, str) else pod.name
    net = LabNetwork.describe(lab, topology)
    pod = net.pods[pod_name]
    node = net.nodes[pod.node]
    if not nsexec.netns_exists(node.netns):
        raise LabNetError(f"pod {pod_name!r}: node netns {node.netns!r} does not exist; "
                          f"is lab {lab!r} up?")
    if nsexec.netns_exists(pod.netns):
        raise LabExistsError(f"pod {pod_name!r}: netns {pod.netns!r} already exists")
    node_ns = _Netns(node.netns)
    try:
        _attach_pod(net, node_ns, pod)
        via = _by_version(topology.node(pod.node).ips)
        for prefix in _outside_prefixes(topology, pod_name):
            version = _version(prefix)
            for other in _route_holders(net, skip_node=pod.node):
                src = _by_version(_own_ips(net, other)).get(version)
                if src is None:
                    continue
                with _closing(_Netns(other)) as ns:
                    ns.via_route(ns.index(naming.UPLINK), prefix, via[version], src)
    except BaseException:
        _teardown_pod(net, pod)
        raise
    finally:
        node_ns.close()
    return pod


def remove_pod(lab: str, topology: Topology, pod: PodSpec | str) -> None:
    """Remove a pod (spec or name, still listed in ``topology``) from running lab ``lab``:
    kill its processes, remove its cgroup, veth and netns, and any /32 routes other hosts
    had to it. Idempotent."""
    pod_name = pod if isinstance(pod, str) else pod.name
    net = LabNetwork.describe(lab, topology)
    pod = net.pods[pod_name]
    for prefix in _outside_prefixes(topology, pod_name):
        for other in _route_holders(net, skip_node=pod.node):
            if nsexec.netns_exists(other):
                with _closing(_Netns(other)) as ns:
                    ns.del_route(prefix)
    _teardown_pod(net, pod)


def _teardown_pod(net: LabNetwork, pod: PodNet) -> None:
    node_netns = net.nodes[pod.node].netns
    if nsexec.netns_exists(node_netns):
        # Delete the veth now: a netns is freed asynchronously, and a pod of the same name
        # added right after would otherwise find its lxc name still taken.
        with _closing(_Netns(node_netns)) as ns:
            found = ns.ipr.link_lookup(ifname=pod.host_ifname)
            if found:
                ns.ipr.link("del", index=found[0])
    netns = [pod.netns] if nsexec.netns_exists(pod.netns) else []
    cgroups = _cgroup_tree(pod.cgroup)
    _kill(_pids_in(netns, cgroups))
    _remove_cgroups(cgroups)
    if netns:
        delete_netns(pod.netns)


def _route_holders(net: LabNetwork, skip_node: str) -> list[str]:
    return [n.netns for n in net.nodes.values() if n.name != skip_node] + [
        c.netns for c in net.clients.values()]


def _own_ips(net: LabNetwork, netns: str) -> tuple[str, ...]:
    for n in net.nodes.values():
        if n.netns == netns:
            return net.topology.node(n.name).ips
    for c in net.clients.values():
        if c.netns == netns:
            return net.topology.client(c.name).ips
    raise LabNetError(f"netns {netns!r} is neither a node nor a client of lab {net.name!r}")


class _closing:
    def __init__(self, ns: _Netns):
        self.ns = ns

    def __enter__(self) -> _Netns:
        return self.ns

    def __exit__(self, *exc) -> None:
        self.ns.close()


# --- teardown -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Teardown:
    """What :func:`destroy` removed (empty when there was nothing left)."""

    lab: str
    killed: tuple[int, ...]
    cgroups: tuple[str, ...]
    netns: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not (self.killed or self.cgroups or self.netns)


def destroy(lab: str) -> Teardown:
    """Remove everything of lab ``lab``: its processes, cgroups and namespaces.

    Needs no state file, works after a crash, and is idempotent. Only ever touches objects
    carrying the lab's prefix, and never the calling process.
    """
    naming.validate_lab_name(lab)
    netns = naming.lab_netns_names(lab)
    cgroup_root = naming.lab_cgroup(lab)
    cgroups = _cgroup_tree(cgroup_root)
    killed = _kill(_pids_in(netns, cgroups))
    _remove_cgroups(cgroups)
    for name in netns:
        delete_netns(name)
    try:
        os.rmdir(naming.CGROUP_PARENT)  # shared by all labs: only if now empty
    except OSError:
        pass
    return Teardown(lab, tuple(sorted(killed)), tuple(cgroups), tuple(netns))


def destroy_all() -> list[Teardown]:
    """Destroy every lab that has leftovers on this machine (``lab down --all``)."""
    return [destroy(lab) for lab in naming.leftover_labs()]


def _cgroup_tree(root: str) -> list[str]:
    """Every cgroup directory under (and including) ``root``, deepest first."""
    if not os.path.isdir(root):
        return []
    found = [dirpath for dirpath, _dirs, _files in os.walk(root, topdown=False)]
    return found


def _netns_ids(names: Iterable[str]) -> set[tuple[int, int]]:
    ids = set()
    for name in names:
        try:
            st = os.stat(nsexec.netns_path(name))
        except FileNotFoundError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return ids


def _protected_pids() -> set[int]:
    """This process and its ancestors: teardown must never kill its own caller."""
    pids, pid = {0, 1}, os.getpid()
    while pid is not None and pid > 1:
        pids.add(pid)
        pid = procs.parent(pid)
    return pids


def _pids_in(netns: Iterable[str], cgroups: Iterable[str]) -> set[int]:
    """Processes whose netns is one of ``netns`` or that sit in one of ``cgroups``."""
    ids = _netns_ids(netns)
    pids: set[int] = set()
    if ids:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in ids:
                pids.add(int(entry))
    for cg in cgroups:
        try:
            with open(os.path.join(cg, "cgroup.procs")) as f:
                pids.update(int(line) for line in f if line.strip())
        except FileNotFoundError:
            continue
    return pids - _protected_pids()


def _kill(pids: set[int], grace: float = 1.0, hard_deadline: float = 5.0) -> set[int]:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL and wait; return the pids signalled."""
    signalled = set()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a frozen process (`lab apiserver freeze`) exits only once continued
            signalled.add(pid)
        except ProcessLookupError:
            pass
    remaining = _wait_gone(signalled, grace)
    for pid in remaining:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    still = _wait_gone(remaining, hard_deadline)
    if still:
        raise LabNetError(f"processes {sorted(still)} survived SIGKILL for {hard_deadline}s")
    return signalled


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if procs.alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = {p for p in left if procs.alive(p)}
    return left


def _remove_cgroups(paths: Iterable[str], timeout: float = 2.0) -> None:
    """rmdir each cgroup (given deepest first); EBUSY while exiting tasks drain is retried."""
    for path in paths:
        if not path.startswith(naming.CGROUP_PARENT + os.sep):
            raise LabNetError(f"refusing to remove cgroup {path!r} outside {naming.CGROUP_PARENT}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                    raise LabNetError(f"cannot remove cgroup {path}: {e.strerror}") from e
                time.sleep(0.02)
