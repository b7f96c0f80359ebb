/* The arena planner: offline placement of buffers with known live ranges.
 *
 * First-fit in a given order (each buffer at the lowest offset clear of every
 * already placed buffer it is live with) reaches the optimum for some order: take
 * an optimal placement and feed its buffers bottom-up; by induction each lands at
 * or below its optimal offset. So trying every order is exact, which small
 * problems afford; larger ones take the best of a few greedy orders. */
#include <stdlib.h>

#include "kw_capture.h"

#define EXACT_MAX 7

typedef struct placed {
    size_t lo, hi;
} placed;

static size_t round_up(size_t n) { return (n + 63) & ~(size_t)63; }

static int live(const kw_arena_item *it) { return it->size > 0 && it->first >= 0; }

static int overlap_in_time(const kw_arena_item *a, const kw_arena_item *b) {
    return a->first <= b->last && b->first <= a->last;
}

static int by_lo(const void *x, const void *y) {
    const placed *a = x, *b = y;
    return (a->lo > b->lo) - (a->lo < b->lo);
}

/* Places items[order[0..n)] first-fit into off[]; returns the arena size.
 * `scratch` holds n entries. */
static size_t first_fit(const kw_arena_item *items, const int *order, int n, size_t *off,
                        placed *scratch) {
    size_t top = 0;
    for (int i = 0; i < n; i++) {
        const kw_arena_item *it = &items[order[i]];
        const size_t size = round_up(it->size);
        int k = 0;
        for (int j = 0; j < i; j++) {
            const kw_arena_item *other = &items[order[j]];
            if (!overlap_in_time(it, other)) continue;
            scratch[k].lo = off[order[j]];
            scratch[k++].hi = off[order[j]] + round_up(other->size);
        }
        qsort(scratch, (size_t)k, sizeof *scratch, by_lo);
        size_t at = 0;
        for (int j = 0; j < k && scratch[j].lo < at + size; j++)
            if (scratch[j].hi > at) at = scratch[j].hi;
        off[order[i]] = at;
        if (at + size > top) top = at + size;
    }
    return top;
}

typedef struct search {
    const kw_arena_item *items;
    int n;
    int *order;
    size_t *off, *best_off, best;
    placed *scratch;
} search;

static void try_order(search *s) {
    const size_t top = first_fit(s->items, s->order, s->n, s->off, s->scratch);
    if (top >= s->best) return;
    s->best = top;
    for (int i = 0; i < s->n; i++) s->best_off[s->order[i]] = s->off[s->order[i]];
}

static void permute(search *s, int k) {
    if (k == s->n) {
        try_order(s);
        return;
    }
    for (int i = k; i < s->n; i++) {
        int t = s->order[k];
        s->order[k] = s->order[i];
        s->order[i] = t;
        permute(s, k + 1);
        s->order[i] = s->order[k];
        s->order[k] = t;
    }
}

/* Greedy orders, sorted on copies of the keys (qsort has no context pointer). */
typedef struct key {
    int idx, first, span;
    size_t size;
} key;

static int by_size_desc(const void *x, const void *y) {
    const key *a = x, *b = y;
    if (a->size != b->size) return a->size < b->size ? 1 : -1;
    return (a->first > b->first) - (a->first < b->first);
}

static int by_span_desc(const void *x, const void *y) {
    const key *a = x, *b = y;
    if (a->span != b->span) return a->span < b->span ? 1 : -1;
    return by_size_desc(x, y);
}

static int by_first(const void *x, const void *y) {
    const key *a = x, *b = y;
    if (a->first != b->first) return a->first > b->first ? 1 : -1;
    return by_size_desc(x, y);
}

static void try_greedy(search *s, const int *live_idx, key *keys) {
    int (*const orders[])(const void *, const void *) = {by_size_desc, by_span_desc, by_first};
    for (size_t k = 0; k < sizeof orders / sizeof *orders; k++) {
        for (int i = 0; i < s->n; i++) {
            const kw_arena_item *it = &s->items[live_idx[i]];
            keys[i] = (key){live_idx[i], it->first, it->last - it->first, it->size};
        }
        qsort(keys, (size_t)s->n, sizeof *keys, orders[k]);
        for (int i = 0; i < s->n; i++) s->order[i] = keys[i].idx;
        try_order(s);
    }
}

size_t kw_arena_plan(kw_arena_item *items, int n) {
    int n_live = 0;
    for (int i = 0; i < n; i++) {
        items[i].offset = 0;
        n_live += live(&items[i]);
    }
    if (n_live == 0) return 0;
    int *live_idx = malloc(sizeof(int) * (size_t)n_live);
    int *order = malloc(sizeof(int) * (size_t)n_live);
    size_t *off = malloc(sizeof(size_t) * (size_t)n);
    size_t *best_off = malloc(sizeof(size_t) * (size_t)n);
    placed *scratch = malloc(sizeof(placed) * (size_t)n_live);
    key *keys = malloc(sizeof(key) * (size_t)n_live);
    size_t top = 0;
    if (live_idx && order && off && best_off && scratch && keys) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (live(&items[i])) live_idx[k++] = i;
        search s = {items, n_live, order, off, best_off, (size_t)-1, scratch};
        if (n_live <= EXACT_MAX) {
            for (int i = 0; i < n_live; i++) order[i] = live_idx[i];
            permute(&s, 0);
        } else {
            try_greedy(&s, live_idx, keys);
        }
        for (int i = 0; i < n_live; i++) items[live_idx[i]].offset = best_off[live_idx[i]];
        top = s.best;
    } else {
        /* Out of memory: lay the buffers end to end, which needs no bookkeeping. */
        for (int i = 0; i < n; i++)
            if (live(&items[i])) {
                items[i].offset = top;
                top += round_up(items[i].size);
            }
    }
    free(live_idx);
    free(order);
    free(off);
    free(best_off);
    free(scratch);
    free(keys);
    return top;
}
