"""fp8 KV values -> fp16, the MMAs' operand type beside an fp8 cache whatever the queries'
type: whole tiles shared memory to shared memory (`Dequant`, for the wgmma path), or
register words straight into mma.sync fragments (`byte_perm`, `fp8_pair_to_f16x2`, for
the warp-level fp8 decode path, `decode_fp8.py`); and bf16 queries scaled into fp16's
range, as register fragments (`q_fragment_to_fp16`) or, at D 256, in place in shared
memory (`q_tile_to_fp16`; both through `fp16_range_scale`).

The converting warps of the producer warpgroup read a staged fp8 tile (row-major, as TMA
or cp.async wrote it; with its 16-byte chunks XOR-swizzled by the row where the staging
is swizzled) 16 bytes a thread and write the 16-bit stage the MMA warpgroups read
(swizzled, as wgmma wants it).

e4m3 -> fp16 is one hardware instruction a pair (`cvt.rn.f16x2.e4m3x2`, sm_89+); e5m2 is
fp16's high byte (one `prmt` a pair). Every fp8 value, subnormals included, is exactly
representable in fp16, so the conversion is exact. (To bf16 it would take five
instructions a pair: the bytes moved to the top of 16-bit lanes, a shift, the sign
restored, a multiply undoing the bias difference. That is why the MMAs run in fp16.)
e5m2 codes that mean NaN or infinity stay so; valid caches hold none (the quantiser
saturates), and slots past a request's keys are masked (K) or zeroed (V) whatever they
hold.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import dsl_user_op

from podcute.kernels.ptx import asm32, f32_bits, pow2

# Passes whose loads are in flight together (3 x 4 words: what the producer's registers,
# 56 since cf0960a (2026-12-04), hold beside the addresses without spilling).
BATCH = 3
# prmt selectors: bytes 0, 1 (or 2, 3) of a word to the high bytes of two 16-bit lanes.
_LOW_PAIR, _HIGH_PAIR = 0x1404, 0x3424
# Queries beside an fp8 cache meet K and V as fp16 (e4m3 -> fp16 is one instruction a
# pair, -> bf16 five), so bf16 queries are scaled into fp16's range by a power of two:
# the largest |q| of the rows scaled together goes to [2^14, 2^15), and e is clamped so
# 2^+-e stays a normal float (an all-zero Q gets 2^100, harmless). bf16 -> fp16 is then
# exact for every value within 2^-28 of the largest (smaller ones move S by less than
# 2^-28 of its scale); the products and sums are fp32, and 2^e folds into the score
# scale exactly.
_Q_TOP_EXP, _Q_EXP_LIMIT = 14, 100


@cute.jit
def fp16_range_scale(amax: Float32):
    """(2^e, 2^-e) for rows of bf16 queries whose largest |q| is `amax` (the same for
    every thread that scales them): q x 2^-e is an exact fp16, and scores of the scaled
    rows are 2^-e times the true ones."""
    e = ((f32_bits(amax) >> 23) & 0xFF) - 127 - _Q_TOP_EXP
    e = cutlass.max(-_Q_EXP_LIMIT, cutlass.min(e, _Q_EXP_LIMIT))
    return pow2(e), pow2(-e)


@cute.jit
def finite_abs_max(x) -> Float32:
    """The largest finite |x| of the float32 TensorSSA x (0 if none). A row of inf or
    NaN queries must not set the scale of the rows it is scaled with: through 2^-e they
    would all round to zero; this way only its own scores are non-finite, as without
    the scaling."""
    ax = abs(x)
    return cute.where(ax < Float32(float("inf")), ax, Float32(0.0)).reduce(
        cute.ReductionOp.MAX, Float32(0.0), 0)


@cute.jit
def q_fragment_to_fp16(rQ: cute.Tensor, tSrQ: cute.Tensor) -> Float32:
    """Fill the fp16 fragment tSrQ from the 16-bit query fragment rQ (same layout): as is
    for fp16, scaled by 2^-e for bf16, e from the largest |q| of the warp's fragments
    (a warp of a wgmma holds whole rows: 16 of them). Returns 2^e, the factor the scores
    need."""
    up = Float32(1.0)
    if const_expr(rQ.element_type == cutlass.Float16):
        tSrQ.store(rQ.load())
    else:
        x = rQ.load().to(Float32)
        up, down = fp16_range_scale(
            cute.arch.warp_reduction_max(finite_abs_max(x), threads_in_group=32))
        tSrQ.store((x * down).to(cutlass.Float16))
    return up


@cute.jit
def q_tile_to_fp16(sQ: cute.Tensor, sQ16: cute.Tensor, warp: Int32, lane: Int32) -> Float32:
    """In place, warp `warp`'s 16 rows of an MMA warpgroup's (64, D) bf16 Q tile `sQ` as
    fp16 (`sQ16`, the same shared memory seen as fp16): scaled by 2^-e as
    `q_fragment_to_fp16` scales a register fragment, e from the largest finite |q| of the
    16 rows, which are the rows of the warp's S accumulator in an m64 wgmma. For head
    dims whose Q does not fit in registers beside O (D 256). Returns 2^e, the factor the
    warp's scores need. Each lane takes half a row, 8 values (16 bytes) a step: a first
    pass finds the maximum, a second converts (all of a half row held at once would take
    D / 4 registers). The caller fences and syncs the warpgroup before a wgmma reads it."""
    d = cute.size(sQ, mode=[1])
    steps = d // 2 // 8
    row = warp * 16 + lane // 2
    first = (lane % 2) * steps
    amax = Float32(0.0)
    for c in cutlass.range_constexpr(steps):
        v = cute.make_rmem_tensor((1, 8), sQ.element_type)
        cute.autovec_copy(cute.local_tile(sQ, (1, 8), (row, first + c)), v)
        amax = cutlass.max(amax, finite_abs_max(v.load().to(Float32)))
    up, down = fp16_range_scale(cute.arch.warp_reduction_max(amax, threads_in_group=32))
    for c in cutlass.range_constexpr(steps):
        v = cute.make_rmem_tensor((1, 8), sQ.element_type)
        cute.autovec_copy(cute.local_tile(sQ, (1, 8), (row, first + c)), v)
        h = cute.make_rmem_tensor((1, 8), cutlass.Float16)
        h.store((v.load().to(Float32) * down).to(cutlass.Float16))
        cute.autovec_copy(h, cute.local_tile(sQ16, (1, 8), (row, first + c)))
    return up


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """`prmt.b32`: byte i of the result is byte (selector >> 4i) & 7 of the 8 bytes
    (a's 0-3, b's 4-7)."""
    return asm32(Int32, [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {selector:#x};",
                 loc=loc, ip=ip)


@dsl_user_op
def fp8_pair_to_f16x2(word: Int32, high: bool, kv_dtype: str, *, loc=None,
                      ip=None) -> Int32:
    """Bytes 0-1 (or 2-3 with `high`) of `word`, two fp8 values, as an fp16 pair in one
    register (the lower byte in the lower half: the order of an mma.sync fragment's
    pair). e4m3: the hardware cvt; e5m2: the bytes are the pair's high bytes. Exact."""
    if kv_dtype == "float8_e4m3fn":
        half = "hi" if high else "lo"
        asm = ("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $1;\n"
               f"cvt.rn.f16x2.e4m3x2 $0, {half};\n}}")
        return asm32(Int32, [Int32(word)], asm, loc=loc, ip=ip)
    return asm32(Int32, [Int32(word)],
                 f"prmt.b32 $0, $1, 0, {_HIGH_PAIR if high else _LOW_PAIR:#x};", loc=loc, ip=ip)


