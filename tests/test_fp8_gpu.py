"""GPU correctness with fp8 KV caches (marker `gpu`): the kernel against podcute.reference
on the dequantised cache.

Each case builds test_kernel_gpu's hostile batch (NaN outside the pages in use, pools 3x
the need, random page order), quantises its caches with `quantize_kv_cache` (the NaN
garbage stays NaN: fp8 NaN codes in every unused slot), poisons `out`, runs twice and
checks rel L2 against the float32 reference on k_fp8 * k_scale, v_fp8 * v_scale (bf16
<= 5e-3, fp16 <= 2e-3: the conversion itself is exact, so the bound is the 16-bit
kernel's), the LSE, and that every output row was written. Scales come as a Python
float, a float32 [] tensor or a per-KV-head [Hkv] tensor.

PODCUTE_GPU_REPORT=path.json writes case counts and worst errors.
"""

import json
import os
import random

import pytest
import torch

from podcute import PODAttention
from podcute.reference import pod_attention_reference
from podcute.testing import (FP8_CASES, FP8_DEFAULTS, FP8_KV, FP8_RANDOM_SHAPES, FP8_SPLIT_CASES,
                             handover_lengths, make_batch, mixed_lengths,
                             quantize_kv_cache)

# (skips this module with it where there is no sm_90 GPU; the same bounds)
from tests.test_kernel_gpu import LSE_TOL, SEED0, TOL  # noqa: E402

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn

