"""`lab audit` on real agents: clean after convergence; a datapath broken behind the agent's back
is found (named, exit 1) and repaired on request, after which the broken Service works again.

The e2e topology runs its agents with --audit-repair=false, so nothing repairs before we ask.
"""

from __future__ import annotations

import pytest

from ebpf_proxy.lab import audit as lab_audit
from tests.e2e.test_verify import BROKEN, _break_ebpf, _break_iptables

pytestmark = [pytest.mark.root, pytest.mark.e2e]

NODE_PORT = 31190


def _drifts(report: dict) -> list[str]:
    return [f"{d['kind']} {d['what']} {d['key']}: {d['detail']}" for d in report.get("drifts", [])]


def test_audit_finds_and_repairs_a_broken_datapath(e2e_lab):
    e2e_lab.apply_manifests(BROKEN, "audit-broken")
    try:
        e2e_lab.wait_converged()
        clean = lab_audit.run(e2e_lab)
        assert all(r["exit"] == 0 for r in clean.values()), clean
        assert all(r["mode"] == e2e_lab.mode and r["clean"] for r in clean.values()), clean

        target = f"{e2e_lab.topology.node('worker2').ip}:{NODE_PORT}"
        assert e2e_lab.probe("outside", target, count=2).all_ok
        (_break_ebpf if e2e_lab.mode == "ebpf" else _break_iptables)(e2e_lab)  # never restored by hand

        found = lab_audit.run(e2e_lab, ["worker2"])["worker2"]
        assert found["exit"] == 1 and not found["repaired"], found
        drifts = _drifts(found)
        if e2e_lab.mode == "ebpf":
            assert any(d.startswith(f"stale service frontend <node>:{NODE_PORT}/tcp: of default/verify-broken:http")
                       for d in drifts), drifts
        else:
            assert any(d.startswith("extra iptables rule nat KUBE-SERVICES rule 1:") and "RETURN" in d
                       for d in drifts), drifts
        assert len(drifts) == 1, drifts
        assert lab_audit.run(e2e_lab, ["worker1", "worker3"]).keys() == {"worker1", "worker3"}

        repaired = lab_audit.run(e2e_lab, ["worker2"], repair=True)["worker2"]
        assert repaired["exit"] == 1 and repaired["repaired"] and repaired["writes"] >= 1, repaired
        assert lab_audit.run(e2e_lab, ["worker2"])["worker2"]["exit"] == 0
        assert e2e_lab.probe("outside", target, count=2).all_ok
    finally:
        e2e_lab.delete_manifests(BROKEN, "audit-broken")
        e2e_lab.wait_converged()
