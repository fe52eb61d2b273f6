"""Legacy IP forms and padded source ranges: accepted and stored as given, with kube-apiserver's
warnings (util/validation/ip.go GetWarningsForIP/GetWarningsForCIDR, pkg/api/service/warnings.go,
the Service status and EndpointSlice strategies)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ebpf_proxy.apiserver import ApiError, ApiServer, Store
from ebpf_proxy.apiserver import legacyip


@pytest.fixture
def server():
    store = Store(service_cidr="10.96.0.0/16")
    srv = ApiServer(store, ["127.0.0.1:0"]).start()
    yield srv, store
    srv.stop()
    store.close()


def call(srv, path, method="POST", body=None, content_type="application/json"):
    req = urllib.request.Request(srv.url + path, method=method, data=json.dumps(body).encode(),
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers.get_all("Warning") or [], json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get_all("Warning") or [], json.loads(err.read())


def nonstandard(field, value, use):
    return (f'299 - "{field}: non-standard IP address \\"{value}\\" will be considered invalid in a future '
            f'Kubernetes release: use \\"{use}\\""')


LB = {
    "metadata": {"name": "lb"},
    "spec": {"type": "LoadBalancer", "clusterIP": "10.96.00.041", "ports": [{"port": 80}],
             "externalIPs": ["192.168.099.022"], "loadBalancerIP": "1.2.3.004",
             "loadBalancerSourceRanges": [" 203.0.113.0/25 ", "198.051.100.0/24"]},
    "status": {"loadBalancer": {"ingress": [{"ip": "1.2.3.004"}]}},
}


def test_service_with_legacy_ips_is_stored_as_given_with_warnings(server):
    srv, store = server
    status, warnings, obj = call(srv, "/api/v1/namespaces/default/services", body=LB)
    assert status == 201, obj
    spec = obj["spec"]
    assert spec["clusterIP"] == "10.96.00.041" and spec["clusterIPs"] == ["10.96.00.041"]
    assert spec["externalIPs"] == ["192.168.099.022"]
    assert spec["loadBalancerSourceRanges"] == [" 203.0.113.0/25 ", "198.051.100.0/24"]  # as given
    assert obj["status"]["loadBalancer"]["ingress"] == [{"ip": "1.2.3.004"}]
    assert warnings == [
        nonstandard("spec.clusterIPs[0]", "10.96.00.041", "10.96.0.41"),
        nonstandard("spec.externalIPs[0]", "192.168.099.022", "192.168.99.22"),
        nonstandard("spec.loadBalancerIP", "1.2.3.004", "1.2.3.4"),
        # the padded range is not parsable as is, so upstream has no warning for it either
        '299 - "spec.loadBalancerSourceRanges[1]: non-standard CIDR value \\"198.051.100.0/24\\" will be '
        'considered invalid in a future Kubernetes release: use \\"198.51.100.0/24\\""',
        nonstandard("status.loadBalancer.ingress[0]", "1.2.3.004", "1.2.3.4"),
    ]
    # the legacy form holds the address itself: 10.96.0.41 is taken
    with pytest.raises(ApiError, match="provided IP is already allocated"):
        store.create("Service", {"metadata": {"name": "b"}, "spec": {"clusterIP": "10.96.0.41", "ports": [{"port": 80}]}})
    store.delete("Service", "default", "lb")
    assert store.create("Service", {"metadata": {"name": "c"}, "spec": {"clusterIP": "10.96.0.41", "ports": [{"port": 80}]}})


def test_status_update_with_legacy_ingress_ip_warns(server):
    srv, store = server
    store.create("Service", {"metadata": {"name": "lb"}, "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]}})
    patch = {"status": {"loadBalancer": {"ingress": [{"ip": "5.6.7.008"}]}}}
    status, warnings, obj = call(srv, "/api/v1/namespaces/default/services/lb/status", "PATCH", patch,
                                 "application/merge-patch+json")
    assert status == 200 and obj["status"]["loadBalancer"]["ingress"] == [{"ip": "5.6.7.008"}]
    assert warnings == [nonstandard("status.loadBalancer.ingress[0]", "5.6.7.008", "5.6.7.8")]
    bad = {"status": {"loadBalancer": {"ingress": [{"ip": "5.6.7.256"}]}}}
    status, _, obj = call(srv, "/api/v1/namespaces/default/services/lb/status", "PATCH", bad,
                          "application/merge-patch+json")
    assert status == 422 and obj["message"] == (
        'Service "lb" is invalid: status.loadBalancer.ingress[0].ip: Invalid value: "5.6.7.256": '
        "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)")


def test_endpoint_slice_with_legacy_address_warns_unless_a_controller_wrote_it(server):
    srv, _ = server
    body = {"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.180.00.001"]}], "ports": [{"name": "http", "port": 80}]}
    status, warnings, obj = call(srv, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", body=body)
    assert status == 201 and obj["endpoints"][0]["addresses"] == ["10.180.00.001"]
    assert warnings == [nonstandard("endpoints[0].addresses[0]", "10.180.00.001", "10.180.0.1")]
    body["metadata"] = {"name": "web-2", "labels": {"kubernetes.io/service-name": "web",
                                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}}
    status, warnings, _ = call(srv, "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices", body=body)
    assert status == 201 and warnings == []


@pytest.mark.parametrize("spec, message", [
    ({"clusterIP": "10.96.0.300"},
     'spec.clusterIP: Invalid value: "10.96.0.300": must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)'),
    ({"externalIPs": [" 192.168.99.22"]},
     'spec.externalIPs[0]: Invalid value: " 192.168.99.22": must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)'),
    ({"type": "LoadBalancer", "loadBalancerSourceRanges": [" 203.0.113.0/33 "]},
     'spec.LoadBalancerSourceRanges[0]: Invalid value: "203.0.113.0/33": must be a valid CIDR value, '
     "(e.g. 10.9.8.0/24 or 2001:db8::/64)"),
    ({"loadBalancerSourceRanges": ["203.0.113.0/24"]},
     "spec.LoadBalancerSourceRanges: Forbidden: may only be used when `type` is 'LoadBalancer'"),
])
def test_what_stays_invalid(server, spec, message):
    _, store = server
    with pytest.raises(ApiError) as exc:
        store.create("Service", {"metadata": {"name": "bad"}, "spec": {"ports": [{"port": 80}], **spec}})
    assert exc.value.message == f'Service "bad" is invalid: {message}'


def test_endpoint_slice_address_of_the_wrong_family(server):
    _, store = server
    body = {"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["2001:db8::1"]}]}
    with pytest.raises(ApiError) as exc:
        store.create("EndpointSlice", body)
    assert exc.value.message.endswith(
        'endpoints[0].addresses[0]: Invalid value: "2001:db8::1": must be a valid IPv4 address')


@pytest.mark.parametrize("value, warnings", [
    ("10.0.0.0/8", []),
    ("10.0.0.5/8", ['f: CIDR value "10.0.0.5/8" is ambiguous in this context (should be "10.0.0.0/8" or "10.0.0.5/32"?)']),
    ("010.0.0.0/08", ['f: non-standard CIDR value "010.0.0.0/08" will be considered invalid in a future Kubernetes '
                      'release: use "10.0.0.0/8"']),
    (" 10.0.0.0/8", []),
    ("2001:db8:0::/64", ['f: IPv6 CIDR value "2001:db8:0::/64" should be in RFC 5952 canonical format ("2001:db8::/64")']),
])
def test_cidr_warnings(value, warnings):
    assert legacyip.cidr_warnings("f", value) == warnings


def test_ip_warnings():
    assert legacyip.ip_warnings("f", "10.0.0.1") == []
    assert legacyip.ip_warnings("f", "::ffff:10.0.0.1") == [
        'f: non-standard IP address "::ffff:10.0.0.1" will be considered invalid in a future Kubernetes release: '
        'use "10.0.0.1"']
    assert legacyip.ip_warnings("f", "2001:db8:0::1") == [
        'f: IPv6 address "2001:db8:0::1" should be in RFC 5952 canonical format ("2001:db8::1")']
