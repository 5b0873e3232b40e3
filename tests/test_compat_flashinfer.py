"""podcute.compat.flashinfer on a CPU machine: FlashInfer-style plan() arguments become the
right podcute plan, every unsupported FlashInfer feature raises a named error, paged KV
caches unpack into views, and run() validates its arguments before it raises podcute's
RuntimeError for the missing Hopper GPU."""

import math

import numpy as np
import pytest
import torch

from podcute.compat.flashinfer import (LOG2E, BatchAttention, BatchPODWithPagedKVCacheWrapper,
                                       PODWithPagedKVCacheWrapper, _ragged_as_pages,
                                       _rows_in_sequence, unpack_paged_kv_cache)

HQ, HKV, D, PS = 8, 2, 128, 16
BF16 = torch.bfloat16
NUM_PAGES = 12


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def workspace():
    return torch.empty(1024, dtype=torch.uint8)  # CPU: plan on the host only


# Prefill batch: 2 requests (q 20 / kv 32, q 30 / kv 30), CSR pages 7 8 | 9 10.
# Decode batch: 3 requests (kv 5, 32, 1); its kv_indptr starts at 3 (entries 0-2 unused).
PREFILL = dict(qo_indptr_p=i32(0, 20, 50), kv_indptr_p=i32(0, 2, 4),
               kv_indices_p=i32(7, 8, 9, 10), last_page_len_p=i32(16, 14))
DECODE = dict(qo_indptr_d=i32(0, 1, 2, 3), kv_indptr_d=i32(3, 4, 6, 7),
              kv_indices_d=i32(99, 99, 99, 1, 2, 3, 4), last_page_len_d=i32(5, 16, 1))
HEADS = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS)


def batch_pod(layout="NHD", **kw):
    w = BatchPODWithPagedKVCacheWrapper(workspace(), layout)
    args = {**PREFILL, **DECODE, **HEADS, "q_data_type": BF16, **kw}
    w.plan(**args)
    return w


def caches(layout="NHD", num_pages=NUM_PAGES, page=PS):
    tail = (page, HKV, D) if layout == "NHD" else (HKV, page, D)
    return torch.randn(num_pages, 2, *tail, dtype=BF16)


def pod_inputs(layout="NHD"):
    q = torch.randn(53, HQ, D, dtype=BF16)
    return q[:50], q[50:], caches(layout)


def legacy(**kw):
    w = PODWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(i32(0, 2, 3, 5), i32(0, 1, 2, 3, 4), i32(16, 3, 1), HQ, HKV, D, PS,
           **{"q_data_type": BF16, **kw})
    return w


def batch_attention(device="cpu", **kw):
    w = BatchAttention("NHD", device=device)
    args = dict(qo_indptr=i32(0, 20, 21), kv_indptr=i32(0, 3, 5), kv_indices=i32(0, 1, 2, 5, 6),
                kv_len_arr=i32(40, 17), num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                head_dim_vo=D, page_size=PS, causal=True)
    w.plan(**{**args, **kw})
    return w


def raises(exc, *words):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{w})" for w in words))


# --------------------------------------------------------------------------------------
# BatchPODWithPagedKVCacheWrapper
# --------------------------------------------------------------------------------------


def test_batch_pod_plans_one_concatenated_batch():
    w = batch_pod(sm_scale=0.1)
    plan = w._attn.current_plan
    s = plan.summary
    assert (s.num_requests, s.num_prefill_requests, s.num_decode_requests) == (5, 2, 3)
    assert (plan.total_q, plan.batch_size) == (53, 5)
    assert plan.q_start.tolist() == [0, 20, 50, 51, 52, 53]
    # kv_len = (pages - 1) * page_size + last_page_len
    assert plan.kv_len.tolist() == [32, 30, 5, 32, 1]
    # decode indptr rebased (started at 3) and appended after the prefill's 4 entries
    assert plan.page_list.tolist() == [7, 8, 9, 10, 1, 2, 3, 4]
    assert plan.page_start.tolist() == [0, 2, 4, 5, 7]
    assert plan.sm_scale == 0.1 and plan.causal is False  # FlashInfer's causal_p default
    assert w._attn.dtype == BF16 and w._attn.kv_layout == "NHD"
    assert w.device == torch.device("cpu") and not w.is_cuda_graph_enabled


def test_batch_pod_dtype_arguments_resolve_as_flashinfer():
    w = batch_pod(q_data_type="float16")
    assert w._attn.dtype == torch.float16
    w = batch_pod(q_data_type=None, data_type="bfloat16")
    assert w._attn.dtype == BF16
    # FlashInfer's default q_data_type is float16 and data_type only fills None fields
    with raises(NotImplementedError, "kv_data_type", "float16"):
        batch_pod(q_data_type="float16", data_type=BF16)
    with raises(ValueError, "q_data_type", "nonsense"):
        batch_pod(q_data_type="nonsense")
    with raises(TypeError, "q_data_type"):
        batch_pod(q_data_type=3)


