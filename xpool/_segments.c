/* xpool._segments: best fit with splitting and coalescing inside segments (see _segments.h). */
#include <stdlib.h>
#include <string.h>

#include "_segments.h"

static uint32_t prio_of(uintptr_t ptr)
{
    uint64_t x = (uint64_t)ptr;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return (uint32_t)(x ^ (x >> 33));
}

/* a before b in (stream, size, ptr) order */
static inline int before(const Block *a, const Block *b)
{
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
}

/* ------------------------------------------------------------------ treaps */

/* Insert, join and remove of a treap ordered by before() over one pair of child links: the tree of free
 * ranges (left, right) and the index of whole free segments (wleft, wright) share them. */
#define TREAP(NAME, L, R)                                                                 \
static Block *NAME##_insert(Block *root, Block *n)                                        \
{                                                                                         \
    if (!root) return n;                                                                  \
    if (before(n, root)) {                                                                \
        root->L = NAME##_insert(root->L, n);                                              \
        if (root->L->prio > root->prio) {             /* rotate right */                  \
            Block *l = root->L;                                                           \
            root->L = l->R; l->R = root;                                                  \
            return l;                                                                     \
        }                                                                                 \
    } else {                                                                              \
        root->R = NAME##_insert(root->R, n);                                              \
        if (root->R->prio > root->prio) {             /* rotate left */                   \
            Block *r = root->R;                                                           \
            root->R = r->L; r->L = root;                                                  \
            return r;                                                                     \
        }                                                                                 \
    }                                                                                     \
    return root;                                                                          \
}                                                                                         \
                                                                                          \
