"""k8s/convert.py: API dicts → model values as kube-proxy reads them, and bad input never raises."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from ebpf_proxy.k8s import convert
from ebpf_proxy.k8s.invalid import Invalid
from ebpf_proxy.model import Endpoint, NodeState, Protocol, ServicePortName
from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service


class Reports(list):
    def __call__(self, problem: Invalid) -> None:
        self.append(problem)


def spn(port_name="http", protocol=Protocol.TCP, name="web", ns="default"):
    return ServicePortName(ns, name, port_name, protocol)


# ---- Services: what is read -----------------------------------------------------------------------


def test_cluster_ip_service_port_fields():
    reports = Reports()
    (sp,) = convert.service_ports(service(ports=[port("http", 80, "TCP")]), reports)
    assert sp.name == spn()
    assert (sp.cluster_ip, sp.port, sp.protocol, sp.node_port) == ("10.96.0.10", 80, Protocol.TCP, 0)
    assert not sp.external_policy_local and not sp.internal_policy_local
    assert sp.affinity_timeout_seconds == 0 and sp.health_check_node_port == 0
    assert reports == []


def test_multiple_ports_and_protocols_default_tcp():
    ports = [port("dns", 53, "UDP"), port("dns-tcp", 53, None), port("sig", 3868, "SCTP")]
    result = convert.service_ports(service(ports=ports))
    assert [(p.name.port, p.protocol) for p in result] == [
        ("dns", Protocol.UDP), ("dns-tcp", Protocol.TCP), ("sig", Protocol.SCTP)]


def test_unnamed_single_port():
    (sp,) = convert.service_ports(service(ports=[{"port": 80}]))
    assert sp.name == spn(port_name="")


@pytest.mark.parametrize("obj", [
    service(svc_type="ExternalName", cluster_ip=""),
    service(cluster_ip="None"),
    service(cluster_ip=""),
], ids=["externalname", "headless", "unallocated"])
def test_services_kube_proxy_does_not_program_are_skipped_silently(obj):
    reports = Reports()
    assert convert.service_ports(obj, reports) == []
    assert reports == []


def test_dual_stack_uses_the_ipv4_cluster_ip():
    obj = service()
    obj["spec"]["clusterIPs"] = ["fd00::10", "10.96.0.10"]
    (sp,) = convert.service_ports(obj)
    assert sp.cluster_ip == "10.96.0.10"


def test_ipv6_only_service_is_not_the_ipv4_proxiers_and_not_an_invalid():
    obj = service(cluster_ip="fd00::10")
    reports = Reports()
    assert convert.service_ports(obj, reports) == []
    (sp,) = convert.service_ports(obj, reports, family=6)
    assert sp.cluster_ip == "fd00::10"
    assert reports == []


def test_each_family_takes_its_own_addresses():
    """kube-proxy's newBaseServiceInfo per family: the family's cluster IP, external IPs,
    load-balancer IPs and source ranges (upstream serviceport_test / TestServiceToServiceMap
    "dual stack" cases: each proxier sees its family's IPs only)."""
    obj = service(svc_type="LoadBalancer")
    obj["spec"]["clusterIPs"] = ["10.96.0.10", "fd00:10:96::a"]
    obj["spec"]["externalIPs"] = ["203.0.113.9", "2001:db8::9"]
    obj["spec"]["loadBalancerSourceRanges"] = ["198.51.100.0/24", "2001:db8:1::/48"]
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}, {"ip": "2001:db8:2::1"}]}}
    reports = Reports()
    by_family = convert.service_ports_by_family(obj, reports, (4, 6))
    (v4,), (v6,) = by_family[4], by_family[6]
    assert (v4.cluster_ip, v4.external_ips, v4.load_balancer_ips, v4.load_balancer_source_ranges) == (
        "10.96.0.10", ("203.0.113.9",), ("192.0.2.1",), ("198.51.100.0/24",))
    assert (v6.cluster_ip, v6.external_ips, v6.load_balancer_ips, v6.load_balancer_source_ranges) == (
        "fd00:10:96::a", ("2001:db8::9",), ("2001:db8:2::1",), ("2001:db8:1::/48",))
    assert v4.name == v6.name and v4.node_port == v6.node_port
    assert reports == []


