"""What the kernel of a lab node holds for the proxy: its size, and which endpoints it programs.

The bench reads the kernel, never the agent's own account of itself: a rules count comes from
`iptables-save` inside the node's netns, map entries from the pinned maps, and "the change is
programmed" means the new endpoint's address is in the kernel's NAT rules or backend map.

Per mode:

- iptables: `iptables-save` in the node netns. Rules are its `-A` lines, per table; an endpoint
  is programmed when a `--to-destination IP:PORT` names it. iptables-save is slow at scale
  (about 5 s for the 110k lines of 10,000 Services, on this project's 2-core machines), far too
  coarse to time a change; so when the Service is known, the check lists only that endpoint's
  KUBE-SEP chain (named as kube-proxy names it, see datapath/iptables/chains.py): ~4 ms
  whatever the size.
- ebpf: entries of every hash-like map pinned under the agent's bpffs directory (counted with
  bpftool, or by the datapath's own `maps.entry_counts(bpffs_dir)` when it has one). Which endpoints are
  programmed needs the backend map's layout, which only the eBPF datapath knows: the bench calls
  `ebpf_proxy.datapath.ebpf.maps.programmed_backends(bpffs_dir) -> set[(ip, port)]`; until that
  exists the eBPF control-plane figures are reported as unavailable, with this reason. Dumping
  every backend takes ~40 ms at 10,000 Services, so when the Service's frontend is known the
  check reads only its entry, slots and backends (`maps.frontend_backends`): well under 1 ms.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from ebpf_proxy.datapath.iptables.chains import sep_chain
from ebpf_proxy.lab import nsexec
from ebpf_proxy.lab.cluster import Lab
from ebpf_proxy.model import Protocol, ServicePortName

_TO_DEST = re.compile(r"--to-destination (\d+\.\d+\.\d+\.\d+):(\d+)")
EBPF_BACKENDS_HOOK = "ebpf_proxy.datapath.ebpf.maps.programmed_backends(bpffs_dir) -> set[tuple[str, int]]"


class KernelStateError(RuntimeError):
    pass


def _run(lab: Lab, node: str, argv: list[str], timeout: float = 60.0) -> str:
    done = nsexec.run(lab.netns_of(node), argv, timeout=timeout)
    if done.returncode != 0:
        raise KernelStateError(f"{' '.join(argv)} in {node} exited {done.returncode}: {done.stderr.strip()[:300]}")
    return done.stdout


def bpffs_dir(lab: Lab, node: str) -> Path:
    """Where the node's agent pins its maps (the lab passes it as --bpffs)."""
    return lab.dir / "bpffs" / node


# ---- iptables -----------------------------------------------------------------------------------

def count_iptables_rules(save_text: str) -> dict[str, int]:
    """{'iptables_rules_<table>': n, 'iptables_chains_<table>': n} from iptables-save output."""
    counts: dict[str, int] = {}
    table = None
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
            counts.setdefault(f"iptables_rules_{table}", 0)
            counts.setdefault(f"iptables_chains_{table}", 0)
        elif table and line.startswith("-A "):
            counts[f"iptables_rules_{table}"] += 1
        elif table and line.startswith(":"):
            counts[f"iptables_chains_{table}"] += 1
    return counts


def iptables_endpoints(save_text: str) -> set[tuple[str, int]]:
    """Every (ip, port) a DNAT rule sends to."""
    return {(m.group(1), int(m.group(2))) for m in _TO_DEST.finditer(save_text)}


def iptables_save(lab: Lab, node: str, table: str | None = None) -> str:
    return lab.iptables_save(node, table)


def iptables_chain(lab: Lab, node: str, table: str, chain: str) -> str | None:
    """`iptables -S CHAIN` of one chain; None when the chain does not exist."""
    for iptables in ("iptables-legacy", "iptables-nft"):  # whichever backend the agent picked
        done = nsexec.run(lab.netns_of(node), [iptables, "-w", "-t", table, "-S", chain], timeout=30)
        if done.returncode == 0:
            break
    if done.returncode != 0:
        # iptables-nft 1.8.9 says "chain `X' in table `nat' is incompatible" for a chain that does
        # not exist; older versions and the legacy backend say "No chain/target/match".
        if any(text in done.stderr for text in ("No chain", "does not exist", "is incompatible")):
            return None
        raise KernelStateError(f"iptables -t {table} -S {chain} in {node}: {done.stderr.strip()[:300]}")
    return done.stdout


def _dnat_to(text: str, ip: str, port: int) -> bool:
    return re.search(re.escape(f"--to-destination {ip}:{port}") + r"(?!\d)", text) is not None


# ---- ebpf ---------------------------------------------------------------------------------------

def _ebpf_maps_module():
    try:
        from ebpf_proxy.datapath.ebpf import maps
    except ImportError as exc:
        raise NotImplementedError(f"ebpf_proxy.datapath.ebpf.maps cannot be imported ({exc}); the bench needs "
                                  f"{EBPF_BACKENDS_HOOK}") from None
    return maps


