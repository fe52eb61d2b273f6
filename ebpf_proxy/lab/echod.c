/*
 * echod: the lab's native echo server. The same wire format as echo.py (which defines it), in C,
 * with one thread per CPU, for pods whose server must not be what a benchmark measures.
 *
 * Why: the Python server is one thread of an interpreter, about 11k connections/s on the bench's
 * machine, so every proxy mode topped out at that figure and the datapath's differences stayed
 * inside the noise. This server is kernel-bound: each thread owns its own SO_REUSEPORT listener
 * and epoll set (the kernel spreads new connections over the threads, no lock is shared), and
 * does no work a connection does not need.
 *
 * Wire format (echo.py's): TCP, on accept one JSON line {"pod","local","peer","proto":"tcp"}, then
 * everything the client sends is echoed until its EOF, then close. UDP: each datagram is answered
 * with {"pod","local","peer","proto":"udp","echo"} from the address it was sent to (IP_PKTINFO),
 * the request's first ECHO_CAP bytes decoded as UTF-8 with replacement (U+FFFD per maximal
 * invalid subpart, as Python's "replace" does) and escaped as Python's json.dumps escapes
 * (ASCII only: \uXXXX, surrogate pairs above the BMP). `local` is the address after any DNAT,
 * `peer` the source the pod saw; IPv6 addresses are bracketed, IPv4 peers of an IPv6-enabled
 * server are plain IPv4 (separate IPV6_V6ONLY sockets, as echo.py does).
 *
 *   echod --pod NAME --listen 80/tcp [--listen 53/udp ...] [--ready-file F] [--ipv6] [--threads N]
 *
 * A port another process holds is an error (exit 1, "cannot bind"), even though this server's
 * own sockets share ports: each port is first bound once without SO_REUSEPORT, which fails if
 * anybody else has it. The ready file ({"pod","pid","listen","threads"}) is written atomically
 * once every socket is bound, and removed on SIGTERM/SIGINT, after which the process exits 0.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_LISTEN 64
#define MAX_THREADS 256
#define ECHO_CAP 1024
#define CONN_BUF 16384
#define UDP_BATCH 64
#define LINE_CAP (ECHO_CAP * 12 + 512) /* worst case: every byte a surrogate pair */
#define ADDR_CAP (INET6_ADDRSTRLEN + 16)

enum kind { TCP_LISTENER, UDP_SOCKET, TCP_CONN };

/* What an epoll event's data.ptr points at: a socket of one of the three kinds. */
struct sock {
    enum kind kind;
    int fd;
};

struct conn {
    struct sock s; /* first: the event's pointer is read as a struct sock */
    int eof;
    size_t off, len; /* bytes buf[off, len) are still to be sent */
    char buf[CONN_BUF];
};

struct listen_spec {
    int port;
    int udp;
};

static const char *pod;
static struct listen_spec listens[MAX_LISTEN];
static int n_listens;
static int want_ipv6;

static void die(const char *what) {
    fprintf(stderr, "echod[%s]: %s: %s\n", pod ? pod : "?", what, strerror(errno));
    exit(1);
}

/* ---- JSON ------------------------------------------------------------------------------------ */

static size_t put_escaped_cp(char *out, uint32_t cp) {
    static const char hex[] = "0123456789abcdef";
    switch (cp) {
    case '"': return (size_t)sprintf(out, "\\\"");
    case '\\': return (size_t)sprintf(out, "\\\\");
    case '\n': return (size_t)sprintf(out, "\\n");
    case '\r': return (size_t)sprintf(out, "\\r");
    case '\t': return (size_t)sprintf(out, "\\t");
    case '\b': return (size_t)sprintf(out, "\\b");
    case '\f': return (size_t)sprintf(out, "\\f");
    }
    if (cp >= 0x20 && cp < 0x7f) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp > 0xffff) { /* a surrogate pair, as json.dumps writes it */
        cp -= 0x10000;
        size_t n = put_escaped_cp(out, 0xd800 + (cp >> 10));
        return n + put_escaped_cp(out + n, 0xdc00 + (cp & 0x3ff));
    }
    out[0] = '\\';
    out[1] = 'u';
    for (int i = 0; i < 4; i++)
        out[2 + i] = hex[(cp >> (12 - 4 * i)) & 0xf];
    return 6;
}

/* The code point at s (len bytes left) and how many bytes it takes; on an invalid sequence
 * U+FFFD and the length of its maximal invalid subpart (at least 1), as Python decodes. */