def test_source_ranges_of_the_other_family_only_close_this_familys_load_balancer():
    obj = service(svc_type="LoadBalancer")
    obj["spec"]["clusterIPs"] = ["10.96.0.10", "fd00:10:96::a"]
    obj["spec"]["loadBalancerSourceRanges"] = ["198.51.100.0/24"]
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}, {"ip": "2001:db8:2::1"}]}}
    by_family = convert.service_ports_by_family(obj, None, (4, 6))
    assert by_family[4][0].load_balancer_ips == ("192.0.2.1",)
    assert by_family[6][0].load_balancer_ips == ()


def test_a_broken_service_is_reported_once_whatever_the_families():
    obj = service()
    obj["spec"]["externalIPs"] = ["not-an-ip"]
    reports = Reports()
    convert.service_ports_by_family(obj, reports, (4, 6))
    assert len(reports) == 1


def test_old_objects_with_only_cluster_ip():
    obj = service()
    del obj["spec"]["clusterIPs"]
    (sp,) = convert.service_ports(obj)
    assert sp.cluster_ip == "10.96.0.10"


@pytest.mark.parametrize("svc_type,external_ips,expected", [
    ("NodePort", [], True),
    ("LoadBalancer", [], True),
    ("ClusterIP", ["192.0.2.7"], True),  # kube-proxy's ExternallyAccessible includes externalIPs
    ("ClusterIP", [], False),
])
def test_external_traffic_policy_local_only_when_externally_accessible(svc_type, external_ips, expected):
    ports = [port("http", 80, "TCP", node_port=30080 if svc_type != "ClusterIP" else None)]
    obj = service(svc_type=svc_type, ports=ports, externalIPs=external_ips, externalTrafficPolicy="Local")
    (sp,) = convert.service_ports(obj)
    assert sp.external_policy_local is expected


def test_load_balancer_fields():
    obj = service(
        svc_type="LoadBalancer", ports=[port("http", 80, "TCP", node_port=30080)],
        externalTrafficPolicy="Local", healthCheckNodePort=32000,
        loadBalancerSourceRanges=["203.0.113.0/24", " 198.51.100.7/32", "2001:db8::/64", "10.1.2.3/8"],
        externalIPs=["192.0.2.7", "2001:db8::7", "192.0.2.7"],
        status={"loadBalancer": {"ingress": [
            {"ip": "198.51.100.1"}, {"hostname": "lb.example.com"}, {"ip": "198.51.100.2", "ipMode": "Proxy"},
            {"ip": "2001:db8::1"}, {"ip": "198.51.100.3", "ipMode": "VIP"},
        ]}},
    )
    reports = Reports()
    (sp,) = convert.service_ports(obj, reports)
    assert sp.node_port == 30080
    assert sp.external_ips == ("192.0.2.7",)
    assert sp.load_balancer_ips == ("198.51.100.1", "198.51.100.3")
    assert sp.load_balancer_source_ranges == ("203.0.113.0/24", "198.51.100.7/32", "10.0.0.0/8")
    assert sp.external_policy_local and sp.health_check_node_port == 32000
    assert reports == []


def test_health_check_node_port_only_for_local_load_balancers():
    obj = service(svc_type="LoadBalancer", ports=[port(node_port=30080)], healthCheckNodePort=32000)
    (sp,) = convert.service_ports(obj)  # eTP=Cluster: the LB needs no per-node health check
    assert sp.health_check_node_port == 0


def test_only_ipv6_source_ranges_admit_no_ipv4_source_to_the_lb_ips():
    obj = service(svc_type="LoadBalancer", ports=[port(node_port=30080)], loadBalancerSourceRanges=["2001:db8::/64"],
                  status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}})
    (sp,) = convert.service_ports(obj)
    assert sp.load_balancer_ips == ()  # not programmed rather than opened to everyone
    assert sp.node_port == 30080


def test_internal_traffic_policy_and_session_affinity():
    obj = service(internalTrafficPolicy="Local", sessionAffinity="ClientIP")
    (sp,) = convert.service_ports(obj)
    assert sp.internal_policy_local
    assert sp.affinity_timeout_seconds == 10800  # kube's default

    obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}
    (sp,) = convert.service_ports(obj)
    assert sp.affinity_timeout_seconds == 60


