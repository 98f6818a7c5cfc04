// The pool: a GEMM split over threads by columns in one C call (q8_matmul, q4_matmul), without
// Python between. Handing each split to a Python thread pool cost ~30-50 us a GEMM, so one-row
// decode GEMMs (~10-60 us) ran on one thread. Workers live here instead: the caller publishes a
// job, wakes them (a store they spin on briefly, then a futex), and takes columns itself;
// everyone takes `chunk` columns at a time from one counter, and the caller returns when every
// column is done, not when every worker has looked: a worker the OS holds back leaves its part
// to the others, and later finds the counter moved on. The counter holds the job's generation,
// N and the next column, so a late worker can only claim a column of the job it was woken for
// while that job is unfinished (and its arguments, on the caller's stack, still in place). A
// column's bits do not depend on which thread computes it (one thread sums it, in group order).
//
// Each library including this has a pool of its own (static state): q8's and q4's workers are
// separate threads, each set idle while the other library's GEMMs run.
#ifndef BATCHMLX_POOL_H
#define BATCHMLX_POOL_H

#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#define POOL_MAX 63          // workers at most (threads - 1)
#define GEN_BITS 24          // counter: generation (24 bits) | N (20) | next column (20)
#define COL_BITS 20
#define COL_MASK ((1ull << COL_BITS) - 1)
#define WAIT_PAUSES 256      // the caller spins this long for the workers' columns, then sleeps
#define SPIN_ROUNDS 16       // a worker spins ~16 x 4 us for the next job, then sleeps...
#define IDLE_SPIN_ROUNDS 512 // ...or ~2 ms while its CPU has nothing else to run (see pool_worker)
#define YIELD_RAN_OTHERS_NS 30000  // a sched_yield this long: another thread ran on our CPU

// columns [n0, n1) of the job whose arguments `args` points to
typedef void (*pool_columns)(const void* args, int n0, int n1);

struct pool_job {
    pool_columns run;
    const void* args;
    int chunk;
};

static struct {
    pthread_mutex_t lock;  // one caller at a time (others compute alone)
    int workers;           // started
    uint32_t wake;         // the generation the workers wait on (futex word)
    int sleepers;          // workers in futex_wait
    int active;            // workers this job may use (the caller's threads - 1)
    uint64_t counter;      // generation | N | next column
    int done;              // columns finished in this generation (futex word)
    int waiting;           // the caller sleeps on `done`
    int64_t helped;        // columns the workers computed, all jobs (for tests)
    struct pool_job job;
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, {0}};

