"""Mixed batches for compute-sanitizer (memcheck, racecheck, synccheck) on the H200.

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py [--small]

Covers the three page classes (cp.async gather at pages 1 and 8, 16-slot TMA boxes at
page 16, whole-tile TMA boxes with a zeroed V tail at page 128), D 64 and 128, split-KV
with the in-kernel merge, decode items (both MMA warpgroups, combined in shared memory),
prefill items (ping-pong), causal and not, and a CUDA graph captured without splits
replayed after a plan with splits. Exits non-zero if an output is wrong; the sanitizer
reports the rest. `--small` shrinks the batches (racecheck is slow); `--case TEXT` runs
only the batches whose name contains TEXT (no graph replay; with `--fp8` too). `--fp8` runs only
the fp8-cache batches (e4m3 and e5m2, per-head and scalar scales, each page class: the
converting producer warps and their two-level pipeline). `--legacy` runs only FlashInfer's
legacy POD wrapper in one launch (the ragged variant: request 0's K/V from contiguous
tensors, by TMA at pages 16 and 128 and by the gather at page 1); `--cache2` only its
BatchPOD wrapper over separate prefill and decode caches in one launch (the second-cache
variant, each cache exactly its side's pages); `--shared` only shared-prefix plans (the
shared_prefix variant: prefix tiles whose rows come from several requests, own pieces
packed into one slot, the feed into each sharer's merge; TMA at page 16, the gather at 8).
"""

import sys

import torch

from podcute import PODAttention
from podcute.kernels.config import arch_head_dims
from podcute.launch import requested_arch
from podcute.planning import H100_HBM_BYTES_PER_SM_CLOCK, Planner
from podcute.reference import pod_attention_reference
from podcute.testing import handover_lengths, make_batch, quantize_kv_cache


