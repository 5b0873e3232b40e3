"""GPU correctness of podcute.compat.flashinfer against podcute.reference (marker `gpu`).

Each wrapper runs hostile batches from podcute.testing.make_batch (NaN outside the pages
in use, shuffled pages) with FlashInfer-style arguments; outputs must match the float32
reference (relative L2 <= 5e-3, bf16), the LSE must be the reference's natural-log LSE
times log2(e) (FlashInfer's base 2, within 1e-3 natural), and every output row of a
token must be written (caller buffers and the allocator's free blocks are NaN-poisoned
first). Kernel variants are kept few: bf16, head_dim 128, GQA group 4, causal, pages
1 and 16, with and without LSE, the legacy wrapper's ragged variants for pages 1, 16
and 128 (it returns no LSE; its decode batch, one query token per request, is planned
causal), and BatchPOD's second-cache variants for pages 1, 16 and 128.
"""

import math

import pytest
import torch

from podcute.compat.flashinfer import (BatchAttention, BatchPODWithPagedKVCacheWrapper,
                                       PODWithPagedKVCacheWrapper)
from podcute.reference import pod_attention_reference
from podcute.testing import make_batch

pytestmark = pytest.mark.gpu

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
if not HAS_SM90:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

HQ, HKV, D = 8, 2, 128
BF16 = torch.bfloat16
TOL, LSE_TOL = 5e-3, 1e-3
_report = {"cases": 0, "worst_rel_l2": 0.0, "worst_lse_abs": 0.0}

# (prefill q, kv) and decode kv lengths of the mixed batches: a long prefill, a chunk
# with cached prefix, a short one; decodes from 1 to 3000 KV tokens.
PREFILL = ([300, 64, 17], [700, 64, 900])
DECODE_KV = [1, 17, 3000, 64, 512, 2, 999, 128, 31, 2048, 7, 300]


def workspace():
    return torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")


def poison_allocator(nbytes=256 << 20):
    """Leave NaN in the caching allocator's free blocks, so a fresh output buffer that a
    kernel fails to write shows NaN."""
    torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")


