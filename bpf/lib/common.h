/* Every map key/value struct and every constant of the datapath, defined once.
 *
 * The Python side mirrors these in ebpf_proxy/datapath/ebpf/structs.py; tests/bpf compares the
 * two (offsets and sizes against bcc's Key/Leaf types, constants against this file), so a change
 * here without the mirror fails the tests instead of corrupting maps.
 *
 * Byte order lives in the types: __be32/__be16 fields hold network order exactly as they appear
 * in packets; only the Python map module converts. Plain __u16/__u32 fields are host order.
 * Every struct is padded explicitly so that C, bcc's ctypes and our ctypes agree byte for byte.
 */
#ifndef EPX_COMMON_H
#define EPX_COMMON_H

#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/icmp.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/pkt_cls.h>

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif
#ifndef offsetof
#define offsetof(type, member) __builtin_offsetof(type, member)
#endif

/* Byte order, for constants only: packet fields stay in network order (__be*) throughout. */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define epx_htons(x) ((__be16)__builtin_bswap16(x))
#define epx_htonl(x) ((__be32)__builtin_bswap32(x))
#else
#define epx_htons(x) ((__be16)(x))
#define epx_htonl(x) ((__be32)(x))
#endif
#define epx_ntohs(x) epx_htons(x)
#define epx_ntohl(x) epx_htonl(x)
/* little-endian fields (SCTP's CRC32c) */
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define epx_cpu_to_le32(x) ((__le32)(x))
#else
#define epx_cpu_to_le32(x) ((__le32)__builtin_bswap32(x))
#endif
#define epx_le32_to_cpu(x) ((__u32)epx_cpu_to_le32(x))

/* ---- verdict and drop reasons: one per-CPU counter each (stats map index) ----
 * Every packet a program looks at is counted under exactly one reason. Helpers return 0
 * (EPX_CONTINUE) when a step does not apply, a reason when it decided. Names are mirrored by
 * structs.Reason (same names without the EPX_ prefix); keep the values dense. */
