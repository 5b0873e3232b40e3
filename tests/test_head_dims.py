"""Head dims between the compiled tiles (docs/design.md, "Head dims between the tiles"): the
tile a head dim runs on, the refusals, and what the host sizes by which width. The kernels'
numbers: tests/test_kernel_gpu.py::test_head_dims_between_tiles (GPU)."""

import pytest
import torch

from podcute import PODAttention
from podcute.kernels.config import KernelConfig, tile_head_dim


@pytest.mark.parametrize("d, tile", [(8, 64), (40, 64), (64, 64), (72, 96), (80, 96),
                                     (96, 96), (104, 128), (112, 128), (128, 128),
                                     (136, 256), (160, 256), (192, 256), (224, 256),
                                     (256, 256)])
def test_a_head_dim_runs_on_the_next_tile(d, tile):
    assert tile_head_dim(d) == tile
    for page in (1, 16, 128):
        c = KernelConfig.select("bfloat16", d, 4, page_size=page)
        assert c.head_dim == tile and c.io_dim == d and c.head_dim_io == (0 if d == tile else d)
        assert c.can_implement() == (True, "")
    if d <= 128:
        w = KernelConfig.select("bfloat16", d, 4, arch="sm_80")
        assert w.head_dim == tile and w.io_dim == d
    else:
        with pytest.raises(NotImplementedError, match=f"head_dim {d}.*sm_80"):
            KernelConfig.select("bfloat16", d, 4, arch="sm_80")


@pytest.mark.parametrize("d", [4, 12, 59, 84, 111, 264, 512])
def test_other_head_dims_are_refused_by_name(d):
    with pytest.raises(NotImplementedError, match=f"head_dim={d}"):
        PODAttention(8, 2, d, 16, device="cpu")
    with pytest.raises(ValueError, match="multiple of 8"):
        KernelConfig.select("bfloat16", d, 4)


def test_fp8_caches_keep_the_tile_widths():
    for d in (64, 96, 128, 256):
        c = KernelConfig.select("bfloat16", d, 4, page_size=16, kv_dtype="float8_e4m3fn")
        assert c.fp8 and c.io_dim == d and c.head_dim_io == 0
    for d in (40, 80, 112, 160):
        with pytest.raises(NotImplementedError, match=f"fp8 KV caches at head_dim {d}"):
            PODAttention(8, 2, d, 16, device="cpu", kv_dtype=torch.float8_e4m3fn)


