/* Connection tracking for IPv6: ct4.h's table (see its header comment), kept in epx_ct6.
 *
 * The same four kinds of entries (CT4_SVC and its halves CT4_REV_DNAT, CT4_SNAT, CT4_REV_SNAT),
 * the same owner rule (a half is honoured only while its CT4_SVC owner lives and points at it),
 * the same TCP close tracking and lifetimes: ct4_tcp_state and ct4_lifetime_ns are family-free
 * and used as they are, with the shared epx_config's timeouts. The masquerade port comes from
 * epx_config's range, toward lb6_config's address (epx_config6).
 *
 * Not for IPv6 (yet): the early-drop queue (a full table refuses the new connection with
 * EPX_DROP_CT_FULL), the mode-switch handover (CT4_S_HELD, CFG_F_NETFILTER_*), fragments.
 */
#ifndef EPX_CT6_H
#define EPX_CT6_H

#include "lib/pkt6.h"
#include "lib/ct4.h"

static __always_inline struct ct6_key ct6_key_make(const struct epx_in6 *saddr, const struct epx_in6 *daddr,
						   __be16 sport, __be16 dport, __u8 proto, __u8 kind)
{
	struct ct6_key key = {
		.saddr = *saddr, .daddr = *daddr, .sport = sport, .dport = dport, .proto = proto, .kind = kind,
	};
	return key;
}

/* Account one packet of the connection (ct4_touch's IPv6 twin). */
static __always_inline void ct6_touch(struct ct6_entry *e, const struct lb4_config *cfg, const struct pkt6 *p,
				      int reply, __u64 now)
{
	__u8 flags = e->flags;

	if (reply)
		flags |= CT4_F_SEEN_REPLY;
	/* SCTP's flags are only ever SYN or RST (pkt4_sctp_flags), as in ct4_touch */
	if (p->proto == IPPROTO_TCP || p->proto == IPPROTO_SCTP)
		flags = ct4_tcp_state(flags, p->tcp_flags, reply);
	if (flags != e->flags)
		e->flags = flags;
	if (!reply && (flags & CT4_F_SEEN_REPLY) && !(e->state & CT4_S_ASSURED))
		e->state |= CT4_S_ASSURED;
	e->expires = now + ct4_lifetime_ns(cfg, p->proto, flags);
}

static __always_inline struct scratch6 *scratch6_get(void)
{
	__u32 zero = 0;

	return epx_lookup(epx_scratch6, &zero);
}

/* The source port connection `e` (client port `cport`) leaves with toward its backend (ct4_wire_port). */
static __always_inline __be16 ct6_wire_port(const struct ct6_entry *e, __be16 cport)
{
	return (e->state & CT4_S_REMAP) ? e->snat_port : cport;
}

/* The client's own port of the connection a CT4_REV_DNAT half at `key` answers (ct4_rev_dnat_cport). */
static __always_inline __be16 ct6_rev_dnat_cport(const struct ct6_entry *half, const struct ct6_key *key)
{
	return (half->state & CT4_S_REMAP) ? half->snat_port : key->dport;
}

/* The client's own port of the connection a CT4_SNAT half at `key` belongs to (ct4_snat_cport). */
static __always_inline __be16 ct6_snat_cport(const struct ct6_entry *half, const struct ct6_key *key)
{
	return (half->state & CT4_S_REMAP) ? half->snat_port : key->sport;
}

/* The destination port a reply at the CT4_REV_SNAT half at `key` goes on with (ct4_rev_snat_port). */
static __always_inline __be16 ct6_rev_snat_port(const struct ct6_entry *half, const struct ct6_key *key)
{
	return (half->state & CT4_S_REMAP) ? key->dport : half->nat_port;
}

/* Remove the half at s->half if connection `owner` (a CT4_SVC key) still owns it: its frontend
 * and client port (ct4_forget_half). */
static __always_inline void ct6_forget_half(struct scratch6 *s, const struct ct6_key *owner)
{
	struct ct6_entry *h = epx_lookup(epx_ct6, &s->half);

	if (!h || !in6_eq(&h->svc_addr, &owner->daddr) || h->svc_port != owner->dport)
		return;
	if (s->half.kind == CT4_REV_SNAT && (!in6_eq(&h->nat_addr, &owner->saddr) || h->nat_port != owner->sport))
		return;
	/* and its client port (ct4_forget_half) */
	if (s->half.kind == CT4_REV_DNAT && ct6_rev_dnat_cport(h, &s->half) != owner->sport)
		return;
	if (s->half.kind == CT4_SNAT && ct6_snat_cport(h, &s->half) != owner->sport)
		return;
	epx_delete(epx_ct6, &s->half);
}

