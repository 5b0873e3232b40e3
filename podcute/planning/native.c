/* The planner's work expansion (Planner._layout_numpy in expand.py), in C: the same groups,
 * pre-split pieces, cost stream, cuts, CTA lists, split slots and merges; and shared-prefix
 * detection and rewrite (sharing.detect, sharing.rewrite: podcute_detect, podcute_rewrite
 * at the end). This file and its numpy twins must stay bit-identical: the same
 * floating-point operations in the same order, so a change to either needs the same change
 * in the other (tests/test_plan_native.py compares them). Built on first use by native.py
 * (cc -O2 -ffp-contract=off: no fused multiply-adds, which numpy does not use either).
 * All arrays are caller-owned; returns 0, 1 (a capacity would be exceeded: the numpy path
 * handles it) or -1 (out of memory). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { REQ = 0, KV_HEAD, ROW_START, ROW_END, KV_START, KV_END, SPLIT_SLOT, KIND, WORK_COLS };
/* (the shared-prefix columns after M_NUM_SPLITS are planning/sharing.py's to write) */
enum { M_REQ = 0, M_KV_HEAD, M_ROW_START, M_ROW_END, M_FIRST_SLOT, M_NUM_SPLITS, M_OWN_ROW,
       M_WAIT, M_TERMS_FIRST, M_TERMS_COUNT, M_FEED_FIRST, M_FEED_COUNT, MERGE_COLS };
enum { PREFILL = 0, DECODE = 1, KIND_BITS = 1 };

