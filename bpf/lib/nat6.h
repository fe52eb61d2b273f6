/* IPv6 address translation (nat4.h's counterpart): the in-place rewrite with its checksum
 * fix-up, and the three translations that follow a connection's entries in epx_ct6 (masquerade,
 * undoing masquerade, undoing DNAT). Each returns 0 when it does not apply, its EPX_* reason when
 * it translated, or a drop reason. Each takes a trace record (trace.h): NULL for a live packet; with
 * one, the same translation of the packet (BPF_PROG_TEST_RUN's copy), recorded, and no entry
 * touched or removed.
 *
 * Checksums: IPv6 has no header checksum; the addresses are covered by the TCP/UDP checksum's
 * pseudo-header. A 16-byte address is too wide for bpf_l4_csum_replace's 2/4-byte forms, so the
 * difference of the two addresses is computed with bpf_csum_diff and applied as a diff (size 0)
 * with BPF_F_PSEUDO_HDR, which also keeps a CHECKSUM_PARTIAL skb right (see csum.h).
 * SCTP has no pseudo-header: an address leaves its CRC32c alone; a port changes it, which
 * nat4_sctp_finish updates once per run, for IPv6 as for IPv4 (nat6_sctp_begin, sctp.h).
 * (IPv6 fragments are not translated at all, pkt6.h: EPX_PASS_IPV6_FRAG.)
 */
#ifndef EPX_NAT6_H
#define EPX_NAT6_H

#include "lib/csum.h"
#include "lib/ct6.h"
#include "lib/trace.h"

/* Write `new` over the IPv6 address at `addr_off` (now `old`) and fix the checksum at `csum_off`
 * whose pseudo-header covers it (TCP, UDP: `flags` BPF_F_MARK_MANGLED_0; ICMPv6: 0). Returns 0 or
 * -1. Shared by the packet path and the ICMPv6 error path (icmp6_err.h: its outer header). */
static __always_inline int nat6_store_addr(struct __sk_buff *skb, __u32 addr_off, __u32 csum_off,
					   const struct epx_in6 *old, const struct epx_in6 *new, __u64 flags)
{
	__s64 diff = bpf_csum_diff((__be32 *)old->w, sizeof(*old), (__be32 *)new->w, sizeof(*new), 0);

	if (diff < 0 || bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | flags))
		return -1;
	return bpf_skb_store_bytes(skb, addr_off, (void *)new, sizeof(*new), 0) ? -1 : 0;
}

/* Rewrite one side (NAT4_SRC / NAT4_DST) of `p` to addr:port. Returns 0, or EPX_DROP_NAT_FAILED
 * when a helper failed (the packet may be half-written). */
static __always_inline __u32 nat6_rewrite(struct __sk_buff *skb, struct pkt6 *p, int side, const struct epx_in6 *addr,
					  __be16 port)
{
	struct epx_in6 old_addr = side == NAT4_SRC ? p->saddr : p->daddr;
	__be16 old_port = side == NAT4_SRC ? p->sport : p->dport;
	__u32 addr_off = ETH_HLEN + (side == NAT4_SRC ? offsetof(struct ipv6hdr, saddr) : offsetof(struct ipv6hdr, daddr));
	__u32 port_off = p->l4_off + (side == NAT4_SRC ? offsetof(struct udphdr, source) : offsetof(struct udphdr, dest));
	__u32 csum_off = p->l4_off + csum_l4_offset(p->proto);
	__u64 mangled0 = csum_l4_flags(p->proto);
	struct epx_in6 new_addr = *addr;

	if (p->proto == IPPROTO_SCTP) {
		if (!in6_eq(&old_addr, &new_addr) && bpf_skb_store_bytes(skb, addr_off, (void *)&new_addr, sizeof(new_addr), 0))
			return EPX_DROP_NAT_FAILED;
		/* RECOMPUTE_CSUM: no checksum field compensates in a CHECKSUM_COMPLETE sum */
		if (old_port != port && bpf_skb_store_bytes(skb, port_off, &port, sizeof(port), BPF_F_RECOMPUTE_CSUM))
			return EPX_DROP_NAT_FAILED;
	} else if (!in6_eq(&old_addr, &new_addr) &&
		   nat6_store_addr(skb, addr_off, csum_off, &old_addr, &new_addr, mangled0)) {
		return EPX_DROP_NAT_FAILED;
	}
	if (p->proto != IPPROTO_SCTP && old_port != port) {
		if (bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled0 | sizeof(port)))
			return EPX_DROP_NAT_FAILED;
		if (bpf_skb_store_bytes(skb, port_off, &port, sizeof(port), 0))
			return EPX_DROP_NAT_FAILED;
	}
	if (side == NAT4_SRC) {
		p->saddr = new_addr;
		p->sport = port;
	} else {
		p->daddr = new_addr;
		p->dport = port;
	}
	return 0;
}

