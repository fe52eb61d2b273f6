"""What kube-apiserver rejects, the lab's rejects too, in its words: `<Kind> "<name>" is invalid:
<field>: <reason>: <value>: <detail>` (k8s.io/apimachinery field.Error, as kubectl prints it)."""

from __future__ import annotations

import pytest

from ebpf_proxy.apiserver import ApiError, Store


@pytest.fixture
def store():
    s = Store(service_cidr="10.96.0.0/16", node_port_range=(30000, 32767))
    yield s
    s.close()


def create_service(store, name="web", **spec):
    spec.setdefault("ports", [{"port": 80}])
    return store.create("Service", {"metadata": {"name": name}, "spec": spec})


def rejected(call) -> str:
    with pytest.raises(ApiError) as exc:
        call()
    assert exc.value.code == 422 and exc.value.reason == "Invalid"
    return exc.value.message


def test_cluster_ip_outside_the_service_cidr(store):
    assert rejected(lambda: create_service(store, clusterIP="10.97.0.1")) == (
        'Service "web" is invalid: spec.clusterIPs[0]: Invalid value: "10.97.0.1": provided IP is not in the '
        "valid range. The range of valid IPs is 10.96.0.0/16")
    assert rejected(lambda: create_service(store, clusterIPs=["10.97.0.1"])).startswith(
        'Service "web" is invalid: spec.clusterIPs[0]: Invalid value: "10.97.0.1": provided IP is not in')


def test_cluster_ip_already_allocated(store):
    create_service(store, "a", clusterIP="10.96.0.10")
    assert rejected(lambda: create_service(store, "b", clusterIP="10.96.0.10")) == (
        'Service "b" is invalid: spec.clusterIPs[0]: Invalid value: "10.96.0.10": provided IP is already allocated')


def test_node_port_taken_by_another_service(store):
    create_service(store, "a", type="NodePort", ports=[{"port": 80, "nodePort": 30080}])
    assert rejected(lambda: create_service(store, "b", type="NodePort", ports=[{"port": 80, "nodePort": 30080}])) == (
        'Service "b" is invalid: spec.ports[0].nodePort: Invalid value: 30080: provided port is already allocated')


def test_node_port_twice_in_one_service(store):
    ports = [{"name": "a", "port": 80, "nodePort": 30080}, {"name": "b", "port": 81, "nodePort": 30080}]
    assert rejected(lambda: create_service(store, type="NodePort", ports=ports)) == (
        'Service "web" is invalid: spec.ports[1].nodePort: Duplicate value: 30080')


def test_one_node_port_for_tcp_and_udp_of_one_port_is_fine(store):
    ports = [{"name": "a", "port": 53, "protocol": "TCP", "nodePort": 30053},
             {"name": "b", "port": 53, "protocol": "UDP", "nodePort": 30053}]
    assert [p["nodePort"] for p in create_service(store, type="NodePort", ports=ports)["spec"]["ports"]] == [30053] * 2


def test_health_check_node_port_equal_to_a_node_port(store):
    spec = {"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 30080,
            "ports": [{"port": 80, "nodePort": 30080}]}
    assert rejected(lambda: create_service(store, **spec)) == (
        'Service "web" is invalid: spec.healthCheckNodePort: Invalid value: 30080: provided port is already allocated')


@pytest.mark.parametrize("port, field, value", [
    ({"port": 0, "targetPort": 80}, "spec.ports[0].port", 0),
    ({"port": 65536, "targetPort": 80}, "spec.ports[0].port", 65536),
    ({"port": -1, "targetPort": 80}, "spec.ports[0].port", -1),
    ({"port": 80, "targetPort": 65536}, "spec.ports[0].targetPort", 65536),
    ({"port": 80, "targetPort": -5}, "spec.ports[0].targetPort", -5),
])
def test_service_port_numbers(store, port, field, value):
    assert rejected(lambda: create_service(store, ports=[port])) == (
        f'Service "web" is invalid: {field}: Invalid value: {value}: must be between 1 and 65535, inclusive')


def test_port_zero_without_target_port_is_two_errors(store):
    """Defaulting copies port into targetPort first, so both fields are reported, as upstream."""
    assert rejected(lambda: create_service(store, ports=[{"port": 0}])) == (
        'Service "web" is invalid: [spec.ports[0].port: Invalid value: 0: must be between 1 and 65535, inclusive, '
        "spec.ports[0].targetPort: Invalid value: 0: must be between 1 and 65535, inclusive]")


@pytest.mark.parametrize("node_port", [65536, -1, 3001])
def test_node_port_outside_the_range(store, node_port):
    assert rejected(lambda: create_service(store, type="NodePort", ports=[{"port": 80, "nodePort": node_port}])) == (
        f'Service "web" is invalid: spec.ports[0].nodePort: Invalid value: {node_port}: provided port is not in the '
        "valid range. The range of valid ports is 30000-32767")


@pytest.mark.parametrize("number", [0, 65536, -1])
def test_endpoint_slice_port_numbers(store, number):
    slice_ = {"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}, "addressType": "IPv4",
              "endpoints": [{"addresses": ["10.244.1.5"]}], "ports": [{"name": "http", "port": number}]}
    assert rejected(lambda: store.create("EndpointSlice", slice_)) == (
        f'EndpointSlice.discovery.k8s.io "web-1" is invalid: ports[0].port: Invalid value: {number}: '
        "must be between 1 and 65535, inclusive")
