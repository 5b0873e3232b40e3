"""The planner's C work expansion (podcute/planning/native.c) writes the same plan as its numpy
code, bit for bit: work rows, CTA lists, merges, slot list, and the predictions, on random
batches of every kind (prefill / decode / mixed, windows, batch invariance, CSR, other
grids and tile shapes), and on batches that exceed a capacity (the numpy path grows)."""

import random

import numpy as np
import pytest

from podcute.kernels.metadata import MergeCol
from podcute.planning import native as plan_native
from podcute.planning import sharing
from podcute.planning import H100_HBM_BYTES_PER_SM_CLOCK, Planner
from podcute.testing import mixed_lengths

pytestmark = pytest.mark.skipif(plan_native.load() is None,
                                reason="no C compiler: the planner plans with numpy")

_PAIRS = {}


def _pair(hq, hkv, d, page, num_sms, arch, cap, hbm=None):
    """hbm: HBM bytes per SM clock (an H100's: the warp-level kernel's SM pairs run grouped
    lists; None: the H200's, interleaved lists with their heads swapped)."""
    key = (hq, hkv, d, page, num_sms, arch, cap, hbm)
    if key not in _PAIRS:
        kw = dict(device="cpu", num_sms=num_sms, arch=arch, max_batch_size=cap,
                  max_num_tokens=cap * 64, hbm_bytes_per_sm_clock=hbm)
        native, ref = Planner(hq, hkv, d, page, **kw), Planner(hq, hkv, d, page, **kw)
        ref._native = None
        assert native._native is not None
        _PAIRS[key] = (native, ref)
    return _PAIRS[key]


