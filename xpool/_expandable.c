/* xpool._expandable: address ranges whose pages are mapped and unmapped under best fit (see _expandable.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "_expandable.h"

static inline size_t up(size_t n, size_t m) { return (n + m - 1) / m * m; }
static inline size_t down(size_t n, size_t m) { return n / m * m; }
static inline uintptr_t end_of(const Block *b) { return b->ptr + b->size; }
static inline int is_free(const Block *b)
{
    return b && b->vm_state == XE_MAPPED && (b->is_free || b->waiting);
}

size_t xe_range_bytes(uint64_t capacity, size_t page)
{
    uint64_t want = capacity + capacity / 8;
    if (want < capacity) want = UINT64_MAX - page;   /* wrapped */
    size_t r = up((size_t)want, page);
    return r ? r : page;
}

int xe_init(XeDevice *x, int device, size_t page, size_t range_bytes, uint64_t peers)
{
    if (page < 512 || (page & (page - 1))) return -1;
    memset(x, 0, sizeof *x);
    x->device = device;
    x->page = page;
    x->peers = peers;
    x->range_bytes = range_bytes ? up(range_bytes, page) : page;
    x->small_request = (size_t)1 << 20;   /* Note [Handles] */
    x->large_handle = (size_t)20 << 20;
    return 0;
}

/* Note [Handles].  A handle is one physical allocation (cuMemCreate) of whole pages, mapped and unmapped whole: two
 * driver calls a handle and one a run (cuMemSetAccess) to map (docs/decisions/0013).  As PyTorch's segment_size_
 * (kSmallBuffer 2 MiB for requests up to 1 MiB, else kLargeBuffer 20 MiB): a miss of at most small_request maps
 * pages, a larger one handles of large_handle rounded up to whole pages, never larger, each run tiled from its start
 * (the last the rest).  Only the pages a block reaches are mapped.  An edge bit per page boundary marks each mapped
 * handle's first page and the page after its last: a release unmaps whole handles inside one free block only, the
 * top ones first, and a handle holding a byte in use stays mapped whole.  The trade-off: mapping 20 MiB of 2 MiB
 * pages makes 2 calls, not the 30 of a handle a page (3 each); a full release gives back every free byte but those
 * in a handle that also holds a byte in use.  Such a handle lies at an edge of its free block, so each edge beside a
 * block in use strands less than one handle (at most large_handle less a page): at most two a free block, fewer than
 * 2 large_handle beside each block in use.  Handles of a 16th of the request (up to 1 GiB) stranded up to 1 GiB. */
size_t xe_handle_bytes(const XeDevice *x, size_t size)
{
    return size <= x->small_request ? x->page : up(x->large_handle, x->page);
}

static inline size_t page_of(const XeDevice *x, const XeRange *r, uintptr_t a) { return (a - r->base) / x->page; }
static inline int edge(const XeRange *r, size_t i) { return r->edges[i >> 6] >> (i & 63) & 1; }

/* A run of `bytes` at addr mapped in handles of `handle` bytes (the last the rest), or unmapped (handle 0). */
static void edges_mark(const XeDevice *x, XeRange *r, uintptr_t addr, size_t bytes, size_t handle)
{
    size_t lo = page_of(x, r, addr), n = bytes / x->page, h = handle / x->page;
    for (size_t k = 0, i = lo; k <= n; i = lo + ++k)
        r->edges[i >> 6] = (r->edges[i >> 6] & ~((uint64_t)1 << (i & 63))) |
                           (uint64_t)(!k || k == n || (h && k % h == 0)) << (i & 63);
}

/* The whole handles inside [a, e) of a mapped stretch: [*lo, *hi); 0 when there are none. */
static int whole_handles(const XeDevice *x, const XeRange *r, uintptr_t a, uintptr_t e, uintptr_t *lo, uintptr_t *hi)
{
    size_t i = (a - r->base + x->page - 1) / x->page, j = page_of(x, r, e);
    while (i < j && !edge(r, i)) i++;
    while (j > i && !edge(r, j)) j--;
    *lo = r->base + i * x->page;
    *hi = r->base + j * x->page;
    return j > i;
}