enum epx_reason {
	EPX_CONTINUE = 0,                /* not a verdict: "not mine, go on" between helpers; never counted */
	EPX_PASS_NOT_IPV4 = 1,           /* neither IPv4 nor IPv6 (ARP, LLDP, ...): untouched */
	EPX_PASS_NOT_L4 = 2,             /* IPv4 but neither TCP, UDP nor SCTP (ICMP, ...): untouched */
	EPX_PASS_NO_SERVICE = 3,         /* no connection, no service frontend: untouched */
	EPX_PASS_FRAG_UNKNOWN = 4,       /* later fragment whose first fragment was not seen here: untouched */
	EPX_FWD_NEW = 5,                 /* new connection: backend chosen, DNAT */
	EPX_FWD_ESTABLISHED = 6,         /* connection table hit: DNAT to the same backend */
	EPX_SNAT = 7,                    /* masquerade on the way to the backend */
	EPX_REV_SNAT = 8,                /* reply of a masqueraded connection: client restored as destination */
	EPX_REV_DNAT = 9,                /* reply: frontend restored as source */
	EPX_REJECT = 10,                 /* no usable endpoint: ICMP port unreachable sent back (kube-proxy REJECT) */
	EPX_DROP_MALFORMED_IP = 11,      /* bad version/IHL/total length, truncated IP header */
	EPX_DROP_MALFORMED_L4 = 12,      /* truncated TCP/UDP/SCTP header, bad TCP data offset */
	EPX_DROP_NO_LOCAL_EXTERNAL = 13, /* externalTrafficPolicy=Local, from outside, no local endpoint */
	EPX_DROP_NO_LOCAL_INTERNAL = 14, /* internalTrafficPolicy=Local, no local endpoint */
	EPX_DROP_SOURCE_RANGE = 15,      /* loadBalancerSourceRanges does not admit the client */
	EPX_DROP_NO_BACKEND = 16,        /* slot or backend entry missing (maps mid-update) */
	EPX_DROP_CT_FAILED = 17,         /* connection table update failed (a kernel error other than a full table) */
	EPX_DROP_SNAT_NO_ADDR = 18,      /* masquerade needed but no masquerade address configured */
	EPX_DROP_SNAT_NO_PORT = 19,      /* no free masquerade port for this backend */
	EPX_DROP_NAT_FAILED = 20,        /* a rewrite or checksum helper failed */
	EPX_DROP_REJECT_FAILED = 21,     /* the ICMP reject could not be built */
	EPX_SOCK_FWD = 22,               /* socket LB: connect/sendmsg rewritten to a backend */
	EPX_SOCK_REV = 23,               /* socket LB: recvmsg source restored to the frontend */
	EPX_SOCK_REJECT = 24,            /* socket LB: no usable endpoint, call fails with ECONNREFUSED */
	EPX_ARP_MASQ = 25,               /* ARP request announcing 127.0.0.0/8: sender set to the masquerade address */
	EPX_PASS_SOCK_EXTERNAL = 26,     /* socket LB: the node's own call to an externalIP/LB IP of a service without endpoints, left alone (kube-proxy rejects it only in INPUT/FORWARD) */
	EPX_DROP_CT_FULL = 27,           /* new connection, connection table full and no connection to early-drop (nf_conntrack: "table full, dropping packet") */
	EPX_EV_CT_EARLY_DROP = 28,       /* not a verdict: a connection dropped to make room for a new one (ct4_early_drop), counted once per eviction */
	EPX_ICMP_RELATED = 29,           /* ICMP error about a tracked connection: quoted and outer headers translated, as conntrack NAT does */
	EPX_PASS_ICMP_NO_CT = 30,        /* ICMP error quoting no connection this hook translates: untouched */
	EPX_PASS_ICMP_MALFORMED = 31,    /* ICMP error whose quoted header is truncated or invalid: untouched, never translated */
	EPX_PASS_HANDOVER = 32,          /* mode switch: no connection here, left to netfilter's conntrack, which holds the other mode's connections (CFG_F_NETFILTER_*) */
	EPX_DROP_HANDOVER_HELD = 33,     /* mode switch: the connection is being moved between epx_ct4 and the kernel's conntrack (CT4_S_HELD), for microseconds; TCP retransmits */
	/* host routing (fib4.h, CFG_F_HOST_ROUTING): where a packet tc_ingress translated, or a reply of a
	 * tracked connection, went next; one event per such packet, beside its verdict */
	EPX_EV_HOST_ROUTED_PEER = 34,    /* not a verdict: fast path, delivered straight into a local pod (bpf_fib_lookup, bpf_redirect_peer), the host stack skipped */
	EPX_EV_HOST_ROUTED_NEIGH = 35,   /* not a verdict: fast path, sent straight to the route's next hop (bpf_fib_lookup, bpf_redirect_neigh), the host stack skipped */
	EPX_EV_HOST_STACK_FIB = 36,      /* not a verdict: slow path, the route lookup gave no decision to act on (no neighbour yet, local, unreachable, forwarding off, reverse-path check, ICMP redirect due) */
	EPX_EV_HOST_STACK_MTU = 37,      /* not a verdict: slow path, larger than the route's MTU: the kernel fragments it or answers fragmentation needed */
	EPX_EV_HOST_STACK_SKIP = 38,     /* not a verdict: slow path, not a packet to route here (fragment, IP options, TTL <= 1, not for this host, mark, mode switch) */
	EPX_PASS_IPV6_FRAG = 39,         /* IPv6 packet with a fragment header: untouched (no IPv6 fragment tracking; the ip6tables mode reassembles) */
	EPX_PASS_IPV6_NOT_L4 = 40,       /* IPv6 but neither TCP, UDP nor SCTP after the extension headers (ICMPv6, neighbour discovery, ESP, ...): untouched */
	EPX_DROP_MALFORMED_IPV6 = 41,    /* bad IPv6 version or payload length, truncated IPv6 or extension header */
	EPX_DROP_IPV6_EXTHDRS = 42,      /* IPv6 extension header chain longer than the parser walks (pkt6.h): dropped, so that no chain carries a packet past the service rules */
	EPX_PASS_IPV6_UNTRACED = 43,     /* no longer recorded (IPv6 trace runs are explained since): was "trace run of an IPv6 packet, nothing decided"; kept so that no number moves */
	EPX_PASS_IPV6_OFF = 44,          /* IPv6 while the eBPF datapath does not serve it (CFG6_F_ON unset: ip6tables does): untouched */
	EPX_DROP_SCTP_FRAG = 45,         /* SCTP first fragment whose port must change: its CRC32c covers the whole datagram, whose length a first fragment does not tell (sctp.h) */
	EPX_PASS_ICMP6_EXTHDRS = 46,     /* ICMPv6 error whose quoted packet has a longer extension header chain than the parser walks (pkt6.h): untouched, never translated */
	EPX_PASS_ICMP6_FRAG = 47,        /* ICMPv6 error quoting a packet with a fragment header: untouched (no IPv6 fragment tracking: such a packet was never translated) */
	EPX_DROP_LOCALHOST6_NO_LOCAL = 48, /* [::1]:<nodePort> of an externalTrafficPolicy=Local NodePort without a local endpoint, on the node's lo (kube-proxy's IPv6 rules never DNAT ::1; its INPUT rule "has no local endpoints" drops it) */
	EPX_EV_CT_PORT_REMAP = 49,       /* not a verdict: a new connection's client port was taken toward its backend by another live connection (same client port, another frontend): it leaves with another source port, as netfilter's NAT remaps a clashing tuple (ct4.h: ct4_port_alloc); counted once per connection */
	EPX_EV_CT_CLOSED_FORGOTTEN = 50, /* not a verdict: a SYN (SCTP: INIT) met the entries of a connection that had closed (FIN or RST seen): that connection was forgotten whole, so the new one, a reused client port, starts afresh (lb4_forward), or passes as it came where another node translated it (nat4_snat, nat4_rev_dnat); counted once per connection forgotten */
	EPX_REASON_MAX = 51,
};
#define EPX_DROP_FIRST EPX_DROP_MALFORMED_IP
#define EPX_DROP_LAST EPX_DROP_REJECT_FAILED /* and EPX_DROP_CT_FULL, _HANDOVER_HELD, _MALFORMED_IPV6, _IPV6_EXTHDRS, _SCTP_FRAG, _LOCALHOST6_NO_LOCAL, appended later (epx_is_drop) */

