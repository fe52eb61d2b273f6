"""What `trace` needs from the node it runs on, in iptables mode: the live rules and the node's facts.

An IPv6 flow is asked of the IPv6 proxier: ip6tables' rules, the node's IPv6 addresses and
default route. Everything here reads the network namespace of the calling process (a lab node's, when run
through `lab trace`), never writes:
- the rules: `iptables-save -t nat` and `-t filter` of the backend that holds them (legacy or
  nft, decided as the datapath decides: datapath/iptables/backend.py; the other backend's rules
  are invisible to it, and both run, so reading the wrong one would explain nothing);
- the node's local addresses (`-m addrtype LOCAL`), from netlink as the agent reads them;
- the masquerade address: what MASQUERADE picks for traffic leaving through the default route,
  the first primary address of the flow's family on that device (IPv6: not link-local);
- the device a route leads to: for `-o` matches, and for where a packet from a given source
  comes in (the reverse route), when the caller does not say.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
from collections.abc import Sequence

from ebpf_proxy.datapath.iptables import backend as ipt_backend
from ebpf_proxy.explain.iptables_walk import NodeFacts

_IFA_F_SECONDARY = 0x01
SAVE_TIMEOUT_SECONDS = 60


class LiveError(RuntimeError):
    """The node's rules or addresses could not be read; the message names the command or source."""


def _run(cmd: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=SAVE_TIMEOUT_SECONDS, check=False)
    except FileNotFoundError:
        return 127, ""
    return done.returncode, done.stdout


def read_rules(backend: str = "auto", family: int = 4) -> tuple[str, str]:
    """(iptables-save text of the nat and filter tables, the command that printed it); `family` 6:
    ip6tables-save's."""
    cmds = ipt_backend.commands(backend, _run, family=family)
    save = cmds["iptables_save"]
    out = []
    for table in ("nat", "filter"):
        cmd = (*save, "-t", table)
        try:
            done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=SAVE_TIMEOUT_SECONDS, check=False)
        except FileNotFoundError:
            raise LiveError(f"{save[0]}: not installed (--iptables-backend picks another)") from None
        if done.returncode != 0:
            raise LiveError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()}")
        out.append(done.stdout)
    return "".join(out), save[0]


def _af(family: int) -> int:
    return socket.AF_INET6 if family == 6 else socket.AF_INET


def local_addresses(family: int = 4) -> list[str]:
    """Every address of `family` in this network namespace (127.0.0.0/8 and ::1 are local anyway)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        addrs = [m.get("IFA_LOCAL") or m.get("IFA_ADDRESS") for m in ipr.get_addr(family=_af(family))]
    return list(dict.fromkeys(a for a in addrs if a))


def masquerade_address(family: int = 4) -> str | None:
    """The first primary address of `family` of the device holding the default route (None: no
    default route). IPv6: link-local addresses are skipped (MASQUERADE never picks one for a
    routed packet)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        oifs = [r.get("RTA_OIF") for r in ipr.get_routes(family=_af(family), dst_len=0)
                if (r.get("RTA_TABLE") or r["table"]) == 254]
        for oif in (o for o in oifs if o):
            for msg in ipr.get_addr(family=_af(family), index=oif):
                addr = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
                if not addr or msg["flags"] & _IFA_F_SECONDARY:
                    continue
                ip = ipaddress.ip_address(addr)
                if not ip.is_loopback and not ip.is_link_local:
                    return addr
    return None


def route_device(dst: str) -> str | None:
    """The device the kernel routes `dst` out of (`ip route get`), or None when it has no route."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        try:
            routes = ipr.route("get", dst=dst)
        except NetlinkError:
            return None
        oif = next((r.get("RTA_OIF") for r in routes if r.get("RTA_OIF")), None)
        if oif is None:
            return None
        links = ipr.get_links(oif)
        return links[0].get("IFLA_IFNAME") if links else None


def node_facts(local_ips: Sequence[str] | None = None, masquerade_ip: str | None = None,
               family: int = 4) -> NodeFacts:
    """This node's facts for flows of `family`; `local_ips`/`masquerade_ip` override what netlink says
    (a dump from elsewhere: then the first given address of the family masquerades)."""
    try:
        ips = list(local_ips) if local_ips else local_addresses(family)
        given = [ip for ip in local_ips or () if ipaddress.ip_address(ip).version == family]
        masq = masquerade_ip or (given[0] if given else None if local_ips else masquerade_address(family))
    except OSError as exc:
        raise LiveError(f"netlink: cannot read this node's addresses: {exc}") from None
    return NodeFacts(frozenset(ips), masquerade_ip=masq, route_dev=None if local_ips else route_device)
