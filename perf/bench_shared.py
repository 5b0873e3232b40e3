"""Shared-prefix benchmark: workloads S1-S3 with prefix sharing (the default plan) and
without (`share_prefixes=False`), against the roofline that counts every shared KV byte
once, all in one run.

    python -m perf.bench_shared [--out DIR] [--reps N] [--page 16]

- S1: 128 decodes sharing one 8192-token prefix, 256 own tokens each (32/8/128).
- S2: 8 groups of 32 decodes, each group sharing its own 4096-token prefix, 512 own each.
- S3: one 4096-token prefill (M3's) plus 128 decodes sharing a 4096-token prefix, 4096
  own each.

The roofline: max(flops / matmul rate, bytes / copy bandwidth), both measured in the same
run (perf.bench.measure_ceilings); bytes = Q and O once, each request's own K/V once and
each shared prefix's K/V once; flops = 4 D per (query row, visible key), the shared keys
counted for every sharer (they are computed once per sharer, read once). Each result is
checked against the float32 reference. Writes <out>/bench_shared.json and .md.

Prediction (issue 45): S1 >= 5x faster with sharing than without (the prefix is 97 % of
the bytes without), each at >= 0.85 of the roofline.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from perf.bench import _rel_l2, measure_ceilings
from perf.timing import time_gpu

HQ, HKV, D = 32, 8, 128


def workloads():
    """name -> (groups [(prefix tokens, [(q_len, own tokens), ...])], lone requests)."""
    return {
        "S1": ([(8192, [(1, 256)] * 128)], []),
        "S2": ([(4096, [(1, 512)] * 32) for _ in range(8)], []),
        "S3": ([(4096, [(1, 4096)] * 128)], [(4096, 4096)]),
    }


def build(spec, page, dtype=torch.bfloat16, seed=0):
    """(batch tensors, bytes once, flops): the prefixes' pages shared by their groups."""
    groups, lone = spec
    g = torch.Generator().manual_seed(seed)
    rows, next_page = [], 0  # (q_len, pages, kv_len)
    for prefix, members in groups:
        pre = list(range(next_page, next_page + prefix // page))
        next_page += len(pre)
        for q, own in members:
            n = -(-own // page)
            rows.append((q, pre + list(range(next_page, next_page + n)), prefix + own))
            next_page += n
    for q, kv in lone:
        n = -(-kv // page)
        rows.append((q, list(range(next_page, next_page + n)), kv))
        next_page += n
    k = torch.randn(next_page, page, HKV, D, generator=g).to(dtype).cuda()
    v = torch.randn(next_page, page, HKV, D, generator=g).to(dtype).cuda()
    q_lens = [r[0] for r in rows]
    T = sum(q_lens)
    q = torch.randn(T, HQ, D, generator=g).to(dtype).cuda()
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    kvl = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    width = max(len(r[1]) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r[1])] = torch.tensor(r[1], dtype=torch.int32)
    kv_bytes = next_page * page * HKV * D * 2 * 2  # every page once
    qo_bytes = 2 * T * HQ * D * 2
    flops = 0
    for ql, _, kv in rows:
        vis = sum(min(kv, kv - ql + 1 + t) for t in range(ql))  # causal
        flops += 4 * D * HQ * vis
    return (q, k, v, cu, kvl, table), kv_bytes + qo_bytes, flops


def main(argv=None, specs=None) -> int:
    """`specs`: name -> workload spec as workloads() gives them (default: S1-S3)."""
    specs = workloads() if specs is None else specs
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--workloads", default="S1,S2,S3")
    args = ap.parse_args(argv)
    from podcute import PODAttention
    from podcute.reference import pod_attention_reference

    ceil = measure_ceilings()
    mm, bw = ceil["matmul_flops_per_s"], ceil["copy_bytes_per_s"]
    results = []
    for name in args.workloads.split(","):
        (q, k, v, cu, kvl, table), nbytes, flops = build(specs[name], args.page)
        roof_ms = max(flops / mm, nbytes / bw) * 1e3
        ref = pod_attention_reference(q, k, v, cu_seqlens_q=cu.cuda(), seqused_k=kvl.cuda(),
                                      block_table=table.cuda())
        res = dict(name=name, page=args.page, roofline_ms=roof_ms, timings={}, rel_l2={},
                   plans={})
        out = torch.empty_like(q)
        for mode, share in (("shared", True), ("plain", False)):
            att = PODAttention(HQ, HKV, D, args.page, max_batch_size=table.shape[0],
                               max_num_tokens=q.shape[0])
            att.plan(cu, kvl, block_table=table, share_prefixes=share)
            res["plans"][mode] = str(att.current_plan.summary)
            out.fill_(float("nan"))
            att.run(q, k, v, out=out)
            res["rel_l2"][mode] = _rel_l2(out, ref)
            res["timings"][mode] = time_gpu(lambda i, att=att: att.run(q, k, v, out=out),
                                            reps=args.reps).to_dict()
        results.append(res)
        print(name, {m: round(t["ms"], 4) for m, t in res["timings"].items()},
              f"roofline {roof_ms:.4f} ms", res["rel_l2"], flush=True)
        print(res["plans"]["shared"], flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    lines = [f"copy {bw / 1e12:.2f} TB/s, matmul {mm / 1e12:.0f} TFLOP/s (same run), page "
             f"{args.page}", "", "| workload | shared ms | plain ms | plain / shared | "
             "roofline ms | roofline / shared | rel L2 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        s, p = r["timings"]["shared"]["ms"], r["timings"]["plain"]["ms"]
        lines.append(f"| {r['name']} | {s:.4f} | {p:.4f} | {p / s:.2f} | "
                     f"{r['roofline_ms']:.4f} | {r['roofline_ms'] / s:.2f} | "
                     f"{r['rel_l2']['shared']:.1e} |")
    md = "\n".join(lines) + "\n"
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_shared.json"), "w") as f:
        json.dump(dict(ceilings=ceil, results=results), f, indent=1)
    with open(os.path.join(args.out, "bench_shared.md"), "w") as f:
        f.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
