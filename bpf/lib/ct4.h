/* Connection tracking: what kube-proxy gets from the kernel's conntrack, kept in epx_ct4.
 *
 * A connection is its CT4_SVC entry (client -> frontend): chosen backend, masquerade, state and
 * lifetime. Its translation halves (CT4_REV_DNAT, CT4_SNAT, CT4_REV_SNAT, see common.h) are
 * honoured only while that owner is alive and still points at them, so a half left behind (by
 * expiry, or by a connection that took the tuple over) can never rewrite an unrelated flow; the
 * table does not evict, so what is dropped is dropped whole (ct4_forget) and the agent's garbage
 * collector removes what nobody looks up again (Maps.collect_connections).
 *
 * Lifetimes follow nf_conntrack's shape (seconds from epx_config, kube-proxy's conntrack settings):
 * TCP before the first reply, established, half closed (a FIN one way: CLOSE_WAIT) and closed
 * (FINs both ways, or RST); UDP before and after the first reply; SCTP before and after the first
 * reply, and closed (ABORT or SHUTDOWN COMPLETE, either way: nf_conntrack's CLOSED), with
 * nf_conntrack's SCTP defaults, which kube-proxy leaves alone (its other SCTP states, the
 * shutdown handshake and HEARTBEAT_SENT, keep the established lifetime here: the association
 * still holds its tuple). Every packet of the connection, in either direction, pushes the
 * deadline forward.
 *
 * Masquerade ports. A port toward one backend ip:port is busy while its connection lives, and a
 * TCP connection lives tcp_close_timeout (10 s) past its last FIN, like conntrack's. Holding the
 * port that long caps masquerade at ~450 new connections/s per backend (4536 ports / 10 s): at
 * higher rates the allocator ran out and dropped SYNs (SNAT_NO_PORT), each one a client stalled
 * for a 1 s SYN retransmit. So the close is tracked (ct4_tcp_state), and the port follows what
 * the backend still holds, not the entry's lifetime:
 *   - DONE (RST seen, or the client closed first and acknowledged the backend's FIN): the backend
 *     has no socket left for the tuple, the port is free at once;
 *   - TIME_WAIT (the backend closed first): the backend keeps the tuple 60 s, and a SYN into it
 *     is refused unless its sequence number or timestamp is newer (PAWS). The entry lives that
 *     long and the port is reused only when no other is free (as conntrack lets a new SYN reopen
 *     a TIME_WAIT tuple), never dropped for it;
 *   - any other live connection keeps its port: no free one among the probes is SNAT_NO_PORT.
 *
 * Clashing tuples. A client may use one source port for two connections at once through two
 * frontends (connect() reuses a port toward another destination). Should both reach the same
 * backend, they would be one tuple there, and the second's CT4_REV_DNAT half would take the
 * first's replies. netfilter's NAT finds such a clash when it confirms the second connection
 * and gives it another source port; so does ct4_create: it leaves with a port from the
 * masquerade range, CT4_S_REMAP (common.h), counted under EPX_EV_CT_PORT_REMAP. That range lies
 * outside Linux's default ephemeral ports (32768-60999); a client whose own ports reach into it
 * could hold the drawn port toward that backend in a connection no Service translates, which
 * this table does not see (netfilter's sees every connection). A masqueraded connection leaves
 * with its masquerade port: from DNAT on (its SNAT half keyed by it) to the reply's, whose
 * destination ct4's halves restore.
 */
#ifndef EPX_CT4_H
#define EPX_CT4_H

#include "lib/pkt4.h"
#include "lib/stats.h"

#define EPX_NSEC_PER_SEC 1000000000ULL
#define CT4_SNAT_TRIES 8 /* random start, then linear probing, like MASQUERADE --random-fully */
#define CT4_E2BIG 7 /* E2BIG: what a map update returns when a full hash map has no free element */
#define CT4_TIME_WAIT_SECS 60 /* Linux's TCP_TIMEWAIT_LEN: how long a backend that closed first keeps the tuple */

