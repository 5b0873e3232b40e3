"""GPU correctness of shared-prefix plans (planning/sharing.py) against podcute.reference:
decode batches whose requests share leading pages at one or two levels, spread over the
batch in a random order, speculative rows among them, with requests that share nothing
beside them; block table and CSR; causal or not; soft-capping and sinks; a sliding
window; a multi-tile prefix (128 sharers); a CUDA graph replayed after plans that change
the sharing. `out` is poisoned with NaN before each run (marker `gpu`)."""

import random

import pytest
import torch

from podcute import PODAttention
from podcute.planning import Planner
from podcute.reference import pod_attention_reference
from podcute.testing import make_shared_prefix_batch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _share_small_batches(monkeypatch):
    # (most of these batches are below the reads at which sharing pays: share them anyway)
    monkeypatch.setattr(Planner, "share_min_read_bytes", 0)

if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3}


def _attention(*args, **kw):
    """PODAttention, or a skip where the kernel family in use lacks the configuration
    (PODCUTE_ARCH=sm_90 runs the warp-level kernel: head dims up to 128, no fp8 cache)."""
    try:
        return PODAttention(*args, **kw)
    except NotImplementedError as e:
        pytest.skip(str(e))


def _run_and_check(attn, b, fmt, dtype, causal=True, sinks=None, softcap=0.0, share=True,
                   window_size=(-1, -1)):
    kw = (dict(block_table=b.block_table) if fmt == "table"
          else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
    summary = attn.plan(b.cu_seqlens_q, b.seqused_k, causal=causal, softcap=softcap,
                        window_size=window_size, share_prefixes=share, **kw)
    out = torch.full((*b.q.shape[:2], b.v_cache.shape[-1]), float("nan"), dtype=b.q.dtype,
                     device=b.q.device)
    out, lse = attn.run(b.q, b.k_cache, b.v_cache, out=out, return_lse=True, sinks=sinks)
    torch.cuda.synchronize()
    ref, rlse = b.reference(causal=causal, return_lse=True, softcap=softcap, sinks=sinks,
                            window_size=window_size)
    assert not out.isnan().any(), "unwritten output"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= TOL[dtype], rel
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rlse[fin]).abs().max().item() <= 1e-3
    return summary, rel


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt", ["table", "csr"])
def test_shared_prefix_batches(seed, fmt):
    rng = random.Random(seed)
    hq, hkv, d = rng.choice([(32, 8, 128), (8, 2, 64), (16, 8, 256), (8, 8, 128)])
    page = rng.choice([16, 32])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    b = make_shared_prefix_batch(rng, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 page_size=page, dtype=dtype, page_format=fmt, device="cuda")
    attn = _attention(hq, hkv, d, page, dtype=dtype)
    causal = seed % 3 != 2
    summary, _ = _run_and_check(attn, b, fmt, dtype, causal=causal)
    assert summary.num_shared_prefixes > 0, str(summary)
    _run_and_check(attn, b, fmt, dtype, causal=causal, share=False)


@pytest.mark.parametrize("fmt", ["table", "csr"])
def test_shared_prefix_with_a_value_head_dim(fmt):
    """DeepSeek's 192 / 128: prefix tiles and own pieces write 128-column partials, the
    merges combine them at that width."""
    rng = random.Random(11)
    b = make_shared_prefix_batch(rng, num_qo_heads=16, num_kv_heads=2, head_dim=192,
                                 page_size=16, page_format=fmt, device="cuda",
                                 head_dim_vo=128)
    attn = _attention(16, 2, 192, 16, dtype=torch.bfloat16, head_dim_vo=128)
    summary, _ = _run_and_check(attn, b, fmt, torch.bfloat16)
    assert summary.num_shared_prefixes > 0, str(summary)


def test_shared_prefix_with_softcap_and_sinks():
    rng = random.Random(7)
    b = make_shared_prefix_batch(rng, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                 page_size=16, device="cuda")
    attn = _attention(32, 8, 128, 16)
    sinks = torch.randn(32, device="cuda")
    summary, _ = _run_and_check(attn, b, "table", torch.bfloat16, sinks=sinks, softcap=30.0)
    assert summary.num_shared_prefixes > 0