static void free_runs(Block *b)
{
    while (b) {
        free_runs(b->left);
        Block *r = b->right;
        free(b);
        b = r;
    }
}

static void range_free(XeRange *r)
{
    free_runs(r->runs);
    free(r->edges);
    free(r);
}

void xe_destroy(XeDevice *x)
{
    for (size_t i = 0; i < x->n_ranges; i++) range_free(x->ranges[i]);
    free(x->ranges);
    x->ranges = NULL;
    x->n_ranges = x->cap_ranges = 0;
    x->mapped = 0;
}

/* ------------------------------------------------------------------ chains and unmapped lists */

static Block *new_piece(const XeRange *r, int device)
{
    Block *b = calloc(1, sizeof(Block));
    if (b) { b->in_segment = 1; b->stream = r->stream; b->device = device; }
    return b;
}

/* Links n into the chain right after b. */
static void link_after(Block *b, Block *n)
{
    n->prev_addr = b;
    n->next_addr = b->next_addr;
    if (b->next_addr) b->next_addr->prev_addr = n;
    b->next_addr = n;
}

/* Cuts b at `at` bytes: n (a fresh Block) takes the rest, right after it, in b's state (its poison too). */
static void cut(Block *b, size_t at, Block *n)
{
    n->ptr = b->ptr + at;
    n->size = b->size - at;
    n->vm_state = b->vm_state;
    n->poisoned = b->poisoned;
    b->size = at;
    link_after(b, n);
}

/* b swallows its chain successor n (freed). */
static void swallow(Block *b, Block *n)
{
    b->size += n->size;
    b->next_addr = n->next_addr;
    if (n->next_addr) n->next_addr->prev_addr = b;
    free(n);
}

/* ------------------------------------------------------------------ the index of unmapped runs
 *
 * Note [Unmapped runs].  A miss wants the lowest address of its stream's ranges where free space and unmapped pages
 * hold the request (fit_at).  Each unmapped run u carries its span (run_span): the most a plan starting at u can
 * join, the free block before it, u, and up to XE_PLAN_MAPS runs with the free blocks between them, as fit_at walks
 * them; each range keeps its runs in a treap by address whose nodes carry the most span below them (run_max), so
 * the leftmost run that holds a request is one descent, O(log n) in the range's runs, where a walk of them was O(n).
 * A block that changes (cut, merged, freed, taken, mapped, unmapped) changes the spans of the runs whose walk
 * passes it: the run after it, and the runs at most 2 x XE_PLAN_MAPS chain steps before it (touch); each is
 * refreshed by one descent.  On the hit path that is a few pointer loads unless a run is near. */

static uint32_t run_prio(uintptr_t ptr)
{
    uint64_t v = (uint64_t)ptr * 0x9e3779b97f4a7c15ULL;
    return (uint32_t)(v >> 32);
}

static inline int is_run(const Block *b) { return b && b->vm_state == XE_UNMAPPED; }

/* What a plan starting at run u can join: fit_at's walk, to its end. */
static size_t span_at(const Block *u)
{
    size_t got = is_free(u->prev_addr) ? u->prev_addr->size : 0;
    size_t runs = 0;
    for (const Block *x = u; is_run(x) && runs < XE_PLAN_MAPS; runs++) {
        got += x->size;
        const Block *f = x->next_addr;
        if (!is_free(f)) break;
        got += f->size;
        x = f->next_addr;
    }
    return got;
}

static void pull(Block *n)
{
    size_t m = n->run_span;
    if (n->left && n->left->run_max > m) m = n->left->run_max;
    if (n->right && n->right->run_max > m) m = n->right->run_max;
    n->run_max = m;
}

static Block *runs_insert(Block *root, Block *n)
{
    if (!root) { n->left = n->right = NULL; pull(n); return n; }
    if (n->ptr < root->ptr) {
        root->left = runs_insert(root->left, n);
        if (root->left->prio > root->prio) {   /* rotate right */
            Block *l = root->left;
            root->left = l->right; l->right = root;
            pull(root); pull(l);
            return l;
        }
    } else {
        root->right = runs_insert(root->right, n);
        if (root->right->prio > root->prio) {  /* rotate left */
            Block *r = root->right;
            root->right = r->left; r->left = root;
            pull(root); pull(r);
            return r;
        }
    }
    pull(root);
    return root;
}

