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


def test_prefill_heavy_mix_is_shuffled_ragged_and_prefill_bound():
    w = W.PH1
    prefills = [(q, kv) for q, kv in zip(w.q_lens, w.kv_lens) if q > 1]
    decode_ctx = [kv for q, kv in zip(w.q_lens, w.kv_lens) if q == 1]
    assert len(prefills) == 4 and len(decode_ctx) == 96 and len(set(decode_ctx)) > 48
    assert all(256 <= kv <= 8192 for kv in decode_ctx)
    kinds = [q > 1 for q in w.q_lens]
    assert kinds != sorted(kinds) and kinds != sorted(kinds, reverse=True)  # interleaved
    assert w.num_prefill is None and not w.has_split and not w.params.get("shuffled_from")
    assert W.bound(w, 779e12, 4.22e12) == "compute"
    assert W.prefill_heavy() == W.PH1  # the same batch in every run
    assert "PH1" in W.MIXED and W.PH1 in W.workloads()[0]


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
    """At the H200 ceilings (docs/performance.md) (4.22 TB/s, 779 TFLOP/s) the memory-bound
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


# --------------------------------------------------------------------------------------
# Sliding window (window_size=(L, 0), causal) and the shape overrides
# --------------------------------------------------------------------------------------


def brute_window(q_len, kv_len, left, causal=True):
    """(pairs, keys some query sees), key by key: query j at p = kv_len - q_len + j sees
    t with p - left <= t (and t <= p when causal)."""
    pairs, seen = 0, set()
    for j in range(q_len):
        p = kv_len - q_len + j
        for t in range(kv_len):
            if (left < 0 or t >= p - left) and (not causal or t <= p):
                pairs += 1
                seen.add(t)
    return pairs, len(seen)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 7), (3, 3), (3, 5), (4, 10), (5, 5),
                                          (0, 4), (6, 2), (16, 33), (40, 100)])
@pytest.mark.parametrize("left", [-1, 0, 1, 2, 5, 31, 1000])
def test_windowed_pairs_and_keys_match_brute_force(q_len, kv_len, left):
    pairs, seen = brute_window(q_len, kv_len, left)
    assert W.visible_pairs(q_len, kv_len, True, left) == pairs
    if q_len > 0 and left >= 0:  # a causal request's queries all see key kv_len - 1
        assert W.seen_keys(q_len, kv_len, left) == seen
    if left < 0 or left >= kv_len:  # no window, or one wider than the request
        assert W.visible_pairs(q_len, kv_len, True, left) == W.visible_pairs(q_len, kv_len)
    nc_pairs, _ = brute_window(q_len, kv_len, left, causal=False)
    assert W.visible_pairs(q_len, kv_len, False, left) == nc_pairs


def test_windowed_pairs_by_hand():
    # q 3 at kv 5, window 1: queries at 2, 3, 4 see keys {1,2}, {2,3}, {3,4}.
    assert W.visible_pairs(3, 5, window_left=1) == 6
    assert W.seen_keys(3, 5, window_left=1) == 4  # keys 1..4
    # window 0: every query sees itself only; a decode at ctx 2048 with window 128: 129 keys
    assert W.visible_pairs(4, 4, window_left=0) == 4
    assert W.visible_pairs(1, 2048, window_left=128) == 129
    assert W.seen_keys(1, 2048, window_left=128) == 129
    # prefill q = kv = 2048 with window 128: rows 0..127 see p + 1 keys, the rest 129
    assert W.visible_pairs(2048, 2048, window_left=128) == 128 * 129 // 2 + (2048 - 128) * 129
    assert W.seen_keys(2048, 2048, window_left=128) == 2048
    assert W.seen_keys(0, 100, window_left=5) == 0


def test_windowed_flops_and_bytes_tiny_case():
    # (q 3, kv 5) and a decode (q 1, kv 4); window 1; Hq 4, Hkv 2, D 8, bf16.
    w = W.Workload("win", (3, 1), (5, 4), num_qo_heads=4, num_kv_heads=2, head_dim=8,
                   window_left=1)
    pairs = 3 * 2 + 2  # every query sees 2 keys (itself and the one before)
    assert W.flops(w) == 4 * 4 * 8 * pairs == 1024
    q_plus_o = 2 * 4 * 4 * 8 * 2  # (Q + O) x 4 tokens x Hq x D x 2 bytes
    keys = (5 - (5 - 3 - 1)) + (4 - (4 - 1 - 1))  # [1, 5) and [2, 4)
    assert keys == 6
    k_plus_v = 2 * keys * 2 * 8 * 2  # (K + V) x 6 keys x Hkv x D x 2 bytes
    assert W.bytes_moved(w) == q_plus_o + k_plus_v == 512 + 384
    # no window (the default -1): the unwindowed numbers
    w0 = W.Workload("win", (3, 1), (5, 4), num_qo_heads=4, num_kv_heads=2, head_dim=8)
    assert W.flops(w0) == 4 * 4 * 8 * (12 + 4)
    assert W.bytes_moved(w0) == q_plus_o + 2 * 9 * 2 * 8 * 2


def test_with_overrides_flow_into_the_roofline():
    w = W.with_overrides(W.M1, head_dim=96, num_qo_heads=64, num_kv_heads=8)
    assert (w.name, w.q_lens, w.kv_lens, w.num_prefill) == ("M1", W.M1.q_lens, W.M1.kv_lens, 1)
    assert (w.num_qo_heads, w.num_kv_heads, w.head_dim, w.window_left) == (64, 8, 96, -1)
    assert W.flops(w) == W.flops(W.M1) * 2 * 96 // 128
    assert W.bytes_moved(w) == 2 * (2 * 2176 * 64 * 96 + 2 * 129 * 2048 * 8 * 96)
    win = W.with_overrides(W.M1, window_left=128)
    assert W.flops(win) == 16384 * (128 * 129 // 2 + 1920 * 129 + 128 * 129)
    assert W.bytes_moved(win) == 2 * (2 * 2176 * 4096 + 2 * (2048 + 128 * 129) * 1024)
    assert W.with_overrides(W.M1) == W.M1  # nothing overridden
    with pytest.raises(ValueError):
        W.with_overrides(W.M1, num_qo_heads=12, num_kv_heads=8)
    # the shuffled variant keeps a window
    s = W.shuffled(win, "x")
    assert s.window_left == 128 and W.flops(s) == W.flops(win)


def test_default_numbers_unchanged():
    # The M1 numbers of test_m1_numbers_by_hand, through the window-aware code paths.
    assert W.M1.window_left == -1
    assert W.flops(W.M1) == 16384 * (2098176 + 262144)
    assert W.bytes_moved(W.M1) == 2 * (2 * 2176 * 4096 + 2 * 129 * 2048 * 1024)


# --------------------------------------------------------------------------------------
# perf.bench: the feature options on the CPU (parsing, workloads, what each call receives)
# --------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
from perf import bench as B  # noqa: E402


def test_bench_cli_parses_feature_options():
    args = B.parse_args(["--quick", "--only", "M1,D1", "--pages", "16,128", "--window", "128",
                         "--softcap", "30", "--sinks", "--batch-invariant", "--head-dim", "96",
                         "--heads", "64/8"])
    o = B.options_from_args(args)
    assert o == B.Options(window_left=128, softcap=30.0, sinks=True, batch_invariant=True,
                          head_dim=96, heads=(64, 8))
    assert o.window_size == (128, 0) and o.changes_attention
    assert o.plan_kwargs() == dict(window_size=(128, 0), softcap=30.0, batch_invariant=True)
    act = o.active()
    assert act["window_size"] == [128, 0] and act["heads"] == "64/8" and act["head_dim"] == 96
    text = o.describe()
    assert "window_size=(128, 0)" in text and "softcap=30" in text and "batch_invariant" in text
    main, pages, sweep = B.select_workloads(args, o)
    assert [w.name for w in main] == ["M1", "D1"] and pages == (16, 128) and args.no_sweep
    args = B.parse_args(["--only", "PH1,F1"])
    assert [w.name for w in B.select_workloads(args)[0]] == ["F1", "PH1"]
    for w in main:
        assert (w.num_qo_heads, w.num_kv_heads, w.head_dim, w.window_left) == (64, 8, 96, 128)
    assert B.command_line(["--window", "128", "--heads", "64/8"]) == \
        "python -m perf.bench --window 128 --heads 64/8"


def test_bench_cli_defaults_change_nothing():
    args = B.parse_args([])
    o = B.options_from_args(args)
    assert o == B.Options() and not o.changes_attention and o.active() == {}
    assert o.plan_kwargs() == {} and o.reference_kwargs(None) == {} and o.fa4_kwargs(None) == {}
    main, pages, sweep = B.select_workloads(args, o)
    assert main == W.workloads()[0] and pages == (16, 128) and sweep == W.workloads()[2]
    assert B._anchors("M1", 16, o) == W.anchors("M1", 16)
    assert all(v is None for v in B._anchors("M1", 16, B.Options(softcap=5.0)).values())
    assert B._anchors("M1", 16, B.Options(batch_invariant=True)) == W.anchors("M1", 16)


@pytest.mark.parametrize("bad", [["--heads", "64/7"], ["--heads", "64"], ["--window", "-3"],
                                 ["--softcap", "-1"], ["--head-dim", "100"]])
def test_bench_cli_rejects_bad_options(bad):
    with pytest.raises(SystemExit):
        B.parse_args(bad)


def test_bench_main_parses_then_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert B.main(["--out", str(tmp_path), "--window", "64", "--sinks", "--heads", "16/4",
                   "--head-dim", "64", "--softcap", "20", "--batch-invariant"]) == 2
    with pytest.raises(SystemExit):
        B.main(["--heads", "bad"])


def test_sinks_are_fixed_and_bf16_exact():
    s = B.make_sinks(8)
    assert s.dtype == torch.float32 and s.shape == (8,)
    assert torch.equal(s, B.make_sinks(8))  # fixed seed
    assert torch.equal(s.to(torch.bfloat16).float(), s)  # FA4's bf16 copy: the same values
    lo, hi = B.SINK_RANGE
    assert bool(((s >= lo) & (s <= hi)).all()) and float(s.std()) > 0
    kw = B.Options(sinks=True, window_left=7, softcap=3.0).fa4_kwargs(s)
    assert kw["window_size"] == (7, 0) and kw["softcap"] == 3.0
    assert kw["learnable_sink"].dtype == torch.bfloat16 and kw["learnable_sink"].shape == (8,)
    assert B.Options(batch_invariant=True).fa4_kwargs(None) == dict(num_splits=1)


def test_fa4_unavailable_for_head_dims_it_does_not_take():
    assert B.Options().fa4_unavailable(W.M1) is None
    assert B.Options(head_dim=96).fa4_unavailable(B.Options(head_dim=96).apply(W.M1)) is None
    why = B.Options().fa4_unavailable(W.with_overrides(W.M1, head_dim=512))
    assert why and "head_dim" in why
    r = B._unavailable(why)
    assert r["error"].startswith("unavailable: ") and r["unavailable"] == why


class _FakePOD:
    """PODAttention's surface, computing the reference on the CPU; records its calls."""

    calls = []

    def __init__(self, hq, hkv, d, page, **kw):
        self.shape = (hq, hkv, d, page)

    def plan(self, cu, kv, block_table=None, causal=True, **kw):
        self.meta = dict(cu_seqlens_q=cu, seqused_k=kv, block_table=block_table)
        self.causal, self.kw = causal, kw
        _FakePOD.calls.append(("plan", dict(kw)))

    def run(self, q, k, v, out=None, sinks=None):
        from podcute.reference import pod_attention_reference

        _FakePOD.calls.append(("run", sinks))
        feats = dict(self.kw)
        feats.pop("batch_invariant", None)
        o = pod_attention_reference(q, k, v, causal=self.causal, sinks=sinks, **feats,
                                    **self.meta)
        out.copy_(o)
        return out


