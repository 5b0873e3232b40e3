"""fp8 decode items on warp-level tensor cores, K and V converted in registers.

A decode item reads each K/V byte once and does little math with it: HBM is its limit.
The wgmma path needs 16-bit operands in shared memory, so an fp8 tile would cross shared
memory three more times (read by a converting warp, written as 16 bits, read by wgmma)
and cost ~6 converting instructions a value: that, not HBM, bounded fp8 decode
(docs/notes/fp8.md). Here each MMA warp reads its 16 KV rows of a staged fp8 tile
straight into registers with 16-byte loads, converts them there (e4m3: one `cvt` a pair;
e5m2: one byte move) and feeds `mma.sync.m16n8k16` (fp16 operands, fp32 accumulators),
whose operands both come from registers. An item's packed rows (its GQA group x q_len,
at most `ITEM_ROWS`) are the M of both GEMMs, rows 0-7 of the m16 (rows 8-15 are zero
in Q: the 16 Q registers they would take are what keeps the MMA warps' 192 registers
from spilling); each warp keeps its own online softmax over its `WARP_KV_ROWS` rows of
every tile it takes, and the kernel folds the warps together at the end.

Fragment orders (lane = 4 c + q; mma.sync's A/B/C fragments as in the PTX ISA):
  * S = Q K^T, K the B operand (N: this warp's 16 KV rows as two n8 tiles, row 8 t + c of
    tile t; K: D in 8 k16 steps). The contraction order is permuted: step s's pair
    positions (2q, 2q + 1 | 2q + 8, 2q + 9) are columns 32 q + 4 s + (0, 1 | 2, 3), so a
    thread's K values are the 32 contiguous bytes [32 q, 32 q + 32) of its row (two
    16-byte loads; one word a step). Q, the A operand (row c of the m16; row c + 8 is
    zero), is read once per item in the same order.
  * O += P V, V the B operand (K: the 16 KV rows, one k16 step; N: D as 16 n8 tiles).
    n8 tile j's column n is d = 16 n + j, so thread (c, q) needs bytes [16 c, 16 c + 16)
    of its 4 KV rows 2q, 2q + 1, 2q + 8, 2q + 9: one 16-byte load each, and one
    `byte_perm` pairs two rows' bytes for two registers. O's accumulator then holds, per
    thread and row (c; c + 8 holds nothing), the 32 contiguous columns [32 q, 32 q + 32)
    (16-byte stores).
  * Bank conflicts: the staging is 128-byte swizzled (chunk k of row r at k ^ r % 8); a
    quarter warp's 8 loads then hit 8 distinct chunks, for K (rows c, chunks 2q + h) and
    for V (rows 2q (+ 1), chunk c) alike.
  * bf16 queries: the GEMMs run in fp16 all the same, Q scaled into fp16's range by a
    power of two from the item's largest |q| (`dequant.fp16_range_scale`: exact), 2^e
    folded into the score scale. P is fp16 (finer than bf16 on [0, 1]).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warp

from podcute.kernels.dequant import (byte_perm, finite_abs_max, fp16_range_scale,
                                     fp8_pair_to_f16x2)
from podcute.kernels.dtypes import DTYPES

ITEM_ROWS = 8  # packed rows of an item on this path: rows 0-7 of the m16 MMAs
WARP_KV_ROWS = 16  # KV rows a warp takes of a tile (the k16 of P V)
HEAD_DIM = 128  # the fragment orders above are for D 128 (8 k16 steps, 16 n8 tiles)
# byte_perm selectors pairing byte b of word a with byte b of word b: bytes 0, 1 (the
# pairs of n8 tiles 4i, 4i + 1) and bytes 2, 3 (tiles 4i + 2, 4i + 3).
_PAIR_BYTES_01, _PAIR_BYTES_23 = 0x5140, 0x7362


@cute.jit
def _load16(base: Int32, offset: Int32, dst: cute.Tensor):
    """4 words from shared-memory byte address base + offset (16-byte aligned) into dst."""
    src = cute.make_tensor(
        cute.make_ptr(Int32, base + offset, cute.AddressSpace.smem, assumed_align=16),
        cute.make_layout(4))
    cute.autovec_copy(src, dst)


@dataclass(frozen=True)
class Fp8WarpDecode:
    """One MMA warp's share of an fp8 decode item (the orders in the module docstring)."""

    kv_dtype: cutlass.Constexpr[str]  # "float8_e4m3fn" / "float8_e5m2"
    dtype: cutlass.Constexpr[str]  # q's: "bfloat16" / "float16"

    @staticmethod
    def tiled_mma() -> cute.TiledMma:
        """One warp's m16n8k16 MMA, fp16 operands and fp32 accumulators."""
        return cute.make_tiled_mma(warp.MmaF16BF16Op(Float16, Float32, (16, 8, 16)))

    @staticmethod
    def acc_o_layout() -> cute.Layout:
        """O's accumulator (16 x D): ((2 cols, 2 rows), 1, 16 n8 tiles)."""
        return cute.make_layout(((2, 2), 1, HEAD_DIM // 8), stride=((1, 2), 0, 4))

    @cute.jit
    def load_q(self, sQ: cute.Tensor, lane: Int32):
        """Q's A fragments for this thread (row c, columns [32 q, 32 q + 32), fp16; row
        c + 8 zero) from the item's rows in sQ, and 2^e, the factor its scores need (1
        for fp16 queries). bf16 queries are read twice (their largest |q|, then the scaled
        conversion), 8 values at a time: nothing but the fragments stays live."""
        c, q = lane // 4, lane % 4
        cols = HEAD_DIM // 4
        qdt = DTYPES[self.dtype]
        rf = cute.make_rmem_tensor((cols, 2), Float16)
        rf[None, 1].fill(0.0)
        up = Float32(1.0)
        down = Float32(1.0)
        if const_expr(self.dtype == "bfloat16"):
            amax = Float32(0.0)
            for k in cutlass.range_constexpr(cols // 8):
                chunk = self._q_chunk(sQ, c, q, k)
                amax = cutlass.max(amax, finite_abs_max(chunk.load().to(Float32)))
            up, down = fp16_range_scale(cute.arch.warp_reduction_max(amax, threads_in_group=32))
        for k in cutlass.range_constexpr(cols // 8):
            chunk = self._q_chunk(sQ, c, q, k)
            dst = cute.local_tile(rf[None, 0], (8,), (k,))
            if const_expr(self.dtype == "bfloat16"):
                dst.store((chunk.load().to(Float32) * down).to(Float16))
            else:
                dst.store(chunk.load())
        # (pair position, row +8, pair +2 | step): column 4 s + 2 v2 + v0 of row v1
        tSrQ = cute.make_tensor(rf.iterator, cute.make_layout(
            ((2, 2, 2), 1, HEAD_DIM // 16), stride=((1, cols, 2), 0, 4)))
        return tSrQ, up

    @cute.jit
    def _q_chunk(self, sQ: cute.Tensor, c: Int32, q: Int32, k: int) -> cute.Tensor:
        """Columns [32 q + 8 k, + 8) of row c of sQ, into registers. sQ is the 16-bit tile
        of `smem.tile_smem_layout` (128-byte swizzle atoms of 64 columns, a column block
        after all rows; 1024-byte aligned): the address by hand, one 16-byte load (the
        DSL's own indexing of the swizzled tile cost the MMA warps two registers)."""
        col = 32 * q + 8 * k
        block_bytes = cute.size(sQ, mode=[0]) * 128
        offset = (col // 64 * block_bytes + c * 128
                  + ((col % 64 // 8) ^ (c % 8)) * 16)
        words = cute.make_rmem_tensor(4, Int32)
        _load16(sQ.iterator.toint(), offset, words)
        return cute.recast_tensor(words, DTYPES[self.dtype])

    @cute.jit
    def scores(self, tiled_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor,
               stage_base: Int32, row0: Int32, lane: Int32):
        """acc_S = Q K^T over KV rows [row0, row0 + 16) of the staged K tile at
        shared-memory address stage_base (128-byte rows, swizzled). One n8 tile at a
        time: its 8 words, 16 fragment registers, 8 MMAs (what is live stays small)."""
        c, q = lane // 4, lane % 4
        steps = HEAD_DIM // 16
        acc_S.fill(0.0)
        for t in cutlass.range_constexpr(2):
            row = row0 + 8 * t + c
            words = cute.make_rmem_tensor(steps, Int32)
            for h in cutlass.range_constexpr(2):
                _load16(stage_base, row * HEAD_DIM + ((2 * q + h) ^ (row % 8)) * 16,
                        cute.local_tile(words, (4,), (h,)))
            # B fragment registers: 2 s + h = pair h of step s (column 32 q + 4 s + 2 h)
            rk = cute.make_rmem_tensor(2 * steps, Int32)
            for s in cutlass.range_constexpr(steps):
                rk[2 * s] = fp8_pair_to_f16x2(words[s], False, self.kv_dtype)
                rk[2 * s + 1] = fp8_pair_to_f16x2(words[s], True, self.kv_dtype)
            tSrK = cute.make_tensor(cute.recast_tensor(rk, Float16).iterator, cute.make_layout(
                ((2, 2), 1, steps), stride=((1, 2), 0, 4)))
            acc_t = cute.make_tensor(acc_S.iterator + 4 * t, cute.make_layout(
                ((2, 2), 1, 1), stride=((1, 2), 0, 0)))
            cute.gemm(tiled_mma, acc_t, tSrQ, tSrK, acc_t)

    @cute.jit
    def accumulate(self, tiled_mma: cute.TiledMma, acc_O: cute.Tensor, tOrP: cute.Tensor,
                   stage_base: Int32, row0: Int32, valid: Int32, lane: Int32):
        """acc_O += P V over V rows [row0, row0 + 16) of the staged V tile at stage_base;
        rows >= valid (slots past the item's keys, which may hold NaN: P = 0 times NaN
        is NaN) count as zeros. Four n8 tiles at a time (one word of each row)."""
        c, q = lane // 4, lane % 4
        words = cute.make_rmem_tensor((4, 4), Int32)  # (word, row 2q | 2q+1 | 2q+8 | 2q+9)
        for r in cutlass.range_constexpr(4):
            row = row0 + 2 * q + r % 2 + 8 * (r // 2)
            _load16(stage_base, row * HEAD_DIM + (c ^ (row % 8)) * 16, words[None, r])
            if row >= valid:
                words[None, r].fill(0)
        for i in cutlass.range_constexpr(4):
            # B fragment registers: 2 j + h (n8 tile 4 i + j, column 16 c + 4 i + j) =
            # rows (2q, 2q + 1) (h 0) or (2q + 8, 2q + 9) (h 1)
            rv = cute.make_rmem_tensor(8, Int32)
            for h in cutlass.range_constexpr(2):
                for sel, j in ((_PAIR_BYTES_01, 0), (_PAIR_BYTES_23, 2)):
                    pairs = byte_perm(words[i, 2 * h], words[i, 2 * h + 1], sel)
                    rv[2 * j + h] = fp8_pair_to_f16x2(pairs, False, self.kv_dtype)
                    rv[2 * (j + 1) + h] = fp8_pair_to_f16x2(pairs, True, self.kv_dtype)
            tOrV = cute.make_tensor(cute.recast_tensor(rv, Float16).iterator, cute.make_layout(
                ((2, 2), 4, 1), stride=((1, 2), 4, 0)))
            acc_i = cute.make_tensor(acc_O.iterator + 16 * i, cute.make_layout(
                ((2, 2), 1, 4), stride=((1, 2), 0, 4)))
            cute.gemm(tiled_mma, acc_i, tOrP, tOrV, acc_i)

    @cute.jit
    def store_o(self, acc_O: cute.Tensor, gO: cute.Tensor, row_base: Int32, n_valid: Int32,
                lane: Int32):
        """This warp's normalised O: thread (c, q)'s row c, columns [32 q, 32 q + 32), to
        row row_base + c (if c < n_valid) of gO (out's packed rows, or a split slot's fp32
        partial rows), 16 bytes a store."""
        c, q = lane // 4, lane % 4
        dtype = gO.element_type
        elem_bytes = dtype.width // 8
        chunk = 16 // elem_bytes
        cols = HEAD_DIM // 4
        for h in cutlass.range_constexpr(1):  # (row c + 8 holds no row of the item)
            r = c + 8 * h
            if r < n_valid:
                # column 32 q + 16 v0 + j is accumulator value 4 j + v0 of row h
                vals = cute.make_tensor(acc_O.iterator + 2 * h,
                                        cute.make_layout((16, 2), stride=(4, 1)))
                frag = cute.make_rmem_tensor(cols, dtype)
                frag.store(vals.load().to(dtype))
                # (rows are 16-byte aligned: checked by the API, or the fp32 workspace's)
                g_row = gO[row_base + r, None].iterator.toint()
                for k in cutlass.range_constexpr(cols // chunk):
                    dst = cute.make_tensor(
                        cute.make_ptr(dtype, g_row + Int64((q * cols + k * chunk) * elem_bytes),
                                      cute.AddressSpace.gmem, assumed_align=16),
                        cute.make_layout(chunk))
                    cute.autovec_copy(cute.local_tile(frag, (chunk,), (k,)), dst)