@pytest.mark.parametrize("causal", [True, False])
def test_shared_prefix_under_a_window(causal):
    """A sliding window: the nodes every row sees whole are shared, the others planned as
    without sharing (sharing.detect)."""
    rng = random.Random(21)
    b = make_shared_prefix_batch(rng, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                 page_size=16, num_groups=3, own_tokens=(1, 60),
                                 device="cuda")
    attn = _attention(32, 8, 128, 16)
    for left, runs in ((500, 0), (650, 2), (4000, 4)):  # (this batch's, on the CPU)
        window = (left, 0 if causal else 5)
        summary, _ = _run_and_check(attn, b, "table", torch.bfloat16, causal=causal,
                                    window_size=window)
        assert summary.num_shared_prefixes == runs, str(summary)


def test_many_sharers_across_tiles():
    """128 decodes share one prefix: four prefix tiles per KV head (eight on the
    warp-level kernel), each feeding 32 (16) merges."""
    rng = random.Random(3)
    b = make_shared_prefix_batch(rng, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                 page_size=16, num_groups=1, sharers=(128, 128),
                                 prefix_pages=(128, 128), sub_share=0.0, spec=0.0,
                                 own_tokens=(1, 300), others=0, device="cuda")
    attn = _attention(32, 8, 128, 16)
    summary, _ = _run_and_check(attn, b, "table", torch.bfloat16)
    # 512 packed rows a KV head, in tiles of the shortest prefill tile (128 rows on
    # sm_90a, 64 on the warp-level kernel)
    rows = attn.planner._tilings[-1].tile_m
    assert summary.num_shared_tiles == 128 * 4 // rows, str(summary)


def test_graph_replays_plans_that_change_the_sharing():
    attn = _attention(32, 8, 128, 16, max_batch_size=64, max_num_tokens=512)
    batches = [make_shared_prefix_batch(random.Random(s), num_qo_heads=32, num_kv_heads=8,
                                        head_dim=128, page_size=16, device="cuda",
                                        sharers=(2, 8))
               for s in range(4)]
    pool_pages = max(b.k_cache.shape[0] for b in batches)
    T = max(b.q.shape[0] for b in batches)
    k = torch.randn(pool_pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    b0 = batches[0]
    attn.plan(b0.cu_seqlens_q, b0.seqused_k, block_table=b0.block_table, share_prefixes=True)
    attn.run(q, k, v, out=out)  # (compile outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, k, v, out=out)
    for b in batches[1:] + batches[:1]:
        s = attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, share_prefixes=True)
        assert s.num_shared_prefixes > 0
        n = b.q.shape[0]
        q[:n] = b.q
        k[: b.k_cache.shape[0]] = b.k_cache
        v[: b.v_cache.shape[0]] = b.v_cache
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = pod_attention_reference(q[:n], k, v, cu_seqlens_q=b.cu_seqlens_q,
                                      seqused_k=b.seqused_k, block_table=b.block_table).float()
        rel = ((out[:n].float() - ref).norm() / ref.norm()).item()
        assert rel <= 5e-3, rel


@pytest.mark.parametrize("d", [128, 256])
def test_shared_prefix_over_an_fp8_cache(d):
    from podcute.testing import quantize_kv_cache

    rng = random.Random(d)
    hq, hkv = (32, 8) if d == 128 else (16, 8)
    b = make_shared_prefix_batch(rng, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 page_size=16, device="cuda")
    k8, ks = quantize_kv_cache(b.k_cache)
    v8, vs = quantize_kv_cache(b.v_cache)
    attn = _attention(hq, hkv, d, 16, kv_dtype=torch.float8_e4m3fn)
    s = attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table,
                  share_prefixes=True)
    assert s.num_shared_prefixes > 0
    out = torch.full_like(b.q, float("nan"))
    out = attn.run(b.q, k8, v8, out=out, k_scale=ks, v_scale=vs)
    ref = pod_attention_reference(b.q, k8, v8, k_scale=ks, v_scale=vs, **b.kwargs())
    torch.cuda.synchronize()
    assert not out.isnan().any()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= TOL[torch.bfloat16], rel