def test_batch_pod_caches_attention_per_configuration():
    w = batch_pod()
    first = w._attn
    w.plan(**PREFILL, **DECODE, **HEADS, q_data_type=BF16)
    assert w._attn is first
    w.plan(**PREFILL, **DECODE, **{**HEADS, "num_qo_heads": 4}, q_data_type=BF16)
    assert w._attn is not first and w._attn.num_qo_heads == 4


@pytest.mark.parametrize("name, value, words", [
    ("qo_indptr_d", i32(1, 2, 3, 4), ["qo_indptr_d", "start at 0"]),
    ("qo_indptr_p", i32(0, 30, 20), ["qo_indptr_p", "non-decreasing"]),
    ("kv_indptr_p", i32(0, 2), ["kv_indptr_p", "3 entries"]),
    ("kv_indptr_d", i32(3, 4, 6, 9), ["kv_indptr_d", "exceeds", "kv_indices_d"]),
    ("kv_indices_p", torch.tensor([7, 8, 9, 10]), ["kv_indices_p", "int32"]),
    ("last_page_len_d", i32(5, 16), ["last_page_len_d", "3 entries", "\\(2,\\)"]),
    ("last_page_len_d", i32(5, 17, 1), ["last_page_len_p/_d\\[3\\]", "decode request i",
                                        "request 2 \\+ i"]),
])
def test_batch_pod_plan_errors_name_flashinfer_arguments(name, value, words):
    args = {**PREFILL, **DECODE, name: value}
    w = BatchPODWithPagedKVCacheWrapper(workspace())
    exc = TypeError if "int32" in words else ValueError
    with raises(exc, *words):
        w.plan(**args, **HEADS, q_data_type=BF16)
    assert w._attn is None  # no stale plan


@pytest.mark.parametrize("kw, words", [
    (dict(pos_encoding_mode="ROPE_LLAMA"), ["pos_encoding_mode", "NONE"]),
    (dict(rope_scale=1.0), ["rope_scale"]),
    (dict(rope_theta=1e4), ["rope_theta"]),
    (dict(kv_data_type=torch.float32), ["kv_data_type", "float8_e4m3fn"]),
    (dict(q_data_type=torch.float32), ["q_data_type", "bfloat16"]),
])
@pytest.mark.parametrize("wrapper", ["batch_pod", "legacy"])
def test_unsupported_plan_arguments_raise(wrapper, kw, words):
    with raises(NotImplementedError, *words):
        (batch_pod if wrapper == "batch_pod" else legacy)(**kw)


@pytest.mark.parametrize("wrapper", ["batch_pod", "legacy"])
def test_window_left_is_a_left_window(wrapper):
    # FlashInfer's window_left = L: keys p - L .. p (causal) or p - L .. end (not causal):
    # podcute's window_size (L, -1), whose right edge causal clips to 0.
    w = (batch_pod if wrapper == "batch_pod" else legacy)(window_left=128)
    attn = w._attn if wrapper == "batch_pod" else w._decode
    opt = attn.current_plan.options
    assert (opt.window_left, opt.window_right) == (128, -1)
    with raises(ValueError, "window_left", ">= 0"):
        (batch_pod if wrapper == "batch_pod" else legacy)(window_left=-5)
    with raises(TypeError, "window_left", "int"):
        (batch_pod if wrapper == "batch_pod" else legacy)(window_left=1.5)


@pytest.mark.parametrize("kw, words", [
    (dict(custom_mask_p=torch.ones(10, dtype=torch.bool)), ["custom_mask_p", "None"]),
    (dict(packed_custom_mask_p=torch.ones(2, dtype=torch.uint8)), ["packed_custom_mask_p"]),
    (dict(q_scale=0.5), ["q_scale", "fp8"]),
    (dict(k_scale=2.0), ["k_scale", "kv_data_type", "float8"]),
    (dict(use_fp16_qk_reduction=True), ["use_fp16_qk_reduction", "fp32"]),
])
def test_batch_pod_unsupported_run_arguments_raise(kw, words):
    w = batch_pod()
    q_p, q_d, kv = pod_inputs()
    with raises(NotImplementedError, *words):
        w.run(q_p, kv, q_d, kv, **kw)
    # the neutral values are accepted (and the call gets as far as the device check)
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, kv, q_d, kv, q_scale=1.0, k_scale=None, v_scale=1.0, enable_pdl=True)


