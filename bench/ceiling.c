/* The hardware ceiling for smcd's 64 KiB throughput figure: what two processes sharing memory
 * can move on this machine when nothing but C and the cache hierarchy stands between them.
 *
 *   ceiling RING CHUNK RBUF VOLUME WARMUP REPEATS [copy|touch|none]
 *
 * A producer (the parent) copies CHUNK-byte writes into a RING-byte ring in a MAP_SHARED
 * anonymous mapping; a consumer (a forked child) takes whatever is there, up to RBUF bytes at a
 * time, and copies it out into an RBUF-byte buffer: exactly what an application's send and
 * recv_into do over an SMC-D ring, minus everything smcd adds. The cursors are release/acquire
 * atomics on separate cache lines; both sides spin (no syscalls on the data path).
 *
 * WARMUP bytes go through first, untimed; then REPEATS runs of VOLUME bytes each, each timed by
 * the producer from its first write until the consumer's cursor acknowledges the last byte. The
 * last line is machine-readable:
 *
 *   RESULT bytes_per_s=<median> runs=<r1>,<r2>,... verified=<samples>
 *
 * Verification: every 8-byte word of a write is distinct (a xorshift pattern, the first word of
 * each write replaced by its sequence number), and the consumer checks one word per VERIFY_STRIDE
 * bytes of the stream it received, plus the byte count. A wrong ring offset, a lost or repeated
 * write or a copy that never happened makes the program exit 1 instead of reporting a figure.
 *
 * The modes other than `copy` are the evidence for what bounds the copy: `touch` reads one byte
 * per cache line straight from the ring (no copy), `none` releases the bytes unread (only the
 * producer's writes and the cursor traffic remain; nothing can be verified but the count).
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

enum { LINE = 64, VERIFY_STRIDE = 1024, MAX_REPEATS = 64, TIMEOUT_S = 300 };
#ifndef YIELD_SPINS
#define YIELD_SPINS (1UL << 20) /* tens of ms of PAUSE: only when both share one CPU */
#endif
enum mode { COPY, TOUCH, NONE };

/* The shared header: each cursor alone on its cache line, so the producer's stores to `prod`
 * never invalidate the line the producer polls `cons` on, and vice versa. */
struct shared {
    _Alignas(LINE) _Atomic uint64_t prod; /* bytes written into the ring, ever */
    _Alignas(LINE) _Atomic uint64_t cons; /* bytes taken out of the ring, ever */
    _Alignas(LINE) struct check {        /* consumer → producer, written once at the end */
        uint64_t samples;                 /* words compared */
        uint64_t bad_at;                  /* stream offset of the first mismatch + 1; 0: none */
        uint64_t sink;                    /* keeps `touch` from being optimised away */
    } check;
};

/* One turn of a wait loop; `spins` counts the turns of this one wait (start it at 0). */
static inline void relax(unsigned long *spins)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    /* Not on the data path: only if the other side has not moved for a very long time (both
     * processes on one CPU, under load) give the CPU away instead of burning the time slice. */
    if (++*spins % YIELD_SPINS == 0)
        sched_yield();
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* The word expected at `stream` (a multiple of 8) of the byte stream: the write's sequence
 * number at the start of each write, else the pattern's word at that offset within the write. */
static uint64_t expected(const uint64_t *pattern, uint64_t chunk, uint64_t stream)
{
    uint64_t within = stream % chunk;
    return within == 0 ? stream / chunk : pattern[within / 8];
}

/* Check the sampled words of stream bytes [at, at + n), found at `got` (copy: the read buffer)
 * or in the ring (touch, possibly wrapped: `got` then is the ring and `off` its offset). */
static void verify(struct check *ck, const uint64_t *pattern, uint64_t chunk, const char *got,
                   uint64_t ring, uint64_t off, uint64_t at, uint64_t n)
{
    uint64_t first = (at + VERIFY_STRIDE - 1) / VERIFY_STRIDE * VERIFY_STRIDE;
    for (uint64_t s = first; s < at + n; s += VERIFY_STRIDE) {
        uint64_t word, pos = off + (s - at);
        if (ring)
            pos %= ring;
        memcpy(&word, got + pos, sizeof word);
        if (word != expected(pattern, chunk, s) && !ck->bad_at)
            ck->bad_at = s + 1;
        ck->samples++;
    }
}