/* What a masquerade port's current holder still needs it for (ct4_snat_port_use). */
#define CT4_PORT_FREE 0      /* no live connection, or one the backend forgot (DONE) */
#define CT4_PORT_TIME_WAIT 1 /* the backend may still hold the tuple in TIME_WAIT: reuse as a last resort */
#define CT4_PORT_BUSY 2      /* a live connection */

static __always_inline struct ct4_key ct4_key_make(__be32 saddr, __be32 daddr, __be16 sport, __be16 dport, __u8 proto,
						   __u8 kind)
{
	struct ct4_key key = {
		.saddr = saddr, .daddr = daddr, .sport = sport, .dport = dport, .proto = proto, .kind = kind,
	};
	return key;
}

static __always_inline __u64 ct4_lifetime_ns(const struct lb4_config *cfg, __u8 proto, __u8 flags)
{
	__u32 secs;

	if (proto == IPPROTO_TCP) {
		if ((flags & (CT4_F_CLOSING | CT4_F_DONE)) == CT4_F_CLOSING &&
		    !((flags & CT4_F_FIN_ORIG) && (flags & CT4_F_FIN_REPLY))) {
			secs = cfg->tcp_close_wait_timeout; /* half closed: the other side may still send */
			if (flags & CT4_F_TIME_WAIT && secs < CT4_TIME_WAIT_SECS)
				secs = CT4_TIME_WAIT_SECS;
		} else if (flags & CT4_F_CLOSING) {
			secs = cfg->tcp_close_timeout;
			/* keep the port out of the way while the backend's TIME_WAIT lasts */
			if ((flags & (CT4_F_TIME_WAIT | CT4_F_DONE)) == CT4_F_TIME_WAIT && secs < CT4_TIME_WAIT_SECS)
				secs = CT4_TIME_WAIT_SECS;
		} else if (flags & CT4_F_SEEN_REPLY)
			secs = cfg->tcp_est_timeout;
		else
			secs = cfg->tcp_syn_timeout;
	} else if (proto == IPPROTO_SCTP) {
		if (flags & CT4_F_CLOSING)
			secs = cfg->sctp_close_timeout;
		else
			secs = (flags & CT4_F_SEEN_REPLY) ? cfg->sctp_est_timeout : cfg->sctp_timeout;
	} else {
		secs = (flags & CT4_F_SEEN_REPLY) ? cfg->udp_stream_timeout : cfg->udp_timeout;
	}
	return (__u64)secs * EPX_NSEC_PER_SEC;
}

/* TCP close tracking: `flags` after a segment with TCP flags `tcp`, from the backend (`reply`) or
 * from the client. See the header comment for what DONE and TIME_WAIT mean to the port. */
static __always_inline __u8 ct4_tcp_state(__u8 flags, __u8 tcp, int reply)
{
	if (tcp & EPX_TCP_RST)
		return flags | CT4_F_CLOSING | CT4_F_DONE;
	if (tcp & EPX_TCP_FIN) {
		flags |= CT4_F_CLOSING | (reply ? CT4_F_FIN_REPLY : CT4_F_FIN_ORIG);
		if (reply && !(flags & CT4_F_FIN_ORIG))
			flags |= CT4_F_TIME_WAIT; /* the backend is the active closer */
		return flags;
	}
	/* the client closed first and now acknowledges the backend's FIN: the backend's LAST_ACK ends */
	if (!reply && (tcp & EPX_TCP_ACK) && (flags & (CT4_F_FIN_ORIG | CT4_F_FIN_REPLY | CT4_F_TIME_WAIT)) ==
						     (CT4_F_FIN_ORIG | CT4_F_FIN_REPLY))
		flags |= CT4_F_DONE;
	return flags;
}