typedef struct {
    /* the batch */
    int64_t B;
    const int64_t *q_len, *kv_len;
    /* plan options */
    int64_t bounded, right, left, has_window, invariant;
    /* planner constants */
    int64_t G, Hkv, tm_p, tm_d, tn, grid;
    double r_p, r_d, r_row, o_p, o_d, chunks_per_cta, min_chunk_us;
    int64_t min_tiles[2], invariant_tokens[2];
    const double *bounds_unit; /* grid - 1 */
    const uint8_t *odd;        /* grid */
    int64_t group;             /* regroup each list by kind (Planner._group_lists) */
    int64_t cap_items, cap_merges, cap_slots;
    /* outputs: the plan's metadata (staging views) */
    int32_t *work, *merge, *slot_merge;
    int64_t *ptr; /* grid + 1 */
    /* outputs for the lazy predictions: cap_items parts, 2 (grid - 1) cut parts, grid swaps */
    double *pc;
    uint8_t *kind;
    int64_t *fix, *fix_s, *fix_e, *swap_a, *swap_f, *order;
    double *fix_fixed;
    int64_t n, num_merge, num_slots, n_prefill_req, n_decode_req, n0p, n0d, num_fix,
        num_swaps, both, grouped;
    /* scratch memory (caller-owned) and what this plan used of it */
    char *scratch;
    int64_t scratch_size, scratch_wanted;
    /* sharing's first test (share_pages NULL: not asked; first_pages_repeat) */
    const void *share_pages;
    const int64_t *share_indptr;
    int64_t share_max_q, share_min_kv, share_elem_bytes, share_row_stride;
    int64_t share_min_reads, share_page_size; /* a node's least plain reads, in tokens */
    int64_t first_repeat; /* out: 1, 0, or -1 (not run / undecided: numpy decides) */
} PlanIO;

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; } /* a >= 0 */
static inline int64_t fdiv(int64_t a, int64_t b) { /* Python's // for b > 0 */
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* First index whose value is > v ("right") or >= v ("left") in a non-decreasing array. */
#define SEARCH(NAME, T, BEFORE)                                                              \
    static int64_t NAME(const T *a, int64_t n, T v) {                                        \
        int64_t lo = 0, hi = n;                                                              \
        while (lo < hi) {                                                                    \
            int64_t m = (lo + hi) / 2;                                                       \
            if (BEFORE) lo = m + 1; else hi = m;                                             \
        }                                                                                    \
        return lo;                                                                           \
    }
SEARCH(search_right, double, a[m] <= v)
SEARCH(search_left_f, double, a[m] < v)
SEARCH(search_left_i, int64_t, a[m] < v)

/* visibility.py, host side */
static int64_t visible_end(const PlanIO *io, int64_t kv, int64_t q, int64_t row_end) {
    if (!io->bounded) return kv;
    return imin(kv, imax(0, kv - q + (row_end - 1) / io->G + 1 + io->right));
}
static int64_t load_start(const PlanIO *io, int64_t kv, int64_t q, int64_t row_start,
                          int64_t kv_end) {
    int64_t first = kv - q + row_start / io->G - io->left;
    first = first < 0 ? 0 : (first > kv ? kv : first);
    return imin(first / io->tn, kv_end / io->tn) * io->tn;
}
/* KV tokens a piece costs (Planner._span): whole tiles for prefill */
static int64_t span_of(const PlanIO *io, int kind, int64_t s, int64_t e) {
    if (kind == PREFILL) e = cdiv(e, io->tn) * io->tn;
    return e - s;
}

/* Scratch: a bump allocator over the caller's scratch buffer (kept across plans, so its
 * pages stay mapped: fresh memory per plan cost more in page faults than the work), then
 * over malloc'ed blocks when it is too small; `wanted` tells the caller how much to give
 * next time. */
typedef struct { char *base; size_t size, used, wanted; char *block[40]; int nb; } Arena;
static void *take(Arena *ar, size_t bytes) {
    bytes = (bytes + 15) & ~(size_t)15;
    ar->wanted += bytes;
    if (ar->used + bytes > ar->size) {
        if (ar->nb == 40) return NULL;
        size_t size = ar->size * 2 > bytes ? ar->size * 2 : bytes;
        if (size < ((size_t)1 << 16)) size = (size_t)1 << 16;
        char *p = malloc(size);
        if (!p) return NULL;
        ar->block[ar->nb++] = p;
        ar->base = p;
        ar->size = size;
        ar->used = 0;
    }
    void *p = ar->base + ar->used;
    ar->used += bytes;
    return p;
}
static void release(Arena *ar) { for (int i = 0; i < ar->nb; i++) free(ar->block[i]); }

/* Stable argsort of n keys into `idx`: a natural merge sort over (key, index) pairs, so
 * the stream's two ascending runs merge in one linear pass (numpy's timsort does the
 * same) and no pass reads keys indirectly. `runs` scratch of n + 1, `a`/`b` of n pairs. */
#define STABLE_ARGSORT(NAME, T)                                                              \
    typedef struct { T k; int64_t i; } NAME##_pair;                                          \
    static int NAME(Arena *ar, const T *key, int64_t n, int64_t *idx) {                      \
        NAME##_pair *a = take(ar, (size_t)n * sizeof *a), *b = take(ar, (size_t)n * sizeof *b); \
        int64_t *runs = take(ar, (size_t)(n + 1) * sizeof *runs), nr = 0;                      \
        if (!a || !b || !runs) return -1;                                                     \
        for (int64_t i = 0; i < n; i++) { a[i].k = key[i]; a[i].i = i; }                     \
        for (int64_t i = 0; i < n; i++)                                                       \
            if (i == 0 || a[i].k < a[i - 1].k) runs[nr++] = i;                               \
        runs[nr] = n;                                                                         \
        while (nr > 1) {                                                                      \
            int64_t out = 0;                                                                  \
            for (int64_t r = 0; r < nr; r += 2) {                                             \
                int64_t lo = runs[r], mid = runs[r + 1], hi = r + 2 <= nr ? runs[r + 2] : mid; \
                if (r + 1 >= nr) { mid = hi = runs[nr]; }                                      \
                int64_t x = lo, y = mid, o = lo;                                              \
                while (x < mid && y < hi) b[o++] = a[y].k < a[x].k ? a[y++] : a[x++];        \
                while (x < mid) b[o++] = a[x++];                                              \
                while (y < hi) b[o++] = a[y++];                                               \
                runs[out++] = lo;                                                             \
            }                                                                                 \
            runs[out] = n;                                                                    \
            nr = out;                                                                         \
            NAME##_pair *t = a; a = b; b = t;                                                 \
        }                                                                                     \
        for (int64_t i = 0; i < n; i++) idx[i] = a[i].i;                                     \
        return 0;                                                                             \
    }
STABLE_ARGSORT(argsort_i64, int64_t)
STABLE_ARGSORT(argsort_f64, double)

#define NEW(T, n) ((T *)take(&ar, (size_t)(n) * sizeof(T)))
#define CHECK(p) do { if (!(p)) { rc = -1; goto done; } } while (0)

/* Open addressing over int64 keys (INT64_MIN marks an empty slot): the slot of `key`,
 * which holds it or is empty. */
static inline int64_t slot_of(const int64_t *keys, int64_t cap, int64_t key) {
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    int64_t i = (int64_t)(h >> 40) & (cap - 1);
    while (keys[i] != INT64_MIN && keys[i] != key) i = (i + 1) & (cap - 1);
    return i;
}

/* Page j of request b: a block table's (indptr NULL: pages[b * row_stride + j]) or CSR
 * indices' (pages[indptr[b] + j]), of 4- or 8-byte integers. */
typedef struct { const void *pages; const int64_t *indptr; int64_t elem_bytes, row_stride; } PageSrc;
static inline int64_t row_start(const PageSrc *src, int64_t b) {
    return src->indptr ? src->indptr[b] : b * src->row_stride;
}
static inline int64_t page_at(const PageSrc *src, int64_t b, int64_t j) {
    int64_t at = row_start(src, b) + j;
    return src->elem_bytes == 4 ? (int64_t)((const int32_t *)src->pages)[at]
                                : ((const int64_t *)src->pages)[at];
}

/* Sharing's first test (planning/sharing.py, detect): whether two candidates (0 < q_len <=
 * max_q and kv_len - q_len >= min_kv) have the same first page, and with min_reads > 0
 * whether a node of them may pay (sharing._may_pay: a node of n sharers needs a run of
 * min_reads / n tokens, n at most its first page's group g, so two of that group hold
 * the same page at column ceil(min_reads / (g page_size)) - 1). Pages: a block table
 * (indptr NULL: request b's page j at pages[b * row_stride + j]) or CSR indices
 * (pages[indptr[b] + j]), of 4- or 8-byte integers. Open-addressing maps of first pages
 * (with their group sizes), then of (group, page at that column) pairs: O(candidates),
 * beside the expansion that reads q_len and kv_len anyway, where numpy's mask, gather
 * and sort cost a plan ~9 us at B = 256 (a separate ctypes call, with its array
 * addresses, cost 6). Returns 1 (detect builds the tree), 0 (nothing is shared) or -1
 * (out of memory, or a page equal to the maps' empty mark: detect decides in numpy). */
typedef struct {
    PageSrc src;
    const int64_t *q_len, *kv_len;
    int64_t B, max_q, min_kv, min_reads, page_size;
} ShareTest;

static int first_pages_repeat(const ShareTest *t) {
    const int64_t B = t->B, max_q = t->max_q, min_kv = t->min_kv;
    const int64_t *q_len = t->q_len, *kv_len = t->kv_len;
    const int64_t EMPTY = INT64_MIN;
    int64_t cap = 64;
    while (cap < 2 * B) cap <<= 1;
    int64_t local[3 * 256];
    int64_t *keys = cap <= 256 ? local : malloc(3 * (size_t)cap * sizeof(int64_t));
    if (!keys) return -1;
    int64_t *count = keys + cap, *pairs = keys + 2 * cap;
    for (int64_t i = 0; i < cap; i++) { keys[i] = EMPTY; count[i] = 0; pairs[i] = EMPTY; }
#define PAGE_AT(b, j) page_at(&t->src, b, j)
#define CANDIDATE(b) (q_len[b] > 0 && q_len[b] <= max_q && kv_len[b] - q_len[b] >= min_kv)
    int rc = 0, repeat = 0;
    for (int64_t b = 0; b < B; b++) {
        if (!CANDIDATE(b)) continue;
        int64_t page = PAGE_AT(b, 0);
        if (page == EMPTY) { rc = -1; goto out; }
        int64_t i = slot_of(keys, cap, page);
        if (keys[i] == page) {
            repeat = 1;
            if (t->min_reads <= 0) { rc = 1; goto out; }
        }
        keys[i] = page;
        count[i]++;
    }
    if (!repeat) goto out;
    if (cap > ((int64_t)1 << 20)) { rc = 1; goto out; } /* (the pairs' packing: numpy decides) */
    for (int64_t b = 0; b < B; b++) {
        if (!CANDIDATE(b)) continue;
        int64_t i = slot_of(keys, cap, PAGE_AT(b, 0)), g = count[i];
        if (g < 2) continue;
        int64_t col = (t->min_reads + g * t->page_size - 1) / (g * t->page_size) - 1;
        if ((kv_len[b] - q_len[b]) / t->page_size <= col) continue;
        int64_t page = PAGE_AT(b, col);
        /* the pair (group, page): the group's slot in the high bits (slots < 2^20 for any
         * batch the planner takes), the page's low 43 bits; a collision of two pages
         * that differ above them only answers 1, and numpy then decides exactly */
        int64_t key = (i << 43) | (page & (((int64_t)1 << 43) - 1));
        int64_t j = slot_of(pairs, cap, key);
        if (pairs[j] == key) { rc = 1; goto out; }
        pairs[j] = key;
    }
#undef PAGE_AT
#undef CANDIDATE
out:
    if (keys != local) free(keys);
    return rc;
}

int podcute_build(PlanIO *io) {
    Arena ar = {io->scratch, (size_t)io->scratch_size, 0, 0, {0}, 0};
    int rc = 0;
    const int64_t B = io->B, G = io->G, Hkv = io->Hkv, tn = io->tn, grid = io->grid;
    const int has_left = io->left >= 0;
    if (io->share_pages) {
        const ShareTest test = {{io->share_pages, io->share_indptr, io->share_elem_bytes,
                                 io->share_row_stride}, io->q_len, io->kv_len, B,
                                io->share_max_q, io->share_min_kv, io->share_min_reads,
                                io->share_page_size};
        io->first_repeat = first_pages_repeat(&test);
    } else {
        io->first_repeat = -1;
    }

    /* ---- groups: prefill (request, kv head, row tile), then decode (request, kv head) -- */
    int64_t n_pre = 0, n_dec = 0, n_tiles = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t rows = io->q_len[b] * G;
        if (rows > io->tm_d) { n_pre++; n_tiles += cdiv(rows, io->tm_p); }
        else if (rows > 0) n_dec++;
    }
    const int64_t n0p = n_tiles * Hkv, n0d = n_dec * Hkv, n0 = n0p + n0d;
    int64_t *g_req = NEW(int64_t, n0), *g_rs = NEW(int64_t, n0), *g_re = NEW(int64_t, n0);
    int32_t *g_head = NEW(int32_t, n0);
    int64_t *kv_end = NEW(int64_t, n0), *kv_begin = NEW(int64_t, n0);
    double *fixed = NEW(double, n0);
    CHECK(g_req && g_rs && g_re && g_head && kv_end && kv_begin && fixed);
    if (n0p) {
        int64_t *t_req = NEW(int64_t, n_tiles), *t_rs = NEW(int64_t, n_tiles),
                *t_re = NEW(int64_t, n_tiles), *t_e = NEW(int64_t, n_tiles),
                *t_b = NEW(int64_t, n_tiles), *t_len = NEW(int64_t, n_tiles),
                *srt = NEW(int64_t, n_tiles), *ord_t = NEW(int64_t, n0p),
                *ord_h = NEW(int64_t, n0p);
        CHECK(t_req && t_rs && t_re && t_e && t_b && t_len && srt && ord_t && ord_h);
        int64_t t = 0;
        for (int64_t b = 0; b < B; b++) {
            int64_t rows = io->q_len[b] * G;
            if (rows <= io->tm_d) continue;
            for (int64_t r = 0, nr = cdiv(rows, io->tm_p); r < nr; r++, t++) {
                t_req[t] = b;
                t_rs[t] = r * io->tm_p;
                t_re[t] = imin(t_rs[t] + io->tm_p, rows);
                t_e[t] = visible_end(io, io->kv_len[b], io->q_len[b], t_re[t]);
                t_b[t] = has_left ? load_start(io, io->kv_len[b], io->q_len[b], t_rs[t], t_e[t]) : 0;
                t_len[t] = t_e[t] - t_b[t];
            }
        }
        /* zigzag by length: the tiles sorted stably, each followed by its heads, except a
           run of a request's equal tiles, which goes head by head */
        CHECK(argsort_i64(&ar, t_len, n_tiles, srt) == 0);
        for (int64_t f = 0; f < n_tiles;) {
            int64_t L = 1;
            while (f + L < n_tiles) {
                int64_t p = srt[f + L], q = srt[f + L - 1];
                if (t_e[p] != t_e[q] || t_req[p] != t_req[q] || (has_left && t_b[p] != t_b[q]))
                    break;
                L++;
            }
            for (int64_t p = f; p < f + L; p++)
                for (int64_t h = 0; h < Hkv; h++) {
                    int64_t pos = L > 1 ? f * Hkv + h * L + (p - f) : p * Hkv + h;
                    ord_t[pos] = srt[p];
                    ord_h[pos] = h;
                }
            f += L;
        }
        for (int64_t i = 0; i < n0p; i++) {
            /* zig[2i] = by_len[n0p - 1 - i]; zig[2i + 1] = by_len[i] (the longest first) */
            int64_t src = (i % 2 == 0) ? n0p - 1 - i / 2 : i / 2;
            int64_t tt = ord_t[src], te = srt[src / Hkv]; /* (a run's tiles share e, b) */
            g_req[i] = t_req[tt]; g_head[i] = (int32_t)ord_h[src];
            g_rs[i] = t_rs[tt]; g_re[i] = t_re[tt];
            kv_end[i] = t_e[te];
            kv_begin[i] = t_b[te];
            fixed[i] = io->o_p;
        }
    }
    {
        int64_t gi = n0p;
        for (int64_t b = 0; b < B; b++) {
            int64_t rows = io->q_len[b] * G;
            if (rows <= 0 || rows > io->tm_d) continue;
            int64_t e = io->has_window ? visible_end(io, io->kv_len[b], io->q_len[b], rows)
                                       : io->kv_len[b];
            int64_t s = has_left ? load_start(io, io->kv_len[b], io->q_len[b], 0, e) : 0;
            double f = (double)rows * io->r_row + io->o_d;
            for (int64_t h = 0; h < Hkv; h++, gi++) {
                g_req[gi] = b; g_head[gi] = (int32_t)h; g_rs[gi] = 0; g_re[gi] = rows;
                kv_end[gi] = e; kv_begin[gi] = s; fixed[gi] = f;
            }
        }
    }

    /* ---- pieces of each kind: groups pre-split to <= the kind's work per CTA ----------- */
    int nk = 0, k_kind[2];
    int64_t k_lo[2], k_hi[2];
    double k_rate[2];
    if (n0p) { k_kind[nk] = PREFILL; k_lo[nk] = 0; k_hi[nk] = n0p; k_rate[nk++] = io->r_p; }
    if (n0d) { k_kind[nk] = DECODE; k_lo[nk] = n0p; k_hi[nk] = n0; k_rate[nk++] = io->r_d; }
    int64_t *nch = NEW(int64_t, n0), *tpc = NEW(int64_t, n0);
    CHECK(nch && tpc);
    int any_split = 0, split_k[2] = {0, 0};
    for (int k = 0; k < nk; k++) {
        const int64_t mtk = io->min_tiles[k_kind[k]];
        const double rate = k_rate[k];
        int64_t lo = k_lo[k], hi = k_hi[k], max_nch = 0;
        if (io->invariant) {
            int64_t per = io->invariant_tokens[k_kind[k]] / tn;
            for (int64_t g = lo; g < hi; g++) {
                int64_t tt = cdiv(kv_end[g] - kv_begin[g], tn);
                tpc[g] = per;
                nch[g] = imax(cdiv(tt, per), 1);
                max_nch = imax(max_nch, nch[g]);
            }
        } else {
            int64_t span_sum = 0, span_max = 0;
            double fixed_sum = 0.0; /* sequential, as _presplit sums it */
            for (int64_t g = lo; g < hi; g++) {
                int64_t sp = kv_end[g] - kv_begin[g];
                span_sum += sp;
                span_max = imax(span_max, sp);
                fixed_sum += fixed[g];
            }
            double load = ((double)span_sum * rate + fixed_sum) / (double)grid;
            double c_k = load / io->chunks_per_cta;
            if (c_k < io->min_chunk_us) c_k = io->min_chunk_us;
            if ((double)span_max * rate <= c_k) continue;
            double per_us = rate / c_k;
            for (int64_t g = lo; g < hi; g++) {
                int64_t sp = kv_end[g] - kv_begin[g], tt = cdiv(sp, tn);
                nch[g] = imin((int64_t)ceil((double)sp * per_us), tt / mtk);
                max_nch = imax(max_nch, nch[g]);
            }
            if (max_nch > 1)
                for (int64_t g = lo; g < hi; g++) {
                    int64_t tt = cdiv(kv_end[g] - kv_begin[g], tn), c = imax(nch[g], 1);
                    tpc[g] = (imax(tt, 1) + c - 1) / c;
                    nch[g] = imax(cdiv(tt, tpc[g]), 1);
                }
        }
        if (max_nch <= 1) continue;
        split_k[k] = 1;
        any_split = 1;
    }
    int64_t n1 = 0, n1p = 0;
    for (int k = 0; k < nk; k++) {
        int64_t cnt = 0;
        for (int64_t g = k_lo[k]; g < k_hi[k]; g++) cnt += split_k[k] ? nch[g] : 1;
        n1 += cnt;
        if (k_kind[k] == PREFILL) n1p = cnt;
    }
    int64_t *g1 = NEW(int64_t, n1), *j1 = NEW(int64_t, n1), *s1 = NEW(int64_t, n1),
            *e1 = NEW(int64_t, n1);
    double *c1 = NEW(double, n1);
    CHECK(g1 && j1 && s1 && e1 && c1);
    {
        int64_t i = 0;
        for (int k = 0; k < nk; k++)
            for (int64_t g = k_lo[k]; g < k_hi[k]; g++) {
                if (!split_k[k]) {
                    g1[i] = g; j1[i] = 0; s1[i] = kv_begin[g]; e1[i] = kv_end[g];
                    c1[i] = fixed[g] + (double)span_of(io, k_kind[k], kv_begin[g], kv_end[g]) * k_rate[k];
                    i++;
                    continue;
                }
                int64_t step = tpc[g] * tn;
                for (int64_t j = 0; j < nch[g]; j++, i++) {
                    g1[i] = g; j1[i] = j;
                    s1[i] = j * step + kv_begin[g];
                    e1[i] = imin(s1[i] + step, kv_end[g]);
                    c1[i] = fixed[g] + (double)span_of(io, k_kind[k], s1[i], e1[i]) * k_rate[k];
                }
            }
    }
    if (!any_split) n1p = n0p;

    /* ---- one stream, cut into the CTA lists ---------------------------------------------- */
    const int both = n0p && n0d;
    int64_t *order = NEW(int64_t, n1);
    double *c = NEW(double, n1), *end = NEW(double, n1);
    CHECK(order && c && end);
    if (both) {
        double *x = NEW(double, n1);
        CHECK(x);
        double acc = 0.0;
        for (int64_t i = 0; i < n1; i++) { acc = i ? acc + c1[i] : c1[i]; x[i] = acc; }
        double p_tot = x[n1p - 1], total = x[n1 - 1];
        double inv_p = 1.0 / p_tot, inv_d = 1.0 / (total - p_tot);
        for (int64_t i = 0; i < n1; i++) {
            x[i] -= c1[i];
            if (i < n1p) x[i] *= inv_p;
            else { x[i] -= p_tot; x[i] *= inv_d; }
        }
        CHECK(argsort_f64(&ar, x, n1, order) == 0);
        for (int64_t i = 0; i < n1; i++) c[i] = c1[order[i]];
    } else {
        for (int64_t i = 0; i < n1; i++) { order[i] = i; c[i] = c1[i]; }
    }
    double acc = 0.0;
    for (int64_t i = 0; i < n1; i++) { acc = i ? acc + c[i] : c[i]; end[i] = acc; }
    const double cum_total = n1 ? end[n1 - 1] : 0.0;
    const int64_t nb = grid - 1;
    double *bounds = NEW(double, nb + 1);
    int64_t *bi = NEW(int64_t, nb + 1), *bk = NEW(int64_t, nb + 1), *bspan = NEW(int64_t, nb + 1),
            *bmt = NEW(int64_t, nb + 1), *bch = NEW(int64_t, nb + 1);
    uint8_t *bok = NEW(uint8_t, nb + 1);
    double *bstart = NEW(double, nb + 1);
    CHECK(bounds && bi && bk && bspan && bmt && bch && bok && bstart);
    for (int64_t j = 0; j < nb; j++) bounds[j] = io->bounds_unit[j] * cum_total;
    int64_t ni = 0, m = 0;
    if (n1) {
        for (int64_t j = 0; j < nb; j++) {
            int64_t i = search_right(end, n1, bounds[j]);
            if (i >= n1) break; /* (the boundaries are non-decreasing) */
            bi[ni] = i;
            int64_t ch = order[i];
            bch[ni] = ch;
            bspan[ni] = cdiv(e1[ch] - s1[ch], tn);
            bmt[ni] = both ? io->min_tiles[ch >= n1p ? DECODE : PREFILL]
                           : io->min_tiles[n0p ? PREFILL : DECODE];
            ni++;
        }
        int any = 0;
        for (int64_t j = 0; j < ni; j++) any |= bspan[j] >= 2 * bmt[j];
        if (!io->invariant && any) {
            for (int64_t j = 0; j < ni; j++) {
                double ci = c[bi[j]];
                bstart[j] = end[bi[j]] - ci;
                bk[j] = (int64_t)nearbyint((bounds[j] - bstart[j]) / ci * (double)bspan[j]);
                bok[j] = bk[j] >= bmt[j] && bk[j] <= bspan[j] - bmt[j];
            }
            int any_close = 0;
            for (int64_t j = 1; j < ni; j++)
                any_close |= bi[j] == bi[j - 1] && bk[j] - bk[j - 1] < bmt[j];
            if (any_close) {
                uint8_t *snap = NEW(uint8_t, n1);
                CHECK(snap);
                memset(snap, 0, (size_t)n1);
                for (int64_t j = 1; j < ni; j++)
                    if (bi[j] == bi[j - 1] && bk[j] - bk[j - 1] < bmt[j]) snap[bi[j]] = 1;
                for (int64_t j = 0; j < ni; j++) {
                    if (snap[bi[j]]) bk[j] = fdiv(bk[j] + bmt[j] / 2, bmt[j]) * bmt[j];
                    bok[j] = bk[j] >= bmt[j] && bk[j] <= bspan[j] - bmt[j];
                }
                for (int64_t j = ni - 1; j >= 1; j--)
                    if (bi[j] == bi[j - 1] && bk[j] == bk[j - 1]) bok[j] = 0;
            }
            for (int64_t j = 0; j < ni; j++) m += bok[j];
        }
    }

    /* ---- parts: the stream's pieces, those under a kept cut in two ---------------------- */
    const int64_t n = n1 + m;
    if (n > io->cap_items) { rc = 1; goto done; }
    int64_t *npc = NEW(int64_t, n1), *src = NEW(int64_t, n), *chunk = NEW(int64_t, n),
            *kv_s = NEW(int64_t, n), *kv_e = NEW(int64_t, n), *g = NEW(int64_t, n),
            *cut_pos = NEW(int64_t, m), *cut_kv = NEW(int64_t, m), *cut_i = NEW(int64_t, m);
    double *cut_u = NEW(double, m), *mid = NEW(double, n);
    CHECK(npc && src && chunk && kv_s && kv_e && g && cut_pos && cut_kv && cut_i && cut_u && mid);
    {
        for (int64_t i = 0; i < n1; i++) npc[i] = 1;
        int64_t r = 0;
        for (int64_t j = 0; j < ni && m; j++) {
            if (!bok[j]) continue;
            int64_t i = bi[j], ch = bch[j];
            npc[i]++;
            cut_i[r] = i;
            cut_pos[r] = i + r + 1;
            cut_kv[r] = imin(s1[ch] + bk[j] * tn, e1[ch]);
            cut_u[r] = bstart[j] + c[i] * (double)bk[j] / (double)bspan[j];
            r++;
        }
        int64_t q = 0;
        for (int64_t i = 0; i < n1; i++)
            for (int64_t k = 0; k < npc[i]; k++, q++) src[q] = i;
    }
    for (int64_t q = 0; q < n; q++) {
        int64_t ch = order[src[q]];
        chunk[q] = ch;
        kv_e[q] = e1[ch];
        kv_s[q] = s1[ch];
        g[q] = g1[ch];
        io->pc[q] = c[src[q]];
        if (both) io->kind[q] = ch >= n1p;
    }
    if (m) {
        double *u_lo = NEW(double, n), *u_hi = NEW(double, n);
        CHECK(u_lo && u_hi);
        for (int64_t q = 0; q < n; q++) { u_hi[q] = end[src[q]]; u_lo[q] = u_hi[q] - io->pc[q]; }
        for (int64_t r = 0; r < m; r++) {
            u_lo[cut_pos[r]] = cut_u[r];
            u_hi[cut_pos[r] - 1] = cut_u[r];
        }
        for (int64_t q = 0; q < n; q++) mid[q] = 0.5 * (u_lo[q] + u_hi[q]);
        for (int64_t r = 0; r < m; r++) {
            kv_s[cut_pos[r]] = cut_kv[r];
            kv_e[cut_pos[r] - 1] = cut_kv[r];
        }
    } else {
        for (int64_t q = 0; q < n; q++) mid[q] = end[q] - 0.5 * c[q];
    }

    /* ---- CTA lists: part midpoints against the boundaries ------------------------------- */
    io->ptr[0] = 0;
    for (int64_t j = 0; j < nb; j++) io->ptr[1 + j] = search_left_f(mid, n, bounds[j]);
    io->ptr[grid] = n;

    /* ---- split slots and merges: a group with >= 2 parts writes partials ---------------- */
    int64_t *slot = NEW(int64_t, n), *m_rows = NEW(int64_t, n0 + m + 1),
            *m_first = NEW(int64_t, n0 + m + 1), *m_count = NEW(int64_t, n0 + m + 1);
    CHECK(slot && m_rows && m_first && m_count);
    int64_t num_slots = 0, num_merge = 0;
    for (int64_t q = 0; q < n; q++) slot[q] = -1;
    if (m && !any_split) {
        uint8_t *split = NEW(uint8_t, n);
        CHECK(split);
        memset(split, 0, (size_t)n);
        for (int64_t r = 0; r < m; r++) split[cut_pos[r] - 1] = split[cut_pos[r]] = 1;
        for (int64_t q = 0; q < n; q++) if (split[q]) slot[q] = num_slots++;
        for (int64_t r = 0; r < m; r++) {
            if (r && cut_i[r] == cut_i[r - 1]) continue;
            int64_t f = cut_pos[r] - 1;
            m_rows[num_merge] = g[f];
            m_first[num_merge] = slot[f];
            m_count[num_merge++] = npc[cut_i[r]];
        }
    } else if (any_split) {
        int64_t *gcount = NEW(int64_t, n0), *first_slot = NEW(int64_t, n0), *seen = NEW(int64_t, n0);
        CHECK(gcount && first_slot && seen);
        for (int64_t k = 0; k < nk; k++)
            for (int64_t gg = k_lo[k]; gg < k_hi[k]; gg++) gcount[gg] = split_k[k] ? nch[gg] : 1;
        for (int64_t r = 0; r < m; r++) gcount[g[cut_pos[r]]]++;
        for (int64_t gg = 0; gg < n0; gg++) {
            first_slot[gg] = -1;
            seen[gg] = 0;
            if (gcount[gg] > 1) {
                m_rows[num_merge] = gg;
                m_count[num_merge] = gcount[gg];
                m_first[num_merge++] = num_slots;
                first_slot[gg] = num_slots;
                num_slots += gcount[gg];
            }
        }
        for (int64_t q = 0; q < n; q++) slot[q] = first_slot[g[q]] + j1[chunk[q]];
        for (int64_t r = 0; r < m; r++) { /* the part after a cut: after the group's pieces */
            int64_t gc = g[cut_pos[r]], kk = gc < n0p ? 0 : nk - 1;
            slot[cut_pos[r]] = first_slot[gc] + (split_k[kk] ? nch[gc] : 1) + seen[gc]++;
        }
    }
    if (num_merge > io->cap_merges || num_slots > io->cap_slots) { rc = 1; goto done; }

    /* ---- write the metadata ------------------------------------------------------------- */
    for (int64_t q = 0; q < n; q++) {
        int32_t *w = io->work + q * WORK_COLS;
        int64_t gg = g[q];
        w[REQ] = (int32_t)g_req[gg]; w[KV_HEAD] = g_head[gg];
        w[ROW_START] = (int32_t)g_rs[gg]; w[ROW_END] = (int32_t)g_re[gg];
        w[KV_START] = (int32_t)kv_s[q]; w[KV_END] = (int32_t)kv_e[q];
        w[SPLIT_SLOT] = num_slots ? (int32_t)slot[q] : -1;
        w[KIND] = gg < n0p ? PREFILL : DECODE;
    }
    int64_t num_swaps = 0, grouped = both && io->group;
    if (grouped) {
        /* each list's rows of its first kind (odd lists: decode), then the others, each
           kind in its order; order[row] = where the row went (Planner._group_lists) */
        int32_t *moved = NEW(int32_t, n * WORK_COLS);
        CHECK(moved);
        for (int64_t cc = 0; cc < grid; cc++) {
            int64_t a = io->ptr[cc], b = io->ptr[cc + 1], nf = 0;
            uint8_t first = io->odd[cc]; /* io->kind: 1 = decode */
            for (int64_t q = a; q < b; q++) nf += io->kind[q] == first;
            int64_t at_first = a, at_other = a + nf;
            for (int64_t q = a; q < b; q++) {
                int64_t to = io->kind[q] == first ? at_first++ : at_other++;
                io->order[q] = to;
                memcpy(moved + to * WORK_COLS, io->work + q * WORK_COLS,
                       WORK_COLS * sizeof(int32_t));
            }
        }
        memcpy(io->work, moved, (size_t)n * WORK_COLS * sizeof(int32_t));
    } else if (both) {
        /* even lists start with prefill, odd ones with decode (when they hold both) */
        int64_t *ip = NEW(int64_t, n), *idd = NEW(int64_t, n), np_ = 0, nd_ = 0;
        CHECK(ip && idd);
        for (int64_t q = 0; q < n; q++) { if (io->kind[q]) idd[nd_++] = q; else ip[np_++] = q; }
        for (int64_t cc = 0; cc < grid; cc++) {
            int64_t a = io->ptr[cc], b = io->ptr[cc + 1], f;
            if (io->odd[cc]) f = idd[imin(search_left_i(idd, nd_, a), nd_ - 1)];
            else f = ip[imin(search_left_i(ip, np_, a), np_ - 1)];
            if (f > a && f < b) {
                io->swap_a[num_swaps] = a;
                io->swap_f[num_swaps++] = f;
                int32_t t[WORK_COLS];
                memcpy(t, io->work + a * WORK_COLS, sizeof t);
                memcpy(io->work + a * WORK_COLS, io->work + f * WORK_COLS, sizeof t);
                memcpy(io->work + f * WORK_COLS, t, sizeof t);
            }
        }
    }
    if (n0d)
        for (int64_t cc = 0; cc < grid; cc++) {
            int32_t ordinal = 0;
            for (int64_t q = io->ptr[cc]; q < io->ptr[cc + 1]; q++) {
                int32_t *w = io->work + q * WORK_COLS;
                if (w[KIND] == DECODE) w[KIND] |= ordinal++ << KIND_BITS;
            }
        }
    for (int64_t r = 0; r < num_merge; r++) {
        int32_t *mr = io->merge + r * MERGE_COLS;
        int64_t gg = m_rows[r];
        mr[M_REQ] = (int32_t)g_req[gg]; mr[M_KV_HEAD] = g_head[gg];
        mr[M_ROW_START] = (int32_t)g_rs[gg]; mr[M_ROW_END] = (int32_t)g_re[gg];
        mr[M_FIRST_SLOT] = (int32_t)m_first[r]; mr[M_NUM_SPLITS] = (int32_t)m_count[r];
        for (int64_t s = 0; s < m_count[r]; s++) io->slot_merge[m_first[r] + s] = (int32_t)r;
    }
    /* the parts next to a cut, for the predictions (their costs are their own) */
    for (int64_t r = 0; r < m; r++) {
        int64_t lo = cut_pos[r] - 1, hi = cut_pos[r];
        io->fix[r] = lo; io->fix[m + r] = hi;
    }
    for (int64_t x = 0; x < 2 * m; x++) {
        int64_t q = io->fix[x];
        io->fix_fixed[x] = fixed[g[q]];
        io->fix_s[x] = kv_s[q];
        io->fix_e[x] = kv_e[q];
    }
    io->n = n; io->num_merge = num_merge; io->num_slots = num_slots;
    io->n_prefill_req = n_pre; io->n_decode_req = n_dec; io->n0p = n0p; io->n0d = n0d;
    io->num_fix = 2 * m; io->num_swaps = num_swaps; io->both = both; io->grouped = grouped;
done:
    io->scratch_wanted = (int64_t)ar.wanted;
    release(&ar);
    return rc;
}


