/* Address translation: the in-place rewrite (checksums included), and the three translations
 * that follow a connection's CT entries (masquerade, and undoing masquerade and DNAT on replies).
 * Each returns 0 when it does not apply, its EPX_* reason when it translated, or a drop reason.
 * With a trace record (`tr`, trace.h) they translate the packet alike but change no entry. */
#ifndef EPX_NAT4_H
#define EPX_NAT4_H

#include "lib/csum.h"
#include "lib/ct4.h"
#include "lib/sock4.h"
#include "lib/trace.h"

#define NAT4_SRC 0
#define NAT4_DST 1

/* Rewrite one side of `p` to addr:port. Later fragments carry no L4 header: only the address
 * (and the IP checksum) changes; their L4 checksum was fixed in the first fragment. SCTP has no
 * pseudo-header: an address leaves its CRC32c alone; a port changes it, which nat4_sctp_finish
 * updates once for the packet's every rewrite.
 * Returns 0, or EPX_DROP_NAT_FAILED when a helper failed (the packet may be half-written), or
 * EPX_DROP_SCTP_FRAG for an SCTP first fragment whose port must change (sctp.h). */
static __always_inline __u32 nat4_rewrite(struct __sk_buff *skb, struct pkt4 *p, int side, __be32 addr, __be16 port)
{
	__be32 old_addr = side == NAT4_SRC ? p->saddr : p->daddr;
	__be16 old_port = side == NAT4_SRC ? p->sport : p->dport;
	__u32 addr_off = ETH_HLEN + (side == NAT4_SRC ? offsetof(struct iphdr, saddr) : offsetof(struct iphdr, daddr));
	/* the port fields sit at the same offsets in TCP, UDP and SCTP headers */
	__u32 port_off = p->l4_off + (side == NAT4_SRC ? offsetof(struct udphdr, source) : offsetof(struct udphdr, dest));
	__u32 csum_off = p->l4_off + csum_l4_offset(p->proto);
	__u64 mangled0 = csum_l4_flags(p->proto);

	if (p->proto == IPPROTO_SCTP) {
		if (p->frag != EPX_FRAG_LATER && old_port != port) {
			if (p->frag == EPX_FRAG_FIRST)
				return EPX_DROP_SCTP_FRAG;
			/* RECOMPUTE_CSUM: no checksum field compensates in a CHECKSUM_COMPLETE sum */
			if (bpf_skb_store_bytes(skb, port_off, &port, sizeof(port), BPF_F_RECOMPUTE_CSUM))
				return EPX_DROP_NAT_FAILED;
		}
	} else if (p->frag != EPX_FRAG_LATER) {
		if (old_addr != addr &&
		    bpf_l4_csum_replace(skb, csum_off, old_addr, addr, BPF_F_PSEUDO_HDR | mangled0 | sizeof(addr)))
			return EPX_DROP_NAT_FAILED;
		if (old_port != port) {
			if (bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled0 | sizeof(port)))
				return EPX_DROP_NAT_FAILED;
			if (bpf_skb_store_bytes(skb, port_off, &port, sizeof(port), 0))
				return EPX_DROP_NAT_FAILED;
		}
	}
	if (old_addr != addr) {
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), old_addr, addr, sizeof(addr)))
			return EPX_DROP_NAT_FAILED;
		if (bpf_skb_store_bytes(skb, addr_off, &addr, sizeof(addr), 0))
			return EPX_DROP_NAT_FAILED;
	}
	if (side == NAT4_SRC) {
		p->saddr = addr;
		p->sport = port;
	} else {
		p->daddr = addr;
		p->dport = port;
	}
	return 0;
}

/* SCTP: a TC program's translations change a packet's ports at most once per side, and its
 * CRC32c is updated once for all of them, when the program is done (nat4_sctp_finish, from
 * tc_lb.c's entries), from the ports as parsed. Those wait in the skb's scratch words (cb[],
 * of which the trace signal uses cb[0] and cb[1]) rather than on the stack: kept there across
 * the whole program, they overflowed tc_ingress's 512-byte stack. */
#define NAT4_SCTP_PORTS_CB 2
#define NAT6_SCTP_OFF_CB 3 /* IPv6: where the SCTP header starts, 0 if the packet is not SCTP (nat6.h) */