NUM_RANDOM = int(os.environ.get("PODCUTE_GPU_FP8_RANDOM", "60"))
_report = {"cases": 0, "worst_rel_l2": {}, "worst_lse_abs": 0.0}
_wrappers = {}


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    path = os.environ.get("PODCUTE_GPU_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_report, f, indent=1)


def _quantize(b, kv, scale, interleaved):
    """fp8 caches of batch b and their scales in the requested form."""
    dtype = FP8_KV[kv]
    per_head = scale == "per_head"
    k8, ks = quantize_kv_cache(b.k_cache, b.kv_layout, dtype, per_head=per_head)
    v8, vs = quantize_kv_cache(b.v_cache, b.kv_layout, dtype, per_head=per_head)
    if interleaved:  # one [P, 2, ...] fp8 tensor, as an engine's combined cache
        kv8 = torch.stack([k8, v8], dim=1)
        k8, v8 = kv8[:, 0], kv8[:, 1]
    if scale == "float":
        ks, vs = ks.item(), vs.item()
    return k8, v8, ks, vs


def check_fp8(name, q_lens, kv_lens, *, hq=FP8_DEFAULTS["hq"], hkv=FP8_DEFAULTS["hkv"],
              d=FP8_DEFAULTS["d"], page=FP8_DEFAULTS["page"], dtype=FP8_DEFAULTS["dtype"],
              causal=FP8_DEFAULTS["causal"], kv=FP8_DEFAULTS["kv"],
              scale=FP8_DEFAULTS["scale"], window_size=FP8_DEFAULTS["window_size"],
              softcap=FP8_DEFAULTS["softcap"], sinks=FP8_DEFAULTS["sinks"], layout="NHD",
              fmt="table", interleaved=False, seed=0):
    b = make_batch(q_lens, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                   page_size=page, dtype=dtype, device="cuda", kv_layout=layout,
                   page_format=fmt, seed=seed)
    k8, v8, ks, vs = _quantize(b, kv, scale, interleaved)
    key = (hq, hkv, d, page, dtype, layout, kv)
    if key not in _wrappers:
        _wrappers[key] = PODAttention(hq, hkv, d, page, dtype=dtype, kv_layout=layout,
                                      device="cuda", kv_dtype=FP8_KV[kv], max_batch_size=64,
                                      max_num_tokens=4096)
    attn = _wrappers[key]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    pages = (dict(block_table=b.block_table) if fmt == "table"
             else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
    attn.plan(cu, kvl, causal=causal, window_size=window_size, softcap=softcap, **pages)
    sink_t = None
    if sinks:
        g = torch.Generator(device="cuda").manual_seed(seed + 7)
        sink_t = torch.randn(hq, generator=g, device="cuda") * 2.0
    n = b.q.shape[0]
    outs = []
    for _ in range(2):  # twice: split-merge semaphores must be back at zero
        out = torch.full_like(b.q, float("nan"))
        outs.append(attn.run(b.q, k8, v8, out=out, return_lse=True, sinks=sink_t,
                             k_scale=ks, v_scale=vs))
    ref, ref_lse = pod_attention_reference(
        b.q, k8, v8, causal=causal, return_lse=True, window_size=window_size, softcap=softcap,
        sinks=sink_t, k_scale=ks, v_scale=vs, **b.kwargs())
    torch.cuda.synchronize()
    (out, lse), (again, lse_again) = outs
    assert not out.isnan().any(), f"{name}: unwritten or NaN output"
    assert torch.equal(out, again) and torch.equal(lse, lse_again), f"{name}: second run differs"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(inf_ref, torch.isinf(lse)), f"{name}: -inf LSE rows differ"
    fin = ~inf_ref
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    _report["cases"] += 1
    k = f"{str(dtype).replace('torch.', '')}/{kv}"
    _report["worst_rel_l2"][k] = max(_report["worst_rel_l2"].get(k, 0.0), rel)
    _report["worst_lse_abs"] = max(_report["worst_lse_abs"], lse_err)
    assert rel <= TOL[dtype], f"{name}: rel L2 {rel:.2e} > {TOL[dtype]:.0e}"
    assert lse_err <= LSE_TOL, f"{name}: LSE error {lse_err:.2e}"
    assert n == out.shape[0]


MIXED = ([300, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 2000, 8])


@pytest.mark.parametrize("cfg", FP8_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
                         or "default")
def test_fp8_mixed(cfg):
    check_fp8(f"fp8 {cfg}", *MIXED, **cfg)


@pytest.mark.parametrize("cfg", FP8_SPLIT_CASES)
def test_fp8_split_kv(cfg):
    check_fp8(f"fp8 split {cfg}", [1, 1, 2, 700], [32768, 20000, 9000, 30000], **cfg)


@pytest.mark.parametrize("page", [16, 128])
def test_fp8_decode_handover_after_prefill(page):
    # A CTA list's first decode item right after a prefill tile of warpgroup 0's rows
    # (testing.handover_lengths; tests/test_kernel_gpu.py has the 16-bit twin).
    check_fp8(f"fp8 handover p{page}", *handover_lengths(16, 128, 8), hq=32, hkv=4,
              page=page)


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("page", [16, 128])
def test_fp8_warp_decode_rows(kv, page):
    # Decode items of at most 8 packed rows read the fp8 stages on warp-level MMAs
    # (kernels/decode_fp8.py), larger ones take the converters and wgmma: GQA groups 1, 4,
    # 8 and 16 with q_len 1-3 put row counts on both sides of the limit in one batch, next
    # to a prefill; KV lengths end mid-page and mid-tile, and one is long enough to split.
    for hq, hkv in ((8, 8), (32, 8), (64, 8), (32, 2)):
        check_fp8(f"fp8 warp rows {hq}/{hkv} p{page} {kv}", [1, 2, 3, 1, 1, 40],
                  [17, 300, 1000, 65, 30000, 500], hq=hq, hkv=hkv, page=page, kv=kv,
                  dtype=torch.float16 if kv == "e5m2" else torch.bfloat16)


def test_fp8_scales_per_head_matter():
    # Per-head scales that differ by 100x: a kernel applying one head's scale to another
    # (or none) is far off.
    b = make_batch(*MIXED, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                   device="cuda", seed=3)
    k8, ks = quantize_kv_cache(b.k_cache)
    v8, vs = quantize_kv_cache(b.v_cache)
    ks = ks * torch.tensor([1.0, 100.0], device="cuda")
    vs = vs * torch.tensor([0.01, 1.0], device="cuda")
    attn = PODAttention(8, 2, 128, 16, device="cuda", kv_dtype=torch.float8_e4m3fn)
    attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table)
    out = attn.run(b.q, k8, v8, k_scale=ks, v_scale=vs)
    ref = pod_attention_reference(b.q, k8, v8, k_scale=ks, v_scale=vs, **b.kwargs())
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel <= TOL[torch.bfloat16], rel


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_fp8_nonfinite_query_spoils_only_its_row(bad):
    # bf16 queries meet an fp8 cache in fp16, scaled per warp (16 packed rows) by a power
    # of two from the largest finite |q|: one inf or NaN query value must not zero the
    # rows scaled with it. A prefill (wgmma path) and a decode of 4 rows (warp-level
    # path) each get one bad value; every other row must match the reference.
    b = make_batch([40, 1], [300, 500], num_qo_heads=8, num_kv_heads=2, head_dim=128,
                   page_size=16, device="cuda", seed=6)
    k8, ks = quantize_kv_cache(b.k_cache)
    v8, vs = quantize_kv_cache(b.v_cache)
    q = b.q.clone()
    q[5, 1, 7] = bad  # prefill token 5, head 1 (KV head 0)
    q[40, 6, 3] = bad  # the decode's token, head 6 (KV head 1)
    attn = PODAttention(8, 2, 128, 16, device="cuda", kv_dtype=torch.float8_e4m3fn)
    attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table)
    out = attn.run(q, k8, v8, k_scale=ks, v_scale=vs)
    ref = pod_attention_reference(q, k8, v8, k_scale=ks, v_scale=vs, **b.kwargs())
    good = torch.ones(q.shape[:2], dtype=torch.bool, device="cuda")
    good[5, 1] = good[40, 6] = False
    assert ref[good].isfinite().all()
    o, r = out[good].float(), ref[good].float()
    assert ((o - r).norm() / r.norm()).item() <= TOL[torch.bfloat16]