def test_batch_pod_separate_caches_run_in_one_launch(launches):
    # The decode cache is the launch's first, the prefill cache its second, which the
    # plan's first num_prefill requests read (a second_cache launch; plan word 6).
    w = batch_pod()
    q_p, q_d, kv = pod_inputs()
    kv_d = torch.randn(5, *kv.shape[1:], dtype=BF16)  # pages 0-4: the decode side's
    w.run(q_p, kv, q_d, kv_d)
    (plan, q, k, v, out, lse, kw), = launches
    assert plan.second_cache_requests == 2 and plan.batch_size == 5
    assert int(plan.params.view(torch.int32)[6]) == 2
    assert k.data_ptr() == kv_d[:, 0].data_ptr() and v.data_ptr() == kv_d[:, 1].data_ptr()
    k2, v2 = kw["second_cache"]
    assert k2.data_ptr() == kv[:, 0].data_ptr() and v2.data_ptr() == kv[:, 1].data_ptr()
    assert w._sides is None and q.shape[0] == 53
    # each request's pages are checked against its own cache: the prefill side reads
    # pages 7-10 of its 12, the decode side pages 1-4 of its 5
    with raises(ValueError, "kv_indices", "request 1", "page 10", "paged_kv_cache_p",
                "has only 10 pages"):
        w.run(q_p, kv[:10], q_d, kv_d)
    with raises(ValueError, "kv_indices", "request 4", "page 4", "paged_kv_cache_d",
                "has only 4 pages"):
        w.run(q_p, kv, q_d, kv_d[:4])
    # the second cache gets run()'s checks under its own name
    with raises(ValueError, "paged_kv_cache_p"):
        w.run(q_p, kv[:, :, :8], q_d, kv_d)
    with raises(TypeError, "paged_kv_cache_d"):
        w.run(q_p, kv, q_d, kv_d.half())
    # the same cache given two ways is one cache: the plain launch
    launches.clear()
    w.run(q_p, kv, q_d, (kv[:, 0], kv[:, 1]))
    assert launches[0][6]["second_cache"] is None


def test_batch_pod_causal_with_multi_token_decode_raises():
    args = {**PREFILL, **DECODE, "qo_indptr_d": i32(0, 1, 3, 4)}
    w = BatchPODWithPagedKVCacheWrapper(workspace())
    w.plan(**args, **HEADS, q_data_type=BF16)
    q = torch.randn(54, HQ, D, dtype=BF16)
    kv = caches()
    with raises(NotImplementedError, "causal_p=True", "2 query tokens"):
        w.run(q[:50], kv, q[50:], kv, causal_p=True)
    with raises(RuntimeError, "Hopper"):  # non-causal is fine
        w.run(q[:50], kv, q[50:], kv, causal_p=False)
    # Separate caches: each side runs alone (FlashInfer's decode side has no mask)
    with raises(RuntimeError, "Hopper"):  # planned per side, then the device check
        w.run(q[:50], kv, q[50:], kv.clone(), causal_p=True)
    causal, (p, d) = w._sides
    assert causal is True and p.current_plan.causal and not d.current_plan.causal
    assert p.current_plan.batch_size + d.current_plan.batch_size == w._batch.cu.size - 1


def test_batch_pod_run_validates_before_the_device():
    w = batch_pod()
    q_p, q_d, kv = pod_inputs()
    with raises(TypeError, "q_p", "bfloat16"):
        w.run(q_p.half(), kv, q_d, kv)
    with raises(ValueError, "q_p", "49 rows", "50"):
        w.run(q_p[:49], kv, q_d, kv)
    with raises(ValueError, "q_p", "51 rows"):  # the decode rows follow q_p's: exact
        w.run(torch.randn(51, HQ, D, dtype=BF16), kv, q_d, kv)
    with raises(ValueError, "q_d", "2 rows", "3"):
        w.run(q_p, kv, q_d[:2], kv)
    with raises(ValueError, "q_d", "num_qo_heads"):
        w.run(q_p, kv, torch.randn(3, HQ, 64, dtype=BF16), kv)
    kv_half = kv.half()
    with raises(TypeError, "paged_kv_cache_p", "bfloat16"):
        w.run(q_p, kv_half, q_d, kv_half)
    with raises(TypeError, "paged_kv_cache_p", "tuple"):
        w.run(q_p, [kv[:, 0], kv[:, 1]], q_d, kv)
    with raises(TypeError, "causal_p", "bool"):
        w.run(q_p, kv, q_d, kv, causal_p=1)
    with raises(ValueError, "k_cache"):  # podcute's own checks: page 10 of a 8-page pool
        w.run(q_p, kv[:8], q_d, kv[:8])
    with raises(RuntimeError, "before plan"):
        BatchPODWithPagedKVCacheWrapper(workspace()).run(q_p, kv, q_d, kv)


def test_batch_pod_run_needs_hopper_after_fusing_q():
    w = batch_pod("HND")
    q_p, q_d, kv = pod_inputs("HND")
    with raises(RuntimeError, "Hopper", "sm_90a"):
        w.run(q_p, kv, q_d, kv, return_lse=True)
    assert not w._staging  # q_d follows q_p in memory: one view, no staging copy
    with raises(RuntimeError, "Hopper"):
        w.run(q_p.clone(), kv, q_d.clone(), kv)
    (buf,) = w._staging.values()
    assert buf.shape == (53, HQ, D)
    assert torch.equal(buf[:50], q_p) and torch.equal(buf[50:], q_d)
    w.plan(**PREFILL, **DECODE, **HEADS, q_data_type=BF16)  # same size: same buffer
    assert next(iter(w._staging.values())) is buf


