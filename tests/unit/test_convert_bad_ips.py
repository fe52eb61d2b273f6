"""Objects written with legacy IP forms, read as kube-proxy reads them.

kube-apiserver accepts leading zeros ("10.180.00.001") and IPv4-mapped IPv6 in the legacy IP
fields, with a warning; kube-proxy parses every one of those fields with netutils.ParseIPSloppy /
ParseCIDRSloppy (pkg/proxy/serviceport.go newBaseServiceInfo, pkg/proxy/util MapIPsByIPFamily /
MapCIDRsByIPFamily, pkg/proxy/endpointslicecache.go addEndpoints) and programs the normalised
address. Upstream pins this in TestBadIPs (pkg/proxy/iptables and nftables proxier_test.go), and the
whitespace-padded loadBalancerSourceRanges in TestOverallIPTablesRules (svc5, " 203.0.113.0/25").
"""

from __future__ import annotations

from ebpf_proxy.k8s import convert
from ebpf_proxy.k8s.invalid import Invalid
from tests.unit.kobjects import endpoint, endpoint_slice, node, port, service


class Reports(list):
    def __call__(self, problem: Invalid) -> None:
        self.append(problem)


def bad_ip_load_balancer(**spec) -> dict:
    """TestBadIPs' LoadBalancer Service: every IP field of it in a legacy form."""
    fields = dict(
        svc_type="LoadBalancer", cluster_ip="172.30.0.041", ports=[port("p80", 80, "TCP", node_port=3001)],
        externalIPs=["192.168.099.022"], loadBalancerSourceRanges=["203.0.113.000/025"],
        status={"loadBalancer": {"ingress": [{"ip": "1.2.3.004"}]}},
    )
    fields.update(spec)
    return service(**fields)


def test_bad_ips_service_fields_are_normalised_like_TestBadIPs():
    reports = Reports()
    (sp,) = convert.service_ports(bad_ip_load_balancer(), reports)
    assert sp.cluster_ip == "172.30.0.41"
    assert sp.external_ips == ("192.168.99.22",)
    assert sp.load_balancer_ips == ("1.2.3.4",)
    assert sp.load_balancer_source_ranges == ("203.0.113.0/25",)
    assert sp.node_port == 3001
    assert reports == []  # accepted, not "invalid": kube-proxy logs nothing for them either


def test_bad_ips_cluster_ip_from_clusterIP_alone():
    obj = service(cluster_ip="10.096.000.010")
    del obj["spec"]["clusterIPs"]  # an object from before dual-stack: kube-proxy reads clusterIP
    (sp,) = convert.service_ports(obj)
    assert sp.cluster_ip == "10.96.0.10"


def test_ipv4_mapped_ipv6_is_the_ipv4_address():
    """ParseIPSloppy("::ffff:1.2.3.4").To4() is 1.2.3.4: kube-proxy files it under IPv4."""
    obj = bad_ip_load_balancer(externalIPs=["::ffff:192.168.99.22"],
                               status={"loadBalancer": {"ingress": [{"ip": "::ffff:1.2.3.4"}]}})
    (sp,) = convert.service_ports(obj)
    assert sp.external_ips == ("192.168.99.22",) and sp.load_balancer_ips == ("1.2.3.4",)


def test_padded_source_range_is_trimmed_like_TestOverallIPTablesRules():
    (sp,) = convert.service_ports(bad_ip_load_balancer(loadBalancerSourceRanges=[" 203.0.113.0/25 "]))
    assert sp.load_balancer_source_ranges == ("203.0.113.0/25",)


def test_unparsable_external_ip_is_skipped_alone_like_MapIPsByIPFamily():
    """ParseIPSloppy does not trim: a padded or broken external IP is 'Skipping invalid IP'."""
    reports = Reports()
    obj = bad_ip_load_balancer(externalIPs=[" 192.168.99.22", "192.168.99.256", "192.168.99.023"])
    (sp,) = convert.service_ports(obj, reports)
    assert sp.external_ips == ("192.168.99.23",)
    assert [(r.field, r.reason, r.skipped) for r in reports] == [
        ("spec.externalIPs[0]", "invalid_ip", "ip"), ("spec.externalIPs[1]", "invalid_ip", "ip")]


def test_bad_ips_endpoint_addresses_are_normalised_like_TestBadIPs():
    slice_ = endpoint_slice(endpoints=[endpoint("10.180.00.001", "n1"), endpoint("10.180.0.002")])
    result = convert.endpoint_slice(slice_, "n1")
    (eps,) = result.endpoints.values()
    assert [(e.ip, e.is_local) for e in eps] == [("10.180.0.1", True), ("10.180.0.2", False)]


def test_bad_ips_node_addresses_are_normalised():
    """kube-proxy reads its node's IPs with ParseIPSloppy too (utilnode.GetNodeHostIPs)."""
    state = convert.node_info(node(internal="192.168.001.010"))
    assert state.addresses == ("192.168.1.10",) and state.primary_ip == "192.168.1.10"