/* Remove connection `key` (its CT4_SVC entry `e`) with the halves it owns (ct4_forget). `key`
 * must not be s->half. */
static __always_inline void ct6_forget(struct scratch6 *s, struct ct6_key *key, const struct ct6_entry *e)
{
	s->gone = *e; /* read before any deletion: `e` is the map's element, which another CPU may then reuse */
	s->half = ct6_key_make(&s->gone.nat_addr, &key->saddr, s->gone.nat_port, ct6_wire_port(&s->gone, key->sport),
			       key->proto, CT4_REV_DNAT);
	ct6_forget_half(s, key);
	if (s->gone.flags & CT4_F_MASQ) {
		s->half = ct6_key_make(&key->saddr, &s->gone.nat_addr, ct6_wire_port(&s->gone, key->sport),
				       s->gone.nat_port, key->proto, CT4_SNAT);
		ct6_forget_half(s, key);
		s->half = ct6_key_make(&s->gone.nat_addr, &s->gone.snat_addr, s->gone.nat_port, s->gone.snat_port, key->proto,
				       CT4_REV_SNAT);
		ct6_forget_half(s, key);
	}
	epx_delete(epx_ct6, key);
}

/* ct6_forget of a connection that had closed, for a new SYN or INIT on its tuple (ct4_forget_closed). */
static __always_inline void ct6_forget_closed(struct scratch6 *s, struct ct6_key *key, const struct ct6_entry *e)
{
	ct6_forget(s, key, e);
	stats_count(EPX_EV_CT_CLOSED_FORGOTTEN, 0);
}

/* The entry at `key` if it has not expired; an expired CT4_SVC entry is removed with its halves. */
static __always_inline struct ct6_entry *ct6_lookup_svc(struct scratch6 *s, struct ct6_key *key, __u64 now)
{
	struct ct6_entry *e = epx_lookup(epx_ct6, key);

	if (!e)
		return NULL;
	if (e->expires <= now) {
		ct6_forget(s, key, e);
		return NULL;
	}
	return e;
}

/* The entry at `key` if it has not expired, read only: an ICMP error's lookup and a trace run
 * change no connection (ct4_find_svc). */
static __always_inline struct ct6_entry *ct6_find_svc(const struct ct6_key *key, __u64 now)
{
	struct ct6_entry *e = epx_lookup(epx_ct6, key);

	return e && e->expires > now ? e : NULL;
}

/* The live connection owning `half`, whose client side is client:cport (in s->owner); `ro` (an
 * ICMP error's lookup, a trace run): an expired owner is left in place (ct4_owner). */
static __always_inline struct ct6_entry *ct6_owner(struct scratch6 *s, const struct epx_in6 *client, __be16 cport,
						   const struct ct6_entry *half, __u8 proto, __u64 now, int ro)
{
	s->owner = ct6_key_make(client, &half->svc_addr, cport, half->svc_port, proto, CT4_SVC);
	return ro ? ct6_find_svc(&s->owner, now) : ct6_lookup_svc(s, &s->owner, now);
}

/* Whether `owner` (client port `cport`) still owns the CT4_REV_DNAT half at `key` (ct4_rev_dnat_owns). */
static __always_inline int ct6_rev_dnat_owns(const struct ct6_entry *owner, const struct ct6_key *key, __be16 cport)
{
	return owner && in6_eq(&owner->nat_addr, &key->saddr) && owner->nat_port == key->sport &&
	       ct6_wire_port(owner, cport) == key->dport;
}

/* Whether the CT4_REV_DNAT half at s->key answers a live connection (ct4_rev_dnat_taken). Uses s->owner. */
static __always_inline int ct6_rev_dnat_taken(struct scratch6 *s, __u64 now)
{
	struct ct6_entry *half = epx_lookup(epx_ct6, &s->key);
	__be16 cport;

	if (!half)
		return 0;
	cport = ct6_rev_dnat_cport(half, &s->key);
	return ct6_rev_dnat_owns(ct6_owner(s, &s->key.daddr, cport, half, s->key.proto, now, 1), &s->key, cport);
}

/* What the holder of REV_SNAT entry `old` at `key` still needs its port for (CT4_PORT_*). */
static __always_inline __u32 ct6_snat_port_use(struct scratch6 *s, const struct ct6_entry *old,
					       const struct ct6_key *key, __u8 proto, __u64 now)
{
	struct ct6_entry *owner = ct6_owner(s, &old->nat_addr, old->nat_port, old, proto, now, 0);

	if (!owner || owner->snat_port != key->dport || !in6_eq(&owner->nat_addr, &key->saddr) ||
	    owner->nat_port != key->sport)
		return CT4_PORT_FREE;
	if (owner->flags & CT4_F_DONE)
		return CT4_PORT_FREE;
	if (owner->flags & CT4_F_TIME_WAIT)
		return CT4_PORT_TIME_WAIT;
	return CT4_PORT_BUSY;
}

