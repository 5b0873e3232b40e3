"""Experiment (issue 11): what holds the fp8 decode stream below HBM's rate at 16-token pages.

D1 (256 decodes at 4096, 32/8 heads, D 128, bf16 queries) with an e4m3 cache at pages 16 and
128, in NHD and HND, against the fp8 roofline; and as anchors, plain copies of the same
bytes: the used pages gathered whole (torch.index_select: page-sized contiguous pieces, the
pattern a kernel reading every head of a page at once would see) and one contiguous copy.
All in one run (CUDA events, medians, perf.timing).

    python -m perf.experiments.exp_fp8_pages [--reps 30]

In NHD a KV head's row of a page is 128 bytes (D 128, fp8) at a stride of Hkv x 128 bytes:
a 16-token page gives each CTA 16 such pieces per head, 2 KB of a 16 KB page; HND keeps a
head's 16 rows contiguous (2 KB).
"""

from __future__ import annotations

import argparse

import torch

from perf import workloads as W
from perf.bench import measure_ceilings
from perf.timing import time_gpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args(argv)
    from podcute import PODAttention
    from podcute.testing import make_batch, quantize_kv_cache

    ceil = measure_ceilings()
    bw, mm = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    w = W.D1
    roof_ms = max(W.flops(w) / mm, W.bytes_moved(w, kv_elem_bytes=1) / bw) * 1e3
    print(f"copy {bw / 1e12:.2f} TB/s; D1 fp8 roofline {roof_ms:.3f} ms")
    print("| page | layout | e4m3 ms | roofline / e4m3 | page gather TB/s (r+w) | "
          "copy of the same bytes TB/s (r+w) |")
    print("|---|---|---|---|---|---|")
    for page in (16, 128):
        for layout in ("NHD", "HND"):
            b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                           num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                           device="cuda", kv_layout=layout, pool_factor=1.1, garbage=0.0)
            k8, ks = quantize_kv_cache(b.k_cache, layout)
            v8, vs = quantize_kv_cache(b.v_cache, layout)
            att = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page,
                               kv_layout=layout, device="cuda", kv_dtype=torch.float8_e4m3fn,
                               max_batch_size=w.batch_size, max_num_tokens=w.total_q)
            att.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table)
            out = torch.empty_like(b.q)
            t = time_gpu(lambda i: att.run(b.q, k8, v8, out=out, k_scale=ks, v_scale=vs),
                         reps=args.reps).ms
            pages = b.block_table.flatten().long()
            k_pages, v_pages = k8.view(k8.shape[0], -1), v8.view(v8.shape[0], -1)
            g = time_gpu(lambda i: (k_pages.index_select(0, pages),
                                    v_pages.index_select(0, pages)), reps=args.reps).ms
            moved = 2 * 2 * pages.numel() * k_pages.shape[1]  # K and V, read + write
            flat = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")  # K, V read
            c = time_gpu(lambda i: flat.clone(), reps=args.reps).ms
            print(f"| {page} | {layout} | {t:.4f} | {roof_ms / t:.2f} | "
                  f"{moved / g / 1e9:.2f} | {2 * flat.numel() / c / 1e9:.2f} |", flush=True)
            del b, k8, v8, att, flat
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
