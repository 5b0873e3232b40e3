"""podcute.compat.flash_attn and plan reuse (podcute.one_shot) on a CPU machine: arguments
map onto the right plan, unsupported ones raise naming themselves, and a plan is reused
exactly while the metadata tensors are the same and unchanged (never after a change)."""

import numpy as np
import pytest
import torch

import podcute
from podcute import one_shot as one_shot_module
from podcute.compat.flash_attn import flash_attn_varlen_func
from podcute.one_shot import CallPlanner, host_view

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(HAS_HOPPER, reason="CPU-planning paths (run() raises here)")

HQ, HKV, D, PS = 8, 2, 128, 16
I32 = dict(dtype=torch.int32)
CPU = torch.device("cpu")


def batch():
    """Prefill (q 20 / kv 40) + decode (q 1 / kv 17) over a paged cache of 8 pages."""
    return dict(
        q=torch.randn(21, HQ, D, dtype=torch.bfloat16),
        k=torch.randn(8, PS, HKV, D, dtype=torch.bfloat16),
        v=torch.randn(8, PS, HKV, D, dtype=torch.bfloat16),
        cu=torch.tensor([0, 20, 21], **I32),
        kvl=torch.tensor([40, 17], **I32),
        bt=torch.tensor([[0, 1, 2], [3, 4, 7]], **I32),
    )


FA_SCALARS = (True, None, (-1, -1), 0.0)  # flash_attn_varlen_func(causal=True)
POD_SCALARS = (True, None, (-1, -1), 0.0, False)  # pod_attention's defaults


def one_shot(page_size=PS, scalars=FA_SCALARS):
    """The one-shot attention of this configuration and kind of call."""
    return one_shot_module.one_shot_attention(HQ, HKV, D, page_size, torch.bfloat16, "NHD",
                                              torch.device("cpu"), scalars=scalars)


def call(fn, *args, **kw):
    """Run an entry point on this CPU machine: it plans, then refuses to launch."""
    with pytest.raises(RuntimeError, match="Hopper"):
        fn(*args, **kw)


def vllm_call(b, **kw):
    call(flash_attn_varlen_func, b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
         block_table=b["bt"], causal=True, **kw)


def work(att):
    p = att.current_plan
    return p.work.clone(), p.page_list.clone(), p.kv_len.clone(), p.q_start.clone()


def test_paged_call_plans_like_podattention():
    b = batch()
    vllm_call(b)
    att, _ = one_shot()
    ref = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    ref.plan(b["cu"], b["kvl"], block_table=b["bt"], causal=True)
    for x, y in zip(work(att), work(ref)):
        assert torch.equal(x, y)


def test_upstream_positional_order_and_page_table_alias():
    b = batch()
    # FlashAttention 2 upstream: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k), with
    # the KV lengths in cu_seqlens_k when paged.
    cu_k = torch.tensor([0, 40, 57], **I32)
    call(flash_attn_varlen_func, b["q"], b["k"], b["v"], b["cu"], cu_k, 20, 40,
         page_table=b["bt"], causal=True)
    att, _ = one_shot()
    assert att.current_plan.kv_len.tolist() == [40, 17]
    with pytest.raises(ValueError, match="block_table or page_table"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], page_table=b["bt"])


def test_contiguous_kv_is_pages_of_one_token():
    q = torch.randn(21, HQ, D, dtype=torch.bfloat16)
    k = torch.randn(57, HKV, D, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 20, 21], **I32)
    cu_k = torch.tensor([0, 40, 57], **I32)
    call(flash_attn_varlen_func, q, k, k, 20, cu_q, 40, cu_k, causal=True)
    att, _ = one_shot(page_size=1)
    plan = att.current_plan
    assert plan.kv_len.tolist() == [40, 17]
    assert plan.page_list.tolist() == list(range(57))


@pytest.mark.parametrize("kw,name", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(HQ)), "alibi_slopes"),
    (dict(return_attn_probs=True), "return_attn_probs"),
    (dict(q_v=torch.ones(1)), "q_v"),
    (dict(k_descale=torch.rand(2, HKV)), "k_descale"),  # fp8 only: see below
    (dict(attention_chunk=64), "attention_chunk"),  # (seqused_q is served: test_trust.py)
    (dict(cp_world_size=2), "cp_world_size"),
])
def test_unsupported_arguments_are_named(kw, name):
    b = batch()
    if name == "k_descale":  # per-request descales of an fp8 cache
        b["k"], b["v"] = b["k"].to(torch.float8_e4m3fn), b["v"].to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], **kw)


