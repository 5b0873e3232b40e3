"""Model (issue 13, CPU only): what the in-launch split merges cost the fused launch.

A merge runs in the CTA that finishes its group's last piece and is bound by the latency
of its loads (`split_merge.merge_group`): a pass of `rows_per_pass` rows waits a number
of dependent L2 round trips that depends on how the loads are ordered. This plans each
batch as the planner does (H200: 132 SMs, the warp-level kernel's plan for plain sm_90),
walks each CTA list in the model's predicted time to find which CTA merges each group,
and models a CTA's time as

    predicted list time + A_US x (merge round trips it waits) + PIECE_US x (its pieces)

and the launch as the slowest CTA (or SM, two CTAs an SM). A_US and PIECE_US were fitted
(least squares over relative error, a free scale per workload) to the fused times measured
on 2026-12-05 (main 4ddc0ad) with 1-4 pre-split pieces a list
(`perf.experiments.exp_plan_variants 16 --set chunks`, docs/notes/prefill-overlap.md),
where the cost model without merges predicts no change and the launch slowed by up to
30 %. `--fit` redoes the fit; by default the script predicts, from each workload's
measured default time, its time with the one-sweep merge (two splits' LSE and partials in
flight, `split_merge.COLS_PER_THREAD` columns a thread). Measured on the H200 (362073a and
94ded01, docs/notes/split-merge.md): the one sweep at 4 columns gained 1-4 %, about half
of what this model predicted for it; 8 columns a thread 0.3-2.8 % more.

    python -m perf.experiments.merge_model [--fit]
"""
import argparse
import dataclasses
import math

import numpy as np

from perf import workloads as W
from perf.experiments.exp_plan_variants import SWEEP
import podcute.planning as P
from podcute.kernels.metadata import MergeCol, WorkCol
from podcute.kernels.split_merge import COLS_PER_THREAD, SPLITS_IN_FLIGHT
from podcute.testing import make_batch

PAGE = 16
A_US, PIECE_US = 0.15, 0.25  # the fit (--fit): one L2 round trip, one piece's extra cost
# Rows a pass at D 128 on the warp kernel's 128 threads (128 / (128 / columns a thread),
# so the columns a thread): the two-pass merge of 4ddc0ad's times gave a thread 4.
ROWS_PER_PASS = {"two_pass": 4, "one_sweep": COLS_PER_THREAD}
# Fused GPU ms at page 16 with chunks_per_cta 1-4 (H200, PODCUTE_ARCH=sm_90, 4ddc0ad;
# chunks 1: the mean of its two runs).
MEASURED = {
    "M1": (0.345, 0.388, 0.431, 0.450), "M2": (0.845, 0.889, 0.932, 0.964),
    "M3": (1.332, 1.287, 1.373, 1.439), "M5": (0.453, 0.450, 0.532, 0.542),
    "P1": (0.792, 0.831, 0.875, 0.797), "S2048+16@16384": (0.368, 0.423, 0.475, 0.489),
    "S4096+128@4096": (0.835, 0.950, 1.013, 0.981)}


def round_trips(rows: int, splits: int, scheme: str) -> int:
    """Dependent L2 round trips of one merge: `two_pass` (before 362073a: each split's
    LSE for the maximum, then each split's LSE and partial, one split at a time, then
    the store), `one_sweep` (SPLITS_IN_FLIGHT splits' LSE and partials loaded together)."""
    passes = math.ceil(rows / ROWS_PER_PASS[scheme])
    if scheme == "two_pass":
        return passes * (2 * splits + 1)
    return passes * math.ceil(splits / SPLITS_IN_FLIGHT)