/* ---- sharing.detect in C ---------------------------------------------------------------
 * The batch's shared prefixes (planning/sharing.py, detect): the same tree, nodes, tiles and
 * levels, in the same order, so that the plans are byte for byte numpy's
 * (tests/test_plan_native.py compares the two). Rows are sorted as numpy sorts their bytes
 * (a stable sort by memcmp of the little-endian int64 rows). Returns 1 (outputs written),
 * 0 (nothing shared), 2 (cap_tiles / cap_levels too small: n_tiles and n_levels say what
 * is needed) or -1 (out of memory, or pages C does not read: numpy decides). */
typedef struct {
    int64_t B;
    const int64_t *q_len, *kv_len;
    const void *pages;      /* a block table (indptr NULL) or CSR indices, 4- or 8-byte ints */
    const int64_t *indptr;
    int64_t elem_bytes, row_stride;
    int64_t group, page_size, max_q, min_kv, tile_rows, max_tiles, max_tokens, window_left,
        min_reads, min_tokens;
    /* outputs: [B] depth; [participants] participants, home, row_off, levels_ptr (+1);
     * [cap_tiles] tile_first, tile_count, tile_lo, tile_hi, tile_rank0; [cap_levels]
     * levels_tile, levels_row */
    int64_t *depth, *participants, *home, *row_off, *levels_ptr;
    int64_t *tile_first, *tile_count, *tile_lo, *tile_hi, *tile_rank0, *levels_tile, *levels_row;
    int64_t cap_tiles, cap_levels;
    int64_t n_participants, n_tiles, n_levels, num_nodes, shared_tokens, saved_tokens;
} DetectIO;