static uint32_t utf8_next(const unsigned char *s, size_t len, size_t *used) {
    unsigned char c = s[0];
    size_t need;
    uint32_t cp;
    unsigned char lo = 0x80, hi = 0xbf; /* the allowed range of the second byte */
    *used = 1;
    if (c < 0x80)
        return c;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 1;
        cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 2;
        cp = c & 0x0f;
        if (c == 0xe0) lo = 0xa0; /* no overlong forms */
        if (c == 0xed) hi = 0x9f; /* no surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 3;
        cp = c & 0x07;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f; /* nothing above U+10FFFF */
    } else {
        return 0xfffd;
    }
    for (size_t i = 1; i <= need; i++) {
        unsigned char b = i < len ? s[i] : 0;
        unsigned char min = i == 1 ? lo : 0x80, max = i == 1 ? hi : 0xbf;
        if (i >= len || b < min || b > max) {
            *used = i;
            return 0xfffd;
        }
        cp = (cp << 6) | (b & 0x3f);
    }
    *used = need + 1;
    return cp;
}

static size_t put_json_string(char *out, const unsigned char *s, size_t len) {
    size_t n = 0, used;
    out[n++] = '"';
    for (size_t i = 0; i < len; i += used)
        n += put_escaped_cp(out + n, utf8_next(s + i, len - i, &used));
    out[n++] = '"';
    return n;
}

static void format_addr(const struct sockaddr_storage *sa, char *out) {
    char host[INET6_ADDRSTRLEN];
    if (sa->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const void *)sa;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        snprintf(out, ADDR_CAP, "[%s]:%u", host, ntohs(a->sin6_port));
    } else {
        const struct sockaddr_in *a = (const void *)sa;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        snprintf(out, ADDR_CAP, "%s:%u", host, ntohs(a->sin_port));
    }
}

/* The reply line (newline-terminated) into out; its length. echo NULL: no "echo" key. */
static size_t reply_line(char *out, const char *local, const char *peer, const char *proto,
                         const unsigned char *echo, size_t echo_len) {
    size_t n = 0;
    n += (size_t)sprintf(out + n, "{\"pod\":");
    n += put_json_string(out + n, (const unsigned char *)pod, strlen(pod));
    n += (size_t)sprintf(out + n, ",\"local\":\"%s\",\"peer\":\"%s\",\"proto\":\"%s\"", local, peer, proto);
    if (echo && echo_len) {
        n += (size_t)sprintf(out + n, ",\"echo\":");
        n += put_json_string(out + n, echo, echo_len < ECHO_CAP ? echo_len : ECHO_CAP);
    }
    out[n++] = '}';
    out[n++] = '\n';
    return n;
}

/* ---- sockets --------------------------------------------------------------------------------- */

