"""Random paged batches for tests, the demo and benchmarks, built on any device.

The batch is hostile on purpose: every slot that holds no token (the tail of each
last page, pages nobody uses, the K/V columns next to a strided q) holds `garbage`
(NaN by default), and block-table entries past a request's pages point at all-garbage
pages, so a kernel that reads outside the contract produces NaN, not a plausible number.
"""

import contextlib
import dataclasses
import inspect
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from podcute.reference import pod_attention_reference

__all__ = ["Batch", "make_batch", "random_lengths"]


@dataclass(frozen=True)
class Batch:
    q: torch.Tensor  # [total_q, Hq, D]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D] (NHD) or [num_pages, Hkv, page_size, D]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    seqused_k: torch.Tensor  # int32 [B]
    block_table: torch.Tensor | None  # int32 [B, max_pages], page_format="table"
    kv_indptr: torch.Tensor | None  # int32 [B+1], page_format="csr"
    kv_indices: torch.Tensor | None  # int32 [num used pages]
    last_page_len: torch.Tensor  # int32 [B]; 0 for a request with kv_len 0
    kv_layout: str
    q_lens: tuple  # host copies, so callers need no device sync
    kv_lens: tuple
    sm_scale: float | None = None

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1 if self.kv_layout == "NHD" else 2]

    def kwargs(self) -> dict:
        """Keyword arguments that describe the pages and lengths (and layout, scale)."""
        kw = dict(
            cu_seqlens_q=self.cu_seqlens_q,
            seqused_k=self.seqused_k,
            kv_layout=self.kv_layout,
            sm_scale=self.sm_scale,
        )
        if self.block_table is not None:
            kw["block_table"] = self.block_table
        else:
            kw["kv_indptr"] = self.kv_indptr
            kw["kv_indices"] = self.kv_indices
        return kw

    def reference(self, causal=True, return_lse=False, **features):
        """The reference output (features: window_size, softcap, sinks)."""
        return pod_attention_reference(
            self.q,
            self.k_cache,
            self.v_cache,
            causal=causal,
            return_lse=return_lse,
            **features,
            **self.kwargs(),
        )