/* Sort rows [lo, hi) of `srt` (indices into the m x width matrix P) as numpy sorts their
 * bytes: lexicographically by column, a column's int64 compared by its little-endian
 * bytes (memcmp: the byte-swapped value as unsigned), stable. Column by column (MSD): a
 * range whose rows agree on a column moves on to the next without sorting, so rows
 * sharing a long prefix cost one read a page (a comparison sort re-read the prefix in
 * every comparison: 3.7 MB of memcmp for S1's 128 x 528 pages). Each boundary between
 * sorted neighbours gets their LCP (the column they first differ at, or width). */
typedef struct { uint64_t k; int64_t i; } KeyIdx;

static int sort_rows(const int64_t *P, int64_t width, int64_t *srt, int64_t m, int64_t *lcp,
                     Arena *ar) {
    int64_t *st = take(ar, (size_t)3 * (m + 1) * sizeof *st), ns = 0;
    KeyIdx *a = take(ar, (size_t)m * sizeof *a), *b = take(ar, (size_t)m * sizeof *b);
    if (!st || !a || !b) return -1;
    st[0] = 0; st[1] = m; st[2] = 0; ns = 1;
    while (ns) {
        ns--;
        int64_t lo = st[3 * ns], hi = st[3 * ns + 1], col = st[3 * ns + 2], n = hi - lo;
        if (n < 2) continue;
        /* the first column some row differs from the range's first row at: memcmp over the
         * rows' common part, then the exact column only in a row that differs */
        const int64_t *f = P + srt[lo] * width;
        int64_t split = width;
        for (int64_t r = lo + 1; r < hi && split > col; r++) {
            const int64_t *x = P + srt[r] * width;
            if (memcmp(x + col, f + col, (size_t)(split - col) * 8) == 0) continue;
            int64_t j = col;
            while (x[j] == f[j]) j++;
            split = j;
        }
        col = split;
        if (col == width) {
            for (int64_t r = lo; r + 1 < hi; r++) lcp[r] = width;
            continue;
        }
        for (int64_t r = 0; r < n; r++) {
            a[r].k = __builtin_bswap64((uint64_t)P[srt[lo + r] * width + col]);
            a[r].i = srt[lo + r];
        }
        for (int64_t w = 1; w < n; w *= 2) { /* bottom-up merge sort: stable */
            for (int64_t x0 = 0; x0 < n; x0 += 2 * w) {
                int64_t mid = imin(x0 + w, n), end = imin(x0 + 2 * w, n), x = x0, y = mid, o = x0;
                while (x < mid && y < end) b[o++] = a[y].k < a[x].k ? a[y++] : a[x++];
                while (x < mid) b[o++] = a[x++];
                while (y < end) b[o++] = a[y++];
            }
            KeyIdx *t = a; a = b; b = t;
        }
        int64_t run = 0;
        for (int64_t r = 0; r < n; r++) {
            srt[lo + r] = a[r].i;
            if (r + 1 == n || a[r + 1].k != a[r].k) {
                if (r + 1 < n) lcp[lo + r] = col;
                st[3 * ns] = lo + run; st[3 * ns + 1] = lo + r + 1; st[3 * ns + 2] = col + 1;
                ns++;
                run = r + 1;
            }
        }
    }
    return 0;
}

