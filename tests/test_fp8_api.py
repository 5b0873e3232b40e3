"""fp8 KV caches at the public edge, on a CPU machine: the configuration an fp8 cache
selects, the compile key, and every bad argument (kv_dtype, cache dtype, scales) reported
with a named error before any device check; a valid call without a Hopper GPU raises the
clear RuntimeError."""

import os

import pytest
import torch

from podcute import PODAttention, pod_attention
from podcute.compile import VariantKey
from podcute.kernels.config import FP8_HEAD_DIMS, KernelConfig
from podcute.kernels.pod_fwd_sm90 import CONVERTER_GROUP_THREADS, FP8_STAGE_ARRIVALS, WarpRoles
from tests.test_api import HAS_HOPPER, HKV, HQ, I32, PS, D, good, raises

E4M3 = torch.float8_e4m3fn


def fp8_good(layout="NHD", kv=E4M3):
    g = good(layout)
    g["k"], g["v"] = g["k"].to(kv), g["v"].to(kv)
    return g


def fp8_planned(layout="NHD", kv=E4M3):
    g = fp8_good(layout, kv)
    a = PODAttention(HQ, HKV, D, PS, device="cpu", kv_layout=layout, kv_dtype=kv)
    a.plan(g["cu"], g["kvl"], block_table=g["bt"])
    return a, g


@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("d", FP8_HEAD_DIMS)
def test_fp8_config(page, d):
    cfg = KernelConfig.select("bfloat16", d, 4, page_size=page, kv_dtype="float8_e4m3fn")
    tile = 32 if d == 256 else 64
    assert cfg.fp8 and cfg.tile_n == tile and cfg.num_stages == 2 and cfg.fp8_stages >= 4
    assert cfg.kv_box == (tile if page % tile == 0 else 16 if page % 16 == 0 else 0)
    assert cfg.can_implement() == (True, "")
    plain = KernelConfig.select("bfloat16", d, 4, page_size=page)
    assert VariantKey.make(cfg) != VariantKey.make(plain)  # the key carries the KV dtype
    e5m2 = KernelConfig.select("bfloat16", d, 4, page_size=page, kv_dtype="float8_e5m2")
    assert VariantKey.make(e5m2) != VariantKey.make(cfg)


def test_fp8_at_head_dim_256_converts_q_in_shared_memory():
    # D 256: Q's 64 registers beside O's 128 do not fit, so Q stays in shared memory
    # (converted to fp16 there); 32-token tiles make room for the fp8 staging; one producer
    # warpgroup, because the m64n256 P V wgmma needs more registers than 512 threads give.
    for page in (1, 4, 16, 32, 128):
        for dtype in ("bfloat16", "float16"):
            c = KernelConfig.select(dtype, 256, 4, page_size=page, kv_dtype="float8_e5m2")
            assert c.can_implement() == (True, "")
            assert not c.q_in_registers and c.tile_n == 32 and c.fp8_stages >= 2
            assert c.num_producer_warpgroups == 1 and c.launch_regs() >= 158
            assert c.mma_dtype == "float16" and c.combine_rounds == 4 and not c.o_staging
    for d in (64, 96, 128):
        assert KernelConfig.select("bfloat16", d, 4, kv_dtype="float8_e4m3fn").q_in_registers


def test_fp8_config_refusals():
    with raises(ValueError, "kv_dtype"):
        KernelConfig.select("bfloat16", 128, 4, kv_dtype="int8")


def test_setmaxnreg_split_must_fit_the_launch_registers():
    # 48 + 2 x 232 = 512 > 3 x 168 launched (the split the first fp8 build had): the MMA
    # warpgroups' increase would wait forever.
    import dataclasses
    cfg = KernelConfig.select("bfloat16", 128, 4, page_size=16)
    bad = dataclasses.replace(cfg, producer_regs=48, mma_regs=232)
    ok, why = bad.can_implement()
    assert not ok and "setmaxnreg" in why
    for page in (1, 16, 128):
        for d, kv in ((64, ""), (96, ""), (128, ""), (256, ""), (64, "float8_e4m3fn"),
                      (96, "float8_e5m2"), (128, "float8_e4m3fn"), (256, "float8_e4m3fn")):
            c = KernelConfig.select("float16", d, 8, page_size=page, kv_dtype=kv)
            slots = c.num_producer_warpgroups + c.num_mma_warpgroups
            assert (c.num_producer_warpgroups * c.producer_regs + 2 * c.mma_regs
                    <= slots * c.launch_regs())
            assert c.num_threads == 128 * slots