def test_invalid_external_ip_drops_only_that_ip():
    reports = Reports()
    (sp,) = convert.service_ports(service(externalIPs=["192.0.2.7", "not-an-ip", 7]), reports)
    assert sp.external_ips == ("192.0.2.7",)
    assert [(r.field, r.reason, r.skipped) for r in reports] == [
        ("spec.externalIPs[1]", "invalid_ip", "ip"), ("spec.externalIPs[2]", "wrong_type", "ip")]


# ---- Services: malformed objects --------------------------------------------------------------------


def _svc_with(mutate):
    obj = service(ports=[port("http", 80, "TCP")])
    mutate(obj)
    return obj


def _set(path, value):
    def mutate(obj):
        target = obj
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(obj):
        target = obj
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


MALFORMED_SERVICES = [
    ("metadata-missing", _delete(["metadata"]), "metadata.name", "missing_field"),
    ("name-not-string", _set(["metadata", "name"], 5), "metadata.name", "missing_field"),
    ("namespace-missing", _delete(["metadata", "namespace"]), "metadata.namespace", "missing_field"),
    ("spec-missing", _delete(["spec"]), "spec", "missing_field"),
    ("spec-not-object", _set(["spec"], "ClusterIP"), "spec", "wrong_type"),
    ("type-unknown", _set(["spec", "type"], "Magic"), "spec.type", "invalid_value"),
    ("type-not-string", _set(["spec", "type"], ["NodePort"]), "spec.type", "wrong_type"),
    ("cluster-ip-invalid", _set(["spec", "clusterIPs"], ["10.96.0.300"]), "spec.clusterIPs[0]", "invalid_ip"),
    ("cluster-ips-not-list", _set(["spec", "clusterIPs"], "10.96.0.10"), "spec.clusterIPs", "wrong_type"),
    ("ports-not-list", _set(["spec", "ports"], {"port": 80}), "spec.ports", "wrong_type"),
    ("port-entry-not-object", _set(["spec", "ports"], [80]), "spec.ports[0]", "wrong_type"),
    ("port-missing", _delete(["spec", "ports", 0, "port"]), "spec.ports[0].port", "wrong_type"),
    ("port-string", _set(["spec", "ports", 0, "port"], "80"), "spec.ports[0].port", "wrong_type"),
    ("port-bool", _set(["spec", "ports", 0, "port"], True), "spec.ports[0].port", "wrong_type"),
    ("port-zero", _set(["spec", "ports", 0, "port"], 0), "spec.ports[0].port", "port_out_of_range"),
    ("port-too-big", _set(["spec", "ports", 0, "port"], 70000), "spec.ports[0].port", "port_out_of_range"),
    ("node-port-too-big", _set(["spec", "ports", 0, "nodePort"], 65536), "spec.ports[0].nodePort",
     "port_out_of_range"),
    ("node-port-negative", _set(["spec", "ports", 0, "nodePort"], -1), "spec.ports[0].nodePort",
     "port_out_of_range"),
    ("protocol-unknown", _set(["spec", "ports", 0, "protocol"], "ICMP"), "spec.ports[0].protocol",
     "unknown_protocol"),
    ("protocol-number", _set(["spec", "ports", 0, "protocol"], 6), "spec.ports[0].protocol", "wrong_type"),
    ("port-name-number", _set(["spec", "ports", 0, "name"], 1), "spec.ports[0].name", "wrong_type"),
    ("duplicate-port", _set(["spec", "ports"], [port("a", 80), port("a", 81)]), "spec.ports[1].name",
     "invalid_value"),
    ("source-range-invalid", _set(["spec", "loadBalancerSourceRanges"], ["10.0.0.0/33"]),
     "spec.loadBalancerSourceRanges[0]", "invalid_cidr"),
    ("source-range-not-string", _set(["spec", "loadBalancerSourceRanges"], [{"cidr": "10.0.0.0/8"}]),
     "spec.loadBalancerSourceRanges[0]", "wrong_type"),
    ("etp-unknown", _set(["spec", "externalTrafficPolicy"], "Global-ish"), "spec.externalTrafficPolicy",
     "invalid_value"),
    ("itp-unknown", _set(["spec", "internalTrafficPolicy"], "Node"), "spec.internalTrafficPolicy", "invalid_value"),
    ("affinity-unknown", _set(["spec", "sessionAffinity"], "Cookie"), "spec.sessionAffinity", "invalid_value"),
    ("affinity-timeout-zero", lambda o: o["spec"].update(
        sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 0}}),
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "invalid_value"),
    ("affinity-timeout-huge", lambda o: o["spec"].update(
        sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 86401}}),
     "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "invalid_value"),
    ("affinity-config-not-object", lambda o: o["spec"].update(
        sessionAffinity="ClientIP", sessionAffinityConfig="10800"), "spec.sessionAffinityConfig", "wrong_type"),
    ("status-not-object", _set(["status"], []), "status", "wrong_type"),
    ("ingress-not-list", _set(["status"], {"loadBalancer": {"ingress": "198.51.100.1"}}),
     "status.loadBalancer.ingress", "wrong_type"),
    ("external-ips-not-list", _set(["spec", "externalIPs"], "192.0.2.7"), "spec.externalIPs", "wrong_type"),
]