/* ---- packet facts ---- */
#define EPX_MAX_IP_HLEN 60
#define EPX_ICMP_QUOTE_MAX (EPX_MAX_IP_HLEN + 8) /* quoted IP header + first 8 L4 bytes */

/* Where a packet comes from, as kube-proxy's rules distinguish it. */
#define EPX_ORIGIN_POD 0      /* a pod of this node, as the local-traffic detector says (lb4_local_pod) */
#define EPX_ORIGIN_NODE 1     /* source is one of this node's addresses */
#define EPX_ORIGIN_EXTERNAL 2 /* anything else */
#define EPX_ORIGIN_LOCALHOST 3 /* a node process to 127.0.0.0/8:<nodePort> (socket LB only) */

/* 127.0.0.0/8, in network order once converted with epx_htonl */
#define EPX_LOOPBACK_NET 0x7f000000
#define EPX_LOOPBACK_MASK 0xff000000

/* ---- services: frontend -> service ---- */
struct lb4_key {
	__be32 addr;  /* clusterIP, externalIP or LB IP; 0 = any node address (a NodePort) */
	__be16 port;  /* service port, or the nodePort */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP / IPPROTO_SCTP */
	__u8 pad;
};

/* lb4_service.flags */
#define LB4_F_EXTERNAL 0x01      /* nodePort/externalIP/LB frontend: externalTrafficPolicy applies */
#define LB4_F_ETP_LOCAL 0x02     /* externalTrafficPolicy=Local */
#define LB4_F_ITP_LOCAL 0x04     /* internalTrafficPolicy=Local */
#define LB4_F_SOURCE_RANGES 0x08 /* LB frontend with loadBalancerSourceRanges: consult src_ranges */
#define LB4_F_HAS_ENDPOINTS 0x10 /* a usable endpoint exists anywhere (else REJECT) */
#define LB4_F_SLOT_BANK 0x20     /* the slots are bank 1's (see lb4_slot_key.bank) */

struct lb4_service {
	__u32 id;               /* service-port id: keys slots, affinity and source ranges */
	__u16 count;            /* cluster slots 0..count-1 (Cluster traffic policy) */
	__u16 local_count;      /* local slots 0..local_count-1 (this node's endpoints) */
	__u32 affinity_timeout; /* seconds; 0 = no session affinity */
	__u32 flags;            /* LB4_F_* */
};

/* ---- backend slots: (service, scope, slot) -> backend id ---- */
#define LB4_SCOPE_CLUSTER 0
#define LB4_SCOPE_LOCAL 1

struct lb4_slot_key {
	__u32 svc_id;
	__u16 slot;
	__u8 scope; /* LB4_SCOPE_*: cluster and local slots are separate ranges */
	__u8 bank;  /* 0 or 1: a service's slots are rewritten in the bank its frontends do not use, then
		     * each frontend is switched with one write (LB4_F_SLOT_BANK), so a frontend only
		     * ever sees a complete backend set, even if the writer dies halfway */
};

/* lb4_backend.flags: which endpoint sets of its service the backend belongs to */
#define LB4_BE_IN_CLUSTER 0x01
#define LB4_BE_IN_LOCAL 0x02

/* backends: id -> address. Ids are per (service port, endpoint) and never reused. */
struct lb4_backend {
	__be32 addr;
	__be16 port;
	__u8 flags; /* LB4_BE_* */
	__u8 pad;
};

/* ---- session affinity (sessionAffinity=ClientIP) ---- */
struct lb4_affinity_key {
	__u32 svc_id;
	__be32 client;
};

struct lb4_affinity {
	__u64 last_used; /* bpf_ktime_get_ns() of the last new connection that used it */
	__u32 backend_id;
	__u32 pad;
};

