"""Service defaulting, validation and cluster-IP / node-port allocation."""

from __future__ import annotations

import ipaddress

import pytest

from ebpf_proxy.apiserver import ApiError, Store


@pytest.fixture
def store():
    s = Store(service_cidr="10.96.0.0/24", node_port_range=(30000, 30099))
    yield s
    s.close()


def create(store, name="web", **spec):
    spec.setdefault("ports", [{"port": 80}])
    return store.create("Service", {"metadata": {"name": name}, "spec": spec})


def invalid(store, name="bad", **spec):
    with pytest.raises(ApiError) as exc:
        create(store, name, **spec)
    assert exc.value.code == 422 and exc.value.reason == "Invalid"
    return exc.value


def test_defaults_like_the_real_api_server(store):
    spec = create(store, selector={"app": "web"}, ports=[{"port": 80}])["spec"]
    assert spec["type"] == "ClusterIP"
    assert spec["sessionAffinity"] == "None"
    assert spec["internalTrafficPolicy"] == "Cluster"
    assert "externalTrafficPolicy" not in spec
    assert spec["ports"] == [{"port": 80, "protocol": "TCP", "targetPort": 80}]
    assert ipaddress.ip_address(spec["clusterIP"]) in ipaddress.ip_network("10.96.0.0/24")
    assert spec["clusterIPs"] == [spec["clusterIP"]]
    assert spec["ipFamilies"] == ["IPv4"] and spec["ipFamilyPolicy"] == "SingleStack"


def test_named_target_port_is_kept(store):
    spec = create(store, ports=[{"port": 80, "name": "http", "targetPort": "web"}])["spec"]
    assert spec["ports"][0]["targetPort"] == "web"


def test_client_ip_affinity_default_timeout(store):
    spec = create(store, sessionAffinity="ClientIP")["spec"]
    assert spec["sessionAffinityConfig"] == {"clientIP": {"timeoutSeconds": 10800}}


def test_headless_keeps_none(store):
    spec = create(store, clusterIP="None", ports=[])["spec"]
    assert spec["clusterIP"] == "None" and spec["clusterIPs"] == ["None"]


def test_cluster_ips_are_unique_and_released_on_delete(store):
    ips = {create(store, f"s{i}")["spec"]["clusterIP"] for i in range(10)}
    assert len(ips) == 10
    explicit = create(store, "fixed", clusterIP="10.96.0.10")["spec"]["clusterIP"]
    assert explicit == "10.96.0.10"
    err = invalid(store, "dup", clusterIP="10.96.0.10")
    assert err.details["causes"][0]["field"] == "spec.clusterIPs[0]"
    assert "already allocated" in err.message
    store.delete("Service", "default", "fixed")
    assert create(store, "again", clusterIP="10.96.0.10")["spec"]["clusterIP"] == "10.96.0.10"


def test_cluster_ip_outside_the_cidr_is_rejected(store):
    err = invalid(store, clusterIP="10.97.0.1")
    assert err.details["causes"] == [{
        "reason": "FieldValueInvalid",
        "field": "spec.clusterIPs[0]",
        "message": 'Invalid value: "10.97.0.1": provided IP is not in the valid range. The range of valid IPs is 10.96.0.0/24',
    }]


def test_node_ports_allocated_for_nodeport_and_loadbalancer(store):
    np = create(store, "np", type="NodePort", ports=[{"port": 80, "name": "a"}, {"port": 81, "name": "b"}])["spec"]
    assert np["externalTrafficPolicy"] == "Cluster"
    ports = [p["nodePort"] for p in np["ports"]]
    assert len(set(ports)) == 2 and all(30000 <= p <= 30099 for p in ports)
    lb = create(store, "lb", type="LoadBalancer")["spec"]
    assert lb["ports"][0]["nodePort"] not in ports
    assert lb["allocateLoadBalancerNodePorts"] is True
    assert "healthCheckNodePort" not in lb


def test_health_check_node_port_for_local_load_balancers(store):
    spec = create(store, type="LoadBalancer", externalTrafficPolicy="Local")["spec"]
    assert 30000 <= spec["healthCheckNodePort"] <= 30099
    assert spec["healthCheckNodePort"] != spec["ports"][0]["nodePort"]


def test_explicit_node_port_duplicates_and_range(store):
    create(store, "a", type="NodePort", ports=[{"port": 80, "nodePort": 30050}])
    err = invalid(store, type="NodePort", ports=[{"port": 80, "nodePort": 30050}])
    assert err.details["causes"][0]["field"] == "spec.ports[0].nodePort"
    assert "already allocated" in err.message
    err = invalid(store, type="NodePort", ports=[{"port": 80, "nodePort": 31000}])
    assert "valid range" in err.message and "30000-30099" in err.message
    err = invalid(store, type="NodePort", ports=[{"port": 80, "name": "a", "nodePort": 30060},
                                                  {"port": 81, "name": "b", "nodePort": 30060}])
    assert err.details["causes"][0]["field"] == "spec.ports[1].nodePort"


