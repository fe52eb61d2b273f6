/*
 * loadgen: the bench's load generator, built at run time with the system cc (see loadgen.py).
 *
 * Why not wrk: the lab's echo server is not HTTP. It sends one JSON line on accept, then echoes
 * what it receives until EOF (TCP), or answers each datagram with one JSON line (UDP). This
 * client speaks exactly that and nothing else, so a measured figure is the data path's, not a
 * protocol's.
 *
 * TCP, one operation = a new connection: connect, send PAYLOAD, read the JSON line and the
 * echoed PAYLOAD, close (the client closes first). UDP, one operation = a new flow: a fresh
 * socket, one request, one reply, close (a DNS-like pattern, so every request is a new flow
 * through the proxy, as every TCP connection is). Latency is from connect()/socket() to the
 * complete reply.
 *
 * One thread, epoll, CONCURRENCY operations in flight. Operations that complete during the
 * warm-up are not recorded; the measured window follows it. Timeouts and errors are counted by
 * kind (those of the measured window only, like the completions), never folded into the rate.
 * The process bounds itself: it stops at warm-up + duration, and an alarm kills it shortly after
 * whatever happens.
 *
 * CPU: /proc/stat's totals (every CPU of the machine) read as the measured window opens and as
 * it closes, so that a figure per operation can be given: the kernel's share (system + irq +
 * softirq) is what the network stack and the datapath cost. The lab's nodes share this kernel,
 * so it covers the whole path, the servers' and this program's own system calls included. And this
 * program's own CPU seconds over the window (getrusage): near one per second, it was the limit.
 *
 * Output: one JSON object on stdout (parsed by loadgen.py; keys documented there).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_TARGETS 16
#define MAX_PODS 32
#define MAX_SLOTS 4096
#define BUF_SIZE 2048
#define SAMPLE_CAP (4u << 20) /* latency samples kept; beyond, reservoir sampling */

enum proto { TCP, UDP };
enum state { IDLE, CONNECTING, READING };

struct slot {
    int fd;
    enum state st;
    uint64_t start_ns;
    uint64_t deadline_ns;
    size_t got;
    char buf[BUF_SIZE];
};

struct pod_count { char name[64]; uint64_t n; };

static enum proto proto = TCP;
static struct sockaddr_in targets[MAX_TARGETS];
static int n_targets, next_target;
static double duration = 1.0, warmup = 0.0;
static int concurrency = 16;
static int timeout_ms = 1000;
static char payload[256] = "bench";
static size_t payload_len = 5;

static uint64_t t_measure, t_end;
static int measuring; /* inside the measured window: errors, like completions, count only then */
#define ERR(counter) do { if (measuring) (counter)++; } while (0)
static uint64_t completed, started;
static uint64_t err_connect, err_refused, err_reset, err_timeout, err_eof, err_other, bad_reply;
static uint32_t *samples;
static uint64_t n_samples, n_seen;
static uint64_t rng = 88172645463325252ull;
static struct pod_count pods[MAX_PODS];
static int n_pods;

/* /proc/stat's first line in clock ticks: user (+ nice), kernel (system + irq + softirq), idle
 * (+ iowait); all zero when it cannot be read. */
struct cpu_ticks { unsigned long long user, kernel, idle; int ok; };

static struct cpu_ticks read_cpu(void) {
    struct cpu_ticks t = {0};
    unsigned long long user, nice, system, idle, iowait, irq, softirq;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return t;
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &system, &idle, &iowait, &irq,
               &softirq) == 7) {
        t.user = user + nice;
        t.kernel = system + irq + softirq;
        t.idle = idle + iowait;
        t.ok = 1;
    }
    fclose(f);
    return t;
}

