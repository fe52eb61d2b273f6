/* pktgen: the bench's raw-packet generator for the XDP NodePort row (bench/xdppps.py).
 *
 * Sends TCP SYN frames, as fast as one thread can, from an outside client's interface straight to
 * a node's MAC address: every frame a new connection attempt (source port and sequence number
 * change), so each one is a NodePort lookup at the node, never a conntrack hit. The sockets API
 * (connect) cannot do this: one SYN per socket and the client's own stack would be what is
 * measured. AF_PACKET with PACKET_QDISC_BYPASS and sendmmsg batches keeps the sender cheap, so the
 * rate it reaches says how much the receiving node spends per packet (on a veth the receiver's
 * processing runs on the sender's CPU, in the same softirq).
 *
 * Usage: pktgen --ifname eth0 --dst-mac 02:..:ff --src-ip A --dst-ip B --dport N --seconds S
 *               [--batch 64]
 * Prints one JSON object: {"sent": frames, "errors": failed sends, "seconds": elapsed}.
 * Exit 2 on bad arguments (the message names the argument), 1 on a socket error.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_BATCH 256
#define FRAME_LEN (sizeof(struct ether_header) + sizeof(struct iphdr) + sizeof(struct tcphdr))

struct options {
	const char *ifname;
	unsigned char dst_mac[6];
	struct in_addr src, dst;
	unsigned dport;
	double seconds;
	unsigned batch;
};

static void usage_error(const char *what, const char *value)
{
	fprintf(stderr, "pktgen: %s: %s\n", what, value ? value : "missing");
	exit(2);
}

static void parse_mac(const char *text, unsigned char mac[6])
{
	unsigned v[6];
	char extra;

	if (sscanf(text, "%x:%x:%x:%x:%x:%x%c", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &extra) != 6)
		usage_error("--dst-mac is not a MAC address", text);
	for (int i = 0; i < 6; i++) {
		if (v[i] > 255)
			usage_error("--dst-mac is not a MAC address", text);
		mac[i] = (unsigned char)v[i];
	}
}

static struct options parse_args(int argc, char **argv)
{
	struct options o = {.batch = 64, .seconds = -1};
	int have_mac = 0, have_src = 0, have_dst = 0;

	for (int i = 1; i < argc; i++) {
		const char *arg = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
		char *end;

		if (!val)
			usage_error(arg, "needs a value");
		i++;
		if (!strcmp(arg, "--ifname")) {
			o.ifname = val;
		} else if (!strcmp(arg, "--dst-mac")) {
			parse_mac(val, o.dst_mac);
			have_mac = 1;
		} else if (!strcmp(arg, "--src-ip")) {
			if (inet_pton(AF_INET, val, &o.src) != 1)
				usage_error("--src-ip is not an IPv4 address", val);
			have_src = 1;
		} else if (!strcmp(arg, "--dst-ip")) {
			if (inet_pton(AF_INET, val, &o.dst) != 1)
				usage_error("--dst-ip is not an IPv4 address", val);
			have_dst = 1;
		} else if (!strcmp(arg, "--dport")) {
			unsigned long v = strtoul(val, &end, 10);

			if (*end || v < 1 || v > 65535)
				usage_error("--dport is not a port (1-65535)", val);
			o.dport = (unsigned)v;
		} else if (!strcmp(arg, "--seconds")) {
			o.seconds = strtod(val, &end);
			if (*end || !(o.seconds > 0 && o.seconds <= 3600))
				usage_error("--seconds is not in (0, 3600]", val);
		} else if (!strcmp(arg, "--batch")) {
			unsigned long v = strtoul(val, &end, 10);

			if (*end || v < 1 || v > MAX_BATCH)
				usage_error("--batch is not in 1-256", val);
			o.batch = (unsigned)v;
		} else {
			usage_error("unknown option", arg);
		}
	}
	if (!o.ifname)
		usage_error("--ifname", NULL);
	if (!have_mac)
		usage_error("--dst-mac", NULL);
	if (!have_src)
		usage_error("--src-ip", NULL);
	if (!have_dst)
		usage_error("--dst-ip", NULL);
	if (!o.dport)
		usage_error("--dport", NULL);
	if (o.seconds < 0)
		usage_error("--seconds", NULL);
	return o;
}

/* The Internet checksum, in network byte order, ready to store. */
static uint16_t fold(uint32_t sum)
{
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return htons((uint16_t)~sum);
}

/* Sum of big-endian 16-bit words, read byte by byte: reading the headers through a uint16_t
 * pointer breaks C's aliasing rules, and at -O2 the compiler then summed fields before they
 * were written (a wrong TCP checksum on every frame). */
static uint32_t sum16(const void *data, size_t len, uint32_t sum)
{
	const uint8_t *p = data;

	for (; len > 1; len -= 2, p += 2)
		sum += (uint32_t)p[0] << 8 | p[1];
	if (len)
		sum += (uint32_t)p[0] << 8;
	return sum;
}

