"""The lab's network plumbing, for real: namespaces, veths, routes, cgroups and teardown.

Every test uses its own lab name (``t`` + random hex) and tears it down in a finalizer, so a
failing test leaves nothing behind and parallel runs do not collide.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time

import pytest

from ebpf_proxy import procs
from ebpf_proxy.lab import naming, netns, nsexec
from ebpf_proxy.lab.topology import PodSpec, load_topology, parse_topology

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, cgroups)"),
]

# A server that answers every TCP connection and UDP datagram with "<tag> <peer ip>", so a
# test sees both who answered and which source address arrived (no NAT in the plain lab).
SERVER = textwrap.dedent("""
    import socket, sys, threading
    port, tag = int(sys.argv[1]), sys.argv[2]
    tcp = socket.socket(); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port)); tcp.listen(64)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("0.0.0.0", port))
    def serve_udp():
        while True:
            data, peer = udp.recvfrom(65535)
            udp.sendto(f"{tag} {peer[0]}".encode(), peer)
    threading.Thread(target=serve_udp, daemon=True).start()
    print("ready", flush=True)
    while True:
        conn, peer = tcp.accept()
        size = int.from_bytes(conn.recv(4), "big")
        got = 0
        while got < size:
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(f"{tag} {peer[0]} {got}".encode())
        conn.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    ip, port, proto, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if proto == "tcp":
        s = socket.create_connection((ip, port), timeout=3)
        s.sendall(size.to_bytes(4, "big") + b"x" * size)
        print(s.recv(256).decode())
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
        s.sendto(b"hi", (ip, port))
        print(s.recvfrom(256)[0].decode())