/* intervals by first row, then the wider first */
static int cmp_interval(const void *a, const void *b) {
    const int64_t *x = a, *y = b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    return x[1] > y[1] ? -1 : x[1] < y[1];
}

int podcute_detect(DetectIO *io) {
    const int64_t B = io->B, ps = io->page_size, *q_len = io->q_len, *kvl = io->kv_len;
    Arena ar = {NULL, 0, 0, 0, {0}, 0};
    int rc = 0;
    const PageSrc src = {io->pages, io->indptr, io->elem_bytes, io->row_stride};
    /* the first test and its may-pay exit, as the expansion asks them (0: nothing pays) */
    const ShareTest test = {src, q_len, kvl, B, io->max_q, io->min_kv, io->min_reads, ps};
    if (first_pages_repeat(&test) == 0) return 0;
    int64_t *cand = NEW(int64_t, B + 1), *first = NEW(int64_t, B + 1), *order = NEW(int64_t, B + 1);
    CHECK(cand && first && order);
    int64_t nc = 0;
    for (int64_t b = 0; b < B; b++)
        if (q_len[b] <= io->max_q && kvl[b] - q_len[b] >= io->min_kv && q_len[b] > 0)
            cand[nc++] = b;
    if (nc < 2) goto done;
    for (int64_t c = 0; c < nc; c++) first[c] = page_at(&src, cand[c], 0);
    CHECK(argsort_i64(&ar, first, nc, order) == 0);
    int64_t *gid = NEW(int64_t, nc), *gsize = NEW(int64_t, nc);
    CHECK(gid && gsize);
    gid[0] = 0;
    for (int64_t k = 1; k < nc; k++) gid[k] = gid[k - 1] + (first[order[k]] != first[order[k - 1]]);
    if (gid[nc - 1] == nc - 1) goto done; /* no first page repeats */
    for (int64_t k = 0; k < nc; k++) gsize[k] = 0;
    for (int64_t k = 0; k < nc; k++) gsize[gid[k]]++;
    /* the candidates of groups of two or more, in request order */
    uint8_t *keep = NEW(uint8_t, nc);
    CHECK(keep);
    memset(keep, 0, (size_t)nc);
    for (int64_t k = 0; k < nc; k++) if (gsize[gid[k]] > 1) keep[order[k]] = 1;
    int64_t m = 0, width = 0;
    for (int64_t c = 0; c < nc; c++)
        if (keep[c]) {
            cand[m++] = cand[c];
            width = imax(width, (kvl[cand[m - 1]] - q_len[cand[m - 1]]) / ps);
        }
    /* page rows, padded past each request's shareable pages with -1 - i */
    int64_t *P = NEW(int64_t, m * width), *srt = NEW(int64_t, m);
    CHECK(P && srt);
    for (int64_t i = 0; i < m; i++) {
        int64_t b = cand[i], n_pages = (kvl[b] - q_len[b]) / ps, *row = P + i * width;
        int64_t at = row_start(&src, b);
        if (io->elem_bytes == 4) {
            const int32_t *from = (const int32_t *)io->pages + at;
            for (int64_t j = 0; j < n_pages; j++) row[j] = from[j];
        } else {
            memcpy(row, (const int64_t *)io->pages + at, (size_t)n_pages * 8);
        }
        for (int64_t j = n_pages; j < width; j++) row[j] = -1 - i;
        srt[i] = i;
    }
    /* the sorted rows with the LCPs of neighbours; then the LCP intervals (first row,
     * last row, h) */
    int64_t *lcp = NEW(int64_t, m), *stack_h = NEW(int64_t, m + 1), *stack_l = NEW(int64_t, m + 1);
    int64_t *iv = NEW(int64_t, 3 * m), ni = 0, ns = 1;
    CHECK(lcp && stack_h && stack_l && iv);
    CHECK(sort_rows(P, width, srt, m, lcp, &ar) == 0);
    lcp[m - 1] = 0;
    stack_h[0] = 0; stack_l[0] = 0;
    for (int64_t i = 0; i < m; i++) {
        int64_t lv = lcp[i], left = i;
        while (stack_h[ns - 1] > lv) {
            ns--;
            iv[3 * ni] = stack_l[ns]; iv[3 * ni + 1] = i; iv[3 * ni + 2] = stack_h[ns];
            ni++;
            left = stack_l[ns];
        }
        if (stack_h[ns - 1] < lv) { stack_h[ns] = lv; stack_l[ns] = left; ns++; }
    }
    if (ni == 0) goto done;
    qsort(iv, (size_t)ni, 3 * sizeof(int64_t), cmp_interval);
    /* nodes: (first row, last row, base, h) */
    int64_t *nodes = NEW(int64_t, 4 * ni), nn = 0, *open_b = NEW(int64_t, ni), *open_d = NEW(int64_t, ni), no = 0;
    CHECK(nodes && open_b && open_d);
    for (int64_t k = 0; k < ni; k++) {
        int64_t a = iv[3 * k], b = iv[3 * k + 1], h = iv[3 * k + 2];
        while (no && open_b[no - 1] < a) no--;
        int64_t base = no ? open_d[no - 1] : 0, run = (h - base) * ps;
        int kept = run >= io->min_tokens && (b - a + 1) * run >= io->min_reads;
        if (kept && io->window_left >= 0) {
            int64_t kv_max = 0;
            for (int64_t r = a; r <= b; r++) kv_max = imax(kv_max, kvl[cand[srt[r]]]);
            kept = kv_max - 1 - io->window_left <= base * ps
                   && (h - base) * ps + io->tile_rows / io->group - 2 <= io->window_left;
        }
        if (kept) {
            nodes[4 * nn] = a; nodes[4 * nn + 1] = b; nodes[4 * nn + 2] = base; nodes[4 * nn + 3] = h;
            nn++;
        }
        open_b[no] = b; open_d[no] = kept ? h : base; no++;
    }
    if (nn == 0) goto done;
    /* participants: the sorted rows inside a node, in sorted order */
    int64_t *inside = NEW(int64_t, m + 1), *rank_of = NEW(int64_t, m);
    CHECK(inside && rank_of);
    memset(inside, 0, (size_t)(m + 1) * sizeof *inside);
    for (int64_t k = 0; k < nn; k++) { inside[nodes[4 * k]]++; inside[nodes[4 * k + 1] + 1]--; }
    int64_t n_part = 0, run_in = 0;
    for (int64_t r = 0; r < m; r++) {
        run_in += inside[r];
        rank_of[r] = run_in > 0 ? n_part++ : -1;
    }
    int64_t *part = NEW(int64_t, n_part);
    CHECK(part);
    for (int64_t r = 0; r < m; r++) if (rank_of[r] >= 0) part[rank_of[r]] = cand[srt[r]];
    /* tiles: each node's sharers cut into runs of at most tile_rows rows; levels in node
     * order (rank, tile, row) */
    int64_t n_lv = 0;
    for (int64_t k = 0; k < nn; k++) n_lv += rank_of[nodes[4 * k + 1]] - rank_of[nodes[4 * k]] + 1;
    int64_t *lv_rank = NEW(int64_t, n_lv), *lv_tile = NEW(int64_t, n_lv), *lv_row = NEW(int64_t, n_lv);
    int64_t *t_first = NEW(int64_t, n_lv), *t_count = NEW(int64_t, n_lv), *t_lo = NEW(int64_t, n_lv),
            *t_hi = NEW(int64_t, n_lv);
    CHECK(lv_rank && lv_tile && lv_row && t_first && t_count && t_lo && t_hi);
    int64_t nt = 0, nl = 0, tokens = 0, shared = 0, saved = 0;
    for (int64_t k = 0; k < nn; k++) {
        int64_t r0 = rank_of[nodes[4 * k]], r1 = rank_of[nodes[4 * k + 1]] + 1;
        int64_t lo = nodes[4 * k + 2], hi = nodes[4 * k + 3], used = 0;
        shared += hi - lo;
        saved += (hi - lo) * (r1 - r0 - 1);
        t_first[nt] = r0; t_lo[nt] = lo; t_hi[nt] = hi; nt++;
        for (int64_t r = r0; r < r1; r++) {
            int64_t rows = q_len[part[r]] * io->group;
            if (used + rows > io->tile_rows) {
                t_count[nt - 1] = r - t_first[nt - 1];
                t_first[nt] = r; t_lo[nt] = lo; t_hi[nt] = hi; nt++;
                used = 0;
            }
            lv_rank[nl] = r; lv_tile[nl] = nt - 1; lv_row[nl] = used; nl++;
            used += rows;
            tokens += q_len[part[r]];
        }
        t_count[nt - 1] = r1 - t_first[nt - 1];
    }
    if (nt > io->max_tiles || tokens > io->max_tokens) goto done;
    io->n_participants = n_part; io->n_tiles = nt; io->n_levels = nl;
    if (nt > io->cap_tiles || nl > io->cap_levels || n_part > B) { rc = 2; goto done; }
    /* levels by sharer (a stable counting sort: each sharer's levels stay outer first) */
    int64_t *lp = io->levels_ptr;
    for (int64_t r = 0; r <= n_part; r++) lp[r] = 0;
    for (int64_t l = 0; l < nl; l++) lp[lv_rank[l] + 1]++;
    for (int64_t r = 0; r < n_part; r++) lp[r + 1] += lp[r];
    int64_t *fill = NEW(int64_t, n_part);
    CHECK(fill);
    for (int64_t r = 0; r < n_part; r++) fill[r] = lp[r];
    for (int64_t l = 0; l < nl; l++) {
        int64_t at = fill[lv_rank[l]]++;
        io->levels_tile[at] = lv_tile[l];
        io->levels_row[at] = lv_row[l];
    }
    for (int64_t t = 0; t < nt; t++) {
        io->tile_first[t] = t_first[t]; io->tile_count[t] = t_count[t];
        io->tile_lo[t] = t_lo[t]; io->tile_hi[t] = t_hi[t]; io->tile_rank0[t] = -1;
    }
    for (int64_t b = 0; b < B; b++) io->depth[b] = 0;
    for (int64_t r = 0; r < n_part; r++) {
        int64_t last = lp[r + 1] - 1, t = io->levels_tile[last];
        io->participants[r] = part[r];
        io->home[r] = t;
        io->row_off[r] = io->levels_row[last];
        if (io->tile_rank0[t] < 0) io->tile_rank0[t] = r;
        io->depth[part[r]] = t_hi[t];
    }
    io->num_nodes = nn;
    io->shared_tokens = shared * ps;
    io->saved_tokens = saved * ps;
    rc = 1;
done:
    release(&ar);
    return rc;
}