def test_descales_as_vllm_passes_them(monkeypatch):
    """FlashAttention 3's descales: unused with 16-bit inputs (q_descale always: podcute's
    queries are 16-bit), and for an fp8 cache one [Hkv] or [1] row of a [B, Hkv] expand
    that run() receives as k_scale / v_scale, a view of the caller's memory (no copy)."""
    b = batch()
    shape = (2, HKV)
    ones = torch.ones(1).expand(shape)
    vllm_call(b, q_descale=ones, k_descale=ones, v_descale=ones)  # bf16 cache: unused
    with pytest.raises(TypeError, match="k_descale"):
        vllm_call(dict(b), k_descale=1.0)
    with pytest.raises(TypeError, match="q_descale"):
        vllm_call(dict(b), q_descale=1.0)
    seen = {}
    orig = podcute.PODAttention._run_checked  # what run() and the compat path launch through

    def spy(self, plan, q, k, v, out, return_lse, lse, sinks, k_scale, v_scale, *a):
        seen.update(k_scale=k_scale, v_scale=v_scale)
        return orig(self, plan, q, k, v, out, return_lse, lse, sinks, k_scale, v_scale, *a)

    b8 = dict(b, k=b["k"].to(torch.float8_e4m3fn), v=b["v"].to(torch.float8_e4m3fn))
    per_head, scalar = torch.rand(HKV) + 0.5, torch.rand(1) + 0.5
    with monkeypatch.context() as m:
        m.setattr(podcute.PODAttention, "_run_checked", spy)
        vllm_call(b8, q_descale=ones, k_descale=per_head.expand(shape),
                  v_descale=scalar.expand(shape))
    assert seen["k_scale"].shape == (HKV,) and seen["k_scale"].data_ptr() == per_head.data_ptr()
    assert seen["v_scale"].shape == (1,) and seen["v_scale"].data_ptr() == scalar.data_ptr()
    att = one_shot_module.one_shot_attention(HQ, HKV, D, PS, torch.bfloat16, "NHD", CPU,
                                 kv_dtype=torch.float8_e4m3fn, scalars=FA_SCALARS)[0]
    assert att.current_plan.kv_len.tolist() == [40, 17]
    with pytest.raises(ValueError, match="k_descale"):
        vllm_call(b8, k_descale=torch.ones(2, HKV, 1))
    with pytest.raises(TypeError, match="k_scale must be float32"):
        vllm_call(b8, k_descale=torch.ones(1, HKV, dtype=torch.float64).expand(2, HKV))
    # one row per request, as FlashAttention 3 takes it: an empty or short one is refused
    for rows in (0, 1, 3):
        with pytest.raises(ValueError, match=r"k_descale must be \[batch_size=2"):
            vllm_call(b8, k_descale=torch.ones(1, HKV).expand(rows, HKV))


def test_window_softcap_and_sinks_reach_the_plan():
    """window_size (None sides = unbounded), softcap and s_aux (sinks) are served; the
    plan holds the window and the cap, and a changed one plans again."""
    b = batch()
    vllm_call(b, window_size=(128, None), softcap=30.0, s_aux=torch.ones(HQ))
    att, _ = one_shot(scalars=(True, None, (128, -1), 30.0))
    opt = att.current_plan.options
    assert (opt.window_left, opt.window_right, opt.softcap) == (128, -1, 30.0)
    assert att.current_plan.options.kernel_flags() == dict(causal=True, window=True,
                                                           softcap=True)
    vllm_call(b, window_size=(64, 0))  # another kind of layer: its own attention
    att, _ = one_shot(scalars=(True, None, (64, 0), 0.0))
    assert att.current_plan.options.window_left == 64
    assert att.current_plan.options.softcap == 0.0
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], window_size=5)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], softcap=-1.0)


def test_speed_only_arguments_are_accepted():
    b = batch()
    vllm_call(b, num_splits=8, fa_version=3, scheduler_metadata=torch.zeros(4, **I32),
              deterministic=True, window_size=(-1, -1), softcap=0.0)