@pytest.mark.parametrize("mutate,field,reason", [m[1:] for m in MALFORMED_SERVICES],
                         ids=[m[0] for m in MALFORMED_SERVICES])
def test_malformed_service_is_skipped_with_one_report_naming_the_field(mutate, field, reason, caplog):
    reports = Reports()
    with caplog.at_level(logging.WARNING, logger="ebpf_proxy.k8s"):
        assert convert.service_ports(_svc_with(mutate), reports) == []
    assert [(r.kind, r.field, r.reason) for r in reports] == [("Service", field, reason)]
    assert reports[0].skipped == "object"
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert field in line.getMessage()
    if field != "metadata.name":  # without a name there is nothing to name
        assert reports[0].obj in ("default/web", "web") and reports[0].obj in line.getMessage()


@pytest.mark.parametrize("obj", [None, 42, "svc", [], {"metadata": "x"}], ids=repr)
def test_non_objects_never_raise(obj):
    reports = Reports()
    assert convert.service_ports(obj, reports) == []
    assert convert.endpoint_slice(obj, "n1", reports) is None
    assert convert.node_info(obj, reports) is None
    assert len(reports) == 3


def test_conversion_does_not_modify_the_input():
    obj = service(svc_type="LoadBalancer", ports=[port(node_port=30080)], externalIPs=["bad", "192.0.2.1"])
    before = copy.deepcopy(obj)
    convert.service_ports(obj)
    assert obj == before


# ---- EndpointSlices -------------------------------------------------------------------------------


def test_slice_endpoints_per_port_with_conditions_defaulted():
    obj = endpoint_slice(
        endpoints=[
            endpoint("10.244.1.5", "n1"),  # no conditions: ready, serving, not terminating
            endpoint("10.244.2.6", "n2", ready=False),  # serving defaults to ready (false)
            endpoint("10.244.2.7", "n2", ready=False, serving=True, terminating=True),
            endpoint("10.244.3.8"),  # no nodeName
        ],
        ports=[{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 53, "protocol": "UDP"}],
    )
    sl = convert.endpoint_slice(obj, "n1")
    assert (sl.namespace, sl.name, sl.service, sl.service_key) == ("default", "web-abc", "web", "default/web")
    http = sl.endpoints[spn("http")]
    assert http == (
        Endpoint("10.244.1.5", 8080, "n1", ready=True, serving=True, terminating=False, is_local=True),
        Endpoint("10.244.2.6", 8080, "n2", ready=False, serving=False, terminating=False, is_local=False),
        Endpoint("10.244.2.7", 8080, "n2", ready=False, serving=True, terminating=True, is_local=False),
        Endpoint("10.244.3.8", 8080, None, ready=True, serving=True, terminating=False, is_local=False),
    )
    assert [e.port for e in sl.endpoints[spn("dns", Protocol.UDP)]] == [53] * 4


