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
 */
#include "lib/common.h"
#include "lib/maps.h"
#include "lib/stats.h"
#include "lib/lb4.h"
#include "lib/sock4.h"
#include "lib/trace.h"

#define EPX_ECONNREFUSED 111

static __always_inline struct lb4_config *sock_config(struct bpf_sock_addr *ctx)
{
	__u32 zero = 0;
	struct lb4_config *cfg = epx_lookup(epx_config, &zero);

	if (!cfg || (cfg->host_netns_cookie && bpf_get_netns_cookie(ctx) != cfg->host_netns_cookie))
		return NULL; /* pods' own namespaces: their packets take the TC path */
	return cfg;
}

/* Rewrite ctx's destination to a backend. Returns 1 (proceed) or 0 (fail the call). With a trace
 * record: decide, record, rewrite and remember nothing. */
static __always_inline int sock4_decide(struct bpf_sock_addr *ctx, __u8 hook, int remember, struct epx_trace_rec *tr)
{
	struct lb4_config *cfg = sock_config(ctx);
	__be32 daddr = ctx->user_ip4;
	__be16 dport = (__be16)ctx->user_port;
	__u8 proto = ctx->protocol;
	int loopback = epx_is_loopback(daddr);
	__u8 origin = loopback ? EPX_ORIGIN_LOCALHOST : EPX_ORIGIN_NODE;
	struct lb4_service *svc;
	struct lb4_choice c = {};
	struct lb4_backend be;
	__u32 backend_id, reason;
	__be32 src;
	int masq_source;

	if (!cfg || (proto != IPPROTO_TCP && proto != IPPROTO_UDP)) { /* SCTP too: see above */
		if (tr)
			tr->flags |= cfg ? 0 : EPX_TRACE_F_NETNS;
		return 1;
	}
	svc = lb4_lookup_service(daddr, dport, proto);
	if (!svc && loopback && (cfg->flags & CFG_F_LOCALHOST_NODEPORTS)) {
		struct lb4_key key = { .addr = 0, .port = dport, .proto = proto };

		svc = epx_lookup(epx_svc, &key);
	}
	if (!svc) {
		if (tr)
			tr->reason = EPX_PASS_NO_SERVICE;
		return 1;
	}
	trace_service(tr, svc);
	if (cfg->flags & CFG_F_NETFILTER_FIRST) { /* a switch to the iptables mode: its OUTPUT rules decide */
		if (tr) {
			tr->reason = EPX_PASS_HANDOVER;
			return 0;
		}
		stats_count(EPX_PASS_HANDOVER, 0);
		return 1;
	}
	/* the source kube-proxy's rules would see: the socket's own if it is bound, else the one the
	 * kernel will pick for the backend's route, the node's masquerade address */
	src = sock4_bound_source(ctx, hook == EPX_HOOK_SOCK_SENDMSG4) ?: cfg->snat_addr;
	reason = lb4_policy(svc, src, origin, cfg->flags, &c);
	trace_policy(tr, origin, c.scope, c.masq);
	if (!reason)
		reason = lb4_select_backend(svc, c.scope, src, bpf_ktime_get_ns(), &backend_id, &be, tr);
	/* kube-proxy's REJECT for an externalIP or LB IP sits in KUBE-EXTERNAL-SERVICES, which only
	 * INPUT and FORWARD reach: the node's own call to one that is not its own address leaves
	 * unrejected (a nodePort on the node, 127.0.0.1 or a clusterIP is rejected: OUTPUT sees those) */
	if (reason == EPX_REJECT && (svc->flags & LB4_F_EXTERNAL) && !loopback && !epx_lookup(epx_node_addr, &daddr))
		reason = EPX_PASS_SOCK_EXTERNAL;
	if (tr) {
		tr->reason = reason == EPX_REJECT ? EPX_SOCK_REJECT : reason ? reason : EPX_SOCK_FWD;
		return 0;
	}
	if (reason == EPX_REJECT) {
		stats_count(EPX_SOCK_REJECT, 0);
		bpf_set_retval(-EPX_ECONNREFUSED);
		return 0;
	}
	if (reason == EPX_PASS_SOCK_EXTERNAL) {
		stats_count(reason, 0);
		return 1;
	}
	if (reason) {
		stats_count(reason, 0);
		return 0;
	}
	ctx->user_ip4 = be.addr;
	ctx->user_port = be.port;
	/* UDP: recvmsg4 shows the frontend as the peer. A socket bound to 127.0.0.0/8, or bound to
	 * another address than the masquerade one where kube-proxy masquerades, must be masqueraded
	 * on egress (nat4_masq_local), which looks for this entry. */
	masq_source = loopback || (c.masq && src != cfg->snat_addr);
	if (remember && (proto == IPPROTO_UDP || masq_source)) {
		struct sock4_rev_key key = { .cookie = epx_get_socket_cookie(ctx), .addr = be.addr, .port = be.port };
		struct sock4_rev rev = { .addr = daddr, .port = dport, .flags = masq_source ? SOCK4_F_MASQ : 0 };

		epx_update(epx_sock_rev, &key, &rev);
	}
	stats_count(EPX_SOCK_FWD, 0);
	return 1;
}

/* A socket marked for tracing gets the decision recorded and the call failed: it sends nothing. */
static __always_inline int sock4_forward(struct bpf_sock_addr *ctx, __u8 hook)
{
	struct bpf_sock *sk = ctx->sk;

	if (sk->mark == EPX_TRACE_MARK) { /* the one test live sockets pay */
		struct epx_trace_rec *tr = trace_begin(sk->priority, hook);

		if (tr)
			sock4_decide(ctx, hook, 0, tr);
		return 0;
	}
	return sock4_decide(ctx, hook, 1, NULL);
}

int sock_connect4(struct bpf_sock_addr *ctx)
{
	return sock4_forward(ctx, EPX_HOOK_SOCK_CONNECT4);
}

int sock_sendmsg4(struct bpf_sock_addr *ctx)
{
	return sock4_forward(ctx, EPX_HOOK_SOCK_SENDMSG4);
}

/* UDP receive: a datagram from a backend shows the frontend the socket sent to as its source. */
int sock_recvmsg4(struct bpf_sock_addr *ctx)
{
	struct sock4_rev_key key = {
		.cookie = epx_get_socket_cookie(ctx), .addr = ctx->user_ip4, .port = (__be16)ctx->user_port,
	};
	struct sock4_rev *rev;

	if (!sock_config(ctx))
		return 1;
	rev = epx_lookup(epx_sock_rev, &key);
	if (!rev)
		return 1;
	ctx->user_ip4 = rev->addr;
	ctx->user_port = rev->port;
	stats_count(EPX_SOCK_REV, 0);
	return 1;
}