def make_batch(
    q_lens,
    kv_lens,
    *,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    page_size,
    dtype=torch.bfloat16,
    device="cpu",
    kv_layout="NHD",
    page_format="table",
    interleaved=False,
    strided_q=False,
    pool_factor=3.0,
    num_pages=None,
    garbage=float("nan"),
    sm_scale=None,
    seed=0,
    head_dim_vo=None,
) -> Batch:
    """A random batch: request i has q_lens[i] queries and kv_lens[i] KV tokens.

    The pool holds max(1, ceil(pool_factor x pages needed)) pages (or exactly `num_pages`,
    e.g. a fixed pool shared by the batches of one CUDA graph); requests get disjoint
    pages in a random order. Only token slots < kv_len of used pages hold data
    (standard normal); everything else holds `garbage`. Block-table entries past a
    request's pages are random pages that no request uses (all garbage), or 0 when the
    pool has no spare page (pool_factor <= 1). CSR lists exactly the needed pages.
    `interleaved`: k/v are the halves [:, 0], [:, 1] of one [num_pages, 2, ...] tensor.
    `strided_q`: q is qkv[:, :Hq] of a [total_q, Hq + 2 Hkv, D] tensor (rest garbage).
    `head_dim_vo`: V rows of that many columns (default head_dim); interleaved, both
    halves are the first columns of rows max(head_dim, head_dim_vo) wide.
    Deterministic for a given seed and device; the values of q, K, V and the page
    assignment do not depend on kv_layout, page_format, interleaved or strided_q, so
    those variants of one batch have the same reference output.
    """
    q_lens, kv_lens = [int(x) for x in q_lens], [int(x) for x in kv_lens]
    if len(q_lens) != len(kv_lens):
        raise ValueError("q_lens and kv_lens must have the same length")
    if min(q_lens + kv_lens, default=0) < 0:
        raise ValueError("lengths must be non-negative")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if page_format not in ("table", "csr"):
        raise ValueError(f"page_format must be 'table' or 'csr', got {page_format!r}")
    if num_qo_heads % num_kv_heads:
        raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    i32 = dict(dtype=torch.int32, device=device)
    b, hq, hkv, d, ps = len(q_lens), num_qo_heads, num_kv_heads, head_dim, page_size
    dv = d if head_dim_vo is None else int(head_dim_vo)

    n_pages = [-(-n // ps) for n in kv_lens]
    needed = sum(n_pages)
    if num_pages is None:
        num_pages = max(1, needed, math.ceil(pool_factor * needed))
    elif num_pages < max(1, needed):
        raise ValueError(f"num_pages={num_pages} < the {needed} pages the batch needs")
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    used, spare = perm[:needed], perm[needed:]

    # Token view [num_pages, page_size, Hkv, D] of each cache, whatever its layout.
    page_shape = (ps, hkv, max(d, dv)) if kv_layout == "NHD" else (hkv, ps, max(d, dv))
    if interleaved:
        pool = torch.full((num_pages, 2, *page_shape), garbage, dtype=dtype, device=device)
        k_cache, v_cache = pool[:, 0, ..., :d], pool[:, 1, ..., :dv]
    else:
        k_cache = torch.full((num_pages, *page_shape[:2], d), garbage, dtype=dtype,
                             device=device)
        v_cache = torch.full((num_pages, *page_shape[:2], dv), garbage, dtype=dtype,
                             device=device)

    # Where each KV token lives: (page, slot), computed for all tokens at once.
    kv_t = torch.tensor(kv_lens, dtype=torch.int64, device=device)
    total_kv = sum(kv_lens)
    req = torch.repeat_interleave(torch.arange(b, device=device), kv_t, output_size=total_kv)
    tok = torch.arange(total_kv, device=device) - (torch.cumsum(kv_t, 0) - kv_t)[req]
    page_base = torch.tensor([0] + n_pages[:-1], dtype=torch.int64, device=device).cumsum(0)
    page = used.long()[page_base[req] + tok // ps]
    slot = tok % ps
    for cache, cols in ((k_cache, d), (v_cache, dv)):
        tokens = cache if kv_layout == "NHD" else cache.transpose(1, 2)
        data = torch.randn(total_kv, hkv, cols, generator=gen, device=device, dtype=dtype)
        tokens[page, slot] = data

    total_q = sum(q_lens)
    q = torch.randn(total_q, hq, d, generator=gen, device=device, dtype=dtype)
    if strided_q:
        # The K/V columns of the fused tensor hold garbage: reading past Hq shows up.
        qkv = torch.full((total_q, hq + 2 * hkv, d), garbage, dtype=dtype, device=device)
        qkv[:, :hq] = q
        q = qkv[:, :hq]

    block_table = kv_indptr = kv_indices = None
    if page_format == "table":
        max_pages = max(1, max(n_pages, default=0))
        if spare.numel():
            pick = torch.randint(spare.numel(), (b, max_pages), generator=gen, device=device)
            block_table = spare[pick]
        else:
            block_table = torch.zeros(b, max_pages, **i32)
        rows = torch.repeat_interleave(
            torch.arange(b, device=device), torch.tensor(n_pages, device=device), output_size=needed
        )
        cols = torch.arange(needed, device=device) - page_base[rows]
        block_table[rows, cols] = used
    else:
        kv_indptr = torch.tensor([0] + n_pages, **i32).cumsum(0, dtype=torch.int32)
        kv_indices = used.clone()

    last = [n - (p - 1) * ps if p else 0 for n, p in zip(kv_lens, n_pages)]
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_seqlens_q=torch.tensor([0] + q_lens, **i32).cumsum(0, dtype=torch.int32),
        seqused_k=torch.tensor(kv_lens, **i32),
        block_table=block_table,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        last_page_len=torch.tensor(last, **i32),
        kv_layout=kv_layout,
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv_lens),
        sm_scale=sm_scale,
    )


def quantize_kv_cache(cache, kv_layout="NHD", dtype=torch.float8_e4m3fn, per_head=True):
    """An fp8 copy of a 16-bit KV cache and its dequantisation scale (tests, demo and
    benchmarks; engines write their own caches): scale = amax / the format's largest
    finite value, per KV head ([Hkv] float32) or per tensor ([] float32), over the finite
    values (garbage NaN stays NaN, so it still must not reach the output), and
    cache_fp8 = round(cache / scale), saturated. Dequantised: cache_fp8.float() * scale."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"dtype must be torch.float8_e4m3fn or float8_e5m2, got {dtype}")
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    fmax = torch.finfo(dtype).max
    x = cache.float()
    head_dim = 2 if kv_layout == "NHD" else 1
    finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros((), device=x.device))
    if per_head:
        dims = [d for d in range(x.dim()) if d != head_dim]
        amax = finite.amax(dim=dims)
        shape = [1] * x.dim()
        shape[head_dim] = -1
        view = amax.view(shape)
    else:
        amax = finite.amax()
        view = amax
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = torch.where(torch.isfinite(x), (x / torch.where(view > 0, view / fmax, 1.0)).clamp(
        -fmax, fmax), x)
    return q.to(dtype), scale.to(torch.float32)


def random_lengths(
    rng: random.Random, num_decode, num_prefill, *, max_kv_len, max_decode_q=1, max_prefill_q=None
):
    """(q_lens, kv_lens) of a shuffled mix of decode (q_len 1..max_decode_q) and
    prefill (q_len up to max_prefill_q, default the whole kv_len) requests, with
    q_len <= kv_len <= max_kv_len so the batch is valid for causal attention."""
    reqs = []
    for _ in range(num_decode):
        kv = rng.randint(1, max_kv_len)
        reqs.append((rng.randint(1, min(max_decode_q, kv)), kv))
    for _ in range(num_prefill):
        kv = rng.randint(1, max_kv_len)
        cap = kv if max_prefill_q is None else min(max_prefill_q, kv)
        reqs.append((rng.randint(1, cap), kv))
    rng.shuffle(reqs)
    return [r[0] for r in reqs], [r[1] for r in reqs]


def mixed_lengths(rng: random.Random, n: int, causal: bool, max_kv_len: int, decode_weight=2):
    """(q_lens, kv_lens) of n random requests for the GPU sweeps: KV lengths short, medium
    or up to max_kv_len; q_len 0, 1 (`decode_weight` shares), up to 8 or up to 1200,
    capped by kv_len under causal; at least one query in all."""
    q_lens, kv_lens = [], []
    for _ in range(n):
        kv = rng.choice([rng.randint(1, 300), rng.randint(1, 5000), rng.randint(1, max_kv_len)])
        q = rng.choice([0] + [1] * decode_weight + [rng.randint(1, 8), rng.randint(1, 1200)])
        q_lens.append(min(kv, q) if causal else q)
        kv_lens.append(kv)
    if sum(q_lens) == 0:
        q_lens[0] = 1
    return q_lens, kv_lens


def handover_lengths(num_prefill: int, num_decode: int, group: int, seed: int = 0):
    """(q_lens, kv_lens) of a shuffled batch that stresses the decode hand-over's first use
    in a CTA list: prefills of 192 packed rows (the last m-block's 64 rows are all MMA
    warpgroup 0's, so warpgroup 1 leaves that tile at once) and single-tile decodes
    (kv_len <= 128: warpgroup 1 has no KV tile and goes straight to the hand-over, whose
    scratch is warpgroup 0's O staging tile). `group`: query heads per KV head (8 or 4)."""
    rng = random.Random(seed)
    reqs = [(192 // group, rng.randint(192 // group, 400)) for _ in range(num_prefill)]
    reqs += [(1, rng.randint(1, 128)) for _ in range(num_decode)]
    rng.shuffle(reqs)
    return [r[0] for r in reqs], [r[1] for r in reqs]


def handover_transitions(plan) -> int:
    """CTA lists of `plan` in which a prefill item of at most 64 packed rows comes right
    before the list's first decode item (the case `handover_lengths` is built for)."""
    from podcute.kernels.metadata import KIND_BITS, KIND_MASK, Kind, WorkCol

    work = plan.work.cpu().numpy()
    kind = work[:, WorkCol.KIND]
    decode = (kind & KIND_MASK) == int(Kind.DECODE)
    small = (work[:, WorkCol.ROW_END] - work[:, WorkCol.ROW_START]) <= 64
    first_decode = decode & ((kind >> KIND_BITS) == 0)
    ptr = plan.cta_ptr.cpu().numpy()
    ends = np.zeros(len(work), dtype=bool)  # the last item of each list has no successor
    ends[ptr[1:][ptr[1:] > 0] - 1] = True
    hit = ~decode[:-1] & small[:-1] & first_decode[1:] & ~ends[:-1]
    return int(hit.sum())


# ---- the model-feature GPU cases (tests/test_kernel_gpu.py; perf.warm_cache compiles
# their variants ahead of a device run) ---------------------------------------------------

# tests/test_kernel_gpu.py check()'s defaults (its signature reads them from here): 8 query
# heads over 2 KV heads, head_dim 128, page 16, bf16, causal.
CHECK_DEFAULTS = dict(hq=8, hkv=2, d=128, page=16, dtype=torch.bfloat16, causal=True,
                      window_size=(-1, -1), softcap=0.0, sinks=False)

FEATURE_CASES = [
    # window (left, 0) with causal: shorter and longer than the requests
    dict(window_size=(0, 0)), dict(window_size=(1, -1)), dict(window_size=(37, 0)),
    dict(window_size=(128, 0), page=128), dict(window_size=(1000, 0), page=1),
    dict(window_size=(100000, 0)),
    # non-causal windows: both edges, right only, left only
    dict(causal=False, window_size=(100, 50)), dict(causal=False, window_size=(-1, 20)),
    dict(causal=False, window_size=(300, -1), page=128), dict(causal=False, window_size=(0, 0)),
    # soft cap, sinks, and together (with a window)
    dict(softcap=30.0), dict(softcap=5.0, sinks=True, page=128, hq=32, hkv=4),
    dict(sinks=True, page=1, hq=8, hkv=8), dict(sinks=True, causal=False),
    dict(softcap=20.0, sinks=True, window_size=(64, 0), page=32, hq=28, hkv=4),
    # head_dim 96 on every page class, and with every feature
    dict(d=96, page=16), dict(d=96, page=128, dtype=torch.float16), dict(d=96, page=1),
    dict(d=96, page=64, layout="HND", fmt="csr"), dict(d=96, page=8, hq=16, hkv=2),
    dict(d=96, page=256, hq=8, hkv=1), dict(d=96, page=32, causal=False, interleaved=True),
    dict(d=96, window_size=(200, 0), softcap=30.0, sinks=True),
    # head_dim 256 likewise (64-token tiles, 4-round decode combine, direct O stores)
    dict(d=256, page=16), dict(d=256, page=128, dtype=torch.float16), dict(d=256, page=1),
    dict(d=256, page=64, layout="HND", fmt="csr"), dict(d=256, page=8, hq=16, hkv=2),
    dict(d=256, page=256, hq=8, hkv=1), dict(d=256, page=32, causal=False, interleaved=True),
    dict(d=256, window_size=(200, 0), softcap=30.0, sinks=True, page=128),
    # GQA groups 1-8 and MQA with a window and sinks
    dict(hq=4, hkv=4, window_size=(256, 0), sinks=True),
    dict(hq=12, hkv=4, window_size=(256, 0), sinks=True),
    dict(hq=40, hkv=5, window_size=(256, 0), sinks=True, page=128),
    dict(hq=32, hkv=1, window_size=(256, 0), sinks=True),
    dict(d=64, window_size=(90, 0), softcap=10.0, page=1),
]

# Extra feature checks of the GPU tests (split KV, rows that see nothing, invariance).
EXTRA_FEATURE_CASES = [  # the first NUM_SPLIT_CASES: long decodes and prefills (split KV)
    dict(window_size=(500, 0), sinks=True), dict(sinks=True, softcap=15.0),
    dict(window_size=(3000, 0)), dict(d=256, sinks=True, page=128), dict(d=256, page=16),
    # head_dim 96 on TMA pages: long decodes alternate many tiles between the MMA
    # warpgroups (an odd stage count once let one run a barrier phase ahead)
    dict(d=96, page=128), dict(d=96, page=16, sinks=True),
    # the rest: rows that see nothing, batch invariance
    dict(causal=False, window_size=(-1, 0), sinks=True),
    dict(hq=32, hkv=8, window_size=(4096, 0), sinks=True),
    dict(hq=32, hkv=8, window_size=(4096, 0), sinks=True, page=128),
]

# Random feature tests draw one model's feature set (its window edges re-drawn): Gemma 2/3
# (window + soft cap, soft cap), gpt-oss (window + sinks, sinks), Mistral (window), none.
RANDOM_FEATURE_PRESETS = {
    True: [dict(window_size=(1, 0), softcap=30.0), dict(softcap=30.0),
           dict(window_size=(1, 0), sinks=True), dict(sinks=True), dict(window_size=(1, 0)),
           dict()],
    False: [dict(window_size=(1, 1)), dict(window_size=(1, -1)), dict(window_size=(-1, 1)),
            dict(sinks=True), dict()],
}
NUM_SPLIT_CASES = 7
RANDOM_FEATURE_SHAPES = dict(heads=[(8, 2), (32, 4)], head_dims=[96, 128, 256],
                             pages=[1, 16, 128])


def _select_kwargs(c: dict) -> dict:
    """KernelConfig.select keyword arguments of a GPU test case (its defaults merged in):
    the checks return the LSE; an fp8 case names its cache type in "kv"."""
    from podcute.planning import PlanOptions

    flags = PlanOptions.make(c["causal"], c["window_size"], c["softcap"]).kernel_flags()
    kw = dict(dtype=str(c["dtype"]).replace("torch.", ""), head_dim=c["d"],
              group=c["hq"] // c["hkv"], has_lse=True, page_size=c["page"],
              has_sinks=bool(c["sinks"]), **flags)
    if "kv" in c:
        kw["kv_dtype"] = str(FP8_KV[c["kv"]]).replace("torch.", "")
    return kw


# The wide random sweep (tests/test_kernel_gpu.py::test_random_wide): each seed draws a
# (query heads, KV heads, head_dim) shape, a dtype, causal or not, LSE or not, a layout,
# a page format and a page size; its lengths come from mixed_lengths.
WIDE_SHAPES = [(32, 8, 128), (28, 4, 128), (16, 16, 64), (64, 8, 128), (32, 4, 64),
               (40, 8, 96)]
WIDE_PAGES = [1, 2, 8, 16, 32, 64, 128, 256]


def wide_test_variants():
    """KernelConfig.select keyword arguments of every variant the wide sweep can draw."""
    return [_select_kwargs(dict(CHECK_DEFAULTS, hq=hq, hkv=hkv, d=d, page=page,
                                dtype=dtype, causal=causal)) | dict(has_lse=lse)
            for hq, hkv, d in WIDE_SHAPES for page in (1, 16, 128)
            for dtype in (torch.bfloat16, torch.float16) for causal in (True, False)
            for lse in (True, False)]


def head_size_test_variants():
    """KernelConfig.select keyword arguments of test_head_dims_between_tiles' variants."""
    return [_select_kwargs(dict(CHECK_DEFAULTS, **c)) for c in HEAD_SIZE_CASES]


def feature_test_variants():
    """KernelConfig.select keyword arguments of every variant the feature GPU tests run."""
    def variant(c):
        return _select_kwargs(dict(CHECK_DEFAULTS, **c))

    cases = list(FEATURE_CASES) + EXTRA_FEATURE_CASES
    for causal, presets in RANDOM_FEATURE_PRESETS.items():
        for preset in presets:
            for hq, hkv in RANDOM_FEATURE_SHAPES["heads"]:
                for d in RANDOM_FEATURE_SHAPES["head_dims"]:
                    for page in RANDOM_FEATURE_SHAPES["pages"]:
                        cases.append(dict(preset, causal=causal, hq=hq, hkv=hkv, d=d,
                                          page=page))
    return [variant(c) for c in cases]


# ---- the fp8 KV cache GPU cases (tests/test_fp8_gpu.py; perf.warm_cache compiles them) ----

# Head dims between the compiled tiles (tests/test_kernel_gpu.py::test_head_dims_between_tiles,
# perf.warm_cache): TMA boxes of 16 and whole tiles, the gather, D 256's tile half used,
# a column block never copied (160, 192 on the 256 tile), fp16, CSR/HND, non-causal.
HEAD_SIZE_CASES = [
    dict(d=80, page=16), dict(d=40, page=128, hq=16, hkv=2), dict(d=112, page=1, hq=32, hkv=8),
    dict(d=72, page=32, layout="HND", fmt="csr"), dict(d=160, page=16, hq=16, hkv=8),
    dict(d=192, page=1, hq=8, hkv=2, causal=False),
    dict(d=224, page=128, hq=16, hkv=2, dtype=torch.float16),
]

# A value head dim of its own (tests/test_kernel_gpu.py::test_value_head_dims): DeepSeek's
# prefill shape 192 / 128 (MHA and GQA) on each page class, values narrower and wider than
# the keys, interleaved halves of a wider pool, fp16, no LSE, and the model features.
VALUE_HEAD_DIM_CASES = [
    dict(d=192, dv=128, page=16, hq=16, hkv=2), dict(d=192, dv=128, page=128, hq=8, hkv=8),
    dict(d=192, dv=128, page=1, hq=8, hkv=2, causal=False),
    dict(d=128, dv=64, page=16), dict(d=64, dv=128, page=32, layout="HND", fmt="csr"),
    dict(d=128, dv=96, page=8, interleaved=True, dtype=torch.float16),
    dict(d=96, dv=40, page=128, lse=False), dict(d=256, dv=192, page=16, hq=8, hkv=1),
    dict(d=192, dv=128, page=16, window_size=(500, 0), softcap=30.0, sinks=True),
]

# check_fp8()'s defaults: an e4m3 cache with per-KV-head float32 scales, 8/2 heads, D 128,
# page 16, bf16 queries, causal.
FP8_DEFAULTS = dict(hq=8, hkv=2, d=128, page=16, dtype=torch.bfloat16, causal=True,
                    kv="e4m3", scale="per_head", window_size=(-1, -1), softcap=0.0,
                    sinks=False)
FP8_KV = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

FP8_CASES = [
    dict(), dict(dtype=torch.float16), dict(scale="float"), dict(scale="tensor"),
    # every page class, layout and page format
    dict(page=1), dict(page=8, hq=16, hkv=2), dict(page=64, layout="HND", fmt="csr"),
    dict(page=128), dict(page=256, hq=8, hkv=1, dtype=torch.float16),
    dict(page=32, interleaved=True, causal=False), dict(page=2, layout="HND", scale="float"),
    # head dims 64 and 96, GQA groups, e5m2
    dict(d=64), dict(d=64, page=1, dtype=torch.float16), dict(d=96, page=128),
    dict(d=96, page=1), dict(d=96, page=16, hq=28, hkv=4), dict(hq=32, hkv=4, page=128),
    dict(hq=32, hkv=1), dict(kv="e5m2"), dict(kv="e5m2", dtype=torch.float16, page=1),
    dict(kv="e5m2", d=64, page=128, scale="float"),
    # model features on an fp8 cache
    dict(window_size=(128, 0), softcap=30.0, sinks=True),
    dict(causal=False, window_size=(100, 50), page=128, sinks=True),
    dict(softcap=20.0, page=1, d=96),
    # head dim 256 (32-token tiles, Q converted in shared memory): every page class
    dict(d=256), dict(d=256, page=1, dtype=torch.float16), dict(d=256, page=128, kv="e5m2"),
    dict(d=256, page=32, hq=16, hkv=2, window_size=(96, 0), softcap=30.0, sinks=True),
    dict(d=256, page=4, layout="HND", fmt="csr", scale="float"),
]
# Long decodes and a long prefill: split KV and its in-kernel merge (scales per item).
FP8_SPLIT_CASES = [dict(), dict(page=128, scale="float"), dict(page=1, dtype=torch.float16),
                   dict(d=96, kv="e5m2", sinks=True), dict(d=64, page=64, scale="tensor"),
                   dict(d=256, page=16), dict(d=256, page=1, kv="e5m2")]
FP8_RANDOM_SHAPES = dict(heads=[(8, 2), (32, 4)], head_dims=[64, 96, 128, 256],
                         pages=[1, 16, 128])


def fp8_test_variants():
    """KernelConfig.select keyword arguments of every variant the fp8 GPU tests run."""
    cases = FP8_CASES + FP8_SPLIT_CASES + [
        dict(hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, causal=causal)
        for hq, hkv in FP8_RANDOM_SHAPES["heads"] for d in FP8_RANDOM_SHAPES["head_dims"]
        for page in FP8_RANDOM_SHAPES["pages"] for dtype in (torch.bfloat16, torch.float16)
        for causal in (True, False)]
    return [_select_kwargs(dict(FP8_DEFAULTS, **c)) for c in cases]


# KernelConfig flags a GPU run may switch for an A/B: with the variable set to 1 (0), the
# kernel tests, tests/gpu_sanitize.py, perf.warm_cache and perf.bench run every kernel with
# (without) the flag (`kernel_flags_from_env`); unset, as the variants choose.
KERNEL_FLAG_ENV = {
    "decode_kv_evict_first": "PODCUTE_TEST_DECODE_EVICT_FIRST",  # the L2 hint, shipped on
    "softmax_under_pv": "PODCUTE_TEST_SOFTMAX_UNDER_PV",  # shipped on at 128/256 columns
}
DECODE_EVICT_FIRST_ENV = KERNEL_FLAG_ENV["decode_kv_evict_first"]


@contextlib.contextmanager
def selecting(choose):
    """Inside, KernelConfig.select(...) is `choose(select, arguments)`: the shipped select
    and its arguments bound by name (`inspect.BoundArguments`, defaults applied), e.g. to
    change a flag of its result or one of its facts. How the GPU tests and the experiments
    run other variants than the shipped ones for an A/B."""
    from podcute.kernels.config import KernelConfig

    shipped = KernelConfig.__dict__["select"]
    signature = inspect.signature(shipped.__func__)

    def select(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return choose(shipped.__func__, bound)

    KernelConfig.select = staticmethod(select)
    try:
        yield
    finally:
        KernelConfig.select = shipped


def kernel_flags(**flags):
    """Inside, every kernel configuration chosen (KernelConfig.select) has these flags
    (e.g. decode_kv_evict_first=False): how the GPU tests and the experiments run the
    kernels with and without one for an A/B."""
    return selecting(lambda select, bound: dataclasses.replace(
        select(*bound.args, **bound.kwargs), **flags))


def decode_evict_first(on: bool = True):
    """`kernel_flags(decode_kv_evict_first=on)`: the L2 hint (shipped on) on or off."""
    return kernel_flags(decode_kv_evict_first=on)


def kernel_flag_env() -> dict:
    """The KERNEL_FLAG_ENV variables set in this process, by name (what a benchmark's
    report names as its side of an A/B)."""
    return {var: os.environ[var] for var in KERNEL_FLAG_ENV.values() if var in os.environ}


def kernel_flags_from_env():
    """`kernel_flags` of every KERNEL_FLAG_ENV variable set to 1 (on) or 0 (off); none
    set: nothing."""
    flags = {name: os.environ[var] == "1" for name, var in KERNEL_FLAG_ENV.items()
             if os.environ.get(var, "") in ("0", "1")}
    return kernel_flags(**flags) if flags else contextlib.nullcontext()


def make_shared_prefix_batch(rng: random.Random, *, num_qo_heads, num_kv_heads, head_dim,
                             page_size, num_groups=2, sharers=(2, 6), prefix_pages=(16, 40),
                             sub_share=0.5, own_tokens=(1, 200), spec=0.2, others=2,
                             dtype=torch.bfloat16, page_format="table", shuffle=True,
                             device="cpu", head_dim_vo=None):
    """A batch whose decode requests share leading pages: `num_groups` prefixes (each
    `prefix_pages` pages) with `sharers` requests each, some of them (`sub_share`)
    sharing a longer prefix with a neighbour (a second level), each with its own
    `own_tokens` more (the first own page may be partially filled), a few with 2-4 query
    tokens (speculative, `spec`), plus `others` requests that share nothing (one of them
    a prefill). Pages are random in a pool of random K/V; requests in a random order
    (`shuffle`). V rows have `head_dim_vo` columns (default head_dim). Returns a Batch
    (block table or CSR)."""
    Hq, Hkv, D, ps = num_qo_heads, num_kv_heads, head_dim, page_size
    next_page = [0]

    def pages(n):
        p = list(range(next_page[0], next_page[0] + n))
        next_page[0] += n
        return p

    reqs = []  # (q_len, page list, kv_len)
    for _ in range(num_groups):
        prefix = pages(rng.randint(*prefix_pages))
        n = rng.randint(*sharers)
        sub = None
        for i in range(n):
            pre = prefix
            if rng.random() < sub_share:
                if sub is None:
                    sub = prefix + pages(rng.randint(16, 24))
                pre = sub
            q = rng.randint(2, 4) if rng.random() < spec else 1
            own = rng.randint(*own_tokens) + q
            reqs.append((q, pre + pages(-(-own // ps)), len(pre) * ps + own))
    for j in range(others):
        q = 300 if j == 0 else 1
        kv = rng.randint(q, 2000)
        reqs.append((q, pages(-(-kv // ps)), kv))
    if shuffle:
        rng.shuffle(reqs)
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    num_pages = next_page[0] + 3
    k = torch.randn(num_pages, ps, Hkv, D, generator=g).to(dtype)
    v = torch.randn(num_pages, ps, Hkv, head_dim_vo or D, generator=g).to(dtype)
    q_lens = [r[0] for r in reqs]
    kv_lens = [r[2] for r in reqs]
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    need = [-(-kv // ps) for kv in kv_lens]
    table = indptr = indices = None
    if page_format == "table":
        width = max(len(r[1]) for r in reqs)
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, : len(r[1])] = torch.tensor(r[1], dtype=torch.int32)
    else:
        indptr = torch.tensor([0] + list(np.cumsum(need)), dtype=torch.int32)
        indices = torch.tensor([p for r, n in zip(reqs, need) for p in r[1][:n]],
                               dtype=torch.int32)
    last = torch.tensor([kv - (n - 1) * ps if n else 0 for kv, n in zip(kv_lens, need)],
                        dtype=torch.int32)
    dev = torch.device(device)

    def on(t):  # (index tensors beside the caches, as make_batch's)
        return None if t is None else t.to(dev)

    return Batch(q=q.to(dev), k_cache=k.to(dev), v_cache=v.to(dev), cu_seqlens_q=on(cu),
                 seqused_k=on(kvl), block_table=on(table), kv_indptr=on(indptr),
                 kv_indices=on(indices), last_page_len=on(last), kv_layout="NHD",
                 q_lens=tuple(q_lens), kv_lens=tuple(kv_lens))


def execute_plan(plan, q, k_cache, v_cache, sinks=None, softcap=0.0):
    """The kernel's contract over a plan's metadata, in float64 on the CPU (NHD caches):
    every work item attends its rows to its KV range and writes out/lse or partials, the
    split pieces count into their merges (feed rows into their sharers'), and every merge
    that completed combines its terms. Checks the counts as it goes. Returns (out, lse).
    For tests of the planner: a plan that passes this computes the batch's attention."""
    from podcute.kernels.metadata import (SHARE_FIELD_MASK, SHARE_OWN_BIT, SHARE_RANK_SHIFT,
                                          SHARE_ROW_SHIFT, IParam, MergeCol)
    buf = plan._buffers
    cfg = plan.config
    G, ps = cfg.group_size, cfg.page_size
    opts = plan.options
    work = buf["work"][: plan.num_items].cpu().numpy().astype(np.int64)
    merge = buf["merge"].cpu().numpy().astype(np.int64)
    slot_merge = buf["slot_merge"].cpu().numpy().astype(np.int64)
    qs_ = buf["q_start"].cpu().numpy().astype(np.int64)
    kvl_ = buf["kv_len"].cpu().numpy().astype(np.int64)
    pst_ = buf["page_start"].cpu().numpy().astype(np.int64)
    plist = buf["page_list"].cpu().numpy().astype(np.int64)
    shared = buf["shared"].cpu().numpy().astype(np.int64)
    vbase = int(buf["iparams"].cpu().numpy()[IParam.VIRTUAL_REQUESTS]) if plan.shares else 1 << 62
    scale = plan.sm_scale
    T, Hq, D = q.shape
    qd, kd, vd = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64)
    part_o, part_lse, counts = {}, {}, {}
    right = opts.right if opts.bounded_right else None

    def rows_of(req, r0, r1, h):
        qs, ql = qs_[req], qs_[req + 1] - qs_[req]
        tok = np.arange(r0, r1) // G
        heads = h * G + np.arange(r0, r1) % G
        qtok = shared[qs + tok] if req >= vbase else qs + tok
        return qtok, heads, tok, ql

    for i in range(work.shape[0]):
        req, h, r0, r1, ks, ke, slot, kind = (int(x) for x in work[i])
        qtok, heads, tok, ql = rows_of(req, r0, r1, h)
        kl = kvl_[req]
        keys = np.arange(ks, ke)
        pages = plist[pst_[req] + keys // ps]
        K = kd[pages, keys % ps, h]  # [n, D]
        V = vd[pages, keys % ps, h]
        Q = qd[qtok, heads]  # [r, D]
        s = (Q @ K.T) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.from_numpy(kl - ql + tok)[:, None]
        kk = torch.from_numpy(keys)[None, :]
        mask = torch.ones_like(s, dtype=torch.bool)
        if right is not None:
            mask &= kk <= pos + right
        if opts.window_left >= 0:
            mask &= kk >= pos - opts.window_left
        s = s.masked_fill(~mask, -math.inf)
        m = (s.max(dim=1, keepdim=True).values if s.shape[1]
             else torch.full((s.shape[0], 1), -math.inf, dtype=torch.float64))
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m_safe)
        l = p.sum(1, keepdim=True)
        o = (p @ V) / torch.where(l > 0, l, torch.ones_like(l))
        row_lse = torch.where(l[:, 0] > 0, m_safe[:, 0] + torch.log(l[:, 0]),
                              torch.full_like(l[:, 0], -math.inf))
        if slot < 0:
            if sinks is not None:
                sk = sinks[heads].double()
                new = torch.logaddexp(row_lse, sk)
                o = o * torch.exp(row_lse - new)[:, None]
                row_lse = new
            out[qtok, heads] = o
            lse[qtok, heads] = row_lse
            continue
        own = (kind >> SHARE_OWN_BIT) & 1
        row0 = ((kind >> SHARE_ROW_SHIFT) & SHARE_FIELD_MASK) if own else 0
        mrow = slot_merge[slot] + (((kind >> SHARE_RANK_SHIFT) & SHARE_FIELD_MASK) if own else 0)
        for j in range(r1 - r0):
            part_o[(slot, row0 + j)] = o[j]
            part_lse[(slot, row0 + j)] = row_lse[j]
        if plan.shares and merge[mrow, MergeCol.FEED_COUNT] > 0:
            f0, fc = merge[mrow, MergeCol.FEED_FIRST], merge[mrow, MergeCol.FEED_COUNT]
            for mm in range(f0, f0 + fc):
                counts[mm] = counts.get(mm, 0) + 1
        else:
            counts[mrow] = counts.get(mrow, 0) + 1
    for mm, c in counts.items():
        want = merge[mm, MergeCol.WAIT] if plan.shares else merge[mm, MergeCol.NUM_SPLITS]
        assert c == want, f"merge {mm}: {c} pieces counted, waits for {want}"
        req, h = merge[mm, MergeCol.REQ], merge[mm, MergeCol.KV_HEAD]
        rs, re_ = merge[mm, MergeCol.ROW_START], merge[mm, MergeCol.ROW_END]
        terms = []
        if plan.shares:
            tf, tc = merge[mm, MergeCol.TERMS_FIRST], merge[mm, MergeCol.TERMS_COUNT]
            terms = [(shared[tf + 2 * t], shared[tf + 2 * t + 1]) for t in range(tc)]
            own_row = merge[mm, MergeCol.OWN_ROW]
        else:
            own_row = 0
        f, ns = merge[mm, MergeCol.FIRST_SLOT], merge[mm, MergeCol.NUM_SPLITS]
        terms += [(f + s, own_row) for s in range(ns)]
        qtok, heads, _, _ = rows_of(req, rs, re_, h)
        for j in range(re_ - rs):
            ls = torch.stack([part_lse[(s, r + j)] for s, r in terms])
            os_ = torch.stack([part_o[(s, r + j)] for s, r in terms])
            if sinks is not None:
                ls = torch.cat([ls, sinks[heads[j]].double().reshape(1)])
                os_ = torch.cat([os_, torch.zeros(1, D, dtype=torch.float64)])
            mx = ls.max()
            if not torch.isfinite(mx):
                out[qtok[j], heads[j]] = 0
                lse[qtok[j], heads[j]] = -math.inf
                continue
            w = torch.exp(ls - mx)
            out[qtok[j], heads[j]] = (w[:, None] * os_).sum(0) / w.sum()
            lse[qtok[j], heads[j]] = mx + torch.log(w.sum())
    return out, lse
