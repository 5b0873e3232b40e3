"""The float32 reference against an independent float64 oracle that walks the pages
token by token, written straight from docs/contract.md; plus make_batch's promises."""

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import podcute.reference as reference
from podcute import pod_attention_reference
from podcute.testing import make_batch, random_lengths


def contract_keys(kv_len, q_len, j, causal, window=(-1, -1)):
    """The keys query j sees, word for word from docs/contract.md."""
    p = kv_len - q_len + j
    left, right = window
    return [
        t
        for t in range(kv_len)
        if (left < 0 or t >= p - left) and (right < 0 or t <= p + right) and (not causal or t <= p)
    ]


def oracle(
    batch, causal=True, sm_scale=None, window_size=(-1, -1), softcap=0.0, sinks=None, keys_of=None
):
    """float64 out [total_q, Hq, D] and lse [total_q, Hq], one token and head at a time.
    `keys_of(kv_len, q_len, j)` overrides which keys a query sees."""
    if keys_of is None:
        keys_of = lambda kv, ql, j: contract_keys(kv, ql, j, causal, window_size)  # noqa: E731
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
            seen = keys_of(kv_len, q_len, j)
            for h in range(hq):
                sink = -math.inf if sinks is None else float(sinks[h])
                if not seen and sink == -math.inf:
                    continue
                kh = h // (hq // hkv)
                s = [scale * float(keys[t][kh] @ q[row, h]) for t in seen]
                if softcap > 0:
                    s = [softcap * math.tanh(x / softcap) for x in s]
                m = max(s + [sink])
                e = [math.exp(x - m) for x in s]
                total = sum(e) + math.exp(sink - m)
                lse[row, h] = m + math.log(total)
                for t, w in zip(seen, e):
                    out[row, h] += (w / total) * values[t][kh]
    return out, lse


def check(batch, causal=True, tol=2e-5, **features):
    out, lse = pod_attention_reference(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        causal=causal,
        return_lse=True,
        **batch.kwargs(),
        **features,
    )
    want_out, want_lse = oracle(batch, causal, batch.sm_scale, **features)
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


# ---------------------------------------------------------------------------------------
# Model features: sliding window, logit soft-capping, attention sinks (docs/contract.md,
# "Model features"), each against the float64 oracle above.


def random_sinks(hq, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(hq, generator=gen) * scale


def reference_of(batch, causal=True, **features):
    return pod_attention_reference(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        causal=causal,
        return_lse=True,
        **batch.kwargs(),
        **features,
    )


# (window, whether it hides keys somewhere in the MIXED batch with causal / without).
WINDOWS = [
    ((0, -1), True, True),  # causal: the token itself only
    ((2, -1), True, True),  # left shorter than the prefills
    ((5, -1), True, True),
    ((40, -1), False, False),  # left longer than every request
    ((-1, 0), False, True),  # non-causal: the causal mask again
    ((-1, 3), False, True),
    ((0, 0), True, True),
    ((3, 2), True, True),
    ((2, 5), True, True),
    ((40, 40), False, False),
]
STORAGE = [("NHD", "table", False), ("HND", "csr", True), ("HND", "table", False)]


@pytest.mark.parametrize("window,cuts_causal,cuts_full", WINDOWS)
@pytest.mark.parametrize("kv_layout,page_format,interleaved", STORAGE)
@pytest.mark.parametrize("causal", [True, False])
def test_window(window, cuts_causal, cuts_full, kv_layout, page_format, interleaved, causal):
    batch = small(kv_layout=kv_layout, page_format=page_format, interleaved=interleaved, seed=11)
    out, lse = check(batch, causal, window_size=window)
    plain = batch.reference(causal=causal)
    assert torch.allclose(out, plain, atol=1e-6) != (cuts_causal if causal else cuts_full)


@pytest.mark.parametrize("left", [0, 1, 4, 100])
@pytest.mark.parametrize("right", [-1, 0, 3])
def test_causal_window_is_flashinfer_window_left(left, right):
    """Causal caps the right bound at 0; FlashInfer's window_left=L is (L, 0) + causal:
    the query at p sees keys max(0, p - L) .. p."""
    batch = small(page_size=3, seed=12)
    want = oracle(
        batch,
        keys_of=lambda kv, ql, j: list(range(max(0, kv - ql + j - left), kv - ql + j + 1)),
    )
    got = reference_of(batch, window_size=(left, right))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)


