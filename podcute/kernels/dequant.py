"""fp8 KV values -> 16-bit types: whole tiles shared memory to shared memory (`Dequant`,
for the wgmma path), or register words straight into mma.sync fragments (`byte_perm`,
`fp8_pair_to_f16x2`, for the warp-level fp8 decode path, `decode_fp8.py`).

The converting warps of the producer warpgroup read a staged fp8 tile (row-major, as TMA
or cp.async wrote it; with its 16-byte chunks XOR-swizzled by the row where the staging
is swizzled) 16 bytes a thread and write the 16-bit stage the MMA warpgroups read
(swizzled, as wgmma wants it).

e4m3 -> fp16 is one hardware instruction a pair (`cvt.rn.f16x2.e4m3x2`, sm_89+). The
other formats are moved by integer ops (two `prmt` place the 4 bytes of a word at the top
of four 16-bit lanes, a shift lines the exponent up, a `lop3` restores the sign) and one
packed multiply by a power of two undoes the bias difference (none for e5m2 -> fp16,
which is fp16's high byte). Every fp8 value, subnormals included, is exactly
representable in both 16-bit types, and the multiply by a power of two is exact, so the
conversion is exact. fp8 codes that mean NaN or infinity may come out finite through the
bit moves (e4m3 0x7f reads 480 in bf16): valid caches hold none (the quantiser
saturates), and slots past a request's keys are masked (K) or zeroed (V) whatever they
hold.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

# The bit-move formats to bf16: fp8 type -> (right shift that lines the fp8 exponent up
# with bf16's once the byte sits at bits 8-15 of a lane, the mask of the magnitude bits
# after it, the packed power of two the shift divides by: 2^(bias16 - bias8)). fp16
# targets need none (`fp8_pair_to_f16x2`).
_FORMATS = {
    ("float8_e4m3fn", "bfloat16"): (4, 0x07F007F0, 0x7B807B80),  # x 2^120
    ("float8_e5m2", "bfloat16"): (3, 0x0FE00FE0, 0x77807780),  # x 2^112
}
# Passes whose loads are in flight together (3 x 4 words: what the producer's 72 registers
# hold beside the addresses without spilling).
BATCH = 3
# prmt selectors: bytes 0, 1 (or 2, 3) of a word to the high bytes of two 16-bit lanes.
_LOW_PAIR, _HIGH_PAIR = 0x1404, 0x3424


def _asm_b32(args, asm: str, loc=None, ip=None) -> Int32:
    """One 32-bit result of inline PTX over 32-bit register operands $1.. (no side
    effects: the compiler may schedule it freely)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value(loc=loc, ip=ip) for a in args], asm,
        "=r" + ",r" * len(args), has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def byte_perm(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """`prmt.b32`: byte i of the result is byte (selector >> 4i) & 7 of the 8 bytes
    (a's 0-3, b's 4-7)."""
    return _asm_b32([a, b], f"prmt.b32 $0, $1, $2, {selector:#x};", loc, ip)


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
        return _asm_b32([word], asm, loc, ip)
    return _asm_b32([word], f"prmt.b32 $0, $1, 0, {_HIGH_PAIR if high else _LOW_PAIR:#x};",
                    loc, ip)


@dsl_user_op
def _pair_to_16bit(word: Int32, selector: int, kv_dtype: str, dtype: str, *, loc=None,
                   ip=None) -> Int32:
    """Two fp8 values of `word` (bytes 0-1 or 2-3) as a packed pair of `dtype`."""
    if dtype == "float16":
        return fp8_pair_to_f16x2(word, selector == _HIGH_PAIR, kv_dtype, loc=loc, ip=ip)
    shift, mask, factor = _FORMATS[(kv_dtype, dtype)]
    asm = "\n".join([
        "{", ".reg .b32 h, s, f;", f"prmt.b32 h, $1, 0, {selector:#x};",
        "and.b32 s, h, 0x80008000;", f"shr.b32 h, h, {shift};",
        f"lop3.b32 h, h, {mask:#x}, s, 0xea;",  # (h & mask) | s
        f"mov.b32 f, {factor:#x};", "mul.rn.bf16x2 $0, h, f;", "}"])
    return _asm_b32([word], asm, loc, ip)


@dataclass(frozen=True)
class Dequant:
    """One converting thread's share of an fp8 -> 16-bit tile conversion."""

    tid: Int32  # 0 .. num_threads among the converting threads
    num_threads: cutlass.Constexpr[int]
    kv_dtype: cutlass.Constexpr[str]  # config names: "float8_e4m3fn" / "float8_e5m2"
    dtype: cutlass.Constexpr[str]  # "bfloat16" / "float16"
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
        k = self.tid % chunks
        r0 = self.tid // chunks
        # Swizzled staging: row r0 + j * rows_per_pass holds chunk k at k ^ (r0 % 8) ^
        # (j * rows_per_pass % 8), the second term static when rows_per_pass is a multiple
        # of 4 ((x + 4) % 8 == x ^ 4): one XOR for all passes (a clamped last row reads a
        # chunk of its own row, never stored).
        k_load = k
        if const_expr(self.swizzled):
            assert rows_per_pass % 4 == 0, "swizzled staging needs rows_per_pass % 4 == 0"
            k_load = k ^ (r0 % 8)
        out_type = cutlass.BFloat16 if const_expr(self.dtype == "bfloat16") else cutlass.Float16
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
                        self._store(words, j, s16, r, k, zero_from, out_type)
                    else:
                        if r < rows:
                            self._store(words, j, s16, r, k, zero_from, out_type)

    @cute.jit
    def _store(self, words: cute.Tensor, j: cutlass.Constexpr[int], s16: cute.Tensor, r: Int32,
               k: Int32, zero_from: Int32, out_type: cutlass.Constexpr):
        """Convert pass j's 16 values (words[j, :]) and store them as chunk k of row r."""
        out = cute.make_rmem_tensor((1, 8), Int32)
        for i in cutlass.range_constexpr(4):
            out[0, 2 * i] = _pair_to_16bit(words[j, i], _LOW_PAIR, self.kv_dtype, self.dtype)
            out[0, 2 * i + 1] = _pair_to_16bit(words[j, i], _HIGH_PAIR, self.kv_dtype,
                                               self.dtype)
        if r >= zero_from:
            out.fill(0)
        cute.autovec_copy(cute.recast_tensor(out, out_type),
                          cute.local_tile(s16, (1, 16), (r, k)))
