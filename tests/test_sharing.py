"""Shared-prefix plans on the CPU (planning/sharing.py): detection, and every plan checked
numerically by podcute.testing.execute_plan (the kernel's contract over the metadata)
against the float32 reference."""

import random

import numpy as np
import pytest
import torch

from podcute.planning import Planner
from podcute.testing import execute_plan, make_shared_prefix_batch


@pytest.fixture(autouse=True)
def _share_small_batches(monkeypatch):
    # (these batches are far below the reads at which sharing pays: share them anyway)
    monkeypatch.setattr(Planner, "share_min_read_bytes", 0)


def _plan(planner, b, fmt, **kw):
    pages = (dict(block_table=b.block_table) if fmt == "table"
             else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
    kw.setdefault("share_prefixes", True)
    return planner.plan(b.cu_seqlens_q, b.seqused_k, **pages, **kw)


def _check(plan, b, causal=True, sinks=None, softcap=0.0, window_size=(-1, -1)):
    out, lse = execute_plan(plan, b.q, b.k_cache, b.v_cache, sinks=sinks, softcap=softcap)
    ref, rlse = b.reference(causal=causal, return_lse=True, sinks=sinks, softcap=softcap,
                            window_size=window_size)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, rel
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse.float()))
    assert (lse.float()[fin] - rlse[fin]).abs().max() < 1e-4


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("fmt", ["table", "csr"])
def test_shared_plans_compute_the_batch(seed, fmt):
    rng = random.Random(seed)
    hq, hkv = rng.choice([(8, 2), (4, 4), (16, 2)])
    ps = rng.choice([16, 32])
    b = make_shared_prefix_batch(rng, num_qo_heads=hq, num_kv_heads=hkv, head_dim=32,
                                 page_size=ps, page_format=fmt, dtype=torch.float32)
    planner = Planner(hq, hkv, 32, ps, device="cpu", num_sms=rng.choice([4, 16, 132]))
    causal = seed % 4 != 3
    plan = _plan(planner, b, fmt, causal=causal)
    assert plan.shares and plan.summary.num_shared_prefixes > 0
    _check(plan, b, causal)
    # the plain plan of the same batch (the opt-out)
    plain = planner.plan(b.cu_seqlens_q, b.seqused_k, causal=causal, share_prefixes=False,
                         **(dict(block_table=b.block_table) if fmt == "table"
                            else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices)))
    assert not plain.shares and plain.summary.num_shared_prefixes == 0
    _check(plain, b, causal)


def test_sinks_and_softcap_merge_once():
    rng = random.Random(11)
    b = make_shared_prefix_batch(rng, num_qo_heads=8, num_kv_heads=2, head_dim=32,
                                 page_size=16, dtype=torch.float32)
    planner = Planner(8, 2, 32, 16, device="cpu", num_sms=8)
    sinks = torch.randn(8)
    plan = _plan(planner, b, "table", softcap=5.0)
    assert plan.summary.num_shared_prefixes > 0
    _check(plan, b, sinks=sinks, softcap=5.0)


def test_what_is_not_shared():
    """Partial last pages, pages past a sharer's first query, short runs, a run a
    window cuts, and batch-invariant plans (which never share)."""
    ps = 16
    # two decodes whose lists agree on 20 pages, but one's kv ends inside page 19: only
    # whole pages before the first query token count
    table = torch.arange(40, dtype=torch.int32).reshape(1, 40).repeat(2, 1)
    table[1, 25:] += 100
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    planner = Planner(4, 1, 32, ps, device="cpu", num_sms=8)
    kv = torch.tensor([19 * ps + 5, 30 * ps], dtype=torch.int32)
    s = planner.plan(cu, kv, block_table=table, share_prefixes=True).summary
    assert s.num_shared_prefixes == 1 and s.shared_kv_tokens == 19 * ps
    # runs shorter than MIN_SHARED_TOKENS are not worth a tile
    def runs(kv, **kw):
        return planner.plan(cu, kv, block_table=table, share_prefixes=True,
                            **kw).summary.num_shared_prefixes

    assert runs(torch.tensor([10 * ps + 1, 10 * ps + 1], dtype=torch.int32)) == 0
    kv = torch.tensor([30 * ps, 30 * ps], dtype=torch.int32)
    assert runs(kv) == 1
    for kw in (dict(window_size=(100, 0)), dict(batch_invariant=True)):
        assert runs(kv, **kw) == 0
    # A window that keeps the whole run for both rows (positions 480) and for the tile's
    # (at most 128 / 4 tokens after it) shares it; one key short of that does not.
    kv = torch.tensor([30 * ps + 1, 30 * ps + 1], dtype=torch.int32)
    assert runs(kv, window_size=(30 * ps - 1, 0)) == 0
    assert runs(kv, window_size=(30 * ps + 30, 0)) == 1
    with pytest.raises(TypeError, match="share_prefixes"):
        planner.plan(cu, kv, block_table=table, share_prefixes=1)