/* After parsing an IPv6 frame (nat4_sctp_begin's twin): an SCTP packet's ports and where its
 * header starts, for nat4_sctp_finish; for any other frame, no offset, so that finish leaves it
 * alone whatever an earlier program left in the skb's scratch words. */
static __always_inline void nat6_sctp_begin(struct __sk_buff *skb, const struct pkt6 *p)
{
	skb->cb[NAT6_SCTP_OFF_CB] = p->proto == IPPROTO_SCTP ? p->l4_off : 0;
	if (p->proto == IPPROTO_SCTP)
		skb->cb[NAT4_SCTP_PORTS_CB] = sctp4_ports_word(p->sport, p->dport);
}

/* ---- which halves count (nat4.h's *_owns): shared by the packet path here and the ICMPv6 error
 * path (icmp6_err.h), so that an error is translated exactly when its reply would be ---- */

/* Whether `owner` (the live CT4_SVC entry) still owns the CT4_SNAT half `half` found at `key`
 * (nat4_snat_owns). */
static __always_inline int nat6_snat_owns(const struct ct6_entry *owner, const struct ct6_entry *half,
					  const struct ct6_key *key)
{
	return owner && (owner->flags & CT4_F_MASQ) && in6_eq(&owner->nat_addr, &key->daddr) &&
	       owner->nat_port == key->dport && owner->snat_port == half->nat_port &&
	       ct6_wire_port(owner, ct6_snat_cport(half, key)) == key->sport;
}

/* Whether `owner` still owns the CT4_REV_SNAT half at `key` (backend -> masquerade addr:port). */
static __always_inline int nat6_rev_snat_owns(const struct ct6_entry *owner, const struct ct6_key *key)
{
	/* masqueraded: a remapped connection's (CT4_S_REMAP) snat_port is no masquerade port */
	return owner && (owner->flags & CT4_F_MASQ) && owner->snat_port == key->dport &&
	       in6_eq(&owner->nat_addr, &key->saddr) && owner->nat_port == key->sport;
}

/* Egress toward the backend: masquerade a masqueraded connection's forward packets (nat4_snat). */
static __always_inline __u32 nat6_snat(struct __sk_buff *skb, struct scratch6 *s, struct pkt6 *p, __u64 now,
					struct epx_trace_rec *tr)
{
	struct ct6_entry *half, *owner;
	struct epx_in6 addr;
	__be16 port;
	__u32 reason;

	s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_SNAT);
	half = epx_lookup(epx_ct6, &s->key);
	if (!half)
		return 0;
	owner = ct6_owner(s, &p->saddr, ct6_snat_cport(half, &s->key), half, p->proto, now, tr != NULL);
	if (!nat6_snat_owns(owner, half, &s->key)) {
		if (!tr)
			epx_delete(epx_ct6, &s->key); /* left behind by an earlier connection */
		return 0;
	}
	if (ct_syn_of_another(p->proto, p->tcp_flags, owner->flags)) {
		if (!tr)
			ct6_forget_closed(s, &s->owner, owner); /* ct6_owner left its key in s->owner */
		return 0;
	}
	addr = half->nat_addr;
	port = half->nat_port;
	trace_snat6(tr, &addr, port);
	reason = nat6_rewrite(skb, p, NAT4_SRC, &addr, port);
	return reason ? reason : EPX_SNAT;
}