def _fake_fa4(calls):
    def fa4(q, k, v, cu_seqlens_q, seqused_k, page_table, max_seqlen_q, causal, **kw):
        from podcute.reference import pod_attention_reference

        calls.append(dict(kw))
        window = kw.get("window_size", (-1, -1))
        sink = kw.get("learnable_sink")
        o = pod_attention_reference(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                    block_table=page_table, causal=causal,
                                    window_size=window, softcap=kw.get("softcap", 0.0),
                                    sinks=None if sink is None else sink.float())
        return o, None
    return fa4


def _fake_time(fn, reps, warmup):
    class T:
        def to_dict(self):
            return {"ms": 1.0}
    fn(0)
    return T()


def test_run_workload_passes_the_options_to_every_call(monkeypatch):
    """On the CPU, with stand-ins for PODAttention and FA4 (the reference behind both):
    fused, serial, fa4 and fa4x2 all get the run's window / softcap / sinks / batch
    invariance, the check compares to the reference with the same options, and the
    roofline counts the window."""
    monkeypatch.setattr(B, "time_gpu", _fake_time)
    _FakePOD.calls = []
    fa4_calls = []
    opts = B.Options(window_left=5, softcap=4.0, sinks=True, batch_invariant=True, head_dim=16,
                     heads=(4, 2))
    ctx = B.Ctx(None, dict(matmul_flops_per_s=1e12, copy_bytes_per_s=1e11), _FakePOD,
                _fake_fa4(fa4_calls), device="cpu", opts=opts)
    w = W.mixed("tiny", [(12, 20)], 3, 9)
    res = B.run_workload(w, 4, ctx, reps=2, warmup=0)
    assert (res["head_dim"], res["num_qo_heads"], res["num_kv_heads"]) == (16, 4, 2)
    assert res["window_left"] == 5 and res["options"] == opts.active()
    wo = opts.apply(w)
    assert res["flops"] == W.flops(wo) == 4 * 4 * 16 * (12 * 6 + 3 * 6)
    assert res["bytes"] == W.bytes_moved(wo)
    assert all(v is None for v in res["anchors"].values())
    assert set(res["timings"]) == {"fused", "serial", "fa4", "fa4x2"}
    assert all("error" not in t for t in res["timings"].values()), res["timings"]
    assert set(res["rel_l2"]) == {"fused", "serial", "fa4", "fa4x2"}
    assert max(res["rel_l2"].values()) < 1e-2, res["rel_l2"]  # bf16 output rounding
    plans = [kw for kind, kw in _FakePOD.calls if kind == "plan"]
    assert len(plans) == 3  # fused + the serial variant's two plans
    assert all(kw == dict(window_size=(5, 0), softcap=4.0, batch_invariant=True) for kw in plans)
    sinks = [s for kind, s in _FakePOD.calls if kind == "run"]
    assert sinks and all(s is not None and s.dtype == torch.float32 and s.shape == (4,)
                         for s in sinks)
    assert fa4_calls and all(kw["window_size"] == (5, 0) and kw["softcap"] == 4.0
                             and kw["learnable_sink"].dtype == torch.bfloat16
                             and kw["num_splits"] == 1 for kw in fa4_calls)
    assert torch.equal(fa4_calls[0]["learnable_sink"].float(), sinks[0])


