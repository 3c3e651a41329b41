/* The round-trip bound for the user view's request/response rows: two C processes over shared
 * memory, one ring per direction, nothing else between them.
 *
 *   rtt_ceiling SIZE PIECE ROUNDS WARMUP
 *
 * The client (the parent) copies a SIZE-byte request into the request ring, publishing its
 * producer cursor after every PIECE bytes; the server (a forked child) copies the bytes out as
 * they are published into its own SIZE-byte buffer, then copies that buffer into the response
 * ring the same way; the client copies the response out and compares it with the request, which
 * changes every round. With PIECE < SIZE the copies of the two sides overlap (what a channel that
 * publishes piece by piece can do at best); with PIECE = SIZE they do not. Cursors are
 * release/acquire atomics on cache lines of their own; both sides spin (no syscalls), each on a
 * CPU of its own when the process may use two (one CPU is the Python bound's other row).
 *
 * The last line is machine-readable (nanoseconds, nearest rank):
 *
 *   RESULT p50_ns=<p50> p99_ns=<p99> rounds=<n>
 *
 * A wrong echo makes the program exit 1 instead of reporting a figure.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { LINE = 64, TIMEOUT_S = 120 };

struct dir {
    _Alignas(LINE) _Atomic uint64_t prod; /* bytes published in this direction, ever */
    _Alignas(LINE) _Atomic uint64_t cons; /* bytes taken out, ever */
};

struct shared {
    struct dir req, resp;
    _Alignas(LINE) _Atomic int bad;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void relax(unsigned long *spins)
{
    if (++*spins % (1UL << 20) == 0)
        sched_yield(); /* only when both share one CPU */
    __builtin_ia32_pause();
}

/* Copy `size` bytes from `src` into `ring` (one message per round: the ring holds SIZE bytes,
 * and the writer waits until the reader took the previous message). */
static void put(struct dir *d, char *ring, const char *src, uint64_t size, uint64_t piece)
{
    unsigned long spins = 0;
    uint64_t base = atomic_load_explicit(&d->prod, memory_order_relaxed);
    while (atomic_load_explicit(&d->cons, memory_order_acquire) != base)
        relax(&spins);
    for (uint64_t off = 0; off < size; off += piece) {
        uint64_t k = size - off < piece ? size - off : piece;
        memcpy(ring + off, src + off, k);
        atomic_store_explicit(&d->prod, base + off + k, memory_order_release);
    }
}

static void get(struct dir *d, const char *ring, char *dst, uint64_t size)
{
    unsigned long spins = 0;
    uint64_t base = atomic_load_explicit(&d->cons, memory_order_relaxed);
    uint64_t got = 0;
    while (got < size) {
        uint64_t p = atomic_load_explicit(&d->prod, memory_order_acquire) - base;
        if (p == got) {
            relax(&spins);
            continue;
        }
        memcpy(dst + got, ring + got, p - got);
        got = p;
    }
    atomic_store_explicit(&d->cons, base + size, memory_order_release);
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void pin(int cpu)
{
    if (cpu < 0)
        return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    sched_setaffinity(0, sizeof one, &one); /* best effort: unpinned still measures */
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: rtt_ceiling SIZE PIECE ROUNDS WARMUP\n");
        return 2;
    }
    uint64_t size = strtoull(argv[1], 0, 0), piece = strtoull(argv[2], 0, 0);
    uint64_t rounds = strtoull(argv[3], 0, 0), warmup = strtoull(argv[4], 0, 0);
    if (!size || !piece || !rounds) {
        fprintf(stderr, "rtt_ceiling: SIZE, PIECE and ROUNDS must be > 0\n");
        return 2;
    }
    size_t map = sizeof(struct shared) + 2 * size + 2 * LINE;
    struct shared *sh = mmap(0, map, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    char *req = (char *)sh + ((sizeof(struct shared) + LINE - 1) / LINE) * LINE;
    char *resp = req + ((size + LINE - 1) / LINE) * LINE;
    alarm(TIMEOUT_S);
    /* Two CPUs of our own when there are two: spinners that share one get there by yielding
     * every 2^20 spins, which measured milliseconds, not the bound. */
    int cpus[2] = {-1, -1}, found = 0;
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
        for (int c = 0; c < CPU_SETSIZE && found < 2; c++)
            if (CPU_ISSET(c, &allowed))
                cpus[found++] = c;
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) { /* the server: echo every request */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        pin(found == 2 ? cpus[1] : -1);
        char *buf = malloc(size);
        for (uint64_t i = 0; i < warmup + rounds; i++) {
            get(&sh->req, req, buf, size);
            put(&sh->resp, resp, buf, size, piece);
        }
        _exit(0);
    }
    pin(found == 2 ? cpus[0] : -1);
    char *msg = malloc(size), *back = malloc(size);
    uint64_t *rtt = malloc(rounds * sizeof *rtt);
    for (uint64_t i = 0; i < size; i++)
        msg[i] = (char)(i * 131u);
    for (uint64_t i = 0; i < warmup + rounds; i++) {
        msg[0] = (char)i; /* every round's request differs */
        uint64_t t0 = now_ns();
        put(&sh->req, req, msg, size, piece);
        get(&sh->resp, resp, back, size);
        uint64_t t1 = now_ns();
        if (memcmp(msg, back, size) != 0) {
            fprintf(stderr, "rtt_ceiling: wrong echo in round %llu\n", (unsigned long long)i);
            kill(pid, SIGKILL);
            return 1;
        }
        if (i >= warmup)
            rtt[i - warmup] = t1 - t0;
    }
    int status;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "rtt_ceiling: server failed\n");
        return 1;
    }
    qsort(rtt, rounds, sizeof *rtt, cmp);
    uint64_t r50 = (50 * rounds + 99) / 100, r99 = (99 * rounds + 99) / 100;
    printf("RESULT p50_ns=%llu p99_ns=%llu rounds=%llu\n",
           (unsigned long long)rtt[r50 ? r50 - 1 : 0], (unsigned long long)rtt[r99 ? r99 - 1 : 0],
           (unsigned long long)rounds);
    return 0;
}
