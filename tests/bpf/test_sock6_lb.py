"""The socket LB for AF_INET6 sockets (sock_connect6/sendmsg6/recvmsg6), attached for real to a
cgroup this test makes, with real sockets of a node namespace (netlab.py's, given IPv6 too).

An AF_INET6 socket names two kinds of destination, and both are tested with one body each:
  ipv6    an IPv6 frontend: decided over the IPv6 maps while CFG6_F_ON is set (as the TC path)
  mapped  ::ffff:<IPv4 frontend>: IPv4 on the wire, decided over the IPv4 maps whatever CFG6_F_ON
          says, the backend written back mapped
(the AF_INET socket's own tests are test_attach.py's).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import textwrap

import pytest

from ebpf_proxy.datapath.ebpf import loader
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import Backend, Frontend, Maps6, Service
from tests.bpf import netlab, world6
from tests.bpf.netlab import BACKEND_IP, NODE_BACKEND_SIDE, sh
from tests.netns_util import nsenter

pytestmark = [pytest.mark.bpf, pytest.mark.root]

PORT, BACKEND_PORT = 80, 8080
# netlab's links, given IPv6 too (/64 each): role -> (node's device, node's address, peer's address)
LINKS6 = {
    "pod": ("vpod", "fd10:244::1", world6.POD6),
    "backend": ("vbe", "fd10:244:1::1", "fd10:244:1::31"),
    "outside": ("vout", "2001:db8:113::1", world6.OUTSIDE6),
}
NODE6_BACKEND_SIDE, BACKEND6 = LINKS6["backend"][1:]
VIP6, DEAD_VIP6, AFFINITY_VIP6 = "fd00:96::10", "fd00:96::99", "fd00:96::20"
VIP4, DEAD_VIP4 = "10.96.0.10", "10.96.0.99"
AFFINITY = 10800  # seconds (sessionAffinity=ClientIP's default)

# family -> (the frontend the socket names, a frontend without endpoints, what the backend sees as
# the node's address, how the frontend reads back as a peer)
FAMILIES = {
    "ipv6": (VIP6, DEAD_VIP6, NODE6_BACKEND_SIDE, VIP6),
    "mapped": (f"::ffff:{VIP4}", f"::ffff:{DEAD_VIP4}", f"::ffff:{NODE_BACKEND_SIDE}", f"::ffff:{VIP4}"),
}

# TCP and UDP on [::] without IPV6_V6ONLY: IPv6 clients and IPv4 ones (seen mapped) alike; both answer
# with the peer address they saw
SERVER = textwrap.dedent("""
    import selectors, socket, sys
    port = int(sys.argv[1])
    def bound(kind):
        s = socket.socket(socket.AF_INET6, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", port))
        return s
    t, u = bound(socket.SOCK_STREAM), bound(socket.SOCK_DGRAM)
    t.listen(16)
    sel = selectors.DefaultSelector(); sel.register(t, selectors.EVENT_READ); sel.register(u, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is t:
                c, peer = t.accept(); c.sendall(("%s|%d" % peer[:2]).encode()); c.close()
            else:
                data, peer = u.recvfrom(2048); u.sendto(("%s|%d" % peer[:2]).encode(), peer)
""")

# one call from an AF_INET6 socket: "ok <seen by the backend> <peer>" or "error <exception>"
CALL = textwrap.dedent("""
    import socket, sys
    proto, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        c = socket.socket(socket.AF_INET6, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
        c.settimeout(3)
        if proto == "tcp":
            c.connect((host, port)); data, peer = c.recv(200), c.getpeername()
        else:
            c.sendto(b"hi", (host, port)); data, peer = c.recvfrom(200)
        print("ok", data.decode(), "%s|%d" % peer[:2])
    except OSError as e:
        print("error", type(e).__name__)
""")


def add_ipv6(lab: netlab.NetLab) -> None:
    """Give netlab's node and peers their LINKS6 addresses (no duplicate address detection: usable at
    once), the peers a default route through the node, and the node IPv6 forwarding."""
    node = lab.ns["node"]
    sh("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1", ns=node)
    for role, (dev, node_addr, peer_addr) in LINKS6.items():
        sh("ip", "addr", "add", f"{node_addr}/64", "dev", dev, "nodad", ns=node)
        sh("ip", "addr", "add", f"{peer_addr}/64", "dev", "eth0", "nodad", ns=lab.ns[role])
        sh("ip", "-6", "route", "add", "default", "via", node_addr, ns=lab.ns[role])


@contextlib.contextmanager
def dual_stack_server(lab: netlab.NetLab):
    """SERVER on the backend, on BACKEND_PORT, until the block ends."""
    server = subprocess.Popen([*nsenter(lab.ns["backend"]), sys.executable, "-c", SERVER, str(BACKEND_PORT)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield server
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def lab6(datapath, maps):
    """netlab's node with IPv6 too, the dual-stack server on the backend, the services of both
    families, and the socket LB attached to a cgroup of the test's own."""
    with netlab.NetLab() as lab, dual_stack_server(lab):
        add_ipv6(lab)
        _install_services(maps)
        cgroup = lab.cgroup()
        loader.attach_cgroup(datapath, cgroup)
        try:
            maps.reset_stats()
            yield lab, cgroup
        finally:
            loader.detach_cgroup(datapath, cgroup)


def _install_services(maps) -> None:
    world6.install_node6(maps)
    world6.install6(
        maps,
        world6.Svc6(id=1, frontends=((VIP6, PORT, 0),), cluster=((BACKEND6, BACKEND_PORT),)),
        world6.Svc6(id=2, frontends=((VIP6, PORT, 0),), cluster=((BACKEND6, BACKEND_PORT),), proto=world6.UDP_P),
        world6.Svc6(id=3, frontends=((DEAD_VIP6, PORT, 0),), flags=0),
        world6.Svc6(id=4, frontends=((AFFINITY_VIP6, PORT, 0),), cluster=((BACKEND6, BACKEND_PORT),),
                    affinity=AFFINITY),
    )
    for proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
        svc_id = 10 + proto
        maps.set_backend(svc_id, Backend(BACKEND_IP, BACKEND_PORT))
        maps.set_slots(svc_id, s.LB4_SCOPE_CLUSTER, [svc_id])
        maps.set_service(Frontend(VIP4, PORT, proto), Service(svc_id, 1, 0, 0, s.LB4_F_HAS_ENDPOINTS))
        maps.set_service(Frontend(DEAD_VIP4, PORT, proto), Service(svc_id + 100, 0, 0, 0, 0))


def call(lab, cgroup, proto: str, host: str, port: int = PORT, role: str = "node") -> list[str]:
    """One call from an AF_INET6 socket of a process of `role`'s netns (in `cgroup`, if given)."""
    py = [sys.executable, "-c", CALL, proto, host, str(port)]
    if cgroup is None:
        return sh(*py, ns=lab.ns[role]).stdout.split()
    script = f'echo $$ > {cgroup}/cgroup.procs && exec nsenter --net=/run/netns/{lab.ns[role]} "$@"'
    return sh("sh", "-c", script, "sh", *py).stdout.split()


def counted(maps) -> dict[s.Reason, int]:
    return {reason: packets for reason, (packets, _) in maps.stats().items() if packets}


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_node_socket_reaches_the_backend(lab6, maps, family, proto):
    """connect6/sendmsg6 send the node's call to the backend; the backend sees the node's own
    address (the kernel's pick for the backend's route: kube-proxy's masquerade); a UDP reply
    reads back (recvmsg6) as coming from the frontend."""
    lab, cgroup = lab6
    frontend, _, node_addr, peer = FAMILIES[family]
    result = call(lab, cgroup, proto, frontend)
    assert result[0] == "ok", result
    assert result[1].rsplit("|", 1)[0] == node_addr, "the backend saw the node's address"
    counts = counted(maps)
    assert counts.get(s.Reason.SOCK_FWD, 0) >= 1
    if proto == "udp":
        assert result[2] == f"{peer}|{PORT}", "recvmsg6 shows the frontend, not the backend"
        assert counts.get(s.Reason.SOCK_REV, 0) >= 1
        rev_map = "epx_sock_rev6" if family == "ipv6" else "epx_sock_rev"
        assert maps.count(rev_map) >= 1, f"{rev_map} holds the socket's way back"


@pytest.mark.parametrize("family", FAMILIES)
def test_service_without_endpoints_refuses(lab6, maps, family):
    lab, cgroup = lab6
    assert call(lab, cgroup, "tcp", FAMILIES[family][1]) == ["error", "ConnectionRefusedError"]
    assert counted(maps).get(s.Reason.SOCK_REJECT, 0) == 1


def test_ipv6_off_leaves_ipv6_alone_but_serves_mapped(lab6, maps):
    """CFG6_F_ON unset (ip6tables serves the node's IPv6 Services): an IPv6 destination is left as
    it is (the node has no route to the clusterIP: the call fails unrouted), while an IPv4-mapped
    one is IPv4 traffic, which the eBPF datapath serves all the same."""
    lab, cgroup = lab6
    Maps6(maps).set_config6(world6.NODE6, on=False)
    for proto in ("tcp", "udp"):
        assert call(lab, cgroup, proto, VIP6)[0] == "error"
    assert s.Reason.SOCK_FWD not in counted(maps)
    assert maps.count("epx_sock_rev6") == 0
    assert call(lab, cgroup, "tcp", FAMILIES["mapped"][0])[0] == "ok"
    assert counted(maps).get(s.Reason.SOCK_FWD) == 1


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_address_without_a_service_is_untouched(lab6, maps, proto):
    """The backend's own address is no frontend: the call goes there as it is, nothing remembered."""
    lab, cgroup = lab6
    result = call(lab, cgroup, proto, BACKEND6, BACKEND_PORT)
    assert result[0] == "ok" and result[2] == f"{BACKEND6}|{BACKEND_PORT}", result
    assert not {s.Reason.SOCK_FWD, s.Reason.SOCK_REV} & set(counted(maps))
    assert maps.count("epx_sock_rev6") == 0


def test_session_affinity_remembers_the_node_as_client(lab6, maps):
    """sessionAffinity=ClientIP: an unbound socket's client is the node's IPv6 masquerade address
    (epx_config6), which is what the affinity entry is keyed by."""
    lab, cgroup = lab6
    assert call(lab, cgroup, "tcp", AFFINITY_VIP6)[0] == "ok"
    remembered = maps.affinity6(4, world6.NODE6)
    assert remembered is not None and remembered[0] == 4 * 100 + 1
