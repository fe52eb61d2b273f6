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
 * THREADS threads (default 1; the bench gives one per CPU, so that the client is not what limits
 * a rate), each with its own epoll set, its share of the CONCURRENCY operations in flight, its
 * own counters and latency samples, merged when all have stopped: nothing is shared while the
 * load runs. Operations that complete during the warm-up are not recorded; the measured window
 * follows it. Timeouts and errors are counted by
 * kind (those of the measured window only, like the completions), never folded into the rate.
 * The process bounds itself: it stops at warm-up + duration, and an alarm kills it shortly after
 * whatever happens.
 *
 * CPU: /proc/stat's totals (every CPU of the machine) read as the measured window opens and as
 * it closes, so that a figure per operation can be given: the kernel's share (system + irq +
 * softirq) is what the network stack and the datapath cost. The lab's nodes share this kernel,
 * so it covers the whole path, the servers' and this program's own system calls included. And this
 * program's own CPU seconds over the window (getrusage, every thread): near THREADS per second,
 * it was the limit.
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
#include <pthread.h>
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
#define MAX_THREADS 64
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

/* Set by main before the threads start, read-only afterwards. */
static enum proto proto = TCP;
static struct sockaddr_storage targets[MAX_TARGETS]; /* sockaddr_in or sockaddr_in6, one family */
static socklen_t target_len;
static int target_family;
static int n_targets;
static double duration = 1.0, warmup = 0.0;
static int concurrency = 16, threads = 1;
static int timeout_ms = 1000;
static char payload[256] = "bench";
static size_t payload_len = 5;
static uint64_t t_measure, t_end;

/* One thread's load and what it saw; main merges them into the first when all have stopped. */
struct worker {
    int ep, n_slots, next_target;
    struct slot *slots;
    int measuring; /* inside the measured window: errors, like completions, count only then */
    uint64_t completed, started;
    uint64_t err_connect, err_refused, err_reset, err_timeout, err_eof, err_other, bad_reply;
    uint32_t *samples;
    uint64_t n_samples, n_seen, cap;
    uint64_t rng;
    struct pod_count pods[MAX_PODS];
    int n_pods;
};
#define ERR(counter) do { if (w->measuring) (w->counter)++; } while (0)

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

static uint64_t xorshift(struct worker *w) {
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

static void usage(const char *msg) {
    fprintf(stderr, "loadgen: %s\nusage: loadgen --proto tcp|udp --target IP:PORT [--target ...] "
                    "[--duration S] [--warmup S] [--concurrency N] [--threads N] [--timeout-ms MS] [--payload TEXT]\n", msg);
    exit(2);
}

/* IPV4:PORT or [IPV6]:PORT; every target of one run is of one family. */
static void parse_target(const char *text) {
    char host[64];
    const char *colon = strrchr(text, ':');
    const char *start = text, *end = colon;
    if (text[0] == '[') {
        start = text + 1;
        end = colon && colon > text && colon[-1] == ']' ? colon - 1 : NULL;
    }
    if (!colon || !end || end <= start || (size_t)(end - start) >= sizeof host)
        usage("--target: expected IPV4:PORT or [IPV6]:PORT");
    memcpy(host, start, (size_t)(end - start));
    host[end - start] = 0;
    long port = strtol(colon + 1, NULL, 10);
    if (port < 1 || port > 65535) usage("--target: port out of range");
    if (n_targets == MAX_TARGETS) usage("--target: too many targets");
    struct sockaddr_storage *ss = &targets[n_targets++];
    memset(ss, 0, sizeof *ss);
    int family = text[0] == '[' ? AF_INET6 : AF_INET;
    if (target_family && family != target_family) usage("--target: every target must be of one IP family");
    target_family = family;
    if (family == AF_INET) {
        struct sockaddr_in *sa = (struct sockaddr_in *)ss;
        sa->sin_family = AF_INET;
        sa->sin_port = htons((uint16_t)port);
        if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) usage("--target: not an IPv4 address");
        target_len = sizeof *sa;
    } else {
        struct sockaddr_in6 *sa = (struct sockaddr_in6 *)ss;
        sa->sin6_family = AF_INET6;
        sa->sin6_port = htons((uint16_t)port);
        if (inet_pton(AF_INET6, host, &sa->sin6_addr) != 1) usage("--target: not an IPv6 address in brackets");
        target_len = sizeof *sa;
    }
}