def test_batch_pod_causal_replan_checks_lengths():
    # q_len 40 > kv_len 32 is valid with the mask too (its first 8 rows see no key)
    w = BatchPODWithPagedKVCacheWrapper(workspace())
    w.plan(**{**PREFILL, **DECODE, "qo_indptr_p": i32(0, 40, 70)}, **HEADS, q_data_type=BF16)
    q, kv = torch.randn(73, HQ, D, dtype=BF16), caches()
    with raises(RuntimeError, "Hopper"):
        w.run(q[:70], kv, q[70:], kv, causal_p=True)
    assert w._attn.current_plan.causal


def test_batch_pod_replans_once_for_causal_p():
    w = batch_pod()
    q_p, q_d, kv = pod_inputs()
    assert w._attn.current_plan.causal is False
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, kv, q_d, kv, causal_p=True)
    plan = w._attn.current_plan
    assert plan.causal is True and plan.q_start.tolist() == [0, 20, 50, 51, 52, 53]
    # the next plan() plans with the causal_p of the last run()
    w.plan(**PREFILL, **DECODE, **HEADS, q_data_type=BF16)
    assert w._attn.current_plan.causal is True


def test_rows_in_sequence():
    q = torch.randn(10, HQ, D)
    fused = _rows_in_sequence(q[:6], q[6:])
    assert fused.data_ptr() == q.data_ptr() and torch.equal(fused, q)
    assert _rows_in_sequence(q[:6], q[7:]) is None
    assert _rows_in_sequence(q[:6], q[6:].clone()) is None
    qkv = torch.randn(10, HQ + 2 * HKV, D)  # strided q of a fused QKV tensor
    fused = _rows_in_sequence(qkv[:4, :HQ], qkv[4:, :HQ])
    assert torch.equal(fused, qkv[:, :HQ]) and fused.stride() == qkv.stride()
    assert _rows_in_sequence(q[:0], q) is not None


def test_workspace_and_layout_checks():
    with raises(TypeError, "float_workspace_buffer"):
        BatchPODWithPagedKVCacheWrapper(None)
    with raises(ValueError, "kv_layout", "NHD"):
        BatchPODWithPagedKVCacheWrapper(workspace(), "NDH")
    with raises(TypeError, "float_workspace_buffer"):
        PODWithPagedKVCacheWrapper(np.zeros(4))
    with raises(ValueError, "float_workspace_buffer", "CUDA"):
        BatchPODWithPagedKVCacheWrapper(torch.empty(4, device="meta"))
    # BatchAttention's device is checked when plan() creates the PODAttention
    with raises(ValueError, "device"):
        batch_attention(device="bogus")
    with raises(ValueError, "device", "CUDA"):
        batch_attention(device="meta")


# --------------------------------------------------------------------------------------
# paged_kv_cache unpacking
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_unpack_combined_and_tuple_are_views(layout):
    kv = caches(layout)
    k, v = unpack_paged_kv_cache(kv, layout)
    assert k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv[:, 1].data_ptr()
    assert k.shape == v.shape == (NUM_PAGES, *kv.shape[2:]) and k.stride() == kv[:, 0].stride()
    assert torch.equal(k, kv[:, 0]) and torch.equal(v, kv[:, 1])
    kk, vv = kv[:, 0].clone(), kv[:, 1].clone()
    k2, v2 = unpack_paged_kv_cache((kk, vv), layout)
    assert k2 is kk and v2 is vv
    # page_size 1 may drop its dimension, as FlashInfer allows
    kv1 = torch.randn(NUM_PAGES, 2, HKV, D)
    k1, v1 = unpack_paged_kv_cache(kv1, layout)
    want = (NUM_PAGES, 1, HKV, D) if layout == "NHD" else (NUM_PAGES, HKV, 1, D)
    assert k1.shape == want and k1.data_ptr() == kv1.data_ptr()
    assert torch.equal(k1.reshape(NUM_PAGES, HKV, D), kv1[:, 0])
    k1, _ = unpack_paged_kv_cache((kv1[:, 0], kv1[:, 1]), layout)
    assert k1.shape == want


def test_unpack_errors():
    kv = caches()
    with raises(ValueError, "paged_kv_cache", "dim 1"):
        unpack_paged_kv_cache(torch.cat([kv, kv], 1), "NHD")
    with raises(ValueError, "paged_kv_cache", "5-D"):
        unpack_paged_kv_cache(kv[0, 0, 0], "NHD")
    with raises(ValueError, "tuple", "3 items"):
        unpack_paged_kv_cache((kv[:, 0], kv[:, 1], kv[:, 1]), "NHD")
    with raises(TypeError, "paged_kv_cache\\[1\\]"):
        unpack_paged_kv_cache((kv[:, 0], None), "NHD")
    with raises(ValueError, "kv_layout"):
        unpack_paged_kv_cache(kv, "XYZ")


