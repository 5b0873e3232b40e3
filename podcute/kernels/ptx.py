"""Inline PTX for what the DSL has no op for, written once: one 32-bit result over 32-bit
register operands (Float32 values bind as `f` registers, the rest as `r`), and the L2
cache policies of cp.async (64-bit `l` operands)."""

import cutlass
from cutlass import Float32, Int32, Int64
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


def _l2_policy(priority: str, loc=None, ip=None) -> Int64:
    return Int64(llvm.inline_asm(
        Int64.mlir_type, [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy (createpolicy) marking every line a load with it brings in as
    the first to evict: for data read once, so that it does not push out lines read
    again (sm_80+)."""
    return _l2_policy("evict_first", loc, ip)


@dsl_user_op
def l2_policy_read_once(read_once, *, loc=None, ip=None) -> Int64:
    """`l2_evict_first_policy` where the runtime Boolean `read_once` holds, else the
    policy of an unhinted load (evict-normal)."""
    return Int64(cutlass.select_(read_once, _l2_policy("evict_first", loc, ip),
                                 _l2_policy("evict_normal", loc, ip)))


@dsl_user_op
def cp_async_16_with_policy(smem_addr: Int32, gmem_addr: Int64, policy: Int64, *,
                            loc=None, ip=None) -> None:
    """cp.async of 16 bytes from global `gmem_addr` to the shared-memory byte address
    `smem_addr` (the swizzle applied: `smem.swizzled_address`), L2-cached under `policy`.
    It joins the thread's open commit group like the DSL's own cp.async."""
    operands = [Int32(smem_addr), Int64(gmem_addr), Int64(policy)]
    llvm.inline_asm(
        None, [x.ir_value(loc=loc, ip=ip) for x in operands],
        "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;", "r,l,l,~{memory}",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