/* Account one packet of the connection: state flags, then a fresh deadline. */
static __always_inline void ct4_touch(struct ct4_entry *e, const struct lb4_config *cfg, const struct pkt4 *p, int reply,
				      __u64 now)
{
	__u8 flags = e->flags;

	if (reply)
		flags |= CT4_F_SEEN_REPLY;
	/* SCTP's flags are only ever SYN or RST (pkt4_sctp_flags): ABORT or SHUTDOWN COMPLETE is done */
	if ((p->proto == IPPROTO_TCP || p->proto == IPPROTO_SCTP) && p->frag != EPX_FRAG_LATER)
		flags = ct4_tcp_state(flags, p->tcp_flags, reply);
	if (flags != e->flags)
		e->flags = flags;
	if (!reply && (flags & CT4_F_SEEN_REPLY) && !(e->state & CT4_S_ASSURED))
		e->state |= CT4_S_ASSURED;
	e->expires = now + ct4_lifetime_ns(cfg, p->proto, flags);
}

/* The entry at `key` if it has not expired, read only (trace mode: an expired entry stays). */
static __always_inline struct ct4_entry *ct4_find_svc(struct ct4_key *key, __u64 now)
{
	struct ct4_entry *e = epx_lookup(epx_ct4, key);

	return e && e->expires > now ? e : NULL;
}

/* The source port connection `e` (client port `cport`) leaves with toward its backend. */
static __always_inline __be16 ct4_wire_port(const struct ct4_entry *e, __be16 cport)
{
	return (e->state & CT4_S_REMAP) ? e->snat_port : cport;
}

/* The client's own port of the connection a CT4_REV_DNAT half at `key` (backend -> client) answers:
 * the key's, or for a remapped connection (CT4_S_REMAP) the one the half keeps. */
static __always_inline __be16 ct4_rev_dnat_cport(const struct ct4_entry *half, const struct ct4_key *key)
{
	return (half->state & CT4_S_REMAP) ? half->snat_port : key->dport;
}

/* The client's own port of the connection a CT4_SNAT half at `key` (client -> backend) belongs
 * to: the key's, or for a remapped connection the one the half keeps. */
static __always_inline __be16 ct4_snat_cport(const struct ct4_entry *half, const struct ct4_key *key)
{
	return (half->state & CT4_S_REMAP) ? half->snat_port : key->sport;
}

/* The destination port a reply at the CT4_REV_SNAT half at `key` goes on with: the client's own,
 * or for a remapped connection the masquerade port, which its CT4_REV_DNAT half is keyed by. */
static __always_inline __be16 ct4_rev_snat_port(const struct ct4_entry *half, const struct ct4_key *key)
{
	return (half->state & CT4_S_REMAP) ? key->dport : half->nat_port;
}

/* Remove the half at `half` if connection `owner` (a CT4_SVC key) still owns it: a later
 * connection may have taken the tuple over, and its half stays. Its frontend and client port must
 * be the owner's: with remapped ports (CT4_S_REMAP) two connections through one frontend may have
 * held one key in turn. */
static __always_inline void ct4_forget_half(struct ct4_key *half, const struct ct4_key *owner)
{
	struct ct4_entry *h = epx_lookup(epx_ct4, half);
	__be16 cport;

	if (!h || h->svc_addr != owner->daddr || h->svc_port != owner->dport)
		return;
	if (half->kind == CT4_REV_SNAT && (h->nat_addr != owner->saddr || h->nat_port != owner->sport))
		return;
	/* one comparison of the client port for both kinds, not an `if` each: this is inlined
	 * wherever a connection is forgotten, and tc_ingress fits the verifier's budget only so (two
	 * `if`s, or ct4_forget's wire port read through ct4_wire_port, were E2BIG) */
	cport = half->kind == CT4_REV_DNAT ? ct4_rev_dnat_cport(h, half) : ct4_snat_cport(h, half);
	if (half->kind != CT4_REV_SNAT && cport != owner->sport)
		return;
	epx_delete(epx_ct4, half);
}

/* Remove connection `key` (a CT4_SVC entry, `e`) with the halves it owns. The map is a plain hash
 * (it does not evict): whatever the datapath drops it must drop whole, or the halves fill it. */