def ebpf_endpoints(lab: Lab, node: str) -> set[tuple[str, int]]:
    hook: Callable[[Path], set[tuple[str, int]]] | None = getattr(_ebpf_maps_module(), "programmed_backends", None)
    if hook is None:
        raise NotImplementedError(f"{EBPF_BACKENDS_HOOK} is missing: the bench cannot tell which endpoints "
                                  "the BPF maps hold")
    return {(str(ip), int(port)) for ip, port in hook(bpffs_dir(lab, node))}


def is_hash_like(show: dict) -> bool:
    """Maps whose entries exist only when written (hash, LRU, LPM trie): their count is the state.
    Arrays always hold max_entries slots, so their count says nothing about the services."""
    return "array" not in str(show.get("type", ""))


def ebpf_counts(lab: Lab, node: str) -> dict[str, int]:
    root = bpffs_dir(lab, node)
    hook = getattr(_ebpf_maps_module(), "entry_counts", None)
    if hook is not None:
        return {f"bpf_entries_{k}": int(v) for k, v in hook(root).items()}
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        raise KernelStateError("bpftool is not installed (apt-get install bpftool): cannot count BPF map entries")
    pins = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    counts: dict[str, int] = {}
    for pin in pins:
        show = subprocess.run([bpftool, "-j", "map", "show", "pinned", str(pin)], capture_output=True, text=True)
        if show.returncode != 0:  # a pinned program or link, not a map
            continue
        info = json.loads(show.stdout)
        if not is_hash_like(info):
            continue
        dump = subprocess.run([bpftool, "-j", "map", "dump", "pinned", str(pin)], capture_output=True, text=True,
                              timeout=120)
        if dump.returncode != 0:
            raise KernelStateError(f"bpftool map dump pinned {pin}: {dump.stderr.strip()[:300]}")
        counts[f"bpf_entries_{pin.name}"] = len(json.loads(dump.stdout))
    if not counts:
        raise NotImplementedError(f"no BPF maps pinned under {root}, and no "
                                  "ebpf_proxy.datapath.ebpf.maps.entry_counts(bpffs_dir): cannot count map entries")
    return counts


# ---- by mode ------------------------------------------------------------------------------------

def kernel_counts(lab: Lab, node: str, mode: str) -> dict[str, int]:
    """Kernel objects the proxy holds on `node`, plus a `total` (rules, or map entries)."""
    if mode == "iptables":
        counts = count_iptables_rules(iptables_save(lab, node))
        counts["total"] = sum(v for k, v in counts.items() if k.startswith("iptables_rules_"))
    elif mode == "ebpf":
        counts = ebpf_counts(lab, node)
        counts["total"] = sum(counts.values())
    else:
        raise ValueError(f"mode {mode!r} has no kernel state")
    return counts


def kernel_endpoints(lab: Lab, node: str, mode: str) -> set[tuple[str, int]]:
    """Every (ip, port) the node's kernel would send service traffic to.
    NotImplementedError when the mode cannot tell yet (the message names the missing piece)."""
    if mode == "iptables":
        return iptables_endpoints(iptables_save(lab, node, "nat"))
    if mode == "ebpf":
        return ebpf_endpoints(lab, node)
    raise ValueError(f"mode {mode!r} programs no endpoints")


def kernel_has_endpoint(lab: Lab, node: str, mode: str, ip: str, port: int,
                        service: ServicePortName | None = None, frontend: tuple[str, int] | None = None) -> bool:
    """Is (ip, port) programmed on `node` (as an endpoint of `service`, when given)?
    The hook the control-plane measurements poll, so each mode asks the narrowest question its
    kernel answers: iptables the endpoint's own KUBE-SEP chain (the kernel still hands over the
    whole table, which is iptables' cost), ebpf the service's frontend (ClusterIP, port) entry and
    its slots, a few map lookups at any size."""
    if mode == "iptables":
        if service is not None:
            rules = iptables_chain(lab, node, "nat", sep_chain(service, ip, port))
            return rules is not None and _dnat_to(rules, ip, port)
        return _dnat_to(iptables_save(lab, node, "nat"), ip, port)
    if mode == "ebpf" and frontend is not None:
        maps = _ebpf_maps_module()
        protocol = (service.protocol if service is not None else Protocol.TCP).value
        backends = maps.frontend_backends(bpffs_dir(lab, node), frontend[0], frontend[1], maps.IPPROTO[protocol])
        return backends is not None and (ip, port) in backends
    return (ip, port) in kernel_endpoints(lab, node, mode)


def service_port_name(namespace: str, name: str, port_name: str = "", protocol: str = "TCP") -> ServicePortName:
    return ServicePortName(namespace, name, port_name, Protocol(protocol))
