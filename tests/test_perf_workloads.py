"""perf.workloads on the CPU: the roofline math on hand-computed cases, and the issue's
workloads with their sizes."""

import os
import sys

import pytest

# perf/ is not an installed package: import it from the source tree whatever the cwd.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from perf import workloads as W  # noqa: E402


def brute_pairs(q_len, kv_len, causal=True):
    """Pairs counted key by key from docs/contract.md: query j sits at kv_len - q_len + j."""
    if not causal:
        return q_len * kv_len
    return sum(1 for j in range(q_len) for t in range(kv_len) if t <= kv_len - q_len + j)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 7), (3, 3), (3, 5), (4, 10), (5, 5),
                                          (0, 4), (6, 2), (16, 33)])
def test_visible_pairs_matches_brute_force(q_len, kv_len):
    assert W.visible_pairs(q_len, kv_len) == brute_pairs(q_len, kv_len)
    assert W.visible_pairs(q_len, kv_len, causal=False) == q_len * kv_len


def test_visible_pairs_by_hand():
    # q 3 at kv 5: queries at positions 2, 3, 4 see 3 + 4 + 5 keys.
    assert W.visible_pairs(3, 5) == 12
    # square causal: n (n + 1) / 2; a decode sees its whole context.
    assert W.visible_pairs(4, 4) == 10
    assert W.visible_pairs(1, 2048) == 2048


def test_flops_and_bytes_tiny_case():
    # Two requests: (q 2, kv 3) and a decode (q 1, kv 4); Hq 4, Hkv 2, D 8, bf16.
    w = W.Workload("tiny", (2, 1), (3, 4), num_qo_heads=4, num_kv_heads=2, head_dim=8)
    pairs = (2 + 3) + 4  # queries at positions 1, 2 see 2 and 3 keys; the decode 4
    assert W.flops(w) == 4 * 4 * 8 * pairs == 1152
    q_plus_o = 2 * 3 * 4 * 8 * 2  # (Q + O) x 3 tokens x Hq x D x 2 bytes
    k_plus_v = 2 * (3 + 4) * 2 * 8 * 2  # (K + V) x 7 tokens x Hkv x D x 2 bytes
    assert W.bytes_moved(w) == q_plus_o + k_plus_v == 384 + 448
    # roofline: the larger of the two times
    assert W.roofline_s(w, 1152.0, 1e9) == pytest.approx(1.0)
    assert W.bound(w, 1152.0, 1e9) == "compute"
    assert W.roofline_s(w, 1e12, 832.0) == pytest.approx(1.0)
    assert W.bound(w, 1e12, 832.0) == "memory"


def test_request_without_queries_moves_nothing():
    w = W.Workload("pad", (0, 1), (100, 4), num_qo_heads=2, num_kv_heads=1, head_dim=4)
    assert W.bytes_moved(w) == (2 * 1 * 2 * 4 + 2 * 4 * 1 * 4) * 2
    assert W.flops(w) == 4 * 2 * 4 * 4


def _parts(w):
    """(prefills [(q, kv)], decodes [(q, kv)]) split at num_prefill."""
    reqs = list(zip(w.q_lens, w.kv_lens))
    return reqs[: w.num_prefill], reqs[w.num_prefill:]


@pytest.mark.parametrize("w,prefills,n_dec,ctx,hq,hkv", [
    (W.M1, [(2048, 2048)], 128, 2048, 32, 8),
    (W.M2, [(4096, 4096)], 128, 4096, 32, 8),
    (W.M3, [(4096, 4096)], 128, 8192, 32, 8),
    (W.M4, [(6000, 7000)], 128, 8192, 32, 8),
    (W.M5, [(2048, 2048)] * 2, 128, 2048, 32, 8),
    (W.P1, [(1024, 12288)], 80, 12288, 16, 4),
    (W.D1, [], 256, 4096, 32, 8),
    (W.F1, [(8192, 8192)], 0, None, 32, 8),
])
def test_issue_workloads(w, prefills, n_dec, ctx, hq, hkv):
    pre, dec = _parts(w)
    assert pre == prefills
    assert dec == [(1, ctx)] * n_dec
    assert (w.num_qo_heads, w.num_kv_heads, w.head_dim, w.causal) == (hq, hkv, 128, True)
    assert w.has_split == (bool(prefills) and n_dec > 0)
    assert all(q <= kv for q, kv in zip(w.q_lens, w.kv_lens))  # valid for causal


def test_main_sets_and_pages():
    main, pages, sweep = W.workloads(quick=False)
    names = [w.name for w in main]
    assert names[:8] == ["M1", "M2", "M3", "M4", "M5", "P1", "D1", "F1"]
    assert pages == (16, 128)
    quick_main, quick_pages, quick_sweep = W.workloads(quick=True)
    assert [w.name for w in quick_main][:3] == ["M1", "D1", "F1"] and quick_pages == (16,)
    assert 0 < len(quick_sweep) <= 8


def test_shuffled_variant_is_a_permutation_of_m1():
    s = W.M1_SHUFFLED
    assert sorted(zip(s.q_lens, s.kv_lens)) == sorted(zip(W.M1.q_lens, W.M1.kv_lens))
    assert (s.q_lens, s.kv_lens) != (W.M1.q_lens, W.M1.kv_lens)
    assert s.num_prefill is None and not s.has_split
    assert W.flops(s) == W.flops(W.M1) and W.bytes_moved(s) == W.bytes_moved(W.M1)


def test_sweep_grid():
    sw = W.sweep()
    assert len(sw) == 60
    coords = {(w.params["chunk"], w.params["batch"], w.params["ctx"]) for w in sw}
    assert coords == {(c, b, x) for c in (512, 1024, 2048, 4096, 8192)
                      for b in (16, 64, 128, 256) for x in (1024, 4096, 16384)}
    for w in sw:
        p = w.params
        assert _parts(w) == ([(p["chunk"], p["chunk"])], [(1, p["ctx"])] * p["batch"])


@pytest.mark.parametrize("name", ["M1", "M2", "M3", "M4", "M5", "P1", "D1"])
def test_rooflines_match_anchors_at_anchor_ceilings(name):
    """At the ceilings DESIGN.md measured (4.22 TB/s, 779 TFLOP/s) the memory-bound
    rooflines land within 0.5% of the issue's anchors."""
    w = {x.name: x for x in W.MAIN}[name]
    assert W.roofline_s(w, 779e12, 4.22e12) * 1e3 == pytest.approx(
        W.ANCHOR_ROOFLINE_MS[name], rel=5e-3)


def test_m1_numbers_by_hand():
    # FLOPs: 4*32*128 * (2048*2049/2 + 128*2048); bytes: 2 B x (Q+O of 2176 rows x 32 x 128
    # + K+V of 129 x 2048 tokens x 8 x 128).
    assert W.flops(W.M1) == 16384 * (2098176 + 262144)
    assert W.bytes_moved(W.M1) == 2 * (2 * 2176 * 4096 + 2 * 129 * 2048 * 1024)
    assert W.bound(W.M1, 779e12, 4.22e12) == "memory"
    assert W.bound(W.F1, 779e12, 4.22e12) == "compute"


def test_geomean():
    assert W.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert W.geomean([2.0, None]) == pytest.approx(2.0)
