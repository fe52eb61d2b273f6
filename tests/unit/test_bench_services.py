"""The bench's Services and EndpointSlices, against a fake API server (no lab)."""

import threading

import pytest

from ebpf_proxy.bench import ports
from ebpf_proxy.bench.rest import RestError, object_path
from ebpf_proxy.bench.runner import TOPOLOGY
from ebpf_proxy.bench.services import (BenchServices, CHURN_RANGE, FILLER_RANGE, filler_name, filler_slice,
                                       measured_targets, range_address, service_object, slice_object)
from ebpf_proxy.lab.topology import load_topology


class FakeRest:
    """Enough of bench.rest.Rest: objects in a dict, allocations like the lab's server."""

    def __init__(self):
        self.objects = {}
        self.lock = threading.Lock()
        self.writes = []
        self.next_ip = 10
        self.next_node_port = 30000
        self.rv = 100

    def _key(self, obj):
        return obj["kind"], obj["metadata"]["name"]

    def create(self, obj):
        with self.lock:
            key = self._key(obj)
            if key in self.objects:
                raise RestError("POST", "x", 409, "exists")
            obj = {**obj, "spec": dict(obj.get("spec", {}))} if obj["kind"] == "Service" else obj
            if obj["kind"] == "Service":
                v6 = obj["spec"].get("ipFamilies") == ["IPv6"]
                obj["spec"]["clusterIP"] = f"fd00:10:96::{self.next_ip:x}" if v6 else f"10.96.0.{self.next_ip}"
                self.next_ip += 1
                if obj["spec"]["type"] == "NodePort":
                    obj["spec"]["ports"] = [{**obj["spec"]["ports"][0], "nodePort": self.next_node_port}]
                    self.next_node_port += 1
            self.objects[key] = obj
            self.writes.append(("create", key))
            return obj

    def replace(self, obj):
        with self.lock:
            key = self._key(obj)
            if key not in self.objects:
                raise RestError("PUT", "x", 404, "not found")
            self.objects[key] = obj
            self.writes.append(("replace", key))
            self.rv += 1
            return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}

    def get(self, kind, name, namespace="default"):
        return self.objects.get((kind, name))

    def delete(self, kind, name, namespace="default"):
        with self.lock:
            return self.objects.pop((kind, name), None) is not None

    def delete_by_label(self, kind, selector, namespace="default"):
        with self.lock:
            for key in [k for k, o in self.objects.items() if k[0] == kind and selector in o["metadata"]["labels"]]:
                del self.objects[key]

    def list(self, kind, namespace="default", label_selector=""):
        """Only the selector the bench uses: a label key that must exist."""
        with self.lock:
            return [o for k, o in self.objects.items()
                    if k[0] == kind and (not label_selector or label_selector in o["metadata"]["labels"])]

    def map(self, fn, items, threads=4):
        return [fn(i) for i in items]

    def count(self, kind, prefix=""):
        return sum(1 for k in self.objects if k[0] == kind and k[1].startswith(prefix))


@pytest.fixture
def bench_services():
    rest = FakeRest()
    return rest, BenchServices(rest, load_topology(str(TOPOLOGY)), per_service=2)


def test_objects_have_the_shape_the_agent_reads():
    svc = service_object("s", "filler", svc_type="NodePort", etp="Local")
    assert svc["spec"]["externalTrafficPolicy"] == "Local" and "selector" not in svc["spec"]
    sl = slice_object("s", "filler", [("100.64.0.1", "worker1")], 7000)
    assert sl["metadata"]["labels"]["kubernetes.io/service-name"] == "s"
    assert sl["endpoints"][0]["conditions"]["ready"] is True
    assert sl["ports"] == [{"name": "", "port": 7000, "protocol": "TCP"}]
    assert object_path("EndpointSlice", "default", "x") == \
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/x"
    assert object_path("Node", None) == "/api/v1/nodes"


def test_filler_endpoints_are_all_distinct():
    addrs = [e["addresses"][0] for i in range(300) for e in filler_slice(i, 3, ["a", "b"])["endpoints"]]
    assert len(set(addrs)) == 900
    assert range_address(FILLER_RANGE, 0) == "100.64.0.1"
    with pytest.raises(ValueError):
        range_address(CHURN_RANGE, CHURN_RANGE.num_addresses)


def test_sizes_count_the_measured_services(bench_services):
    rest, svc = bench_services
    stats = svc.ensure_size(1)
    assert stats.services == len(ports.MEASURED_SERVICES) and stats.created == 0
    assert rest.count("Service") == len(ports.MEASURED_SERVICES)
    stats = svc.ensure_size(100)
    fillers = 100 - len(ports.MEASURED_SERVICES)  # the bench topology is dual-stack: all are installed
    assert stats.created == fillers and rest.count("Service") == 100 and rest.count("EndpointSlice") == 100
    assert rest.count("Service", "bench-f") == fillers
    stats = svc.ensure_size(50)
    assert stats.deleted == 50 and rest.count("Service") == 50 and rest.count("EndpointSlice") == 50
    svc.remove_all()
    assert not rest.objects


def test_measured_services_follow_the_mode(bench_services):
    rest, svc = bench_services
    svc.install_measured()
    empty = rest.get("EndpointSlice", "bench-clusterip-bench")
    assert empty["endpoints"] == []
    svc.point_at_mode("iptables")
    sl = rest.get("EndpointSlice", "bench-np-local-bench")
    assert sl["ports"][0]["port"] == ports.tcp_port("iptables", "nodeport-local")
    assert {e["addresses"][0] for e in sl["endpoints"]} == {"10.244.1.10", "10.244.2.10"}
    assert {e["nodeName"] for e in sl["endpoints"]} == {"worker1", "worker2"}
    udp = rest.get("EndpointSlice", "bench-udp-bench")
    assert udp["ports"][0] == {"name": "", "port": ports.udp_port("iptables"), "protocol": "UDP"}
    targets = measured_targets(svc.measured, svc.topology, "worker1")
    assert targets["clusterip"].endswith(":80") and targets["udp"].endswith(":53")
    assert targets["nodeport-cluster"].startswith("172.20.20.15:30")


