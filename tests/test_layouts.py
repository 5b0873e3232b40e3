"""CPU tests of podcute.layouts: every offset a layout produces is checked against torch.

Technique: the data tensors are views of an int32 (float32 for lse) storage whose
element values equal their own flat storage offsets. A host-side ``@cute.jit``
function (compiled once per static configuration with ``cute.compile``, layouts marked
dynamic so random shapes/strides reuse it) walks the views and stores what each
coordinate addresses into an output tensor; torch indexing of the same views gives
the expected offsets. Host jit code can load and store host memory directly.
For strides beyond 2**31 elements, views over a tiny numpy buffer (never
dereferenced) are compared by pointer arithmetic (``iterator.toint()``).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import numpy as np
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, const_expr  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from podcute.layouts import (  # noqa: E402
    PageShift,
    canonical_kv,
    kv_locate,
    kv_row,
    kv_row_at,
    kv_row_clamped,
    kv_tma_view,
    packed_coord,
    packed_lse,
    packed_rows,
    partial_lse,
    partial_rows,
)

TILE_N = 32  # tile of the clamped-gather check (kv_start is a multiple of it)


def dyn(t):
    """cute tensor with a dynamic layout (last dim contiguous), so one compile serves all."""
    return from_dlpack(t).mark_layout_dynamic(leading_dim=t.dim() - 1)


_compiled = {}


def compiled(fn, key, *args):
    """cute.compile(fn, *args) once per (fn, static key); args must carry the Constexprs."""
    k = (fn.__name__,) + key
    if k not in _compiled:
        _compiled[k] = cute.compile(fn, *args)
    return _compiled[k]


# ---------------------------------------------------------------------------------------
# paged KV
# ---------------------------------------------------------------------------------------


@cute.jit
def _gather_kv(mK: cute.Tensor, mV: cute.Tensor, page_list: cute.Tensor,
               page_starts: cute.Tensor, kv_lens: cute.Tensor, out_starts: cute.Tensor,
               tile_out_starts: cute.Tensor, outK: cute.Tensor, outV: cute.Tensor,
               outKc: cute.Tensor, outVc: cute.Tensor, ps_dyn: Int32,
               kv_layout: cutlass.Constexpr, ps_mode: cutlass.Constexpr,
               ps_static: cutlass.Constexpr):
    kc = canonical_kv(mK, kv_layout)
    vc = canonical_kv(mV, kv_layout)
    if const_expr(ps_mode == "static"):
        ps = ps_static
    elif const_expr(ps_mode == "int32"):
        ps = ps_dyn
    elif const_expr(ps_mode == "shift"):
        ps = PageShift(ps_dyn)
    else:
        ps = cute.fast_divmod_create_divisor_v2(ps_dyn)
    H = kc.shape[2]
    D = kc.shape[3]
    for b in cutlass.range(page_starts.shape[0]):
        n = kv_lens[b]
        p0 = page_starts[b]
        o0 = out_starts[b]
        for t in cutlass.range(n):
            page, slot = kv_locate(page_list, p0, t, ps)
            for h in cutlass.range(H):
                rk = kv_row(kc, page_list, p0, t, h, ps)
                rv = kv_row_at(vc, page, slot, h)
                for d in cutlass.range(D):
                    outK[o0 + t, h, d] = rk[d]
                    outV[o0 + t, h, d] = rv[d]
        c0 = tile_out_starts[b]
        for i in cutlass.range((n + TILE_N - 1) // TILE_N * TILE_N):
            tile = i // TILE_N * TILE_N
            row = i % TILE_N
            for h in cutlass.range(H):
                rk = kv_row_clamped(kc, page_list, p0, tile, row, n, h, ps)
                rv = kv_row_clamped(vc, page_list, p0, tile, row, n, h, ps)
                for d in cutlass.range(D):
                    outKc[c0 + i, h, d] = rk[d]
                    outVc[c0 + i, h, d] = rv[d]


@cute.jit
def _dump_kv_views(mKV: cute.Tensor, out_canon: cute.Tensor, out_tma: cute.Tensor,
                   kv_layout: cutlass.Constexpr):
    c = canonical_kv(mKV, kv_layout)
    t = kv_tma_view(c)
    for p in cutlass.range(c.shape[0]):
        for s in cutlass.range(c.shape[1]):
            for h in cutlass.range(c.shape[2]):
                for d in cutlass.range(c.shape[3]):
                    out_canon[p, s, h, d] = c[p, s, h, d]
                    out_tma[s, d, h, p] = t[s, d, h, p]


def _make_cache(rng, num_pages, page_size, H, D, kv_layout, storage):
    """(K, V) int32 views whose values are their storage offsets; random padding in
    every dim gives random strides. storage: separate | interleaved ([P, 2, ...]) |
    split ([2, P, ...])."""
    per_page = [page_size, H] if kv_layout == "NHD" else [H, page_size]
    shape = [num_pages] + per_page + [D]
    pad = [int(rng.integers(0, 3)) for _ in shape]
    big = [s + p for s, p in zip(shape, pad)]
    idx = tuple(slice(0, s) for s in shape)

    def arange(shp, start=0):
        n = int(np.prod(shp))
        return torch.arange(start, start + n, dtype=torch.int32).view(*shp)

    if storage == "separate":
        k = arange(big)[idx]
        v = arange(big, start=int(np.prod(big)) + 7)[idx]
        return k, v
    if storage == "interleaved":
        x = arange([big[0], 2] + big[1:])
        return x[:, 0][idx], x[:, 1][idx]
    x = arange([2] + big)
    return x[0][idx], x[1][idx]


def _page_lists(rng, kv_lens, page_size, num_pages, fmt):
    """(flat page list, page_starts) of a random block table or CSR over permuted pages."""
    npg = [-(-n // page_size) for n in kv_lens]
    perm = rng.permutation(num_pages)
    pages, off = [], 0
    for k in npg:
        pages.append(perm[off:off + k])
        off += k
    if fmt == "csr":
        indptr = np.concatenate([[0], np.cumsum(npg)]).astype(np.int64)
        flat = np.concatenate(pages + [rng.integers(0, num_pages, 3)])  # trailing junk
        return torch.tensor(flat, dtype=torch.int32), indptr[:-1].tolist()
    # block table [B, max_pages], a column slice of a wider table, unused entries junk
    # (valid page ids, so a wrong read gives a wrong value rather than a crash)
    width = max(npg) + int(rng.integers(0, 4))
    bt = torch.tensor(rng.integers(0, num_pages, (len(kv_lens), width)), dtype=torch.int32)
    for b, p in enumerate(pages):
        bt[b, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return bt.reshape(-1), [b * width for b in range(len(kv_lens))]


def _ref_gather(canon, page_list, p0, tokens, page_size):
    pages = page_list[p0 + tokens // page_size].long()
    return canon[pages, tokens % page_size]


def _canon_torch(t, kv_layout):
    return t if kv_layout == "NHD" else t.permute(0, 2, 1, 3)


PAGE_SIZES = [1, 16, 64, 12]


def _check_gather(seed, kv_layout, page_size, ps_mode, storage, fmt, static_layout=False):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 5))
    H = int(rng.integers(1, 4))
    D = int(rng.choice([4, 8]))
    max_len = 3 * page_size + 40
    kv_lens = [int(rng.integers(1, max_len)) for _ in range(B)]
    if B > 1:
        kv_lens[int(rng.integers(0, B))] = 0  # an empty request is legal
    if rng.integers(0, 2):
        kv_lens[0] = page_size * int(rng.integers(1, 3))  # ends exactly on a page
    need = sum(-(-n // page_size) for n in kv_lens)
    num_pages = need + int(rng.integers(1, 6))
    K, V = _make_cache(rng, num_pages, page_size, H, D, kv_layout, storage)
    page_list, page_starts = _page_lists(rng, kv_lens, page_size, num_pages, fmt)

    tiles = [-(-n // TILE_N) * TILE_N for n in kv_lens]
    out_starts = np.concatenate([[0], np.cumsum(kv_lens)]).tolist()
    tile_starts = np.concatenate([[0], np.cumsum(tiles)]).tolist()
    outs = [torch.full((max(out_starts[-1], 1), H, D), -1, dtype=torch.int32) for _ in range(2)]
    outs += [torch.full((max(tile_starts[-1], 1), H, D), -1, dtype=torch.int32) for _ in range(2)]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    meta = [i32(page_starts), i32(kv_lens), i32(out_starts[:-1]), i32(tile_starts[:-1])]
    ps_static = page_size if ps_mode == "static" else 0
    consts = (kv_layout, ps_mode, ps_static)
    ps_arg = page_size.bit_length() - 1 if ps_mode == "shift" else page_size
    if static_layout:  # layouts fully static (plain from_dlpack): compiled per shape
        args = [from_dlpack(x) for x in [K, V, page_list] + meta + outs]
        _gather_kv(*args, ps_arg, *consts)
    else:
        args = [dyn(x) for x in [K, V, page_list] + meta + outs]
        fn = compiled(_gather_kv, consts, *args, ps_arg, *consts)
        fn(*args, ps_arg)

    Kc, Vc = _canon_torch(K, kv_layout), _canon_torch(V, kv_layout)
    for b, n in enumerate(kv_lens):
        tok = torch.arange(n)
        o0, c0 = out_starts[b], tile_starts[b]
        for out, cache in ((outs[0], Kc), (outs[1], Vc)):
            torch.testing.assert_close(out[o0:o0 + n], _ref_gather(cache, page_list, page_starts[b], tok, page_size), rtol=0, atol=0)
        ctok = torch.clamp(torch.arange(tiles[b]), max=n - 1)
        for out, cache in ((outs[2], Kc), (outs[3], Vc)):
            torch.testing.assert_close(out[c0:c0 + tiles[b]], _ref_gather(cache, page_list, page_starts[b], ctok, page_size), rtol=0, atol=0)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_gather_static_page_size(kv_layout, page_size):
    i = 0
    for storage in ("separate", "interleaved", "split"):
        for fmt in ("block_table", "csr"):
            for _ in range(2):
                i += 1
                _check_gather(1000 * page_size + i + (kv_layout == "HND") * 7, kv_layout,
                              page_size, "static", storage, fmt)


@pytest.mark.parametrize("ps_mode", ["int32", "fastdivmod", "shift"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_kv_gather_runtime_page_size(kv_layout, ps_mode):
    for i, page_size in enumerate(PAGE_SIZES + [3, 32]):
        if ps_mode == "shift" and page_size & (page_size - 1):
            continue  # PageShift is for powers of two (every page size the kernel takes)
        for storage, fmt in (("interleaved", "csr"), ("separate", "block_table")):
            _check_gather(77 + i, kv_layout, page_size, ps_mode, storage, fmt)


def test_kv_gather_static_layout():
    _check_gather(5, "HND", 16, "static", "interleaved", "block_table", static_layout=True)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_kv_canonical_and_tma_views(kv_layout):
    rng = np.random.default_rng(3)
    for storage in ("separate", "interleaved", "split"):
        for page_size in (1, 16):
            P, H, D = int(rng.integers(1, 5)), int(rng.integers(1, 4)), 8
            K, V = _make_cache(rng, P, page_size, H, D, kv_layout, storage)
            for x in (K, V):
                canon = _canon_torch(x, kv_layout)
                out_c = torch.full(canon.shape, -1, dtype=torch.int32)
                out_t = torch.full(canon.permute(1, 3, 2, 0).shape, -1, dtype=torch.int32)
                args = [dyn(x), dyn(out_c), dyn(out_t)]
                compiled(_dump_kv_views, (kv_layout,), *args, kv_layout)(*args)
                torch.testing.assert_close(out_c, canon, rtol=0, atol=0)
                torch.testing.assert_close(out_t, canon.permute(1, 3, 2, 0), rtol=0, atol=0)


def test_canonical_kv_rejects_unknown_layout():
    @cute.jit
    def bad(mKV: cute.Tensor):
        canonical_kv(mKV, "NDH")

    with pytest.raises(Exception, match="kv_layout"):
        bad(from_dlpack(torch.zeros(2, 2, 2, 2, dtype=torch.int32)))


# ---------------------------------------------------------------------------------------
# Int64 strides: a pool above 2**31 elements (views of a tiny buffer, never dereferenced)
# ---------------------------------------------------------------------------------------


@cute.jit
def _offsets64(mKV: cute.Tensor, mQ: cute.Tensor, page_list: cute.Tensor,
               queries: cute.Tensor, out: cute.Tensor, kv_layout: cutlass.Constexpr,
               page_size: cutlass.Constexpr, group: cutlass.Constexpr):
    c = canonical_kv(mKV, kv_layout)
    base = c.iterator.toint()
    for i in cutlass.range(queries.shape[0]):
        p0 = queries[i, 0]
        tok = queries[i, 1]
        h = queries[i, 2]
        out[i, 0] = kv_row(c, page_list, p0, tok, h, page_size).iterator.toint() - base
        out[i, 1] = kv_row_clamped(c, page_list, p0, 0, tok, 5, h, page_size).iterator.toint() - base
        x = packed_rows(mQ, tok, 3, h, group)
        out[i, 2] = x[group + 1, None].iterator.toint() - mQ.iterator.toint()
        out[i, 3] = kv_tma_view(c)[1, None, h, p0].iterator.toint() - base


def _huge(shape, strides_elems):
    buf = np.zeros(64, dtype=np.int16)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=[2 * s for s in strides_elems])


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_int64_strides(kv_layout):
    P, ps, H, D = 3000, 16, 8, 128
    s_page = (1 << 31) + 4096  # page stride alone beyond 2**31 elements
    per_page = [ps, H] if kv_layout == "NHD" else [H, ps]
    inner = [per_page[1] * D, D]
    kv = _huge([P] + per_page + [D], [s_page] + inner + [1])
    sq_tok, sq_head = (1 << 32) + 256, 256
    q = _huge([10, 32, D], [sq_tok, sq_head, 1])
    group = 4
    page_list = torch.tensor([2999, 1234, 7, 2048], dtype=torch.int32)
    queries = torch.tensor([[0, 17, 5], [2, 31, 7], [1, 0, 0], [0, 3, 1]], dtype=torch.int32)
    out = torch.zeros(len(queries), 4, dtype=torch.int64)
    args = [from_dlpack(kv).mark_layout_dynamic(leading_dim=3),
            from_dlpack(q).mark_layout_dynamic(leading_dim=2),
            dyn(page_list), dyn(queries), dyn(out)]
    fn = compiled(_offsets64, (kv_layout,), *args, kv_layout, ps, group)
    fn(*args)
    s_slot, s_head = (inner[0], inner[1]) if kv_layout == "NHD" else (inner[1], inner[0])
    for i, (p0, tok, h) in enumerate(queries.tolist()):
        def off(t):
            return 2 * (int(page_list[p0 + t // ps]) * s_page + (t % ps) * s_slot + h * s_head)
        assert out[i, 0].item() == off(tok)
        assert out[i, 1].item() == off(min(tok, 4))
        # packed row group+1 = (token 1, head 1 of the group)
        assert out[i, 2].item() == 2 * ((tok + 1) * sq_tok + (h * group + 1) * sq_head)
        assert out[i, 3].item() == 2 * (p0 * s_page + 1 * s_slot + h * s_head)


# ---------------------------------------------------------------------------------------
# ragged q / out / lse, GQA packing
# ---------------------------------------------------------------------------------------


@cute.jit
def _dump_packed(mQ: cute.Tensor, mLSE: cute.Tensor, cu_q: cute.Tensor, out: cute.Tensor,
                 out2: cute.Tensor, out_lse: cute.Tensor, out_coord: cute.Tensor,
                 group: cutlass.Constexpr):
    hkv = mQ.shape[1] // group
    D = mQ.shape[2]
    for b in cutlass.range(cu_q.shape[0] - 1):
        t0 = cu_q[b]
        n = cu_q[b + 1] - t0
        for h in cutlass.range(hkv):
            x = packed_rows(mQ, t0, n, h, group)
            lse = packed_lse(mLSE, t0, n, h, group)
            for r in cutlass.range(cute.size(x, mode=[0])):
                o = (t0 - cu_q[0]) * group + r
                row = x[r, None]
                for d in cutlass.range(D):
                    out[h, o, d] = row[d]
                    out2[h, o, d] = x[r, d]
                out_lse[h, o] = lse[r]
                tok, hg = packed_coord(r, group)
                out_coord[h, o, 0] = tok
                out_coord[h, o, 1] = hg


GROUPS = [1, 4, 7, 8, 32]


@pytest.mark.parametrize("group", GROUPS)
def test_packed_rows_and_lse(group):
    rng = np.random.default_rng(group)
    for trial in range(4):
        hkv = int(rng.integers(1, 4)) if group < 32 else int(rng.integers(1, 3))
        hq, D = hkv * group, int(rng.choice([4, 8]))
        B = int(rng.integers(1, 5))
        q_lens = [int(rng.choice([0, 1, 1, 2, rng.integers(1, 20)])) for _ in range(B)]
        lead, tail = int(rng.integers(0, 4)), int(rng.integers(0, 3))
        total = lead + sum(q_lens) + tail
        cu = np.concatenate([[lead], lead + np.cumsum(q_lens)]).tolist()
        # q as a slice of a fused QKV projection output, head dim padded: strided tokens
        # and heads, contiguous last dim
        width = hq + 2 * hkv + int(rng.integers(0, 2))
        dpad = D + int(rng.integers(0, 3))
        qkv = torch.arange(total * width * dpad, dtype=torch.int32).view(total, width, dpad)
        q = qkv[:, :hq, :D]
        lse_pad = hq + int(rng.integers(0, 3))
        lse = torch.arange(total * lse_pad, dtype=torch.float32).view(total, lse_pad)[:, :hq]
        rows = sum(q_lens) * group
        out = torch.full((hkv, max(rows, 1), D), -1, dtype=torch.int32)
        out2 = out.clone()
        out_lse = torch.full((hkv, max(rows, 1)), -1.0, dtype=torch.float32)
        out_coord = torch.full((hkv, max(rows, 1), 2), -1, dtype=torch.int32)
        args = [dyn(q), dyn(lse), dyn(torch.tensor(cu, dtype=torch.int32)), dyn(out),
                dyn(out2), dyn(out_lse), dyn(out_coord)]
        compiled(_dump_packed, (group,), *args, group)(*args)

        qs = q[lead:lead + sum(q_lens)]
        ls = lse[lead:lead + sum(q_lens)]
        tok_of_row = torch.cat([torch.arange(n).repeat_interleave(group) for n in q_lens] + [torch.zeros(0, dtype=torch.long)])
        for h in range(hkv):
            # packed row = (token, head in group), head fastest
            ref = qs[:, h * group:(h + 1) * group, :].reshape(-1, D)
            torch.testing.assert_close(out[h, :rows], ref, rtol=0, atol=0)
            torch.testing.assert_close(out2[h, :rows], ref, rtol=0, atol=0)
            torch.testing.assert_close(out_lse[h, :rows], ls[:, h * group:(h + 1) * group].reshape(-1), rtol=0, atol=0)
            assert torch.equal(out_coord[h, :rows, 0].long(), tok_of_row)
            assert torch.equal(out_coord[h, :rows, 1].long(), torch.arange(rows) % group)


@cute.jit
def _dump_partial(mPO: cute.Tensor, mPL: cute.Tensor, outO: cute.Tensor, outL: cute.Tensor):
    for s in cutlass.range(mPO.shape[0]):
        po = partial_rows(mPO, s)
        pl = partial_lse(mPL, s)
        for i in cutlass.range(po.shape[0]):
            outL[s, i] = pl[i]
            for d in cutlass.range(po.shape[1]):
                outO[s, i, d] = po[i, d]


def test_partial_views():
    slots, tile_m, D = 5, 16, 8
    po = torch.arange(slots * tile_m * (D + 4), dtype=torch.float32).view(slots, tile_m, D + 4)[:, :, :D]
    pl = torch.arange(slots * (tile_m + 3), dtype=torch.float32).view(slots, tile_m + 3)[:, :tile_m]
    outO, outL = torch.zeros(slots, tile_m, D), torch.zeros(slots, tile_m)
    args = [dyn(po), dyn(pl), dyn(outO), dyn(outL)]
    compiled(_dump_partial, (), *args)(*args)
    torch.testing.assert_close(outO, po, rtol=0, atol=0)
    torch.testing.assert_close(outL, pl, rtol=0, atol=0)
