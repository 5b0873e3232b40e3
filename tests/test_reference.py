"""The float32 reference against an independent float64 oracle that walks the pages
token by token, written straight from docs/contract.md; plus make_batch's promises."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import podcute.reference as reference
from podcute import pod_attention_reference
from podcute.testing import make_batch, random_lengths


def oracle(batch, causal=True, sm_scale=None):
    """float64 out [total_q, Hq, D] and lse [total_q, Hq], one token and head at a time."""
    q = batch.q.double()
    total_q, hq, d = q.shape
    hkv = batch.k_cache.shape[2 if batch.kv_layout == "NHD" else 1]
    ps = batch.page_size
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    cu = batch.cu_seqlens_q.tolist()
    for i, kv_len in enumerate(batch.seqused_k.tolist()):
        if batch.block_table is not None:
            pages = batch.block_table[i].tolist()
        else:
            ptr = batch.kv_indptr.tolist()
            pages = batch.kv_indices[ptr[i] : ptr[i + 1]].tolist()
        keys, values = [], []
        for t in range(kv_len):
            page, slot = pages[t // ps], t % ps
            if batch.kv_layout == "NHD":
                keys.append(batch.k_cache[page, slot].double())
                values.append(batch.v_cache[page, slot].double())
            else:
                keys.append(batch.k_cache[page, :, slot].double())
                values.append(batch.v_cache[page, :, slot].double())
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            row = cu[i] + j
            visible = min(kv_len, kv_len - q_len + j + 1) if causal else kv_len
            for h in range(hq):
                if visible <= 0:
                    continue
                kh = h // (hq // hkv)
                s = torch.stack([keys[t][kh] @ q[row, h] for t in range(visible)]) * scale
                m = s.max()
                e = torch.exp(s - m)
                lse[row, h] = m + torch.log(e.sum())
                out[row, h] = sum(e[t] * values[t][kh] for t in range(visible)) / e.sum()
    return out, lse


def check(batch, causal=True, tol=2e-5):
    out, lse = pod_attention_reference(
        batch.q, batch.k_cache, batch.v_cache, causal=causal, return_lse=True, **batch.kwargs()
    )
    want_out, want_lse = oracle(batch, causal, batch.sm_scale)
    assert out.dtype == batch.q.dtype and lse.dtype == torch.float32
    assert out.shape == batch.q.shape and lse.shape == batch.q.shape[:2]
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
    return out, lse


# Padding (q_len 0, also with kv_len 0), kv_len 1, decode, prefill, q_len == kv_len.
MIXED_Q = [3, 0, 1, 4, 1, 0, 6]
MIXED_KV = [9, 5, 1, 4, 20, 0, 13]


def small(q_lens=MIXED_Q, kv_lens=MIXED_KV, **kw):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32)
    return make_batch(q_lens, kv_lens, **{**args, **kw})


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_format", ["table", "csr"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("strided_q", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_layouts_and_page_formats(kv_layout, page_format, interleaved, strided_q, causal):
    batch = small(
        kv_layout=kv_layout, page_format=page_format, interleaved=interleaved, strided_q=strided_q
    )
    assert batch.k_cache.is_contiguous() != interleaved
    assert batch.q.is_contiguous() != strided_q
    check(batch, causal)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (14, 2), (16, 2), (8, 1), (1, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_and_mqa(hq, hkv, causal):
    check(small(num_qo_heads=hq, num_kv_heads=hkv, kv_layout="HND"), causal)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_page_sizes_decode_and_prefill(page_size, causal):
    q_lens = [1, 2, 3, 4, 5, 6, 7, 8, 17, 1]
    kv_lens = [1, 5, 16, 17, 33, 8, 40, 9, 17, 1]
    check(small(q_lens, kv_lens, page_size=page_size), causal)


@pytest.mark.parametrize("causal", [True, False])
def test_custom_sm_scale(causal):
    check(small(sm_scale=0.37), causal)


def test_rows_that_see_no_key():
    # kv_len 0 with q_len > 0 is legal without causal: such rows give out 0, lse -inf.
    batch = small([2, 1], [0, 3])
    out, lse = check(batch, causal=False)
    assert torch.all(out[:2] == 0) and torch.all(lse[:2] == -math.inf)
    assert torch.isfinite(lse[2:]).all()
    # Beyond the contract (the API rejects it), causal q_len > kv_len: the first
    # q_len - kv_len rows sit before position 0 and see nothing.
    out, lse = check(small([5], [3]), causal=True)
    assert torch.all(lse[:2] == -math.inf) and torch.isfinite(lse[2:]).all()
    assert torch.all(out[:2] == 0)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_out_dtype_is_q_dtype(dtype, tol):
    check(small(dtype=dtype, strided_q=True), tol=tol)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_garbage_does_not_leak(kv_layout):
    nan = small(kv_layout=kv_layout, interleaved=True, strided_q=True)
    big = small(kv_layout=kv_layout, interleaved=True, strided_q=True, garbage=1e30)
    for causal in (True, False):
        out, lse = nan.reference(causal=causal, return_lse=True)
        assert not out.isnan().any() and not lse.isnan().any()
        # Same seed, other garbage: bit-identical results.
        out2, lse2 = big.reference(causal=causal, return_lse=True)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_variants_share_values():
    """Layout, page format, interleaving and strided q change storage, not the batch."""
    base = small().reference(return_lse=True)
    for kw in (
        dict(kv_layout="HND"),
        dict(page_format="csr"),
        dict(interleaved=True, strided_q=True, kv_layout="HND", page_format="csr"),
    ):
        torch.testing.assert_close(small(**kw).reference(return_lse=True), base, atol=0, rtol=0)


def test_long_prefill_is_chunked(monkeypatch):
    batch = small([40, 1], [50, 30], page_size=16)
    whole = batch.reference(return_lse=True)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 8 * 50 * 3)  # 3 queries per chunk
    chunked = check(batch)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


def test_errors():
    b = small()
    args = (b.q, b.k_cache, b.v_cache)
    lens = dict(cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k)
    csr = small(page_format="csr")
    with pytest.raises(ValueError, match="kv_layout"):
        pod_attention_reference(*args, **lens, block_table=b.block_table, kv_layout="NDH")
    with pytest.raises(ValueError, match="page format"):
        pod_attention_reference(*args, **lens)
    with pytest.raises(ValueError, match="page format"):
        pod_attention_reference(
            *args,
            **lens,
            block_table=b.block_table,
            kv_indptr=csr.kv_indptr,
            kv_indices=csr.kv_indices,
        )
    with pytest.raises(ValueError, match="together"):
        pod_attention_reference(*args, **lens, kv_indptr=csr.kv_indptr)


@pytest.mark.parametrize("page_format", ["table", "csr"])
def test_make_batch_pool(page_format):
    ps = 4
    b = small(page_format=page_format, interleaved=True, strided_q=True, pool_factor=3.0)
    n_pages = [-(-n // ps) for n in MIXED_KV]
    needed = sum(n_pages)
    assert b.k_cache.shape == (3 * needed, ps, 2, 16)
    assert b.k_cache.data_ptr() != b.v_cache.data_ptr()
    assert b.k_cache.untyped_storage().data_ptr() == b.v_cache.untyped_storage().data_ptr()
    assert b.q.stride(0) == (8 + 2 * 2) * 16
    assert b.cu_seqlens_q.dtype == b.seqused_k.dtype == b.last_page_len.dtype == torch.int32
    assert b.cu_seqlens_q.tolist() == [0, 3, 3, 4, 8, 9, 9, 15]
    assert b.seqused_k.tolist() == MIXED_KV
    assert b.last_page_len.tolist() == [1, 1, 1, 4, 4, 0, 1]
    for kv, p, last in zip(MIXED_KV, n_pages, b.last_page_len.tolist()):
        assert kv == (0 if p == 0 else (p - 1) * ps + last)
    if page_format == "csr":
        assert b.block_table is None and b.kv_indptr.dtype == b.kv_indices.dtype == torch.int32
        assert b.kv_indptr.tolist() == [0, 3, 5, 6, 7, 12, 12, 16]
        pages = [b.kv_indices[s:e].tolist() for s, e in zip(b.kv_indptr[:-1], b.kv_indptr[1:])]
    else:
        assert b.kv_indptr is None and b.block_table.dtype == torch.int32
        assert b.block_table.shape == (7, max(n_pages))
        pages = [row[:p] for row, p in zip(b.block_table.tolist(), n_pages)]
    flat = [p for own in pages for p in own]
    assert len(set(flat)) == needed  # requests never share pages
    for kv, own in zip(MIXED_KV, pages):
        for n, page in enumerate(own):
            filled = min(ps, kv - n * ps)
            assert torch.isfinite(b.k_cache[page, :filled]).all()
            assert torch.isnan(b.k_cache[page, filled:]).all()  # tail of the last page
            v = b.v_cache[page, :filled]
            assert (v != 0).all() and not v.isnan().any()
    unused = set(range(b.k_cache.shape[0])) - set(flat)
    assert all(torch.isnan(b.k_cache[p]).all() and torch.isnan(b.v_cache[p]).all() for p in unused)
    if page_format == "table":  # entries past a request's pages: all-garbage pages
        for row, p in zip(b.block_table.tolist(), n_pages):
            assert set(row[p:]) <= unused
    assert torch.isnan(b.q.as_strided((b.q.shape[0], 4, 16), (b.q.stride(0), 16, 1), 8 * 16)).all()


def test_make_batch_without_spare_pages():
    b = small(pool_factor=1.0)
    assert b.k_cache.shape[0] == sum(-(-n // 4) for n in MIXED_KV)
    assert b.block_table[5].tolist() == [0] * b.block_table.shape[1]  # kv_len 0: all pads
    check(b)


def test_random_lengths():
    q_lens, kv_lens = random_lengths(
        random.Random(1), 5, 3, max_kv_len=30, max_decode_q=4, max_prefill_q=12
    )
    assert len(q_lens) == 8 and all(1 <= q <= kv <= 30 for q, kv in zip(q_lens, kv_lens))
    assert sum(q > 4 for q in q_lens) <= 3
    check(small(q_lens, kv_lens, page_size=2))


HEADS = [(1, 1), (4, 4), (8, 2), (7, 1), (14, 2), (8, 1)]


@st.composite
def batches(draw):
    causal = draw(st.booleans())
    kv_lens = draw(st.lists(st.integers(0, 24), min_size=1, max_size=4))
    q_lens = [draw(st.integers(0, kv if causal else 6)) for kv in kv_lens]
    hq, hkv = draw(st.sampled_from(HEADS))
    batch = make_batch(
        q_lens,
        kv_lens,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=draw(st.sampled_from([8, 16])),
        page_size=draw(st.sampled_from([1, 2, 4, 16])),
        dtype=torch.float32,
        kv_layout=draw(st.sampled_from(["NHD", "HND"])),
        page_format=draw(st.sampled_from(["table", "csr"])),
        interleaved=draw(st.booleans()),
        strided_q=draw(st.booleans()),
        pool_factor=draw(st.sampled_from([1.0, 1.5, 3.0])),
        sm_scale=draw(st.sampled_from([None, 0.3])),
        seed=draw(st.integers(0, 2**16)),
    )
    return batch, causal


@settings(max_examples=50, deadline=None)
@given(batches())
def test_random_batches(case):
    batch, causal = case
    check(batch, causal)
