"""One lab per datapath mode, shared by every scenario of that mode (a lab takes seconds to build)."""

import os

import pytest

from ebpf_proxy.lab.cluster import Lab, destroy
from tests.e2e.scenario_runner import TOPOLOGY

E2E_MODES = [m for m in os.environ.get("EBPF_PROXY_E2E_MODES", "iptables,ebpf").split(",") if m]


@pytest.fixture(scope="session", params=E2E_MODES)
def e2e_lab(request):
    mode = request.param
    name = f"e2e{mode[:3]}{os.getpid() % 10000}"
    destroy(name)
    lab = Lab.up(name, str(TOPOLOGY), mode=mode)
    try:
        yield lab
    finally:
        destroy(name)