/* ---- sharing.rewrite in C --------------------------------------------------------------
 * The expansion's work rows, merges and slot list of an augmented batch rewritten in place
 * for its shared prefixes (planning/sharing.py, rewrite: the same writes in the same
 * places), and the terms written as (slot, row) pairs at `terms`. Returns 1 (done), 2 (a
 * capacity would be exceeded: need_* say what the plan needs), -1 (out of memory) or -3
 * (a row or rank field past SHARE_FIELD_MASK: numpy's assertion). */
typedef struct {
    /* the Sharing (int64): [P] participants, home, row_off, p_rows (packed rows),
     * levels_ptr (P + 1); [U] tile_first, tile_count, tile_rank0; [L] levels_tile,
     * levels_row */
    int64_t P, U, L;
    const int64_t *participants, *home, *row_off, *p_rows, *levels_ptr, *tile_first,
        *tile_count, *tile_rank0, *levels_tile, *levels_row;
    /* the plan (int32, row-major) */
    int32_t *work, *merge, *slot_merge, *terms;
    int64_t n, num_merge, num_slots, B, Hkv, terms_base, cap_merges, cap_slots, cap_terms;
    int64_t own_bit, row_shift, rank_shift, field_mask;
    int64_t total_merge, total_slots, n_terms; /* out (also what is needed, rc 2) */
} RewriteIO;