/* One SYN from `sport` with sequence `seq`: the IPv4 and TCP checksums computed in full. */
static void fill_frame(unsigned char *frame, const struct options *o, const unsigned char src_mac[6],
		       uint16_t sport, uint32_t seq, uint16_t ip_id)
{
	struct ether_header *eth = (struct ether_header *)frame;
	struct iphdr *ip = (struct iphdr *)(eth + 1);
	struct tcphdr *tcp = (struct tcphdr *)(ip + 1);
	struct {
		uint32_t src, dst;
		uint8_t zero, proto;
		uint16_t len;
	} pseudo = {o->src.s_addr, o->dst.s_addr, 0, IPPROTO_TCP, htons(sizeof(*tcp))};

	memcpy(eth->ether_dhost, o->dst_mac, 6);
	memcpy(eth->ether_shost, src_mac, 6);
	eth->ether_type = htons(ETHERTYPE_IP);
	memset(ip, 0, sizeof(*ip));
	ip->version = 4;
	ip->ihl = 5;
	ip->tot_len = htons(sizeof(*ip) + sizeof(*tcp));
	ip->id = htons(ip_id);
	ip->frag_off = htons(IP_DF);
	ip->ttl = 64;
	ip->protocol = IPPROTO_TCP;
	ip->saddr = o->src.s_addr;
	ip->daddr = o->dst.s_addr;
	ip->check = fold(sum16(ip, sizeof(*ip), 0));
	memset(tcp, 0, sizeof(*tcp));
	tcp->source = htons(sport);
	tcp->dest = htons((uint16_t)o->dport);
	tcp->seq = htonl(seq);
	tcp->doff = 5;
	tcp->syn = 1;
	tcp->window = htons(64240);
	tcp->check = fold(sum16(tcp, sizeof(*tcp), sum16(&pseudo, sizeof(pseudo), 0)));
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	struct options o = parse_args(argc, argv);
	static unsigned char frames[MAX_BATCH][FRAME_LEN];
	struct iovec iov[MAX_BATCH];
	struct mmsghdr msgs[MAX_BATCH];
	struct sockaddr_ll addr = {0};
	unsigned char src_mac[6];
	struct ifreq ifr = {0};
	unsigned long long sent = 0, errors = 0;
	uint32_t counter = (uint32_t)getpid() * 2654435761u;
	int one = 1, fd;
	double start, end;

	fd = socket(AF_PACKET, SOCK_RAW, 0); /* protocol 0: send only, never receives */
	if (fd < 0) {
		perror("pktgen: socket(AF_PACKET)");
		return 1;
	}
	if (strlen(o.ifname) >= IFNAMSIZ)
		usage_error("--ifname is too long", o.ifname);
	strcpy(ifr.ifr_name, o.ifname);
	if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0) {
		fprintf(stderr, "pktgen: --ifname %s: %s\n", o.ifname, strerror(errno));
		return 1;
	}
	memcpy(src_mac, ifr.ifr_hwaddr.sa_data, 6);
	addr.sll_family = AF_PACKET;
	addr.sll_ifindex = (int)if_nametoindex(o.ifname);
	addr.sll_halen = 6;
	memcpy(addr.sll_addr, o.dst_mac, 6);
	if (setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof(one)) < 0)
		perror("pktgen: PACKET_QDISC_BYPASS (going through the qdisc)");

	memset(msgs, 0, sizeof(msgs));
	for (unsigned i = 0; i < o.batch; i++) {
		iov[i].iov_base = frames[i];
		iov[i].iov_len = FRAME_LEN;
		msgs[i].msg_hdr.msg_iov = &iov[i];
		msgs[i].msg_hdr.msg_iovlen = 1;
		msgs[i].msg_hdr.msg_name = &addr;
		msgs[i].msg_hdr.msg_namelen = sizeof(addr);
	}
	start = now();
	end = start + o.seconds;
	do {
		for (unsigned i = 0; i < o.batch; i++) {
			counter++;
			/* source ports 1024..65535, sequence numbers scattered */
			fill_frame(frames[i], &o, src_mac, (uint16_t)(1024 + counter % 64512), counter * 2246822519u,
				   (uint16_t)counter);
		}
		int n = sendmmsg(fd, msgs, o.batch, 0);

		if (n < 0) {
			if (errno != ENOBUFS && errno != EAGAIN) {
				perror("pktgen: sendmmsg");
				return 1;
			}
			errors += o.batch;
			continue;
		}
		sent += (unsigned)n;
		errors += o.batch - (unsigned)n;
	} while (now() < end);
	printf("{\"sent\": %llu, \"errors\": %llu, \"seconds\": %.6f}\n", sent, errors, now() - start);
	close(fd);
	return 0;
}
