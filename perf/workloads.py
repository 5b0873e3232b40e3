"""Benchmark workloads (the performance issue's M1-M5, P1, D1, F1 and the sweep) and the
roofline of a batch. Pure Python: importable and testable on a CPU-only machine.

Roofline of a batch = max(FLOPs / matmul rate, bytes / copy bandwidth), with the two rates
measured on the GPU in the same run (perf.bench) and

- FLOPs = 4 * Hq * D * (visible query-key pairs): QK^T and PV, 2 FLOPs per multiply-add;
  with `causal` a query at position p = kv_len - q_len + j (bottom-right alignment, as
  docs/contract.md) sees keys 0..p;
- bytes = Q read + O written (total_q * Hq * D each) + K and V read once per KV head of
  each request (kv_len * Hkv * D each), in the element size of the inputs. Only the
  kv_len tokens a request uses are counted (not the unused tail of its last page), so the
  roofline is a lower bound on any kernel's time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

ELEM_BYTES = 2  # bf16
HEAD_DIM = 128
PAGE_SIZES = (16, 128)

# Targets from the performance issue.
MIXED_MAX_ROOFLINE_RATIO = 1.25  # M1-M5, P1 (page 16 and 128): fused time <= 1.25 x roofline
DECODE_MIN_ROOFLINE_FRACTION = 0.90  # D1: roofline / fused time >= 0.90
SERIAL_MIN_SPEEDUP_GEOMEAN = 1.25  # M1-M5: geomean of serial / fused >= 1.25
MIXED = ("M1", "M2", "M3", "M4", "M5", "P1")
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
    return Workload(name, tuple(w.q_lens[i] for i in order), tuple(w.kv_lens[i] for i in order),
                    w.num_qo_heads, w.num_kv_heads, w.head_dim, w.causal, num_prefill=None,
                    kind=w.kind, params=dict(w.params, shuffled_from=w.name))


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

MAIN = (M1, M2, M3, M4, M5, P1, D1, F1)
QUICK_MAIN = (M1, D1, F1)

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
    return MAIN + (M1_SHUFFLED,), PAGE_SIZES, sweep()


# --------------------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------------------


def visible_pairs(q_len: int, kv_len: int, causal: bool = True) -> int:
    """Query-key pairs one request computes. Causal, bottom-right: query j sees
    min(kv_len, max(0, kv_len - q_len + j + 1)) keys; with k = min(q_len, kv_len) that sums
    to k * (kv_len - k) + k * (k + 1) / 2."""
    if not causal:
        return q_len * kv_len
    k = min(q_len, kv_len)
    return k * (kv_len - k) + k * (k + 1) // 2


def flops(w: Workload) -> int:
    pairs = sum(visible_pairs(q, kv, w.causal) for q, kv in zip(w.q_lens, w.kv_lens))
    return 4 * w.num_qo_heads * w.head_dim * pairs


def bytes_moved(w: Workload, elem_bytes: int = ELEM_BYTES) -> int:
    qo = 2 * w.total_q * w.num_qo_heads * w.head_dim
    kv = 2 * sum(kv for q, kv in zip(w.q_lens, w.kv_lens) if q > 0) * w.num_kv_heads * w.head_dim
    return (qo + kv) * elem_bytes


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
