"""The planner's work expansion in numpy: a checked batch -> groups, pre-split pieces, one
cost stream cut into the CTA lists, split slots and merges, written into the staging
buffers (:meth:`WorkExpansion._layout_numpy`), and the predictions read from it.

This code and the C expansion (``native.c``, loaded by ``native.py``) must compute
bit-identical plans, so a change to either needs the same change, with the same
floating-point operations in the same order, in the other (``tests/test_plan_native.py``
compares them).
"""

from __future__ import annotations

import numpy as np

from podcute.kernels.metadata import KIND_BITS, WORK_COLS, Kind, MergeCol, WorkCol
from podcute.kernels.visibility import load_start_host, visible_end_host
from podcute.planning.arrays import _ragged_arange, _rows
from podcute.planning.types import INVARIANT_SPLIT_TOKENS, Layout


class WorkExpansion:
    """The expansion half of :class:`~podcute.planning.Planner` (a mixin: Planner is its
    only subclass). It reads the planner's configuration (``config``, ``cost``, ``grid``,
    ``capacity``), the batch's prefill tiling (``_tiling``, set by ``_build``), the
    per-planner constants (``_iota``, ``_group_rows``, ``_bounds_unit``, ``_odd``,
    ``_group_kinds``), writes the staging views (``_h``) and calls ``_grow_splits`` when a
    batch-invariant plan needs more split room."""

    def _span(self, kind, kv_start, kv_end):
        """KV tokens a piece costs: a prefill tile is tensor work whether its keys are all
        visible or not (whole tiles); decode streams the bytes of its tokens. kv_start
        None: 0."""
        if kind == Kind.PREFILL:
            tn = self.config.kernel.tile_n
            kv_end = (kv_end + (tn - 1)) // tn * tn
        return kv_end if kv_start is None else kv_end - kv_start

    def _presplit(self, b, e, fixed, rate, min_tiles, invariant_tokens=None):
        """Split KV ranges [b, e) (b tile-aligned; None: 0) into tile-aligned pieces of
        about equal work, each >= max(L / s, min_chunk) (L = these groups' work per CTA,
        s = chunks_per_cta) and >= min_tiles tiles; with `invariant_tokens`, into pieces
        of that many tokens from b (split points that depend on the request alone).
        Returns (group, index in group, kv start, kv end, pieces per group), or None
        when nothing splits."""
        tn = self.config.kernel.tile_n
        span = e if b is None else e - b
        t = (span + (tn - 1)) // tn
        if invariant_tokens is not None:
            tpc = np.full(e.size, invariant_tokens // tn, dtype=np.int64)
            nch = np.maximum((t + tpc - 1) // tpc, 1)
            if nch.max() <= 1:
                return None
        else:
            # (fixed summed in order, as native.c does: numpy's sum is pairwise)
            load = (float(span.sum()) * rate + float(fixed.cumsum()[-1])) / self.grid
            c_k = max(load / self.cost.chunks_per_cta, self.cost.min_chunk_us)
            if float(span.max()) * rate <= c_k:
                return None
            nch = np.minimum(np.ceil(span * (rate / c_k)).astype(np.int64), t // min_tiles)
            if nch.max() <= 1:
                return None
            nch = np.maximum(nch, 1)
            tpc = (np.maximum(t, 1) + nch - 1) // nch  # KV tiles per piece
            nch = np.maximum((t + tpc - 1) // tpc, 1)
        src = np.arange(e.size).repeat(nch)
        j = _ragged_arange(nch, src.size)
        step = tpc[src] * tn
        s = j * step
        if b is not None:
            s += b[src]
        return src, j, s, np.minimum(s + step, e[src]), nch

    def _group_lists(self, wk: np.ndarray, ptr: np.ndarray, decode: np.ndarray) -> np.ndarray:
        """The work rows `wk` (in stream order, `decode` True for a decode row) regrouped
        by kind within each CTA list, in place: the first list of an SM (`_odd` False)
        all its prefill rows first, the second all its decode rows first, each kind in its
        order (native.c does the same). Returns where each row went."""
        n = wk.shape[0]
        counts = np.diff(ptr)
        first = decode == np.repeat(self._odd, counts)  # the list's first kind
        before = np.zeros(n + 1, dtype=np.int64)  # first-kind rows before each row
        np.cumsum(first, out=before[1:])
        at_start = before[ptr[:-1]]
        rank_first = before[:-1] - np.repeat(at_start, counts)
        n_first = before[ptr[1:]] - at_start
        pos_in_list = np.arange(n) - np.repeat(ptr[:-1], counts)
        dest = np.repeat(ptr[:-1], counts) + np.where(
            first, rank_first, np.repeat(n_first, counts) + pos_in_list - rank_first)
        grouped = np.empty_like(wk)
        grouped[dest] = wk
        wk[:] = grouped
        return dest

    def _layout_numpy(self, q_len, kvl, options) -> "Layout":
        """The work rows, merges and slot list of the batch in the staging buffers, and
        what the predictions need (numpy; native.c is the same in C)."""
        cfg, kcfg, grid = self.config, self.config.kernel, self.grid
        causal, bounded, right = options.causal, options.bounded_right, options.right
        left = options.window_left
        tm_p, tm_d, tn = self._tiling.tile_m, kcfg.tile_m_decode, kcfg.tile_n
        G, Hkv = cfg.group_size, cfg.num_kv_heads
        B = q_len.size
        r_p, r_d, r_row, o_p, o_d = self._tiling.us

        rows = q_len * G
        is_pre = rows > tm_d
        preq = is_pre.nonzero()[0]
        if preq.size or not rows.all():
            dreq = ((rows > 0) ^ is_pre).nonzero()[0]  # 0 < rows <= tm_d
            d_rows, d_kv = rows[dreq], kvl[dreq]
        else:  # the common decode step: every request is decode work
            dreq, d_rows, d_kv = self._iota[:B], rows, kvl

        # ---- groups: work items before KV splitting ---------------------------------------
        # prefill (request, kv head, tm_p-row tile), then decode (request, kv head). tmpl
        # holds each group's work row, fixed its fixed cost.
        if preq.size:
            n_rt = (rows[preq] + (tm_p - 1)) // tm_p  # row tiles per prefill request
            n_tiles = int(n_rt.sum())
            n0p = n_tiles * Hkv
        else:
            n0p = 0
        n0d = dreq.size * Hkv
        n0 = n0p + n0d
        tmpl = np.empty((n0, WORK_COLS), dtype=np.int32)
        kv_end = np.empty(n0, dtype=np.int64)  # each group's KV range is [kv_begin, kv_end)
        # a tile-aligned start when a window's left edge skips keys, else 0 (None)
        kv_begin = np.zeros(n0, dtype=np.int64) if left >= 0 else None
        fixed = np.empty(n0)
        kinds = []  # per kind: (kind, its groups, cost per KV token)
        if n0p:
            # The row tiles, in (request, tile) order: the KV heads of one are alike.
            req = preq.repeat(n_rt)
            row_start = _ragged_arange(n_rt, n_tiles) * tm_p
            row_end = np.minimum(row_start + tm_p, rows[req])
            # keys no row of the item sees are never loaded
            e = visible_end_host(kvl[req], q_len[req], row_end, G, bounded, right)
            if left >= 0:  # nor those left of every row's window (whole tiles)
                b = load_start_host(kvl[req], q_len[req], row_start, G, left, e, tn)
                e_len = e - b  # the zigzag sorts by the work, not the end
            else:
                b, e_len = None, e
            # Zigzag the groups by length (longest, shortest, next longest, ...): every
            # stretch of the stream, so every CTA list, then holds long and short tiles in
            # the batch's proportion, and per-item costs the model misses spread evenly.
            # "By length" is a stable sort of the groups in (request, head, tile) order:
            # the tiles sorted stably, each followed by its heads, except that a request's
            # tiles of equal length (a run) go head by head (below).
            srt = e_len.argsort(kind="stable")
            e, e_len, req = e[srt], e_len[srt], req[srt]
            by_len = np.empty((n_tiles, Hkv, WORK_COLS), dtype=np.int32)
            by_len[:] = self._group_rows[Kind.PREFILL]  # KV_HEAD = head, KIND = PREFILL
            by_len[:, :, WorkCol.REQ] = req[:, None]
            by_len[:, :, WorkCol.ROW_START] = row_start[srt][:, None]
            by_len[:, :, WorkCol.ROW_END] = row_end[srt][:, None]
            by_len = _rows(by_len.reshape(n0p, WORK_COLS))
            # continues the tile before (the same KV range)
            run = (e[1:] == e[:-1]) & (req[1:] == req[:-1])
            if b is not None:
                b = b[srt]
                run &= b[1:] == b[:-1]
            if run.any():
                first = np.concatenate(([True], ~run)).nonzero()[0]  # each run's first tile
                run_len = np.diff(first, append=n_tiles)
                r = np.arange(first.size).repeat(run_len)  # run of each tile
                # group (tile p, head h) of a run of L tiles from tile f: f * Hkv + h * L + p - f
                pos = (first * (Hkv - 1))[r] + np.arange(n_tiles)
                pos = pos[:, None] + run_len[r][:, None] * np.arange(Hkv)
                ordered = np.empty_like(by_len)
                ordered[pos.reshape(-1)] = by_len
                by_len = ordered
            e = e.repeat(Hkv)  # (a run's tiles are of one KV range)
            half = (n0p + 1) // 2
            zig = _rows(tmpl[:n0p])
            zig[0::2], zig[1::2] = by_len[::-1][:half], by_len[: n0p - half]
            ends = kv_end[:n0p]
            ends[0::2], ends[1::2] = e[::-1][:half], e[: n0p - half]
            if b is not None:
                b = b.repeat(Hkv)
                begins = kv_begin[:n0p]
                begins[0::2], begins[1::2] = b[::-1][:half], b[: n0p - half]
            fixed[:n0p] = o_p
            kinds.append((Kind.PREFILL, slice(0, n0p), r_p))
        if n0d:
            t = tmpl[n0p:].reshape(dreq.size, Hkv, WORK_COLS)
            t[:] = self._group_rows[Kind.DECODE]  # KV_HEAD = head, ROW_START = 0
            t[:, :, WorkCol.REQ] = dreq[:, None]
            t[:, :, WorkCol.ROW_END] = d_rows[:, None]
            # the causal clip is a no-op for an item holding all rows of its request (not
            # a window's right edge, nor its left)
            if options.has_window:
                d_q = q_len[dreq]
                d_e = visible_end_host(d_kv, d_q, d_rows, G, bounded, right)
                kv_end[n0p:].reshape(dreq.size, Hkv)[:] = d_e[:, None]
                if left >= 0:
                    d_b = load_start_host(d_kv, d_q, 0, G, left, d_e, tn)
                    kv_begin[n0p:].reshape(dreq.size, Hkv)[:] = d_b[:, None]
            else:
                kv_end[n0p:].reshape(dreq.size, Hkv)[:] = d_kv[:, None]
            fixed[n0p:].reshape(dreq.size, Hkv)[:] = (d_rows * r_row + o_d)[:, None]
            kinds.append((Kind.DECODE, slice(n0p, n0), r_d))

        # ---- pieces of each kind: groups pre-split to <= the kind's work per CTA -----------
        # so each kind reaches every CTA and co-runs with the other on every SM.
        invariant = options.batch_invariant
        splits = [self._presplit(None if kv_begin is None else kv_begin[sl], kv_end[sl],
                                 fixed[sl], rate, self._tiling.min_tiles[kind_k],
                                 INVARIANT_SPLIT_TOKENS[kind_k] if invariant else None)
                  for kind_k, sl, rate in kinds]
        if not any(splits):  # (each is None or a tuple)
            # The pieces are the groups (g1 None: piece i is group i), with their KV ranges.
            nch_g = g1 = j1 = None
            s1 = np.zeros(n0, dtype=np.int64) if kv_begin is None else kv_begin
            e1, c1 = kv_end, np.empty(n0)
            for kind_k, sl, rate in kinds:
                b_k = None if kv_begin is None else kv_begin[sl]
                np.add(fixed[sl], self._span(kind_k, b_k, kv_end[sl]) * rate, out=c1[sl])
            n1p = n0p
        else:
            nch_g = np.ones(n0, dtype=np.int64)  # pieces per group
            cols = []  # per kind: group, index in group, kv start, kv end, cost
            for (kind_k, sl, rate), sp in zip(kinds, splits):
                e, f, g0 = kv_end[sl], fixed[sl], sl.start
                if sp is None:
                    z = np.zeros(e.size, dtype=np.int64)
                    b_k = z if kv_begin is None else kv_begin[sl]
                    cols.append((np.arange(g0, g0 + e.size), z, b_k, e,
                                 f + self._span(kind_k, b_k, e) * rate))
                else:
                    src, j, s, e2, nch = sp
                    nch_g[sl] = nch
                    cols.append((src + g0, j, s, e2,
                                 f[src] + self._span(kind_k, s, e2) * rate))
            n1p = cols[0][0].size if n0p else 0
            g1, j1, s1, e1, c1 = (np.concatenate(x) for x in zip(*cols)) if len(cols) == 2 \
                else cols[0]
        n1 = c1.size

        # ---- one stream, cut into the CTA lists ------------------------------------------
        # Merge the kinds by progress through their own kind (start / kind total): any
        # stretch of the stream then holds prefill and decode work in the batch's
        # proportion, interleaved. Cut the stream into `grid` runs of equal cost; the piece
        # under a boundary is split there at a KV tile when both sides keep >= min_chunk
        # of work, else it goes whole to the CTA holding its midpoint. So a CTA's load is
        # the mean +- about one KV tile plus an overhead.
        both = bool(n0p and n0d)
        if both:
            x = c1.cumsum()
            p_tot, total = float(x[n1p - 1]), float(x[-1])
            x -= c1  # each piece's start, then its progress through its kind
            x[:n1p] *= 1.0 / p_tot
            x[n1p:] -= p_tot
            x[n1p:] *= 1.0 / (total - p_tot)
            order = x.argsort(kind="stable")  # two sorted runs: a merge; prefill first at ties
            c = c1[order]
        else:
            order, c = None, c1
        cum = np.empty(n1 + 1)  # cost before each piece, and the total
        cum[0] = 0.0
        end = c.cumsum(out=cum[1:])
        bounds = self._bounds_unit * float(cum[-1])

        m = 0
        if n1:
            i = end.searchsorted(bounds, "right")  # the piece under each boundary
            if i.size and i[-1] >= n1:  # boundaries at the very end (rounding): none
                i = i[: i.searchsorted(n1)]
            ch = order[i] if both else i
            s_i, e_i, c_i = s1[ch], e1[ch], c[i]
            span_t = (e_i - s_i + (tn - 1)) // tn
            mt = self._tiling.mt[(ch >= n1p).view(np.int8)] if both else \
                self._tiling.mt[Kind.PREFILL if n0p else Kind.DECODE]
        # A cut must leave >= min_tiles on both sides: none when no piece under a boundary
        # has 2 * min_tiles (then skip the search).
        # A batch-invariant plan never cuts: a piece's KV range is the request's own.
        if n1 and not invariant and (span_t >= 2 * mt).any():
            start_i = end[i] - c_i
            k = np.rint((bounds[: i.size] - start_i) / c_i * span_t).astype(np.int64)
            # Boundaries closer than min_tiles under one piece (per-CTA load below
            # min_chunk): snap that piece's cuts to multiples of min_tiles and drop repeats,
            # so every part keeps >= min_tiles tiles (k ascends within a piece).
            ok = (k >= mt) & (k <= span_t - mt)
            if i.size > 1:
                same = i[1:] == i[:-1]
                mt1 = mt[1:] if both else mt
                close = same & (k[1:] - k[:-1] < mt1)
                if close.any():
                    snap = np.zeros(n1, dtype=bool)
                    snap[i[1:][close]] = True
                    sn = snap[i]
                    k[sn] = (k[sn] + mt // 2) // mt * mt if not both else \
                        (k[sn] + mt[sn] // 2) // mt[sn] * mt[sn]
                    ok = (k >= mt) & (k <= span_t - mt)
                    ok[1:] &= ~(same & (k[1:] == k[:-1]))
            m = np.count_nonzero(ok)

        if m:
            ci, ck, cspan = i[ok], k[ok], span_t[ok]
            npc = np.bincount(ci, minlength=n1)
            npc += 1
            src = np.arange(n1).repeat(npc)  # stream position of each part
            cut_pos = ci + np.arange(1, m + 1)  # the part that starts at each cut
            cut_kv = np.minimum(s_i[ok] + ck * tn, e_i[ok])
            cut_u = start_i[ok] + c_i[ok] * ck / cspan  # the cut in stream cost coordinates
            chunk = order[src] if both else src
        else:
            chunk = order  # None: identity
        if chunk is None:  # (g None: part i is group i)
            g, kv_s, kv_e, pc, n = g1, s1, e1, c1, n1
        else:
            kv_e, n = e1[chunk], chunk.size
            g, kv_s = (chunk if g1 is None else g1[chunk]), s1[chunk]
            pc = c[src] if m else c  # each part's cost, the piece's until fixed (below)
        kind = (chunk >= n1p) if both else None  # True: decode
        fix = None  # the parts next to a cut, whose costs are their own
        if m:
            u_hi = end[src]  # each part's span in stream cost coordinates
            u_lo = u_hi - pc
            u_lo[cut_pos] = cut_u
            u_hi[cut_pos - 1] = cut_u
            mid = 0.5 * (u_lo + u_hi)
            kv_s[cut_pos] = cut_kv
            kv_e[cut_pos - 1] = cut_kv
            fix = np.concatenate((cut_pos - 1, cut_pos))
        else:
            mid = end - 0.5 * c

        # ---- CTA lists: part midpoints (stream coordinates) against the boundaries -------
        ptr = np.empty(grid + 1, dtype=np.int64)
        ptr[0] = 0
        ptr[1:grid] = mid.searchsorted(bounds, "left")
        ptr[grid] = n

        # ---- split slots and merges: a group with >= 2 parts writes partials --------------
        # Its slots are contiguous: pre-split piece j takes local slot j, the part after
        # the r-th cut of the group takes (pieces of the group) + r.
        num_slots = num_merge = 0
        if m and nch_g is None:
            # Only the cut split groups, and a cut group's parts are adjacent: number the
            # parts next to a cut in stream order.
            split = np.zeros(n, dtype=bool)
            split[fix] = True
            at = split.nonzero()[0]
            num_slots = at.size
            slot = np.full(n, -1, dtype=np.int64)
            slot[at] = np.arange(num_slots)
            first_cut = np.concatenate(([True], ci[1:] != ci[:-1]))
            firsts = cut_pos[first_cut] - 1
            num_merge = firsts.size
            m_rows = g[firsts]
            m_first = slot[firsts]
            m_count = npc[ci[first_cut]]
        elif nch_g is not None:
            gcount = nch_g
            if m:
                gc = g[cut_pos]
                gcount = nch_g + np.bincount(gc, minlength=n0)
            m_rows = (gcount > 1).nonzero()[0]
            num_merge = m_rows.size
            m_count = gcount[m_rows]
            m_end = m_count.cumsum()
            num_slots = int(m_end[-1]) if num_merge else 0
            m_first = m_end - m_count
            # A part's slot = its group's first slot + its local slot; -1 (and local slot
            # 0) outside split groups.
            first_slot = np.full(n0, -1, dtype=np.int64)
            first_slot[m_rows] = m_first
            loc = j1[chunk] if chunk is not None else j1.copy()
            if m:
                o = gc.argsort(kind="stable")
                gs = gc[o]
                rank = np.empty(m, dtype=np.int64)
                rank[o] = np.arange(m) - gs.searchsorted(gs)
                loc[cut_pos] = nch_g[gc] + rank
            slot = first_slot[g] + loc
        cap = self.capacity
        if n > cap.items or num_merge > cap.merges or num_slots > cap.slots:
            if not invariant:
                raise AssertionError("podcute planner exceeded its capacity bound "
                                     f"({n}/{cap.items} items, {num_merge}/{cap.merges} "
                                     f"merges, {num_slots}/{cap.slots} slots)")
            # Fixed-size splits grow with the KV lengths, which no capacity bounds.
            self._grow_splits(n, num_merge, num_slots)

        # ---- write the metadata -------------------------------------------------------------
        hs = self._h
        wk = hs["work"][:n]
        if g is None:
            wk[:] = tmpl
        else:
            np.take(_rows(tmpl), g, out=_rows(wk))
        wk[:, WorkCol.KV_START] = kv_s
        wk[:, WorkCol.KV_END] = kv_e
        wk[:, WorkCol.SPLIT_SLOT] = slot if num_slots else -1
        swaps = None  # (rows, rows): list heads swapped with a later row of the other kind
        order = None  # where each row went when the lists were grouped by kind
        if both and self._group_kinds:
            order = self._group_lists(wk, ptr, kind)
        elif both:
            # Even lists start with prefill, odd ones with decode (when they hold both): swap
            # the first row with the first one of the wanted kind (all rows between are of
            # the other kind, so only that row moves within its kind's order).
            a, b = ptr[:-1], ptr[1:]
            ip, idd = (~kind).nonzero()[0], kind.nonzero()[0]
            f = np.where(self._odd, idd[np.minimum(idd.searchsorted(a), idd.size - 1)],
                         ip[np.minimum(ip.searchsorted(a), ip.size - 1)])
            moved = (f > a) & (f < b)
            if moved.any():
                swaps = a[moved], f[moved]
                rv = _rows(wk)
                rv[swaps[0]], rv[swaps[1]] = rv[swaps[1]], rv[swaps[0]].copy()
        if n0d:
            # A decode item's ordinal among its CTA list's decode items, above the kind
            # bit: the phase of the kernel's decode hand-over (metadata.KIND_BITS).
            kind_col = wk[:, WorkCol.KIND]
            dec = kind_col == Kind.DECODE
            before = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(dec, out=before[1:])
            ordinal = before[:-1] - np.repeat(before[ptr[:-1]], np.diff(ptr))
            kind_col[dec] |= (ordinal[dec] << KIND_BITS).astype(np.int32)
        if num_merge:
            mr = hs["merge"][:num_merge]
            mr[:, MergeCol.REQ: MergeCol.ROW_END + 1] = tmpl[m_rows, WorkCol.REQ: WorkCol.ROW_END + 1]
            mr[:, MergeCol.FIRST_SLOT] = m_first
            mr[:, MergeCol.NUM_SPLITS] = m_count
            hs["slot_merge"][:num_slots] = np.arange(num_merge).repeat(m_count)
        fixes = None if fix is None else (fix, fixed[g[fix]], kv_s[fix], kv_e[fix])
        return Layout(n, num_merge, num_slots, ptr, pc, kind, swaps, fixes, n0p, n0d,
                      preq.size, dreq.size, order)

    def _predicted_costs(self, pc, kind, ptr, swaps, n0p, fixes, rates, order=None):
        """(predicted time of each work row, of each CTA list, of each list's prefill
        rows). pc: each part's cost, its piece's for the parts next to a cut, which have
        their own: `fixes` = (those parts, their fixed costs, KV starts, KV ends), or None;
        kind: True for decode (None: all of one kind); swaps: the rows the list heads
        were swapped with; rates: the batch's prefill and decode cost per KV token."""
        r_p, r_d = rates
        if fixes is not None:
            fix, f, s, e = fixes
            pc = pc.copy()
            if kind is not None:
                dec_fix = kind[fix]
                span = np.where(dec_fix, self._span(Kind.DECODE, s, e),
                                self._span(Kind.PREFILL, s, e))
                rate = np.where(dec_fix, r_d, r_p)
            else:
                k_fix = Kind.PREFILL if n0p else Kind.DECODE
                span = self._span(k_fix, s, e)
                rate = r_p if n0p else r_d
            pc[fix] = f + span * rate
        cum = np.zeros(pc.size + 1)
        pc.cumsum(out=cum[1:])
        cta_cost = cum[ptr[1:]] - cum[ptr[:-1]]
        if kind is not None:
            (pc * ~kind).cumsum(out=cum[1:])
            p_cost = cum[ptr[1:]] - cum[ptr[:-1]]
        else:
            p_cost = cta_cost if n0p else cta_cost * 0
        item_cost = pc
        if swaps is not None:
            fa, ff = swaps
            item_cost = pc.copy()
            item_cost[fa], item_cost[ff] = pc[ff], pc[fa]
        if order is not None:  # (the lists grouped by kind: the same rows, moved)
            moved = np.empty_like(item_cost)
            moved[order] = item_cost
            item_cost = moved
        return item_cost, cta_cost, p_cost

    def _summary_values(self, counts, costs, kind, n, n0d):
        """PlanSummary's fields: `counts` plus the predictions from the per-CTA costs
        (all rows, prefill rows) and the rows' kinds (True: decode; None: all of one
        kind, decode if n0d)."""
        cta_cost, p_us = costs
        spm = self.config.kernel.ctas_per_sm
        per_sm = cta_cost.reshape(spm, -1).T
        p_sm = p_us.reshape(spm, -1).T
        mean = cta_cost.mean()
        n_d = int(kind.sum()) if kind is not None else (n if n0d else 0)
        # The HBM bound of the whole batch: every decode byte at the full-chip rate.
        d_total = (float((cta_cost - p_us).sum()) * self.cost.decode_sm_bandwidth
                   / self.cost.ref_num_sms)
        return dict(
            counts, num_prefill_items=n - n_d, num_decode_items=n_d,
            predicted_prefill_us=float(p_us.max()),
            predicted_decode_us=float((cta_cost - p_us).max()),
            predicted_us=float(max(per_sm.max(), p_sm.sum(1).max(),
                                   (per_sm - p_sm).sum(1).max(), d_total)),
            balance=float(cta_cost.max() / mean) if mean > 0 else 1.0)