def check(name, out, lse, ref, ref_lse):
    """out (and base-2 lse, if given) against the reference rows."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not out.isnan().any(), f"{name}: unwritten or NaN output"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    _report["cases"] += 1
    _report["worst_rel_l2"] = max(_report["worst_rel_l2"], rel)
    assert rel <= TOL, f"{name}: rel L2 {rel:.2e} > {TOL:.0e}"
    if lse is None:
        return
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    inf = torch.isinf(ref_lse)
    assert torch.equal(inf, torch.isinf(lse)), f"{name}: -inf LSE rows differ"
    # FlashInfer's base-2 LSE * ln 2 = the natural-log LSE of the reference
    err = (lse[~inf] * math.log(2) - ref_lse[~inf]).abs().max().item() if (~inf).any() else 0.0
    _report["worst_lse_abs"] = max(_report["worst_lse_abs"], err)
    assert err <= LSE_TOL, f"{name}: LSE error {err:.2e} (natural log units)"


def mixed_batch(page, layout, seed=0, prefill=PREFILL, decode_kv=DECODE_KV, num_pages=None):
    """One hostile batch, prefill requests first, CSR pages in one [P, 2, ...] pool."""
    q_lens, kv_lens = prefill[0] + [1] * len(decode_kv), prefill[1] + list(decode_kv)
    return make_batch(q_lens, kv_lens, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                      page_size=page, dtype=BF16, device="cuda", kv_layout=layout,
                      page_format="csr", interleaved=True, num_pages=num_pages, seed=seed)


def pod_plan_args(b, num_prefill, on_cpu):
    """FlashInfer's BatchPOD plan() arguments for batch b split after num_prefill requests.
    The decode kv_indptr keeps its offset into the whole kv_indices (FlashInfer allows it)."""
    Bp = num_prefill
    cu, ip = b.cu_seqlens_q, b.kv_indptr
    args = dict(qo_indptr_p=cu[: Bp + 1], kv_indptr_p=ip[: Bp + 1],
                kv_indices_p=b.kv_indices[: int(ip[Bp])], last_page_len_p=b.last_page_len[:Bp],
                qo_indptr_d=cu[Bp:] - cu[Bp], kv_indptr_d=ip[Bp:], kv_indices_d=b.kv_indices,
                last_page_len_d=b.last_page_len[Bp:])
    if on_cpu:
        args = {k: v.cpu() for k, v in args.items()}
    return dict(args, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=b.page_size,
                q_data_type=BF16)


def pool_of(b):
    """The [P, 2, ...] tensor whose halves are b's caches (make_batch(interleaved=True))."""
    pool = b.k_cache._base
    assert pool is b.v_cache._base and pool.shape[1] == 2
    return pool


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_pod_matches_reference(page, layout):
    b = mixed_batch(page, layout, seed=page)
    Bp, total_p = len(PREFILL[0]), sum(PREFILL[0])
    ref, ref_lse = b.reference(causal=True, return_lse=True)
    w = BatchPODWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(**pod_plan_args(b, Bp, on_cpu=page == 1))
    pool = pool_of(b)
    q_view = (b.q[:total_p], b.q[total_p:])  # q_d follows q_p in memory: no copy
    q_copy = (b.q[:total_p].clone(), b.q[total_p:].clone())  # staged into one q
    for cache_name, cache in (("[P, 2, ...]", pool), ("(k, v)", (b.k_cache, b.v_cache))):
        for q_name, (q_p, q_d) in (("view", q_view), ("copy", q_copy)):
            name = f"BatchPOD page {page} {layout} {cache_name} q {q_name}"
            poison_allocator()
            (out_p, out_d), (lse_p, lse_d) = w.run(q_p, cache, q_d, cache, causal_p=True,
                                                   return_lse=True)
            torch.cuda.synchronize()
            assert out_p.shape == q_p.shape and out_d.shape == q_d.shape
            assert out_p.data_ptr() + out_p.shape[0] * out_p.stride(0) * 2 == out_d.data_ptr()
            check(name + " prefill", out_p, lse_p, ref[:total_p], ref_lse[:total_p])
            check(name + " decode", out_d, lse_d, ref[total_p:], ref_lse[total_p:])
    if page == 16 and layout == "NHD":  # the return_lse=False form, one variant
        out_p, out_d = w.run(q_copy[0], pool, q_copy[1], pool, causal_p=True)
        check("BatchPOD no lse prefill", out_p, None, ref[:total_p], None)
        check("BatchPOD no lse decode", out_d, None, ref[total_p:], None)


@pytest.mark.parametrize("page, layout", [(1, "NHD"), (16, "HND"), (128, "NHD")])
def test_batch_pod_separate_caches_in_one_launch(page, layout):
    # Each side's pages live in its own cache, and the other side's pages hold NaN there:
    # a request that read the wrong cache would show NaN. One launch (no per-side plans).
    b = mixed_batch(page, layout, seed=40 + page)
    Bp, total_p = len(PREFILL[0]), sum(PREFILL[0])
    ref, ref_lse = b.reference(causal=True, return_lse=True)
    w = BatchPODWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(**pod_plan_args(b, Bp, on_cpu=True))
    ip, idx = b.kv_indptr.cpu().long(), b.kv_indices.cpu().long()
    split = int(ip[Bp])
    pages_p, pages_d = set(idx[:split].tolist()), set(idx[split: int(ip[-1])].tolist())
    cache_p, cache_d = pool_of(b).clone(), pool_of(b).clone()
    cache_p[sorted(pages_d - pages_p)] = float("nan")
    cache_d[sorted(pages_p - pages_d)] = float("nan")
    for return_lse in (True, False):
        poison_allocator()
        res = w.run(b.q[:total_p], cache_p, b.q[total_p:], cache_d, causal_p=True,
                    return_lse=return_lse)
        torch.cuda.synchronize()
        assert w._sides is None
        (out_p, out_d), (lse_p, lse_d) = res if return_lse else (res, (None, None))
        name = f"BatchPOD separate caches page {page} {layout}"
        check(name + " prefill", out_p, lse_p, ref[:total_p],
              ref_lse[:total_p] if return_lse else None)
        check(name + " decode", out_d, lse_d, ref[total_p:],
              ref_lse[total_p:] if return_lse else None)


