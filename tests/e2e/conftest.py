"""One lab per datapath mode, shared by every scenario of that mode (a lab takes seconds to build)."""

import os

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.scenario_runner import TOPOLOGY, ZONES_TOPOLOGY

E2E_MODES = [m for m in os.environ.get("EBPF_PROXY_E2E_MODES", "iptables,ebpf").split(",") if m]


@pytest.fixture(scope="session", params=E2E_MODES)
def e2e_lab(request):
    mode = request.param
    yield from _lab(f"e2e{mode[:3]}{os.getpid() % 10000}", TOPOLOGY, mode)


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
