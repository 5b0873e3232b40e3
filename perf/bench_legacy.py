"""FlashInfer's legacy POD wrapper: one podcute launch (the ragged variant) against the two
launches it made before (the prefill over its ragged K/V seen as pages, then the decode
batch), in one run.

    python -m perf.bench_legacy [--out DIR] [--reps N] [--pages 1,16,128]

Each case is one prefill (ragged K/V, q_p and q_d cut from one q tensor, as an engine
holds them) beside a paged decode batch; bf16, 32 query heads, 8 KV heads, head_dim 128.
Both paths are timed with perf.timing (CUDA events, medians, launch gaps hidden) and
checked against each other. Writes <out>/bench_legacy.json and bench_legacy.md.

Prediction (issue 12): the one launch is faster than the two wherever the decode batch is
large enough to fill the SMs the prefill leaves idle (its tiles and the decode splits
share the persistent grid), by up to the smaller of the two launches' times; at pages of
1 both paths gather rows with cp.async (the ragged request too), so the gain is the same
overlap.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from perf.timing import time_gpu

HQ, HKV, D = 32, 8, 128
# (name, prefill q_len, prefill kv_len, decode KV lengths)
CASES = [
    ("L1 chunk 512/4096 + 64 decodes of 2048", 512, 4096, [2048] * 64),
    ("L2 prefill 2048/2048 + 32 decodes of 4096", 2048, 2048, [4096] * 32),
    ("L3 chunk 256/8192 + 128 decodes of 1024", 256, 8192, [1024] * 128),
    ("L4 prefill 4096/4096 + 8 decodes of 512", 4096, 4096, [512] * 8),
]


def run_case(name, qo_len, kv_len, decode_kv, page, reps):
    from podcute.compat.flashinfer import PODWithPagedKVCacheWrapper, unpack_paged_kv_cache
    from podcute.testing import make_batch

    dec = make_batch([1] * len(decode_kv), decode_kv, num_qo_heads=HQ, num_kv_heads=HKV,
                     head_dim=D, page_size=page, device="cuda", page_format="csr",
                     interleaved=True, garbage=0.0, seed=1)
    pool = dec.k_cache._base
    gen = torch.Generator(device="cuda").manual_seed(2)
    kv = torch.randn(kv_len, 2, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    k_p, v_p = kv[:, 0], kv[:, 1]
    q = torch.randn(qo_len + len(decode_kv), HQ, D, generator=gen, device="cuda",
                    dtype=torch.bfloat16)
    q_p, q_d = q[:qo_len], q[qo_len:]
    ws = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    w = PODWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(dec.kv_indptr, dec.kv_indices, dec.last_page_len, HQ, HKV, D, page,
           q_data_type=torch.bfloat16)
    one = time_gpu(lambda i: w.run(q_p, k_p, v_p, q_d, pool, causal_p=True), reps)
    fused_p, fused_d = w.run(q_p, k_p, v_p, q_d, pool, causal_p=True)
    assert w._fused_key is not None
    # The two launches run() made before (and still makes where one plan cannot serve).
    prefill, k_pages, v_pages = w._plan_prefill(q_p, k_p, v_p, "NHD", True, None, (-1, -1),
                                                kv_len)
    k_d, v_d = unpack_paged_kv_cache(pool, "NHD", "pool")

    def two(i):
        return prefill.run(q_p, k_pages, v_pages), w._decode.run(q_d, k_d, v_d)

    two_t = time_gpu(two, reps)
    two_p, two_d = two(0)
    torch.cuda.synchronize()
    diff = max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in ((fused_p, two_p), (fused_d, two_d)))
    return dict(case=name, page=page, prefill_page=prefill.page_size, one_launch_ms=one.ms,
                two_launches_ms=two_t.ms, speedup=two_t.ms / one.ms,
                one_launch_gaps_ms=one.gaps_ms, two_launches_gaps_ms=two_t.gaps_ms,
                rel_diff=diff)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pages", default="16,128,1")
    args = ap.parse_args()
    rows = []
    for page in (int(p) for p in args.pages.split(",")):
        for case in CASES:
            r = run_case(*case, page, args.reps)
            print(json.dumps(r), flush=True)
            rows.append(r)
    dev = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "bench_legacy.json"), "w") as f:
        json.dump(dict(device=dev, rows=rows), f, indent=1)
    lines = [f"# legacy POD wrapper, {dev}", "",
             "| case | page | one launch ms | two launches ms | speed-up | rel diff |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['page']} | {r['one_launch_ms']:.3f} | "
              f"{r['two_launches_ms']:.3f} | {r['speedup']:.2f}x | {r['rel_diff']:.1e} |"
              for r in rows]
    with open(os.path.join(args.out, "bench_legacy.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
