"""Host planner properties on random batches (CPU only).

Every plan must: cover each (query token, query head) exactly once (by an unsplit item
or by one merge group); tile each split group's KV range exactly with its pieces; keep
every KV range within the causal limit, the request's kv_len and its pages; partition
the work among the CTAs; balance the predicted per-CTA time; and put both kinds on every
SM (CTA pair) when both kinds have work.
"""

from types import SimpleNamespace

import dataclasses
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from podcute.kernels.config import SUPPORTED_PAGE_SIZES, KernelConfig
from podcute.kernels.metadata import KIND_BITS, KIND_MASK, Kind, MergeCol, WorkCol
from podcute.planning import (DEFAULT_COST_MODEL, H100_HBM_BYTES_PER_SM_CLOCK as H100_HBM,
                              H200_HBM_BYTES_PER_SM_CLOCK, CapacityError, CostModel, PlanBuffers,
                              Planner, PlanSummary, capacities, chip_hbm_bytes_per_sm_clock)

KIND_PREFILL, KIND_DECODE = int(Kind.PREFILL), int(Kind.DECODE)

_PLANNERS = {}


def planner(hq, hkv, d, ps, **kw):
    key = (hq, hkv, d, ps, tuple(sorted(kw.items())))
    if key not in _PLANNERS:
        _PLANNERS[key] = Planner(hq, hkv, d, ps, device="cpu", **kw)
    return _PLANNERS[key]