def test_window_rows_that_see_nothing():
    # Non-causal, q_len > kv_len with a right bound: rows with p + right < 0 see no key.
    # Request 0 (q 5, kv 2) sits at p = -3..1; request 1 has kv_len 0; request 2 is decode.
    batch = small([5, 2, 1], [2, 0, 6], seed=13)
    for window, empty in (((-1, 0), [0, 1, 2, 5, 6]), ((1, 1), [0, 1, 5, 6]), ((0, 2), [0, 5, 6])):
        out, lse = check(batch, causal=False, window_size=window)
        rows = torch.zeros(batch.q.shape[0], dtype=torch.bool)
        rows[empty] = True
        assert torch.all(out[rows] == 0) and torch.all(lse[rows] == -math.inf)
        assert torch.isfinite(lse[~rows]).all() and not out.isnan().any()


@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("causal", [True, False])
def test_softcap(softcap, causal):
    # sm_scale 1 on D = 16: scores have std ~4, so a cap of 0.5 or 2 bends most of them.
    batch = small(sm_scale=1.0, kv_layout="HND", page_format="csr", seed=14)
    out, lse = check(batch, causal, softcap=softcap)
    n_seen = torch.tensor(
        [
            len(contract_keys(kv, ql, j, causal))
            for ql, kv in zip(MIXED_Q, MIXED_KV)
            for j in range(ql)
        ],
        dtype=torch.float32,
    )
    assert torch.all(lse <= torch.log(n_seen)[:, None] + softcap + 1e-5)  # |s| < softcap
    if softcap < 30:
        assert not torch.allclose(out, batch.reference(causal=causal), atol=1e-3)


@pytest.mark.parametrize("sink_scale", [0.5, 3.0])
@pytest.mark.parametrize("kv_layout,page_format,interleaved", STORAGE)
@pytest.mark.parametrize("causal", [True, False])
def test_sinks(sink_scale, kv_layout, page_format, interleaved, causal):
    batch = small(kv_layout=kv_layout, page_format=page_format, interleaved=interleaved, seed=15)
    sinks = random_sinks(8, seed=16, scale=sink_scale)
    out, lse = check(batch, causal, sinks=sinks)
    plain_out, plain_lse = reference_of(batch, causal)
    assert torch.all(lse > plain_lse)  # the sink only ever adds to the normaliser
    # Out is the plain softmax scaled down by the sink's share: exp(plain_lse - lse).
    torch.testing.assert_close(
        out, plain_out * torch.exp(plain_lse - lse)[..., None], atol=1e-6, rtol=1e-5
    )


def test_sinks_are_stable_and_minus_inf_is_none():
    batch = small(seed=17)
    # exp(100) overflows float32; exp(-100) underflows: both must stay exact.
    sinks = torch.tensor([100.0, -100.0, 0.0, 30.0, -30.0, 5.0, -5.0, 88.0])
    out, lse = check(batch, sinks=sinks)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    plain = reference_of(batch)
    none = reference_of(batch, sinks=torch.full((8,), -math.inf))
    torch.testing.assert_close(none, plain, atol=0, rtol=0)


def test_sinks_rows_that_see_no_key():
    # kv_len 0 (request 0), and non-causal windowed rows before position 0 (request 1).
    batch = small([2, 4, 1], [0, 2, 5], seed=18)
    sinks = random_sinks(8, seed=19)
    out, lse = check(batch, causal=False, window_size=(-1, 0), sinks=sinks)
    empty = [0, 1, 2, 3]  # request 1 sits at p = -2..1: its rows p = -2, -1 see nothing
    assert torch.all(out[empty] == 0)
    assert torch.equal(lse[empty], sinks.expand(len(empty), 8))
    assert torch.all(lse[4:] > sinks)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])  # group 1, 4, MQA
