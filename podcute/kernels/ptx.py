"""Inline PTX for what the DSL has no op for, written once: one 32-bit result over 32-bit
register operands (Float32 values bind as `f` registers, the rest as `r`)."""

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def asm32(out_type, args, asm: str, *, side_effects: bool = False, loc=None, ip=None):
    """`asm` ($0 the result, $1.. the args) as one instruction block. Without side effects
    the compiler may move, merge or drop it like any arithmetic."""
    def reg(t):
        return "f" if t is Float32 else "r"
    types = [Float32 if isinstance(a, Float32) else Int32 for a in args]
    return out_type(llvm.inline_asm(
        out_type.mlir_type, [t(a).ir_value(loc=loc, ip=ip) for t, a in zip(types, args)],
        asm, ",".join(["=" + reg(out_type)] + [reg(t) for t in types]),
        has_side_effects=side_effects, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def kept_in_loop(value: Int32, *, loc=None, ip=None) -> Int32:
    """`value` through a volatile `mov`: arithmetic on the result stays inside the loop
    that uses it. The compiler hoists loop-invariant addresses (a thread's ldmatrix
    addresses, say) out of the MMA warps' item loop, where they hold registers through
    every path of the loop, the ones that need all of them included."""
    return asm32(Int32, [Int32(value)], "mov.b32 $0, $1;", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of a float."""
    return asm32(Int32, [Float32(x)], "mov.b32 $0, $1;", loc=loc, ip=ip)


@dsl_user_op
def pow2(e: Int32, *, loc=None, ip=None) -> Float32:
    """2^e as a float (e a normal exponent): the bits (e + 127) << 23."""
    return asm32(Float32, [(Int32(e) + 127) << 23], "mov.b32 $0, $1;", loc=loc, ip=ip)


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    """The SM this thread runs on (%smid)."""
    return asm32(Int32, [], "mov.u32 $0, %smid;", side_effects=True, loc=loc, ip=ip)