static Block *runs_join(Block *a, Block *b)   /* every key of a before every key of b */
{
    if (!a) return b;
    if (!b) return a;
    if (a->prio > b->prio) { a->right = runs_join(a->right, b); pull(a); return a; }
    b->left = runs_join(a, b->left);
    pull(b);
    return b;
}

static Block *runs_remove(Block *root, Block *n)
{
    if (!root) return NULL;
    if (root == n) {
        Block *j = runs_join(n->left, n->right);
        n->left = n->right = NULL;
        return j;
    }
    if (n->ptr < root->ptr) root->left = runs_remove(root->left, n);
    else root->right = runs_remove(root->right, n);
    pull(root);
    return root;
}

/* n's span again, and the most spans on the path down to it. */
static void runs_refresh(Block *root, Block *n)
{
    if (!root) return;
    if (root != n) runs_refresh(n->ptr < root->ptr ? root->left : root->right, n);
    else n->run_span = span_at(n);
    pull(root);
}

/* The lowest-addressed run of the treap whose span holds `size`, or NULL. */
static Block *runs_first_fit(Block *x, size_t size)
{
    while (x && x->run_max >= size) {
        if (x->left && x->left->run_max >= size) x = x->left;
        else if (x->run_span >= size) return x;
        else x = x->right;
    }
    return NULL;
}

static void run_add(XeRange *r, Block *b)
{
    b->prio = run_prio(b->ptr);
    b->run_span = span_at(b);
    r->runs = runs_insert(r->runs, b);
}

static void run_drop(XeRange *r, Block *b) { r->runs = runs_remove(r->runs, b); }

/* The spans of the runs whose walk passes b (b changed): the run after it (or after the free block after it), b if
 * a run, and the runs before it within 2 x XE_PLAN_MAPS chain steps of runs and free blocks. */
static void touch(XeRange *r, Block *b)
{
    Block *after = b->next_addr;
    if (after && !is_run(after) && is_free(after)) after = after->next_addr;
    if (is_run(after)) runs_refresh(r->runs, after);
    Block *x = b;
    for (int steps = 0; x && steps <= 2 * XE_PLAN_MAPS; steps++, x = x->prev_addr) {
        if (is_run(x)) runs_refresh(r->runs, x);
        else if (x != b && !is_free(x)) break;
    }
}

/* touch() on the hot path, where the range is found only when a run is near b. */
static void touch_near(XeDevice *x, Block *b)
{
    Block *n = b->next_addr, *p = b->prev_addr;
    int near = is_run(n) || (is_free(n) && is_run(n->next_addr)) || is_run(p) || (is_free(p) && is_run(p->prev_addr));
    XeRange *r = near && x ? xe_range_of(x, b->ptr) : NULL;
    if (r) touch(r, b);
}

Block *xe_take(XeDevice *x, FreeTree *t, intptr_t stream, size_t size, SegDelta *d)
{
    Block *b = seg_take(t, stream, size, d);
    if (b) {
        touch_near(x, b);
        if (is_free(b->next_addr)) touch_near(x, b->next_addr);   /* the rest of a cut */
    }
    return b;
}

Block *xe_put(XeDevice *x, FreeTree *t, Block *b, SegDelta *d)
{
    b = seg_put(t, b, d);
    touch_near(x, b);
    return b;
}

/* A free piece back into the tree, merged with its free neighbours, the spans near it kept. */
static Block *put_free(XeRange *r, FreeTree *t, Block *b, XeDelta *d)
{
    b->vm_state = XE_MAPPED;
    b->is_free = b->waiting = 0;
    b = seg_put(t, b, &d->free);
    touch(r, b);
    return b;
}

