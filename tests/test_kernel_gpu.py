"""GPU correctness of the fused kernel against podcute.reference (marker `gpu`).

Every case builds a hostile batch (NaN outside the pages in use, pools 3x the need,
random page permutations), poisons `out` with NaN, runs PODAttention and checks:
relative L2 error (bf16 <= 5e-3, fp16 <= 2e-3), |LSE - ref| <= 1e-3 with -inf exactly
where the reference has it, and that every output element was written.

Set PODCUTE_GPU_REPORT=path.json to get case counts and worst errors (docs/ records them).
"""

import os
import random

import pytest
import torch

from podcute import PODAttention
from podcute.kernels.config import arch_head_dims
from podcute.launch import requested_arch
from podcute.planning import H100_HBM_BYTES_PER_SM_CLOCK as H100_HBM, Planner
from podcute.reference import pod_attention_reference
from podcute.testing import (CHECK_DEFAULTS, EXTRA_FEATURE_CASES, FEATURE_CASES, HEAD_SIZE_CASES,
                             NUM_SPLIT_CASES,
                             RANDOM_FEATURE_PRESETS, RANDOM_FEATURE_SHAPES, WIDE_PAGES,
                             VALUE_HEAD_DIM_CASES, WIDE_SHAPES, handover_lengths, make_batch,
                             mixed_lengths)

pytestmark = pytest.mark.gpu

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
if not HAS_SM90:
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

# PODCUTE_ARCH=sm_90 runs the sweep on the portable (mma.sync) kernel; head dims it lacks
# are skipped.
ARCH = requested_arch(None) or "sm_90a"
TOL = {torch.bfloat16: 5e-3, torch.float16: 2e-3}
LSE_TOL = 1e-3
NUM_RANDOM = int(os.environ.get("PODCUTE_GPU_RANDOM", "200"))
NUM_WIDE = int(os.environ.get("PODCUTE_GPU_WIDE", "40"))
# First seed of every random sweep (mixed, wide, features, fp8): a new start draws batches
# no earlier run has seen.
SEED0 = int(os.environ.get("PODCUTE_GPU_SEED", "0"))
_report = {"cases": 0, "worst_rel_l2": {}, "worst_lse_abs": 0.0, "failures": []}


def _record(name, dtype, rel, lse_err):
    _report["cases"] += 1
    key = str(dtype).replace("torch.", "")
    _report["worst_rel_l2"][key] = max(_report["worst_rel_l2"].get(key, 0.0), rel)
    _report["worst_lse_abs"] = max(_report["worst_lse_abs"], lse_err)


_wrappers = {}


def _wrapper(hq, hkv, d, page, dtype, layout, dv=None):
    key = (hq, hkv, d, page, dtype, layout, dv)
    if key not in _wrappers:
        _wrappers[key] = PODAttention(hq, hkv, d, page, dtype=dtype, kv_layout=layout,
                                      device="cuda", max_batch_size=64, max_num_tokens=4096,
                                      head_dim_vo=dv)
    return _wrappers[key]


_D = CHECK_DEFAULTS  # (perf.warm_cache compiles the feature cases' variants from them)


