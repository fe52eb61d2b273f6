"""The lab topology file: parsing, defaults, allocation and every way it can be wrong.

Also the lab's naming rules (pure functions, no root), which the topology's names feed.
"""

from __future__ import annotations

import copy
import json

import pytest

from ebpf_proxy.lab import naming
from ebpf_proxy.lab.topology import (
    PodSpec,
    TopologyError,
    allocate_pod_ip,
    load_topology,
    parse_listen,
    parse_topology,
    topology_from_dict,
    topology_from_yaml,
    topology_to_dict,
    with_pod,
    without_pod,
)

BASE = {
    "nodes": [
        {"name": "worker1", "ip": "172.20.20.15", "extraIPs": ["192.168.99.11"],
         "podCIDR": "10.244.5.0/24"},
        {"name": "worker2", "ip": "172.20.20.16"},
    ],
    "pods": [
        {"name": "web-1", "node": "worker1", "ip": "10.244.5.4", "labels": {"app": "web"},
         "listen": ["80/tcp", "53/udp"]},
    ],
    "clients": [{"name": "outside", "ip": "203.0.113.5"}],
}


def variant(path: str, value, base=BASE):
    """A copy of ``base`` with the value at ``path`` (``nodes.1.ip``) replaced;
    the value ``DELETE`` removes the key."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    target = data
    for part in parents:
        target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
    key = int(last) if last.isdigit() else last
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return data


DELETE = object()


# --- the default topology --------------------------------------------------------------------


def test_default_topology_is_the_articles_kind_cluster():
    t = load_topology(None)
    assert t.service_cidr == "10.96.0.0/12"
    assert t.cluster_cidr == "10.244.0.0/16"
    assert [(n.name, n.ip, n.pod_cidr) for n in t.nodes] == [
        ("worker1", "172.20.20.15", "10.244.5.0/24"),
        ("worker2", "172.20.20.16", "10.244.3.0/24"),
        ("worker3", "172.20.20.17", "10.244.4.0/24"),
    ]
    nginx = [p for p in t.pods if p.labels.get("app") == "my-nginx"]
    assert sorted((p.node, p.ip) for p in nginx) == [("worker1", "10.244.5.4"), ("worker3", "10.244.4.3")]
    assert len(nginx) == 2 == len(t.pods)
    assert sorted(p.node for p in nginx) == ["worker1", "worker3"]
    assert all(p.listen == ("80/tcp", "53/udp") for p in nginx)
    assert t.pods_on("worker2") == ()
    assert [(c.name, c.ip) for c in t.clients] == [("outside", "203.0.113.5")]
    assert t.api_server_ip == "192.0.2.1"
    assert t.kube_proxy_configuration is None


def test_load_topology_from_a_file(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(BASE))  # JSON is YAML
    t = load_topology(path)
    assert t.node("worker1").extra_ips == ("192.168.99.11",)


# --- defaults and allocation -----------------------------------------------------------------


def test_defaults_fill_in():
    t = parse_topology(BASE)
    assert t.service_cidr == "10.96.0.0/12" and t.cluster_cidr == "10.244.0.0/16"
    assert t.api_server_ip == "192.0.2.1"
    # worker2 (index 1) gets the (index+1)-th /24 of clusterCIDR.
    assert t.node("worker2").pod_cidr == "10.244.2.0/24"
    assert t.client("outside").gateway == "worker1"  # the first node
    assert t.pod("web-1").namespace == "default"


def test_default_pod_cidr_skips_explicit_ones():
    data = {"nodes": [{"name": "a", "ip": "172.20.0.1", "podCIDR": "10.244.1.0/24"},
                      {"name": "b", "ip": "172.20.0.2"},
                      {"name": "c", "ip": "172.20.0.3", "podCIDR": "10.244.3.0/24"}]}
    t = parse_topology(data)
    assert [n.pod_cidr for n in t.nodes] == ["10.244.1.0/24", "10.244.2.0/24", "10.244.3.0/24"]
    data["nodes"][1]["podCIDR"] = "10.244.0.0/23"
    data["nodes"][0]["podCIDR"] = None
    t = parse_topology(data)
    assert t.node("a").pod_cidr == "10.244.2.0/24"


def test_pod_ip_allocation_skips_network_gateway_and_taken():
    data = variant("pods", [
        {"name": "fixed", "node": "worker2", "ip": "10.244.2.2"},
        {"name": "auto1", "node": "worker2"},
        {"name": "auto2", "node": "worker2"},
    ])
    t = parse_topology(data)
    assert t.pod("auto1").ip == "10.244.2.3"  # .0 network, .1 gateway, .2 fixed later in file
    assert t.pod("auto2").ip == "10.244.2.4"
    assert t.pod("auto1").listen == ("80/tcp",)
    assert allocate_pod_ip(t, "worker2") == "10.244.2.5"


def test_allocation_reports_an_exhausted_pod_cidr():
    data = variant("nodes.1.podCIDR", "10.244.9.0/30")  # .0 .1 .2 .3: one usable (.2)
    data["pods"] = [{"name": "a", "node": "worker2"}, {"name": "b", "node": "worker2"}]
    with pytest.raises(TopologyError) as err:
        parse_topology(data)
    assert err.value.field == "pods[1].ip"
    assert "no free address" in str(err.value)
    t = parse_topology(variant("pods", [{"name": "a", "node": "worker2"}], data))
    with pytest.raises(TopologyError, match=r"nodes\[1\]\.podCIDR: 10.244.9.0/30 .* no free"):
        allocate_pod_ip(t, "worker2")


def test_fixed_pod_ip_may_lie_outside_its_pod_cidr():
    t = parse_topology(variant("pods.0.ip", "10.250.0.9"))
    assert t.pod("web-1").ip == "10.250.0.9"
    assert t.pod_prefixes("worker1") == ("10.244.5.0/24", "10.250.0.9/32")
    assert t.pod_prefixes("worker2") == ("10.244.2.0/24",)


def test_with_pod_and_without_pod():
    t = parse_topology(BASE)
    t2 = with_pod(t, PodSpec(name="web-2", node="worker1", labels={"app": "web"},
                             listen=("8080/TCP",)))
    new = t2.pod("web-2")
    assert new.ip == "10.244.5.2" and new.listen == ("8080/tcp",) and new.labels == {"app": "web"}
    assert t.pods == parse_topology(BASE).pods  # the original is unchanged
    t3 = t2.with_pod(PodSpec(name="web-3", node="worker1", ip="10.244.5.9"))
    assert t3.pod("web-3").ip == "10.244.5.9"
    assert without_pod(t3, "web-3") == t2
    assert t3.without_pod("web-2").without_pod("web-3") == t
    with pytest.raises(KeyError, match="nope"):
        t.without_pod("nope")


def test_with_pod_validates_like_a_file():
    t = parse_topology(BASE)
    with pytest.raises(TopologyError, match=r"pods\[1\]\.name: 'web-1' duplicates pods\[0\]"):
        t.with_pod(PodSpec(name="web-1", node="worker2"))
    with pytest.raises(TopologyError, match=r"pods\[1\]\.ip: 10.244.5.4 is already used by pods\[0\]\.ip"):
        t.with_pod(PodSpec(name="x", node="worker1", ip="10.244.5.4"))
    with pytest.raises(TopologyError, match=r"pods\[1\]\.node: 'worker9' is not a node"):
        t.with_pod(PodSpec(name="x", node="worker9"))


def test_round_trip_through_dict_and_json():
    data = variant("kubeProxyConfiguration", {"kind": "KubeProxyConfiguration", "mode": "ipvs"})
    t = parse_topology(data)
    again = topology_from_dict(json.loads(json.dumps(topology_to_dict(t))))
    assert again == t
    assert again.kube_proxy_configuration["mode"] == "ipvs"
    with pytest.raises(TypeError):
        t.kube_proxy_configuration["mode"] = "x"  # frozen all the way down


def test_node_zone_is_optional_and_round_trips():
    t = parse_topology(variant("nodes.0.zone", "zone-a"))
    assert [n.zone for n in t.nodes] == ["zone-a", ""]
    assert topology_from_dict(json.loads(json.dumps(topology_to_dict(t)))) == t


def test_parse_listen():
    assert parse_listen("53/UDP") == (53, "udp")
    with pytest.raises(TopologyError, match="PORT/tcp"):
        parse_listen("http")


# --- every error path ------------------------------------------------------------------------

ERRORS = [
    # (description, data, field, message fragment)
    ("not a mapping", ["x"], "topology", "expected a mapping"),
    ("unknown top key", variant("serviceCidr", "10.96.0.0/12"), "serviceCidr",
     "did you mean 'serviceCIDR'"),
    ("nodes missing", variant("nodes", DELETE), "nodes", "is required"),
    ("nodes empty", variant("nodes", []), "nodes", "at least one node"),
    ("nodes not a list", variant("nodes", {"a": 1}), "nodes", "expected a list"),
    ("node not a mapping", variant("nodes.1", "worker2"), "nodes[1]", "expected a mapping"),
    ("unknown node key", variant("nodes.1.podCidr", "10.244.9.0/24"), "nodes[1].podCidr",
     "did you mean 'podCIDR'"),
    ("node name missing", variant("nodes.1.name", DELETE), "nodes[1].name", "is required"),
    ("node name invalid", variant("nodes.1.name", "Worker_2"), "nodes[1].name",
     "not a valid node name"),
    ("node name not string", variant("nodes.1.name", 7), "nodes[1].name", "not a string"),
    ("duplicate node", variant("nodes.1.name", "worker1"), "nodes[1].name",
     "duplicates nodes[0].name"),
    ("bad node ip", variant("nodes.1.ip", "172.20.20.300"), "nodes[1].ip",
     "'172.20.20.300' is not an IPv4 address"),
    ("node ip number", variant("nodes.1.ip", 17), "nodes[1].ip", "17 is not an IPv4 address"),
    ("ipv6 node ip in an IPv4 cluster", variant("nodes.1.ip", "fd00::1"), "nodes[1].ip",
     "fd00::1 is an IPv6 address, but the cluster has no IPv6 (clusterCIDR 10.244.0.0/16)"),
    ("loopback node ip", variant("nodes.1.ip", "127.0.0.2"), "nodes[1].ip", "loopback"),
    ("link-local node ip", variant("nodes.1.ip", "169.254.1.1"), "nodes[1].ip", "link-local"),
    ("multicast node ip", variant("nodes.1.ip", "224.0.0.5"), "nodes[1].ip", "multicast"),
    ("node ip in serviceCIDR", variant("nodes.1.ip", "10.96.0.10"), "nodes[1].ip",
     "inside serviceCIDR"),
    ("node ip in clusterCIDR", variant("nodes.1.ip", "10.244.200.1"), "nodes[1].ip",
     "inside clusterCIDR"),
    ("duplicate node ip", variant("nodes.1.ip", "172.20.20.15"), "nodes[1].ip",
     "already used by nodes[0].ip"),
    ("extra ip duplicates node ip", variant("nodes.1.extraIPs", ["172.20.20.15"]),
     "nodes[1].extraIPs[0]", "already used by nodes[0].ip"),
    ("bad extra ip", variant("nodes.0.extraIPs", ["192.168.99.11", "x"]),
     "nodes[0].extraIPs[1]", "'x' is not an IPv4 address"),
    ("node ip is apiServerIP", variant("nodes.1.ip", "192.0.2.1"), "nodes[1].ip",
     "already used by apiServerIP"),
    ("bad podCIDR", variant("nodes.1.podCIDR", "10.244.2.0/33"), "nodes[1].podCIDR",
     "not an IPv4 CIDR"),
    ("podCIDR host bits", variant("nodes.1.podCIDR", "10.244.2.1/24"), "nodes[1].podCIDR",
     "host bits set (did you mean 10.244.2.0/24?)"),
    ("podCIDR outside cluster", variant("nodes.1.podCIDR", "10.250.0.0/24"), "nodes[1].podCIDR",
     "not inside clusterCIDR 10.244.0.0/16"),
    ("podCIDR overlap", variant("nodes.1.podCIDR", "10.244.5.128/25"), "nodes[1].podCIDR",
     "overlaps nodes[0].podCIDR 10.244.5.0/24"),
    ("no room for default podCIDR",
     variant("clusterCIDR", "10.244.0.0/25", variant("nodes.0.podCIDR", "10.244.0.0/26")),
     "nodes[1].podCIDR", "cannot pick a default"),
    ("service overlaps cluster", variant("serviceCIDR", "10.240.0.0/12"), "serviceCIDR",
     "overlaps clusterCIDR"),
    ("bad serviceCIDR", variant("serviceCIDR", "10.96.0.1/12"), "serviceCIDR",
     "host bits set (did you mean 10.96.0.0/12?)"),
    ("bad clusterCIDR", variant("clusterCIDR", "pods"), "clusterCIDR", "not an IPv4 CIDR"),
    ("bad apiServerIP", variant("apiServerIP", "192.0.2"), "apiServerIP", "not an IPv4 address"),
    ("apiServerIP in clusterCIDR", variant("apiServerIP", "10.244.0.1"), "apiServerIP",
     "inside clusterCIDR"),
    ("pods not a list", variant("pods", "web-1"), "pods", "expected a list"),
    ("unknown pod key", variant("pods.0.lables", {}), "pods[0].lables", "did you mean 'labels'"),
    ("pod name missing", variant("pods.0.name", DELETE), "pods[0].name", "is required"),
    ("pod name invalid", variant("pods.0.name", "Web_1"), "pods[0].name", "not a valid pod name"),
    ("pod name too long", variant("pods.0.name", "a" * 64), "pods[0].name",
     "not a valid pod name"),
    ("pod node missing", variant("pods.0.node", DELETE), "pods[0].node", "is required"),
    ("unknown node", variant("pods.0.node", "worker9"), "pods[0].node",
     "'worker9' is not a node (nodes: worker1, worker2)"),
    ("bad namespace", variant("pods.0.namespace", "Kube_System"), "pods[0].namespace",
     "not a valid namespace"),
    ("bad pod ip", variant("pods.0.ip", "10.244.5.256"), "pods[0].ip", "not an IPv4 address"),
    ("pod ip in serviceCIDR", variant("pods.0.ip", "10.96.0.1"), "pods[0].ip",
     "inside serviceCIDR"),
    ("pod ip is the network address", variant("pods.0.ip", "10.244.5.0"), "pods[0].ip",
     "network or broadcast address"),
    ("pod ip in another node's podCIDR", variant("pods.0.ip", "10.244.2.9"), "pods[0].ip",
     "lies in podCIDR 10.244.2.0/24 of node 'worker2', but the pod runs on 'worker1'"),
    ("pod ip collides with a node", variant("pods.0.ip", "172.20.20.16"), "pods[0].ip",
     "already used by nodes[1].ip"),
    ("pod ip collides with apiServerIP", variant("pods.0.ip", "192.0.2.1"), "pods[0].ip",
     "already used by apiServerIP"),
    ("duplicate pod", variant("pods", BASE["pods"] * 2), "pods[1].name",
     "duplicates pods[0].name"),
    ("listen not a list", variant("pods.0.listen", "80/tcp"), "pods[0].listen",
     "expected a list"),
    ("listen without protocol", variant("pods.0.listen", [80]), "pods[0].listen[0]",
     "not PORT/tcp, PORT/udp or PORT/sctp"),
    ("listen bad protocol", variant("pods.0.listen", ["80/quic"]), "pods[0].listen[0]",
     "protocol 'quic' is not tcp, udp or sctp"),
    ("listen port zero", variant("pods.0.listen", ["0/tcp"]), "pods[0].listen[0]",
     "outside 1-65535"),
    ("listen port too big", variant("pods.0.listen", ["53/udp", "70000/udp"]),
     "pods[0].listen[1]", "outside 1-65535"),
    ("listen duplicate", variant("pods.0.listen", ["80/tcp", "80/TCP"]), "pods[0].listen[1]",
     "80/tcp is listed twice"),
    ("labels not a mapping", variant("pods.0.labels", ["app"]), "pods[0].labels",
     "expected a mapping"),
    ("label value not a string", variant("pods.0.labels", {"tier": 1}), "pods[0].labels.tier",
     "not a string"),
    ("label value invalid", variant("pods.0.labels", {"app": "a b"}), "pods[0].labels.app",
     "not a valid label value"),
    ("label key invalid", variant("pods.0.labels", {"bad key": "x"}), "pods[0].labels",
     "not a valid label key"),
    ("clients not a list", variant("clients", {"name": "x"}), "clients", "expected a list"),
    ("unknown client key", variant("clients.0.gatway", "worker1"), "clients[0].gatway",
     "did you mean 'gateway'"),
    ("client ip missing", variant("clients.0.ip", DELETE), "clients[0].ip", "is required"),
    ("client ip collides", variant("clients.0.ip", "192.168.99.11"), "clients[0].ip",
     "already used by nodes[0].extraIPs[0]"),
    ("client gateway unknown", variant("clients.0.gateway", "worker7"), "clients[0].gateway",
     "'worker7' is not a node"),
    ("duplicate client", variant("clients", BASE["clients"] * 2), "clients[1].name",
     "duplicates clients[0].name"),
    ("zone not a string", variant("nodes.0.zone", 1), "nodes[0].zone", "is not a string"),
    ("zone empty", variant("nodes.0.zone", ""), "nodes[0].zone", "is not a valid zone name"),
    ("zone not a label value", variant("nodes.0.zone", "zone a"), "nodes[0].zone", "is not a valid zone name"),
    ("zone misspelt", variant("nodes.0.zones", "a"), "nodes[0].zones", "did you mean 'zone'"),
    ("kubeProxyConfiguration not a mapping", variant("kubeProxyConfiguration", "ipvs"),
     "kubeProxyConfiguration", "expected a mapping"),
    ("kubeProxyConfiguration wrong kind",
     variant("kubeProxyConfiguration", {"kind": "KubeletConfiguration"}),
     "kubeProxyConfiguration.kind", "is not KubeProxyConfiguration"),
]


@pytest.mark.parametrize("data, field, fragment", [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_invalid_topology(data, field, fragment):
    with pytest.raises(TopologyError) as err:
        parse_topology(data)
    assert err.value.field == field
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"{field}: ")


def test_the_briefs_example_message():
    with pytest.raises(TopologyError) as err:
        parse_topology(variant("nodes.1.ip", "172.20.20.300"))
    assert str(err.value) == "nodes[1].ip: '172.20.20.300' is not an IPv4 address"


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(TopologyError, match=rf"^{bad}: not valid YAML: line \d+"):
        load_topology(bad)
    bad.write_text(json.dumps(variant("nodes.0.ip", "x")))
    with pytest.raises(TopologyError, match=rf"^{bad}: nodes\[0\]\.ip: 'x' is not"):
        load_topology(bad)
    with pytest.raises(TopologyError, match="cannot read topology file"):
        load_topology(tmp_path / "missing.yaml")
    with pytest.raises(TopologyError, match="^inline: topology: expected a mapping"):
        topology_from_yaml("", source="inline")


# --- naming ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lab", "t1a2b3c4", "my-lab-2", "a" * naming.MAX_LAB_NAME])
def test_valid_lab_names(name):
    assert naming.validate_lab_name(name) == name


@pytest.mark.parametrize("name, fragment", [
    ("", "non-empty"),
    ("Lab", "lowercase"),
    ("lab_1", "lowercase"),
    ("-lab", "lowercase"),
    ("lab--x", "lowercase"),
    ("a" * (naming.MAX_LAB_NAME + 1), "longer than"),
    ("foo-p", "segment 'p'"),
    ("n-foo", "segment 'n'"),
    ("x-underlay-y", "segment 'underlay'"),
])
def test_invalid_lab_names(name, fragment):
    with pytest.raises(naming.LabNameError, match=fragment):
        naming.validate_lab_name(name)


def test_names_of_a_lab():
    assert naming.underlay_netns("lab") == "epx-lab-underlay"
    assert naming.node_netns("lab", "worker1") == "epx-lab-n-worker1"
    assert naming.pod_netns("lab", "my-nginx-1") == "epx-lab-p-my-nginx-1"
    assert naming.client_netns("lab", "outside") == "epx-lab-c-outside"
    assert naming.node_cgroup("lab", "worker1") == \
        "/sys/fs/cgroup/unified/ebpf-proxy-lab/lab/worker1"
    assert naming.pod_cgroup("lab", "worker1", "web") == \
        "/sys/fs/cgroup/unified/ebpf-proxy-lab/lab/worker1/pod-web"
    assert naming.apiserver_cgroup("lab").endswith("/lab/_apiserver")


def test_interface_names_fit_ifnamsiz_and_are_stable():
    long_pod = "a" * 63
    name = naming.pod_host_ifname(long_pod)
    assert len(name) <= 15 and name.startswith("lxc")
    assert name == naming.pod_host_ifname(long_pod)
    assert naming.pod_host_ifname("web-1") != naming.pod_host_ifname("web-2")
    assert len(naming.node_port_ifname(999)) <= 15


@pytest.mark.parametrize("netns, lab", [
    ("epx-lab-underlay", "lab"),
    ("epx-lab-n-worker1", "lab"),
    ("epx-my-lab-p-web-1", "my-lab"),
    ("epx-lab-p-n-x", "lab"),  # a pod called n-x
    ("epx-lab-n-underlay", "lab"),  # a node called underlay
    ("epx-lab-x-p-web", "lab-x"),
    ("epx-lab", None),
    ("epx-lab-q-x", None),
    ("cni-1234", None),
    ("epx-lab-underlay-2", None),
])
def test_lab_of_netns(netns, lab):
    assert naming.lab_of_netns(netns) == lab


def test_lab_prefixes_cannot_capture_another_lab():
    """destroy("foo") must never match lab "foo-x"'s namespaces, whatever they contain."""
    for netns in (naming.underlay_netns("foo-x"), naming.node_netns("foo-x", "n"),
                  naming.pod_netns("foo-x", "p-1"), naming.client_netns("foo-x", "c")):
        assert naming.lab_of_netns(netns) == "foo-x"


