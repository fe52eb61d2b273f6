"""The port plan: one backend port per (mode, path), and the bench topology serves all of them."""

import pytest

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.runner import TOPOLOGY
from ebpf_proxy.lab.topology import load_topology


def test_every_mode_and_path_has_its_own_port():
    pairs = [("direct", ports.DIRECT)] + [(m, p) for m in ports.PROXY_MODES for p in ports.TCP_PATHS]
    tcp = [ports.tcp_port(m, p) for m, p in pairs]
    assert len(set(tcp)) == len(tcp)
    udp = [ports.udp_port(m) for m in ports.MODES]
    assert len(set(udp)) == len(udp)
    assert ports.FILLER_PORT not in tcp


def test_unknown_pairs_are_refused():
    with pytest.raises(ValueError):
        ports.tcp_port("direct", "clusterip")
    with pytest.raises(ValueError):
        ports.tcp_port("ipvs", "clusterip")
    with pytest.raises(ValueError):
        ports.udp_port("ipvs")


def test_bench_topology_backends_listen_on_every_port():
    topo = load_topology(str(TOPOLOGY))
    backends = [p for p in topo.pods if p.labels.get("app") == "bench-backend"]
    assert len(backends) >= 2
    assert {p.node for p in backends} == {n.name for n in topo.nodes}, "one backend per node"
    want = ports.all_ports()
    for pod in backends:
        listen = {"tcp": set(), "udp": set()}
        for entry in pod.listen:
            port, proto = entry.split("/")
            listen[proto].add(int(port))
        assert listen == want, pod.name
    assert any(p.name == "client-1" for p in topo.pods)
    assert any(c.name == "outside" for c in topo.clients)