def test_host_sizes_the_caller_width_and_the_tile_width_apart():
    """q/K/V/out are checked at the caller's width; the split partials (the kernel's own
    workspace) have the tile's; the default softmax scale is the caller's."""
    a = PODAttention(8, 2, 80, 16, device="cpu")
    cu = torch.tensor([0, 300, 301], dtype=torch.int32)
    kvl = torch.tensor([700, 9000], dtype=torch.int32)
    bt = torch.arange(2 * 600, dtype=torch.int32).reshape(2, 600)
    a.plan(cu, kvl, block_table=bt)
    assert a.planner.buffers.mPartialO.shape[-1] == 96
    assert a.planner.config.head_dim == 80 and a.planner.config.kernel.head_dim == 96
    assert abs(a.planner.kernel_scale(None) - 80 ** -0.5) < 1e-7
    q = torch.randn(301, 8, 96, dtype=torch.bfloat16)  # the tile's width is not the caller's
    k = torch.randn(1200, 16, 2, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=80"):
        a.run(q, k, k)


# A value head dim of its own (docs/design.md, "Head dims between the tiles"): DeepSeek's
# prefill shape 192 / 128, and narrower or wider values on every family that has the tile.
@pytest.mark.parametrize("d, dv, tile", [(192, 128, 256), (128, 64, 128), (64, 128, 128),
                                         (72, 96, 96), (256, 192, 256), (128, 40, 128)])
def test_a_value_head_dim_runs_on_the_tile_of_the_wider(d, dv, tile):
    for page in (1, 16, 128):
        c = KernelConfig.select("bfloat16", d, 4, page_size=page, head_dim_vo=dv)
        assert (c.head_dim, c.io_dim, c.vo_dim) == (tile, d, dv)
        assert c.vo_io == (0 if dv == tile else dv) and c.can_implement() == (True, "")
        # the same tiling as the tile's own variant: only the copies' columns differ
        own = KernelConfig.select("bfloat16", tile, 4, page_size=page)
        assert (c.tile_n, c.num_stages, c.kv_box) == (own.tile_n, own.num_stages, own.kv_box)
        shared = KernelConfig.select("bfloat16", d, 4, page_size=page, head_dim_vo=dv,
                                     shared_prefix=True)
        assert shared.shared_prefix and shared.vo_dim == dv
    if tile <= 128:
        w = KernelConfig.select("bfloat16", d, 4, arch="sm_80", head_dim_vo=dv)
        assert (w.head_dim, w.io_dim, w.vo_dim) == (tile, d, dv)
    else:
        with pytest.raises(NotImplementedError, match=f"head_dim {d} with head_dim_vo {dv}.*sm_80"):
            KernelConfig.select("bfloat16", d, 4, arch="sm_80", head_dim_vo=dv)


def test_value_head_dim_refusals_name_it():
    with pytest.raises(NotImplementedError, match="head_dim_vo=84"):
        PODAttention(8, 2, 128, 16, device="cpu", head_dim_vo=84)
    with pytest.raises(NotImplementedError, match="fp8 KV caches with head_dim_vo=64"):
        PODAttention(8, 2, 128, 16, device="cpu", head_dim_vo=64, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8 KV caches with a value head dim"):
        KernelConfig.select("bfloat16", 128, 4, kv_dtype="float8_e4m3fn", head_dim_vo=64)
    with pytest.raises(TypeError, match="head_dim_vo"):
        PODAttention(8, 2, 128, 16, device="cpu", head_dim_vo=64.0)
    # the same dim twice is the plain variant
    assert KernelConfig.select("bfloat16", 96, 4, head_dim_vo=96) == KernelConfig.select(
        "bfloat16", 96, 4)


def test_value_head_dim_shapes_at_run(launches):
    """v_cache and out have head_dim_vo columns, q and k_cache head_dim; out is allocated
    that wide; a v_cache or out of q's width is refused by name."""
    a = PODAttention(8, 2, 192, 16, device="cpu", head_dim_vo=128)
    cu = torch.tensor([0, 30, 31], dtype=torch.int32)
    kvl = torch.tensor([70, 40], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    a.plan(cu, kvl, block_table=bt)
    q = torch.randn(31, 8, 192, dtype=torch.bfloat16)
    k = torch.randn(10, 16, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(10, 16, 2, 128, dtype=torch.bfloat16)
    out = a.run(q, k, v)
    assert out.shape == (31, 8, 128) and launches[-1][4] is out
    given = torch.empty(31, 8, 128, dtype=torch.bfloat16)
    assert a.run(q, k, v, out=given) is given
    # strided V rows (the value half of a wider interleaved pool) pass as they are
    pool = torch.randn(10, 2, 16, 2, 192, dtype=torch.bfloat16)
    a.run(q, pool[:, 0], pool[:, 1, ..., :128])
    with pytest.raises(ValueError, match="v_cache must be k_cache's shape with head_dim_vo=128"):
        a.run(q, k, k)
    with pytest.raises(ValueError, match="out must be"):
        a.run(q, k, v, out=torch.empty(31, 8, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ragged v"):
        a._check_ragged_kv(a.current_plan, q, (torch.empty(1, 70, 2, 192, dtype=torch.bfloat16),
                                               torch.empty(1, 70, 2, 192, dtype=torch.bfloat16)))


def test_value_head_dim_through_the_entry_points(launches):
    """pod_attention and flash_attn_varlen_func take v's head dim from v; FlashInfer's
    BatchAttention from head_dim_vo."""
    import podcute
    from podcute.compat.flash_attn import flash_attn_varlen_func
    from podcute.compat.flashinfer import BatchAttention

    cu = torch.tensor([0, 30, 31], dtype=torch.int32)
    kvl = torch.tensor([70, 40], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=torch.int32)
    q = torch.randn(31, 8, 192, dtype=torch.bfloat16)
    k = torch.randn(10, 16, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(10, 16, 2, 128, dtype=torch.bfloat16)
    out = podcute.pod_attention(q, k, v, cu_seqlens_q=cu, seqused_k=kvl, block_table=bt)
    assert out.shape == (31, 8, 128)
    assert launches[-1][0].config.kernel.vo_dim == 128
    out = flash_attn_varlen_func(q, k, v, 30, cu, 70, seqused_k=kvl, block_table=bt,
                                 causal=True)
    assert out.shape == (31, 8, 128)
    w = BatchAttention(device="cpu")
    w.plan(cu, torch.tensor([0, 5, 10], dtype=torch.int32), torch.arange(10, dtype=torch.int32),
           kvl, 8, 2, 192, 128, 16, causal=True)
    out, lse = w.run(q, (k, v))
    assert out.shape == (31, 8, 128) and lse.shape == (31, 8)


def test_reference_value_columns_are_independent():
    """The reference with V's first dv columns equals its full-width output's first dv
    columns (what the GPU tests' value-head-dim cases rely on)."""
    from podcute.testing import make_batch

    b = make_batch([7, 1, 1], [50, 17, 33], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                   page_size=16, seed=3)
    full, lse = b.reference(return_lse=True)
    narrow, lse_n = pod_attention_reference_of(b, b.v_cache[..., :48])
    assert narrow.shape == (9, 8, 48)
    torch.testing.assert_close(narrow.float(), full[..., :48].float(), atol=1e-2, rtol=0)
    assert torch.equal(lse, lse_n)


def pod_attention_reference_of(b, v_cache):
    from podcute.reference import pod_attention_reference
    return pod_attention_reference(b.q, b.k_cache, v_cache, return_lse=True, **b.kwargs())


def test_cost_model_counts_the_columns_the_kernel_works_on():
    """The planner's unit costs: the tile's width twice for a tile's own head dim (the
    plans of those are unchanged), the MMA columns sm_90a runs (k-blocks of Q K^T, the
    value blocks of P V) and the caller's bytes otherwise."""
    from podcute.planning.cost import DEFAULT_COST_MODEL, PrefillTiling

    def us(d, dv=0, arch="sm_90a"):
        k = KernelConfig.select("bfloat16", d, 4, page_size=16, arch=arch, head_dim_vo=dv)
        return PrefillTiling.make(DEFAULT_COST_MODEL.for_kernel(k), k).us

    full = us(256)
    vo = us(192, 128)
    assert vo[0] == pytest.approx(full[0] * (192 + 128) / 512)  # per KV token of prefill
    assert vo[1] == pytest.approx(full[1] * (192 + 128) / 512)  # K + V bytes of a token
    assert us(80)[0] == pytest.approx(us(96)[0] * (80 + 96) / 192)  # 5 of 6 k-blocks
    assert us(80, arch="sm_80")[0] == us(96, arch="sm_80")[0]  # every k-block there
    for d in (64, 96, 128):
        k = KernelConfig.select("bfloat16", d, 4, page_size=16)
        c = DEFAULT_COST_MODEL
        assert us(d)[0] == 4.0 * d * k.tile_m_prefill * k.tile_n / c.mma_flops_per_us() / k.tile_n


def test_compile_ahead_takes_value_head_dims():
    """`python -m podcute compile --head-dims 192:128` builds the value-head-dim variants
    (every page class, causal or not, LSE or not) where the arch has the tile."""
    from podcute.__main__ import main
    from podcute.compile import shipped_variants

    keys = shipped_variants("sm_90a", head_dims=((192, 128), 128), groups=(4,))
    dims = {(k.config.head_dim, k.config.io_dim, k.config.vo_dim) for k in keys}
    assert dims == {(256, 192, 128), (128, 128, 128)} and len(keys) == 24
    assert not shipped_variants("sm_80", head_dims=((192, 128),), groups=(4,))
    assert {k.config.vo_dim for k in shipped_variants("sm_80", head_dims=((128, 64),),
                                                      groups=(4,))} == {64}
    assert main(["compile", "--head-dims", "192:x"]) == 2  # a malformed pair: usage error