def test_constructor_kv_dtype_errors():
    with raises(TypeError, "kv_dtype"):
        PODAttention(HQ, HKV, D, PS, device="cpu", kv_dtype=torch.float32)
    with raises(TypeError, "kv_dtype"):
        PODAttention(HQ, HKV, D, PS, device="cpu", kv_dtype=torch.float16)  # not q's dtype
    wide = PODAttention(HQ, HKV, 256, PS, device="cpu", kv_dtype=E4M3)
    assert wide.fp8 and wide.planner.config.kernel.head_dim == 256
    a = PODAttention(HQ, HKV, D, PS, device="cpu", kv_dtype=torch.bfloat16)  # q's dtype
    assert not a.fp8 and a.planner.config.kernel.kv_dtype == ""
    b = PODAttention(HQ, HKV, D, PS, device="cpu", kv_dtype=E4M3)
    assert b.fp8 and b.planner.config.kernel.kv_dtype == "float8_e4m3fn"


def test_run_fp8_cache_dtype_errors():
    a, g = fp8_planned()
    with raises(TypeError, "k_cache", "float8_e4m3fn"):
        a.run(g["q"], g["k"].to(torch.bfloat16), g["v"])
    with raises(TypeError, "k_cache", "float8_e4m3fn"):
        a.run(g["q"], g["k"], g["v"].to(torch.float8_e5m2))
    with raises(TypeError, "q", "bfloat16"):
        a.run(g["q"].half(), g["k"], g["v"])
    plain, g16 = fp8_planned(kv=torch.bfloat16)  # a 16-bit PODAttention given fp8 caches
    with raises(TypeError, "k_cache", "kv_dtype"):
        plain.run(g16["q"], g["k"], g["v"])


def test_fp8_rows_must_be_16_byte_aligned():
    a, g = fp8_planned()
    big = torch.zeros(8, PS, HKV, D + 8, dtype=E4M3)[..., :D]  # row stride D + 8 bytes
    with raises(ValueError, "k_cache", "16-byte", "16 elements"):
        a.run(g["q"], big, big)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_errors(name):
    a, g = fp8_planned()

    def run(scale):
        a.run(g["q"], g["k"], g["v"], **{name: scale})

    with raises(TypeError, name, "float"):
        run("1.0")
    with raises(TypeError, name):
        run(True)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with raises(ValueError, name, "finite and > 0"):
            run(bad)
    with raises(TypeError, name, "float32"):
        run(torch.ones(HKV, dtype=torch.float16))
    with raises(ValueError, name, "[num_kv_heads]"):
        run(torch.ones(HKV + 1))
    with raises(ValueError, name, "[num_kv_heads]"):
        run(torch.ones(1, HKV))
    with raises(ValueError, name, "on"):
        run(torch.ones(HKV, device="meta"))
    with raises(ValueError, name, "contiguous"):
        run(torch.ones(2 * HKV)[::2])


def test_scales_refused_for_16bit_caches():
    g = good()
    a = PODAttention(HQ, HKV, D, PS, device="cpu")
    a.plan(g["cu"], g["kvl"], block_table=g["bt"])
    with raises(ValueError, "k_scale", "fp8"):
        a.run(g["q"], g["k"], g["v"], k_scale=1.0)