def test_slice_port_without_name_or_protocol_matches_the_unnamed_tcp_port():
    sl = convert.endpoint_slice(endpoint_slice(ports=[{"port": 8080}]), "n1")
    assert list(sl.endpoints) == [spn(port_name="")]


def test_empty_slice_has_ports_but_no_endpoints():
    obj = endpoint_slice()
    obj["endpoints"] = None
    sl = convert.endpoint_slice(obj, "n1")
    assert sl.endpoints == {spn(): ()}


@pytest.mark.parametrize("address_type", ["IPv6", "FQDN"])
def test_slices_of_a_family_not_served_contribute_nothing_and_are_not_invalid(address_type):
    reports = Reports()
    assert convert.endpoint_slice(endpoint_slice(address_type=address_type), "n1", reports) is None
    assert reports == []


def test_fqdn_slices_belong_to_no_family():
    assert convert.endpoint_slice(endpoint_slice(address_type="FQDN"), "n1", None, (4, 6)) is None


def test_an_ipv6_slice_belongs_to_the_ipv6_proxier():
    obj = endpoint_slice(address_type="IPv6", endpoints=[endpoint("fd00:10:244:1::5", "n1"),
                                                         endpoint("10.244.1.6", "n2"),
                                                         endpoint("FD00:10:244:2::0006", "n2")])
    reports = Reports()
    sl = convert.endpoint_slice(obj, "n1", reports, families=(4, 6))
    assert sl.family == 6
    assert [(ep.ip, ep.is_local) for ep in sl.endpoints[spn()]] == [("fd00:10:244:1::5", True),
                                                                      ("fd00:10:244:2::6", False)]
    assert [(r.field, r.reason) for r in reports] == [("endpoints[1].addresses[0]", "wrong_family")]
    assert "is not IPv6 in an IPv6 slice" in reports[0].detail
    assert convert.endpoint_slice(obj, "n1", None, families=(4,)) is None


def test_change_trigger_time_annotation():
    sl = convert.endpoint_slice(endpoint_slice(trigger="2024-05-01T10:00:00Z"), "n1")
    assert sl.trigger_time == 1714557600.0
    sl = convert.endpoint_slice(endpoint_slice(trigger="2024-05-01T10:00:00.5+00:00"), "n1")
    assert sl.trigger_time == 1714557600.5
    assert convert.endpoint_slice(endpoint_slice(trigger="yesterday"), "n1").trigger_time is None


MALFORMED_ENDPOINTS = [
    # (id, endpoint entry, field, reason)
    ("ip-invalid", endpoint("10.244.1.300"), "endpoints[0].addresses[0]", "invalid_ip"),
    ("ip-v6-in-v4-slice", endpoint("fd00::5"), "endpoints[0].addresses[0]", "wrong_family"),
    ("addresses-empty", {"addresses": []}, "endpoints[0].addresses", "missing_field"),
    ("addresses-missing", {"nodeName": "n1"}, "endpoints[0].addresses", "missing_field"),
    ("addresses-not-list", {"addresses": "10.244.1.5"}, "endpoints[0].addresses", "wrong_type"),
    ("ready-not-bool", {"addresses": ["10.244.1.5"], "conditions": {"ready": "yes"}},
     "endpoints[0].conditions.ready", "wrong_type"),
    ("conditions-not-object", {"addresses": ["10.244.1.5"], "conditions": True}, "endpoints[0].conditions",
     "wrong_type"),
    ("node-name-not-string", {"addresses": ["10.244.1.5"], "nodeName": 7}, "endpoints[0].nodeName", "wrong_type"),
    ("entry-not-object", "10.244.1.5", "endpoints[0]", "wrong_type"),
]


@pytest.mark.parametrize("bad,field,reason", [m[1:] for m in MALFORMED_ENDPOINTS],
                         ids=[m[0] for m in MALFORMED_ENDPOINTS])
def test_malformed_endpoint_drops_only_that_endpoint(bad, field, reason):
    reports = Reports()
    sl = convert.endpoint_slice(endpoint_slice(endpoints=[bad, endpoint("10.244.2.6", "n2")]), "n1", reports)
    assert [e.ip for e in sl.endpoints[spn()]] == ["10.244.2.6"]
    assert [(r.kind, r.obj, r.field, r.reason, r.skipped) for r in reports] == [
        ("EndpointSlice", "default/web-abc", field, reason, "endpoint")]


