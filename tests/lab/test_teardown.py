"""Nothing of a lab survives its teardown (issue 13, part 8), even after `kill -9` of everything.

A lab runs agents in both modes (eBPF on worker1 and worker3: TC/XDP programs, cgroup socket-LB
links, pinned maps; iptables on worker2: KUBE-* rules), the embedded API server and the pods'
echo servers. Then either `ebpf-proxy cleanup` runs on each node after its agent was killed, or
every process of the lab is killed with SIGKILL and `ebpf-proxy lab down` runs; afterwards each
kind of object is listed from the kernel, without bpftool (libbpf's id iterators, /proc,
/sys/fs/bpf, `ip netns`, iptables-save, cgroupfs), and none of the lab's may remain.

Other labs run concurrently on this machine, so only the lab's own objects are counted: BPF
objects by the ids its pins and cgroups led to while it ran, everything else by its name prefix
(netns epx-<lab>-*, cgroup ebpf-proxy-lab/<lab>, state and bpffs under /run/ebpf-proxy/labs/<lab>)
or by the identity of its network namespaces (the inodes behind them).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ebpf_proxy.datapath.ebpf import libbpf
from ebpf_proxy.lab import naming, nsexec, state
from ebpf_proxy.lab._setns import run_in_netns
from ebpf_proxy.lab.cluster import Lab, destroy
from tests.netns_util import nsenter

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, cgroups, BPF)"),
]

CLI = [sys.executable, "-m", "ebpf_proxy"]
MODES = {"worker1": "ebpf", "worker2": "iptables", "worker3": "ebpf"}
# cgroup attach types the socket LB uses (libbpf.ATTACH_CGROUP_*)
CGROUP_ATTACH = ("ATTACH_CGROUP_INET4_CONNECT", "ATTACH_CGROUP_UDP4_SENDMSG", "ATTACH_CGROUP_UDP4_RECVMSG")
DATAPATH_KINDS = ("bpf prog", "bpf map", "bpf link", "pin", "tc/xdp program", "cgroup program", "iptables rule")
LAB_KINDS = (*DATAPATH_KINDS, "bpffs mount", "cgroup", "netns", "process")


@pytest.fixture
def lab():
    name = "ct" + secrets.token_hex(3)  # this test's own prefix: ct + 6 hex digits
    destroy(name)
    lab = Lab.up(name, None, "none")
    try:
        for node, mode in MODES.items():
            lab.start_agent(node, mode, wait=False)
        for node in MODES:
            lab.wait_agent_ready(node, timeout=90)
        yield lab
    finally:
        destroy(name)


# ---- what the lab holds, kind by kind ------------------------------------------------------------


# what the kernel's bpf_preload puts in every bpffs mount (iterators it owns), not pins of ours
KERNEL_PRELOAD = ("maps.debug", "progs.debug")


def _pins(lab: Lab) -> list[Path]:
    root = lab.dir / "bpffs"
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and not (p.name in KERNEL_PRELOAD and p.parent.parent == root))


def _cgroups(lab: Lab) -> list[Path]:
    root = Path(naming.lab_cgroup(lab.name))
    return [root, *sorted(p for p in root.rglob("*") if p.is_dir())] if root.is_dir() else []


def _record_bpf(lab: Lab, seen: dict[str, set[int]], cgroup_ids: set[int]) -> None:
    """Add the ids of the lab's BPF objects to `seen`: everything pinned under its bpffs, the
    programs attached to its cgroups, the maps those programs use, the links on its cgroups."""
    for pin in _pins(lab):
        fd = libbpf.obj_get(str(pin))
        try:
            kind = libbpf.object_kind(fd)
            assert kind, f"pin {pin} is no BPF object"
            seen[kind].add(libbpf.object_id(fd, kind))
        finally:
            os.close(fd)
    for cgroup in _cgroups(lab):
        cgroup_ids.add(os.stat(cgroup).st_ino)  # a cgroup v2 id is its directory's inode
        fd = os.open(cgroup, os.O_RDONLY)
        try:
            for attach in CGROUP_ATTACH:
                seen["prog"].update(libbpf.prog_query(fd, getattr(libbpf, attach)))
        finally:
            os.close(fd)
    for prog_id in list(seen["prog"]):
        try:
            fd = libbpf.prog_fd_by_id(prog_id)
        except OSError:
            continue
        try:
            seen["map"].update(libbpf.prog_info(fd)[1])
        finally:
            os.close(fd)
    seen["link"].update(_links_on(cgroup_ids))


def _links_on(cgroup_ids: set[int]) -> set[int]:
    """Ids of the links, of every link the kernel lists now, that attach to one of `cgroup_ids`."""
    found = set()
    for link_id in libbpf.object_ids("link"):
        try:
            fd = libbpf.link_fd_by_id(link_id)
        except OSError:
            continue  # gone meanwhile
        try:
            if libbpf.link_info(fd).cgroup_id in cgroup_ids:
                found.add(link_id)
        finally:
            os.close(fd)
    return found


def _netns_ids(lab: Lab) -> set[tuple[int, int]]:
    out = set()
    for name in naming.lab_netns_names(lab.name):
        st = os.stat(nsexec.netns_path(name))
        out.add((st.st_dev, st.st_ino))
    return out


def _ip_netns_list() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _in_netns(netns: str, argv: list[str]) -> str:
    """`argv`'s output inside `netns`, entered with nsenter: `ip netns exec` also remounts /sys,
    which fails in a chroot (the fresh-machine check) and then lists nothing at all."""
    done = subprocess.run([*nsenter(netns), *argv], capture_output=True, text=True, timeout=30)
    return done.stdout


def _iptables_rules(netns: str) -> list[str]:
    rules = []
    for save in ("iptables-legacy-save", "iptables-nft-save"):
        rules += [f"{save}: {line}" for line in _in_netns(netns, [save]).splitlines()
                  if line.startswith("-A") and "KUBE-" in line]
    return rules


def _tc_xdp(netns: str) -> list[str]:
    found = []
    links = _in_netns(netns, ["ip", "-o", "-d", "link", "show"])
    for line in links.splitlines():
        dev = line.split(":")[1].strip().split("@")[0]
        if "prog/xdp" in line or " xdp" in line.split("link/")[0]:
            found.append(f"{netns} {dev}: xdp")
        for hook in ("ingress", "egress"):
            shown = _in_netns(netns, ["tc", "filter", "show", "dev", dev, hook])
            found += [f"{netns} {dev} {hook}: {f.strip()}" for f in shown.splitlines() if " bpf " in f or "epx_" in f]
    found += [f"{netns} {dev} {hook}: tcx program id {i}" for dev, hook, i in run_in_netns(netns, _tcx_programs)]
    return found


def _tcx_programs() -> list[tuple[str, str, int]]:
    """(device, hook, program id) of every tcx program in the calling thread's netns (neither tc
    nor this machine's bpftool lists them)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        links = [(link["index"], link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()]
    return [(dev, hook, i) for index, dev in links
            for hook, attach_type in (("ingress", libbpf.ATTACH_TCX_INGRESS), ("egress", libbpf.ATTACH_TCX_EGRESS))
            for i in libbpf.prog_query(index, attach_type)]