/* "IP:PORT" or "[IP]:PORT" of target i, for the report. */
static void format_target(int i, char *out, size_t n) {
    char ip[INET6_ADDRSTRLEN];
    if (targets[i].ss_family == AF_INET6) {
        const struct sockaddr_in6 *sa = (const struct sockaddr_in6 *)&targets[i];
        inet_ntop(AF_INET6, &sa->sin6_addr, ip, sizeof ip);
        snprintf(out, n, "[%s]:%u", ip, ntohs(sa->sin6_port));
    } else {
        const struct sockaddr_in *sa = (const struct sockaddr_in *)&targets[i];
        inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip);
        snprintf(out, n, "%s:%u", ip, ntohs(sa->sin_port));
    }
}

static void record_sample(struct worker *w, uint64_t ns) {
    uint64_t us = ns / 1000;
    uint32_t v = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    w->n_seen++;
    if (w->n_samples < w->cap) {
        w->samples[w->n_samples++] = v;
    } else {
        uint64_t j = xorshift(w) % w->n_seen;
        if (j < w->cap) w->samples[j] = v;
    }
}

/* Count `k` answers from pod name[0..n) (a table of at most MAX_PODS names; more are not kept). */
static void add_pod(struct worker *w, const char *name, size_t n, uint64_t k) {
    for (int i = 0; i < w->n_pods; i++)
        if (strlen(w->pods[i].name) == n && memcmp(w->pods[i].name, name, n) == 0) { w->pods[i].n += k; return; }
    if (w->n_pods < MAX_PODS) {
        memcpy(w->pods[w->n_pods].name, name, n);
        w->pods[w->n_pods].name[n] = 0;
        w->pods[w->n_pods++].n = k;
    }
}

/* The echo server's line starts {"pod":"NAME",...: count answers per pod (a sanity check that
 * the path load-balances, and that what answered is ours). */
static void count_pod(struct worker *w, const char *line, size_t len) {
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
    add_pod(w, p, n, 1);
}

static void finish(struct worker *w, struct slot *s, int ok_err, uint64_t now);

static void start_op(struct worker *w, struct slot *s) {
    uint64_t now = now_ns();
    if (now >= t_end) { s->st = IDLE; return; }
    int type = proto == TCP ? SOCK_STREAM : SOCK_DGRAM;
    int fd = socket(target_family, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) { ERR(err_other); s->st = IDLE; return; }
    if (proto == TCP) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    struct sockaddr_storage *dst = &targets[w->next_target];
    w->next_target = (w->next_target + 1) % n_targets;
    s->fd = fd;
    s->got = 0;
    s->start_ns = now;
    s->deadline_ns = now + (uint64_t)timeout_ms * 1000000ull;
    w->started++;
    int rc = connect(fd, (struct sockaddr *)dst, target_len);
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
        if (send(fd, payload, payload_len, 0) < 0) { finish(w, s, 1, now); ERR(err_other); return; }
        s->st = READING;
        ev.events = EPOLLIN;
    } else {
        s->st = CONNECTING;
        ev.events = EPOLLOUT;
    }
    if (epoll_ctl(w->ep, EPOLL_CTL_ADD, fd, &ev) < 0) { perror("epoll_ctl"); exit(1); }
}

/* ok_err: 0 = success (record it), 1 = error already counted by the caller. */
static void finish(struct worker *w, struct slot *s, int ok_err, uint64_t now) {
    if (!ok_err) {
        if (now >= t_measure && now < t_end) {
            w->completed++;
            record_sample(w, now - s->start_ns);
        }
    }
    if (s->fd >= 0) {
        epoll_ctl(w->ep, EPOLL_CTL_DEL, s->fd, NULL);
        close(s->fd);
    }
    s->fd = -1;
    s->st = IDLE;
}