MALFORMED_SLICE_PORTS = [
    ("port-null", {"name": "http", "port": None}, "ports[0].port", "wrong_type"),
    ("port-zero", {"name": "http", "port": 0}, "ports[0].port", "port_out_of_range"),
    ("port-too-big", {"name": "http", "port": 65536}, "ports[0].port", "port_out_of_range"),
    ("protocol-unknown", {"name": "http", "port": 80, "protocol": "GRE"}, "ports[0].protocol", "unknown_protocol"),
    ("not-object", 8080, "ports[0]", "wrong_type"),
]


@pytest.mark.parametrize("bad,field,reason", [m[1:] for m in MALFORMED_SLICE_PORTS],
                         ids=[m[0] for m in MALFORMED_SLICE_PORTS])
def test_malformed_slice_port_drops_only_that_port(bad, field, reason):
    reports = Reports()
    obj = endpoint_slice(ports=[bad, {"name": "metrics", "port": 9090, "protocol": "TCP"}])
    sl = convert.endpoint_slice(obj, "n1", reports)
    assert list(sl.endpoints) == [spn("metrics")]
    assert [(r.field, r.reason, r.skipped) for r in reports] == [(field, reason, "port")]


MALFORMED_SLICES = [
    ("no-service-label", lambda o: o["metadata"]["labels"].clear(),
     "metadata.labels[kubernetes.io/service-name]", "missing_field"),
    ("labels-not-object", lambda o: o["metadata"].update(labels=["web"]), "metadata.labels", "wrong_type"),
    ("address-type-missing", lambda o: o.pop("addressType"), "addressType", "missing_field"),
    ("address-type-unknown", lambda o: o.update(addressType="IPv5"), "addressType", "invalid_value"),
    ("endpoints-not-list", lambda o: o.update(endpoints={"a": 1}), "endpoints", "wrong_type"),
    ("ports-not-list", lambda o: o.update(ports="http"), "ports", "wrong_type"),
    ("annotations-not-object", lambda o: o["metadata"].update(annotations="x"), "metadata.annotations",
     "wrong_type"),
]


@pytest.mark.parametrize("mutate,field,reason", [m[1:] for m in MALFORMED_SLICES],
                         ids=[m[0] for m in MALFORMED_SLICES])
def test_malformed_slice_is_skipped_whole(mutate, field, reason):
    obj = endpoint_slice()
    mutate(obj)
    reports = Reports()
    assert convert.endpoint_slice(obj, "n1", reports) is None
    assert [(r.field, r.reason, r.skipped) for r in reports] == [(field, reason, "object")]


def test_slice_service_key_for_deletes():
    assert convert.slice_service_key(endpoint_slice()) == "default/web"
    assert convert.slice_service_key({"metadata": {"name": "x", "namespace": "d"}}) is None
    assert convert.slice_service_key("garbage") is None


# ---- Nodes ----------------------------------------------------------------------------------------


def test_node_addresses_primary_and_eligibility():
    obj = node("n1", internal="192.168.1.10", external="203.0.113.10")
    obj["status"]["addresses"].insert(0, {"type": "InternalIP", "address": "fd00::10"})
    info = convert.node_info(obj)
    assert info == NodeState(name="n1", addresses=("fd00::10", "192.168.1.10", "203.0.113.10"),
                             primary_ip="fd00::10", eligible=True)
    # an IPv6-primary dual-stack node: each family's own primary, the IPv6 proxier first
    assert (info.primary_of(4), info.primary_of(6), info.families) == ("192.168.1.10", "fd00::10", (6, 4))
    assert convert.node_info(node("n1", internal=None, external="203.0.113.10")).primary_ip == "203.0.113.10"