static __always_inline void ct4_forget(struct ct4_key *key, const struct ct4_entry *e)
{
	/* read before any deletion: `e` is the map's element, which another CPU may then reuse */
	__be32 be_addr = e->nat_addr, snat_addr = e->snat_addr;
	__be16 be_port = e->nat_port, snat_port = e->snat_port;
	__u8 masq = e->flags & CT4_F_MASQ;
	__be16 wire_port = (e->state & CT4_S_REMAP) ? snat_port : key->sport; /* from the copy read above */
	__u32 zero = 0;
	struct ct4_ring *ring = epx_lookup(epx_ct4_ring, &zero); /* its `half`: tc_ingress's stack is full */

	if (ring) {
		ring->half = ct4_key_make(be_addr, key->saddr, be_port, wire_port, key->proto, CT4_REV_DNAT);
		ct4_forget_half(&ring->half, key);
		if (masq) {
			ring->half = ct4_key_make(key->saddr, be_addr, wire_port, be_port, key->proto, CT4_SNAT);
			ct4_forget_half(&ring->half, key);
			ring->half = ct4_key_make(be_addr, snat_addr, be_port, snat_port, key->proto, CT4_REV_SNAT);
			ct4_forget_half(&ring->half, key);
		}
	}
	epx_delete(epx_ct4, key);
}

/* ct4_forget of a connection that had closed (CT4_F_CLOSING), for a new SYN or INIT on its tuple:
 * counted as EPX_EV_CT_CLOSED_FORGOTTEN, so an operator sees how often closed connections' ports
 * come back while their entries are still here (netfilter's TIME_WAIT reopen, or a clash with a
 * connection another node translated, nat4.h). */
static __always_inline void ct4_forget_closed(struct ct4_key *key, const struct ct4_entry *e)
{
	ct4_forget(key, e);
	stats_count(EPX_EV_CT_CLOSED_FORGOTTEN, 0);
}

/* The entry at `key` if it has not expired; an expired CT4_SVC entry is removed with its halves. */
static __always_inline struct ct4_entry *ct4_lookup_svc(struct ct4_key *key, __u64 now)
{
	struct ct4_entry *e = epx_lookup(epx_ct4, key);

	if (!e)
		return NULL;
	if (e->expires <= now) {
		ct4_forget(key, e);
		return NULL;
	}
	return e;
}

/* ---- a full table (common.h: ct4_ring) ----
 * nf_conntrack, when full, drops a non-assured connection near the new one's hash bucket
 * (early_drop), and its GC worker, above 95 %, also TCP connections that are closing; when it
 * finds none, the new packet is dropped. Here: the first of the CT4_EVICT_SCAN oldest connections
 * in this CPU's queue (common.h: struct ct4_ring) that has expired, is not assured
 * (CT4_S_ASSURED) or is a closing TCP connection is dropped; established connections are never
 * dropped to make room. A flood is spread over the CPUs by the NIC, and so is its share of the
 * queues. */

/* Whether connection `e` may be dropped to make room for a new one. */
static __always_inline int ct4_evictable(const struct ct4_entry *e, __u8 proto, __u64 now)
{
	if (e->expires <= now || !(e->state & CT4_S_ASSURED))
		return 1;
	/* nf_conntrack's can_early_drop: closing TCP, and closing SCTP (sctp_can_early_drop) */
	return (proto == IPPROTO_TCP || proto == IPPROTO_SCTP) && (e->flags & CT4_F_CLOSING);
}

/* Drop connections to make room for `need` entries (counted under EPX_EV_CT_EARLY_DROP, one per
 * connection). Returns 1 if it dropped any. */
static __always_inline int ct4_early_drop(__u64 now, __u32 need)
{
	__u32 zero = 0, freed = 0;
	struct ct4_ring *ring = epx_lookup(epx_ct4_ring, &zero);

	if (!ring)
		return 0;
	if (ring->head - ring->tail > CT4_RING_SLOTS)
		ring->tail = ring->head - CT4_RING_SLOTS; /* the oldest were overwritten */
	for (__u32 i = 0; i < CT4_EVICT_SCAN && freed < need && ring->tail != ring->head; i++) {
		struct ct4_key *key = &ring->keys[ring->tail & (CT4_RING_SLOTS - 1)];
		struct ct4_entry *e;

		ring->tail++;
		e = epx_lookup(epx_ct4, key);
		if (!e || !ct4_evictable(e, key->proto, now))
			continue;
		freed += (e->flags & CT4_F_MASQ) ? 4 : 2; /* the entry and its halves */
		ct4_forget(key, e);
		stats_count(EPX_EV_CT_EARLY_DROP, 0);
	}
	return freed > 0;
}