""")

PORT = 8080


def _lab_name() -> str:
    return "t" + secrets.token_hex(4)


def _assert_gone(lab: str) -> None:
    assert naming.lab_netns_names(lab) == []
    assert not os.path.exists(naming.lab_cgroup(lab))
    assert lab not in naming.leftover_labs()


@pytest.fixture
def fresh_lab():
    """Yields a lab name; destroys the lab whatever the test did."""
    lab = _lab_name()
    try:
        yield lab
    finally:
        netns.destroy(lab)
        _assert_gone(lab)


def _root_snapshot() -> dict:
    """What the lab must never change in the root netns (our own threads are in it here)."""
    keys = ["net/ipv4/ip_forward", "net/ipv4/conf/all/rp_filter",
            "net/ipv4/conf/all/route_localnet", "net/ipv4/conf/default/rp_filter"]
    values = {}
    for key in keys:
        with open(f"/proc/sys/{key}") as f:
            values[key] = f.read().strip()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    values["links"] = sorted(line.split(":")[1].strip().split("@")[0]
                             for line in links.splitlines())
    return values


BUILD_SECONDS = {}
ROOT_BEFORE = {}


@pytest.fixture(scope="module")
def default_lab():
    lab = _lab_name()
    ROOT_BEFORE.update(_root_snapshot())
    started = time.perf_counter()
    try:
        net = netns.build(lab, load_topology(None))
        BUILD_SECONDS[lab] = time.perf_counter() - started
    except BaseException:
        netns.destroy(lab)
        raise
    servers: list[subprocess.Popen] = []
    try:
        yield net, servers
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
        netns.destroy(lab)
        _assert_gone(lab)


def _start_server(netns_name: str, tag: str, servers: list, cgroup: str | None = None):
    proc = nsexec.spawn(netns_name, [sys.executable, "-c", SERVER, str(PORT), tag],
                        cgroup=cgroup, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    servers.append(proc)
    line = proc.stdout.readline().decode().strip()
    assert line == "ready", f"server in {netns_name} did not start: {line!r}"
    return proc


def _talk(netns_name: str, ip: str, proto: str = "tcp", size: int = 0) -> str:
    done = nsexec.run(netns_name, [sys.executable, "-c", CLIENT, ip, str(PORT), proto, str(size)],
                      timeout=10)
    assert done.returncode == 0, f"{netns_name} -> {ip}/{proto} failed: {done.stderr}"
    return done.stdout.strip()


# --- the default topology --------------------------------------------------------------------


def test_default_topology_builds_fast(default_lab):
    net, _ = default_lab
    assert BUILD_SECONDS[net.name] < 2.0, f"building took {BUILD_SECONDS[net.name]:.2f}s"
    for name in net.all_netns():
        assert nsexec.netns_exists(name), name


def test_root_netns_is_untouched(default_lab):
    net, _ = default_lab
    after = _root_snapshot()
    assert after == ROOT_BEFORE


@pytest.mark.parametrize(
    "src, dst, proto",
    [
        ("pod:my-nginx-1", "pod:my-nginx-2", "tcp"),  # pod to pod, across nodes
        ("pod:my-nginx-2", "pod:my-nginx-1", "udp"),
        ("pod:my-nginx-1", "node:worker1", "tcp"),  # pod to its own node
        ("pod:my-nginx-1", "node:worker2", "tcp"),  # pod to another node
        ("node:worker2", "pod:my-nginx-1", "tcp"),  # node to a pod elsewhere
        ("node:worker3", "pod:my-nginx-2", "udp"),  # node to its own pod
        ("client:outside", "node:worker3", "tcp"),
        ("client:outside", "pod:my-nginx-2", "tcp"),
        ("pod:my-nginx-2", "client:outside", "tcp"),
        ("node:worker1", "node:worker3", "udp"),
    ],
)
def test_reachability_without_nat(default_lab, src, dst, proto):
    net, servers = default_lab
    where = {"pod": net.pods, "node": net.nodes, "client": net.clients}
    src_kind, src_name = src.split(":")
    dst_kind, dst_name = dst.split(":")
    source, target = where[src_kind][src_name], where[dst_kind][dst_name]
    server = _start_server(target.netns, dst_name, servers)
    try:
        reply = _talk(source.netns, target.ip, proto)
    finally:
        server.kill()
        server.wait()
    # The answer names the server, and the server saw the client's own address.
    assert reply.split()[:2] == [dst_name, source.ip]


def test_bulk_tcp_with_software_checksums(default_lab):
    """1 MiB pod to pod across nodes: segmentation and software checksums all work."""
    net, servers = default_lab
    _start_server(net.pods["my-nginx-2"].netns, "big", servers)
    reply = _talk(net.pods["my-nginx-1"].netns, net.pods["my-nginx-2"].ip, "tcp", 1 << 20)
    assert reply == f"big {net.pods['my-nginx-1'].ip} {1 << 20}"


def test_every_node_reaches_the_api_server_address(default_lab):
    net, servers = default_lab
    _start_server(net.underlay_netns, "api", servers)
    for node in net.nodes.values():
        assert _talk(node.netns, net.topology.api_server_ip).split()[:2] == ["api", node.ip]


def test_unroutable_destination_leaves_via_default_route(default_lab):
    """Nodes need a default route so a connect() to a ClusterIP reaches OUTPUT hooks."""
    net, _ = default_lab
    done = nsexec.run(net.nodes["worker1"].netns, ["ip", "-4", "route", "get", "10.96.0.10"],
                      check=True)
    assert f"via {net.topology.api_server_ip} dev eth0" in done.stdout
    assert f"src {net.nodes['worker1'].ip}" in done.stdout


def _sysctl(netns_name: str, key: str) -> str:
    return nsexec.run(netns_name, ["cat", f"/proc/sys/{key}"], check=True).stdout.strip()


def test_node_sysctls(default_lab):
    net, _ = default_lab
    for node in net.nodes.values():
        assert _sysctl(node.netns, "net/ipv4/ip_forward") == "1"
        assert _sysctl(node.netns, "net/ipv4/conf/all/route_localnet") == "1"
        assert _sysctl(node.netns, "net/ipv4/conf/all/rp_filter") == "0"
        assert _sysctl(node.netns, "net/ipv4/conf/eth0/rp_filter") == "0"
    for pod in net.pods.values():
        assert _sysctl(net.nodes[pod.node].netns,
                       f"net/ipv4/conf/{pod.host_ifname}/proxy_arp") == "1"
        assert _sysctl(pod.netns, "net/ipv4/ip_forward") == "0"


def _tx_checksumming(netns_name: str, ifname: str) -> str:
    out = nsexec.run(netns_name, ["ethtool", "-k", ifname], check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("tx-checksumming:"))
    return line.split(":", 1)[1].strip()


def test_tx_checksum_offload_is_off_on_every_veth(default_lab):
    net, _ = default_lab
    for node in net.nodes.values():
        assert _tx_checksumming(node.netns, node.uplink) == "off"
        assert _tx_checksumming(net.underlay_netns, node.bridge_port) == "off"
    for pod in net.pods.values():
        assert _tx_checksumming(net.nodes[pod.node].netns, pod.host_ifname) == "off"
        assert _tx_checksumming(pod.netns, pod.ifname) == "off"
    for client in net.clients.values():
        assert _tx_checksumming(client.netns, client.uplink) == "off"


def test_cgroups_exist_for_nodes_pods_and_apiserver(default_lab):
    net, _ = default_lab
    for node in net.nodes.values():
        assert os.path.isfile(os.path.join(node.cgroup, "cgroup.procs"))
    for pod in net.pods.values():
        assert pod.cgroup.startswith(net.nodes[pod.node].cgroup + "/")
        assert os.path.isfile(os.path.join(pod.cgroup, "cgroup.procs"))
    assert os.path.isdir(naming.apiserver_cgroup(net.name))


# --- nsexec ----------------------------------------------------------------------------------


def test_run_enters_cgroup_before_the_program_starts(default_lab):
    net, _ = default_lab
    node = net.nodes["worker2"]
    done = nsexec.run(node.netns, ["cat", "/proc/self/cgroup"], cgroup=node.cgroup, check=True)
    relative = node.cgroup[len(naming.CGROUP_MOUNT):]
    assert f"0::{relative}" in done.stdout.splitlines()


def test_spawn_places_process_in_netns_and_cgroup(default_lab):
    net, servers = default_lab
    pod = net.pods["my-nginx-1"]
    proc = nsexec.spawn(pod.netns, ["sleep", "30"], cgroup=pod.cgroup)
    servers.append(proc)
    time.sleep(0.05)
    ns_of_proc = os.stat(f"/proc/{proc.pid}/ns/net")
    ns_of_pod = os.stat(nsexec.netns_path(pod.netns))
    assert (ns_of_proc.st_dev, ns_of_proc.st_ino) == (ns_of_pod.st_dev, ns_of_pod.st_ino)
    with open(os.path.join(pod.cgroup, "cgroup.procs")) as f:
        assert str(proc.pid) in f.read().split()
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0].endswith(b"sleep")  # the shim exec'd away


def test_spawn_without_netns_stays_in_the_callers_netns():
    proc = nsexec.spawn(None, ["sleep", "5"])
    try:
        assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino
    finally:
        proc.kill()
        proc.wait()


def test_in_netns_switches_only_for_the_block(default_lab):
    net, _ = default_lab
    before = os.stat("/proc/thread-self/ns/net").st_ino
    with nsexec.in_netns(net.nodes["worker1"].netns):
        inside = os.stat("/proc/thread-self/ns/net").st_ino
    assert inside == os.stat(nsexec.netns_path(net.nodes["worker1"].netns)).st_ino
    assert os.stat("/proc/thread-self/ns/net").st_ino == before != inside


def test_in_netns_restores_after_an_exception(default_lab):
    net, _ = default_lab
    before = os.stat("/proc/thread-self/ns/net").st_ino
    with pytest.raises(ZeroDivisionError):
        with nsexec.in_netns(net.underlay_netns):
            1 / 0
    assert os.stat("/proc/thread-self/ns/net").st_ino == before


def test_nsexec_errors_name_what_is_missing(default_lab):
    net, _ = default_lab
    with pytest.raises(FileNotFoundError, match="epx-nonexistent-n-x"):
        nsexec.run("epx-nonexistent-n-x", ["true"])
    with pytest.raises(FileNotFoundError, match="no-such-command-xyz"):
        nsexec.run(net.underlay_netns, ["no-such-command-xyz"])
    with pytest.raises(FileNotFoundError, match="cgroup"):
        nsexec.run(net.underlay_netns, ["true"], cgroup=naming.lab_cgroup(net.name) + "/nope")
    with pytest.raises(subprocess.TimeoutExpired):
        nsexec.run(net.underlay_netns, ["sleep", "5"], timeout=0.2)
    with pytest.raises(subprocess.CalledProcessError):
        nsexec.run(net.underlay_netns, ["false"], check=True)
    assert nsexec.run(net.underlay_netns, ["cat"], input="hello").stdout == "hello"


# --- pods at runtime, mixed subnets ------------------------------------------------------------

MIXED = {
    "nodes": [
        {"name": "a", "ip": "172.31.0.10", "extraIPs": ["192.168.99.11"]},
        {"name": "b", "ip": "10.1.2.3"},
    ],
    "pods": [{"name": "pa", "node": "a"}],
    "clients": [{"name": "ext", "ip": "198.51.100.7", "gateway": "b"}],
    "apiServerIP": "100.64.0.1",
}


def test_unrelated_subnets_and_extra_ips_are_reachable(fresh_lab):
    net = netns.build(fresh_lab, parse_topology(MIXED))
    servers: list = []
    try:
        _start_server(net.nodes["a"].netns, "a", servers)
        assert _talk(net.clients["ext"].netns, "192.168.99.11").split()[:2] == ["a", "198.51.100.7"]
        assert _talk(net.nodes["b"].netns, "172.31.0.10").split()[:2] == ["a", "10.1.2.3"]
        _start_server(net.pods["pa"].netns, "pa", servers)
        assert _talk(net.clients["ext"].netns, net.pods["pa"].ip).split()[:2] == ["pa", "198.51.100.7"]
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def test_add_and_remove_pods_at_runtime(fresh_lab):
    topology = parse_topology(MIXED)
    netns.build(fresh_lab, topology)
    servers: list = []
    try:
        # One pod with an allocated IP, one with a fixed IP outside every podCIDR.
        topology = topology.with_pod(PodSpec(name="pb", node="b"))
        topology = topology.with_pod(PodSpec(name="odd", node="b", ip="10.250.0.7"))
        pb = netns.add_pod(fresh_lab, topology, "pb")
        odd = netns.add_pod(fresh_lab, topology, topology.pod("odd"))
        assert pb.ip == "10.244.2.2"
        with pytest.raises(netns.LabExistsError, match="pb"):
            netns.add_pod(fresh_lab, topology, "pb")  # twice: refused, the first one intact
        assert nsexec.netns_exists(pb.netns)
        net = netns.LabNetwork.describe(fresh_lab, topology)
        _start_server(odd.netns, "odd", servers)
        _start_server(pb.netns, "pb", servers)
        pa = net.pods["pa"]
        assert _talk(pa.netns, odd.ip).split()[:2] == ["odd", pa.ip]
        assert _talk(pa.netns, pb.ip).split()[:2] == ["pb", pa.ip]
        assert _talk(net.clients["ext"].netns, odd.ip).split()[:2] == ["odd", "198.51.100.7"]

        netns.remove_pod(fresh_lab, topology, "odd")
        assert not nsexec.netns_exists(odd.netns)
        assert not os.path.exists(odd.cgroup)
        routes = nsexec.run(net.nodes["a"].netns, ["ip", "-4", "route", "show", "10.250.0.7/32"],
                            check=True).stdout
        assert routes.strip() == ""
        assert all(p.poll() is not None for p in servers[:1]), "odd's server survived"
        topology = topology.without_pod("odd")

        # The same name again at once: the veth name must be free immediately.
        topology = topology.with_pod(PodSpec(name="odd", node="b", ip="10.250.0.7"))
        odd = netns.add_pod(fresh_lab, topology, "odd")
        _start_server(odd.netns, "odd2", servers)
        assert _talk(pa.netns, odd.ip).split()[:2] == ["odd2", pa.ip]
        netns.remove_pod(fresh_lab, topology, "odd")
        netns.remove_pod(fresh_lab, topology, "odd")  # idempotent
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


# --- build failures and teardown -------------------------------------------------------------


def test_build_refuses_an_existing_lab(fresh_lab):
    topology = parse_topology(MIXED)
    netns.build(fresh_lab, topology)
    with pytest.raises(netns.LabExistsError, match=fresh_lab):
        netns.build(fresh_lab, topology)
    assert nsexec.netns_exists(naming.underlay_netns(fresh_lab))  # the first one is untouched


def test_failed_build_removes_what_it_made(fresh_lab, monkeypatch):
    def broken(*_args, **_kwargs):
        raise RuntimeError("injected failure while attaching a pod")

    monkeypatch.setattr(netns, "_attach_pod", broken)
    with pytest.raises(RuntimeError, match="injected"):
        netns.build(fresh_lab, parse_topology(MIXED))
    _assert_gone(fresh_lab)


CRASHING_BUILDER = textwrap.dedent("""
    import os, sys, time
    from ebpf_proxy.lab import naming, netns, nsexec
    from ebpf_proxy.lab.topology import load_topology
    lab = sys.argv[1]
    net = netns.build(lab, load_topology(None))
    node = net.nodes["worker1"]
    pod = net.pods["my-nginx-1"]
    procs = [nsexec.spawn(node.netns, ["sleep", "600"], cgroup=node.cgroup),
             nsexec.spawn(pod.netns, ["sleep", "600"]),
             nsexec.spawn(None, ["sleep", "600"], cgroup=naming.apiserver_cgroup(lab))]
    for proc in procs:  # the cgroup shim joins its cgroup, then execs sleep: wait for that
        while b"/bin/sh" in open(f"/proc/{proc.pid}/cmdline", "rb").read():
            time.sleep(0.01)
    os._exit(0)  # crash: no teardown, no state file anywhere
