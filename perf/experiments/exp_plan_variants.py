"""Experiment (issue 13): how much the plan moves the fused time. The same batch planned
with the cost model's default and with its prefill MMA efficiency set to 0.3-0.55 (the
warp-level kernel's default is `CostModel.warp_mma_efficiency`), each timed in one
process, the default twice (first and last: the run-to-run spread); outputs compared
with the first plan's; "grouped" is `exp_group_kinds`' regrouping (2026-12-02:
even lists prefill items first, odd lists decode items first). `--set chunks` instead
pre-splits each kind into 2-4 pieces per CTA (`CostModel.chunks_per_cta`, default 1): a
finer interleave of the kinds in every list, for more partials and merges; `--set
coarse` the other way: every split piece and cut of at least 8, 16 or 32 us of work
(`CostModel.min_chunk_us`, default 4): fewer partials and merges.

    PODCUTE_ARCH=sm_90 python -m perf.experiments.exp_plan_variants [PAGE]
        [--set efficiency|chunks|coarse]
"""
import argparse
import dataclasses

import torch

from perf import workloads as W
from perf.experiments.exp_group_kinds import regroup
from perf.timing import time_gpu
import podcute.planning as P
from podcute import PODAttention
from podcute.testing import make_batch


def with_costs(**fields):
    """CostModel.for_kernel with the named CostModel fields replaced."""
    def for_kernel(self, kernel):
        return dataclasses.replace(ORIG_FOR_KERNEL(self, kernel), **fields)
    return for_kernel


ORIG_FOR_KERNEL = P.CostModel.for_kernel
VARIANT_SETS = {
    "efficiency": [("default", {}), ("grouped", {})]
    + [(f"eff{e}", dict(mma_efficiency=e)) for e in (0.3, 0.4, 0.45, 0.5, 0.55)]
    + [("default2", {})],
    "chunks": [("default", {})] + [(f"chunks{c}", dict(chunks_per_cta=c)) for c in (2, 3, 4)]
    + [("default2", {})],
    # fewer pieces: every split piece and cut >= 8 / 16 / 32 us of work
    "coarse": [("default", {})] + [(f"min{m}", dict(min_chunk_us=float(m))) for m in (8, 16, 32)]
    + [("default2", {})],
}
SWEEP = [W.mixed(f"S{c}+{n}@{x}", [(c, c)], n, x) for c, n, x in
         ((512, 64, 4096), (2048, 16, 16384), (8192, 256, 1024), (4096, 128, 4096),
          (1024, 256, 4096))]


def main(page: int, variants) -> int:
    for w in list(W.MAIN) + SWEEP:
        if w.kind in ("decode", "prefill"):
            continue
        b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                       num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                       device="cuda", pool_factor=1.1, garbage=0.0)
        ref, line = None, []
        for name, kw in variants:
            P.CostModel.for_kernel = with_costs(**kw)
            try:
                attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page,
                                    device="cuda", max_batch_size=w.batch_size,
                                    max_num_tokens=w.total_q)
                attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table,
                          causal=w.causal)
            finally:
                P.CostModel.for_kernel = ORIG_FOR_KERNEL
            if name == "grouped":
                regroup(attn)
            out = torch.empty_like(b.q)
            t = time_gpu(lambda i: attn.run(b.q, b.k_cache, b.v_cache, out=out), reps=30)
            if ref is None:
                ref = out.clone()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            line.append(f"{name} {t.ms:.3f}" + ("" if err < 5e-3 else f" ERR {err:.1e}"))
        print(w.name, f"p{page}", attn.arch, " | ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("page", nargs="?", type=int, default=16)
    p.add_argument("--set", choices=sorted(VARIANT_SETS), default="efficiency")
    args = p.parse_args()
    raise SystemExit(main(args.page, VARIANT_SETS[args.set]))