/* b (out of every index) becomes unmapped pages, merged with unmapped chain neighbours, indexed. */
static void make_unmapped(XeRange *r, Block *b)
{
    b->vm_state = XE_UNMAPPED;
    b->is_free = b->waiting = 0;
    b->requested = 0;
    b->poisoned = 0;
    Block *p = b->prev_addr, *n = b->next_addr;
    if (is_run(p)) {          /* p is indexed already: it takes b in (its key, its address, stays) */
        swallow(p, b);
        b = p;
    } else {
        run_add(r, b);
    }
    if (is_run(n)) {
        run_drop(r, n);
        swallow(b, n);
    }
    touch(r, b);
}

/* ------------------------------------------------------------------ ranges */

static size_t range_index(const XeDevice *x, uintptr_t ptr)   /* the first range with base > ptr */
{
    size_t lo = 0, hi = x->n_ranges;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (x->ranges[mid]->base <= ptr) lo = mid + 1; else hi = mid;
    }
    return lo;
}

XeRange *xe_range_of(const XeDevice *x, uintptr_t ptr)
{
    size_t i = range_index(x, ptr);
    if (!i) return NULL;
    XeRange *r = x->ranges[i - 1];
    return ptr - r->base < r->bytes ? r : NULL;
}

static int insert_range(XeDevice *x, XeRange *r)
{
    if (x->n_ranges == x->cap_ranges) {
        size_t cap = x->cap_ranges ? 2 * x->cap_ranges : 8;
        XeRange **a = realloc(x->ranges, cap * sizeof *a);
        if (!a) return -1;
        x->ranges = a;
        x->cap_ranges = cap;
    }
    size_t i = range_index(x, r->base);
    memmove(&x->ranges[i + 1], &x->ranges[i], (x->n_ranges - i) * sizeof *x->ranges);
    x->ranges[i] = r;
    x->n_ranges++;
    return 0;
}

XeRange *xe_add_range(XeDevice *x, intptr_t stream, uintptr_t base, size_t bytes, XeDelta *d)
{
    XeRange *r = calloc(1, sizeof *r);
    Block *b = r ? calloc(1, sizeof *b) : NULL;
    if (b) r->edges = calloc(bytes / x->page / 64 + 1, sizeof(uint64_t));
    if (!b || !r->edges) { free(b); if (r) free(r->edges); free(r); return NULL; }
    r->base = base;
    r->bytes = bytes;
    r->stream = stream;
    b->ptr = base;
    b->size = bytes;
    b->stream = stream;
    b->device = x->device;
    b->in_segment = 1;
    b->vm_state = XE_UNMAPPED;
    r->first = b;
    run_add(r, b);
    if (insert_range(x, r) < 0) { free(b); free(r->edges); free(r); return NULL; }
    d->ranges += 1;
    return r;
}

size_t xe_take_empty(XeDevice *x, XeRange **out, size_t cap)
{
    size_t n = 0, kept = 0;
    for (size_t i = 0; i < x->n_ranges; i++) {
        XeRange *r = x->ranges[i];
        if (n < cap && !r->mapped && !r->in_flight) out[n++] = r;
        else x->ranges[kept++] = r;
    }
    x->n_ranges = kept;
    return n;
}

void xe_release_finish(XeDevice *x, XeRange *r, int released, XeDelta *d)
{
    if (released || insert_range(x, r) < 0) {   /* not back without memory: its addresses are lost, not its pages */
        range_free(r);
        d->ranges -= 1;
    }
}

/* ------------------------------------------------------------------ a miss */

/* The plan's block in range r starting at unmapped run u (with the free block before it): 0 if the run, free
 * blocks between runs and runs after hold `size` bytes within XE_PLAN_MAPS runs; the pieces listed in p. */