def test_leftover_labs_reads_netns_and_cgroup_dirs(tmp_path, monkeypatch):
    netns_dir, cgroup_dir = tmp_path / "netns", tmp_path / "cg"
    netns_dir.mkdir()
    (cgroup_dir / "crashed").mkdir(parents=True)
    (cgroup_dir / "Not_Ours").mkdir()
    for name in ("epx-a-underlay", "epx-b-x-n-worker1", "cni-123", "epx-junk"):
        (netns_dir / name).touch()
    monkeypatch.setattr(naming, "NETNS_DIR", str(netns_dir))
    monkeypatch.setattr(naming, "CGROUP_PARENT", str(cgroup_dir))
    assert naming.leftover_labs() == ["a", "b-x", "crashed"]
    assert naming.lab_netns_names("b-x") == ["epx-b-x-n-worker1"]
    assert naming.lab_netns_names("b") == []


def test_pod_bridge_is_optional_validated_and_round_trips():
    t = parse_topology(variant("nodes.1.podBridge", "cbr0"))
    assert t.node("worker2").pod_bridge == "cbr0" and t.node("worker1").pod_bridge == ""
    assert parse_topology(topology_to_dict(t)) == t
    assert "podBridge" not in topology_to_dict(t)["nodes"][0]
    for bad in ("eth0", "a" * 16, "bad name", 7):
        with pytest.raises(TopologyError) as err:
            parse_topology(variant("nodes.1.podBridge", bad))
        assert err.value.field == "nodes[1].podBridge"