# --------------------------------------------------------------------------------------
# PODWithPagedKVCacheWrapper (legacy; one launch, two where one plan cannot serve both)
# --------------------------------------------------------------------------------------


def legacy_inputs(qo_len=24, kv_len=64, layout_p="NHD"):
    shape = (kv_len, HKV, D) if layout_p == "NHD" else (HKV, kv_len, D)
    return (torch.randn(qo_len, HQ, D, dtype=BF16), torch.randn(shape, dtype=BF16),
            torch.randn(shape, dtype=BF16), torch.randn(3, HQ, D, dtype=BF16), caches())


def test_legacy_plans_the_decode_batch():
    w = legacy(sm_scale=0.2)
    plan = w._decode.current_plan
    assert plan.q_start.tolist() == [0, 1, 2, 3] and plan.kv_len.tolist() == [32, 3, 17]
    assert plan.page_list.tolist() == [0, 1, 2, 3, 4] and plan.summary.num_decode_requests == 3
    # one query token sees its whole KV either way: planned causal (shares the kernel)
    assert plan.causal is True and plan.sm_scale == 0.2
    w.plan(i32(0, 2, 2), i32(0, 1), i32(16, 1), HQ, HKV, D, PS, q_data_type=BF16)
    assert w._decode.current_plan.causal is False  # a request without KV: no mask
    assert w.plan == w.begin_forward or w.begin_forward.__func__ is w.plan.__func__


def run_on_cpu(w, *args, **kw):
    """run() up to its launch: on a CPU machine it stops at podcute's Hopper error."""
    with raises(RuntimeError, "Hopper"):
        w.run(*args, **kw)


@pytest.mark.parametrize("layout_p", ["NHD", "HND"])
def test_legacy_run_plans_prefill_and_decode_as_one_batch(layout_p):
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs(kv_len=50, layout_p=layout_p)
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=True, kv_layout_p=layout_p)
    plan = w._fused.current_plan
    # request 0 is the prefill: 24 queries over 50 tokens, 4 page entries (page 0, never
    # used to address: the ragged variant reads k_p / v_p); then the decode batch
    assert plan.q_start.tolist() == [0, 24, 25, 26, 27]
    assert plan.kv_len.tolist() == [50, 32, 3, 17]
    assert plan.page_list.tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4]
    assert plan.causal is True and plan.sm_scale == w._decode.current_plan.sm_scale
    assert w._prefill_key is None and w._fused_key == (24, 50, True, None, (-1, -1))
    # the same prefill again: no new plan; plan() re-plans the fused batch at once
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=True, kv_layout_p=layout_p)
    assert w._fused.current_plan is plan
    w.plan(i32(0, 1, 3), i32(4, 0, 1), i32(7, 2), HQ, HKV, D, PS, q_data_type=BF16)
    plan = w._fused.current_plan
    assert plan.q_start.tolist() == [0, 24, 25, 26] and plan.kv_len.tolist() == [50, 7, 18]
    assert plan.page_list.tolist() == [0, 0, 0, 0, 4, 0, 1]


@pytest.mark.parametrize("case, kw", [
    ("sm_scale_p", dict(sm_scale_p=0.3)),
    ("window_left_p", dict(window_left_p=8)),
    ("no prefill KV", dict()),
])
def test_legacy_run_falls_back_to_two_launches(case, kw):
    """What one plan cannot serve: the prefill alone over its K/V seen as pages."""
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs(qo_len=0 if case == "no prefill KV" else 24,
                                           kv_len=0 if case == "no prefill KV" else 64)
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, **kw)
    assert w._fused_key is None and w._prefill_key is not None


def test_legacy_run_causal_prefill_beside_a_decode_without_kv():
    w = PODWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(i32(0, 2, 2), i32(0, 1), i32(16, 1), HQ, HKV, D, PS, q_data_type=BF16)
    q_p, k_p, v_p, _, kv = legacy_inputs()
    q_d = torch.randn(2, HQ, D, dtype=BF16)
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=True)  # causal: two launches
    assert w._fused_key is None
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=False)  # no mask: one plan
    assert w._fused.current_plan.kv_len.tolist() == [64, 32, 0]


def test_legacy_plan_refuses_an_unfusable_batch_after_capture():
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs()
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=True)
    w._fused.planner.freeze()  # as a CUDA-graph capture does
    with raises(ValueError, "captured", "without KV"):
        w.plan(i32(0, 2, 2), i32(0, 1), i32(16, 1), HQ, HKV, D, PS, q_data_type=BF16)


