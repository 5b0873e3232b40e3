"""Epilogue of a work item: normalised O (and LSE) to `out`/`lse`, or fp32 partials of a
split to the plan's workspace. Used by prefill and decode items alike.

An MMA warpgroup holds its 64 rows of O as wgmma accumulator fragments: per thread 2
adjacent columns of 2 rows in every 8-column group, so a direct store writes 4 bytes
per row at a time. `store_rows` stages the tile through shared memory instead (4-byte
fragment stores, bank-conflict free with padded rows) and writes each row of `out` in
16-byte pieces, a warp covering whole 128-byte lines.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from podcute import layouts
from podcute.kernels.config import WARPGROUP_THREADS
from podcute.kernels.mma_utils import rows_cols_view

STORE_BYTES = 16


@cute.jit
def store_rows(acc_O: cute.Tensor, thr_mma: cute.ThrMma, sO: cute.Tensor, gO: cute.Tensor,
               row_base: Int32, n_valid: Int32, barrier_id: Int32,
               cols: cutlass.Constexpr[int] = 0):
    """Write this warpgroup's (64, D) fp32 tile `acc_O` (already normalised) to rows
    `row_base + r` (r < n_valid) of the packed-row view `gO`, through the warpgroup's
    own staging tile `sO` (64, D) in out's dtype. Every thread of the warpgroup calls
    it (barriers); `barrier_id` is the warpgroup's own named barrier. `cols`: out's
    columns where the tile is wider (KernelConfig.vo_io; 0: all)."""
    dtype = sO.element_type
    elem_bytes = dtype.width // 8
    rows, d = cute.size(sO, mode=[0]), cute.size(sO, mode=[1])
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    rO.store(acc_O.load().to(dtype))
    tOsO = thr_mma.partition_C(sO)
    # The previous readers of the staging tile (this warpgroup's threads) are done.
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
    cute.autovec_copy(rO, tOsO)
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
    chunk = STORE_BYTES // elem_bytes
    chunks_per_row = d // chunk
    rows_per_pass = WARPGROUP_THREADS // chunks_per_row
    # The thread's chunk, from its lane and its (uniform) warp, derived here rather than
    # passed in: values live from the kernel's start to its epilogue would be spilled.
    tidx = (cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4) * 32 + cute.arch.lane_idx()
    col = (tidx % chunks_per_row) * chunk
    row_stride = sO.layout.stride[0]
    s_base = sO.iterator.toint()
    # A rolled loop: one row's addresses live at a time (the MMA warpgroups run at their
    # register limit).
    live = Int32(1)
    if const_expr(0 < cols < d):
        live = Int32(col < cols)
    for r in cutlass.range(tidx // chunks_per_row, rows, rows_per_pass, unroll=1):
        if r < n_valid and live != 0:
            src = cute.make_tensor(
                cute.make_ptr(dtype, s_base + (r * row_stride + col) * elem_bytes,
                              cute.AddressSpace.smem, assumed_align=STORE_BYTES),
                cute.make_layout(chunk))
            # Row starts are 16-byte aligned (checked by the API); the DSL cannot see it
            # through the dynamic token and head strides.
            g_row = gO[row_base + r, None].iterator.toint()
            dst = cute.make_tensor(
                cute.make_ptr(dtype, g_row + Int64(col * elem_bytes), cute.AddressSpace.gmem,
                              assumed_align=STORE_BYTES),
                cute.make_layout(chunk))
            frag = cute.make_rmem_tensor(chunk, dtype)
            cute.autovec_copy(src, frag)
            cute.autovec_copy(frag, dst)


@cute.jit
def store_fragments(acc_O: cute.Tensor, tOcO: cute.Tensor, gO: cute.Tensor, row_base: Int32,
                    n_valid: Int32, cols: cutlass.Constexpr[int] = 0):
    """Write this warpgroup's (64, D) fp32 tile `acc_O` (already normalised) straight from
    its fragments, 2 adjacent columns (4 bytes) at a time: the epilogue of variants with
    no shared memory to stage through (head_dim 256). `cols`: as store_rows'."""
    dtype = gO.element_type
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    rO.store(acc_O.load().to(dtype))
    rO_mn = rows_cols_view(rO)
    tOcO_mn = rows_cols_view(tOcO)
    for r in cutlass.range_constexpr(cute.size(rO_mn, mode=[0])):
        row = tOcO_mn[r, 0][0]
        if row < n_valid:
            g_row = gO[row_base + row, None].iterator.toint()
            for c in cutlass.range_constexpr(0, cute.size(rO_mn, mode=[1]), 2):
                col = tOcO_mn[0, c][1]
                if const_expr(cols > 0):
                    if col < cols:
                        _store_pair(rO_mn, r, c, g_row, col, dtype)
                else:
                    _store_pair(rO_mn, r, c, g_row, col, dtype)


@cute.jit
def _store_pair(rO_mn: cute.Tensor, r: cutlass.Constexpr[int], c: cutlass.Constexpr[int],
                g_row, col, dtype):
    """Columns c, c + 1 of fragment row r to out's row at `g_row`, column `col`."""
    # (rows are 16-byte aligned, checked by the API; the pair at an even column)
    dst = cute.make_tensor(
        cute.make_ptr(dtype, g_row + Int64(col * (dtype.width // 8)),
                      cute.AddressSpace.gmem, assumed_align=4),
        cute.make_layout(2))
    pair = cute.make_rmem_tensor(2, dtype)
    pair[0] = rO_mn[r, c]
    pair[1] = rO_mn[r, c + 1]
    cute.autovec_copy(pair, dst)


@cute.jit
def store_lse(lse: cute.Tensor, tOcO: cute.Tensor, gLSE: cute.Tensor, row_base: Int32,
              n_valid: Int32, tidx: Int32):
    """LSE of this thread's rows (one thread of each row's quad writes it)."""
    tOcO_mn = rows_cols_view(tOcO)
    if tidx % 4 == 0:
        for r in cutlass.range_constexpr(cute.size(tOcO_mn, mode=[0])):
            row = tOcO_mn[r, 0][0]
            if row < n_valid:
                gLSE[row_base + row] = lse[r]


@cute.jit
def store_partial(acc_O: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor,
                  mPartialO: cute.Tensor, mPartialLSE: cute.Tensor, slot: Int32,
                  row_offset: Int32, n_rows: Int32, tidx: Int32, dest_row=0):
    """fp32 partial O and LSE of a split piece: tile row `row_offset + r` goes to row
    `dest_row + row_offset + r` of split slot `slot` (rows below `n_rows`, the item's;
    `dest_row`: a sharer's own piece's row in its packed slot, planning/sharing.py)."""
    tOcO_mn = rows_cols_view(tOcO)
    acc_O_mn = rows_cols_view(acc_O)
    gO = layouts.partial_rows(mPartialO, slot)
    gLSE = layouts.partial_lse(mPartialLSE, slot)
    for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
        row = row_offset + tOcO_mn[r, 0][0]
        if row < n_rows:
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                gO[dest_row + row, tOcO_mn[0, c][1]] = acc_O_mn[r, c]
            if tidx % 4 == 0:
                gLSE[dest_row + row] = lse[r]


def staging_tile(base_ptr: cute.Pointer, dtype, rows: int, head_dim: int, row_elems: int):
    """(rows, head_dim) tile in `dtype` at shared-memory `base_ptr`, rows `row_elems` apart."""
    ptr = cute.recast_ptr(base_ptr, dtype=dtype)
    return cute.make_tensor(ptr, cute.make_layout((rows, head_dim), stride=(row_elems, 1)))

