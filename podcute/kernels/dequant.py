"""fp8 KV tiles -> q's 16-bit type, shared memory to shared memory.

The converting warps of the producer warpgroup read a staged fp8 tile (row-major,
unswizzled, as TMA or cp.async wrote it) 16 bytes a thread and write the 16-bit stage
the MMA warpgroups read (swizzled, as wgmma wants it).

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

# The bit-move formats: (fp8 type, 16-bit type) -> (right shift that lines the fp8
# exponent up with the 16-bit one once the byte sits at bits 8-15 of a lane, the mask of
# the magnitude bits after it, the packed power of two the shift divides by:
# 2^(bias16 - bias8); None for 1). e4m3 -> fp16 is the hardware cvt instead.
_FORMATS = {
    ("float8_e4m3fn", "bfloat16"): (4, 0x07F007F0, 0x7B807B80),  # x 2^120
    ("float8_e5m2", "bfloat16"): (3, 0x0FE00FE0, 0x77807780),  # x 2^112
    ("float8_e5m2", "float16"): (0, 0x7F007F00, None),  # e5m2 is fp16's high byte
}
# Passes whose loads are in flight together (3 x 4 words: what the producer's 72 registers
# hold beside the addresses without spilling).
BATCH = 3
# prmt selectors: bytes 0, 1 (or 2, 3) of a word to the high bytes of two 16-bit lanes.
_LOW_PAIR, _HIGH_PAIR = 0x1404, 0x3424


@dsl_user_op
def _pair_to_16bit(word: Int32, selector: int, kv_dtype: str, dtype: str, *, loc=None,
                   ip=None) -> Int32:
    """Two fp8 values of `word` (bytes 0-1 or 2-3) as a packed pair of `dtype`."""
    if (kv_dtype, dtype) == ("float8_e4m3fn", "float16"):
        # sm_89+ converts an e4m3 pair to f16x2 in one instruction.
        half = "lo" if selector == _LOW_PAIR else "hi"
        asm = ("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $1;\n"
               f"cvt.rn.f16x2.e4m3x2 $0, {half};\n}}")
    else:
        shift, mask, factor = _FORMATS[(kv_dtype, dtype)]
        mul = "bf16x2" if dtype == "bfloat16" else "f16x2"
        body = [f"prmt.b32 h, $1, 0, {selector:#x};"]
        if shift:
            body += [
                "and.b32 s, h, 0x80008000;",
                f"shr.b32 h, h, {shift};",
                f"lop3.b32 h, h, {mask:#x}, s, 0xea;",  # (h & mask) | s
            ]
        if factor is None:
            body += ["mov.b32 $0, h;"]
        else:
            body += [f"mov.b32 f, {factor:#x};", f"mul.rn.{mul} $0, h, f;"]
        asm = "{\n.reg .b32 h, s, f;\n" + "\n".join(body) + "\n}"
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(word).ir_value(loc=loc, ip=ip)], asm, "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dataclass(frozen=True)
class Dequant:
    """One converting thread's share of an fp8 -> 16-bit tile conversion."""

    tid: Int32  # 0 .. num_threads among the converting threads
    num_threads: cutlass.Constexpr[int]
    kv_dtype: cutlass.Constexpr[str]  # config names: "float8_e4m3fn" / "float8_e5m2"
    dtype: cutlass.Constexpr[str]  # "bfloat16" / "float16"

    @cute.jit
    def tile(self, s8: cute.Tensor, s16: cute.Tensor, zero_from: Int32):
        """s16[r, :] = dequantised s8[r, :] for rows r < zero_from, 0 for the rest (V rows
        past the item's keys: P = 0 times a garbage slot's value must not be NaN).

        s8: (tile_n, D) fp8 stage viewed as int32 words, (tile_n, D / 4), row-major;
        s16: (tile_n, D) 16-bit stage (swizzled). A thread takes 16 values a pass."""
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
        out_type = cutlass.BFloat16 if const_expr(self.dtype == "bfloat16") else cutlass.Float16
        if self.tid < rows_per_pass * chunks:
            for j0 in cutlass.range_constexpr(0, passes, BATCH):
                n = min(BATCH, passes - j0)
                words = cute.make_rmem_tensor((n, 4), Int32)
                for j in cutlass.range_constexpr(n):
                    r = cutlass.min(r0 + (j0 + j) * rows_per_pass, rows - 1)
                    cute.autovec_copy(cute.local_tile(s8, (1, 4), (r, k))[0, None],
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
