"""The scenario table, in every mode: the drop-in proof (see scenarios.yaml).

The same table also runs on an IPv6-only cluster (topology_ipv6.yaml, tests named
`ipv6-<mode>-<scenario>`, e.g. `ipv6-iptables-clusterip-from-pod`). It is derived from the IPv4
table by the address translation of scenarios_ipv6.py, so the two never drift apart; where
kube-proxy's IPv6 outcome differs, the scenario runs its IPv6 expectation instead
(scenario_runner.IPV6_DIFFERENCES, each with its reason). test_scenarios_ipv6.py checks the
translation itself, without a lab.

The IPv6 table runs in the modes of EBPF_PROXY_E2E_IPV6_MODES (default: every mode of
EBPF_PROXY_E2E_MODES; ~45 s per mode, lab included). In ebpf mode the eBPF programs serve IPv6
(the agent's IPv6 EbpfDatapath writes the epx_*6 maps and switches the programs' IPv6 path on), so
`ipv6-ebpf-*` checks them, not ip6tables.

And on a dual-stack cluster (topology_dualstack.yaml, tests named `dual-<mode>-<scenario>`): each
scenario's Services RequireDualStack, each probe over IPv4 and then over IPv6
(scenarios_dualstack.py; test_scenarios_dualstack.py checks the derivation), in every mode
(EBPF_PROXY_E2E_DUALSTACK_MODES): so each row holds in the three cluster shapes.
"""

import pytest

from tests.e2e.conftest import E2E_DUALSTACK_MODES, E2E_IPV6_MODES, SHAPES
from tests.e2e.scenario_runner import (
    load_dualstack_scenarios,
    load_ipv6_scenarios,
    load_scenarios,
    run_scenario,
)

SCENARIOS = load_scenarios()
IPV6_SCENARIOS = load_ipv6_scenarios()
DUALSTACK_SCENARIOS = load_dualstack_scenarios()

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_table_covers_every_semantics_rule():
    covered = {s["rule"] for s in SCENARIOS}
    assert set(range(1, 15)) <= covered, f"rules without a scenario: {sorted(set(range(1, 15)) - covered)}"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario(e2e_lab, scenario):
    run_scenario(e2e_lab, scenario)


SHAPED = ([("ipv6", mode, s) for mode in E2E_IPV6_MODES for s in IPV6_SCENARIOS]
          + [("dual", mode, s) for mode in E2E_DUALSTACK_MODES for s in DUALSTACK_SCENARIOS])


@pytest.mark.parametrize("shaped_lab, scenario, topology",
                         [pytest.param((shape, mode), s, SHAPES[shape][1], id=f"{shape}-{mode}-{s['name']}")
                          for shape, mode, s in SHAPED],
                         indirect=["shaped_lab"], scope="session")
def test_scenario_in_other_shapes(shaped_lab, scenario, topology):
    run_scenario(shaped_lab, scenario, topology=topology)