def lengths_to_inputs(q_lens, kv_lens, ps, fmt, rng, pad=0):
    """cu_seqlens_q, kv_lens and a page source (block table or CSR) with unique pages."""
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    cu = np.zeros(len(q_lens) + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    npages = -(-kv_lens // ps)
    if fmt == "table":
        width = int(npages.max(initial=0)) + pad
        perm = rng.permutation(max(1, len(q_lens) * max(width, 1))).astype(np.int32)
        bt = perm[: len(q_lens) * width].reshape(len(q_lens), width)
        return torch.from_numpy(cu), torch.from_numpy(kv_lens.astype(np.int32)), dict(
            block_table=torch.from_numpy(np.ascontiguousarray(bt)))
    count = npages + rng.integers(0, 2, len(q_lens)) * pad
    indptr = np.zeros(len(q_lens) + 1, np.int32)
    indptr[1:] = np.cumsum(count)
    indices = rng.permutation(max(1, int(indptr[-1]))).astype(np.int32)[: indptr[-1]]
    return torch.from_numpy(cu), torch.from_numpy(kv_lens.astype(np.int32)), dict(
        kv_indptr=torch.from_numpy(indptr), kv_indices=torch.from_numpy(indices))


def check_plan(plan, q_lens, kv_lens, page_limit):
    """All structural invariants of one plan (docs/design.md)."""
    cfg = plan.config
    G, Hkv, Hq, ps = cfg.group_size, cfg.num_kv_heads, cfg.num_qo_heads, cfg.page_size
    tm_p, tm_d, tn = plan.prefill_tile_m, cfg.kernel.tile_m_decode, cfg.kernel.tile_n
    assert tm_p in (cfg.kernel.tile_m_prefill, tm_d)
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    work = plan.work.numpy().astype(np.int64)
    merge = plan.merge.numpy().astype(np.int64)
    cta_ptr = plan.cta_ptr.numpy()
    n = plan.num_items
    assert work.shape == (n, len(WorkCol)) and merge.shape == (plan.num_merge, len(MergeCol))

    # CTA lists partition the items.
    assert cta_ptr.shape == (plan.grid + 1,)
    assert cta_ptr[0] == 0 and cta_ptr[-1] == n and (np.diff(cta_ptr) >= 0).all()

    req, head, rs, re, ks, ke, slot, kind_col = work.T
    kind = kind_col & KIND_MASK
    # Above the kind bit: a decode item's ordinal among its CTA list's decode items (the
    # kernel's decode hand-over phase); 0 for prefill items.
    for c in range(plan.grid):
        lst = kind_col[cta_ptr[c]: cta_ptr[c + 1]]
        d = (lst & KIND_MASK) == KIND_DECODE
        assert (lst[d] >> KIND_BITS).tolist() == list(range(int(d.sum())))
        assert not (lst[~d] >> KIND_BITS).any()
    rows = q_lens * G
    assert ((req >= 0) & (req < len(q_lens))).all() and ((head >= 0) & (head < Hkv)).all()
    # Classification: decode work iff the whole request fits one decode tile.
    assert (kind == np.where(rows[req] <= tm_d, KIND_DECODE, KIND_PREFILL)).all()
    dec = kind == KIND_DECODE
    assert (rs >= 0).all() and (re > rs).all() and (re <= rows[req]).all()
    assert (re - rs <= np.where(dec, tm_d, tm_p)).all()
    assert (rs[~dec] % tm_p == 0).all() and (rs[dec] == 0).all()  # tiles start on boundaries
    # KV range: tile-aligned start, non-empty unless the visible range is empty, causal,
    # inside the window (from the tile holding the first row's first key).
    q, kvl = q_lens[req], kv_lens[req]
    opt = plan.options
    limit = kvl
    if opt.bounded_right:
        limit = np.minimum(kvl, np.maximum(0, kvl - q + (re - 1) // G + 1 + opt.right))
    start = np.zeros_like(kvl)
    if opt.window_left >= 0:
        first = np.clip(kvl - q + rs // G - opt.window_left, 0, kvl)
        start = np.minimum(first // tn, limit // tn) * tn
    assert (ks % tn == 0).all() and (ks >= start).all()
    assert (ke <= limit).all() and (ke <= kvl).all()
    assert ((ke > ks) | ((ks == start) & (limit <= start))).all()
    # Pages: the tokens an item reads lie in the request's first pages, all of which
    # the page source provides.
    assert (-(-ke // ps) <= plan.needed_pages[req]).all()
    assert (plan.needed_pages <= page_limit).all()

    # Unsplit items cover their group's whole KV range.
    un = slot < 0
    assert (ks[un] == start[un]).all() and (ke[un] == limit[un]).all()

    # Split groups: slots 0..num_slots-1 each used once; a merge row's slots are exactly
    # its pieces, whose KV ranges tile [0, limit) in order.
    sp = np.flatnonzero(~un)
    assert plan.num_slots == sp.size == int(merge[:, 5].sum())
    assert np.array_equal(np.sort(slot[sp]), np.arange(sp.size))
    by_slot = np.empty(sp.size, np.int64)
    by_slot[slot[sp]] = sp
    slot_merge = plan.slot_merge.numpy()
    for m, (mr, mh, mrs, mre, first, cnt) in enumerate(merge[:, :6]):
        assert cnt >= 2
        items = by_slot[first: first + cnt]
        assert (slot_merge[first: first + cnt] == m).all()
        assert (req[items] == mr).all() and (head[items] == mh).all()
        assert (rs[items] == mrs).all() and (re[items] == mre).all()
        order = np.argsort(ks[items])
        a, b = ks[items][order], ke[items][order]
        assert a[0] == start[items[0]] and b[-1] == limit[items[0]] and (a[1:] == b[:-1]).all()

    # Every (query token, query head) is covered exactly once.
    total_q = int(q_lens.sum())
    assert plan.total_q == total_q
    groups = np.concatenate([work[un][:, :4], merge[:, :4]]) if len(merge) else work[un][:, :4]
    cover = np.zeros((total_q, Hq), np.int64)
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    cnt = groups[:, 3] - groups[:, 2]
    g_idx = np.repeat(np.arange(len(groups)), cnt)
    r = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt) + groups[g_idx, 2]
    tok = q_start[groups[g_idx, 0]] + r // G
    qh = groups[g_idx, 1] * G + r % G
    np.add.at(cover, (tok, qh), 1)
    assert (cover == 1).all()

    # Device metadata mirrors the inputs.
    assert np.array_equal(plan.q_start.numpy(), q_start)
    assert np.array_equal(plan.kv_len.numpy(), kv_lens)


def page_limits(pages, kv_lens, ps):
    if "block_table" in pages:
        return np.full(len(kv_lens), pages["block_table"].shape[1])
    return np.diff(pages["kv_indptr"].numpy())


# ---- random batches ----------------------------------------------------------------------

HEADS = st.sampled_from([(8, 8), (32, 8), (28, 4), (64, 8), (32, 1), (4, 4), (16, 2)])


@st.composite
def batches(draw):
    hq, hkv = draw(HEADS)
    d = draw(st.sampled_from([64, 128]))
    ps = draw(st.sampled_from(SUPPORTED_PAGE_SIZES))
    causal = draw(st.booleans())
    n_dec = draw(st.integers(0, 40))
    n_pre = draw(st.integers(0, 4))
    n_pad = draw(st.integers(0, 3))
    max_kv = draw(st.sampled_from([64, 2048, 32768]))
    reqs = []
    for _ in range(n_dec):
        q = draw(st.integers(1, 8))
        reqs.append((q, draw(st.integers(q if causal else 0, max(q, max_kv)))))
    for _ in range(n_pre):
        q = draw(st.integers(1, 600))
        reqs.append((q, draw(st.integers(q if causal else 0, max(q, max_kv)))))
    for _ in range(n_pad):
        reqs.append((0, draw(st.integers(0, 100))))
    reqs = draw(st.permutations(reqs))
    fmt = draw(st.sampled_from(["table", "csr"]))
    seed = draw(st.integers(0, 2**31))
    return hq, hkv, d, ps, causal, [r[0] for r in reqs], [r[1] for r in reqs], fmt, seed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_plan_invariants(b):
    hq, hkv, d, ps, causal, q_lens, kv_lens, fmt, seed = b
    rng = np.random.default_rng(seed)
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, ps, fmt, rng, pad=int(rng.integers(0, 3)))
    plan = planner(hq, hkv, d, ps).plan(cu, kvl, causal=causal, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, ps))
    s = plan.summary
    assert s.num_requests == len(q_lens)
    assert s.num_prefill_items + s.num_decode_items == plan.num_items
    assert s.num_merges == plan.num_merge and s.num_split_items == plan.num_slots


WINDOWS = st.sampled_from([(-1, -1), (0, 0), (5, -1), (100, 0), (1000, 7), (-1, 30),
                           (4096, 0), (70000, 0)])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), WINDOWS, st.booleans())
def test_plan_invariants_with_window(b, window, invariant):
    """Windowed plans load no tile left of every row's window nor right of its limit,
    still cover every row once; batch-invariant plans too."""
    hq, hkv, d, ps, causal, q_lens, kv_lens, fmt, seed = b
    rng = np.random.default_rng(seed)
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, ps, fmt, rng)
    plan = planner(hq, hkv, d, ps).plan(cu, kvl, causal=causal, window_size=window,
                                        batch_invariant=invariant, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, ps))


def test_window_costs_scale_with_the_window():
    # A long prefill with a short window is O(q_len * window) in the cost model.
    cu = torch.tensor([0, 16384], dtype=torch.int32)
    kvl = torch.tensor([16384], dtype=torch.int32)
    bt = torch.arange(1024, dtype=torch.int32).view(1, -1)
    p = planner(32, 8, 128, 16)
    full = p.plan(cu, kvl, block_table=bt).summary.predicted_us
    win = p.plan(cu, kvl, block_table=bt, window_size=(512, 0)).summary.predicted_us
    assert win < full / 6, (win, full)


def _items_by_request(plan, req_ids):
    """{request id: sorted (kv head, rows, KV range, split) of its work items}."""
    work = plan.work.numpy()
    out = {}
    for row in work:
        r = int(row[WorkCol.REQ])
        if r in req_ids:
            out.setdefault(req_ids[r], []).append(
                (int(row[WorkCol.KV_HEAD]), int(row[WorkCol.ROW_START]), int(row[WorkCol.ROW_END]),
                 int(row[WorkCol.KV_START]), int(row[WorkCol.KV_END]),
                 int(row[WorkCol.SPLIT_SLOT]) >= 0))
    return {k: sorted(v) for k, v in out.items()}


def test_batch_invariant_items_depend_on_the_request_alone():
    """Every work item of a request (rows, KV range, split or not) is the same in any
    batch and on any grid size; the default plan does depend on the batch."""
    probes = [(1500, 40000), (1, 100000), (3, 5000), (1, 64), (700, 700)]
    rng = np.random.default_rng(0)
    seen, default_differs = None, False
    for trial in range(20):
        comp = [(int(rng.choice([1, 2, 900])), int(rng.integers(1000, 60000)))
                for _ in range(int(rng.integers(0, 30)))]
        reqs = [(i, r) for i, r in enumerate(probes)] + [(None, r) for r in comp]
        order = rng.permutation(len(reqs))
        reqs = [reqs[k] for k in order]
        q_lens = [r[0] for _, r in reqs]
        kv_lens = [r[1] for _, r in reqs]
        ids = {pos: i for pos, (i, _) in enumerate(reqs) if i is not None}
        cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", rng)
        p = planner(32, 8, 128, 16, num_sms=int(rng.choice([132, 61, 7])))
        items = _items_by_request(p.plan(cu, kvl, batch_invariant=True, **pages), ids)
        default = _items_by_request(p.plan(cu, kvl, **pages), ids)
        if seen is None:
            seen, seen_default = items, default
        assert items == seen, f"trial {trial}"
        default_differs |= default != seen_default
    assert default_differs


@settings(max_examples=60, deadline=None)
@given(batches())
def test_last_page_len_matches_kv_lens(b):
    hq, hkv, d, ps, causal, q_lens, kv_lens, _, seed = b
    rng = np.random.default_rng(seed)
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, ps, "csr", rng)
    npages = np.diff(pages["kv_indptr"].numpy())
    lpl = np.where(npages > 0, np.asarray(kv_lens) - (npages - 1) * ps, 0).astype(np.int32)
    p = planner(hq, hkv, d, ps)
    a = p.plan(cu, kvl, causal=causal, **pages)
    wa = a.work.numpy().copy()
    b2 = p.plan(cu, last_page_len=torch.from_numpy(lpl), causal=causal, **pages)
    assert np.array_equal(b2.kv_len.numpy(), np.asarray(kv_lens))
    assert np.array_equal(b2.work.numpy(), wa)


