"""One lab per datapath mode, shared by every scenario of that mode (a lab takes seconds to build)."""

import os

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.scenario_runner import TOPOLOGY, TOPOLOGY_DUALSTACK, TOPOLOGY_IPV6, ZONES_TOPOLOGY

E2E_MODES = [m for m in os.environ.get("EBPF_PROXY_E2E_MODES", "iptables,ebpf").split(",") if m]
# The modes of the IPv6-only run of the scenario table (test_scenarios.py), ~45 s each: every mode
# (in ebpf mode the eBPF programs serve IPv6, ip6tables has no rules).
E2E_IPV6_MODES = [m for m in os.environ.get("EBPF_PROXY_E2E_IPV6_MODES", ",".join(E2E_MODES)).split(",")
                  if m and m in E2E_MODES]
# The modes of the dual-stack run of the scenario table: every mode, since in ebpf mode it is the
# run where the programs serve one Service over both families side by side.
E2E_DUALSTACK_MODES = [m for m in os.environ.get("EBPF_PROXY_E2E_DUALSTACK_MODES", ",".join(E2E_MODES)).split(",")
                       if m and m in E2E_MODES]


@pytest.fixture(scope="session", params=E2E_MODES)
def e2e_lab(request):
    mode = request.param
    yield from _lab(f"e2e{mode[:3]}{os.getpid() % 10000}", TOPOLOGY, mode)


# The other cluster shapes of the scenario table: name prefix and topology of each.
SHAPES = {"ipv6": ("e2e6", TOPOLOGY_IPV6), "dual": ("e2e46", TOPOLOGY_DUALSTACK)}


@pytest.fixture(scope="session")
def shaped_lab(request):
    """The IPv6-only or dual-stack twin of e2e_lab, for the (shape, mode) the test is parametrized
    with (indirectly: test_scenarios.py names each test by shape, mode and scenario)."""
    shape, mode = request.param
    prefix, topology = SHAPES[shape]
    yield from _lab(f"{prefix}{mode[:2]}{os.getpid() % 10000}", topology, mode)


@pytest.fixture(scope="session", params=E2E_MODES)
def zones_lab(request):
    """The three-zone lab of the topology-aware routing table (scenarios_zones.yaml)."""
    yield from _lab(f"e2ez{request.param[:3]}{os.getpid() % 10000}", ZONES_TOPOLOGY, request.param)


def _lab(name, topology, mode):
    destroy(name)
    lab = Lab.up(name, str(topology), mode=mode)
    try:
        yield lab
    finally:
        destroy(name)
