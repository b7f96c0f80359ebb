/* kw_watch.h — notices writes to memory that kwker has copied from.
 *
 * kwker keeps copies of some of a model's weights (a bfloat16 copy of a
 * bfloat16-valued float32 weight, q/k/v stacked). A copy must never be read
 * stale, and a version counter does not see every write: `param.data.mul_(2)`
 * bumps none. So the memory itself is watched:
 *
 * - the whole pages inside a watched range are made read-only; the first write
 *   to one of them faults, kwker's SIGSEGV handler makes the range writable
 *   again and marks the watch changed, and the write goes on;
 * - the bytes on the partial pages at either end share their page with memory
 *   that is not the watched tensor's (malloc's neighbours), which must stay
 *   writable: they are kept as a snapshot and compared by kw_watch_changed.
 *
 * The one thing a watch changes for its memory's owner: a system call that
 * writes into a watched page (read(2) into a weight, a socket receive) fails
 * with EFAULT instead of faulting, and so is loud, not silent.
 *
 * The handler passes every fault that is not a write to a watched page on to
 * the handler installed before it (or the default action), and so a write to
 * a watched page that cannot be made writable (memory mapped read-only there
 * since the weight was freed: the write would fault again forever). A SIGSEGV sent by
 * kill/raise rather than by a fault (Python's faulthandler, installed after
 * kwker, re-raises the fault that way once it has printed its dump) makes every
 * watch writable and changed, so the program goes on and copies are refreshed.
 * kw_watch_handler_check puts the handler back in front when someone else
 * installed one since. */
#ifndef KW_WATCH_H
#define KW_WATCH_H

#include <stddef.h>

typedef struct kw_watch kw_watch;

/* Watches [p, p + bytes) from now on. NULL with errno set when the memory
 * cannot be protected (EINVAL for bytes == 0), when the table of watches is full
 * (ENOSPC) or out of memory. */
kw_watch *kw_watch_new(const void *p, size_t bytes);

/* Unprotects the memory and forgets the watch; NULL is ignored. */
void kw_watch_free(kw_watch *w);

/* 1 when the memory may have been written since kw_watch_new or the last
 * kw_watch_rearm: a write faulted on a protected page, or the end bytes differ
 * from their snapshot. 0 otherwise. */
int kw_watch_changed(const kw_watch *w);

/* Starts fetching what kw_watch_changed reads (the flag, the first lines of the
 * ends and of their snapshots), so that checking many watches overlaps their
 * cache misses. */
void kw_watch_prefetch(const kw_watch *w);

/* Starts watching afresh: protects the pages again and snapshots the end bytes.
 * Read the memory (copy it) only after this returns: a write between the two is
 * then seen. 0, or -1 with errno set (the watch then reports changed). */
int kw_watch_rearm(kw_watch *w);
/* Reports changed from now until the next kw_watch_rearm: the copy made since
 * the last arming is not whole (its making failed), so it must be made again. */
void kw_watch_invalidate(kw_watch *w);
/* kw_watch_invalidate for every watch there is: in a child forked while a
 * thread it does not have may have been making a copy. */
void kw_watch_invalidate_all(void);

/* The watched range. */
const void *kw_watch_data(const kw_watch *w);
size_t kw_watch_bytes(const kw_watch *w);
/* Bytes made read-only (whole pages), and bytes compared instead (the ends). */
size_t kw_watch_protected_bytes(const kw_watch *w);

/* Installs kwker's SIGSEGV handler in front again if another was installed
 * since (cheap: one sigaction call). 0, or -1 with errno set. */
int kw_watch_handler_check(void);

#endif