# ---- balance and co-location -----------------------------------------------------------------


def _mixed(rng, n_dec, n_pre, max_kv, max_pre_q=4000, spec=8):
    q = [int(rng.integers(1, spec + 1)) for _ in range(n_dec)]
    q += [int(rng.integers(65, max_pre_q)) for _ in range(n_pre)]
    kv = [x + int(rng.integers(0, max_kv)) for x in q]
    perm = rng.permutation(len(q))
    return [q[i] for i in perm], [kv[i] for i in perm]


@pytest.mark.parametrize("seed", range(40))
def test_balance(seed):
    """Per-CTA predicted time: max <= 1.02 * mean + 10 us whenever the mean is >= 5 us
    (the slack is one minimum chunk plus per-item overheads), so balance (max/mean) is
    <= 1.15 at a mean of 50 us and <= 1.05 at 200 us and above."""
    rng = np.random.default_rng(seed)
    hq, hkv = [(32, 8), (28, 4), (8, 8), (64, 8), (32, 1)][seed % 5]
    d, ps = [128, 64][seed % 2], [16, 1, 64, 256][seed % 4]
    q_lens, kv_lens = _mixed(rng, int(rng.integers(0, 300)), int(rng.integers(0, 6)),
                             int(rng.choice([2048, 32768])))
    if not q_lens:
        q_lens, kv_lens = [1], [4096]
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, ps, "table", rng)
    plan = planner(hq, hkv, d, ps).plan(cu, kvl, causal=True, **pages)
    cost = plan.cta_cost_us
    mean, mx = cost.mean(), cost.max()
    assert abs(cost.sum() - plan.item_cost_us.sum()) < 1e-6 * cost.sum() + 1e-6
    if mean >= 5:
        assert mx <= 1.02 * mean + 10.0, plan.summary
    if mean >= 200:
        assert plan.summary.balance <= 1.05, plan.summary
    assert plan.summary.balance == pytest.approx(mx / mean)