def test_ragged_kv_is_checked_before_launch():
    """PODAttention.run's internal `_ragged_kv`: request 0's K/V, [1, kv_len, Hkv, D]."""
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs(kv_len=50)
    run_on_cpu(w, q_p, k_p, v_p, q_d, kv, causal_p=True)
    attn, q = w._fused, torch.cat((q_p, q_d))
    k, v = unpack_paged_kv_cache(kv, "NHD", "kv")
    good = k_p.unsqueeze(0)
    for bad, exc, words in ((good[:, :49], ValueError, ["ragged k", "50"]),
                            (good.half(), TypeError, ["ragged k", "dtype"]),
                            (good.transpose(2, 3), ValueError, ["ragged k"]),
                            (torch.randn(50 * HKV * D + 4, dtype=BF16)[4:].view(1, 50, HKV, D),
                             ValueError, ["ragged k", "16-byte"])):
        with raises(exc, *words):
            attn.run(q, k, v, _ragged_kv=(bad, v_p.unsqueeze(0)))
    run_on_cpu(attn, q, k, v, _ragged_kv=(good, v_p.unsqueeze(0)))


@pytest.mark.parametrize("kv_len, page", [(64, PS), (50, 1)])
@pytest.mark.parametrize("layout_p", ["NHD", "HND"])
def test_legacy_run_plans_the_prefill_over_a_page_view(kv_len, page, layout_p):
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs(kv_len=kv_len, layout_p=layout_p)
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, k_p, v_p, q_d, kv, causal_p=True, kv_layout_p=layout_p, sm_scale_p=0.3)
    prefill = w._prefill_key[0]
    plan = prefill.current_plan
    assert prefill.page_size == page and prefill is not w._decode
    assert plan.q_start.tolist() == [0, 24] and plan.kv_len.tolist() == [kv_len]
    assert plan.page_list.tolist() == list(range(kv_len // page))
    assert plan.causal is True and plan.sm_scale == 0.3
    # a second call with the same prefill shape does not plan again
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, k_p, v_p, q_d, kv, causal_p=True, kv_layout_p=layout_p, sm_scale_p=0.3)
    assert prefill.current_plan is plan


@pytest.mark.parametrize("layout_in", ["NHD", "HND"])
@pytest.mark.parametrize("layout_out", ["NHD", "HND"])
@pytest.mark.parametrize("page", [1, 16])
def test_ragged_as_pages_is_an_exact_view(layout_in, layout_out, page):
    L = 64
    tokens = torch.randn(L, HKV, D)
    x = tokens if layout_in == "NHD" else tokens.transpose(0, 1).contiguous()
    pages = _ragged_as_pages(x, layout_in, page, layout_out)
    assert pages.data_ptr() == x.data_ptr() and pages.stride(-1) == 1
    nhd = pages if layout_out == "NHD" else pages.transpose(1, 2)
    assert nhd.shape == (L // page, page, HKV, D)
    assert torch.equal(nhd.reshape(L, HKV, D), tokens)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(custom_mask_p=torch.ones(4, dtype=torch.bool)), NotImplementedError, ["custom_mask_p"]),
    (dict(packed_custom_mask_d=torch.ones(4, dtype=torch.uint8)), NotImplementedError,
     ["packed_custom_mask_d"]),
    (dict(window_left_p=-3), ValueError, ["window_left_p", ">= 0"]),
    (dict(window_left_d=16), ValueError, ["window_left_d", "plan"]),
    (dict(pos_encoding_mode_p="ALIBI"), NotImplementedError, ["pos_encoding_mode_p", "NONE"]),
    (dict(pos_encoding_mode_d="ROPE_LLAMA"), NotImplementedError, ["pos_encoding_mode_d"]),
    (dict(rope_scale_p=2.0), NotImplementedError, ["rope_scale_p"]),
    (dict(rope_theta_d=1e6), NotImplementedError, ["rope_theta_d"]),
    (dict(q_scale=0.5), NotImplementedError, ["q_scale"]),
    (dict(use_fp16_qk_reduction=True), NotImplementedError, ["use_fp16_qk_reduction"]),
    (dict(sm_scale_d=0.5), ValueError, ["sm_scale_d", "plan"]),
    (dict(kv_layout_p="NDH"), ValueError, ["kv_layout_p"]),
    (dict(causal_d=None), TypeError, ["causal_d"]),
    (dict(sm_scale_p=-1.0), ValueError, ["sm_scale_p"]),
])
def test_legacy_run_unsupported_and_bad_arguments(kw, exc, words):
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs()
    with raises(exc, *words):
        w.run(q_p, k_p, v_p, q_d, kv, **kw)