def test_run_workload_without_options_is_unchanged(monkeypatch):
    monkeypatch.setattr(B, "time_gpu", _fake_time)
    _FakePOD.calls = []
    fa4_calls = []
    ctx = B.Ctx(None, dict(matmul_flops_per_s=1e12, copy_bytes_per_s=1e11), _FakePOD,
                _fake_fa4(fa4_calls), device="cpu", opts=B.Options())
    w = W.mixed("tiny", [(12, 20)], 3, 9, num_qo_heads=4, num_kv_heads=2)
    w = W.with_overrides(w, head_dim=16)
    res = B.run_workload(w, 4, ctx, reps=2, warmup=0, seed=3)
    assert res["flops"] == W.flops(w) and res["window_left"] == -1 and res["options"] == {}
    assert all(kw == {} for kind, kw in _FakePOD.calls if kind == "plan")
    assert all(s is None for kind, s in _FakePOD.calls if kind == "run")
    assert fa4_calls and all(kw == {} for kw in fa4_calls)
    assert max(res["rel_l2"].values()) < 1e-2


def test_run_workload_records_fa4_unavailable(monkeypatch):
    monkeypatch.setattr(B, "time_gpu", _fake_time)
    fa4_calls = []
    ctx = B.Ctx(None, dict(matmul_flops_per_s=1e12, copy_bytes_per_s=1e11), _FakePOD,
                _fake_fa4(fa4_calls), device="cpu", opts=B.Options(head_dim=264))
    res = B.run_workload(W.mixed("tiny", [(4, 6)], 2, 5, num_qo_heads=2, num_kv_heads=1),
                         4, ctx, reps=1, warmup=0)
    assert not fa4_calls
    for m in ("fa4", "fa4x2"):
        assert res["timings"][m]["error"].startswith("unavailable: ")
    assert "error" not in res["timings"]["fused"]