def test_node_being_deleted_is_not_eligible():
    assert not convert.node_info(node("n1", deletionTimestamp="2024-05-01T10:00:00Z")).eligible
    obj = node("n1")
    obj["spec"] = {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
    assert not convert.node_info(obj).eligible


def test_node_bad_address_is_reported_and_skipped():
    obj = node("n1", internal="192.168.1.10")
    obj["status"]["addresses"].append({"type": "ExternalIP", "address": "999.1.1.1"})
    reports = Reports()
    info = convert.node_info(obj, reports)
    assert info.addresses == ("192.168.1.10",)
    assert [(r.kind, r.obj, r.field, r.reason) for r in reports] == [
        ("Node", "n1", "status.addresses[2].address", "invalid_ip")]


def test_a_failing_reporter_does_not_turn_bad_input_into_a_crash():
    def broken(_):
        raise RuntimeError("metrics down")
    assert convert.service_ports(service(cluster_ip="nope"), broken) == []


def test_node_pod_cidrs_for_the_node_cidr_detector():
    """--detect-local-mode NodeCIDR matches the Node's spec.podCIDRs (spec.podCIDR on old objects)."""
    obj = node("n1")
    obj["spec"] = {"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24", "fd00:10:244:3::/64"]}
    assert convert.node_info(obj).pod_cidrs == ("10.244.3.0/24", "fd00:10:244:3::/64")
    obj["spec"] = {"podCIDR": "10.244.4.0/24"}
    assert convert.node_info(obj).pod_cidrs == ("10.244.4.0/24",)
    assert convert.node_info(node("n1")).pod_cidrs == ()


def test_node_bad_pod_cidr_is_reported_and_skipped():
    obj = node("n1")
    obj["spec"] = {"podCIDRs": ["10.244.3.0/24", "10.244.300.0/24", 7]}
    reports = Reports()
    assert convert.node_info(obj, reports).pod_cidrs == ("10.244.3.0/24",)
    assert [(r.field, r.reason) for r in reports] == [("spec.podCIDRs[1]", "invalid_cidr"),
                                                      ("spec.podCIDRs[2]", "wrong_type")]


def test_node_pod_cidr_is_parsed_as_kube_proxy_parses_it():
    """ParseCIDRSloppy: a bare address is not a CIDR (ip_network read "10.244.3.0" as a /32), and
    leading zeros are decimal. Found by tests/unit/test_fuzz_k8s.py."""
    obj = node("n1")
    obj["spec"] = {"podCIDRs": ["010.244.003.0/24", "10.244.9.0", ""]}
    reports = Reports()
    assert convert.node_info(obj, reports).pod_cidrs == ("10.244.3.0/24",)
    assert [(r.field, r.reason) for r in reports] == [("spec.podCIDRs[1]", "invalid_cidr"),
                                                      ("spec.podCIDRs[2]", "invalid_cidr")]


def test_bad_load_balancer_ip_report_names_the_ingress_field():
    """The report named `status.loadBalancer.ingress[0].ip[0]`, a field that does not exist.
    Found by tests/unit/test_fuzz_k8s.py."""
    reports = Reports()
    obj = service(svc_type="LoadBalancer", status={"loadBalancer": {"ingress": [{"ip": "10.0.0.256"},
                                                                                {"ip": "198.51.100.1"}]}})
    (sp,) = convert.service_ports(obj, reports)
    assert sp.load_balancer_ips == ("198.51.100.1",)
    assert [(r.field, r.reason, r.skipped) for r in reports] == [
        ("status.loadBalancer.ingress[0].ip", "invalid_ip", "ip")]


def test_a_namespace_that_is_not_a_string_is_reported_as_such():
    """It was reported as "metadata.name: missing or not a string", pointing at the wrong field.
    Found by tests/unit/test_fuzz_k8s.py."""
    reports = Reports()
    assert convert.service_ports(service(namespace=["default"]), reports) == []
    assert [(r.obj, r.field, r.reason) for r in reports] == [("?", "metadata.namespace", "wrong_type")]
    assert "'web'" in reports[0].detail