/* This process's CPU seconds (user + system): whether the load generator itself was the limit. */
static double self_cpu(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t xorshift(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static void usage(const char *msg) {
    fprintf(stderr, "loadgen: %s\nusage: loadgen --proto tcp|udp --target IP:PORT [--target ...] "
                    "[--duration S] [--warmup S] [--concurrency N] [--timeout-ms MS] [--payload TEXT]\n", msg);
    exit(2);
}

static void parse_target(const char *text) {
    char host[64];
    const char *colon = strrchr(text, ':');
    if (!colon || colon == text || (size_t)(colon - text) >= sizeof host) usage("--target: expected IP:PORT");
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = 0;
    long port = strtol(colon + 1, NULL, 10);
    if (port < 1 || port > 65535) usage("--target: port out of range");
    if (n_targets == MAX_TARGETS) usage("--target: too many targets");
    struct sockaddr_in *sa = &targets[n_targets++];
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) usage("--target: not an IPv4 address");
}

static void record_sample(uint64_t ns) {
    uint64_t us = ns / 1000;
    uint32_t v = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    n_seen++;
    if (n_samples < SAMPLE_CAP) {
        samples[n_samples++] = v;
    } else {
        uint64_t j = xorshift() % n_seen;
        if (j < SAMPLE_CAP) samples[j] = v;
    }
}

/* The echo server's line starts {"pod":"NAME",...: count answers per pod (a sanity check that
 * the path load-balances, and that what answered is ours). */
static void count_pod(const char *line, size_t len) {
    static const char key[] = "\"pod\":\"";
    const char *p = memmem(line, len, key, sizeof key - 1);
    if (!p) { ERR(bad_reply); return; }
    p += sizeof key - 1;
    const char *q = memchr(p, '"', (size_t)(line + len - p));
    if (!q || q - p >= 63) { ERR(bad_reply); return; }
    size_t n = (size_t)(q - p);
    for (size_t k = 0; k < n; k++) /* DNS-1123 names only: they go into our JSON unescaped */
        if (!((p[k] >= 'a' && p[k] <= 'z') || (p[k] >= '0' && p[k] <= '9') || p[k] == '-' || p[k] == '.')) {
            ERR(bad_reply);
            return;
        }
    for (int i = 0; i < n_pods; i++)
        if (strlen(pods[i].name) == n && memcmp(pods[i].name, p, n) == 0) { pods[i].n++; return; }
    if (n_pods < MAX_PODS) {
        memcpy(pods[n_pods].name, p, n);
        pods[n_pods].name[n] = 0;
        pods[n_pods++].n = 1;
    }
}

static void finish(int ep, struct slot *s, int ok_err, uint64_t now);

static void start_op(int ep, struct slot *s) {
    uint64_t now = now_ns();
    if (now >= t_end) { s->st = IDLE; return; }
    int type = proto == TCP ? SOCK_STREAM : SOCK_DGRAM;
    int fd = socket(AF_INET, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) { ERR(err_other); s->st = IDLE; return; }
    if (proto == TCP) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    struct sockaddr_in *dst = &targets[next_target];
    next_target = (next_target + 1) % n_targets;
    s->fd = fd;
    s->got = 0;
    s->start_ns = now;
    s->deadline_ns = now + (uint64_t)timeout_ms * 1000000ull;
    started++;
    int rc = connect(fd, (struct sockaddr *)dst, sizeof *dst);
    if (rc < 0 && errno != EINPROGRESS) {
        if (errno == ECONNREFUSED || errno == EHOSTUNREACH || errno == ENETUNREACH) ERR(err_refused);
        else ERR(err_connect);
        close(fd);
        s->fd = -1;
        s->st = IDLE;
        return;
    }
    struct epoll_event ev = {.data.ptr = s};
    if (proto == UDP) {
        if (send(fd, payload, payload_len, 0) < 0) { finish(ep, s, 1, now); ERR(err_other); return; }
        s->st = READING;
        ev.events = EPOLLIN;
    } else {
        s->st = CONNECTING;
        ev.events = EPOLLOUT;
    }
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0) { perror("epoll_ctl"); exit(1); }
}

/* ok_err: 0 = success (record it), 1 = error already counted by the caller. */
static void finish(int ep, struct slot *s, int ok_err, uint64_t now) {
    if (!ok_err) {
        if (now >= t_measure && now < t_end) {
            completed++;
            record_sample(now - s->start_ns);
        }
    }
    if (s->fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, s->fd, NULL);
        close(s->fd);
    }
    s->fd = -1;
    s->st = IDLE;
}