static int fit_at(Block *u, size_t size, XeMapPlan *p)
{
    p->n_pieces = 0;
    size_t got = 0, runs = 0;
    if (is_free(u->prev_addr)) {
        p->piece[p->n_pieces++] = u->prev_addr;
        got = u->prev_addr->size;
        if (got >= size) return 0;   /* the free block alone holds it (freed since the hit looked): no map */
    }
    for (Block *x = u; x && x->vm_state == XE_UNMAPPED && runs < XE_PLAN_MAPS; runs++) {
        p->piece[p->n_pieces++] = x;
        if ((got += x->size) >= size) return 0;
        Block *f = x->next_addr;   /* a whole mapped run between two unmapped ones, all free, joins them */
        if (!is_free(f)) return -1;
        p->piece[p->n_pieces++] = f;
        if ((got += f->size) >= size) return 0;
        x = f->next_addr;
    }
    return -1;
}

int xe_plan_map(XeDevice *x, FreeTree *t, intptr_t stream, size_t size, XeMapPlan *p, XeDelta *d)
{
    memset(p, 0, sizeof *p);
    p->size = size;
    p->handle = xe_handle_bytes(x, size);
    XeRange *r = NULL;
    for (size_t i = 0; i < x->n_ranges && !r; i++) {
        if (x->ranges[i]->stream != stream) continue;
        Block *u = runs_first_fit(x->ranges[i]->runs, size);
        if (u && fit_at(u, size, p) == 0) r = x->ranges[i];   /* the span said so: the walk agrees */
    }
    if (!r) {
        p->n_pieces = 0;
        p->new_range = x->range_bytes > size ? x->range_bytes : up(size, x->page);
        return 0;
    }
    Block *first = p->piece[0], *last = p->piece[p->n_pieces - 1];
    p->ptr = first->ptr;
    uintptr_t need_end = p->ptr + size;
    /* the last piece an unmapped run the block ends in: only the pages the block reaches are mapped */
    Block *tail = NULL, *spare = NULL;
    size_t keep = last->vm_state == XE_UNMAPPED ? up(need_end - last->ptr, x->page) : last->size;
    if (keep < last->size && !(tail = new_piece(r, x->device))) return -1;
    if (p->ptr + size < last->ptr + keep && !(spare = new_piece(r, x->device))) { free(tail); return -1; }
    if (tail) {                                  /* the run's rest stays indexed, in place of what is mapped */
        run_drop(r, last);
        last->vm_state = XE_MAPPING;
        cut(last, keep, tail);
        make_unmapped(r, tail);
    }
    for (size_t i = 0; i < p->n_pieces; i++) {
        Block *b = p->piece[i];
        if (b->vm_state == XE_UNMAPPED || b->vm_state == XE_MAPPING) {
            if (b->vm_state == XE_UNMAPPED) run_drop(r, b);
            b->vm_state = XE_MAPPING;
            p->map[p->n_maps].addr = b->ptr;
            p->map[p->n_maps++].bytes = b->size;
            p->map_bytes += b->size;
        } else {
            seg_unfile(t, b, &d->free);
            b->vm_state = XE_HELD;
            d->held += (int64_t)b->size;
        }
    }
    touch(r, first);
    touch(r, last);
    p->range = r;
    p->spare = spare;
    r->in_flight++;
    return 0;
}

