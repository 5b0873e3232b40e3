"""Python cost of the per-layer entry points on a machine without a GPU.

    python -m perf.host_path_cpu [--rounds 40] [--calls 200]

The compiled kernel call is replaced by a no-op (and the device checks pass), so what
is timed is podcute's Python in front of the launch: `PODAttention.run()`,
`pod_attention` (CPU metadata, plan reused) and `flash_attn_varlen_func` (vLLM's form,
plan reused), on 64 decodes at kv 4096 (Hq/Hkv/D 32/8/128, page 16, bf16 CPU tensors).
Each round calls every entry point `--calls` times after one untimed call (the one-shot
entry points share a planner, so that call may plan); the minimum over rounds is
printed, in us per call. The H200 numbers are `perf.bench_host`'s.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()

    import podcute
    import podcute.api as api
    import podcute.launch as launch
    from podcute.compat.flash_attn import flash_attn_varlen_func

    launch._kernel = lambda *a, **kw: (lambda *x: None)
    api.require_arch = lambda *a, **kw: None
    torch.cuda.is_current_stream_capturing = lambda: False

    B, Hq, Hkv, D, ps, kv = 64, 32, 8, 128, 16, 4096
    n_pages = kv // ps
    k = torch.randn(B * n_pages + 1, ps, Hkv, D, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.arange(B + 1, dtype=torch.int32)
    lens = torch.full((B,), kv, dtype=torch.int32)
    bt = torch.arange(B * n_pages, dtype=torch.int32).reshape(B, n_pages)
    att = api.PODAttention(Hq, Hkv, D, ps, device="cpu")
    att.plan(cu, lens, block_table=bt, causal=True)
    calls = {
        "run()": lambda: att.run(q, k, v, out=out),
        "pod_attention": lambda: podcute.pod_attention(q, k, v, cu_seqlens_q=cu,
                                                       seqused_k=lens, block_table=bt, out=out),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(
            q, k, v, 1, cu, kv, seqused_k=lens, causal=True, block_table=bt, out=out),
    }
    best = {name: float("inf") for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            fn()
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / args.calls * 1e6)
    for name, us in best.items():
        print(f"{name:24s} {us:6.2f} us")


if __name__ == "__main__":
    main()