def test_bad_values_are_named():
    b = batch()
    with pytest.raises(ValueError, match="seqused_k or cu_seqlens_k"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, block_table=b["bt"])
    with pytest.raises(TypeError, match="max_seqlen_q"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], -1, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"])
    with pytest.raises(TypeError, match="q must be"):
        flash_attn_varlen_func(b["q"].float(), b["k"], b["v"], 20, b["cu"], 40,
                               seqused_k=b["kvl"], block_table=b["bt"])
    with pytest.raises(NotImplementedError, match="head_dim"):
        flash_attn_varlen_func(b["q"][..., :84], b["k"][..., :84], b["v"][..., :84], 20,
                               b["cu"], 40, seqused_k=b["kvl"], block_table=b["bt"])


# ---- plan reuse ------------------------------------------------------------------------


def planner_counting(att):
    """A CallPlanner whose plans are counted."""
    count = []
    planner = CallPlanner(att)

    def plan_fn():
        count.append(1)
        att.plan(*planner_args[0], **planner_args[1])
    planner_args = [(), {}]
    return planner, count, plan_fn, planner_args


def test_reuse_while_unchanged_and_replan_after_any_write():
    b = batch()
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    planner, count, plan_fn, args = planner_counting(att)
    args[0] = (b["cu"], b["kvl"])
    args[1] = dict(block_table=b["bt"])
    tensors = (b["cu"], b["kvl"], b["bt"])
    for _ in range(3):  # three layers of one step
        planner.plan(tensors, (True, None), plan_fn)
    assert len(count) == 1
    b["kvl"][1] += 1  # next step, written in place: torch's version counter moves
    assert not planner.plan(tensors, (True, None), plan_fn)
    assert att.current_plan.kv_len.tolist() == [40, 18]
    b["bt"][1, 1] = 5  # a page swap, same lengths
    assert not planner.plan(tensors, (True, None), plan_fn)
    assert att.current_plan.page_list.tolist()[3:6] == [3, 5, 7]
    assert not planner.plan(tensors, (False, None), plan_fn)  # another scalar
    assert planner.plan(tensors, (False, None), plan_fn)
    podcute.invalidate_plans()
    assert not planner.plan(tensors, (False, None), plan_fn)
    assert len(count) == 5


def test_reuse_rule_compares_values_not_tensors():
    b = batch()
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    planner, count, plan_fn, args = planner_counting(att)
    args[0], args[1] = (b["cu"], b["kvl"]), dict(block_table=b["bt"])
    planner.plan((b["cu"], b["kvl"], b["bt"]), (), plan_fn)
    # A new tensor with other values plans; one with the same values (a new object, other
    # memory) reuses.
    b["kvl"] = torch.tensor([40, 17], **I32)
    assert planner.plan((b["cu"], b["kvl"], b["bt"]), (), plan_fn)
    b["kvl"] = torch.tensor([40, 16], **I32)
    args[0] = (b["cu"], b["kvl"])
    assert not planner.plan((b["cu"], b["kvl"], b["bt"]), (), plan_fn)
    # A view of other shape differs; numpy arrays compare by value like tensors.
    assert not planner.plan((b["cu"], b["kvl"], b["bt"][:, :2]), (), plan_fn)
    a = np.array([0, 20, 21], dtype=np.int32)
    args[0] = (a, b["kvl"])
    args[1] = dict(block_table=b["bt"])
    assert not planner.plan((a, b["kvl"], b["bt"]), (), plan_fn)
    assert planner.plan((a, b["kvl"], b["bt"]), (), plan_fn)
    a[1] = 19
    assert not planner.plan((a, b["kvl"], b["bt"]), (), plan_fn)
    assert att.current_plan.q_lens.tolist() == [19, 2]
    assert len(count) == 5


def test_one_shot_entry_points_reuse_their_plan():
    b = batch()
    _, planner = one_shot()
    planner.invalidate()
    vllm_call(b)
    made = planner._made
    vllm_call(b)  # the next layer: same tensors
    assert planner._made is made
    plan_before = one_shot()[0].current_plan
    vllm_call(b)
    assert one_shot()[0].current_plan is plan_before  # not re-planned
    b["kvl"].add_(1)
    vllm_call(b)
    assert one_shot()[0].current_plan is not plan_before
    # pod_attention shares the same machinery.
    call(podcute.pod_attention, b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"],
         seqused_k=b["kvl"], block_table=b["bt"])
    p = one_shot(scalars=POD_SCALARS)[0].current_plan
    call(podcute.pod_attention, b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"],
         seqused_k=b["kvl"], block_table=b["bt"])
    assert one_shot(scalars=POD_SCALARS)[0].current_plan is p