/* After parsing: remember an SCTP packet's ports. */
static __always_inline void nat4_sctp_begin(struct __sk_buff *skb, const struct pkt4 *p)
{
	if (p->proto == IPPROTO_SCTP)
		skb->cb[NAT4_SCTP_PORTS_CB] = sctp4_ports_word(p->sport, p->dport);
}

/* After the translations of a packet the program lets through, IPv4 or IPv6: its CRC32c for the
 * ports they changed. Only an SCTP packet that nat4_sctp_begin or nat6_sctp_begin saw can have
 * changed ports: any other packet is left alone by sctp_crc_update. Returns 0 or -1. */
static __always_inline int nat4_sctp_finish(struct __sk_buff *skb)
{
	return sctp_crc_update(skb, skb->cb[NAT4_SCTP_PORTS_CB], skb->cb[NAT6_SCTP_OFF_CB]);
}

/* ---- which halves count: shared by the packet path here and the ICMP error path (icmp4_err.h),
 * so that an error is translated by exactly the entries its connection's packets are ---- */

/* Whether `owner` (the live CT4_SVC entry) still owns the CT4_SNAT half `half` found at `key`:
 * masqueraded to the same backend and port, leaving with the port the key has (CT4_S_REMAP). */
static __always_inline int nat4_snat_owns(const struct ct4_entry *owner, const struct ct4_entry *half,
					  const struct ct4_key *key)
{
	return owner && (owner->flags & CT4_F_MASQ) && owner->nat_addr == key->daddr && owner->nat_port == key->dport &&
	       owner->snat_port == half->nat_port && ct4_wire_port(owner, ct4_snat_cport(half, key)) == key->sport;
}

/* Whether daddr:dport may be a masquerade address and port of this node (CT4_REV_SNAT's keys). */
static __always_inline int nat4_is_masq_dest(const struct lb4_config *cfg, __be32 daddr, __be16 dport)
{
	__u16 port = epx_ntohs(dport);

	return cfg->snat_addr && daddr == cfg->snat_addr &&
	       ((port >= cfg->snat_port_min && port <= cfg->snat_port_max) || (cfg->flags & CFG_F_ADOPTED_MASQ));
}

/* Whether `owner` still owns the CT4_REV_SNAT half at `key` (backend -> masquerade addr:port). */
static __always_inline int nat4_rev_snat_owns(const struct ct4_entry *owner, const struct ct4_key *key)
{
	/* masqueraded: a remapped connection's (CT4_S_REMAP) snat_port is no masquerade port */
	return owner && (owner->flags & CT4_F_MASQ) && owner->snat_port == key->dport && owner->nat_addr == key->saddr &&
	       owner->nat_port == key->sport;
}

/* Egress toward the backend: masquerade a masqueraded connection's forward packets. */
static __always_inline __u32 nat4_snat(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg, __u64 now,
					struct epx_trace_rec *tr)
{
	struct ct4_key key = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_SNAT);
	struct ct4_entry *half = epx_lookup(epx_ct4, &key), *owner;
	__u32 reason;

	if (!half)
		return 0;
	owner = ct4_owner(p->saddr, ct4_snat_cport(half, &key), half, p->proto, now, tr != NULL);
	if (!nat4_snat_owns(owner, half, &key)) {
		if (!tr)
			epx_delete(epx_ct4, &key); /* left behind by an earlier connection */
		return 0;
	}
	if (ct_syn_of_another(p->proto, p->tcp_flags, owner->flags)) {
		if (!tr) {
			key = ct4_key_make(p->saddr, half->svc_addr, ct4_snat_cport(half, &key), half->svc_port, p->proto,
					   CT4_SVC);
			ct4_forget_closed(&key, owner);
		}
		return 0;
	}
	if (tr) {
		tr->flags |= EPX_TRACE_F_SNAT;
		tr->snat_addr = half->nat_addr;
		tr->snat_port = half->nat_port;
	} else if (owner->flags & CT4_F_SOCK_MASQ)
		ct4_touch(owner, cfg, p, 0, now);
	reason = nat4_rewrite(skb, p, NAT4_SRC, half->nat_addr, half->nat_port);
	return reason ? reason : EPX_SNAT;
}