@pytest.mark.parametrize("kv_layout,page_format,interleaved", STORAGE)
@pytest.mark.parametrize(
    "causal,window", [(True, (3, -1)), (True, (0, 0)), (False, (2, 1)), (False, (-1, 2))]
)
def test_feature_combinations(hq, hkv, kv_layout, page_format, interleaved, causal, window):
    batch = small(
        num_qo_heads=hq,
        num_kv_heads=hkv,
        kv_layout=kv_layout,
        page_format=page_format,
        interleaved=interleaved,
        strided_q=True,
        sm_scale=0.8,
        seed=20 + hq + hkv,
    )
    sinks = random_sinks(hq, seed=hq * 10 + hkv)
    check(batch, causal, window_size=window, softcap=2.5, sinks=sinks)
    check(batch, causal, window_size=window, softcap=2.5)
    check(batch, causal, window_size=window, sinks=sinks)
    check(batch, causal, softcap=2.5, sinks=sinks)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_features_in_half_precision(dtype, tol):
    batch = small(dtype=dtype, seed=21)
    check(batch, window_size=(2, -1), softcap=4.0, sinks=random_sinks(8, seed=22), tol=tol)


def test_features_with_chunked_prefill(monkeypatch):
    """Each query chunk cuts its own key range [lo, hi) out of the window."""
    batch = small([40, 7, 1], [50, 30, 30], page_size=16, seed=23)
    features = dict(window_size=(5, -1), softcap=3.0, sinks=random_sinks(8, seed=24))
    whole = reference_of(batch, **features)
    monkeypatch.setattr(reference, "_SCORE_BUDGET", 8 * 50 * 3)  # 3 queries per chunk
    torch.testing.assert_close(check(batch, **features), whole, atol=1e-6, rtol=1e-6)
    check(batch, causal=False, window_size=(4, 2), sinks=features["sinks"])


def test_garbage_does_not_leak_with_features():
    nan = small(kv_layout="HND", interleaved=True, strided_q=True, seed=25)
    big = small(kv_layout="HND", interleaved=True, strided_q=True, seed=25, garbage=1e30)
    features = dict(window_size=(3, 2), softcap=2.0, sinks=random_sinks(8, seed=26))
    for causal in (True, False):
        out, lse = reference_of(nan, causal, **features)
        assert not out.isnan().any() and not lse.isnan().any()
        again = reference_of(big, causal, **features)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def _attend_before_features(q, k, v, first_pos, causal, sm_scale):
    """reference._attend as it was before the model features, verbatim."""
    m, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    g = hq // hkv
    qh = q.reshape(m, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * m, d)
    s = torch.bmm(qh, k.permute(1, 2, 0)).view(hkv, g, m, kv_len) * sm_scale
    if causal:
        pos = torch.arange(first_pos, first_pos + m, device=q.device)
        keys = torch.arange(kv_len, device=q.device)
        s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.bmm(p.view(hkv, g * m, kv_len), v.transpose(0, 1)).view(hkv, g, m, d)
    return o.permute(2, 0, 1, 3).reshape(m, hq, d), lse.permute(2, 0, 1).reshape(m, hq)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(kv_layout="HND", page_format="csr", interleaved=True, strided_q=True),
        dict(num_qo_heads=8, num_kv_heads=1, dtype=torch.bfloat16),
        dict(q_lens=[2, 1, 40], kv_lens=[0, 3, 45], page_size=16),
    ],
)
def test_features_off_is_bitwise_the_old_result(monkeypatch, causal, kw):
    batch = small(**{"seed": 27, **kw})
    default = reference_of(batch, causal)
    explicit = reference_of(batch, causal, window_size=(-1, -1), softcap=0.0, sinks=None)

    def old(q, k, v, first_pos, causal, sm_scale, window, softcap, sinks):
        assert window == (-1, -1) and softcap == 0.0 and sinks is None
        return _attend_before_features(q, k, v, first_pos, causal, sm_scale)

    monkeypatch.setattr(reference, "_attend", old)
    before = reference_of(batch, causal)
    for got in (default, explicit):
        assert all(torch.equal(a, b) for a, b in zip(got, before))


