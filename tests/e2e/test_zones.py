"""Topology-aware routing as real traffic on a three-zone lab, in every datapath mode
(scenarios_zones.yaml on topology_zones.yaml): the same table for iptables and ebpf, as the
main scenario table proves the drop-in for the rest of SEMANTICS."""

import pytest

from tests.e2e.scenario_runner import ZONES_SCENARIOS, ZONES_TOPOLOGY, load_scenarios, run_scenario

SCENARIOS = load_scenarios(ZONES_SCENARIOS)

pytestmark = [pytest.mark.root, pytest.mark.e2e]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_zone_scenario(zones_lab, scenario):
    run_scenario(zones_lab, scenario, ZONES_TOPOLOGY)
