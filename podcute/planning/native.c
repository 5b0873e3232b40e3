/* The planner's work expansion (Planner._layout_numpy in expand.py), in C: the same groups,
 * pre-split pieces, cost stream, cuts, CTA lists, split slots and merges. This file and
 * expand.py must stay bit-identical: the same floating-point operations in the same order,
 * so a change to either needs the same change in the other (tests/test_plan_native.py
 * compares them). Built on first use by native.py
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
static int first_pages_repeat(const PlanIO *io) {
    const int64_t B = io->B, max_q = io->share_max_q, min_kv = io->share_min_kv;
    const int64_t *q_len = io->q_len, *kv_len = io->kv_len, *indptr = io->share_indptr;
    const int64_t EMPTY = INT64_MIN;
    int64_t cap = 64;
    while (cap < 2 * B) cap <<= 1;
    int64_t local[3 * 256];
    int64_t *keys = cap <= 256 ? local : malloc(3 * (size_t)cap * sizeof(int64_t));
    if (!keys) return -1;
    int64_t *count = keys + cap, *pairs = keys + 2 * cap;
    for (int64_t i = 0; i < cap; i++) { keys[i] = EMPTY; count[i] = 0; pairs[i] = EMPTY; }
#define PAGE_AT(b, j)                                                                       \
    (io->share_elem_bytes == 4                                                              \
         ? (int64_t)((const int32_t *)io->share_pages)[(indptr ? indptr[b] : (b) * io->share_row_stride) + (j)] \
         : ((const int64_t *)io->share_pages)[(indptr ? indptr[b] : (b) * io->share_row_stride) + (j)])
#define CANDIDATE(b) (q_len[b] > 0 && q_len[b] <= max_q && kv_len[b] - q_len[b] >= min_kv)
    int rc = 0, repeat = 0;
    for (int64_t b = 0; b < B; b++) {
        if (!CANDIDATE(b)) continue;
        int64_t page = PAGE_AT(b, 0);
        if (page == EMPTY) { rc = -1; goto out; }
        int64_t i = slot_of(keys, cap, page);
        if (keys[i] == page) {
            repeat = 1;
            if (io->share_min_reads <= 0) { rc = 1; goto out; }
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
        int64_t col = (io->share_min_reads + g * io->share_page_size - 1)
                      / (g * io->share_page_size) - 1;
        if ((kv_len[b] - q_len[b]) / io->share_page_size <= col) continue;
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
    io->first_repeat = io->share_pages ? first_pages_repeat(io) : -1;

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

