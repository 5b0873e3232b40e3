"""Model (CPU only): a mixed batch's HBM traffic when its prefill K/V stays in L2 and when
every prefill row tile re-reads it from HBM, against the fused times measured on the H200.

A prefill request's K/V is read by each of its row tiles (128 packed rows: 32 tokens at
GQA group 4, each tile up to its causal diagonal), so the kernels read it about
q_len / 32 / 2 times over. Alone (F1, a prefill part) those re-reads hit L2 (ncu: DRAM 6 %
busy on F1). Beside 128 decode requests streaming their K/V once, they need not: between
two reads of a prefill line the decode stream passes tens of MB through the 50 MB L2. The
model prices the batch at the copy bandwidth both ways:

    once:     (decode K/V + prefill K/V once + Q and O) / bandwidth   (the roofline)
    all-miss: (decode K/V + every prefill tile's K/V reads + Q and O) / bandwidth

and prints them beside the measured fused times of both kernels (`MEASURED`). The
measured times sat on the all-miss line (2026-12-05, docs/notes/l2-hint.md), which led to
KernelConfig.decode_kv_evict_first, predicted to move the fused time from the all-miss line
towards the once line; the last column is the H200's answer (ef98a47, 2026-12-05): the
sm_90a kernel's times fell 8-15 %, the portable kernel's 0-6 %.

    python -m perf.experiments.l2_model
"""
from perf import workloads as W

TILE_ROWS = 128  # packed rows of a prefill item (both kernels at D 128)
COPY_TB_S = 4.27  # the H200's copy bandwidth, read + write (perf.bench, 2026-12-05, 362073a)
# Fused GPU ms at page 16 on the H200: the portable kernel (PODCUTE_ARCH=sm_90, planner
# as on main 0779876, `perf.experiments.exp_parts --variant blockidx`, 2026-12-05) and the
# sm_90a kernel (perf/results/bench.md, ab4499f).
MEASURED = {"M1": (0.323, 0.330), "M2": (0.780, 0.774), "M3": (1.205, 1.259),
            "M5": (0.421, 0.410), "P1": (0.728, 0.666)}
# The same with decode_kv_evict_first (main ef98a47, 2026-12-05, `perf.bench --quick`:
# perf/results/portable_sm90/bench.md and the sm_90a run beside it, docs/performance.md).
MEASURED_HINT = {"M1": (0.310, 0.302), "M2": (0.754, 0.655), "M3": (1.176, 1.128),
                 "M5": (0.418, 0.379), "P1": (0.683, 0.583)}


def traffic(w: W.Workload) -> dict:
    """Bytes of `w` (bf16) by kind: decode K/V, prefill K/V once and as every row tile
    reads it, Q and O."""
    group = w.num_qo_heads // w.num_kv_heads
    per_key = w.num_kv_heads * w.head_dim * W.ELEM_BYTES * 2  # K and V of every KV head
    out = dict(decode=0, prefill_once=0, prefill_tiles=0, q_o=0)
    tokens_per_tile = TILE_ROWS // group
    for q, kv in zip(w.q_lens, w.kv_lens):
        out["q_o"] += 2 * q * w.num_qo_heads * w.head_dim * W.ELEM_BYTES
        if q == 1:
            out["decode"] += kv * per_key
            continue
        out["prefill_once"] += kv * per_key
        for first in range(0, q, tokens_per_tile):
            last = kv - q + min(first + tokens_per_tile, q)  # the tile's causal diagonal
            out["prefill_tiles"] += (last if w.causal else kv) * per_key
    return out


def main() -> int:
    print("workload | decode GB | prefill K/V once MB / every tile GB | once ms | all-miss ms"
          " | measured portable / sm_90a ms | with the L2 hint")
    for w in W.MAIN:
        if w.name not in MEASURED:
            continue
        t = traffic(w)
        once = (t["decode"] + t["prefill_once"] + t["q_o"]) / COPY_TB_S / 1e9
        miss = (t["decode"] + t["prefill_tiles"] + t["q_o"]) / COPY_TB_S / 1e9
        portable, hopper = MEASURED[w.name]
        portable_h, hopper_h = MEASURED_HINT[w.name]
        print(f"{w.name} | {t['decode'] / 1e9:.2f} | {t['prefill_once'] / 1e6:.0f} / "
              f"{t['prefill_tiles'] / 1e9:.2f} | {once:.3f} | {miss:.3f} | "
              f"{portable:.3f} / {hopper:.3f} | {portable_h:.3f} / {hopper_h:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