def check(name, q_lens, kv_lens, *, hq=_D["hq"], hkv=_D["hkv"], d=_D["d"], page=_D["page"],
          dtype=_D["dtype"], layout="NHD", fmt="table", causal=_D["causal"], interleaved=False,
          strided_q=False, seed=0, pad_rows=0, window_size=_D["window_size"],
          softcap=_D["softcap"], sinks=_D["sinks"], batch_invariant=False, lse=True,
          planner_kw=None, dv=None):
    """One batch against the reference; `sinks` True draws random per-head sink logits;
    `dv`: a value head dim of its own (v_cache and out rows that wide);
    `lse` False runs the variant without LSE (only the output is compared); `planner_kw`:
    a wrapper of its own whose Planner gets these arguments (`num_sms`: a grid made for
    another chip; `hbm_bytes_per_sm_clock`: another chip's choice of SM pairs)."""
    if max(d, dv or d) > max(arch_head_dims(ARCH)):
        pytest.skip(f"head_dim {d} / {dv or d}: no {ARCH} kernel")
    b = make_batch(q_lens, kv_lens, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                   page_size=page, dtype=dtype, device="cuda", kv_layout=layout,
                   page_format=fmt, interleaved=interleaved, strided_q=strided_q, seed=seed,
                   head_dim_vo=dv)
    if not planner_kw:
        attn = _wrapper(hq, hkv, d, page, dtype, layout, dv)
    else:
        init = Planner.__init__
        Planner.__init__ = lambda self, *a, **kw: init(self, *a, **dict(kw, **planner_kw))
        try:
            attn = PODAttention(hq, hkv, d, page, dtype=dtype, kv_layout=layout,
                                device="cuda", max_batch_size=64, max_num_tokens=4096)
        finally:
            Planner.__init__ = init
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    pages = (dict(block_table=b.block_table) if fmt == "table"
             else dict(kv_indptr=b.kv_indptr, kv_indices=b.kv_indices))
    attn.plan(cu, kvl, causal=causal, window_size=window_size, softcap=softcap,
              batch_invariant=batch_invariant, **pages)
    sink_t = None
    if sinks:
        g = torch.Generator(device="cuda").manual_seed(seed + 7)
        sink_t = torch.randn(hq, generator=g, device="cuda") * 2.0
    q, n = b.q, b.q.shape[0]
    if pad_rows:  # an engine's padded token count: rows past cu_seqlens_q[-1]
        q = torch.cat([b.q, torch.full((pad_rows, *b.q.shape[1:]), float("nan"),
                                       dtype=dtype, device="cuda")])
    def run(out):
        res = attn.run(q, b.k_cache, b.v_cache, out=out, return_lse=lse, sinks=sink_t)
        return res if lse else (res, None)

    def poison():
        return torch.full((q.shape[0], hq, dv or d), float("nan"), dtype=dtype, device="cuda")

    out, lse_out = run(poison())
    # Again into fresh poison: split groups merge in-kernel behind per-group semaphores,
    # which must be back at zero for the next launch (and for CUDA-graph replays).
    again, lse_again = run(poison())
    ref, ref_lse = b.reference(causal=causal, return_lse=True, window_size=window_size,
                               softcap=softcap, sinks=sink_t)
    torch.cuda.synchronize()
    assert out[n:].isnan().all(), f"{name}: padding rows written"
    out, again = out[:n], again[:n]
    assert not out.isnan().any(), f"{name}: unwritten or NaN output"
    assert torch.equal(out, again), f"{name}: second run differs"
    assert not attn.current_plan.merge_sem.any(), f"{name}: merge semaphores not reset"
    rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    if not lse:
        _record(name, dtype, rel, 0.0)
        assert rel <= TOL[dtype], f"{name}: rel L2 {rel:.2e} > {TOL[dtype]:.0e}"
        return
    lse, lse_again = lse_out[:n], lse_again[:n]
    assert torch.equal(lse, lse_again), f"{name}: second run's LSE differs"
    inf_ref = torch.isinf(ref_lse)
    assert torch.equal(inf_ref, torch.isinf(lse)), f"{name}: -inf LSE rows differ"
    fin = ~inf_ref
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    _record(name, dtype, rel, lse_err)
    assert rel <= TOL[dtype], f"{name}: rel L2 {rel:.2e} > {TOL[dtype]:.0e}"
    assert lse_err <= LSE_TOL, f"{name}: LSE error {lse_err:.2e}"


MIXED = ([300, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 2000, 8])

