"""Experiment (issue 13): does grouping each CTA list by kind (even lists all prefill
items first, odd lists all decode items first; lists s and s + num_SMs share an SM) make
co-resident CTAs overlap prefill with decode? Same plan, same process: the fused launch
timed with the planner's list order, then with the work rows of every list regrouped on
the device (outputs must match bit for bit).

    [PODCUTE_ARCH=sm_90] python -m perf.experiments.exp_group_kinds [--page 16]

(They do not: the block scheduler pairs other CTAs, `perf.experiments.exp_sm_pairs`.
Since 76a7ad9 (2026-12-05) the planner groups a mixed batch's lists by kind itself for the
warp-level kernel on chips short of HBM bandwidth per SM (an H100), so there both orders
here are the planner's; docs/notes/sm-pairing.md.)
"""

import argparse

import torch

from perf import workloads as W
from perf.timing import time_gpu
from podcute import PODAttention
from podcute.kernels.metadata import KIND_BITS, KIND_MASK, WorkCol
from podcute.testing import make_batch


def regroup(attn):
    plan, planner = attn.current_plan, attn.planner
    work = plan.work
    host = work.cpu().numpy().copy()
    ptr = planner._h["cta_ptr"][: planner.grid + 1].astype("int64")
    import numpy as np

    kind = host[:, WorkCol.KIND] & KIND_MASK
    lst = np.repeat(np.arange(planner.grid), np.diff(ptr))
    odd = planner._odd[lst]
    order = np.lexsort((np.arange(kind.size), kind ^ odd, lst))
    host = host[order]
    kind = host[:, WorkCol.KIND] & KIND_MASK
    dec = kind == 1
    before = np.zeros(kind.size + 1, dtype=np.int64)
    np.cumsum(dec, out=before[1:])
    ordinal = before[:-1] - np.repeat(before[ptr[:-1]], np.diff(ptr))
    host[:, WorkCol.KIND] = kind | np.where(dec, ordinal << KIND_BITS, 0)
    work.copy_(torch.from_numpy(host))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--only", default="M1,M2,M3,M5,P1")
    args = p.parse_args()
    for w in W.MAIN:
        if w.name not in args.only.split(","):
            continue
        b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                       num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=args.page,
                       device="cuda", pool_factor=1.1, garbage=0.0)
        attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, args.page,
                            device="cuda", max_batch_size=w.batch_size,
                            max_num_tokens=w.total_q)
        attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal)
        out = torch.empty_like(b.q)
        res = {}
        for label in ("planned", "grouped"):
            if label == "grouped":
                ref = out.clone()
                regroup(attn)
            t = time_gpu(lambda i: attn.run(b.q, b.k_cache, b.v_cache, out=out), reps=30)
            res[label] = t.ms
        same = torch.equal(out, ref)
        print(f"{w.name} page {args.page} {attn.arch} ctas/SM {attn.planner.config.kernel.ctas_per_sm}: "
              f"planned {res['planned']:.3f} ms, grouped {res['grouped']:.3f} ms "
              f"({res['planned'] / res['grouped']:.3f}x), same output {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
