"""Hostile inputs at the public edge (CPU): every one is refused with a ValueError or
TypeError that names the argument and the limit, or handled correctly, before anything
reaches a device. Cases from issue 8's probe: int32 overflow of lengths and page
offsets, float32 overflow of sm_scale, the planner's cost arithmetic on the largest
prefills the capacities allow, aliasing outputs, and unhelpful torch internals."""

import numpy as np
import pytest
import torch

from podcute import CapacityError, PODAttention, pod_attention
from podcute.planning import MAX_KV_LEN, MAX_NUM_TOKENS, Planner

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
I32 = dict(dtype=torch.int32)


def _match(exc, *words):
    msg = str(exc.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


# ---- int32 ranges --------------------------------------------------------------------------


def test_csr_kv_len_past_int32_is_refused():
    """kv_indptr = [0, 2**23 + 10] pages of 256 tokens: kv_len 2**31 + 2560 (it wrapped to
    a negative int32 before)."""
    n = 2**23 + 10
    a = PODAttention(8, 8, 128, 256, device="cpu")
    with pytest.raises(ValueError) as e:
        a.plan(torch.tensor([0, 1], **I32), kv_indptr=torch.tensor([0, n], **I32),
               kv_indices=torch.zeros(n, **I32), last_page_len=torch.tensor([256], **I32))
    _match(e, "last_page_len", str(MAX_KV_LEN))
    with pytest.raises(ValueError) as e:  # the same through kv_lens: int32 can't hold it
        a.plan(torch.tensor([0, 1], **I32), torch.tensor([2**31 - 1], **I32),
               block_table=torch.zeros(1, 2**23, **I32))
    _match(e, "kv_lens", str(MAX_KV_LEN))


def test_block_table_row_stride_past_int32_is_copied_not_wrapped():
    """A block table whose rows lie 2**30 elements apart: page offsets past 2**31 used to
    wrap. The plan copies the pages it reads into its own list, so offsets stay small."""
    storage = torch.empty(2 * 2**30 + 3, **I32)  # never touched beyond three short rows
    bt = storage.as_strided((3, 3), (2**30, 1))
    for r in range(3):
        bt[r] = torch.tensor([3 * r, 3 * r + 1, 3 * r + 2], **I32)
    p = Planner(8, 8, 128, 16, device="cpu")
    plan = p.plan(torch.tensor([0, 1, 2, 3], **I32), torch.tensor([40, 17, 48], **I32),
                  block_table=bt)
    assert plan.page_start.tolist() == [0, 3, 6]
    assert plan.page_list.tolist() == list(range(9))


def test_sm_scale_must_fit_float32():
    a = PODAttention(8, 8, 128, 16, device="cpu")
    args = (torch.tensor([0, 1], **I32), torch.tensor([5], **I32))
    for bad in (1e39, -1.0, 0.0, float("nan"), float("inf"), 1e-46, 10**400):
        with pytest.raises(ValueError) as e:
            a.plan(*args, block_table=torch.zeros(1, 1, **I32), sm_scale=bad)
        _match(e, "sm_scale", "float32")
    with pytest.raises(ValueError, match="sm_scale.*float32"):  # the planner checks too
        a.planner.plan(*args, block_table=torch.zeros(1, 1, **I32), sm_scale=1e39)


# ---- the planner's arithmetic at the capacity limits ------------------------------------------


@pytest.mark.parametrize("tokens", [2**20, 2**21])
def test_huge_prefill_is_balanced(tokens):
    """One causal prefill of 2**20 / 2**21 tokens at 64/8/128: the cost prefix sums and the
    cut search stay exact (float64), so every CTA gets its share (balance within 5%) and
    the prediction is the work over the grid."""
    p = Planner(64, 8, 128, 16, device="cpu", max_batch_size=1, max_num_tokens=tokens,
                max_num_pages=tokens // 16)
    pages = torch.arange(tokens // 16, **I32).view(1, -1)
    plan = p.plan(torch.tensor([0, tokens], **I32), torch.tensor([tokens], **I32),
                  block_table=pages)
    s = plan.summary
    assert s.balance <= 1.05, s
    ideal = plan.item_cost_us.sum() / plan.grid
    assert ideal > 0 and s.predicted_us == pytest.approx(plan.cta_cost_us.max())
    assert s.predicted_us <= 1.05 * ideal
    work = plan.work.numpy()
    assert (work[:, 5] > work[:, 4]).all() and work[:, 5].max() <= tokens


def test_capacity_limits_are_named():
    with pytest.raises(CapacityError) as e:
        PODAttention(8, 8, 128, 16, device="cpu", max_num_tokens=2**31 - 1)
    _match(e, "max_num_tokens", str(MAX_NUM_TOKENS))
    with pytest.raises(CapacityError) as e:
        PODAttention(8, 8, 128, 16, device="cpu", max_batch_size=2**31 - 1)
    _match(e, "max_batch_size")
    with pytest.raises(CapacityError) as e:
        PODAttention(8, 8, 128, 16, device="cpu", max_num_pages=2**31 - 1)
    _match(e, "max_num_pages")
    # a batch that large, planned before any capture, is refused the same way
    a = PODAttention(8, 8, 128, 16, device="cpu", max_num_tokens=64)
    with pytest.raises(CapacityError) as e:
        a.plan(torch.tensor([0, 2**31 - 1], **I32), torch.tensor([5], **I32),
               kv_indptr=torch.tensor([0, 1], **I32), kv_indices=torch.zeros(1, **I32),
               causal=False)
    _match(e, "max_num_tokens")


# ---- aliasing outputs ------------------------------------------------------------------------


def _planned(device="cpu"):
    a = PODAttention(8, 2, 128, 16, device=device)
    a.plan(torch.tensor([0, 20, 21], **I32), torch.tensor([40, 17], **I32),
           block_table=torch.tensor([[0, 1, 2], [3, 4, 7]], **I32))
    return a


def _valid_stop(call):
    """A valid call: on a machine without a Hopper GPU it stops at the GPU check."""
    if HAS_HOPPER:
        return call()
    with pytest.raises(RuntimeError, match="Hopper"):
        call()


def test_out_must_not_alias_inputs():
    a = _planned()
    buf = torch.randn(22, 8, 128, dtype=torch.bfloat16)
    q = buf[:21]
    k = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with pytest.raises(ValueError) as e:  # out = q shifted by one row
        a.run(q, k, v, out=buf[1:])
    _match(e, "out", "overlaps q")
    with pytest.raises(ValueError) as e:  # out = q itself: no in-place
        a.run(q, k, v, out=q)
    _match(e, "out", "q")
    pool = torch.randn(128, 8, 128, dtype=torch.bfloat16)
    kv = pool.view(8, 16, 8, 128)[:, :, :2]
    with pytest.raises(ValueError) as e:  # out inside the KV cache's storage
        a.run(q, kv, kv, out=pool[30:51])
    _match(e, "out", "k_cache")
    with pytest.raises(ValueError) as e:  # zero strides
        a.run(q, k, v, out=torch.zeros(1, 8, 128, dtype=torch.bfloat16).expand(21, 8, 128))
    _match(e, "out", "zero strides")
    with pytest.raises(ValueError) as e:  # rows overlapping each other
        a.run(q, k, v, out=torch.zeros(4096, dtype=torch.bfloat16).as_strided(
            (21, 8, 128), (64, 128, 1)))
    _match(e, "out", "overlap")
    # a separate buffer, also one wider than needed, is fine
    _valid_stop(lambda: a.run(q, k, v, out=torch.empty(21, 8, 128, dtype=torch.bfloat16)))
    _valid_stop(lambda: a.run(q, k, v, out=torch.empty(21, 8, 256, dtype=torch.bfloat16)[..., :128]))


def test_padding_rows_of_q_and_out_are_allowed():
    """Engines pad the token count to a captured graph's size: q and out may have more
    rows than cu_seqlens_q[-1] (the padding is never read or written)."""
    a = _planned()
    q = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(8, 16, 2, 128, dtype=torch.bfloat16)
    _valid_stop(lambda: a.run(q, k, k.clone(), out=torch.empty_like(q)))
    with pytest.raises(ValueError, match="out"):
        a.run(q, k, k.clone(), out=torch.empty(63, 8, 128, dtype=torch.bfloat16))


# ---- unhelpful errors ------------------------------------------------------------------------


def test_zero_kv_heads_and_devices_are_named():
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(4, 16, 0, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        pod_attention(q, k, k, cu_seqlens_q=torch.tensor([0, 2], **I32),
                      seqused_k=torch.tensor([2], **I32), block_table=torch.zeros(1, 1, **I32))
    _match(e, "k_cache", "KV heads")
    for dev in ("meta", "bogus", "cuda:zz"):
        with pytest.raises(ValueError) as e:
            PODAttention(8, 8, 128, 16, device=dev)
        _match(e, "device")
    with pytest.raises(TypeError, match="device"):
        PODAttention(8, 8, 128, 16, device=3.5)


def test_sparse_and_meta_inputs_are_named():
    a = PODAttention(8, 8, 128, 16, device="cpu")
    cu = torch.tensor([0, 1], **I32)
    with pytest.raises(TypeError) as e:
        a.plan(cu.to_sparse(), torch.tensor([5], **I32), block_table=torch.zeros(1, 1, **I32))
    _match(e, "cu_seqlens_q", "dense")
    with pytest.raises(TypeError) as e:
        a.plan(cu, torch.tensor([5], **I32), block_table=torch.zeros(1, 1, **I32).to_sparse())
    _match(e, "block_table", "dense")
    with pytest.raises(ValueError) as e:
        a.plan(cu, torch.tensor([5], dtype=torch.int32, device="meta"),
               block_table=torch.zeros(1, 1, **I32))
    _match(e, "kv_lens", "meta")
    a.plan(cu, torch.tensor([5], **I32), block_table=torch.zeros(1, 1, **I32))
    q = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 16, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError) as e:
        a.run(q.to_sparse(), k, k)
    _match(e, "q", "dense")
    with pytest.raises(ValueError) as e:
        a.run(q.to("meta"), k, k)
    _match(e, "q", "meta")


def test_plan_copies_page_tables_into_its_own_buffer():
    """The kernel reads only plan-owned buffers: the same kernel_args tuple for every plan,
    whatever tensors the caller passed, and the caller's table may change afterwards."""
    p = Planner(8, 8, 128, 16, device="cpu")
    args = p.kernel_args
    rng = np.random.default_rng(0)
    for fmt in ("table", "csr", "table"):
        bt = torch.from_numpy(rng.permutation(64).astype(np.int32).reshape(4, 16))
        kvl = torch.tensor([100, 7, 256, 33], **I32)
        if fmt == "table":
            plan = p.plan(torch.tensor([0, 1, 2, 3, 4], **I32), kvl, block_table=bt)
            want = [bt[b, : -(-int(n) // 16)].tolist() for b, n in enumerate(kvl)]
        else:
            counts = [-(-int(n) // 16) for n in kvl]
            indptr = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), **I32)
            idx = torch.from_numpy(rng.permutation(64)[: int(indptr[-1])].astype(np.int32))
            plan = p.plan(torch.tensor([0, 1, 2, 3, 4], **I32), kvl, kv_indptr=indptr,
                          kv_indices=idx)
            want = [idx[indptr[b]: indptr[b + 1]].tolist() for b in range(4)]
        assert plan.kernel_args is args
        starts = plan.page_start.tolist()
        got = [p._page_list[s: s + len(w)].tolist() for s, w in zip(starts, want)]
        assert got == want
        bt.fill_(-1)  # the caller reuses its tensor: the plan's copy is unaffected
        assert [p._page_list[s: s + len(w)].tolist() for s, w in zip(starts, want)] == want
    assert plan.params[0].item() == pytest.approx(1 / 128**0.5)
