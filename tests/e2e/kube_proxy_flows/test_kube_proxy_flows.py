"""kube-proxy's own packet-flow tests (flows.yaml), replayed on the lab in every datapath mode.

One lab per mode serves every upstream world (replay.py). Each upstream test (sub-case) is one
test here; it fails listing every flow whose outcome differs from kube-proxy's, and is skipped
only when every one of its flows is blocked on a lab gap (flows.yaml's lab_gaps).
EPX_KPF_IGNORE_GAPS=1 runs the blocked flows too, the harness working around each gap itself;
EPX_KPF_REPORT=FILE appends every flow's result there as JSON lines.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest

from ebpf_proxy.lab.cluster import destroy
from tests.e2e.conftest import E2E_MODES
from tests.e2e.kube_proxy_flows import replay

DATA = replay.load()
WORLDS = replay.ordered(replay.worlds(DATA))
RUNNABLE = [w for w in WORLDS if any(not f.not_runnable for f in w.all_flows)]
OUTPUT = re.compile(r"^(|DROP|REJECT|ACCEPT|\[?[0-9a-f.:]+\]?:\d+(, \[?[0-9a-f.:]+\]?:\d+)*)$")


def test_every_upstream_flow_is_stated_once_and_well_formed():
    flows = [f for w in WORLDS for f in w.all_flows]
    dupes = [i for i, n in Counter(f.id for f in flows).items() if n > 1]
    assert not dupes, f"flows stated twice: {dupes}"
    bad = [f.id for f in flows if not OUTPUT.match(f.out)]
    assert not bad, f"outputs that are not upstream's form: {bad}"
    assert all(f.masq is False for f in flows if f.out in ("DROP", "REJECT", "")), "masq on a flow nothing answers"
    # every upstream test that calls runPacketFlowTests in the replayed revision, and the two that
    # assert whole rulesets instead (their flows derived, and marked so)
    assert {w.upstream for w in WORLDS if w.derived} == {"TestOverallIPTablesRules", "TestBadIPs"}
    assert {w.upstream for w in WORLDS if not w.derived} == {
        "TestTracePacket", "TestNoEndpointsReject", "TestClusterIPGeneral", "TestLoadBalancer", "TestNodePorts",
        "TestHealthCheckNodePort", "TestExternalTrafficPolicyLocal", "TestExternalTrafficPolicyCluster",
        "TestInternalTrafficPolicy", "TestTerminatingEndpointsTrafficPolicyLocal",
        "TestTerminatingEndpointsTrafficPolicyCluster", "TestInternalExternalMasquerade"}


def test_flows_no_lab_can_run_say_why_and_are_few():
    flows = [f for w in WORLDS for f in w.all_flows]
    idle = [f for f in flows if f.not_runnable]
    assert all(len(f.not_runnable) > 10 for f in idle)
    ipv4 = [f for f in flows if ":" not in f.source]
    assert [f.id for f in ipv4 if f.not_runnable] == [
        "TestClusterIPGeneral :: clusterIP with TCP, UDP, and SCTP on same port (SCTP)"]


def test_each_lab_gap_is_one_line_and_detected_from_the_objects():
    gaps = DATA["lab_gaps"]
    found = {g for w in WORLDS for s in w.services for g in replay.service_gaps(s, gaps, w.slices)}
    # a gap nobody runs into is stale: delete its line; one the harness cannot detect blocks nothing
    assert found == set(gaps), f"lab_gaps {sorted(set(gaps) - found)} block no flow"


@pytest.fixture(scope="module", params=E2E_MODES)
def kpf_lab(request, tmp_path_factory):
    mode = request.param
    name = f"kpf{mode[:3]}{os.getpid() % 10000}"
    lab = replay.lab_up(name, mode, tmp_path_factory.mktemp("kpf"))
    try:
        yield lab
    finally:
        destroy(name)


@pytest.mark.root
@pytest.mark.e2e
@pytest.mark.parametrize("world", RUNNABLE, ids=[w.id for w in RUNNABLE])
def test_upstream_flows(kpf_lab, world):
    results = replay.run_world(kpf_lab, world, DATA)
    report = os.environ.get("EPX_KPF_REPORT")
    if report:
        with open(report, "a") as fh:
            for r in results:
                fh.write(json.dumps(r.to_json(kpf_lab.mode)) + "\n")
    ran = [r for r in results if r.status in ("pass", "fail")]
    blocked = [r for r in results if r.status == "blocked"]
    if not ran:
        gaps = sorted({g for r in blocked for g in r.gaps})
        pytest.skip(f"all {len(blocked)} flows blocked on lab gap(s) {', '.join(gaps)}")
    failures = replay.format_failures(kpf_lab.mode, results)
    assert not failures, (f"{world.id}: {sum(r.status == 'fail' for r in results)} of {len(ran)} flows disagree "
                          f"with kube-proxy ({len(blocked)} blocked on lab gaps):\n{failures}")