# One case per value of every coverage axis (each compiles at most a few variants).
GRID = [
    dict(dtype=torch.bfloat16, d=128, page=16, hq=8, hkv=2),
    dict(dtype=torch.float16, d=128, page=16, hq=8, hkv=2),
    dict(dtype=torch.bfloat16, d=64, page=16, hq=8, hkv=2),
    dict(dtype=torch.float16, d=64, page=64, hq=8, hkv=8),
    dict(dtype=torch.bfloat16, d=128, page=1, hq=8, hkv=8),
    dict(dtype=torch.bfloat16, d=128, page=64, hq=28, hkv=4),  # G = 7
    dict(dtype=torch.bfloat16, d=128, page=128, hq=32, hkv=4),  # G = 8
    dict(dtype=torch.bfloat16, d=128, page=16, hq=32, hkv=1),  # MQA
    dict(dtype=torch.bfloat16, d=128, page=16, layout="HND"),
    dict(dtype=torch.bfloat16, d=128, page=16, fmt="csr"),
    dict(dtype=torch.bfloat16, d=128, page=16, interleaved=True, strided_q=True),
    dict(dtype=torch.bfloat16, d=128, page=16, causal=False),
    dict(dtype=torch.float16, d=64, page=1, layout="HND", fmt="csr", causal=False),
    dict(dtype=torch.bfloat16, d=64, page=128, layout="HND", interleaved=True),  # TMA, D 64
    dict(dtype=torch.float16, d=128, page=64, fmt="csr", causal=False),  # 16-slot boxes
    dict(dtype=torch.bfloat16, d=128, page=8, hq=16, hkv=2),  # gather, 64-token tiles
    dict(dtype=torch.float16, d=64, page=256, hq=8, hkv=1, layout="HND"),  # 2 tiles a page
    dict(dtype=torch.bfloat16, d=128, page=32, hq=28, hkv=4, interleaved=True),  # G 7, boxes
]


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_grid_mixed(cfg):
    check(f"grid {cfg}", *MIXED, **cfg)


