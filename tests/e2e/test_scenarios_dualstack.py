"""The dual-stack shape of the scenario table is the IPv4 table and its IPv6 twin, paired
(scenarios_dualstack.py): the lab has both families everywhere, IPv4 first; every Service is
RequireDualStack with both families' addresses; every probe runs over IPv4, then over IPv6. No
lab, no root (the table itself runs in test_scenarios.py)."""

import pytest
import yaml

from tests.e2e import scenarios_dualstack as ds
from tests.e2e.scenario_runner import (
    TOPOLOGY,
    TOPOLOGY_DUALSTACK,
    load_dualstack_scenarios,
    load_ipv6_scenarios,
    load_scenarios,
)
from ebpf_proxy.lab.topology import load_topology

SCENARIOS = load_scenarios()
IPV6_SCENARIOS = load_ipv6_scenarios()
DUAL_SCENARIOS = load_dualstack_scenarios()


def test_dualstack_topology_is_the_derivation_of_topology_yaml_and_loads_as_dual_stack():
    want = ds.dual_topology(yaml.safe_load(TOPOLOGY.read_text()))
    assert yaml.safe_load(TOPOLOGY_DUALSTACK.read_text()) == want, \
        "regenerate tests/e2e/topology_dualstack.yaml: python -m tests.e2e.scenarios_dualstack"
    topo = load_topology(TOPOLOGY_DUALSTACK)
    assert topo.families == ("IPv4", "IPv6")
    worker1 = topo.node("worker1")
    assert worker1.ips == ("172.20.20.15", "fd00:20::f")
    assert set(worker1.extra_ips) == {"192.168.99.11", "fd00:192:168:99::b"}
    assert all(len(p.ips) == 2 for p in topo.pods)  # client-1's addresses allocated in both families
    assert "--bpf-host-routing=off" in topo.agent_args  # this shape keeps the eBPF slow path covered


def test_every_probe_runs_over_ipv4_then_over_ipv6_and_the_other_steps_once():
    assert [s["name"] for s in DUAL_SCENARIOS] == [s["name"] for s in SCENARIOS]
    for v4, v6, dual in zip(SCENARIOS, IPV6_SCENARIOS, DUAL_SCENARIOS):
        want = []
        for a, b in zip(v4["steps"], v6["steps"]):
            if "probe" in a or "http" in a:
                want += [{**a, "family": 4}, {**b, "family": 6}]
            else:
                want.append({k: v for k, v in a.items() if k != "apply"})
        got = [{k: v for k, v in step.items() if k != "apply"} for step in dual["steps"]]
        assert got == want, v4["name"]
        assert dual.get("ipv6_difference") == v6.get("ipv6_difference")


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_services_are_require_dual_stack_with_both_families_addresses():
    lb = next(s for s in DUAL_SCENARIOS if "198.51.100.11" in (s.get("manifests") or ""))
    svc = next(d for d in _docs(lb["manifests"]) if d["metadata"]["name"] == "web-lb")
    spec = svc["spec"]
    assert (spec["ipFamilyPolicy"], spec["ipFamilies"]) == ("RequireDualStack", ["IPv4", "IPv6"])
    assert spec["clusterIPs"] == [spec["clusterIP"], "fd00:10:96::640f"]
    assert spec["externalIPs"] == ["198.51.100.10", "2001:db8:198:51:100::a"]
    assert spec["loadBalancerSourceRanges"] == ["203.0.113.0/24", "2001:db8:203:113::/120"]
    assert svc["status"]["loadBalancer"]["ingress"] == [{"ip": "198.51.100.11"}, {"ip": "2001:db8:198:51:100::b"}]
    assert len(spec["ports"]) == 1  # the ports once, not once per family


def test_a_hand_written_endpoint_slice_gets_its_ipv6_twin():
    hairpin = next(s for s in DUAL_SCENARIOS if s["name"] == "hairpin")
    slices = [d for d in _docs(hairpin["manifests"]) if d["kind"] == "EndpointSlice"]
    assert [(d["metadata"]["name"], d["addressType"], d["endpoints"][0]["addresses"]) for d in slices] == [
        ("only-web-1-abc", "IPv4", ["10.244.5.4"]), ("only-web-1-abc-v6", "IPv6", ["fd00:10:244:5::4"])]


@pytest.mark.parametrize("text, message", [
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "ConfigMap x: no dual-stack form"),
    ("apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: '${web-1}'}\n", "placeholders"),
])
def test_what_has_no_dual_stack_form_is_an_error(text, message):
    with pytest.raises(ds.DualStackError, match=message):
        ds.dual_manifests(text)