def test_markdown_header_records_command_and_options():
    o = B.Options(window_left=128, sinks=True)
    report = dict(env=dict(gpu="GPU", torch="t", cuda="c", git="g", podcute_api="api", fa4="fa4"),
                  command="python -m perf.bench --window 128 --sinks", options=o.active(),
                  options_text=o.describe(), notes=["anchors left out"],
                  ceilings=dict(copy_bytes_per_s=4e12, matmul_flops_per_s=7e14),
                  main=[], sweep=[], host={}, targets=[], skipped=[])
    md = B.markdown(report)
    assert "Command: `python -m perf.bench --window 128 --sinks`" in md
    assert "window_size=(128, 0)" in md and "sinks" in md and "anchors left out" in md
    assert B.short_options(o.active()) == "window 128, sinks"
    assert "kernel sources" not in md and "Kernel flags" not in md  # an older report's env
    report["env"].update(kernel_sources="0123abcd",
                         kernel_flags={"PODCUTE_TEST_SOFTMAX_UNDER_PV": "1"})
    md = B.markdown(report)
    assert "podcute g (api, kernel sources 0123abcd)" in md
    assert "Kernel flags: `PODCUTE_TEST_SOFTMAX_UNDER_PV=1`" in md


def test_kernel_sources_name_the_compiled_sources():
    from podcute.compile import VariantKey, kernel_sources
    from podcute.kernels.config import KernelConfig

    key = VariantKey.make(KernelConfig.select("bfloat16", 128, 4))
    assert kernel_sources() == key.sources and len(kernel_sources()) == 16