def test_pod_server_is_optional_validated_and_round_trips():
    t = parse_topology(variant("pods.0.server", "native"))
    assert t.pod("web-1").server == "native" and all(p.server == "python" for p in t.pods[1:])
    assert parse_topology(topology_to_dict(t)) == t
    copy_ = t.with_pod(PodSpec(name="web-9", node="worker2", server="native"))  # as `lab scale` copies a replica
    assert copy_.pod("web-9").server == "native" and copy_.pod("web-1").server == "native"
    plain = t.with_pod(PodSpec(name="web-8", node="worker2"))
    assert plain.pod("web-8").server == "python"
    assert "server" not in topology_to_dict(plain)["pods"][1]  # the default is not written out
    for bad in ("go", "", 1):
        with pytest.raises(TopologyError) as err:
            parse_topology(variant("pods.0.server", bad))
        assert err.value.field == "pods[0].server" and "python, native" in str(err.value)


def test_pod_listen_sctp_is_for_the_python_server_only():
    """The Python echo server serves SCTP (where the kernel has it); echod.c does not, so a native
    pod asking for it is refused when the topology is read, not when its server starts."""
    t = parse_topology(variant("pods.0.listen", ["80/tcp", "3868/SCTP"]))
    assert t.pod("web-1").listen == ("80/tcp", "3868/sctp")
    with pytest.raises(TopologyError) as err:
        parse_topology(variant("pods.0.server", "native", variant("pods.0.listen", ["3868/sctp"])))
    assert err.value.field == "pods[0].listen" and "native" in str(err.value) and "sctp" in str(err.value)
