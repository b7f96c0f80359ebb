/* kw_mem.h — memory for kwker's buffers. Large blocks come from mmap with
 * MADV_HUGEPAGE (fewer TLB misses on multi-MB arenas and packed weights);
 * small ones from aligned_alloc. Every block is 64-byte aligned. */
#ifndef KW_MEM_H
#define KW_MEM_H

#include <stddef.h>

void *kw_mem_alloc(size_t bytes); /* zero-filled; NULL on failure */
void kw_mem_free(void *p, size_t bytes);

/* A large block in three steps, for memory faulted in on another thread while
 * this one works: reserve (>= 2 MiB, zero-filled, nothing faulted in yet),
 * populate any part of it (from any thread; on some VMs fresh memory faults in
 * at under 1 GB/s), and trim to its first `keep` bytes. kw_mem_trim takes any
 * block of kw_mem_alloc or kw_mem_reserve (a small one stays whole) and returns
 * the size to free it with: kw_mem_free(p, returned). */
void *kw_mem_reserve(size_t bytes);
void kw_mem_populate(void *p, size_t bytes);
size_t kw_mem_trim(void *p, size_t bytes, size_t keep);

/* Asks the kernel to back the 2 MiB pages inside [p, p + bytes) of someone
 * else's memory (a model's weights) with huge pages now: MADV_HUGEPAGE, then
 * MADV_COLLAPSE (Linux 6.1+). Contents are unchanged; where the kernel says no,
 * nothing happens. Returns the bytes now asked for (0: none or refused). */
size_t kw_mem_prefer_huge(void *p, size_t bytes);

#endif