int podcute_rewrite(RewriteIO *io) {
    Arena ar = {NULL, 0, 0, 0, {0}, 0};
    int rc = 0;
    const int64_t n = io->n, B = io->B, Hkv = io->Hkv, P = io->P, U = io->U, L = io->L;
    const int64_t num_merge = io->num_merge, num_slots = io->num_slots;
    int32_t *wk = io->work, *mg = io->merge, *sm = io->slot_merge;
#define W(i, c) wk[(i) * WORK_COLS + (c)]
#define M(i, c) mg[(i) * MERGE_COLS + (c)]
    int64_t *rank_of = NEW(int64_t, B + 1), *local = NEW(int64_t, n + 1);
    int64_t *feed = NEW(int64_t, U * Hkv + 1), *g_first = NEW(int64_t, U * Hkv + 1),
            *g_pieces = NEW(int64_t, U * Hkv + 1), *block = NEW(int64_t, U + 1),
            *block_first = NEW(int64_t, U + 1);
    CHECK(rank_of && local && feed && g_first && g_pieces && block && block_first);
    for (int64_t b = 0; b <= B; b++) rank_of[b] = -1;
    for (int64_t r = 0; r < P; r++) rank_of[io->participants[r]] = r;
    for (int64_t g = 0; g < U * Hkv; g++) { feed[g] = -1; g_first[g] = 0; g_pieces[g] = 0; }
    for (int64_t u = 0; u < U; u++) block[u] = 0;
    const int64_t sharer_base = num_merge, new_merge = num_merge + P * Hkv;
    int64_t n_feed = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t slot = W(i, SPLIT_SLOT), req = W(i, REQ);
        local[i] = slot >= 0 ? slot - M(sm[slot], M_FIRST_SLOT) : 0;
        if (req > B) { /* a tile piece: its group (tile, head) */
            int64_t g = (req - B - 1) / 2 * Hkv + W(i, KV_HEAD);
            if (slot >= 0) {
                int64_t mm = sm[slot];
                feed[g] = mm;
                g_first[g] = M(mm, M_FIRST_SLOT);
                g_pieces[g] = M(mm, M_NUM_SPLITS);
            } else {
                feed[g] = new_merge + n_feed;
                g_first[g] = num_slots + n_feed; /* its new slot */
                g_pieces[g] = 1;
                n_feed++;
            }
        } else if (rank_of[req] >= 0) {
            int64_t u = io->home[rank_of[req]];
            block[u] = imax(block[u], local[i] + 1);
        }
    }
    const int64_t total_merge = new_merge + n_feed, s = num_slots + n_feed;
    block_first[0] = 0;
    for (int64_t u = 0; u < U; u++) block_first[u + 1] = block_first[u] + block[u];
    const int64_t total_slots = s + block_first[U] * Hkv;