static int count_error(int err) {
    switch (err) {
    case ECONNREFUSED: case EHOSTUNREACH: case ENETUNREACH: case EHOSTDOWN: case EACCES: ERR(err_refused); break;
    case ECONNRESET: case EPIPE: ERR(err_reset); break;
    case ETIMEDOUT: ERR(err_timeout); break;
    default: ERR(err_other);
    }
    return 1;
}

/* A complete reply: the JSON line, then (TCP) the echoed payload. */
static int reply_complete(struct slot *s) {
    char *nl = memchr(s->buf, '\n', s->got);
    if (!nl) return 0;
    size_t line = (size_t)(nl - s->buf) + 1;
    if (proto == UDP) return 1;
    return s->got >= line + payload_len;
}

static void on_event(int ep, struct slot *s, uint32_t events) {
    uint64_t now;
    if (s->st == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) { count_error(err); finish(ep, s, 1, now_ns()); return; }
        if (send(s->fd, payload, payload_len, MSG_NOSIGNAL) < 0) {
            count_error(errno); finish(ep, s, 1, now_ns()); return;
        }
        s->st = READING;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
        epoll_ctl(ep, EPOLL_CTL_MOD, s->fd, &ev);
        return;
    }
    (void)events;
    for (;;) {
        if (s->got >= BUF_SIZE) { ERR(bad_reply); finish(ep, s, 1, now_ns()); return; }
        ssize_t n = recv(s->fd, s->buf + s->got, BUF_SIZE - s->got, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            count_error(errno);
            finish(ep, s, 1, now_ns());
            return;
        }
        if (n == 0) { ERR(err_eof); finish(ep, s, 1, now_ns()); return; }
        s->got += (size_t)n;
        if (reply_complete(s)) {
            now = now_ns();
            if (now >= t_measure && now < t_end) count_pod(s->buf, s->got);
            finish(ep, s, 0, now);
            return;
        }
        if (proto == UDP) { ERR(bad_reply); finish(ep, s, 1, now_ns()); return; }
    }
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (the same definition as results.percentile). */
static double pct(double p) {
    if (!n_samples) return 0;
    double rank = ceil(p / 100.0 * (double)n_samples);
    uint64_t idx = rank < 1 ? 0 : (uint64_t)rank - 1;
    if (idx >= n_samples) idx = n_samples - 1;
    return samples[idx];
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--proto") && v) {
            if (!strcmp(v, "tcp")) proto = TCP;
            else if (!strcmp(v, "udp")) proto = UDP;
            else usage("--proto: tcp or udp");
            i++;
        } else if (!strcmp(a, "--target") && v) { parse_target(v); i++; }
        else if (!strcmp(a, "--duration") && v) { duration = atof(v); i++; }
        else if (!strcmp(a, "--warmup") && v) { warmup = atof(v); i++; }
        else if (!strcmp(a, "--concurrency") && v) { concurrency = atoi(v); i++; }
        else if (!strcmp(a, "--timeout-ms") && v) { timeout_ms = atoi(v); i++; }
        else if (!strcmp(a, "--payload") && v) {
            payload_len = strlen(v);
            if (payload_len == 0 || payload_len >= sizeof payload) usage("--payload: 1 to 255 bytes");
            memcpy(payload, v, payload_len + 1);
            i++;
        } else usage("unknown or incomplete option");
    }
    if (!n_targets) usage("at least one --target");
    if (duration <= 0 || duration > 600) usage("--duration: 0 < S <= 600");
    if (warmup < 0 || warmup > 600) usage("--warmup: 0 <= S <= 600");
    if (concurrency < 1 || concurrency > MAX_SLOTS) usage("--concurrency: 1 to 4096");
    if (timeout_ms < 1) usage("--timeout-ms: >= 1");

    alarm((unsigned)(warmup + duration) + 10); /* hard bound, whatever happens below */
    struct rlimit rl = {MAX_SLOTS + 64, MAX_SLOTS + 64};
    setrlimit(RLIMIT_NOFILE, &rl);
    samples = malloc(SAMPLE_CAP * sizeof *samples);
    struct slot *slots = calloc((size_t)concurrency, sizeof *slots);
    if (!samples || !slots) { perror("malloc"); return 1; }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) { perror("epoll_create1"); return 1; }

    uint64_t t0 = now_ns();
    t_measure = t0 + (uint64_t)(warmup * 1e9);
    t_end = t_measure + (uint64_t)(duration * 1e9);
    for (int i = 0; i < concurrency; i++) { slots[i].fd = -1; start_op(ep, &slots[i]); }

    struct epoll_event evs[256];
    uint64_t last_scan = t0;
    struct cpu_ticks cpu_start = {0}, cpu_end = {0};
    double self_start = -1, self_end = -1;
    for (;;) {
        if (!measuring && now_ns() >= t_measure) { cpu_start = read_cpu(); self_start = self_cpu(); }
        measuring = now_ns() >= t_measure;
        int n = epoll_wait(ep, evs, 256, 5);
        if (n < 0 && errno != EINTR) { perror("epoll_wait"); return 1; }
        for (int i = 0; i < n; i++) on_event(ep, evs[i].data.ptr, evs[i].events);
        uint64_t now = now_ns();
        if (now >= t_end) { cpu_end = read_cpu(); self_end = self_cpu(); break; }
        int scan = now - last_scan > 2000000ull;
        if (scan) last_scan = now;
        for (int i = 0; i < concurrency; i++) {
            struct slot *s = &slots[i];
            if (s->st != IDLE && scan && now > s->deadline_ns) { ERR(err_timeout); finish(ep, s, 1, now); }
            if (s->st == IDLE) start_op(ep, s);
        }
    }
    for (int i = 0; i < concurrency; i++)
        if (slots[i].fd >= 0) close(slots[i].fd);

    qsort(samples, n_samples, sizeof *samples, cmp_u32);
    double sum = 0;
    for (uint64_t i = 0; i < n_samples; i++) sum += samples[i];
    printf("{\"proto\":\"%s\",\"duration_s\":%.6f,\"warmup_s\":%.3f,\"concurrency\":%d,\"targets\":[",
           proto == TCP ? "tcp" : "udp", duration, warmup, concurrency);
    for (int i = 0; i < n_targets; i++) {
        char ip[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &targets[i].sin_addr, ip, sizeof ip);
        printf("%s\"%s:%u\"", i ? "," : "", ip, ntohs(targets[i].sin_port));
    }
    printf("],\"started\":%llu,\"completed\":%llu,\"rate\":%.3f,", (unsigned long long)started,
           (unsigned long long)completed, (double)completed / duration);
    printf("\"latency_us\":{\"samples\":%llu,\"min\":%.0f,\"mean\":%.3f,\"p50\":%.0f,\"p90\":%.0f,"
           "\"p99\":%.0f,\"p999\":%.0f,\"max\":%.0f},",
           (unsigned long long)n_samples, n_samples ? (double)samples[0] : 0.0,
           n_samples ? sum / (double)n_samples : 0.0, pct(50), pct(90), pct(99), pct(99.9),
           n_samples ? (double)samples[n_samples - 1] : 0.0);
    printf("\"errors\":{\"connect\":%llu,\"refused\":%llu,\"reset\":%llu,\"timeout\":%llu,\"eof\":%llu,"
           "\"bad_reply\":%llu,\"other\":%llu},\"backends\":{",
           (unsigned long long)err_connect, (unsigned long long)err_refused, (unsigned long long)err_reset,
           (unsigned long long)err_timeout, (unsigned long long)err_eof, (unsigned long long)bad_reply,
           (unsigned long long)err_other);
    for (int i = 0; i < n_pods; i++) printf("%s\"%s\":%llu", i ? "," : "", pods[i].name, (unsigned long long)pods[i].n);
    printf("},\"cpu_s\":");
    if (cpu_start.ok && cpu_end.ok) {
        double tick = (double)sysconf(_SC_CLK_TCK);
        printf("{\"user\":%.3f,\"kernel\":%.3f,\"idle\":%.3f,\"cpus\":%ld,\"loadgen\":%.3f}",
               (double)(cpu_end.user - cpu_start.user) / tick, (double)(cpu_end.kernel - cpu_start.kernel) / tick,
               (double)(cpu_end.idle - cpu_start.idle) / tick, sysconf(_SC_NPROCESSORS_ONLN),
               self_start >= 0 && self_end >= 0 ? self_end - self_start : 0.0);
    } else {
        printf("null");
    }
    printf("}\n");
    return 0;
}