def test_run_lse_buffer_is_checked():
    b = batch()
    att = podcute.PODAttention(HQ, HKV, D, PS, device="cpu")
    att.plan(b["cu"], b["kvl"], block_table=b["bt"])
    with pytest.raises(TypeError, match="lse must be float32"):
        att.run(b["q"], b["k"], b["v"], lse=torch.empty(21, HQ, dtype=torch.float16))
    with pytest.raises(ValueError, match="lse must be"):
        att.run(b["q"], b["k"], b["v"], lse=torch.empty(HQ, 21))
    with pytest.raises(ValueError, match="zero strides"):
        att.run(b["q"], b["k"], b["v"], lse=torch.empty(1, HQ).expand(21, HQ))
    with pytest.raises(RuntimeError, match="Hopper"):  # a transposed [Hq, T] buffer is fine
        att.run(b["q"], b["k"], b["v"], lse=torch.empty(HQ, 21).t())


def test_contiguous_token_pages_share_one_array():
    """Contiguous K/V's 1-token page list: arange(total_k) for every size, views of one
    array, so a loop of varying sizes keeps no array per size alive."""
    from podcute.compat import flash_attn as fa

    views = [fa._token_pages(n) for n in (5, 300, 17, 1000, 1)]
    for n, v in zip((5, 300, 17, 1000, 1), views):
        assert v.dtype == np.int32 and (v == np.arange(n)).all()
    big = fa._TOKEN_PAGES
    assert big.size >= 1000
    assert fa._token_pages(999).base is big and fa._token_pages(0).size == 0


# ---- the per-layer path (launch recorded instead of run on a GPU) ----------------------


def pod_call(b, **kw):
    return podcute.pod_attention(b["q"], b["k"], b["v"], cu_seqlens_q=b["cu"],
                                 seqused_k=b["kvl"], block_table=b["bt"], **kw)


def test_layers_reuse_the_plan_and_any_change_replans(launches):
    b = batch()
    out = torch.empty_like(b["q"])
    for _ in range(3):
        assert pod_call(b, out=out) is out
    plans = [r[0] for r in launches]
    assert plans[0] is plans[1] is plans[2] and launches[2][1] is b["q"]
    b["kvl"].add_(1)  # an in-place write moves the version counter
    pod_call(b, out=out)
    assert launches[-1][0] is not plans[0] and launches[-1][0].kv_len.tolist() == [41, 18]
    b["kvl"].data = torch.tensor([40, 10], **I32)  # re-pointed: no version counter moves
    pod_call(b)
    assert launches[-1][0].kv_len.tolist() == [40, 10]
    # Same address and shape, other strides (a .data view): request 1's pages differ.
    base = torch.tensor([0, 1, 2, 3, 4, 7, 5, 6], **I32)
    b["bt"] = base[:6].view(2, 3)
    pod_call(b)
    assert launches[-1][0].page_list.tolist()[3:] == [3, 4, 7]
    b["bt"].data = base.as_strided((2, 3), (4, 1))
    p = launches[-1][0]
    pod_call(b)
    assert launches[-1][0] is not p and launches[-1][0].page_list.tolist()[3:] == [4, 7, 5]
    # A new tensor object over unchanged memory compares by fingerprint: reused.
    p = launches[-1][0]
    b["cu"] = b["cu"].view(3)
    pod_call(b)
    assert launches[-1][0] is p
    # A scalar change replans.
    pod_call(b, causal=False)
    assert launches[-1][0] is not p and not launches[-1][0].causal


def test_layer_path_finds_each_configuration(launches):
    """The per-layer path starts from the last call's attention; a call of another head
    count, head dim or cache layout must still get its own (and bad shapes their errors)."""
    b = batch()
    pod_call(b)
    wide = dict(b, q=torch.randn(21, 2 * HQ, D, dtype=torch.bfloat16))
    pod_call(wide)
    att_wide = one_shot_module.one_shot_attention(2 * HQ, HKV, D, PS, torch.bfloat16, "NHD",
                                      torch.device("cpu"), scalars=POD_SCALARS)[0]
    assert launches[-1][0] is att_wide.current_plan and launches[-1][1] is wide["q"]
    pod_call(b)
    assert launches[-1][0] is one_shot(scalars=POD_SCALARS)[0].current_plan
    with pytest.raises(NotImplementedError, match="head_dim"):
        pod_call(dict(b, q=b["q"][..., :84], k=b["k"][..., :84], v=b["v"][..., :84]))
    with pytest.raises(ValueError, match="kv_layout"):
        pod_call(b, kv_layout="NDH")
    # Hkv == page_size: an NHD and an HND cache have one shape; the layout tells them apart.
    sq = dict(b, q=torch.randn(21, 16, D, dtype=torch.bfloat16),
              k=torch.randn(8, 16, 16, D, dtype=torch.bfloat16),
              v=torch.randn(8, 16, 16, D, dtype=torch.bfloat16))
    pod_call(sq)
    pod_call(sq, kv_layout="HND")
    hnd = one_shot_module.one_shot_attention(16, 16, D, 16, torch.bfloat16, "HND", CPU,
                                 scalars=POD_SCALARS)[0]
    assert launches[-1][0] is hnd.current_plan
    pod_call(sq)
    nhd = one_shot_module.one_shot_attention(16, 16, D, 16, torch.bfloat16, "NHD", CPU,
                                 scalars=POD_SCALARS)[0]
    assert launches[-1][0] is nhd.current_plan and nhd is not hnd