/* ---- LPM keys: cluster CIDRs, and loadBalancerSourceRanges per service ---- */
struct lpm4_key {
	__u32 prefixlen;
	__be32 addr;
};

struct lb4_range_key {
	__u32 prefixlen; /* 32 (the service id) + the CIDR's prefix length */
	__u32 svc_id;
	__be32 addr;
};

/* ---- connection table ----
 * One hash map (not LRU: an LRU evicts idle established connections first) holds four kinds of entries, told apart by ct4_key.kind:
 *   CT4_SVC       client -> frontend         nat = backend            (ingress, forward DNAT)
 *   CT4_REV_DNAT  backend -> client          nat = frontend           (egress, reply source restore)
 *   CT4_SNAT      client -> backend          nat = masquerade addr    (egress, forward SNAT)
 *   CT4_REV_SNAT  backend -> masq addr:port  nat = client             (ingress, reply destination restore)
 * Only the CT4_SVC entry carries the lifetime; the other three carry the frontend (svc_addr,
 * svc_port) so that they can find their owner and are honoured only while it is alive. */
#define CT4_SVC 0
#define CT4_REV_DNAT 1
#define CT4_SNAT 2
#define CT4_REV_SNAT 3

struct ct4_key {
	__be32 saddr;
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 kind; /* CT4_* */
	__u16 pad;
};

/* ct4_entry.flags */
#define CT4_F_MASQ 0x01       /* connection is masqueraded (SNAT entries exist) */
#define CT4_F_SEEN_REPLY 0x02 /* a reply went back: established timeouts apply */
#define CT4_F_CLOSING 0x04    /* TCP FIN or RST seen, SCTP ABORT or SHUTDOWN COMPLETE: closing timeout applies */
#define CT4_F_SOCK_MASQ 0x08  /* a node socket masqueraded on egress (nat4_masq_local): no packet of it
			       * crosses lb4_forward, so the SNAT halves keep it alive */
/* TCP close tracking (ct4_tcp_state): when may a masquerade port be handed to a new connection? */
#define CT4_F_FIN_ORIG 0x10   /* the client sent FIN */
#define CT4_F_FIN_REPLY 0x20  /* the backend sent FIN */
#define CT4_F_TIME_WAIT 0x40  /* the backend closed first: it keeps the tuple in TIME_WAIT (60 s) */
#define CT4_F_DONE 0x80       /* over, and the backend holds nothing of it (RST, or it closed second
			       * and the client acknowledged its FIN; SCTP: ABORT or SHUTDOWN COMPLETE,
			       * after which neither end keeps the association): its masquerade port is free */

struct ct4_entry {
	__u64 expires;    /* CT4_SVC: bpf_ktime_get_ns() deadline */
	__be32 nat_addr;  /* see the table above */
	__be32 svc_addr;  /* frontend of the owning connection */
	__be16 nat_port;
	__be16 svc_port;
	__u32 backend_id; /* CT4_SVC: chosen backend */
	__be32 snat_addr; /* CT4_SVC with CT4_F_MASQ: the source the backend sees */
	__be16 snat_port;
	__u8 flags;       /* CT4_F_* */
	__u8 state;       /* CT4_S_* */
};

/* ct4_entry.state */
#define CT4_S_ASSURED 0x01 /* nf_conntrack's ASSURED: the client spoke again after the first reply
			    * (TCP: the handshake's last ACK; UDP: a stream, not a one-shot query such
			    * as DNS). Only such a connection is never early-dropped for a new one. */
#define CT4_S_HELD 0x02    /* a mode switch moves it (agent/handover.py): its packets are dropped until
			    * the kernel's conntrack entry for it is gone or made; with both in place,
			    * netfilter would track our translated packets as a new connection and its
			    * NAT would give them another source port */
#define CT4_S_REMAP 0x04   /* the client's port was taken toward this backend by another live connection
			    * (the same client port through another frontend): like netfilter's NAT on a
			    * clashing tuple, the connection leaves with another source port. On the
			    * CT4_SVC entry: snat_port = the port on the wire, snat_addr = the client (or,
			    * with CT4_F_MASQ, the masquerade address: the port is the masquerade port from
			    * DNAT on). Its CT4_REV_DNAT and CT4_SNAT halves are keyed by that port and keep
			    * the client's own port in snat_port (the reply's destination gets it back); a
			    * masqueraded one's CT4_REV_SNAT half sends the reply on to that port */

/* ---- connection table pressure: the connections each CPU created, oldest first ----
 * A queue (per CPU: no atomics) of CT4_SVC keys in creation order. When epx_ct4 is full,
 * ct4_early_drop takes up to CT4_EVICT_SCAN keys off its old end and drops the first connection
 * that may go (not assured, expired, or TCP closing), as nf_conntrack's early_drop looks for
 * a non-assured entry; none: the new connection is dropped (EPX_DROP_CT_FULL). Keys taken off
 * and kept (established connections) leave the queue: they are not looked at again. */
