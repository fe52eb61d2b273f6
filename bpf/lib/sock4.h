/* Socket facts shared by the socket LB (sock_lb.c) and the TC egress program: the socket
 * cookie that ties a packet to the socket the socket LB rewrote, and the loopback test. */
#ifndef EPX_SOCK4_H
#define EPX_SOCK4_H

#include "lib/common.h"

/* bcc declares bpf_get_socket_cookie as returning 32 bits; the cookie is 64. Valid for
 * sock_addr contexts and for skbs (0 when the skb has no socket, e.g. forwarded packets). */
static __u64 (*epx_get_socket_cookie)(void *ctx) = (void *)BPF_FUNC_get_socket_cookie;

static __always_inline int epx_is_loopback(__be32 addr)
{
	return (addr & epx_htonl(EPX_LOOPBACK_MASK)) == epx_htonl(EPX_LOOPBACK_NET);
}

#endif /* EPX_SOCK4_H */