@dataclasses.dataclass
class PlanShape:
    list_us: np.ndarray  # the cost model's time of each CTA list
    pieces: np.ndarray  # work rows of each list
    merges: list  # (merging CTA, rows, splits) of each merge group
    num_sms: int

    @staticmethod
    def of(w, batch, **cost_fields) -> "PlanShape":
        cost = dataclasses.replace(P.DEFAULT_COST_MODEL, **cost_fields)
        planner = P.Planner(w.num_qo_heads, w.num_kv_heads, w.head_dim, PAGE, device="cpu",
                            max_batch_size=w.batch_size, max_num_tokens=w.total_q,
                            cost_model=cost, arch="sm_90")
        plan = planner.plan(batch.cu_seqlens_q, batch.seqused_k,
                            block_table=batch.block_table, causal=w.causal)
        grid = planner.grid
        ptr = plan.cta_ptr.numpy()[: grid + 1]
        cta = np.repeat(np.arange(grid), np.diff(ptr))
        item_us = plan.item_cost_us
        done_at = np.zeros(len(cta))  # each row's predicted finish within its list
        for c in range(grid):
            done_at[ptr[c]:ptr[c + 1]] = np.cumsum(item_us[ptr[c]:ptr[c + 1]])
        slot = plan.work.numpy()[:, WorkCol.SPLIT_SLOT]
        split_rows = np.nonzero(slot >= 0)[0]
        merge_of = plan.slot_merge.numpy()[slot[split_rows]]  # each split row's group
        merges = []
        for m, row in enumerate(plan.merge.numpy()):
            pieces = split_rows[merge_of == m]
            last = pieces[np.argmax(done_at[pieces])]
            merges.append((cta[last], int(row[MergeCol.ROW_END] - row[MergeCol.ROW_START]),
                           int(row[MergeCol.NUM_SPLITS])))
        return PlanShape(plan.cta_cost_us.copy(), np.bincount(cta, minlength=grid),
                         merges, planner.num_sms)

    def launch_us(self, scheme: str, a_us=A_US, piece_us=PIECE_US) -> float:
        waits = np.zeros(self.list_us.size)
        for c, rows, splits in self.merges:
            waits[c] += round_trips(rows, splits, scheme)
        t = self.list_us + a_us * waits + piece_us * self.pieces
        return float(max(t.max(), t.reshape(-1, self.num_sms).sum(0).max() / 2))


def workload(name):
    return next(w for w in list(W.MAIN) + SWEEP if w.name == name)


def batch_of(w):
    return make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                      num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=PAGE,
                      device="cpu", pool_factor=1.1, garbage=0.0)


def fit() -> None:
    shapes = {}
    for name in MEASURED:
        w = workload(name)
        b = batch_of(w)
        shapes[name] = [PlanShape.of(w, b, chunks_per_cta=c) for c in (1, 2, 3, 4)]

    def error(a_us, piece_us):
        err = 0.0
        for name, ts in MEASURED.items():
            m = np.array([s.launch_us("two_pass", a_us, piece_us) for s in shapes[name]])
            t = np.array(ts)
            scale = (m @ t) / (m @ m)
            err += float((((scale * m - t) / t) ** 2).sum())
        return err

    grid = [(a, p) for a in np.arange(0.0, 0.41, 0.025) for p in np.arange(0.0, 4.01, 0.25)]
    best = min(grid, key=lambda ap: error(*ap))
    n = sum(len(v) for v in MEASURED.values())
    print(f"fit: A_US {best[0]:.3f}, PIECE_US {best[1]:.2f}: rms relative error "
          f"{math.sqrt(error(*best) / n):.3f} (without merges or pieces: "
          f"{math.sqrt(error(0.0, 0.0) / n):.3f})")


def predict() -> None:
    print("workload | measured (merge as before) | modelled with the one-sweep merge")
    for name, ts in MEASURED.items():
        w = workload(name)
        shape = PlanShape.of(w, batch_of(w))
        before, now = shape.launch_us("two_pass"), shape.launch_us("one_sweep")
        print(f"{name} | {ts[0]:.3f} | {ts[0] * now / before:.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true", help="refit A_US and PIECE_US")
    fit() if ap.parse_args().fit else predict()