#define CT4_RING_SLOTS 512 /* a power of two */
#define CT4_EVICT_SCAN 8   /* nf_conntrack's NF_CT_EVICTION_RANGE */

struct ct4_ring {
	__u32 head; /* the next slot to write (counts up; slot = head % CT4_RING_SLOTS) */
	__u32 tail; /* the oldest key not yet taken off; head - tail <= CT4_RING_SLOTS */
	struct ct4_key half; /* scratch for ct4_forget's keys: tc_ingress's 512-byte stack is full */
	struct ct4_key keys[CT4_RING_SLOTS]; /* CT4_SVC keys */
	/* scratch, for the same full stack: fib4.h's route lookups and redirect (host routing), and
	 * icmp4_reject's zero padding (it clears what it uses). Per CPU, and a program runs to its end
	 * on one CPU, so nothing else writes it meanwhile. */
	struct bpf_fib_lookup fib;
	/* scratch, for the same full stack: the half entries ct4_create writes (ct4.h), the reply's
	 * (CT4_REV_DNAT) and the masquerade's (CT4_SNAT, CT4_REV_SNAT). The connection's own entry
	 * stays on the stack, where the verifier knows the flags ct4_touch branches on. */
	struct ct4_entry rev_dnat;
	struct ct4_entry snat;
	struct ct4_entry rev_snat;
};

/* ---- IPv4 fragments: ports of a datagram, learnt from its first fragment ---- */
struct frag4_key {
	__be32 saddr;
	__be32 daddr;
	__be16 id;
	__u8 proto;
	__u8 pad;
};

struct frag4_ports {
	__be16 sport;
	__be16 dport;
};

/* ---- socket LB: what a UDP socket's recvmsg must show as the peer ---- */
struct sock4_rev_key {
	__u64 cookie;   /* socket cookie */
	__be32 addr;    /* backend */
	__be16 port;
	__u16 pad;
};

/* sock4_rev.flags */
#define SOCK4_F_MASQ 0x01 /* the socket's bound source must be masqueraded on egress (nat4_masq_local) */

struct sock4_rev {
	__be32 addr;    /* frontend */
	__be16 port;
	__u16 flags;    /* SOCK4_F_* */
};

/* ---- node configuration: a single-entry array ---- */
#define CFG_F_MASQ_ALL 0x01            /* --masquerade-all */
#define CFG_F_LOCALHOST_NODEPORTS 0x02 /* socket LB: NodePorts answer on 127.0.0.0/8 too */
/* The local-traffic detector (--detect-local-mode): by source CIDR (epx_pod_cidr: ClusterCIDR,
 * NodeCIDR) when neither flag is set, by ingress interface (epx_iface: BridgeInterface,
 * InterfaceNamePrefix), or none: kube-proxy's no-op detector, which cannot tell pods from the
 * rest and so writes neither its "masquerade off-cluster clusterIP traffic" rule nor its
 * "pod traffic to an eTP=Local external destination goes to every endpoint" rule. */
#define CFG_F_DETECT_NONE 0x04
#define CFG_F_DETECT_IFACE 0x08
/* A mode switch in progress (agent/handover.py): the other mode's rules are in place and the
 * kernel's conntrack translates its connections until each is moved (into epx_ct4, or out of it).
 * NETFILTER_FIRST: a packet without an entry here is netfilter's, even a SYN (handing over to the
 * iptables mode; and taking over from it, until the connections it had are moved).
 * NETFILTER_MIDSTREAM: a SYN without an entry is a new connection, ours; any other packet without
 * one is netfilter's (taking over: the connections its rules made last are still being moved). */
#define CFG_F_NETFILTER_MIDSTREAM 0x10
#define CFG_F_NETFILTER_FIRST 0x20
/* Connections taken over from the kernel's conntrack were masqueraded by it outside
 * [snat_port_min, snat_port_max]: a reply to any port of snat_addr may be theirs (nat4_is_masq_dest).
 * Cleared by the agent once none of them is left. */
#define CFG_F_ADOPTED_MASQ 0x40
/* Host routing (--bpf-host-routing, fib4.h): tc_ingress forwards what it translated itself, with
 * bpf_fib_lookup and bpf_redirect_peer / bpf_redirect_neigh, instead of handing it to the host's
 * routing, neighbour and netfilter stack. A flag, not a build option: flipped without a reload. */
#define CFG_F_HOST_ROUTING 0x80

/* ---- devices: ifindex -> EPX_IF_* (epx_iface), written by the agent as devices come and go ---- */
#define EPX_IF_POD 0x01   /* a pod's veth (its packets may be CHECKSUM_PARTIAL, see icmp4.h) */
#define EPX_IF_LOCAL 0x02 /* interface detectors: a packet arriving here enters the IP layer through
			   * the bridge (BridgeInterface) or a device named with the prefix
			   * (InterfaceNamePrefix): kube-proxy's `-i` match says "local" */