def test_failed_create_leaves_nothing_allocated(store):
    invalid(store, "bad", type="NodePort", clusterIP="10.96.0.20",
            ports=[{"port": 80, "name": "a", "nodePort": 30070}, {"port": 81, "name": "b", "nodePort": 99999}])
    spec = create(store, "good", type="NodePort", clusterIP="10.96.0.20", ports=[{"port": 80, "nodePort": 30070}])["spec"]
    assert spec["clusterIP"] == "10.96.0.20" and spec["ports"][0]["nodePort"] == 30070


def test_node_ports_released_on_delete(store):
    create(store, "a", type="NodePort", ports=[{"port": 80, "nodePort": 30010}])
    store.delete("Service", "default", "a")
    assert create(store, "b", type="NodePort", ports=[{"port": 80, "nodePort": 30010}])


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"type": "Bogus"}, "spec.type"),
        ({"ports": []}, "spec.ports"),
        ({"ports": [{"port": 0}]}, "spec.ports[0].port"),
        ({"ports": [{"port": 80, "protocol": "ICMP"}]}, "spec.ports[0].protocol"),
        ({"ports": [{"port": 80}, {"port": 81}]}, "spec.ports[0].name"),
        ({"ports": [{"port": 80, "name": "a"}, {"port": 81, "name": "a"}]}, "spec.ports[1].name"),
        ({"ports": [{"port": 80, "targetPort": 70000}]}, "spec.ports[0].targetPort"),
        ({"ports": [{"port": 80, "nodePort": 30001}]}, "spec.ports[0].nodePort"),
        ({"externalTrafficPolicy": "Local"}, "spec.externalTrafficPolicy"),
        ({"type": "NodePort", "externalTrafficPolicy": "Sometimes"}, "spec.externalTrafficPolicy"),
        ({"internalTrafficPolicy": "Nearby"}, "spec.internalTrafficPolicy"),
        ({"type": "NodePort", "clusterIP": "None"}, "spec.clusterIP"),
        ({"clusterIP": "not-an-ip"}, "spec.clusterIP"),
        ({"ipFamilies": ["IPv6"]}, "spec.ipFamilies[0]"),
        ({"ipFamilyPolicy": "RequireDualStack"}, "spec.ipFamilyPolicy"),
        ({"type": "ExternalName"}, "spec.externalName"),
        ({"healthCheckNodePort": 30001}, "spec.healthCheckNodePort"),
        ({"sessionAffinity": "Sticky"}, "spec.sessionAffinity"),
        ({"selector": {"app": "has space"}}, "spec.selector[app]"),
    ],
)
def test_validation_names_the_field(store, spec, field):
    err = invalid(store, **spec)
    assert field in [c["field"] for c in err.details["causes"]], err.message
    assert err.message.startswith('Service "bad" is invalid: ')


def test_external_name_gets_no_cluster_ip(store):
    spec = create(store, type="ExternalName", externalName="example.com", ports=[])["spec"]
    assert "clusterIP" not in spec and "internalTrafficPolicy" not in spec


def test_update_keeps_allocations_the_update_left_out(store):
    created = create(store, type="NodePort", ports=[{"port": 80, "name": "http"}])
    ip, node_port = created["spec"]["clusterIP"], created["spec"]["ports"][0]["nodePort"]
    body = {"metadata": {"name": "web"}, "spec": {"type": "NodePort", "ports": [{"port": 80, "name": "http", "targetPort": 8080}]}}
    updated = store.update("Service", body)["spec"]
    assert updated["clusterIP"] == ip
    assert updated["ports"][0]["nodePort"] == node_port
    assert updated["ports"][0]["targetPort"] == 8080


def test_cluster_ip_is_immutable(store):
    create(store)
    with pytest.raises(ApiError) as exc:
        store.patch("Service", "default", "web", {"spec": {"clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50"]}})
    assert exc.value.code == 422
    assert exc.value.details["causes"][0]["field"] == "spec.clusterIP"
    assert "immutable" in exc.value.message


def test_type_change_to_cluster_ip_releases_node_ports(store):
    create(store, type="NodePort", ports=[{"port": 80, "nodePort": 30020}])
    spec = store.patch("Service", "default", "web", {"spec": {"type": "ClusterIP"}})["spec"]
    assert "nodePort" not in spec["ports"][0] and "externalTrafficPolicy" not in spec
    assert create(store, "other", type="NodePort", ports=[{"port": 80, "nodePort": 30020}])


def test_switching_traffic_policy_allocates_and_releases_health_check_port(store):
    create(store, type="LoadBalancer")
    local = store.patch("Service", "default", "web", {"spec": {"externalTrafficPolicy": "Local"}})["spec"]
    hc = local["healthCheckNodePort"]
    cluster = store.patch("Service", "default", "web", {"spec": {"externalTrafficPolicy": "Cluster"}})["spec"]
    assert "healthCheckNodePort" not in cluster
    assert create(store, "other", type="NodePort", ports=[{"port": 80, "nodePort": hc}])


def test_dry_run_allocates_nothing(store):
    dry = store.create("Service", {"metadata": {"name": "d"}, "spec": {"clusterIP": "10.96.0.30", "ports": [{"port": 80}]}},
                       dry_run=True)
    assert dry["spec"]["clusterIP"] == "10.96.0.30"
    with pytest.raises(ApiError):
        store.get("Service", "default", "d")
    assert create(store, "real", clusterIP="10.96.0.30")
