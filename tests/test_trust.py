"""What an engine must be able to trust, on a CPU machine (launch stubbed: `launches`):

- no entry point launches a plan other than the one of the values its index tensors hold
  at the call, whatever wrote them (torch, NumPy views, DLPack, ctypes, storages,
  re-pointed ``.data``, fresh ``torch.from_numpy`` views of a persistent buffer), unless
  the caller names the plan (``scheduler_metadata``);
- the page check guards the plan's own copy of the pages, which is what the kernel reads;
- after a CUDA-graph capture plan() refuses what the capture fixed;
- the argument conventions of the engines' own test files (FlashAttention 2/3/4, vLLM,
  FlashInfer) map onto podcute or raise a named error.
"""

import ctypes

import numpy as np
import pytest
import torch

import podcute
from podcute import checks, one_shot
from podcute.compat.flash_attn import (flash_attn2_varlen_func, flash_attn4_varlen_func,
                                       flash_attn_varlen_func, flash_attn_varlen_plan)
from podcute.compat.flashinfer import BatchAttention, PODWithPagedKVCacheWrapper

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(HAS_HOPPER, reason="CPU-planning paths (launch stubbed)")

HQ, HKV, D, PS = 8, 2, 128, 16
I32 = dict(dtype=torch.int32)


def batch():
    """Prefill (q 20 / kv 40) + decode (q 1 / kv 17) over a paged cache of 8 pages."""
    return dict(q=torch.randn(21, HQ, D, dtype=torch.bfloat16),
                k=torch.randn(8, PS, HKV, D, dtype=torch.bfloat16),
                v=torch.randn(8, PS, HKV, D, dtype=torch.bfloat16),
                cu=torch.tensor([0, 20, 21], **I32), kvl=torch.tensor([40, 17], **I32),
                bt=torch.tensor([[0, 1, 2], [3, 4, 7]], **I32))


def pod_call(b):
    return podcute.pod_attention(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"],
                                 seqused_k=b["kvl"], block_table=b["bt"])


def fa_call(b):
    return flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                                  block_table=b["bt"], causal=True)


def launched(rec):
    """What the last launch reads: (q_start, kv_len, page entries) of its plan."""
    p = rec[-1][0]
    return p.q_start.tolist(), p.kv_len.tolist(), p.page_list.tolist()


def expected(b):
    """The same of a fresh plan of the values the tensors hold now."""
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    att.plan(b["cu"].clone(), b["kvl"].clone(), block_table=b["bt"].clone())
    p = att.current_plan
    return p.q_start.tolist(), p.kv_len.tolist(), p.page_list.tolist()


def _numpy_view(b):
    b["kvl"].numpy()[1] = 33


def _data_index(b):
    b["kvl"].data[1] = 18


def _data_copy(b):
    b["bt"].data.copy_(torch.tensor([[0, 1, 2], [5, 6, 4]], **I32))


def _dlpack(b):
    torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(b["kvl"]))[1] = 9


def _frombuffer(b):
    np.frombuffer(b["bt"].numpy().data, dtype=np.int32)[4] = 6


def _storage(b):
    b["kvl"].untyped_storage().copy_(torch.tensor([40, 30], **I32).untyped_storage())


def _ctypes(b):
    ctypes.memmove(b["bt"].data_ptr() + 3 * 4, ctypes.byref(ctypes.c_int32(6)), 4)


def _from_numpy_alias(b):
    torch.from_numpy(b["kvl"].numpy())[1] = 5


def _repointed(b):
    b["kvl"].data = torch.tensor([40, 3], **I32)


WRITES = [_numpy_view, _data_index, _data_copy, _dlpack, _frombuffer, _storage, _ctypes,
          _from_numpy_alias, _repointed]