/* joins two treaps, every key of a before every key of b */                              \
static Block *NAME##_join(Block *a, Block *b)                                             \
{                                                                                         \
    if (!a) return b;                                                                     \
    if (!b) return a;                                                                     \
    if (a->prio > b->prio) { a->R = NAME##_join(a->R, b); return a; }                     \
    b->L = NAME##_join(a, b->L);                                                          \
    return b;                                                                             \
}                                                                                         \
                                                                                          \
static Block *NAME##_remove(Block *root, Block *n)                                        \
{                                                                                         \
    if (!root) return NULL;   /* not reached: n is in the tree */                         \
    if (root == n) {                                                                      \
        Block *j = NAME##_join(n->L, n->R);                                               \
        n->L = n->R = NULL;                                                               \
        return j;                                                                         \
    }                                                                                     \
    if (before(n, root)) root->L = NAME##_remove(root->L, n);                             \
    else root->R = NAME##_remove(root->R, n);                                             \
    return root;                                                                          \
}

TREAP(tree, left, right)
TREAP(whole, wleft, wright)

/* A whole free segment filed in the tree: into the index too (Note [Whole free segments]).  One waiting in
 * recent[] is not indexed: the searches scan those (at most SEG_RECENT), so a pair that frees a segment's one
 * block and takes it again (the segment whole in between) pays nothing for the index.  b->prio is set. */
static void whole_add(FreeTree *t, Block *b)
{
    b->wleft = b->wright = NULL;
    t->whole = whole_insert(t->whole, b);
    b->in_whole = 1;
    t->n_whole++;
}

/* A range leaving the tree: out of the index, if it was there. */
static void whole_drop(FreeTree *t, Block *b)
{
    if (!b->in_whole) return;
    t->whole = whole_remove(t->whole, b);
    b->in_whole = 0;
    t->n_whole--;
}

static void file_free(FreeTree *t, Block *b)
{
    b->is_free = 1; b->requested = 0;
    b->left = b->right = NULL;
    b->prio = prio_of(b->ptr);
    t->root = tree_insert(t->root, b);
    if (!b->prev_addr && !b->next_addr) whole_add(t, b);
}

static void unfile(FreeTree *t, Block *b)
{
    t->root = tree_remove(t->root, b);
    whole_drop(t, b);
    b->is_free = 0;
}

static inline int is_whole(const Block *b) { return !b->prev_addr && !b->next_addr; }

/* ------------------------------------------------------------------ ranges */

size_t seg_size_for(size_t size, size_t round)
{
    return (size + round - 1) / round * round;
}

/* Cuts b to `size` bytes; the rest becomes a free range after it.  When no Block can be had for the
 * rest, b keeps it (handed out larger than asked: counted as such, never lost). */
#define MAX_SPARE 4096

static Block *new_block(FreeTree *t)
{
    Block *b = t->spare;
    if (!b) return calloc(1, sizeof(Block));
    t->spare = b->next; t->n_spare--;
    memset(b, 0, sizeof *b);
    return b;
}

static void drop_block(FreeTree *t, Block *b)
{
    if (t->n_spare >= MAX_SPARE) { free(b); return; }
    b->next = t->spare; t->spare = b; t->n_spare++;
}

static inline size_t recent_slot(intptr_t stream, size_t size)
{
    return (size_t)((((uint64_t)size >> 9) ^ ((uint64_t)stream << 7)) * 0x9e3779b97f4a7c15ULL >> 58)
           & (SEG_RECENT - 1);
}

/* Takes a waiting range out of t->recent (it stays free: the caller files, merges or hands it out). */
static void unwait(FreeTree *t, Block *b)
{
    size_t i = recent_slot(b->stream, b->size);
    t->recent[i] = NULL;
    t->occupied &= ~((uint64_t)1 << i);
    t->n_recent--;
    b->waiting = 0;
}

/* A free range with no free neighbour waits in t->recent; its slot's former range moves to the tree. */
static void wait_free(FreeTree *t, Block *b)
{
    size_t i = recent_slot(b->stream, b->size);
    Block *old = t->recent[i];
    if (old) {
        unwait(t, old);
        file_free(t, old);
    }
    t->recent[i] = b;
    t->occupied |= (uint64_t)1 << i;
    t->n_recent++;
    b->waiting = 1; b->is_free = 0; b->requested = 0;
}

void seg_flush(FreeTree *t)
{
    while (t->occupied) {
        Block *b = t->recent[__builtin_ctzll(t->occupied)];
        unwait(t, b);
        file_free(t, b);
    }
}

void seg_unfile(FreeTree *t, Block *b, SegDelta *d)
{
    if (b->waiting) unwait(t, b); else unfile(t, b);
    d->free_ranges -= 1; d->free_bytes -= (int64_t)b->size;
}

static void split(FreeTree *t, Block *b, size_t size, SegDelta *d)
{
    if (b->size <= size) return;
    Block *rest = new_block(t);
    if (!rest) return;
    rest->ptr = b->ptr + size; rest->size = b->size - size;
    rest->stream = b->stream; rest->device = b->device;
    rest->poisoned = b->poisoned;           /* the rest of a poisoned range is poisoned */
    rest->in_segment = 1;
    rest->prev_addr = b; rest->next_addr = b->next_addr;
    if (b->next_addr) b->next_addr->prev_addr = rest;
    b->next_addr = rest;
    b->size = size;
    wait_free(t, rest);   /* its neighbours: b, in use, and what was in use after the range it was cut from */
    d->free_ranges += 1; d->free_bytes += (int64_t)rest->size;
}

void seg_init(FreeTree *t, Block *b, size_t size, SegDelta *d)
{
    b->in_segment = 1; b->is_free = 0;
    b->prev_addr = b->next_addr = b->left = b->right = NULL;
    split(t, b, size, d);
}

/* The tree's least key >= (stream, size, 0): the best fit there, if it is of `stream`. */
static Block *tree_fit(const FreeTree *t, intptr_t stream, size_t size)
{
    Block *best = NULL;
    for (Block *x = t->root; x;) {
        if (x->stream > stream || (x->stream == stream && x->size >= size)) { best = x; x = x->left; }
        else x = x->right;
    }
    return best;
}

Block *seg_take(FreeTree *t, intptr_t stream, size_t size, SegDelta *d)
{
    size_t i = recent_slot(stream, size);
    Block *w = t->recent[i];
    Block *best = tree_fit(t, stream, size);   /* the least key >= (stream, size, 0) in the tree */
    if (best && best->stream != stream) best = NULL;
    /* the exact-size fast path: the waiting range of exactly `size` bytes, when no range of that size
     * lies at a lower address in the tree (the tree's order breaks ties), so every request gets the
     * range best fit over all free ranges gives (replays stay exact: memory_study.py) */
    if (w && w->size == size && w->stream == stream &&
        (!best || best->size != size || best->ptr > w->ptr)) {
        unwait(t, w);
        d->free_ranges -= 1; d->free_bytes -= (int64_t)size;
        return w;
    }
    if (t->n_recent > SEG_SCAN) {   /* too many to scan on every request: file them */
        seg_flush(t);
        best = tree_fit(t, stream, size);
        if (best && best->stream != stream) best = NULL;
    } else {                        /* the best fit of the tree's and the waiting ranges, in key order */
        for (uint64_t bits = t->occupied; bits; bits &= bits - 1) {
            Block *x = t->recent[__builtin_ctzll(bits)];
            if (x->stream == stream && x->size >= size &&
                (!best || x->size < best->size || (x->size == best->size && x->ptr < best->ptr)))
                best = x;
        }
    }
    if (!best) return NULL;
    if (best->waiting) unwait(t, best); else unfile(t, best);
    d->free_ranges -= 1; d->free_bytes -= (int64_t)best->size;
    split(t, best, size, d);
    return best;
}

Block *seg_put(FreeTree *t, Block *b, SegDelta *d)
{
    d->free_ranges += 1; d->free_bytes += (int64_t)b->size;
    Block *n = b->next_addr;
    if (n && n->waiting) unwait(t, n); else if (n && n->is_free) unfile(t, n); else n = NULL;
    if (n) {                             /* b swallows its free successor */
        b->size += n->size;
        b->poisoned &= n->poisoned;      /* poisoned only if every part is */
        b->next_addr = n->next_addr;
        if (n->next_addr) n->next_addr->prev_addr = b;
        drop_block(t, n);
        d->free_ranges -= 1;
    }
    Block *p = b->prev_addr;
    if (p && p->waiting) unwait(t, p); else if (p && p->is_free) unfile(t, p); else p = NULL;
    if (p) {                             /* its free predecessor swallows b (its key, size, changes) */
        p->size += b->size;
        p->poisoned &= b->poisoned;
        p->next_addr = b->next_addr;
        if (b->next_addr) b->next_addr->prev_addr = p;
        drop_block(t, b);
        d->free_ranges -= 1;
        b = p;
    }
    wait_free(t, b);   /* merged with every free neighbour: none is left */
    return b;
}

/* Whole free segments (of one stream, or all), listed in (stream, size, ptr) order until `cached` (counted down by
   each one listed) is down to `keep` or `out` is full.
   From the index (the tree's whole segments) merged with the whole ones waiting in recent[], sorted: the order a
   walk of every free range gave.  Listed first and taken out after: the walk must not see the index change. */
typedef struct {
    int all_streams;
    intptr_t stream;
    uint64_t keep, cached;
    Block **out;
    size_t n, cap;
    uint64_t visits;
    Block *waiting[SEG_RECENT];   /* the whole ranges of recent[] of the scan's stream(s), in key order */
    size_t n_waiting, next_waiting;
} WholeScan;

/* Considers one whole segment; 1 once the scan is done. */
static int consider(WholeScan *s, Block *x)
{
    s->visits++;
    if (s->cached <= s->keep || s->n >= s->cap) return 1;
    s->out[s->n++] = x;
    s->cached -= x->size;
    return 0;
}

/* Considers the waiting whole segments ordered before x (all that are left when x is NULL). */
static int consider_waiting(WholeScan *s, const Block *x)
{
    while (s->next_waiting < s->n_waiting && (!x || before(s->waiting[s->next_waiting], x)))
        if (consider(s, s->waiting[s->next_waiting++])) return 1;
    return 0;
}

/* In-order walk of the index, only into the subtrees that may hold the scan's stream; 1 once the scan is done. */
static int walk_whole(Block *x, WholeScan *s)
{
    while (x) {
        if (!s->all_streams && x->stream != s->stream) {
            s->visits++;
            x = x->stream < s->stream ? x->wright : x->wleft;
            continue;
        }
        if (walk_whole(x->wleft, s) || consider_waiting(s, x) || consider(s, x)) return 1;
        x = x->wright;
    }
    return 0;
}

static void collect_whole(FreeTree *t, WholeScan *s)
{
    s->n_waiting = s->next_waiting = 0;
    for (uint64_t bits = t->occupied; bits; bits &= bits - 1) {
        Block *b = t->recent[__builtin_ctzll(bits)];
        if (!is_whole(b) || (!s->all_streams && b->stream != s->stream)) continue;
        size_t i = s->n_waiting++;   /* insertion sort: at most SEG_RECENT */
        for (; i > 0 && before(b, s->waiting[i - 1]); i--) s->waiting[i] = s->waiting[i - 1];
        s->waiting[i] = b;
    }
    if (!walk_whole(t->whole, s)) consider_waiting(s, NULL);
    t->whole_visits += s->visits;
}

/* Takes listed whole segments out of the cache: out of the tree (and the index) or recent[]. */
static void take_all(FreeTree *t, Block **blocks, size_t k, SegDelta *d)
{
    for (size_t i = 0; i < k; i++) seg_unfile(t, blocks[i], d);
}

void seg_take_whole(FreeTree *t, int all_streams, intptr_t stream, uint64_t keep, uint64_t *cached,
                    Block **out, size_t *n, size_t cap, SegDelta *d)
{
    WholeScan s = {all_streams, stream, keep, *cached, out, *n, cap, 0};
    collect_whole(t, &s);
    take_all(t, out + *n, s.n - *n, d);
    *n = s.n;
    *cached = s.cached;
}

static int walk(Block *x, int (*fn)(Block *, void *), void *arg)
{
    while (x) {   /* recursion on the left, a loop on the right: depth stays O(log n) expected */
        if (walk(x->left, fn, arg)) return 1;
        if (fn(x, arg)) return 1;
        x = x->right;
    }
    return 0;
}

int seg_each_free(const FreeTree *t, int (*fn)(Block *, void *), void *arg)
{
    if (walk(t->root, fn, arg)) return 1;
    for (size_t i = 0; t->n_recent && i < SEG_RECENT; i++)
        if (t->recent[i] && fn(t->recent[i], arg)) return 1;
    return 0;
}

static void destroy(Block *x)
{
    while (x) {
        destroy(x->left);
        Block *r = x->right;
        free(x);
        x = r;
    }
}

void seg_destroy(FreeTree *t)
{
    destroy(t->root);          /* the whole free segments are among these: the index goes with them */
    t->root = NULL;
    t->whole = NULL;
    t->n_whole = 0;
    for (size_t i = 0; i < SEG_RECENT; i++) {
        free(t->recent[i]);
        t->recent[i] = NULL;
    }
    t->occupied = 0;
    t->n_recent = 0;
    while (t->spare) {
        Block *b = t->spare;
        t->spare = b->next;
        free(b);
    }
    t->n_spare = 0;
}