#define EPX_IF_PEER 0x04  /* a veth whose other end is in another netns (a pod's): bpf_redirect_peer
			   * can deliver into it (on any other device the helper drops the packet) */
#define EPX_IF_NO_REDIRECTS 0x08 /* sends no ICMP redirects (send_redirects off for it and for all):
				  * a packet routed back out of it may take the fast path (fib4.h) */
/* Bits 16-31 of a device's epx_iface value: the smallest MTU metric of a route out of it (0: none).
 * Forwarding honours a route's MTU (ip_dst_mtu_maybe_forward); bpf_fib_lookup's MTU check does
 * only when it is locked: fib4.h checks this one too, so a packet the kernel would refuse as too
 * big takes the slow path. */
#define EPX_IF_MTU_SHIFT 16

struct lb4_config {
	__be32 snat_addr;        /* masquerade source: this node's primary address */
	__u16 snat_port_min;     /* masquerade port range (host order), outside ip_local_port_range */
	__u16 snat_port_max;
	__u32 flags;             /* CFG_F_* */
	__u32 tcp_syn_timeout;   /* seconds, until the first reply */
	__u32 tcp_est_timeout;   /* seconds, after a reply */
	__u32 tcp_close_timeout; /* seconds, after FINs both ways or RST */
	__u32 udp_timeout;       /* seconds, until the first reply */
	__u32 udp_stream_timeout;/* seconds, after a reply */
	__u32 tcp_close_wait_timeout; /* seconds, after a FIN one way only (conntrack's CLOSE_WAIT) */
	/* SCTP: kube-proxy sets no SCTP conntrack timeout, so nf_conntrack's defaults apply (three
	 * fields: the first in what was padding, the others after host_netns_cookie, which keeps its
	 * offset) */
	__u32 sctp_timeout;      /* seconds, until the first reply (COOKIE_WAIT, COOKIE_ECHOED: 3) */
	__u64 host_netns_cookie; /* socket LB acts only in this netns (0: every netns) */
	__u32 sctp_est_timeout;  /* seconds, after a reply (ESTABLISHED: 210; heartbeats every 30 s keep it) */
	__u32 sctp_close_timeout;/* seconds, after ABORT or SHUTDOWN COMPLETE (CLOSED: 10) */
};

/* ---- per-CPU counters ---- */
struct epx_stat {
	__u64 packets;
	__u64 bytes;
};

/* ---- trace mode: one packet explained by the real programs, without touching any state ----
 * `ebpf-proxy trace` (ebpf_proxy/explain/ebpf_trace.py) asks the loaded programs what they would
 * do with a packet. Live packets never carry the signal, so they pay one predictable branch:
 *   TC    BPF_PROG_TEST_RUN with a struct __sk_buff ctx: mark = EPX_TRACE_MARK,
 *         cb[0] = EPX_TRACE_MAGIC, cb[1] = the caller's nonce (both: a live skb's mark may be
 *         anything another program set, its cb[] is scratch space)
 *   XDP   BPF_PROG_TEST_RUN with a struct epx_trace_meta in front of the frame (data_meta)
 *   sock  a node socket with SO_MARK = EPX_TRACE_MARK and SO_PRIORITY = the nonce calling
 *         connect() (TCP) or sendto() (UDP): the program decides, records, and fails the call, so
 *         nothing is ever sent (BPF_PROG_TEST_RUN cannot run CGROUP_SOCK_ADDR programs)
 * A trace run is a dry run: the same decision as a live packet's (origin, policy, backend choice
 * including the affinity lookup), but no connection-table entry, no affinity entry, no masquerade
 * port, no fragment entry and no counter is written. What it decided goes to epx_trace (per-CPU,
 * one entry: the reader picks the CPU whose record carries its nonce). */
#define EPX_TRACE_MARK 0x65707874  /* "epxt" */
#define EPX_TRACE_MAGIC 0x54524143 /* "TRAC" */

struct epx_trace_meta {
	__u32 magic; /* EPX_TRACE_MAGIC */
	__u32 nonce;
};

/* epx_trace_rec.hook: the program that wrote the record */
#define EPX_HOOK_XDP 1
#define EPX_HOOK_TC_INGRESS 2
#define EPX_HOOK_TC_EGRESS 3
#define EPX_HOOK_SOCK_CONNECT4 4
#define EPX_HOOK_SOCK_SENDMSG4 5
#define EPX_HOOK_SOCK_CONNECT6 6 /* connect6, for IPv6 and IPv4-mapped destinations alike */
#define EPX_HOOK_SOCK_SENDMSG6 7

