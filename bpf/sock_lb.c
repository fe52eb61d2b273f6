/* cgroup sock_addr programs: node-originated traffic to services, balanced at the socket.
 *
 * A process on the node (host network namespace) that connects or sends to a frontend is
 * connected or sent to a backend instead, chosen by the same policy as packets (rules 2, 7, 8:
 * the node is "from the node", 127.0.0.0/8:<nodePort> is the localhost case). No packet carries
 * the frontend address, so nothing needs translating on the wire; the kernel picks the source
 * address for the backend's route, which is the masquerade kube-proxy would apply. A socket
 * already bound keeps its source: the policy sees that source (loadBalancerSourceRanges,
 * affinity), and when it is not the masquerade address (127.0.0.0/8, or an LB IP the node holds)
 * and kube-proxy would masquerade, its packets are masqueraded on egress by tc_egress
 * (nat4_masq_local), which recognises the socket by its cookie in epx_sock_rev. UDP
 * sockets that receive get the frontend back as the peer address (recvmsg4), using epx_sock_rev.
 *
 * TCP and UDP sockets only. SCTP sockets are left to the kernel: an SCTP association may
 * address several peer addresses (sctp_connectx, multi-homing) that one rewrite of connect()'s
 * address would not cover, and the machines this was built on have no SCTP sockets at all
 * (CONFIG_IP_SCTP unset), so nothing could test it. A node process's SCTP packet to a service
 * is therefore not balanced by the eBPF datapath (the TC programs see it only on egress, where
 * no DNAT happens): node-originated SCTP to a Service is a known gap of the eBPF mode.
 *
 * REJECT becomes ECONNREFUSED from connect()/sendmsg() itself (bpf_set_retval), which is what a
 * TCP client sees after kube-proxy's ICMP port unreachable; policy drops fail with EPERM.
 *
 * Trace mode (common.h): BPF_PROG_TEST_RUN cannot run these programs, so a trace asks them through
 * a real socket of the node's cgroup and netns marked EPX_TRACE_MARK (its SO_PRIORITY the nonce).
 * The program decides as for any socket, records the decision in epx_trace, writes nothing, and
 * fails the call (return 0: EPERM), so the trace socket never sends a packet.
 *
 * IPv6 (connect6, sendmsg6, recvmsg6; lib/sock6.h): an AF_INET6 socket's destination is either
 * IPv6, decided over the IPv6 maps (epx_svc6 ..., lb6.h's lookup, policy and selection) while the
 * node's IPv6 Services are the eBPF datapath's (CFG6_F_ON, as the TC path), or IPv4-mapped
 * (::ffff:a.b.c.d), which is IPv4 on the wire: decided by the IPv4 socket LB (sock4_decide, the
 * IPv4 maps, epx_sock_rev) and written back mapped, whatever CFG6_F_ON says. The IPv6 side has
 * no localhost NodePorts (kube-proxy's route_localnet is IPv4-only: ::1 is left alone; tc_lo
 * drops what kube-proxy's INPUT rule drops of it, lib/lo6.h), no
 * egress masquerade of a bound source (a socket bound to another node address keeps it: the reply
 * comes back to the node all the same), and no mode-switch handover (as the TC path).
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/stats.h"
#include "lib/lb4.h"
#include "lib/lb6.h"
#include "lib/sock4.h"
#include "lib/sock6.h"
#include "lib/trace.h"

#define EPX_ECONNREFUSED 111

/* What a decision tells its entry to do with the call (the entry returns 1 for both PASS and
 * FORWARD: the call proceeds, rewritten or not). */
#define SOCK_FAIL 0
#define SOCK_PASS 1
#define SOCK_FORWARD 2

static __always_inline struct lb4_config *sock_config(struct bpf_sock_addr *ctx)
{
	__u32 zero = 0;
	struct lb4_config *cfg = epx_lookup(epx_config, &zero);

	if (!cfg || (cfg->host_netns_cookie && bpf_get_netns_cookie(ctx) != cfg->host_netns_cookie))
		return NULL; /* pods' own namespaces: their packets take the TC path */
	return cfg;
}

/* A decision that is not a forward, settled: recorded (trace: the call fails), or counted and the
 * call failed (SOCK_FAIL) or let through untouched (SOCK_PASS). -1: a forward (live), the caller's. */