def _processes(lab: Lab, netns_ids: set[tuple[int, int]]) -> list[str]:
    marks = (f"/ebpf-proxy-lab/{lab.name}/", f"/ebpf-proxy-lab/{lab.name}\n")
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if ((st.st_dev, st.st_ino) in netns_ids or any(m in cgroup for m in marks)
                or str(lab.dir) + "/" in cmdline or naming.lab_prefix(lab.name) in cmdline):
            found.append(f"pid {pid}: {cmdline[:100]}")
    return found


def inventory(lab: Lab, seen: dict[str, set[int]], cgroup_ids: set[int],
              netns_ids: set[tuple[int, int]]) -> dict[str, list[str]]:
    """Every object of the lab still on the machine, by kind. BPF objects: of every object the
    kernel lists now, those whose id the lab's pins and cgroups led to (`seen`) or that sit on
    one of its cgroups (`cgroup_ids`)."""
    out: dict[str, list[str]] = {kind: [] for kind in LAB_KINDS}
    for kind in libbpf.OBJECT_KINDS:
        out[f"bpf {kind}"] = [f"{kind} id {i}" for i in sorted(libbpf.object_ids(kind) & seen[kind])]
    out["bpf link"] += [f"link id {i} on a lab cgroup" for i in sorted(_links_on(cgroup_ids) - seen["link"])]
    out["pin"] = [str(p) for p in _pins(lab)]
    out["bpffs mount"] = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                          if line.split()[4].startswith(str(lab.dir) + "/")]
    lab_netns = sorted(set(naming.lab_netns_names(lab.name))
                       | {n for n in _ip_netns_list() if n.startswith(naming.lab_prefix(lab.name))})
    out["netns"] = lab_netns
    for netns in lab_netns:
        out["iptables rule"] += [f"{netns} {r}" for r in _iptables_rules(netns)]
        out["tc/xdp program"] += _tc_xdp(netns)
    for cgroup in _cgroups(lab):
        out["cgroup"].append(str(cgroup))
        fd = os.open(cgroup, os.O_RDONLY)
        try:
            for attach in CGROUP_ATTACH:
                out["cgroup program"] += [f"{cgroup} {attach}: prog id {i}"
                                          for i in libbpf.prog_query(fd, getattr(libbpf, attach))]
        finally:
            os.close(fd)
    out["process"] = _processes(lab, netns_ids)
    return out