Block *xe_map_finish(XeDevice *x, FreeTree *t, XeMapPlan *p, size_t maps_ok, XeDelta *d)
{
    XeRange *r = p->range;
    size_t m = 0;
    for (size_t i = 0; i < p->n_pieces; i++) {   /* the runs mapped: counted as mapped, still pieces */
        Block *b = p->piece[i];
        if (b->vm_state == XE_HELD) { d->held -= (int64_t)b->size; continue; }
        if (m++ >= maps_ok) continue;
        r->mapped += b->size;
        x->mapped += b->size;
        d->mapped += (int64_t)b->size;
        d->maps += 1;
        d->map_pages += (int64_t)((b->size + p->handle - 1) / p->handle);
        edges_mark(x, r, b->ptr, b->size, p->handle);
    }
    r->in_flight--;
    if (maps_ok < p->n_maps) {
        /* Decided before anything changes: making a run unmapped may free its Block (merged into an unmapped
         * neighbour).  The runs not mapped go back first, so what is mapped merges with mapped neighbours only. */
        int back[2 * XE_PLAN_MAPS + 1];
        m = 0;
        for (size_t i = 0; i < p->n_pieces; i++) back[i] = p->piece[i]->vm_state == XE_MAPPING && m++ >= maps_ok;
        for (size_t i = 0; i < p->n_pieces; i++) if (back[i]) make_unmapped(r, p->piece[i]);
        for (size_t i = 0; i < p->n_pieces; i++) if (!back[i]) put_free(r, t, p->piece[i], d);
        free(p->spare);
        p->spare = NULL;
        return NULL;
    }
    /* the rest after the block lies in the last piece: new pages (poisoned if the caller filled them), or a free
     * block the plan joined (its own poison) */
    const Block *last = p->piece[p->n_pieces - 1];
    int rest_poisoned = last->vm_state == XE_HELD ? last->poisoned : p->poisoned;
    p->all_poisoned = 1;                         /* every byte of the block freed or new, and poisoned */
    for (size_t i = 0; i < p->n_pieces; i++)
        if (!(p->piece[i]->vm_state == XE_HELD ? p->piece[i]->poisoned : p->poisoned)) p->all_poisoned = 0;
    Block *b = p->piece[0];                      /* every piece joins the first */
    for (size_t i = 1; i < p->n_pieces; i++) swallow(b, p->piece[i]);
    b->vm_state = XE_MAPPED;
    b->is_free = b->waiting = 0;
    b->requested = 0;
    b->poisoned = 0;
    if (b->size > p->size) {
        Block *rest = p->spare;
        p->spare = NULL;
        cut(b, p->size, rest);
        rest->poisoned = rest_poisoned;
        put_free(r, t, rest, d);
    }
    free(p->spare);
    p->spare = NULL;
    touch(r, b);
    return b;
}

/* ------------------------------------------------------------------ a release */

typedef struct {
    Block *b;
    size_t pages;          /* bytes of its whole handles: [lo, hi) */
    uintptr_t lo, hi;
} Candidate;

typedef struct {
    const XeDevice *x;
    const XeRelease *spec;
    Candidate *c;
    size_t n, cap;
    int oom;
} Candidates;

static int collect(Block *b, void *arg)
{
    Candidates *s = arg;
    if (b->vm_state != XE_MAPPED || (!s->spec->all_streams && b->stream != s->spec->stream)) return 0;
    uintptr_t lo, hi;
    if (!whole_handles(s->x, xe_range_of(s->x, b->ptr), b->ptr, end_of(b), &lo, &hi)) return 0;
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        Candidate *c = realloc(s->c, cap * sizeof *c);
        if (!c) { s->oom = 1; return 1; }
        s->c = c;
        s->cap = cap;
    }
    s->c[s->n++] = (Candidate){b, hi - lo, lo, hi};
    return 0;
}

static int by_pages(const void *a, const void *b)
{
    const Candidate *x = a, *y = b;
    if (x->pages != y->pages) return x->pages < y->pages ? -1 : 1;
    return x->b->ptr < y->b->ptr ? -1 : x->b->ptr > y->b->ptr;
}

/* The start of the fewest top handles of c that hold `need` bytes (all of them when they hold no more). */
static uintptr_t top_handles(const XeDevice *x, const Candidate *c, uint64_t need)
{
    const XeRange *r = xe_range_of(x, c->lo);
    size_t lo = page_of(x, r, c->lo), at = page_of(x, r, c->hi) - up((size_t)need, x->page) / x->page;
    while (need < c->pages && at > lo && !edge(r, at)) at--;
    return need < c->pages ? r->base + at * x->page : c->lo;
}

