/* kw_pool.h — kwker's own thread pool (pthreads; never OpenMP).
 *
 * The caller of kw_pool_run is thread 0; n_threads - 1 workers wait for work.
 * One kw_pool_run is one wake-up: every thread runs fn(arg, ith, nth) once, and
 * inside it kw_pool_barrier separates dependent steps (a replayed plan runs
 * all its ops inside a single task). Idle workers spin briefly, then sleep,
 * so they do not steal CPU from PyTorch between calls.
 * kw_pool_run may be called from several threads: calls are serialised. */
#ifndef KW_POOL_H
#define KW_POOL_H

typedef struct kw_pool kw_pool;
typedef void (*kw_task_fn)(void *arg, int ith, int nth);

kw_pool *kw_pool_create(int n_threads); /* NULL on failure or n_threads < 1 */
void kw_pool_destroy(kw_pool *pool);
int kw_pool_size(const kw_pool *pool);
void kw_pool_run(kw_pool *pool, kw_task_fn fn, void *arg);
void kw_pool_barrier(kw_pool *pool); /* every thread of the running task calls it */

#endif
