"""`lab verify` on the e2e table: every row's state agrees three ways, and a broken datapath is caught.

For each scenario of scenarios.yaml (its manifests applied, the agents converged), every node's
model, rendered iptables rules and running datapath (eBPF programs in trace mode, or the live
iptables rules) must agree on every frontend × sender. Then one datapath is broken on purpose,
behind the agent's back, and verify must fail naming the flow.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import be16
from ebpf_proxy.lab import verify as lab_verify
from tests.e2e.scenario_runner import load_scenarios

pytestmark = [pytest.mark.root, pytest.mark.e2e]

SCENARIOS = [sc for sc in load_scenarios() if sc.get("manifests")]
BROKEN = """
apiVersion: v1
kind: Service
metadata: {name: verify-broken}
spec:
  type: NodePort
  clusterIP: 10.96.102.10
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 80, nodePort: 31190}]
"""


def problems(results: dict) -> list[str]:
    out = []
    for node, report in results.items():
        out += [f"{node}: {m['service']} {m['frontend']} from {m['sender']}: {'; '.join(m['problems'])}"
                for m in report.get("mismatches", [])]
        out += [f"{node}: {e}" for e in report.get("errors", [])]
    return out


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[sc["name"] for sc in SCENARIOS])
def test_verify_agrees_on_every_row(e2e_lab, scenario):
    e2e_lab.apply_manifests(scenario["manifests"], f"verify-{scenario['name']}")
    try:
        e2e_lab.wait_converged()
        results = lab_verify.run(e2e_lab)
        assert all(r["flows"] for r in results.values()), results
        assert not problems(results), "\n".join(problems(results))
    finally:
        e2e_lab.delete_manifests(scenario["manifests"], f"verify-{scenario['name']}")
        e2e_lab.wait_converged()


def _break_ebpf(lab):
    """worker2's NodePort frontend of the Service turns externalTrafficPolicy=Local in the map."""
    fd = libbpf.obj_get(str(lab.dir / "bpffs" / "worker2" / "ebpf-proxy" / "epx_svc"))
    key, value = s.LB4Key(addr=0, port=be16(31190), proto=6), s.LB4Service()
    assert libbpf.map_lookup(fd, key, value)
    original = value.flags
    value.flags |= s.LB4_F_ETP_LOCAL
    libbpf.map_update(fd, key, value)

    def restore():
        value.flags = original
        libbpf.map_update(fd, key, value)
    return restore


def _break_iptables(lab):
    """worker2's clusterIP capture is shadowed by a RETURN at the top of KUBE-SERVICES."""
    saved = lab.exec("worker2", ["iptables-legacy-save", "-t", "nat"], capture_output=True, text=True).stdout
    binary = "iptables-legacy" if "KUBE-SERVICES" in saved else "iptables-nft"
    rule = ["-t", "nat", "KUBE-SERVICES", "-d", "10.96.102.10/32", "-p", "tcp", "--dport", "80", "-j", "RETURN"]
    lab.exec("worker2", [binary, rule[0], rule[1], "-I", *rule[2:]], check=True)
    return lambda: lab.exec("worker2", [binary, rule[0], rule[1], "-D", *rule[2:]], check=True)


def test_verify_catches_a_broken_datapath(e2e_lab):
    e2e_lab.apply_manifests(BROKEN, "verify-broken")
    try:
        e2e_lab.wait_converged()
        assert not problems(lab_verify.run(e2e_lab, ["worker2"]))
        restore = _break_ebpf(e2e_lab) if e2e_lab.mode == "ebpf" else _break_iptables(e2e_lab)
        try:
            results = lab_verify.run(e2e_lab, ["worker2"])
        finally:
            restore()
        assert results["worker2"]["exit"] == 1
        found = problems(results)
        assert any("default/verify-broken:http" in p for p in found), found
        if e2e_lab.mode == "ebpf":
            assert any("nodePort from client outside: ebpf: verdict drop, the model says dnat" in p for p in found), found
        else:
            assert any("clusterIP" in p and "iptables (live): verdict pass, the model says dnat" in p for p in found), found
        assert not problems(lab_verify.run(e2e_lab, ["worker2"]))
    finally:
        e2e_lab.delete_manifests(BROKEN, "verify-broken")
        e2e_lab.wait_converged()
