"""Benchmark workloads (the performance issue's M1-M5, P1, D1, F1 and the sweep) and the
roofline of a batch. Pure Python: importable and testable on a CPU-only machine.

Roofline of a batch = max(FLOPs / matmul rate, bytes / copy bandwidth), with the two rates
measured on the GPU in the same run (perf.bench) and

- FLOPs = 4 * Hq * D * (visible query-key pairs): QK^T and PV, 2 FLOPs per multiply-add;
  with `causal` a query at position p = kv_len - q_len + j (bottom-right alignment, as
  docs/contract.md) sees keys 0..p; with a sliding window (`window_left` = L >= 0, i.e.
  window_size=(L, 0) in FlashAttention's convention) only keys max(0, p - L)..p;
- bytes = Q read + O written (total_q * Hq * D each) + K and V read once per KV head of
  each request (Hkv * D each per key), in the element size of the inputs. Only the keys
  some query of the request sees are counted: its kv_len tokens (not the unused tail of
  its last page), and under a window only [max(0, kv_len - q_len - L), kv_len). So the
  roofline is a lower bound on any kernel's time. Soft-capping and sinks add no matmul
  FLOPs and (sinks: 4 bytes per query head) next to nothing to the bytes; not counted.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

ELEM_BYTES = 2  # bf16
HEAD_DIM = 128
PAGE_SIZES = (16, 128)

# Targets from the performance issue.
MIXED_MAX_ROOFLINE_RATIO = 1.25  # M1-M5, P1 (page 16 and 128): fused time <= 1.25 x roofline
DECODE_MIN_ROOFLINE_FRACTION = 0.90  # D1: roofline / fused time >= 0.90
SERIAL_MIN_SPEEDUP_GEOMEAN = 1.25  # M1-M5: geomean of serial / fused >= 1.25
MIXED = ("M1", "M2", "M3", "M4", "M5", "P1", "PH1")
SERIAL_TARGET_SET = ("M1", "M2", "M3", "M4", "M5")


@dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple
    kv_lens: tuple
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = HEAD_DIM
    causal: bool = True
    # Requests [0, num_prefill) are the prefill part and the rest the decode part, so
    # each part is a contiguous slice of q / out (the serial and two-call variants).
    # None when the order is shuffled (no contiguous split).
    num_prefill: int | None = 0
    kind: str = "mixed"  # "mixed", "decode", "prefill" or "sweep"
    params: dict = field(default_factory=dict, compare=False)  # sweep coordinates
    # Sliding window: a query at position p sees keys >= p - window_left (FlashAttention's
    # window_size=(window_left, 0) with causal); -1 = unbounded.
    window_left: int = -1
    # The value head dim (V and out rows) where it differs from head_dim (DeepSeek's
    # prefill: 192 / 128); None: head_dim.
    head_dim_vo: int | None = None

    @property
    def vo_dim(self) -> int:
        return self.head_dim if self.head_dim_vo is None else self.head_dim_vo

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def has_split(self) -> bool:
        """True when the batch has a prefill part and a decode part to run separately."""
        return self.num_prefill is not None and 0 < self.num_prefill < self.batch_size


def mixed(name, prefills, num_decodes, decode_ctx, *, num_qo_heads=32, num_kv_heads=8,
          kind="mixed", params=None) -> Workload:
    """Prefill requests `prefills` = [(q_len, kv_len), ...] first, then `num_decodes`
    decodes (q_len 1) of `decode_ctx` KV tokens each."""
    q_lens = tuple(q for q, _ in prefills) + (1,) * num_decodes
    kv_lens = tuple(kv for _, kv in prefills) + (decode_ctx,) * num_decodes
    return Workload(name, q_lens, kv_lens, num_qo_heads, num_kv_heads,
                    num_prefill=len(prefills), kind=kind, params=dict(params or {}))


def shuffled(w: Workload, name: str, seed: int = 0) -> Workload:
    """`w` with its requests in a random (fixed) order."""
    order = list(range(w.batch_size))
    random.Random(seed).shuffle(order)
    return replace(w, name=name, q_lens=tuple(w.q_lens[i] for i in order),
                   kv_lens=tuple(w.kv_lens[i] for i in order), num_prefill=None,
                   params=dict(w.params, shuffled_from=w.name))


def with_overrides(w: Workload, *, head_dim: int | None = None, num_qo_heads: int | None = None,
                   num_kv_heads: int | None = None, window_left: int | None = None,
                   head_dim_vo: int | None = None) -> Workload:
    """`w` with its head_dim / heads / window / value head dim replaced (None: keep `w`'s).
    The lengths, order and name stay, so results of a run with overrides line up with the
    default's."""
    hq = w.num_qo_heads if num_qo_heads is None else int(num_qo_heads)
    hkv = w.num_kv_heads if num_kv_heads is None else int(num_kv_heads)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"num_qo_heads ({hq}) must be a positive multiple of "
                         f"num_kv_heads ({hkv})")
    d = w.head_dim if head_dim is None else int(head_dim)
    if d < 1:
        raise ValueError(f"head_dim must be positive, got {d}")
    left = w.window_left if window_left is None else int(window_left)
    if left < -1:
        raise ValueError(f"window_left must be >= 0 or -1 (unbounded), got {left}")
    dv = w.head_dim_vo if head_dim_vo is None else int(head_dim_vo)
    return replace(w, head_dim=d, num_qo_heads=hq, num_kv_heads=hkv, window_left=left,
                   head_dim_vo=None if dv == d else dv, params=dict(w.params))