@pytest.mark.parametrize("seed", range(30))
def test_every_cta_gets_both_kinds(seed):
    """When each kind has 1.5 pieces' worth of work per CTA (one CTA per SM),
    every CTA list runs prefill and decode items, interleaved, and neighbouring SMs start
    on different kinds (even lists on prefill, odd ones on decode), so both kinds run on
    the chip at any moment. (With less, a piece that spans a CTA's share of the stream
    can land whole on a neighbour.)"""
    rng = np.random.default_rng(1000 + seed)
    hq, hkv = [(32, 8), (28, 4), (64, 8), (32, 4)][seed % 4]
    d, ps = [128, 64][seed % 2], [16, 32, 1][seed % 3]
    q_lens, kv_lens = _mixed(rng, int(rng.integers(20, 300)), int(rng.integers(1, 5)),
                             int(rng.choice([2048, 8192, 32768])))
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, ps, "table", rng)
    p = planner(hq, hkv, d, ps)
    assert p.config.kernel.ctas_per_sm == 1 and p.grid == p.num_sms
    plan = p.plan(cu, kvl, **pages)
    work, cta_ptr = plan.work.numpy(), plan.cta_ptr.numpy()
    kind, cost = work[:, WorkCol.KIND] & KIND_MASK, plan.item_cost_us
    for k in (KIND_PREFILL, KIND_DECODE):
        if cost[kind == k].sum() / plan.grid < 1.5 * max(cost[kind == k].max(initial=0),
                                                         p.cost.min_chunk_us):
            pytest.skip("a kind has less than one piece of work per CTA")
    for c in range(plan.grid):
        k = kind[cta_ptr[c]: cta_ptr[c + 1]]
        assert set(k.tolist()) == {KIND_PREFILL, KIND_DECODE}, f"CTA {c} runs only {set(k)}"
        assert k[0] == (KIND_DECODE if c % 2 else KIND_PREFILL)
        # Interleaved (items follow the batch-wide progress of their kind): with >= 3
        # items of each kind, the list neither runs one kind entirely first nor last.
        switches = int((k[1:] != k[:-1]).sum())
        if min((k == 0).sum(), (k == 1).sum()) >= 3:
            assert switches >= 2, (c, k)


