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
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from ebpf_proxy.model import ChangeSet, Protocol, ProxyState, ServicePort

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaleFilter:
    """Selects UDP entries: None fields match anything."""

    orig_dst: str | None
    orig_dport: int
    reply_src: str | None

    def matches(self, orig_dst: str, orig_dport: int, reply_src: str) -> bool:
        return (
            (self.orig_dst is None or self.orig_dst == orig_dst)
            and self.orig_dport == orig_dport
            and (self.reply_src is None or self.reply_src == reply_src)
        )


def _service_ips(svc: ServicePort) -> tuple[str, ...]:
    ips = (svc.cluster_ip,) if svc.cluster_ip else ()
    return (*ips, *svc.external_ips, *svc.load_balancer_ips)


def _filters_for(svc: ServicePort, reply_src: str | None) -> list[StaleFilter]:
    out = [StaleFilter(ip, svc.port, reply_src) for ip in _service_ips(svc)]
    if svc.node_port:
        out.append(StaleFilter(None, svc.node_port, reply_src))
    return out


def stale_filters(changes: ChangeSet, state: ProxyState, previous: ProxyState | None = None) -> list[StaleFilter]:
    """What to delete after a sync. A removed endpoint's service may itself be gone from `state`
    (deleted service): its addresses are then taken from `previous`, the last synced state."""
    out: list[StaleFilter] = []
    for name, ep_ip in sorted(changes.stale_udp_endpoints):
        svc = state.services.get(name) or (previous.services.get(name) if previous else None)
        if svc is None:
            log.warning("stale UDP endpoint %s of %s: service unknown, conntrack entries left", ep_ip, name)
            continue
        if svc.protocol is Protocol.UDP:
            out.extend(_filters_for(svc, ep_ip))
    for name in sorted(changes.stale_udp_services):
        svc = state.services.get(name)
        if svc is not None and svc.protocol is Protocol.UDP:
            out.extend(_filters_for(svc, None))
    return out


class ConntrackCleaner:
    """Deletes conntrack entries in one network namespace (None: the current one)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns

    def delete(self, filters: Iterable[StaleFilter]) -> int:
        """Delete every UDP entry any filter selects; returns how many were deleted."""
        filters = list(filters)
        if not filters:
            return 0
        # Imported here so that rendering and unit tests never need netlink.
        from pyroute2.conntrack import Conntrack, NFCTAttrTuple
        from pyroute2.netlink.exceptions import NetlinkError

        kwargs = {"netns": self.netns, "flags": 0} if self.netns else {}  # flags=0: never create the netns
        deleted = 0
        ct = Conntrack(**kwargs)
        try:
            entries = list(ct.dump_entries(tuple_orig=NFCTAttrTuple(proto=socket.IPPROTO_UDP)))
            for entry in entries:
                orig, reply = entry.tuple_orig, entry.tuple_reply
                if not any(f.matches(orig.daddr, orig.dport, reply.saddr) for f in filters):
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
