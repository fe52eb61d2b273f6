"""What the agent's process loads: `ebpf-proxy run` must start without the kubernetes client's
optional extras, which a deployment does not install (they are ~16 MB of RSS in a dev venv), and
without the package `__init__` of pyroute2 and kubernetes (bareimport.py, ~5.4 MiB)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import ebpf_proxy.cli
assert "kubernetes" not in sys.modules, "the CLI imports the kubernetes client before any command runs"
from ebpf_proxy.bareimport import leave_out_unused_client_extras
{leave_out}
import ebpf_proxy.k8s.client  # what the agent imports when it starts watching
print(sorted(m for m in ("kubernetes_validate", "jsonschema") if sys.modules.get(m) is not None))
"""


def _loaded(leave_out: bool) -> str:
    code = PROBE.format(leave_out="leave_out_unused_client_extras()" if leave_out else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_agent_loads_the_client_without_its_validation_extras():
    assert _loaded(leave_out=True) == "[]"


def test_the_extras_are_there_to_leave_out_in_this_venv():
    """Guards the test above against passing vacuously: in the test venv the client does load them."""
    assert _loaded(leave_out=False) == "['jsonschema', 'kubernetes_validate']"


# ---- packages whose __init__ the agent skips (bareimport.py) ------------------------------

# What the agent imports of them: the client and watch (k8s/client.py), netlink (nodeconfig,
# devices, kernel_nat, iptables/conntrack); then what their package __init__ alone would add.
NETLINK_AND_CLIENT = """
import sys
from ebpf_proxy.bareimport import slim_imports
{slim}
import ebpf_proxy.k8s.client
from pyroute2.iproute import IPRoute
from pyroute2.conntrack import Conntrack, NFCTAttrTuple
from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_NEW, nfct_msg
from pyroute2.netlink.exceptions import NetlinkError
print(sorted(m for m in ("pyroute2.ndb.main", "pyroute2.ipdb", "pyroute2.iwutil", "pyroute2.netlink.nfnetlink.nftsocket",
                         "kubernetes.dynamic", "kubernetes.stream", "kubernetes.informer") if m in sys.modules))
"""


def _package_extras(slim: bool) -> str:
    code = NETLINK_AND_CLIENT.format(slim="slim_imports()" if slim else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_the_agent_imports_netlink_and_the_client_without_their_packages_init():
    assert _package_extras(slim=True) == "[]"


def test_their_packages_init_would_load_the_rest():
    """Guards the test above against passing vacuously."""
    assert _package_extras(slim=False) == str(["kubernetes.dynamic", "kubernetes.informer", "kubernetes.stream",
                                               "pyroute2.ipdb", "pyroute2.iwutil", "pyroute2.ndb.main",
                                               "pyroute2.netlink.nfnetlink.nftsocket"])


def test_a_bare_package_still_gives_what_its_init_exports():
    """Anything other than a submodule asked of a bare package runs its real __init__ then, so code
    outside the agent's path (or a missed import) keeps working, only at the memory it costs."""
    code = """
import sys
from ebpf_proxy.bareimport import register_bare
assert register_bare("pyroute2") and not register_bare("pyroute2")
from pyroute2 import netlink                     # a submodule: no __init__
assert "pyroute2.ndb.main" not in sys.modules
from pyroute2 import IPRoute, NDB                 # the package's own names: its __init__ runs
import pyroute2.iproute, pyroute2.ndb.main
assert IPRoute is pyroute2.iproute.IPRoute and NDB is pyroute2.ndb.main.NDB
assert pyroute2.__version__ and not hasattr(pyroute2, "no_such_name")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# the agent's run path: the modules `ebpf-proxy run` imports, at once or when it first needs them
RUN_PATH = ("agent", "datapath", "k8s", "model", "cli/run.py", "explain/audit.py", "explain/audit_ebpf.py",
            "explain/audit_iptables.py")


def test_the_run_path_imports_only_submodules_of_the_bare_packages():
    """`from pyroute2 import IPRoute` would run pyroute2's whole __init__ in the agent (~4.8 MiB):
    the run path names the submodule (`from pyroute2.iproute import IPRoute`)."""
    import ast
    import importlib.util
    from pathlib import Path

    import ebpf_proxy
    from ebpf_proxy.bareimport import AGENT_BARE_PACKAGES

    root = Path(ebpf_proxy.__file__).parent
    files = [f for part in RUN_PATH for f in ((root / part).rglob("*.py") if (root / part).is_dir() else [root / part])]
    assert len(files) > 40
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wrong += [f"{path.relative_to(root)}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name in AGENT_BARE_PACKAGES]
            elif isinstance(node, ast.ImportFrom) and node.module in AGENT_BARE_PACKAGES:
                wrong += [f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert wrong == []