/* Whether daddr:dport may be this node's IPv6 masquerade address and port (CT4_REV_SNAT keys). */
static __always_inline int nat6_is_masq_dest(const struct lb4_config *cfg, const struct lb6_config *cfg6,
					     const struct epx_in6 *daddr, __be16 dport)
{
	__u16 port = epx_ntohs(dport);

	return cfg6 && !in6_is_zero(&cfg6->snat_addr) && in6_eq(daddr, &cfg6->snat_addr) &&
	       port >= cfg->snat_port_min && port <= cfg->snat_port_max;
}

/* Ingress from the backend: a reply to a masqueraded connection goes back to the real client. */
static __always_inline __u32 nat6_rev_snat(struct __sk_buff *skb, struct scratch6 *s, struct pkt6 *p,
					   const struct lb4_config *cfg, __u64 now, struct epx_trace_rec *tr)
{
	struct ct6_entry *half, *owner;
	struct epx_in6 addr;
	__be16 port;
	__u32 reason;

	if (!nat6_is_masq_dest(cfg, p->cfg6, &p->daddr, p->dport))
		return 0;
	s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_REV_SNAT);
	half = epx_lookup(epx_ct6, &s->key);
	if (!half)
		return 0;
	addr = half->nat_addr;
	port = ct6_rev_snat_port(half, &s->key); /* remapped: the masquerade port (nat4_rev_snat) */
	owner = ct6_owner(s, &addr, half->nat_port, half, p->proto, now, tr != NULL);
	if (!nat6_rev_snat_owns(owner, &s->key))
		return 0; /* stale: left for the port allocator to reclaim */
	reason = nat6_rewrite(skb, p, NAT4_DST, &addr, port);
	return reason ? reason : EPX_REV_SNAT;
}

/* Egress toward the client: a reply leaves with the frontend it was sent to as its source. */
static __always_inline __u32 nat6_rev_dnat(struct __sk_buff *skb, struct scratch6 *s, struct pkt6 *p,
					   const struct lb4_config *cfg, __u64 now, struct epx_trace_rec *tr)
{
	struct ct6_entry *half, *owner;
	struct epx_in6 addr;
	__be16 port, cport;
	__u32 reason;

	s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_REV_DNAT);
	half = epx_lookup(epx_ct6, &s->key);
	if (!half)
		return 0;
	cport = ct6_rev_dnat_cport(half, &s->key);
	owner = ct6_owner(s, &p->daddr, cport, half, p->proto, now, tr != NULL);
	if (!ct6_rev_dnat_owns(owner, &s->key, cport)) {
		if (!tr)
			epx_delete(epx_ct6, &s->key);
		return 0;
	}
	if (ct_syn_of_another(p->proto, p->tcp_flags, owner->flags)) {
		if (!tr)
			ct6_forget_closed(s, &s->owner, owner); /* ct6_owner left its key in s->owner */
		return 0;
	}
	if (!tr)
		ct6_touch(owner, cfg, p, 1, now);
	addr = half->nat_addr;
	port = half->nat_port;
	reason = nat6_rewrite(skb, p, NAT4_SRC, &addr, port);
	if (!reason && cport != p->dport) {
		addr = p->daddr; /* a remapped connection (CT4_S_REMAP): the client's own port back */
		reason = nat6_rewrite(skb, p, NAT4_DST, &addr, cport);
	}
	return reason ? reason : EPX_REV_DNAT;
}

#endif /* EPX_NAT6_H */