def test_changes_use_fresh_addresses_and_chain(bench_services):
    rest, svc = bench_services
    svc.ensure_size(10)
    assert svc.churn_targets() == [filler_name(i) for i in range(10 - len(ports.MEASURED_SERVICES))]
    name = filler_name(0)
    first, (ip1, port1) = svc.changed_slice(name)
    assert first["endpoints"][0]["addresses"] == [ip1] and port1 == ports.FILLER_PORT
    assert first["endpoints"][1] == filler_slice(0, 2, ["worker1", "worker2"])["endpoints"][1]
    svc.write(first)
    assert rest.get("EndpointSlice", f"{name}-bench")["endpoints"][0]["addresses"] == [ip1]
    second, (ip2, _) = svc.changed_slice(name)
    assert ip2 != ip1 and second["endpoints"][1] == first["endpoints"][1]
    assert svc.expected_endpoints(second) == {(ip2, port1), (first["endpoints"][1]["addresses"][0], port1)}


def test_without_fillers_the_churn_service_changes(bench_services):
    rest, svc = bench_services
    svc.ensure_size(1)
    assert svc.churn_targets() == [ports.SVC_CHURN]
    obj, (ip, _) = svc.changed_slice(ports.SVC_CHURN)
    svc.write(obj)
    assert rest.get("EndpointSlice", "bench-churn-bench")["endpoints"][0]["addresses"] == [ip]


def test_a_dual_stack_topology_measures_an_ipv6_cluster_ip_too(bench_services):
    """The bench topology is dual-stack: an IPv6 single-stack ClusterIP with an IPv6 slice of the
    backends' IPv6 addresses, reached as [VIP]:80; direct6 is their IPv6 pod IPs."""
    from ebpf_proxy.bench import traffic

    rest, svc = bench_services
    svc.install_measured()
    assert rest.get("Service", ports.SVC_CLUSTERIP6)["spec"]["ipFamilies"] == ["IPv6"]
    svc.point_at_mode("ebpf")
    sl = rest.get("EndpointSlice", f"{ports.SVC_CLUSTERIP6}-bench")
    assert sl["addressType"] == "IPv6" and sl["ports"][0]["port"] == ports.tcp_port("ebpf", "clusterip6")
    assert {e["addresses"][0] for e in sl["endpoints"]} == {"fd00:10:244:1::10", "fd00:10:244:2::10"}
    targets = measured_targets(svc.measured, svc.topology, "worker1")
    assert targets["clusterip6"].startswith("[fd00:10:96::") and targets["clusterip6"].endswith("]:80")
    assert [p.path for p in traffic.proxy_points("ebpf", targets)][-1] == "clusterip6"
    direct6 = [p for p in traffic.direct_points(svc.topology) if p.path == ports.DIRECT6]
    assert direct6[0].targets == ("[fd00:10:244:1::10]:8101", "[fd00:10:244:2::10]:8101")


def test_an_ipv4_topology_measures_no_ipv6_path():
    from ebpf_proxy.bench import traffic
    from ebpf_proxy.lab.topology import topology_to_dict, parse_topology

    data = topology_to_dict(load_topology(str(TOPOLOGY)))
    data["serviceCIDR"], data["clusterCIDR"] = "10.96.0.0/12", "10.244.0.0/16"
    for item in (*data["nodes"], *data["pods"], *data["clients"]):
        item["ip"] = item["ip"].split(",")[0]
    for node in data["nodes"]:
        node["podCIDR"] = node["podCIDR"].split(",")[0]
    v4 = parse_topology(data)
    rest = FakeRest()
    svc = BenchServices(rest, v4)
    stats = svc.ensure_size(1)
    assert stats.services == len(ports.MEASURED_SERVICES) - 1 and rest.get("Service", ports.SVC_CLUSTERIP6) is None
    svc.point_at_mode("iptables")
    assert "clusterip6" not in measured_targets(svc.measured, v4, "worker1")
    assert [p.path for p in traffic.direct_points(v4)] == ["direct", "direct"]


def test_the_pod_ip_point_is_directs_traffic_on_the_modes_own_port(bench_services):
    """podip: the client pod to both backend pod IPs, as direct, but on a port of the mode's own
    (PAWS: no ip:port shared with another point, ports.py) that the bench topology's pods listen on."""
    from ebpf_proxy.bench import traffic

    _, svc = bench_services
    direct = next(p for p in traffic.direct_points(svc.topology) if p.path == ports.DIRECT and p.proto == "tcp")
    ports_seen = set()
    for mode in ports.PROXY_MODES:
        point = traffic.podip_point(svc.topology, mode)
        assert (point.metric, point.path, point.mode, point.source) == ("conn_rate", "podip", mode, direct.source)
        assert [t.rsplit(":", 1)[0] for t in point.targets] == [t.rsplit(":", 1)[0] for t in direct.targets]
        port = int(point.targets[0].rsplit(":", 1)[1])
        assert port == ports.tcp_port(mode, ports.PODIP) and port in ports.all_ports()["tcp"]
        ports_seen.add(port)
    assert len(ports_seen) == len(ports.PROXY_MODES) and int(direct.targets[0].rsplit(":", 1)[1]) not in ports_seen
