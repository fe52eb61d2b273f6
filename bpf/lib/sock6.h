/* Socket facts of the IPv6 socket LB (sock_lb.c: connect6, sendmsg6, recvmsg6): a sock_addr
 * context's IPv6 addresses read and written as struct epx_in6, and the two kinds of destination an
 * AF_INET6 socket can name.
 *
 * An AF_INET6 socket reaches IPv4 too, through IPv4-mapped addresses (::ffff:a.b.c.d, RFC 4291
 * 2.5.5.2): its packets are IPv4 on the wire, so kube-proxy's IPv4 rules are the ones that see
 * them. Such a destination is decided by the IPv4 socket LB against the IPv4 maps, and the
 * backend written back mapped; the kernel's own connect/sendmsg hooks for IPv4 do not run for it.
 */
#ifndef EPX_SOCK6_H
#define EPX_SOCK6_H

#include "lib/sock4.h"
#include "lib/pkt6.h"

/* the third word of an IPv4-mapped address, 0000:ffff */
#define EPX_V4MAPPED_W2 0x0000ffff

/* The context's user address (the destination of connect6/sendmsg6, the peer of recvmsg6). The
 * verifier takes user_ip6 a 4-byte word at a time. */
static __always_inline struct epx_in6 sock6_user_addr(const struct bpf_sock_addr *ctx)
{
	struct epx_in6 a = { .w = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] } };

	return a;
}

static __always_inline void sock6_set_user_addr(struct bpf_sock_addr *ctx, const struct epx_in6 *a)
{
	ctx->user_ip6[0] = a->w[0];
	ctx->user_ip6[1] = a->w[1];
	ctx->user_ip6[2] = a->w[2];
	ctx->user_ip6[3] = a->w[3];
}

static __always_inline int in6_is_v4mapped(const struct epx_in6 *a)
{
	return !a->w[0] && !a->w[1] && a->w[2] == epx_htonl(EPX_V4MAPPED_W2);
}

static __always_inline int in6_is_loopback(const struct epx_in6 *a)
{
	return !a->w[0] && !a->w[1] && !a->w[2] && a->w[3] == epx_htonl(1);
}

/* sock4_bound_source for an AF_INET6 socket (:: when unbound): for sendmsg6 its explicit source
 * (IPV6_PKTINFO) first (only sendmsg6 programs may read msg_src_ip6), else the socket's own. */
static __always_inline struct epx_in6 sock6_bound_source(struct bpf_sock_addr *ctx, int sendmsg)
{
	struct bpf_sock *sk = ctx->sk;
	struct epx_in6 a = {};

	if (sendmsg) {
		a.w[0] = ctx->msg_src_ip6[0];
		a.w[1] = ctx->msg_src_ip6[1];
		a.w[2] = ctx->msg_src_ip6[2];
		a.w[3] = ctx->msg_src_ip6[3];
		if (!in6_is_zero(&a))
			return a;
	}
	if (sk) {
		a.w[0] = sk->src_ip6[0];
		a.w[1] = sk->src_ip6[1];
		a.w[2] = sk->src_ip6[2];
		a.w[3] = sk->src_ip6[3];
	}
	return a;
}

#endif /* EPX_SOCK6_H */