def test_demo_batch_summary():
    """The README's batch: 1 prefill of 2048 + 128 decodes at 2048, 32/8/128, page 16."""
    q_lens, kv_lens = [2048] + [1] * 128, [2048] * 129
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", np.random.default_rng(0))
    plan = planner(32, 8, 128, 16).plan(cu, kvl, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    s = plan.summary
    assert isinstance(s, PlanSummary)
    assert (s.num_prefill_requests, s.num_decode_requests) == (1, 128)
    assert s.num_prefill_items >= 2048 * 4 // 128 * 8  # 64 row tiles x 8 kv heads
    assert s.balance < 1.05
    # Roofline of this batch is 0.264 ms (docs/performance.md); the prediction adds overheads.
    assert 250 < s.predicted_us < 400
    text = str(s)
    assert "129 requests" in text and "balance" in text and "predicted" in text


# ---- classification -----------------------------------------------------------------------


def test_classification_by_packed_rows():
    """Decode work = q_len * G <= tile_m_decode (any order, no label); q_len == 0 is no
    work."""
    p = planner(32, 8, 128, 16)  # G = 4: q_len <= 16 is decode work
    q_lens, kv_lens = [16, 17, 0, 1, 8, 300], [100, 100, 50, 5, 20, 400]
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", np.random.default_rng(0))
    plan = p.plan(cu, kvl, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    assert plan.summary.num_decode_requests == 3 and plan.summary.num_prefill_requests == 2
    w = plan.work.numpy()
    assert 2 not in set(w[:, 0].tolist())  # the padding request
    assert set(w[w[:, 7] == KIND_DECODE, 0].tolist()) == {0, 3, 4}


def test_non_causal_empty_kv_still_writes():
    """Rows that see no key still get an item (it writes 0 and lse -inf)."""
    q_lens, kv_lens = [3, 100], [0, 0]
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "csr", np.random.default_rng(0))
    plan = planner(8, 8, 128, 16).plan(cu, kvl, causal=False, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    assert plan.num_items == 8 * (1 + 100 // 128 + 1) and plan.max_page_index == -1


def test_long_decode_is_split_and_merged():
    p = planner(32, 8, 128, 16)
    q_lens, kv_lens = [1], [32768]
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", np.random.default_rng(0))
    plan = p.plan(cu, kvl, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    assert plan.num_merge == 8 and plan.num_items > 8 * 10
    # chunks keep at least the minimum chunk of KV
    w = plan.work.numpy()
    span = w[:, 5] - w[:, 4]
    assert span.min() >= p._tiling.min_tiles[KIND_DECODE] * p.config.kernel.tile_n
    assert plan.summary.balance < 1.2


@pytest.mark.parametrize("hq,hkv", [(64, 8), (32, 8), (32, 4)])
def test_handover_batch_exercises_the_first_decode_after_prefill(hq, hkv):
    """The GPU regression batch for the decode hand-over's first use (testing.py
    handover_lengths) must keep producing the transition it targets: a prefill tile of
    warpgroup 0's rows right before a CTA list's first decode item, in many lists."""
    from podcute.testing import handover_lengths, handover_transitions

    q_lens, kv_lens = handover_lengths(16, 128, hq // hkv)
    cu, kv, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", np.random.default_rng(0))
    plan = planner(hq, hkv, 128, 16).plan(cu, kv, causal=True, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    assert handover_transitions(plan) >= 16


def test_tiny_batch_does_not_split():
    p = planner(32, 8, 128, 16)
    plan = p.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([100], dtype=torch.int32),
                  block_table=torch.zeros(1, 7, dtype=torch.int32))
    assert plan.num_items == 8 and plan.num_merge == 0
    assert (plan.work.numpy()[:, 6] == -1).all()


def test_empty_batch():
    p = planner(8, 8, 128, 16)
    plan = p.plan(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                  block_table=torch.zeros(0, 4, dtype=torch.int32))
    assert plan.num_items == 0 and plan.total_q == 0 and (plan.cta_ptr.numpy() == 0).all()
    plan = p.plan(torch.zeros(3, dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32),
                  block_table=torch.zeros(2, 4, dtype=torch.int32))
    assert plan.num_items == 0 and plan.summary.num_requests == 2


# ---- buffers ------------------------------------------------------------------------------


def test_buffers_reused_within_capacity_and_grown_beyond():
    p = Planner(32, 8, 128, 16, device="cpu", max_batch_size=8, max_num_tokens=256)
    cap = p.capacity
    base = capacities(8, 256, 1 << 20, 32, 8, 64, p.grid)
    # (plus a row tile per KV head for each of up to `batch` shared-prefix tiles)
    assert cap == dataclasses.replace(base, items=base.items + 8 * 8)
    rng = np.random.default_rng(0)
    ptrs = None
    for _ in range(20):  # any batch within capacity: same buffers
        q_lens, kv_lens = _mixed(rng, int(rng.integers(0, 7)), 1, 32768, max_pre_q=200)
        cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", rng)
        plan = p.plan(cu, kvl, **pages)
        check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
        now = tuple(a.data_ptr() for a in plan.kernel_args if isinstance(a, torch.Tensor)) + (
            plan.buffer_epoch,)
        assert ptrs is None or now == ptrs
        ptrs = now
    # bigger than the capacity: grown once, and then stable again
    q_lens, kv_lens = [1] * 20 + [1000], [5000] * 21
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", rng)
    plan = p.plan(cu, kvl, **pages)
    check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
    assert plan.buffer_epoch == ptrs[-1] + 1
    assert p.capacity.batch >= 21 and p.capacity.tokens >= 1020
    again = p.plan(cu, kvl, **pages)
    assert again.buffer_epoch == plan.buffer_epoch
    assert again.work.data_ptr() == plan.work.data_ptr()


def test_capacity_bound_holds_for_worst_case_batches():
    """Batches at the capacity limits never overflow the preallocated buffers."""
    p = Planner(32, 8, 128, 16, device="cpu", max_batch_size=64, max_num_tokens=4096)
    rng = np.random.default_rng(1)
    shapes = [
        ([64] * 64, [32768] * 64),  # 64 chunked prefills of one tile each, long KV
        ([1] * 63 + [4033], [32768] * 63 + [32768]),
        ([4096], [4096]),
        ([1] * 64, [32768] * 64),
        ([0] * 63 + [1], [0] * 63 + [262144]),
    ]
    for q_lens, kv_lens in shapes:
        cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", rng)
        plan = p.plan(cu, kvl, **pages)
        check_plan(plan, q_lens, kv_lens, page_limits(pages, kv_lens, 16))
        assert plan.buffer_epoch == 1


def test_capture_refuses_to_grow(monkeypatch):
    p = Planner(8, 8, 128, 16, device="cpu", max_batch_size=2, max_num_tokens=16)
    p._on_cuda = True  # pretend: growth must check for graph capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(CapacityError, match="max_batch_size.*capture"):
        p.plan(torch.tensor([0, 1, 2, 3], dtype=torch.int32),
               torch.tensor([5, 5, 5], dtype=torch.int32),
               block_table=torch.zeros(3, 1, dtype=torch.int32))


def test_frozen_planner_refuses_to_grow_in_plan():
    """After a capture (freeze), a batch past any capacity raises CapacityError in plan(),
    naming the constructor argument, and the buffers stay where the graph has them."""
    p = Planner(8, 8, 128, 16, device="cpu", max_batch_size=4, max_num_tokens=64,
                max_num_pages=8)
    i32 = dict(dtype=torch.int32)
    p.plan(torch.tensor([0, 1], **i32), torch.tensor([5], **i32), block_table=torch.zeros(1, 1, **i32))
    p.freeze()
    args = p.kernel_args
    for kw, match in (
        (dict(cu=[0, 1, 2, 3, 4, 5], kv=[5] * 5, bt=torch.zeros(5, 1, **i32)), "max_batch_size"),
        (dict(cu=[0, 65], kv=[65], bt=torch.zeros(1, 5, **i32)), "max_num_tokens"),
        (dict(cu=[0, 1, 2], kv=[100, 100], bt=torch.zeros(2, 7, **i32)), "max_num_pages"),
    ):
        with pytest.raises(CapacityError, match=match):
            p.plan(torch.tensor(kw["cu"], **i32), torch.tensor(kw["kv"], **i32),
                   block_table=kw["bt"])
        assert p.kernel_args is args
    # within the capacities: planned into the same buffers
    plan = p.plan(torch.tensor([0, 2, 3], **i32), torch.tensor([60, 40], **i32),
                  block_table=torch.zeros(2, 4, **i32))
    assert plan.kernel_args is args and plan.num_items > 0


# ---- page bounds ----------------------------------------------------------------------------


def test_max_page_index_and_exact_check():
    p = planner(8, 8, 128, 16)
    # request 0 uses pages 3, 9; request 1 (padding, q_len 0) would use page 50
    bt = torch.tensor([[3, 9, 77], [50, 0, 0]], dtype=torch.int32)
    plan = p.plan(torch.tensor([0, 1, 1], dtype=torch.int32),
                  torch.tensor([20, 5], dtype=torch.int32), block_table=bt)
    # the cheap bound may include unused columns, the exact check does not
    assert plan.max_page_index >= 9
    plan.check_pages(10)  # pages 3 and 9 exist in a 10-page cache
    with pytest.raises(ValueError, match="block_table: request 0 reads page 9"):
        plan.check_pages(9)
    csr = p.plan(torch.tensor([0, 1, 1], dtype=torch.int32),
                 torch.tensor([20, 5], dtype=torch.int32),
                 kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
                 kv_indices=torch.tensor([3, 9, 50], dtype=torch.int32))
    assert csr.max_page_index == 9


# ---- validation of values -----------------------------------------------------------------


def _bad(match, **kw):
    p = planner(8, 4, 128, 16)
    args = dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
                kv_lens=torch.tensor([10, 20], dtype=torch.int32),
                block_table=torch.zeros(2, 2, dtype=torch.int32))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        p.plan(args.pop("cu_seqlens_q"), args.pop("kv_lens"), **args)


def test_value_errors():
    i32 = dict(dtype=torch.int32)
    _bad("cu_seqlens_q", cu_seqlens_q=torch.tensor([0, 3, 1], **i32))
    _bad("cu_seqlens_q.*start at 0", cu_seqlens_q=torch.tensor([1, 2, 3], **i32))
    _bad("kv_lens.*>= 0", kv_lens=torch.tensor([-1, 20], **i32))
    _bad("kv_lens.*pages", kv_lens=torch.tensor([10, 33], **i32))
    _bad("block_table.*negative", block_table=torch.tensor([[-1, 0], [1, 2]], **i32))
    _bad("kv_indptr", block_table=None, kv_indptr=torch.tensor([0, 1], **i32),
         kv_indices=torch.tensor([0], **i32))
    _bad("kv_lens.*pages", block_table=None, kv_indptr=torch.tensor([0, 1, 2], **i32),
         kv_indices=torch.tensor([0, 1], **i32))
    _bad("kv_indices.*negative.*request 1", block_table=None,
         kv_indptr=torch.tensor([0, 1, 3], **i32), kv_indices=torch.tensor([0, 5, -4], **i32))
    _bad("last_page_len", kv_lens=None, block_table=None,
         kv_indptr=torch.tensor([0, 1, 3], **i32), kv_indices=torch.arange(3, **i32),
         last_page_len=torch.tensor([17, 1], **i32))
    _bad("last_page_len", kv_lens=None, block_table=None,
         kv_indptr=torch.tensor([0, 1, 3], **i32), kv_indices=torch.arange(3, **i32),
         last_page_len=torch.tensor([0, 1], **i32))
    # negative page only in an unused column: fine
    planner(8, 4, 128, 16).plan(torch.tensor([0, 1, 3], **i32), torch.tensor([10, 20], **i32),
                                block_table=torch.tensor([[0, -1], [1, 2]], **i32))


def test_gpu_style_inputs_are_read_once(monkeypatch):
    """Index tensors on a non-CPU device are gathered with a single device->host copy."""
    calls = []
    orig = torch.Tensor.cpu

    def spy(self, *a, **k):
        calls.append(self.shape)
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", spy)
    p = planner(8, 8, 128, 16)
    plan = p.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                  block_table=torch.zeros(1, 1, dtype=torch.int32))
    assert calls == [] and plan.num_items == 8  # CPU inputs: no copies at all


def test_cost_model_constants_are_exposed():
    c = CostModel()
    assert c.tensor_flops_per_s == 779e12 and c.hbm_bytes_per_s == 4.22e12
    assert c.mma_flops_per_us() == pytest.approx(779e12 / 132 * c.mma_efficiency * 1e-6)
    p = planner(32, 8, 128, 16)
    # one decode item of 2048 tokens (8 kv heads -> 8 items): bytes / per-SM bandwidth
    plan = p.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([2048], dtype=torch.int32),
                  block_table=torch.zeros(1, 128, dtype=torch.int32))
    # (the 8 items are cut into min-chunk pieces over the grid; each piece pays Q/O + 2 us)
    bw = 4.22e12 / 132 * c.decode_sm_bandwidth
    kv_us = 8 * 2048 * 2 * 128 * 2 / bw * 1e6
    piece_us = 4 * 2 * 128 * 2 / bw * 1e6 + c.decode_item_overhead_us
    total = plan.item_cost_us.sum()
    assert total == pytest.approx(kv_us + plan.num_items * piece_us, rel=1e-3)
    assert KernelConfig.select("bfloat16", 128).tile_m_decode == 64


def test_cost_model_takes_each_kernels_prefill_rate():
    """The warp-level kernel's prefill runs at its own measured MMA rate (lower than
    sm_90a's), so its plans balance prefill against decode with that rate; decode's
    bytes cost the same on both."""
    from podcute.planning import DEFAULT_COST_MODEL, Planner

    hopper = Planner(32, 8, 128, 16, device="cpu")
    warp = Planner(32, 8, 128, 16, device="cpu", arch="sm_90")  # 128-row prefill items
    narrow = Planner(32, 8, 128, 16, device="cpu", arch="sm_86")  # 64-row ones
    assert hopper.cost is DEFAULT_COST_MODEL
    assert warp.config.kernel.tile_m_prefill == 128
    assert narrow.config.kernel.tile_m_prefill == 64
    assert narrow.cost.mma_efficiency == DEFAULT_COST_MODEL.warp_mma_efficiency < \
        warp.cost.mma_efficiency == DEFAULT_COST_MODEL.warp_wide_mma_efficiency < \
        DEFAULT_COST_MODEL.mma_efficiency
    assert warp.cost.hbm_bytes_per_us() == hopper.cost.hbm_bytes_per_us()
    q = torch.tensor([0, 4096], dtype=torch.int32)
    kv = torch.tensor([4096], dtype=torch.int32)
    bt = torch.zeros(1, 256, dtype=torch.int32)
    # per CTA with 64-row items; per SM with 128-row ones (two CTAs on each, whose faster
    # items leave each CTA's half of the prefill under one sm_90a CTA's whole)
    p_hopper = hopper.plan(q, kv, block_table=bt).summary
    p_narrow = narrow.plan(q, kv, block_table=bt).summary
    p_warp = warp.plan(q, kv, block_table=bt).summary
    assert p_narrow.predicted_prefill_us > p_hopper.predicted_prefill_us
    assert p_warp.predicted_us > p_hopper.predicted_us


def test_warp_kernel_cuts_prefill_into_shorter_tiles_when_few():
    """The warp-level kernel's 128-row prefill items (two 16-row blocks a warp) are used
    when a batch's prefill gives every CTA a group of them; a batch with fewer takes
    64-row items (one block a warp) rather than KV-splitting the few groups over the
    grid. Batch-invariant plans keep 128 rows, whatever the batch."""
    p = planner(16, 4, 128, 16, arch="sm_90")
    assert p.config.kernel.tile_m_prefill == 128 and p.grid == 2 * p.num_sms

    def items(q_lens, kv_lens, **kw):
        cu = np.zeros(len(q_lens) + 1, np.int32)
        cu[1:] = np.cumsum(q_lens)
        kvl = np.array(kv_lens, np.int32)
        bt = np.arange(len(q_lens) * 1024, dtype=np.int32).reshape(len(q_lens), 1024)
        plan = p.plan(torch.from_numpy(cu), torch.from_numpy(kvl),
                      block_table=torch.from_numpy(bt), **kw)
        check_plan(plan, q_lens, kv_lens, 1024)
        work = plan.work.numpy()
        pre = (work[:, WorkCol.KIND] & KIND_MASK) == KIND_PREFILL
        return plan, (work[pre, WorkCol.ROW_END] - work[pre, WorkCol.ROW_START]).max()

    # 1024 tokens x G 4 = 32 tiles of 128 rows x 4 KV heads = 128 groups < 264 CTAs
    few = ([1024] + [1] * 80, [12288] * 81)
    plan, rows = items(*few)
    assert plan.prefill_tile_m == 64 and rows == 64
    # 8192 tokens: 1024 groups of 128 rows
    plan, rows = items([8192], [8192])
    assert plan.prefill_tile_m == 128 and rows == 128
    plan, rows = items(*few, batch_invariant=True)
    assert plan.prefill_tile_m == 128 and rows == 128
    # decode only: the kernel's tiling (no prefill to cut)
    plan = p.plan(torch.tensor([0, 1, 2], dtype=torch.int32),
                  torch.tensor([5, 6], dtype=torch.int32),
                  block_table=torch.zeros(2, 1, dtype=torch.int32))
    assert plan.prefill_tile_m == 128


@pytest.mark.parametrize("seed", range(4))
def test_lists_of_one_sm_run_different_kinds_first(seed):
    """The warp-level kernel at two CTAs an SM, on a chip short of HBM per SM (an H100):
    in a mixed batch each list runs its kinds one after the other, lists s (one an SM, the
    block scheduler's first wave) prefill first, lists s + num_sms decode first, holding
    the same rows as the interleaved plan, each kind in its order (so the decode ordinals
    hold); one kind alone, or the sm_90a kernel (one CTA an SM), keeps the interleaved
    lists."""
    rng = np.random.default_rng(2000 + seed)
    q_lens, kv_lens = _mixed(rng, int(rng.integers(20, 200)), int(rng.integers(1, 4)),
                             int(rng.choice([2048, 8192])))
    cu, kvl, pages = lengths_to_inputs(q_lens, kv_lens, 16, "table", rng)
    p = planner(32, 8, 128, 16, arch="sm_90", hbm_bytes_per_sm_clock=H100_HBM)
    assert p.config.kernel.ctas_per_sm == 2 and p._group_kinds
    plan = p.plan(cu, kvl, **pages)
    check_plan(plan, q_lens, kv_lens, pages["block_table"].numel())
    work, ptr, cost = plan.work.numpy().copy(), plan.cta_ptr.numpy().copy(), plan.item_cost_us
    h200 = planner(32, 8, 128, 16, arch="sm_90")  # a host-only planner: the H200's rate
    inter = h200.plan(cu, kvl, **pages)  # the same batch interleaved
    assert not h200._group_kinds
    w0, c0 = inter.work.numpy(), inter.item_cost_us
    assert (inter.cta_ptr.numpy() == ptr).all()
    for c in range(p.grid):
        a, b = ptr[c], ptr[c + 1]
        k = work[a:b, WorkCol.KIND] & KIND_MASK
        assert int((k[1:] != k[:-1]).sum()) <= 1, (c, k)
        head = KIND_DECODE if c >= p.num_sms else KIND_PREFILL
        if len(set(k.tolist())) == 2:
            assert k[0] == head
        for kk in (KIND_PREFILL, KIND_DECODE):  # each kind's rows and costs, in order
            mine, theirs = k == kk, (w0[a:b, WorkCol.KIND] & KIND_MASK) == kk
            # (KIND's ordinal bits number a list's decode rows in order: check_plan)
            ours, its = work[a:b][mine].copy(), w0[a:b][theirs].copy()
            ours[:, WorkCol.KIND] &= KIND_MASK
            its[:, WorkCol.KIND] &= KIND_MASK
            ours_cost, its_cost = cost[a:b][mine], c0[a:b][theirs]
            if kk != head and len(ours) and not (ours == its).all():
                # The interleaved plan swapped its list's head (this kind's first row)
                # with the first row of the other kind: this kind's first row sits
                # later there, the rest in order. Grouped, the stream's order holds.
                at = int(np.flatnonzero((its == ours[0]).all(axis=1))[0])
                keep = np.arange(len(its)) != at
                its = np.concatenate((its[at:at + 1], its[keep]))
                its_cost = np.concatenate((its_cost[at:at + 1], its_cost[keep]))
            assert (ours == its).all()
            assert np.allclose(ours_cost, its_cost)
    decode_only = p.plan(torch.tensor([0, 1, 2], dtype=torch.int32),
                         torch.tensor([5, 6], dtype=torch.int32),
                         block_table=torch.zeros(2, 1, dtype=torch.int32))
    assert decode_only.num_items
    hopper = planner(32, 8, 128, 16, hbm_bytes_per_sm_clock=H100_HBM)
    hopper.plan(cu, kvl, **pages)
    assert not hopper._group_kinds


def test_chip_bandwidth_decides_the_sm_pairs():
    """The warp-level kernel pairs an SM's CTAs by kind only on a chip with less HBM
    bandwidth per SM clock than CostModel.pair_kinds_below_bytes_per_sm_clock: the H100
    (measured faster so), not the H200 (measured slower); a device's rate comes from its
    properties, and a bad rate is refused before anything is planned."""
    h100 = SimpleNamespace(memory_clock_rate=2619000, memory_bus_width=5120,
                           clock_rate=1980000, multi_processor_count=132)
    h200 = SimpleNamespace(memory_clock_rate=3201000, memory_bus_width=6144,
                           clock_rate=1980000, multi_processor_count=132)
    assert chip_hbm_bytes_per_sm_clock(h100) == pytest.approx(H100_HBM, abs=0.05)
    assert chip_hbm_bytes_per_sm_clock(h200) == pytest.approx(H200_HBM_BYTES_PER_SM_CLOCK,
                                                               abs=0.05)
    assert chip_hbm_bytes_per_sm_clock(SimpleNamespace(multi_processor_count=132)) is None
    below = DEFAULT_COST_MODEL.pair_kinds_below_bytes_per_sm_clock
    assert H100_HBM < below < H200_HBM_BYTES_PER_SM_CLOCK
    for arch, rate, paired in (("sm_90", H100_HBM, True),
                               ("sm_90", H200_HBM_BYTES_PER_SM_CLOCK, False),
                               ("sm_90", None, False), ("sm_90a", H100_HBM, False)):
        p = Planner(32, 8, 128, 16, device="cpu", arch=arch, hbm_bytes_per_sm_clock=rate)
        assert p._group_kinds == paired, (arch, rate)
    for bad in (0, -1.0, True, "12.8"):
        with pytest.raises(ValueError, match="hbm_bytes_per_sm_clock"):
            Planner(32, 8, 128, 16, device="cpu", arch="sm_90", hbm_bytes_per_sm_clock=bad)


def test_second_cache_requests_word_and_page_checks():
    # BatchPOD's separate caches: requests [0, n) read a second cache, whose count plan()
    # writes as a plan word (IParam.SECOND_CACHE_REQUESTS) and run() checks pages by.
    from podcute.kernels.metadata import IParam
    p = Planner(8, 2, 128, 16, device="cpu", max_batch_size=8, max_num_tokens=256)
    cu = np.array([0, 20, 21, 22], np.int32)
    kvl = np.array([40, 17, 33], np.int32)
    bt = np.array([[7, 8, 9], [1, 0, 0], [2, 3, 4]], np.int32)  # request 0: pages 7-9
    plan = p.plan(cu, kvl, block_table=bt, _second_cache_requests=1)
    assert plan.second_cache_requests == 1
    assert p.buffers.mIParams[IParam.SECOND_CACHE_REQUESTS] == 1
    plan.check_second_cache_pages(5, 10)  # second cache: pages 7-9; first: 1-4
    with pytest.raises(ValueError, match="request 0 reads page 9.*second cache.*< 1.*only 9"):
        plan.check_second_cache_pages(5, 9)
    with pytest.raises(ValueError, match="request 2 reads page 4.*first cache.*>= 1.*only 4"):
        plan.check_second_cache_pages(4, 10)
    with pytest.raises(ValueError, match="request 0 reads page 7"):
        plan.check_pages(5)  # one cache: every request against it
    assert p.plan(cu, kvl, block_table=bt).second_cache_requests == 0
    assert p.buffers.mIParams[IParam.SECOND_CACHE_REQUESTS] == 0
    for bad in (-1, 4, 1.0, True):
        with pytest.raises(ValueError, match="_second_cache_requests"):
            p.plan(cu, kvl, block_table=bt, _second_cache_requests=bad)


def test_pages_survive_a_batch_invariant_regrow():
    # A batch-invariant layout that needs more split room regrows the buffers mid-plan
    # (_grow_splits): the pages must be staged into the new page list, not the old one
    # (a regression served page 0 for every request: another request's K/V).
    hq, hkv, page = 32, 8, 16
    q_lens = np.array([1, 300, 1500, 4, 1, 1, 3], np.int32)
    kv_lens = np.array([30000, 300, 12000, 5000, 77, 19000, 8000], np.int32)
    used = (kv_lens + page - 1) // page
    perm = np.random.default_rng(0).permutation(int(used.sum())).astype(np.int32)
    table = np.zeros((q_lens.size, used.max()), np.int32)
    starts = np.concatenate([[0], np.cumsum(used)])
    for i, n in enumerate(used):
        table[i, :n] = perm[starts[i]: starts[i] + n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    p = Planner(hq, hkv, 128, page, device="cpu", max_batch_size=64, max_num_tokens=32768,
                num_sms=7)
    epoch = p.buffer_epoch
    plan = p.plan(cu, kv_lens, block_table=table, window_size=(4096, 0),
                  batch_invariant=True)
    assert p.buffer_epoch > epoch  # (the case: the split room grew during this plan)
    pl, ps = plan.page_list.numpy(), plan.page_start.numpy()
    # (the list the kernel is given is the one checked and read here)
    assert plan.kernel_args[PlanBuffers._fields.index("mPageList")].data_ptr() == \
        plan.page_list.data_ptr()
    for i, n in enumerate(used):
        assert (pl[ps[i]: ps[i] + n] == table[i, :n]).all(), f"request {i}'s pages"
    assert plan.max_page_index == perm.max()
