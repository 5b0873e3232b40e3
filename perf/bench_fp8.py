"""fp8 KV cache benchmark: podcute with an e4m3 cache against the same batch with its
16-bit cache, and the roofline of one byte per KV element, all in one run.

    python -m perf.bench_fp8 [--out DIR] [--reps N] [--pages 16,128] [--workloads M1,D1]
                             [--dtypes bfloat16,float16] [--head-dim D] [--heads HQ/HKV]

Every workload of perf.workloads' main set (M1-M5, P1, D1, F1) at each page size and query
dtype: the 16-bit batch (perf.bench's, garbage 0) and its per-KV-head e4m3 quantisation
(`podcute.testing.quantize_kv_cache`), both timed with perf.timing (CUDA events, medians,
launch gaps hidden, input sets rotated past L2), each checked once against the float32
reference on its own cache (the fp8 one dequantised). The roofline counts Q/O at 2 bytes
and K/V at 1 byte an element, against the copy bandwidth and matmul rate measured in the
same run. `--head-dim`, `--heads` override every workload's shape (as in perf.bench).
Writes <out>/bench_fp8.json and bench_fp8.md.

Predictions (issue 11): D1 at >= 0.9 of the fp8 roofline (half the bytes of bf16, so about
half its time); M1-M5 and P1 faster with the fp8 cache than with bf16 (decode halves,
prefill slows a little: 64-token tiles and the converter on the producer's warps); F1
no more than 1.15x its bf16 time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from perf import workloads as W
from perf.bench import parse_heads
from perf.bench import _rel_l2, _sets, kernel_flags_line, measure_ceilings
from perf.timing import time_gpu
from podcute.testing import kernel_flag_env


def run(w: W.Workload, page: int, ceil: dict, reps: int, l2_bytes: int,
        dtype=torch.bfloat16) -> dict:
    from podcute import PODAttention
    from podcute.reference import pod_attention_reference
    from podcute.testing import make_batch, quantize_kv_cache

    batch = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                       num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                       dtype=dtype, device="cuda", pool_factor=1.1, garbage=0.0)
    k8, ks = quantize_kv_cache(batch.k_cache)
    v8, vs = quantize_kv_cache(batch.v_cache)
    mm, bw = ceil["matmul_flops_per_s"], ceil["copy_bytes_per_s"]
    res = dict(name=w.name, page_size=page, dtype=str(dtype).replace("torch.", ""),
               timings={}, rel_l2={},
               roofline_bf16_ms=W.roofline_s(w, mm, bw) * 1e3,
               roofline_fp8_ms=max(W.flops(w) / mm, W.bytes_moved(w, kv_elem_bytes=1) / bw) * 1e3)
    out = torch.empty_like(batch.q)
    for name, kv_dtype, k, v, scales in (
            ("16-bit", None, batch.k_cache, batch.v_cache, {}),
            ("e4m3", torch.float8_e4m3fn, k8, v8, dict(k_scale=ks, v_scale=vs))):
        att = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page,
                           dtype=dtype, device="cuda", kv_dtype=kv_dtype,
                           max_batch_size=w.batch_size, max_num_tokens=w.total_q)
        att.plan(batch.cu_seqlens_q, batch.seqused_k, block_table=batch.block_table,
                 causal=w.causal)
        res.setdefault("plans", {})[name] = str(att.current_plan.summary)
        ref = pod_attention_reference(batch.q, k, v, causal=w.causal, **scales,
                                      **batch.kwargs())
        out.fill_(float("nan"))
        att.run(batch.q, k, v, out=out, **scales)
        res["rel_l2"][name] = _rel_l2(out, ref)
        del ref
        qs = _sets(batch, W.bytes_moved(w, kv_elem_bytes=1), l2_bytes)
        sets = [(s[0], k, v) if i == 0 else (s[0], k.clone(), v.clone())
                for i, s in enumerate(qs)]

        def fn(i, att=att, sets=sets, scales=scales):
            q, kk, vv = sets[i % len(sets)]
            att.run(q, kk, vv, out=out, **scales)
        res["timings"][name] = time_gpu(fn, reps=reps, warmup=5).to_dict()
        del sets, qs
        torch.cuda.empty_cache()
    return res


def markdown(results, ceil) -> str:
    lines = [f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
             f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (same run)", "",
             "| workload | page | q dtype | 16-bit cache ms | e4m3 ms | 16-bit / e4m3 | "
             "fp8 roofline ms | roofline / e4m3 | rel L2 16-bit / e4m3 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t16 = r["timings"].get("16-bit", {}).get("ms")
        t8 = r["timings"].get("e4m3", {}).get("ms")
        ratio = f"{t16 / t8:.2f}" if t16 and t8 else "-"
        roof = f"{r['roofline_fp8_ms'] / t8:.2f}" if t8 else "-"
        lines.append(f"| {r['name']} | {r['page_size']} | {r.get('dtype', '-')} | "
                     f"{t16 or '-':.4} | {t8 or '-':.4} | "
                     f"{ratio} | {r['roofline_fp8_ms']:.3f} | {roof} | "
                     f"{r['rel_l2'].get('16-bit', float('nan')):.1e} / "
                     f"{r['rel_l2'].get('e4m3', float('nan')):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="perf/results/fp8")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--pages", default="16,128")
    p.add_argument("--workloads", default=",".join(w.name for w in W.MAIN))
    p.add_argument("--dtypes", default="bfloat16",
                   help="query dtypes, comma-separated (bfloat16, float16)")
    p.add_argument("--head-dim", type=int, default=None, help="every workload's head dim")
    p.add_argument("--heads", type=parse_heads, default=None, metavar="HQ/HKV",
                   help="every workload's query and KV heads")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ceil = measure_ceilings()
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    wanted = args.workloads.split(",")
    results = []
    flags = kernel_flag_env()
    t0 = time.perf_counter()
    for w in W.MAIN:
        if w.name not in wanted:
            continue
        hq, hkv = args.heads or (None, None)
        w = W.with_overrides(w, head_dim=args.head_dim, num_qo_heads=hq, num_kv_heads=hkv)
        for page, dt in ((int(p), getattr(torch, d)) for d in args.dtypes.split(",")
                         for p in args.pages.split(",")):
            try:
                results.append(run(w, page, ceil, args.reps, l2, dt))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                results.append(dict(name=w.name, page_size=page, error=repr(e)[:500],
                                    timings={}, rel_l2={}, roofline_fp8_ms=float("nan")))
            print(f"[{time.perf_counter() - t0:6.1f}s] {w.name} p{page}: "
                  f"{ {k: v.get('ms') for k, v in results[-1]['timings'].items()} }"
                  f"{' ' + results[-1]['error'] if 'error' in results[-1] else ''}",
                  file=sys.stderr, flush=True)
            with open(os.path.join(args.out, "bench_fp8.json"), "w") as f:
                json.dump(dict(ceilings=ceil, command=" ".join(sys.argv), results=results,
                               kernel_flags=flags), f, indent=1)
    md = markdown(results, ceil)
    if flags:  # an A/B's side, named in the table's file
        md = kernel_flags_line(flags) + "\n\n" + md
    with open(os.path.join(args.out, "bench_fp8.md"), "w") as f:
        f.write(md)
    print(md)
    # A row that failed is in the JSON and the table as "-"; the exit status says so too
    # (a run whose every row failed once passed for a measurement).
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    from podcute.testing import kernel_flags_from_env

    with kernel_flags_from_env():  # $PODCUTE_TEST_*=0/1: an A/B of a KernelConfig flag
        sys.exit(main())