/* Queue the connection just created at `key` as this CPU's newest. */
static __always_inline void ct4_ring_push(const struct ct4_key *key)
{
	__u32 zero = 0;
	struct ct4_ring *ring = epx_lookup(epx_ct4_ring, &zero);

	if (!ring)
		return;
	ring->keys[ring->head & (CT4_RING_SLOTS - 1)] = *key;
	ring->head++;
}

/* A connection table update's error as a reason: a full table, or another failure. */
static __always_inline __u32 ct4_put_failed(long err)
{
	return err == -CT4_E2BIG ? EPX_DROP_CT_FULL : EPX_DROP_CT_FAILED;
}

/* The live connection owning a half-entry whose client side is client:cport (`ro`: trace mode,
 * an expired owner is left in place). */
static __always_inline struct ct4_entry *ct4_owner(__be32 client, __be16 cport, const struct ct4_entry *half, __u8 proto,
						    __u64 now, int ro)
{
	struct ct4_key key = ct4_key_make(client, half->svc_addr, cport, half->svc_port, proto, CT4_SVC);

	return ro ? ct4_find_svc(&key, now) : ct4_lookup_svc(&key, now);
}

/* Whether `owner` (client port `cport`) still owns the CT4_REV_DNAT half at `key`: the same
 * backend, and the port it leaves with (CT4_S_REMAP: snat_port) is the key's. */
static __always_inline int ct4_rev_dnat_owns(const struct ct4_entry *owner, const struct ct4_key *key, __be16 cport)
{
	return owner && owner->nat_addr == key->saddr && owner->nat_port == key->sport &&
	       ct4_wire_port(owner, cport) == key->dport;
}

/* Whether a packet with TCP flags `tcp` that meets a half of `owner_flags`'s connection belongs to
 * another connection: a SYN, or the backend's SYN-ACK, cannot be part of a connection that has
 * closed (a FIN or RST seen; a SYN through its frontend here reopens it before any half sees the
 * packet). It is a new connection of the same client port, toward another frontend that another
 * node translated to the same backend (connect() picks ports per destination): it addresses the
 * backend itself, and its tuple there is the closed connection's (its CT4_REV_DNAT half's; its
 * CT4_SNAT half's, when that was masqueraded). netfilter keeps the two apart where they meet
 * (nf_nat_core.c get_unique_tuple: the new one's null binding, with another source port where the
 * tuples clash); here the closed connection is over and is forgotten whole, and the new one
 * passes as it came. Both families use this. */
static __always_inline int ct_syn_of_another(__u8 proto, __u8 tcp, __u8 owner_flags)
{
	return proto == IPPROTO_TCP && (tcp & EPX_TCP_SYN) && (owner_flags & CT4_F_CLOSING);
}

/* Whether the CT4_REV_DNAT half at `key` answers a live connection: a new connection of that
 * client port toward that backend would clash with it. Read only: an expired owner stays for
 * the lookups that remove it. */
static __always_inline int ct4_rev_dnat_taken(const struct ct4_key *key, __u64 now)
{
	struct ct4_entry *half = epx_lookup(epx_ct4, key);
	__be16 cport;

	if (!half)
		return 0;
	cport = ct4_rev_dnat_cport(half, key);
	return ct4_rev_dnat_owns(ct4_owner(key->daddr, cport, half, key->proto, now, 1), key, cport);
}

/* What the connection holding the masquerade port of REV_SNAT entry `old` (key `key`) still needs
 * it for: CT4_PORT_*. A holder that is gone, or that moved to another port or backend (its client
 * reused the tuple), left the entry behind: the port is free. */