def _split_in_two(batch):
    """Two table-format batches with the same queries: the first half of each request's
    pages (whole pages), and the rest."""
    assert batch.block_table is not None
    ps = batch.page_size
    table = batch.block_table.tolist()
    kv_a, kv_b, table_b = [], [], []
    for kv, row in zip(batch.kv_lens, table):
        n_a = (-(-kv // ps)) // 2
        kv_a.append(n_a * ps)
        kv_b.append(kv - n_a * ps)
        table_b.append(row[n_a:] + row[:n_a])  # entries past the pages are never read
    i32 = dict(dtype=torch.int32)
    # Only the lengths and pages the reference reads are replaced (not last_page_len).
    part_a = dataclasses.replace(batch, seqused_k=torch.tensor(kv_a, **i32), kv_lens=tuple(kv_a))
    part_b = dataclasses.replace(
        batch,
        seqused_k=torch.tensor(kv_b, **i32),
        kv_lens=tuple(kv_b),
        block_table=torch.tensor(table_b, **i32),
    )
    return part_a, part_b


def _merge(parts, sinks=None):
    """Merge (out, lse) states in float64; `sinks` adds the sink term once."""
    outs = [o.double() for o, _ in parts]
    lses = [lse.double() for _, lse in parts]
    if sinks is not None:
        lses_all = lses + [sinks.double().expand_as(lses[0])]
    else:
        lses_all = lses
    lse = torch.logsumexp(torch.stack(lses_all), dim=0)
    shift = torch.where(torch.isinf(lse), 0.0, lse)
    out = sum(torch.exp(l - shift)[..., None] * o for o, l in zip(outs, lses))
    return out, lse


@pytest.mark.parametrize(
    "q_lens,kv_lens,causal",
    [
        (MIXED_Q, MIXED_KV, False),
        ([1] * 6, [1, 4, 9, 16, 33, 2], True),  # decode: causal sees every key
    ],
)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_split_kv_merge_counts_the_sink_once(q_lens, kv_lens, causal, softcap):
    batch = small(q_lens, kv_lens, seed=28)
    sinks = random_sinks(8, seed=29)
    want = reference_of(batch, causal, softcap=softcap, sinks=sinks)
    oracle_want = oracle(batch, causal, softcap=softcap, sinks=sinks)
    part_a, part_b = _split_in_two(batch)
    assert any(kv > 0 for kv in part_a.kv_lens)  # both halves hold keys of some request
    assert all(kb > 0 for kv, kb in zip(batch.kv_lens, part_b.kv_lens) if kv > 0)

    def run(part, **kw):
        return reference_of(part, causal, softcap=softcap, **kw)

    # Both parts without sinks; the merge adds the sink once.
    merged = _merge([run(part_a), run(part_b)], sinks=sinks)
    # Or the sink passed to one part only; a plain merge.
    one_part = _merge([run(part_a, sinks=sinks), run(part_b)])
    for got in (merged, one_part):
        for g, w, o in zip(got, want, oracle_want):
            torch.testing.assert_close(g, w.double(), atol=2e-6, rtol=2e-6)
            torch.testing.assert_close(g, o, atol=2e-5, rtol=2e-5)
    # Passing it to both parts counts it twice.
    twice = _merge([run(part_a, sinks=sinks), run(part_b, sinks=sinks)])
    assert not torch.allclose(twice[1], want[1].double(), atol=1e-3)


def test_feature_errors():
    b = small()
    args = (b.q, b.k_cache, b.v_cache)
    kw = b.kwargs()
    for window in ((1,), (1, 2, 3), (-2, 0), (0, -5), (1.0, 2), (True, 0), "ab", None, 3):
        with pytest.raises(ValueError, match="window_size"):
            pod_attention_reference(*args, **kw, window_size=window)
    for cap in (-1.0, -1e-9, math.nan, math.inf, "x", None):
        with pytest.raises(ValueError, match="softcap"):
            pod_attention_reference(*args, **kw, softcap=cap)
    bad_sinks = (torch.zeros(7), torch.zeros(1, 8), torch.ones(8, dtype=torch.int32), [0.0] * 8)
    for sinks in bad_sinks:
        with pytest.raises(ValueError, match="sinks"):
            pod_attention_reference(*args, **kw, sinks=sinks)
    # Accepted: a list window, an int softcap, float64 sinks (cast to float32).
    got = pod_attention_reference(
        *args, **kw, window_size=[3, -1], softcap=2, sinks=torch.ones(8).double(), return_lse=True
    )
    want = pod_attention_reference(
        *args, **kw, window_size=(3, -1), softcap=2.0, sinks=torch.ones(8), return_lse=True
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@st.composite
def feature_batches(draw):
    batch, causal = draw(batches())
    hq = batch.q.shape[1]
    left = draw(st.sampled_from([-1, 0, 1, 3, 10]))
    right = draw(st.sampled_from([-1, 0, 2, 7]))
    softcap = draw(st.sampled_from([0.0, 0.7, 5.0]))
    sinks = draw(st.none() | st.integers(0, 2**16).map(lambda s: random_sinks(hq, s)))
    return batch, causal, dict(window_size=(left, right), softcap=softcap, sinks=sinks)


@settings(max_examples=50, deadline=None)
@given(feature_batches())
def test_random_batches_with_features(case):
    batch, causal, features = case
    check(batch, causal, **features)


# ---- fp8 caches (the contract's dequantisation; the kernel reads them in issue 11) ------


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_cache_is_attention_on_the_dequantised_cache(per_head, layout):
    from podcute.testing import make_batch, quantize_kv_cache

    b = make_batch([7, 1, 3], [50, 17, 33], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                   page_size=16, kv_layout=layout, seed=5)
    k8, ks = quantize_kv_cache(b.k_cache, layout, per_head=per_head)
    v8, vs = quantize_kv_cache(b.v_cache, layout, per_head=per_head)
    assert k8.dtype == torch.float8_e4m3fn and ks.shape == ((2,) if per_head else ())
    head = 2 if layout == "NHD" else 1
    shape = [1] * 4
    shape[head] = -1
    kd = k8.float() * (ks.view(shape) if per_head else ks)
    vd = v8.float() * (vs.view(shape) if per_head else vs)
    kw = b.kwargs()
    out, lse = pod_attention_reference(b.q, k8, v8, k_scale=ks, v_scale=vs, return_lse=True,
                                       **kw)
    ref, ref_lse = pod_attention_reference(b.q, kd, vd, return_lse=True, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    # a float scale is the per-tensor form
    s = float(ks.max())
    a = pod_attention_reference(b.q, k8, v8, k_scale=s, v_scale=2.0, **kw)
    c = pod_attention_reference(b.q, k8.float() * s, v8.float() * 2.0, **kw)
    assert torch.equal(a, c)


def test_quantize_kv_cache_bounds_and_garbage():
    from podcute.testing import quantize_kv_cache

    x = torch.randn(6, 16, 4, 64) * torch.tensor([0.01, 1.0, 30.0, 500.0]).view(1, 1, 4, 1)
    x[0, 0, 0, 0] = float("nan")
    for dtype, rel in ((torch.float8_e4m3fn, 2.0**-4), (torch.float8_e5m2, 2.0**-3)):
        q, s = quantize_kv_cache(x, "NHD", dtype=dtype)
        d = q.float() * s.view(1, 1, 4, 1)
        fin = torch.isfinite(x)
        assert torch.isnan(d[0, 0, 0, 0]) and torch.isfinite(d[fin]).all()
        tiny = s.view(1, 1, 4, 1).expand_as(x)[fin] * 2.0**-6  # subnormal spacing
        assert ((d[fin] - x[fin]).abs() <= rel * x[fin].abs() + tiny).all()
        assert torch.allclose(s, x.nan_to_num(0).abs().amax(dim=(0, 1, 3)) /
                              torch.finfo(dtype).max)


def test_fp8_scale_errors():
    from podcute.testing import make_batch, quantize_kv_cache

    b = make_batch([2], [20], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    k8, ks = quantize_kv_cache(b.k_cache)
    kw = b.kwargs()
    for bad, match in ((torch.ones(3), "Hkv"), (torch.ones(2, 2), "Hkv"), (0.0, "> 0"),
                       (float("nan"), "finite"), (torch.tensor([1.0, -1.0]), "> 0")):
        with pytest.raises(ValueError, match=match):
            pod_attention_reference(b.q, k8, k8, k_scale=bad, **kw)
    with pytest.raises(ValueError, match="only for fp8"):
        pod_attention_reference(b.q, b.k_cache, b.v_cache, k_scale=ks, **kw)