@pytest.mark.skipif(HAS_HOPPER, reason="checks the no-GPU error path")
@pytest.mark.parametrize("scale", [None, 0.5, "tensor0", "tensorH"])
def test_valid_fp8_call_without_hopper(scale):
    a, g = fp8_planned()
    s = {"tensor0": torch.tensor(0.5), "tensorH": torch.full((HKV,), 0.5)}.get(scale, scale)
    with raises(RuntimeError, "Hopper"):
        a.run(g["q"], g["k"], g["v"], k_scale=s, v_scale=s)
    kw = dict(cu_seqlens_q=g["cu"], seqused_k=g["kvl"], block_table=g["bt"])
    with raises(RuntimeError, "Hopper"):
        pod_attention(g["q"], g["k"], g["v"], k_scale=s, v_scale=s, **kw)


def test_one_shot_fp8_errors():
    g = fp8_good()
    kw = dict(cu_seqlens_q=g["cu"], seqused_k=g["kvl"], block_table=g["bt"])
    with raises(ValueError, "v_scale", "finite"):
        pod_attention(g["q"], g["k"], g["v"], v_scale=-2.0, **kw)
    q = torch.randn(21, HQ, 256, dtype=torch.bfloat16)
    k = torch.zeros(8, PS, HKV, 256, dtype=E4M3)
    with raises(RuntimeError, "Hopper"):  # D 256 is served: checked, then the device check
        pod_attention(q, k, k, **kw)
    assert I32  # (shared fixtures)


@pytest.mark.skipif(HAS_HOPPER, reason="checks the no-GPU error path")
def test_flash_attn_compat_takes_fp8_caches():
    """An fp8 cache through the FlashAttention-shaped call plans an fp8 PODAttention (here
    it then refuses to launch: no GPU); a per-request descale is refused by name."""
    from podcute.compat.flash_attn import flash_attn_varlen_func
    g = fp8_good()
    kw = dict(cu_seqlens_q=g["cu"], max_seqlen_q=20, seqused_k=g["kvl"], max_seqlen_k=40,
              block_table=g["bt"])
    with pytest.raises(RuntimeError, match="GPU"):
        flash_attn_varlen_func(g["q"], g["k"], g["v"], **kw)
    with raises(NotImplementedError, "k_descale", "per request"):
        flash_attn_varlen_func(g["q"], g["k"], g["v"], k_descale=torch.rand(2, HKV), **kw)


