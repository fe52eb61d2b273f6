"""Connections in and out of epx_ct4 for a mode switch (agent/handover.py drives it).

Taking over from the iptables mode, each connection the kernel's conntrack translates gets the
epx_ct4 entries bpf/lib/ct4.h's ct4_create would have written for it (the reply halves first, the
connection last, as ct4_create does), so the programs translate its next packet exactly as the
kernel did. Handing over, each of our connections is read back as the kernel's NatConnection and,
once the kernel holds it, forgotten here. While either runs, epx_config carries
CFG_F_NETFILTER_FIRST or _MIDSTREAM (bpf/lib/lb4.h: lb4_left_to_netfilter) so that a packet of a
connection not moved yet is left to the kernel rather than balanced afresh.
"""

from __future__ import annotations

import socket

from ebpf_proxy.datapath.ebpf import structs as s
from ebpf_proxy.datapath.ebpf.maps import (
    Connection,
    Frontend,
    Maps,
    be16,
    be32,
    ct_key,
    half_is_held,
    half_owner,
    live_owner,
)
from ebpf_proxy.datapath.kernel_nat import (
    TCP_CLOSE,
    TCP_CLOSE_WAIT,
    TCP_ESTABLISHED,
    TCP_FIN_WAIT,
    TCP_LAST_ACK,
    TCP_SYN_SENT,
    TCP_TIME_WAIT,
    NatConnection,
)

NSEC = 1_000_000_000
HANDOVER_FLAGS = s.CFG_F_NETFILTER_MIDSTREAM | s.CFG_F_NETFILTER_FIRST


def set_handover(maps: Maps, flag: int) -> None:
    """Put epx_config in a mode-switch state (CFG_F_NETFILTER_FIRST or _MIDSTREAM), or out of it (0)."""
    if flag & ~HANDOVER_FLAGS:
        raise ValueError(f"handover flag {flag:#x} is not CFG_F_NETFILTER_FIRST, _MIDSTREAM or 0")
    cfg = maps.config()
    cfg.flags = (cfg.flags & ~HANDOVER_FLAGS) | flag
    maps.set_config(cfg)