K = 1024
M1 = mixed("M1", [(2048, 2048)], 128, 2048)
M2 = mixed("M2", [(4096, 4096)], 128, 4096)
M3 = mixed("M3", [(4096, 4096)], 128, 8192)
M4 = mixed("M4", [(6000, 7000)], 128, 8192)
M5 = mixed("M5", [(2048, 2048)] * 2, 128, 2048)
P1 = mixed("P1", [(1024, 12288)], 80, 12288, num_qo_heads=16, num_kv_heads=4)
D1 = mixed("D1", [], 256, 4096, kind="decode")
F1 = mixed("F1", [(8192, 8192)], 0, 0, kind="prefill")
M1_SHUFFLED = shuffled(M1, "M1-shuf")


def prefill_heavy(name: str = "PH1", seed: int = 3) -> Workload:
    """A chunked-prefill engine's prefill-bound step (issue 44's own mix): prefills of
    mixed lengths (a fresh prompt, a long chunk at an offset, a short one) and 96 decodes
    of ragged contexts (256..8192 keys), in one fixed shuffled order, so neither the
    planner nor a peer sees the kinds sorted. No contiguous split: no serial column."""
    rng = random.Random(seed)
    prefills = [(1500, 1500), (6000, 6000), (2048, 7168), (700, 3000)]
    decodes = [(1, rng.randint(256, 8192)) for _ in range(96)]
    reqs = prefills + decodes
    rng.shuffle(reqs)
    return Workload(name, tuple(q for q, _ in reqs), tuple(kv for _, kv in reqs),
                    num_prefill=None, params=dict(prefill_heavy=True))


PH1 = prefill_heavy()

MAIN = (M1, M2, M3, M4, M5, P1, D1, F1)
QUICK_MAIN = (M1, D1, F1)
# Workloads without FlashInfer anchors, beside MAIN in a full run (M1-shuf at the first
# page size only).
EXTRA = (M1_SHUFFLED, PH1)

SWEEP_CHUNKS = (512, 1 * K, 2 * K, 4 * K, 8 * K)
SWEEP_BATCHES = (16, 64, 128, 256)
SWEEP_CTXS = (1 * K, 4 * K, 16 * K)
QUICK_SWEEP = ((1 * K, 4 * K), (16, 128), (4 * K,))


def sweep(chunks=SWEEP_CHUNKS, batches=SWEEP_BATCHES, ctxs=SWEEP_CTXS) -> list:
    """One prefill chunk (q = kv = chunk) + `batch` decodes at `ctx`, for every combination."""
    return [
        mixed(f"S{c}+{b}@{x}", [(c, c)], b, x, kind="sweep",
              params=dict(chunk=c, batch=b, ctx=x))
        for c in chunks for x in ctxs for b in batches
    ]


def workloads(quick: bool = False) -> tuple:
    """(main workloads, page sizes, sweep workloads) of a full or a --quick run."""
    if quick:
        return QUICK_MAIN + (M1_SHUFFLED,), (16,), sweep(*QUICK_SWEEP)
    return MAIN + EXTRA, PAGE_SIZES, sweep()


# --------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------


def _sum_min(lo: int, hi: int, cap: int) -> int:
    """sum(min(n, cap) for n in range(lo, hi + 1)), for 1 <= lo and cap >= 1 (0 if empty)."""
    def s(n):  # sum over 1..n
        return n * (n + 1) // 2 if n <= cap else cap * (cap + 1) // 2 + (n - cap) * cap
    return s(hi) - s(lo - 1) if hi >= lo else 0