def test_bytes_moved_with_a_one_byte_cache():
    # Q/O stay 2 bytes, K/V at 1 byte: the fp8 roofline of perf.bench_fp8.
    w = W.M1
    qo = 2 * w.total_q * w.num_qo_heads * w.head_dim
    assert W.bytes_moved(w, kv_elem_bytes=1) == (W.bytes_moved(w) - 2 * qo) // 2 + 2 * qo


def test_sass_loops_finds_back_branches_and_counts_inside():
    from perf.experiments.sass_loops import loops

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
.L_x_1:
        /*0030*/                   LDL R3, [R1+0x8] ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   STL [R1], R3 ;
        /*0060*/              @P1 BRA `(.L_x_0) ;
        /*0070*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""
    found = {(s, e): c for s, e, c in loops(sass)}
    assert set(found) == {(0x10, 0x60), (0x30, 0x40)}  # a forward branch is no loop
    outer, inner = found[(0x10, 0x60)], found[(0x30, 0x40)]
    assert (outer["HMMA"], outer["LDSM"], outer["LDL"], outer["STL"], outer["BRA"]) == (1, 1, 1, 1, 2)
    assert sum(inner.values()) == 2 and inner["LDL"] == 1


def test_l2_model_traffic_by_hand():
    """perf.experiments.l2_model: M3's decode streams 128 x 8192 keys once; its 4096-token causal
    prefill has 128 row tiles of 32 tokens (128 packed rows at group 4) per KV head, tile
    t reading keys [0, 32 (t + 1)): 32 x 128 x 129 / 2 keys over, against 4096 once."""
    from perf.experiments.l2_model import traffic

    t = traffic(W.M3)
    per_key = 8 * 128 * 2 * 2
    assert t["decode"] == 128 * 8192 * per_key
    assert t["prefill_once"] == 4096 * per_key
    assert t["prefill_tiles"] == 32 * 128 * 129 // 2 * per_key
    assert t["q_o"] == 2 * (4096 + 128) * 32 * 128 * 2
    # and the roofline's bytes are the once line (perf.workloads.bytes_moved)
    assert W.bytes_moved(W.M3) == t["decode"] + t["prefill_once"] + t["q_o"]
