"""Names of everything a lab creates, and how to find leftovers without any state file.

Every object of a lab called NAME carries the prefix ``epx-NAME-`` so that teardown can find
all of it from the name alone, even after a crash that lost every record:

===================  ===========================================================
network namespace    ``epx-NAME-underlay``, ``epx-NAME-n-<node>``,
                     ``epx-NAME-p-<pod>``, ``epx-NAME-c-<client>``
cgroup (v2)          ``/sys/fs/cgroup/unified/ebpf-proxy-lab/NAME/<node>`` and, for
                     each pod, ``.../NAME/<node>/pod-<pod>`` (a pod's processes sit
                     below their node's cgroup, so cgroup BPF hooks a node agent
                     attaches to its node cgroup apply to that node's pods too);
                     ``.../NAME/_apiserver`` for the embedded API server
===================  ===========================================================

Interface names must fit IFNAMSIZ (15 bytes), which ``<lab>-<node>`` strings would not, so
each netns uses short fixed names instead: ``eth0`` in nodes, pods and clients; ``br0`` and
its ports ``n<index>`` / ``c<index>`` in the underlay; and on a node, the host side of a pod's
veth is ``lxc`` + 8 hex digits of a hash of the pod's name (stable, so the agent and tests can
compute it).

Lab names are short ``[a-z0-9-]`` strings. A hyphen-separated segment of a lab name may not be
one of the kind markers ``n``, ``p``, ``c`` or ``underlay``: that keeps ``epx-foo-...`` and
``epx-foo-p-...`` from ever being confused, so ``destroy("foo")`` can never touch lab
``foo-p``'s namespaces (see :func:`lab_of_netns`).
"""

from __future__ import annotations

import hashlib
import os
import re

PREFIX = "epx"
NETNS_DIR = "/run/netns"
CGROUP_MOUNT = "/sys/fs/cgroup/unified"
CGROUP_PARENT = os.path.join(CGROUP_MOUNT, "ebpf-proxy-lab")

MAX_LAB_NAME = 16
UNDERLAY = "underlay"
NODE_MARK, POD_MARK, CLIENT_MARK = "n", "p", "c"
_KIND_MARKS = frozenset({NODE_MARK, POD_MARK, CLIENT_MARK, UNDERLAY})
_LAB_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")

# Fixed interface names inside the lab's namespaces.
BRIDGE = "br0"
UPLINK = "eth0"
POD_IFNAME = "eth0"
POD_VETH_PREFIX = "lxc"


class LabNameError(ValueError):
    """A lab name that cannot be used to name netns and cgroups unambiguously."""


def validate_lab_name(name: str) -> str:
    """Return ``name`` if it can prefix every object of a lab; raise LabNameError otherwise."""
    if not isinstance(name, str) or not name:
        raise LabNameError(f"lab name: {name!r} must be a non-empty string")
    if len(name) > MAX_LAB_NAME:
        raise LabNameError(f"lab name: {name!r} is longer than {MAX_LAB_NAME} characters")
    if not _LAB_NAME.match(name):
        raise LabNameError(
            f"lab name: {name!r} must be lowercase letters, digits and single inner hyphens"
        )
    bad = [seg for seg in name.split("-") if seg in _KIND_MARKS]
    if bad:
        raise LabNameError(
            f"lab name: {name!r} contains the segment {bad[0]!r}, which is reserved to mark "
            "namespace kinds (n, p, c, underlay)"
        )
    return name


def lab_prefix(lab: str) -> str:
    return f"{PREFIX}-{lab}-"


def underlay_netns(lab: str) -> str:
    return f"{lab_prefix(lab)}{UNDERLAY}"


def node_netns(lab: str, node: str) -> str:
    return f"{lab_prefix(lab)}{NODE_MARK}-{node}"


def pod_netns(lab: str, pod: str) -> str:
    return f"{lab_prefix(lab)}{POD_MARK}-{pod}"


def client_netns(lab: str, client: str) -> str:
    return f"{lab_prefix(lab)}{CLIENT_MARK}-{client}"


def lab_cgroup(lab: str) -> str:
    return os.path.join(CGROUP_PARENT, lab)


def apiserver_cgroup(lab: str) -> str:
    """Cgroup of the lab's embedded API server. It runs in the root netns (listening into the
    underlay through a socket made there), so only this cgroup lets teardown find it. The
    leading underscore keeps it apart from node cgroups: node names are DNS labels."""
    return os.path.join(lab_cgroup(lab), "_apiserver")


def node_cgroup(lab: str, node: str) -> str:
    return os.path.join(lab_cgroup(lab), node)


def pod_cgroup(lab: str, node: str, pod: str) -> str:
    return os.path.join(node_cgroup(lab, node), f"pod-{pod}")


def node_port_ifname(index: int) -> str:
    """Underlay bridge port facing node number ``index`` (its position in the topology)."""
    return f"n{index}"


def client_port_ifname(index: int) -> str:
    """Underlay bridge port facing client number ``index``."""
    return f"c{index}"


def pod_host_ifname(pod: str) -> str:
    """Node-side name of a pod's veth: stable, unique per pod name, within IFNAMSIZ."""
    digest = hashlib.sha1(pod.encode()).hexdigest()[:8]
    return f"{POD_VETH_PREFIX}{digest}"


def lab_of_netns(netns: str) -> str | None:
    """The lab owning a netns name of ours, or None for a name this project did not make.

    The lab name ends right before the first kind marker, which lab names cannot contain.
    """
    parts = netns.split("-")
    if len(parts) < 3 or parts[0] != PREFIX:
        return None
    for i in range(2, len(parts)):
        seg = parts[i]
        if seg == UNDERLAY and i == len(parts) - 1:
            return "-".join(parts[1:i])
        if seg in (NODE_MARK, POD_MARK, CLIENT_MARK) and i < len(parts) - 1:
            return "-".join(parts[1:i])
    return None


def lab_netns_names(lab: str) -> list[str]:
    """Every existing netns that belongs to ``lab`` (exactly, never a lab with a longer name)."""
    try:
        entries = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if lab_of_netns(e) == lab)


def leftover_labs() -> list[str]:
    """Names of all labs that still have a netns or a cgroup directory on this machine.

    Works from what the kernel shows, not from state files, so ``lab down --all`` can clean
    up after a crash. Only names this project could have made are returned.
    """
    labs: set[str] = set()
    try:
        entries = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        owner = lab_of_netns(entry)
        if owner is not None:
            labs.add(owner)
    try:
        cgroups = os.listdir(CGROUP_PARENT)
    except FileNotFoundError:
        cgroups = []
    for entry in cgroups:
        if os.path.isdir(os.path.join(CGROUP_PARENT, entry)):
            labs.add(entry)
    return sorted(lab for lab in labs if _is_lab_name(lab))


def _is_lab_name(name: str) -> bool:
    try:
        validate_lab_name(name)
    except LabNameError:
        return False
    return True