static __always_inline __u32 ct4_snat_port_use(const struct ct4_entry *old, const struct ct4_key *key, __u8 proto,
					       __u64 now)
{
	struct ct4_entry *owner = ct4_owner(old->nat_addr, old->nat_port, old, proto, now, 0);

	if (!owner || owner->snat_port != key->dport || owner->nat_addr != key->saddr || owner->nat_port != key->sport)
		return CT4_PORT_FREE;
	if (owner->flags & CT4_F_DONE)
		return CT4_PORT_FREE;
	if (owner->flags & CT4_F_TIME_WAIT)
		return CT4_PORT_TIME_WAIT;
	return CT4_PORT_BUSY;
}

/* Take over the REV_SNAT entry at `key` (its holder no longer needs it). Delete, then insert only
 * if absent: of two CPUs reclaiming the same port at once, one gets it. Returns 0 when ours
 * (the deletion freed an element: a full table cannot refuse this insert). */
static __always_inline int ct4_snat_claim(struct ct4_key *key, struct ct4_entry *rev)
{
	epx_delete(epx_ct4, key);
	return epx_insert(epx_ct4, key, rev);
}

/* Whether the masquerade port range is usable (remapped ports come from it too). Returns 0 or
 * EPX_DROP_SNAT_NO_PORT. */
static __always_inline __u32 ct4_port_range_check(const struct lb4_config *cfg)
{
	return !cfg->snat_port_min || cfg->snat_port_max < cfg->snat_port_min ? EPX_DROP_SNAT_NO_PORT : 0;
}

/* Whether masquerade is possible at all: an address and a port range. Returns 0 or a drop reason
 * (the trace dry run's answer too: it allocates no port, so it cannot see SNAT_NO_PORT from a
 * range that is full). */
static __always_inline __u32 ct4_snat_check(const struct lb4_config *cfg)
{
	if (!cfg->snat_addr)
		return EPX_DROP_SNAT_NO_ADDR;
	return ct4_port_range_check(cfg);
}

/* Pick a port of the masquerade range (ct4_port_range_check: usable) for the half `rev` at
 * saddr -> daddr of kind `kind` (the port its dport) and insert it there. Random start, then linear probing: a port
 * nobody needs is taken at once. A masquerade port (CT4_REV_SNAT: backend -> snat addr) whose
 * holder is done with it is free, one the backend may still hold in TIME_WAIT is taken only when
 * the probes found nothing better; a remapped client port (CT4_REV_DNAT: backend -> client,
 * CT4_S_REMAP) is free when it answers no live connection. Returns 0 with *port set, or a drop
 * reason. */
static __always_inline __u32 ct4_port_alloc(__be32 saddr, __be32 daddr, __be16 sport, __u8 proto, __u8 kind,
					    const struct lb4_config *cfg, __u64 now, __be16 *port, struct ct4_entry *rev)
{
	struct ct4_key key = ct4_key_make(saddr, daddr, sport, 0, proto, kind);
	__u32 min = cfg->snat_port_min, range = cfg->snat_port_max - cfg->snat_port_min + 1;
	__u32 start = bpf_get_prandom_u32();
	__be16 last_resort = 0;

#pragma unroll
	for (int i = 0; i < CT4_SNAT_TRIES; i++) {
		struct ct4_entry *old;
		__u32 use;

		key.dport = epx_htons((__u16)(min + (start + i) % range));
		long err = epx_insert(epx_ct4, &key, rev);

		if (err == 0)
			goto claimed;
		if (err == -CT4_E2BIG)
			return EPX_DROP_CT_FULL; /* not the port range: the table */
		if (kind == CT4_REV_SNAT) {
			old = epx_lookup(epx_ct4, &key);
			use = old ? ct4_snat_port_use(old, &key, proto, now) : CT4_PORT_FREE;
		} else {
			use = ct4_rev_dnat_taken(&key, now) ? CT4_PORT_BUSY : CT4_PORT_FREE;
		}
		if (use == CT4_PORT_FREE && ct4_snat_claim(&key, rev) == 0)
			goto claimed;
		if (use == CT4_PORT_TIME_WAIT && !last_resort)
			last_resort = key.dport;
	}
	if (!last_resort)
		return EPX_DROP_SNAT_NO_PORT;
	key.dport = last_resort;
	if (ct4_snat_claim(&key, rev))
		return EPX_DROP_SNAT_NO_PORT;
claimed:
	*port = key.dport;
	return 0;
}

