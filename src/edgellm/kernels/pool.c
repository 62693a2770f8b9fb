/* The thread pool of pool.h.

   A job is published as one 64-bit word, (sequence << 16) | threads: a worker that sees a new word
   knows at once whether it takes part, and body/ctx cannot change under a participant, since the
   next job waits for it. Workers spin on the word for SPIN_NS after their last job, then sleep on
   a condition variable; the caller wakes sleepers only when there are any (a Dekker pair of
   seq_cst atomics: `sleepers` raised before the last look at the word, the word stored before
   `sleepers` is read).

   A share goes to whichever thread claims it first: its worker, or the caller once the caller's own
   share is done. So a worker without a core (torch's OpenMP threads spin ~20 ms after each of
   torch's parallel ops, and a 2-core machine then has none to spare) delays nothing: a tiny model's
   decode step after a torch head waited 3.6 ms for it, against 0.05 ms when OpenMP slept. A claim
   raises the share's slot to the job word: a worker that wakes to a finished job finds its share
   claimed under that word or a later one and skips it. */
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define POOL_MAX 256
/* A worker spins SPIN_PAUSE_NS after a job (the next kernel of a decode step comes within
   microseconds), then spins yielding its core to any thread that wants it (torch's GEMM threads
   in a prompt, the caller's Python between decode steps) up to SPIN_NS, then sleeps. */
#define SPIN_PAUSE_NS 50000L
#define SPIN_NS 1000000L

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static struct {
    pthread_mutex_t turn; /* one caller at a time */
    pthread_mutex_t lock; /* with `wake`: for sleeping workers */
    pthread_cond_t wake;
    _Atomic uint64_t job;
    atomic_int sleepers, pending;          /* pending: shares of the job not yet finished */
    _Atomic uint64_t taken[POOL_MAX];      /* the job word its share was last claimed under */
    PoolBody body;
    void *ctx;
    int workers;              /* started, thread ids 1 .. workers */
    uint64_t born[POOL_MAX];  /* the job word each worker was started under */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static _Thread_local int inside; /* this thread is running a body */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Whether share t of `job` is the calling thread's to run: nobody claimed it under this job or a
   later one. Job words only grow, and every share of a finished job was claimed, so a worker that
   slept through jobs (its word is stale) can never claim: it would run the new job's body with the
   old job's thread count. */
static int claim(int t, uint64_t job) {
    uint64_t seen = atomic_load_explicit(&pool.taken[t], memory_order_relaxed);
    while (seen < job)
        if (atomic_compare_exchange_weak_explicit(&pool.taken[t], &seen, job, memory_order_acq_rel,
                                                  memory_order_relaxed))
            return 1;
    return 0;
}

static uint64_t next_job(uint64_t seen) {
    int64_t start = now_ns(), polite = start + SPIN_PAUSE_NS, until = start + SPIN_NS;
    for (unsigned spin = 1;; spin++) {
        uint64_t job = atomic_load_explicit(&pool.job, memory_order_acquire);
        if (job != seen) return job;
        if (spin % 64 == 0) {
            int64_t t = now_ns();
            if (t > until) break;
            if (t > polite) sched_yield();
        }
        CPU_RELAX();
    }
    atomic_fetch_add(&pool.sleepers, 1);
    pthread_mutex_lock(&pool.lock);
    uint64_t job;
    while ((job = atomic_load(&pool.job)) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    atomic_fetch_sub(&pool.sleepers, 1);
    return job;
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    inside = 1;
    for (uint64_t job = pool.born[me];;) {
        job = next_job(job);
        int threads = (int)(job & 0xFFFF);
        if (me >= threads || !claim(me, job)) continue;
        pool.body(pool.ctx, me, threads);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* In a child of fork() the workers are gone (only the forking thread survives): start afresh. */
static void after_fork(void) {
    pthread_mutex_init(&pool.turn, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.pending, 0);
    pool.workers = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork); }

/* Start workers up to `threads` - 1 (with the caller's turn held); returns how many threads run. */
static int start_workers(int threads) {
    if (pool.workers + 1 >= threads) return threads;  /* the usual case: no signal-mask syscalls per job */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* signals go to the caller's threads, never to a worker */
    while (pool.workers + 1 < threads) {
        int me = pool.workers + 1;
        pool.born[me] = atomic_load(&pool.job);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)me);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers = me;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return threads < pool.workers + 1 ? threads : pool.workers + 1;
}

void pool_run(int threads, PoolBody body, void *ctx) {
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (threads <= 1 || inside) {
        for (int t = 0; t < (threads > 1 ? threads : 1); t++) body(ctx, t, threads > 1 ? threads : 1);
        return;
    }
    pthread_mutex_lock(&pool.turn);
    threads = start_workers(threads);
    pool.body = body, pool.ctx = ctx;
    atomic_store(&pool.pending, threads - 1);
    uint64_t job = ((atomic_load(&pool.job) >> 16) + 1) << 16 | (uint64_t)threads;
    atomic_store(&pool.job, job);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    inside = 1;
    body(ctx, 0, threads);
    for (int t = 1; t < threads; t++) /* the shares no worker has started */
        if (claim(t, job)) {
            body(ctx, t, threads);
            atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_relaxed);
        }
    inside = 0;
    for (unsigned spin = 1; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; spin++)
        if (spin < 1u << 16) CPU_RELAX();
        else sched_yield(); /* a worker lost its core mid-share: let it have ours */
    pthread_mutex_unlock(&pool.turn);
}

typedef struct {
    PoolRange range;
    void *ctx;
    int64_t n;
} Shares;

static void run_share(void *p, int t, int threads) {
    const Shares *s = p;
    int64_t begin, end;
    pool_share(s->n, t, threads, &begin, &end);
    if (begin < end) s->range(s->ctx, begin, end);
}

void pool_for(int64_t n, int threads, PoolRange range, void *ctx) {
    if (n <= 0) return;
    Shares s = {range, ctx, n};
    pool_run(n < threads ? (int)n : threads, run_share, &s);
}

void team_run(int threads, PoolBody body, void *ctx) {
#ifdef _OPENMP
    if (threads > 1 && !inside) {
#pragma omp parallel num_threads(threads)
        body(ctx, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    pool_run(threads, body, ctx);
}

void team_for(int64_t n, int threads, PoolRange range, void *ctx) {
    if (n <= 0) return;
    Shares s = {range, ctx, n};
    team_run(n < threads ? (int)n : threads, run_share, &s);
}
