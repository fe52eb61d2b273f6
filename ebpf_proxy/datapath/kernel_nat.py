"""Service connections in the kernel's conntrack, read and written over netlink (a mode switch).

The iptables mode's connections live in nf_conntrack: an entry whose original tuple is
client -> frontend and whose reply tuple is backend -> client (or backend -> masquerade address
when masqueraded) translates every later packet, whatever the rules say by then. The eBPF mode
keeps the same facts in epx_ct4. Switching modes without breaking an established connection
means moving each one across (agent/handover.py): `dump` reads the kernel's translated
connections; `install` writes one, as conntrackd does for a failover, with the NAT set up by the
kernel's own nf_nat from CTA_NAT_DST / CTA_NAT_SRC (ctnetlink cannot take the NAT status bits
directly); `remove` deletes one. The netlink work is pyroute2's; only IPv4 TCP and UDP, the
connections both datapaths translate, are read.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from dataclasses import dataclass

# include/uapi/linux/netfilter/nf_conntrack_common.h
IPS_SEEN_REPLY = 1 << 1
IPS_ASSURED = 1 << 2
IPS_CONFIRMED = 1 << 3  # set on every entry ctnetlink creates; a CTA_STATUS without it is refused (EBUSY)
IPS_SRC_NAT = 1 << 4
IPS_DST_NAT = 1 << 5
# include/uapi/linux/netfilter/nf_conntrack_tcp.h (enum tcp_conntrack)
TCP_SYN_SENT = 1
TCP_SYN_RECV = 2
TCP_ESTABLISHED = 3
TCP_FIN_WAIT = 4
TCP_CLOSE_WAIT = 5
TCP_LAST_ACK = 6
TCP_TIME_WAIT = 7
TCP_CLOSE = 8
IP_CT_TCP_FLAG_BE_LIBERAL = 0x08

INSTALL_TRIES = 4  # a packet may re-create the plain entry between our delete and our create


@dataclass(frozen=True, slots=True)
class NatConnection:
    """One translated connection: client -> frontend, sent to backend, from `source` (the client,
    the masquerade address and port, or the client with another port: netfilter's NAT remaps a
    tuple that clashes with another connection's, so does the eBPF mode, CT4_S_REMAP)."""

    proto: int  # socket.IPPROTO_TCP / IPPROTO_UDP
    client: str
    client_port: int
    frontend: str
    frontend_port: int
    backend: str
    backend_port: int
    source: str
    source_port: int
    timeout: int  # seconds left
    tcp_state: int = TCP_ESTABLISHED  # nf_conntrack's (TCP only)
    seen_reply: bool = True
    assured: bool = False  # nf_conntrack's ASSURED (never early-dropped): the client spoke after a reply

    @property
    def source_translated(self) -> bool:
        """The backend sees another source than the client's: masqueraded or port-remapped."""
        return (self.source, self.source_port) != (self.client, self.client_port)

    @property
    def masqueraded(self) -> bool:
        """The backend sees another source address (SNAT to the masquerade address)."""
        return self.source != self.client

    @property
    def port_remapped(self) -> bool:
        """The backend sees the client's address with another port: not a masquerade, the NAT's
        answer to a clash (the client's port toward that backend was another connection's)."""
        return self.source == self.client and self.source_port != self.client_port

    @property
    def closing(self) -> bool:
        return self.proto == socket.IPPROTO_TCP and self.tcp_state >= TCP_FIN_WAIT

    @property
    def half_open(self) -> bool:
        """A TCP handshake still under way."""
        return self.proto == socket.IPPROTO_TCP and self.tcp_state < TCP_ESTABLISHED

    def describe(self) -> str:
        via = f" as {self.source}:{self.source_port}" if self.source_translated else ""
        return (f"{'tcp' if self.proto == socket.IPPROTO_TCP else 'udp'} {self.client}:{self.client_port} -> "
                f"{self.frontend}:{self.frontend_port} -> {self.backend}:{self.backend_port}{via}")


def _tuple(saddr: str, daddr: str, proto: int, sport: int, dport: int):
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    return NFCTAttrTuple(saddr=saddr, daddr=daddr, proto=proto, sport=sport, dport=dport)


def _nat_attr(addr: str, port: int) -> dict:
    return {"attrs": [["CTA_NAT_V4_MINIP", addr], ["CTA_NAT_V4_MAXIP", addr],
                      ["CTA_NAT_PROTO", {"attrs": [["CTA_PROTONAT_PORT_MIN", port],
                                                   ["CTA_PROTONAT_PORT_MAX", port]]}]]}


def _liberal_tcp(state: int) -> dict:
    liberal = {"value": (IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL)}
    return {"attrs": [["CTA_PROTOINFO_TCP", {"attrs": [
        ["CTA_PROTOINFO_TCP_STATE", state],
        ["CTA_PROTOINFO_TCP_FLAGS_ORIGINAL", liberal], ["CTA_PROTOINFO_TCP_FLAGS_REPLY", liberal]]}]]}


class KernelConntrack:
    """The kernel's conntrack table of the current network namespace, over one netlink socket."""

    def __init__(self) -> None:
        from pyroute2.conntrack import Conntrack

        self._ct = Conntrack()

    def close(self) -> None:
        self._ct.close()

    def __enter__(self) -> KernelConntrack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dump(self) -> Iterator[NatConnection]:
        """Every IPv4 TCP/UDP entry whose destination was translated (a service connection)."""
        for entry in self._ct.dump_entries():
            orig, reply = entry.tuple_orig, entry.tuple_reply
            if not (entry.status or 0) & IPS_DST_NAT or orig.proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                continue
            if orig.family != socket.AF_INET:
                continue
            state = entry.protoinfo.state if entry.protoinfo is not None else TCP_ESTABLISHED
            yield NatConnection(
                proto=orig.proto, client=orig.saddr, client_port=orig.sport, frontend=orig.daddr,
                frontend_port=orig.dport, backend=reply.saddr, backend_port=reply.sport,
                source=reply.daddr, source_port=reply.dport, timeout=int(entry.timeout or 0),
                tcp_state=state, seen_reply=bool(entry.status & IPS_SEEN_REPLY),
                assured=bool(entry.status & IPS_ASSURED))

    def _delete(self, **tuples) -> bool:
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            self._ct.entry("del", **tuples)
        except NetlinkError as err:
            if err.code == errno.ENOENT:
                return False
            raise
        return True

    def remove(self, conn: NatConnection) -> bool:
        """Delete the translated entry of `conn`; False when it was not there."""
        return self._delete(tuple_orig=_tuple(conn.client, conn.frontend, conn.proto, conn.client_port,
                                              conn.frontend_port))

    def install(self, conn: NatConnection) -> None:
        """Make the kernel translate `conn` from its next packet on, as if its own rules had.

        The entry it has for the connection's translated tuple (the eBPF mode translated before
        netfilter saw the packets, so conntrack tracked client -> backend untranslated) would
        clash with the new entry's reply tuple: it goes first. A packet arriving in between
        re-creates it, so the create is retried."""
        from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nfctsocket import IPCTNL_MSG_CT_NEW, nfct_msg

        status = IPS_CONFIRMED | (IPS_SEEN_REPLY if conn.seen_reply else 0) | (IPS_ASSURED if conn.assured else 0)
        attrs = {
            "tuple_orig": _tuple(conn.client, conn.frontend, conn.proto, conn.client_port, conn.frontend_port),
            # the untranslated reply: the kernel's nf_nat rewrites it from the NAT attributes below
            "tuple_reply": _tuple(conn.frontend, conn.client, conn.proto, conn.frontend_port, conn.client_port),
            "timeout": max(conn.timeout, 1),
            "status": status,
        }
        if conn.proto == socket.IPPROTO_TCP:
            # liberal window tracking, as nf_conntrack gives a connection it picks up mid-stream:
            # the window scale was in the SYNs, which this entry never saw
            attrs["protoinfo"] = _liberal_tcp(conn.tcp_state)
        for attempt in range(INSTALL_TRIES):
            if attempt:  # a clash on the original tuple: a packet made its own entry meanwhile
                self.remove(conn)
            # what conntrack tracked of the translated packets, either direction first
            self._delete(tuple_orig=_tuple(conn.source, conn.backend, conn.proto, conn.source_port,
                                           conn.backend_port))
            self._delete(tuple_orig=_tuple(conn.backend, conn.source, conn.proto, conn.backend_port,
                                           conn.source_port))
            if conn.masqueraded:  # the eBPF mode masquerades after netfilter: it saw the client's source,
                # with the client's port or, remapped (CT4_S_REMAP), with the masquerade port already
                for port in {conn.client_port, conn.source_port}:
                    self._delete(tuple_orig=_tuple(conn.client, conn.backend, conn.proto, port, conn.backend_port))
            msg = nfct_msg.create_from(**attrs)
            msg["attrs"].append(["CTA_NAT_DST", _nat_attr(conn.backend, conn.backend_port)])
            if conn.source_translated:  # masqueraded, or only its port remapped (a clash)
                msg["attrs"].append(["CTA_NAT_SRC", _nat_attr(conn.source, conn.source_port)])
            try:
                self._ct.request(msg, IPCTNL_MSG_CT_NEW,
                                 msg_flags=NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
                return
            except NetlinkError as err:
                if err.code != errno.EEXIST or attempt == INSTALL_TRIES - 1:
                    raise OSError(err.code, f"conntrack: cannot create {conn.describe()}: {err}") from err
