// A thread pool as another library lends it (q8.c's q8_pool_run, over pool.h's workers): a
// library that takes one runs its parts on the GEMMs' spinning workers, so that a process has
// one set of them. runner(fn, arg, n, chunk, threads) calls fn(arg, c0, c1) over [0, n),
// `chunk` at a time, on the calling thread and up to threads - 1 workers, and returns when
// all are done (pool.h's pool_run, whose pool_columns has fn's type).
#ifndef BATCHMLX_RUNNER_H
#define BATCHMLX_RUNNER_H

typedef void (*pool_fn)(const void* arg, int c0, int c1);
typedef void (*pool_runner)(pool_fn fn, const void* arg, int n, int chunk, int threads);

#endif