static int open_socket(int family, const struct listen_spec *l, int reuseport) {
    int one = 1;
    int fd = socket(family, (l->udp ? SOCK_DGRAM : SOCK_STREAM) | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (!l->udp) /* TIME_WAIT only; on UDP it would let a stranger's socket share the port */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (reuseport)
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    struct sockaddr_storage ss = {0};
    socklen_t sl;
    if (family == AF_INET6) {
        struct sockaddr_in6 *a = (void *)&ss;
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
        if (l->udp)
            setsockopt(fd, IPPROTO_IPV6, IPV6_RECVPKTINFO, &one, sizeof(one));
        a->sin6_family = AF_INET6;
        a->sin6_addr = in6addr_any;
        a->sin6_port = htons((uint16_t)l->port);
        sl = sizeof(*a);
    } else {
        struct sockaddr_in *a = (void *)&ss;
        if (l->udp)
            setsockopt(fd, IPPROTO_IP, IP_PKTINFO, &one, sizeof(one));
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl(INADDR_ANY);
        a->sin_port = htons((uint16_t)l->port);
        sl = sizeof(*a);
    }
    if (bind(fd, (struct sockaddr *)&ss, sl) < 0 || (!l->udp && listen(fd, 4096) < 0)) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

static void arm(int ep, struct sock *s, uint32_t events, int op) {
    struct epoll_event ev = {.events = events, .data.ptr = s};
    if (epoll_ctl(ep, op, s->fd, &ev) < 0 && op == EPOLL_CTL_ADD)
        die("epoll_ctl");
}

static void conn_close(struct conn *c) {
    close(c->s.fd); /* also removes it from the epoll set */
    free(c);
}

/* Send what is pending, then wait for what the connection needs next (more input, or room). */
static void conn_flush(int ep, struct conn *c, int added) {
    while (c->off < c->len) {
        ssize_t n = send(c->s.fd, c->buf + c->off, c->len - c->off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            conn_close(c);
            return;
        }
        c->off += (size_t)n;
    }
    if (c->off == c->len) {
        c->off = c->len = 0;
        if (c->eof) {
            conn_close(c);
            return;
        }
    }
    arm(ep, &c->s, c->len ? EPOLLOUT : EPOLLIN, added ? EPOLL_CTL_MOD : EPOLL_CTL_ADD);
}

static void on_accept(int ep, struct sock *l) {
    for (;;) {
        struct sockaddr_storage peer, local;
        socklen_t pl = sizeof(peer), ll = sizeof(local);
        int fd = accept4(l->fd, (struct sockaddr *)&peer, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return; /* EAGAIN, or EMFILE/ECONNABORTED: skip this one, keep serving */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        struct conn *c = malloc(sizeof(*c));
        if (!c || getsockname(fd, (struct sockaddr *)&local, &ll) < 0) {
            free(c);
            close(fd);
            continue;
        }
        char la[ADDR_CAP], pa[ADDR_CAP];
        format_addr(&local, la);
        format_addr(&peer, pa);
        c->s.kind = TCP_CONN;
        c->s.fd = fd;
        c->eof = 0;
        c->off = 0;
        c->len = reply_line(c->buf, la, pa, "tcp", NULL, 0);
        conn_flush(ep, c, 0);
    }
}

static void on_conn(int ep, struct conn *c, uint32_t events) {
    if (!c->len && (events & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
        ssize_t n = recv(c->s.fd, c->buf, sizeof(c->buf), 0);
        if (n < 0 && errno != EAGAIN && errno != EINTR) {
            conn_close(c);
            return;
        }
        if (n == 0)
            c->eof = 1;
        else if (n > 0)
            c->len = (size_t)n;
    }
    conn_flush(ep, c, 1);
}

/* Make `rmsg` carry one control message (level, type, data): the address to answer from. */
static void answer_from(struct msghdr *rmsg, char *control, int level, int type, const void *data, size_t len) {
    struct cmsghdr *rc = (struct cmsghdr *)control;
    rc->cmsg_level = level;
    rc->cmsg_type = type;
    rc->cmsg_len = CMSG_LEN(len);
    memcpy(CMSG_DATA(rc), data, len);
    rmsg->msg_control = control;
    rmsg->msg_controllen = CMSG_SPACE(len);
}

static void on_datagram(struct sock *s) {
    static __thread unsigned char in[65536];
    static __thread char out[LINE_CAP];
    for (int i = 0; i < UDP_BATCH; i++) {
        struct sockaddr_storage peer;
        char control[CMSG_SPACE(sizeof(struct in6_pktinfo))];
        struct iovec iov = {.iov_base = in, .iov_len = sizeof(in)};
        struct msghdr msg = {.msg_name = &peer, .msg_namelen = sizeof(peer), .msg_iov = &iov,
                             .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof(control)};
        ssize_t n = recvmsg(s->fd, &msg, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                return;
            continue; /* an ICMP error queued by an earlier reply: ignore */
        }
        struct sockaddr_storage local = {0};
        socklen_t ll = sizeof(local);
        getsockname(s->fd, (struct sockaddr *)&local, &ll); /* the port, and the family */
        char reply_control[CMSG_SPACE(sizeof(struct in6_pktinfo))] = {0};
        struct msghdr rmsg = {.msg_name = &peer, .msg_namelen = msg.msg_namelen};
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
            if (cm->cmsg_level == IPPROTO_IP && cm->cmsg_type == IP_PKTINFO) {
                struct in_pktinfo pi;
                memcpy(&pi, CMSG_DATA(cm), sizeof(pi));
                ((struct sockaddr_in *)&local)->sin_addr = pi.ipi_addr;
                struct in_pktinfo answer = {.ipi_spec_dst = pi.ipi_addr};
                answer_from(&rmsg, reply_control, IPPROTO_IP, IP_PKTINFO, &answer, sizeof(answer));
            } else if (cm->cmsg_level == IPPROTO_IPV6 && cm->cmsg_type == IPV6_PKTINFO) {
                struct in6_pktinfo pi;
                memcpy(&pi, CMSG_DATA(cm), sizeof(pi));
                ((struct sockaddr_in6 *)&local)->sin6_addr = pi.ipi6_addr;
                struct in6_pktinfo answer = {.ipi6_addr = pi.ipi6_addr};
                answer_from(&rmsg, reply_control, IPPROTO_IPV6, IPV6_PKTINFO, &answer, sizeof(answer));
            }
        }
        char la[ADDR_CAP], pa[ADDR_CAP];
        format_addr(&local, la);
        format_addr(&peer, pa);
        struct iovec riov = {.iov_base = out, .iov_len = reply_line(out, la, pa, "udp", in, (size_t)n)};
        rmsg.msg_iov = &riov;
        rmsg.msg_iovlen = 1;
        sendmsg(s->fd, &rmsg, MSG_DONTWAIT | MSG_NOSIGNAL); /* a lost reply is a lost datagram */
    }
}

/* ---- threads --------------------------------------------------------------------------------- */

struct worker {
    int ep;
    struct sock socks[MAX_LISTEN * 2];
    int n;
};

static void *serve(void *arg) {
    struct worker *w = arg;
    struct epoll_event events[256];
    for (;;) {
        int n = epoll_wait(w->ep, events, 256, -1);
        for (int i = 0; i < n; i++) {
            struct sock *s = events[i].data.ptr;
            if (s->kind == TCP_LISTENER)
                on_accept(w->ep, s);
            else if (s->kind == UDP_SOCKET)
                on_datagram(s);
            else
                on_conn(w->ep, (struct conn *)s, events[i].events);
        }
    }
    return NULL;
}

static void check_port_free(int family, const struct listen_spec *l) {
    int fd = open_socket(family, l, 0);
    if (fd < 0) {
        char what[64];
        snprintf(what, sizeof(what), "cannot bind %d/%s", l->port, l->udp ? "udp" : "tcp");
        die(what);
    }
    close(fd);
}

static void write_ready_file(const char *path, int threads) {
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        die("writing the ready file");
    fprintf(f, "{\"pod\": \"%s\", \"pid\": %d, \"listen\": [", pod, (int)getpid());
    for (int i = 0; i < n_listens; i++)
        fprintf(f, "%s\"%d/%s\"", i ? ", " : "", listens[i].port, listens[i].udp ? "udp" : "tcp");
    fprintf(f, "], \"threads\": %d}\n", threads);
    if (fclose(f) != 0 || rename(tmp, path) < 0)
        die("writing the ready file");
}

static void usage(void) {
    fprintf(stderr, "usage: echod --pod NAME --listen PORT[/tcp|udp] ... [--ready-file F] [--ipv6] "
                    "[--threads N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    const char *ready = NULL;
    int threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--ipv6")) {
            want_ipv6 = 1;
            continue;
        }
        if (!v)
            usage();
        i++;
        if (!strcmp(a, "--pod")) {
            pod = v;
        } else if (!strcmp(a, "--ready-file")) {
            ready = v;
        } else if (!strcmp(a, "--threads")) {
            threads = atoi(v);
            if (threads < 1 || threads > MAX_THREADS)
                usage();
        } else if (!strcmp(a, "--listen")) {
            char proto[8] = "tcp";
            int port;
            if (n_listens == MAX_LISTEN || sscanf(v, "%d/%7s", &port, proto) < 1 || port < 1 ||
                port > 65535 || (strcmp(proto, "tcp") && strcmp(proto, "udp"))) {
                fprintf(stderr, "echod: --listen %s: PORT/tcp or PORT/udp, PORT from 1 to 65535, "
                                "at most %d\n", v, MAX_LISTEN);
                exit(2);
            }
            listens[n_listens++] = (struct listen_spec){port, !strcmp(proto, "udp")};
        } else {
            usage();
        }
    }
    if (!pod || !n_listens)
        usage();
    for (const char *p = pod; *p; p++)
        if (*p == '"' || *p == '\\' || (unsigned char)*p < 0x20)
            usage(); /* the ready file writes the name unescaped; pod names never need escaping */
    if (!threads) {
        cpu_set_t set;
        threads = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
        if (threads > MAX_THREADS)
            threads = MAX_THREADS;
    }
    int families[2] = {AF_INET, AF_INET6}, n_families = want_ipv6 ? 2 : 1;
    for (int i = 0; i < n_listens; i++)
        for (int f = 0; f < n_families; f++)
            check_port_free(families[f], &listens[i]);

    /* Every thread, and so every socket, inherits this mask: the signals go to sigwait below. */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);

    static struct worker workers[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        struct worker *w = &workers[t];
        if ((w->ep = epoll_create1(EPOLL_CLOEXEC)) < 0)
            die("epoll_create1");
        for (int i = 0; i < n_listens; i++)
            for (int f = 0; f < n_families; f++) {
                struct sock *s = &w->socks[w->n++];
                s->kind = listens[i].udp ? UDP_SOCKET : TCP_LISTENER;
                if ((s->fd = open_socket(families[f], &listens[i], 1)) < 0) {
                    char what[64];
                    snprintf(what, sizeof(what), "cannot bind %d/%s", listens[i].port,
                             listens[i].udp ? "udp" : "tcp");
                    die(what);
                }
                arm(w->ep, s, EPOLLIN, EPOLL_CTL_ADD);
            }
    }
    for (int t = 0; t < threads; t++) {
        pthread_t tid;
        if ((errno = pthread_create(&tid, NULL, serve, &workers[t])) != 0)
            die("pthread_create");
    }
    if (ready)
        write_ready_file(ready, threads);
    int sig;
    sigwait(&stop, &sig);
    if (ready)
        unlink(ready);
    return 0;
}
