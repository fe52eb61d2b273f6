"""A restarted iptables agent on a real lab: the audit it makes 10 s after its start (not a whole
--audit-period later: agent.first_audit_delay) leaves the proof its next restart reads, and that
restart restores no table (datapath/iptables/proof.py), which /metrics counts
(ebpf_proxy_iptables_tables_proven_total). The lab's nodes keep their proofs in
<lab>/iptables-proofs; the e2e topology audits every minute (the default period)."""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_stats import scrape

pytestmark = [pytest.mark.root, pytest.mark.e2e]

NODE = "worker1"


def _tables_proven(lab) -> float | None:
    return scrape(lab, NODE).get(("ebpf_proxy_iptables_tables_proven_total", ()))


def test_a_restart_soon_after_another_finds_the_early_audits_proof(e2e_lab):
    if e2e_lab.mode != "iptables":
        pytest.skip("the proof is the iptables datapath's (datapath/iptables/proof.py)")
    proof = e2e_lab.dir / "iptables-proofs" / f"proven-{NODE}-ipv4.json"
    e2e_lab.stop_agent(NODE)
    proof.unlink(missing_ok=True)
    started = time.monotonic()
    e2e_lab.start_agent(NODE)
    assert _tables_proven(e2e_lab) == 0, "no proof: this start restored every table"
    while not proof.exists() and time.monotonic() - started < 45:
        time.sleep(0.25)
    assert proof.exists(), "no audit within 45 s of the start (the period is 60 s)"

    e2e_lab.stop_agent(NODE)
    e2e_lab.start_agent(NODE)
    assert _tables_proven(e2e_lab) == 2, "the restart restored a table the early audit had proved"
    e2e_lab.wait_converged()