@pytest.mark.parametrize("entry", [pod_call, fa_call], ids=["pod_attention", "flash_attn"])
@pytest.mark.parametrize("write", WRITES, ids=[w.__name__[1:] for w in WRITES])
def test_no_write_path_serves_a_stale_plan(launches, entry, write):
    b = batch()
    entry(b)
    entry(b)  # the next layer: reused
    assert launches[0][0] is launches[1][0]
    write(b)  # the next step, written behind torch's version counter (or beside it)
    entry(b)
    assert launched(launches) == expected(b)
    entry(b)
    assert launches[-1][0] is launches[-2][0]  # and reused again while unchanged


@pytest.mark.parametrize("wrap", [torch.from_numpy, torch.as_tensor])
def test_vllm_persistent_numpy_buffers(launches, wrap):
    """vLLM's CPU buffers: persistent NumPy arrays written through their `.np` view, passed
    as fresh tensor slices every step (and every layer)."""
    cu_np = np.zeros(9, np.int32)
    kvl_np = np.zeros(8, np.int32)
    bt_np = np.zeros((8, 4), np.int32)
    k = torch.randn(16, PS, HKV, D, dtype=torch.bfloat16)
    steps = [([20, 1], [40, 17], [[0, 1, 2, 0], [3, 4, 7, 0]]),
             ([1, 1, 3], [17, 50, 3], [[5, 6, 0, 0], [8, 9, 10, 11], [12, 0, 0, 0]]),
             ([1, 1, 3], [17, 50, 4], [[5, 6, 0, 0], [8, 9, 10, 11], [13, 0, 0, 0]])]
    for q_lens, kv_lens, pages in steps:
        n = len(q_lens)
        cu_np[: n + 1] = np.concatenate(([0], np.cumsum(q_lens)))
        kvl_np[:n] = kv_lens
        bt_np[:n] = pages
        q = torch.randn(sum(q_lens), HQ, D, dtype=torch.bfloat16)
        for _ in range(2):  # two layers
            b = dict(q=q, k=k, v=k, cu=wrap(cu_np[: n + 1]), kvl=wrap(kvl_np[:n]),
                     bt=wrap(bt_np[:n]))
            fa_call(b)
            assert launched(launches) == expected(b)
        assert launches[-1][0] is launches[-2][0]


def test_plan_handle_is_the_callers_word_and_never_outlives_its_plan(launches):
    b = batch()
    handle = flash_attn_varlen_plan(b["q"], b["k"], b["v"], 20, b["cu"], 40,
                                    seqused_k=b["kvl"], block_table=b["bt"], causal=True)
    assert isinstance(handle, podcute.compat.flash_attn.StepPlan)
    for _ in range(2):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], causal=True, scheduler_metadata=handle)
        assert launches[-1][0] is handle.plan
    with pytest.raises(ValueError, match="causal=False"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], causal=False, scheduler_metadata=handle)
    # the next step's plan, made after a write behind the version counter: always planned
    b["kvl"].numpy()[1] = 30
    nxt = flash_attn_varlen_plan(b["q"], b["k"], b["v"], 20, b["cu"], 40,
                                 seqused_k=b["kvl"], block_table=b["bt"], causal=True)
    assert nxt.plan.kv_len.tolist() == [40, 30]
    with pytest.raises(ValueError, match="scheduler_metadata.*replaced"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], causal=True, scheduler_metadata=handle)
    with pytest.raises(TypeError, match="softmax_scal"):
        flash_attn_varlen_plan(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], softmax_scal=0.01)


def test_capture_never_plans(launches, monkeypatch):
    """Under capture a call that would plan (device metadata, or other values) raises,
    naming the handle; one that reuses by value launches."""
    b = batch()
    fa_call(b)
    monkeypatch.setattr(one_shot, "capturing", lambda: True)
    fa_call(b)  # same values: reused
    b["kvl"].numpy()[1] = 30
    with pytest.raises(RuntimeError, match="scheduler_metadata"):
        fa_call(b)