def test_batch_pod_cuda_graph_replay_after_replan():
    """Capture run() once, plan another batch with the same prefill token count (the
    capture fixes it) and a different decode batch, load its data, replay."""
    page, num_pages, rows_d = 16, 1000, 24  # batch B needs 899 pages
    # (batch, number of prefill requests): 256 prefill tokens each
    batches = [(mixed_batch(page, "NHD", seed=10, prefill=([200, 56], [900, 56]),
                            decode_kv=DECODE_KV[:10], num_pages=num_pages), 2),
               (mixed_batch(page, "NHD", seed=11, prefill=([100, 100, 56], [100, 2000, 300]),
                            decode_kv=DECODE_KV + DECODE_KV[:8], num_pages=num_pages), 3)]
    total_p = 256
    pool = torch.empty_like(pool_of(batches[0][0]))
    q_p = torch.empty(total_p, HQ, D, dtype=BF16, device="cuda")
    q_d = torch.empty(rows_d, HQ, D, dtype=BF16, device="cuda")
    w = BatchPODWithPagedKVCacheWrapper(workspace(), "NHD")

    def load(b, num_prefill):
        w.plan(**pod_plan_args(b, num_prefill, on_cpu=True))
        pool.copy_(pool_of(b))
        q_p.copy_(b.q[:total_p])
        q_d.fill_(float("nan"))  # padding rows past the decode batch: never read
        q_d[: b.q.shape[0] - total_p].copy_(b.q[total_p:])

    load(*batches[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # eager warm-up: the first re-plans for causal_p=True
            w.run(q_p, pool, q_d, pool, causal_p=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out_p, out_d), (lse_p, lse_d) = w.run(q_p, pool, q_d, pool, causal_p=True,
                                               return_lse=True)
    for i, (b, num_prefill) in enumerate(batches + batches[:1]):
        load(b, num_prefill)
        for t in (out_p, out_d, lse_p, lse_d):
            t.fill_(float("nan"))
        graph.replay()
        (e_p, e_d), (el_p, el_d) = w.run(q_p, pool, q_d, pool, causal_p=True, return_lse=True)
        torch.cuda.synchronize()
        n_d = b.q.shape[0] - total_p
        assert torch.equal(out_p, e_p) and torch.equal(out_d[:n_d], e_d[:n_d])
        assert torch.equal(lse_p, el_p) and torch.equal(lse_d[:n_d], el_d[:n_d])
        assert out_d[n_d:].isnan().all(), "padding rows of q_d written"
        ref, ref_lse = b.reference(causal=True, return_lse=True)
        check(f"graph replay {i} prefill", out_p, lse_p, ref[:total_p], ref_lse[:total_p])
        check(f"graph replay {i} decode", out_d[:n_d], lse_d[:n_d], ref[total_p:],
              ref_lse[total_p:])
    other = mixed_batch(page, "NHD", seed=12, prefill=([100], [100]), num_pages=num_pages)
    with pytest.raises(ValueError, match="captured"):
        w.plan(**pod_plan_args(other, 1, on_cpu=True))


class _Launches:
    """Counts podcute kernel launches (podcute.api.launch) while active."""

    def __init__(self, monkeypatch):
        import podcute.api as api
        self.count, inner = 0, api.launch

        def counted(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)
        monkeypatch.setattr(api, "launch", counted)


def legacy_case(page, layout, kv_len, qo_len, seed, decode_kv=DECODE_KV):
    """A legacy-wrapper batch: a paged decode batch (NaN pools, shuffled pages) and one
    prefill whose ragged K/V are strided halves of one [L, 2, Hkv, D] tensor (in
    `layout`), with q_p and q_d cut from one q tensor. Returns (decode batch, q_p, k_p,
    v_p, the prefill's reference output)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dec = make_batch([1] * len(decode_kv), decode_kv, num_qo_heads=HQ, num_kv_heads=HKV,
                     head_dim=D, page_size=page, dtype=BF16, device="cuda", kv_layout=layout,
                     page_format="csr", interleaved=True, seed=seed)
    kv = torch.randn(kv_len, 2, HKV, D, generator=gen, device="cuda", dtype=BF16)
    q = torch.randn(qo_len + len(decode_kv), HQ, D, generator=gen, device="cuda", dtype=BF16)
    q[qo_len:] = dec.q
    k_p, v_p = kv[:, 0], kv[:, 1]
    if layout == "HND":
        k_p, v_p = k_p.transpose(0, 1), v_p.transpose(0, 1)
    i32 = dict(dtype=torch.int32, device="cuda")
    ref_p = pod_attention_reference(
        q[:qo_len], kv[:, 0].unsqueeze(1), kv[:, 1].unsqueeze(1),
        cu_seqlens_q=torch.tensor([0, qo_len], **i32), seqused_k=torch.tensor([kv_len], **i32),
        kv_indptr=torch.tensor([0, kv_len], **i32), kv_indices=torch.arange(kv_len, **i32))
    return dec, q, k_p, v_p, ref_p


def legacy_wrapper(dec, layout):
    w = PODWithPagedKVCacheWrapper(workspace(), layout)
    w.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, HQ, HKV, D, dec.page_size,
           q_data_type=BF16)
    return w


# Pages of 1 (the cp.async gather), 16 (16-slot TMA boxes), 128 (whole-tile boxes); KV
# lengths on and off a page and tile boundary; a one-token prefill (a decode item).
@pytest.mark.parametrize("page", [1, 16, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_len, qo_len", [(640, 200), (650, 200), (5000, 129), (40, 1)])
def test_legacy_pod_one_launch_matches_reference(page, layout, kv_len, qo_len, monkeypatch):
    """The prefill (request 0, its K/V from the ragged tensors) and the decode batch in
    one launch of the ragged variant."""
    dec, q, k_p, v_p, ref_p = legacy_case(page, layout, kv_len, qo_len, seed=kv_len + page)
    w = legacy_wrapper(dec, layout)
    launches = _Launches(monkeypatch)
    for q_p, q_d in ((q[:qo_len], q[qo_len:]),  # one q tensor: a view
                     (q[:qo_len].clone(), q[qo_len:].clone())):  # two: one torch.cat
        poison_allocator()
        out_p, out_d = w.run(q_p, k_p, v_p, q_d, pool_of(dec), causal_p=True,
                             kv_layout_p=layout)
        torch.cuda.synchronize()
        name = f"legacy POD page {page} {layout} kv {kv_len} q {qo_len}"
        check(f"{name} prefill", out_p, None, ref_p, None)
        check(f"{name} decode", out_d, None, dec.reference(causal=True), None)
    assert launches.count == 2 and w._prefill_key is None  # one a run(), no prefill-only plan


def test_legacy_pod_two_launches_when_the_settings_differ(monkeypatch):
    """A prefill sm_scale other than the decode side's cannot share its plan: two launches,
    both still right."""
    dec, q, k_p, v_p, _ = legacy_case(16, "NHD", 650, 200, seed=5)
    w = legacy_wrapper(dec, "NHD")
    scale = 0.5 / math.sqrt(D)
    launches = _Launches(monkeypatch)
    poison_allocator()
    out_p, out_d = w.run(q[:200], k_p, v_p, q[200:], pool_of(dec), causal_p=True,
                         sm_scale_p=scale)
    torch.cuda.synchronize()
    i32 = dict(dtype=torch.int32, device="cuda")
    ref_p = pod_attention_reference(
        q[:200], k_p.unsqueeze(1), v_p.unsqueeze(1), sm_scale=scale,
        cu_seqlens_q=torch.tensor([0, 200], **i32), seqused_k=torch.tensor([650], **i32),
        kv_indptr=torch.tensor([0, 650], **i32), kv_indices=torch.arange(650, **i32))
    check("legacy POD two launches prefill", out_p, None, ref_p, None)
    check("legacy POD two launches decode", out_d, None, dec.reference(causal=True), None)
    assert launches.count == 2 and w._fused_key is None


def test_legacy_pod_cuda_graph_replay_after_replan():
    """A captured run() replays, after plan() with a new decode batch (other lengths and
    pages over the same pool), what an eager run() computes for it, bitwise, beside the
    prefill shape it was captured with."""
    dec, q, k_p, v_p, _ = legacy_case(16, "NHD", 650, 200, seed=7)
    other = make_batch([1] * len(DECODE_KV), DECODE_KV[::-1], num_qo_heads=HQ,
                       num_kv_heads=HKV, head_dim=D, page_size=16, dtype=BF16, device="cuda",
                       page_format="csr", interleaved=True, num_pages=dec.k_cache.shape[0],
                       seed=8)
    pool, saved = pool_of(dec), pool_of(dec).clone()
    w = PODWithPagedKVCacheWrapper(workspace(), "NHD")
    plan_args = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16,
                     q_data_type=BF16)
    w.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, **plan_args)
    w.run(q[:200], k_p, v_p, q[200:], pool, causal_p=True)  # plans the fused batch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out_p, g_out_d = w.run(q[:200], k_p, v_p, q[200:], pool, causal_p=True)
    for b, data in ((other, pool_of(other)), (dec, saved)):
        pool.copy_(data)
        q[200:] = b.q
        w.plan(b.kv_indptr, b.kv_indices, b.last_page_len, **plan_args)
        g_out_d.fill_(float("nan"))
        graph.replay()
        eager_p, eager_d = w.run(q[:200], k_p, v_p, q[200:], pool, causal_p=True)
        torch.cuda.synchronize()
        assert torch.equal(g_out_p, eager_p) and torch.equal(g_out_d, eager_d)
        check("legacy POD graph replay decode", g_out_d, None, b.reference(causal=True), None)


@pytest.mark.parametrize("page", [1, 16])
def test_batch_attention_matches_reference(page):
    b = mixed_batch(page, "HND" if page == 16 else "NHD", seed=20 + page)
    ref, ref_lse = b.reference(causal=True, return_lse=True)
    total, pad = b.q.shape[0], 5
    q = torch.cat([b.q, torch.full((pad, HQ, D), float("nan"), dtype=BF16, device="cuda")])
    w = BatchAttention(b.kv_layout, device="cuda")
    w.plan(b.cu_seqlens_q, b.kv_indptr, b.kv_indices, b.seqused_k, HQ, HKV, D, D, page,
           causal=True, sm_scale=1 / math.sqrt(D))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], HQ), float("nan"), device="cuda")
    for cache in (pool_of(b), (b.k_cache, b.v_cache)):
        o, l = w.run(q, cache, out=out, lse=lse)
        torch.cuda.synchronize()
        assert o is out and l is lse
        assert out[total:].isnan().all() and lse[total:].isnan().all(), "padding rows written"
        check(f"BatchAttention page {page}", out[:total], lse[:total], ref, ref_lse)
    poison_allocator()
    o, l = w.run(q, pool_of(b))  # fresh buffers
    torch.cuda.synchronize()
    check(f"BatchAttention page {page} fresh", o[:total], l[:total], ref, ref_lse)


# --------------------------------------------------------------------------------------
# fp8 KV caches: kv_data_type e4m3, k_scale / v_scale at run()
# --------------------------------------------------------------------------------------

FP8_TOL = 1e-2  # issue 11's bound with 16-bit queries, against the dequantised cache


def quantized_pool(b, per_head):
    """b's [P, 2, ...] pool in e4m3 (K and V halves quantised apart, FlashInfer's layout)
    with its scales (floats for per-tensor, [Hkv] tensors per head) and b with the
    dequantised caches for the reference."""
    import dataclasses

    from podcute.testing import quantize_kv_cache

    k8, ks = quantize_kv_cache(b.k_cache, b.kv_layout, per_head=per_head)
    v8, vs = quantize_kv_cache(b.v_cache, b.kv_layout, per_head=per_head)
    pool8 = torch.stack([k8, v8], dim=1)
    shape = (1, 1, -1, 1) if b.kv_layout == "NHD" else (1, -1, 1, 1)

    def deq(x8, s):
        return (x8.float() * (s.view(shape) if per_head else s)).to(BF16)

    ref_b = dataclasses.replace(b, k_cache=deq(k8, ks), v_cache=deq(v8, vs))
    scales = (ks, vs) if per_head else (ks.item(), vs.item())
    return pool8, scales, ref_b


def check_fp8(name, out, ref):
    assert not out.isnan().any(), f"{name}: unwritten or NaN output"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= FP8_TOL, f"{name}: rel L2 {rel:.2e} > {FP8_TOL:.0e}"


@pytest.mark.usefixtures("fp8_kernel")
@pytest.mark.parametrize("per_head", [True, False])
def test_batch_pod_fp8_cache(per_head):
    """One launch over an e4m3 pool; the scales apply to both sides (the same cache)."""
    b = mixed_batch(16, "NHD", seed=30)
    Bp, total_p = len(PREFILL[0]), sum(PREFILL[0])
    pool8, (ks, vs), ref_b = quantized_pool(b, per_head)
    ref, ref_lse = ref_b.reference(causal=True, return_lse=True)
    w = BatchPODWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(**dict(pod_plan_args(b, Bp, on_cpu=True), kv_data_type=torch.float8_e4m3fn))
    poison_allocator()
    (out_p, out_d), (lse_p, lse_d) = w.run(b.q[:total_p], pool8, b.q[total_p:], pool8,
                                           causal_p=True, return_lse=True, k_scale=ks,
                                           v_scale=vs)
    torch.cuda.synchronize()
    check_fp8("BatchPOD fp8 prefill", out_p, ref[:total_p])
    check_fp8("BatchPOD fp8 decode", out_d, ref[total_p:])
    fin = torch.isfinite(ref_lse)
    err = (torch.cat([lse_p, lse_d]) * math.log(2) - ref_lse)[fin].abs().max().item()
    assert err <= 1e-2, f"BatchPOD fp8 LSE error {err:.2e}"


@pytest.mark.usefixtures("fp8_kernel")
def test_legacy_pod_fp8_decode_cache():
    """The older wrapper: the decode pool in e4m3 with float scales, the prefill's ragged
    K/V in bf16."""
    qo_len, kv_len = 100, 320
    dec = make_batch([1] * len(DECODE_KV), DECODE_KV, num_qo_heads=HQ, num_kv_heads=HKV,
                     head_dim=D, page_size=16, dtype=BF16, device="cuda",
                     page_format="csr", interleaved=True, seed=31)
    pool8, (ks, vs), ref_dec = quantized_pool(dec, per_head=False)
    gen = torch.Generator(device="cuda").manual_seed(31)
    k_p, v_p = (torch.randn(kv_len, HKV, D, generator=gen, device="cuda", dtype=BF16)
                for _ in range(2))
    q_p = torch.randn(qo_len, HQ, D, generator=gen, device="cuda", dtype=BF16)
    w = PODWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, HQ, HKV, D, 16,
           q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    poison_allocator()
    out_p, out_d = w.run(q_p, k_p, v_p, dec.q, pool8, causal_p=True, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    i32 = dict(dtype=torch.int32, device="cuda")
    ref_p = pod_attention_reference(
        q_p, k_p.unsqueeze(1), v_p.unsqueeze(1),
        cu_seqlens_q=torch.tensor([0, qo_len], **i32), seqused_k=torch.tensor([kv_len], **i32),
        kv_indptr=torch.tensor([0, kv_len], **i32), kv_indices=torch.arange(kv_len, **i32))
    check("legacy POD fp8 prefill (bf16 K/V)", out_p, None, ref_p, None)
    check_fp8("legacy POD fp8 decode", out_d, ref_dec.reference(causal=True))


@pytest.mark.usefixtures("fp8_kernel")
def test_batch_attention_fp8_cache():
    b = mixed_batch(1, "NHD", seed=32)
    pool8, (ks, vs), ref_b = quantized_pool(b, per_head=True)
    ref = ref_b.reference(causal=True)
    w = BatchAttention("NHD", device="cuda")
    w.plan(b.cu_seqlens_q, b.kv_indptr, b.kv_indices, b.seqused_k, HQ, HKV, D, D, 1,
           causal=True, q_data_type=BF16, kv_data_type=torch.float8_e4m3fn)
    poison_allocator()
    out, lse = w.run(b.q, pool8, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    check_fp8("BatchAttention fp8", out, ref)