def converter_chunk(tid, chunks: int, rows_per_pass: int):
    """(first row, 16-value chunk) of converting thread `tid` (an Int32 in the kernel, an
    int in tests/test_fp8_api.py); its rows are first row + j * rows_per_pass.

    By default a quarter warp (8 threads) takes 8 chunks of one row. At D 128 (8 chunks)
    that conflicts: a row's 16-bit chunks k and k + 4 sit in the two 64-column blocks at
    the same banks, so the quarter warp's 16-byte stores were 2-way conflicted. There a
    quarter warp takes chunks 0-3 of one row and 4-7 of the next (the next quarter the
    other halves): its stores land on even chunks (row r) and odd ones (r ^ 1) after the
    swizzle, and its 16-byte fp8 loads on chunks {0-3} and {4-7}, XORed with r % 8 (< 4
    or >= 4 for both rows alike): conflict-free both ways, swizzled staging or not."""
    k = tid % chunks
    r0 = tid // chunks
    if chunks == 8 and rows_per_pass % 2 == 0:
        r0 = 2 * (tid // 16) + ((k // 4) ^ ((tid // 8) % 2))
    return r0, k


@dataclass(frozen=True)
class Dequant:
    """One converting thread's share of an fp8 -> 16-bit tile conversion."""

    tid: Int32  # 0 .. num_threads among the converting threads
    num_threads: cutlass.Constexpr[int]
    kv_dtype: cutlass.Constexpr[str]  # config names: "float8_e4m3fn" / "float8_e5m2"
    # The staging's 16-byte chunks are XOR-swizzled by the row (TMA's 128-byte swizzle of
    # 128-byte rows: chunk k of row r sits at k ^ (r % 8)).
    swizzled: cutlass.Constexpr[bool] = False

    @cute.jit
    def tile(self, s8: cute.Tensor, s16: cute.Tensor, zero_from: Int32):
        """s16[r, :] = dequantised s8[r, :] for rows r < zero_from, 0 for the rest (V rows
        past the item's keys: P = 0 times a garbage slot's value must not be NaN).

        s8: (tile_n, D) fp8 stage viewed as int32 words, (tile_n, D / 4), row-major (its
        chunks swizzled with `swizzled`); s16: (tile_n, D) 16-bit stage (swizzled). A
        thread takes 16 values a pass."""
        rows = cute.size(s16, mode=[0])
        chunks = cute.size(s16, mode=[1]) // 16  # 16-value chunks of a row
        # A thread keeps one chunk column and steps down the rows (the index math once).
        # All its loads are issued first: the compiler cannot move a load from the fp8
        # stage above a store to the 16-bit one (it cannot tell they never alias), so
        # loads interleaved with stores would each wait out a shared-memory round trip.
        # The last pass's rows past the tile re-read the last row and store nothing;
        # threads past the last whole group of rows (D 96's 4 of 64) idle.
        rows_per_pass = self.num_threads // chunks
        passes = -(-rows // rows_per_pass)
        r0, k = converter_chunk(self.tid, chunks, rows_per_pass)
        # Swizzled staging: row r0 + j * rows_per_pass holds chunk k at k ^ (r0 % 8) ^
        # (j * rows_per_pass % 8), the second term static when rows_per_pass is a multiple
        # of 4 ((x + 4) % 8 == x ^ 4): one XOR for all passes (a clamped last row reads a
        # chunk of its own row, never stored).
        k_load = k
        if const_expr(self.swizzled):
            assert rows_per_pass % 4 == 0, "swizzled staging needs rows_per_pass % 4 == 0"
            k_load = k ^ (r0 % 8)
        if self.tid < rows_per_pass * chunks:
            for j0 in cutlass.range_constexpr(0, passes, BATCH):
                n = min(BATCH, passes - j0)
                words = cute.make_rmem_tensor((n, 4), Int32)
                for j in cutlass.range_constexpr(n):
                    r = cutlass.min(r0 + (j0 + j) * rows_per_pass, rows - 1)
                    k_at = k_load
                    if const_expr(self.swizzled):
                        k_at = k_load ^ ((j0 + j) * rows_per_pass % 8)
                    cute.autovec_copy(cute.local_tile(s8, (1, 4), (r, k_at))[0, None],
                                      words[j, None])
                for j in cutlass.range_constexpr(n):
                    r = r0 + (j0 + j) * rows_per_pass
                    if const_expr((j0 + j + 1) * rows_per_pass <= rows):
                        self._store(words, j, s16, r, k, zero_from)
                    else:
                        if r < rows:
                            self._store(words, j, s16, r, k, zero_from)

    @cute.jit
    def _store(self, words: cute.Tensor, j: cutlass.Constexpr[int], s16: cute.Tensor, r: Int32,
               k: Int32, zero_from: Int32):
        """Convert pass j's 16 values (words[j, :]) and store them as chunk k of row r."""
        out = cute.make_rmem_tensor((1, 8), Int32)
        for i in cutlass.range_constexpr(4):
            out[0, 2 * i] = fp8_pair_to_f16x2(words[j, i], False, self.kv_dtype)
            out[0, 2 * i + 1] = fp8_pair_to_f16x2(words[j, i], True, self.kv_dtype)
        if r >= zero_from:
            out.fill(0)
        cute.autovec_copy(cute.recast_tensor(out, cutlass.Float16),
                          cute.local_tile(s16, (1, 16), (r, k)))