/* epx_trace_rec.flags */
#define EPX_TRACE_F_SERVICE 0x01     /* a service frontend matched (svc_* are set) */
#define EPX_TRACE_F_POLICY 0x02      /* lb4_policy ran (origin, scope, masq are set) */
#define EPX_TRACE_F_BACKEND 0x04     /* a backend was chosen (backend_* are set) */
#define EPX_TRACE_F_ESTABLISHED 0x08 /* the connection table already holds the flow: its backend */
#define EPX_TRACE_F_AFFINITY 0x10    /* session affinity picked the backend */
#define EPX_TRACE_F_SNAT 0x20        /* egress: the source became snat_addr:snat_port */
#define EPX_TRACE_F_NETNS 0x40       /* socket LB: not the node's netns, nothing done */
#define EPX_TRACE_F_IPV6 0x80        /* an IPv6 decision: the addresses are backend_addr6 / snat_addr6 */

/* epx_trace_rec.masq */
#define EPX_TRACE_MASQ_POLICY 0x01  /* lb4_policy masquerades (or the connection table says so) */
#define EPX_TRACE_MASQ_HAIRPIN 0x02 /* a pod landing on itself */

struct epx_trace_rec {
	__u32 nonce;         /* the caller's, echoed: tells its record from another CPU's */
	__u32 reason;        /* enum epx_reason: the verdict (CONTINUE: XDP passed it on) */
	__u32 svc_id;
	__u32 svc_flags;     /* LB4_F_* of the frontend */
	__u32 backend_id;
	__be32 backend_addr;
	__be16 backend_port;
	__u16 svc_count;     /* cluster slots when decided */
	__u16 svc_local_count;
	__u8 hook;           /* EPX_HOOK_* */
	__u8 origin;         /* EPX_ORIGIN_* */
	__u8 scope;          /* LB4_SCOPE_* */
	__u8 masq;           /* EPX_TRACE_MASQ_* */
	__u8 flags;          /* EPX_TRACE_F_* */
	__u8 pad;
	__be32 snat_addr;    /* egress SNAT, or an established connection's masquerade source */
	__be16 snat_port;
	__u16 pad2;
	__u32 ifindex;       /* the device the program saw (TC: skb->ifindex, XDP: the ingress device) */
	/* EPX_TRACE_F_IPV6: backend_addr and snat_addr's IPv6 twins (struct epx_in6's words, which is
	 * defined below with the rest of IPv6) */
	__be32 backend_addr6[4];
	__be32 snat_addr6[4];
};

/* ================= IPv6 (issue 10): the same datapath for the other family =================
 * Separate maps (bpf/maps.c: epx_*6), so that the IPv6 proxier's service and backend ids, written
 * by its own writer, live in their own id space and never collide with IPv4's.
 *
 * Addresses are struct epx_in6: four __be32 words holding the 16 bytes in network order, exactly
 * as in the packet. Words rather than __u8[16]: addresses are compared and copied a word at a time
 * (in6_eq), bpf_csum_diff takes __be32 arrays for the checksum fix-ups, and a struct (not a bare
 * array) can be assigned, returned and used as a map key (epx_node_addr6).
 *
 * Family-free structs are reused, not duplicated: epx_svc6's value is struct lb4_service,
 * epx_slot6's key struct lb4_slot_key, epx_affinity6's value struct lb4_affinity, epx_stats and
 * epx_iface are shared, and so are the LB4_F_*, LB4_SCOPE_*, LB4_BE_*, CT4_* kind/flag/state
 * constants, EPX_ORIGIN_* and the lifetimes and port range of epx_config (struct lb4_config). */
struct epx_in6 {
	__be32 w[4];
};

/* ---- services: frontend -> struct lb4_service ---- */
struct lb6_key {
	struct epx_in6 addr; /* clusterIP, externalIP or LB IP; :: = any node address (a NodePort) */
	__be16 port;
	__u8 proto;          /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad;
};

/* backends: id -> address (ids: the IPv6 writer's own, see above) */
struct lb6_backend {
	struct epx_in6 addr;
	__be16 port;
	__u8 flags; /* LB4_BE_* */
	__u8 pad;
};

/* session affinity: (service, client) -> struct lb4_affinity */
struct lb6_affinity_key {
	__u32 svc_id;
	struct epx_in6 client;
};

/* LPM keys: the pod CIDRs (epx_pod_cidr6), and loadBalancerSourceRanges per service */
struct lpm6_key {
	__u32 prefixlen;
	struct epx_in6 addr;
};

struct lb6_range_key {
	__u32 prefixlen; /* 32 (the service id) + the CIDR's prefix length */
	__u32 svc_id;
	struct epx_in6 addr;
};

