"""What the agent's process loads: `ebpf-proxy run` must start without the kubernetes client's
optional extras, which a deployment does not install (they are ~16 MB of RSS in a dev venv)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import ebpf_proxy.cli
assert "kubernetes" not in sys.modules, "the CLI imports the kubernetes client before any command runs"
from ebpf_proxy.cli.run import _leave_out_unused_client_extras
{leave_out}
import ebpf_proxy.k8s.client  # what the agent imports when it starts watching
print(sorted(m for m in ("kubernetes_validate", "jsonschema") if sys.modules.get(m) is not None))
"""


def _loaded(leave_out: bool) -> str:
    code = PROBE.format(leave_out="_leave_out_unused_client_extras()" if leave_out else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_agent_loads_the_client_without_its_validation_extras():
    assert _loaded(leave_out=True) == "[]"


def test_the_extras_are_there_to_leave_out_in_this_venv():
    """Guards the test above against passing vacuously: in the test venv the client does load them."""
    assert _loaded(leave_out=False) == "['jsonschema', 'kubernetes_validate']"