def outgoing(maps: Maps, now_ns: int) -> list[NatConnection]:
    """Our live connections as the kernel would hold them. Not among them: a node socket's own
    connections (the socket LB connected those to the backend directly, nothing translates their
    packets; CT4_F_SOCK_MASQ ones aside, see README "Switching modes"), and a connection that is
    over (CT4_F_DONE: its masquerade port may serve a new one already). Where two still share
    the tuple the backend sees (a port handed to a new connection while the old one closes),
    the kernel can hold only one: the one not closing."""
    best: dict[tuple, tuple[Connection, NatConnection]] = {}
    for c in maps.connections(kind=s.CT4_SVC):
        if c.expires_ns <= now_ns or c.flags & (s.CT4_F_SOCK_MASQ | s.CT4_F_DONE):
            continue
        # masqueraded: from the masquerade address:port; remapped (CT4_S_REMAP): the client's
        # address with another port (snat_addr is the client's then)
        translated = bool(c.flags & s.CT4_F_MASQ or c.state & s.CT4_S_REMAP)
        conn = NatConnection(
            proto=c.proto, client=c.saddr, client_port=c.sport, frontend=c.daddr, frontend_port=c.dport,
            backend=c.nat_addr, backend_port=c.nat_port,
            source=c.snat_addr if translated else c.saddr, source_port=c.snat_port if translated else c.sport,
            timeout=max(1, (c.expires_ns - now_ns) // NSEC),
            tcp_state=_tcp_state(c), seen_reply=bool(c.flags & s.CT4_F_SEEN_REPLY),
            assured=bool(c.state & s.CT4_S_ASSURED))
        seen_by_backend = (conn.proto, conn.backend, conn.backend_port, conn.source, conn.source_port)
        other = best.get(seen_by_backend)
        if other is None or _preferred(c, other[0]):
            best[seen_by_backend] = (c, conn)
    return [conn for _, conn in best.values()]


def _preferred(a: Connection, b: Connection) -> bool:
    """Whether connection `a` rather than `b` should keep a tuple both hold: the one not closing,
    else the one that lives longer."""
    a_closing, b_closing = bool(a.flags & s.CT4_F_CLOSING), bool(b.flags & s.CT4_F_CLOSING)
    return (not a_closing, a.expires_ns) > (not b_closing, b.expires_ns)


def _tcp_state(c: Connection) -> int:
    """nf_conntrack's state for one of our TCP connections: what the kernel must believe for the
    packets still to come to pass its state machine (a SYN-ACK is invalid in ESTABLISHED)."""
    if c.proto != socket.IPPROTO_TCP:
        return TCP_ESTABLISHED
    if not c.flags & s.CT4_F_CLOSING:
        return TCP_ESTABLISHED if c.flags & s.CT4_F_SEEN_REPLY else TCP_SYN_SENT
    if c.flags & s.CT4_F_DONE:
        return TCP_CLOSE
    if c.flags & s.CT4_F_FIN_ORIG and c.flags & s.CT4_F_FIN_REPLY:
        return TCP_TIME_WAIT
    return TCP_CLOSE_WAIT if c.flags & s.CT4_F_FIN_ORIG else TCP_FIN_WAIT


def _closing_flags(conn: NatConnection) -> int:
    """The CT4_F_* close tracking of a connection the kernel has in `conn.tcp_state` (the
    direction of a lone FIN is nf_conntrack's to know, not ours: the client's is assumed)."""
    if not conn.closing:
        return 0
    if conn.tcp_state == TCP_CLOSE:
        return s.CT4_F_CLOSING | s.CT4_F_DONE
    if conn.tcp_state in (TCP_TIME_WAIT, TCP_LAST_ACK):
        return s.CT4_F_CLOSING | s.CT4_F_FIN_ORIG | s.CT4_F_FIN_REPLY
    return s.CT4_F_CLOSING | s.CT4_F_FIN_ORIG


def forget(maps: Maps, conn: NatConnection) -> None:
    """Delete our entries of `conn`: the connection first, so that no packet finds a half
    without its owner (they would be ignored anyway, see maps._half_is_live). The client's halves
    (reply, and SNAT when masqueraded) are keyed by the port it leaves with: the client's own, or
    for a remapped connection (CT4_S_REMAP) the remapped or masquerade port (bpf/lib/ct4.h:
    ct4_forget). Both are looked at, whether or not the connection's entry is still there, and a
    half is deleted only if it is this connection's: another connection of the client's port may
    hold the other key."""
    svc_key = ct_key(conn.client, conn.frontend, conn.client_port, conn.frontend_port, conn.proto, s.CT4_SVC)
    wire_ports = {conn.client_port, conn.source_port}
    halves = [ct_key(conn.backend, conn.client, conn.backend_port, w, conn.proto, s.CT4_REV_DNAT) for w in wire_ports]
    if conn.masqueraded:
        halves += [ct_key(conn.client, conn.backend, w, conn.backend_port, conn.proto, s.CT4_SNAT) for w in wire_ports]
        halves.append(ct_key(conn.backend, conn.source, conn.backend_port, conn.source_port, conn.proto,
                             s.CT4_REV_SNAT))
    owner = (svc_key.saddr, svc_key.daddr, svc_key.sport, svc_key.dport, svc_key.proto)
    ours = [key for key in halves if (half := maps.connection_entry(key)) is not None and half_owner(key, half) == owner]
    for key in (svc_key, *ours):
        maps.delete_connection_entry(key)


def _frontend_of(maps: Maps, conn: NatConnection, node_addrs: set[str]) -> Frontend | None:
    exact = Frontend(conn.frontend, conn.frontend_port, conn.proto)
    if maps.service(exact) is not None:
        return exact
    nodeport = Frontend(None, conn.frontend_port, conn.proto)
    if conn.frontend in node_addrs and maps.service(nodeport) is not None:
        return nodeport
    return None


def backend_ids(maps: Maps) -> dict[tuple[str, int], int]:
    """(address, port) -> backend id, for `adopt` (one read of epx_backend for a whole takeover)."""
    return {(be.addr, be.port): backend_id for backend_id, be in maps.backends().items()}


def hold(maps: Maps, conn: NatConnection, held: bool = True) -> bool:
    """Set (or clear) CT4_S_HELD on `conn`: while held, its packets are dropped (see common.h),
    for the moment both the kernel and epx_ct4 know the connection. False when it is not here."""
    key = ct_key(conn.client, conn.frontend, conn.client_port, conn.frontend_port, conn.proto, s.CT4_SVC)
    entry = maps.connection_entry(key)
    if entry is None:
        return False
    entry.state = (entry.state | s.CT4_S_HELD) if held else (entry.state & ~s.CT4_S_HELD)
    maps.put_connection_entry(key, entry)
    return True


def _step_aside(maps: Maps, rev_key: s.CT4Key, now_ns: int) -> bool:
    """Move the live connection whose reply half is at `rev_key` (backend -> client:port) to its
    masquerade port, as ct4_create lays out a masqueraded connection whose client port clashes
    (CT4_S_REMAP): for an unmasqueraded connection of that client port, which the backend knows by
    it, adopted after the masqueraded one (a handshake still under way when the masquerade was
    taken over). Only a masqueraded, not yet remapped connection can; False when the holder
    cannot or its masquerade port is held too. The new halves go first, the connection entry
    after them, the old SNAT half last (the old reply half is the caller's to overwrite)."""
    holder = live_owner(maps, rev_key, now_ns)
    if holder is None:
        return False
    half, owner_key, owner = holder
    if not owner.flags & s.CT4_F_MASQ or owner.flags & s.CT4_F_SOCK_MASQ or owner.state & s.CT4_S_REMAP:
        return False
    moved_rev_key = _copy(rev_key, dport=owner.snat_port)
    if half_is_held(maps, moved_rev_key, now_ns):
        return False
    snat_key = _copy(rev_key, saddr=rev_key.daddr, daddr=rev_key.saddr, sport=rev_key.dport, dport=rev_key.sport,
                     kind=s.CT4_SNAT)
    rev_snat_key = _copy(rev_key, daddr=owner.snat_addr, dport=owner.snat_port, kind=s.CT4_REV_SNAT)
    snat, rev_snat = maps.connection_entry(snat_key), maps.connection_entry(rev_snat_key)
    if snat is None or rev_snat is None:
        return False
    for moved in (half, snat):  # keyed by the masquerade port, keeping the client's own
        moved.state |= s.CT4_S_REMAP
        moved.snat_port = rev_key.dport
    rev_snat.state |= s.CT4_S_REMAP  # the reply goes on to the masquerade port
    maps.put_connection_entry(moved_rev_key, half)
    maps.put_connection_entry(_copy(snat_key, sport=owner.snat_port), snat)
    maps.put_connection_entry(rev_snat_key, rev_snat)
    owner.state |= s.CT4_S_REMAP
    maps.put_connection_entry(owner_key, owner)
    maps.delete_connection_entry(snat_key)
    return True


def _other_holder(maps: Maps, key: s.CT4Key, me: s.CT4Key, now_ns: int) -> s.CT4Entry | None:
    """The entry of the live connection other than `me` (a CT4_SVC key) whose half is at `key`."""
    holder = live_owner(maps, key, now_ns)
    return holder[2] if holder is not None and bytes(holder[1]) != bytes(me) else None


def _copy(key: s.CT4Key, **fields: int) -> s.CT4Key:
    out = s.CT4Key.from_buffer_copy(key)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def adopt(maps: Maps, conn: NatConnection, backends: dict[tuple[str, int], int], node_addrs: set[str],
          now_ns: int, held: bool = False) -> str | None:
    """Write the epx_ct4 entries of a connection the kernel translated (`held`: CT4_S_HELD, until
    the caller has deleted the kernel's entry); returns why it cannot be (None: adopted). It
    cannot when its frontend or backend is not programmed here (a Service deleted meanwhile).
    One netfilter's NAT gave another source port only (a clash: the client's port toward that
    backend was another connection's) is written as ct4_create writes such a connection:
    CT4_S_REMAP, not masqueraded, its reply half keyed by that port; so is a masqueraded one whose
    client port toward the backend another connection holds (keyed by its masquerade port), and a
    masqueraded holder steps aside so for an unmasqueraded one adopted after it (_step_aside). It
    cannot either when a key it needs is another live connection's: nothing is overwritten."""
    if _frontend_of(maps, conn, node_addrs) is None:
        return f"frontend {conn.frontend}:{conn.frontend_port} is not a service here"
    backend_id = backends.get((conn.backend, conn.backend_port))
    if backend_id is None:
        return f"backend {conn.backend}:{conn.backend_port} is not programmed here"
    flags = (s.CT4_F_SEEN_REPLY if conn.seen_reply else 0) | _closing_flags(conn)
    entry = s.CT4Entry(expires=now_ns + conn.timeout * NSEC, nat_addr=be32(conn.backend),
                       nat_port=be16(conn.backend_port), svc_addr=be32(conn.frontend),
                       svc_port=be16(conn.frontend_port), backend_id=backend_id, flags=flags,
                       state=(s.CT4_S_ASSURED if conn.assured else 0) | (s.CT4_S_HELD if held else 0))

    def half(nat_addr: str, nat_port: int) -> s.CT4Entry:
        return s.CT4Entry(nat_addr=be32(nat_addr), nat_port=be16(nat_port), svc_addr=be32(conn.frontend),
                          svc_port=be16(conn.frontend_port))

    p, client, backend, source = conn.proto, conn.client, conn.backend, conn.source
    cport, bport, sport = conn.client_port, conn.backend_port, conn.source_port
    rev_dnat = half(conn.frontend, conn.frontend_port)
    wire_port = cport
    # The client's own port toward the backend held by another live connection (adopt_connections
    # takes the unmasqueraded first): a masqueraded one leaves with its masquerade port from DNAT
    # on, as ct4_create makes it; netfilter's remap is one already.
    svc_key = ct_key(client, conn.frontend, cport, conn.frontend_port, p, s.CT4_SVC)

    def taken(port: int) -> bool:
        """Whether another live connection's reply half is keyed by the client and `port`."""
        return _other_holder(maps, ct_key(backend, client, bport, port, p, s.CT4_REV_DNAT), svc_key, now_ns) is not None

    clash = not conn.port_remapped and taken(cport)  # read once: both branches below ask it
    remap = conn.port_remapped or (conn.masqueraded and clash)
    if remap:
        wire_port = sport
        if taken(sport):
            return f"its tuple toward {backend}:{bport} is another connection's, from port {cport} and {sport}"
        entry.state |= s.CT4_S_REMAP
        rev_dnat.state, rev_dnat.snat_port = s.CT4_S_REMAP, be16(cport)  # the reply's destination port
    elif clash and not _step_aside(maps, ct_key(backend, client, bport, cport, p, s.CT4_REV_DNAT), now_ns):
        return f"its tuple toward {backend}:{bport} is another connection's, from port {cport}"
    # another live connection's masquerade port, unless closing (the kernel lets a new connection
    # have it; so does the programs' allocator once it is over, bpf/lib/ct4.h: ct4_snat_port_use)
    port_holder = _other_holder(maps, ct_key(backend, source, bport, sport, p, s.CT4_REV_SNAT), svc_key, now_ns) \
        if conn.masqueraded else None
    if port_holder is not None and not port_holder.flags & s.CT4_F_CLOSING:
        return f"its masquerade port {source}:{sport} toward {backend}:{bport} is another connection's"
    if conn.port_remapped:
        entry.snat_addr, entry.snat_port = be32(client), be16(sport)
    elif conn.masqueraded:
        entry.flags |= s.CT4_F_MASQ
        entry.snat_addr, entry.snat_port = be32(source), be16(sport)
        rev_snat, snat = half(client, cport), half(source, sport)
        if remap:  # the reply goes on to the masquerade port; the SNAT half keeps the client's own port
            rev_snat.state = s.CT4_S_REMAP
            snat.state, snat.snat_port = s.CT4_S_REMAP, be16(cport)
        maps.put_connection_entry(ct_key(backend, source, bport, sport, p, s.CT4_REV_SNAT), rev_snat)
        maps.put_connection_entry(ct_key(client, backend, wire_port, bport, p, s.CT4_SNAT), snat)
    maps.put_connection_entry(ct_key(backend, client, bport, wire_port, p, s.CT4_REV_DNAT), rev_dnat)
    # the connection last, as ct4_create writes it: no packet finds it before its halves
    maps.put_connection_entry(svc_key, entry)
    return None