@pytest.mark.parametrize("value", [False, "", [], {}, 0.0])
def test_a_falsy_node_port_of_the_wrong_type_is_reported_not_read_as_unset(value):
    """`nodePort: false` was read as "no nodePort" without a word. Found by tests/unit/test_fuzz_k8s.py."""
    reports = Reports()
    assert convert.service_ports(service(svc_type="NodePort", ports=[{"port": 80, "nodePort": value}]), reports) == []
    assert [(r.field, r.reason) for r in reports] == [("spec.ports[0].nodePort", "wrong_type")]
    reports = Reports()
    obj = service(svc_type="LoadBalancer", externalTrafficPolicy="Local", healthCheckNodePort=value)
    assert convert.service_ports(obj, reports) == []
    assert [(r.field, r.reason) for r in reports] == [("spec.healthCheckNodePort", "wrong_type")]


@pytest.mark.parametrize("bad", ['a"b', "a\nb", "a b", "Web", "名前", "-web", "a" * 64])
def test_names_written_into_rules_must_be_dns_labels(bad):
    """A quote or a newline in a Service, namespace or port name broke the iptables-restore input
    (a newline could smuggle in a rule of its own). kube-apiserver allows only DNS-1123 labels
    there; the agent now checks it. Found by tests/unit/test_fuzz_k8s.py."""
    cases = [
        (convert.service_ports, service(name=bad), "metadata.name"),
        (convert.service_ports, service(namespace=bad), "metadata.namespace"),
        (convert.service_ports, service(ports=[port(bad, 80)]), "spec.ports[0].name"),
        (lambda o, r: convert.endpoint_slice(o, "n1", r), endpoint_slice(namespace=bad), "metadata.namespace"),
        (lambda o, r: convert.endpoint_slice(o, "n1", r), endpoint_slice(service_name=bad),
         "metadata.labels[kubernetes.io/service-name]"),
    ]
    for fn, obj, field in cases:
        reports = Reports()
        assert not fn(obj, reports)
        assert [(r.field, r.reason) for r in reports] == [(field, "invalid_value")], field
    reports = Reports()
    sl = convert.endpoint_slice(endpoint_slice(ports=[{"name": bad, "port": 80}, {"name": "http", "port": 8080}]),
                                "n1", reports)
    assert [spn.port for spn in sl.endpoints] == ["http"]
    assert [(r.field, r.reason, r.skipped) for r in reports] == [("ports[0].name", "invalid_value", "port")]


def test_huge_address_lists_convert_in_linear_time():
    """80,000 distinct externalIPs, load-balancer IPs and source ranges (about what the API
    server's 1.5 MB object limit lets through) took 34 s to deduplicate with list lookups, a
    watch handler stalled for every update of one hostile Service; now well under a second.
    Found while sizing the huge-list cases of tests/unit/test_fuzz_k8s.py."""
    import time

    ips = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(80_000)]
    obj = service(svc_type="LoadBalancer", externalIPs=ips, loadBalancerSourceRanges=[f"{ip}/32" for ip in ips],
                  status={"loadBalancer": {"ingress": [{"ip": ip} for ip in ips]}})
    started = time.process_time()
    (sp,) = convert.service_ports(obj)
    assert time.process_time() - started < 5
    assert len(sp.external_ips) == len(sp.load_balancer_ips) == len(sp.load_balancer_source_ranges) == 80_000
    assert sp.external_ips[:2] == ("10.0.0.0", "10.0.0.1"), "order kept"


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "checked"])
def test_a_port_name_is_one_string_object_however_many_ports_have_it(monkeypatch, plain):
    # decoded as the API client decodes: every "http" its own string object
    decoded = json.loads(json.dumps([service("a", ports=[port("http"), port("dns", 53, "UDP")]),
                                     service("b", ports=[port("http", 8080)]),
                                     endpoint_slice("a-1", service_name="a"), endpoint_slice("b-1", service_name="b")]))
    if not plain:  # the checked readings
        monkeypatch.setattr(convert, "_plain_service_ports", lambda *_: None)
        monkeypatch.setattr(convert, "_plain_ipv4_slice", lambda *_: None)
    names = [spn.port for obj in decoded[:2] for spn in (p.name for p in convert.service_ports(obj))]
    names += [spn.port for obj in decoded[2:] for spn in convert.endpoint_slice(obj, "n1").endpoints]
    assert names == ["http", "dns", "http", "http", "http"]
    http = [name for name in names if name == "http"]
    assert all(name is http[0] for name in http), "one object per distinct port name, not one per port"