def _settled(lab, seen, cgroup_ids, netns_ids, kinds, timeout=15.0) -> dict[str, list[str]]:
    """The inventory once `kinds` are empty, or at the deadline: the kernel frees a BPF program
    or map after its last reference goes, in deferred work, not at once."""
    deadline = time.monotonic() + timeout
    while True:
        found = inventory(lab, seen, cgroup_ids, netns_ids)
        if not any(found[k] for k in kinds) or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


def _record(lab: Lab):
    seen: dict[str, set[int]] = {kind: set() for kind in libbpf.OBJECT_KINDS}
    cgroup_ids: set[int] = set()
    _record_bpf(lab, seen, cgroup_ids)
    netns_ids = _netns_ids(lab)
    before = inventory(lab, seen, cgroup_ids, netns_ids)
    print("\nwhile running: " + ", ".join(f"{len(v)} {k}" for k, v in before.items()))
    # every kind the test checks is really there: a check of an empty kind could not fail
    assert all(before[kind] for kind in LAB_KINDS), {k: v for k, v in before.items() if not v}
    return seen, cgroup_ids, netns_ids


def _kill9(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _root_kube_rules() -> set[str]:
    rules = set()
    for save in ("iptables-legacy-save", "iptables-nft-save"):
        out = subprocess.run([save], capture_output=True, text=True).stdout
        rules |= {f"{save}: {line}" for line in out.splitlines() if "KUBE-" in line}
    return rules


def test_cleanup_after_kill_9_of_the_agents_removes_the_datapath(lab):
    """`ebpf-proxy cleanup` on each node, its agent killed with SIGKILL (nothing shut down):
    no BPF program, map, link or pin of the lab, no TC/XDP or cgroup attachment, no KUBE rule."""
    seen, cgroup_ids, netns_ids = _record(lab)
    for node in MODES:
        _kill9(lab.data["agents"][node]["pid"])
    for node in MODES:
        result = lab.exec(node, CLI + ["cleanup", "--hostname-override", node,
                                       "--bpffs", str(lab.dir / "bpffs" / node),
                                       "--cgroup-path", naming.node_cgroup(lab.name, node)],
                          capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"cleanup on {node}:\n{result.stdout}{result.stderr}"
    after = _settled(lab, seen, cgroup_ids, netns_ids, DATAPATH_KINDS)
    print("after cleanup: " + ", ".join(f"{len(after[k])} {k}" for k in DATAPATH_KINDS))
    assert {k: after[k] for k in DATAPATH_KINDS} == {k: [] for k in DATAPATH_KINDS}
    assert after["netns"] and after["cgroup"], "cleanup removes the datapath, not the lab"


def test_lab_down_after_kill_9_of_everything_leaves_nothing(lab):
    """SIGKILL to every process of the lab (agents, API server, echo servers), then `lab down`
    in another process with nothing but the lab's name: every kind is empty."""
    seen, cgroup_ids, netns_ids = _record(lab)
    root_rules = _root_kube_rules()
    pids = [a["pid"] for a in lab.data["agents"].values()]
    pids += [lab.data.get("apiserver", {}).get("pid")] + [p.get("pid") for p in lab.data["pods"].values()]
    assert len([p for p in pids if p]) == len(MODES) + 1 + len(lab.data["pods"]) >= 6
    for pid in pids:
        _kill9(pid)
    down = subprocess.run(CLI + ["lab", "down", "--name", lab.name], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    after = _settled(lab, seen, cgroup_ids, netns_ids, LAB_KINDS)
    print("after kill -9 and lab down: " + ", ".join(f"{len(v)} {k}" for k, v in after.items()))
    assert after == {kind: [] for kind in LAB_KINDS}
    assert not state.lab_dir(lab.name).exists()
    assert _root_kube_rules() == root_rules, "the root netns' rules are not the lab's to touch"
