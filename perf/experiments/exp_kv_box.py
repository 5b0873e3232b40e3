"""Experiment (issue 44, item 4): does a 16-token page lose prefill speed to its TMA boxes?

The sm_90a kernel loads pages of 16..64 tokens as 16-row TMA boxes (a K/V tile of 64 or
128 tokens = 4 or 8 boxes per swizzle-atom column block: 16 issues a tile at D 256) and
pages of 1..8 tokens by the producer warpgroup's cp.async row gather. F1 at page 16 ran
0.86 of its page-128 speed at D 256 and 0.89 at D 80, where FA4 (which gathers small pages
by cp.async) runs its page 16 as fast as its page 128 at D 256. This times a workload at
page 16 with the boxes (the shipped variant) and with the gather variant forced (the
page-class choice of `KernelConfig.select` patched to pages of 1..8), beside page 128, in
one run, each checked against the reference:

    python -m perf.experiments.exp_kv_box [--workload F1] [--head-dims 256:16/8,80,128]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from perf import workloads as W
from perf.bench import measure_ceilings
from perf.timing import time_gpu
from podcute.testing import selecting


def page_class(gather: bool):
    """With `gather`, every variant podcute selects takes the cp.async row gather, as for
    pages of 1..8 tokens (the kernel reads any page size that way)."""
    if not gather:
        return contextlib.nullcontext()

    def as_gathered(select, bound):
        bound.arguments["page_size"] = 1
        return select(*bound.args, **bound.kwargs)

    return selecting(as_gathered)


def run_one(w: W.Workload, page: int, gather: bool, reps: int) -> tuple:
    """(ms, rel L2 of out, kv_box of the variant that ran)."""
    from podcute import PODAttention
    from podcute.testing import make_batch

    b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                   num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                   device="cuda", pool_factor=1.1, garbage=0.0, seed=1)
    with page_class(gather):
        att = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                           max_batch_size=w.batch_size, max_num_tokens=w.total_q)
        att.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal)
        out = torch.empty_like(b.q)
        out.fill_(float("nan"))
        att.run(b.q, b.k_cache, b.v_cache, out=out)
        ref = b.reference(causal=w.causal)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        t = time_gpu(lambda i: att.run(b.q, b.k_cache, b.v_cache, out=out), reps=reps).ms
        box = att.planner.config.kernel.kv_box
    return t, err, box


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="F1")
    p.add_argument("--head-dims", default="256:16/8,80,128",
                   help="comma-separated D or D:HQ/HKV")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    base = next(x for x in W.MAIN + W.EXTRA if x.name == args.workload)
    ceil = measure_ceilings()
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    print("| workload | head dim | heads | page | loads | ms | page-128 ms / ms | rel L2 |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.head_dims.split(","):
        d, _, heads = spec.partition(":")
        hq, hkv = (int(x) for x in heads.split("/")) if heads else (None, None)
        w = W.with_overrides(base, head_dim=int(d), num_qo_heads=hq, num_kv_heads=hkv)
        rows = [(128, False), (16, False), (16, True)]
        results = [run_one(w, page, gather, args.reps) for page, gather in rows]
        t128 = results[0][0]
        for (page, _), (t, err, box) in zip(rows, results):
            loads = f"TMA {box}-row boxes" if box else "cp.async gather"
            print(f"| {w.name} | {w.head_dim} | {w.num_qo_heads}/{w.num_kv_heads} | {page} "
                  f"| {loads} | {t:.3f} | {t128 / t:.2f} | {err:.1e} |", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