def test_flash_attn_layer_path(launches):
    """vLLM's per-layer call: descales (unused for a bf16 cache, run()'s scales for fp8)
    and softmax_lse [Hq, total_q] on the path that skips the argument mapping."""
    b = batch()
    ones = torch.ones(1).expand(2, HKV)
    for _ in range(2):
        out, lse = flash_attn_varlen_func(
            b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"], block_table=b["bt"],
            causal=True, q_descale=ones, k_descale=ones, v_descale=ones,
            return_softmax_lse=True)
        assert lse.shape == (HQ, 21) and launches[-1][5].data_ptr() == lse.data_ptr()
        assert launches[-1][5].stride() == (1, 21) and launches[-1][6]["k_scale"] is None
    assert launches[0][0] is launches[1][0]
    b8 = dict(b, k=b["k"].to(torch.float8_e4m3fn), v=b["v"].to(torch.float8_e4m3fn))
    per_head = torch.rand(HKV) + 0.5
    for _ in range(2):
        vllm_call_ok = flash_attn_varlen_func(
            b8["q"], b8["k"], b8["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
            block_table=b["bt"], causal=True, k_descale=per_head.expand(2, HKV))
        assert vllm_call_ok.shape == b["q"].shape
        ks = launches[-1][6]["k_scale"]
        assert ks.data_ptr() == per_head.data_ptr() and ks.shape == (HKV,)
    assert launches[-1][0] is launches[-2][0] is not launches[0][0]
    b["bt"][1, 2] = 6  # the next step writes the page table in place
    flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                           block_table=b["bt"], causal=True)
    assert launches[-1][0].page_list.tolist()[3:] == [3, 4, 6]
    with pytest.raises(TypeError, match="k_descale"):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], causal=True, k_descale=1.0)


def test_inference_mode_metadata(launches):
    """Index tensors made under torch.inference_mode() have no version counter: CPU ones
    are compared by content (reused while equal, replanned after a write), device ones
    plan every call (never a stale plan)."""
    with torch.inference_mode():
        b = batch()
        pod_call(b)
        pod_call(b)
        assert launches[0][0] is launches[1][0]
        b["kvl"][1] = 9
        pod_call(b)
        assert launches[2][0] is not launches[0][0]
        assert launches[2][0].kv_len.tolist() == [40, 9]
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, seqused_k=b["kvl"],
                               block_table=b["bt"], causal=True)
        meta = torch.zeros(3, device="meta", dtype=torch.int32)
        assert host_view(meta) is None  # (device values are never compared)


def test_a_layers_call_takes_the_per_layer_path(launches, monkeypatch):
    """After the step's first call, a vLLM-form call with unchanged metadata launches
    without mapping its arguments again (_Call.of): the per-layer path's index tuple
    must be the planned one's."""
    from podcute.compat import flash_attn as fa

    b = batch()
    vllm = dict(seqused_k=b["kvl"], block_table=b["bt"], causal=True)
    flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, **vllm)
    mapped = []
    of = fa._Call.of
    monkeypatch.setattr(fa._Call, "of", staticmethod(lambda *a: mapped.append(1) or of(*a)))
    for _ in range(3):
        flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, **vllm)
    assert not mapped and launches[-1][0] is launches[0][0]
    b["kvl"].numpy()[1] = 16  # a new step: the full path plans it
    flash_attn_varlen_func(b["q"], b["k"], b["v"], 20, b["cu"], 40, **vllm)
    assert mapped == [1] and launches[-1][0].kv_len.tolist() == [40, 16]
