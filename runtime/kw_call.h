/* kw_call.h — one native op run on its own, outside any plan: what kwker's ops
 * do when PyTorch calls them (eagerly, or as Inductor's extern kernels).
 *
 * A plan prepares each of its calls once and runs them many times; a call run
 * alone is prepared, run and released each time, so it costs its op's
 * preparation every call (microseconds for kwker's own kernels; matmul_dnnl's
 * primitive comes from oneDNN's primitive cache after the first). */
#ifndef KW_CALL_H
#define KW_CALL_H

#include <stddef.h>

#include "kw_ops.h"
#include "kw_pool.h"

/* Below this many bytes of tensors a call runs on the calling thread alone:
 * handing it to the pool costs more than the work (Zen 4, 2 threads, calls in a
 * loop: silu_mul over 2560 floats 4.5 µs on the pool against 2.0 alone, rms_norm
 * of one row of 960 3.8 against 1.2). */
#define KW_CALL_INLINE_BYTES ((size_t)128 << 10)

/* Checks c's parameters and tensors against the op's rules (and that a written
 * tensor overlaps no other and not itself, KW_EALIAS), prepares it for
 * `isa`, and runs it on every thread of `pool` (on the calling thread alone
 * when pool is NULL or the call is smaller than KW_CALL_INLINE_BYTES), with
 * each thread's scratch and the shared hand-out
 * memory it asks for. 0; KW_EINDEX when the kernel met an index out of range
 * (*fault says which); else the op's rejection (a KW_E* and msg). n_ip and
 * n_fp are how many parameters the caller gives, checked against the op's. */
int kw_call_run(kw_op_id id, kw_call *c, int n_ip, int n_fp, kw_isa isa, kw_pool *pool, kw_fault *fault, char *msg,
                size_t msg_len);

#endif