@pytest.mark.parametrize("cfg", HEAD_SIZE_CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_head_dims_between_tiles(cfg):
    """Head dims engines ship between the compiled tiles (each on the next tile, its other
    columns zero): every page class, split KV (the 8000-token decode), CSR and HND."""
    check(f"head dim {cfg}", [300, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000, 8], **cfg)


@pytest.mark.parametrize("cfg", VALUE_HEAD_DIM_CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_value_head_dims(cfg):
    """A value head dim of its own (DeepSeek's prefill 192 / 128, narrower and wider
    values): V copied and out stored at their width, splits merged at it, every page
    class, CSR/HND, interleaved halves of a wider pool, with and without LSE."""
    check(f"value head dim {cfg}", [300, 1, 1, 5, 0, 1, 8], [700, 64, 1, 900, 17, 8000, 8],
          **cfg)


@pytest.mark.parametrize("order", ["prefill-only", "decode-only", "long-decode", "spec-decode"])
def test_batch_kinds(order):
    cases = {
        "prefill-only": ([1000, 513, 64], [1000, 2000, 64]),
        "decode-only": ([1] * 40, [random.Random(1).randint(1, 3000) for _ in range(40)]),
        "long-decode": ([1, 1, 1], [32768, 20000, 1]),
        "spec-decode": ([2, 3, 4, 5, 6, 7, 8], [9, 100, 1000, 4000, 17, 300, 8]),
    }
    check(order, *cases[order])


@pytest.mark.parametrize("sms", ["half", "odd", "more"])
def test_lists_on_other_sms(sms):
    """A grid planned for another SM count (the planner told the chip is an H100's, whose
    lists it groups by kind on any chip): with half the SMs, or more than the chip has,
    CTA c still runs list c, every list once."""
    chip = torch.cuda.get_device_properties(0).multi_processor_count
    n = {"half": chip // 2, "odd": chip // 2 + 1, "more": chip + 7}[sms]
    q_lens, kv_lens = [300, 1, 1, 5, 0, 1, 8] * 3, [700, 64, 1, 900, 17, 2000, 8] * 3
    check(f"{n} SMs planned", q_lens, kv_lens,
          planner_kw=dict(num_sms=n, hbm_bytes_per_sm_clock=H100_HBM))


@pytest.mark.parametrize("hq,hkv,page", [(64, 8, 16), (32, 8, 128), (64, 8, 1)])
def test_decode_handover_after_prefill(hq, hkv, page):
    """A CTA list's first decode item right after a prefill tile of warpgroup 0's rows
    (testing.handover_lengths; tests/test_plan.py checks the plans keep the transition):
    warpgroup 1 reaches the hand-over at once and must wait for warpgroup 0's O staging
    (the same shared memory). Before the fix every run of the (64, 8) batch differed."""
    q_lens, kv_lens = handover_lengths(16, 128, hq // hkv)
    check(f"handover {hq}/{hkv} p{page}", q_lens, kv_lens, hq=hq, hkv=hkv, page=page)


@pytest.mark.parametrize("hq,hkv,q_lens", [(32, 2, [1, 1, 2, 1]), (16, 2, [2, 3, 1, 2]),
                                           (4, 4, [16, 17, 15, 1])])
@pytest.mark.parametrize("features", [{}, dict(window_size=(700, 0), sinks=True, d=64),
                                      dict(softcap=20.0, sinks=True, d=96, page=1)])
def test_items_around_16_rows(hq, hkv, q_lens, features):
    """Items of at most 16 packed rows (GQA 16 x 1, 8 x 2, 1 x 16) split every KV tile over
    the warps by keys in the warp-level kernel and fold the warps at the end; 17 rows and up
    keep rows on warps. Both sides of the boundary, KV long enough for split-KV merges and
    short enough to leave warps without a key, with and without a window, sinks, soft cap."""
    check(f"16 rows {hq}/{hkv} {q_lens} {features}", q_lens, [30000, 700, 5000, 40],
          hq=hq, hkv=hkv, **features)


def test_kv_len_without_queries_attend_nothing():
    # Non-causal rows of a request with kv_len 0 see no key: output 0, LSE -inf.
    check("kv0", [3, 2], [0, 50], causal=False)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_RANDOM))
def test_random_mixed(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    q_lens, kv_lens = [], []
    for _ in range(n):
        kind = rng.random()
        kv = rng.choice([rng.randint(1, 300), rng.randint(1, 5000), rng.randint(1, 32768)])
        if kind < 0.15:
            q = 0
        elif kind < 0.7:
            q = min(kv, rng.choice([1, 1, 1, rng.randint(1, 8)]))
        elif kind < 0.93:
            q = min(kv, rng.randint(1, 1500))
        else:  # causal with more queries than keys: the first q - kv rows see nothing
            q = kv + rng.randint(1, 200)
        q_lens.append(q)
        kv_lens.append(kv)
    if sum(q_lens) == 0:
        q_lens[0] = 1
    check(f"random {seed}", q_lens, kv_lens, page=rng.choice([1, 8, 16, 32, 64, 128, 256]),
          fmt=rng.choice(["table", "csr"]), interleaved=rng.random() < 0.3,
          strided_q=rng.random() < 0.3, seed=seed, pad_rows=rng.choice([0, 0, 0, 7]),
          # half the batches planned as on an H100 (the warp-level kernel's SM pairs run
          # grouped lists, taken by %smid), half as on this chip
          planner_kw=dict(hbm_bytes_per_sm_clock=H100_HBM) if rng.random() < 0.5 else None)


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_WIDE))
def test_random_wide(seed):
    """Random shapes and variants beyond the default's: GQA 1/4/7/8, head dims 64/96/128,
    fp16, non-causal, no LSE, HND, CSR, every page class, padded and strided q."""
    rng = random.Random(10_000 + seed)
    hq, hkv, d = rng.choice(WIDE_SHAPES)
    causal = rng.random() < 0.6
    q_lens, kv_lens = mixed_lengths(rng, rng.randint(1, 20), causal,
                                    rng.choice([2000, 20000]))
    check(f"wide {seed}", q_lens, kv_lens, hq=hq, hkv=hkv, d=d,
          page=rng.choice(WIDE_PAGES), dtype=rng.choice([torch.bfloat16, torch.float16]),
          layout=rng.choice(["NHD", "HND"]), fmt=rng.choice(["table", "csr"]), causal=causal,
          interleaved=rng.random() < 0.3, strided_q=rng.random() < 0.3, seed=seed,
          pad_rows=rng.choice([0, 0, 5]), lse=rng.random() < 0.5)


# ---- model features: head_dim 96, sliding window, soft-capping, sinks ----------------

@pytest.mark.parametrize("cfg", FEATURE_CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_features_mixed(cfg):
    check(f"features {cfg}", *MIXED, **cfg)


@pytest.mark.parametrize("cfg", EXTRA_FEATURE_CASES[:NUM_SPLIT_CASES])
def test_features_split_kv(cfg):
    # Long decodes and a long prefill split their KV: partials never hold the sink, the
    # merge adds it once; the window bounds every split's range.
    check(f"split {cfg}", [1, 1, 2, 700], [32768, 20000, 9000, 30000], **cfg)


@pytest.mark.parametrize("page,hq,hkv", [(16, 32, 8), (128, 32, 4), (1, 16, 2)])
@pytest.mark.parametrize("sinks", [False, True])
def test_causal_with_more_queries_than_keys(page, hq, hkv, sinks):
    # Causal, bottom-right aligned as FlashAttention and FlashInfer: the first q_len - kv_len
    # rows of a request see no key (out 0, lse -inf or the sink), across prefill tiles
    # (300 / 100), inside decode items (2 / 1, 5 / 3), with no KV at all (4 / 0), beside
    # ordinary requests.
    check(f"causal q > kv p{page}", [300, 2, 1, 5, 4, 70], [100, 1, 900, 3, 0, 2000],
          page=page, hq=hq, hkv=hkv, causal=True, sinks=sinks)


def test_rows_that_see_nothing_get_the_sink():
    # Non-causal with a right edge and q_len > kv_len: early rows see no key (out 0,
    # lse = the sink's logit); kv_len 0 too.
    check("nothing", [3, 40, 2], [0, 10, 50], causal=False, window_size=(-1, 0), sinks=True)


NUM_FEATURE_RANDOM = int(os.environ.get("PODCUTE_GPU_FEATURE_RANDOM", "60"))


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + NUM_FEATURE_RANDOM))
def test_random_features(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 16)
    causal = rng.random() < 0.75
    q_lens, kv_lens = mixed_lengths(rng, n, causal, 20000)
    preset = dict(rng.choice(RANDOM_FEATURE_PRESETS[causal]))
    if "window_size" in preset:  # a random window of the preset's shape
        left, right = preset["window_size"]
        preset["window_size"] = (rng.choice([0, 16, 128, 700, 4096]) if left >= 0 else -1,
                                 rng.choice([0, 64]) if right >= 0 else -1)
    hq, hkv = rng.choice(RANDOM_FEATURE_SHAPES["heads"])
    check(f"random features {seed} {preset}", q_lens, kv_lens, hq=hq, hkv=hkv,
          d=rng.choice(RANDOM_FEATURE_SHAPES["head_dims"]),
          page=rng.choice(RANDOM_FEATURE_SHAPES["pages"]), causal=causal,
          fmt=rng.choice(["table", "csr"]), seed=seed, **preset)