static __always_inline int sock_settle(__u32 reason, struct epx_trace_rec *tr)
{
	if (tr) {
		tr->reason = reason == EPX_REJECT ? EPX_SOCK_REJECT : reason ? reason : EPX_SOCK_FWD;
		return SOCK_FAIL;
	}
	if (reason == EPX_REJECT) {
		stats_count(EPX_SOCK_REJECT, 0);
		bpf_set_retval(-EPX_ECONNREFUSED);
		return SOCK_FAIL;
	}
	if (reason == EPX_PASS_SOCK_EXTERNAL) {
		stats_count(reason, 0);
		return SOCK_PASS;
	}
	if (reason) {
		stats_count(reason, 0);
		return SOCK_FAIL;
	}
	return -1;
}

/* Decide an IPv4 destination daddr:dport (of an AF_INET socket, or the IPv4 inside a mapped one)
 * for a socket bound to `bound` (0: unbound). Returns SOCK_FORWARD with *out the backend,
 * SOCK_PASS (untouched) or SOCK_FAIL. With a trace record: decide, record, remember nothing, and
 * fail. */
static __always_inline int sock4_decide(struct bpf_sock_addr *ctx, __be32 daddr, __be16 dport, __be32 bound,
					int remember, struct epx_trace_rec *tr, struct lb4_backend *out)
{
	struct lb4_config *cfg = sock_config(ctx);
	__u8 proto = ctx->protocol;
	int loopback = epx_is_loopback(daddr);
	__u8 origin = loopback ? EPX_ORIGIN_LOCALHOST : EPX_ORIGIN_NODE;
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct lb4_backend be;
	__u32 backend_id, reason;
	__be32 src;
	int masq_source, settled;

	if (!cfg || (proto != IPPROTO_TCP && proto != IPPROTO_UDP)) { /* SCTP too: see above */
		if (tr)
			tr->flags |= cfg ? 0 : EPX_TRACE_F_NETNS;
		return SOCK_PASS;
	}
	svc = lb4_lookup_service(daddr, dport, proto);
	if (!svc && loopback && (cfg->flags & CFG_F_LOCALHOST_NODEPORTS)) {
		struct lb4_key key = { .addr = 0, .port = dport, .proto = proto };

		svc = epx_lookup(epx_svc, &key);
	}
	if (!svc) {
		if (tr)
			tr->reason = EPX_PASS_NO_SERVICE;
		return SOCK_PASS;
	}
	trace_service(tr, svc);
	if (cfg->flags & CFG_F_NETFILTER_FIRST) { /* a switch to the iptables mode: its OUTPUT rules decide */
		if (tr) {
			tr->reason = EPX_PASS_HANDOVER;
			return SOCK_FAIL;
		}
		stats_count(EPX_PASS_HANDOVER, 0);
		return SOCK_PASS;
	}
	/* the source kube-proxy's rules would see: the socket's own if it is bound, else the one the
	 * kernel will pick for the backend's route, the node's masquerade address */
	src = bound ?: cfg->snat_addr;
	reason = lb4_policy(svc, src, origin, cfg->flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	if (!reason)
		reason = lb4_select_backend(svc, c.scope, src, bpf_ktime_get_ns(), &backend_id, &be, tr);
	/* kube-proxy's REJECT for an externalIP or LB IP sits in KUBE-EXTERNAL-SERVICES, which only
	 * INPUT and FORWARD reach: the node's own call to one that is not its own address leaves
	 * unrejected (a nodePort on the node, 127.0.0.1 or a clusterIP is rejected: OUTPUT sees those) */
	if (reason == EPX_REJECT && (svc->flags & LB4_F_EXTERNAL) && !loopback && !epx_lookup(epx_node_addr, &daddr))
		reason = EPX_PASS_SOCK_EXTERNAL;
	settled = sock_settle(reason, tr);
	if (settled >= 0)
		return settled;
	*out = be;
	/* UDP: recvmsg shows the frontend as the peer. A socket bound to 127.0.0.0/8, or bound to
	 * another address than the masquerade one where kube-proxy masquerades, must be masqueraded
	 * on egress (nat4_masq_local), which looks for this entry. */
	masq_source = loopback || (c.masq && src != cfg->snat_addr);
	if (remember && (proto == IPPROTO_UDP || masq_source)) {
		struct sock4_rev_key key = { .cookie = epx_get_socket_cookie(ctx), .addr = be.addr, .port = be.port };
		struct sock4_rev rev = { .addr = daddr, .port = dport, .flags = masq_source ? SOCK4_F_MASQ : 0 };

		epx_update(epx_sock_rev, &key, &rev);
	}
	stats_count(EPX_SOCK_FWD, 0);
	return SOCK_FORWARD;
}

/* An AF_INET socket's call: decide its destination, rewrite it to the backend on a forward. */
static __always_inline int sock4_run(struct bpf_sock_addr *ctx, __u8 hook, struct epx_trace_rec *tr)
{
	struct lb4_backend be;
	__be32 bound = sock4_bound_source(ctx, hook == EPX_HOOK_SOCK_SENDMSG4);
	int ret = sock4_decide(ctx, ctx->user_ip4, (__be16)ctx->user_port, bound, !tr, tr, &be);

	if (ret != SOCK_FORWARD)
		return ret;
	ctx->user_ip4 = be.addr;
	ctx->user_port = be.port;
	return SOCK_PASS;
}

/* Decide an IPv6 destination: sock4_decide over the IPv6 maps, while CFG6_F_ON says the node's
 * IPv6 Services are ours (same returns). The caller has checked the netns and the protocol. */
static __always_inline int sock6_decide(struct bpf_sock_addr *ctx, const struct lb4_config *cfg,
					const struct epx_in6 *daddr, __be16 dport, const struct epx_in6 *bound,
					int remember, struct epx_trace_rec *tr, struct lb6_backend *out)
{
	const struct lb6_config *cfg6 = pkt6_config();
	__u8 proto = ctx->protocol;
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct lb6_backend be;
	struct epx_in6 src;
	__u32 backend_id, reason;
	int settled;

	if (!pkt6_served(cfg6)) { /* ip6tables serves IPv6 (or nothing does) */
		if (tr)
			tr->reason = EPX_PASS_IPV6_OFF;
		return SOCK_PASS;
	}
	/* ::1 is no NodePort address: kube-proxy's localhost NodePorts are IPv4's (route_localnet).
	 * The call proceeds untranslated; the one [::1]:<nodePort> kube-proxy drops (eTP=Local, no
	 * local endpoint) tc_lo drops on the node's lo (lib/lo6.h: a call cannot be failed silently). */
	svc = in6_is_loopback(daddr) ? NULL : lb6_lookup_service(daddr, dport, proto);
	if (!svc) {
		if (tr)
			tr->reason = EPX_PASS_NO_SERVICE;
		return SOCK_PASS;
	}
	trace_service(tr, svc);
	src = in6_is_zero(bound) ? cfg6->snat_addr : *bound;
	reason = lb6_policy(svc, &src, EPX_ORIGIN_NODE, lb6_flags(cfg, cfg6), &c);
	trace_policy(tr, EPX_ORIGIN_NODE, c.scope, c.masq);
	if (!reason)
		reason = lb6_select_backend(svc, c.scope, &src, bpf_ktime_get_ns(), &backend_id, &be, tr);
	if (reason == EPX_REJECT && (svc->flags & LB4_F_EXTERNAL) && !epx_lookup(epx_node_addr6, daddr))
		reason = EPX_PASS_SOCK_EXTERNAL; /* as sock4_decide: OUTPUT does not reach that REJECT */
	settled = sock_settle(reason, tr);
	if (settled >= 0)
		return settled;
	*out = be;
	if (remember && proto == IPPROTO_UDP) {
		struct sock6_rev_key key = { .cookie = epx_get_socket_cookie(ctx), .addr = be.addr, .port = be.port };
		struct sock6_rev rev = { .addr = *daddr, .port = dport };

		epx_update(epx_sock_rev6, &key, &rev);
	}
	stats_count(EPX_SOCK_FWD, 0);
	return SOCK_FORWARD;
}

/* An AF_INET6 socket's call: an IPv4-mapped destination goes to sock4_decide (the backend is
 * written back mapped), any other to sock6_decide. (The kernel itself hands an unconnected UDP
 * sendmsg to a mapped destination to udp_sendmsg, whose hook is sendmsg4: connect6 is where
 * mapped destinations arrive; their UDP replies come through recvmsg6 mapped.) */
static __always_inline int sock6_run(struct bpf_sock_addr *ctx, __u8 hook, struct epx_trace_rec *tr)
{
	struct epx_in6 daddr = sock6_user_addr(ctx);
	struct epx_in6 bound = sock6_bound_source(ctx, hook == EPX_HOOK_SOCK_SENDMSG6);
	__be16 dport = (__be16)ctx->user_port;
	struct lb4_config *cfg;
	struct lb6_backend be;
	int ret;

	if (in6_is_v4mapped(&daddr)) {
		struct lb4_backend be4;

		ret = sock4_decide(ctx, daddr.w[3], dport, in6_is_v4mapped(&bound) ? bound.w[3] : 0, !tr, tr, &be4);
		if (ret != SOCK_FORWARD)
			return ret;
		ctx->user_ip6[3] = be4.addr;
		ctx->user_port = be4.port;
		return SOCK_PASS;
	}
	cfg = sock_config(ctx);
	if (!cfg || (ctx->protocol != IPPROTO_TCP && ctx->protocol != IPPROTO_UDP)) {
		if (tr)
			tr->flags |= cfg ? 0 : EPX_TRACE_F_NETNS;
		return SOCK_PASS;
	}
	if (tr)
		tr->flags |= EPX_TRACE_F_IPV6;
	ret = sock6_decide(ctx, cfg, &daddr, dport, &bound, !tr, tr, &be);
	if (ret != SOCK_FORWARD)
		return ret;
	sock6_set_user_addr(ctx, &be.addr);
	ctx->user_port = be.port;
	return SOCK_PASS;
}

/* Each entry: a socket marked for tracing gets the decision recorded and the call failed (it sends
 * nothing); the run is inlined twice, once with a literal NULL, so live calls pay that one test.
 * `v6`: an AF_INET6 socket's hook (a constant at every call: only one run is inlined). */
static __always_inline int sock_entry(struct bpf_sock_addr *ctx, __u8 hook, int v6)
{
	struct bpf_sock *sk = ctx->sk;

	if (sk->mark == EPX_TRACE_MARK) {
		struct epx_trace_rec *tr = trace_begin(sk->priority, hook);

		if (tr) {
			if (v6)
				sock6_run(ctx, hook, tr);
			else
				sock4_run(ctx, hook, tr);
		}
		return 0;
	}
	return v6 ? sock6_run(ctx, hook, NULL) : sock4_run(ctx, hook, NULL);
}

int sock_connect4(struct bpf_sock_addr *ctx)
{
	return sock_entry(ctx, EPX_HOOK_SOCK_CONNECT4, 0);
}

int sock_sendmsg4(struct bpf_sock_addr *ctx)
{
	return sock_entry(ctx, EPX_HOOK_SOCK_SENDMSG4, 0);
}

int sock_connect6(struct bpf_sock_addr *ctx)
{
	return sock_entry(ctx, EPX_HOOK_SOCK_CONNECT6, 1);
}

int sock_sendmsg6(struct bpf_sock_addr *ctx)
{
	return sock_entry(ctx, EPX_HOOK_SOCK_SENDMSG6, 1);
}

/* The frontend a UDP socket sent to, for a datagram from backend addr:port (epx_sock_rev). */
static __always_inline struct sock4_rev *sock4_rev_of(struct bpf_sock_addr *ctx, __be32 addr, __be16 port)
{
	struct sock4_rev_key key = { .cookie = epx_get_socket_cookie(ctx), .addr = addr, .port = port };

	return epx_lookup(epx_sock_rev, &key);
}

/* UDP receive: a datagram from a backend shows the frontend the socket sent to as its source. */
int sock_recvmsg4(struct bpf_sock_addr *ctx)
{
	struct sock4_rev *rev;

	if (!sock_config(ctx))
		return 1;
	rev = sock4_rev_of(ctx, ctx->user_ip4, (__be16)ctx->user_port);
	if (!rev)
		return 1;
	ctx->user_ip4 = rev->addr;
	ctx->user_port = rev->port;
	stats_count(EPX_SOCK_REV, 0);
	return 1;
}

/* recvmsg4's IPv6 twin: from a mapped backend, the mapped frontend (epx_sock_rev); from an IPv6
 * one, the IPv6 frontend (epx_sock_rev6). Not gated on CFG6_F_ON: an entry exists only for a
 * socket the datapath did send to a backend, and that socket must keep seeing its frontend. */
int sock_recvmsg6(struct bpf_sock_addr *ctx)
{
	struct epx_in6 addr = sock6_user_addr(ctx);
	__be16 port = (__be16)ctx->user_port;

	if (!sock_config(ctx))
		return 1;
	if (in6_is_v4mapped(&addr)) {
		struct sock4_rev *rev = sock4_rev_of(ctx, addr.w[3], port);

		if (!rev)
			return 1;
		ctx->user_ip6[3] = rev->addr;
		ctx->user_port = rev->port;
	} else {
		struct sock6_rev_key key = { .cookie = epx_get_socket_cookie(ctx), .addr = addr, .port = port };
		struct sock6_rev *rev = epx_lookup(epx_sock_rev6, &key);

		if (!rev)
			return 1;
		sock6_set_user_addr(ctx, &rev->addr);
		ctx->user_port = rev->port;
	}
	stats_count(EPX_SOCK_REV, 0);
	return 1;
}