def test_legacy_run_validates_tensors():
    w = legacy()
    q_p, k_p, v_p, q_d, kv = legacy_inputs()
    with raises(ValueError, "k_p", "kv_len, Hkv, D"):
        w.run(q_p, k_p[:, :1], v_p, q_d, kv)
    with raises(ValueError, "v_p"):
        w.run(q_p, k_p, v_p[:10], q_d, kv)
    with raises(TypeError, "k_p", "dtype"):
        w.run(q_p, k_p.half(), v_p, q_d, kv)
    with raises(ValueError, "q_p", "num_qo_heads"):
        w.run(q_p[:, :4], k_p, v_p, q_d, kv)
    with raises(ValueError, "q_d", "2 rows"):
        w.run(q_p, k_p, v_p, q_d[:2], kv)
    with raises(TypeError, "extra|more"):
        w.run(q_p, k_p, v_p, q_d, kv, *([None] * 26), 1)
    # FlashInfer ignores these decode settings; so does podcute (documented)
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, k_p, v_p, q_d, kv, kv_layout_d="HND", causal_d=True, return_lse_p=True,
              return_lse_d=True, sm_scale_d=1 / math.sqrt(D))


def test_legacy_constructor_and_cuda_graph_buffers():
    with raises(NotImplementedError, "jit_args"):
        PODWithPagedKVCacheWrapper(workspace(), jit_args=["x"])
    with raises(ValueError, "paged_kv_indptr_buffer"):
        PODWithPagedKVCacheWrapper(workspace(), use_cuda_graph=True)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(8, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    with raises(ValueError, "batch_size \\+ 1"):
        PODWithPagedKVCacheWrapper(workspace(), "NHD", True, **bufs)
    bufs["paged_kv_last_page_len_buffer"] = torch.zeros(3, dtype=torch.int32)
    w = PODWithPagedKVCacheWrapper(workspace(), "NHD", True, **bufs)
    assert w.is_cuda_graph_enabled
    w.plan(i32(0, 2, 3, 5), i32(0, 1, 2, 3, 4), i32(16, 3, 1), HQ, HKV, D, PS, q_data_type=BF16)
    with raises(ValueError, "batch size 2", "3"):
        w.plan(i32(0, 2, 3), i32(0, 1, 2), i32(16, 3), HQ, HKV, D, PS, q_data_type=BF16)
    with raises(ValueError, "len\\(indices\\)=9"):
        w.plan(i32(0, 2, 3, 9), torch.arange(9, dtype=torch.int32), i32(16, 3, 1), HQ, HKV, D,
               PS, q_data_type=BF16)
    w.reset_workspace_buffer(workspace(), workspace())
    w.end_forward()


# --------------------------------------------------------------------------------------
# BatchAttention
# --------------------------------------------------------------------------------------


def test_batch_attention_plan():
    w = batch_attention(sm_scale=0.05)
    plan = w._attn.current_plan
    assert plan.q_start.tolist() == [0, 20, 21] and plan.kv_len.tolist() == [40, 17]
    assert plan.page_list.tolist() == [0, 1, 2, 5, 6] and plan.causal is True
    assert plan.sm_scale == 0.05 and w._attn.dtype == BF16  # FlashInfer's default dtype
    assert (plan.summary.num_prefill_requests, plan.summary.num_decode_requests) == (1, 1)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(logits_soft_cap=-1.0), ValueError, ["softcap", ">= 0"]),
    (dict(logits_soft_cap="30"), TypeError, ["logits_soft_cap", "float"]),
    (dict(head_dim_vo=64, kv_data_type=torch.float8_e4m3fn), NotImplementedError,
     ["fp8", "head_dim_vo=64"]),
    (dict(head_dim_vo=84), NotImplementedError, ["head_dim_vo", "multiples of 8"]),
    (dict(use_profiler=True), NotImplementedError, ["use_profiler"]),
    (dict(kv_data_type=torch.int8), NotImplementedError, ["kv_data_type", "float8_e5m2"]),
    (dict(head_dim_qk=84, head_dim_vo=84), NotImplementedError, ["head_dim_qk", "multiples of 8"]),
    (dict(qo_indptr=i32(0, 20, 19)), ValueError, ["qo_indptr", "non-decreasing"]),
    (dict(kv_len_arr=i32(40, 40)), ValueError, ["kv_len_arr\\[1\\]", "pages"]),
    (dict(kv_indices=torch.arange(5)), TypeError, ["kv_indices", "int32"]),
])
def test_batch_attention_plan_errors(kw, exc, words):
    with raises(exc, *words):
        batch_attention(**kw)
    batch_attention(logits_soft_cap=0.0)  # "off" is accepted
    w = batch_attention(logits_soft_cap=30.0)
    assert w._attn.current_plan.options.softcap == 30.0


@pytest.mark.parametrize("kw, words", [
    (dict(k_scale=0.5), ["k_scale", "kv_data_type"]),
    (dict(profiler_buffer=torch.zeros(4)), ["profiler_buffer"]),
    (dict(kv_cache_sf=torch.zeros(4)), ["kv_cache_sf", "NVFP4"]),
])
def test_batch_attention_unsupported_run_arguments(kw, words):
    w = batch_attention()
    with raises(NotImplementedError, *words):
        w.run(torch.randn(21, HQ, D, dtype=BF16), caches(), **kw)