/* ---- connection table: the same four kinds (CT4_SVC, CT4_REV_DNAT, CT4_SNAT, CT4_REV_SNAT) and
 * the same flags and states as ct4, with 16-byte addresses. No early-drop queue and no mode-switch
 * handover for IPv6 yet: a full table refuses the new connection (EPX_DROP_CT_FULL). */
struct ct6_key {
	struct epx_in6 saddr;
	struct epx_in6 daddr;
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 kind; /* CT4_* */
	__u16 pad;
};

struct ct6_entry {
	__u64 expires;            /* CT4_SVC: bpf_ktime_get_ns() deadline */
	struct epx_in6 nat_addr;  /* as ct4_entry's */
	struct epx_in6 svc_addr;  /* frontend of the owning connection */
	__be16 nat_port;
	__be16 svc_port;
	__u32 backend_id;         /* CT4_SVC: chosen backend */
	struct epx_in6 snat_addr; /* CT4_SVC with CT4_F_MASQ: the source the backend sees */
	__be16 snat_port;
	__u8 flags;               /* CT4_F_* */
	__u8 state;               /* CT4_S_* */
	__u32 pad;
};

/* ---- per-CPU scratch of the IPv6 path (epx_scratch6, one entry): the connection steps' 40-byte
 * keys and 72-byte entries, inlined at every step, do not fit tc_ingress's 512-byte stack beside
 * the IPv4 path (the reason ct4_ring has its `half`), nor do the REJECT's quote and options. A
 * packet runs to completion on its CPU, so one set per CPU suffices; each field has one job, so
 * that nested steps never share one. ---- */
#define EPX_IPV6_MAX_EXTLEN 256 /* bytes of extension headers the parser walks (pkt6.h) */
#define EPX_ICMP6_QUOTE_MAX (40 + EPX_IPV6_MAX_EXTLEN + 8) /* icmp6.h: IPv6 header, extension headers, 8 L4 bytes */
#define EPX_ICMP6_PARTIAL_PAD 24 /* icmp6.h: destination-options bytes from the original L4 offset on */
#define EPX_ICMP6_OPTS_MAX (EPX_IPV6_MAX_EXTLEN + EPX_ICMP6_PARTIAL_PAD)

struct scratch6 {
	struct ct6_key key;    /* the step's own key: lookups, ct6_create's and ct6_port_alloc's writes */
	struct ct6_key owner;  /* ct6_owner: the CT4_SVC key of a half's connection */
	struct ct6_key half;   /* ct6_forget: the halves it removes */
	struct ct6_entry gone; /* ct6_forget: the connection removed, read before its entry goes */
	struct ct6_entry val;  /* ct6_create: the entries it writes */
	__u8 quote[EPX_ICMP6_QUOTE_MAX]; /* icmp6_reject: the quoted packet, moved behind the new headers */
	__u8 opts[EPX_ICMP6_OPTS_MAX];   /* icmp6_reject: its destination-options header (a pod's packet) */
};

/* ---- socket LB for IPv6 sockets (sock_lb.c: connect6/sendmsg6/recvmsg6): what a UDP socket's
 * recvmsg6 must show as the peer. An IPv4-mapped destination (::ffff:a.b.c.d) is IPv4 traffic and
 * uses epx_sock_rev. No flags yet: a node socket sending IPv6 is never masqueraded on egress (no
 * nat4_masq_local twin), so there is nothing to mark. ---- */
struct sock6_rev_key {
	__u64 cookie;        /* socket cookie */
	struct epx_in6 addr; /* backend */
	__be16 port;
	__u16 pad;
	__u32 pad2;
};

struct sock6_rev {
	struct epx_in6 addr; /* frontend */
	__be16 port;
	__u16 pad;
};

/* ---- node configuration for IPv6: a single-entry array beside epx_config, which keeps the
 * flags, the masquerade port range and the lifetimes for both families ---- */
/* lb6_config.flags */
#define CFG6_F_ON 0x01 /* this node's IPv6 Services are the eBPF datapath's: the programs act on IPv6.
			* Unset (the agent serves IPv6 with ip6tables, or programs none), IPv6 packets are
			* untouched (EPX_PASS_IPV6_OFF): not parsed, translated or dropped. */
#define CFG6_F_DETECT_NONE 0x02 /* IPv6's local-traffic detector is kube-proxy's no-op one (a CIDR
				 * detector without an IPv6 CIDR): for IPv6 it replaces epx_config's
				 * CFG_F_DETECT_NONE, which says the same of IPv4 (lb6_flags) */

struct lb6_config {
	struct epx_in6 snat_addr; /* IPv6 masquerade source (:: = none: masquerade drops, SNAT_NO_ADDR) */
	__u32 flags;              /* CFG6_F_* */
};

#endif /* EPX_COMMON_H */
