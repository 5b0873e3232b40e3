"""Run one benchmark workload's fused launch a few times, for a profiler to pick up:

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight ... python -m perf.experiments.profile_one F1 128

(perf.workloads names, or the shared-prefix batches of perf.bench_shared and
perf.experiments.shared_parts: S1-S3, OWN, PRE2, PRE, P32, P32x4, P128, planned with their
sharing; page size). Prints the plan and the median of the runs. With
PODCUTE_PROFILE_KV=float8_e4m3fn (or float8_e5m2) the cache is the per-head fp8
quantisation of the same one (podcute.testing.quantize_kv_cache). With
PODCUTE_PROFILE_PEER=fa4 the same batch runs through FlashAttention-4's
`flash_attn.cute.interface.flash_attn_varlen_func` (16-bit caches; its kernel's name
also starts with kernel_cutlass), so one ncu command profiles both mainloops alike.
"""

import os
import sys

import torch

from perf import workloads as W
from podcute import PODAttention
from podcute.testing import make_batch, quantize_kv_cache


def _shared(name: str, page: int):
    """A shared-prefix batch's launch (bench_shared's tensors and plan), or None."""
    import perf.bench_shared as bench_shared
    from perf.experiments.shared_parts import EXTRA

    spec = {**bench_shared.workloads(), **EXTRA}.get(name)
    if spec is None:
        return None
    (q, k, v, cu, kvl, table), _, _ = bench_shared.build(spec, page)
    hq, hkv, d = bench_shared.HQ, bench_shared.HKV, bench_shared.D
    attn = PODAttention(hq, hkv, d, page, max_batch_size=table.shape[0],
                        max_num_tokens=q.shape[0])
    print(attn.plan(cu, kvl, block_table=table))
    out = torch.empty_like(q)
    return lambda: attn.run(q, k, v, out=out)


def main(name: str, page: int, runs: int = 5) -> int:
    run = _shared(name, page)
    if run is not None:
        return _time(name, page, run, runs)
    w = next(x for x in W.MAIN if x.name == name)
    b = make_batch(w.q_lens, w.kv_lens, num_qo_heads=w.num_qo_heads,
                   num_kv_heads=w.num_kv_heads, head_dim=w.head_dim, page_size=page,
                   device="cuda", pool_factor=1.1, garbage=0.0)
    k, v, scales, kv_dtype = b.k_cache, b.v_cache, {}, None
    if os.environ.get("PODCUTE_PROFILE_KV"):
        kv_dtype = getattr(torch, os.environ["PODCUTE_PROFILE_KV"])
        k, k_scale = quantize_kv_cache(k, dtype=kv_dtype)
        v, v_scale = quantize_kv_cache(v, dtype=kv_dtype)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    attn = PODAttention(w.num_qo_heads, w.num_kv_heads, w.head_dim, page, device="cuda",
                        max_batch_size=w.batch_size, max_num_tokens=w.total_q,
                        kv_dtype=kv_dtype)
    print(attn.plan(b.cu_seqlens_q, b.seqused_k, block_table=b.block_table, causal=w.causal))
    out = torch.empty_like(b.q)
    run = lambda: attn.run(b.q, k, v, out=out, **scales)  # noqa: E731
    if os.environ.get("PODCUTE_PROFILE_PEER") == "fa4":
        from flash_attn.cute.interface import flash_attn_varlen_func

        max_q = max(w.q_lens)
        run = lambda: flash_attn_varlen_func(  # noqa: E731
            b.q, k, v, cu_seqlens_q=b.cu_seqlens_q, seqused_k=b.seqused_k,
            page_table=b.block_table, max_seqlen_q=max_q, causal=w.causal)
        name = f"{name} (FA4)"
    return _time(name, page, run, runs)


def _time(name: str, page: int, run, runs: int) -> int:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    print(f"{name} page {page}: median {sorted(times)[runs // 2]:.3f} ms over {runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