static void consumer(struct shared *sh, char *data, const uint64_t *pattern, uint64_t ring,
                     uint64_t chunk, uint64_t rbuf, uint64_t total, enum mode mode)
{
    char *dst = malloc(rbuf);
    if (!dst)
        _exit(3);
    memset(dst, 0, rbuf); /* fault the pages in before the clock can see them */
    struct check ck = {0};
    uint64_t c = 0;
    while (c < total) {
        uint64_t p;
        unsigned long spins = 0;
        while ((p = atomic_load_explicit(&sh->prod, memory_order_acquire)) == c)
            relax(&spins);
        uint64_t n = p - c < rbuf ? p - c : rbuf;
        uint64_t off = c % ring, first = ring - off < n ? ring - off : n;
        if (mode == COPY) {
            memcpy(dst, data + off, first);
            memcpy(dst + first, data, n - first);
            verify(&ck, pattern, chunk, dst, 0, 0, c, n);
        } else if (mode == TOUCH) {
            for (uint64_t i = 0; i < first; i += LINE)
                ck.sink += (unsigned char)data[off + i];
            for (uint64_t i = 0; i < n - first; i += LINE)
                ck.sink += (unsigned char)data[i];
            verify(&ck, pattern, chunk, data, ring, off, c, n);
        }
        c += n;
        atomic_store_explicit(&sh->cons, c, memory_order_release);
    }
    sh->check = ck;
    free(dst);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t arg(const char *s, const char *what)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*s == '\0' || *end != '\0') {
        fprintf(stderr, "ceiling: %s: not a number: %s\n", what, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv)
{
    if (argc != 7 && argc != 8) {
        fprintf(stderr, "usage: %s RING CHUNK RBUF VOLUME WARMUP REPEATS [copy|touch|none]\n",
                argv[0]);
        return 2;
    }
    uint64_t ring = arg(argv[1], "RING"), chunk = arg(argv[2], "CHUNK");
    uint64_t rbuf = arg(argv[3], "RBUF"), volume = arg(argv[4], "VOLUME");
    uint64_t warmup = arg(argv[5], "WARMUP"), repeats = arg(argv[6], "REPEATS");
    const char *mname = argc == 8 ? argv[7] : "copy";
    enum mode mode = !strcmp(mname, "copy") ? COPY : !strcmp(mname, "touch") ? TOUCH : NONE;
    if (strcmp(mname, "copy") && strcmp(mname, "touch") && strcmp(mname, "none")) {
        fprintf(stderr, "ceiling: unknown mode %s\n", mname);
        return 2;
    }
    /* Multiples of 8 keep every cursor on a word boundary, so a sampled word never straddles
     * two reads; whole writes keep the run's volume exact. */
    if (chunk < 8 || chunk % 8 || ring % 8 || rbuf % 8 || chunk > ring || rbuf < 8 ||
        volume % chunk || warmup % chunk || volume == 0 || repeats < 1 ||
        repeats > MAX_REPEATS) {
        fprintf(stderr, "ceiling: need 8 <= CHUNK <= RING, all three multiples of 8, VOLUME "
                        "and WARMUP whole CHUNKs, 1 <= REPEATS <= %d\n", MAX_REPEATS);
        return 2;
    }

    /* One page of header, then the ring; zeroed so every page is faulted in before timing. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *map = mmap(NULL, page + ring, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
        perror("ceiling: mmap");
        return 1;
    }
    memset(map, 0, page + ring);
    struct shared *sh = (struct shared *)map;
    char *data = map + page;

    /* The writes' content, made before the fork so both sides know it. */
    uint64_t *pattern = malloc(chunk), *src = malloc(chunk), x = 0x9e3779b97f4a7c15u;
    if (!pattern || !src) {
        perror("ceiling: malloc");
        return 1;
    }
    for (uint64_t i = 0; i < chunk / 8; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        pattern[i] = x;
    }
    memcpy(src, pattern, chunk);
    uint64_t total = warmup + repeats * volume;

    alarm(TIMEOUT_S); /* a hang (the other side died) ends as SIGALRM, not forever */
    pid_t pid = fork();
    if (pid < 0) {
        perror("ceiling: fork");
        return 1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the producer */
        alarm(TIMEOUT_S);
        consumer(sh, data, pattern, ring, chunk, rbuf, total, mode);
        _exit(0);
    }

    double rates[MAX_REPEATS];
    uint64_t p = 0, seq = 0, end = warmup;
    unsigned long spins;
    for (uint64_t run = 0; run <= repeats; run++) { /* run 0 is the warm-up */
        double t0 = now();
        while (p < end) {
            spins = 0;
            while (p + chunk - atomic_load_explicit(&sh->cons, memory_order_acquire) > ring)
                relax(&spins);
            src[0] = seq++;
            uint64_t off = p % ring, first = ring - off < chunk ? ring - off : chunk;
            memcpy(data + off, src, first);
            memcpy(data, (char *)src + first, chunk - first);
            p += chunk;
            atomic_store_explicit(&sh->prod, p, memory_order_release);
        }
        spins = 0;
        while (atomic_load_explicit(&sh->cons, memory_order_acquire) < end)
            relax(&spins); /* the reader's acknowledgement of the last byte */
        double t1 = now();
        if (run > 0)
            rates[run - 1] = (double)volume / (t1 - t0);
        end += volume;
    }

    int status = -1;
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "ceiling: the consumer failed (status %d)\n", status);
        return 1;
    }
    if (sh->check.bad_at) {
        fprintf(stderr, "ceiling: wrong data at stream offset %llu\n",
                (unsigned long long)(sh->check.bad_at - 1));
        return 1;
    }
    if (mode != NONE && sh->check.samples < total / VERIFY_STRIDE) {
        fprintf(stderr, "ceiling: only %llu samples checked\n",
                (unsigned long long)sh->check.samples);
        return 1;
    }

    for (uint64_t i = 0; i < repeats; i++)
        fprintf(stderr, "ceiling %s: run %llu: %.2f GB/s\n", mname, (unsigned long long)i + 1,
                rates[i] / 1e9);
    double sorted[MAX_REPEATS];
    memcpy(sorted, rates, sizeof(double) * repeats);
    qsort(sorted, repeats, sizeof(double), cmp);
    double median = repeats % 2 ? sorted[repeats / 2]
                                : (sorted[repeats / 2 - 1] + sorted[repeats / 2]) / 2;
    printf("RESULT bytes_per_s=%.6e runs=", median);
    for (uint64_t i = 0; i < repeats; i++)
        printf("%s%.6e", i ? "," : "", rates[i]);
    printf(" verified=%llu\n", (unsigned long long)sh->check.samples);
    return 0;
}