/* Plans [a, e) of f, whole handles: f splits into free head, unmapping middle, free tail. */
static int plan_run(XeDevice *x, FreeTree *t, Block *f, uintptr_t a, uintptr_t e, XeUnmapPlan *plan, XeDelta *d)
{
    XeRange *r = xe_range_of(x, f->ptr);
    size_t bytes = e - a;
    if (plan->n == plan->cap) {
        size_t cap = plan->cap ? 2 * plan->cap : 16;
        XeUnmapRun *runs = realloc(plan->runs, cap * sizeof *runs);
        if (!runs) return -1;
        plan->runs = runs;
        plan->cap = cap;
    }
    Block *mid = a > f->ptr ? new_piece(r, x->device) : f;
    Block *tail = mid && e < end_of(f) ? new_piece(r, x->device) : NULL;
    Block *spare = mid ? new_piece(r, x->device) : NULL;
    if (!spare || (e < end_of(f) && !tail)) {
        if (mid != f) free(mid);
        free(tail);
        free(spare);
        return -1;
    }
    seg_unfile(t, f, &d->free);
    f->vm_state = XE_UNMAPPING;   /* pieces cut from it keep this until they are put back */
    if (tail) cut(f, e - f->ptr, tail);
    if (mid != f) cut(f, a - f->ptr, mid);
    mid->vm_state = XE_UNMAPPING;
    if (mid != f) put_free(r, t, f, d);
    if (tail) put_free(r, t, tail, d);
    touch(r, mid);
    d->held += (int64_t)bytes;
    r->in_flight++;
    plan->runs[plan->n++] = (XeUnmapRun){r, mid, a, bytes, spare};
    plan->bytes += bytes;
    return 0;
}

int xe_plan_unmap(XeDevice *x, FreeTree *t, const XeRelease *spec, XeUnmapPlan *plan, XeDelta *d)
{
    memset(plan, 0, sizeof *plan);
    if (!spec->need) return 0;
    seg_flush(t);
    Candidates s = {x, spec, NULL, 0, 0, 0};
    seg_each_free(t, collect, &s);
    int rc = s.oom ? -1 : 0;
    if (s.n) qsort(s.c, s.n, sizeof *s.c, by_pages);   /* by whole-handle bytes, then address: deterministic */
    uint64_t left = spec->need;
    size_t i = 0;
    if (left != UINT64_MAX)                   /* the smallest one that covers the need alone */
        while (i < s.n && s.c[i].pages < left) i++;
    if (left == UINT64_MAX || i == s.n) {     /* else the largest first */
        for (size_t k = s.n; k-- > 0 && left && rc == 0;) {
            uintptr_t a = top_handles(x, &s.c[k], left);
            size_t take = s.c[k].hi - a;
            if (plan_run(x, t, s.c[k].b, a, s.c[k].hi, plan, d) < 0) rc = -1;
            else if (left != UINT64_MAX) left -= take < left ? take : left;
        }
    } else if (plan_run(x, t, s.c[i].b, top_handles(x, &s.c[i], left), s.c[i].hi, plan, d) < 0) {
        rc = -1;
    }
    free(s.c);
    return rc;
}

void xe_unmap_finish(XeDevice *x, FreeTree *t, XeUnmapPlan *plan, size_t i, size_t done, XeDelta *d)
{
    XeUnmapRun *run = &plan->runs[i];
    XeRange *r = run->range;
    Block *b = run->b;
    done = down(done < run->bytes ? done : run->bytes, x->page);
    d->held -= (int64_t)run->bytes;
    r->mapped -= done;
    x->mapped -= done;
    d->mapped -= (int64_t)done;
    for (size_t k = page_of(x, r, run->addr), e = k + done / x->page; k < e; k++) d->unmap_pages += edge(r, k);
    if (done) edges_mark(x, r, run->addr, done, 0);   /* handles: an edge at each one's first page */
    if (done) d->unmaps += 1;    /* a call that unmapped pages, a failed one's prefix too: as the timeline shows */
    if (done && done < run->bytes) {             /* the prefix is unmapped, the rest stays mapped and free */
        Block *rest = run->spare;
        run->spare = NULL;
        cut(b, done, rest);
        put_free(r, t, rest, d);
    } else if (!done) {
        put_free(r, t, b, d);
    }
    if (done) make_unmapped(r, b);
    r->in_flight--;
    free(run->spare);
    run->spare = NULL;
    run->b = NULL;
}

void xe_unmap_plan_free(XeUnmapPlan *plan)
{
    for (size_t i = 0; i < plan->n; i++) free(plan->runs[i].spare);
    free(plan->runs);
    memset(plan, 0, sizeof *plan);
}
