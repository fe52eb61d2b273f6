/* Socket facts shared by the socket LB (sock_lb.c) and the TC egress program: the socket
 * cookie that ties a packet to the socket the socket LB rewrote, and the loopback test. */
#ifndef EPX_SOCK4_H
#define EPX_SOCK4_H

#include "lib/common.h"

/* bcc declares bpf_get_socket_cookie as returning 32 bits; the cookie is 64. Valid for
 * sock_addr contexts and for skbs (0 when the skb has no socket, e.g. forwarded packets). */
static __u64 (*epx_get_socket_cookie)(void *ctx) = (void *)BPF_FUNC_get_socket_cookie;

/* The address a socket is bound to (0: unbound, the kernel picks one when it connects or sends):
 * for sendmsg its explicit source (IP_PKTINFO) first (the verifier lets only sendmsg programs
 * read msg_src_ip4), else the socket's own. */
static __always_inline __be32 sock4_bound_source(struct bpf_sock_addr *ctx, int sendmsg)
{
	struct bpf_sock *sk = ctx->sk;

	if (sendmsg && ctx->msg_src_ip4)
		return ctx->msg_src_ip4;
	return sk ? sk->src_ip4 : 0;
}

static __always_inline int epx_is_loopback(__be32 addr)
{
	return (addr & epx_htonl(EPX_LOOPBACK_MASK)) == epx_htonl(EPX_LOOPBACK_NET);
}

#endif /* EPX_SOCK4_H */