# ---- batch invariance ---------------------------------------------------------------


def _build(reqs, page, hkv, d, dtype, gen):
    """Caches (NaN pool, pages in random order) and a block table for requests given as
    (q, k, v) tensors; returns (q, k_cache, v_cache, cu, kv_lens, block_table)."""
    n_pages = [-(-k.shape[0] // page) for _, k, _ in reqs]
    total = max(1, 2 * sum(n_pages))
    perm = torch.randperm(total, generator=gen, device="cuda")
    k_cache = torch.full((total, page, hkv, d), float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(len(reqs), max(1, max(n_pages)), dtype=torch.int32)
    at = 0
    for i, (_, k, v) in enumerate(reqs):
        pages = perm[at: at + n_pages[i]]
        at += n_pages[i]
        table[i, : n_pages[i]] = pages.cpu().to(torch.int32)
        for j, p in enumerate(pages.tolist()):
            n = min(page, k.shape[0] - j * page)
            k_cache[p, :n] = k[j * page: j * page + n]
            v_cache[p, :n] = v[j * page: j * page + n]
    q = torch.cat([q for q, _, _ in reqs])
    cu = torch.tensor([0] + [q.shape[0] for q, _, _ in reqs], dtype=torch.int32).cumsum(
        0, dtype=torch.int32)
    kvl = torch.tensor([k.shape[0] for _, k, _ in reqs], dtype=torch.int32)
    return q, k_cache, v_cache, cu, kvl, table


@pytest.mark.parametrize("page", [16, 128])
def test_batch_invariant_bitwise(page):
    """The same requests in >= 20 batches (other companions, orders, lengths, and a
    planner for another SM count) give bitwise-identical out and lse."""
    from podcute.planning import Planner

    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(page)

    def request(q_len, kv_len):
        return (torch.randn(q_len, hq, d, generator=gen, device="cuda", dtype=dtype),
                torch.randn(kv_len, hkv, d, generator=gen, device="cuda", dtype=dtype),
                torch.randn(kv_len, hkv, d, generator=gen, device="cuda", dtype=dtype))

    # A long prefill (split by the fixed size), a short one, a long decode (split), a
    # speculative decode, a plain decode.
    probes = [request(*s) for s in ((1500, 12000), (300, 300), (1, 30000), (4, 5000), (1, 77))]
    sinks = torch.randn(hq, generator=gen, device="cuda")
    seen = None
    rng = random.Random(page)
    for trial in range(22):
        companions = [request(rng.choice([1, 1, 3, rng.randint(1, 2000)]),
                              rng.randint(2000, 20000)) for _ in range(rng.randint(0, 12))]
        reqs = [(i, r) for i, r in enumerate(probes)] + [(None, r) for r in companions]
        rng.shuffle(reqs)
        q, k_cache, v_cache, cu, kvl, table = _build([r for _, r in reqs], page, hkv, d,
                                                       dtype, gen)
        attn = PODAttention(hq, hkv, d, page, dtype=dtype, device="cuda", max_batch_size=64,
                            max_num_tokens=32768)
        if trial % 3 == 2:  # another SM count: another grid
            attn.planner = Planner(hq, hkv, d, page, device="cuda", max_batch_size=64,
                                   max_num_tokens=32768, num_sms=rng.choice([7, 61, 100]),
                                   arch=attn.arch)
        attn.plan(cu, kvl, block_table=table, window_size=(4096, 0), batch_invariant=True)
        out = torch.full_like(q, float("nan"))
        out, lse = attn.run(q, k_cache, v_cache, out=out, return_lse=True, sinks=sinks)
        rows = {}
        for pos, (i, _) in enumerate(reqs):
            if i is not None:
                rows[i] = (out[cu[pos]: cu[pos + 1]].clone(), lse[cu[pos]: cu[pos + 1]].clone())
        if seen is None:
            seen = rows
            ref, ref_lse = pod_attention_reference(
                q, k_cache, v_cache, cu_seqlens_q=cu.cuda(), seqused_k=kvl.cuda(),
                block_table=table.cuda(), window_size=(4096, 0), sinks=sinks,
                return_lse=True)
            rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert rel <= TOL[dtype], f"invariant plan: rel L2 {rel:.2e}"
        for i, (o, l) in rows.items():
            assert torch.equal(o, seen[i][0]) and torch.equal(l, seen[i][1]), \
                f"trial {trial}: request {i}'s output changed with its batch"
