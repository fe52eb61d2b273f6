"""A dual-stack lab (examples/dualstack.yaml) with real packets over IPv6, and the API objects
a dual-stack cluster has: Nodes with both InternalIPs and podCIDRs, Pods with both podIPs,
Services with a ClusterIP per family, an EndpointSlice per family.

Mode none: the agents handle IPv4 only so far (the datapaths' IPv6 is separate work), so this
checks the lab's own IPv6 plumbing, which is what the proxy will be tested on: pod to pod
across nodes, pod to node, outside client to pod and node, UDP, `--source-ip`, a pod added
at runtime. ~10 s.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from ebpf_proxy.lab.probe import ProbeError

pytestmark = [pytest.mark.root, pytest.mark.e2e]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dualstack.yaml"


@pytest.fixture(scope="module")
def lab():
    name = f"dsl{os.getpid() % 100000}"
    destroy(name)
    lab = Lab.up(name, str(EXAMPLE), mode="none")
    try:
        yield lab
    finally:
        destroy(name)


def ok_from(report, pod: str, backend: str, source_ip: str) -> None:
    assert report.summary["ok"] == 1, report.to_json()
    result = report.results[0]
    assert result.pod == pod and result.backend == backend, report.to_json()
    assert report.source_ips == {source_ip}, report.to_json()


def test_pod_to_pod_across_nodes_over_ipv6_without_nat(lab):
    ok_from(lab.probe("my-nginx-1", "[fd00:10:244:4::2]:80"), "my-nginx-2", "[fd00:10:244:4::2]:80", "fd00:10:244:5::4")
    ok_from(lab.probe("my-nginx-2", "[fd00:10:244:5::4]:80"), "my-nginx-1", "[fd00:10:244:5::4]:80", "fd00:10:244:4::2")


def test_ipv4_keeps_working_beside_ipv6(lab):
    ok_from(lab.probe("my-nginx-2", "10.244.5.4:80"), "my-nginx-1", "10.244.5.4:80", "10.244.4.2")


def test_udp_over_ipv6_answers_from_the_address_asked(lab):
    ok_from(lab.probe("outside", "[fd00:10:244:4::2]:53/udp"), "my-nginx-2", "[fd00:10:244:4::2]:53", "2001:db8:1::5")


def test_outside_client_reaches_pods_and_nodes_over_ipv6(lab):
    ok_from(lab.probe("outside", "[fd00:10:244:5::4]:80"), "my-nginx-1", "[fd00:10:244:5::4]:80", "2001:db8:1::5")
    # nothing listens on a node's port 1: its kernel's RST is a full round trip (a lost packet
    # would be a timeout), from the gateway node and from one behind the underlay
    for node_ip in ("fd00:20::17", "fd00:20::15"):
        assert lab.probe("outside", f"[{node_ip}]:1").outcomes == {"refused"}


def test_pod_reaches_nodes_over_ipv6(lab):
    assert lab.probe("my-nginx-1", "[fd00:20::15]:1").outcomes == {"refused"}  # its own node
    assert lab.probe("my-nginx-1", "[fd00:20::16]:1").outcomes == {"refused"}  # another node


def test_probe_source_ip_ipv6(lab):
    ok_from(lab.probe("worker2", "[fd00:10:244:5::4]:80", source_ip="fd00:20::16"),
            "my-nginx-1", "[fd00:10:244:5::4]:80", "fd00:20::16")
    with pytest.raises(ProbeError, match="not the same IP version"):
        lab.probe("worker2", "10.244.5.4:80", source_ip="fd00:20::16")


def test_nodes_and_pods_carry_both_families(lab):
    api = lab.api()
    try:
        node = api.get("Node", "worker2", namespace=None)
        internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == ["172.20.20.16", "fd00:20::16"]
        assert node["spec"]["podCIDRs"] == ["10.244.2.0/24", "fd00:10:244:2::/64"]
        assert node["spec"]["podCIDR"] == "10.244.2.0/24"
        pod = api.get("Pod", "my-nginx-2")
        assert [p["ip"] for p in pod["status"]["podIPs"]] == ["10.244.4.2", "fd00:10:244:4::2"]
    finally:
        api.close()


def _service(name: str, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"selector": {"app": "my-nginx"}, "ports": [{"port": 80}], **spec}}


def _slices(api, service: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for s in api.list("EndpointSlice", "default", label_selector=f"kubernetes.io/service-name={service}"):
        out.setdefault(s["addressType"], set()).update(a for ep in s["endpoints"] for a in ep["addresses"])
    return out


def _wait_slices(api, service: str, want: dict[str, set[str]]) -> None:
    import time

    deadline = time.monotonic() + 10  # the controller works asynchronously; not a timing claim
    while _slices(api, service) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slices(api, service) == want


V4 = {"10.244.5.4", "10.244.4.2"}
V6 = {"fd00:10:244:5::4", "fd00:10:244:4::2"}


def test_services_get_cluster_ips_and_slices_per_family(lab):
    api = lab.api()
    try:
        dual = api.apply(_service("ds-prefer", ipFamilyPolicy="PreferDualStack"))["spec"]
        assert dual["ipFamilies"] == ["IPv4", "IPv6"] and dual["ipFamilyPolicy"] == "PreferDualStack"
        assert ipaddress.ip_address(dual["clusterIPs"][0]) in ipaddress.ip_network("10.96.0.0/12")
        assert ipaddress.ip_address(dual["clusterIPs"][1]) in ipaddress.ip_network("fd00:10:96::/112")
        _wait_slices(api, "ds-prefer", {"IPv4": V4, "IPv6": V6})

        single = api.apply(_service("ds-single"))["spec"]
        assert single["ipFamilies"] == ["IPv4"] and len(single["clusterIPs"]) == 1
        _wait_slices(api, "ds-single", {"IPv4": V4})

        v6 = api.apply(_service("ds-v6", ipFamilies=["IPv6"]))["spec"]
        assert v6["ipFamilies"] == ["IPv6"] and ":" in v6["clusterIP"]
        _wait_slices(api, "ds-v6", {"IPv6": V6})

        # downgrade: SingleStack drops the secondary ClusterIP and its slices
        body = api.get("Service", "ds-prefer")
        body["spec"]["ipFamilyPolicy"] = "SingleStack"
        down = api.apply(body)["spec"]
        assert down["clusterIPs"] == dual["clusterIPs"][:1] and down["ipFamilies"] == ["IPv4"]
        _wait_slices(api, "ds-prefer", {"IPv4": V4})
    finally:
        api.close()


def test_a_pod_added_at_runtime_gets_both_families_and_is_reachable(lab):
    pods = lab.scale("my-nginx", 3)
    new = lab.topology.pod(next(p for p in pods if p not in ("my-nginx-1", "my-nginx-2")))
    assert len(new.ips) == 2 and ":" in new.ips[1]
    ok_from(lab.probe("outside", f"[{new.ips[1]}]:80"), new.name, f"[{new.ips[1]}]:80", "2001:db8:1::5")
    api = lab.api()
    try:
        api.apply(_service("ds-scaled", ipFamilyPolicy="RequireDualStack"))
        _wait_slices(api, "ds-scaled", {"IPv4": V4 | {new.ips[0]}, "IPv6": V6 | {new.ips[1]}})
    finally:
        api.close()


def test_a_pod_with_fixed_addresses_outside_its_podcidrs_is_routed_and_unrouted(lab):
    from ebpf_proxy.lab.topology import PodSpec

    lab.add_pod(PodSpec(name="odd", node="worker2", ip="10.250.0.7", ips=("10.250.0.7", "fd00:99::7")))
    ok_from(lab.probe("outside", "[fd00:99::7]:80"), "odd", "[fd00:99::7]:80", "2001:db8:1::5")
    ok_from(lab.probe("my-nginx-1", "10.250.0.7:80"), "odd", "10.250.0.7:80", "10.244.5.4")
    route = lab.exec("worker1", ["ip", "-6", "route", "show", "fd00:99::7"], capture_output=True, text=True)
    assert "via fd00:20::16" in route.stdout
    lab.remove_pod("odd")
    route = lab.exec("worker1", ["ip", "-6", "route", "show", "fd00:99::7"], capture_output=True, text=True)
    assert route.stdout.strip() == ""