""")


def test_destroy_after_a_crash_needs_no_state(fresh_lab):
    subprocess.run([sys.executable, "-c", CRASHING_BUILDER, fresh_lab], check=True, timeout=60)
    assert fresh_lab in naming.leftover_labs()
    netns_names = naming.lab_netns_names(fresh_lab)
    assert len(netns_names) == 7
    ids = {(os.stat(nsexec.netns_path(n)).st_dev, os.stat(nsexec.netns_path(n)).st_ino)
           for n in netns_names}
    orphans = netns._pids_in(netns_names, netns._cgroup_tree(naming.lab_cgroup(fresh_lab)))
    assert len(orphans) == 3

    report = netns.destroy(fresh_lab)

    assert set(report.killed) == orphans
    assert set(report.netns) == set(netns_names)
    _assert_gone(fresh_lab)
    for pid in orphans:
        assert not procs.alive(pid), f"pid {pid} survived teardown"
    for entry in os.listdir("/proc"):  # nothing at all still lives in those namespaces
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            assert (st.st_dev, st.st_ino) not in ids, f"pid {entry} still in a lab netns"
    assert netns.destroy(fresh_lab).empty  # idempotent


def test_destroy_leaves_other_labs_alone(fresh_lab):
    """Lab names are prefixes of each other's netns names only in ways naming forbids."""
    other = fresh_lab + "-x"
    try:
        netns.build(fresh_lab, parse_topology(MIXED))
        netns.build(other, parse_topology(MIXED))
        netns.destroy(fresh_lab)
        _assert_gone(fresh_lab)
        assert nsexec.netns_exists(naming.underlay_netns(other))
        assert len(naming.lab_netns_names(other)) == 5
    finally:
        netns.destroy(other)
        _assert_gone(other)