def _batch(rng: random.Random, page: int, causal: bool):
    n = rng.choice([1, 1, 2, 5, rng.randint(1, 40), rng.randint(1, 300)])
    q_lens, kv_lens = mixed_lengths(rng, n, causal, 40000)
    if not causal:  # requests with no KV, and more queries than keys
        for b in range(n):
            if rng.random() < 0.05:
                kv_lens[b] = rng.choice([0, 1, 7])
    cu = np.zeros(n + 1, dtype=np.int32)
    cu[1:] = np.cumsum(q_lens)
    kvl = np.array(kv_lens, dtype=np.int32)
    pages = -(-kvl // page)
    if rng.random() < 0.5:
        width = max(1, int(pages.max()))
        table = np.arange(n * width, dtype=np.int32).reshape(n, width)
        return cu, dict(kv_lens=kvl, block_table=table)
    indptr = np.zeros(n + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(pages)
    return cu, dict(kv_lens=kvl, kv_indptr=indptr,
                    kv_indices=np.arange(int(indptr[-1]), dtype=np.int32))


def _assert_same(a, b, what):
    assert a.num_items == b.num_items and a.num_merge == b.num_merge, what
    assert a.num_slots == b.num_slots, what
    for name in ("work", "cta_ptr", "merge", "slot_merge", "q_start", "kv_len",
                 "page_start"):
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), \
            f"{what}: {name} differs"
    for x, y in zip(a._costs(), b._costs()):
        assert np.array_equal(x, y), f"{what}: predictions differ"
    assert str(a.summary) == str(b.summary), what


@pytest.mark.parametrize("seed", range(60))
def test_native_and_numpy_plans_agree(seed):
    rng = random.Random(seed)
    for trial in range(25):
        shape = rng.choice([(32, 8, 128), (8, 8, 64), (28, 4, 128), (32, 1, 128), (8, 2, 96)])
        page = rng.choice([1, 16, 128])
        num_sms = rng.choice([132, 132, 7, 61, 1])
        arch = rng.choice(["sm_90a", "sm_90a", "sm_80", "sm_90"])
        native, ref = _pair(*shape, page, num_sms, arch, 512, rng.choice([H100_HBM_BYTES_PER_SM_CLOCK, None]))
        causal = rng.random() < 0.7
        cu, kw = _batch(rng, page, causal)
        opts = dict(causal=causal)
        r = rng.random()
        if r < 0.15:
            opts["window_size"] = (rng.choice([0, 16, 700, 4096]), rng.choice([-1, 0, 64]))
        elif r < 0.25:
            opts["window_size"] = (-1, rng.choice([0, 64]))
        if rng.random() < 0.1:
            opts["batch_invariant"] = True
        what = f"seed {seed} trial {trial} {shape} page {page} sms {num_sms} {arch} {opts}"
        a, b = native.plan(cu, **kw, **opts), ref.plan(cu, **kw, **opts)
        _assert_same(a, b, what)


def test_capacity_overflow_falls_back_and_grows():
    """A batch past the buffers: the numpy path regrows them, the C path follows."""
    native, ref = _pair(32, 8, 128, 16, 132, "sm_90a", 4)
    rng = random.Random(5)
    for _ in range(3):
        cu, kw = _batch(rng, 16, True)
        _assert_same(native.plan(cu, **kw), ref.plan(cu, **kw), "overflow")
    n = 200
    cu = np.arange(n + 1, dtype=np.int32) * 3
    kvl = np.full(n, 9000, dtype=np.int32)
    table = np.arange(n * 600, dtype=np.int32).reshape(n, 600)
    _assert_same(native.plan(cu, kvl, block_table=table), ref.plan(cu, kvl, block_table=table),
                 "grown")


def _first_pages_repeat(page_src, q_len, kvl, max_q, min_kv):
    """numpy's answer to sharing's first test."""
    fmt, pages, arg = page_src
    ok = (q_len > 0) & (q_len <= max_q) & (kvl - q_len >= min_kv)
    first = pages[: q_len.size, 0][ok] if fmt == "table" else pages[arg[:-1][ok]]
    return np.unique(first).size < first.size


class _FirstTestBatch:
    """A random decode-heavy batch for sharing's first test on a 16/4/64 page-16 planner
    whose searches for a prefix tree (Planner._detect_sharing: native.c's podcute_detect
    or sharing.detect) are recorded in `calls` (the search itself not run)."""

    width = 40

    def __init__(self, rng, monkeypatch, min_batch: int):
        self.planner = Planner(16, 4, 64, 16, device="cpu", max_batch_size=300,
                               max_num_tokens=2048)
        assert self.planner._native is not None
        self.max_q, self.min_kv = sharing.candidate_bounds(
            4, 16, self.planner.config.kernel.tile_m_decode)
        self.calls = []
        monkeypatch.setattr(self.planner, "_detect_sharing",
                            lambda *a, **k: self.calls.append(1))
        B = self.B = int(rng.integers(min_batch, 300))
        self.q_len = rng.integers(0, self.max_q + 2, B).astype(np.int64)
        self.kvl = self.q_len + rng.integers(0, 600, B)
        self.cu = np.concatenate([[0], np.cumsum(self.q_len)]).astype(np.int32)
        self.table = rng.permutation(100000)[: B * self.width].reshape(B, self.width)
        self.cand = ((self.q_len > 0) & (self.q_len <= self.max_q)
                     & (self.kvl - self.q_len >= self.min_kv)).nonzero()[0]


@pytest.mark.parametrize("seed", range(24))
def test_sharing_first_test_in_the_expansion(seed, monkeypatch):
    """plan() (sharing by default) looks for a prefix tree (sharing.detect) exactly when two
    candidates start on the same page: the C expansion's answer to the first test agrees
    with numpy's on block tables (int32, int64, row views) and CSR, candidates or not."""
    x = _FirstTestBatch(np.random.default_rng(seed), monkeypatch, 1)
    rng, planner, calls, B, table, cand = (np.random.default_rng(seed + 1000), x.planner,
                                           x.calls, x.B, x.table, x.cand)
    q_len, kvl, cu, width, max_q, min_kv = x.q_len, x.kvl, x.cu, x.width, x.max_q, x.min_kv
    planner.share_min_read_bytes = 0  # (the test looks whatever the batch's reads)
    if seed % 4 == 1 and cand.size > 1:  # a repeat between two candidates
        a, b = rng.choice(cand, 2, replace=False)
        table[b, 0] = table[a, 0]
    elif seed % 4 == 3 and B > 1:  # one that may involve other requests
        a, b = rng.choice(B, 2, replace=False)
        table[b, 0] = table[a, 0]
    kv32 = kvl.astype(np.int32)
    for dtype in (np.int32, np.int64):
        t = table.astype(dtype)
        wide = np.concatenate([t, t], axis=1)
        indptr = np.arange(B + 1, dtype=np.int64) * width
        for pages, src in ((dict(block_table=t), ("table", t, width)),
                           (dict(block_table=wide[:, :width]), ("table", t, width)),
                           (dict(kv_indptr=indptr.astype(np.int32), kv_indices=t.reshape(-1)),
                            ("csr", t.reshape(-1), indptr))):
            calls.clear()
            planner.plan(cu, kv32, **pages)
            assert bool(calls) == _first_pages_repeat(src, q_len, kvl, max_q, min_kv)
            calls.clear()
            planner.plan(cu, kv32, **pages, share_prefixes=False)
            assert not calls


def _numpy_may_search(page_src, q_len, kvl, max_q, min_kv, min_reads, page):
    """numpy's answer to sharing's first test and its early exit (sharing._may_pay)."""
    fmt, pages, arg = page_src
    ok = (q_len > 0) & (q_len <= max_q) & (kvl - q_len >= min_kv)
    cand = ok.nonzero()[0]
    first = pages[cand, 0] if fmt == "table" else pages[arg[cand]]
    order = first.argsort(kind="stable")
    f = first[order]
    gid = np.concatenate([[0], np.cumsum(f[1:] != f[:-1])]).astype(np.int64)
    size = np.bincount(gid)[gid]
    kept = size > 1
    if not kept.any():
        return False
    reqs = cand[order[kept]]
    return sharing._may_pay(page_src, reqs, gid[kept], size[kept],
                            (kvl[reqs] - q_len[reqs]) // page, min_reads, page)


@pytest.mark.parametrize("seed", range(16))
def test_sharing_pays_test_in_the_expansion(seed, monkeypatch):
    """With a read threshold, the C expansion's first test also ends the searches that
    could find no paying node (sharing._may_pay's test), exactly where numpy does: groups
    of requests sharing runs of random lengths, thresholds around their reads, tables
    and CSR of both integer widths."""
    x = _FirstTestBatch(np.random.default_rng(100 + seed), monkeypatch, 50)
    rng, planner, calls, B, table, cand = (np.random.default_rng(seed + 2000), x.planner,
                                           x.calls, x.B, x.table, x.cand)
    q_len, kvl, cu, width, max_q, min_kv = x.q_len, x.kvl, x.cu, x.width, x.max_q, x.min_kv
    assert planner._token_bytes == 1024
    for _ in range(int(rng.integers(1, 5))):  # groups sharing a run of r pages
        # (mostly candidates, now and then another request among them)
        members = np.concatenate([rng.choice(cand, int(rng.integers(2, 8)), replace=False),
                                  rng.choice(B, int(rng.integers(0, 2)))])
        r = int(rng.integers(1, width + 1))
        table[members, :r] = table[members[0], :r]
    kv32 = kvl.astype(np.int32)
    searched = 0
    for min_reads in [1, 256, 1024] + [int(x) for x in rng.integers(1, 6000, 5)]:
        planner.share_min_read_bytes = min_reads * 1024
        for dtype in (np.int32, np.int64):
            t = table.astype(dtype)
            indptr = np.arange(B + 1, dtype=np.int64) * width
            for pages, src in ((dict(block_table=t), ("table", t, width)),
                               (dict(kv_indptr=indptr.astype(np.int32),
                                     kv_indices=t.reshape(-1)), ("csr", t.reshape(-1), indptr))):
                calls.clear()
                planner.plan(cu, kv32, **pages)
                want = _numpy_may_search(src, q_len, kvl, max_q, min_kv, min_reads, 16)
                assert bool(calls) == want, (min_reads, dtype, src[0])
                searched += want
    assert searched  # (the batches reach the search at some thresholds)


def _random_shared_pages(seed: int):
    """detect()'s arguments for a random batch whose requests share chunks of pages in
    random nests (a table or CSR, int32 or int64 pages; windows, thresholds, tile room)."""
    rng, R = random.Random(seed), np.random.default_rng(seed)
    ps, B = rng.choice([1, 2, 16]), rng.randint(1, 60)
    chunks = [list(R.integers(0, 50, size=rng.randint(1, 40)))
              for _ in range(rng.randint(1, 6))]
    lists, q, kv = [], [], []
    for _ in range(B):
        pg = []
        for c in rng.sample(range(len(chunks)), rng.randint(0, len(chunks))):
            pg += chunks[c]
            if rng.random() < 0.5:
                break
        pg += list(R.integers(0, rng.choice([60, 10**6]), size=rng.randint(0, 30)))
        ql = rng.choice([1, 1, 1, 2, 3, 4, 40])
        kvl = max(ql, len(pg) * ps - rng.randint(0, ps - 1) if pg else ql)
        n = -(-kvl // ps)
        lists.append((pg + list(R.integers(0, 10**6, size=max(0, n - len(pg)))))[:n])
        q.append(ql)
        kv.append(kvl)
    dt = rng.choice([np.int32, np.int64])
    if rng.random() < 0.5:
        t = np.full((B, max(1, max(map(len, lists))) + rng.randint(0, 3)), 7, dtype=dt)
        for i, pages in enumerate(lists):
            t[i, :len(pages)] = pages
        src = ("table", t, t.shape[1])
    else:
        ind = np.concatenate([np.array(p, dtype=dt) for p in lists] + [np.zeros(0, dt)])
        ptr = np.zeros(B + 1, np.int64)
        ptr[1:] = np.cumsum([len(p) for p in lists])
        src = ("csr", ind, ptr)
    return (src, np.array(q, np.int64), np.array(kv, np.int64), rng.choice([1, 4, 8]), ps,
            64, rng.choice([64, 128]), rng.choice([2, 1000]), rng.choice([20, 100000]),
            rng.choice([-1, -1, 40, 400]), rng.choice([0, 0, 0, 300, 3000]))


def test_detect_in_c_is_numpy_detect():
    """native.c's podcute_detect finds the same tree, nodes, tiles and levels as
    sharing.detect, array for array, on 1500 random nests of shared pages (its rows sorted
    as numpy sorts their bytes)."""
    nb = plan_native.load()
    found = 0
    for seed in range(1500):
        args = _random_shared_pages(seed)
        want, got = sharing.detect(*args), nb.detect(*args)
        assert (want is None) == (got is None), seed
        if want is None:
            continue
        found += 1
        for f in sharing.Sharing.__dataclass_fields__:
            a, b = getattr(want, f), getattr(got, f)
            assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), (seed, f)
    assert found > 50


@pytest.mark.parametrize("seed", range(12))
def test_native_and_numpy_sharing_plans_agree(seed, monkeypatch):
    """Plans that share prefixes (detection and rewrite in C: native.c podcute_detect and
    podcute_rewrite) are byte for byte numpy's: work rows, merges with their feed and
    term columns, slot lists, the shared token-and-term list, on random nests of sharers
    (tables and CSR, speculative rows, windows)."""
    from podcute.testing import make_shared_prefix_batch

    monkeypatch.setattr(Planner, "share_min_read_bytes", 0)
    rng = random.Random(seed)
    shared = 0
    for trial in range(6):
        hq, hkv, d = rng.choice([(32, 8, 128), (8, 2, 64), (16, 16, 128), (8, 1, 64)])
        page, fmt = rng.choice([16, 32]), rng.choice(["table", "csr"])
        native, ref = _pair(hq, hkv, d, page, rng.choice([132, 61]), "sm_90a", 512)
        b = make_shared_prefix_batch(rng, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                     page_size=page, page_format=fmt,
                                     num_groups=rng.randint(1, 4), sharers=(2, rng.randint(2, 70)))
        kw = (dict(block_table=b.block_table) if fmt == "table"
              else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
        opts = dict(causal=rng.random() < 0.8)
        if rng.random() < 0.3:
            opts["window_size"] = (rng.choice([700, 4096, 100000]), 0)
        what = f"seed {seed} trial {trial} {hq}/{hkv}/{d} page {page} {fmt} {opts}"
        a = native.plan(b.cu_seqlens_q, b.seqused_k, **kw, **opts)
        r = ref.plan(b.cu_seqlens_q, b.seqused_k, **kw, **opts)
        _assert_same(a, r, what)
        assert a.shares == r.shares, what
        if a.summary.num_shared_prefixes:
            shared += 1
            n = native._segs["shared"][1]
            assert np.array_equal(native._h["shared"][:n], ref._h["shared"][:n]), what
    assert shared


def test_a_plan_after_a_sharing_plan_is_the_same(monkeypatch):
    """After a plan that shared, the planner looks for sharing before expanding (skipping
    the plain expansion that answers the first test): every plan of a sequence of sharing
    and non-sharing batches equals a fresh planner's plan of the same batch."""
    from podcute.testing import make_shared_prefix_batch

    monkeypatch.setattr(Planner, "share_min_read_bytes", 0)
    rng = random.Random(5)
    kw = dict(device="cpu", max_batch_size=512, max_num_tokens=8192)
    steady = Planner(32, 8, 128, 16, **kw)
    for trial in range(16):
        b = make_shared_prefix_batch(rng, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                     page_size=16, num_groups=rng.randint(1, 3))
        if trial % 3 == 2:  # a batch that shares nothing between sharing ones
            b = make_shared_prefix_batch(rng, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                                         page_size=16, sharers=(1, 1))
        args = (b.cu_seqlens_q, b.seqused_k)
        a = steady.plan(*args, block_table=b.block_table)
        fresh = Planner(32, 8, 128, 16, **kw).plan(*args, block_table=b.block_table)
        assert a.shares == fresh.shares
        if not a.shares:  # (the plain variant reads no merge column past NUM_SPLITS,
            # which a plain plan after a sharing one leaves as that plan wrote them)
            for p in (a, fresh):
                p.merge[:, MergeCol.OWN_ROW:] = 0
        _assert_same(a, fresh, f"trial {trial}")