def test_page_check_guards_the_plans_copy(launches):
    b = batch()
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    bad = b["bt"].clone()
    bad[0, 2] = 1000  # outside the 8-page cache
    att.plan(b["cu"], b["kvl"], block_table=bad)
    bad[0, 2] = 2  # fixed after plan(): the plan's copy still holds 1000
    with pytest.raises(ValueError, match="block_table: request 0 reads page 1000"):
        att.run(b["q"], b["k"], b["v"])
    indices = torch.tensor([0, 1, 1000, 3, 4], **I32)
    att.plan(b["cu"], b["kvl"], kv_indptr=torch.tensor([0, 3, 5], **I32), kv_indices=indices)
    indices[2] = 2
    with pytest.raises(ValueError, match="kv_indices: request 0 reads page 1000"):
        att.run(b["q"], b["k"], b["v"])
    assert not launches
    # FlashInfer's BatchAttention, the same way
    w = BatchAttention("NHD", device="cpu")
    indices = torch.tensor([0, 1, 1000, 3, 4], **I32)
    w.plan(b["cu"], torch.tensor([0, 3, 5], **I32), indices, b["kvl"], HQ, HKV, D, D, PS,
           causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    indices.numpy()[2] = 2
    with pytest.raises(ValueError, match="page 1000"):
        w.run(b["q"], torch.stack((b["k"], b["v"]), 1))
    assert not launches


def test_a_refused_one_shot_call_is_planned_again_after_a_fix(launches):
    b = batch()
    b["bt"][0, 2] = 1000
    for entry in (pod_call, fa_call):
        with pytest.raises(ValueError, match="page 1000"):
            entry(b)
    b["bt"].numpy()[0, 2] = 2  # fixed behind the version counter
    for entry in (pod_call, fa_call):
        entry(b)
        assert launched(launches) == expected(b)


def test_legacy_pod_wrapper_copies_its_inputs_at_plan(launches):
    w = PODWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8), "NHD")
    indptr, indices, last = (torch.tensor([0, 1, 2], **I32), torch.tensor([3, 4], **I32),
                             torch.tensor([16, 3], **I32))
    w.plan(indptr, indices, last, HQ, HKV, D, PS, q_data_type=torch.bfloat16)
    indices.copy_(torch.tensor([6, 7], **I32))  # FlashInfer copies at plan(); so does podcute
    q_p = torch.randn(5, HQ, D, dtype=torch.bfloat16)
    k_p = torch.randn(9, HKV, D, dtype=torch.bfloat16)
    cache = torch.randn(8, 2, PS, HKV, D, dtype=torch.bfloat16)
    w.run(q_p, k_p, k_p.clone(), torch.randn(2, HQ, D, dtype=torch.bfloat16), cache)
    assert launches[-1][0].page_list.tolist()[-2:] == [3, 4]


def test_capture_fixes_the_kernel_variant():
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    b = batch()
    att.plan(b["cu"], b["kvl"], block_table=b["bt"], causal=True, softcap=30.0)
    att.planner.freeze(att.current_plan.options)  # as run() does under capture
    att.plan(b["cu"], b["kvl"], block_table=b["bt"], causal=True, softcap=20.0)  # a value
    for kw, what in ((dict(causal=False), "causal"), (dict(softcap=0.0), "softcap"),
                     (dict(window_size=(8, 0)), "sliding window")):
        with pytest.raises(ValueError, match=what):
            att.plan(b["cu"], b["kvl"], block_table=b["bt"], **{"causal": True, **kw})
    # causal and a window's right edge at 0 are one variant
    att2 = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    att2.plan(b["cu"], b["kvl"], block_table=b["bt"], causal=True)
    att2.planner.freeze(att2.current_plan.options)
    with pytest.raises(ValueError, match="window"):
        att2.plan(b["cu"], b["kvl"], block_table=b["bt"], causal=False)


def test_scales_and_caps_the_kernel_cannot_hold_are_named():
    b = batch()
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    with pytest.raises(ValueError, match="softcap"):
        att.plan(b["cu"], b["kvl"], block_table=b["bt"], softcap=1e39)
    for bad in (1e-50, 1e39, 10**400, 0.0, float("nan")):
        with pytest.raises(ValueError, match="k_scale"):
            checks.scale_tensor("k_scale", bad, HKV, torch.device("cpu"), {})