def test_producer_roles_of_fp8_variants_are_disjoint():
    # The copy warp(s), the converter groups and the Q warps of every fp8 variant fit in
    # its producer warpgroups without sharing a warp (Q's loaders may be the gather's
    # warpgroup, whose cp.async loaders and first converters also load Q, or at D 256 the
    # TMA warp), and each converter group owns the 16-bit stages of one parity.
    for page in (1, 8, 16, 64, 128):
        for d, kv in ((64, "float8_e4m3fn"), (96, "float8_e5m2"), (128, "float8_e4m3fn"),
                      (256, "float8_e4m3fn")):
            c = KernelConfig.select("bfloat16", d, 4, page_size=page, kv_dtype=kv)
            ok, why = c.can_implement()
            assert ok, why
            roles = WarpRoles.of(c)
            copy_warps = set(range(roles.first_converter // 32))
            first, w = roles.first_converter // 32, CONVERTER_GROUP_THREADS // 32
            groups = [set(range(first + w * g, first + w * (g + 1)))
                      for g in range(roles.converter_groups)]
            first_q, q_warps = roles.q_loaders
            q = set(range(first_q, first_q + q_warps))
            producer_warps = set(range(c.num_producer_threads // 32))
            assert copy_warps | set().union(*groups) | q <= producer_warps
            assert not set.intersection(*groups) or len(groups) == 1
            assert not copy_warps & set().union(*groups)
            assert roles.converter_groups == c.num_producer_warpgroups
            if c.tma_kv:  # one TMA warp, and Q by a warp of its own unless there is none
                assert copy_warps == {0} and not q & set().union(*groups)
                assert (q == {0}) == (c.num_producer_warpgroups == 1)
            assert c.num_stages % roles.converter_groups == 0
            assert roles.num_converters == roles.converter_groups * CONVERTER_GROUP_THREADS


def test_warp_decode_path_and_its_arrivals():
    # The warp-level fp8 decode path (kernels/decode_fp8.py) serves D 128 over TMA pages;
    # the gathered page class and D 64 / 96 keep the converters for decode items too.
    # A freed TMA fp8 stage takes FP8_STAGE_ARRIVALS arrivals: one per warp of the MMA
    # warpgroup that read it, or a converter group's warps with its first arriving twice.
    from podcute.kernels.decode_fp8 import ITEM_ROWS, WARP_KV_ROWS
    for page in (1, 8, 16, 64, 128):
        for d in FP8_HEAD_DIMS:
            for kv in ("float8_e4m3fn", "float8_e5m2"):
                c = KernelConfig.select("bfloat16", d, 4, page_size=page, kv_dtype=kv)
                assert c.warp_decode == (d == 128 and page >= 16)
                if c.warp_decode:
                    assert FP8_STAGE_ARRIVALS == 128 // 32 == CONVERTER_GROUP_THREADS // 32 + 1
                    # each of an MMA warpgroup's warps takes WARP_KV_ROWS rows of a tile
                    assert c.tile_n == 4 * WARP_KV_ROWS and c.fp8_stages % 2 == 0
                    assert c.tile_m_decode >= ITEM_ROWS
    assert not KernelConfig.select("bfloat16", 128, 4, page_size=16).warp_decode


def _stage_offsets(head_dim):
    """Element offset of (row, column) in a 64-row 16-bit K/V stage (kernels/smem.py) and
    the byte swizzle on its pointer, from the DSL on the host."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute

    from podcute.kernels.smem import tile_smem_layout
    found = {}

    @cute.jit
    def offsets():
        lay = tile_smem_layout(cutlass.Float16, 64, head_dim)
        found["swizzle"] = str(lay.inner)
        for r in cutlass.range_constexpr(64):
            for c in cutlass.range_constexpr(0, head_dim, 8):
                found[(r, c)] = lay.outer((r, c))

    offsets()
    return found


@pytest.mark.parametrize("swizzled", [False, True])
def test_converters_cover_the_tile_without_bank_conflicts(swizzled):
    # A converter group (96 threads) at D 128: every (row, chunk) of a 64-token tile once
    # per pass set, and each quarter warp's 16-byte accesses on 8 distinct bank groups:
    # its two stores a pass into the 16-bit stage (the real layout and swizzle) and its
    # load from the fp8 staging (128-byte rows, chunks XOR-swizzled by the row or not).
    from podcute.kernels.dequant import converter_chunk
    threads, chunks, rows, d = 96, 8, 64, 128
    rows_per_pass = threads // chunks
    found = _stage_offsets(d)
    assert found["swizzle"] == "S<3,4,3>"  # bytes [4, 7) ^= bytes [7, 10)

    def bank_group(byte_addr):
        return ((byte_addr ^ (((byte_addr >> 7) & 7) << 4)) // 16) % 8

    covered = set()
    for j in range(-(-rows // rows_per_pass)):
        for quarter in range(threads // 8):
            stores, loads = [set(), set()], set()
            for tid in range(8 * quarter, 8 * quarter + 8):
                r0, k = converter_chunk(tid, chunks, rows_per_pass)
                r = r0 + j * rows_per_pass
                if r >= rows:
                    continue
                covered.add((r, k))
                for half in range(2):  # the chunk's 16 values: two 16-byte stores
                    stores[half].add(bank_group(2 * found[(r, 16 * k + 8 * half)]))
                loads.add((k ^ (r % 8) if swizzled else k) % 8)
            live = len(loads)
            assert live in (0, 8) and all(len(s) == live for s in stores), (j, quarter)
    assert covered == {(r, k) for r in range(rows) for k in range(chunks)}


@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
def test_converter_rows_are_a_partition(head_dim):
    from podcute.kernels.dequant import converter_chunk
    chunks = head_dim // 16
    rows_per_pass = 96 // chunks
    cells = [converter_chunk(t, chunks, rows_per_pass) for t in range(rows_per_pass * chunks)]
    assert sorted(cells) == [(r, k) for r in range(rows_per_pass) for k in range(chunks)]
