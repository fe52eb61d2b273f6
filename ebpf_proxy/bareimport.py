"""Let the agent import a package's submodules without running the package's own `__init__`,
and leave out the client's optional extras (slim_imports, which `ebpf-proxy run` and the agent's
kubeconfig child, k8s/kubeconfig.py, call before anything imports those packages). A module of
no layer: the CLI and k8s/ both use it.

pyroute2's `__init__` imports every netlink family it knows (NDB, IPDB, wireless, nftables,
IPVS, devlink, plan9, ...) only to re-export their classes: ~4.8 MiB of a 1-Service agent's
~61 MiB (issue 12), where the agent needs IPRoute and Conntrack. kubernetes' `__init__` imports
its dynamic client, websocket streams, informer and leader election, which the agent never uses
(~0.6 MiB); kubernetes.config's imports the kubeconfig loader, which the agent runs in a child
(k8s/kubeconfig.py), where it needs the in-cluster loader only. `ebpf-proxy run` registers these
packages bare (AGENT_BARE_PACKAGES, a subpackage after its parent) before anything imports them:
submodules import as usual (`from pyroute2.iproute import IPRoute`), and anything
else asked of the package itself (`from pyroute2 import NDB`) runs the real `__init__` at that
moment, so code that relies on it still works, only at the memory it costs.
tests/unit/test_k8s_path_calls.py runs the agent so and checks what stayed out.

The kubernetes client imports kubernetes_validate when it is installed, for its dynamic client's
schema validation, which the agent never uses: with jsonschema and pydantic's extras it is ~16 MB
of the agent's RSS. A deployment installs the agent without it (it is a test dependency, in
pyproject's `test` extra); a development venv (the lab, the bench) has it, so the agent keeps it
out of its own process to measure, and run, as deployed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any, Iterable

AGENT_BARE_PACKAGES = ("pyroute2", "kubernetes", "kubernetes.config")

_init_lock = threading.Lock()


def register_bare(name: str) -> bool:
    """Put package `name` in sys.modules without executing its `__init__`. False (and nothing
    done) when it is already imported, not installed, or not a package, or, for a subpackage, when
    its parent is not imported yet (finding it would import the parent whole)."""
    parent, _, child = name.rpartition(".")
    if name in sys.modules or (parent and parent not in sys.modules):
        return False
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr: str) -> Any:  # noqa: N807 (PEP 562's name)
        if attr.startswith("__"):  # probes by the import system, copy, inspect...: not the package's API
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        if importlib.util.find_spec(f"{name}.{attr}") is not None:  # `from pkg import submodule`
            return importlib.import_module(f"{name}.{attr}")
        _run_init(module, __getattr__)
        return getattr(module, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module
    if parent:
        setattr(sys.modules[parent], child, module)  # as an import of the subpackage would
    return True


def _run_init(module: ModuleType, bare_getattr: Any) -> None:
    """Execute the package's real `__init__` in its module object, once: from then on it is the
    package a plain import would have made (with its own `__getattr__`, if it defines one)."""
    with _init_lock:
        if module.__dict__.get("__getattr__") is bare_getattr:
            del module.__dict__["__getattr__"]
            module.__spec__.loader.exec_module(module)  # type: ignore[union-attr]


def register_bare_packages(names: Iterable[str] = AGENT_BARE_PACKAGES) -> list[str]:
    """register_bare for each of `names`; the ones registered."""
    return [name for name in names if register_bare(name)]


UNUSED_CLIENT_EXTRAS = ("kubernetes_validate",)


def leave_out_unused_client_extras() -> None:
    """Make the client's optional `import kubernetes_validate` fail, as where it is not installed
    (a None entry in sys.modules is Python's way to say "no such module"). Only before the client
    is loaded: afterwards it would change nothing."""
    if "kubernetes" not in sys.modules:
        for name in UNUSED_CLIENT_EXTRAS:
            sys.modules.setdefault(name, None)


def slim_imports() -> None:
    """What the agent's process leaves out before it imports the client or netlink: the client's
    unused extras, and the `__init__` of the packages it only needs some submodules of."""
    leave_out_unused_client_extras()
    register_bare_packages()
