/* How kernels share out their work between threads: two kinds of team.

   pool_*: edgellm's own thread pool, one per process (per loaded kernel library), shared by every
   thread that calls a kernel. The decode kernels run on it. Why not `#pragma omp` there: libgomp
   keeps a pool of workers per calling thread, and once the pools' threads outnumber the cores it
   stops spinning at barriers and sleeps on a futex instead. A Python program that ran the model in
   its main thread and then in a server thread decoded ~4x slower (docs/performance.md). The pool's
   workers spin a little after each job (decode calls come microseconds apart), then sleep.

   team_*: the OpenMP team of the calling thread, the one torch's GEMMs use (our library binds to
   torch's libgomp). The prompt kernels run there, between a prompt's GEMMs: the same threads go
   from GEMM to kernel to GEMM while still spinning. On the pool instead, each hand-over between the
   two sets of threads cost a wake-up or a core, and a 512-token prompt took 10-15 % longer.
   Without OpenMP (a compiler lacking it) team_* runs on the pool. */
#ifndef EDGELLM_POOL_H
#define EDGELLM_POOL_H
#include <stdint.h>

/* body(ctx, t, threads) runs once for each share t = 0 .. threads - 1: the caller runs share 0,
   worker t share t unless the caller, done with its own, claimed it first (a worker without a
   core delays nothing); returns when all have run. A body must not wait for another share.
   Callers in different threads take turns; a call from inside a body runs its shares one after
   another in the calling thread. */
typedef void (*PoolBody)(void *ctx, int thread, int threads);
void pool_run(int threads, PoolBody body, void *ctx);

/* range(ctx, begin, end) over contiguous shares of [0, n), one per thread (at most n threads). */
typedef void (*PoolRange)(void *ctx, int64_t begin, int64_t end);
void pool_for(int64_t n, int threads, PoolRange range, void *ctx);

/* The same on the calling thread's OpenMP team. */
void team_run(int threads, PoolBody body, void *ctx);
void team_for(int64_t n, int threads, PoolRange range, void *ctx);

/* Thread t's share of n items split over `threads`: [*begin, *end). */
static inline void pool_share(int64_t n, int t, int threads, int64_t *begin, int64_t *end) {
    *begin = n * t / threads;
    *end = n * (t + 1) / threads;
}

#endif
