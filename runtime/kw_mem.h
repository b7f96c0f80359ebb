/* kw_mem.h — memory for kwker's buffers. Large blocks come from mmap with
 * MADV_HUGEPAGE (fewer TLB misses on multi-MB arenas and packed weights);
 * small ones from aligned_alloc. Every block is 64-byte aligned. */
#ifndef KW_MEM_H
#define KW_MEM_H

#include <stddef.h>

void *kw_mem_alloc(size_t bytes); /* zero-filled; NULL on failure */
void kw_mem_free(void *p, size_t bytes);

/* Asks the kernel to back the 2 MiB pages inside [p, p + bytes) of someone
 * else's memory (a model's weights) with huge pages now: MADV_HUGEPAGE, then
 * MADV_COLLAPSE (Linux 6.1+). Contents are unchanged; where the kernel says no,
 * nothing happens. Returns the bytes now asked for (0: none or refused). */
size_t kw_mem_prefer_huge(void *p, size_t bytes);

#endif
