"""Stale UDP conntrack cleanup (SEMANTICS rule 10), over netlink with pyroute2.

UDP has no connection end, so a conntrack entry keeps steering a client's datagrams to its old
DNAT target for as long as the client keeps sending: to an endpoint that is gone, or (for entries
created while the service had no endpoints) to nowhere. kube-proxy deletes those entries after
each sync; so do we, with the same selectors:
- an endpoint went away: entries whose original destination is one of the service's IPs and port
  (or any address with its nodePort) and whose reply source is the removed endpoint's IP;
- a service went from no endpoints to some: every entry to its IPs:port and its nodePort.

Entries are dumped once per cleanup (UDP only, filtered in the kernel) and deleted one by one on
the same netlink socket; no process is spawned per entry.

Like the rules, the cleanup is per IP family, the datapath's: only services whose cluster IP is
of that family, only that family's addresses and endpoints, and only that family's entries
(an IPv6 datapath dumps and deletes AF_INET6 entries). Addresses are compared in canonical form
(`fd00::a` whatever the spelling), as the kernel reports them.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from ebpf_proxy.model import ChangeSet, Protocol, ProxyState, ServicePort

log = logging.getLogger(__name__)


def _canonical(ip: str | None) -> str | None:
    """An address in one spelling (as the kernel reports it); anything else as given."""
    if ip is None:
        return None
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:
        return ip


def _version(ip: str) -> int | None:
    try:
        return ipaddress.ip_address(ip).version
    except ValueError:
        return None


@dataclass(frozen=True)
class StaleFilter:
    """Selects UDP entries: None fields match anything. Addresses are kept canonical."""

    orig_dst: str | None
    orig_dport: int
    reply_src: str | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "orig_dst", _canonical(self.orig_dst))
        object.__setattr__(self, "reply_src", _canonical(self.reply_src))

    def matches(self, orig_dst: str, orig_dport: int, reply_src: str) -> bool:
        """Whether an entry matches; its addresses must be canonical (ConntrackCleaner makes them so)."""
        return (
            (self.orig_dst is None or self.orig_dst == orig_dst)
            and self.orig_dport == orig_dport
            and (self.reply_src is None or self.reply_src == reply_src)
        )


def _service_ips(svc: ServicePort, family: int) -> tuple[str, ...]:
    ips = (svc.cluster_ip,) if svc.cluster_ip else ()
    return tuple(ip for ip in (*ips, *svc.external_ips, *svc.load_balancer_ips) if _version(ip) == family)


def _filters_for(svc: ServicePort, reply_src: str | None, family: int) -> list[StaleFilter]:
    out = [StaleFilter(ip, svc.port, reply_src) for ip in _service_ips(svc, family)]
    if svc.node_port:
        out.append(StaleFilter(None, svc.node_port, reply_src))
    return out


def _programmed(svc: ServicePort, family: int) -> bool:
    """Whether this family's datapath programs the service (its cluster IP is of the family)."""
    return svc.cluster_ip is not None and _version(svc.cluster_ip) == family


def stale_filters(
    changes: ChangeSet, state: ProxyState, previous: ProxyState | None = None, family: int = 4
) -> list[StaleFilter]:
    """What to delete after a sync, in IP `family`. A removed endpoint's service may itself be gone
    from `state` (deleted service): its addresses are then taken from `previous`, the last synced
    state. Services of the other family, and endpoints of the other family, select nothing here:
    the other family's datapath clears those."""
    out: list[StaleFilter] = []
    for name, ep_ip in sorted(changes.stale_udp_endpoints):
        svc = state.services.get(name) or (previous.services.get(name) if previous else None)
        if svc is None:
            log.warning("stale UDP endpoint %s of %s: service unknown, conntrack entries left", ep_ip, name)
            continue
        if svc.protocol is Protocol.UDP and _programmed(svc, family) and _version(ep_ip) == family:
            out.extend(_filters_for(svc, ep_ip, family))
    for name in sorted(changes.stale_udp_services):
        svc = state.services.get(name)
        if svc is not None and svc.protocol is Protocol.UDP and _programmed(svc, family):
            out.extend(_filters_for(svc, None, family))
    return out


class ConntrackCleaner:
    """Deletes conntrack entries of IP `family` (4 or 6) in one network namespace (None: the current one)."""

    def __init__(self, netns: str | None = None, family: int = 4) -> None:
        if family not in (4, 6):
            raise ValueError(f"conntrack: IP family {family!r} is not 4 or 6")
        self.netns = netns
        self.family = family

    def delete(self, filters: Iterable[StaleFilter]) -> int:
        """Delete every UDP entry any filter selects; returns how many were deleted."""
        filters = list(filters)
        if not filters:
            return 0
        # Imported here so that rendering and unit tests never need netlink.
        from pyroute2.conntrack import Conntrack, NFCTAttrTuple
        from pyroute2.netlink.exceptions import NetlinkError

        af = socket.AF_INET6 if self.family == 6 else socket.AF_INET
        kwargs = {"netns": self.netns, "flags": 0} if self.netns else {}  # flags=0: never create the netns
        deleted = 0
        # the socket's nfgen_family selects what the dump returns and what a delete addresses
        ct = Conntrack(nfgen_family=af, **kwargs)
        try:
            entries = list(ct.dump_entries(tuple_orig=NFCTAttrTuple(family=af, proto=socket.IPPROTO_UDP)))
            for entry in entries:
                orig, reply = entry.tuple_orig, entry.tuple_reply
                daddr, saddr = _canonical(orig.daddr), _canonical(reply.saddr)
                if not any(f.matches(daddr, orig.dport, saddr) for f in filters):
                    continue
                try:
                    ct.delete(entry)
                    deleted += 1
                except NetlinkError as err:
                    if err.code != errno.ENOENT:  # expired between dump and delete: already gone
                        raise
        finally:
            ct.close()
        return deleted
