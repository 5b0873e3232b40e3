"""Shared prefixes read once: find the leading pages that several requests share (a radix
tree over their page lists, no label from the caller) and rewrite a plan so that each
shared run is attended once for all its sharers (docs/notes/shared-prefix.md).

How a plan changes, in the kernel's terms (metadata.py, a `shared_prefix` variant):

- Each tree node whose run [lo, hi) pages is long enough becomes *prefix tiles*: virtual
  requests whose query rows are the packed rows of the node's sharers, one after another
  (at most a prefill tile's rows each, cut at sharer boundaries), read through a token
  list (`mShared` from `mQStart` of the tile), against the run's pages. Every row of a
  tile sees every key of the run: the run ends at or before each sharer's first query
  position, so causal masking passes it whole (the tile's KV length says so).
- A sharer keeps its own suffix: the request's pages and KV length move past its deepest
  shared run, which leaves its own causal mask as it was (the positions shift together).
- The work expansion (expand.py or native.c, unchanged) plans the augmented batch: real
  requests, then the tiles at indices VIRTUAL_REQUESTS + 2 u (each followed by an empty
  request, so that mQStart[r + 1] is the tile's end).
- :func:`rewrite` then makes every piece of a tile write partials whose merge row is a
  *feed* row (the sharers' merges it counts into), packs each sharer's own pieces into one
  slot per tile (at the sharer's row offset), and writes one merge per (sharer, KV head)
  that combines its prefix terms (slot, row) and its own slots.

Only decode-like requests share (their packed rows fit one decode tile), only whole pages
strictly before a sharer's first query token, and not in batch-invariant plans or plans
over a second K/V source (planner.py decides). Under a sliding window a node is shared
only where its window drops none of its keys, for any of its sharers' rows or its tiles'
(`detect`): the tiles then need no window of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from podcute.planning.arrays import _ragged_arange
from podcute.kernels.metadata import (SHARE_FIELD_MASK, SHARE_OWN_BIT, SHARE_RANK_SHIFT,
                                      SHARE_ROW_SHIFT, MergeCol, WorkCol)

# A node is worth its partials and merges when its run holds this many tokens (two KV
# tiles of the prefill kernel): below it a sharer reads little that it would not anyway.
MIN_SHARED_TOKENS = 256
# ... and when its sharers' plain plan would read this many bytes of it (sharers x run x
# the K and V bytes of a token, every KV head): sharing adds a prefix tile (a 128-row
# item, mostly empty rows when few share) and a merge per sharer and KV head, which
# cost a launch 10-17 us more on an H100 when they save little. Measured
# (`perf.experiments.share_pays`, docs/notes/shared-prefix.md, "When sharing pays"):
# every node of <= 32768 x 4 KB (128 MiB) of plain reads measured 0.75-0.95x of the
# plain plan's speed with two exceptions, every one of >= 256 MiB 1.13-2.6x.
MIN_SHARED_READ_BYTES = 192 << 20


@dataclass(frozen=True)
class Sharing:
    """The prefix tree of one batch and the tiles cut from it (host arrays)."""

    participants: np.ndarray  # request ids in tree order: a node's sharers are contiguous
    depth: np.ndarray  # [B] pages of each request's deepest shared run (0: none)
    # per tile: first participant rank, sharers, run [lo, hi) in pages, node
    tile_first: np.ndarray
    tile_count: np.ndarray
    tile_lo: np.ndarray
    tile_hi: np.ndarray
    home: np.ndarray  # [participants] the tile of each sharer's deepest node
    row_off: np.ndarray  # [participants] the sharer's first row in its home tile
    tile_rank0: np.ndarray  # [tiles] rank of the first sharer whose home it is (or -1)
    # per (participant, level) the tiles that hold it, outer first: CSR over participants
    levels_ptr: np.ndarray
    levels_tile: np.ndarray
    levels_row: np.ndarray  # the sharer's first row in that tile
    num_nodes: int
    shared_tokens: int  # KV tokens the tiles read once (each node's run once)
    saved_tokens: int  # KV tokens the sharers no longer read themselves

    @property
    def num_tiles(self) -> int:
        return int(self.tile_first.size)


def _page_rows(page_src, reqs: np.ndarray, width: int) -> np.ndarray:
    """int64 [len(reqs), width]: the first `width` page indices of each request (the table's
    columns, or its CSR run; entries past a request's list are clipped, and masked by the
    caller)."""
    fmt, pages, arg = page_src
    if fmt == "table":
        return pages[reqs, :width].astype(np.int64)
    start = arg[:-1][reqs].astype(np.int64)
    idx = start[:, None] + np.arange(width)
    np.minimum(idx, max(pages.size - 1, 0), out=idx)
    return pages[idx].astype(np.int64) if pages.size else np.zeros(idx.shape, np.int64)


def _cut(rows: np.ndarray, tile_rows: int):
    """Cut sharers of `rows` packed rows each (in order) into tiles of at most `tile_rows`
    rows, filling each before the next. Returns (each sharer's tile, its first row there,
    each tile's first sharer, its sharer count)."""
    n = rows.size
    if (rows == rows[0]).all():  # (decodes of one shape: whole multiples a tile)
        per = tile_rows // int(rows[0])
        idx = np.arange(n)
        tile, pos = np.divmod(idx, per)
        first = np.arange(0, n, per)
        return tile, pos * int(rows[0]), first, np.minimum(per, n - first)
    tile, row = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    firsts, t, used = [0], 0, 0
    for i, r in enumerate(rows.tolist()):
        if used + r > tile_rows:
            t, used = t + 1, 0
            firsts.append(i)
        tile[i], row[i] = t, used
        used += r
    first = np.array(firsts, dtype=np.int64)
    return tile, row, first, np.diff(first, append=n)


def _may_pay(page_src, reqs, grp, g, n_pages, min_reads: int, page_size: int) -> bool:
    """False when no node of these candidates (`reqs`, grouped by first page: group ids
    `grp` in order, sizes `g`) can reach `min_reads` tokens of plain reads. A necessary
    test, one gather and one sort: a node's n sharers share its pages from the first, all
    in one group of g >= n candidates, and its run holds >= min_reads / n >= min_reads / g
    tokens; so two of that group hold the same page at that column."""
    col = -(-min_reads // (g * page_size)) - 1
    ok = n_pages > col
    if int(ok.sum()) < 2:
        return False
    fmt, pages, arg = page_src
    rows, col, grp = reqs[ok], col[ok], grp[ok]
    at = pages[rows, col] if fmt == "table" else pages[arg[rows] + col]
    o = np.lexsort((at, grp))
    return bool(((grp[o][1:] == grp[o][:-1]) & (at[o][1:] == at[o][:-1])).any())


def candidate_bounds(group: int, page_size: int, decode_rows: int) -> tuple[int, int]:
    """(max q_len, min kv_len - q_len) of the requests that may share: their packed rows
    fit a decode tile, and MIN_SHARED_TOKENS of whole pages precede their first query."""
    return decode_rows // group, -(-MIN_SHARED_TOKENS // page_size) * page_size


def detect(page_src, q_len: np.ndarray, kvl: np.ndarray, group: int, page_size: int,
           decode_rows: int, tile_rows: int, max_tiles: int, max_tokens: int,
           window_left: int = -1, min_reads: int = 0) -> Sharing | None:
    """The batch's shared prefixes, or None when no two decode-like requests share
    MIN_SHARED_TOKENS of whole leading pages (one sort of the first pages decides that:
    the cost of a batch that shares nothing). A node is kept when its run adds
    MIN_SHARED_TOKENS beyond its nearest kept ancestor and its sharers x that run's
    tokens reach `min_reads` (the planner's MIN_SHARED_READ_BYTES in tokens).

    `window_left` >= 0 (a sliding window: a row at position p sees keys >= p - left): a
    node's keys [base, h) pages must all lie in every sharer row's window, so
    max(kv_len) - 1 - left <= base * page_size over its sharers; and in its tiles' rows'
    (virtual positions run - 1 + t, t < tile_rows / group tokens), so
    run + tile_rows / group - 2 <= left. The plan's window then masks nothing in a tile,
    and a sharer's own suffix moves its keys and positions together, so its window is
    unchanged. (The keys right of a prefix are never masked: they precede every row.)"""
    max_q, min_kv = candidate_bounds(group, page_size, decode_rows)
    # The first test, as few array passes as may be (a plan without the C expansion pays
    # it; native.c's first_pages_repeat answers it in the others' expansion).
    ok = (q_len <= max_q) & (kvl - q_len >= min_kv) & (q_len > 0)
    fmt, pages, arg = page_src
    B = ok.size
    if int(ok.sum()) < 2:  # (also an empty batch, or a table without columns)
        return None
    first = pages[:B, 0][ok] if fmt == "table" else pages[arg[:B][ok]]
    f = np.sort(first)
    if not (f[1:] == f[:-1]).any():
        return None
    rows = q_len * group
    n_pages = (kvl - q_len) // page_size  # whole pages before the first query token
    cand = ok.nonzero()[0]
    order = first.argsort(kind="stable")
    f = first[order]
    # each candidate's first-page group (in sorted order) and its size; the candidates
    # whose first page another candidate has are those of groups of two or more
    gid = np.zeros(f.size, dtype=np.int64)
    np.cumsum(f[1:] != f[:-1], out=gid[1:])
    size = np.bincount(gid)[gid]
    kept = size > 1
    if min_reads > 0 and not _may_pay(page_src, cand[order[kept]], gid[kept], size[kept],
                                      n_pages[cand[order[kept]]], min_reads, page_size):
        return None
    keep = np.zeros(cand.size, dtype=bool)
    keep[order[kept]] = True
    cand = cand[keep]
    width = int(n_pages[cand].max())
    P = _page_rows(page_src, cand, width)
    m = cand.size
    # Past a request's shareable pages: a value no other row holds (negative, unique).
    # (copyto: 69 us at 256 x 288 where the masked assignment took 102 and np.where 600)
    np.copyto(P, -1 - np.arange(m)[:, None], where=np.arange(width)[None, :]
              >= n_pages[cand][:, None])
    # Lexicographic order (any order of the elements will do: it keeps every prefix's
    # rows together), then the longest common prefix of neighbours.
    rows_bytes = np.ascontiguousarray(P).view(np.dtype((np.void, 8 * width))).ravel()
    srt = rows_bytes.argsort(kind="stable")
    P = P[srt]
    cand = cand[srt]
    kv_sorted = kvl[cand]
    eq = P[1:] == P[:-1]
    lcp = np.where(eq.all(axis=1), width, eq.argmin(axis=1))
    # LCP intervals: each node is a run [a, b] of sorted rows sharing `h` pages, h the
    # minimum lcp over it; its parent is the enclosing interval.
    stack = [(0, 0)]  # open intervals: (h, first row)
    intervals = []  # (first row, last row, h)
    # (a row whose lcp equals the previous row's opens and closes nothing: only the
    # changes are walked, a few per prefix group however many sharers it has)
    lcp_all = np.append(lcp, 0)
    change = np.ones(m, dtype=bool)
    np.not_equal(lcp_all[1:], lcp_all[:-1], out=change[1:])
    steps = change.nonzero()[0]
    for i, lv in zip(steps.tolist(), lcp_all[steps].tolist()):
        left = i
        while stack[-1][0] > lv:
            h, lb = stack.pop()
            intervals.append((lb, i, h))
            left = lb
        if stack[-1][0] < lv:
            stack.append((lv, left))
    if not intervals:
        return None
    # Parents first: by start, then the wider first. A node is kept when it adds
    # MIN_SHARED_TOKENS beyond its nearest kept ancestor (`base`), and its sharers would
    # read `min_reads` tokens of that run without it.
    intervals.sort(key=lambda t: (t[0], -t[1]))
    nodes = []  # (first row, last row, base, h): pages [base, h) shared
    open_ = []  # enclosing intervals: (last row, depth kept below it)
    for a, b, h in intervals:
        while open_ and open_[-1][0] < a:
            open_.pop()
        base = open_[-1][1] if open_ else 0
        run = (h - base) * page_size
        kept = run >= MIN_SHARED_TOKENS and (b - a + 1) * run >= min_reads
        if kept and window_left >= 0:
            kept = (int(kv_sorted[a: b + 1].max()) - 1 - window_left <= base * page_size
                    and (h - base) * page_size + tile_rows // group - 2 <= window_left)
        if kept:
            nodes.append((a, b, base, h))
        open_.append((b, h if kept else base))
    if not nodes:
        return None
    # Participants: the sorted rows inside an emitted node, in sorted order.
    inside = np.zeros(m + 1, dtype=np.int64)
    for a, b, _, _ in nodes:
        inside[a] += 1
        inside[b + 1] -= 1
    part_pos = (np.cumsum(inside[:m]) > 0).nonzero()[0]
    rank_of_pos = np.full(m, -1, dtype=np.int64)
    rank_of_pos[part_pos] = np.arange(part_pos.size)
    participants = cand[part_pos]
    p_rows = rows[participants]
    p_tok = q_len[participants]
    # Tiles: each node's sharers cut into runs of at most tile_rows rows (`_cut`). Nodes
    # come parents first, so a stable sort by sharer keeps each one's levels outer first.
    t_first, t_count, t_lo, t_hi, l_rank, l_tile, l_row = [], [], [], [], [], [], []
    n_tiles = 0
    for a, b, lo, hi in nodes:
        r0, r1 = int(rank_of_pos[a]), int(rank_of_pos[b]) + 1
        tile, row, first, count = _cut(p_rows[r0:r1], tile_rows)
        t_first.append(first + r0)
        t_count.append(count)
        t_lo.append(np.full(first.size, lo, dtype=np.int64))
        t_hi.append(np.full(first.size, hi, dtype=np.int64))
        l_rank.append(np.arange(r0, r1))
        l_tile.append(tile + n_tiles)
        l_row.append(row)
        n_tiles += first.size
    l_rank, l_tile, l_row = (np.concatenate(x) for x in (l_rank, l_tile, l_row))
    tokens = int(p_tok[l_rank].sum())
    if n_tiles > max_tiles or tokens > max_tokens:
        return None  # (the planner's room for tiles: plan this batch without sharing)
    by_rank = l_rank.argsort(kind="stable")
    levels_tile, levels_row = l_tile[by_rank], l_row[by_rank]
    levels_ptr = np.zeros(participants.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(l_rank, minlength=participants.size), out=levels_ptr[1:])
    home = levels_tile[levels_ptr[1:] - 1]
    row_off = levels_row[levels_ptr[1:] - 1]
    # each tile's first sharer whose deepest level it is (-1: none)
    tile_rank0 = np.full(n_tiles, participants.size, dtype=np.int64)
    np.minimum.at(tile_rank0, home, np.arange(participants.size))
    tile_rank0[tile_rank0 == participants.size] = -1
    t_lo_a, t_hi_a = np.concatenate(t_lo), np.concatenate(t_hi)
    depth = np.zeros(q_len.size, dtype=np.int64)
    depth[participants] = t_hi_a[home]
    runs = np.array([(hi - lo) for _, _, lo, hi in nodes], dtype=np.int64)
    sizes = np.array([int(rank_of_pos[b] - rank_of_pos[a] + 1) for a, b, _, _ in nodes])
    return Sharing(
        participants=participants, depth=depth,
        tile_first=np.concatenate(t_first), tile_count=np.concatenate(t_count),
        tile_lo=t_lo_a, tile_hi=t_hi_a, home=home, row_off=row_off, tile_rank0=tile_rank0,
        levels_ptr=levels_ptr, levels_tile=levels_tile, levels_row=levels_row,
        num_nodes=len(nodes), shared_tokens=int(runs.sum()) * page_size,
        saved_tokens=int((runs * (sizes - 1)).sum()) * page_size)


def augment(sh: Sharing, q_len, kvl, page_start, cu, page_size: int):
    """The batch the expansion plans: the real requests (sharers' KV past their deepest
    run), an empty request, then each tile at B + 1 + 2 u followed by an empty one.
    Returns (q_len, kv_len the expansion sees, kv_len the kernel reads, page_start,
    q_start, token list)."""
    B, U = q_len.size, sh.num_tiles
    n = B + 1 + 2 * U
    q2 = np.zeros(n, dtype=q_len.dtype)
    kv2 = np.zeros(n, dtype=np.int64)
    ps2 = np.zeros(n, dtype=np.int64)
    q2[:B] = q_len
    kv2[:B] = kvl - sh.depth * page_size
    ps2[:B] = page_start + sh.depth
    # tokens of each tile: its sharers' tokens in rank order
    p = sh.participants
    tok_counts = q_len[sh.participants]
    tok_before = np.zeros(tok_counts.size + 1, dtype=np.int64)
    np.cumsum(tok_counts, out=tok_before[1:])
    t_tok = tok_before[sh.tile_first + sh.tile_count] - tok_before[sh.tile_first]
    vi = B + 1 + 2 * np.arange(U)
    q2[vi] = t_tok
    run = (sh.tile_hi - sh.tile_lo) * page_size
    kv2[vi] = run
    ps2[vi] = page_start[p[sh.tile_first]] + sh.tile_lo
    kv_kernel = kv2.copy()
    # every row of a tile sees its whole run under the causal mask: the last key sits
    # at or before the first row's position
    kv_kernel[vi] = run + t_tok - 1
    qs = np.zeros(n + 1, dtype=np.int64)
    qs[: B + 1] = cu
    t_off = np.zeros(U + 1, dtype=np.int64)
    np.cumsum(t_tok, out=t_off[1:])
    qs[vi] = t_off[:-1]
    qs[vi + 1] = t_off[1:]
    qs[n] = t_off[-1]
    # each tile's sharers (ranks) in order, then each sharer's tokens
    ranks = np.repeat(sh.tile_first, sh.tile_count) + _ragged_arange(
        sh.tile_count, int(sh.tile_count.sum()))
    counts = tok_counts[ranks].astype(np.int64)
    tokens = (np.repeat(cu[p[ranks]].astype(np.int64), counts)
              + _ragged_arange(counts, int(counts.sum())))
    return q2, kv2, kv_kernel, ps2, qs, tokens


def rewrite(sh: Sharing, work: np.ndarray, merge: np.ndarray, slot_merge: np.ndarray,
            n: int, num_merge: int, num_slots: int, B: int, num_kv_heads: int,
            p_rows: np.ndarray, terms_base: int, cap_merges: int, cap_slots: int,
            cap_terms: int):
    """Rewrite the expansion's work rows, merges and slot list of the augmented batch in
    place (module docstring). Returns (num_merge, num_slots, terms [k, 2]), or a dict of
    what it needs (merges, slots, terms) when the buffers cannot hold the result.
    `p_rows`: each participant's packed rows; `terms_base`: where the terms start in the
    shared list (after the tiles' tokens)."""
    Hkv = num_kv_heads
    P = sh.participants.size
    U = sh.num_tiles
    wk = work[:n]
    req = wk[:, WorkCol.REQ].astype(np.int64)
    head = wk[:, WorkCol.KV_HEAD].astype(np.int64)
    slot = wk[:, WorkCol.SPLIT_SLOT].astype(np.int64)
    rank_of_req = np.full(B, -1, dtype=np.int64)
    rank_of_req[sh.participants] = np.arange(P)
    is_tile = req > B
    tile = np.where(is_tile, (req - B - 1) // 2, -1)
    is_own = np.zeros(n, dtype=bool)
    is_own[~is_tile] = rank_of_req[req[~is_tile]] >= 0
    # ---- merges: the expansion's, then P x Hkv sharer merges (head-major, rank order),
    # then a feed row for each tile group the expansion left unsplit
    sharer_base = num_merge
    new_merge = num_merge + P * Hkv
    # each piece's slot within its group, in the expansion's numbering
    m_of_slot = slot_merge[:num_slots].astype(np.int64)
    first_of_slot = np.where(slot >= 0, merge[m_of_slot[np.maximum(slot, 0)],
                                              MergeCol.FIRST_SLOT] if num_slots else 0, 0)
    local = np.where(slot >= 0, slot - first_of_slot, 0)
    # ---- tile groups (tile, head): their slots
    g_key = tile * Hkv + head
    tiles_idx = is_tile.nonzero()[0]
    unsplit_tile = tiles_idx[slot[tiles_idx] < 0]
    n_feed_new = unsplit_tile.size
    feed_of_group = np.full(U * Hkv, -1, dtype=np.int64)
    split_tile = tiles_idx[slot[tiles_idx] >= 0]
    feed_of_group[g_key[split_tile]] = m_of_slot[slot[split_tile]]
    feed_of_group[g_key[unsplit_tile]] = new_merge + np.arange(n_feed_new)
    total_merge = new_merge + n_feed_new
    # new slots: one per unsplit tile piece, then each home tile's own block per head
    s = num_slots
    tile_slot_new = s + np.arange(n_feed_new)
    s += n_feed_new
    own_idx = is_own.nonzero()[0]
    own_rank = rank_of_req[req[own_idx]]
    own_local = local[own_idx]
    own_home = sh.home[own_rank]
    block = np.zeros(U, dtype=np.int64)  # own slots a home tile needs (per head)
    if own_idx.size:
        np.maximum.at(block, own_home, own_local + 1)
    block_first = np.zeros(U + 1, dtype=np.int64)
    np.cumsum(block, out=block_first[1:])
    own_slot0 = s + (block_first[:-1][None, :] + block_first[-1] * np.arange(Hkv)[:, None])
    total_slots = s + int(block_first[-1]) * Hkv
    # terms: for each sharer (rank) and head, every piece of each tile of its levels
    g_pieces = np.zeros(U * Hkv, dtype=np.int64)
    g_first = np.zeros(U * Hkv, dtype=np.int64)
    if split_tile.size:
        mm = m_of_slot[slot[split_tile]]
        g_first[g_key[split_tile]] = merge[mm, MergeCol.FIRST_SLOT]
        g_pieces[g_key[split_tile]] = merge[mm, MergeCol.NUM_SPLITS]
    g_first[g_key[unsplit_tile]] = tile_slot_new
    g_pieces[g_key[unsplit_tile]] = 1
    lv_counts = np.diff(sh.levels_ptr)  # levels of each sharer
    # per (head, rank, level): pieces of that tile group
    lv_rank = np.arange(P).repeat(lv_counts)
    gk = sh.levels_tile[None, :] * Hkv + np.arange(Hkv)[:, None]  # [Hkv, levels]
    pieces = g_pieces[gk]
    n_terms = int(pieces.sum())
    if total_merge > cap_merges or total_slots > cap_slots or n_terms > cap_terms:
        return dict(merges=total_merge, slots=total_slots, terms=n_terms)
    # ---- write: tile pieces
    wk[unsplit_tile, WorkCol.SPLIT_SLOT] = tile_slot_new
    slot_merge[tile_slot_new] = feed_of_group[g_key[unsplit_tile]]
    fr = merge[num_merge + P * Hkv: total_merge]
    fr[:] = 0
    ut = unsplit_tile
    fr[:, MergeCol.REQ] = req[ut]
    fr[:, MergeCol.KV_HEAD] = head[ut]
    fr[:, MergeCol.ROW_START] = wk[ut, WorkCol.ROW_START]
    fr[:, MergeCol.ROW_END] = wk[ut, WorkCol.ROW_END]
    fr[:, MergeCol.FIRST_SLOT] = tile_slot_new
    fr[:, MergeCol.NUM_SPLITS] = 1
    # every feed row: the sharers' merges of its tile and head
    fg = feed_of_group >= 0
    f_rows = feed_of_group[fg]
    f_tile, f_head = np.divmod(np.nonzero(fg)[0], Hkv)
    merge[f_rows, MergeCol.FEED_FIRST] = sharer_base + f_head * P + sh.tile_first[f_tile]
    merge[f_rows, MergeCol.FEED_COUNT] = sh.tile_count[f_tile]
    # ---- own pieces: into their home tile's block, at their row
    o_head = head[own_idx]
    new_slot = own_slot0[o_head, own_home] + own_local
    wk[own_idx, WorkCol.SPLIT_SLOT] = new_slot
    first_home = sh.tile_rank0[own_home]
    share_bits = ((1 << SHARE_OWN_BIT) | (sh.row_off[own_rank] << SHARE_ROW_SHIFT)
                  | ((own_rank - first_home) << SHARE_RANK_SHIFT))
    assert (sh.row_off[own_rank] <= SHARE_FIELD_MASK).all()
    assert ((own_rank - first_home) <= SHARE_FIELD_MASK).all()
    wk[own_idx, WorkCol.KIND] |= share_bits.astype(np.int32)
    slot_merge[new_slot] = sharer_base + o_head * P + first_home
    # ---- sharer merges
    # (counts by bincount: np.add.at took 22 + 29 us of S2's plan for these two)
    own_count = np.bincount(o_head * P + own_rank, minlength=Hkv * P).reshape(Hkv, P)
    sm = merge[sharer_base: sharer_base + P * Hkv].reshape(Hkv, P, -1)
    sm[:] = 0
    sm[:, :, MergeCol.REQ] = sh.participants[None, :]
    sm[:, :, MergeCol.KV_HEAD] = np.arange(Hkv)[:, None]
    sm[:, :, MergeCol.ROW_END] = p_rows[None, :]
    sm[:, :, MergeCol.FIRST_SLOT] = own_slot0[:, sh.home]
    sm[:, :, MergeCol.NUM_SPLITS] = own_count
    sm[:, :, MergeCol.OWN_ROW] = sh.row_off[None, :]
    # terms in (head, rank, level, piece) order
    per_sharer = np.bincount((np.arange(Hkv)[:, None] * P + lv_rank[None, :]).reshape(-1),
                             weights=pieces.reshape(-1), minlength=Hkv * P
                             ).astype(np.int64).reshape(Hkv, P)  # (exact: small integers)
    t_end = per_sharer.reshape(-1).cumsum()
    t_first = t_end - per_sharer.reshape(-1)
    sm[:, :, MergeCol.TERMS_FIRST] = terms_base + 2 * t_first.reshape(Hkv, P)
    sm[:, :, MergeCol.TERMS_COUNT] = per_sharer
    sm[:, :, MergeCol.WAIT] = own_count + per_sharer
    flat_p = pieces.reshape(-1)
    tslots = np.repeat(g_first[gk].reshape(-1), flat_p)
    tslots = tslots + _ragged_arange(flat_p, n_terms)
    trows = np.repeat(np.broadcast_to(sh.levels_row[None, :], pieces.shape).reshape(-1), flat_p)
    terms = np.stack([tslots, trows], axis=1)
    return total_merge, total_slots, terms


def fill_merge_columns(merge: np.ndarray, num_merge: int) -> None:
    """The `shared_prefix` columns of a plan's own merges: no terms, no feed, the wait its
    split count (a shared_prefix kernel reads them for every merge)."""
    mr = merge[:num_merge]
    mr[:, MergeCol.OWN_ROW] = 0
    mr[:, MergeCol.WAIT] = mr[:, MergeCol.NUM_SPLITS]
    mr[:, MergeCol.TERMS_FIRST:] = 0