def test_causal_with_more_queries_than_keys_plans():
    """Causal q_len > kv_len (FlashAttention's and FlashInfer's bottom-right alignment):
    rows before position 0 see no key; the plan gives them no keys (kernel: 0, -inf)."""
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    att.plan(torch.tensor([0, 30, 32, 33], **I32), torch.tensor([10, 1, 0], **I32),
             block_table=torch.tensor([[0], [1], [2]], **I32), causal=True)
    p = att.current_plan
    assert p.causal and p.q_lens.tolist() == [30, 2, 1] and p.kv_lens.tolist() == [10, 1, 0]
    assert p.needed_pages.tolist() == [1, 1, 0]


# ---- the engines' calling conventions ----------------------------------------------------


def test_fa2_positional_order_with_block_table(launches):
    b = batch()
    cu_k = torch.tensor([0, 40, 57], **I32)
    for fn in (flash_attn_varlen_func, flash_attn2_varlen_func):
        fn(b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40, 0.0, None, True, (-1, -1), 0.0,
           None, False, False, b["bt"])
        assert launched(launches) == expected(b)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_k"):  # errors name FA's argument
        flash_attn_varlen_func(b["q"], b["k"], b["v"], b["cu"], torch.tensor([0, 40, 30], **I32),
                               20, 40, block_table=b["bt"])


def test_window_size_as_a_tensor(launches):
    b = batch()
    flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                           block_table=b["bt"], causal=True, window_size=torch.tensor([8, 0]))
    opt = launches[-1][0].options
    assert (opt.window_left, opt.window_right) == (8, 0)
    flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                           block_table=b["bt"], causal=True,
                           window_size=(torch.tensor(4), torch.tensor(-1)))
    assert launches[-1][0].options.window_left == 4


def test_fa3_keyword_defaults_and_what_they_switch_on(launches):
    b = batch()
    cu_k = torch.tensor([0, 40, 57], **I32)
    flash_attn_varlen_func(b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=True, qv=None,
                           q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, page_table=b["bt"])
    assert launched(launches) == expected(b)
    for kw, name in ((dict(attention_chunk=128), "attention_chunk"),
                     (dict(qv=torch.randn(21, HQ, 64)), "q_v")):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_varlen_func(b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40,
                                   page_table=b["bt"], **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rotary_cos'"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40,
                               page_table=b["bt"], rotary_cos=None)


def test_fa4_learnable_sink_and_out_lse(launches):
    b = batch()
    sink = torch.randn(HQ, dtype=torch.bfloat16)
    for fn in (flash_attn_varlen_func, flash_attn4_varlen_func):
        out, lse = fn(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seqused_k=b["kvl"],
                      page_table=b["bt"], causal=True, learnable_sink=sink)
        assert lse is None and launches[-1][6]["sinks"].dtype == torch.float32
        assert torch.equal(launches[-1][6]["sinks"], sink.float())
        out, lse = fn(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seqused_k=b["kvl"],
                      page_table=b["bt"], causal=True, return_lse=True)
        assert lse.shape == (HQ, 21) and lse.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="score_mod"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seqused_k=b["kvl"],
                               page_table=b["bt"], score_mod=lambda *a: None)


def test_fa3_return_attn_probs_and_contiguous_seqused_k(launches):
    """FlashAttention 3's return_attn_probs returns (out, softmax_lse); contiguous K/V take
    seqused_k (how many of each request's rows from cu_seqlens_k it uses)."""
    b = batch()
    k = torch.randn(60, HKV, D, dtype=torch.bfloat16)
    cu_k = torch.tensor([0, 45, 60], **I32)
    out, lse = flash_attn_varlen_func(b["q"], k, k.clone(), b["cu"], cu_k, 20, 45,
                                      seqused_k=torch.tensor([40, 12], **I32), causal=True,
                                      qv=None, return_attn_probs=True)
    assert lse.shape == (HQ, 21)
    p = launches[-1][0]
    assert p.kv_len.tolist() == [40, 12] and p.page_list.tolist()[:3] == [0, 1, 2]
    assert p.page_start.tolist() == [0, 45]  # request 1 starts at row 45
    assert p.page_list.tolist()[45:48] == [45, 46, 47]