static int count_error(struct worker *w, int err) {
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

static void on_event(struct worker *w, struct slot *s, uint32_t events) {
    uint64_t now;
    if (s->st == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) { count_error(w, err); finish(w, s, 1, now_ns()); return; }
        if (send(s->fd, payload, payload_len, MSG_NOSIGNAL) < 0) {
            count_error(w, errno); finish(w, s, 1, now_ns()); return;
        }
        s->st = READING;
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
        epoll_ctl(w->ep, EPOLL_CTL_MOD, s->fd, &ev);
        return;
    }
    (void)events;
    for (;;) {
        if (s->got >= BUF_SIZE) { ERR(bad_reply); finish(w, s, 1, now_ns()); return; }
        ssize_t n = recv(s->fd, s->buf + s->got, BUF_SIZE - s->got, 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            count_error(w, errno);
            finish(w, s, 1, now_ns());
            return;
        }
        if (n == 0) { ERR(err_eof); finish(w, s, 1, now_ns()); return; }
        s->got += (size_t)n;
        if (reply_complete(s)) {
            now = now_ns();
            if (now >= t_measure && now < t_end) count_pod(w, s->buf, s->got);
            finish(w, s, 0, now);
            return;
        }
        if (proto == UDP) { ERR(bad_reply); finish(w, s, 1, now_ns()); return; }
    }
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile (the same definition as results.percentile) of n sorted samples. */
static double pct(const uint32_t *samples, uint64_t n, double p) {
    if (!n) return 0;
    double rank = ceil(p / 100.0 * (double)n);
    uint64_t idx = rank < 1 ? 0 : (uint64_t)rank - 1;
    if (idx >= n) idx = n - 1;
    return samples[idx];
}

/* One thread's load: keep its slots busy until t_end, time out the stuck ones. */
static void *run_worker(void *arg) {
    struct worker *w = arg;
    for (int i = 0; i < w->n_slots; i++) { w->slots[i].fd = -1; start_op(w, &w->slots[i]); }
    struct epoll_event evs[256];
    uint64_t last_scan = now_ns();
    for (;;) {
        w->measuring = now_ns() >= t_measure;
        int n = epoll_wait(w->ep, evs, 256, 5);
        if (n < 0 && errno != EINTR) { perror("epoll_wait"); exit(1); }
        for (int i = 0; i < n; i++) on_event(w, evs[i].data.ptr, evs[i].events);
        uint64_t now = now_ns();
        if (now >= t_end) break;
        int scan = now - last_scan > 2000000ull;
        if (scan) last_scan = now;
        for (int i = 0; i < w->n_slots; i++) {
            struct slot *s = &w->slots[i];
            if (s->st != IDLE && scan && now > s->deadline_ns) { ERR(err_timeout); finish(w, s, 1, now); }
            if (s->st == IDLE) start_op(w, s);
        }
    }
    for (int i = 0; i < w->n_slots; i++)
        if (w->slots[i].fd >= 0) close(w->slots[i].fd);
    return NULL;
}

/* Fold worker `from` into `into`: counters summed, samples appended (each thread kept its share
 * of SAMPLE_CAP, so they fit), answers per pod added. */
static void merge(struct worker *into, const struct worker *from) {
    into->completed += from->completed;
    into->started += from->started;
    into->err_connect += from->err_connect;
    into->err_refused += from->err_refused;
    into->err_reset += from->err_reset;
    into->err_timeout += from->err_timeout;
    into->err_eof += from->err_eof;
    into->err_other += from->err_other;
    into->bad_reply += from->bad_reply;
    memmove(into->samples + into->n_samples, from->samples, from->n_samples * sizeof *from->samples); /* may overlap */
    into->n_samples += from->n_samples;
    for (int i = 0; i < from->n_pods; i++) add_pod(into, from->pods[i].name, strlen(from->pods[i].name), from->pods[i].n);
}

static void sleep_until(uint64_t t) {
    for (uint64_t now = now_ns(); now < t; now = now_ns()) {
        struct timespec ts = {(time_t)((t - now) / 1000000000ull), (long)((t - now) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
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
        else if (!strcmp(a, "--threads") && v) { threads = atoi(v); i++; }
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
    if (threads < 1 || threads > MAX_THREADS || threads > concurrency) usage("--threads: 1 to 64, at most --concurrency");
    if (timeout_ms < 1) usage("--timeout-ms: >= 1");

    alarm((unsigned)(warmup + duration) + 10); /* hard bound, whatever happens below */
    struct rlimit rl = {MAX_SLOTS + 64, MAX_SLOTS + 64};
    setrlimit(RLIMIT_NOFILE, &rl);
    uint32_t *samples = malloc(SAMPLE_CAP * sizeof *samples);
    struct worker *workers = calloc((size_t)threads, sizeof *workers);
    struct slot *slots = calloc((size_t)concurrency, sizeof *slots);
    if (!samples || !workers || !slots) { perror("malloc"); return 1; }

    uint64_t t0 = now_ns();
    t_measure = t0 + (uint64_t)(warmup * 1e9);
    t_end = t_measure + (uint64_t)(duration * 1e9);
    int slot = 0;
    uint64_t share = SAMPLE_CAP / (uint64_t)threads;
    for (int t = 0; t < threads; t++) {
        struct worker *w = &workers[t];
        w->n_slots = concurrency / threads + (t < concurrency % threads);
        w->slots = slots + slot;
        slot += w->n_slots;
        w->samples = samples + share * (uint64_t)t; /* adjacent shares: merging moves them together */
        w->cap = share;
        w->rng = 88172645463325252ull + (uint64_t)t * 0x9e3779b97f4a7c15ull;
        w->next_target = t % n_targets;
        w->ep = epoll_create1(EPOLL_CLOEXEC);
        if (w->ep < 0) { perror("epoll_create1"); return 1; }
    }
    pthread_t tids[MAX_THREADS];
    for (int t = 0; t < threads; t++)
        if ((errno = pthread_create(&tids[t], NULL, run_worker, &workers[t])) != 0) { perror("pthread_create"); return 1; }
    sleep_until(t_measure);
    struct cpu_ticks cpu_start = read_cpu();
    double self_start = self_cpu();
    sleep_until(t_end);
    struct cpu_ticks cpu_end = read_cpu();
    double self_end = self_cpu();
    for (int t = 0; t < threads; t++) pthread_join(tids[t], NULL);
    struct worker *w = &workers[0]; /* the whole run's figures */
    for (int t = 1; t < threads; t++) merge(w, &workers[t]);
    uint64_t n_samples = w->n_samples;

    qsort(samples, n_samples, sizeof *samples, cmp_u32);
    double sum = 0;
    for (uint64_t i = 0; i < n_samples; i++) sum += samples[i];
    printf("{\"proto\":\"%s\",\"duration_s\":%.6f,\"warmup_s\":%.3f,\"concurrency\":%d,\"threads\":%d,\"targets\":[",
           proto == TCP ? "tcp" : "udp", duration, warmup, concurrency, threads);
    for (int i = 0; i < n_targets; i++) {
        char target[INET6_ADDRSTRLEN + 16];
        format_target(i, target, sizeof target);
        printf("%s\"%s\"", i ? "," : "", target);
    }
    printf("],\"started\":%llu,\"completed\":%llu,\"rate\":%.3f,", (unsigned long long)w->started,
           (unsigned long long)w->completed, (double)w->completed / duration);
    printf("\"latency_us\":{\"samples\":%llu,\"min\":%.0f,\"mean\":%.3f,\"p50\":%.0f,\"p90\":%.0f,"
           "\"p99\":%.0f,\"p999\":%.0f,\"max\":%.0f},",
           (unsigned long long)n_samples, n_samples ? (double)samples[0] : 0.0,
           n_samples ? sum / (double)n_samples : 0.0, pct(samples, n_samples, 50), pct(samples, n_samples, 90),
           pct(samples, n_samples, 99), pct(samples, n_samples, 99.9),
           n_samples ? (double)samples[n_samples - 1] : 0.0);
    printf("\"errors\":{\"connect\":%llu,\"refused\":%llu,\"reset\":%llu,\"timeout\":%llu,\"eof\":%llu,"
           "\"bad_reply\":%llu,\"other\":%llu},\"backends\":{",
           (unsigned long long)w->err_connect, (unsigned long long)w->err_refused, (unsigned long long)w->err_reset,
           (unsigned long long)w->err_timeout, (unsigned long long)w->err_eof, (unsigned long long)w->bad_reply,
           (unsigned long long)w->err_other);
    for (int i = 0; i < w->n_pods; i++)
        printf("%s\"%s\":%llu", i ? "," : "", w->pods[i].name, (unsigned long long)w->pods[i].n);
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