def visible_pairs(q_len: int, kv_len: int, causal: bool = True, window_left: int = -1) -> int:
    """Query-key pairs one request computes. Query j sits at p = kv_len - q_len + j
    (bottom-right). Causal: it sees keys max(0, p - window_left)..p, i.e.
    min(p + 1, window_left + 1) keys (p + 1 unbounded; none when p < 0); without a window,
    with k = min(q_len, kv_len) that sums to k * (kv_len - k) + k * (k + 1) / 2.
    Not causal: keys max(0, p - window_left)..kv_len - 1."""
    if window_left < 0:
        if not causal:
            return q_len * kv_len
        k = min(q_len, kv_len)
        return k * (kv_len - k) + k * (k + 1) // 2
    if causal:
        # rows with p >= 0 are p = kv_len - k .. kv_len - 1: n = p + 1 = kv_len - k + 1 .. kv_len
        k = min(q_len, kv_len)
        return _sum_min(kv_len - k + 1, kv_len, window_left + 1)
    return sum(kv_len - min(kv_len, max(0, kv_len - q_len + j - window_left))
               for j in range(q_len))


def seen_keys(q_len: int, kv_len: int, window_left: int = -1) -> int:
    """Keys that some query of one request sees (their K/V is read): all kv_len of them,
    or under a window [max(0, kv_len - q_len - window_left), kv_len); none if q_len is 0."""
    if q_len <= 0 or kv_len <= 0:
        return 0
    if window_left < 0:
        return kv_len
    return kv_len - max(0, kv_len - q_len - window_left)


def flops(w: Workload) -> int:
    pairs = sum(visible_pairs(q, kv, w.causal, w.window_left)
                for q, kv in zip(w.q_lens, w.kv_lens))
    return 2 * w.num_qo_heads * (w.head_dim + w.vo_dim) * pairs  # Q K^T, then P V


def bytes_moved(w: Workload, elem_bytes: int = ELEM_BYTES,
                kv_elem_bytes: int | None = None) -> int:
    """Q and O at `elem_bytes` an element, the K/V each request sees at `kv_elem_bytes`
    (default the same; 1 for an fp8 cache)."""
    qo = w.total_q * w.num_qo_heads * (w.head_dim + w.vo_dim)
    keys = sum(seen_keys(q, kv, w.window_left) for q, kv in zip(w.q_lens, w.kv_lens))
    kv = keys * w.num_kv_heads * (w.head_dim + w.vo_dim)
    return qo * elem_bytes + kv * (elem_bytes if kv_elem_bytes is None else kv_elem_bytes)


def roofline_s(w: Workload, matmul_flops_per_s: float, copy_bytes_per_s: float) -> float:
    return max(flops(w) / matmul_flops_per_s, bytes_moved(w) / copy_bytes_per_s)


def bound(w: Workload, matmul_flops_per_s: float, copy_bytes_per_s: float) -> str:
    """"compute" or "memory": which term of the roofline is larger."""
    c, m = flops(w) / matmul_flops_per_s, bytes_moved(w) / copy_bytes_per_s
    return "compute" if c >= m else "memory"


def geomean(xs) -> float:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


# --------------------------------------------------------------------------------------
# Reference anchors: GPU ms measured earlier on the same H200 (page 16 unless noted).
# FlashInfer cannot run in the benchmark environment; its numbers are shown beside the
# FA4 numbers of the same earlier run so they can be rescaled to this run.
# --------------------------------------------------------------------------------------

ANCHOR_ROOFLINE_MS = {"M1": 0.264, "M2": 0.528, "M3": 1.036, "M4": 1.046, "M5": 0.274,
                      "P1": 0.484, "D1": 1.017, "F1": 0.73}
# Page 128: FlashInfer 0.7.2 BatchPOD as issue 9 recorded it (pages shuffled); scaled
# against the page-128 FA4 anchors below (within 1% of that day's FA4 where both exist).
ANCHOR_FLASHINFER_POD_MS = {16: {"M1": 0.336, "M2": 0.812, "M3": 1.153, "M4": 1.935,
                                 "M5": 0.441, "P1": 0.714},
                            128: {"M1": 0.326, "M2": 0.783, "M3": 1.114, "M4": 1.894,
                                  "M5": 0.428, "P1": 0.631}}
ANCHOR_FA4_MS = {
    16: {"M1": 0.382, "M2": 0.826, "M3": 1.372, "M4": 1.764, "M5": 0.454, "P1": 0.749,
         "D1": 1.180, "F1": 0.882},
    128: {"M1": 0.345, "M2": 0.738, "M3": 1.214, "M4": 1.564, "M5": 0.410, "P1": 0.652,
          "D1": 1.049, "F1": 0.801},
}


def anchors(name: str, page_size: int) -> dict:
    """Earlier-run numbers for workload `name` at `page_size` (None where not measured)."""
    return dict(
        roofline_ms=ANCHOR_ROOFLINE_MS.get(name),
        flashinfer_pod_ms=ANCHOR_FLASHINFER_POD_MS.get(page_size, {}).get(name),
        fa4_ms=ANCHOR_FA4_MS.get(page_size, {}).get(name),
    )