/* One attempt of ct4_create. On failure nothing it wrote stays behind (the table does not evict).
 * The half entries are built in this CPU's scratch (common.h: struct ct4_ring), not on
 * tc_ingress's 512-byte stack: beside the SCTP paths it has no room left for them. */
static __always_inline __u32 ct4_create_once(const struct pkt4 *p, const struct lb4_config *cfg, __u64 now,
					     __u32 backend_id, __be32 be_addr, __be16 be_port, __u8 masq)
{
	struct ct4_entry e = {
		.nat_addr = be_addr, .nat_port = be_port, .svc_addr = p->daddr, .svc_port = p->dport,
		.backend_id = backend_id,
	};
	__u32 zero = 0;
	struct ct4_ring *s = epx_lookup(epx_ct4_ring, &zero);
	struct ct4_key key;
	__u32 reason;
	long err;

	if (!s)
		return EPX_DROP_CT_FAILED;
	s->rev_dnat = (struct ct4_entry){ .nat_addr = p->daddr, .nat_port = p->dport, .svc_addr = p->daddr,
					  .svc_port = p->dport };
	if (masq) {
		s->rev_snat = (struct ct4_entry){ .nat_addr = p->saddr, .nat_port = p->sport, .svc_addr = p->daddr,
						  .svc_port = p->dport };
		/* The client's port toward this backend is a live connection's already: this one
		 * leaves with its masquerade port from DNAT on (see the header comment). Not a node
		 * socket's (CT4_F_SOCK_MASQ): its tuple is the kernel's own, unique. */
		key = ct4_key_make(be_addr, p->saddr, be_port, p->sport, p->proto, CT4_REV_DNAT);
		if (!(masq & CT4_F_SOCK_MASQ) && ct4_rev_dnat_taken(&key, now)) {
			e.state = CT4_S_REMAP;
			s->rev_snat.state = CT4_S_REMAP; /* the reply's destination: the masquerade port */
			s->rev_dnat.state = CT4_S_REMAP;
			s->rev_dnat.snat_port = p->sport;
		}
		reason = ct4_snat_check(cfg);
		if (!reason)
			reason = ct4_port_alloc(be_addr, cfg->snat_addr, be_port, p->proto, CT4_REV_SNAT, cfg, now,
						&e.snat_port, &s->rev_snat);
		if (reason)
			return reason;
		e.snat_addr = cfg->snat_addr;
		e.flags = masq | CT4_F_MASQ;
		/* forward: client -> backend leaves as snat_addr:snat_port -> backend */
		s->snat = (struct ct4_entry){
			.nat_addr = e.snat_addr, .nat_port = e.snat_port, .svc_addr = p->daddr, .svc_port = p->dport,
			.state = e.state,
		};
		if (e.state & CT4_S_REMAP)
			s->snat.snat_port = p->sport; /* the client's own port: its owner's key */
		/* the masquerade port as the client's port toward the backend: taken (a client's own
		 * port in the masquerade range) is refused, the client's retransmit draws another */
		key = ct4_key_make(be_addr, p->saddr, be_port, e.snat_port, p->proto, CT4_REV_DNAT);
		err = (e.state & CT4_S_REMAP) && ct4_rev_dnat_taken(&key, now);
		if (!err) {
			key = ct4_key_make(p->saddr, be_addr, ct4_wire_port(&e, p->sport), be_port, p->proto, CT4_SNAT);
			err = epx_update(epx_ct4, &key, &s->snat);
		}
		if (err) {
			key = ct4_key_make(be_addr, e.snat_addr, be_port, e.snat_port, p->proto, CT4_REV_SNAT);
			epx_delete(epx_ct4, &key);
			return err > 0 ? EPX_DROP_SNAT_NO_PORT : ct4_put_failed(err);
		}
	} else {
		/* The client's port toward this backend is a live connection's already (through
		 * another frontend): this one leaves with another port (see the header comment). */
		key = ct4_key_make(be_addr, p->saddr, be_port, p->sport, p->proto, CT4_REV_DNAT);
		if (ct4_rev_dnat_taken(&key, now)) {
			s->rev_dnat.state = CT4_S_REMAP;
			s->rev_dnat.snat_port = p->sport;
			reason = ct4_port_range_check(cfg);
			if (!reason)
				reason = ct4_port_alloc(be_addr, p->saddr, be_port, p->proto, CT4_REV_DNAT, cfg, now,
							&e.snat_port, &s->rev_dnat);
			if (reason)
				return reason;
			e.snat_addr = p->saddr;
			e.state = CT4_S_REMAP;
		}
		/* The client may reuse its port toward the same backend through another frontend
		 * while the SNAT half of an earlier, masqueraded connection still lingers (its owner
		 * closed, or expired): egress would masquerade this one too. The new connection owns
		 * the client -> backend tuple now. */
		key = ct4_key_make(p->saddr, be_addr, ct4_wire_port(&e, p->sport), be_port, p->proto, CT4_SNAT);
		epx_delete(epx_ct4, &key);
	}
	/* reply: backend -> client leaves with the frontend as source (a remapped connection's half
	 * is in place already) */
	key = ct4_key_make(be_addr, p->saddr, be_port, ct4_wire_port(&e, p->sport), p->proto, CT4_REV_DNAT);
	err = (e.state & CT4_S_REMAP) && !masq ? 0 : epx_update(epx_ct4, &key, &s->rev_dnat);
	if (!err) {
		ct4_touch(&e, cfg, p, 0, now);
		key = ct4_key_make(p->saddr, p->daddr, p->sport, p->dport, p->proto, CT4_SVC);
		err = epx_update(epx_ct4, &key, &e);
		if (!err) {
			ct4_ring_push(&key);
			if (e.state & CT4_S_REMAP)
				stats_count(EPX_EV_CT_PORT_REMAP, 0);
			return 0;
		}
		key = ct4_key_make(be_addr, p->saddr, be_port, ct4_wire_port(&e, p->sport), p->proto, CT4_REV_DNAT);
		epx_delete(epx_ct4, &key);
	}
	if (masq) {
		key = ct4_key_make(p->saddr, be_addr, ct4_wire_port(&e, p->sport), be_port, p->proto, CT4_SNAT);
		epx_delete(epx_ct4, &key);
		key = ct4_key_make(be_addr, e.snat_addr, be_port, e.snat_port, p->proto, CT4_REV_SNAT);
		epx_delete(epx_ct4, &key);
	}
	return ct4_put_failed(err);
}

/* Record a new connection of `p` (still addressed to the frontend) to backend be_addr:be_port:
 * the CT4_SVC entry and its halves. `masq` is 0, or the CT4_F_MASQ (| CT4_F_SOCK_MASQ) flags of
 * a masqueraded connection. A full table makes room with ct4_early_drop, or the connection is
 * refused with EPX_DROP_CT_FULL. Returns 0 or a drop reason. */
static __always_inline __u32 ct4_create(const struct pkt4 *p, const struct lb4_config *cfg, __u64 now, __u32 backend_id,
					__be32 be_addr, __be16 be_port, __u8 masq)
{
	__u32 reason = ct4_create_once(p, cfg, now, backend_id, be_addr, be_port, masq);

	/* one retry, not a loop: a loop around the inlined attempt overflowed tc_ingress's stack */
	if (reason == EPX_DROP_CT_FULL && ct4_early_drop(now, masq ? 4 : 2))
		reason = ct4_create_once(p, cfg, now, backend_id, be_addr, be_port, masq);
	return reason;
}

#endif /* EPX_CT4_H */