@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3fn"])
def test_a_node_is_shared_where_it_pays(kv_dtype):
    """By default a node is shared when its sharers' plain plan would read
    MIN_SHARED_READ_BYTES of its run (sharers x run x the K and V bytes of a token): at
    32/8/128, 4 KB a 16-bit token and 2 KB an fp8 one. Nested nodes are judged alone."""
    from podcute.planning import sharing

    planner = Planner(32, 8, 128, 16, device="cpu", num_sms=16, kv_dtype=kv_dtype,
                      max_batch_size=64, max_num_tokens=64)
    planner.share_min_read_bytes = sharing.MIN_SHARED_READ_BYTES  # (the fixture's 0 off)
    need = sharing.MIN_SHARED_READ_BYTES // (4096 if not kv_dtype else 2048)  # tokens

    def shares(n, run, own=64):
        table = torch.arange(n * 2048, dtype=torch.int32).reshape(n, 2048) + 10**6
        table[:, : run // 16] = torch.arange(run // 16, dtype=torch.int32)
        cu = torch.arange(n + 1, dtype=torch.int32)
        kv = torch.full((n,), run + own, dtype=torch.int32)
        s = planner.plan(cu, kv, block_table=table).summary
        return s.shared_kv_tokens

    n = 12
    run = need // n
    assert run % 16 == 0
    assert shares(n, run) == run
    assert shares(n, run - 16) == 0
    assert shares(2, 256) == 0 and shares(64, 8192) == 8192


@pytest.mark.parametrize("seed", range(12))
def test_the_early_exit_never_drops_a_node_that_pays(seed, monkeypatch):
    """sharing._may_pay (the gather at the column a paying node must reach) only ends
    searches that would find nothing: with it and without it, detect finds the same
    nodes, at thresholds around the batch's own nodes."""
    from podcute.planning import sharing

    rng = random.Random(seed)
    fmt = rng.choice(["table", "csr"])
    b = make_shared_prefix_batch(rng, num_qo_heads=8, num_kv_heads=2, head_dim=32,
                                 page_size=16, num_groups=rng.randint(1, 4),
                                 sharers=(2, 9), page_format=fmt, dtype=torch.float32)
    q_len = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).numpy().astype(np.int64)
    kvl = b.seqused_k.numpy().astype(np.int64)
    src = (("table", b.block_table.numpy(), b.block_table.shape[1]) if fmt == "table"
           else ("csr", b.kv_indices.numpy(), b.kv_indptr.numpy().astype(np.int64)))

    def found(min_reads, exit_early=True):
        if not exit_early:
            monkeypatch.setattr(sharing, "_may_pay", lambda *a: True)
        sh = sharing.detect(src, q_len, kvl, 4, 16, 64, 128, 256, 4096, -1, min_reads)
        monkeypatch.undo()
        return None if sh is None else (sh.shared_tokens, sh.saved_tokens, sh.num_nodes)

    base = found(0)
    assert base is not None
    for mr in sorted({1, 256, 512, 1024, 2048, 4096, 8192, 16384, 10**6}
                     | {rng.randint(1, 20000) for _ in range(8)}):
        assert found(mr) == found(mr, exit_early=False), mr