def test_batch_attention_run_soft_cap_must_match_the_plan():
    w = batch_attention(logits_soft_cap=30.0)
    with raises(ValueError, "logits_soft_cap", "plan"):
        w.run(torch.randn(21, HQ, D, dtype=BF16), caches(), logits_soft_cap=5.0)


def test_batch_attention_run_validates_then_needs_hopper():
    w = batch_attention()
    q, kv = torch.randn(21, HQ, D, dtype=BF16), caches()
    with raises(TypeError, "lse", "float32"):
        w.run(q, kv, lse=torch.empty(21, HQ, dtype=BF16))
    with raises(ValueError, "out"):
        w.run(q, kv, out=torch.empty(20, HQ, D, dtype=BF16))
    with raises(ValueError, "q"):
        w.run(q[:20], kv)
    with raises(RuntimeError, "Hopper"):
        w.run(q, kv, out=torch.empty_like(q), lse=torch.empty(21, HQ), k_scale=1.0)
    with raises(RuntimeError, "before plan"):
        BatchAttention(device="cpu").run(q, kv)


def test_lse_base():
    assert LOG2E == pytest.approx(1 / math.log(2), rel=1e-15)


# --------------------------------------------------------------------------------------
# fp8 KV caches (kv_data_type float8, k_scale / v_scale at run())
# --------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn


def _fp8(kv):
    return kv.to(E4M3)


@pytest.mark.parametrize("kv_data_type", [E4M3, "float8_e5m2"])
def test_fp8_plans_select_fp8_variants(kv_data_type):
    want = E4M3 if kv_data_type is E4M3 else torch.float8_e5m2
    for attn in (batch_pod(kv_data_type=kv_data_type)._attn,
                 legacy(kv_data_type=kv_data_type)._decode,
                 batch_attention(q_data_type=BF16, kv_data_type=kv_data_type)._attn):
        assert attn.fp8 and attn.kv_dtype == want and attn.dtype == BF16
        assert attn.current_plan is not None


def test_fp8_plan_takes_head_dim_256():
    w = BatchPODWithPagedKVCacheWrapper(workspace())
    w.plan(**PREFILL, **DECODE, **{**HEADS, "head_dim": 256}, q_data_type=BF16,
           kv_data_type=E4M3)
    assert w._attn.fp8 and w._attn.planner.config.kernel.head_dim == 256


@pytest.mark.parametrize("scale", [0.5, torch.tensor(0.5), torch.full((HKV,), 0.25), None])
def test_batch_pod_fp8_run_takes_scales(scale):
    w = batch_pod(kv_data_type=E4M3)
    q_p, q_d, kv = pod_inputs()
    kv8 = _fp8(kv)
    with raises(RuntimeError, "Hopper"):  # checked, then the device check
        w.run(q_p, kv8, q_d, kv8, k_scale=scale, v_scale=scale)
    with raises(TypeError, "paged_kv_cache_p", "float8_e4m3fn"):  # a bf16 cache for an fp8 plan
        w.run(q_p, kv, q_d, kv, k_scale=scale)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(k_scale=-1.0), ValueError, ["k_scale", "> 0"]),
    (dict(v_scale=float("inf")), ValueError, ["v_scale", "finite"]),
    (dict(k_scale=torch.ones(3)), ValueError, ["k_scale", "num_kv_heads"]),
    (dict(v_scale=torch.ones(HKV, dtype=torch.float64)), TypeError, ["v_scale", "float32"]),
    (dict(k_scale="1"), TypeError, ["k_scale", "float"]),
    (dict(q_scale=0.5), NotImplementedError, ["q_scale", "bf16/fp16"]),
])
def test_fp8_run_refuses_bad_scales(kw, exc, words):
    q_p, q_d, kv = pod_inputs()
    kv8 = _fp8(kv)
    with raises(exc, *words):
        batch_pod(kv_data_type=E4M3).run(q_p, kv8, q_d, kv8, **kw)
    if "q_scale" not in kw:
        with raises(exc, *words):
            batch_attention(q_data_type=BF16, kv_data_type=E4M3).run(
                torch.randn(21, HQ, D, dtype=BF16), kv8, **kw)


def test_legacy_fp8_decode_cache_with_16bit_prefill():
    """FlashInfer's older POD wrapper: the paged decode cache in fp8 (its scales), the
    prefill's ragged K/V in q's dtype."""
    w = legacy(kv_data_type=E4M3)
    q_p, k_p, v_p, q_d, kv = legacy_inputs()
    kv8 = _fp8(kv)
    with raises(RuntimeError, "Hopper"):
        w.run(q_p, k_p, v_p, q_d, kv8, k_scale=0.5, v_scale=2.0)
    with raises(TypeError, "paged_kv_cache_d", "float8_e4m3fn"):
        w.run(q_p, k_p, v_p, q_d, kv, k_scale=0.5)
    with raises(ValueError, "k_scale", "> 0"):
        w.run(q_p, k_p, v_p, q_d, kv8, k_scale=0.0)