/* Whether masquerade is possible: an IPv6 address and epx_config's port range. */
static __always_inline __u32 ct6_snat_check(const struct lb4_config *cfg, const struct lb6_config *cfg6)
{
	if (!cfg6 || in6_is_zero(&cfg6->snat_addr))
		return EPX_DROP_SNAT_NO_ADDR;
	return ct4_port_range_check(cfg);
}

/* Pick a port of the masquerade range (ct4_port_range_check: usable) for the half s->val keyed
 * like s->key (its kind and addresses set: a masquerade port, CT4_REV_SNAT, or a remapped client
 * port, CT4_REV_DNAT) and insert it there, as ct4_port_alloc: random start, linear probing, a
 * TIME_WAIT masquerade port only as a last resort. Returns 0 with *port set, or a drop reason.
 * The loop is not unrolled: eight inlined copies of the owner lookup would not fit the stack
 * either. */
static __always_inline __u32 ct6_port_alloc(struct scratch6 *s, const struct lb4_config *cfg, __u64 now, __be16 *port)
{
	__u32 min = cfg->snat_port_min, range = cfg->snat_port_max - cfg->snat_port_min + 1;
	__u32 start = bpf_get_prandom_u32();
	__be16 last_resort = 0;

#pragma clang loop unroll(disable)
	for (int i = 0; i < CT4_SNAT_TRIES; i++) {
		struct ct6_entry *old;
		__u32 use;
		long err;

		s->key.dport = epx_htons((__u16)(min + (start + i) % range));
		err = epx_insert(epx_ct6, &s->key, &s->val);
		if (err == 0)
			goto claimed;
		if (err == -CT4_E2BIG)
			return EPX_DROP_CT_FULL;
		if (s->key.kind == CT4_REV_SNAT) {
			old = epx_lookup(epx_ct6, &s->key);
			use = old ? ct6_snat_port_use(s, old, &s->key, s->key.proto, now) : CT4_PORT_FREE;
		} else {
			use = ct6_rev_dnat_taken(s, now) ? CT4_PORT_BUSY : CT4_PORT_FREE;
		}
		if (use == CT4_PORT_FREE) {
			epx_delete(epx_ct6, &s->key);
			if (epx_insert(epx_ct6, &s->key, &s->val) == 0)
				goto claimed;
		}
		if (use == CT4_PORT_TIME_WAIT && !last_resort)
			last_resort = s->key.dport;
	}
	if (!last_resort)
		return EPX_DROP_SNAT_NO_PORT;
	s->key.dport = last_resort;
	epx_delete(epx_ct6, &s->key);
	if (epx_insert(epx_ct6, &s->key, &s->val))
		return EPX_DROP_SNAT_NO_PORT;
claimed:
	*port = s->key.dport;
	return 0;
}

/* Record a new connection of `p` (still addressed to the frontend) to backend be_addr:be_port:
 * the CT4_SVC entry and its halves (ct4_create_once), built in s->key / s->val. On failure nothing
 * written stays. Returns 0 or a drop reason (a full table: EPX_DROP_CT_FULL, no early drop). */