def test_fp8_device_scale_changes_without_replan():
    # A device scale tensor is read by the kernel: new values, same plan, new output.
    b = make_batch(*MIXED, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                   device="cuda", seed=4)
    k8, ks = quantize_kv_cache(b.k_cache, per_head=False)
    v8, vs = quantize_kv_cache(b.v_cache, per_head=False)
    attn = PODAttention(8, 2, 128, 16, device="cuda", kv_dtype=torch.float8_e4m3fn)
    attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table)
    vs_t = vs.clone()
    first = attn.run(b.q, k8, v8, k_scale=ks, v_scale=vs_t).clone()
    vs_t.mul_(2.0)
    second = attn.run(b.q, k8, v8, k_scale=ks, v_scale=vs_t)
    ref = pod_attention_reference(b.q, k8, v8, k_scale=ks, v_scale=vs * 2.0, **b.kwargs())
    assert ((second.float() - ref.float()).norm() / ref.float().norm()).item() <= 5e-3
    assert ((second.float() - 2 * first.float()).norm() / second.float().norm()).item() <= 1e-2


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_RANDOM))
def test_fp8_random(seed):
    rng = random.Random(5000 + seed)
    n = rng.randint(1, 20)
    causal = rng.random() < 0.8
    q_lens, kv_lens = mixed_lengths(rng, n, causal, 24000, decode_weight=3)
    hq, hkv = rng.choice(FP8_RANDOM_SHAPES["heads"])
    check_fp8(f"fp8 random {seed}", q_lens, kv_lens, hq=hq, hkv=hkv,
              d=rng.choice(FP8_RANDOM_SHAPES["head_dims"]),
              page=rng.choice(FP8_RANDOM_SHAPES["pages"]), causal=causal,
              dtype=rng.choice([torch.bfloat16, torch.float16]),
              scale=rng.choice(["per_head", "tensor", "float"]),
              fmt=rng.choice(["table", "csr"]), interleaved=rng.random() < 0.3, seed=seed)


def test_fp8_graph_replay_follows_plan_and_scales():
    # One graph captured with a float k_scale and a device v_scale tensor: replays after a
    # new plan (split KV or not) and after new v_scale values match eager runs bitwise.
    hq, hkv, d, page, n_pages = 8, 2, 128, 16, 4000
    attn = PODAttention(hq, hkv, d, page, device="cuda", kv_dtype=E4M3, max_batch_size=16,
                        max_num_tokens=512)
    batches = [make_batch(ql, kl, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                          page_size=page, device="cuda", num_pages=n_pages, seed=s)
               for s, (ql, kl) in enumerate([([5, 1, 1], [40, 300, 9]),
                                             ([1, 1, 30, 1], [20000, 7, 900, 15000])])]
    k_buf = torch.empty(n_pages, page, hkv, d, dtype=E4M3, device="cuda")
    v_buf = torch.empty_like(k_buf)
    q_buf = torch.zeros(64, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q_buf)
    v_scale = torch.ones(hkv, device="cuda")

    def load(b):
        k8, _ = quantize_kv_cache(b.k_cache, per_head=False)
        v8, vs = quantize_kv_cache(b.v_cache)
        k_buf.copy_(k8)
        v_buf.copy_(v8)
        v_scale.copy_(vs)
        q_buf[: b.q.shape[0]].copy_(b.q)
        attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table)

    load(batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            attn.run(q_buf, k_buf, v_buf, out=out, k_scale=0.02, v_scale=v_scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, k_buf, v_buf, out=out, k_scale=0.02, v_scale=v_scale)
    for b in batches + batches[:1]:
        load(b)
        for factor in (1.0, 3.0):
            v_scale.mul_(factor)
            out.fill_(float("nan"))
            graph.replay()
            replayed = out.clone()
            eager = attn.run(q_buf, k_buf, v_buf, k_scale=0.02, v_scale=v_scale)
            n = b.q.shape[0]
            assert torch.equal(replayed[:n], eager[:n])
            ref = pod_attention_reference(q_buf[:n], k_buf, v_buf, k_scale=0.02,
                                          v_scale=v_scale, **b.kwargs())
            rel = ((replayed[:n].float() - ref).norm() / ref.norm()).item()
            assert rel <= TOL[torch.bfloat16], rel