#define OWN_SLOT0(h, u) (s + block_first[u] + block_first[U] * (h))
    int64_t n_terms = 0;
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t l = 0; l < L; l++) n_terms += g_pieces[io->levels_tile[l] * Hkv + h];
    io->total_merge = total_merge; io->total_slots = total_slots; io->n_terms = n_terms;
    if (total_merge > io->cap_merges || total_slots > io->cap_slots || n_terms > io->cap_terms) {
        rc = 2;
        goto done;
    }
    /* tile pieces left unsplit: a slot each, and a feed row as their merge */
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t req = W(i, REQ);
        if (req <= B || W(i, SPLIT_SLOT) >= 0) continue;
        int64_t g = (req - B - 1) / 2 * Hkv + W(i, KV_HEAD), slot = num_slots + k;
        int32_t *fr = mg + (new_merge + k) * MERGE_COLS;
        W(i, SPLIT_SLOT) = (int32_t)slot;
        sm[slot] = (int32_t)feed[g];
        for (int c = 0; c < MERGE_COLS; c++) fr[c] = 0;
        fr[M_REQ] = (int32_t)req; fr[M_KV_HEAD] = W(i, KV_HEAD);
        fr[M_ROW_START] = W(i, ROW_START); fr[M_ROW_END] = W(i, ROW_END);
        fr[M_FIRST_SLOT] = (int32_t)slot; fr[M_NUM_SPLITS] = 1;
        k++;
    }
    /* every feed row: the sharers' merges of its tile and head */
    for (int64_t g = 0; g < U * Hkv; g++) {
        if (feed[g] < 0) continue;
        int64_t u = g / Hkv, h = g % Hkv;
        M(feed[g], M_FEED_FIRST) = (int32_t)(sharer_base + h * P + io->tile_first[u]);
        M(feed[g], M_FEED_COUNT) = (int32_t)io->tile_count[u];
    }
    /* sharer merges, zeroed (their own-piece counts below) */
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < P; r++) {
            int32_t *row = mg + (sharer_base + h * P + r) * MERGE_COLS;
            for (int c = 0; c < MERGE_COLS; c++) row[c] = 0;
            row[M_REQ] = (int32_t)io->participants[r]; row[M_KV_HEAD] = (int32_t)h;
            row[M_ROW_END] = (int32_t)io->p_rows[r];
            row[M_FIRST_SLOT] = (int32_t)OWN_SLOT0(h, io->home[r]);
            row[M_OWN_ROW] = (int32_t)io->row_off[r];
        }
    /* own pieces: into their home tile's block, at their row */
    for (int64_t i = 0; i < n; i++) {
        int64_t req = W(i, REQ);
        if (req > B || rank_of[req] < 0) continue;
        int64_t r = rank_of[req], h = W(i, KV_HEAD), u = io->home[r];
        int64_t slot = OWN_SLOT0(h, u) + local[i], first_home = io->tile_rank0[u];
        if (io->row_off[r] > io->field_mask || r - first_home > io->field_mask) {
            rc = -3;
            goto done;
        }
        W(i, SPLIT_SLOT) = (int32_t)slot;
        W(i, KIND) |= (int32_t)(((int64_t)1 << io->own_bit) | (io->row_off[r] << io->row_shift)
                                | ((r - first_home) << io->rank_shift));
        sm[slot] = (int32_t)(sharer_base + h * P + first_home);
        M(sharer_base + h * P + r, M_NUM_SPLITS)++;
    }
    /* terms in (head, sharer, level, piece) order */
    int64_t t = 0;
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t r = 0; r < P; r++) {
            int32_t *row = mg + (sharer_base + h * P + r) * MERGE_COLS;
            int64_t t0 = t;
            for (int64_t l = io->levels_ptr[r]; l < io->levels_ptr[r + 1]; l++) {
                int64_t g = io->levels_tile[l] * Hkv + h;
                for (int64_t p = 0; p < g_pieces[g]; p++) {
                    io->terms[2 * t] = (int32_t)(g_first[g] + p);
                    io->terms[2 * t + 1] = (int32_t)io->levels_row[l];
                    t++;
                }
            }
            row[M_TERMS_FIRST] = (int32_t)(io->terms_base + 2 * t0);
            row[M_TERMS_COUNT] = (int32_t)(t - t0);
            row[M_WAIT] = row[M_NUM_SPLITS] + (int32_t)(t - t0);
        }
    rc = 1;
#undef W
#undef M
#undef OWN_SLOT0
done:
    release(&ar);
    return rc;
}