// Claims chunks of generation `gen` until none is left (or the job is another's)
static void pool_take(uint32_t gen, int helper) {
    for (;;) {
        uint64_t c = __atomic_load_n(&pool.counter, __ATOMIC_ACQUIRE);
        int n = (int)(c >> COL_BITS & COL_MASK), next = (int)(c & COL_MASK);
        if ((uint32_t)(c >> (2 * COL_BITS)) != gen || next >= n) return;
        // the job is unfinished while `next` < N: its arguments are this generation's
        struct pool_job j = pool.job;
        int n1 = next + j.chunk < n ? next + j.chunk : n;
        if (!__atomic_compare_exchange_n(&pool.counter, &c, c - next + n1, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        j.run(j.args, next, n1);
        if (!helper) {
            __atomic_fetch_add(&pool.done, n1 - next, __ATOMIC_RELEASE);
            continue;
        }
        __atomic_fetch_add(&pool.helped, n1 - next, __ATOMIC_RELAXED);
        // the last columns: wake the caller if it sleeps (see pool_run)
        if (__atomic_add_fetch(&pool.done, n1 - next, __ATOMIC_SEQ_CST) == n &&
            __atomic_load_n(&pool.waiting, __ATOMIC_SEQ_CST))
            syscall(SYS_futex, &pool.done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
}

// sched_yield, and whether it let another thread run (it took YIELD_RAN_OTHERS_NS or more)
static inline int yield_ran_others(void) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    sched_yield();
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec) >= YIELD_RAN_OTHERS_NS;
}

static void* pool_worker(void* arg) {
    int index = (int)(intptr_t)arg;
    // AMX's tile state, asked for per thread (harmless where there is none)
    syscall(SYS_arch_prctl, 0x1023, 18);
    uint32_t seen = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t w = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
        // spin rounds of 64 pauses, yielding after each: woken onto the caller's CPU (the
        // other one busy), a worker that only spun would hold it from the caller. Asleep, a
        // worker wakes too late for a one-row GEMM (~10-100 us), and the decode step's GEMMs
        // come ~20-150 us apart (its attention, norms, Python between): so while its CPU is
        // otherwise idle (each yield comes straight back) it spins IDLE_SPIN_ROUNDS (~2 ms, a
        // step's gaps), and once a yield shows another thread waiting there, SPIN_ROUNDS only
        // (measured, 135M, 2-core Xeon: width-1 decode step 18.6 -> 14.0 ms, its GEMMs 9.5 ->
        // 6.8 ms; spinning long beside a busy process cost width-64 steps 5-12%)
        int contended = 0;
        for (int round = 0; w == seen; round++) {
            for (int i = 0; i < 64 && w == seen; i++) {
                _mm_pause();
                w = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
            }
            if (w != seen) break;
            contended |= yield_ran_others();
            if (round >= (contended ? SPIN_ROUNDS : IDLE_SPIN_ROUNDS)) {
                // sleep: the caller's store to `wake` then its look at `sleepers`, and ours in
                // the other order (both sequentially consistent), lose no wake-up
                __atomic_fetch_add(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                syscall(SYS_futex, &pool.wake, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                __atomic_fetch_sub(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                round = 0;
                contended = 0;
            }
            w = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
        }
        seen = w;
        if (index < __atomic_load_n(&pool.active, __ATOMIC_ACQUIRE))
            pool_take(w & ((1u << GEN_BITS) - 1), 1);
    }
    return NULL;
}

static void pool_forked(void) {  // a child has none of the parent's workers
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = pool.sleepers = 0;
}

// Starts workers until there are `want` (fewer where the OS refuses); under the lock
static void pool_grow(int want) {
    static int atfork;
    if (!atfork) atfork = pthread_atfork(NULL, NULL, pool_forked) == 0;
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        // what the lent kernels keep on their stacks too (runner.h): head8's AMX path holds
        // two column blocks of widened weights, 256 KB at K = 2,048 (1.7B), 1 MB at 8,192;
        // 256 KB here ended a 1.7B process with SIGSEGV. Reserved, not touched, past use
        pthread_attr_setstacksize(&attr, 8 << 20);
        int failed = pthread_create(&t, &attr, pool_worker, (void*)(intptr_t)pool.workers);
        pthread_attr_destroy(&attr);
        if (failed) return;
        pool.workers++;
    }
}

// Columns [0, N) of a job: `run(args, n0, n1)` `chunk` columns at a time over this thread and
// up to threads - 1 workers (threads 1: this thread alone, in one call); returns when all are
// done. N < 2^19.
static void pool_run(pool_columns run, const void* args, int N, int chunk, int threads) {
    int helpers = threads - 1 < POOL_MAX ? threads - 1 : POOL_MAX;
    if (helpers < 1 || chunk >= N || N >= (1 << (COL_BITS - 1)) ||
        pthread_mutex_trylock(&pool.lock)) {
        run(args, 0, N);
        return;
    }
    pool_grow(helpers);
    uint32_t gen = (__atomic_load_n(&pool.wake, __ATOMIC_RELAXED) + 1) & ((1u << GEN_BITS) - 1);
    // a late worker may read this meanwhile but claims nothing with it: the counter still
    // holds the last job, finished
    pool.job = (struct pool_job){run, args, chunk};
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.active, helpers, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.counter, (uint64_t)gen << (2 * COL_BITS) | (uint64_t)N << COL_BITS,
                     __ATOMIC_RELEASE);
    __atomic_store_n(&pool.wake, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &pool.wake, FUTEX_WAKE_PRIVATE, POOL_MAX, NULL, NULL, 0);
    pool_take(gen, 0);
    // the columns workers took: a chunk's time, unless the OS holds a worker back. Then sleep
    // rather than spin: an idle CPU is where Linux puts the worker (spinning here, width-64
    // steps at load 4-6 on 2 cores took 1.2-2x a Python pool's, which blocked)
    for (int i = 0;; i++) {
        int d = __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE);
        if (d >= N) break;
        if (i < WAIT_PAUSES) {
            _mm_pause();
            continue;
        }
        __atomic_store_n(&pool.waiting, 1, __ATOMIC_SEQ_CST);
        d = __atomic_load_n(&pool.done, __ATOMIC_SEQ_CST);
        if (d < N) {
            struct timespec t = {0, 1000000};  // 1 ms: a bound, not needed to wake
            syscall(SYS_futex, &pool.done, FUTEX_WAIT_PRIVATE, d, &t, NULL, 0);
        }
    }
    __atomic_store_n(&pool.waiting, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&pool.lock);
}

// Workers started, and the columns they have computed (for tests)
static inline int pool_workers(void) { return pool.workers; }
static inline int64_t pool_helped(void) { return __atomic_load_n(&pool.helped, __ATOMIC_RELAXED); }

#endif