/* Ingress from the backend: a reply to a masqueraded connection goes back to the real client. */
static __always_inline __u32 nat4_rev_snat(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg,
					   __u64 now, struct epx_trace_rec *tr)
{
	struct ct4_key key;
	struct ct4_entry *half, *owner;
	__u32 reason;

	if (!nat4_is_masq_dest(cfg, p->daddr, p->dport))
		return 0;
	key = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_REV_SNAT);
	half = epx_lookup(epx_ct4, &key);
	if (!half)
		return 0;
	owner = ct4_owner(half->nat_addr, half->nat_port, half, p->proto, now, tr != NULL);
	if (!nat4_rev_snat_owns(owner, &key))
		return 0; /* stale: left for the port allocator to reclaim */
	if (!tr && (owner->flags & CT4_F_SOCK_MASQ))
		ct4_touch(owner, cfg, p, 1, now);
	/* a remapped connection's client port toward the backend is the masquerade port: its reply
	 * half (egress) is keyed by it */
	reason = nat4_rewrite(skb, p, NAT4_DST, half->nat_addr, ct4_rev_snat_port(half, &key));
	return reason ? reason : EPX_REV_SNAT;
}

/* Egress toward the client: a reply leaves with the frontend it was sent to as its source (and
 * a remapped connection's, CT4_S_REMAP, with the client's own port as its destination). */
static __always_inline __u32 nat4_rev_dnat(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg,
					   __u64 now, struct epx_trace_rec *tr)
{
	struct ct4_key key = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_REV_DNAT);
	struct ct4_entry *half = epx_lookup(epx_ct4, &key), *owner;
	__be16 cport;
	__u32 reason;

	if (!half)
		return 0;
	cport = ct4_rev_dnat_cport(half, &key);
	owner = ct4_owner(p->daddr, cport, half, p->proto, now, tr != NULL);
	if (!ct4_rev_dnat_owns(owner, &key, cport)) {
		if (!tr)
			epx_delete(epx_ct4, &key);
		return 0;
	}
	if (ct_syn_of_another(p->proto, p->tcp_flags, owner->flags)) {
		if (!tr) {
			key = ct4_key_make(p->daddr, half->svc_addr, cport, half->svc_port, p->proto, CT4_SVC);
			ct4_forget_closed(&key, owner);
		}
		return 0;
	}
	if (!tr)
		ct4_touch(owner, cfg, p, 1, now);
	reason = nat4_rewrite(skb, p, NAT4_SRC, half->nat_addr, half->nat_port);
	if (!reason && cport != p->dport)
		reason = nat4_rewrite(skb, p, NAT4_DST, p->daddr, cport);
	return reason ? reason : EPX_REV_DNAT;
}

/* Egress: the first packet of a node socket bound to 127.0.0.0/8 that the socket LB sent to a
 * backend (a localhost NodePort, rule 8), or bound to another address of the node than the
 * masquerade address (an LB IP the node holds) where kube-proxy masquerades. kube-proxy
 * masquerades it in POSTROUTING; here the
 * connection is recorded as masqueraded toward the backend it already addresses (the "frontend"
 * of its CT entries is the backend itself: nothing was DNATed on the wire), so that later
 * packets take nat4_snat and the replies nat4_rev_snat, and are delivered to 127.0.0.1 again.
 * Only sockets the socket LB remembered in epx_sock_rev for this backend qualify: such a source
 * leaving the node for any other reason is not ours to touch. (A UDP socket's entry, there for
 * recvmsg4, leaves with the masquerade address unless bound elsewhere: nothing to do then.)
 * Returns 0 when it does not apply, EPX_SNAT, or a drop reason. */
static __always_inline __u32 nat4_masq_local(struct __sk_buff *skb, struct pkt4 *p, const struct lb4_config *cfg,
					     __u64 now, struct epx_trace_rec *tr)
{
	struct sock4_rev_key skey = { .addr = p->daddr, .port = p->dport };
	struct sock4_rev *rev;
	__u32 reason;

	if (tr || p->saddr == cfg->snat_addr || p->frag == EPX_FRAG_LATER)
		return 0; /* a trace run has no socket (and would have to write the connection) */
	skey.cookie = epx_get_socket_cookie(skb);
	if (!skey.cookie)
		return 0;
	rev = epx_lookup(epx_sock_rev, &skey);
	if (!rev || !(rev->flags & SOCK4_F_MASQ))
		return 0;
	reason = ct4_create(p, cfg, now, 0, p->daddr, p->dport, CT4_F_MASQ | CT4_F_SOCK_MASQ);
	if (reason)
		return reason;
	reason = nat4_snat(skb, p, cfg, now, NULL);
	return reason ? reason : EPX_DROP_CT_FAILED; /* the entries just written must be found */
}

#endif /* EPX_NAT4_H */