static __always_inline __u32 ct6_create(struct scratch6 *s, const struct pkt6 *p, const struct lb4_config *cfg,
					__u64 now, __u32 backend_id, const struct epx_in6 *be_addr, __be16 be_port, int masq)
{
	const struct lb6_config *cfg6 = p->cfg6;
	__be16 snat_port = 0, wire_port = p->sport; /* the port it leaves with toward the backend */
	__u32 reason;
	long err;

	__builtin_memset(&s->val, 0, sizeof(s->val));
	s->val.nat_addr = p->saddr;
	s->val.nat_port = p->sport;
	s->val.svc_addr = p->daddr;
	s->val.svc_port = p->dport;
	if (masq) {
		reason = ct6_snat_check(cfg, cfg6);
		if (reason)
			return reason;
		/* the client's port toward this backend is a live connection's already: this one
		 * leaves with its masquerade port from DNAT on (CT4_S_REMAP, see ct4_create_once) */
		s->key = ct6_key_make(be_addr, &p->saddr, be_port, p->sport, p->proto, CT4_REV_DNAT);
		if (ct6_rev_dnat_taken(s, now)) {
			s->val.state = CT4_S_REMAP; /* every half's, and the client's own port in snat_port */
			s->val.snat_port = p->sport;
		}
		/* s->val is the REV_SNAT half: backend -> masq addr:port, nat = the client */
		s->key = ct6_key_make(be_addr, &cfg6->snat_addr, be_port, 0, p->proto, CT4_REV_SNAT);
		reason = ct6_port_alloc(s, cfg, now, &snat_port);
		if (reason)
			return reason;
		/* the masquerade port as the client's port toward the backend: taken (a client's own
		 * port in the masquerade range) is refused, the client's retransmit draws another */
		s->key = ct6_key_make(be_addr, &p->saddr, be_port, snat_port, p->proto, CT4_REV_DNAT);
		if ((s->val.state & CT4_S_REMAP) && ct6_rev_dnat_taken(s, now)) {
			s->key = ct6_key_make(be_addr, &cfg6->snat_addr, be_port, snat_port, p->proto, CT4_REV_SNAT);
			epx_delete(epx_ct6, &s->key);
			return EPX_DROP_SNAT_NO_PORT;
		}
		if (s->val.state & CT4_S_REMAP)
			wire_port = snat_port;
		/* forward: client -> backend leaves as snat_addr:snat_port -> backend */
		s->val.nat_addr = cfg6->snat_addr;
		s->val.nat_port = snat_port;
		s->key = ct6_key_make(&p->saddr, be_addr, wire_port, be_port, p->proto, CT4_SNAT);
		err = epx_update(epx_ct6, &s->key, &s->val);
		if (err)
			goto undo_rev_snat;
	} else {
		/* the client's port toward this backend is a live connection's already: this one
		 * leaves with another (CT4_S_REMAP, see ct4_create_once); s->val is its reply half */
		s->key = ct6_key_make(be_addr, &p->saddr, be_port, p->sport, p->proto, CT4_REV_DNAT);
		if (ct6_rev_dnat_taken(s, now)) {
			s->val.nat_addr = p->daddr;
			s->val.nat_port = p->dport;
			s->val.state = CT4_S_REMAP;
			s->val.snat_port = p->sport;
			reason = ct4_port_range_check(cfg);
			s->key = ct6_key_make(be_addr, &p->saddr, be_port, 0, p->proto, CT4_REV_DNAT);
			if (!reason)
				reason = ct6_port_alloc(s, cfg, now, &snat_port);
			if (reason)
				return reason;
			wire_port = snat_port;
		}
		/* the new connection owns the client -> backend tuple now (see ct4_create_once) */
		s->key = ct6_key_make(&p->saddr, be_addr, wire_port, be_port, p->proto, CT4_SNAT);
		epx_delete(epx_ct6, &s->key);
	}
	/* reply: backend -> client leaves with the frontend as source (a remapped connection's
	 * half is in place: snat_port without masquerade) */
	if (masq || !snat_port) {
		s->val.nat_addr = p->daddr;
		s->val.nat_port = p->dport;
		s->key = ct6_key_make(be_addr, &p->saddr, be_port, wire_port, p->proto, CT4_REV_DNAT);
		err = epx_update(epx_ct6, &s->key, &s->val);
		if (err)
			goto undo_snat;
	}
	/* the connection itself */
	s->val.nat_addr = *be_addr;
	s->val.nat_port = be_port;
	s->val.backend_id = backend_id;
	if (masq) {
		s->val.snat_addr = cfg6->snat_addr;
		s->val.snat_port = snat_port; /* and, remapped, the port it leaves with */
		s->val.flags = CT4_F_MASQ;
	} else if (snat_port) {
		s->val.snat_addr = p->saddr;
		s->val.snat_port = snat_port;
		s->val.state = CT4_S_REMAP;
	}
	ct6_touch(&s->val, cfg, p, 0, now);
	s->key = ct6_key_make(&p->saddr, &p->daddr, p->sport, p->dport, p->proto, CT4_SVC);
	err = epx_update(epx_ct6, &s->key, &s->val);
	if (!err) {
		if (s->val.state & CT4_S_REMAP)
			stats_count(EPX_EV_CT_PORT_REMAP, 0);
		return 0;
	}
	s->key = ct6_key_make(be_addr, &p->saddr, be_port, wire_port, p->proto, CT4_REV_DNAT);
	epx_delete(epx_ct6, &s->key);
undo_snat:
	if (masq) {
		s->key = ct6_key_make(&p->saddr, be_addr, wire_port, be_port, p->proto, CT4_SNAT);
		epx_delete(epx_ct6, &s->key);
	}
undo_rev_snat:
	if (masq && cfg6) {
		s->key = ct6_key_make(be_addr, &cfg6->snat_addr, be_port, snat_port, p->proto, CT4_REV_SNAT);
		epx_delete(epx_ct6, &s->key);
	}
	return ct4_put_failed(err);
}

#endif /* EPX_CT6_H */