def check(attn, b, causal, name, fp8=None, **features):
    """One run against the reference; `fp8`: (k_fp8, v_fp8, k_scale, v_scale) in place of
    the batch's caches."""
    sinks = features.pop("sinks", None)
    out = torch.full_like(b.q, float("nan"))
    if fp8 is None:
        out, lse = attn.run(b.q, b.k_cache, b.v_cache, out=out, return_lse=True, sinks=sinks)
        ref = b.reference(causal=causal, sinks=sinks, **features)
    else:
        k8, v8, ks, vs = fp8
        out, lse = attn.run(b.q, k8, v8, out=out, return_lse=True, sinks=sinks, k_scale=ks,
                            v_scale=vs)
        ref = pod_attention_reference(b.q, k8, v8, causal=causal, sinks=sinks, k_scale=ks,
                                      v_scale=vs, **features, **b.kwargs())
    torch.cuda.synchronize()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ok = rel < 5e-3 and not out.isnan().any()
    print(f"{name}: rel L2 {rel:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main(small: bool, only: str = "") -> int:
    s = 4 if small else 1
    cases = [
        # (name, Hq, Hkv, D, page, fmt, causal, q_lens, kv_lens)
        ("16-slot boxes p16 mixed+splits", 8, 2, 128, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8]),
        # the same planned as on an H100, where the warp-level kernel's lists run their
        # kinds one after the other (Planner._group_kinds)
        ("16-slot boxes p16 mixed+splits as on an H100", 8, 2, 128, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8],
         dict(hbm_bytes_per_sm_clock=H100_HBM_BYTES_PER_SM_CLOCK)),
        ("gather p8 mixed+splits", 8, 2, 128, 8, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8]),
        ("gather p1 csr D64", 8, 8, 64, 1, "csr", True, [1, 2, 200 // s], [3000 // s, 40, 500]),
        ("tma p128 non-causal tail", 16, 2, 128, 128, "table", False,
         [1, 130, 3], [4000 // s, 300, 77]),
        ("tma p128 D64 decode-only", 32, 4, 64, 128, "csr", True, [1] * 6, [9000 // s] * 6),
        # model features: head_dim 96 on each page class; window + soft cap + sinks
        # with splits (the merge adds the sink)
        ("D96 p16 mixed+splits", 8, 2, 96, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8]),
        ("D96 p1 csr non-causal", 8, 8, 96, 1, "csr", False, [1, 2, 200 // s], [3000 // s, 40, 500]),
        ("D96 p128 tail", 16, 2, 96, 128, "table", True, [1, 130, 3], [4000 // s, 300, 77]),
        ("D256 p16 mixed+splits", 8, 2, 256, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8]),
        ("D256 p128 decode-only", 32, 4, 256, 128, "csr", True, [1] * 6, [9000 // s] * 6),
        ("D256 p1 non-causal", 8, 8, 256, 1, "csr", False, [1, 2, 200 // s], [3000 // s, 40, 500]),
        # head dims between the tiles: D 160 on the 256 tile (TMA boxes of 3 of its 4
        # column blocks; the 4th zero from the start), D 80 on the 96 tile (gathered rows,
        # the last 16 columns never copied)
        ("head dim 160 p16 mixed+splits", 8, 2, 160, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8]),
        ("head dim 80 p1 csr", 8, 2, 80, 1, "csr", True, [1, 2, 200 // s],
         [3000 // s, 40, 500]),
        ("window+softcap+sinks p16", 8, 2, 128, 16, "table", True,
         [300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8],
         dict(window_size=(200, 0), softcap=20.0, sinks=True)),
        ("window+sinks p8 non-causal", 8, 2, 128, 8, "csr", False,
         [1, 40, 3], [6000 // s, 30, 900], dict(window_size=(100, 16), sinks=True)),
        ("window+softcap p128", 16, 2, 128, 128, "table", True, [1, 130, 3], [4000 // s, 300, 77],
         dict(window_size=(64, 0), softcap=30.0)),
        # a CTA list's first decode item right after a prefill tile of warpgroup 0's
        # rows: the decode hand-over's first use against warpgroup 0's O staging
        ("handover after prefill p16", 64, 8, 128, 16, "table", True,
         *handover_lengths(32 // s, 192 // s, 8)),
    ]
    ok = True
    arch = requested_arch(None) or "sm_90a"  # PODCUTE_ARCH=sm_90: the portable kernel
    for name, hq, hkv, d, page, fmt, causal, ql, kl, *feat in cases:
        if only not in name:
            continue
        if d > max(arch_head_dims(arch)):
            print(f"{name}: skipped (no {arch} kernel for head_dim {d})", flush=True)
            continue
        features = dict(feat[0]) if feat else {}
        if features.get("sinks"):
            features["sinks"] = torch.randn(hq, device="cuda")
        attn = PODAttention(hq, hkv, d, page, device="cuda")
        if "hbm_bytes_per_sm_clock" in features:  # another chip's plan
            attn.planner = Planner(hq, hkv, d, page, device="cuda", arch=attn.arch,
                                   hbm_bytes_per_sm_clock=features.pop("hbm_bytes_per_sm_clock"))
        b = make_batch(ql, kl, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       device="cuda", page_format=fmt, seed=7)
        pages = (dict(block_table=b.block_table) if fmt == "table"
                 else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
        plan_kw = {k: v for k, v in features.items() if k != "sinks"}
        attn.plan(b.cu_seqlens_q, b.seqused_k, causal=causal, **pages, **plan_kw)
        ok &= check(attn, b, causal, name, **features)

    if only:
        return 0 if ok else 1
    # Graph captured with a no-split plan, replayed after a plan with splits (issue 8).
    attn = PODAttention(4, 4, 64, 16, dtype=torch.float16, device="cuda",
                        max_batch_size=32, max_num_tokens=512, max_num_pages=32 * 200)
    n = 17
    big = make_batch([17] * n, [2048] * n, num_qo_heads=4, num_kv_heads=4, head_dim=64,
                     page_size=16, dtype=torch.float16, device="cuda", page_format="csr",
                     num_pages=n * 200, seed=3)
    small_b = make_batch([17] * n, [17] * n, num_qo_heads=4, num_kv_heads=4, head_dim=64,
                         page_size=16, dtype=torch.float16, device="cuda", page_format="csr",
                         num_pages=n * 200, seed=4)
    q, k, v = small_b.q.clone(), small_b.k_cache.clone(), small_b.v_cache.clone()
    out = torch.empty_like(q)

    def plan(b):
        return attn.plan(b.cu_seqlens_q, kv_indptr=b.kv_indptr, kv_indices=b.kv_indices,
                         last_page_len=b.last_page_len, causal=True)

    assert plan(small_b).num_merges == 0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            attn.run(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    q.copy_(big.q)
    k.copy_(big.k_cache)
    v.copy_(big.v_cache)
    assert plan(big).num_merges > 0
    out.fill_(float("nan"))
    graph.replay()
    ref = big.reference(causal=True)
    torch.cuda.synchronize()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    good = rel < 2e-3 and not out.isnan().any()
    print(f"graph no-split -> split replay: rel L2 {rel:.2e} {'ok' if good else 'FAIL'}")
    ok &= good
    return 0 if ok else 1


def main_fp8(small: bool, only: str = "") -> int:
    s = 4 if small else 1
    mixed = ([300 // s, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000 // s, 8])
    cases = [  # (name, Hq, Hkv, D, page, fmt, causal, kv dtype, per-head scales, lens)
        ("fp8 e4m3 p16 mixed+splits", 8, 2, 128, 16, "table", True, torch.float8_e4m3fn,
         True, mixed),
        ("fp8 e4m3 p128 non-causal tail", 16, 2, 128, 128, "table", False,
         torch.float8_e4m3fn, False, ([1, 130, 3], [4000 // s, 300, 77])),
        ("fp8 e4m3 p8 gather mixed+splits", 8, 2, 128, 8, "csr", True, torch.float8_e4m3fn,
         True, mixed),
        ("fp8 e5m2 p1 D96", 8, 8, 96, 1, "csr", True, torch.float8_e5m2, True,
         ([1, 2, 200 // s], [3000 // s, 40, 500])),
        ("fp8 e4m3 p64 D64 decode-only", 32, 4, 64, 64, "table", True, torch.float8_e4m3fn,
         False, ([1] * 6, [9000 // s] * 6)),
        # the decode hand-over's first use after a prefill tile (the 16-bit case's twin:
        # fp8 variants have their own warp roles and stage counts)
        ("fp8 e4m3 handover after prefill p16", 32, 4, 128, 16, "table", True,
         torch.float8_e4m3fn, True, handover_lengths(16 // s, 128 // s, 8)),
        # D 256: one producer warpgroup, Q converted in shared memory, 32-token tiles
        ("fp8 e4m3 p16 D256 mixed+splits", 8, 2, 256, 16, "table", True,
         torch.float8_e4m3fn, True, mixed),
        ("fp8 e5m2 p4 D256 gather", 8, 1, 256, 4, "csr", False, torch.float8_e5m2, False,
         ([1, 70 // s, 3], [2000 // s, 300, 33])),
    ]
    ok = True
    for name, hq, hkv, d, page, fmt, causal, kv, per_head, (ql, kl) in cases:
        if only not in name:
            continue
        attn = PODAttention(hq, hkv, d, page, device="cuda", kv_dtype=kv)
        b = make_batch(ql, kl, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       device="cuda", page_format=fmt, seed=7)
        k8, ks = quantize_kv_cache(b.k_cache, dtype=kv, per_head=per_head)
        v8, vs = quantize_kv_cache(b.v_cache, dtype=kv, per_head=per_head)
        pages = (dict(block_table=b.block_table) if fmt == "table"
                 else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
        attn.plan(b.cu_seqlens_q, b.seqused_k, causal=causal, **pages)
        ok &= check(attn, b, causal, name, fp8=(k8, v8, ks, vs))
    return 0 if ok else 1


def main_legacy(small: bool) -> int:
    from podcute.compat.flashinfer import PODWithPagedKVCacheWrapper

    s = 4 if small else 1
    hq, hkv, d = 8, 2, 128
    decode_kv = [1, 17, 3000 // s, 64, 2, 999 // s, 128, 7]
    ok = True
    for page, kv_len, qo_len in ((1, 650 // s, 200 // s), (16, 2000 // s, 129),
                                 (128, 650 // s, 64)):
        dec = make_batch([1] * len(decode_kv), decode_kv, num_qo_heads=hq, num_kv_heads=hkv,
                         head_dim=d, page_size=page, device="cuda", page_format="csr",
                         interleaved=True, seed=page)
        gen = torch.Generator(device="cuda").manual_seed(page)
        k_p, v_p = (torch.randn(kv_len, hkv, d, generator=gen, device="cuda",
                                dtype=torch.bfloat16) for _ in range(2))
        q_p = torch.randn(qo_len, hq, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        w = PODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, hq, hkv, d, page,
               q_data_type=torch.bfloat16)
        out_p, out_d = w.run(q_p, k_p, v_p, dec.q, dec.k_cache._base, causal_p=True)
        i32 = dict(dtype=torch.int32, device="cuda")
        ref_p = pod_attention_reference(
            q_p, k_p.unsqueeze(1), v_p.unsqueeze(1), cu_seqlens_q=torch.tensor([0, qo_len], **i32),
            seqused_k=torch.tensor([kv_len], **i32), kv_indptr=torch.tensor([0, kv_len], **i32),
            kv_indices=torch.arange(kv_len, **i32))
        torch.cuda.synchronize()
        for name, out, ref in (("prefill", out_p, ref_p),
                               ("decode", out_d, dec.reference(causal=True))):
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            good = rel < 5e-3 and not out.isnan().any()
            print(f"legacy one launch p{page} {name}: rel L2 {rel:.2e} "
                  f"{'ok' if good else 'FAIL'}", flush=True)
            ok &= good
        assert w._fused_key is not None  # (one launch, not the two-launch fallback)
        # Its twin with the prefill's K/V in pages: one paged batch, the plain variant.
        b = make_batch([qo_len] + [1] * len(decode_kv), [kv_len] + decode_kv,
                       num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       device="cuda", page_format="csr", seed=page)
        attn = PODAttention(hq, hkv, d, page, device="cuda")
        attn.plan(b.cu_seqlens_q, b.seqused_k, kv_indptr=b.kv_indptr, kv_indices=b.kv_indices)
        out = attn.run(b.q, b.k_cache, b.v_cache)  # (no LSE, as the legacy wrapper)
        ref = b.reference(causal=True)
        torch.cuda.synchronize()
        rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        good = rel < 5e-3 and not out.isnan().any()
        print(f"legacy's paged twin p{page}: rel L2 {rel:.2e} {'ok' if good else 'FAIL'}",
              flush=True)
        ok &= good
    return 0 if ok else 1


def main_second_cache(small: bool) -> int:
    """FlashInfer's BatchPOD with separate prefill and decode caches in one launch (the
    second-cache variant), each cache holding exactly its side's pages, renumbered from 0:
    a request that read the other cache would read past its end (memcheck) or wrong
    values."""
    from podcute.compat.flashinfer import BatchPODWithPagedKVCacheWrapper

    s = 4 if small else 1
    hq, hkv, d = 8, 2, 128
    prefill_q, prefill_kv = [300 // s, 64, 17], [700 // s, 64, 900 // s]
    decode_kv = [1, 17, 3000 // s, 64, 2, 999 // s, 128, 7]
    ok = True
    for page in (1, 16, 128):
        b = make_batch(prefill_q + [1] * len(decode_kv), prefill_kv + decode_kv,
                       num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
                       device="cuda", page_format="csr", seed=50 + page)
        n = len(prefill_q)
        ip, idx = b.kv_indptr.long(), b.kv_indices.long()
        split, end = int(ip[n]), int(ip[-1])
        i32 = dict(dtype=torch.int32, device="cuda")
        args = {}
        caches = []
        for side, rows, lo, hi in (("p", slice(0, n + 1), 0, split),
                                   ("d", slice(n, None), split, end)):
            pages = idx[lo:hi]
            caches.append((b.k_cache[pages].contiguous(), b.v_cache[pages].contiguous()))
            qo = b.cu_seqlens_q[rows].long()
            args.update({f"qo_indptr_{side}": (qo - qo[0]).to(**i32),
                         f"kv_indptr_{side}": (ip[rows] - lo).to(**i32),
                         f"kv_indices_{side}": torch.arange(hi - lo, **i32)})
        args.update(last_page_len_p=b.last_page_len[:n], last_page_len_d=b.last_page_len[n:])
        w = BatchPODWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8,
                                                        device="cuda"))
        w.plan(**args, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page,
               q_data_type=torch.bfloat16)
        total_p = int(b.cu_seqlens_q[n])
        out_p, out_d = w.run(b.q[:total_p], caches[0], b.q[total_p:], caches[1],
                             causal_p=True)
        ref = b.reference(causal=True)
        torch.cuda.synchronize()
        assert w._sides is None  # (one launch, not the per-side fallback)
        for name, out, r in (("prefill", out_p, ref[:total_p]), ("decode", out_d,
                                                                   ref[total_p:])):
            rel = ((out.float() - r.float()).norm() / r.float().norm()).item()
            good = rel < 5e-3 and not out.isnan().any()
            print(f"BatchPOD separate caches p{page} {name}: rel L2 {rel:.2e} "
                  f"{'ok' if good else 'FAIL'}", flush=True)
            ok &= good
    return 0 if ok else 1


def main_shared(small: bool) -> int:
    """Shared-prefix plans: two groups of decodes (one with a second level), speculative
    rows, a prefill beside them, in a random order; page 16 (TMA) and 8 (the gather)."""
    import random

    from podcute.testing import make_shared_prefix_batch

    ok = True
    for page, fmt in ((16, "table"), (8, "csr")):
        rng = random.Random(page)
        b = make_shared_prefix_batch(rng, num_qo_heads=8, num_kv_heads=2, head_dim=128,
                                     page_size=page, page_format=fmt, device="cuda",
                                     sharers=(2, 4) if small else (3, 12),
                                     prefix_pages=(256 // page, 512 // page))
        attn = PODAttention(8, 2, 128, page)
        attn.planner.share_min_read_bytes = 0  # (a small batch: share it anyway)
        pages = (dict(block_table=b.block_table) if fmt == "table"
                 else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
        s = attn.plan(b.cu_seqlens_q, b.seqused_k, share_prefixes=True, **pages)
        assert s.num_shared_prefixes > 0, str(s)
        ok &= check(attn, b, True, f"shared prefixes p{page} {fmt}")
    return 0 if ok else 1


if __name__ == "__main__":
    from podcute.testing import kernel_flags_from_env

    only = sys.argv[sys.argv.index("--case") + 1] if "--case" in sys.argv else ""
    with kernel_flags_from_env():  # $PODCUTE_TEST_*=0/1: KernelConfig flags (testing)
        if "--legacy" in sys.argv:
            sys.exit(main_legacy("--small" in sys.argv))
        if "--cache2" in sys.argv:
            sys.exit(main_second_cache("--small" in sys.argv))
        if "--shared" in sys.argv:
            sys.exit(main_shared("--small" in sys.argv))
        if "--fp8" in sys.argv:
            sys.exit(main_fp8("--small" in sys.argv, only))
        sys.exit(main("--small" in sys.argv, only))