def test_a_batch_below_the_reads_is_not_searched(monkeypatch):
    """A batch whose pages hold fewer tokens than a node needs to pay skips the search
    (no first test: decode-1's plan costs what it did before sharing was the default)."""
    from podcute.planning import sharing

    calls = []
    monkeypatch.setattr(sharing, "detect", lambda *a, **k: calls.append(1))
    planner = Planner(32, 8, 128, 16, device="cpu", num_sms=16)
    planner.share_min_read_bytes = sharing.MIN_SHARED_READ_BYTES
    need = sharing.MIN_SHARED_READ_BYTES // 4096
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    for kv, searched in ((need // 2 - 16, False), (need // 2, True)):
        table = torch.zeros(2, need // 32, dtype=torch.int32)  # (one page, repeated)
        calls.clear()
        planner.plan(cu, torch.tensor([kv, kv], dtype=torch.int32), block_table=table,
                     causal=False)
        assert bool(calls) == searched, kv
        planner._native = None  # (then numpy's first test)


def test_batches_with_nothing_to_share():
    """Sharing is looked for by default: an empty batch, a table without columns and
    requests without keys plan as before (numpy's first test and C's)."""
    for impl in ("numpy", "native"):
        planner = Planner(8, 2, 32, 16, device="cpu", num_sms=4)
        if impl == "numpy":
            planner._native = None
        empty = torch.zeros(1, dtype=torch.int32)
        plan = planner.plan(empty, torch.zeros(0, dtype=torch.int32),
                            block_table=torch.zeros(0, 0, dtype=torch.int32))
        assert not plan.shares and plan.num_items == 0
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        plan = planner.plan(cu, torch.zeros(2, dtype=torch.int32),
                            block_table=torch.zeros(2, 0, dtype=torch.int32), causal=False)
        assert not plan.shares


def test_the_same_page_twice_in_one_request():
    rng = random.Random(5)
    b = make_shared_prefix_batch(rng, num_qo_heads=4, num_kv_heads=2, head_dim=32,
                                 page_size=16, dtype=torch.float32, num_groups=1,
                                 sharers=(4, 4))
    t = b.block_table.clone()
    t[:, 3] = t[:, 1]  # a page repeated in every sharer's prefix (and its own list)
    b = type(b)(**{**b.__dict__, "block_table": t})
    planner = Planner(4, 2, 32, 16, device="cpu", num_sms=8)
    plan = _plan(planner, b, "table")
    assert plan.summary.num_shared_prefixes > 0
    _check(plan, b)


def test_warp_kernel_plans_share_with_its_shorter_tiles():
    """The warp-level kernel may cut a batch's prefill rows into 64-row tiles: prefix tiles
    are cut no taller, so each stays one row tile."""
    rng = random.Random(2)
    b = make_shared_prefix_batch(rng, num_qo_heads=16, num_kv_heads=2, head_dim=32,
                                 page_size=16, dtype=torch.float32, num_groups=1,
                                 sharers=(20, 20), sub_share=0.0, spec=0.0)
    planner = Planner(16, 2, 32, 16, device="cpu", num_sms=8, arch="sm_80")
    plan = _plan(planner, b, "table")
    assert plan.summary.num_shared_tiles >= 3  # 20 sharers x 8 rows in tiles of 64
    _check(plan, b)


@pytest.mark.parametrize("seed", range(8))
def test_windows_share_what_every_row_sees(seed):
    """Under a sliding window a node is shared only where no sharer's row and no tile row
    loses a key of it to the window; the rest is planned as without sharing."""
    rng = random.Random(100 + seed)
    b = make_shared_prefix_batch(rng, num_qo_heads=8, num_kv_heads=2, head_dim=32,
                                 page_size=16, dtype=torch.float32, num_groups=3,
                                 own_tokens=(1, 60))
    planner = Planner(8, 2, 32, 16, device="cpu", num_sms=rng.choice([4, 16]))
    causal = seed % 3 != 2
    shared = 0
    for left in (rng.randint(300, 900), 4000):
        window = (left, 0 if causal else rng.choice([-1, 0, 7]))
        plan = _plan(planner, b, "table", causal=causal, window_size=window)
        _check(plan, b, causal, window_size=window)
        shared += plan.summary.num_shared_prefixes
    assert shared > 0  # (a window past every position shares as much as none)


def test_a_window_that_would_cut_a_tile_row():
    """24 decodes one token past a 480-token run, window 482: every sharer sees the whole
    run, but a tile's later rows (virtual positions past the run) would not, so the run
    is not shared; 34 keys more and it is."""
    rng = random.Random(3)
    b = make_shared_prefix_batch(rng, num_qo_heads=8, num_kv_heads=2, head_dim=32,
                                 page_size=16, dtype=torch.float32, num_groups=1,
                                 sharers=(24, 24), prefix_pages=(30, 30), sub_share=0.0,
                                 own_tokens=(0, 0), spec=0.0, others=0)
    planner = Planner(8, 2, 32, 16, device="cpu", num_sms=8)
    for left, runs in ((30 * 16 + 2, 0), (30 * 16 + 34, 1)):
        plan = _plan(planner, b, "table", window_size=(left, 0))
        assert plan.summary.num_shared_prefixes == runs
        _check(plan, b, window_size=(left, 0))