def test_what_podcute_lacks_is_named(launches):
    b = batch()
    with pytest.raises(NotImplementedError, match="fp8 queries"):
        flash_attn_varlen_func(b["q"].to(torch.float8_e4m3fn), b["k"], b["v"], 20, b["cu"], 40,
                               seqused_k=b["kvl"], block_table=b["bt"])
    with pytest.raises(NotImplementedError, match="fp8 KV caches with head_dim_vo=64"):
        flash_attn_varlen_func(b["q"], b["k"].to(torch.float8_e4m3fn),
                               b["v"][..., :64].to(torch.float8_e4m3fn), 20, b["cu"], 40,
                               seqused_k=b["kvl"], block_table=b["bt"])
    with pytest.raises(NotImplementedError, match="page_size.*512"):
        flash_attn_varlen_func(b["q"], torch.randn(2, 512, HKV, D, dtype=torch.bfloat16),
                               torch.randn(2, 512, HKV, D, dtype=torch.bfloat16), 20, b["cu"],
                               40, seqused_k=b["kvl"], block_table=b["bt"][:, :1])
    for kw, name in ((dict(output_scale=torch.ones(1)), "output_scale"),
                     (dict(gather_kv_indices=b["bt"]), "gather_kv_indices")):
        with pytest.raises(NotImplementedError, match=name):  # also on the per-layer path
            flash_attn_varlen_func(b["q"], b["k"], b["v"], max_seqlen_q=20,
                                   cu_seqlens_q=b["cu"], max_seqlen_k=40, seqused_k=b["kvl"],
                                   block_table=b["bt"], causal=True, **kw)
    assert not launches


def test_fa4_keyword_call_with_qv_first(launches):
    """FA4's fourth positional argument is qv: its calls are keyword calls, told apart by
    FA4-only keywords, and return (out, lse)."""
    b = batch()
    out, lse = flash_attn4_varlen_func(b["q"], b["k"], b["v"], None, b["cu"], None, 20, 40,
                                       None, None, b["kvl"], None, b["bt"], causal=True)
    assert lse is None and launched(launches) == expected(b)
    res = flash_attn_varlen_func(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"], seqused_k=b["kvl"],
                                 page_table=b["bt"], causal=True, min_seqlen_k=1)
    assert isinstance(res, tuple) and res[1] is None


def test_fa3_seqused_q_plans_the_used_rows(launches):
    """FlashAttention 3's seqused_q: request i uses its first seqused_q[i] rows; the rest
    become a request of their own with no KV (0 and -inf), so every row keeps its place."""
    b = batch()
    k = torch.randn(60, HKV, D, dtype=torch.bfloat16)
    cu_k = torch.tensor([0, 45, 60], **I32)
    flash_attn_varlen_func(b["q"], k, k.clone(), b["cu"], cu_k, 20, 45,
                           seqused_q=torch.tensor([12, 1], **I32),
                           seqused_k=torch.tensor([40, 12], **I32), causal=True)
    p = launches[-1][0]
    assert p.q_start.tolist() == [0, 12, 20, 21, 21]
    assert p.kv_len.tolist() == [40, 0, 12, 0]
    assert p.page_start.tolist()[::2] == [0, 45]
    with pytest.raises(ValueError, match="seqused_q"):
        flash_attn_varlen_func(b["q"], k, k.clone(), b["cu"], cu_k, 20, 45,
                               seqused_q=torch.tensor([21, 1], **I32), causal=True)
